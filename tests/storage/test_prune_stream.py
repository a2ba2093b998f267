"""Retention beside a stream: a follower whose cursor a prune passed is told so.

A ``pruned`` frame names the seq the facts it missed went up to, where they would have
come (a reconnect from the cursor, or a prune while it follows), before the facts kept:
it never gets a later Run's facts as if they came next.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from runtime.ids import ThreadId
from runtime.stream import follow
from tests.storage.test_prune import DAY_US, JAN_1, T, asyncio_timeout, run_on, three_runs
from tests.support.waiting import until


async def test_a_stream_from_a_cursor_a_prune_passed_says_what_it_missed(store: Any) -> None:
    """A client that saw r1's first fact reconnects after r1 and r2 were pruned: it is
    told the facts through r2's end are gone (a ``pruned`` frame), then gets r3's. It
    got r3's facts as if they came next, with no word of the gap, reconnecting or
    reading from the beginning alike."""
    ends = await three_runs(store, last_ends=False)
    assert await store.prune(T, ends[1]) == ends[1]
    for cursor in (None, "1:0", f"{ends[0]}:0"):
        frames = follow(store, T, cursor, poll_s=0.01, until_rest=False)
        fs: list[Any] = []
        async for frame in asyncio_timeout(frames):
            fs.append(frame)
            if frame.offset is not None:
                break  # the first fact kept
        await frames.aclose()
        assert [(f.type, f.pruned_through) for f in fs[:2]] == [
            ("thread_status", None),
            ("pruned", ends[1]),
        ], cursor
        assert fs[2].event.seq == ends[1] + 1
    fs = []  # a cursor at the anchor saw everything pruned
    async for frame in asyncio_timeout(follow(store, T, f"{ends[1]}:0", until_rest=False)):
        fs.append(frame)
        if frame.offset is not None:
            break
    assert [f.type for f in fs] == ["thread_status", "fact"]


async def test_a_follower_a_prune_passes_while_it_waits_is_told(store: Any) -> None:
    """A follower (of every later Run too) saw r1's end and polls; r2 runs, ends and is
    pruned before it reads r2, and r3 starts: it is told r2 was pruned before r3's
    facts, which it got as if they came next."""
    ends = [await run_on(store, T, "r1", JAN_1)]
    reads = _CountedReads(store)
    frames = follow(reads, T, f"{ends[0]}:0", poll_s=0.01, until_rest=False)
    seen: list[Any] = []

    async def follower() -> None:
        async for frame in frames:
            seen.append(frame)

    task = asyncio.ensure_future(follower())
    try:
        await until(lambda: reads.count >= 3)  # following: past its first read
        reads.open.clear()
        await until(lambda: reads.waiting)  # its reads before are done: r2 is never read
        ends.append(await run_on(store, T, "r2", JAN_1 + DAY_US))
        assert await store.prune(T, ends[1]) == ends[1]
        await run_on(store, T, "r3", None)
        reads.open.set()
        await until(lambda: any(f.event is not None and f.event.seq > ends[0] for f in seen))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    later = [f for f in seen if f.event is None or f.event.seq > ends[0]][1:]  # no snapshot
    assert (later[0].type, later[0].pruned_through) == ("pruned", ends[1])
    assert later[1].event.seq == ends[1] + 1


class _CountedReads:
    """The store, counting the reads of its log, which wait while ``open`` is clear."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count, self.waiting = inner, 0, 0
        self.open = asyncio.Event()
        self.open.set()

    async def read(self, thread: ThreadId, after_seq: int = 0) -> Any:
        self.waiting += 1
        await self.open.wait()
        self.waiting -= 1
        self.count += 1
        return await self.inner.read(thread, after_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
