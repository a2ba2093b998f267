"""Per-thread history limits: reached, the Run ends failed(history_limit) naming the
limit, once, never retried; a start on a thread at the limit is refused, nothing
written."""

from __future__ import annotations

import pytest

from runtime import (
    Agent,
    Command,
    InProcessRunner,
    Limits,
    ModelResponse,
    ScriptedModel,
    call,
    tool,
)
from runtime.errors import HistoryLimitReached
from runtime.hooks import Hook, HookInput
from runtime.limits import history_headroom, history_size, state_size
from runtime.replay_check import replay
from runtime.tools import ToolResult
from storage.memory import MemoryCommitStore


@tool
def echo(text: str) -> str:
    return text * 50


def chatty(steps: int = 6) -> Agent:
    script = [
        ModelResponse(tool_calls=(call("echo", f"c{i}", text="x" * 40),)) for i in range(steps)
    ]
    return Agent(name="chatty", model=ScriptedModel([*script, ModelResponse(text="done")]),
                 tools=[echo], max_steps=steps + 1)  # fmt: skip


async def test_the_commit_limit_ends_the_run_failed_naming_it():
    store = MemoryCommitStore()
    runner = InProcessRunner(chatty(), store, limits=Limits(history_commits=6))
    f = await runner.start("go", thread_id="t")
    cause = f.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "history_limit", "history_commits")
    assert f.version == 7  # six commits, then the end, which always lands
    assert len(await store.read("t")) == 7


@pytest.mark.parametrize("limit", [3, 4])
async def test_a_wait_keeps_a_commit_for_its_resume(limit: int) -> None:
    """Awaiting at the thread's last commit, every resume was refused (HistoryLimitReached
    to its caller) and nothing ended the Run: it waited for ever. The wait that would
    take the last commit ends the Run instead; one with a commit to spare is resumed."""
    from runtime import answer
    from runtime.lifecycle import PermissionDecision

    @tool(needs_permission=True)
    def risky() -> str:
        return "ran"

    script = [ModelResponse(tool_calls=(call("risky", "c1"),)), ModelResponse(text="done")]
    agent = Agent(name="a", model=ScriptedModel(script), tools=[risky])
    runner = InProcessRunner(agent, MemoryCommitStore(), limits=Limits(history_commits=limit))
    f = await runner.start("go", thread_id="t")  # its wait would be commit 3
    if limit == 3:
        cause = f.run_state.cause
        assert (cause.kind, cause.failure, cause.code) == (
            "failed",
            "history_limit",
            "history_commits",
        )
        return
    resumed = await runner.resume(answer(f.run_state.ticket, PermissionDecision(approve=True)))
    assert resumed.run_state.cause.code == "history_commits"  # it ends, at the limit


async def test_the_size_limit_ends_the_run_failed_naming_it():
    store = MemoryCommitStore()
    runner = InProcessRunner(chatty(), store, limits=Limits(history_bytes=5000))
    f = await runner.start("go", thread_id="t")
    cause = f.run_state.cause
    assert (cause.failure, cause.code) == ("history_limit", "history_bytes")
    assert "the limit is 5000" in cause.message
    # the end lands whatever the limits, with the results of the Step it ends
    assert 5000 < history_size(f.messages) <= 5000 + Limits().batch_result_bytes


async def test_a_start_on_a_thread_at_its_limit_is_refused_and_writes_nothing():
    store = MemoryCommitStore()
    limits = Limits(history_commits=6)
    await InProcessRunner(chatty(), store, limits=limits).start("go", thread_id="t")
    before = len(await store.read("t"))
    with pytest.raises(HistoryLimitReached) as refused:
        await InProcessRunner(chatty(), store, limits=limits).start("again", thread_id="t")
    assert refused.value.limit == "history_commits"
    assert len(await store.read("t")) == before


async def test_headroom_says_how_close_a_thread_is():
    store = MemoryCommitStore()
    f = await InProcessRunner(chatty(2), store).start("go", thread_id="t")
    room = history_headroom(f.messages, f.version, Limits())
    assert room["commits"] == f.version and room["commits_limit"] == 50_000
    assert room["bytes"] == history_size(f.messages) > 4000


@tool
def remember(note: str) -> ToolResult:
    """Adds its note to a commutative list: the thread's state grows every Step."""
    return ToolResult("noted", commands=[Command(key="notes", merge="commutative", value=[note])])


@tool
def forget() -> ToolResult:
    return ToolResult("forgot", commands=[Command(key="notes", op="remove")])


def noting(steps: int, tool_name: str = "remember", size: int = 4000) -> Agent:
    args = {"note": "n" * size} if tool_name == "remember" else {}
    script = [
        ModelResponse(tool_calls=(call(tool_name, f"c{i}", **{**args, **_nth(args, i)}),))
        for i in range(steps)
    ]
    return Agent(name="noting", model=ScriptedModel([*script, ModelResponse(text="done")]),
                 tools=[remember, forget], max_steps=steps + 1)  # fmt: skip


def _nth(args: dict[str, str], i: int) -> dict[str, str]:
    return {"note": f"{i}:{args['note']}"} if args else {}


async def test_a_state_grown_past_its_limit_ends_the_run_failed_naming_it():
    """A commutative list grew with every Step, without bound: every commit carries the
    whole state in the frontier, and re-encoded it (megabytes per commit, then past what
    a backend holds in one value)."""
    store = MemoryCommitStore()
    runner = InProcessRunner(noting(12), store, limits=Limits(state_bytes=20_000))
    f = await runner.start("go", thread_id="t")
    cause = f.run_state.cause
    assert (cause.failure, cause.code) == ("history_limit", "state_bytes")
    assert "the limit is 20000" in cause.message
    assert 16_000 < state_size(f.state) <= 20_000  # four notes landed, the fifth did not
    assert len(f.state["thread"]["notes"]) == 4


async def test_a_commit_that_shrinks_a_state_past_a_lowered_limit_lands():
    store = MemoryCommitStore()
    await InProcessRunner(noting(3), store).start("go", thread_id="t")
    lowered = Limits(state_bytes=2_000)
    f = await InProcessRunner(noting(1, "forget"), store, limits=lowered).start(
        "again", thread_id="t"
    )
    assert f.run_state.cause.kind == "natural"
    assert "notes" not in f.state["thread"] and state_size(f.state) < 2_000


def asking(inject: str = "") -> Agent:
    """One echo Step, then its StepEnd hook asks for input (injecting ``inject`` first):
    the answer must carry the Step's results (and the injected text) before its own."""

    def ask(hook_input: HookInput) -> None:
        if hook_input.step == 0:
            if inject:
                hook_input.execution.inject_message(inject)
            hook_input.execution.request_input("which?")

    script = [ModelResponse(tool_calls=(call("echo", "c1", text="x" * 40),))]
    return Agent(name="asking", model=ScriptedModel([*script, ModelResponse(text="done")]),
                 tools=[echo], hooks=[Hook(point="StepEnd", fn=ask)])  # fmt: skip


@pytest.mark.parametrize(
    ("inject", "limit"), [("", 1000), ("y" * 2000, 3000)], ids=["results", "injected"]
)
async def test_a_wait_for_input_keeps_room_in_bytes_for_what_its_answer_carries(
    inject: str, limit: int
) -> None:
    """The answer to a wait for input writes the last Step's results and the messages
    injected before the wait, then its text, in one commit. Past ``history_bytes`` already
    without its text, every answer was refused (HistoryLimitReached to its caller) and the
    Run waited for ever. The wait that leaves no room for them ends the Run instead."""
    store = MemoryCommitStore()
    runner = InProcessRunner(asking(inject), store, limits=Limits(history_bytes=limit))
    f = await runner.start("go", thread_id="t")  # the results fit; with the injected, not
    cause = f.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "history_limit", "history_bytes")
    assert f"the limit is {limit}" in cause.message
    assert f.messages[-1].kind == "tool_result"  # the end lands with the Step's results


async def test_a_wait_for_input_with_room_takes_an_answer_that_fits() -> None:
    """With room for what it carries, the wait is made; an answer too long to fit is
    refused and the ticket stays, and a shorter one lands."""
    from runtime import UserInput, answer

    store = MemoryCommitStore()
    runner = InProcessRunner(asking(), store, limits=Limits(history_bytes=2200))
    f = await runner.start("go", thread_id="t")
    ticket = f.run_state.ticket
    with pytest.raises(HistoryLimitReached) as refused:
        await runner.resume(answer(ticket, UserInput(text="z" * 500)))
    assert refused.value.limit == "history_bytes"
    assert (await store.load("t")).run_state == f.run_state
    done = await runner.resume(answer(ticket, UserInput(text="savings")))
    assert done.run_state.cause.kind == "natural"


@tool(needs_permission=True)
def risky() -> str:
    return "ran"


def permitting() -> Agent:
    script = [ModelResponse(tool_calls=(call("risky", "c1"),)), ModelResponse(text="done")]
    return Agent(name="a", model=ScriptedModel(script), tools=[risky])


def _failed_on(f, limit: str) -> bool:
    cause = f.run_state.cause
    return (cause.kind, cause.failure, cause.code) == ("failed", "history_limit", limit)


async def _ended_once(store: MemoryCommitStore, f) -> None:
    """The end is committed, once."""
    from runtime.lifecycle import EndedState

    records = await store.read("t")
    assert records[-1].commit.label == "ended"
    assert sum(isinstance(r.commit.disposition, EndedState) for r in records) == 1
    assert (await store.load("t")).ended


async def test_a_budget_pause_whose_grant_cannot_fit_the_state_ends_the_run() -> None:
    """Unpausing a budget pause writes a grant into the run state: paused within a few
    bytes of ``state_bytes``, every Unpause was refused (HistoryLimitReached to its
    caller) and the Run waited for ever. What the runtime must write to resume not fitting,
    the resume ends the Run failed(history_limit, state_bytes) instead."""
    from runtime import ResumeRejected, answer
    from runtime.lifecycle import Unpause
    from runtime.usage import Budget
    from tests.runtime.test_usage import USED, noop, spending

    def budgeted() -> Agent:
        return Agent(name="a", model=spending(4, USED), tools=[noop],
                     budget=Budget(max_tokens=250))  # fmt: skip

    paused = await InProcessRunner(budgeted(), MemoryCommitStore()).start("go", thread_id="t")
    store = MemoryCommitStore()
    limits = Limits(state_bytes=state_size(paused.state))
    runner = InProcessRunner(budgeted(), store, limits=limits)
    f = await runner.start("go", thread_id="t")
    assert f.run_state.ticket.target.reason == "budget"
    ended = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert _failed_on(ended, "state_bytes") and "the limit is" in ended.run_state.cause.message
    await _ended_once(store, ended)
    with pytest.raises(ResumeRejected) as again:
        await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert again.value.axis == "ticket"


@pytest.mark.parametrize("limit", ["history_commits", "history_bytes"])
async def test_a_limit_lowered_while_a_run_waits_ends_it_at_its_resume(limit: str) -> None:
    """The wait kept room under the limits it was made with; lowered since, its resume
    (an approval: nothing of the caller's own is written) cannot land, and was refused
    for ever. It ends the Run instead."""
    from runtime import answer
    from runtime.lifecycle import PermissionDecision

    store = MemoryCommitStore()
    f = await InProcessRunner(permitting(), store).start("go", thread_id="t")
    lowered = {"history_commits": f.version, "history_bytes": history_size(f.messages) - 1}
    runner = InProcessRunner(permitting(), store, limits=Limits(**{limit: lowered[limit]}))
    ended = await runner.resume(answer(f.run_state.ticket, PermissionDecision(approve=True)))
    assert _failed_on(ended, limit)
    await _ended_once(store, ended)
    assert ended.messages[-1].kind == "tool_result"  # the waiting call, sealed
    # ended at rest, as a cancel ends a Run: its replay makes the same end
    report = await replay(store, "t", permitting())
    assert report.clean, report.line()


async def test_an_answer_whose_carried_part_cannot_fit_a_lowered_limit_ends_the_run() -> None:
    """Past ``history_bytes`` with what its answer carries ahead of its text (the Step's
    results), no answer could land, however short: the Run ends, where an answer too long
    by itself is refused with the ticket kept
    (``test_a_wait_for_input_with_room_takes_an_answer_that_fits``)."""
    from runtime import UserInput, answer

    store = MemoryCommitStore()
    f = await InProcessRunner(asking(), store, limits=Limits(history_bytes=2200)).start(
        "go", thread_id="t"
    )
    runner = InProcessRunner(asking(), store, limits=Limits(history_bytes=1000))
    ended = await runner.resume(answer(f.run_state.ticket, UserInput(text="ok")))
    assert _failed_on(ended, "history_bytes")
    await _ended_once(store, ended)


@pytest.mark.parametrize("rival", ["resume", "cancel"])
async def test_a_resume_that_cannot_fit_behind_a_rival_ends_the_run_once(rival: str) -> None:
    """Its end claims the thread at the version its ticket was read at, as a cancel's
    does: behind a rival that landed first (another resumer's end, a cancel), it is
    fenced, makes no second end, and hears its ticket gone, as a second resume does."""
    from runtime import ResumeRejected, answer
    from runtime.control import control_engine
    from runtime.lifecycle import Cancelled, PermissionDecision

    store = MemoryCommitStore()
    f = await InProcessRunner(permitting(), store).start("go", thread_id="t")
    runner = InProcessRunner(permitting(), store, limits=Limits(history_commits=f.version))
    command = answer(f.run_state.ticket, PermissionDecision(approve=True))
    if rival == "resume":
        first = await runner.resume(command)
        assert _failed_on(first, "history_commits")
    else:
        await control_engine(store, owner="ctl#1").terminate(f.thread_id, Cancelled())
    with pytest.raises(ResumeRejected) as refused:  # read before the rival landed
        await runner.engine().resume(command, loaded=f)
    assert refused.value.axis == "ticket"
    final = await store.load("t")
    assert final.run_state.cause.kind == ("failed" if rival == "resume" else "cancelled")
    await _ended_once(store, final)
