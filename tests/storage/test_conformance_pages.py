"""The conformance suite's bounded reads, on every backend (see conftest.py).

``read(thread, after_seq, limit)`` answers a page: at most ``limit`` records, read and
verified without reading the rest of the log (a record corrupted past the page does not
fail it), the first one linked to the record before it, a pruned thread's to its
anchor. Walking the pages gives the whole read.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from storage.memory import MemoryCommitStore
from tests.storage.conftest import Corruptor
from tests.storage.test_conformance import _next, _started
from tests.storage.test_prune import three_runs

T = ThreadId("thread-a")


async def _log_of(store: Any, n: int) -> None:
    await _started(store)
    for i in range(n - 1):
        await _next(store, T, "run-1", f"step {i}")


async def _walk(store: Any, thread: ThreadId, limit: int) -> list[int]:
    seqs: list[int] = []
    after = 0
    while page := await store.read(thread, after, limit):
        assert len(page) <= limit
        seqs += [r.seq for r in page]
        after = page[-1].seq
    return seqs


async def test_pages_walk_the_whole_log(store: Any) -> None:
    await _log_of(store, 6)
    whole = await store.read(T)
    assert [r.seq for r in whole] == [1, 2, 3, 4, 5, 6]
    for limit in (1, 2, 4, 6, 7):
        assert await _walk(store, T, limit) == [1, 2, 3, 4, 5, 6]
    page = await store.read(T, 2, 3)
    assert [r.seq for r in page] == [3, 4, 5] and page == whole[2:5]
    assert [r.seq for r in await store.read(T, 4, 100)] == [5, 6]
    assert await store.read(T, 6, 1) == [] and await store.read(T, 60, 1) == []
    assert await store.read(T, 2**63 - 1, 500) == []  # a store's largest seq: no overflow
    assert await store.read(ThreadId("nobody"), 0, 1) == []


async def test_a_page_reads_no_further_than_itself(store: Any, corrupt: Corruptor) -> None:
    await _log_of(store, 5)
    await corrupt(T, 4, '{"schema_version": 1, "thread_id": "thread-a"}')
    assert [r.seq for r in await store.read(T, 0, 3)] == [1, 2, 3]  # 4 is not read
    with pytest.raises(CorruptRecord) as info:  # a page holding it fails closed
        await store.read(T, 2, 2)
    assert info.value.seq == 4
    with pytest.raises(CorruptRecord):  # as does the page after it: it links to it
        await store.read(T, 4, 1)
    with pytest.raises(CorruptRecord):
        await store.read(T)


async def test_a_pruned_threads_pages_begin_at_its_anchor(store: Any) -> None:
    ends = await three_runs(store, T)
    assert await store.prune(T, ends[0]) == ends[0]
    whole = await store.read(T)
    assert whole[0].seq == ends[0] + 1
    first = await store.read(T, 0, 2)  # a cursor before the anchor: from the anchor on
    assert first == whole[:2] == await store.read(T, ends[0] - 1, 2)
    assert await _walk(store, T, 2) == [r.seq for r in whole]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2"])
async def test_a_limit_that_is_no_count_is_refused(store: Any, limit: Any) -> None:
    await _log_of(store, 2)
    with pytest.raises(ValueError, match="limit"):
        await store.read(T, 0, limit)


async def test_a_page_short_of_a_gap_at_its_end_fails_closed() -> None:
    store = MemoryCommitStore()
    await _log_of(store, 4)
    store.delete(T, 3)
    with pytest.raises(CorruptRecord) as info:
        await store.read(T, 0, 3)
    assert info.value.seq == 3
    assert [r.seq for r in await store.read(T, 0, 2)] == [1, 2]
