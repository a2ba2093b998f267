"""One CommitStore conformance suite, run against every backend (see conftest.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.commit import Frontier, head_only
from runtime.errors import (
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InputRefused,
    InvalidTransition,
    PayloadTooLarge,
    RunEnded,
    StateConflict,
    VersionConflict,
)
from runtime.ids import ThreadId
from runtime.limits import MAX_JSON_DEPTH, STORED_DEPTH
from runtime.ports import refused_in
from runtime.rules import replay
from runtime.state import Command
from tests.storage.builders import activation, ended, head, step
from tests.storage.conftest import Corruptor

T = ThreadId("thread-a")


async def _started(store: Any, thread: ThreadId = T, run: str = "run-1") -> int:
    """Activate a Run on the thread, claiming it in the same append; returns the epoch."""
    before = await store.load(thread)
    await store.append(
        activation(thread, run, prev=before.head, epoch=before.epoch + 1, claim="owner-1"),
        before.version,
        before.epoch,
        claim="owner-1",
    )
    return int(before.epoch + 1)


async def _next(store: Any, thread: ThreadId, run: str, text: str = "thinking", **kw: Any) -> Any:
    """Append the next inference commit of ``run`` as its owner."""
    f = await store.load(thread)
    return await store.append(
        step(thread, run, f.next_ordinal, text, prev=f.head, epoch=f.epoch, **kw),
        f.version,
        f.epoch,
    )


def _same_log(frontier: Frontier, replayed: Frontier) -> None:
    """The stored frontier is the fold of the log (ownership is not in the log)."""
    ignore = {"epoch", "owner"}
    assert frontier.model_dump(exclude=ignore) == replayed.model_dump(exclude=ignore)


async def test_unknown_thread_loads_empty(store: Any) -> None:
    frontier = await store.load(ThreadId("nobody"))
    assert frontier.version == 0 and frontier.run_state is None and frontier.head == ""
    assert await store.read(ThreadId("nobody")) == []


async def test_append_load_and_read_by_cursor(store: Any) -> None:
    epoch = await _started(store)
    r2 = await _next(store, T, "run-1", "one")
    r3 = await _next(store, T, "run-1", "two")
    assert (r2.seq, r3.seq) == (2, 3)
    frontier = await store.load(T)
    assert frontier.version == 3 and frontier.epoch == epoch and frontier.steps == 2
    assert frontier.head == r3.payload_hash
    records = await store.read(T)
    assert [r.seq for r in records] == [1, 2, 3]
    assert [r.seq for r in await store.read(T, after_seq=1)] == [2, 3]
    assert [r.seq for r in await store.read(T, after_seq=2)] == [3]
    assert await store.read(T, after_seq=3) == []
    assert records[2].commit.payload_hash == r3.payload_hash
    # each commit names the hash of the one before: the chain
    assert [r.commit.prev for r in records] == ["", records[0].commit.payload_hash, r2.payload_hash]
    _same_log(frontier, replay(T, [r.commit for r in records]))


async def test_version_conflict(store: Any) -> None:
    epoch = await _started(store)
    h = await head(store, T)
    await store.append(step(T, "run-1", 1, prev=h, epoch=epoch), 1, epoch)
    with pytest.raises(VersionConflict) as info:
        await store.append(step(T, "run-1", 2, prev=h, epoch=epoch), 1, epoch)
    assert (info.value.expected, info.value.actual) == (1, 2)
    assert (await store.load(T)).version == 2


async def test_an_append_that_does_not_extend_the_head_is_refused(store: Any) -> None:
    epoch = await _started(store)
    with pytest.raises(InvalidTransition, match="head"):
        await store.append(step(T, "run-1", 1, prev="0" * 64, epoch=epoch), 1, epoch)
    assert (await store.load(T)).version == 1


async def test_stale_epoch_is_fenced(store: Any) -> None:
    old = await _started(store)
    claimed = await store.claim(T, "owner-2", old)
    assert claimed.epoch == old + 1 and claimed.owner == "owner-2"
    h = await head(store, T)
    with pytest.raises(Fenced):
        await store.append(step(T, "run-1", 1, prev=h, epoch=old), 1, old)
    assert len(await store.read(T)) == 1
    await store.append(step(T, "run-1", 1, prev=h, epoch=claimed.epoch), 1, claimed.epoch)
    frontier = await store.load(T)
    assert (frontier.version, frontier.owner) == (2, "owner-2")


async def test_a_claim_names_the_epoch_it_supersedes(store: Any) -> None:
    epoch = await _started(store)
    claimed = await store.claim(T, "owner-2", epoch)
    assert (claimed.epoch, claimed.owner, claimed.version) == (epoch + 1, "owner-2", 1)
    assert claimed == await store.load_head(T)
    with pytest.raises(Fenced) as stale:  # the thread moved on past the named epoch
        await store.claim(T, "owner-3", epoch)
    assert (stale.value.epoch, stale.value.current) == (epoch, epoch + 1)
    after = await store.load(T)
    assert (after.epoch, after.owner) == (epoch + 1, "owner-2")  # nothing written
    fresh = await store.claim(ThreadId("fresh"), "owner-1", 0)
    assert (fresh.version, fresh.epoch, fresh.run_state) == (0, 1, None)


async def test_of_two_claims_of_one_epoch_exactly_one_lands(store: Any) -> None:
    epoch = await _started(store)
    outcomes = await asyncio.gather(
        *(store.claim(T, f"racer-{i}", epoch) for i in range(8)), return_exceptions=True
    )
    won = [o for o in outcomes if isinstance(o, Frontier)]
    assert len(won) == 1 and all(isinstance(o, Fenced) for o in outcomes if o not in won)
    assert (await store.load(T)).owner == won[0].owner


CLAIMS = 30


async def test_a_claim_lands_while_the_owner_keeps_appending(store: Any) -> None:
    """A claim decides by the epoch alone: appends of the owner it supersedes that the
    claimer never saw (landed since it looked, or while the claim is on its way) neither
    refuse it nor go missing from the frontier it returns. The owner appends without
    pause, under the epoch of the last claim once it has heard of it; each claim waits
    for an append under the epoch it supersedes and goes while the next one is under
    way. (Redis, where a claim reads before its script writes: test_redis_store.py.)"""
    first = await _started(store)
    shared = asyncio.Condition()
    epoch, done = first, False
    landed: dict[int, int] = {}
    """Appends landed under each epoch."""
    last = 1
    """The version the owner's last landed append made."""

    async def owner() -> None:
        nonlocal last
        f = await store.load(T)
        version, prev, ordinal = f.version, f.head, f.next_ordinal
        while not done:
            mine = epoch
            commit = step(T, "run-1", ordinal, "on", prev=prev, epoch=mine)
            try:
                receipt = await store.append(commit, version, mine)
            except Fenced:  # a claim landed: go on under its epoch, once the claimer says
                async with shared:
                    await shared.wait_for(lambda mine=mine: epoch != mine or done)
                continue
            version, prev, ordinal = receipt.seq, receipt.payload_hash, ordinal + 1
            await asyncio.sleep(0)  # the in-memory store never yields by itself
            async with shared:  # the claimer wakes once the next append is on its way
                landed[mine], last = landed.get(mine, 0) + 1, version
                shared.notify_all()

    overlapped = 0
    writer = asyncio.create_task(owner())
    try:
        async with asyncio.timeout(60):
            for i in range(CLAIMS):
                async with shared:
                    await shared.wait_for(lambda now=epoch: landed.get(now, 0) > 0)
                    before = last
                claimed = await store.claim(T, f"claimer-{i}", epoch)
                assert (claimed.epoch, claimed.owner) == (first + i + 1, f"claimer-{i}")
                overlapped += claimed.version > before
                records = await store.read(T)  # what it returns is the log's fold at its version
                # a claim answers the head: the fold of the log but for the messages
                folded = head_only(replay(T, [r.commit for r in records[: claimed.version]]))
                _same_log(claimed, folded)
                async with shared:
                    epoch = claimed.epoch
                    shared.notify_all()
    finally:
        async with shared:
            done = True
            shared.notify_all()
        await writer
    assert sum(landed.values()) >= CLAIMS
    assert overlapped > 0, "no claim met an append its claimer had not seen"
    frontier = await store.load(T)
    assert (frontier.epoch, frontier.owner) == (first + CLAIMS, f"claimer-{CLAIMS - 1}")
    _same_log(frontier, replay(T, [r.commit for r in await store.read(T)]))


async def test_an_append_carries_its_own_claim(store: Any) -> None:
    epoch = await _started(store)
    assert (await store.load(T)).owner == "owner-1"
    h = await head(store, T)
    claimed = step(T, "run-1", 1, prev=h, epoch=epoch + 1, claim="owner-2")
    receipt = await store.append(claimed, 1, epoch, claim="owner-2")
    after = await store.load(T)
    assert (receipt.seq, after.epoch, after.owner) == (2, epoch + 1, "owner-2")
    with pytest.raises(Fenced):  # the previous owner is fenced by it
        await store.append(step(T, "run-1", 2, prev=after.head, epoch=epoch), 2, epoch)
    with pytest.raises(Fenced):  # and a claim-append must name the current epoch too
        late = step(T, "run-1", 2, prev=after.head, epoch=epoch + 1, claim="owner-3")
        await store.append(late, 2, epoch, claim="owner-3")


async def test_a_commit_names_its_writers_epoch(store: Any) -> None:
    """Two owners never write the same bytes: a fenced writer's commit that equals its
    successor's is refused, not taken for a harmless retry of the successor's."""
    epoch = await _started(store)
    h = await head(store, T)
    with pytest.raises(InvalidTransition, match="epoch"):  # it must say who writes it
        await store.append(step(T, "run-1", 1, prev=h, epoch=epoch + 7), 1, epoch)
    successor = await store.claim(T, "owner-2", epoch)
    theirs = step(T, "run-1", 1, prev=h, epoch=successor.epoch)
    await store.append(theirs, 1, successor.epoch)
    ours = step(T, "run-1", 1, prev=h, epoch=epoch)  # the same step, by the fenced owner
    assert ours.operation_id == theirs.operation_id and ours.payload_hash != theirs.payload_hash
    with pytest.raises(Fenced):
        await store.append(ours, 1, epoch)
    assert (await store.append(theirs, 1, successor.epoch)).seq == 2  # a true retry


async def test_of_racing_claim_appends_exactly_one_lands(store: Any) -> None:
    """Two starts of different Runs on one new thread: one Run exists, no one is fenced
    after committing."""
    outcomes = await asyncio.gather(
        *(
            store.append(activation(T, f"run-{i}", epoch=1, claim=f"s-{i}"), 0, 0, claim=f"s-{i}")
            for i in range(6)
        ),
        return_exceptions=True,
    )
    landed = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(landed) == 1
    assert all(isinstance(o, VersionConflict | Fenced) for o in outcomes if o not in landed)
    frontier = await store.load(T)
    winner = outcomes.index(landed[0])
    assert (frontier.run_id, frontier.owner, frontier.epoch) == (f"run-{winner}", f"s-{winner}", 1)


async def test_same_operation_is_idempotent_by_payload(store: Any) -> None:
    epoch = await _started(store)
    h = await head(store, T)
    first = await store.append(step(T, "run-1", 1, "answer", prev=h, epoch=epoch), 1, epoch)
    again = await store.append(step(T, "run-1", 1, "answer", prev=h, epoch=epoch), 1, epoch)
    assert again == first
    with pytest.raises(DuplicateOperation):
        h2 = await head(store, T)
        other = step(T, "run-1", 1, "another answer", prev=h2, epoch=epoch)
        await store.append(other, 2, epoch)
    assert [r.seq for r in await store.read(T)] == [1, 2]


async def test_terminal_is_final(store: Any) -> None:
    epoch = await _started(store)
    await store.append(ended(T, "run-1", 1, prev=await head(store, T), epoch=epoch), 1, epoch)
    with pytest.raises(RunEnded):
        late = step(T, "run-1", 2, prev=await head(store, T), epoch=epoch)
        await store.append(late, 2, epoch)
    assert (await store.load(T)).ended and len(await store.read(T)) == 2
    # The thread lives on: a new Run may start after the old one ended.
    await store.append(activation(T, "run-2", prev=await head(store, T), epoch=epoch), 2, epoch)
    assert (await store.load(T)).run_id == "run-2"


async def test_commit_that_fails_midway_leaves_nothing(store: Any) -> None:
    epoch = await _started(store)
    before, log = await store.load(T), await store.read(T)
    h = before.head
    clash = (Command(key="k", value=1), Command(key="k", value=2))
    with pytest.raises(StateConflict):  # the fold raises after admission
        await store.append(step(T, "run-1", 1, commands=clash, prev=h, epoch=epoch), 1, epoch)
    with pytest.raises(InvalidTransition):  # an ordinal gap
        await store.append(step(T, "run-1", 5, prev=h, epoch=epoch), 1, epoch)
    with pytest.raises(InvalidTransition):  # a second Run while one is active
        await store.append(activation(T, "run-2", prev=h, epoch=epoch), 1, epoch)
    with pytest.raises(InvalidTransition):  # a second Run, claiming
        intruder = activation(T, "run-2", prev=h, epoch=epoch + 1, claim="intruder")
        await store.append(intruder, 1, epoch, claim="intruder")
    with pytest.raises(PayloadTooLarge):
        big = "x" * (store.payload_limit + 1)
        await store.append(step(T, "run-1", 1, big, prev=h, epoch=epoch), 1, epoch)
    assert await store.load(T) == before
    assert await store.read(T) == log
    # Nothing was half-written: the same slot still takes a good commit.
    assert (await store.append(step(T, "run-1", 1, prev=h, epoch=epoch), 1, epoch)).seq == 2


async def test_what_could_not_be_read_back_is_never_written(store: Any) -> None:
    """A value nested deeper than a record may be to decode again, text with an unpaired
    surrogate, or a thread id no store can key by: refused with the rule it breaks, and
    nothing written (written, the deep one failed every later load as CorruptRecord)."""
    epoch = await _started(store)
    before, h = await store.load(T), await head(store, T)
    deep: Any = 0
    for _ in range(STORED_DEPTH):
        deep = [deep]
    with pytest.raises(InputRefused) as nested:
        commands = (Command(key="k", value=deep),)
        await store.append(step(T, "run-1", 1, commands=commands, prev=h, epoch=epoch), 1, epoch)
    assert nested.value.limit == "json_depth"
    with pytest.raises(InputRefused) as text:
        await store.append(step(T, "run-1", 1, "half \ud800", prev=h, epoch=epoch), 1, epoch)
    assert text.value.limit == "utf8"
    with pytest.raises(InputRefused):
        await store.append(activation(ThreadId("bad\ud800"), "run-x"), 0, 0)
    assert await store.load(T) == before
    within: Any = 0
    for _ in range(MAX_JSON_DEPTH):
        within = [within]
    commands = (Command(key="k", value=within),)
    await store.append(step(T, "run-1", 1, commands=commands, prev=h, epoch=epoch), 1, epoch)
    assert (await store.load(T)).state["thread"]["k"] == within  # and it reads back


async def test_a_refused_request_on_an_unknown_thread_leaves_no_thread(store: Any) -> None:
    """A claim or an append refused on a thread the store does not hold writes nothing,
    not even a row for it (such a row vouches for nothing: ``ratchet verify --all``
    named it a thread that does not exist)."""
    ghost = ThreadId("t-ghost")
    with pytest.raises(Fenced):
        await store.claim(ghost, "intruder#1", 3)
    with pytest.raises((VersionConflict, Fenced)):
        await store.append(activation(ghost, "run-1", epoch=4, claim="x"), 2, 3, claim="x")
    assert ghost not in await store.thread_ids()
    assert (await store.load(ghost)).version == 0
    await store.append(activation(ghost, "run-1", epoch=1, claim="x"), 0, 0, claim="x")
    assert ghost in await store.thread_ids()


async def test_oversized_payload_names_the_limit(store: Any) -> None:
    epoch = await _started(store)
    with pytest.raises(PayloadTooLarge) as info:
        await store.append(
            step(T, "run-1", 1, "y" * (2 << 20), prev=await head(store, T), epoch=epoch), 1, epoch
        )
    assert info.value.limit == store.payload_limit
    assert str(store.payload_limit) in str(info.value)


async def test_fifty_concurrent_writers_race_on_one_thread(store: Any) -> None:
    epoch = await _started(store)
    conflicts = 0

    async def writer(i: int) -> int:
        nonlocal conflicts
        while True:
            f = await store.load(T)
            commit = step(T, "run-1", f.next_ordinal, f"writer {i}", prev=f.head, epoch=epoch)
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
    await _started(store)
    await _next(store, T, "run-1")
    await corrupt(T, 2, '{"schema_version": 1, "thread_id": "thread-a"}')
    with pytest.raises(CorruptRecord) as info:
        await store.read(T)
    assert (info.value.thread, info.value.seq) == (T, 2)
    assert "thread-a" in str(info.value) and "2" in str(info.value)
    with pytest.raises(CorruptRecord):  # reading from the record on still checks it
        await store.read(T, after_seq=1)


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
    await store.append(ended(b, "run-b", 1, prev=await head(store, b), epoch=eb), 1, eb)
    await store.claim(c, "owner", 0)
    everything = sorted((s.thread_id, s.state) for s in await store.list_runs())
    assert everything == [(b, "ended"), (a, "running")]
    running = await store.list_runs("running")
    assert [(s.thread_id, s.run_id, s.version, s.owner) for s in running] == [
        (a, "run-a", 1, "owner-1")
    ]
    [done] = await store.list_runs("ended")
    assert (done.thread_id, done.cause, done.version) == (b, "natural", 2)
    assert await store.list_runs("awaiting") == []


async def test_a_listing_beside_commits_lists_every_healthy_run(store: Any) -> None:
    """Runs committing while they are listed are listed as they are, never refused as
    corrupt: a refused Run is quarantined by the Supervisor (never taken over) and fails
    ``wait_all``. Redis read its run index and the threads' heads in two round trips, and
    a commit between them made a healthy entry look forged."""
    threads = [ThreadId(f"busy-{i}") for i in range(4)]
    for t in threads:
        await _started(store, t, f"run-{t}")
    refused: list[ThreadId] = []
    moving = True

    async def commits(t: ThreadId) -> None:
        for run in (f"run-{t}", f"again-{t}"):  # ended, then running again: states move
            if run.startswith("again"):
                await _started(store, t, run)
            for _ in range(12):
                await _next(store, t, run)
            f = await store.load_head(t)
            last = ended(t, run, f.next_ordinal, prev=f.head, epoch=f.epoch)
            await store.append(last, f.version, f.epoch)

    async def listings() -> int:
        count = 0
        while moving or count < 3:
            for state in (None, "running"):
                listing = await store.list_runs(state)
                refused.extend(refused_in(listing))
                listed = sorted(s.thread_id for s in listing)
                if state is None:  # every thread, once, whatever state it is in
                    assert listed == sorted(threads)
                assert set(listed) <= set(threads)
            for host in ("owner-1", None):
                refused.extend(refused_in(await store.list_runs("running", host=host)))
            count += 1
            await asyncio.sleep(0)  # let the commits go on between listings
        return count

    listed = asyncio.create_task(listings())
    await asyncio.gather(*(commits(t) for t in threads))
    moving = False
    assert await listed >= 3
    assert refused == []
    every = await store.list_runs()
    assert sorted((s.thread_id, s.run_id, s.state) for s in every) == [
        (t, f"again-{t}", "ended") for t in sorted(threads)
    ]


async def test_the_owner_index_lists_running_runs_by_host(store: Any) -> None:
    threads = [ThreadId(f"t-{i}") for i in range(4)]
    for i, t in enumerate(threads):
        before = await store.load(t)
        owner = f"host-{i % 2}#{100 + i}"
        await store.append(activation(t, f"run-{i}", epoch=1, claim=owner), 0, 0, claim=owner)
        assert before.version == 0
    await store.claim(threads[2], "host-1#7", 1)  # host-0's Run taken over by host-1
    e3 = (await store.load(threads[3])).epoch
    last = ended(threads[3], "run-3", 1, prev=await head(store, threads[3]), epoch=e3)
    await store.append(last, 1, e3)

    def owned(rows: list[Any]) -> list[tuple[str, str | None]]:
        return sorted((r.thread_id, r.owner) for r in rows)

    assert owned(await store.list_runs("running", host="host-0")) == [("t-0", "host-0#100")]
    assert owned(await store.list_runs("running", host="host-1")) == [
        ("t-1", "host-1#101"),
        ("t-2", "host-1#7"),
    ]
    assert await store.list_runs("running", host="host-9") == []
    assert owned(await store.list_runs(host="host-1")) == [
        ("t-1", "host-1#101"),
        ("t-2", "host-1#7"),
        ("t-3", "host-1#103"),
    ]


async def test_group_of_appends_lands_and_one_bad_fails_alone(store: Any) -> None:
    threads = [ThreadId(f"t-{i:02d}") for i in range(40)]

    async def one(i: int) -> Any:
        expected = 7 if i == 13 else 0  # thread 13 asks for a version it is not at
        try:
            first = activation(threads[i], f"run-{i}", epoch=1, claim="o")
            return await store.append(first, expected, 0, claim="o")
        except VersionConflict as exc:
            return exc

    outcomes = await asyncio.gather(*(one(i) for i in range(40)))
    assert isinstance(outcomes[13], VersionConflict)
    assert all(o.seq == 1 for i, o in enumerate(outcomes) if i != 13)
    versions = [(await store.load(t)).version for t in threads]
    assert versions == [0 if i == 13 else 1 for i in range(40)]
