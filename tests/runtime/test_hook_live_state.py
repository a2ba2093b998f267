"""What a hook (or a session's handler) may do to its Run besides returning data: call
the documented live controls, held to the limits, and nothing else. The ExecutionState
it is shown is a read-only view (``runtime.execution.ExecutionView``): writing a
request field would undo another hook's or a plugin's reaction unchecked, or hand the
store what it cannot hold. A hook that cancels its own task, or whose output together
with the hooks' before it passes what one commit takes, is the one that fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from runtime import (
    Agent,
    Crash,
    FaultPlan,
    Hook,
    HookOutput,
    InjectMessage,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    StopRun,
    call,
    tool,
)
from runtime.agent import Session, SessionSide
from runtime.lifecycle import EndedState, Failed
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.plugins import CapabilityBound, Contributions, Plugin, PluginManifest
from runtime.state import Command
from storage.memory import MemoryCommitStore
from tests.runtime.agents import SEALED_AND_REJOINED
from tests.runtime.test_hostile_user_code import _rest, _script, fine


def _hook_failed(ended: EndedState) -> Failed:
    assert isinstance(ended.cause, Failed), ended.cause
    assert ended.cause.failure == "hook", ended.cause
    return ended.cause


# ---- the live state is read-only ---------------------------------------------------------

_WRITES: dict[str, Callable[[Any], None]] = {
    "stop_reason cleared": lambda e: setattr(e, "stop_reason", None),
    "stop_reason unpaired": lambda e: setattr(e, "stop_reason", "why \ud800"),
    "stop_reason not text": lambda e: setattr(e, "stop_reason", {"x": 1}),
    "stopped_by": lambda e: setattr(e, "stopped_by", "b"),
    "session_stopped": lambda e: setattr(e, "session_stopped", True),
    "forced_side": lambda e: setattr(e, "forced_side", "zz"),
    "wait_request": lambda e: setattr(e, "wait_request", "please"),
    "injected": lambda e: e.injected.append("x" * (5 * 1024 * 1024)),
    "limits": lambda e: setattr(e, "limits", Limits(input_bytes=10**9)),
    "step_count": lambda e: setattr(e, "step_count", -1),
    "current_side": lambda e: setattr(e, "current_side", "zz"),
    "abort_signal set": lambda e: e.abort_signal.set(),
    "abort_signal clear": lambda e: e.abort_signal.clear(),
    "abort_signal replaced": lambda e: setattr(e, "abort_signal", None),
}


@pytest.mark.parametrize("write", list(_WRITES))
async def test_a_hook_that_writes_the_live_state_is_the_one_that_fails(write: str) -> None:
    """A write past the live controls is refused where it is made: the Run ends
    ``failed(hook)`` naming the hook — not stopped, cancelled or undone unchecked, and
    not ``failed(store)`` or ``failed(internal)`` at a commit later."""

    def writes(seen: Any) -> None:
        _WRITES[write](seen.execution)

    hooks = [Hook("StepStart", writes, name="writer")]
    failed = _hook_failed(await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks)))
    assert failed.code == "AttributeError" and "hook writer at StepStart" in failed.message


def _policy(_: Any) -> HookOutput:
    return HookOutput(reactions=[StopRun(reason="policy: wires need review")])


async def test_a_plugin_s_stop_cannot_be_undone_by_a_later_hook() -> None:
    """A policy plugin stops the Run before a never_replay wire runs; a later plugin's
    hook, bound to nothing but AfterInference, sees the stop and tries to clear it: it
    fails, and the wire never runs."""
    wired: list[int] = []
    seen_stopped: list[bool] = []

    @tool(recovery=("never_replay",))
    def wire(amount: int) -> str:
        wired.append(amount)
        return f"wired {amount}"

    def undo(seen: Any) -> None:
        seen_stopped.append(seen.execution.stopped)
        seen.execution.stop_reason = None

    def plugin(name: str, fn: Callable[[Any], Any]) -> Plugin:
        bound = CapabilityBound(hook_points=frozenset({"AfterInference"}))
        hooks = [Hook("AfterInference", fn, name=name)]
        return Plugin(PluginManifest(id=name, bound=bound), lambda: Contributions(hooks=hooks))

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("wire", "c1", amount=5000),)), ModelResponse(text="ok")]
    )
    plugins = [plugin("policy", _policy), plugin("sloppy", undo)]
    agent = Agent(name="a", model=model, tools=[wire], plugins=plugins)
    failed = _hook_failed(await _rest(agent))
    assert "hook sloppy at AfterInference" in failed.message
    assert seen_stopped == [True] and wired == []


async def test_a_session_handler_that_writes_the_live_state_fails_the_run() -> None:
    def handler(seen: Any) -> str:
        seen.execution.forced_side = "zz"
        return "again"

    session = Session(b=SessionSide(handler=handler, name="h"))
    failed = _hook_failed(
        await _rest(Agent(name="a", model=_script(), tools=[fine], session=session))
    )
    assert failed.code == "AttributeError"


async def test_the_view_shows_the_live_state_and_its_controls_still_act() -> None:
    """What a hook reads is the Run as it is now (a stop made by the hook before it,
    the signal), and a control it calls takes effect as the reaction would."""
    seen: list[tuple[bool, str | None, bool]] = []

    def stops(h: Any) -> None:
        h.execution.stop("enough")

    def reads(h: Any) -> None:
        e = h.execution
        seen.append((e.stopped, e.stopped_by, e.abort_signal.is_set()))

    hooks = [Hook("StepStart", stops), Hook("StepStart", reads)]
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks))
    assert ended.cause.kind == "stopped" and getattr(ended.cause, "reason", "") == "enough"
    assert seen == [(True, "a", False)]


# ---- a hook that cancels its own task ----------------------------------------------------


async def _cancels_itself(_: Any) -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)


def _cancels_itself_and_returns(_: Any) -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()  # lands on whatever the task awaits next


@pytest.mark.parametrize("point", ["StepStart", "AfterTool", "StepEnd"])
@pytest.mark.parametrize("fn", [_cancels_itself, _cancels_itself_and_returns])
async def test_a_hook_that_cancels_its_own_task_fails_as_a_hook(point: str, fn: Any) -> None:
    """As a tool that cancels its own task: the hook's error, ``failed(hook)`` naming it,
    never a ``failed(internal, CancelledError)`` of the runtime's."""
    hooks = [Hook(point, fn, name="canceller"), Hook(point, lambda _: None, name="after")]
    failed = _hook_failed(await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks)))
    assert failed.code == "CancelledError"
    assert f"hook canceller at {point}" in failed.message


# ---- what the hooks hand one commit, together ------------------------------------------

_NEAR_INPUT = DEFAULT_LIMITS.input_bytes - 8 * 1024  # one such message is fine alone


def _injects(count: int, live: bool = False) -> Callable[[Any], Any]:
    def fn(h: Any) -> HookOutput | None:
        if h.step != 0:
            return None
        if live:
            for _ in range(count):
                h.execution.inject_message("y" * _NEAR_INPUT)
            return None
        return HookOutput(reactions=[InjectMessage(text="y" * _NEAR_INPUT)] * count)

    return fn


def _writes(count: int) -> Callable[[Any], Any]:
    size = DEFAULT_LIMITS.state_value_bytes - 1024
    commands = [Command(key=f"k{i}", value="v" * size) for i in range(count)]
    return lambda h: HookOutput(commands=commands) if h.step == 0 else None


_OVER: dict[str, list[Hook]] = {
    "many reactions": [Hook("StepStart", _injects(40), name="over")],
    "many live injections": [Hook("StepStart", _injects(40, live=True), name="over")],
    "two hooks of one point": [
        Hook("StepStart", _injects(1), name="first"),
        Hook("StepStart", _injects(1), name="over"),
    ],
    "two points of one Step": [
        Hook("StepStart", _injects(1), name="first"),
        Hook("BeforeInference", _injects(1), name="over"),
    ],
    "state commands": [Hook("StepStart", _writes(8), name="over")],
    "after a tool": [Hook("AfterTool", _injects(40), name="over")],
}


@pytest.mark.parametrize("case", list(_OVER))
async def test_hooks_handing_one_commit_more_than_an_input_fail_the_hook(case: str) -> None:
    """Each message within ``input_bytes``, each value within ``state_value_bytes``, but
    together past ``input_bytes``: the hook that went over fails, by name, with the
    limit — not the store refusing the commit, nor the state's size."""
    hooks = _OVER[case]
    failed = _hook_failed(await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks)))
    assert "input_bytes" in failed.message and "hook over at" in failed.message, failed


async def test_hooks_within_one_input_together_inject_as_before() -> None:
    hooks = [Hook("StepStart", _injects(1)), Hook("AfterTool", _injects(1))]
    ended = await _rest(Agent(name="a", model=_script(), tools=[fine], hooks=hooks))
    assert ended.cause.kind == "natural", ended.cause


async def test_a_handler_injecting_more_than_an_input_fails_as_a_hook() -> None:
    """A session's handler injects live, as a hook does: its turn's commit carries what
    it injected, held to ``input_bytes`` together, and past it the handler fails."""

    def handler(seen: Any) -> str:
        for _ in range(40):
            seen.execution.inject_message("y" * _NEAR_INPUT)
        return "again"

    session = Session(b=SessionSide(handler=handler, name="h"))
    agent = Agent(name="a", model=_script(), tools=[fine], session=session)
    failed = _hook_failed(await _rest(agent))
    assert "input_bytes" in failed.message and "hook handler h at" in failed.message, failed


def _sealed_and_rejoined(hooks: list[Hook]) -> Agent:
    """One wave of two calls: ``charge`` (never_replay) is sealed by a recovery, and
    ``order`` (durable_request) is rejoined without an ``executing`` commit, so the
    sealed call's AfterTool hooks ride the wave's results commit beside its own."""
    script = [
        ModelResponse(tool_calls=(call("charge", "c1"), call("order", "c2"))),
        ModelResponse(text="ok"),
    ]
    return Agent(name="a", model=ScriptedModel(script), tools=SEALED_AND_REJOINED, hooks=hooks)


@pytest.mark.parametrize("crash", [False, True])
async def test_the_hooks_of_calls_a_recovery_sealed_share_the_commit_s_budget(
    crash: bool,
) -> None:
    """Each call's AfterTool hook injects nearly ``input_bytes``. Both ride one results
    commit, whether the wave ran at once or a recovery sealed one call and rejoined the
    other: the second hook goes over and fails by name (a recovery counted the sealed
    call's hooks apart, and committed both, twice what one commit is given)."""
    hooks = [
        Hook(
            "AfterTool",
            lambda h: HookOutput(reactions=[InjectMessage(text="y" * _NEAR_INPUT)]),
            name="over",
        )
    ]
    store = MemoryCommitStore()
    if crash:
        with pytest.raises(Crash):
            await InProcessRunner(_sealed_and_rejoined(hooks), store).start(
                "go", thread_id="t", faults=FaultPlan(crash_at=("during:tools", 1))
            )
        frontier = await InProcessRunner(_sealed_and_rejoined(hooks), store).recover("t")
    else:
        frontier = await InProcessRunner(_sealed_and_rejoined(hooks), store).start(
            "go", thread_id="t"
        )
    assert isinstance(frontier.run_state, EndedState), frontier.run_state
    failed = _hook_failed(frontier.run_state)
    assert "input_bytes" in failed.message and "hook over at AfterTool" in failed.message


def _noting_step_end(h: Any) -> HookOutput:
    """Each Step's end injects a message and records the Step in the run state."""
    return HookOutput(
        commands=[Command(key=f"ended_{h.step}", scope="run", value=True)],
        reactions=[InjectMessage(text=f"step {h.step} ended")],
    )


async def test_a_session_side_s_step_end_injection_rides_its_handover() -> None:
    """A session's model side answers on every Step, and its StepEnd hook injects each
    time: the second answer's inference commit writes the first message into the
    history and stages the new one. Staged after that commit's commands were settled,
    the new one wrote the key a second way, and the Run failed ``state_conflict``."""
    agent = Agent(
        name="writer",
        model=ScriptedModel([lambda r: ModelResponse(text=f"writer@{r.step}")] * 4),
        hooks=[Hook("StepEnd", _noting_step_end)],
        session=Session(b=SessionSide(handler=lambda s: f"heard {s.turn}"), max_session_turns=4),
    )
    frontier = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert isinstance(frontier.run_state, EndedState), frontier.run_state
    assert frontier.run_state.cause.kind == "natural", frontier.run_state.cause
    texts = [getattr(m, "text", "") for m in frontier.messages]
    assert "step 0 ended" in texts  # step 1's waits staged for an inference to come
    assert frontier.state["run"]["ended_1"] is True
