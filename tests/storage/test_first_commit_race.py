"""Two PostgreSQL stores race the first commit of a new thread: the loser is told it
lost (a typed refusal it can act on), never that the thread is corrupt.

Store B's group goes the read-first way (another of its requests is refused by the
plan) and finds no row for the new thread when it locks; store A's first commit lands
before B inserts the missing row. B's insert then meets A's row, and A's records are
A's, vouched for by its row — not records no frontier vouches for.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import event

from runtime.errors import CorruptRecord, Fenced, StoreUnavailable, VersionConflict
from runtime.ids import ThreadId
from storage.sql import SqlCommitStore
from tests.storage.builders import activation

pytestmark = pytest.mark.postgres


def _append_first(url: str, thread: ThreadId, go: threading.Event, done: threading.Event) -> None:
    """Store A, in a thread and loop of its own: the first commit of ``thread``."""

    async def run() -> None:
        a = await SqlCommitStore.connect(url)
        try:
            await a.append(
                activation(thread, "runA", "from A", epoch=1, claim="A#1"), 0, 0, claim="A#1"
            )
        finally:
            await a.close()

    go.wait(30)
    try:
        asyncio.run(run())
    finally:
        done.set()


async def test_the_loser_of_a_first_commit_race_is_refused_not_told_corrupt(
    pg_conformance_url: str,
) -> None:
    tag = uuid.uuid4().hex[:8]
    new, other = ThreadId(f"new-{tag}"), ThreadId(f"other-{tag}")
    b = await SqlCommitStore.connect(pg_conformance_url)
    try:
        await b.append(activation(other, "runU", epoch=1, claim="B#1"), 0, 0, claim="B#1")
        go, done = threading.Event(), threading.Event()
        armed = [True]

        def after_lock(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            # B has locked the rows there are (none for the new thread): A lands now
            if armed[0] and "FOR UPDATE" in statement and new in str(params):
                armed[0] = False
                go.set()
                done.wait(30)

        event.listen(b.engine.sync_engine, "after_cursor_execute", after_lock)
        racer = threading.Thread(
            target=_append_first, args=(pg_conformance_url, new, go, done), daemon=True
        )
        racer.start()
        stale = activation(other, "runU", "again", epoch=1, claim="B#1")  # refused: read-first
        first = activation(new, "runB", "from B", epoch=1, claim="B#1")
        refused, lost = await asyncio.gather(
            b.append(stale, 0, 0, claim="B#1"),
            b.append(first, 0, 0, claim="B#1"),
            return_exceptions=True,
        )
        racer.join(30)
        assert not armed[0], "the race was not staged: B's group took another path"
        assert isinstance(refused, VersionConflict | Fenced), repr(refused)
        assert not isinstance(lost, CorruptRecord), repr(lost)
        assert isinstance(lost, VersionConflict | Fenced), repr(lost)
        head = await b.load_head(new)
        assert (head.run_id, head.version) == ("runA", 1)  # A's commit, whole and vouched
    finally:
        await b.close()


async def test_a_group_postgresql_rolls_back_to_break_a_deadlock_is_written_again(
    pg_conformance_url: str,
) -> None:
    """Two groups making the same new threads can deadlock (the rows there are are
    locked in id order, the missing ones made after): PostgreSQL rolls one back, which
    heard StoreUnavailable — a fork or an import, which does not retry, failed over it
    — and failed every request queued behind it as if the server were out."""
    import asyncpg

    store = await SqlCommitStore.connect(pg_conformance_url)
    tries = []
    write_planned = store._write_planned

    async def deadlocking_once(plan: Any) -> Any:
        tries.append(plan)
        if len(tries) == 1:
            cause = asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
            raise StoreUnavailable(f"store unavailable: {cause}") from cause
        return await write_planned(plan)

    store._write_planned = deadlocking_once  # type: ignore[method-assign]
    try:
        thread = ThreadId(f"dl-{uuid.uuid4().hex[:8]}")
        receipt = await store.append(
            activation(thread, "r", epoch=1, claim="A#1"), 0, 0, claim="A#1"
        )
        assert receipt.seq == 1 and len(tries) == 2
    finally:
        await store.close()
