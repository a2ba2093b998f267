"""W1 in one process, without Ray: what the engine and the store cost per Run.

The load benchmark measures the whole system; this one isolates the part every
RunHost runs: ``InProcessRunner`` drives W1 Runs (R in total, C at once) against one
store in this process, and reports wall time and this process's CPU time per Run
(the SQLite writer thread included). Profile it with ``py-spy record -- python -m
benchmarks.engine_bench``.

    python -m benchmarks.engine_bench [--store memory|sqlite|postgres|URL] [--runs R]
        [--concurrency C] [--runs-per-thread K] [--trials N] [--tracing off|memory]
        [--heap default|host] [--json]

``--runs-per-thread K`` gives each thread K Runs, one after another (R/K threads, K
rounds, C Runs at once in each): a conversation's later turns, whose start reads the
thread at rest. The SQL stores also report what share of their groups was planned
(``store_planned_share``: written without reading their rows first).

``--heap host`` collects garbage as a RunHost does (``actors.heap.freeze_startup_heap``:
the startup heap frozen, thresholds raised); the default keeps Python's own thresholds,
under which the collector took about 15 % of this benchmark's CPU (thirty-second round),
none of it the engine's work. The default stays, so that earlier rounds compare.

``--tracing memory`` traces every Run into the SDK's in-memory exporter (a simple
span processor: each span is exported as it ends), so the figures include what making
the spans costs; ``off`` (the default) sets no tracer provider, as a process without
one runs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import typer

from actors.heap import freeze_startup_heap
from benchmarks.w1_agent import W1
from runtime import tracing
from runtime.agent import load_agent
from runtime.runner import InProcessRunner
from storage.url import open_store

WARMUP_RUNS = 10


async def one_trial(
    url: str, runs: int, concurrency: int, traced: str = "off", per_thread: int = 1
) -> dict[str, float]:
    spans = _trace_into_memory() if traced == "memory" else None
    w1 = W1()
    agent = load_agent(w1.ref)
    store = await open_store(url)
    runner = InProcessRunner(agent, store, agent_ref=w1.ref)
    limit = asyncio.Semaphore(concurrency)
    stamp = f"{time.time_ns():x}"
    threads = -(-runs // per_thread)

    async def one(i: int) -> None:
        async with limit:
            await runner.start("go", thread_id=f"eb-{stamp}-{i}")

    try:
        await asyncio.gather(*(one(-i - 1) for i in range(WARMUP_RUNS)))
        before = getattr(store, "groups", 0), getattr(store, "planned", 0)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(per_thread):  # each round starts the next Run of every thread
            await asyncio.gather(*(one(i) for i in range(threads)))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        groups = getattr(store, "groups", 0) - before[0]
        planned = getattr(store, "planned", 0) - before[1]
    finally:
        await store.close()
        tracing.disable()
    done = threads * per_thread
    result = {"runs_per_s": done / wall, "cpu_ms_per_run": 1000 * cpu / done}
    if groups:
        result["store_planned_share"] = planned / groups
    if spans is not None:
        result["spans_per_run"] = len(spans.get_finished_spans()) / (runs + WARMUP_RUNS)
    return result


def _trace_into_memory() -> Any:
    """Trace into the SDK's in-memory exporter; returns the exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    return exporter


def store_url(store: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='ratchet-eb-')}/ratchet.db"
    if store == "memory":
        return "memory://"
    return store


def main(
    store: str = typer.Option("memory", help="memory, sqlite (a fresh file) or a store URL"),
    runs: int = typer.Option(500, min=1),
    concurrency: int = typer.Option(50, min=1),
    per_thread: int = typer.Option(
        1, "--runs-per-thread", min=1, help="K: each thread's Runs, one after another"
    ),
    trials: int = typer.Option(3, min=1),
    traced: str = typer.Option("off", "--tracing", help="off, or memory: spans of every Run"),
    heap: str = typer.Option(
        "default", "--heap", help="default (Python's GC), or host: a RunHost's GC settings"
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    if traced not in ("off", "memory"):
        raise typer.BadParameter("--tracing is off or memory")
    if heap not in ("default", "host"):
        raise typer.BadParameter("--heap is default or host")
    if heap == "host":  # what every actor does once its imports are done
        freeze_startup_heap()
    results = [
        asyncio.run(one_trial(store_url(store), runs, concurrency, traced, per_thread))
        for _ in range(trials)
    ]
    summary: dict[str, Any] = {
        "store": store if "://" not in store else store.split("://")[0],
        "runs": runs,
        "concurrency": concurrency,
        "runs_per_thread": per_thread,
        "trials": trials,
        "tracing": traced,
        "heap": heap,
        "runs_per_s": round(statistics.median(r["runs_per_s"] for r in results), 1),
        "cpu_ms_per_run": round(statistics.median(r["cpu_ms_per_run"] for r in results), 2),
    }
    if "store_planned_share" in results[0]:
        shares = (r["store_planned_share"] for r in results)
        summary["store_planned_share"] = round(statistics.median(shares), 3)
    if traced == "memory":
        summary["spans_per_run"] = round(statistics.median(r["spans_per_run"] for r in results), 1)
    print(json.dumps(summary) if as_json else summary)


if __name__ == "__main__":
    typer.run(main)
