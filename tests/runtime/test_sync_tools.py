"""Synchronous tools run in the process's tool threads: a blocking call stalls nobody,
and ``timeout_s`` bounds it (the call then follows its pinned recovery policy)."""

from __future__ import annotations

import threading

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call, tool
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.ports import Finished, Lost, ToolInvocation
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore

DEADLINE_S = 10.0


def invocation(tool_id: str, call_id: str, timeout_s: float | None = None) -> ToolInvocation:
    return ToolInvocation(
        operation_id=OperationId(f"op-{call_id}"),
        call_id=CallId(call_id),
        tool=tool_id,
        arguments={},
        attempt=1,
        run_id=RunId("r"),
        thread_id=ThreadId("t"),
        timeout_s=timeout_s,
    )


async def test_a_blocking_tool_does_not_stall_the_other_calls_of_its_wave():
    """The blocking call waits for its neighbour, which can only run if the blocking
    one is off the event loop (on the loop, it would wait out its deadline)."""
    released = threading.Event()

    @tool
    def blocking() -> str:
        return "released" if released.wait(DEADLINE_S) else "stalled"

    @tool
    async def neighbour() -> str:
        released.set()
        return "ran"

    runner = LocalToolRunner([blocking, neighbour])
    outcomes = await runner.run([invocation("blocking", "a"), invocation("neighbour", "b")])
    assert [o.output.content for o in outcomes if isinstance(o, Finished)] == ["released", "ran"]


async def test_a_synchronous_call_past_its_timeout_is_lost_and_follows_its_policy():
    freed = threading.Event()

    @tool(timeout_s=0.1)
    def hangs() -> str:
        freed.wait(DEADLINE_S)  # set once the test saw the timeout: the thread ends
        return "too late"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("hangs", "c1"),)), ModelResponse(text="done")]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[hangs]), MemoryCommitStore())
    try:
        (outcome,) = await LocalToolRunner([hangs]).run([invocation("hangs", "x")])
        assert isinstance(outcome, Lost) and "timed out after 0.1s" in outcome.message
        f = await runner.start("go", thread_id="t")
    finally:
        freed.set()
    # never_replay (its default): the timed-out call is indeterminate, the model is told
    (result,) = [m for m in f.messages if m.kind == "tool_result"]
    assert result.is_error and f.run_state.cause.kind == "natural"


async def test_a_synchronous_tool_sees_the_callers_context_variables():
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    @tool
    def reads() -> str:
        return var.get()

    var.set("the caller's")
    (outcome,) = await LocalToolRunner([reads]).run([invocation("reads", "a")])
    assert isinstance(outcome, Finished) and outcome.output.content == "the caller's"
