"""Token usage committed with each inference, the Run's and thread's totals, and the
budget that pauses a Run before an inference would go past it."""

from __future__ import annotations

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, answer, call, tool
from runtime.lifecycle import Unpause
from runtime.models import Usage
from runtime.usage import Budget, admitted_usage, step_usage
from storage.memory import MemoryCommitStore


@tool
def noop() -> str:
    return "ok"


def spending(steps: int, used: Usage) -> ScriptedModel:
    """``steps`` Steps that each call a tool, then an answer; every one uses ``used``."""
    script = [ModelResponse(tool_calls=(call("noop", f"c{i}"),), usage=used) for i in range(steps)]
    return ScriptedModel([*script, ModelResponse(text="done", usage=used)])


USED = Usage(input_tokens=60, output_tokens=40, cached_tokens=10, model="m-1")


async def test_each_inference_commits_its_usage_and_the_frontier_keeps_the_totals():
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=spending(2, USED), tools=[noop]), store)
    f = await runner.start("go", thread_id="t", run_id="r1")
    want = {"input_tokens": 180, "output_tokens": 120, "cached_tokens": 30, "inferences": 3}
    assert f.state["run"]["usage"] == want and f.state["run"]["model"] == "m-1"
    per_step = [step_usage(r.commit.commands) for r in await store.read("t")]
    one = {"input_tokens": 60, "output_tokens": 40, "cached_tokens": 10, "inferences": 1}
    assert [u for u in per_step if u is not None] == [(one, "m-1")] * 3
    again = await runner.start("more", thread_id="t", run_id="r2")
    assert again.state["run"]["usage"] == want  # the Run's own
    assert again.state["thread"]["usage"] == {k: 2 * v for k, v in want.items()}  # the thread's


async def test_a_model_without_usage_commits_none():
    f = await InProcessRunner(
        Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")])), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert "usage" not in f.state["run"]


def test_usage_a_provider_cannot_have_used_is_not_believed():
    assert admitted_usage(Usage(input_tokens=-1)) is None
    assert admitted_usage(Usage(output_tokens=2**62)) is None
    assert admitted_usage(Usage.model_construct(input_tokens="12")) is None  # built unchecked
    assert admitted_usage({"input_tokens": 1}) is None
    # cached input is a part of the input: more of it made every later input free of cost
    held = admitted_usage(Usage(input_tokens=7, cached_tokens=10**9, output_tokens=3))
    assert held == Usage(input_tokens=7, cached_tokens=7, output_tokens=3)
    shown = admitted_usage(Usage(input_tokens=1, model="m\ud800" + "x" * 500))
    assert shown is not None and len(shown.model) <= 200 and "\ud800" not in shown.model


async def test_a_run_past_its_token_budget_pauses_and_an_unpause_grants_it_anew():
    # 100 tokens an inference: after two (200), a third would make 300 > 250
    agent = Agent(name="a", model=spending(4, USED), tools=[noop], budget=Budget(max_tokens=250))
    runner = InProcessRunner(agent, MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    target = f.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "budget")
    assert f.state["run"]["usage"]["inferences"] == 2
    assert (f.status.state, f.status.reason) == ("idle", "awaiting_pause")
    f = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert f.run_state.ticket.target.reason == "budget"  # two more, then paused again
    assert f.state["run"]["usage"]["inferences"] == 4
    f = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert f.run_state.cause.kind == "natural" and f.state["run"]["usage"]["inferences"] == 5


async def test_a_cost_budget_counts_cached_input_at_its_own_price():
    # per inference: 50 fresh input at 1.0, 10 cached at 0.1, 40 output at 2.0 (per Mtok)
    budget = Budget(max_cost=0.0003, input_cost=1.0, cached_cost=0.1, output_cost=2.0)
    assert (
        abs(budget.cost({"input_tokens": 60, "cached_tokens": 10, "output_tokens": 40}) - 131e-6)
        < 1e-12
    )
    agent = Agent(name="a", model=spending(3, USED), tools=[noop], budget=budget)
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    # 131e-6 an inference: two make 262e-6, a third would pass 300e-6
    assert f.run_state.ticket.target.reason == "budget"
    assert f.state["run"]["usage"]["inferences"] == 2


def test_a_budget_that_cannot_be_is_refused_when_made():
    import pytest
    from pydantic import ValidationError

    bads = ({"max_tokens": -1}, {"max_tokens": True}, {"max_tokens": "5"}, {"max_tokens": 2.0})
    for bad in (*bads, {"max_cost": float("nan")}, {"input_cost": -0.5}):
        with pytest.raises(ValidationError):
            Budget(**bad)


def test_a_budget_of_the_wrong_type_is_refused_when_the_agent_is_made():
    """(A dict from a config file was taken, and the Run failed ``internal`` at its second
    inference, the first one spent.)"""
    import pytest

    for bad in ({"max_tokens": 5}, 5):
        with pytest.raises(TypeError, match="budget"):
            Agent(name="a", model=spending(1, USED), tools=[noop], budget=bad)


async def test_an_inference_the_run_ends_on_before_its_commit_is_still_counted():
    """The provider counted it, whatever ends the Run before its commit: an
    AfterInference hook that raises, or a commit past the thread's history limit. Both
    ends used to record no usage of it."""
    from runtime.hooks import Hook
    from runtime.limits import Limits

    def broken(hook_input):
        raise RuntimeError("hook bug")

    hooked = Agent(
        name="a", model=spending(1, USED), tools=[noop], hooks=[Hook("AfterInference", broken)]
    )
    f = await InProcessRunner(hooked, MemoryCommitStore()).start("go", thread_id="t")
    assert (f.run_state.cause.kind, f.run_state.cause.failure) == ("failed", "hook")
    one = {"input_tokens": 60, "output_tokens": 40, "cached_tokens": 10, "inferences": 1}
    assert f.state["run"]["usage"] == one == f.state["thread"]["usage"]

    long = ModelResponse(text="x" * 5000, tool_calls=(call("noop", "c1"),), usage=USED)
    agent = Agent(name="a", model=ScriptedModel([long]), tools=[noop])
    runner = InProcessRunner(agent, MemoryCommitStore(), limits=Limits(history_bytes=4000))
    f = await runner.start("go", thread_id="t")
    assert (f.run_state.cause.kind, f.run_state.cause.code) == ("failed", "history_bytes")
    assert f.state["run"]["usage"] == one


async def test_an_unpause_always_lets_the_run_move():
    """A first inference far over the budget made the average alone pass it: every
    Unpause committed a resume and at once a new pause, and the Run never moved."""
    huge = Usage(input_tokens=1_000_000, output_tokens=0)
    agent = Agent(name="a", model=spending(3, huge), tools=[noop], budget=Budget(max_tokens=10))
    runner = InProcessRunner(agent, MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    for inferences in (1, 2, 3):
        assert f.run_state.ticket.target.reason == "budget"
        assert f.state["run"]["usage"]["inferences"] == inferences
        f = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert f.run_state.cause.kind == "natural" and f.state["run"]["usage"]["inferences"] == 4


async def test_a_cached_surplus_does_not_make_later_input_free():
    """One report of more cached input than input (0 input, 10**9 cached) gave the Run's
    totals a surplus that priced every later inference's input at the cached rate: the
    Run ran past ``max_cost`` without a pause."""
    odd = Usage(input_tokens=0, cached_tokens=10**9)
    big = Usage(input_tokens=1_000_000)
    script = [
        ModelResponse(tool_calls=(call("noop", f"c{i}"),), usage=odd if i == 0 else big)
        for i in range(8)
    ]
    budget = Budget(max_cost=2.5, input_cost=1.0)  # a dollar per inference after the first
    agent = Agent(
        name="a",
        model=ScriptedModel([*script, ModelResponse(text="done")]),
        tools=[noop],
        budget=budget,
    )
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert f.run_state.ticket.target.reason == "budget"
    assert f.state["run"]["usage"]["inferences"] == 3  # $2 spent; a third would pass 2.5
