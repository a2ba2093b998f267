"""Tools that misbehave at the tool boundary: each failure is its own call's error, seen
by the model, and never escapes into the wave, the other calls, or the event loop (an
executor runs the waves of many Runs in one call: one call raising through would have
lost them all)."""

from __future__ import annotations

import sys

import pytest

from runtime import (
    Agent,
    Command,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    OutcomeUnknown,
    ScriptedModel,
    ToolResult,
    call,
    tool,
)
from runtime.ports import Finished
from runtime.tools import LocalToolRunner
from storage.memory import MemoryCommitStore

from .test_sync_tools import invocation


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for you")


class Custom(BaseException):
    pass


@tool
async def exits_on_the_loop() -> str:
    sys.exit(3)


@tool
def exits_in_a_thread() -> str:
    raise KeyboardInterrupt


@tool(timeout_s=5)
async def exits_under_a_timeout() -> str:
    raise SystemExit(1)


@tool
async def generator_exit() -> str:
    raise GeneratorExit


@tool
async def custom_base() -> str:
    raise Custom("mine")


@tool
async def unprintable() -> str:
    raise Unprintable


@tool
async def fine() -> str:
    return "fine"


TOOLS = [
    exits_on_the_loop,
    exits_in_a_thread,
    exits_under_a_timeout,
    generator_exit,
    custom_base,
    unprintable,
    fine,
]
HOSTILE = [
    ("exits_on_the_loop", "SystemExit"),
    ("exits_in_a_thread", "KeyboardInterrupt"),
    ("exits_under_a_timeout", "SystemExit"),
    ("generator_exit", "GeneratorExit"),
    ("custom_base", "Custom"),
    ("unprintable", "cannot be printed"),
]


@pytest.mark.parametrize(("name", "said"), HOSTILE, ids=[n for n, _ in HOSTILE])
async def test_a_hostile_failure_is_its_own_call_s_error(name: str, said: str) -> None:
    runner = LocalToolRunner(TOOLS)
    outcomes = await runner.run([invocation(name, "a"), invocation("fine", "b")])
    hostile, neighbour = outcomes
    assert isinstance(hostile, Finished) and hostile.output.is_error, hostile
    assert said in hostile.output.content
    assert isinstance(neighbour, Finished) and neighbour.output.content == "fine"
    # and the loop goes on: a later call runs
    (again,) = await runner.run([invocation("fine", "c")])
    assert again.output.content == "fine"


async def test_a_finished_call_s_commands_survive_a_crash_while_its_neighbour_is_retried():
    """A finishes with state commands; B is lost and tried again. The retry's executing
    commit holds A completed: a crash right after it, and recovery never runs A again,
    so A's commands must have gone in with that commit."""
    tries: list[int] = []

    @tool
    def setter() -> ToolResult:
        return ToolResult(content="set", commands=[Command(key="k", value="from A")])

    @tool(recovery=("replay_safe",))
    def flaky() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise OutcomeUnknown("lost on the way back")
        return "ok"

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("setter", "a"), call("flaky", "b"))),
            ModelResponse(text="done"),
        ]
    )
    runner = InProcessRunner(
        Agent(name="a", model=model, tools=[setter, flaky]), MemoryCommitStore()
    )
    # the first executing is committed with the inference: the retry's is the first alone
    with pytest.raises(Crash):  # right after the retry's executing commit
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("after:executing", 1)))
    done = await runner.recover("t")
    assert done.run_state.cause.kind == "natural"
    assert done.state["thread"]["k"] == "from A"


async def test_a_call_that_never_got_a_tool_thread_is_unavailable_and_never_runs():
    """Synchronous calls past their timeout keep their threads (a thread cannot be
    interrupted). Once every tool thread is held so, a later call waits in the queue
    and times out without having run: it is unavailable (tried again), not lost (its
    never_replay policy would have ended it indeterminate), and it never runs later."""
    import threading

    from runtime.ports import Lost, Unavailable
    from runtime.tools import SYNC_TOOL_THREADS

    from .test_sync_tools import DEADLINE_S

    released, ran = threading.Event(), threading.Event()

    @tool(timeout_s=0.2)
    def stuck() -> str:
        released.wait(DEADLINE_S)
        return "late"

    @tool(timeout_s=0.5)
    def victim() -> str:
        ran.set()
        return "ran"

    @tool
    def sentinel() -> str:
        return "drained"

    runner = LocalToolRunner([stuck, victim, sentinel])
    jam = [invocation("stuck", f"s{i}") for i in range(SYNC_TOOL_THREADS)]
    try:
        outcomes = await runner.run([*jam, invocation("victim", "v")])
    finally:
        released.set()
    assert all(isinstance(o, Lost) for o in outcomes[:-1])
    assert isinstance(outcomes[-1], Unavailable), outcomes[-1]
    (drained,) = await runner.run([invocation("sentinel", "z")])  # queued after the victim
    assert drained.output.content == "drained" and not ran.is_set()
