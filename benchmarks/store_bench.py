"""Store benchmark: CommitStore appends beside the raw limit of the same server.

For each backend and each writer count (1 and 50), every writer drives Runs of 12
commits (activation, 10 steps, end) on threads of its own, appending through the
store; p50/p99 are per-append latencies. "raw" is the same server's limit
measured in the same run: one plain INSERT (Redis: one RPUSH) of a row of the same
size per transaction, through the driver directly, one connection per writer.
SQLite raw is also measured through one shared connection (writers take turns),
because connection-per-writer SQLite spends its time in the busy handler.

    python -m benchmarks.store_bench --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg

from runtime.commit import ThreadCommit
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState, Natural, RunningState
from runtime.messages import AssistantMessage, UserMessage
from storage.sql import SqlCommitStore

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/10"
TEXT = "The quick brown fox considers the tool results and decides what to do next. " * 3


@dataclass
class Result:
    backend: str
    mode: str
    writers: int
    commits: int
    seconds: float
    commits_per_s: float
    p50_ms: float
    p99_ms: float


def run_commits(thread: str, run: str) -> list[ThreadCommit]:
    """One Run's 12 commits, chained and encoded before the clock starts."""
    t, r = ThreadId(thread), RunId(run)
    running = RunningState(run_id=r)
    parts: list[dict[str, Any]] = [
        {"label": "activation", "disposition": running,
         "messages": (UserMessage(id=f"{run}:input", text=TEXT),)},
        *({"label": "inference", "disposition": running,
           "messages": (AssistantMessage(text=f"{i} {TEXT}"),)} for i in range(1, 11)),
        {"label": "ended", "disposition": EndedState(run_id=r, cause=Natural()),
         "messages": (AssistantMessage(text=TEXT),)},
    ]  # fmt: skip
    commits: list[ThreadCommit] = []
    for ordinal, part in enumerate(parts):
        prev = commits[-1].payload_hash if commits else ""
        commits.append(ThreadCommit(thread_id=t, run_id=r, ordinal=ordinal, prev=prev, **part))
    return commits


def workload(writers: int, per_writer: int) -> list[list[tuple[int, ThreadCommit]]]:
    """Per writer: (expected version, commit) pairs, Run after Run on fresh threads."""
    tag = uuid.uuid4().hex[:8]
    plans = []
    for w in range(writers):
        plan: list[tuple[int, ThreadCommit]] = []
        while len(plan) < per_writer:
            n = len(plan) // 12
            plan += list(enumerate(run_commits(f"b-{tag}-{w}-{n}", f"r-{tag}-{w}-{n}")))
        plans.append(plan[:per_writer])
    return plans


Op = Callable[[int, int, ThreadCommit], Awaitable[Any]]


async def measure(backend: str, mode: str, writers: int, per_writer: int, op: Op) -> Result:
    plans = workload(writers, per_writer)
    latencies: list[float] = []

    async def writer(w: int) -> None:
        for expected, commit in plans[w]:
            t0 = time.perf_counter()
            await op(w, expected, commit)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    seconds = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return Result(
        backend, mode, writers, len(latencies), round(seconds, 3),
        round(len(latencies) / seconds, 1), round(q[49] * 1000, 3), round(q[98] * 1000, 3),
    )  # fmt: skip


# ---- our stores ---------------------------------------------------------------------------


async def bench_store(backend: str, url: str, writers: int, n: int, group: bool) -> Result:
    store = await SqlCommitStore.connect(url, group_commit=group)
    try:
        mode = "append" if group else "append (no group commit)"
        return await measure(backend, mode, writers, n, lambda _w, v, c: store.append(c, v, 0))
    finally:
        await store.close()


async def bench_redis_store(writers: int, n: int) -> Result:
    from storage.redis_store import RedisCommitStore

    store = await RedisCommitStore.connect(REDIS_URL)
    try:
        await store.client.flushdb()
        return await measure("redis", "append", writers, n, lambda _w, v, c: store.append(c, v, 0))
    finally:
        await store.close()


# ---- raw limits ---------------------------------------------------------------------------

RAW_TABLE = "CREATE TABLE IF NOT EXISTS raw_bench (thread_id TEXT, seq BIGINT, body TEXT, "
RAW_TABLE += "PRIMARY KEY (thread_id, seq))"
RAW_INSERT_PG = "INSERT INTO raw_bench VALUES ($1, $2, $3)"
RAW_INSERT_SQLITE = "INSERT INTO raw_bench VALUES (?, ?, ?)"


async def raw_postgres(url: str, writers: int, n: int) -> Result:
    conns = [await asyncpg.connect(url) for _ in range(writers)]
    await conns[0].execute(RAW_TABLE)

    async def op(w: int, v: int, c: ThreadCommit) -> None:
        async with conns[w].transaction():
            await conns[w].execute(RAW_INSERT_PG, c.thread_id, v + 1, c.encoded)

    try:
        return await measure("postgres", "raw insert", writers, n, op)
    finally:
        for conn in conns:
            await conn.close()


async def _sqlite_conn(path: str) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, timeout=30, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000"):
        await conn.execute(f"PRAGMA {pragma}")
    return conn


async def raw_sqlite(path: str, writers: int, n: int, shared: bool) -> Result:
    conns = [await _sqlite_conn(path) for _ in range(1 if shared else writers)]
    await conns[0].execute(RAW_TABLE)
    turn = asyncio.Lock()

    async def op(w: int, v: int, c: ThreadCommit) -> None:
        conn = conns[0 if shared else w]
        async with turn if shared else _nothing():
            await conn.execute("BEGIN IMMEDIATE")
            await conn.execute(RAW_INSERT_SQLITE, (c.thread_id, v + 1, c.encoded))
            await conn.execute("COMMIT")

    try:
        mode = "raw insert (1 shared conn)" if shared else "raw insert (conn per writer)"
        return await measure("sqlite", mode, writers, n, op)
    finally:
        for conn in conns:
            await conn.close()


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


async def raw_redis(writers: int, n: int) -> Result:
    import redis.asyncio as aioredis

    client = aioredis.from_url(REDIS_URL, max_connections=writers + 2)

    async def op(w: int, v: int, c: ThreadCommit) -> None:
        await client.rpush(f"raw:{c.thread_id}", c.encoded)

    try:
        return await measure("redis", "raw rpush", writers, n, op)
    finally:
        await client.aclose()


# ---- driver ---------------------------------------------------------------------------


async def fresh_pg_database() -> str:
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute("DROP DATABASE IF EXISTS ratchet_bench WITH (FORCE)")
        await admin.execute("CREATE DATABASE ratchet_bench")
    finally:
        await admin.close()
    return PG_ADMIN.rsplit("/", 1)[0] + "/ratchet_bench"


def _redis_available() -> bool:
    try:
        import storage.redis_store  # noqa: F401
    except ImportError:
        return False
    return True


async def main(per_writer_1: int, per_writer_50: int, backends: list[str]) -> list[Result]:
    results: list[Result] = []
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-bench-"))
    for writers, n in ((1, per_writer_1), (50, per_writer_50)):
        if "sqlite" in backends:
            url = f"sqlite:///{tmp}/store-{writers}.db"
            results.append(await bench_store("sqlite", url, writers, n, True))
            results.append(await bench_store("sqlite", url, writers, n, False))
            raw = str(tmp / f"raw-{writers}.db")
            results.append(await raw_sqlite(raw, writers, n, shared=True))
            if writers > 1:
                results.append(await raw_sqlite(raw, writers, n, shared=False))
        if "postgres" in backends:
            url = await fresh_pg_database()
            results.append(await bench_store("postgres", url, writers, n, True))
            results.append(await bench_store("postgres", url, writers, n, False))
            results.append(await raw_postgres(url, writers, n))
        if "redis" in backends and _redis_available():
            results.append(await bench_redis_store(writers, n))
            results.append(await raw_redis(writers, n))
    return results


def medians(trials: list[list[Result]]) -> list[Result]:
    """Per (backend, mode, writers): the median of each figure over the trials."""
    out = []
    for i, first in enumerate(trials[0]):
        runs = [t[i] for t in trials]
        out.append(
            Result(
                first.backend, first.mode, first.writers, first.commits,
                statistics.median(r.seconds for r in runs),
                statistics.median(r.commits_per_s for r in runs),
                statistics.median(r.p50_ms for r in runs),
                statistics.median(r.p99_ms for r in runs),
            )
        )  # fmt: skip
    return out


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """Our append's commits/s over the best raw mode's, per backend and writer count."""
    out = []
    for r in results:
        if r.mode != "append":
            continue
        raw = max(
            (x for x in results
             if x.backend == r.backend and x.writers == r.writers and x.mode.startswith("raw")),
            key=lambda x: x.commits_per_s,
        )  # fmt: skip
        out.append({
            "backend": r.backend, "writers": r.writers, "raw_mode": raw.mode,
            "append_over_raw": round(r.commits_per_s / raw.commits_per_s, 2),
        })  # fmt: skip
    return out


def _table(results: list[Result]) -> str:
    head = f"{'backend':9} {'mode':30} {'writers':>7} {'commits/s':>10} {'p50 ms':>8} {'p99 ms':>8}"
    rows = [
        f"{r.backend:9} {r.mode:30} {r.writers:>7} {r.commits_per_s:>10.0f} "
        f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f}"
        for r in results
    ]
    return "\n".join([head, *rows])


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--commits-1", type=int, default=1200, help="commits for 1 writer")
    parser.add_argument("--commits-50", type=int, default=200, help="commits per writer of 50")
    parser.add_argument("--backends", default="sqlite,postgres,redis")
    parser.add_argument("--trials", type=int, default=3, help="report medians of N trials")
    args = parser.parse_args()
    backends = args.backends.split(",")
    trials = [
        asyncio.run(main(args.commits_1, args.commits_50, backends)) for _ in range(args.trials)
    ]
    results = medians(trials)
    if args.json:
        report = {"results": [asdict(r) for r in results], "ratios": ratios(results)}
        print(json.dumps(report, indent=2))
    else:
        print(_table(results))
        for line in ratios(results):
            print(line)


if __name__ == "__main__":
    cli()
