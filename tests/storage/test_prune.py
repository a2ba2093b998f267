"""Retention: ``CommitStore.prune`` on every backend, and ``ratchet prune``.

A thread of three Runs (two ended, the last ended or still running) is pruned through
a Run's end: the frontier loads exactly as before, the records kept read (by cursor
too) and verify as a chain from the anchor, ``audit`` passes and says how far the log
was pruned, and an engine starts a new Run on it. A prune never reaches into a Run
that has not ended, two prunes at once remove each record once, and an anchor edited
by hand makes reads fail closed. The CLI walks the store in pages: ``--dry-run`` says
what would go and removes nothing, ``--keep-last`` keeps the last Runs' logs, and bad
input is one line on stderr.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
import typer
from click.testing import Result
from sqlalchemy import update
from typer.testing import CliRunner

from cluster.cli_prune import register
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.commit import Frontier, ThreadCommit
from runtime.errors import CorruptRecord, InvalidTransition, RunSuperseded
from runtime.history import ForkRefused, HistoryRefused, export, fork
from runtime.ids import RunId, ThreadId
from runtime.integrity import audit, audit_thread
from runtime.lifecycle import EndedState, Natural, RunningState, ThreadStatus
from runtime.messages import AssistantMessage, UserMessage
from runtime.replay_check import ReplayInputError, replay
from runtime.stream import follow
from storage.retention import prune_point, run_logs
from storage.schema import threads

T = ThreadId("pruned")
DAY_US = 86_400_000_000
JAN_1 = int(datetime(2025, 1, 1, tzinfo=UTC).timestamp() * 1_000_000)


# ---- threads of Runs, made of real commits -----------------------------------------------


def _commit(
    frontier: Frontier,
    run: str,
    label: Any,
    disposition: Any,
    text: str,
    status: ThreadStatus | None,
) -> ThreadCommit:
    new_run = frontier.run_id != run
    message: Any = UserMessage(id=f"{run}:input", text=text) if new_run else None
    return ThreadCommit(
        thread_id=frontier.thread_id,
        run_id=RunId(run),
        ordinal=0 if new_run else frontier.next_ordinal,
        label=label,
        disposition=disposition,
        messages=(message or AssistantMessage(text=text),),
        status=status,
        prev=frontier.head,
        epoch=frontier.epoch,
    )


async def _append(store: Any, thread: ThreadId, commit_of: Any) -> int:
    frontier = await store.load(thread)
    receipt = await store.append(commit_of(frontier), frontier.version, frontier.epoch)
    return int(receipt.seq)


async def run_on(
    store: Any, thread: ThreadId, run: str, ended_at: int | None = JAN_1, steps: int = 1
) -> int:
    """A Run of ``steps`` inferences, ended at ``ended_at`` (None: left running); returns
    the seq of its last record."""
    running = RunningState(run_id=RunId(run))
    status = ThreadStatus(state="running", since=(ended_at or JAN_1) - 1000)
    seq = await _append(
        store, thread, lambda f: _commit(f, run, "activation", running, "go", status)
    )
    for i in range(steps):
        seq = await _append(
            store, thread, lambda f, i=i: _commit(f, run, "inference", running, f"s{i}", None)
        )
    if ended_at is None:
        return seq
    end = EndedState(run_id=RunId(run), cause=Natural())
    idle = ThreadStatus(state="idle", since=ended_at, reason="natural")
    return await _append(store, thread, lambda f: _commit(f, run, "ended", end, "done", idle))


async def three_runs(store: Any, thread: ThreadId = T, last_ends: bool = True) -> list[int]:
    """Runs ended on Jan 1st and 2nd, then one ended on the 3rd (or running): their ends."""
    return [
        await run_on(store, thread, "r1", JAN_1),
        await run_on(store, thread, "r2", JAN_1 + DAY_US, steps=2),
        await run_on(store, thread, "r3", JAN_1 + 2 * DAY_US if last_ends else None),
    ]


def _same(a: Frontier, b: Frontier) -> None:
    assert a.model_dump() == b.model_dump()


# ---- the store ---------------------------------------------------------------------------


async def test_pruning_an_ended_run_keeps_the_frontier_and_the_rest_verifies(store: Any) -> None:
    ends = await three_runs(store)
    before = await store.load(T)
    everything = await store.read(T)
    assert await store.prune(T, ends[0]) == ends[0]
    _same(await store.load(T), before)
    kept = await store.read(T)
    assert kept == everything[ends[0] :]
    assert kept[0].commit.prev == everything[ends[0] - 1].commit.payload_hash  # the anchor
    for after in (0, 1, ends[0], ends[0] + 1, ends[2]):  # cursors before, at, past the anchor
        assert await store.read(T, after_seq=after) == everything[max(after, ends[0]) :]
    assert await audit_thread(store, T) == ([], ends[0])
    assert await store.prune(T, ends[0]) == 0  # nothing left to remove there
    assert await store.prune(T, ends[2]) == ends[2] - ends[0]  # the whole log
    _same(await store.load(T), before)
    assert await store.read(T) == [] and await store.read(T, after_seq=ends[1]) == []
    assert await audit_thread(store, T) == ([], ends[2])


async def test_only_the_end_of_an_ended_run_can_be_pruned_through(store: Any) -> None:
    ends = await three_runs(store, last_ends=False)
    everything = await store.read(T)
    for seq in (0, 1, ends[0] + 1, ends[1] + 1, ends[2], ends[2] + 1):
        with pytest.raises(InvalidTransition):
            await store.prune(T, seq)
    with pytest.raises(InvalidTransition):
        await store.prune(ThreadId("nobody"), 1)
    assert await store.read(T) == everything  # nothing removed
    assert await store.prune(T, ends[1]) == ends[1]
    with pytest.raises(InvalidTransition):  # the running Run's records stay, all of them
        await store.prune(T, ends[2])
    assert [r.seq for r in await store.read(T)] == list(range(ends[1] + 1, ends[2] + 1))
    assert await audit(store, T) == []


async def test_a_running_run_goes_on_after_earlier_runs_are_pruned(store: Any) -> None:
    ends = await three_runs(store, last_ends=False)
    assert await store.prune(T, ends[1]) == ends[1]
    running = RunningState(run_id=RunId("r3"))
    seq = await _append(store, T, lambda f: _commit(f, "r3", "inference", running, "on", None))
    end = EndedState(run_id=RunId("r3"), cause=Natural())
    idle = ThreadStatus(state="idle", since=JAN_1 + 3 * DAY_US, reason="natural")
    seq = await _append(store, T, lambda f: _commit(f, "r3", "ended", end, "done", idle))
    records = await store.read(T)
    assert [r.seq for r in records] == list(range(ends[1] + 1, seq + 1))
    assert [r.commit.run_id for r in records] == ["r3"] * len(records)
    assert await audit(store, T) == []


async def test_an_engine_starts_a_new_run_on_a_pruned_thread(store: Any) -> None:
    ends = await three_runs(store)
    assert await store.prune(T, ends[2]) == ends[2]
    pruned = await store.load(T)
    anchor = pruned.head
    agent = Agent(name="again", model=ScriptedModel([ModelResponse(text="hi again")]))
    frontier = await InProcessRunner(agent, store).start("once more", thread_id=T)
    assert isinstance(frontier.run_state, EndedState) and frontier.messages[-1].text == "hi again"
    records = await store.read(T)
    assert records[0].seq == ends[2] + 1 and records[0].commit.prev == anchor
    assert frontier.messages[:-2] == pruned.messages  # every Run's messages are kept
    assert await audit_thread(store, T) == ([], ends[2])
    done = await store.load(T)
    assert await store.prune(T, done.version) == done.version - ends[2]
    assert await audit_thread(store, T) == ([], done.version)
    _same(await store.load(T), done)


async def test_a_thread_pruned_through_its_head_is_named_pruned_everywhere(store: Any) -> None:
    """Only the frontier is kept: a follower is told the facts after its cursor were
    pruned and stops at its status (it waited forever for facts the store no longer
    keeps), and a fork, an export or a replay says the thread was pruned (they said it
    had no commits)."""
    ends = await three_runs(store)
    assert await store.prune(T, ends[1]) == ends[1]
    with pytest.raises(HistoryRefused, match="from seq") as partly:
        await export(store, T)
    assert partly.value.reason == "pruned"
    assert await store.prune(T, ends[2]) == ends[2] - ends[1]
    for cursor in (None, "1:0", f"{ends[1]}:0"):
        fs = [f async for f in asyncio_timeout(follow(store, T, cursor, poll_s=0.01))]
        assert [(f.type, f.pruned_through) for f in fs] == [
            ("thread_status", None),
            ("pruned", ends[2]),
        ]
    fs = [f async for f in asyncio_timeout(follow(store, T, f"{ends[2]}:0", poll_s=0.01))]
    assert [f.type for f in fs] == ["thread_status"]  # it saw the end: nothing missed
    with pytest.raises(ForkRefused, match="keeps no records") as forked:
        await fork(store, T, 1, ThreadId("copy"))
    with pytest.raises(HistoryRefused, match="keeps no records") as exported:
        await export(store, T)
    assert forked.value.reason == exported.value.reason == "pruned"
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="unused")]))
    with pytest.raises(ReplayInputError, match="pruned"):
        await replay(store, T, agent)
    assert (await store.load(ThreadId("copy"))).version == 0


async def asyncio_timeout(frames: Any, within_s: float = 10.0) -> Any:
    """The frames, failing (not hanging) if they do not end within ``within_s``."""
    async with asyncio.timeout(within_s):
        async for frame in frames:
            yield frame


async def test_a_start_retried_after_its_run_was_pruned_does_not_run_it_again(
    store: Any,
) -> None:
    """A start is idempotent by run id; an earlier Run's start receipt goes with a prune,
    yet its input message stays in the history: a retried start of it is that Run's
    repeat, never a second Run under the same id (its tool calls would reuse their
    operation ids). Its end, which would answer it, went with the prune: RunSuperseded
    says so (not the later Run's frontier, as if it were this one's); with another input
    it is refused."""
    agent = Agent(name="again", model=ScriptedModel([ModelResponse(text="hi")] * 3))
    runner = InProcessRunner(agent, store)
    first = await runner.start("first", thread_id=T, run_id="run-x")
    second = await runner.start("second", thread_id=T, run_id="run-y")
    assert (await runner.start("first", thread_id=T, run_id="run-x")).version == first.version
    assert await store.prune(T, second.version) == second.version
    with pytest.raises(RunSuperseded, match="run-y"):
        await runner.start("first", thread_id=T, run_id="run-x")
    # the id asked by another agent (a cluster's input message names it), once its
    # receipts are gone: refused — it started a second Run under the id, whose repeat
    # then answered with that Run
    asked = "run-x:input|hosted|pkg.mod:other"
    with pytest.raises(InvalidTransition, match="run-x already ran"):
        await runner.engine().start(T, "first", run_id=RunId("run-x"), message_id=asked)
    with pytest.raises(InvalidTransition, match="another input"):
        await runner.start("not the first", thread_id=T, run_id="run-x")
    assert (await store.load(T)).version == second.version  # nothing was written


async def test_two_prunes_at_once_remove_each_record_once(store: Any) -> None:
    ends = await three_runs(store)
    before = await store.load(T)
    same = await asyncio.gather(store.prune(T, ends[0]), store.prune(T, ends[0]))
    assert sorted(same) == [0, ends[0]]
    other = ThreadId("other")
    far = await three_runs(store, other)
    both = await asyncio.gather(*(store.prune(other, e) for e in (far[1], far[0], far[2])))
    assert sum(both) == far[2]
    racing = await asyncio.gather(*(store.prune(T, ends[2]) for _ in range(4)))
    assert sum(racing) == ends[2] - ends[0]
    for thread in (T, other):
        assert await store.read(thread) == []
        assert await audit_thread(store, thread) == ([], ends[2])
    _same(await store.load(T), before)


async def test_a_prune_beside_appends_to_the_same_thread(store: Any) -> None:
    """The running Run appends while its thread's ended Runs are pruned: both land."""
    ends = await three_runs(store, last_ends=False)
    running = RunningState(run_id=RunId("r3"))

    async def appends() -> None:
        for i in range(10):
            await _append(
                store, T, lambda f, i=i: _commit(f, "r3", "inference", running, f"{i}", None)
            )
            await asyncio.sleep(0)

    pruned, _ = await asyncio.gather(store.prune(T, ends[1]), appends())
    assert pruned == ends[1]
    frontier = await store.load(T)
    assert frontier.version == ends[2] + 10
    assert [r.seq for r in await store.read(T)] == list(range(ends[1] + 1, frontier.version + 1))
    assert await audit(store, T) == []


async def test_reads_beside_prunes_see_a_log_that_verifies(store: Any) -> None:
    """Every read and load while prunes cut the log Run by Run returns a suffix of it
    that verifies (SQL reads the anchor and the records in two statements: a cut in
    between is read again, never taken for damage)."""
    ends = [await run_on(store, T, f"r{i}", JAN_1 + i, steps=3) for i in range(12)]
    everything = await store.read(T)
    before = await store.load(T)
    done = False

    async def reads() -> int:
        n = 0
        while not done:
            for after in (0, 5, 20):
                got = await store.read(T, after_seq=after)
                assert got == everything[len(everything) - len(got) :] and got
                assert got[0].seq > after
            _same(await store.load(T), before)
            n += 1
            await asyncio.sleep(0)  # the in-memory store never yields by itself
        return n

    async def prunes() -> None:
        nonlocal done
        for end in ends[:-1]:
            assert await store.prune(T, end) > 0
            await asyncio.sleep(0)
        done = True

    counted, _ = await asyncio.gather(reads(), prunes())
    assert counted > 0
    assert await audit_thread(store, T) == ([], ends[-2])


async def _set_anchor(store: Any, backend: str, through: int, hash_: str) -> None:
    """Hand-edit a pruned thread's anchor where the backend keeps it."""
    if backend == "memory":
        store.set_anchor(T, (through, hash_))
    elif backend == "redis":
        await store.client.hset(
            f"ratchet:thread:{T}:meta", mapping={"pruned": through, "pruned_hash": hash_}
        )
    else:
        async with store.engine.begin() as conn:
            stmt = update(threads).where(threads.c.thread_id == T)
            await conn.execute(stmt.values(pruned_through=through, pruned_hash=hash_))


async def test_an_anchor_edited_by_hand_fails_closed(store: Any, backend: str) -> None:
    ends = await three_runs(store)
    everything = await store.read(T)
    await store.prune(T, ends[0])
    anchor = everything[ends[0] - 1].commit.payload_hash
    bad = "0" * 64
    await _set_anchor(store, backend, ends[0], bad)  # the first record kept does not name it
    with pytest.raises(CorruptRecord) as info:
        await store.read(T)
    assert (info.value.thread, info.value.seq) == (T, ends[0] + 1)
    assert [p.seq for p in await audit(store, T)] == [ends[0] + 1]
    # says a record is kept that is gone, or one is gone that is kept (a Redis list holds
    # no seqs: it may name another seq of the thread)
    for through in (ends[0] - 1, ends[0] + 1):
        await _set_anchor(store, backend, through, anchor)
        with pytest.raises(CorruptRecord) as info:
            await store.read(T)
        assert info.value.thread == T
        assert [p.thread for p in await audit(store, T)] == [T]
    await _set_anchor(store, backend, ends[0], anchor)
    assert await audit(store, T) == []
    await store.prune(T, ends[2])  # pruned through its head: the load checks the anchor
    await _set_anchor(store, backend, ends[2], bad)
    with pytest.raises(CorruptRecord) as info:
        await store.load(T)
    assert (info.value.thread, info.value.seq) == (T, ends[2])
    with pytest.raises(CorruptRecord):
        await store.read(T)
    agent = Agent(name="again", model=ScriptedModel([ModelResponse(text="no")]))
    with pytest.raises(CorruptRecord):  # no engine acts on it
        await InProcessRunner(agent, store).start("once more", thread_id=T)


# ---- choosing what to prune --------------------------------------------------------------


async def test_the_prune_point_keeps_runs_ended_after_the_date_and_the_last_ones(
    store: Any,
) -> None:
    if store.__class__.__name__ != "MemoryCommitStore":
        pytest.skip("a pure choice: one backend shows it")
    ends = await three_runs(store)
    runs = run_logs(await store.read(T))
    assert [(r.run_id, r.end, r.ended_at) for r in runs] == [
        ("r1", ends[0], JAN_1),
        ("r2", ends[1], JAN_1 + DAY_US),
        ("r3", ends[2], JAN_1 + 2 * DAY_US),
    ]
    assert prune_point(runs, JAN_1) == 0  # before: not ended before it
    assert prune_point(runs, JAN_1 + 1) == ends[0]
    assert prune_point(runs, JAN_1 + 5 * DAY_US) == ends[2]
    assert prune_point(runs, JAN_1 + 5 * DAY_US, keep_last=1) == ends[1]
    assert prune_point(runs, JAN_1 + 5 * DAY_US, keep_last=3) == 0
    running = [*runs[:2], runs[2]._replace(end=None, ended_at=None)]
    assert prune_point(running, JAN_1 + 5 * DAY_US) == ends[1]


# ---- the command -------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command()
    def other() -> None:  # with two commands, ``prune`` is named on the command line
        """Nothing."""

    return app


async def ratchet(*args: str) -> Result:
    """``ratchet ARGS`` in-process (its own loop, in a worker thread)."""
    return await asyncio.to_thread(CliRunner().invoke, _app(), list(args))


@pytest.fixture
def url(backend: str, backend_url: str) -> str:
    if backend == "memory":
        pytest.skip("an in-memory store lives in one process: the command cannot open it")
    return backend_url


async def test_the_command_dry_run_then_prune(store: Any, url: str) -> None:
    ends = await three_runs(store)
    others = [ThreadId(f"t{i}") for i in range(5)]
    for thread in others:
        await three_runs(store, thread, last_ends=False)
    before = {t: await store.read(t) for t in (T, *others)}
    jan_2 = "2025-01-02T12:00:00+00:00"  # after r1 and r2 ended, before r3

    dry = await ratchet(
        "prune", "--ended-before", jan_2, "--batch", "2", "--dry-run", "--store", url
    )
    assert dry.exit_code == 0, dry.output
    assert {t: await store.read(t) for t in before} == before  # nothing removed
    assert "round 3: 6 threads scanned" in dry.stdout  # pages of two
    removed = 6 * ends[1]
    assert f"dry run: 6 of 6 threads would be pruned, {removed} records" in dry.stdout

    kept = await ratchet("prune", "--ended-before", jan_2, "--keep-last", "2", "--store", url)
    assert kept.exit_code == 0, kept.output
    assert f"pruned 6 of 6 threads, {6 * ends[0]} records removed" in kept.stdout
    done = await ratchet("prune", "--ended-before", "2025-01-02", "--store", url)  # r1 only
    assert "pruned 0 of 6 threads, 0 records removed" in done.stdout, done.output
    real = await ratchet("prune", "--ended-before", jan_2, "--store", url)
    assert real.exit_code == 0, real.output
    assert f"pruned 6 of 6 threads, {6 * (ends[1] - ends[0])} records removed" in real.stdout
    for thread in (T, *others):
        assert await store.read(thread) == before[thread][ends[1] :]
        assert await audit_thread(store, thread) == ([], ends[1])
    again = await ratchet("prune", "--ended-before", jan_2, "--store", url)
    assert "pruned 0 of 6 threads, 0 records removed" in again.stdout, again.output
    from cluster.cli import app as ratchet_app  # ratchet verify on what is left

    verify = CliRunner().invoke
    one = await asyncio.to_thread(verify, ratchet_app, ["verify", T, "--store", url])
    assert one.exit_code == 0, one.output
    assert f"{T}: pruned through seq {ends[1]}" in one.stdout
    every = await asyncio.to_thread(verify, ratchet_app, ["verify", "--all", "--store", url])
    assert "6 threads audited, 0 with problems (6 pruned" in every.stdout, every.output


async def test_the_command_names_a_thread_it_cannot_prune_and_goes_on(
    store: Any, url: str, corrupt: Any
) -> None:
    await three_runs(store)
    ends = await three_runs(store, ThreadId("fine"))
    await corrupt(T, 2, '{"not": "a commit"}')
    result = await ratchet("prune", "--ended-before", "2030-01-01", "--store", url)
    assert result.exit_code == 1
    assert f"skipped: thread {T!r}" in result.stderr and "seq 2" in result.stderr
    assert f"pruned 1 of 2 threads, {ends[2]} records removed, 1 skipped" in result.stdout
    assert await store.read(ThreadId("fine")) == []


async def test_a_thread_whose_frontier_does_not_verify_is_not_pruned_copied_or_exported(
    store: Any, url: str, corrupt_frontier: Any
) -> None:
    """Its log verifies, its frontier does not: the log is the intact copy of its history.
    A prune that read only the log removed it (exit 0, the thread still unreadable); a
    fork or export took it as whole (a fork passed ``verify``: the damage laundered)."""
    ends = await three_runs(store)
    await corrupt_frontier(T, 1, '{"thread_id": "tampered", "version": 1}')
    with pytest.raises(CorruptRecord):
        await store.prune(T, ends[0])
    with pytest.raises(CorruptRecord):
        await fork(store, T, ends[0], ThreadId("copy"))
    with pytest.raises(CorruptRecord):
        await export(store, T)
    result = await ratchet("prune", "--ended-before", "2030-01-01", "--store", url)
    assert result.exit_code == 1 and f"skipped: thread {T!r}" in result.stderr
    assert len(await store.read(T)) == ends[2]  # every record kept
    assert (await store.load_head(ThreadId("copy"))).version == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--ended-before", "yesterday"], "--ended-before must be a date"),
        (["--ended-before", "2025-01-01", "--keep-last", "-1"], "--keep-last must be 0 or more"),
        (["--ended-before", "2025-01-01", "--batch", "0"], "--batch must be 1 to 10000"),
        # a page no store can ask for was the store's OverflowError, the store opened
        (["--ended-before", "2025-01-01", "--batch", "9" * 20], "--batch must be 1 to 10000"),
    ],
)
async def test_bad_input_is_one_line(tmp_path: Any, args: list[str], words: str) -> None:
    result = await ratchet("prune", *args, "--store", f"sqlite:///{tmp_path}/s.db")
    assert result.exit_code == 1
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s.db").exists()  # refused before the store is opened


def test_a_date_to_the_microsecond_is_that_microsecond() -> None:
    """The cutoff was ``int(timestamp() * 10**6)``: a float a hair below the exact value
    made it a microsecond early (a Run ended just before the date kept) for this date,
    and about one in a hundred others; offsets and far dates are exact too."""
    from cluster.cli_prune import cutoff_of

    assert cutoff_of("2040-04-07T06:07:31.046169+00:00") == 2_217_391_651_046_169
    assert cutoff_of("2040-04-07T08:07:31.046169+02:00") == 2_217_391_651_046_169
    assert cutoff_of("9999-12-31T23:59:59.999999") == 253_402_300_799_999_999
    assert cutoff_of("0001-01-01T00:00:00+05:00") == -62_135_614_800_000_000


# ---- upgrading a store written before retention ------------------------------------------


async def test_a_store_from_before_retention_upgrades(
    store: Any, backend: str, backend_url: str
) -> None:
    """SQL schema 4 (no anchor columns) and Redis layout 2 (no anchors) open as stores
    with nothing pruned; their threads then prune like any other."""
    if backend == "memory":
        pytest.skip("nothing is stored to upgrade")
    ends = await three_runs(store)
    everything = await store.read(T)
    await store.close()
    if backend == "redis":
        from storage.redis_store import RedisCommitStore

        old = await RedisCommitStore.connect(backend_url)
        await old.client.set("ratchet:schema", "2")
        await old.close()
        store = await RedisCommitStore.connect(backend_url)
        assert await store.client.get("ratchet:schema") == "4"
    else:
        from sqlalchemy import delete as sql_delete
        from sqlalchemy import inspect, text

        from storage.schema import schema_version
        from storage.sql import SqlCommitStore

        old = await SqlCommitStore.connect(backend_url)
        async with old.engine.begin() as conn:
            await conn.execute(sql_delete(schema_version).where(schema_version.c.version >= 5))
            for column in ("pruned_through", "pruned_hash", "pruned_digest"):
                await conn.execute(text(f"ALTER TABLE ratchet_threads DROP COLUMN {column}"))
            await conn.execute(text("DROP TABLE ratchet_pruned_messages"))
        await old.close()
        store = await SqlCommitStore.connect(backend_url)
        async with store.engine.connect() as conn:
            names = await conn.run_sync(
                lambda c: {col["name"] for col in inspect(c).get_columns("ratchet_threads")}
            )
        assert {"pruned_through", "pruned_hash", "pruned_digest"} <= names
    try:
        assert await store.read(T) == everything
        assert await store.prune(T, ends[1]) == ends[1]
        assert await audit_thread(store, T) == ([], ends[1])
    finally:
        await store.close()


async def test_a_damaged_pruned_history_is_named_and_the_command_goes_on(
    sql_store: Any, tmp_path: Any
) -> None:
    """A row of a thread's pruned history deleted by hand: the next prune of it cannot
    number its rows; it is that thread's CorruptRecord (it said "other prunes kept moving
    its anchor", a StoreError `ratchet prune` stopped at), which the command names and
    skips (``test_the_command_names_a_thread_it_cannot_prune_and_goes_on``)."""
    from sqlalchemy import text

    from runtime.errors import CorruptRecord
    from storage.schema import pruned_messages

    ends = await three_runs(sql_store)
    await sql_store.prune(T, ends[0])
    async with sql_store.engine.begin() as conn:
        await conn.execute(
            text(f"DELETE FROM {pruned_messages.name} WHERE thread_id = :t AND idx = 0"), {"t": T}
        )
    with pytest.raises(CorruptRecord):
        await sql_store.prune(T, ends[1])


async def _add_to_pruned_history(store: Any, thread: ThreadId, text: str) -> None:
    """A message put into the thread's pruned history by hand, as each backend keeps it."""
    from sqlalchemy import text as sql

    from storage.memory import MemoryCommitStore
    from storage.schema import pruned_messages

    if isinstance(store, MemoryCommitStore):
        store._threads[thread].history.append(text)
    elif hasattr(store, "engine"):
        async with store.engine.begin() as conn:
            count = f"SELECT count(*) FROM {pruned_messages.name} WHERE thread_id = :t"
            idx = (await conn.execute(sql(count), {"t": thread})).scalar()
            insert = (
                f"INSERT INTO {pruned_messages.name} (thread_id, idx, body) VALUES (:t, :i, :b)"
            )
            await conn.execute(sql(insert), {"t": thread, "i": idx, "b": text})
    else:
        await store.client.rpush(store._key(thread, "history"), text)


@pytest.mark.parametrize("pruned_first", [False, True], ids=["never-pruned", "pruned"])
async def test_a_pruned_history_added_to_by_hand_is_not_pruned_into(
    store: Any, pruned_first: bool
) -> None:
    """An entry put into a thread's pruned history by hand: a thread never pruned
    verified (no history is read), and its first prune numbered its messages after the
    stranger, so no load verified it again (an awaiting Run could never be resumed), and
    a pruned one the same way. Now CorruptRecord, with nothing removed."""
    ends = await three_runs(store)
    if pruned_first:
        await store.prune(T, ends[0])
    await _add_to_pruned_history(store, T, '{"kind":"user","id":"x","text":"planted"}')
    before = await store.read(T)
    with pytest.raises(CorruptRecord, match="pruned history"):
        await store.prune(T, ends[1])
    assert await store.read(T) == before  # nothing removed
    # the stranger lies past what the anchor vouches for: loads do not read it
    assert (await store.load(T)).version == ends[2]
    # an audit names it (``ratchet verify`` passed the thread the prune refused)
    [problem] = await audit(store, T)
    assert "the pruned history holds" in problem.detail and problem.seq == (
        ends[0] if pruned_first else 0
    )


async def _edit_pruned_history(store: Any, thread: ThreadId) -> None:
    """The first message of the thread's pruned history edited by hand."""
    from sqlalchemy import text as sql

    from storage.memory import MemoryCommitStore
    from storage.schema import pruned_messages

    edited = '{"kind":"user","id":"x","text":"edited"}'
    if isinstance(store, MemoryCommitStore):
        store._threads[thread].history[0] = edited
    elif hasattr(store, "engine"):
        async with store.engine.begin() as conn:
            change = f"UPDATE {pruned_messages.name} SET body = :b WHERE thread_id = :t AND idx = 0"
            await conn.execute(sql(change), {"t": thread, "b": edited})
    else:
        await store.client.lset(store._key(thread, "history"), 0, edited)


async def test_a_thread_whose_pruned_history_does_not_verify_is_not_pruned(store: Any) -> None:
    """A message of the pruned history edited by hand: every load said CorruptRecord,
    yet ``ratchet prune`` pruned the thread on (it verified the head and the records
    only), and said nothing."""
    ends = await three_runs(store)
    await store.prune(T, ends[0])
    await _edit_pruned_history(store, T)
    before = await store.read(T)
    with pytest.raises(CorruptRecord, match="pruned history"):
        await store.prune(T, ends[1])
    assert await store.read(T) == before


async def test_an_anchor_that_is_no_seq_fails_closed(sql_store: Any) -> None:
    """``pruned_through`` set below 1 by hand: loads, exports and starts went ahead, and
    a prune said "other prunes kept moving its anchor" (Redis refused it already)."""
    ends = await three_runs(sql_store)
    async with sql_store.engine.begin() as conn:
        await conn.execute(
            update(threads).where(threads.c.thread_id == T).values(pruned_through=-1)
        )
    for attempt in (sql_store.load(T), sql_store.read(T), sql_store.prune(T, ends[0])):
        with pytest.raises(CorruptRecord, match="anchor -1 is no seq"):
            await attempt


async def test_the_dry_run_names_a_thread_the_prune_would_refuse(store: Any, url: str) -> None:
    """The dry run reads as the prune does (``read_for_prune``): a thread whose pruned
    history does not verify was counted as one it would prune."""
    ends = await three_runs(store)
    await store.prune(T, ends[0])
    await _edit_pruned_history(store, T)
    said = await ratchet("prune", "--ended-before", "2100-01-01", "--dry-run", "--store", url)
    assert said.exit_code == 1, said.output
    assert f"skipped: thread {T!r}" in said.output and "pruned history" in said.output


async def test_the_command_leaves_a_copy_being_written_dry_run_or_not(store: Any, url: str) -> None:
    """A half-written import: the prune skips it, naming why (and exits 1); the dry run
    says the same, not that it would prune it."""
    from runtime.errors import StoreUnavailable
    from runtime.history import import_thread

    from .test_fork_export import CutOff

    ends = await three_runs(store)
    copy = ThreadId("copy-half")
    with pytest.raises(StoreUnavailable):
        await import_thread(CutOff(store, ends[1] + 1), list(await export(store, T)), copy)
    for dry in (["--dry-run"], []):
        args = ["prune", "--ended-before", "2100-01-01", *dry, "--store", url]
        said = await ratchet(*args)
        assert said.exit_code == 1, said.output
        assert "skipped: thread 'copy-half'" in said.output and "being written" in said.output
    assert (await store.load(copy)).version == ends[1] + 1  # nothing pruned


async def test_the_dry_run_names_a_thread_whose_pruned_history_was_added_to(
    store: Any, url: str
) -> None:
    """A pruned history added to by hand: the prune skips the thread (CorruptRecord),
    yet the dry run counted it as one it would prune and exited 0 (it read the
    history's vouched messages only, never how many the store holds)."""
    ends = await three_runs(store)
    await store.prune(T, ends[0])
    await _add_to_pruned_history(store, T, '{"kind":"user","id":"x","text":"planted"}')
    dry = await ratchet("prune", "--ended-before", "2030-01-01", "--dry-run", "--store", url)
    real = await ratchet("prune", "--ended-before", "2030-01-01", "--store", url)
    assert dry.exit_code == real.exit_code == 1, (dry.output, real.output)
    for result in (dry, real):
        assert f"skipped: thread {T!r}" in result.stderr and "pruned history" in result.stderr
    assert "0 of 1 threads would be pruned, 0 records would be removed, 1 skipped" in dry.stdout
    assert len(await store.read(T)) == ends[2] - ends[0]  # nothing removed
