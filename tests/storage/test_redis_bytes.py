"""Bytes that are not UTF-8, written into Redis by hand: each read that meets them is
that thread's CorruptRecord (or leaves it out of a listing), never a UnicodeDecodeError
out of the read, never another thread's failure."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import audit_thread

from .test_integrity import make_victim

pytestmark = pytest.mark.parametrize("backend", ["redis"], indirect=True)
BAD, GOOD = ThreadId("bytes-bad"), ThreadId("bytes-good")


async def _raw(store: Any, backend_url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(backend_url, decode_responses=False)


@pytest.mark.parametrize("part", ["frontier", "owner", "version", "head"])
async def test_invalid_utf8_in_a_meta_field_is_that_threads_corrupt_record(
    store: Any, backend_url: str, part: str
) -> None:
    await make_victim(store, BAD)
    await make_victim(store, GOOD)
    raw = await _raw(store, backend_url)
    try:
        await raw.hset(f"{store.prefix}:thread:{BAD}:meta", part, b"\xff\xfe")
    finally:
        await raw.aclose()
    with pytest.raises(CorruptRecord):
        await store.load(BAD)
    assert [s.thread_id for s in await store.list_runs()] == [GOOD]
    assert (await store.load(GOOD)).version == 5
    assert (await audit_thread(store, BAD)).problems  # named, not raised
    assert not (await audit_thread(store, GOOD)).problems


async def test_invalid_utf8_in_a_run_index_entry_leaves_only_it_out(
    store: Any, backend_url: str
) -> None:
    await make_victim(store, BAD)
    await make_victim(store, GOOD)
    raw = await _raw(store, backend_url)
    try:
        await raw.hset(f"{store.prefix}:runs:awaiting", str(BAD), b'{"thread_id": "\xff"}')
    finally:
        await raw.aclose()
    assert [s.thread_id for s in await store.list_runs("awaiting")] == [GOOD]


async def test_a_key_of_the_wrong_type_leaves_only_its_thread_out_of_a_listing(
    store: Any, backend_url: str
) -> None:
    """A thread's meta hash replaced by a string (WRONGTYPE for every read of it): the
    listing reads every listed thread's meta in one transaction, and went down whole."""
    await make_victim(store, BAD)
    await make_victim(store, GOOD)
    raw = await _raw(store, backend_url)
    try:
        meta = f"{store.prefix}:thread:{BAD}:meta"
        await raw.delete(meta)
        await raw.set(meta, b"not a hash")
    finally:
        await raw.aclose()
    assert [s.thread_id for s in await store.list_runs()] == [GOOD]
    assert [s.thread_id for s in await store.list_runs("awaiting")] == [GOOD]
    # and every read of that thread names it (a Supervisor quarantines it, rather than
    # retry a StoreError at every sweep)
    for read in (store.load(BAD), store.load_head(BAD), store.read(BAD)):
        with pytest.raises(CorruptRecord, match="wrong type"):
            await read
    assert (await audit_thread(store, BAD)).problems
    assert (await store.load(GOOD)).version == 5


async def test_invalid_utf8_in_a_pruned_history_is_that_threads_corrupt_record(
    store: Any, backend_url: str
) -> None:
    """SQLite's equivalent, a BLOB there, was an AttributeError out of the digest; Redis
    reads the entry as text (its bytes escaped), which then fails the digest."""
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel

    for said in ("one", "two"):  # a prune keeps at least the last Run
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text=said)]))
        await InProcessRunner(agent, store).start(said, thread_id=BAD)
    assert await store.prune(BAD, 2)
    raw = await _raw(store, backend_url)
    try:
        await raw.lset(f"{store.prefix}:thread:{BAD}:history", 0, b"\xff\xfe")
    finally:
        await raw.aclose()
    with pytest.raises(CorruptRecord, match="pruned"):
        await store.load(BAD)
    assert (await audit_thread(store, BAD)).problems
