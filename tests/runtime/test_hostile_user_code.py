"""Code of the user's that the engine calls — a model, a hook, a tool gate, a run-end
guard, a session's handler — raising what an ordinary ``except Exception`` does not
catch (SystemExit, KeyboardInterrupt, GeneratorExit, a BaseException of its own), or an
exception whose text cannot be had: each is that code's failure, and the Run comes to
rest as the design says for it. None escapes the Run: asyncio re-raises SystemExit and
KeyboardInterrupt out of the event loop, which would stop every Run of a host, and the
Run would be left running, to fail again at every recovery. A hook that hangs does not
hold a Run that is stopped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from runtime import (
    Agent,
    Hook,
    HookOutput,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    ToolContext,
    call,
    tool,
)
from runtime.agent import Session, SessionSide
from runtime.failures import failure_of
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, Failed, Stopped
from runtime.messages import ToolResultMessage
from runtime.models import ModelDelta
from runtime.state import Command
from runtime.tools import ToolResult
from storage.memory import MemoryCommitStore
from tests.support.stubborn import hanging, stopped_once_entered


class Mine(BaseException):
    pass


class Unsayable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


RAISED: dict[str, BaseException] = {
    "SystemExit": SystemExit(3),
    "KeyboardInterrupt": KeyboardInterrupt(),
    "GeneratorExit": GeneratorExit(),
    "Mine": Mine("of its own"),
    "Unsayable": Unsayable(),
}


def _raising(name: str) -> Any:
    def fn(*_: Any) -> Any:
        raise RAISED[name]

    return fn


@tool
async def fine() -> str:
    return "fine"


def _script() -> ScriptedModel:
    return ScriptedModel(
        [ModelResponse(tool_calls=(call("fine", "c1"),)), ModelResponse(text="ok")]
    )


async def _rest(agent: Agent) -> EndedState:
    frontier = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert isinstance(frontier.run_state, EndedState), frontier.run_state
    return frontier.run_state


def _results(frontier: Any) -> list[tuple[bool, str]]:
    return [(m.is_error, m.content) for m in frontier.messages if isinstance(m, ToolResultMessage)]


class _Raising:
    """A model whose stream raises ``name`` after a first delta, at every attempt."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        yield ModelDelta(text="thinking")
        raise RAISED[self.name]


@pytest.mark.parametrize("name", list(RAISED))
async def test_a_model_raising_it_fails_the_inference(name: str) -> None:
    ended = await _rest(Agent(name="a", model=_Raising(name)))
    assert isinstance(ended.cause, Failed) and ended.cause.failure == "inference"
    assert ended.cause.code == type(RAISED[name]).__name__


@pytest.mark.parametrize("name", list(RAISED))
async def test_a_hook_raising_it_fails_the_run_with_a_hook_failure(name: str) -> None:
    hooks = [Hook(point="AfterTool", fn=_raising(name))]
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks))
    assert isinstance(ended.cause, Failed) and ended.cause.failure == "hook"
    assert ended.cause.code == type(RAISED[name]).__name__


@pytest.mark.parametrize("name", list(RAISED))
async def test_a_gate_raising_it_denies_the_call(name: str) -> None:
    runner = InProcessRunner(
        Agent(name="a", model=_script(), tools=[fine], gates=[_raising(name)]), MemoryCommitStore()
    )
    done = await runner.start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
    ((is_error, text),) = _results(done)
    assert is_error and f"the gate raised {type(RAISED[name]).__name__}" in text


@pytest.mark.parametrize("name", list(RAISED))
async def test_a_run_end_guard_raising_it_refuses_the_end(name: str) -> None:
    guards = [_raising(name)]
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], run_end_guards=guards))
    assert isinstance(ended.cause, Failed) and ended.cause.code == "run_end_guard"
    assert f"the guard raised {type(RAISED[name]).__name__}" in ended.cause.message


@pytest.mark.parametrize("name", list(RAISED))
async def test_a_session_handler_raising_it_fails_the_run(name: str) -> None:
    session = Session(b=SessionSide(handler=_raising(name)))
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], session=session))
    assert isinstance(ended.cause, Failed) and ended.cause.failure == "hook"
    assert ended.cause.code == type(RAISED[name]).__name__


async def test_reasons_that_cannot_be_said_still_deny_and_refuse() -> None:
    class Unsaid:
        def __str__(self) -> str:
            raise ValueError("no text")

    def says_nothing(*_: Any) -> Unsaid:
        return Unsaid()

    runner = InProcessRunner(
        Agent(name="a", model=_script(), tools=[fine], gates=[says_nothing]), MemoryCommitStore()
    )
    ((is_error, text),) = _results(await runner.start("go", thread_id="t"))
    assert is_error and "the gate raised ValueError" in text
    ended = await _rest(
        Agent(name="a", model=_script(), tools=[fine], run_end_guards=[says_nothing])
    )
    assert isinstance(ended.cause, Failed) and ended.cause.code == "run_end_guard"


async def test_an_after_tool_hook_that_fails_keeps_what_the_tools_did() -> None:
    """The wave ran and finished; its AfterTool hook raises: the Run ends failed(hook),
    and its end holds the finished calls' results, not "outcome unknown" for calls
    whose effects happened (a never_replay charge the model would be told never ran)."""
    charged: list[int] = []

    @tool
    async def charge(amount: int) -> str:
        charged.append(amount)
        return f"charged {amount}"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("charge", "c1", amount=42),)), ModelResponse(text="no")]
    )
    hooks = [Hook(point="AfterTool", fn=_raising("Mine"))]
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[charge], hooks=hooks), store)
    done = await runner.start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState)
    assert isinstance(done.run_state.cause, Failed) and done.run_state.cause.failure == "hook"
    assert _results(done) == [(False, "charged 42")] and charged == [42]


@tool
async def debit(amount: int) -> ToolResult:
    """Writes the balance as a commutative delta, as a ledger tool would."""
    return ToolResult(
        content=f"debited {amount}",
        commands=[Command(key="balance", merge="commutative", value=-amount)],
    )


def _debit_then(hooks: list[Hook]) -> Agent:
    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("debit", "c1", amount=42),)), ModelResponse(text="ok")]
    )
    return Agent(name="a", model=model, tools=[debit], hooks=hooks)


async def test_an_after_tool_hook_that_fails_keeps_what_the_tools_wrote_too() -> None:
    """The end holds the finished calls' state commands with their results: a history
    saying "debited 42" beside a balance that never moved would be a lie for good."""
    runner = InProcessRunner(
        _debit_then([Hook(point="AfterTool", fn=_raising("Mine"))]), MemoryCommitStore()
    )
    done = await runner.start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState) and isinstance(done.run_state.cause, Failed)
    assert done.run_state.cause.failure == "hook"
    assert _results(done) == [(False, "debited 42")]
    assert dict(done.state["thread"]) == {"balance": -42}


async def test_a_hook_whose_commands_clash_with_the_tools_is_the_one_that_fails() -> None:
    """An AfterTool hook writes the key the tool wrote, with another policy: the clash
    is the hook's (named in the cause), and the tool's result and write are kept — not
    the whole results commit refused and the finished call sealed "outcome unknown"."""

    def reset(_: Any) -> HookOutput:
        return HookOutput(commands=[Command(key="balance", merge="exclusive", value=0)])

    runner = InProcessRunner(
        _debit_then([Hook(point="AfterTool", fn=reset, name="reset")]), MemoryCommitStore()
    )
    done = await runner.start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState) and isinstance(done.run_state.cause, Failed)
    cause = done.run_state.cause
    assert (cause.failure, cause.code) == ("hook", "StateConflict")
    assert "reset" in cause.message
    assert _results(done) == [(False, "debited 42")]
    assert dict(done.state["thread"]) == {"balance": -42}


@tool
async def claim(who: str) -> ToolResult:
    """Writes one exclusive key: two calls of one wave clash."""
    return ToolResult(content=who, commands=[Command(key="holder", value=who)])


def _audit(_: Any) -> HookOutput:
    return HookOutput(commands=[Command(key="audited", merge="commutative", value=1)])


@pytest.mark.parametrize("hooks", [[], [Hook("AfterTool", _audit)]], ids=["alone", "audited"])
async def test_tools_whose_commands_clash_end_the_run_with_their_results_kept(
    hooks: list[Hook],
) -> None:
    """Two calls of one wave write one exclusive key: the results commit cannot merge
    and is refused before anything is written. The Run ends failed(state_conflict)
    with both calls' results (they ran), not sealed as outcomes unknown; an AfterTool
    hook writing another key is not blamed for the tools' clash."""
    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("claim", "c1", who="a"), call("claim", "c2", who="b"))),
            ModelResponse(text="ok"),
        ]
    )
    agent = Agent(name="a", model=model, tools=[claim], hooks=hooks)
    runner = InProcessRunner(agent, MemoryCommitStore())
    done = await runner.start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState) and isinstance(done.run_state.cause, Failed)
    assert done.run_state.cause.failure == "state_conflict"
    assert sorted(_results(done)) == [(False, "a"), (False, "b")]
    assert "holder" not in done.state["thread"]


@pytest.mark.parametrize("stubborn", [False, True], ids=["hangs", "swallows_cancels"])
@pytest.mark.parametrize("point", ["BeforeInference", "AfterTool"])
async def test_a_hook_that_hangs_does_not_hold_a_stopped_run(point: str, stubborn: bool) -> None:
    """A hook that never returns: a stop ends the Run all the same, and at AfterTool
    the end keeps what the wave's tools did and wrote. One that swallows every
    cancellation it is sent held the Run's task for good: it is left behind."""
    entered, released = asyncio.Event(), asyncio.Event()
    hang = hanging(entered, released, swallows=stubborn)
    runner = InProcessRunner(_debit_then([Hook(point=point, fn=hang)]), MemoryCommitStore())
    done = await stopped_once_entered(runner, entered, released)
    assert isinstance(done.run_state, EndedState), done.run_state
    assert done.run_state.cause == Stopped(reason="operator stop")
    if point == "AfterTool":
        assert _results(done) == [(False, "debited 42")]
        assert dict(done.state["thread"]) == {"balance": -42}


_LIVE_CONTROLS = {
    "inject_message": lambda e, text: e.inject_message(text),
    "stop": lambda e, text: e.stop(text),
    "request_input": lambda e, text: e.request_input(text),
}


@pytest.mark.parametrize("text", ["half a pair: \udcff", "x" * (2 * 1024 * 1024)])
@pytest.mark.parametrize("control", list(_LIVE_CONTROLS))
async def test_a_hook_calling_the_live_controls_is_held_to_the_limits(
    control: str, text: str
) -> None:
    """A hook may call ``stop()`` and the like on the live ExecutionState instead of
    returning reactions: the same text checks apply, and the hook is the one that fails
    (not the store at the commit, nor the runtime with an encoding error)."""

    def calls(seen: Any) -> None:
        _LIVE_CONTROLS[control](seen.execution, text)

    hooks = [Hook("BeforeInference", calls)]
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks))
    assert isinstance(ended.cause, Failed)
    assert (ended.cause.failure, ended.cause.code) == ("hook", "InputRefused")


async def test_a_tools_stop_reason_over_the_limit_is_refused_with_its_result() -> None:
    """A tool asks its Run to stop with a reason past ``model_text_bytes`` (within
    ``input_bytes``): the outcome is refused at admission, as an over-limit result is,
    and the model is told; not a Run failed ``internal`` with its wave sealed."""

    @tool
    async def halt(ctx: ToolContext) -> str:
        ctx.execution.stop("x" * (100 * 1024))
        return "halting"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("halt", "c1"),)), ModelResponse(text="ok")]
    )
    done = await InProcessRunner(
        Agent(name="a", model=model, tools=[halt]), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
    ((is_error, content),) = _results(done)
    assert is_error and "tool output refused" in content and "model_text_bytes" in content


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_an_agent_s_own_text_no_store_can_hold_is_refused_typed(backend, tmp_path) -> None:
    """Text of the agent's own configuration that reaches a commit (a plugin's id, pinned
    at the activation; a session's prompt, in its ticket) with an unpaired surrogate: the
    start is refused with nothing written, the Run that meets it mid-way ends
    ``failed(store, utf8)`` — never a UnicodeEncodeError out of the engine."""
    from runtime import CommitRefused, InputRefused
    from runtime.plugins import Contributions, Plugin, PluginManifest
    from storage.url import open_store

    store = (
        MemoryCommitStore()
        if backend == "memory"
        else await open_store(f"sqlite:///{tmp_path}/s.db")
    )
    model = ScriptedModel([ModelResponse(text="hi"), ModelResponse(text="bye")])
    plugin = Plugin(PluginManifest(id="p\ud800"), lambda: Contributions())
    with pytest.raises(CommitRefused, match="unpaired surrogate") as refused:
        await InProcessRunner(Agent(name="a", model=model, plugins=[plugin]), store).start(
            "go", thread_id="t1"
        )
    assert isinstance(refused.value, InputRefused) and refused.value.limit == "utf8"
    assert (await store.load(ThreadId("t1"))).version == 0

    side = SessionSide(human="your turn\ud800")
    agent = Agent(name="a", model=model, session=Session(b=side))
    f = await InProcessRunner(agent, store).start("go", thread_id="t2")
    assert isinstance(f.run_state, EndedState)
    cause = f.run_state.cause
    assert isinstance(cause, Failed) and (cause.failure, cause.code) == ("store", "utf8")
    assert "your turn" in cause.message
    assert (await store.load(ThreadId("t2"))).run_state == f.run_state
    await store.close()


@pytest.mark.parametrize("mode", ["never_replay", "replay_safe"])
async def test_a_call_a_recovery_seals_or_runs_again_has_its_after_tool_hooks(mode: str) -> None:
    """A Step's host died while its tool ran. On recovery a ``replay_safe`` call runs
    again, a ``never_replay`` one is sealed ``indeterminate`` by the gates: both have
    their AfterTool hooks before the commit that makes them terminal (as a call that
    timed out has), their commands committed; one that raises ends the Run
    failed(hook). The sealed call skipped them: an audit hook never saw the uncertain
    payment, and the Run ended natural."""
    from runtime import Crash, FaultPlan

    seen: list[tuple[str, str]] = []

    def audit(h: Any) -> HookOutput:
        seen.append((h.call.call_id, h.call.phase.kind))
        return HookOutput(commands=[Command(key="audited", merge="commutative", value=1)])

    @tool(recovery=(mode,))
    def pay() -> str:
        return "paid"

    def agent(hooks: list[Hook]) -> Agent:
        model = ScriptedModel(
            [ModelResponse(tool_calls=(call("pay", "c0"),)), ModelResponse(text="ok")]
        )
        return Agent(name="a", model=model, tools=[pay], hooks=hooks)

    for hooks in ([Hook("AfterTool", audit)], [Hook("AfterTool", _raising("SystemExit"))]):
        store = MemoryCommitStore()
        with pytest.raises(Crash):
            await InProcessRunner(agent(hooks), store).start(
                "go", thread_id="t", faults=FaultPlan(("during:tools", 1))
            )
        done = await InProcessRunner(agent(hooks), store).recover("t")
        assert isinstance(done.run_state, EndedState)
        if hooks[0].fn is audit:
            kind = "indeterminate" if mode == "never_replay" else "completed"
            assert seen == [("c0", kind)] and done.run_state.cause.kind == "natural"
            assert done.state["thread"]["audited"] == 1
        else:
            cause = done.run_state.cause
            assert isinstance(cause, Failed) and (cause.failure, cause.code) == (
                "hook",
                "SystemExit",
            )


async def test_records_built_without_validation_are_refused_not_committed(tmp_path) -> None:
    """A hook's or a tool's command, a reaction, a resume built with ``model_construct``
    (pydantic checks nothing): taken as they were, a command with an ``op`` of no kind
    was committed and its thread never decoded again (CorruptRecord at every read); a
    stop with no reason was dropped, a forced turn to no side ignored, ``approve="yes"``
    authorised a call. Each is refused as bad input is, and the thread stays readable."""
    from runtime import PermissionDecision, ResumeCommand, StopRun
    from runtime.errors import InputRefused
    from storage.url import open_store

    store = await open_store(f"sqlite:///{tmp_path}/s.db")
    bogus = Command.model_construct(key="k", op="bogus", value=1)
    hooked = {
        "h1": HookOutput(commands=[bogus]),
        "h2": HookOutput(reactions=[StopRun.model_construct(kind="stop", reason=None)]),
        "h3": HookOutput(reactions=[StopRun.model_construct(kind="stop", reason=123)]),
    }
    for thread, out in hooked.items():
        hook = Hook(point="StepStart", fn=lambda _, out=out: out)
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]), hooks=[hook])
        f = await InProcessRunner(agent, store).start("go", thread_id=thread)
        assert isinstance(f.run_state, EndedState)
        cause = f.run_state.cause
        assert isinstance(cause, Failed) and (cause.failure, cause.code) == ("hook", "InputRefused")
        assert (await store.load(ThreadId(thread))).run_state == f.run_state

    @tool
    def writes() -> ToolResult:
        return ToolResult(content="done", commands=[bogus])

    f = await InProcessRunner(
        Agent(name="a", model=_script_of("writes"), tools=[writes]), store
    ).start("go", thread_id="t1")
    [(is_error, content)] = _results(f)
    assert is_error and "cannot be a result" in content and "op" in content
    assert (await store.load(ThreadId("t1"))).state["thread"] == {}

    ran: list[str] = []

    @tool(needs_permission=True)
    def risky() -> str:
        ran.append("ran")
        return "ran"

    runner = InProcessRunner(Agent(name="a", model=_script_of("risky"), tools=[risky]), store)
    ticket = (await runner.start("go", thread_id="t2")).run_state.ticket
    fields = {
        "correlation": ticket.correlation,
        "run_id": ticket.run_id,
        "thread_id": ticket.thread_id,
        "payload": PermissionDecision.model_construct(kind="permission", approve="yes", note=""),
    }
    with pytest.raises(ValidationError):  # a command made with it is checked as it is made
        ResumeCommand(**fields)
    with pytest.raises(InputRefused, match="resume command"):
        await runner.resume(ResumeCommand.model_construct(**fields))
    assert ran == [] and (await store.load(ThreadId("t2"))).run_state.ticket == ticket
    await store.close()


def _script_of(tool_id: str) -> ScriptedModel:
    return ScriptedModel(
        [ModelResponse(tool_calls=(call(tool_id, "c1"),)), ModelResponse(text="ok")]
    )


@pytest.mark.parametrize("point", ["AfterInference", "StepEnd"])
async def test_a_hook_that_stops_the_run_after_its_last_answer_is_heard(point: str) -> None:
    """A stop from a hook on the last Step (a text answer, no tools) was dropped: the
    Run ended natural, as if nothing had looked at the answer."""
    from runtime import StopRun

    def flag(_: Any) -> HookOutput:
        return HookOutput(reactions=[StopRun(reason="flagged")])

    model = ScriptedModel([ModelResponse(text="an answer the hook flags")])
    agent = Agent(name="a", model=model, hooks=[Hook(point=point, fn=flag)])
    done = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert done.run_state.cause == Stopped(reason="flagged")
    assert done.messages[-1].text == "an answer the hook flags"  # the answer is kept


@pytest.mark.parametrize("where", ["hook", "session handler", "internal"])
async def test_an_error_whose_type_name_no_store_holds_still_ends_the_run(where: str) -> None:
    """A generated exception class may be named anything, megabytes long.
    The code a failure records is its type's name cut to 80 storable characters, or the
    Run's end itself would be refused, at every recovery, and the Run left running."""
    named = type("E" * 1_100_000, (Exception,), {})
    if where == "internal":
        cause = failure_of(named("bad"))
        assert cause.failure == "internal" and len(cause.code) == 80
        return

    def fn(*_: Any) -> Any:
        raise named("bad input")

    if where == "hook":
        agent = Agent(name="a", model=_script(), tools=[fine], hooks=[Hook("StepStart", fn)])
    else:
        session = Session(b=SessionSide(handler=fn))
        agent = Agent(name="a", model=_script(), tools=[fine], session=session)
    ended = await _rest(agent)
    assert isinstance(ended.cause, Failed) and ended.cause.failure == "hook"
    assert ended.cause.code.startswith("EEEE") and len(ended.cause.code) == 80
    assert len(ended.cause.message) <= 2000


def _cancelling_its_task(*_: Any) -> Any:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    return None


def _cancelling_its_task_and_raising(*_: Any) -> Any:
    _cancelling_its_task()
    raise ValueError("and then it failed")


def _with(who: str, fn: Any) -> Agent:
    """An agent running ``fn`` as ``who`` (in the Run's task, but an async handler)."""

    async def later(*_: Any) -> Any:
        return fn()

    if who in ("handler", "async handler"):
        session = Session(b=SessionSide(handler=fn if who == "handler" else later))
        return Agent(name="a", model=_script(), tools=[fine], session=session)
    if who == "hook":
        return Agent(name="a", model=_script(), tools=[fine], hooks=[Hook("StepStart", fn)])
    if who == "gate":
        return Agent(name="a", model=_script(), tools=[fine], gates=[fn])
    return Agent(name="a", model=_script(), run_end_guards=[fn])


async def _at_rest_once(agent: Agent, who: str) -> Any:
    """The cause the Run ends with; a gate's denial checked; a recovery finds it at rest."""
    store = MemoryCommitStore()
    done = await InProcessRunner(agent, store).start("go", thread_id="t")
    assert isinstance(done.run_state, EndedState)
    if who == "gate":
        assert done.run_state.cause.kind == "natural"
        ((is_error, text),) = _results(done)
        assert is_error and "the gate cancelled its own task" in text
    again = await InProcessRunner(agent, store).recover("t")  # at rest: nothing to do
    assert again.version == done.version
    return done.run_state.cause


@pytest.mark.parametrize("who", ["gate", "guard", "handler"])
async def test_user_code_cancelling_the_runs_task_is_its_own_failure(who: str) -> None:
    """A gate, a run-end guard or a session's handler runs synchronously in the Run's
    task: one calling ``current_task().cancel()`` left a cancellation that landed at the
    Run's next wait, taken for its host stopping the drive. The start raised
    CancelledError, the Run was left running (each recovery cancelled again), or the
    handler's Run ended natural. Now it denies the call, refuses the end, fails the Run."""
    cause = await _at_rest_once(_with(who, _cancelling_its_task), who)
    if who == "guard":
        assert isinstance(cause, Failed) and cause.code == "run_end_guard"
        assert "cancelled its own task" in cause.message
    elif who == "handler":
        assert isinstance(cause, Failed) and cause.failure == "hook"
        assert cause.code == "CancelledError"


@pytest.mark.parametrize("who", ["handler", "async handler", "hook", "gate", "guard"])
async def test_user_code_cancelling_the_runs_task_and_raising_fails_or_denies(who: str) -> None:
    """User code run in the Run's task that cancelled the task and then raised: the
    raise took the way out before the cancellation was dropped, which landed at the
    settling commit's wait and was taken for the host stopping the drive: the Run was
    left running (a handler's). Each still fails the Run, denies or refuses."""
    cause = await _at_rest_once(_with(who, _cancelling_its_task_and_raising), who)
    if who != "gate":
        assert isinstance(cause, Failed) and cause.failure == "hook"
