"""A shared index key of the wrong type (``SET P:runs:STATE x``, ``SET P:owner:HOST x``,
edited by hand) is no thread's fault: appends and claims go on without it, the
thread's own log, meta and head stay the truth, and ``ratchet verify`` names the key.

It failed every append and claim that touched it with CorruptRecord, blaming whichever
thread was committing: one bad key stalled every Run of the system.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import pytest

from runtime.errors import CorruptRecord
from runtime.ids import RunId, ThreadId
from runtime.integrity import audit
from runtime.lifecycle import Cancelled, EndedState
from storage.redis_store import RedisCommitStore
from tests.storage.builders import activation, head, step
from tests.storage.test_redis_store import TEST_DB, db_url, one_shot


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisCommitStore]:
    prefix = f"index-test-{uuid.uuid4().hex[:8]}"
    s = await RedisCommitStore.connect(db_url(redis_url, TEST_DB), prefix=prefix)
    yield s
    keys = [k async for k in s.client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await s.client.delete(*keys)
    await s.close()


async def _break(store: RedisCommitStore, key: str) -> None:
    await store.client.delete(key)
    await store.client.set(key, "edited by hand")


async def _running(store: RedisCommitStore, thread: ThreadId, owner: str) -> int:
    epoch = (await store.claim(thread, owner, 0)).epoch
    await store.append(activation(thread, "r", epoch=epoch), 0, epoch)
    return epoch


async def test_an_append_goes_on_past_a_run_index_of_the_wrong_type(
    store: RedisCommitStore, caplog: pytest.LogCaptureFixture
) -> None:
    done, live = ThreadId("ends"), ThreadId("runs")
    ended = store._index("ended")
    await _break(store, ended)
    epoch = (await store.claim(done, "host-0#1", 0)).epoch
    with caplog.at_level(logging.ERROR, logger="ratchet.storage.redis"):
        receipt = await store.append(one_shot(done, "r", epoch=epoch), 0, epoch)
    assert receipt.seq == 1 and ended in caplog.text
    frontier = await store.load(done)  # the thread's own keys are the truth
    assert (frontier.version, frontier.ended) == (1, True)
    assert [r.seq for r in await store.read(done)] == [1]
    epoch = await _running(store, live, "host-0#1")  # a Run the broken key is not of
    await store.append(step(live, "r", 1, prev=await head(store, live), epoch=epoch), 1, epoch)
    assert [s.thread_id for s in await store.list_runs("running", host="host-0")] == [live]
    for thread in (done, live):  # verify names the key, on every thread it may hide
        (problem,) = await audit(store, thread)
        assert ended in problem.detail, problem
    await store.client.delete(ended)  # repaired: the entry the append could not write
    (problem,) = await audit(store, done)
    assert "hidden" in problem.detail
    assert await audit(store, live) == []


async def test_a_claim_goes_on_past_owner_and_run_indexes_of_the_wrong_type(
    store: RedisCommitStore,
) -> None:
    thread, other = ThreadId("moves"), ThreadId("held")
    await _running(store, thread, "host-0#1")
    await _running(store, other, "host-0#1")
    old, new = store._owners("host-0#1"), store._owners("host-1#1")
    for key in (old, new, store._index("awaiting")):
        await _break(store, key)
    claimed = await store.claim(thread, "host-1#1", 1)
    assert (claimed.epoch, claimed.owner, claimed.version) == (2, "host-1#1", 1)
    [summary] = await store.list_runs("running", host="host-1")  # the running index
    assert (summary.thread_id, summary.owner) == (thread, "host-1#1")
    prev = await head(store, thread)
    await store.append(step(thread, "r", 1, prev=prev, epoch=2), 1, 2)
    assert (await store.load_head(thread)).version == 2
    (problem,) = await audit(store, thread)
    assert new in problem.detail, problem
    # a Run whose entry a broken key held is claimed too (its next append writes one)
    await _break(store, store._index("running"))
    assert (await store.claim(other, "host-1#1", 1)).epoch == 2
    prev = await head(store, other)
    await store.append(step(other, "r", 1, prev=prev, epoch=2), 1, 2)
    await store.client.delete(store._index("running"), store._index("awaiting"), old, new)
    assert await audit(store, thread) != [] and await audit(store, other) != []
    await store.append(step(thread, "r", 2, prev=await head(store, thread), epoch=2), 2, 2)
    assert await audit(store, thread) == []  # its next append wrote its entries again


async def test_a_claim_answers_the_appends_that_moved_the_thread_past_a_broken_index(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("raced")
    epoch = await _running(store, thread, "host-0#1")
    loaded = await store.load_head(thread)
    await store.append(step(thread, "r", 1, prev=loaded.head, epoch=epoch), 1, epoch)
    await _break(store, store._index("ended"))
    claimed = await store._claim(loaded, "host-1#1")  # as if loaded before that append
    assert (claimed.version, claimed.epoch, claimed.owner) == (2, 2, "host-1#1")


async def test_a_threads_own_key_of_the_wrong_type_still_fails_closed_before_any_write(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("own-key")
    epoch = (await store.claim(thread, "me", 0)).epoch
    ops = store._key(thread, "ops")
    await store.client.set(ops, "not a hash")
    with pytest.raises(CorruptRecord, match=ops):
        await store.append(one_shot(thread, "run-w"), 0, epoch)
    assert await store.read(thread) == [] and (await store.load(thread)).version == 0
    assert await store.client.hlen(store._index("ended")) == 0


async def test_a_run_comes_to_rest_with_every_run_index_of_the_wrong_type(
    store: RedisCommitStore,
) -> None:
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel

    for state in ("running", "awaiting", "ended"):
        await _break(store, store._index(state))
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    thread = ThreadId("whole-run")
    await InProcessRunner(agent, store).start("go", thread_id=thread, run_id="r1")
    frontier = await store.load(thread)
    assert frontier.ended and frontier.run_id == RunId("r1")
    assert isinstance(frontier.run_state, EndedState)
    assert not isinstance(frontier.run_state.cause, Cancelled)
    (problem,) = await audit(store, thread)
    assert store._index("running") in problem.detail


async def test_a_claim_past_a_broken_run_index_takes_the_run_off_the_old_hosts_owner_index(
    store: RedisCommitStore,
) -> None:
    """The claim patches the owner into the entry it reads: with none to read (the run
    index that held it is of another type), the old host's owner index kept the Run."""
    thread = ThreadId("left-behind")
    await _running(store, thread, "host-0#1")
    await _break(store, store._index("running"))
    await store.claim(thread, "host-1#1", 1)
    assert not await store.client.hexists(store._owners("host-0#1"), thread)
    await _running(store, ThreadId("same-host"), "host-0#1")  # one host: kept
    await store.claim(ThreadId("same-host"), "host-0#2", 1)
    assert await store.client.hexists(store._owners("host-0#2"), ThreadId("same-host"))
