"""Thread history on every store: fork at rest, export and import (``runtime.history``).

The threads are real Runs (``InProcessRunner``, ``ScriptedModel``): a two-Run thread
whose Runs each look a key up and answer ("one", then "two"), and a Run that waits for
permission to delete. The commands are driven through a fresh Typer app with
``cluster.cli_history.register`` (``CliRunner``, in a worker thread: the CLI owns its
event loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
from click.testing import Result
from typer.testing import CliRunner

from cluster.cli_history import register
from runtime import (
    Agent,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    call,
    tool,
)
from runtime.commit import Frontier, ThreadCommit, assemble_commit
from runtime.errors import InputRefused, InvalidTransition, RunEnded, StoreUnavailable
from runtime.history import (
    ForkRefused,
    HistoryRefused,
    ImportRefused,
    export,
    fork,
    fork_owner,
    import_thread,
)
from runtime.history_format import MAX_LINE_BYTES
from runtime.ids import RunId, ThreadId
from runtime.integrity import audit
from runtime.lifecycle import AwaitingState, Cancelled, EndedState, RunningState, answer
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.messages import UserMessage
from runtime.rules import replay
from runtime.state import Command
from runtime.tools import ToolResult
from storage.memory import MemoryCommitStore
from storage.sql import SqlCommitStore
from tests.storage.test_prune import run_on

T = ThreadId("history")
F = ThreadId("history-fork")
REDIS_DB = 11
"""This file's own Redis database (the shared fixture's db 9 is flushed by other suites)."""


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


# ---- the threads ----------------------------------------------------------------------------


def _input(request: Any) -> str:
    return str([m for m in request.messages if m.kind == "user"][-1].text)


def history_agent() -> Agent:
    """Step 0 looks the input up (or asks to delete it), step 1 answers it."""

    @tool(recovery=("replay_safe",))
    def lookup(key: str) -> str:
        return f"value of {key}"

    @tool(needs_permission=True)
    def delete(path: str) -> str:
        return f"deleted {path}"

    def first(request: Any) -> ModelResponse:
        text = _input(request)
        if text.startswith("delete "):
            return ModelResponse(tool_calls=(call("delete", "c1", path=text[7:]),))
        return ModelResponse(text="looking", tool_calls=(call("lookup", "c1", key=text),))

    def second(request: Any) -> ModelResponse:
        return ModelResponse(text=f"answered {_input(request)}")

    return Agent(name="history", model=ScriptedModel([first, second]), tools=[lookup, delete])


async def two_runs(store: Any) -> tuple[InProcessRunner, int]:
    """Runs "one" and "two" on T; returns the runner and the seq where "one" ended."""
    runner = InProcessRunner(history_agent(), store)
    first = await runner.start("one", thread_id=T)
    await runner.start("two", thread_id=T)
    return runner, first.version


async def stored(store: Any, thread: str) -> list[tuple[int, str, str]]:
    """The records as the store holds them: seq, body text, hash."""
    return [(r.seq, r.commit.encoded, r.commit.payload_hash) for r in await store.read(thread)]


def history(frontier: Frontier) -> dict[str, Any]:
    """A frontier but for what names its thread and owner."""
    return frontier.model_dump(mode="json", exclude={"thread_id", "head", "epoch", "owner"})


def texts(frontier: Frontier) -> list[str]:
    return [m.text for m in frontier.messages if m.kind in ("user", "assistant")]


# ---- fork ----------------------------------------------------------------------------------


async def test_a_fork_at_rest_verifies_and_drives_on_apart(store: Any) -> None:
    runner, end_of_one = await two_runs(store)
    before, loaded = await stored(store, T), await store.load(T)
    forked = await fork(store, T, end_of_one, F)
    assert await audit(store, F) == []
    originals = (await store.read(T))[:end_of_one]
    assert history(forked) == history(replay(T, [r.commit for r in originals]))
    assert (forked.version, forked.epoch, forked.owner) == (
        end_of_one,
        1,
        fork_owner(T, end_of_one),
    )
    copies = await store.read(F)
    for copy, original in zip(copies, originals, strict=True):
        new, old = copy.commit, original.commit
        assert new.thread_id == F and new.epoch == 1
        parts = ("run_id", "ordinal", "label", "disposition", "messages", "batch", "events")
        assert [getattr(new, p) for p in parts] == [getattr(old, p) for p in parts]
    assert [r.commit.claim for r in copies] == [fork_owner(T, end_of_one)] + [None] * (
        end_of_one - 1
    )

    driven = await runner.start("three", thread_id=F)
    assert texts(driven) == ["one", "looking", "answered one", "three", "looking", "answered three"]
    assert texts(await store.load(T))[3:] == ["two", "looking", "answered two"]
    assert driven.epoch == 2 and driven.run_id != loaded.run_id
    assert await stored(store, T) == before and await store.load(T) == loaded  # untouched
    assert await audit(store, F) == [] and await audit(store, T) == []


async def test_a_fork_is_refused_where_the_run_was_not_at_rest(store: Any) -> None:
    _, end_of_one = await two_runs(store)
    labels = [r.commit.label for r in await store.read(T)][:end_of_one]
    assert labels == ["activation", "inference", "results", "ended"]
    # results staged but not yet published: every call terminal, the batch still open
    for seq, reason in ((1, "run_running"), (2, "batch_open"), (3, "batch_open")):
        with pytest.raises(ForkRefused) as refused:
            await fork(store, T, seq, F)
        assert refused.value.reason == reason
        assert f"seq {seq}" in str(refused.value) and reason in str(refused.value)
    assert (await store.load(F)).version == 0 and F not in await store.thread_ids()


async def test_an_awaiting_run_is_not_at_rest_for_a_fork(store: Any) -> None:
    """Waiting for permission (its batch open) or paused (no batch): both refused, as the
    Run's ticket and tool operation ids would be in two threads. Once it ended, the fork
    carries its history, the ticket re-addressed to the new thread."""
    runner = InProcessRunner(history_agent(), store)
    waiting = await runner.start("delete SAFE", thread_id=T)
    assert isinstance(waiting.run_state, AwaitingState)
    with pytest.raises(ForkRefused) as refused:
        await fork(store, T, waiting.version, F)
    assert refused.value.reason == "batch_open"
    engine = runner.engine()
    engine.pause()
    paused = await engine.start(ThreadId("paused"), "one")
    assert isinstance(paused.run_state, AwaitingState) and paused.batch is None
    with pytest.raises(ForkRefused) as refused:
        await fork(store, ThreadId("paused"), paused.version, F)
    assert refused.value.reason == "run_awaiting" and "awaits pause" in str(refused.value)

    done = await runner.resume(answer(waiting.run_state.ticket, PermissionDecision(approve=True)))
    forked = await fork(store, T, done.version, F)
    assert history(forked) == history(done) and await audit(store, F) == []
    waits = [r.commit for r in await store.read(F) if r.commit.label == "awaiting"]
    assert len(waits) == 1 and isinstance(waits[0].disposition, AwaitingState)
    assert waits[0].disposition.ticket.thread_id == F
    fact = next(e for e in waits[0].facts if e.type == "awaiting")
    assert fact.data["ticket"]["thread_id"] == F


async def test_a_fork_refuses_what_it_cannot_start_from(store: Any) -> None:
    _, end_of_one = await two_runs(store)
    await InProcessRunner(history_agent(), store).start("one", thread_id="other")
    threads = await store.thread_ids()
    cases: list[tuple[ThreadId, int, ThreadId, str]] = [
        (ThreadId("nobody"), 1, F, "unknown_thread"),
        (T, 0, F, "beyond_head"),
        (T, 9, F, "beyond_head"),
        # no seq: "4" and None raised TypeError, True forked at seq 1
        (T, "4", F, "beyond_head"),  # type: ignore[list-item]
        (T, 4.0, F, "beyond_head"),  # type: ignore[list-item]
        (T, None, F, "beyond_head"),  # type: ignore[list-item]
        (T, True, F, "beyond_head"),
        (T, end_of_one, T, "thread_exists"),
        (T, end_of_one, ThreadId("other"), "thread_exists"),
    ]
    for source, seq, target, reason in cases:
        with pytest.raises(ForkRefused) as refused:
            await fork(store, source, seq, target)
        assert refused.value.reason == reason, (source, seq, target)
    with pytest.raises(InputRefused):
        await fork(store, T, end_of_one, ThreadId("bad\nid"))
    assert await store.thread_ids() == threads


class Pruned:
    """The real store, as if its records 1 and 2 of every thread had been pruned."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def read(self, thread: ThreadId, after_seq: int = 0) -> Any:
        return await self.store.read(thread, max(after_seq, 2))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_a_pruned_thread_is_neither_forked_nor_exported(store: Any) -> None:
    _, end_of_one = await two_runs(store)
    for attempt in (fork(Pruned(store), T, end_of_one, F), export(Pruned(store), T)):
        with pytest.raises(HistoryRefused) as refused:
            await attempt
        assert refused.value.reason == "pruned" and "from seq 3" in str(refused.value)
    assert F not in await store.thread_ids()


class CutOff:
    """The real store, out (StoreUnavailable) after ``left`` appends."""

    def __init__(self, store: Any, left: int) -> None:
        self.store, self.left = store, left

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        if self.left == 0:
            raise StoreUnavailable("cut off")
        self.left -= 1
        return await self.store.append(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class RacedToTheEnd:
    """The real store, where another run of the same copy writes the last record first
    and this one hears RunEnded (PostgreSQL's row lock saw the other's end before its
    receipt lookup saw the record)."""

    def __init__(self, store: Any, last: int) -> None:
        self.store, self.last = store, last

    async def append(self, commit: Any, expected: int, *args: Any, **kwargs: Any) -> Any:
        receipt = await self.store.append(commit, expected, *args, **kwargs)
        if expected + 1 == self.last:
            raise RunEnded(commit.thread_id, commit.run_id)
        return receipt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_two_runs_of_one_copy_racing_to_its_end_both_complete(store: Any) -> None:
    """Of two processes running the same fork or import at once on PostgreSQL, the one
    that lost the race to the end record failed with RunEnded instead of finding the
    copy whole."""
    _, end_of_one = await two_runs(store)
    forked = await fork(RacedToTheEnd(store, end_of_one), T, end_of_one, F)
    assert forked.version == end_of_one and await audit(store, F) == []
    lines = list(await export(store, T))
    copy = ThreadId("copy")
    imported = await import_thread(RacedToTheEnd(store, len(lines) - 1), lines, copy)
    assert imported.version == len(lines) - 1 and await audit(store, copy) == []


async def test_an_interrupted_fork_is_completed_by_running_it_again(store: Any) -> None:
    runner, end_of_one = await two_runs(store)
    with pytest.raises(StoreUnavailable):
        await fork(CutOff(store, 2), T, end_of_one, F)
    assert (await store.load(F)).version == 2
    done = await fork(store, T, end_of_one, F)
    assert done.version == end_of_one and await audit(store, F) == []
    assert await fork(store, T, end_of_one, F) == done  # a repeat writes nothing
    head = (await store.load(T)).version
    with pytest.raises(ForkRefused) as refused:  # another fork to the same thread
        await fork(store, T, head, F)
    assert refused.value.reason == "thread_exists"
    await runner.start("three", thread_id=F)
    with pytest.raises(ForkRefused) as refused:  # the fork, driven on, is no fork's
        await fork(store, T, end_of_one, F)
    assert refused.value.reason == "thread_exists"


async def test_no_run_starts_or_resumes_on_a_copy_half_written(store: Any) -> None:
    """An import (or fork) cut off, or slow, just after one of its Runs ended: a start
    on the new thread took it for a thread at rest and committed a Run there, the copy's
    next record was refused, and the thread held half the copy under the start's Run."""
    runner, end_of_one = await two_runs(store)
    lines = list(await export(store, T))
    copy = ThreadId("copy-1")
    with pytest.raises(StoreUnavailable):
        await import_thread(CutOff(store, end_of_one), lines, copy)
    with pytest.raises(InvalidTransition, match=f"import .{end_of_one} of 8 records"):
        await runner.start("racer", thread_id=copy)
    with pytest.raises(StoreUnavailable):
        await fork(CutOff(store, end_of_one), T, 8, F)
    with pytest.raises(InvalidTransition, match="being written by ratchet-fork"):
        await runner.start("racer", thread_id=F)
    done = await import_thread(store, lines, copy)  # run again: completed
    assert done.version == 8 and await audit(store, copy) == []
    assert (await runner.start("after", thread_id=copy)).run_state is not None


async def test_a_copy_half_written_is_not_pruned_until_it_is_whole(store: Any) -> None:
    """A prune cut the records of an import killed half way (its first Run had ended):
    running the import again then found the thread taken ("thread_exists"), and no Run
    could start there ("being written"): stuck for good. The prune refuses it until the
    import, run again, has written it whole."""
    _, end_of_one = await two_runs(store)
    lines = list(await export(store, T))
    copy = ThreadId("copy-2")
    with pytest.raises(StoreUnavailable):
        await import_thread(CutOff(store, end_of_one + 1), lines, copy)
    with pytest.raises(InvalidTransition, match="being written by ratchet-import"):
        await store.prune(copy, end_of_one)
    done = await import_thread(store, lines, copy)
    assert done.version == 8 and await audit(store, copy) == []
    assert await store.prune(copy, end_of_one) == end_of_one  # whole: prunable as any
    assert await import_thread(store, lines, copy) == await store.load(copy)  # a repeat
    assert await store.prune(copy, 8) == 8 - end_of_one  # through its head
    assert await import_thread(store, lines, copy) == await store.load(copy)


async def test_a_run_half_copied_is_not_driven_and_its_source_keeps_its_records(
    store: Any,
) -> None:
    """A fork cut off in the middle of a Run: ``recover`` drove the source's Run on in the
    copy, its tool calls again under the source's operation ids, and the fork could never
    be completed; and a prune of the source left it unable to complete too. Both are
    refused until the fork, run again, is whole; ending the copy's Run abandons it."""
    runner, end_of_one = await two_runs(store)
    with pytest.raises(StoreUnavailable):
        await fork(CutOff(store, end_of_one + 2), T, 8, F)
    half = await store.load(F)
    assert isinstance(half.run_state, RunningState) and half.version == end_of_one + 2
    with pytest.raises(InvalidTransition, match="being written by ratchet-fork"):
        await runner.recover(F)
    with pytest.raises(InvalidTransition, match=r"not pruned while it is copied.*a fork of"):
        await store.prune(T, end_of_one)
    assert (await store.load(F)).version == half.version and len(await store.read(T)) == 8
    done = await fork(store, T, 8, F)  # run again: completed, from the source kept whole
    assert done.version == 8 and await audit(store, F) == []
    assert await store.prune(T, end_of_one) == end_of_one  # no fork under way: prunable
    abandoned = ThreadId("abandoned")
    with pytest.raises(StoreUnavailable):
        await fork(CutOff(store, 2), F, 8, abandoned)
    ended = await runner.engine().terminate(abandoned, Cancelled())
    assert isinstance(ended.run_state, EndedState) and await audit(store, abandoned) == []
    assert await store.prune(F, end_of_one) == end_of_one  # its one fork was abandoned


async def test_a_fork_cut_between_runs_keeps_its_source_from_a_prune(store: Any) -> None:
    """Only a fork cut in the middle of a Run held its source's prune back: one cut
    between two Runs let the prune through, and could then never be completed (its
    records were gone), the new thread's id refused for good."""
    _, end_of_one = await two_runs(store)
    head = (await store.load(T)).version
    with pytest.raises(StoreUnavailable):
        await fork(CutOff(store, end_of_one), T, head, F)  # the first Run copied whole
    assert isinstance((await store.load(F)).run_state, EndedState)
    with pytest.raises(InvalidTransition, match=r"not pruned while it is copied.*a fork of"):
        await store.prune(T, end_of_one)
    done = await fork(store, T, head, F)
    assert done.version == head and await audit(store, F) == []
    assert await store.prune(T, end_of_one) == end_of_one


async def test_a_copy_half_written_is_neither_exported_nor_forked(store: Any) -> None:
    """An export of an import cut off half way answered its records as a whole thread
    (exit 0): written back elsewhere, it made a thread that could not be told from the
    original's first half. Refused, as a pruned thread is, until the copy is whole."""
    _, end_of_one = await two_runs(store)
    lines = list(await export(store, T))
    copy = ThreadId("copy-3")
    with pytest.raises(StoreUnavailable):
        await import_thread(CutOff(store, end_of_one), lines, copy)
    for attempt in (export(store, copy), fork(store, copy, end_of_one, F)):
        with pytest.raises(HistoryRefused) as refused:
            await attempt
        assert refused.value.reason == "copy_under_way"
        assert f"({end_of_one} of 8 records)" in str(refused.value)
    assert F not in await store.thread_ids()
    await import_thread(store, lines, copy)
    assert len(list(await export(store, copy))) == len(lines)  # whole: exported as any


async def test_forks_racing_to_one_thread_leave_one_fork(store: Any) -> None:
    _, end_of_one = await two_runs(store)
    same = await asyncio.gather(fork(store, T, end_of_one, F), fork(store, T, end_of_one, F))
    assert same[0] == same[1] and same[0].version == end_of_one  # one fork, twice
    head = (await store.load(T)).version
    other = ThreadId("other-fork")
    results = await asyncio.gather(
        fork(store, T, end_of_one, other), fork(store, T, head, other), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, ForkRefused)]
    assert len(refused) == 1 and refused[0].reason == "thread_exists", results
    assert await audit(store, other) == [] and await audit(store, F) == []


def _client(store: Any, limits: Limits = DEFAULT_LIMITS) -> Any:
    """A cluster client of a system of ``limits`` on ``store`` (no cluster: its store only)."""
    from actors.wire import SystemSpec
    from cluster.client import Ratchet

    return Ratchet(SystemSpec(name="history", store_url="memory://", limits=limits), store, [])


async def test_the_client_forks_on_its_store(store: Any) -> None:
    _, end_of_one = await two_runs(store)
    forked = await _client(store).fork(T, end_of_one, F)
    assert forked == await store.load(F) and forked.version == end_of_one


async def test_new_ids_of_a_fork_or_an_import_are_held_to_their_systems_id_chars(
    store: Any,
) -> None:
    """A fork's new thread and an import's given target were held to the default
    ``id_chars`` whatever the system's: one with a raised limit could not fork or import
    to a 300-character id its Runs take. The client holds them to its system's limits,
    the library functions to those they are given (the defaults by default)."""
    _, end_of_one = await two_runs(store)
    lines = list(await export(store, T))
    new, other = ThreadId("f" * 300), ThreadId("i" * 300)
    for refused_at in (
        fork(store, T, end_of_one, new),
        _client(store).fork(T, end_of_one, new),
        import_thread(store, lines, other),
        _client(store).import_thread(lines, other),
    ):
        with pytest.raises(InputRefused) as refused:
            await refused_at
        assert refused.value.limit == "id_chars"
    assert await store.thread_ids() == [T]  # nothing written
    wide = _client(store, Limits(id_chars=1024, tool_calls=16))
    assert (await wide.fork(T, end_of_one, new)).version == end_of_one
    assert (await wide.import_thread(lines, other)).version == len(lines) - 1
    assert await audit(store, new) == [] and await audit(store, other) == []
    longer = Limits(id_chars=2048, tool_calls=4)
    assert (await fork(store, T, end_of_one, ThreadId("g" * 300), longer)).version == end_of_one


# ---- export and import -----------------------------------------------------------------------


async def test_export_then_import_round_trips(store: Any) -> None:
    await two_runs(store)
    original = await store.load(T)
    lines = list(await export(store, T))
    assert lines == list(await export(store, T))  # the same log: the same bytes
    assert orjson.loads(lines[0]) == {
        "format": "ratchet-thread",
        "version": 1,
        "thread_id": T,
        "records": original.version,
        "head": original.head,
    }
    bodies = [orjson.loads(line)["body"] for line in lines[1:]]
    assert bodies == [body for _, body, _ in await stored(store, T)]  # kept as text

    copy = await import_thread(store, lines, ThreadId("copy"))
    assert history(copy) == history(original) and await audit(store, ThreadId("copy")) == []
    with pytest.raises(ImportRefused) as refused:  # by default its own id: it exists here
        await import_thread(store, lines)
    assert refused.value.reason == "thread_exists" and refused.value.line is None

    fixture = MemoryCommitStore()  # a recorded thread becomes a test's fixture
    same = await import_thread(fixture, lines)
    assert same.thread_id == T and history(same) == history(original)
    driven = await InProcessRunner(history_agent(), fixture).start("three", thread_id=T)
    assert texts(driven)[-2:] == ["looking", "answered three"]


async def test_an_integer_a_run_stored_in_its_state_is_imported_whole(store: Any) -> None:
    """A state value may be an integer of up to 4,300 digits (``check_json_value``): the
    import read each body with orjson as well, which takes one past 64 bits as a float
    and refused one past 1e308 as "infinity", so the thread, exported, never went in."""
    huge = {"big": 10**400, "least": -(10**4299), "list": [2**64, 10**308]}

    @tool
    def count() -> ToolResult:
        return ToolResult("counted", commands=[Command(key="n", scope="thread", value=huge)])

    script = [ModelResponse(tool_calls=(call("count", "c1"),)), ModelResponse(text="done")]
    agent = Agent(name="counter", model=ScriptedModel(script), tools=[count])
    original = await InProcessRunner(agent, store).start("go", thread_id=T)
    assert original.state["thread"]["n"] == huge
    copy = await import_thread(store, list(await export(store, T)), ThreadId("copy"))
    assert copy.state["thread"]["n"] == huge and history(copy) == history(original)
    assert await audit(store, ThreadId("copy")) == []


async def test_an_import_whose_ids_no_index_takes_is_refused_before_a_write(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied run id may be 1,024 characters: 4 KB of 4-byte characters, which
    PostgreSQL's index on (thread, operation id) refused at that Run's first record,
    after the records before it were written (a copy half written for good)."""
    import runtime.rules

    source = MemoryCommitStore()
    wide = "".join(chr(0x20000 + i) for i in range(1000))  # 4 bytes each in UTF-8
    monkeypatch.setattr(runtime.rules, "KEY_BYTES", 10**6)  # written where it was allowed
    await run_on(source, T, "short-run")
    await run_on(source, T, wide)
    lines = list(await export(source, T))
    monkeypatch.undo()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(store, lines, ThreadId("wide-copy"))
    assert refused.value.reason == "id_chars" and refused.value.line == 5  # record 4
    assert (await store.load_head(ThreadId("wide-copy"))).version == 0  # nothing written


async def test_an_imported_thread_mid_run_is_resumed_where_it_waits(store: Any) -> None:
    waiting = await InProcessRunner(history_agent(), store).start("delete SAFE", thread_id=T)
    lines = list(await export(store, T))
    fixture = MemoryCommitStore()
    copy = await import_thread(fixture, lines, ThreadId("replica"))
    assert isinstance(copy.run_state, AwaitingState) and isinstance(
        waiting.run_state, AwaitingState
    )
    assert copy.run_state.ticket.thread_id == "replica"
    runner = InProcessRunner(history_agent(), fixture)
    done = await runner.resume(answer(copy.run_state.ticket, PermissionDecision(approve=True)))
    assert done.run_state is not None and done.run_state.kind == "ended"
    assert texts(done)[-1] == "answered delete SAFE"
    assert (await store.load(T)).run_state == waiting.run_state  # the source still waits


async def test_a_thread_of_a_system_with_longer_ids_is_exported_imported_and_resumed(
    store: Any,
) -> None:
    """A system whose ``id_chars`` is raised makes a thread and a Run of 300-character
    ids. Its export was refused (the thread id held to the default ``id_chars``), so was
    the import of that export, and the Run, copied into a system of default limits, was
    refused every resume: ids that name what is stored are held to ``STORED_IDS``."""
    thread, run = ThreadId("h" * 300), "r" * 300
    source = MemoryCommitStore()
    wide = InProcessRunner(history_agent(), source, limits=Limits(id_chars=1024, tool_calls=16))
    waiting = await wide.start("delete SAFE", thread_id=thread, run_id=run)
    assert isinstance(waiting.run_state, AwaitingState)
    copy = await import_thread(store, list(await export(source, thread)))
    assert copy.thread_id == thread and copy.run_id == run
    decision = answer(copy.run_state.ticket, PermissionDecision(approve=True))
    done = await InProcessRunner(history_agent(), store).resume(decision)
    assert texts(done)[-1] == "answered delete SAFE"


async def test_a_run_not_over_is_not_imported_beside_its_source_while_it_goes_on_there(
    store: Any,
) -> None:
    """A copy beside its source, both awaiting the same Run's approval under the same
    operation ids: approved on both, the tool ran twice as one operation. Once the
    source's Run has ended, the copy is the only one to go on with it."""
    runner = InProcessRunner(history_agent(), store)
    waiting = await runner.start("delete SAFE", thread_id=T)
    lines = list(await export(store, T))
    with pytest.raises(ImportRefused) as refused:
        await import_thread(store, lines, ThreadId("copy"))
    assert refused.value.reason == "batch_open" and refused.value.line is None  # its ask
    assert (await store.load_head(ThreadId("copy"))).version == 0  # nothing written
    denied = PermissionDecision(approve=False)
    assert isinstance(waiting.run_state, AwaitingState)
    await runner.resume(answer(waiting.run_state.ticket, denied))  # the source's Run goes on
    copy = await import_thread(store, lines, ThreadId("copy"))
    assert isinstance(copy.run_state, AwaitingState)


async def test_an_imported_thread_left_running_is_recovered_in_process(store: Any) -> None:
    """What the README tells a cluster's user to do with one: no host owns it."""
    from runtime import Crash, FaultPlan

    with pytest.raises(Crash):
        crash = FaultPlan(crash_at=("during:tools", 1))
        await InProcessRunner(history_agent(), store).start("one", thread_id=T, faults=crash)
    fixture = MemoryCommitStore()
    copy = await import_thread(fixture, list(await export(store, T)), ThreadId("replica"))
    assert isinstance(copy.run_state, RunningState)
    assert copy.owner is not None and copy.owner.startswith("ratchet-import#")
    done = await InProcessRunner(history_agent(), fixture).recover("replica")
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
    assert texts(done)[-1] == "answered one"


# ---- import refuses bad input, naming the line -----------------------------------------------

Edit = Callable[[list[Any]], list[Any]]


def _line(seq: int, body: str, digest: str | None = None) -> str:
    digest = digest or hashlib.sha256(body.encode()).hexdigest()
    return orjson.dumps({"seq": seq, "hash": digest, "body": body}).decode()


def _body(lines: list[Any], index: int) -> str:
    return str(orjson.loads(lines[index])["body"])


def _set(index: int, value: Any) -> Edit:
    return lambda lines: [*lines[:index], value, *lines[index + 1 :]]


def _header(**changes: Any) -> Edit:
    return lambda lines: [orjson.dumps({**orjson.loads(lines[0]), **changes}).decode(), *lines[1:]]


def _changed_body(rehash: bool) -> Edit:
    def edit(lines: list[Any]) -> list[Any]:
        old = orjson.loads(lines[2])
        body = old["body"].replace('"looking"', '"lurking"', 1)
        assert body != old["body"]
        digest = None if rehash else old["hash"]
        return _set(2, _line(2, body, digest))(lines)

    return edit


def _deep_body(lines: list[Any]) -> list[Any]:
    body = _body(lines, 1).replace('"batch":null', '"batch":' + "[" * 400 + "]" * 400, 1)
    assert body != _body(lines, 1)
    return _set(1, _line(1, body))(lines)


def _activation(run: str, prev: str) -> ThreadCommit:
    return assemble_commit(
        thread_id=T,
        run_id=RunId(run),
        ordinal=0,
        label="activation",
        disposition=RunningState(run_id=RunId(run)),
        messages=(UserMessage(id=f"{run}:input", text="hello"),),
        prev=prev,
    )


def _illegal_log(lines: list[Any]) -> list[Any]:
    """Two activations, chained and hashed: every line holds, the log does not fold."""
    one = _activation("run-1", "")
    two = _activation("run-2", one.payload_hash)
    return _export_of(one, two)


def _after_its_end(lines: list[Any]) -> list[Any]:
    """A Run that ends in its first commit, then a commit of that Run: each commit folds
    on its own, the store refuses the second (RunEnded), so the import does at once."""
    run = RunId("run-1")
    one = assemble_commit(
        thread_id=T,
        run_id=run,
        ordinal=0,
        label="activation",
        disposition=EndedState(run_id=run, cause=Cancelled()),
        messages=(UserMessage(id="run-1:input", text="hello"),),
        prev="",
    )
    two = assemble_commit(
        thread_id=T,
        run_id=run,
        ordinal=1,
        label="status",
        disposition=RunningState(run_id=run),
        prev=one.payload_hash,
    )
    return _export_of(one, two)


def _export_of(*commits: ThreadCommit) -> list[str]:
    """An export of thread T holding ``commits``, line by line."""
    header = {"format": "ratchet-thread", "version": 1, "thread_id": T, "records": len(commits)}
    head = orjson.dumps({**header, "head": commits[-1].payload_hash}).decode()
    return [head, *(_line(i, c.encoded) for i, c in enumerate(commits, start=1))]


def _stored_too_deep(lines: list[Any]) -> list[Any]:
    """A second activation whose state command nests 170 levels: it decodes (pydantic
    stops near 200), and the log folds, but no store takes it (``STORED_DEPTH``, 160).
    Refused before anything is written: the store refused it after the record before."""
    deep: Any = 1
    for _ in range(170):
        deep = [deep]
    return _ended_with(Command(key="deep", value=deep))


def _ended_with(*commands: Command) -> list[str]:
    """An export of a Run that starts, then ends carrying ``commands``."""
    one = _activation("run-1", "")
    ended = assemble_commit(
        thread_id=T,
        run_id=RunId("run-1"),
        ordinal=1,
        label="ended",
        disposition=EndedState(run_id=RunId("run-1"), cause=Cancelled()),
        commands=commands,
        prev=one.payload_hash,
    )
    return _export_of(one, ended)


def _non_finite(token: str) -> Edit:
    """A Run's end whose state value reads as a float JSON cannot hold (``1e400``, and
    literals no JSON has), its hash and the header's head recomputed: it was imported,
    the store kept the text and folded ``null``, and the thread failed ``verify``."""

    def edit(lines: list[Any]) -> list[Any]:
        ended = _ended_with(Command(key="x", value=7.5))
        body = _body(ended, 2).replace("7.5", token, 1)
        digest = hashlib.sha256(body.encode()).hexdigest()
        return _header(head=digest)([*ended[:2], _line(2, body, digest)])

    return edit


def _twice_in_body(lines: list[Any]) -> list[Any]:
    """A Run's end whose command names its value twice, hash and head recomputed: a
    reader keeps one of the two, and which one depends on the reader."""
    ended = _ended_with(Command(key="x", value=7.5))
    body = _body(ended, 2)
    assert body.count('"value":7.5') == 1
    body = body.replace('"value":7.5', '"value":7.5,"value":8.5')
    digest = hashlib.sha256(body.encode()).hexdigest()
    return _header(head=digest)([*ended[:2], _line(2, body, digest)])


def _reserved(key: str, value: Any, scope: Any = "run") -> Edit:
    """A Run's end setting a key only Ratchet writes to what it never writes there: such
    a thread, imported, made ``ratchet runs`` fail for every thread (``runtime.reserved``)."""
    return lambda lines: _ended_with(Command(key=key, scope=scope, value=value))


BAD_INPUT: dict[str, tuple[Edit, int, str]] = {
    "body changed": (_changed_body(rehash=False), 3, "hash"),
    "body changed, hash too": (_changed_body(rehash=True), 4, "chain"),
    "line removed": (lambda ls: [*ls[:3], *ls[4:]], 4, "seq"),
    "last line removed": (lambda ls: ls[:-1], 9, "truncated"),
    "line repeated": (lambda ls: [*ls[:4], ls[3], *ls[4:]], 5, "seq"),
    "line past the count": (lambda ls: [*ls, ls[-1]], 10, "seq"),
    "no header": (lambda ls: ls[1:], 1, "format"),
    "empty": (lambda ls: [], 1, "header"),
    "other format": (_header(format="jsonl"), 1, "format"),
    "format version 2": (_header(version=2), 1, "version"),
    "format version true": (_header(version=True), 1, "version"),  # == 1 in Python
    "format version 1.0": (_header(version=1.0), 1, "version"),
    "a megabyte format version": (_header(version="v" * 1_000_000), 1, "version"),
    "a megabyte extra field": (_header(**{"x" * 1_000_000: 1}), 1, "malformed"),
    "header without count": (_header(records=None), 1, "header"),
    "header with an extra field": (_header(surprise={"x": 1}), 1, "malformed"),
    "a float past JSON's": (_non_finite("1e400"), 3, "record"),
    "NaN": (_non_finite("NaN"), 3, "record"),
    "Infinity": (_non_finite("-Infinity"), 3, "record"),
    "another thread's records": (_header(thread_id="elsewhere"), 2, "thread"),
    "malformed JSON": (lambda ls: _set(4, ls[4][:-3])(ls), 5, "malformed"),
    "not a record": (_set(2, '{"seq": 2}'), 3, "malformed"),
    "lone surrogate": (_set(2, '{"seq":2,"hash":"x","body":"\ud800"}'), 3, "malformed"),
    "escaped lone surrogate": (_set(2, '{"seq":2,"hash":"x","body":"\\ud800"}'), 3, "malformed"),
    "invalid UTF-8": (_set(2, b'{"seq":2,"hash":"x","body":"\xff"}'), 3, "malformed"),
    "a line that is no text": (_set(2, 7), 3, "malformed"),  # AttributeError, was
    "deep nesting": (_set(2, "[" * 5000 + "]" * 5000), 3, "malformed"),
    "nesting orjson reads and Python's parser does not": (
        _set(2, "[" * 1000 + "]" * 1000),
        3,
        "malformed",
    ),
    "a key twice on a line": (lambda ls: _set(2, ls[2][:-1] + ',"seq":2}')(ls), 3, "malformed"),
    "a key twice in a body": (_twice_in_body, 3, "record"),
    "deep body": (_deep_body, 2, "record"),
    "log that does not fold": (_illegal_log, 3, "replay"),
    "a commit after its Run's end": (_after_its_end, 3, "replay"),
    "a record no store takes": (_stored_too_deep, 3, "json_depth"),
    "usage as text": (_reserved("usage", "lots"), 3, "reserved_state"),
    "thread usage of a bool": (
        _reserved("usage", {"inferences": True}, "thread"),
        3,
        "reserved_state",
    ),
    "children not thread ids": (_reserved("children", {"c1": 7}), 3, "reserved_state"),
    "a parent of another shape": (_reserved("parent", {"thread": "t"}), 3, "reserved_state"),
    "a reserved key never written": (_reserved("session", {}), 3, "reserved_state"),
}


@pytest.fixture(scope="module")
def recorded() -> list[str]:
    """The two-Run thread's export: a header and eight records."""

    async def record() -> list[str]:
        store = MemoryCommitStore()
        await two_runs(store)
        return list(await export(store, T))

    lines = asyncio.run(record())
    assert len(lines) == 9
    return lines


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_import_refuses_bad_input_naming_the_line(recorded: list[str], case: str) -> None:
    edit, line, reason = BAD_INPUT[case]
    target = MemoryCommitStore()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(target, edit(list(recorded)))
    assert (refused.value.line, refused.value.reason) == (line, reason), str(refused.value)
    assert str(refused.value).startswith(f"line {line}: {reason}: ")
    assert len(str(refused.value)) < 1000  # the input is not echoed back whole
    assert await target.thread_ids() == []


async def test_a_refused_import_writes_nothing(store: Any, recorded: list[str]) -> None:
    for case, (edit, line, _) in BAD_INPUT.items():
        with pytest.raises(ImportRefused) as refused:
            await import_thread(store, edit(list(recorded)))
        assert refused.value.line == line, case
    assert await store.thread_ids() == []
    await import_thread(store, recorded)  # and the export itself goes in
    assert await audit(store, T) == []


async def test_an_unknown_thread_has_no_export(store: Any) -> None:
    with pytest.raises(HistoryRefused) as refused:
        await export(store, ThreadId("nobody"))
    assert refused.value.reason == "unknown_thread"


# ---- the commands ----------------------------------------------------------------------------


async def ratchet(*args: str, stdin: bytes | None = None) -> Result:
    app = typer.Typer()
    register(app)
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), input=stdin)


async def test_the_commands_fork_export_and_import(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    store = await SqlCommitStore.connect(url)
    try:
        _, end_of_one = await two_runs(store)
        lines = list(await export(store, T))
        forked = await ratchet("fork", T, "--at", str(end_of_one), "--to", F, "--store", url)
        assert forked.exit_code == 0, forked.output
        assert f"forked thread {T} at seq 4 to {F} (4 commits)" in forked.stdout
        assert "ended natural" in forked.stdout and await audit(store, F) == []
        refused = await ratchet("fork", T, "--at", "2", "--to", "x", "--store", url)
        assert refused.exit_code == 1 and "batch_open" in refused.stderr

        out = tmp_path / "history.jsonl"
        to_file = await ratchet("export", T, "--out", str(out), "--store", url)
        assert to_file.exit_code == 0, to_file.output
        assert out.read_text().splitlines() == lines
        to_stdout = await ratchet("export", T, "--store", url)
        assert to_stdout.exit_code == 0 and to_stdout.stdout.splitlines() == lines
        unknown = await ratchet("export", "nobody", "--out", str(tmp_path / "n"), "--store", url)
        assert unknown.exit_code == 1 and not (tmp_path / "n").exists()

        imported = await ratchet("import", str(out), "--as", "copy", "--store", url)
        assert imported.exit_code == 0, imported.output
        assert "imported thread copy (8 commits)" in imported.stdout
        assert await audit(store, ThreadId("copy")) == []
        piped = await ratchet(
            "import", "-", "--as", "piped", "--store", url, stdin=out.read_bytes()
        )
        assert piped.exit_code == 0, piped.output
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join(lines[:3] + lines[4:]) + "\n")
        broken = await ratchet("import", str(bad), "--as", "broken", "--store", url)
        assert broken.exit_code == 1 and "line 4: seq" in broken.stderr
        missing = await ratchet("import", str(tmp_path / "none"), "--store", url)
        assert missing.exit_code == 1 and "cannot read" in missing.stderr
        assert ThreadId("broken") not in await store.thread_ids()
    finally:
        await store.close()


async def test_export_out_replaces_only_a_file_and_keeps_its_mode_and_links(
    tmp_path: Path,
) -> None:
    """Renaming over FILE replaced a pipe or a device (``--out /dev/null``) with a file
    of mode 0600, and a link with the file: they are written as a shell's ``>`` writes
    them, a link's file is replaced under it, a file keeps its mode."""
    import stat
    import subprocess

    url = f"sqlite:///{tmp_path}/cli.db"
    store = await SqlCommitStore.connect(url)
    try:
        await two_runs(store)
        lines = list(await export(store, T))
    finally:
        await store.close()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = await asyncio.create_subprocess_exec("cat", str(fifo), stdout=subprocess.PIPE)
    try:
        piped = await ratchet("export", T, "--out", str(fifo), "--store", url)
        assert piped.exit_code == 0, piped.output
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        read, _ = await asyncio.wait_for(reader.communicate(), 30)
        assert read.decode().splitlines() == lines
    finally:
        if reader.returncode is None:
            reader.kill()
            await reader.wait()
    kept = tmp_path / "kept.jsonl"
    kept.write_text("old\n")
    kept.chmod(0o644)
    link = tmp_path / "link.jsonl"
    link.symlink_to(kept)
    assert (await ratchet("export", T, "--out", str(link), "--store", url)).exit_code == 0
    assert link.is_symlink() and kept.read_text().splitlines() == lines
    assert stat.S_IMODE(kept.stat().st_mode) == 0o644
    new = tmp_path / "new.jsonl"
    assert (await ratchet("export", T, "--out", str(new), "--store", url)).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
    assert [n for n in await asyncio.to_thread(os.listdir, tmp_path) if "partial" in n] == []
    folder = await ratchet("export", T, "--out", str(tmp_path), "--store", url)
    assert folder.exit_code == 1 and "it is a directory" in folder.stderr


async def test_import_reads_no_further_than_the_first_line_it_refuses(tmp_path: Path) -> None:
    """All of the input was read before its first line was looked at: ``/dev/zero``
    filled the memory, and a stream that never ends was never refused. Here 64 MiB of
    NUL bytes come through a pipe: the import stops reading past the first 16 MiB,
    and the writer is left with the rest (SIGPIPE, where it wrote all before)."""
    url = f"sqlite:///{tmp_path}/cli.db"
    fifo = tmp_path / "zeros"
    os.mkfifo(fifo)
    size = 4 * MAX_LINE_BYTES
    writer = await asyncio.create_subprocess_exec("sh", "-c", f"head -c {size} /dev/zero > {fifo}")
    try:
        refused = await ratchet("import", str(fifo), "--store", url)
        assert refused.exit_code == 1 and "line 1: too_large" in refused.stderr
        assert await asyncio.wait_for(writer.wait(), 30) != 0  # it could not write it all
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()


async def test_replay_of_an_export_reads_no_further_than_its_first_line_refused(
    tmp_path: Path,
) -> None:
    """``ratchet replay --export`` read a line with no bound: ``/dev/zero`` filled the
    memory (as import did before it read a line at a time)."""
    from cluster.cli import app

    fifo = tmp_path / "zeros"
    os.mkfifo(fifo)
    writer = await asyncio.create_subprocess_exec(
        "sh", "-c", f"head -c {1 << 26} /dev/zero > {fifo}"
    )
    try:
        args = ["replay", T, "--agent", "cluster.demo_agent:agent", "--export", str(fifo)]
        refused = await asyncio.to_thread(CliRunner().invoke, app, args)
        assert refused.exit_code == 1 and "line 1: too_large" in refused.stderr, refused.output
        assert await asyncio.wait_for(writer.wait(), 30) != 0  # it could not write it all
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()


async def test_an_import_refused_makes_no_store(tmp_path: Path) -> None:
    """The store was opened, so made (a new SQLite file, a schema in an empty database),
    before the first line was read: a refused import left a store where none was."""
    source = tmp_path / "garbage.jsonl"
    source.write_text("garbage\n")
    url = f"sqlite:///{tmp_path}/typo.db"
    refused = await ratchet("import", str(source), "--store", url)
    assert refused.exit_code == 1 and "line 1: malformed" in refused.stderr
    assert not (tmp_path / "typo.db").exists()


def _recorded_sqlite(tmp_path: Path) -> str:
    """A SQLite store holding the two-Run thread ``T``, for a command in a process of its
    own; its URL."""
    url = f"sqlite:///{tmp_path}/cli.db"

    async def record() -> None:
        store = await SqlCommitStore.connect(url)
        try:
            await two_runs(store)
        finally:
            await store.close()

    asyncio.run(record())
    return url


def _cli(*args: str, closing: int | None = None, stdout: Any = subprocess.PIPE) -> Any:
    """``ratchet ARGS`` in a process of its own, file descriptor ``closing`` closed."""
    command = [sys.executable, "-m", "cluster.cli", *args]
    opened = None if closing is None else (lambda: os.close(closing))
    return subprocess.run(
        command, preexec_fn=opened, stdout=stdout, stderr=subprocess.PIPE, timeout=120,
        text=True, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["stdin closed", "stdout closed", "stdout full"])
def test_a_closed_or_full_stream_is_one_line(tmp_path: Path, how: str) -> None:
    """``import -`` with stdin closed, ``export`` to a closed stdout or ``/dev/full``: a
    traceback of AttributeError or OSError, where ``--out /dev/full`` said one line."""
    url = _recorded_sqlite(tmp_path)
    if how == "stdin closed":
        done = _cli("import", "-", "--as", "copy", "--store", url, closing=0)
        expected = "cannot read -: stdin is closed"
    elif how == "stdout closed":
        done = _cli("export", T, "--store", url, closing=1, stdout=None)
        expected = "stdout is closed"
    else:
        with open("/dev/full", "wb") as full:
            done = _cli("export", T, "--store", url, stdout=full)
        expected = "cannot write stdout: [Errno 28]"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1 and expected in lines[0], done.stderr


async def test_an_import_is_held_to_the_commit_limit_of_the_system_it_goes_into(
    recorded: list[str],
) -> None:
    """A Run that reaches history_commits still commits its end: such a thread holds one
    more record than the limit, and its export must go in (one past that is refused).
    The limit is the target system's: it was the default's whatever the target's, so a
    system with a raised history_commits exported threads its own import refused."""
    for limits in (DEFAULT_LIMITS, Limits(history_commits=200_000)):
        most = limits.history_commits + 1
        for count, reason in [(most + 1, "too_large"), (most, "truncated")]:
            edited = _header(records=count)(list(recorded))
            with pytest.raises(ImportRefused) as refused:
                await import_thread(MemoryCommitStore(), edited, limits=limits)
            assert refused.value.reason == reason, (count, str(refused.value))
    # eight records: a thread of seven commits and the end its Run commits past them
    with pytest.raises(ImportRefused) as refused:
        await import_thread(MemoryCommitStore(), recorded, limits=Limits(history_commits=6))
    assert (refused.value.line, refused.value.reason) == (1, "too_large")
    seven = await import_thread(MemoryCommitStore(), recorded, limits=Limits(history_commits=7))
    assert seven.version == 8


async def test_an_import_reads_lines_as_long_as_its_stores_records_make() -> None:
    """A record line carries its body as a JSON string: a quote the body holds escaped
    (``\\"``) takes four bytes there. The line's cap was 16 times the *default* payload
    limit: a store whose limit was raised held a body of 9 MiB of quotes that its own
    import refused (``too_large``). The cap follows the target store's payload limit."""
    quotes = '"' * (4608 * 1024)  # 9 MiB in the body, 18 MiB on its line
    one = assemble_commit(
        thread_id=T,
        run_id=RunId("run-1"),
        ordinal=0,
        label="activation",
        disposition=RunningState(run_id=RunId("run-1")),
        messages=(UserMessage(id="run-1:input", text=quotes),),
        prev="",
    )
    lines = _export_of(one)
    assert len(lines[1]) > MAX_LINE_BYTES
    large = MemoryCommitStore(payload_limit=10 << 20)
    copy = await import_thread(large, lines)
    assert copy.messages[0].text == quotes and await audit(large, T) == []
    with pytest.raises(ImportRefused) as refused:  # the default store takes no such record
        await import_thread(MemoryCommitStore(), lines)
    assert (refused.value.line, refused.value.reason) == (2, "too_large")


async def test_a_copied_run_id_is_held_to_what_a_store_holds_not_to_four_times_the_default(
    store: Any,
) -> None:
    """A copied record's run id was held to 1,024 characters (four times the default
    ``id_chars``): a thread of a system whose ``id_chars`` is 2,048 was exported and
    refused by every import (``id_chars``). A stored run id is held to ``STORED_IDS``."""
    run = "r" * 1500
    lines = _export_of(_activation(run, ""))
    copy = await import_thread(store, lines, ThreadId("copy"))
    assert copy.run_id == run and await audit(store, ThreadId("copy")) == []
    with pytest.raises(ImportRefused) as refused:  # past what any store holds
        await import_thread(store, _export_of(_activation("r" * 2600, "")), ThreadId("x"))
    assert (refused.value.line, refused.value.reason) == (2, "id_chars")


# ---- the shape of ownership ------------------------------------------------------------------


async def test_a_copy_keeps_where_each_way_in_began_and_replays_cleanly(store: Any) -> None:
    """A thread recovered after a crash (a new epoch, no claim in the record) and
    resumed (a claim in the record): its fork and its import claim where it did, so a
    replay of either reads the same ways in. The copies named epoch 1 throughout, and
    their replays reported an unrecorded call where the recovery had been. An import
    cut short at any record, also right after a claim it made, completes when run again."""
    from runtime import Crash, FaultPlan
    from runtime.replay_check import replay as replay_check

    runner = InProcessRunner(history_agent(), store)
    with pytest.raises(Crash):
        await runner.start(
            "delete X", thread_id=T, faults=FaultPlan(crash_at=("before:awaiting", 1))
        )
    waiting = await InProcessRunner(history_agent(), store).recover(T)
    assert isinstance(waiting.run_state, AwaitingState)
    command = answer(waiting.run_state.ticket, PermissionDecision(approve=True))
    ended = await InProcessRunner(history_agent(), store).resume(command)
    assert isinstance(ended.run_state, EndedState)
    source = [r.commit for r in await store.read(T)]
    assert (await replay_check(store, T, history_agent())).clean

    def shape(commits: list[ThreadCommit]) -> list[tuple[bool, bool]]:
        """Per record: does it carry a claim, is it at a new epoch."""
        return [
            (c.claim is not None, i == 0 or c.epoch != commits[i - 1].epoch)
            for i, c in enumerate(commits)
        ]

    assert (False, True) in shape(source)  # the recovery
    forked = await fork(store, T, ended.version, F)
    lines = list(await export(store, T))
    cuts = 0
    while True:  # each run appends one record more, then the store is out
        try:
            copy = await import_thread(CutOff(store, 1), lines, ThreadId("copy"))
            break
        except StoreUnavailable:
            cuts += 1
    assert cuts == len(source) - 1
    assert await import_thread(store, lines, ThreadId("copy")) == copy  # writes nothing
    for thread, frontier in ((F, forked), (ThreadId("copy"), copy)):
        commits = [r.commit for r in await store.read(thread)]
        assert shape(commits) == shape(source)
        assert frontier.epoch == commits[-1].epoch == ended.epoch
        assert await audit(store, thread) == []
        report = await replay_check(store, thread, history_agent())
        assert report.clean, report.line()
    assert history(copy) == history(ended) == history(forked)


def test_an_export_whose_reader_left_ends_quietly(tmp_path: Path) -> None:
    """``ratchet export T | head``: the reader leaving is no error to print (141, as for
    every command), where a full disk is one."""
    url = _recorded_sqlite(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "export", T, "--store", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before it writes: it imports the CLI first
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""
    proc.stderr.close()
