"""A wait a hook asks for in the middle of a Step (``RequestInput``, ``Pause``) is a
decision committed with the Step: it is taken at the Step boundary exactly once, even
when a call of the same batch waits first (its resume drives on from the store), or the
driver dies between the commit that carried the hook's output and the wait."""

from __future__ import annotations

import asyncio

import pytest

from runtime import (
    Agent,
    Crash,
    EndedState,
    FaultPlan,
    Hook,
    HookOutput,
    InProcessRunner,
    ModelResponse,
    Pause,
    PermissionDecision,
    RequestInput,
    ScriptedModel,
    UserInput,
    call,
    tool,
)
from runtime.lifecycle import AwaitingState, Unpause, answer
from storage.memory import MemoryCommitStore

REACTIONS = {
    "user_input": (RequestInput(prompt="Which account?"), UserInput(text="savings")),
    "pause": (Pause(), Unpause()),
}


@tool(recovery=("replay_safe",))
def noop(x: int) -> str:
    return "ok"


@tool(needs_permission=True)
def guarded(x: int) -> str:
    return "ran"


def asking_agent(point: str, wait: str, *, permission: bool = False) -> Agent:
    """Step 0 asks for two calls (``noop``, and ``guarded`` with ``permission``); a hook
    at ``point`` asks for ``wait`` once, on Step 0 (at AfterTool: ``noop``'s)."""
    reaction = REACTIONS[wait][0]

    def ask(h):
        if h.step != 0 or (h.call is not None and h.call.tool != "noop"):
            return None
        return HookOutput(reactions=[reaction])

    calls = (call("noop", "c1", x=1), *((call("guarded", "c2", x=2),) if permission else ()))
    model = ScriptedModel([ModelResponse(tool_calls=calls), ModelResponse(text="finished")])
    tools = [noop, guarded] if permission else [noop]
    return Agent(name="asker", model=model, tools=tools, hooks=[Hook(point, ask)])


async def awaits(store: MemoryCommitStore) -> int:
    return sum(r.commit.label == "awaiting" for r in await store.read("t"))


@pytest.mark.parametrize("point", ["AfterInference", "AfterTool"])
@pytest.mark.parametrize("wait", sorted(REACTIONS))
async def test_a_hooks_wait_is_taken_after_a_calls_wait_in_its_batch_is_resumed(point, wait):
    store = MemoryCommitStore()
    runner = InProcessRunner(asking_agent(point, wait, permission=True), store)
    f = await runner.start("go", thread_id="t", run_id="r")
    assert f.run_state.ticket.target.wait == "permission"
    f = await runner.resume(answer(f.run_state.ticket, PermissionDecision(approve=True)))
    # the batch is done: the Step ends, and the hook's wait is taken before Step 1
    assert isinstance(f.run_state, AwaitingState), f.run_state
    assert f.run_state.ticket.target.kind == wait
    assert f.batch is not None and f.batch.all_terminal
    f = await runner.resume(answer(f.run_state.ticket, REACTIONS[wait][1]))
    assert f.run_state.cause.kind == "natural"
    assert [m.content for m in f.messages if m.kind == "tool_result"] == ["ok", "ran"]
    assert await awaits(store) == 2  # the permission, then the hook's: once
    assert "wait_request" not in f.state["run"]


def _fault_points(point: str) -> list[tuple[str, int]]:
    plan = FaultPlan()
    agent = asking_agent(point, "user_input")
    asyncio.run(InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t", faults=plan))
    return plan.seen


@pytest.mark.parametrize(
    ("point", "crash"),
    [(p, c) for p in ("AfterInference", "AfterTool") for c in _fault_points(p)],
    ids=lambda v: v if isinstance(v, str) else f"{v[0]}#{v[1]}",
)
async def test_a_hooks_wait_survives_a_crash_and_is_taken_once(point, crash):
    store = MemoryCommitStore()
    with pytest.raises(Crash):
        await InProcessRunner(asking_agent(point, "user_input"), store).start(
            "go", thread_id="t", run_id="r", faults=FaultPlan(crash_at=crash)
        )
    fresh = InProcessRunner(asking_agent(point, "user_input"), store)
    if await store.read("t"):
        f = await fresh.recover("t")
    else:  # nothing committed: the caller redelivers the start, idempotent by run id
        f = await fresh.start("go", thread_id="t", run_id="r")
    assert isinstance(f.run_state, AwaitingState), f.run_state
    assert f.run_state.ticket.target.prompt == "Which account?"
    f = await fresh.resume(answer(f.run_state.ticket, UserInput(text="savings")))
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    assert await awaits(store) == 1
    assert [m.text for m in f.messages if m.kind == "user"] == ["go", "savings"]
    assert "wait_request" not in f.state["run"]


async def test_a_hooks_wait_held_by_a_run_that_ended_is_not_the_next_runs():
    store = MemoryCommitStore()
    runner = InProcessRunner(asking_agent("AfterInference", "pause", permission=True), store)
    f = await runner.start("go", thread_id="t", run_id="r1")
    assert f.run_state.ticket.target.wait == "permission"
    assert f.state["run"]["wait_request"]["kind"] == "pause"  # committed with the Step
    await runner.engine().terminate("t")  # r1 ends before its Step boundary
    plain = Agent(name="asker", model=ScriptedModel([ModelResponse(text="hello")]))
    f = await InProcessRunner(plain, store).start("again", thread_id="t", run_id="r2")
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    assert await awaits(store) == 1  # r1's permission only
