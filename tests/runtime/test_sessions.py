"""Dual-side sessions: model ↔ model, model ↔ handler, model ↔ human; force_turn,
max_session_turns, stop_session; each through a crash at every fault point."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from runtime import (
    Agent,
    AwaitingState,
    Crash,
    EndedState,
    FaultPlan,
    Hook,
    HookOutput,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    StopSession,
    ToolContext,
    UserInput,
    answer,
    call,
    tool,
)
from runtime.agent import HandlerInput, Session, SessionSide
from runtime.lifecycle import Stopped
from runtime.replay_check import replay
from runtime.session import SESSION_KEY
from storage.memory import MemoryCommitStore
from tests.runtime.agents import SEALED_AND_REJOINED
from tests.support.stubborn import hanging, stopped_once_entered

SEEN: dict[str, list] = {}


def speaker(name: str, *, with_tool: bool = False) -> ScriptedModel:
    """Answers by step, so a recovered Run is answered alike; on its first Step of a
    turn it may call its tool first, then answers with its name and the step."""

    def respond(request):
        SEEN.setdefault(name, []).append(
            [(m.kind, getattr(m, "text", "")) for m in request.messages]
        )
        last = request.messages[-1]
        if with_tool and last.kind != "tool_result":
            return ModelResponse(tool_calls=(call("where", f"w{request.step}"),))
        return ModelResponse(text=f"{name}@{request.step}")

    return ScriptedModel([respond] * 32)


PATHS: list[tuple[str, str, int, int]] = []


@tool(recovery=("replay_safe",))
def where(ctx: ToolContext) -> str:
    e = ctx.execution
    PATHS.append(
        (e.current_side, "/".join(e.prompt_path), e.side_a_step_count, e.side_b_step_count)
    )
    return f"side {e.current_side}"


def model_pair(turns: int = 4) -> Agent:
    other = Agent(name="critic", model=speaker("critic", with_tool=True), tools=[where])
    return Agent(
        name="writer",
        model=speaker("writer"),
        session=Session(b=SessionSide(agent=other), max_session_turns=turns),
    )


def echo_handler(seen: HandlerInput) -> str | None:
    last = seen.messages[-1]
    return f"handler heard {last.text!r} at turn {seen.turn}"


def with_handler(turns: int = 4, handler: Callable = echo_handler) -> Agent:
    return Agent(
        name="writer",
        model=speaker("writer"),
        session=Session(b=SessionSide(handler=handler), max_session_turns=turns),
    )


def with_human(turns: int = 4) -> Agent:
    return Agent(
        name="writer",
        model=speaker("writer"),
        session=Session(b=SessionSide(human="Your reply?"), max_session_turns=turns),
    )


def lines(f) -> list[tuple[str, str | None, str]]:
    return [
        (m.kind, getattr(m, "side", None), getattr(m, "text", "") or getattr(m, "content", ""))
        for m in f.messages
    ]


async def start(agent: Agent, store=None, **kw):
    return await InProcessRunner(agent, store or MemoryCommitStore()).start(
        "write a haiku", thread_id="t", run_id="r", **kw
    )


# ---- the three backings -------------------------------------------------------------


async def test_model_and_model_take_turns_each_seeing_the_session_its_way():
    SEEN.clear()
    PATHS.clear()
    f = await start(model_pair(turns=4))
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    answers = [(side, text) for kind, side, text in lines(f) if kind == "assistant" and text]
    assert answers == [("a", "writer@0"), ("b", "critic@2"), ("a", "writer@3"), ("b", "critic@5")]
    # the critic sees the writer's answers as user messages, never the writer as assistant
    first_critic = SEEN["critic"][0]
    assert first_critic == [("user", "write a haiku"), ("user", "writer@0")]
    # the writer does not see the critic's tool calls or results, only its answer
    assert SEEN["writer"][1] == [
        ("user", "write a haiku"),
        ("assistant", "writer@0"),
        ("user", "critic@2"),
    ]
    # the critic's tool ran with the critic's prompt path and side, counted per side
    assert PATHS == [("b", "critic", 1, 0), ("b", "critic", 2, 2)]
    session = f.state["thread"][SESSION_KEY]
    assert session == {"side": "a", "turns": 4, "a_steps": 2, "b_steps": 4, "ended": True}
    assert f.steps == 6


async def test_a_session_whose_turns_are_over_closes_though_a_guard_refuses_its_end():
    """A run-end guard refusing the session's end ended the Run ``failed(hook)`` and left
    the session open: every later Run of the thread met its turns over and ended the
    same way, without an inference."""
    import dataclasses

    agent = dataclasses.replace(
        with_handler(turns=3), run_end_guards=(lambda seen: "not good enough",)
    )
    store = MemoryCommitStore()
    runner = InProcessRunner(agent, store)
    f = await runner.start("write a haiku", thread_id="t")
    assert (f.run_state.cause.kind, f.run_state.cause.code) == ("failed", "run_end_guard")
    assert f.state["thread"][SESSION_KEY]["ended"] is True
    again = await runner.start("another", thread_id="t")
    assert again.steps > 0  # a fresh session: its model took Steps (none, left open)


@pytest.mark.parametrize(
    "agent",
    [with_handler(turns=3), with_handler(turns=4), model_pair(turns=4)],
    ids=["handler-last-turn-a", "handler-last-turn-b", "model-pair"],
)
async def test_a_guard_at_the_end_of_a_sessions_turns_sees_its_last_answer(agent: Agent):
    """A session whose turns are over ends before a Step, committing no message: its
    run-end guards were shown ``answer=""`` whatever the session had answered. They see
    the session's last answer (a model's; a handler's or a human's turn is none)."""
    import dataclasses

    shown: list[str] = []
    guarded = dataclasses.replace(agent, run_end_guards=(lambda seen: shown.append(seen.answer),))
    f = await start(guarded)
    assert f.run_state.cause.kind == "natural"
    answers = [text for kind, _, text in lines(f) if kind == "assistant" and text]
    assert shown == [answers[-1]] and answers[-1]


async def test_a_guard_is_never_shown_an_earlier_runs_answer_for_this_ones():
    """A Run whose session its handler ends at once answers nothing: its guard was shown
    the last answer of an earlier Run on the thread, and let the end pass for it."""
    shown: list[str] = []

    def guard(seen: Any) -> str | None:
        shown.append(seen.answer)
        return None if "writer" in seen.answer else "no answer of this Run's"

    def ending(seen: HandlerInput) -> None:
        return None

    store = MemoryCommitStore()
    first = with_handler(turns=1)
    runner = InProcessRunner(dataclasses.replace(first, run_end_guards=(guard,)), store)
    f = await runner.start("first", thread_id="t", run_id="r1")
    assert f.run_state.cause.kind == "natural" and shown == ["writer@0"]
    session = Session(b=SessionSide(handler=ending), max_session_turns=1, first="b")
    second = Agent(name="writer", model=speaker("writer"), session=session, run_end_guards=[guard])
    f = await InProcessRunner(second, store).start("second", thread_id="t", run_id="r2")
    assert shown == ["writer@0", ""]
    assert (f.run_state.cause.kind, f.run_state.cause.code) == ("failed", "run_end_guard")


async def test_handler_turns_add_no_steps_but_count_toward_max_session_turns():
    f = await start(with_handler(turns=5))
    assert f.run_state.cause.kind == "natural"
    said = [(side, text) for kind, side, text in lines(f) if kind in ("assistant", "user")]
    assert said == [
        (None, "write a haiku"),
        ("a", "writer@0"),
        ("b", "handler heard 'writer@0' at turn 1"),
        ("a", "writer@1"),
        ("b", "handler heard 'writer@1' at turn 3"),
        ("a", "writer@2"),
    ]
    assert f.steps == 3  # only the model's
    assert f.state["thread"][SESSION_KEY]["turns"] == 5


async def test_a_message_a_handler_injects_is_committed_with_its_turn():
    """``execution.inject_message`` from a handler: the message went nowhere unless a
    hook ran later in the Step (it was staged by the hooks' point only)."""

    def injecting(seen: HandlerInput) -> str:
        if seen.turn == 1:
            seen.execution.inject_message("a note from the handler")
        return echo_handler(seen)

    store = MemoryCommitStore()
    f = await start(with_handler(turns=3, handler=injecting), store)
    said = [(side, text) for kind, side, text in lines(f) if kind == "user"]
    assert said == [
        (None, "write a haiku"),
        ("b", "handler heard 'writer@0' at turn 1"),
        (None, "a note from the handler"),
    ]
    assert [t for k, s, t in lines(f) if k == "assistant"] == ["writer@0", "writer@1"]
    report = await replay(store, "t", with_handler(turns=3, handler=injecting))
    assert report.clean, report.line()


async def test_a_handler_returning_none_ends_the_session_naturally():
    f = await start(with_handler(turns=9, handler=lambda seen: None))
    assert f.run_state.cause.kind == "natural"
    assert f.state["thread"][SESSION_KEY]["ended"] is True
    assert [t for k, s, t in lines(f) if k == "assistant"] == ["writer@0"]


async def test_a_handler_ending_the_session_passes_the_run_end_guards():
    """A handler that returned None ended the Run ``natural`` without asking its run-end
    guards: a guard that refuses every end was bypassed. Every natural end is guarded
    where it is committed; the session is closed whatever the guard says, as at the end
    of its turns (``..._closes_though_a_guard_refuses_its_end``)."""
    import dataclasses

    shown: list[str] = []

    def refusing(seen):
        shown.append(seen.answer)
        return "always refuse"

    handler = with_handler(turns=10, handler=lambda seen: None)
    f = await start(dataclasses.replace(handler, run_end_guards=(refusing,)))
    cause = f.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "hook", "run_end_guard")
    assert cause.message == "always refuse"
    assert shown == ["writer@0"]  # the session's last answer, as at the end of its turns
    assert f.state["thread"][SESSION_KEY]["ended"] is True


async def test_a_handler_that_raises_fails_the_run_as_a_hook_does():
    def broken(seen):
        raise RuntimeError("handler bug")

    f = await start(with_handler(handler=broken))
    assert f.run_state.cause.failure == "hook" and "handler bug" in f.run_state.cause.message


async def test_a_handler_raising_the_engine_s_cancel_signal_fails_as_a_hook_does():
    """A handler that raised ``CancelledSignal`` itself ended its Run ``cancelled``, as if
    the Run had been cancelled."""
    from runtime.signals import CancelledSignal

    def impostor(seen):
        raise CancelledSignal

    f = await start(with_handler(handler=impostor))
    assert f.run_state.cause.failure == "hook"


async def test_a_handler_that_swallows_its_cancellations_does_not_hold_a_stopped_run():
    """The handler runs in the Run's task: one that caught every cancellation it was
    sent held its Run past a stop for good. It is left behind now."""
    entered, released = asyncio.Event(), asyncio.Event()
    runner = InProcessRunner(with_handler(handler=hanging(entered, released)), MemoryCommitStore())
    done = await stopped_once_entered(runner, entered, released)
    assert done.run_state.cause == Stopped(reason="operator stop")


async def test_a_human_side_settles_the_run_idle_awaiting_human_then_resumes():
    store = MemoryCommitStore()
    runner = InProcessRunner(with_human(turns=3), store)
    f = await runner.start("write a haiku", thread_id="t", run_id="r")
    assert isinstance(f.run_state, AwaitingState)
    assert (f.status.state, f.status.reason) == ("idle", "awaiting_human")
    assert f.run_state.ticket.target.prompt == "Your reply?"
    f = await runner.resume(answer(f.run_state.ticket, UserInput(text="more autumn, please")))
    assert f.run_state.cause.kind == "natural"  # three turns: writer, human, writer
    said = [(side, text) for kind, side, text in lines(f) if kind in ("assistant", "user")]
    assert said[1:] == [("a", "writer@0"), ("b", "more autumn, please"), ("a", "writer@1")]


# ---- force_turn, stop_session, stop -------------------------------------------------


async def test_force_turn_gives_the_next_turn_to_the_named_side():
    def keep_writing(h):
        if h.step == 0:
            h.execution.force_turn("a")  # the seed's control, made by a hook

    agent = with_handler(turns=3)
    agent = Agent(
        name=agent.name,
        model=agent.model,
        session=agent.session,
        hooks=[Hook("AfterInference", keep_writing)],
    )
    f = await start(agent)
    sides = [side for kind, side, _ in lines(f) if kind in ("assistant", "user") and side]
    assert sides == ["a", "a", "b"]


async def test_stop_session_ends_it_for_good_and_stop_only_ends_the_run():
    def stop_session(h):
        return HookOutput(reactions=[StopSession(reason="done talking")])

    agent = Agent(
        name="writer",
        model=speaker("writer"),
        session=Session(b=SessionSide(handler=echo_handler), max_session_turns=8),
        hooks=[Hook("StepEnd", stop_session)],
    )
    store = MemoryCommitStore()
    f = await InProcessRunner(agent, store).start("go", thread_id="t", run_id="r1")
    assert f.run_state.cause.kind == "stopped" and f.run_state.cause.reason == "done talking"
    assert f.state["thread"][SESSION_KEY]["ended"] is True

    def stop(h):
        h.execution.stop("pause the talk")

    agent = Agent(
        name="writer",
        model=speaker("writer"),
        session=Session(b=SessionSide(handler=echo_handler), max_session_turns=8),
        hooks=[Hook("StepEnd", stop)],
    )
    f = await InProcessRunner(agent, store).start("again", thread_id="t", run_id="r2")
    assert f.state["thread"][SESSION_KEY]["ended"] is False  # a fresh session, still open
    turns = f.state["thread"][SESSION_KEY]["turns"]
    f = await InProcessRunner(agent, store).start("go on", thread_id="t", run_id="r3")
    assert f.state["thread"][SESSION_KEY]["turns"] >= turns  # the next Run continued it


def test_a_session_side_is_backed_by_exactly_one_thing():
    with pytest.raises(ValueError, match="exactly one"):
        SessionSide()
    with pytest.raises(ValueError, match="exactly one"):
        SessionSide(handler=echo_handler, human="hi")


@pytest.mark.parametrize("turns", [0, -1, 1.5, "3", None, True])
def test_max_session_turns_is_a_whole_count(turns):
    side = SessionSide(handler=echo_handler)
    with pytest.raises(ValueError, match="max_session_turns must be an integer"):
        Session(b=side, max_session_turns=turns)


# ---- crash at every fault point -------------------------------------------------------

AGENTS: dict[str, Callable[[], Agent]] = {
    "model-model": lambda: model_pair(turns=4),
    "model-handler": lambda: with_handler(turns=4),
    "model-human": lambda: with_human(turns=4),
}


async def run_to_end(runner: InProcessRunner, f, faults: FaultPlan | None = None):
    """Answer every human turn (by the turn it is, so alike after a crash) until the end."""
    while isinstance(f.run_state, AwaitingState):
        turn = f.state["thread"][SESSION_KEY]["turns"]
        command = answer(f.run_state.ticket, UserInput(text=f"human reply at turn {turn}"))
        f = await (runner.resume(command, faults) if faults else runner.resume(command))
    return f


def _clean(kind: str):
    async def go():
        plan = FaultPlan()
        runner = InProcessRunner(AGENTS[kind](), MemoryCommitStore())
        f = await runner.start("write a haiku", thread_id="t", run_id="r", faults=plan)
        f = await run_to_end(runner, f, plan)
        return plan.seen, lines(f)

    return asyncio.run(go())


CLEAN = {kind: _clean(kind) for kind in AGENTS}
CASES = [(kind, point) for kind, (points, _) in CLEAN.items() for point in points]


@pytest.mark.parametrize(("kind", "point"), CASES, ids=[f"{k}-{p[0]}#{p[1]}" for k, p in CASES])
async def test_a_session_survives_a_crash_at_every_fault_point(kind, point):
    store = MemoryCommitStore()
    faults = FaultPlan(crash_at=point)
    runner = InProcessRunner(AGENTS[kind](), store)
    f = None
    try:
        f = await runner.start("write a haiku", thread_id="t", run_id="r", faults=faults)
        f = await run_to_end(runner, f, faults)
    except Crash:
        fresh = InProcessRunner(AGENTS[kind](), store)
        if await store.read("t"):
            f = await fresh.recover("t")
        else:  # nothing committed: the caller redelivers the start
            f = await fresh.start("write a haiku", thread_id="t", run_id="r")
        f = await run_to_end(fresh, f)
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    assert lines(f) == CLEAN[kind][1]


@tool(recovery=("replay_safe",))
def keep_the_floor(ctx: ToolContext) -> str:
    ctx.execution.force_turn("a")
    return "floor kept"


def floor_keeper() -> Agent:
    def respond(request):
        if request.step == 0:
            return ModelResponse(tool_calls=(call("keep_the_floor", "k1"),))
        return ModelResponse(text=f"writer@{request.step}")

    return Agent(
        name="writer",
        model=ScriptedModel([respond] * 8),
        tools=[keep_the_floor],
        session=Session(b=SessionSide(handler=echo_handler), max_session_turns=3),
    )


@pytest.mark.parametrize("crash", [None, ("after:results", 1)])
async def test_a_tools_forced_turn_is_committed_with_its_result(crash):
    store = MemoryCommitStore()
    try:
        f = await start(floor_keeper(), store, faults=FaultPlan(crash_at=crash))
        assert crash is None
    except Crash:
        f = await InProcessRunner(floor_keeper(), store).recover("t")
    sides = [side for kind, side, text in lines(f) if kind in ("assistant", "user") and side]
    assert sides == ["a", "a", "a", "b"]  # the call, its answer, a again, b
    assert f.run_state.cause.kind == "natural"


async def test_a_tools_and_an_after_tool_hooks_forced_turns_in_one_step_the_last_counts():
    """The tool forces side a, then the call's AfterTool hook forces side b: two writes
    of the one key in one commit would fail the Run; the hook's, made last, counts."""

    def hand_over(h):
        h.execution.force_turn("b")

    keeper = floor_keeper()
    agent = Agent(
        name=keeper.name,
        model=keeper.model,
        tools=[keep_the_floor],
        session=keeper.session,
        hooks=[Hook("AfterTool", hand_over)],
    )
    f = await start(agent)
    assert f.run_state.cause.kind == "natural", f.run_state
    sides = [side for kind, side, _ in lines(f) if kind in ("assistant", "user") and side]
    assert sides[:3] == ["a", "a", "b"]  # the call, its result, then b as the hook asked


def sealed_and_rejoined_forcing() -> Agent:
    """One wave of ``charge`` (never_replay: a recovery seals it) and ``order``
    (durable_request: a recovery rejoins it, committing no ``executing`` again): each
    call's AfterTool hook forces a turn, ``charge``'s to b, then ``order``'s to a."""

    def force(h):
        h.execution.force_turn("b" if h.call.call_id == "c1" else "a")

    def respond(request):
        if request.step == 0:
            return ModelResponse(tool_calls=(call("charge", "c1"), call("order", "c2")))
        return ModelResponse(text=f"writer@{request.step}")

    return Agent(
        name="writer",
        model=ScriptedModel([respond] * 8),
        tools=SEALED_AND_REJOINED,
        session=Session(b=SessionSide(handler=echo_handler), max_session_turns=3),
        hooks=[Hook("AfterTool", force)],
    )


@pytest.mark.parametrize("crash", [None, ("during:tools", 1)])
async def test_the_forced_turns_of_sealed_and_rejoined_calls_hooks_the_last_counts(crash):
    """After a crash the sealed call's hook forces a turn before the rejoined call runs,
    and its forced side is staged for the next commit: the wave's results commit, where
    the rejoined call's hook forces one too. Two writes of the one key in one commit
    failed the Run (state_conflict); the last force counts, as in the Run never
    interrupted: a answers, then a again, then b."""
    store = MemoryCommitStore()
    try:
        f = await start(sealed_and_rejoined_forcing(), store, faults=FaultPlan(crash_at=crash))
        assert crash is None
    except Crash:
        f = await InProcessRunner(sealed_and_rejoined_forcing(), store).recover("t")
    assert f.run_state.cause.kind == "natural", f.run_state
    sides = [side for kind, side, _ in lines(f) if kind in ("assistant", "user") and side]
    assert sides == ["a", "a", "a", "b"]  # the calls, a's answer, a again (forced), b
