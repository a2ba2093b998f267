"""Incremental history on every store: each message kept once, an append writes only
what it adds, and a load still gives the whole history, verified (issue 20, item 1).

Sizes are measured as each backend stores them: the thread row's (or meta's) frontier
text, the log's bodies and a pruned thread's pruned history.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import delete, select, text, update

from runtime.commit import Frontier, frontier_text
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import audit_thread, frontier_checksum
from storage.schema import commits, pruned_messages, schema_version, threads
from tests.storage.builders import activation, step
from tests.storage.test_prune import three_runs

T = ThreadId("t-history")
KIB_TEXT = "x" * 1024


class Stored:
    """What one thread takes in its backend, read behind the store's back."""

    def __init__(self, store: Any, backend: str) -> None:
        self.store, self.backend = store, backend

    async def frontier(self, thread: str = T) -> str:
        if self.backend == "memory":
            return frontier_text(self.store._threads[thread].frontier)
        if self.backend == "redis":
            return str(await self.store.client.hget(f"ratchet:thread:{thread}:meta", "frontier"))
        async with self.store.engine.connect() as conn:
            query = select(threads.c.frontier).where(threads.c.thread_id == thread)
            return str((await conn.execute(query)).scalar_one())

    async def bodies(self, thread: str = T) -> list[str]:
        if self.backend == "memory":
            return [r.body for r in self.store._threads[thread].log]
        if self.backend == "redis":
            return list(await self.store.client.lrange(f"ratchet:thread:{thread}:log", 0, -1))
        async with self.store.engine.connect() as conn:
            query = select(commits.c.body).where(commits.c.thread_id == thread)
            return list((await conn.execute(query.order_by(commits.c.seq))).scalars())

    async def history(self, thread: str = T) -> list[str]:
        if self.backend == "memory":
            return list(self.store._threads[thread].history)
        if self.backend == "redis":
            key = f"ratchet:thread:{thread}:history"
            return list(await self.store.client.lrange(key, 0, -1))
        async with self.store.engine.connect() as conn:
            query = select(pruned_messages.c.body).where(pruned_messages.c.thread_id == thread)
            return list((await conn.execute(query.order_by(pruned_messages.c.idx))).scalars())

    async def everything(self, thread: str = T) -> str:
        parts = [await self.frontier(thread), *await self.bodies(thread)]
        return "".join([*parts, *await self.history(thread)])

    async def edit_history(self, index: int, new: str, thread: str = T) -> None:
        if self.backend == "memory":
            self.store.corrupt_history(thread, index, new)
        elif self.backend == "redis":
            await self.store.client.lset(f"ratchet:thread:{thread}:history", index, new)
        else:
            async with self.store.engine.begin() as conn:
                await conn.execute(
                    update(pruned_messages)
                    .where(pruned_messages.c.thread_id == thread, pruned_messages.c.idx == index)
                    .values(body=new)
                )


async def _grow(store: Any, thread: str, steps: int, text_: str = KIB_TEXT) -> None:
    """``steps`` more inferences of the thread's one Run (started if need be)."""
    head = await store.load_head(ThreadId(thread))
    if head.version == 0:
        epoch = (await store.claim(ThreadId(thread), "owner-1", 0)).epoch
        await store.append(activation(thread, "run-1", epoch=epoch), 0, epoch)
        head = await store.load_head(ThreadId(thread))
    for _ in range(steps):
        commit = step(thread, "run-1", head.next_ordinal, text_, prev=head.head, epoch=head.epoch)
        await store.append(commit, head.version, head.epoch)
        head = await store.load_head(ThreadId(thread))


async def test_an_append_writes_what_it_adds_whatever_the_history(store: Any, backend: str) -> None:
    """The frontier text and the newest record are as large on a thread of 300 KiB of
    messages as on one of 10 KiB: what an append writes does not grow with the history."""
    stored = Stored(store, backend)
    short, long_ = "t-short", "t-long"
    await _grow(store, short, 10)
    await _grow(store, long_, 300)
    sizes = {}
    for thread in (short, long_):
        before = await stored.frontier(thread)
        await _grow(store, thread, 1, "the newest step")
        sizes[thread] = (
            len(before),
            len(await stored.frontier(thread)),
            (await stored.bodies(thread))[-1],
        )
    (s_before, s_after, s_body), (l_before, l_after, l_body) = sizes[short], sizes[long_]
    assert abs(l_after - s_after) < 16 and abs(l_before - s_before) < 16  # count digits
    assert s_after < 1024  # the head alone: no message's text
    assert len(l_body) == len(s_body) and l_body.count("the newest step") == 1
    whole = await store.load(ThreadId(long_))
    assert len(whole.messages) == whole.message_count == 302


async def test_each_message_is_stored_once(store: Any, backend: str) -> None:
    """Not in the frontier, not repeated in the facts: one copy, in its record."""
    stored = Stored(store, backend)
    await _grow(store, T, 3, "a unique answer")
    assert (await stored.everything()).count("a unique answer") == 3
    facts = [f.type for r in await store.read(T) for f in r.commit.facts]
    assert facts.count("assistant_message") == 3  # derived by the reader
    head = await store.load_head(T)
    assert (head.messages, head.message_count) == ((), 4)
    assert len((await store.load(T)).messages) == 4


async def test_a_message_edited_in_its_record_fails_closed(
    store: Any, backend: str, corrupt: Any
) -> None:
    await _grow(store, T, 3, "what was said")
    body = (await Stored(store, backend).bodies())[2]
    await corrupt(T, 3, body.replace("what was said", "what was NOT said"))
    with pytest.raises(CorruptRecord) as info:
        await store.read(T)
    assert info.value.seq == 3
    with pytest.raises(CorruptRecord):
        await store.load(T)


async def test_a_pruned_thread_keeps_every_message_once(store: Any, backend: str) -> None:
    stored = Stored(store, backend)
    ends = await three_runs(store, T)
    before = await store.load(T)
    assert await store.prune(T, ends[0]) == ends[0]
    assert await store.prune(T, ends[1]) == ends[1] - ends[0]  # the history grows by a prune
    after = await store.load(T)
    assert after.messages == before.messages and after.message_count == before.message_count
    everything = await stored.everything()
    assert everything.count('"text":"s1"') == 1  # r2's second step: now in the pruned history
    history = await stored.history()
    assert len(history) == len(before.messages) - sum(
        len(r.commit.messages) for r in await store.read(T)
    )
    assert await audit_thread(store, T) == ([], ends[1])
    await stored.edit_history(1, history[1].replace("s0", "s9"))
    with pytest.raises(CorruptRecord, match="pruned history"):
        await store.load(T)
    assert next(r.seq for r in await store.read(T)) == ends[1] + 1  # the log is unharmed


async def test_an_old_pruned_thread_is_upgraded_with_its_history(
    store: Any, backend: str, backend_url: str
) -> None:
    """A thread pruned before incremental history (SQL schema 5, Redis layout 3): its
    frontier held the messages of the records removed, and nothing else did. The upgrade
    gives it its pruned history; it loads whole, verifies, and goes on."""
    if backend == "memory":
        pytest.skip("nothing is stored to upgrade")
    ends = await three_runs(store, T)
    await store.prune(T, ends[1])
    whole = await store.load(T)
    old = whole.model_copy(update={"schema_version": 2}).model_dump_json(exclude={"message_count"})
    await store.close()
    if backend == "redis":
        from storage.redis_store import RedisCommitStore

        store = await RedisCommitStore.connect(backend_url)
        meta = f"ratchet:thread:{T}:meta"
        await store.client.hset(meta, mapping={"frontier": old, "checksum": frontier_checksum(old)})
        await store.client.hdel(meta, "pruned_digest")
        await store.client.delete(f"ratchet:thread:{T}:history")
        await store.client.set("ratchet:schema", "3")
        await store.close()
        store = await RedisCommitStore.connect(backend_url)
        assert await store.client.get("ratchet:schema") == "4"
    else:
        from storage.sql import SqlCommitStore

        store = await SqlCommitStore.connect(backend_url)
        async with store.engine.begin() as conn:
            await conn.execute(delete(schema_version).where(schema_version.c.version >= 6))
            await conn.execute(
                update(threads)
                .where(threads.c.thread_id == T)
                .values(frontier=old, checksum=frontier_checksum(old))
            )
            await conn.execute(text("ALTER TABLE ratchet_threads DROP COLUMN pruned_digest"))
            await conn.execute(text("DROP TABLE ratchet_pruned_messages"))
        await store.close()
        store = await SqlCommitStore.connect(backend_url)
    try:
        assert json.loads(await Stored(store, backend).frontier())["schema_version"] == 2
        assert (await store.load(T)).messages == whole.messages
        assert await audit_thread(store, T) == ([], ends[1])
        await _grow(store, T, 0)
        head = await store.load_head(T)
        from tests.storage.test_prune import run_on

        await run_on(store, T, "r4", steps=0)
        assert json.loads(await Stored(store, backend).frontier())["schema_version"] == 3
        now = await store.load(T)
        assert now.messages[: len(whole.messages)] == whole.messages
        assert now.message_count == head.message_count + 2
        assert await audit_thread(store, T) == ([], ends[1])
    finally:
        await store.close()


async def test_a_frontier_stored_with_its_messages_reads_and_appends(
    store: Any, backend: str
) -> None:
    """A schema 2 frontier (the history inside) of an unpruned thread: it loads whole from
    its log, and the next append writes it as a head."""
    if backend == "memory":
        pytest.skip("the memory store keeps its frontier as an object")
    await _grow(store, T, 2, "before")
    whole = await store.load(T)
    old = whole.model_copy(update={"schema_version": 2}).model_dump_json(exclude={"message_count"})
    if backend == "redis":
        meta = f"ratchet:thread:{T}:meta"
        await store.client.hset(meta, mapping={"frontier": old, "checksum": frontier_checksum(old)})
    else:
        async with store.engine.begin() as conn:
            await conn.execute(
                update(threads)
                .where(threads.c.thread_id == T)
                .values(frontier=old, checksum=frontier_checksum(old))
            )
    assert (await store.load(T)).messages == whole.messages
    await _grow(store, T, 1, "after")
    stored = await Stored(store, backend).frontier()
    assert "before" not in stored and json.loads(stored)["message_count"] == 4
    assert [m.text for m in (await store.load(T)).messages][-1] == "after"
    assert await audit_thread(store, T) == ([], 0)


def test_a_frontier_text_names_no_message() -> None:
    frontier = Frontier.model_validate(
        {"thread_id": "t", "messages": [{"kind": "user", "id": "m", "text": "secret"}]}
    )
    assert "secret" not in frontier_text(frontier)
    assert json.loads(frontier_text(frontier))["message_count"] == 1
