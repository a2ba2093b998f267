"""History cost per commit: what one append writes, and how long it takes, against the
length of the thread it extends (issue 20).

For each thread length L it builds a thread of L messages on a fresh store (in commits
of up to 100 messages each, so the build stays quick whatever the store writes per
commit), then appends ``--appends`` commits of one ~200-byte assistant message each and
reports, per commit, the median latency of ``store.append`` and the bytes it wrote as
the backend holds them: the thread row's (or meta's) frontier text and the new record's
body (SQL: ``length()`` of the two columns; Redis: the two values). Indexes, receipts
and the run index come on top, and do not grow with the thread.

    python -m benchmarks.history_bench [--store sqlite|postgres|redis] [--lengths 10,100,...]
        [--appends N] [--json]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from benchmarks.stores import prepare_store
from runtime.commit import ThreadCommit
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import RunningState
from runtime.messages import AssistantMessage, Message, UserMessage
from storage.url import open_store

TEXT = "The quick brown fox jumps over the lazy dog. " * 4 + "Done."
"""About 200 bytes: a short answer."""
PER_BUILD_COMMIT = 100
RUN = RunId("run-history-bench")


def _commit(thread: str, ordinal: int, messages: tuple[Message, ...], f: Any) -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RUN,
        ordinal=ordinal,
        label="activation" if ordinal == 0 else "inference",
        disposition=RunningState(run_id=RUN),
        messages=messages,
        prev=f.head,
        epoch=f.epoch,
    )


class Thread:
    """One thread the benchmark appends to, tracking its version, head and epoch."""

    def __init__(self, store: Any, thread: str) -> None:
        self.store, self.thread = store, thread
        self.version, self.head, self.epoch, self.ordinal = 0, "", 0, 0

    async def start(self) -> None:
        self.epoch = (await self.store.claim(ThreadId(self.thread), "bench", 0)).epoch

    async def append(self, messages: tuple[Message, ...]) -> float:
        commit = _commit(self.thread, self.ordinal, messages, self)
        began = time.perf_counter()
        receipt = await self.store.append(commit, self.version, self.epoch)
        took = time.perf_counter() - began
        self.version, self.head, self.ordinal = receipt.seq, receipt.payload_hash, self.ordinal + 1
        return took


async def _written(store: Any, kind: str, thread: str, seq: int) -> int:
    """Bytes of the frontier text and of record ``seq``'s body, as stored."""
    if kind == "redis":
        meta, log = f"ratchet:thread:{thread}:meta", f"ratchet:thread:{thread}:log"
        frontier = await store.client.hstrlen(meta, "frontier")
        body = await store.client.lindex(log, -1)
        return int(frontier) + len(body.encode())
    from sqlalchemy import text

    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT (SELECT length(frontier) FROM ratchet_threads WHERE thread_id = :t)"
                    " + (SELECT length(body) FROM ratchet_commits"
                    " WHERE thread_id = :t AND seq = :s)"
                ),
                {"t": thread, "s": seq},
            )
        ).scalar_one()
    return int(row)


async def measure(url: str, kind: str, length: int, appends: int) -> dict[str, Any]:
    store = await open_store(url)
    thread = f"hb-{length}-{time.time_ns():x}"
    try:
        t = Thread(store, thread)
        await t.start()
        await t.append((UserMessage(id="input", text=TEXT),))
        built = 1
        while built < length:
            n = min(PER_BUILD_COMMIT, length - built)
            await t.append(tuple(AssistantMessage(text=TEXT) for _ in range(n)))
            built += n
        latencies, written = [], []
        for _ in range(appends):
            latencies.append(await t.append((AssistantMessage(text=TEXT),)))
            written.append(await _written(store, kind, thread, t.version))
    finally:
        await store.close()
    return {
        "messages": length,
        "bytes_per_commit": int(statistics.median(written)),
        "latency_ms": round(1000 * statistics.median(latencies), 3),
    }


async def run(store: str, lengths: list[int], appends: int) -> list[dict[str, Any]]:
    results = []
    for length in lengths:
        prepared = await prepare_store(store, Path(tempfile.mkdtemp(prefix="ratchet-hb-")))
        try:
            results.append(await measure(prepared.url, prepared.kind, length, appends))
        finally:
            await prepared.cleanup()
    return results


def main(
    store: str = typer.Option("sqlite", help="sqlite (a fresh file), postgres or redis"),
    lengths: str = typer.Option("10,100,1000,10000", help="thread lengths, in messages"),
    appends: int = typer.Option(20, min=1, help="appends measured per length"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    rows = asyncio.run(run(store, [int(x) for x in lengths.split(",")], appends))
    if as_json:
        print(json.dumps({"store": store, "results": rows}))
        return
    print(f"store {store}: one ~200-byte message per commit, median of {appends} appends")
    print(f"{'messages':>9} {'bytes/commit':>13} {'latency ms':>11}")
    for r in rows:
        print(f"{r['messages']:>9,} {r['bytes_per_commit']:>13,} {r['latency_ms']:>11.3f}")


if __name__ == "__main__":
    typer.run(main)
