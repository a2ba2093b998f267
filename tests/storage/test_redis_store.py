"""The Redis CommitStore's own guarantees: the Lua script decides atomically.

The shared conformance suite covers the port; these tests aim at the script: the
re-check it makes after Python's load, and that a refused append writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from runtime.commit import Frontier, ThreadCommit
from runtime.errors import (
    CorruptRecord,
    Fenced,
    RunEnded,
    StoreUnavailable,
    VersionConflict,
)
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import Cancelled, EndedState, RunningState
from runtime.messages import UserMessage
from runtime.ports import RunSummary, StreamCheckpoint
from runtime.rules import advance, replay
from storage.redis_checkpoints import RedisCheckpointStore
from storage.redis_store import RedisCommitStore
from tests.storage.builders import activation, step

TEST_DB = 12
"""This file's own Redis database; keys carry a per-test prefix as well."""


def db_url(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisCommitStore]:
    prefix = f"store-test-{uuid.uuid4().hex[:8]}"
    s = await RedisCommitStore.connect(db_url(redis_url, TEST_DB), prefix=prefix)
    yield s
    keys = [k async for k in s.client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await s.client.delete(*keys)
    await s.close()


def one_shot(
    thread: str, run: str, text: str = "hi", prev: str = "", epoch: int = 1
) -> ThreadCommit:
    """A whole Run in one commit (activation and end together): any writer may add one."""
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=0,
        label="activation",
        disposition=EndedState(run_id=RunId(run), cause=Cancelled()),
        messages=(UserMessage(id=f"{run}:input", text=text),),
        prev=prev,
        epoch=epoch,
    )


def unowned(frontier: Frontier) -> Frontier:
    return frontier.model_copy(update={"epoch": 0, "owner": None})


async def test_fifty_concurrent_writers_one_winner_per_version(store: RedisCommitStore) -> None:
    thread = ThreadId("race")
    await store.claim(thread, "racers", 0)
    conflicts = 0

    async def writer(i: int) -> int:
        nonlocal conflicts
        while True:
            f = await store.load(thread)
            commit = one_shot(thread, f"run-{i}", prev=f.head)
            try:
                return (await store.append(commit, f.version, f.epoch)).seq
            except VersionConflict:
                conflicts += 1

    seqs = await asyncio.gather(*(writer(i) for i in range(50)))
    assert sorted(seqs) == list(range(1, 51))  # exactly one winner per version
    assert conflicts > 0  # they really raced
    records = await store.read(thread)
    assert [r.seq for r in records] == list(range(1, 51))
    assert len({r.commit.run_id for r in records}) == 50  # none lost, none twice
    loaded = await store.load(thread)
    assert unowned(loaded) == replay(thread, [r.commit for r in records])


async def test_the_script_lets_one_of_many_stale_snapshots_win(store: RedisCommitStore) -> None:
    """All writers pass Python's check on the same snapshot; only the script decides."""
    thread = ThreadId("script-race")
    epoch = (await store.claim(thread, "me", 0)).epoch
    f = await store.load(thread)
    commits = [one_shot(thread, f"run-{i}") for i in range(20)]
    outcomes = await asyncio.gather(
        *(store._apply(c, f, advance(f, c), None) for c in commits),
        return_exceptions=True,
    )
    winners = [o for o in outcomes if o is not None]
    assert len(winners) == 1 and not isinstance(winners[0], BaseException)
    assert winners[0].seq == 1  # the other 19 were refused by the script itself
    assert len(await store.read(thread)) == 1
    with pytest.raises(VersionConflict):  # and the refusal is named by admit
        await store.append(commits[1], f.version, epoch)


async def test_the_script_refuses_a_stale_epoch_and_writes_nothing(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("fenced")
    old = (await store.claim(thread, "zombie", 0)).epoch
    f = await store.load(thread)
    commit = one_shot(thread, "run-z")
    new_epoch = (await store.claim(thread, "successor", old)).epoch  # between load and script
    assert await store._apply(commit, f, advance(f, commit), None) is None
    assert await store.read(thread) == [] and (await store.load(thread)).version == 0
    with pytest.raises(Fenced) as caught:
        await store.append(commit, f.version, old)
    assert (caught.value.epoch, caught.value.current) == (old, new_epoch)
    assert (await store.append(one_shot(thread, "run-z", epoch=new_epoch), 0, new_epoch)).seq == 1


async def test_the_script_answers_known_operations_and_the_rule_ended_runs(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("known")
    epoch = (await store.claim(thread, "me", 0)).epoch
    f = await store.load(thread)
    commit = one_shot(thread, "run-k")
    receipt = await store._apply(commit, f, advance(f, commit), None)
    assert receipt is not None
    # The script refuses a known operation id; the append then answers from the rule:
    # the same payload gets the original receipt, another payload is a duplicate.
    assert await store._apply(commit, f, advance(f, commit), None) is None
    assert await store.append(commit, 0, epoch) == receipt
    other = one_shot(thread, "run-k", text="another payload")
    assert await store._apply(other, f, advance(f, other), None) is None
    with pytest.raises(RunEnded):  # the rule names the first thing wrong: that Run is over
        await store.append(other, 0, epoch)
    after = await store.load(thread)
    late = ThreadCommit(
        thread_id=thread,
        run_id=RunId("run-k"),
        ordinal=1,
        label="status",
        disposition=RunningState(run_id=RunId("run-k")),
        prev=after.head,
        epoch=epoch,
    )
    # the end came with a version, so the script's version check covers it; the rule
    # refuses on the frontier the checksum vouches for, before the script is asked
    with pytest.raises(RunEnded):
        await store.append(late, after.version, epoch)
    assert len(await store.read(thread)) == 1


async def test_corrupt_frontier_and_record_fail_closed_naming_thread_and_seq(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("corrupt")
    epoch = (await store.claim(thread, "me", 0)).epoch
    await store.append(one_shot(thread, "run-c"), 0, epoch)
    await store.corrupt(thread, 1, '{"schema_version": 1, "nope": true}')
    with pytest.raises(CorruptRecord) as record:
        await store.read(thread)
    assert (record.value.thread, record.value.seq) == ("corrupt", 1)
    await store.client.hset(f"{store.prefix}:thread:corrupt:meta", "frontier", "{garbage")
    with pytest.raises(CorruptRecord) as frontier:
        await store.load(thread)
    assert frontier.value.thread == "corrupt"


async def test_claims_never_touch_the_frontier(store: RedisCommitStore) -> None:
    thread = ThreadId("claims")
    epoch = (await store.claim(thread, "a", 0)).epoch
    await store.append(one_shot(thread, "run-1"), 0, epoch)
    before = await store.load(thread)
    meta = f"{store.prefix}:thread:claims:meta"
    written = await store.client.hget(meta, "frontier")
    again = await store.claim(thread, "b", epoch)
    after = await store.load(thread)
    assert (again.epoch, after.owner) == (epoch + 1, "b")
    assert unowned(after) == unowned(before)
    # the text keeps the epoch and owner of the append that wrote it; the claim moved
    # the ones beside it alone
    assert await store.client.hget(meta, "frontier") == written and '"owner":"a"' in written


@pytest.mark.parametrize(
    "edit",
    [{"epoch": "1"}, {"epoch": "0"}, {"owner": "c"}, {"epoch": "2", "owner": "a"}],
    ids=["lowered", "zero", "owner-alone", "epoch-alone-as-claimed"],
)
async def test_an_owner_epoch_edited_by_hand_fails_closed(
    store: RedisCommitStore, edit: dict[str, str]
) -> None:
    """The epoch is the fencing token: lowered by hand, it would let a fenced writer
    append again. The frontier text names the epoch and owner of its append, so a pair
    beside it that is older, or the same epoch with another owner, does not verify."""
    thread = ThreadId("fenced-again")
    first = (await store.claim(thread, "a", 0)).epoch
    second = (await store.claim(thread, "b", first)).epoch
    r1 = await store.append(one_shot(thread, "run-1", epoch=second), 0, second)
    assert r1.seq == 1 and second == 2
    await store.client.hset(f"{store.prefix}:thread:{thread}:meta", mapping=edit)
    with pytest.raises(CorruptRecord, match="owner epoch"):
        await store.load(thread)
    with pytest.raises(CorruptRecord):
        fenced = one_shot(thread, "run-2", prev=r1.payload_hash, epoch=first)
        await store.append(fenced, 1, first)  # the fenced writer


async def test_a_claim_lands_on_appends_made_after_its_load(store: RedisCommitStore) -> None:
    """The claim script decides by the epoch alone: appends of the superseded owner that
    land between the claimer's load and its script neither refuse the claim nor go
    missing from the frontier it answers; the run and owner indexes follow the claim,
    the new owner written into the run-index entry as JSON (a quote, a non-ASCII char)."""
    thread = ThreadId("claimed-late")
    epoch = (await store.claim(thread, "host-a#1", 0)).epoch
    r1 = await store.append(activation(thread, "run-1", epoch=epoch), 0, epoch)
    looked = await store.load(thread)  # the claimer's look
    r2 = await store.append(step(thread, "run-1", 1, prev=r1.payload_hash, epoch=epoch), 1, epoch)
    owner = 'host-b#2 "the \\ second" \u00e9'
    claimed = await store._claim(looked, owner)
    assert (claimed.version, claimed.head) == (2, r2.payload_hash)
    assert (claimed.epoch, claimed.owner) == (epoch + 1, owner)
    assert claimed == await store.load_head(thread)  # a claim answers the head
    (listed,) = await store.list_runs("running")
    assert (listed.version, listed.owner) == (2, owner)
    assert await store.list_runs("running", host="host-b") == [listed]
    assert await store.list_runs("running", host="host-a") == []
    with pytest.raises(Fenced) as stale:  # the look's epoch is superseded now
        await store._claim(looked, "host-c#3")
    assert (stale.value.epoch, stale.value.current) == (epoch, epoch + 1)
    assert await store.list_runs("running") == [listed]  # and a refused claim wrote nothing
    await store.claim(thread, "host-c#3", epoch + 1)  # it finds the escaped owner's end
    assert [r.owner for r in await store.list_runs("running")] == ["host-c#3"]


def test_the_claim_script_patches_the_last_field_of_a_run_summary() -> None:
    """The claim script rewrites the owner at the end of a run-index entry in place: it
    must stay RunSummary's last field (an entry with more after it is reported corrupt)."""
    assert list(RunSummary.model_fields)[-1] == "owner"


async def test_a_run_index_entry_not_ending_in_its_owner_is_reported_not_rewritten(
    store: RedisCommitStore,
) -> None:
    thread = ThreadId("odd-entry")
    epoch = (await store.claim(thread, "host-a#1", 0)).epoch
    await store.append(activation(thread, "run-1", epoch=epoch), 0, epoch)
    index = f"{store.prefix}:runs:running"
    entry = str(await store.client.hget(index, thread))
    for odd in (entry[:-1] + ',"later":1}', entry.replace(',"owner":', ',"OWNER":')):
        await store.client.hset(index, thread, odd)
        with pytest.raises(CorruptRecord):
            await store.claim(thread, "host-b#2", epoch)
        assert (await store.load(thread)).epoch == epoch  # nothing written
        assert await store.client.hget(index, thread) == odd


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return f"redis://user:s3cret@127.0.0.1:{port}/0"


async def test_an_unreachable_server_is_store_unavailable_without_the_password() -> None:
    with pytest.raises(StoreUnavailable) as caught:
        await RedisCommitStore.connect(dead_url())
    assert "s3cret" not in str(caught.value) and "127.0.0.1" in str(caught.value)


async def test_checkpoints_round_trip(redis_url: str) -> None:
    prefix = f"ckpt-test-{uuid.uuid4().hex[:8]}"
    checkpoints = RedisCheckpointStore.connect(db_url(redis_url, TEST_DB), prefix=prefix)
    thread = ThreadId("t")
    point = StreamCheckpoint(run_id=RunId("r"), step=2, text="partial", tool_calls=({"a": 1},))
    assert await checkpoints.get(thread) is None
    await checkpoints.put(thread, point)
    assert await checkpoints.get(thread) == point
    await checkpoints.client.set(f"{prefix}:checkpoint:u", "{not json")
    assert await checkpoints.get(ThreadId("u")) is None  # unreadable: a miss, not an error
    sealed = await checkpoints.client.get(f"{prefix}:checkpoint:t")
    await checkpoints.client.set(f"{prefix}:checkpoint:u", sealed)
    assert await checkpoints.get(ThreadId("u")) is None  # another thread's: not acted on
    await checkpoints.client.set(f"{prefix}:checkpoint:t", sealed.replace("partial", "forged"))
    assert await checkpoints.get(thread) is None  # edited behind its digest
    await checkpoints.delete(thread)
    await checkpoints.delete(ThreadId("u"))
    assert await checkpoints.get(thread) is None
    await checkpoints.close()


async def test_a_checkpoint_forged_in_redis_without_the_commit_store_s_key_is_not_acted_on(
    redis_url: str,
) -> None:
    """Redis may be shared with clients that read the live bus and may not write the
    system's commits: one wrote a checkpoint holding a call the model never made, its
    digest recomputed, and a recovery ran the call as the model's. The seal is keyed by
    the commit store; every host of the system reads the same key there."""
    import hashlib
    import hmac
    import json

    from storage.checkpoint_key import CheckpointKey
    from storage.memory import MemoryCommitStore

    prefix = f"ckpt-key-{uuid.uuid4().hex[:8]}"
    commits = MemoryCommitStore()  # the system's commit store, which Redis clients cannot read
    url = db_url(redis_url, TEST_DB)
    host_a = RedisCheckpointStore.connect(url, prefix=prefix, key=CheckpointKey(commits, "sys"))
    host_b = RedisCheckpointStore.connect(url, prefix=prefix, key=CheckpointKey(commits, "sys"))
    thread = ThreadId("t")
    point = StreamCheckpoint(run_id=RunId("r"), step=2, text="partial", tool_calls=({"a": 1},))
    await host_a.put(thread, point)
    assert await host_b.get(thread) == point  # recovered on another host of the system
    stored = await host_a.client.get(f"{prefix}:checkpoint:t")
    body = json.loads(stored.split("\n", 1)[1])
    body["tool_calls"] = [{"id": "x", "name": "transfer", "arguments": '{"to": "mallory"}'}]
    forged_body = json.dumps(body)
    message = f"t\n{forged_body}".encode()
    for digest in (  # what a forger can compute: a digest, an HMAC under no key or a guess
        hashlib.sha256(message).hexdigest(),
        hmac.new(b"", message, hashlib.sha256).hexdigest(),
        hmac.new(b"sys", message, hashlib.sha256).hexdigest(),
    ):
        await host_a.client.set(f"{prefix}:checkpoint:t", f"{digest}\n{forged_body}")
        assert await host_b.get(thread) is None
    other = RedisCheckpointStore.connect(
        url, prefix=prefix, key=CheckpointKey(MemoryCommitStore(), "sys")
    )
    await host_a.put(thread, point)
    assert await other.get(thread) is None  # another commit store's system: another key
    await host_a.delete(thread)

    class Out:  # a commit store that cannot be asked: no key, no checkpoint either way
        async def hold_lease(self, *args: object) -> None:
            raise StoreUnavailable("out (test)")

    keyless = RedisCheckpointStore.connect(url, prefix=prefix, key=CheckpointKey(Out(), "sys"))  # type: ignore[arg-type]
    await keyless.put(thread, point)
    assert await host_a.get(thread) is None and await keyless.get(thread) is None
    for checkpoints in (host_a, host_b, other, keyless):
        await checkpoints.close()


async def test_checkpoint_failures_are_logged_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    checkpoints = RedisCheckpointStore.connect(dead_url())
    thread, point = ThreadId("t"), StreamCheckpoint(run_id=RunId("r"), step=0)
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.checkpoints"):
        await checkpoints.put(thread, point)
        assert await checkpoints.get(thread) is None
        await checkpoints.delete(thread)
    assert len(caplog.records) == 3
    assert all("s3cret" not in r.getMessage() for r in caplog.records)
    await checkpoints.close()


async def test_connect_warns_exactly_when_the_server_is_not_durable(
    store: RedisCommitStore, caplog: pytest.LogCaptureFixture
) -> None:
    config = await store.client.config_get("append*")  # read only: a shared server
    durable = (config["appendonly"], config["appendfsync"]) == ("yes", "always")
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.redis"):
        await store._warn_unless_durable()
    assert ("appendfsync always" in caplog.text) is not durable


async def test_a_claim_whose_answer_was_lost_is_never_reported_fenced(redis_url: str) -> None:
    """The connection drops after the claim's script ran and before its answer came back:
    the caller hears that the store did not answer (its retry by owner and epoch then
    finds the claim its own), never Fenced for a claim that landed — the client sends
    no command twice on its own (a second run of the script answered for the second)."""
    from tests.support.cutting_proxy import CuttingProxy

    target = urlsplit(redis_url)
    proxy = CuttingProxy(target.port or 6379)
    await proxy.start()
    via = urlunsplit(target._replace(netloc=f"127.0.0.1:{proxy.port}", path=f"/{TEST_DB}"))
    prefix = f"store-test-{uuid.uuid4().hex[:8]}"
    store = await RedisCommitStore.connect(via, prefix=prefix)
    direct = await RedisCommitStore.connect(db_url(redis_url, TEST_DB), prefix=prefix)
    try:
        thread = ThreadId("t-cut")
        first = activation(thread, "r1", epoch=1, claim="host-a#1")
        await store.append(first, 0, 0, claim="host-a#1")
        proxy.cut_on = b"EVALSHA"  # the next script: it runs, its answer is lost
        with pytest.raises(StoreUnavailable):
            await store.claim(thread, "host-b#2", 1)
        assert proxy.cuts == 1
        landed = await direct.load_head(thread)
        assert (landed.epoch, landed.owner) == (2, "host-b#2")  # it did land
    finally:
        keys = [k async for k in direct.client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await direct.client.delete(*keys)
        await store.close()
        await direct.close()
        await proxy.close()


async def test_a_thread_id_no_command_can_carry_is_refused_typed(store: RedisCommitStore) -> None:
    """An unpaired surrogate cannot be sent as a key: InputRefused(utf8), never a raw
    UnicodeEncodeError out of the driver."""
    from runtime.errors import InputRefused

    for read in (store.load, store.load_head, store.read):
        with pytest.raises(InputRefused) as refused:
            await read(ThreadId("bad\ud800"))
        assert refused.value.limit == "utf8"


@pytest.mark.parametrize("edit", ["run-index", "owner-index", "receipt-gone", "receipt-garbled"])
async def test_verify_names_index_entries_and_receipts_that_are_not_the_thread_s(
    store: RedisCommitStore, edit: str
) -> None:
    """Kept outside a thread's verified keys, yet read by listings, the Supervisor's sweeps
    and retried appends: an entry removed or changed by hand is named by the audit (as
    the SQL stores' run index is), never passed as clean."""
    from runtime.integrity import audit

    thread = ThreadId("t-indexed")
    first = activation(thread, "r1", epoch=1, claim="host-a#1")
    await store.append(first, 0, 0, claim="host-a#1")
    assert await audit(store, thread) == []
    keys = {
        "run-index": (store._index("running"), thread),
        "owner-index": (f"{store.prefix}:owner:host-a", thread),
        "receipt-gone": (store._key(thread, "ops"), first.operation_id),
        "receipt-garbled": (store._key(thread, "ops"), first.operation_id),
    }
    key, field = keys[edit]
    if edit == "receipt-garbled":
        await store.client.hset(key, field, '{"thread_id":')
    else:
        assert await store.client.hdel(key, field) == 1
    (problem,) = await audit(store, thread)
    assert problem.thread == thread


async def test_verify_compares_one_moment_of_a_live_thread_s_indexes(
    store: RedisCommitStore,
) -> None:
    """An append between the audit's read of the head and its read of the indexes: the
    head is read again and one moment compared, not "the run index is not the
    frontier's" for a healthy thread written to as it is audited."""
    from storage.redis_audit import index_problem

    thread = ThreadId("t-live-index")
    first = activation(thread, "r1", epoch=1, claim="host-a#1")
    await store.append(first, 0, 0, claim="host-a#1")
    later = step(thread, "r1", 1, prev=first.payload_hash, epoch=1)

    class AppendedAfterTheHead:
        def __init__(self) -> None:
            self.pending: ThreadCommit | None = later

        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        async def load_head(self, thread_id: ThreadId) -> Frontier:
            head = await store.load_head(thread_id)
            if self.pending is not None:
                commit, self.pending = self.pending, None
                await store.append(commit, 1, 1)  # lands before the indexes are read
            return head

    assert await index_problem(AppendedAfterTheHead(), thread) is None  # type: ignore[arg-type]
    assert (await store.load_head(thread)).version == 2


async def test_a_store_whose_contents_are_lost_fails_closed(redis_url: str) -> None:
    """A FLUSHDB (or a server restarted without persistence) left an empty database that
    passed for the truth: appends were refused as Fenced (the epoch "went back" to 0),
    hosts dropped their Runs as another owner's, and waiters saw version 0 for ever.
    Every read, listing and append of a process connected before it is StoreLost now;
    one that connects afterwards starts on the new, empty store."""
    from runtime.errors import StoreLost

    prefix = f"store-test-{uuid.uuid4().hex[:8]}"
    url = db_url(redis_url, TEST_DB)
    before = await RedisCommitStore.connect(url, prefix=prefix)
    thread = ThreadId("lost-1")
    epoch = (await before.claim(thread, "h#1", 0)).epoch
    await before.append(one_shot(thread, "r1", epoch=epoch), 0, epoch)
    loaded = await before.load(thread)
    assert loaded.version == 1
    keys = [k async for k in before.client.scan_iter(match=f"{prefix}:*")]
    await before.client.delete(*keys)  # the prefix's FLUSHDB
    later = one_shot(thread, "r2", epoch=epoch)
    reads = (
        # flushed between an append's or a claim's read and its script: the script sees it
        before._apply(later, loaded, advance(loaded, later), None),
        before._claim(loaded, "h#1"),
        before.load(thread),
        before.load_head(thread),
        before.read(thread),
        before.list_runs(),
        before.list_runs("running", host="h"),
        before.append(later, 1, epoch),
        before.claim(thread, "h#1", epoch),
    )
    for read in reads:
        with pytest.raises(StoreLost):
            await read
    after = await RedisCommitStore.connect(url, prefix=prefix)
    try:
        assert (await after.load(thread)).version == 0
        fresh = (await after.claim(thread, "h#2", 0)).epoch
        await after.append(one_shot(thread, "r3", epoch=fresh), 0, fresh)
        with pytest.raises(StoreLost):  # the old process still knows better
            await before.load(thread)
        await after.client.delete(f"{prefix}:instance")  # another type, set by hand
        await after.client.hset(f"{prefix}:instance", "token", after.instance or "")
        for listing in (after.list_runs(), after.list_runs("ended")):
            with pytest.raises(StoreLost):  # not the driver's WRONGTYPE, untranslated
                await listing
    finally:
        keys = [k async for k in after.client.scan_iter(match=f"{prefix}:*")]
        await after.client.delete(*keys)
        await after.close()
        await before.close()


async def test_a_run_index_key_of_the_wrong_type_is_left_out_not_every_listing(
    store: RedisCommitStore,
) -> None:
    """``SET P:runs:ended oops``: every listing failed with the driver's WRONGTYPE, and a
    listing of one state refused every thread (each thread's entry is read in every
    state's index), so a Supervisor quarantined every Run for good. That index is left
    out now, logged; the others are listed, and once it is repaired it is listed too."""
    from runtime.ports import refused_in

    done, live = ThreadId("ix-ended"), ThreadId("ix-running")
    for thread in (done, live):
        epoch = (await store.claim(thread, "host-0#1", 0)).epoch
        commit = one_shot(thread, "r") if thread == done else activation(thread, "r", epoch=epoch)
        await store.append(commit.model_copy(update={"epoch": epoch}), 0, epoch)
    ended = f"{store.prefix}:runs:ended"
    saved = await store.client.hgetall(ended)
    await store.client.delete(ended)
    await store.client.set(ended, "oops")
    everything = await store.list_runs()
    assert [s.thread_id for s in everything] == [live] and refused_in(everything) == ()
    running = await store.list_runs("running")
    assert [s.thread_id for s in running] == [live] and refused_in(running) == ()
    assert await store.list_runs("ended") == []
    await store.client.delete(ended)
    await store.client.hset(ended, mapping=saved)
    assert {s.thread_id for s in await store.list_runs()} == {done, live}


async def test_verify_all_finds_a_run_index_entry_naming_no_thread(
    store: RedisCommitStore,
) -> None:
    """A ghost entry (an index names a thread that has no keys) was left out of listings
    and quarantined by the Supervisor, but ``verify --all`` audited only threads with
    keys: "0 threads audited, 0 with problems"."""
    from runtime.integrity import audit

    ghost = ThreadId("ghost-1")
    await store.client.hset(store._index("running"), ghost, '{"thread_id": "ghost-1"}')
    assert ghost in await store.thread_ids()
    (problem,) = await audit(store, ghost)
    assert problem.thread == ghost
