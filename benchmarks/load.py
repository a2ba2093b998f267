"""Load generator: workload W1 on a Ratchet system, beside a no-durability baseline.

W1: R Runs in total, at most C at once; each Run is S model Steps of a scripted
model that asks for K tool calls on Steps 1..S-1 and answers with final text on
Step S; the tools return a small string. Defaults R=200, C=50, S=5, K=2.

    python -m benchmarks.load                               # SQLite, hosted, baseline
    python -m benchmarks.load --store postgres --json
    python -m benchmarks.load --chaos --runs 1000
    python -m benchmarks.load --runs 5000 --concurrency 5000 \\
        --model-latency-ms 20 --tool-latency-ms 10           # W1-io, the scale scenario
    python -m benchmarks.load --scenario store              # the store's raw limit
    python -m benchmarks.load --plot throughput.png         # sweep C per store, plot

Correctness is part of every run: after the timed part every Run is read back
from the store through a new connection; ``ok`` holds only if every Run ended
naturally with its expected final text, every thread's log has no gap and
replays to its stored frontier, and the side-effect ledger (one O_APPEND file per
process, written by the tools themselves) holds every tool call's operation id
exactly once — under ``--chaos``: every completed call at least once, replayed
calls at most once per attempt, and never a ``never_replay`` call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import ray
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.wire import NAMESPACE
from benchmarks.baseline import Baseline
from benchmarks.trials import combine
from benchmarks.w1_agent import NEVER_REPLAY, W1, ledger_dir, new_ledger, read_ledger
from cluster.client import Ratchet
from cluster.report import EXECUTION_LOST
from runtime.commit import Frontier, replay
from runtime.errors import StoreUnavailable
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, Natural
from runtime.messages import AssistantMessage
from runtime.ports import CommitStore, CommittedRecord
from storage.url import open_store, scheme_of

PG_SERVER = os.environ.get(
    "RATCHET_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_SERVER = os.environ.get("RATCHET_BENCH_REDIS", "redis://127.0.0.1:6379/13")
WARMUP_RUNS = 4
START_ATTEMPTS = 30
VERIFY_CONCURRENCY = 32
RSS_SAMPLE_S = 0.25
T = TypeVar("T")
CHILDREN_EVERY = 8
"""Re-list the process tree every 8 samples (2 s); RSS is read every sample."""


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
    baseline: bool = True
    trials: int = 1
    timeout_s: float = 1800.0

    def params(self, ledger: str | None) -> W1:
        return W1(self.steps, self.tools, self.model_latency_ms, self.tool_latency_ms, ledger)


# ---- stores ---------------------------------------------------------------------------------


@dataclass
class PreparedStore:
    kind: str
    url: str
    cleanup: Callable[[], Awaitable[None]]


async def prepare_store(spec: str, tmp: Path) -> PreparedStore:
    """``sqlite``/``postgres``/``redis``/``memory`` make a fresh store (dropped after);
    a full URL is used as given."""

    async def nothing() -> None:
        return None

    if spec == "sqlite":
        return PreparedStore("sqlite", f"sqlite:///{tmp}/w1-{uuid.uuid4().hex[:8]}.db", nothing)
    if spec == "memory":
        return PreparedStore("memory", "memory://", nothing)
    if spec in ("postgres", "postgresql"):
        return await _fresh_postgres(PG_SERVER)
    if spec == "redis":
        return await _fresh_redis(REDIS_SERVER)
    kind = scheme_of(spec)
    return PreparedStore("postgres" if kind.startswith("postgres") else kind, spec, nothing)


async def _fresh_postgres(server: str) -> PreparedStore:
    import asyncpg

    name = f"ratchet_w1_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()

    async def drop() -> None:
        conn = await asyncpg.connect(server)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await conn.close()

    return PreparedStore("postgres", server.rsplit("/", 1)[0] + f"/{name}", drop)


async def _fresh_redis(url: str) -> PreparedStore:
    """Redis has no databases to create: the benchmark owns one db index and flushes it."""
    import redis.asyncio as aioredis

    async def flush() -> None:
        client = aioredis.from_url(url)
        try:
            await client.flushdb()
        finally:
            await client.aclose()

    await flush()
    return PreparedStore("redis", url, flush)


# ---- memory -------------------------------------------------------------------------------


class RssSampler:
    """Peak RSS of this process plus the Ray processes it started, sampled in a thread;
    and the CPU time each kind of process spent meanwhile.

    ``workers``: the driver and every ``ray::`` process (actors, idle workers);
    ``total``: also Ray's own daemons (raylet, GCS, agents). Only descendants of this
    process count: other Ray instances on the machine are not ours. CPU time of a
    process that dies (a killed host) counts up to its last sample.
    """

    def __init__(self) -> None:
        import psutil  # vendored by Ray (ray/thirdparty_files), importable once ray is

        self.psutil = psutil
        self.me = psutil.Process()
        self.peak_workers = 0
        self.peak_total = 0
        self._children: list[Any] = []
        self._ticks = 0
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")

    def sample(self) -> tuple[int, int]:
        if self._ticks % CHILDREN_EVERY == 0:  # listing /proc is the costly part
            self._children = self.me.children(recursive=True)
        self._ticks += 1
        workers = total = self.me.memory_info().rss
        self._cpu(self.me.pid, "driver", self.me.cpu_times())
        for proc in self._children:
            try:
                rss = proc.memory_info().rss
                first = (proc.cmdline() or [""])[0]
                self._cpu(proc.pid, _kind(first), proc.cpu_times())
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
            total += rss
            if first.startswith("ray::"):
                workers += rss
        return workers, total

    def _cpu(self, pid: int, kind: str, times: Any) -> None:
        used = times.user + times.system
        if self._thread.is_alive() or pid in self._cpu_first:
            self._cpu_first.setdefault(pid, 0.0)  # a process born during the load
        else:
            self._cpu_first[pid] = used
        self._cpu_last[pid] = (kind, used)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds per kind of process between ``__enter__`` and ``__exit__``."""
        spent: dict[str, float] = defaultdict(float)
        for pid, (kind, used) in self._cpu_last.items():
            spent[kind] += used - self._cpu_first.get(pid, 0.0)
        return dict(spent)

    def _loop(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self._take()

    def _take(self) -> None:
        workers, total = self.sample()
        self.peak_workers = max(self.peak_workers, workers)
        self.peak_total = max(self.peak_total, total)

    def __enter__(self) -> RssSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._children = self.me.children(recursive=True)
        self._ticks = 1
        self._take()


def _kind(title: str) -> str:
    """``ray::ratchet-…:host:0:RunHost.run`` → ``RunHost``; Ray's daemons are ``ray``."""
    if not title.startswith("ray::"):
        return "ray"
    name = title.removeprefix("ray::").split()[0].split(".")[0].rsplit(":", 1)[-1]
    return name or "ray"


def _mb(n: float) -> float:
    return round(n / 2**20, 1)


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


async def run_durable(client: Ratchet, ref: str, thread: str, run: str, placement: str) -> None:
    """``client.run``, retried (a start is idempotent by run id) while a host is down."""
    for attempt in range(START_ATTEMPTS):
        try:
            await client.run(ref, f"W1 input {thread}", thread_id=thread, run_id=run,
                             placement=placement)  # type: ignore[arg-type]  # fmt: skip
            return
        except Exception:
            if attempt == START_ATTEMPTS - 1:
                raise
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))


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


async def drive_durable(client: Ratchet, cfg: Config, ref: str, progress: Progress) -> Timed:
    stamp = uuid.uuid4().hex[:8]

    async def launch(prefix: str, i: int) -> None:
        thread, run = f"w1-{stamp}-{prefix}{i:05d}", f"run-{stamp}-{prefix}{i:05d}"
        # one call to the host, which answers when the Run is done; the store confirms
        await run_durable(client, ref, thread, run, cfg.placement)

    warm = [(f"w1-{stamp}-w{i:05d}", f"run-{stamp}-w{i:05d}") for i in range(WARMUP_RUNS)]
    threads = [(f"w1-{stamp}-r{i:05d}", f"run-{stamp}-r{i:05d}") for i in range(cfg.runs)]
    await bounded(WARMUP_RUNS, WARMUP_RUNS, lambda i: launch("w", i))
    task = progress.add_task(f"durable W1 ({cfg.placement})", total=cfg.runs)
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
                 rss.cpu_seconds())  # fmt: skip


# ---- verification -------------------------------------------------------------------------


@dataclass
class Verdict:
    natural_runs: int = 0
    wrong_text: int = 0
    commits: int = 0
    lost_commits: int = 0
    duplicate_never_replay: int = 0
    exactly_once_calls: int = 0
    replayed_calls: int = 0
    indeterminate_calls: int = 0
    ledger_violations: int = 0
    recovered_runs: int = 0
    recoveries_ms: list[float] = field(default_factory=list)
    settled_ms: list[float] = field(default_factory=list)
    """Host kill → the lost Run's ``failed/execution_lost`` commit (part of recovery)."""
    step_ms: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 10:
            self.problems.append(text)

    def ok(self, runs: int) -> bool:
        return (
            self.natural_runs == runs
            and self.wrong_text == 0
            and self.lost_commits == 0
            and self.duplicate_never_replay == 0
            and self.ledger_violations == 0
        )


_FRONTIER_TRUTH = {"epoch", "owner"}
"""Claims change these without a commit: a replayed log cannot reproduce them."""


async def verify(
    store: CommitStore,
    params: W1,
    runs: Sequence[tuple[str, str]],
    host_kills: Sequence[float],
    strict: bool,
    timed_runs: set[str] | None = None,
) -> Verdict:
    """Read every Run back from ``store`` and check it against the ledger."""
    verdict = Verdict()
    gate = asyncio.Semaphore(VERIFY_CONCURRENCY)

    async def fetch(thread: str) -> tuple[list[CommittedRecord], Frontier]:
        async with gate:
            records = await _patiently(lambda: store.read(ThreadId(thread)))
            return records, await _patiently(lambda: store.load(ThreadId(thread)))

    fetched = await asyncio.gather(*(fetch(t) for t, _ in runs))
    assert params.ledger is not None
    effects: Counter[str] = Counter()
    tool_of: dict[str, str] = {}
    inferences: dict[str, dict[int, float]] = defaultdict(dict)
    for line in read_ledger(params.ledger):
        if line[0] == "t":
            effects[line[1]] += 1
            tool_of[line[1]] = line[2]
        elif line[0] == "m":
            steps = inferences[line[1]]
            step = int(line[2])
            steps[step] = min(steps.get(step, math.inf), float(line[3]))
    expected_ops: set[str] = set()
    for (thread, run), (records, frontier) in zip(runs, fetched, strict=True):
        verdict.commits += len(records)
        _check_log(verdict, thread, records, frontier)
        _check_end(verdict, params, thread, run, frontier)
        calls = {}
        for record in records:
            if record.commit.batch is not None:
                calls.update({c.operation_id: c for c in record.commit.batch.calls})
        for op in params.operation_ids(run):
            expected_ops.add(op)
            call = calls.get(op)
            if call is None:
                verdict.ledger_violations += 1
                verdict.problem(f"{thread}: call {op} was never committed")
                continue
            _check_call(verdict, op, call, effects[op], strict)
        _recoveries(verdict, records, host_kills)
        if timed_runs is None or run in timed_runs:
            verdict.step_ms += _intervals_ms(inferences.get(run, {}))
    phantom = set(effects) - expected_ops
    if phantom:
        verdict.ledger_violations += len(phantom)
        verdict.problem(f"{len(phantom)} ledger effects of no committed call, e.g. {min(phantom)}")
    verdict.duplicate_never_replay = sum(
        1 for op, n in effects.items() if n > 1 and tool_of[op] in NEVER_REPLAY
    )
    return verdict


async def _patiently(op: Callable[[], Awaitable[T]], give_up_s: float = 60.0) -> T:
    """Retry a read while the store is unavailable (e.g. PostgreSQL out of connection
    slots until the killed system's backends are gone)."""
    deadline = time.monotonic() + give_up_s
    delay = 0.1
    while True:
        try:
            return await op()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def _intervals_ms(starts: dict[int, float]) -> list[float]:
    """A Step's time: from its inference's start to the next Step's inference's start."""
    times = [t for _, t in sorted(starts.items())]
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def _check_log(v: Verdict, thread: str, records: list[CommittedRecord], frontier: Frontier) -> None:
    seqs = [r.seq for r in records]
    if seqs != list(range(1, len(seqs) + 1)) or frontier.version != len(seqs):
        missing = max([*seqs, frontier.version]) - len(seqs)
        v.lost_commits += max(missing, 1)
        v.problem(f"{thread}: log seqs {seqs[:3]}… of {len(seqs)}, frontier v{frontier.version}")
        return
    rebuilt = replay(ThreadId(thread), [r.commit for r in records])
    if rebuilt.model_dump(exclude=_FRONTIER_TRUTH) != frontier.model_dump(exclude=_FRONTIER_TRUTH):
        v.lost_commits += 1
        v.problem(f"{thread}: replay(log) differs from the stored frontier")


def _check_end(v: Verdict, params: W1, thread: str, run: str, frontier: Frontier) -> None:
    state = frontier.run_state
    if frontier.run_id != run or not isinstance(state, EndedState):
        v.problem(f"{thread}: not ended ({type(state).__name__})")
        return
    if not isinstance(state.cause, Natural):
        v.problem(f"{thread}: ended {state.cause.kind}")
        return
    v.natural_runs += 1
    last = next((m for m in reversed(frontier.messages) if isinstance(m, AssistantMessage)), None)
    if last is None or last.text != params.final_text(run):
        v.wrong_text += 1
        v.problem(f"{thread}: final text {last.text if last else None!r}")


def _check_call(v: Verdict, op: str, call: Any, seen: int, strict: bool) -> None:
    phase, attempts = call.phase.kind, call.attempts
    if phase == "completed" and attempts == 1 and seen == 1:
        v.exactly_once_calls += 1
        return
    if strict:
        v.ledger_violations += 1
        v.problem(f"{op}: {phase} after {attempts} attempt(s), {seen} effect(s) in the ledger")
        return
    if phase == "indeterminate":
        v.indeterminate_calls += 1
        good = seen <= attempts
    elif phase == "completed":
        v.replayed_calls += attempts > 1
        good = 1 <= seen <= attempts
    else:
        good = False
    if not good:
        v.ledger_violations += 1
        v.problem(f"{op}: {phase} after {attempts} attempt(s), {seen} effect(s) in the ledger")


def _recoveries(v: Verdict, records: list[CommittedRecord], host_kills: Sequence[float]) -> None:
    """Host kill → the first commit of the resumed Run (its status back to running)."""
    lost_at: int | None = None
    recovered = False
    for record in records:
        status = record.commit.status
        if status is None:
            continue
        if status.state == "failed" and status.reason == EXECUTION_LOST:
            lost_at = status.since
        elif status.state == "running" and lost_at is not None:
            before = [k for k in host_kills if k * 1e6 <= lost_at]
            if before:
                v.recoveries_ms.append((status.since - max(before) * 1e6) / 1000)
                v.settled_ms.append((lost_at - max(before) * 1e6) / 1000)
            recovered, lost_at = True, None
    v.recovered_runs += recovered


# ---- one W1 measurement -------------------------------------------------------------------


def _quantile(values: Sequence[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return round(values[0], 2)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)


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
        )
        own = prepared.kind != "memory"
        timed = await drive_durable(client, cfg, params.ref, progress)
        report = await client.supervisor_report() if cfg.chaos else {}
        coalescing = await _waves_per_call(client)
        if own:
            await client.shutdown()
            client = None
        check_store = await _patiently(lambda: open_store(prepared.url)) if own else None
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
        "p50_step_ms": _quantile(verdict.step_ms, 50),
        "p99_step_ms": _quantile(verdict.step_ms, 99),
        "peak_rss_mb": _mb(timed.peak_rss),
        "peak_rss_total_mb": _mb(timed.peak_rss_total),
        "idle_rss_mb": _mb(timed.idle_rss),
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
        "cpu_ms_per_run": _per_run_ms(timed.cpu_s, cfg.runs),
    }
    if cfg.chaos:
        result.update(
            kills=len(timed.kills),
            host_kills=len(host_kills),
            executor_kills=len(timed.kills) - len(host_kills),
            recovered_runs=verdict.recovered_runs,
            median_recovery_ms=_quantile(verdict.recoveries_ms, 50),
            max_recovery_ms=round(max(verdict.recoveries_ms, default=0.0), 1),
            median_settled_ms=_quantile(verdict.settled_ms, 50),
            replayed_calls=verdict.replayed_calls,
            indeterminate_calls=verdict.indeterminate_calls,
            supervisor=report.get("counts", {}),
        )
    if verdict.problems:
        result["problems"] = verdict.problems
    return result


def _per_run_ms(cpu_s: dict[str, float], runs: int) -> dict[str, float]:
    """CPU milliseconds per Run by kind of process, the largest first."""
    ranked = sorted(cpu_s.items(), key=lambda kv: -kv[1])
    return {kind: round(seconds * 1000 / runs, 2) for kind, seconds in ranked if seconds > 0}


async def _waves_per_call(client: Ratchet) -> float | None:
    """How many Runs' waves shared an executor round trip, on average (hosted pool; a
    host restarted by chaos counts from its restart)."""
    waves = calls = 0
    for host in client.hosts:
        with contextlib.suppress(Exception):
            info = await host.info.remote()
            waves, calls = waves + info["waves_sent"], calls + info["executor_calls"]
    return round(waves / calls, 2) if calls else None


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
    steps = [ms for s in inferences.values() for ms in _intervals_ms(s)]
    ok = (
        all(texts[r] == params.final_text(r) for r in texts)
        and all(effects[op] == 1 for op in expected)
        and len(effects) == len(expected)
    )
    return {
        "baseline_ok": ok,
        "baseline_wall_s": round(wall, 3),
        "baseline_runs_per_s": round(cfg.runs / wall, 1),
        "baseline_p50_step_ms": _quantile(steps, 50),
        "baseline_p99_step_ms": _quantile(steps, 99),
        "baseline_cpu_ms_per_run": _per_run_ms(rss.cpu_seconds(), cfg.runs),
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


# ---- sweeps and the plot -------------------------------------------------------------------

SWEEP_CONCURRENCY = (1, 5, 10, 25, 50, 100)


def _available(store: str) -> bool:
    import socket

    port = {"postgres": 5432, "redis": 6379}.get(store)
    if port is None:
        return True
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


async def run_sweep(
    cfg: Config, stores: Sequence[str], levels: Sequence[int], console: Console, progress: Progress
) -> list[dict[str, Any]]:
    """One point per store (and the baseline) and level of C: the median runs/s of
    ``cfg.trials`` trials, which alternate between the series."""
    points = []
    for c in levels:
        point = replace(cfg, concurrency=c, chaos=False)
        series = (["baseline"] if cfg.baseline else []) + list(stores)
        trials: dict[str, list[dict[str, Any]]] = {name: [] for name in series}
        for _ in range(cfg.trials):
            for name in series:
                trials[name].append(await _sweep_trial(point, name, console, progress))
        for name in series:
            rates = [t["runs_per_s"] for t in trials[name] if t["runs_per_s"] is not None]
            rate = round(statistics.median(rates), 1) if rates else None
            ok = all(t["ok"] for t in trials[name])
            points.append({"store": name, "concurrency": c, "runs_per_s": rate, "ok": ok,
                           "per_trial": trials[name]})  # fmt: skip
            console.log(f"{name} C={c}: {rate} runs/s ok={ok}")
    return points


async def _sweep_trial(
    point: Config, name: str, console: Console, progress: Progress
) -> dict[str, Any]:
    if name == "baseline":
        base = await run_baseline(point, progress)
        return {"runs_per_s": base["baseline_runs_per_s"], "ok": base["baseline_ok"]}
    try:
        result = await run_w1(replace(point, store=name), console, progress)
    except Exception as exc:  # one failed point must not lose the sweep
        console.log(f"[red]{name} C={point.concurrency} failed: {exc!r}")
        return {"runs_per_s": None, "ok": False, "error": repr(exc)}
    return {"runs_per_s": result["runs_per_s"], "ok": result["ok"]}


def plot(points: Sequence[dict[str, Any]], path: str, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in points:
        if p.get("runs_per_s") is not None:
            series[p["store"]].append((p["concurrency"], p["runs_per_s"]))
    for name, values in series.items():
        xs, ys = zip(*sorted(values), strict=True)
        style = {"linestyle": "--", "color": "black"} if name == "baseline" else {}
        label = "plain Ray, no durability" if name == "baseline" else f"Ratchet on {name}"
        ax.plot(xs, ys, marker="o", label=label, **style)
    ax.set_xscale("log")
    ax.set_xlabel("concurrent Runs (C)")
    ax.set_ylabel("Runs / s")
    ax.set_title(
        f"W1 ({cfg.runs} Runs, {cfg.steps} steps, {cfg.tools} tools/step, {cfg.placement}, "
        f"{cfg.hosts} hosts / {cfg.executors} executors"
        + (f"; median of {cfg.trials} trials)" if cfg.trials > 1 else ")"),
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- output -------------------------------------------------------------------------------


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"W1 on {result.get('store')}", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key == "problems":
            continue
        style = ""
        if key == "ok":
            style = "[green]" if value else "[red]"
        table.add_row(key, f"{style}{value}")
    console.print(table)
    for problem in result.get("problems", []):
        console.print(f"[red]{problem}")


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


async def bench(cfg: Config, scenario: str, plot_file: str | None, console: Console) -> Any:
    if scenario == "store":
        return await run_store_limit(cfg)
    with _progress(console) as progress:
        if plot_file:
            stores = [s for s in ("sqlite", "postgres") if _available(s)]
            points = await run_sweep(cfg, stores, SWEEP_CONCURRENCY, console, progress)
            plot(points, plot_file, cfg)
            Path(plot_file).with_suffix(".json").write_text(json.dumps(points, indent=1))
            ok = all(p["ok"] for p in points)
            return {"scenario": "sweep", "ok": ok, "plot": plot_file, "points": points}
        trials = []
        for trial in range(cfg.trials):
            # the baseline goes first every other trial: a drift in the machine's speed
            # then falls on both alike
            trials.append(await _w1_beside_baseline(cfg, console, progress, trial % 2 == 1))
        return combine(trials)


async def _w1_beside_baseline(
    cfg: Config, console: Console, progress: Progress, baseline_first: bool
) -> dict[str, Any]:
    if not cfg.baseline:
        result = await run_w1(cfg, console, progress)
        result.update(baseline_runs_per_s=None, ratio_to_baseline=None)
        return result
    if baseline_first:
        base = await run_baseline(cfg, progress)
        result = await run_w1(cfg, console, progress)
    else:
        result = await run_w1(cfg, console, progress)
        base = await run_baseline(cfg, progress)
    result.update(base)
    result["ratio_to_baseline"] = round(result["runs_per_s"] / base["baseline_runs_per_s"], 3)
    # CPU is what the two cores run out of; it is steadier than wall time on a shared
    # machine (other tenants stall both alike, but not in the same second)
    ours = sum(result["cpu_ms_per_run"].values())
    theirs = sum(base["baseline_cpu_ms_per_run"].values())
    result["cpu_ratio_to_baseline"] = round(theirs / ours, 3) if ours else None
    return result


def bench_command(
    runs: int = typer.Option(200, "--runs", help="R: Runs in total"),
    concurrency: int = typer.Option(50, "--concurrency", help="C: Runs at most at once"),
    steps: int = typer.Option(5, "--steps", help="S: model Steps per Run"),
    tools: int = typer.Option(2, "--tools", help="K: tool calls per Step (Steps 1..S-1)"),
    model_latency_ms: float = typer.Option(0.0, "--model-latency-ms"),
    tool_latency_ms: float = typer.Option(0.0, "--tool-latency-ms"),
    store: str = typer.Option(
        "sqlite",
        "--store",
        help="sqlite | postgres | redis | memory (a fresh store, removed after) or a store URL",
    ),
    placement: str = typer.Option("hosted", "--placement", help="hosted | dedicated"),
    hosts: int = typer.Option(2, "--hosts", help="RunHosts in the hosted pool"),
    executors: int = typer.Option(2, "--executors", help="ToolExecutors in the pool"),
    sqlite_writer: str = typer.Option(
        "direct", "--sqlite-writer", help="direct (each host writes) | actor (one store actor)"
    ),
    chaos: bool = typer.Option(False, "--chaos", help="kill a RunHost or ToolExecutor often"),
    chaos_interval_s: float = typer.Option(2.0, "--chaos-interval-s"),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline"),
    trials: int = typer.Option(
        1, "--trials", min=1, help="repeat W1 and its baseline (each --plot point) N times"
    ),
    scenario: str = typer.Option("w1", "--scenario", help="w1 | store (the store's raw limit)"),
    plot_file: str | None = typer.Option(
        None, "--plot", help="sweep C for each store and the baseline; write a PNG"
    ),
    seed: int = typer.Option(7, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line last on stdout"),
) -> None:
    """Run workload W1 (or the store's raw limit) and report throughput and correctness."""
    if placement not in ("hosted", "dedicated"):
        raise typer.BadParameter("--placement must be hosted or dedicated")
    if sqlite_writer not in ("direct", "actor"):
        raise typer.BadParameter("--sqlite-writer must be direct or actor")
    if scenario not in ("w1", "store"):
        raise typer.BadParameter("--scenario must be w1 or store")
    if trials > 1 and scenario != "w1":
        raise typer.BadParameter("--trials repeats W1 measurements: not with --scenario store")
    cfg = Config(
        runs=runs, concurrency=concurrency, steps=steps, tools=tools,
        model_latency_ms=model_latency_ms, tool_latency_ms=tool_latency_ms, store=store,
        placement=placement, hosts=hosts, executors=executors, sqlite_writer=sqlite_writer,
        chaos=chaos,
        chaos_interval_s=chaos_interval_s, seed=seed, baseline=baseline, trials=trials,
    )  # fmt: skip
    console = Console(stderr=as_json)
    console.print(f"[dim]{_describe(cfg, scenario)}")
    ours = not ray.is_initialized()
    try:
        result = asyncio.run(bench(cfg, scenario, plot_file, console))
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()  # before printing: nothing of Ray's may print after the JSON line
    if result.get("scenario") == "sweep":
        console.print(f"plot written to {plot_file}")
    else:
        render(result, console)
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
    if not result.get("ok", True):
        raise typer.Exit(1)


def _describe(cfg: Config, scenario: str) -> str:
    if scenario == "store":
        return f"store limit: {cfg.store}, {cfg.concurrency} writers"
    what = asdict(cfg)
    return ", ".join(f"{k}={v}" for k, v in what.items() if k not in ("seed", "timeout_s"))


def cli() -> None:
    typer.run(bench_command)


if __name__ == "__main__":
    cli()


__all__ = ["Config", "bench", "bench_command", "run_baseline", "run_w1"]
