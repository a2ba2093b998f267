"""A fork and an import are held to the history limits of the system they write for:
``history_bytes``, ``state_bytes`` and ``history_commits`` as the runtime holds a Run's
commits to them (``runtime.history_write.folded``), refused before anything is written.

A thread copied past them held what no Run of that system could have left: its Run,
awaiting, answered, ended ``failed(history_limit)`` with the answer never applied, and
every start on it was refused. A Run's end is committed past any limit, so a thread
whose Run reached a limit on a system goes into a system of the same limits whole.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime import InProcessRunner, PermissionDecision
from runtime.commit import ThreadCommit, assemble_commit
from runtime.history import ForkRefused, ImportRefused, export, fork, import_thread
from runtime.ids import RunId, ThreadId
from runtime.integrity import audit
from runtime.lifecycle import AwaitingState, Cancelled, EndedState, Failed, answer
from runtime.limits import Limits, history_size, state_size
from runtime.messages import UserMessage
from runtime.state import Command
from storage.memory import MemoryCommitStore
from tests.storage.test_fork_export import T, _activation, _export_of, history_agent

BIG = "x" * 5000


def _ended(after: ThreadCommit, *commands: Command, text: str | None = None) -> ThreadCommit:
    run = after.run_id
    return assemble_commit(
        thread_id=T,
        run_id=run,
        ordinal=after.ordinal + 1,
        label="ended",
        disposition=EndedState(run_id=run, cause=Cancelled()),
        messages=() if text is None else (UserMessage(id=f"{run}:late", text=text),),
        commands=commands,
        prev=after.payload_hash,
    )


async def test_an_awaiting_run_past_the_targets_history_bytes_is_not_imported(
    store: Any,
) -> None:
    """Imported, its resume was taken and the Run ended failed(history_limit)."""
    waiting = await InProcessRunner(history_agent(), store).start(f"delete {BIG}", thread_id=T)
    assert isinstance(waiting.run_state, AwaitingState)
    held = history_size(waiting.messages)
    lines = list(await export(store, T))
    target = MemoryCommitStore()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(target, lines, ThreadId("copy"), Limits(history_bytes=held - 1))
    assert (refused.value.reason, refused.value.line) == ("history_bytes", 3), str(refused.value)
    assert f"{held - 1}" in str(refused.value)  # the inference: the call repeats the path
    assert await target.thread_ids() == []  # nothing written
    copy = await import_thread(target, lines, ThreadId("copy"), Limits(history_bytes=held))
    assert isinstance(copy.run_state, AwaitingState)
    runner = InProcessRunner(history_agent(), target, limits=Limits(history_bytes=held + 1000))
    done = await runner.resume(answer(copy.run_state.ticket, PermissionDecision(approve=True)))
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"


async def test_a_run_that_reached_history_bytes_goes_into_a_system_of_the_same_limits(
    store: Any,
) -> None:
    """Its end is committed past the limit: that is what a Run of the system leaves."""
    limits = Limits(history_bytes=5100)
    ended = await InProcessRunner(history_agent(), store, limits=limits).start(BIG, thread_id=T)
    assert isinstance(ended.run_state, EndedState)
    cause = ended.run_state.cause
    assert isinstance(cause, Failed) and cause.code == "history_bytes", cause
    lines = list(await export(store, T))
    copy = await import_thread(MemoryCommitStore(), lines, ThreadId("copy"), limits)
    assert copy.version == ended.version
    # a commit other than an end that took it past the limit: no Run made that
    one = _activation("run-1", "")
    two = _ended(one, text=BIG)
    small = Limits(history_bytes=100)
    assert (
        await import_thread(MemoryCommitStore(), _export_of(one, two), None, small)
    ).version == 2
    started = assemble_commit(
        thread_id=T,
        run_id=RunId("run-2"),
        ordinal=0,
        label="activation",
        disposition=EndedState(run_id=RunId("run-2"), cause=Cancelled()),
        messages=(UserMessage(id="run-2:input", text="hi"),),
        prev=two.payload_hash,
    )
    target = MemoryCommitStore()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(target, _export_of(one, two, started), None, small)
    assert (refused.value.reason, refused.value.line) == ("history_bytes", 4), str(refused.value)
    assert await target.thread_ids() == []


async def test_a_state_past_the_targets_state_bytes_is_not_imported() -> None:
    one = assemble_commit(
        thread_id=T,
        run_id=RunId("run-1"),
        ordinal=0,
        label="activation",
        disposition=EndedState(run_id=RunId("run-1"), cause=Cancelled()),
        messages=(UserMessage(id="run-1:input", text="hello"),),
        commands=(Command(key="big", value=BIG),),
        prev="",
    )
    lines = _export_of(one)
    size = state_size({"run": {"big": BIG}, "thread": {}})
    target = MemoryCommitStore()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(target, lines, None, Limits(state_bytes=1000))
    assert (refused.value.reason, refused.value.line) == ("state_bytes", 2), str(refused.value)
    assert await target.thread_ids() == []
    assert (await import_thread(target, lines, None, Limits(state_bytes=size + 100))).version == 1
    # set by a Run's end (its last usage, say), past the limit: the runtime lets it land
    start = _activation("run-1", "")
    end = _ended(start, Command(key="big", value=BIG))
    other = MemoryCommitStore()
    done = await import_thread(other, _export_of(start, end), None, Limits(state_bytes=1000))
    assert done.version == 2 and await audit(other, T) == []


async def test_an_awaiting_run_keeps_a_commit_for_its_resume_in_history_commits(
    store: Any,
) -> None:
    """Awaiting at the limit, no resume could land: the Run waited for ever."""
    waiting = await InProcessRunner(history_agent(), store).start("delete SAFE", thread_id=T)
    lines = list(await export(store, T))
    seqs = waiting.version  # the awaiting commit is the last
    with pytest.raises(ImportRefused) as refused:
        await import_thread(MemoryCommitStore(), lines, None, Limits(history_commits=seqs))
    assert refused.value.reason == "history_commits", str(refused.value)
    copy = await import_thread(MemoryCommitStore(), lines, None, Limits(history_commits=seqs + 1))
    assert copy.version == seqs


async def test_a_fork_is_held_to_its_systems_history_limits(store: Any) -> None:
    await InProcessRunner(history_agent(), store).start(BIG, thread_id=T)
    records = await store.read(T)
    at = next(r.seq for r in records if r.commit.label == "ended")
    held = history_size((await store.load(T)).messages)
    with pytest.raises(ForkRefused) as refused:
        await fork(store, T, at, ThreadId("forked"), Limits(history_bytes=held // 2))
    assert refused.value.reason == "history_bytes", str(refused.value)
    assert await store.thread_ids() == [T]
    assert (await fork(store, T, at, ThreadId("forked"), Limits())).version == at


async def test_a_run_not_over_is_imported_into_a_store_once(store: Any) -> None:
    """Imported twice under two ids into a store its source is not in, an awaiting Run
    went on twice: both copies, approved, ran the tool under the same operation ids.
    Once one copy's Run has ended, the other is the only one to go on with it."""
    source = MemoryCommitStore()
    await InProcessRunner(history_agent(), source).start("delete SAFE", thread_id=T)
    lines = list(await export(source, T))
    first = await import_thread(store, lines, ThreadId("first"))
    assert isinstance(first.run_state, AwaitingState)
    for again in (ThreadId("second"), None):  # another id, or the exported one
        with pytest.raises(ImportRefused) as refused:
            await import_thread(store, lines, again)
        assert refused.value.reason == "batch_open" and refused.value.line is None
        assert "'first'" in str(refused.value), str(refused.value)
    assert sorted(await store.thread_ids()) == ["first"]  # nothing written
    assert (await import_thread(store, lines, ThreadId("first"))) == first  # its own repeat
    runner = InProcessRunner(history_agent(), store)
    await runner.resume(answer(first.run_state.ticket, PermissionDecision(approve=False)))
    second = await import_thread(store, lines, ThreadId("second"))
    assert isinstance(second.run_state, AwaitingState)


async def test_a_wait_for_input_is_imported_only_with_room_for_what_its_answer_carries(
    store: Any,
) -> None:
    """The answer to a wait for input writes the last Step's results and the messages
    injected before the wait ahead of its own text: a copy with no room for them in
    ``history_bytes`` refused every answer, and its Run waited for ever."""
    from runtime import UserInput
    from runtime.injection import carried_by_answer
    from tests.runtime.test_history_limits import asking

    waiting = await InProcessRunner(asking("y" * 500), store).start("go", thread_id=T)
    assert isinstance(waiting.run_state, AwaitingState)
    held = history_size(waiting.messages)
    room = held + history_size(carried_by_answer(waiting))
    lines = list(await export(store, T))
    target = MemoryCommitStore()
    with pytest.raises(ImportRefused) as refused:
        await import_thread(target, lines, ThreadId("copy"), Limits(history_bytes=room - 1))
    assert refused.value.reason == "history_bytes" and "wait for input" in str(refused.value)
    assert await target.thread_ids() == []  # nothing written
    copy = await import_thread(target, lines, ThreadId("copy"), Limits(history_bytes=room + 100))
    runner = InProcessRunner(asking(), target, limits=Limits(history_bytes=room + 100))
    done = await runner.resume(answer(copy.run_state.ticket, UserInput(text="ok")))
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
