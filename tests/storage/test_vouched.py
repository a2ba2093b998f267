"""A log is served only as far as a frontier vouches for it, on every backend.

A thread's frontier names its version and head beside the log. A log that no frontier
vouches for (the thread row deleted by hand, Redis's meta hash, the memory store's
frontier; or the row put back at version 0 with a checksum that holds) must fail
closed with CorruptRecord at seq 1: never pass for a new thread that a Run may start
on, nor serve records that no head vouches for. SQL reads the head first and the
records after it (two statements): records past that head may be an append landing
in between, and are not served.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import delete, insert, select, update

from runtime.commit import Frontier
from runtime.errors import CorruptRecord
from runtime.integrity import audit
from storage.schema import commits, threads
from tests.storage.test_integrity import SqlTamper, T, make_victim, sha, tamper_for

REDIS_DB = 10
"""This file's own Redis database (the shared fixture's db 9 is flushed by other suites)."""


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


@pytest.mark.parametrize("edit", ["drop_thread", "reset_frontier", "reset_unowned"])
async def test_a_log_no_frontier_vouches_for_fails_closed(
    store: Any, backend: str, edit: str
) -> None:
    """``reset_unowned`` puts the row back at epoch 0 with no owner, so that a start
    that takes the thread for new (``new_thread``) gets past the compare-and-set on
    version and epoch: the store itself must refuse to append onto a log it does not
    vouch for."""
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)
    if edit == "drop_thread":
        await tamper.drop_thread()
    elif edit == "reset_frontier":
        owned = {"epoch": victim.frontier.epoch, "owner": victim.frontier.owner}
        await tamper.reset_frontier(Frontier(thread_id=T, **owned))
    else:
        await tamper.reset_frontier(Frontier(thread_id=T))
    for op, args in (("load", ()), ("read", ()), ("read", (2,))):
        with pytest.raises(CorruptRecord) as info:
            await getattr(store, op)(T, *args)
        assert (info.value.thread, info.value.seq) == (T, 1), (op, args, str(info.value))
    assert [p.thread for p in await audit(store, T)] == [T]
    before = await tamper.snapshot()
    with pytest.raises(CorruptRecord):
        await victim.runner(store).resume(victim.approval())
    for new_thread in (False, True):  # not a new thread either, whatever its caller thinks
        with pytest.raises(CorruptRecord):
            await victim.runner(store).start("again", thread_id=T, new_thread=new_thread)
    assert victim.ran == [] and await tamper.snapshot() == before


async def test_sql_refuses_a_log_past_the_head_it_read(sql_store: Any) -> None:
    """The thread row is read with its last record's seq in one statement (one snapshot,
    in which an append moved both or neither): a record past the row is one no frontier
    vouches for, whatever a concurrent append does between that statement and the
    records' read (those past the head read are not read). A head of NULL vouches for
    nothing. (The other stores read in one snapshot: test_integrity covers them.)"""
    store = sql_store
    victim = await make_victim(store)
    tamper = SqlTamper(store, T)
    assert [r.commit.encoded for r in await store.read(T)] == victim.bodies
    beyond = {"thread_id": T, "seq": 6, "operation_id": "later", "label": "inference"}
    await tamper._run(insert(commits).values(beyond | {"body": "?", "payload_hash": sha("x")}))
    for read in (store.read(T), store.read(T, after_seq=5), store.load(T), store.load_head(T)):
        with pytest.raises(CorruptRecord, match="past the frontier's head") as info:
            await read
        assert (info.value.thread, info.value.seq) == (T, 6)
    await tamper._run(delete(commits).where((commits.c.thread_id == T) & (commits.c.seq == 6)))
    await tamper.set_meta(head=None)
    for after in (0, 3):
        with pytest.raises(CorruptRecord) as info:
            await store.read(T, after)
        assert (info.value.thread, info.value.seq) == (T, 5)


async def test_sql_refuses_a_thread_row_put_back_by_hand(sql_store: Any) -> None:
    """A genuine thread row from before the last commits, written back by hand: its own
    checksum and hash still match, but the log runs past it, and the Run could append
    no more (every append would meet a record there). It fails closed, for an audit."""
    store = sql_store
    victim = await make_victim(store)
    tamper = SqlTamper(store, T)
    (old,) = await tamper._run(select(threads).where(threads.c.thread_id == T))
    await victim.runner(store).resume(victim.approval())
    assert (await store.load(T)).version > old.version
    await tamper._run(update(threads).where(threads.c.thread_id == T).values(**old._mapping))
    for read in (store.load(T), store.load_head(T), store.read(T)):
        with pytest.raises(CorruptRecord, match="past the frontier's head"):
            await read
    assert [p.thread for p in await audit(store, T)] == [T]
