"""Scale limits: N Runs parked on a permission wait, then every one resumed (issue 21, item 4).

    python -m benchmarks.parked --runs 10000 [--store sqlite|postgres] [--json]

Each Run is of the parked agent (``benchmarks.parked:parked_l<tag>``): its first Step
asks for one tool that needs permission, so the Run commits ``awaiting`` with a
ticket; approved, the tool runs (writing its effect into a ledger like W1's), and the
second Step answers with final text. The benchmark starts N Runs, at most
``--concurrency`` at once, until every one is awaiting; checks that no RunHost drives
any of them (an awaiting Run holds nothing in a host); resumes every one (approve)
and waits until each has ended; then reads every Run back through a new store
connection (``benchmarks.verify``: ended natural with its text, its log replays to
its frontier, its tool's effect in the ledger exactly once).

Memory is each RunHost's RSS (its process, by the pid it reports): idle (after a
warm-up, before the first start), the peak while the Runs are being started, once
all are parked, and the peak while they are being resumed. ``rss_per_parked_run_kb``
is (parked - idle) summed over the hosts, per parked Run: what a Run at rest costs a
host. RSS counts memory the allocator keeps after the objects are gone, so it is an
upper bound.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import typer

from benchmarks.rss import RSS_SAMPLE_S, RssSampler, mb
from benchmarks.stores import prepare_store
from benchmarks.verify import verify
from benchmarks.w1 import bounded, run_durable
from benchmarks.w1_agent import W1, ledger_dir, new_ledger, record
from cluster.client import Ratchet, RunHandle, command_for
from runtime.agent import Agent
from runtime.commit import Frontier
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, PermissionDecision
from runtime.models import InferenceRequest, ModelResponse, ScriptedModel, call
from runtime.patience import patiently
from runtime.tools import ToolContext, tool
from storage.url import open_store

NAME = re.compile(r"^parked(?:_l([0-9a-z]+))?$")
TOOL = "parked_write"
"""Needs permission: the Run awaits a decision before the call runs."""
WARMUP_RUNS = 4
PROGRESS_EVERY = 500
PARK_DEADLINE_S = 60.0
"""How long the hosts may take to drop the drives of Runs they answered as parked."""


# ---- the parked agent ---------------------------------------------------------------------


@dataclass(frozen=True)
class Parked(W1):
    """W1 with two Steps and one call, which waits for permission (``benchmarks.verify``
    checks it like a W1 Run: the call's operation id and the final text are W1's)."""

    steps: int = 2
    tools: int = 1

    @property
    def name(self) -> str:
        return f"parked_l{self.ledger}" if self.ledger else "parked"

    @property
    def ref(self) -> str:
        return f"benchmarks.parked:{self.name}"

    @classmethod
    def parse(cls, name: str) -> Parked | None:
        match = NAME.match(name)
        return None if match is None else cls(ledger=match.group(1))

    def final_text(self, run_id: str) -> str:
        return f"parked done: {run_id}"


def build(params: Parked) -> Agent:
    tag = params.ledger

    @tool(name=TOOL, needs_permission=True)
    async def write(n: int, ctx: ToolContext) -> str:
        """Write something once a human allows it (an effect: never replayed)."""
        record(tag, "t", ctx.operation_id, TOOL, ctx.attempt, time.time())
        return f"wrote {n}"

    def ask(request: InferenceRequest) -> ModelResponse:
        return ModelResponse(text="may I?", tool_calls=(call(TOOL, params.call_id(0, 0), n=1),))

    def final(request: InferenceRequest) -> ModelResponse:
        return ModelResponse(text=params.final_text(request.run_id))

    return Agent(name="parked", model=ScriptedModel([ask, final]), tools=(write,), max_steps=2)


_built: dict[str, Agent] = {}


def __getattr__(name: str) -> Agent:
    params = Parked.parse(name)
    if params is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        _built[name] = build(params)
    return _built[name]


# ---- each host's RSS ----------------------------------------------------------------------


class HostRss:
    """RSS of each RunHost process by pid, sampled in a thread: the latest and the peak
    since the last ``reset``."""

    def __init__(self, pids: list[int]) -> None:
        import psutil  # vendored by Ray, importable once ray is

        self.procs = [psutil.Process(pid) for pid in pids]
        self.peak = [0] * len(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="host-rss")

    def sample(self) -> list[int]:
        now = [p.memory_info().rss for p in self.procs]
        self.peak = [max(a, b) for a, b in zip(self.peak, now, strict=True)]
        return now

    def reset(self) -> list[int]:
        """A sample now, which is also the new peak."""
        self.peak = [0] * len(self.procs)
        return self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.sample()

    def __enter__(self) -> HostRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def host_pids(client: Ratchet) -> list[int]:
    return [int((await host.info.remote())["pid"]) for host in client.hosts]


async def driven(client: Ratchet, threads: set[str]) -> int:
    """How many of ``threads`` some host of the pool is driving now."""
    lists = await asyncio.gather(*(host.driving.remote() for host in client.hosts))
    return sum(len(threads.intersection(names)) for names in lists)


async def until_undriven(client: Ratchet, threads: set[str], deadline_s: float) -> int:
    """Wait until no host drives any of ``threads`` (or the deadline): how many still are."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        left = await driven(client, threads)
        if not left or loop.time() >= end:
            return left
        await asyncio.sleep(0.1)


# ---- parking and resuming -----------------------------------------------------------------


@dataclass
class Phase:
    """One bounded pass over the Runs: its wall time and what went wrong."""

    wall_s: float = 0.0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    """The first ten failures' descriptions."""

    def fail(self, text: str) -> None:
        self.failed += 1
        if len(self.failures) < 10:
            self.failures.append(text)


async def timed_pass(
    label: str, n: int, limit: int, one: Callable[[int], Awaitable[str | None]]
) -> Phase:
    """``one(i)`` for every i < n, ``limit`` at once, a progress line every
    ``PROGRESS_EVERY``; ``one`` returns a failure's description or None."""
    phase, done = Phase(), 0
    began = time.perf_counter()

    async def slot(i: int) -> None:
        nonlocal done
        try:
            failure = await one(i)
        except Exception as exc:  # one Run's failure is reported, not the pass's end
            failure = f"run {i}: {exc!r}"
        if failure:
            phase.fail(failure)
        done += 1
        if done % PROGRESS_EVERY == 0 or done == n:
            elapsed = time.perf_counter() - began
            print(f"{label} {done}/{n} ({elapsed:.1f} s)", file=sys.stderr, flush=True)

    await bounded(n, limit, slot)
    phase.wall_s = time.perf_counter() - began
    return phase


class Fleet:
    """The Runs of one measurement: their ids, and the frontier each parked with."""

    def __init__(self, client: Ratchet, params: Parked, prefix: str, n: int) -> None:
        stamp = uuid.uuid4().hex[:8]
        self.client, self.params = client, params
        self.threads = [(f"p-{stamp}-{prefix}{i:05d}", f"run-{stamp}-{prefix}{i:05d}")
                        for i in range(n)]  # fmt: skip
        self.parked: dict[str, Frontier] = {}

    async def park(self, i: int) -> str | None:
        thread, run = self.threads[i]
        frontier = await run_durable(self.client, self.params.ref, thread, run, "hosted")
        if frontier is None or not isinstance(frontier.run_state, AwaitingState):
            state = frontier and type(frontier.run_state).__name__
            return f"{thread}: not awaiting after its start ({state})"
        self.parked[thread] = frontier
        return None

    async def resume(self, i: int) -> str | None:
        thread, run = self.threads[i]
        state = self.parked[thread].run_state
        assert isinstance(state, AwaitingState)
        handle = RunHandle(self.client, ThreadId(thread), RunId(run), "hosted")
        await handle.resume(command_for(state.ticket, PermissionDecision(approve=True)))
        await handle.result()
        return None

    async def run(self, limit: int, label: str) -> tuple[Phase, Phase | None]:
        """Park every Run, then resume every one (not if some failed to park)."""
        n = len(self.threads)
        parked = await timed_pass(f"parked ({label})", n, limit, self.park)
        if parked.failures:
            return parked, None
        return parked, await timed_pass(f"resumed ({label})", n, limit, self.resume)


# ---- one measurement ----------------------------------------------------------------------


@dataclass
class ParkedConfig:
    runs: int = 10_000
    concurrency: int = 500
    store: str = "sqlite"
    hosts: int = 2
    executors: int = 2
    timeout_s: float = 1800.0


async def run_parked(cfg: ParkedConfig) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-parked-"))
    prepared = await prepare_store(cfg.store, tmp)
    params = Parked(ledger=new_ledger())
    client: Ratchet | None = None
    try:
        client = await Ratchet.connect(
            store_url=prepared.url, hosts=cfg.hosts, executors=cfg.executors, quiet=True
        )
        measured = await asyncio.wait_for(measure(client, params, cfg), cfg.timeout_s)
        await client.shutdown()
        client = None
        check_store = await patiently(lambda: open_store(prepared.url))
        try:
            verdict = await verify(check_store, params, measured.pop("threads"), [], strict=True)
        finally:
            await check_store.close()
    finally:
        if client is not None:
            await client.shutdown()
        await prepared.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ledger_dir(params.ledger or ""), ignore_errors=True)
    checked = cfg.runs + WARMUP_RUNS
    problems = [*measured.pop("problems"), *verdict.problems]
    ok = verdict.ok(checked) and measured["ok"]
    result = {"scenario": "parked", "store": prepared.kind, "runs": cfg.runs,
              "concurrency": cfg.concurrency, "hosts": cfg.hosts, "ok": ok, **measured,
              "checked_runs": checked, "natural_runs": verdict.natural_runs,
              "commits_per_run": round(verdict.commits / checked, 2),
              "exactly_once_calls": verdict.exactly_once_calls,
              "lost_commits": verdict.lost_commits,
              "ledger_violations": verdict.ledger_violations}  # fmt: skip
    if problems:
        result["problems"] = problems[:10]
    return result


async def measure(client: Ratchet, params: Parked, cfg: ParkedConfig) -> dict[str, Any]:
    """Warm up, then park and resume ``cfg.runs`` Runs, sampling each host's RSS."""
    warm = Fleet(client, params, "w", WARMUP_RUNS)
    await warm.run(WARMUP_RUNS, "warm-up")
    fleet = Fleet(client, params, "r", cfg.runs)
    with HostRss(await host_pids(client)) as rss, RssSampler() as workers:
        idle, workers_idle = rss.reset(), workers.sample()[0]
        parked = await timed_pass("parked", cfg.runs, cfg.concurrency, fleet.park)
        starting_peak = list(rss.peak)
        ours = {t for t, _ in fleet.threads}
        still_driven = await until_undriven(client, ours, PARK_DEADLINE_S)
        at_rest = rss.reset()
        resumed = Phase(failed=cfg.runs, failures=["not resumed: some Runs did not park"])
        if not parked.failures:
            resumed = await timed_pass("resumed", cfg.runs, cfg.concurrency, fleet.resume)
        resuming_peak = list(rss.peak)
    n = max(cfg.runs, 1)
    return {
        "ok": not parked.failures and not resumed.failures and not still_driven,
        "park_all_s": round(parked.wall_s, 2),
        "parks_per_s": round(cfg.runs / parked.wall_s, 1) if parked.wall_s else None,
        "park_failures": parked.failed,
        "driven_while_parked": still_driven,
        "resume_failures": resumed.failed,
        "resume_all_s": round(resumed.wall_s, 2),
        "resumes_per_s": round(cfg.runs / resumed.wall_s, 1) if resumed.wall_s else None,
        "host_rss_idle_mb": [mb(x) for x in idle],
        "host_rss_peak_starting_mb": [mb(x) for x in starting_peak],
        "host_rss_parked_mb": [mb(x) for x in at_rest],
        "host_rss_peak_resuming_mb": [mb(x) for x in resuming_peak],
        "rss_per_parked_run_kb": round((sum(at_rest) - sum(idle)) / 1024 / n, 2),
        "rss_per_starting_run_kb": round((sum(starting_peak) - sum(idle)) / 1024 / n, 2),
        "idle_rss_mb": mb(workers_idle),
        "peak_rss_mb": mb(workers.peak_workers),
        "problems": parked.failures + resumed.failures,
        "threads": [*warm.threads, *fleet.threads],
    }


# ---- the command --------------------------------------------------------------------------


def parked_command(
    runs: int = typer.Option(10_000, "--runs", help="N: Runs to park, then resume"),
    concurrency: int = typer.Option(500, "--concurrency", help="starts (resumes) at once"),
    store: str = typer.Option(
        "sqlite", "--store", help="sqlite | postgres (a fresh store, removed after) or a URL"
    ),
    hosts: int = typer.Option(2, "--hosts", help="RunHosts in the hosted pool"),
    executors: int = typer.Option(2, "--executors", help="ToolExecutors in the pool"),
    timeout_s: float = typer.Option(1800.0, "--timeout-s", help="the whole measurement"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line last on stdout"),
) -> None:
    """Park N Runs on a permission wait, measure the hosts' memory, resume them all."""
    cfg = ParkedConfig(runs, concurrency, store, hosts, executors, timeout_s)
    print(f"parked: {cfg}", file=sys.stderr, flush=True)
    ours = not ray.is_initialized()
    try:
        result = asyncio.run(run_parked(cfg))
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()  # before printing: nothing of Ray's may print after the JSON line
    for key, value in result.items():
        print(f"{key}: {value}", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
    if not result["ok"]:
        raise typer.Exit(1)


def cli() -> None:
    typer.run(parked_command)


if __name__ == "__main__":
    cli()


__all__ = ["HostRss", "Parked", "ParkedConfig", "build", "parked_command", "run_parked"]
