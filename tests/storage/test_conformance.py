"""One CommitStore conformance suite, run against every backend (see conftest.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.commit import Frontier, replay
from runtime.errors import (
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    PayloadTooLarge,
    RunEnded,
    StateConflict,
    VersionConflict,
)
from runtime.ids import RunId, ThreadId
from runtime.state import Command
from tests.storage.builders import activation, ended, step
from tests.storage.conftest import Corruptor

T = ThreadId("thread-a")


async def _started(store: Any, thread: ThreadId = T, run: str = "run-1") -> int:
    """Claim the thread and activate a Run on it; returns the owner epoch."""
    epoch: int = await store.claim(thread, "owner-1")
    await store.append(activation(thread, run), 0, epoch)
    return epoch


def _same_log(frontier: Frontier, replayed: Frontier) -> None:
    """The stored frontier is the fold of the log (ownership is not in the log)."""
    ignore = {"epoch", "owner"}
    assert frontier.model_dump(exclude=ignore) == replayed.model_dump(exclude=ignore)


async def test_unknown_thread_loads_empty(store: Any) -> None:
    frontier = await store.load(ThreadId("nobody"))
    assert frontier.version == 0 and frontier.run_state is None
    assert await store.read(ThreadId("nobody")) == []


async def test_append_load_and_read_by_cursor(store: Any) -> None:
    epoch = await _started(store)
    r2 = await store.append(step(T, "run-1", 1, "one"), 1, epoch)
    r3 = await store.append(step(T, "run-1", 2, "two"), 2, epoch)
    assert (r2.seq, r3.seq) == (2, 3)
    frontier = await store.load(T)
    assert frontier.version == 3 and frontier.epoch == epoch and frontier.steps == 2
    records = await store.read(T)
    assert [r.seq for r in records] == [1, 2, 3]
    assert [r.seq for r in await store.read(T, after_seq=1)] == [2, 3]
    assert await store.read(T, after_seq=3) == []
    assert records[2].commit.payload_hash == r3.payload_hash
    _same_log(frontier, replay(T, [r.commit for r in records]))


async def test_version_conflict(store: Any) -> None:
    epoch = await _started(store)
    await store.append(step(T, "run-1", 1), 1, epoch)
    with pytest.raises(VersionConflict) as info:
        await store.append(step(T, "run-1", 2), 1, epoch)
    assert (info.value.expected, info.value.actual) == (1, 2)
    assert (await store.load(T)).version == 2


async def test_stale_epoch_is_fenced(store: Any) -> None:
    old = await _started(store)
    new = await store.claim(T, "owner-2")
    assert new == old + 1
    with pytest.raises(Fenced):
        await store.append(step(T, "run-1", 1), 1, old)
    assert len(await store.read(T)) == 1
    await store.append(step(T, "run-1", 1), 1, new)
    frontier = await store.load(T)
    assert (frontier.version, frontier.owner) == (2, "owner-2")


async def test_claim_frontier_returns_the_frontier_as_claimed(store: Any) -> None:
    epoch = await _started(store)
    claimed = await store.claim_frontier(T, "owner-2")
    assert (claimed.epoch, claimed.owner, claimed.version) == (epoch + 1, "owner-2", 1)
    assert claimed == await store.load(T)
    fresh = await store.claim_frontier(ThreadId("fresh"), "owner-1", RunId("run-9"))
    assert (fresh.version, fresh.epoch, fresh.run_state) == (0, 1, None)


async def test_a_claim_to_start_a_run_is_refused_while_another_is_active(store: Any) -> None:
    epoch = await _started(store, run="run-1")
    with pytest.raises(InvalidTransition):
        await store.claim_frontier(T, "owner-2", RunId("run-2"))
    after = await store.load(T)
    assert (after.epoch, after.owner) == (epoch, "owner-1")  # nothing written, no one fenced
    await store.append(step(T, "run-1", 1), 1, epoch)
    again = await store.claim_frontier(T, "owner-2", RunId("run-1"))  # a retried start
    assert (again.epoch, again.run_id, again.version) == (epoch + 1, "run-1", 2)


async def test_a_claim_to_start_a_run_after_the_last_one_ended_is_granted(store: Any) -> None:
    epoch = await _started(store, run="run-1")
    await store.append(ended(T, "run-1", 1), 1, epoch)
    claimed = await store.claim_frontier(T, "owner-2", RunId("run-2"))
    assert claimed.ended and claimed.epoch == epoch + 1
    await store.append(activation(T, "run-2"), 2, claimed.epoch)
    assert (await store.load(T)).run_id == "run-2"


async def test_same_operation_is_idempotent_by_payload(store: Any) -> None:
    epoch = await _started(store)
    first = await store.append(step(T, "run-1", 1, "answer"), 1, epoch)
    again = await store.append(step(T, "run-1", 1, "answer"), 1, epoch)
    assert again == first
    with pytest.raises(DuplicateOperation):
        await store.append(step(T, "run-1", 1, "another answer"), 2, epoch)
    assert [r.seq for r in await store.read(T)] == [1, 2]


async def test_terminal_is_final(store: Any) -> None:
    epoch = await _started(store)
    await store.append(ended(T, "run-1", 1), 1, epoch)
    with pytest.raises(RunEnded):
        await store.append(step(T, "run-1", 2), 2, epoch)
    assert (await store.load(T)).ended and len(await store.read(T)) == 2
    # The thread lives on: a new Run may start after the old one ended.
    await store.append(activation(T, "run-2"), 2, epoch)
    assert (await store.load(T)).run_id == "run-2"


async def test_commit_that_fails_midway_leaves_nothing(store: Any) -> None:
    epoch = await _started(store)
    before, log = await store.load(T), await store.read(T)
    clash = (Command(key="k", value=1), Command(key="k", value=2))
    with pytest.raises(StateConflict):  # the fold raises after admission
        await store.append(step(T, "run-1", 1, commands=clash), 1, epoch)
    with pytest.raises(InvalidTransition):  # an ordinal gap
        await store.append(step(T, "run-1", 5), 1, epoch)
    with pytest.raises(InvalidTransition):  # a second Run while one is active
        await store.append(activation(T, "run-2"), 1, epoch)
    with pytest.raises(PayloadTooLarge):
        await store.append(step(T, "run-1", 1, "x" * (store.payload_limit + 1)), 1, epoch)
    assert await store.load(T) == before
    assert await store.read(T) == log
    # Nothing was half-written: the same slot still takes a good commit.
    assert (await store.append(step(T, "run-1", 1), 1, epoch)).seq == 2


async def test_oversized_payload_names_the_limit(store: Any) -> None:
    epoch = await _started(store)
    with pytest.raises(PayloadTooLarge) as info:
        await store.append(step(T, "run-1", 1, "y" * (2 << 20)), 1, epoch)
    assert info.value.limit == store.payload_limit
    assert str(store.payload_limit) in str(info.value)


async def test_fifty_concurrent_writers_race_on_one_thread(store: Any) -> None:
    epoch = await _started(store)
    conflicts = 0

    async def writer(i: int) -> int:
        nonlocal conflicts
        while True:
            f = await store.load(T)
            commit = step(T, "run-1", f.next_ordinal, f"writer {i}")
            await asyncio.sleep(0)  # yield, so others load the same version: a real race
            try:
                return int((await store.append(commit, f.version, epoch)).seq)
            except (VersionConflict, InvalidTransition, DuplicateOperation):
                conflicts += 1  # lost this version to another writer: reload and retry

    seqs = await asyncio.wait_for(asyncio.gather(*(writer(i) for i in range(50))), 60)
    assert sorted(seqs) == list(range(2, 52))  # exactly one winner per version
    records = await store.read(T)
    assert [r.seq for r in records] == list(range(1, 52))
    texts = [m.text for r in records[1:] for m in r.commit.messages]
    assert sorted(texts) == sorted(f"writer {i}" for i in range(50))  # none lost
    _same_log(await store.load(T), replay(T, [r.commit for r in records]))
    assert conflicts > 0


async def test_corrupt_record_fails_closed(store: Any, corrupt: Corruptor) -> None:
    epoch = await _started(store)
    await store.append(step(T, "run-1", 1), 1, epoch)
    await corrupt(T, 2, '{"schema_version": 1, "thread_id": "thread-a"}')
    with pytest.raises(CorruptRecord) as info:
        await store.read(T)
    assert (info.value.thread, info.value.seq) == (T, 2)
    assert "thread-a" in str(info.value) and "2" in str(info.value)
    assert len(await store.read(T, after_seq=2)) == 0


async def test_corrupt_frontier_fails_closed(store: Any, corrupt_frontier: Corruptor) -> None:
    await _started(store)
    await corrupt_frontier(T, 1, '{"thread_id": "thread-a", "version": "not a number"}')
    with pytest.raises(CorruptRecord) as info:
        await store.load(T)
    assert info.value.thread == T


async def test_list_runs_by_state(store: Any) -> None:
    a, b, c = ThreadId("t-running"), ThreadId("t-ended"), ThreadId("t-claimed-only")
    await _started(store, a, "run-a")
    eb = await _started(store, b, "run-b")
    await store.append(ended(b, "run-b", 1), 1, eb)
    await store.claim(c, "owner")
    everything = sorted((s.thread_id, s.state) for s in await store.list_runs())
    assert everything == [(b, "ended"), (a, "running")]
    running = await store.list_runs("running")
    assert [(s.thread_id, s.run_id, s.version) for s in running] == [(a, "run-a", 1)]
    [done] = await store.list_runs("ended")
    assert (done.thread_id, done.cause, done.version) == (b, "natural", 2)
    assert await store.list_runs("awaiting") == []


async def test_group_of_appends_lands_and_one_bad_fails_alone(store: Any) -> None:
    threads = [ThreadId(f"t-{i:02d}") for i in range(40)]
    epochs = await asyncio.gather(*(store.claim(t, "owner") for t in threads))

    async def one(i: int) -> Any:
        expected = 7 if i == 13 else 0  # thread 13 asks for a version it is not at
        try:
            return await store.append(activation(threads[i], f"run-{i}"), expected, epochs[i])
        except VersionConflict as exc:
            return exc

    outcomes = await asyncio.gather(*(one(i) for i in range(40)))
    assert isinstance(outcomes[13], VersionConflict)
    assert all(o.seq == 1 for i, o in enumerate(outcomes) if i != 13)
    versions = [(await store.load(t)).version for t in threads]
    assert versions == [0 if i == 13 else 1 for i in range(40)]
