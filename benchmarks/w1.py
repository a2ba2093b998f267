"""One W1 measurement: the durable workload on a Ratchet system (optionally under chaos),
the same workload on plain Ray with nothing durable, and the store's raw limit."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import typer
from rich.console import Console
from rich.progress import Progress

from actors.wire import NAMESPACE
from benchmarks.baseline import Baseline
from benchmarks.rss import RssSampler, mb
from benchmarks.stores import prepare_store
from benchmarks.verify import Answer, intervals_ms, quantile, verify
from benchmarks.w1_agent import W1, ledger_dir, new_ledger, read_ledger
from cluster.client import Ratchet
from runtime.commit import Frontier
from runtime.patience import patiently
from storage.url import open_store

WARMUP_RUNS = 4
START_ATTEMPTS = 30


@dataclass
class Config:
    runs: int = 200
    concurrency: int = 50
    steps: int = 5
    tools: int = 2
    model_latency_ms: float = 0.0
    tool_latency_ms: float = 0.0
    store: str = "sqlite"
    placement: str = "hosted"
    hosts: int = 2
    executors: int = 2
    sqlite_writer: str = "direct"
    chaos: bool = False
    chaos_interval_s: float = 2.0
    seed: int = 7
    baseline: str = "plain"
    """The arms measured beside the durable one: ``plain`` (plain Ray, ``benchmarks.
    baseline``), ``same-dispatch`` (Ratchet with commits off, ``benchmarks.same_dispatch``),
    ``both`` or ``none``."""
    trials: int = 1
    timeout_s: float = 1800.0
    spec_options: dict[str, Any] = field(default_factory=dict)
    """More ``SystemSpec`` options for the durable arm (``benchmarks.critical_path``
    gives its actors a trace file through ``host_options`` and ``core_options``)."""

    @property
    def plain_baseline(self) -> bool:
        return self.baseline in ("plain", "both")

    @property
    def same_dispatch(self) -> bool:
        return self.baseline in ("same-dispatch", "both")

    def params(self, ledger: str | None) -> W1:
        return W1(self.steps, self.tools, self.model_latency_ms, self.tool_latency_ms, ledger)


# ---- driving the load ---------------------------------------------------------------------


async def bounded(n: int, limit: int, one: Callable[[int], Awaitable[None]]) -> int:
    """Run ``one(i)`` for i < n with at most ``limit`` at once; returns the peak in flight."""
    gate = asyncio.Semaphore(limit)
    active = peak = 0

    async def slot(i: int) -> None:
        nonlocal active, peak
        async with gate:
            active += 1
            peak = max(peak, active)
            try:
                await one(i)
            finally:
                active -= 1

    await asyncio.gather(*(slot(i) for i in range(n)))
    return peak


async def run_durable(
    client: Ratchet,
    ref: str,
    thread: str,
    run: str,
    placement: str,
    timeout_s: float | None = None,
) -> Frontier | None:
    """``client.run``, retried (a start is idempotent by run id) while a host is down; the
    frontier the host answered with (None: not at rest within ``timeout_s``)."""
    for attempt in range(START_ATTEMPTS):
        try:
            return await client.run(
                ref,
                f"W1 input {thread}",
                thread_id=thread,
                new_thread=True,  # each Run's thread is made for it (a retry reads it)
                run_id=run,
                placement=placement,  # type: ignore[arg-type]
                timeout_s=timeout_s,
            )
        except TimeoutError:
            return None
        except Exception:
            if attempt == START_ATTEMPTS - 1:
                raise
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
    return None


@dataclass
class Kill:
    at: float
    kind: str
    name: str


async def chaos_monkey(
    client: Ratchet, cfg: Config, kills: list[Kill], stop: asyncio.Event
) -> None:
    """Every ``chaos_interval_s``: kill a random RunHost or ToolExecutor; Ray restarts it."""
    rng = random.Random(cfg.seed)
    spec = client.spec
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), cfg.chaos_interval_s)
        if stop.is_set():
            return
        targets = [("executor", spec.executor_name("default", i)) for i in range(spec.executors)]
        if cfg.placement == "hosted":
            targets += [("host", spec.host_name(i)) for i in range(spec.hosts)]
        else:
            prefix = f"{spec.name}:dedicated:"
            targets += [
                ("host", a["name"])
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
            ]
        kind, name = rng.choice(targets)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        kills.append(Kill(time.time(), kind, name))
        ray.kill(handle, no_restart=False)


@dataclass
class Timed:
    wall_s: float
    peak_active: int
    threads: list[tuple[str, str]]
    warmup: list[tuple[str, str]]
    kills: list[Kill] = field(default_factory=list)
    peak_rss: int = 0
    peak_rss_total: int = 0
    idle_rss: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    answers: dict[str, Answer | None] = field(default_factory=dict)
    """By run id: what the host answered with (None: not at rest in time)."""


async def drive_durable(
    client: Ratchet,
    cfg: Config,
    ref: str,
    progress: Progress,
    label: str = "durable W1",
    answer_timeout_s: float | None = None,
) -> Timed:
    stamp = uuid.uuid4().hex[:8]
    answers: dict[str, Answer | None] = {}

    async def launch(prefix: str, i: int) -> None:
        thread, run = f"w1-{stamp}-{prefix}{i:05d}", f"run-{stamp}-{prefix}{i:05d}"
        # one call to the host, which answers when the Run is done; the store confirms
        frontier = await run_durable(client, ref, thread, run, cfg.placement, answer_timeout_s)
        answers[run] = None if frontier is None else Answer.of(frontier)

    warm = [(f"w1-{stamp}-w{i:05d}", f"run-{stamp}-w{i:05d}") for i in range(WARMUP_RUNS)]
    threads = [(f"w1-{stamp}-r{i:05d}", f"run-{stamp}-r{i:05d}") for i in range(cfg.runs)]
    await bounded(WARMUP_RUNS, WARMUP_RUNS, lambda i: launch("w", i))
    task = progress.add_task(f"{label} ({cfg.placement})", total=cfg.runs)
    kills: list[Kill] = []
    stop = asyncio.Event()
    monkey = asyncio.create_task(chaos_monkey(client, cfg, kills, stop)) if cfg.chaos else None

    async def one(i: int) -> None:
        await launch("r", i)
        progress.advance(task)

    with RssSampler() as rss:
        idle = rss.sample()[0]
        began = time.perf_counter()
        peak = await asyncio.wait_for(bounded(cfg.runs, cfg.concurrency, one), cfg.timeout_s)
        wall = time.perf_counter() - began
    stop.set()
    if monkey is not None:
        await monkey
    return Timed(wall, peak, threads, warm, kills, rss.peak_workers, rss.peak_total, idle,
                 rss.cpu_seconds(), answers)  # fmt: skip


async def run_w1(cfg: Config, console: Console, progress: Progress) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-load-"))
    prepared = await prepare_store(cfg.store, tmp)
    tag = new_ledger()
    params = cfg.params(tag)
    client: Ratchet | None = None
    try:
        client = await Ratchet.connect(
            store_url=prepared.url,
            hosts=cfg.hosts,
            executors=cfg.executors,
            quiet=True,
            sqlite_writer=cfg.sqlite_writer,
            **cfg.spec_options,
        )
        own = prepared.kind != "memory"
        timed = await drive_durable(client, cfg, params.ref, progress)
        report = await client.supervisor_report() if cfg.chaos else {}
        counts = await host_counts(client)
        coalescing, grouping = sharing(counts)
        if own:
            await client.shutdown()
            client = None
        check_store = await patiently(lambda: open_store(prepared.url)) if own else None
        host_kills = [k.at for k in timed.kills if k.kind == "host"]
        verdict = await verify(
            check_store or client.store,  # type: ignore[union-attr]
            params, [*timed.warmup, *timed.threads], host_kills, strict=not cfg.chaos,
            timed_runs={run for _, run in timed.threads},
        )  # fmt: skip
        if check_store is not None:
            await check_store.close()
    finally:
        if client is not None:
            await client.shutdown()
        await prepared.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ledger_dir(tag), ignore_errors=True)
    measured = cfg.runs + WARMUP_RUNS
    result: dict[str, Any] = {
        "scenario": "w1",
        "store": prepared.kind,
        "placement": cfg.placement,
        "runs": cfg.runs,
        "concurrency": cfg.concurrency,
        "steps": cfg.steps,
        "tools": cfg.tools,
        "model_latency_ms": cfg.model_latency_ms,
        "tool_latency_ms": cfg.tool_latency_ms,
        "hosts": cfg.hosts,
        "executors": cfg.executors,
        "ok": verdict.ok(measured),
        "wall_s": round(timed.wall_s, 3),
        "runs_per_s": round(cfg.runs / timed.wall_s, 1),
        "steps_per_s": round(cfg.runs * cfg.steps / timed.wall_s, 1),
        "commits": verdict.commits,
        "commits_per_run": round(verdict.commits / measured, 2),
        "p50_step_ms": quantile(verdict.step_ms, 50),
        "p99_step_ms": quantile(verdict.step_ms, 99),
        "peak_rss_mb": mb(timed.peak_rss),
        "peak_rss_total_mb": mb(timed.peak_rss_total),
        "idle_rss_mb": mb(timed.idle_rss),
        "peak_active_runs": timed.peak_active,
        "rss_per_active_run_kb": round(
            (timed.peak_rss - timed.idle_rss) / 1024 / max(timed.peak_active, 1), 1
        ),
        "lost_commits": verdict.lost_commits,
        "duplicate_never_replay": verdict.duplicate_never_replay,
        "checked_runs": measured,
        "natural_runs": verdict.natural_runs,
        "exactly_once_calls": verdict.exactly_once_calls,
        "ledger_violations": verdict.ledger_violations,
        "waves_per_executor_call": coalescing,
        "commits_per_group": grouping,
        **store_times(counts),
        "cpu_ms_per_run": per_run_ms(timed.cpu_s, cfg.runs),
    }
    if cfg.chaos:
        result.update(
            kills=len(timed.kills),
            host_kills=len(host_kills),
            executor_kills=len(timed.kills) - len(host_kills),
            recovered_runs=verdict.recovered_runs,
            median_recovery_ms=quantile(verdict.recoveries_ms, 50),
            max_recovery_ms=round(max(verdict.recoveries_ms, default=0.0), 1),
            median_settled_ms=quantile(verdict.settled_ms, 50),
            replayed_calls=verdict.replayed_calls,
            indeterminate_calls=verdict.indeterminate_calls,
            supervisor=report.get("counts", {}),
        )
    if verdict.problems:
        result["problems"] = verdict.problems
    return result


def per_run_ms(cpu_s: dict[str, float], runs: int) -> dict[str, float]:
    """CPU milliseconds per Run by kind of process, the largest first."""
    ranked = sorted(cpu_s.items(), key=lambda kv: -kv[1])
    return {kind: round(seconds * 1000 / runs, 2) for kind, seconds in ranked if seconds > 0}


async def host_counts(client: Ratchet) -> dict[str, float]:
    """The hosted pool's counts of waves and executor calls, appends and group
    transactions, and the seconds appends waited for their groups and groups took to
    write, summed (a host restarted by chaos counts from its restart)."""
    keys = ("waves_sent", "executor_calls", "store_appends", "store_groups")
    extra = ("store_waited_s", "store_written_s", "store_planned", "store_skipped")
    totals = dict.fromkeys((*keys, *extra), 0.0)
    for host in client.hosts:
        with contextlib.suppress(Exception):
            info = await host.info.remote()
            for key in totals:
                totals[key] += info.get(key) or 0
    return totals


def store_times(totals: dict[str, float]) -> dict[str, float | None]:
    """Per append, the ms it waited for its group (queue and linger); per group, the ms
    its transaction took (commit and fsync included); the share of groups written as
    planned (without reading their rows first) and the requests dropped because their
    callers had given up. None on stores that keep no count."""
    appends, groups = totals["store_appends"], totals["store_groups"]
    return {
        "store_planned_share": round(totals["store_planned"] / groups, 3) if groups else None,
        "store_skipped": int(totals["store_skipped"]),
        "store_wait_ms_per_append": (
            round(totals["store_waited_s"] * 1000 / appends, 3) if appends else None
        ),
        "group_write_ms": round(totals["store_written_s"] * 1000 / groups, 3) if groups else None,
    }


def sharing(totals: dict[str, float]) -> tuple[float | None, float | None]:
    """How many Runs' waves shared an executor round trip, and how many commits a group
    transaction, on average (None where nothing was counted, or the store keeps no
    count)."""

    def ratio(part: str, whole: str) -> float | None:
        return round(totals[part] / totals[whole], 2) if totals[whole] else None

    return ratio("waves_sent", "executor_calls"), ratio("store_appends", "store_groups")


async def run_baseline(cfg: Config, progress: Progress) -> dict[str, Any]:
    """The same workload on plain Ray, nothing durable; checked against its own ledger."""
    tag = new_ledger()
    params = cfg.params(tag)
    base = Baseline(params.ref, cfg.hosts, cfg.executors, cfg.placement)
    stamp = uuid.uuid4().hex[:8]
    texts: dict[str, str] = {}
    try:
        await base.ready()

        async def launch(prefix: str, i: int) -> None:
            thread, run = f"b-{stamp}-{prefix}{i:05d}", f"run-{stamp}-{prefix}{i:05d}"
            texts[run] = await base.run(thread, run, f"W1 input {thread}")

        await bounded(WARMUP_RUNS, WARMUP_RUNS, lambda i: launch("w", i))
        task = progress.add_task(f"baseline W1 ({cfg.placement}, no durability)", total=cfg.runs)

        async def one(i: int) -> None:
            await launch("r", i)
            progress.advance(task)

        with RssSampler() as rss:
            began = time.perf_counter()
            await asyncio.wait_for(bounded(cfg.runs, cfg.concurrency, one), cfg.timeout_s)
            wall = time.perf_counter() - began
        ledger = read_ledger(tag)
    finally:
        base.close()
        shutil.rmtree(ledger_dir(tag), ignore_errors=True)
    effects = Counter(line[1] for line in ledger if line[0] == "t")
    expected = [op for run in texts for op in params.operation_ids(run)]
    inferences: dict[str, dict[int, float]] = defaultdict(dict)
    for line in ledger:
        if line[0] == "m":
            inferences[line[1]].setdefault(int(line[2]), float(line[3]))
    steps = [ms for s in inferences.values() for ms in intervals_ms(s)]
    ok = (
        all(texts[r] == params.final_text(r) for r in texts)
        and all(effects[op] == 1 for op in expected)
        and len(effects) == len(expected)
    )
    return {
        "baseline_ok": ok,
        "baseline_wall_s": round(wall, 3),
        "baseline_runs_per_s": round(cfg.runs / wall, 1),
        "baseline_p50_step_ms": quantile(steps, 50),
        "baseline_p99_step_ms": quantile(steps, 99),
        "baseline_cpu_ms_per_run": per_run_ms(rss.cpu_seconds(), cfg.runs),
    }


# ---- the store's raw limit ----------------------------------------------------------------


async def run_store_limit(cfg: Config) -> dict[str, Any]:
    """One plain single-row insert per commit of W1, C writers: the store's raw limit."""
    from benchmarks import store_bench

    tmp = Path(tempfile.mkdtemp(prefix="ratchet-load-"))
    prepared = await prepare_store(cfg.store, tmp)
    per_run = cfg.params(None).commits_per_run()
    per_writer = max(1, math.ceil(cfg.runs * per_run / cfg.concurrency))
    try:
        if prepared.kind == "sqlite":
            path = prepared.url.split(":///", 1)[1]
            results = [
                await store_bench.raw_sqlite(path, cfg.concurrency, per_writer, shared=True),
                await store_bench.raw_sqlite(path, cfg.concurrency, per_writer, shared=False),
            ]
        elif prepared.kind == "postgres":
            results = [await store_bench.raw_postgres(prepared.url, cfg.concurrency, per_writer)]
        elif prepared.kind == "redis":
            results = [await _raw_redis(prepared.url, cfg.concurrency, per_writer)]
        else:
            raise typer.BadParameter(f"no raw limit for a {prepared.kind} store")
    finally:
        await prepared.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    best = max(results, key=lambda r: r.commits_per_s)
    return {
        "scenario": "store",
        "store": prepared.kind,
        "concurrency": cfg.concurrency,
        "commits_per_run": per_run,
        "mode": best.mode,
        "commits": best.commits,
        "commits_per_s": best.commits_per_s,
        "runs_per_s": round(best.commits_per_s / per_run, 1),
        "p50_commit_ms": best.p50_ms,
        "p99_commit_ms": best.p99_ms,
        "modes": {r.mode: r.commits_per_s for r in results},
    }


async def _raw_redis(url: str, writers: int, n: int) -> Any:
    import redis.asyncio as aioredis

    from benchmarks import store_bench

    client = aioredis.from_url(url, max_connections=writers + 2)

    async def op(_w: int, _v: int, c: Any) -> None:
        await client.rpush(f"raw:{c.thread_id}", c.encoded)

    try:
        return await store_bench.measure("redis", "raw rpush", writers, n, op)
    finally:
        await client.aclose()


__all__ = [
    "WARMUP_RUNS",
    "Config",
    "Kill",
    "Timed",
    "bounded",
    "drive_durable",
    "host_counts",
    "per_run_ms",
    "run_baseline",
    "run_store_limit",
    "run_w1",
    "sharing",
]
