"""Terminal-only child delegation on the in-process runner."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from runtime import Crash, EndedState, FaultPlan, InProcessRunner, PermissionDecision
from runtime.delegation import DelegationLimits, child_ids
from runtime.ids import CallId, RunId, ThreadId
from runtime.lifecycle import AwaitingState
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

from . import delegation_agents as agents
from .test_waits_and_control import command_for

HERE = agents.HERE


def runner(agent, store=None) -> InProcessRunner:
    return InProcessRunner(agent, store or MemoryCommitStore(), agent_ref=f"{HERE}:{agent.name}")


async def children_of(store, parent) -> list:
    threads = parent.state["run"].get("children", {})
    return [await store.load(t) for t in threads.values()]


async def activations(store, thread) -> int:
    return sum(r.commit.label == "activation" for r in await store.read(thread))


async def test_fan_out_to_eight_children_runs_them_concurrently_in_model_order():
    store = MemoryCommitStore()
    f = await runner(agents.fanout(), store).start("go", thread_id="p")
    assert f.run_state.cause.kind == "natural"
    assert json.loads(f.messages[-1].text) == [f"done: task {i}" for i in range(8)]
    kids = await children_of(store, f)
    assert len(kids) == 8
    # overlap from committed timestamps: every child started before any child ended
    starts, ends = [], []
    for kid in kids:
        statuses = [r.commit.status for r in await store.read(kid.thread_id) if r.commit.status]
        starts.append(statuses[0].since)
        ends.append(statuses[-1].since)
    assert max(starts) < min(ends)


async def test_child_ids_are_derived_from_parent_run_and_call():
    store = MemoryCommitStore()
    f = await runner(agents.fanout(), store).start("go", thread_id="p", run_id="r")
    thread, run = child_ids("p", "r", "d3")
    assert f.state["run"]["children"]["d3"] == thread
    assert (await store.load(thread)).run_id == run


async def test_prompt_path_inside_a_child():
    agents.PROMPT_PATHS.clear()
    await runner(agents.fanout()).start("go", thread_id="p")
    assert set(agents.PROMPT_PATHS) == {("fanout", "worker")}


@pytest.mark.parametrize(
    "point",
    [
        ("during:tools", 1),  # after the relationship commit, before any child starts
        ("before:results", 1),
    ],  # children finished, parent has not consumed their results
)
async def test_parent_crash_leaves_exactly_one_child_per_call(point):
    store = MemoryCommitStore()
    with pytest.raises(Crash):
        await runner(agents.fanout(), store).start("go", thread_id="p", faults=FaultPlan(point))
    f = await runner(agents.fanout(), store).recover("p")
    assert f.run_state.cause.kind == "natural"
    assert json.loads(f.messages[-1].text) == [f"done: task {i}" for i in range(8)]
    for kid in await children_of(store, f):
        assert await activations(store, kid.thread_id) == 1
        assert kid.run_state.cause.kind == "natural"
    results = [m for m in f.messages if m.kind == "tool_result"]
    assert len(results) == 8  # every result consumed once


async def test_a_child_crash_mid_run_is_recovered_and_consumed_once():
    store = MemoryCommitStore()
    first = runner(agents.fanout(), store)
    first.children.faults = FaultPlan(("after:activation", 3))  # the third child to start dies
    with pytest.raises(Crash):
        await first.start("go", thread_id="p")
    f = await runner(agents.fanout(), store).recover("p")
    assert f.run_state.cause.kind == "natural"
    for kid in await children_of(store, f):
        assert await activations(store, kid.thread_id) == 1
    assert json.loads(f.messages[-1].text) == [f"done: task {i}" for i in range(8)]


@pytest.mark.parametrize(
    ("limits", "n", "refused"),
    [
        (DelegationLimits(max_parallel=2), 3, [2]),
        (DelegationLimits(max_total=2), 3, [2]),
        (DelegationLimits(max_depth=1), 2, [0, 1]),
    ],
)
async def test_limits_refuse_starts_as_model_visible_errors(limits, n, refused):
    store = MemoryCommitStore()
    agent = agents.fanout_agent("worker", n, limits)
    f = await runner(agent, store).start("go", thread_id="p")
    out = json.loads(f.messages[-1].text)
    assert [i for i, text in enumerate(out) if text.startswith("delegation refused")] == refused
    assert len(await children_of(store, f)) == n - len(refused)


async def test_a_session_s_side_b_is_held_to_the_depth_limit():
    """Side b's prompt path dropped its ancestry: every child's side b delegated from
    depth 1, and a session delegating to itself nested children without end."""
    store = MemoryCommitStore()
    f = await asyncio.wait_for(runner(agents.debate, store).start("go", thread_id="s"), 60)
    assert isinstance(f.run_state, EndedState)
    deepest = max(s.thread_id.count("/") for s in await store.list_runs())
    assert deepest <= 3


async def test_cycles_are_refused_unless_allowed():
    f = await runner(agents.self_delegating()).start("go", thread_id="p")
    assert "cycle" in json.loads(f.messages[-1].text)[0]
    store = MemoryCommitStore()
    f = await runner(agents.deep(), store).start("go", thread_id="p")
    # root → child → grandchild; the grandchild's own delegation hits max_depth 3
    assert f.run_state.cause.kind == "natural"
    text = json.dumps(json.loads(f.messages[-1].text))
    assert "depth limit 3" in text


def test_child_ids_stay_within_the_id_limit_at_any_depth():
    thread, run = ThreadId("t" * 40), RunId("r" * 36)
    seen = set()
    for _ in range(12):
        child, child_run = child_ids(thread, run, CallId("call_" + "x" * 24))
        assert len(child) <= 256 and len(child_run) <= 256
        assert child_ids(thread, run, CallId("call_" + "x" * 24)) == (child, child_run)
        assert child_ids(thread, run, CallId("another"))[0] != child
        seen.add(child)
        thread, run = child, child_run
    assert len(seen) == 12
    assert child_ids(ThreadId("p"), RunId("r"), CallId("d3")) == ("p/d3@r", "r/d3")  # as before
    assert len(child_ids(thread, run, CallId("c"), max_chars=64)[0]) == 64


async def test_delegation_eight_deep_with_long_call_ids_comes_to_rest():
    store = MemoryCommitStore()
    f = await runner(agents.deep_long_ids(), store).start("go", thread_id="p" * 40)
    assert f.run_state.cause.kind == "natural"
    assert "depth limit 8" in json.dumps(json.loads(f.messages[-1].text))


async def test_a_child_input_no_store_can_hold_fails_only_that_call():
    store = MemoryCommitStore()
    f = await runner(agents.surrogate_input(), store).start("go", thread_id="p")
    assert f.run_state.cause.kind == "natural"
    (text,) = json.loads(f.messages[-1].text)
    assert "refused" in text and "utf8" in text  # the call's arguments: no child starts
    assert await children_of(store, f) == []


@pytest.mark.parametrize(
    ("target", "allowed"),
    [
        ("pdb:set_trace", None),  # would stop the host's event loop
        ("tests.ray.agents:long_napping_agent", None),  # another module, not named
        (f"{HERE}:worker", ("tests.ray.agents:long_napping_agent",)),  # not among those named
        ("worker", None),  # not a reference at all
        (f"{HERE}:reset_everything", None),  # of its module, but no agent factory
    ],
)
async def test_a_model_delegates_only_to_agents_its_agent_may_start(target, allowed):
    """The model names the child's agent; loading it imports the module it names. Only
    agents of the delegating agent's module, or those its limits name, may be started:
    any other is a refusal the model reads, and nothing is imported or started."""
    from runtime import Agent, ModelResponse, ScriptedModel, call
    from runtime.delegation import delegate_tool

    first = ModelResponse(tool_calls=(call("delegate", "d0", agent=target, input="task"),))
    answer = lambda r: ModelResponse(text=json.dumps(agents._results(r)))  # noqa: E731
    parent = Agent(
        name="picky",
        model=ScriptedModel([first, answer]),
        tools=[delegate_tool()],
        delegation=DelegationLimits(agents=allowed),
    )
    store = MemoryCommitStore()
    f = await runner(parent, store).start("go", thread_id="p")
    assert f.run_state.cause.kind == "natural"
    (text,) = json.loads(f.messages[-1].text)
    assert text.startswith("delegation refused") and "may delegate to" in text, text
    assert await children_of(store, f) == []
    assert agents.RESET == []  # looked up, never called


async def _cancelled_with_three_children_waiting(store, r):
    """Start a parent of three slow children, cancel it once all three wait: its end."""
    engine = r.engine()
    task = asyncio.create_task(engine.start("p", "go"))
    await until(lambda: _all_waiting(store, 3))
    engine.cancel()
    f = await asyncio.wait_for(task, timeout=10)
    assert f.run_state.cause.kind == "cancelled"
    return f


async def test_cancelling_the_parent_cancels_its_children(monkeypatch):
    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("slow_worker", 3), store)
    f = await _cancelled_with_three_children_waiting(store, r)
    kids = await children_of(store, f)
    assert [k.run_state.cause.kind for k in kids] == ["cancelled"] * 3


async def test_a_child_whose_cancel_hangs_holds_neither_its_parent_nor_its_siblings(
    monkeypatch,
):
    """The cancel of one child never answers (its host hung): the parent's drive ends
    after that cancel's deadline, and the other children are cancelled meanwhile."""
    import runtime.committing

    monkeypatch.setattr(runtime.committing, "CANCEL_CHILD_S", 0.2)
    # an Event of its own: one waited on in an earlier test is bound to that test's loop
    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("slow_worker", 3), store)
    cancel = r.children.cancel
    hung: list[str] = []

    async def hangs_for_the_first(child_thread, child_run=None):
        if not hung:
            hung.append(child_thread)
            await asyncio.Event().wait()
        await cancel(child_thread, child_run)

    monkeypatch.setattr(r.children, "cancel", hangs_for_the_first)
    f = await _cancelled_with_three_children_waiting(store, r)
    kids = {k.thread_id: k.run_state for k in await children_of(store, f)}
    assert [s.cause.kind for t, s in kids.items() if t not in hung] == ["cancelled"] * 2
    agents.BLOCK.set()  # the hung one's own tool lets go; it ends at its next look


async def test_a_delegation_whose_child_host_is_lost_each_time_ends_the_parent(monkeypatch):
    """Every attempt of the delegating call is Lost (the child's host dies each time):
    once they are used up the parent ends indeterminate and cancels the child, as a
    recovery that finds the call so does; not a call marked indeterminate beside a child
    that runs on uncancelled (and which the model might delegate again)."""
    from runtime.ports import Lost

    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("slow_worker", 1), store)
    really_run, started = r.children.run, []

    async def lost_each_time(request):
        if not started:  # the child does start, once, and runs on
            started.append(asyncio.ensure_future(really_run(request)))
            await until(lambda: _all_waiting(store, 1))
        return Lost(message="the child's host died")

    monkeypatch.setattr(r.children, "run", lost_each_time)
    f = await asyncio.wait_for(r.start("go", thread_id="p"), 10)
    assert f.run_state.cause.kind == "indeterminate" and "delegation d0" in f.run_state.cause.reason
    (kid,) = await children_of(store, f)
    assert kid.run_state.cause.kind == "cancelled"
    agents.BLOCK.set()  # the child's first drive, fenced by that end, finds out and goes
    await asyncio.wait(started, timeout=10)
    assert started[0].done() and (await store.load(kid.thread_id)) == kid


async def test_a_parallel_child_that_needs_a_human_ends_the_parent_indeterminate():
    store = MemoryCommitStore()
    f = await runner(agents.fanout_agent("needy_worker", 2), store).start("go", thread_id="p")
    assert isinstance(f.run_state, EndedState)
    assert f.run_state.cause.kind == "indeterminate"
    assert all(k.run_state.cause.kind == "cancelled" for k in await children_of(store, f))


async def test_a_parallel_child_that_needs_a_human_keeps_its_siblings_answers():
    """The sibling that answered was sealed "outcome unknown" in the end, its answer (and
    any state it handed) dropped, though it was known."""
    store = MemoryCommitStore()
    f = await runner(agents.mixed, store).start("go", thread_id="p")
    assert f.run_state.cause.kind == "indeterminate"
    results = {m.call_id: m.content for m in f.messages if m.kind == "tool_result"}
    assert results["d0"] == "done: quick"
    assert "unknown" in results["d1"]


async def test_a_lone_child_surfaces_its_wait_and_its_outcome_resumes_the_parent():
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("needy_worker", 1), store)
    f = await r.start("go", thread_id="p")
    assert isinstance(f.run_state, AwaitingState)
    assert f.run_state.ticket.target.wait == "delegation"
    (kid,) = await children_of(store, f)
    assert isinstance(kid.run_state, AwaitingState)
    await r.resume(command_for(kid, PermissionDecision(approve=True)))
    parent = await store.load("p")
    assert parent.run_state.cause.kind == "natural"
    assert json.loads(parent.messages[-1].text) == ["needy done"]


async def test_lone_children_in_waves_of_their_own_surface_their_waits_in_turn():
    """A lone child that surfaced a wait left the parent running its later waves: a child
    there that asked a human too was a second awaiting call, and the parent ended
    ``failed(internal)`` with both children cancelled. The later waves wait for the
    first child's outcome now, and each child's wait reaches the parent in turn."""
    store = MemoryCommitStore()
    r = runner(agents.needy_twice_in_turn, store)
    f = await r.start("go", thread_id="p")
    assert f.run_state.ticket.target.call_id == "d0", f.run_state
    assert [c.phase.kind for c in f.batch.calls] == ["awaiting", "requested", "requested"]
    (first,) = await children_of(store, f)
    f = await r.resume(command_for(first, PermissionDecision(approve=True)))
    parent = await store.load("p")
    assert parent.run_state.ticket.target.call_id == "d1", parent.run_state
    second = next(k for k in await children_of(store, parent) if k.thread_id != first.thread_id)
    await r.resume(command_for(second, PermissionDecision(approve=True)))
    parent = await store.load("p")
    assert parent.run_state.cause.kind == "natural", parent.run_state
    assert json.loads(parent.messages[-1].text) == ["needy done", "noted", "needy done"]


async def test_a_delegation_approved_first_records_its_child_before_starting_it():
    """The child of a call that waited for permission started from the resume, whose
    commit did not record it: the child's end was never handed over, and its parent
    waited for ever (recovered, again)."""
    store = MemoryCommitStore()
    r = runner(agents.asked_first, store)
    f = await r.start("go", thread_id="p")
    assert f.run_state.ticket.target.wait == "permission"
    f = await r.resume(command_for(f, PermissionDecision(approve=True)))
    assert f.run_state.ticket.target.wait == "delegation"
    (kid,) = await children_of(store, f)
    await r.resume(command_for(kid, PermissionDecision(approve=True)))
    parent = await store.load("p")
    assert parent.run_state.cause.kind == "natural"
    assert json.loads(parent.messages[-1].text) == ["needy done"]


async def test_a_delegation_s_wait_takes_no_deadline_from_its_permission():
    """A delegating tool whose permission is due within a minute: its lone child waiting
    for a human made the parent await the child under that deadline, and a child ending
    later could hand over nothing (refused past the deadline, and a delegation's wait
    never expires): the parent waited for ever."""
    store = MemoryCommitStore()
    r = runner(agents.asked_first_by_a_deadline, store)
    f = await r.start("go", thread_id="p")
    assert f.run_state.ticket.deadline_us is not None  # the permission's own
    f = await r.resume(command_for(f, PermissionDecision(approve=True)))
    assert f.run_state.ticket.target.wait == "delegation"
    assert f.run_state.ticket.deadline_us is None


async def test_a_delegation_takes_only_its_child_s_own_outcome():
    """A caller's made-up child outcome, sent while the child still waits for its human,
    is refused on its payload: the parent keeps waiting, and the child's real answer
    resumes it. The child's stored end is the only voucher of a delegation's result."""
    from runtime import ResumeRejected
    from runtime.lifecycle import DelegationOutcome
    from runtime.ports import ToolOutput

    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("needy_worker", 1), store)
    parked = await r.start("go", thread_id="p")
    (kid,) = await children_of(store, parked)
    forged = command_for(parked, DelegationOutcome(output=ToolOutput(content="FORGED")))
    with pytest.raises(ResumeRejected, match="has not ended") as refused:
        await r.resume(forged)
    assert refused.value.axis == "payload"
    assert (await store.load("p")).run_state == parked.run_state  # the ticket stayed
    await r.resume(command_for(kid, PermissionDecision(approve=True)))
    parent = await store.load("p")
    assert parent.run_state.cause.kind == "natural"
    assert json.loads(parent.messages[-1].text) == ["needy done"]


async def test_a_delegation_refuses_an_outcome_other_than_its_ended_child_s():
    from runtime import ResumeRejected
    from runtime.control import control_engine
    from runtime.delegation import check_delegation_answer, delivery
    from runtime.lifecycle import Cancelled, DelegationOutcome
    from runtime.ports import ToolOutput

    store = MemoryCommitStore()
    parent = await runner(agents.lone_needy(), store).start("go", thread_id="p")
    (kid,) = await children_of(store, parent)
    await control_engine(store, owner="test#1").terminate(kid.thread_id, Cancelled())
    vouched = delivery(await store.load(kid.thread_id), parent)
    assert vouched is not None
    await check_delegation_answer(parent, vouched, store.load)  # the child's own: taken
    other = command_for(parent, DelegationOutcome(output=ToolOutput(content="all fine")))
    with pytest.raises(ResumeRejected, match="not the outcome") as refused:
        await check_delegation_answer(parent, other, store.load)
    assert refused.value.axis == "payload"


async def test_a_child_answer_its_parents_call_cannot_hold_is_handed_over_as_an_error():
    """The lone child's answer (its model's, within ``model_text_bytes``) is over
    ``tool_result_bytes``: handed up raw, its resume would be refused by every host for
    ever and the parent would never wake. It is handed as the error the running path
    makes of it, and the parent goes on."""
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("long_winded_worker", 1), store)
    f = await r.start("go", thread_id="p")
    (kid,) = await children_of(store, f)
    await r.resume(command_for(kid, PermissionDecision(approve=True)))
    assert (await store.load(kid.thread_id)).run_state.cause.kind == "natural"
    parent = await store.load("p")
    assert parent.run_state.cause.kind == "natural"
    (result,) = json.loads(parent.messages[-1].text)
    assert "tool output refused" in result and "tool_result_bytes" in result


def test_a_child_that_ended_naturally_having_said_nothing_has_an_outcome():
    """A session child whose turns all went to its handler: no assistant message, and
    still an outcome (not a StopIteration that fails every hand-over)."""
    from runtime.commit import Frontier
    from runtime.delegation import NO_ANSWER, outcome_of
    from runtime.lifecycle import Natural
    from runtime.ports import Finished

    run = RunId("r")
    ended = EndedState(run_id=run, cause=Natural())
    frontier = Frontier(thread_id=ThreadId("kid"), run_id=run, run_state=ended)
    outcome = outcome_of(frontier)
    assert isinstance(outcome, Finished) and outcome.output.content == NO_ANSWER


def _all_waiting(store, n: int) -> bool:
    kids = [t for t in store._threads if "@" in t]
    return len(kids) == n and all(
        store._threads[t].frontier.batch is not None
        and store._threads[t].frontier.batch.calls[0].phase.kind == "executing"
        for t in kids
    )


async def test_only_the_parents_own_child_answers_its_delegation():
    """A copy of a child (imported under another id) carries the same parent link: its
    end must not answer the parent, whose own record names the child it started."""
    from runtime.base import evolve
    from runtime.control import control_engine
    from runtime.delegation import delivery
    from runtime.lifecycle import Cancelled

    store = MemoryCommitStore()
    parent = await runner(agents.lone_needy(), store).start("go", thread_id="p")
    assert isinstance(parent.run_state, AwaitingState)
    (kid,) = await children_of(store, parent)
    ended = await control_engine(store, owner="test#1").terminate(kid.thread_id, Cancelled())
    assert ended.ended
    assert delivery(ended, parent) is not None
    assert delivery(evolve(ended, thread_id=ThreadId("a-copy")), parent) is None


async def test_a_child_answer_over_the_resume_payload_limit_is_handed_over_as_an_error(
    monkeypatch,
):
    """With ``tool_result_bytes`` raised past ``resume_payload_bytes`` (a tuning), an
    answer within the first and over the second passed ``delivery`` and was refused by
    the host's resume for good: the parent awaited an ended child for ever. The
    hand-over now meets the resume's own rule."""
    import runtime.delegation
    from runtime.batch import ToolOutput
    from runtime.control import control_engine
    from runtime.delegation import delivery
    from runtime.lifecycle import Cancelled, check_payload
    from runtime.limits import KIB, Limits
    from runtime.ports import Finished

    store = MemoryCommitStore()
    parent = await runner(agents.lone_needy(), store).start("go", thread_id="p")
    (kid,) = await children_of(store, parent)
    ended = await control_engine(store, owner="test#1").terminate(kid.thread_id, Cancelled())
    long = Finished(output=ToolOutput(content="x" * (80 * KIB)))
    monkeypatch.setattr(runtime.delegation, "outcome_of", lambda child: long)
    limits = Limits(tool_result_bytes=96 * KIB)  # resume_payload_bytes left at 64 KiB
    command = delivery(ended, parent, limits)
    assert command is not None
    check_payload(command.payload, limits)  # what the parent's host checks: it holds
    assert command.payload.output.is_error
    assert "resume_payload_bytes" in command.payload.output.content


async def test_a_child_whose_parent_ended_without_cancelling_it_ends_at_its_next_step(monkeypatch):
    """The parent's end cancels its open children; a host killed between the two leaves
    them running (here: the parent ended at rest by a writer that cancels nothing). A
    child looks at its parent before each Step, and ends cancelled."""
    from runtime.control import control_engine
    from runtime.lifecycle import Cancelled

    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("slow_worker", 1), store)
    task = asyncio.create_task(r.engine().start("p", "go"))
    await until(lambda: _all_waiting(store, 1))
    ended = await control_engine(store, owner="elsewhere#1").terminate(ThreadId("p"), Cancelled())
    assert ended.ended
    agents.BLOCK.set()  # the child's tool returns: its next Step would answer "slow done"
    (kid,) = await children_of(store, ended)
    await until(lambda: _ended(store, kid.thread_id))
    kid = await store.load(kid.thread_id)
    assert kid.run_state.cause.kind == "cancelled"
    assert all(m.text != "slow done" for m in kid.messages if m.kind == "assistant")
    task.cancel()  # the fenced parent drive: nothing of it is left to wait for
    with contextlib.suppress(BaseException):
        await task


async def _ended(store, thread) -> bool:
    return (await store.load_head(thread)).ended


def test_child_ids_name_one_parent_call_even_with_separators_in_the_call_id():
    """The model picks the call id: separators in it cannot make two calls of two Runs
    (or of one) derive one child."""
    assert child_ids("p", "y", "a@x") != child_ids("p", "x@y", "a")
    assert child_ids("p", "r", "a/b")[1] != child_ids("p", "r/a", "b")[1]
    assert child_ids("p", "r", "a~b") != child_ids("p", "r", "a%7Eb")
    assert child_ids("p", "r", "call_1") == ("p/call_1@r", "r/call_1")  # as before


async def test_a_child_is_never_started_on_a_thread_that_holds_another_run():
    """Thread ids a caller chose can equal a derived child's ("a/c@x" with run "y" and
    call "d", against thread "a" with run "x/d@y" and call "c"): the second parent's
    child is refused (its call fails, seen by its model), never started on the first
    child's thread, whose history it would have been shown; and ending that parent does
    not cancel the Run of the thread it could not start on."""
    store = MemoryCommitStore()
    agents.SEEN_INPUTS.clear()
    first = runner(agents.delegating("d", "SECRET of tenant 1"), store)
    one = await first.start("go", thread_id="a/c@x", run_id="y")
    assert one.run_state.cause.kind == "natural"
    second = runner(agents.delegating("c", "task of tenant 2"), store)
    two = await second.start("go", thread_id="a", run_id="x/d@y")
    assert agents.SEEN_INPUTS == [["SECRET of tenant 1"]]  # the second child never ran
    (result,) = json.loads(two.messages[-1].text)
    assert "delegation failed" in result and "collide" in result
    shared = one.state["run"]["children"]["d"]
    assert two.state["run"]["children"]["c"] == shared
    assert (await activations(store, shared)) == 1


async def test_a_parent_ends_only_its_own_child_s_run():
    """A parent whose child could not start (another Run holds the derived thread) and
    which then ends failed cancels its children: the Run on that thread is not its own
    and is left as it is."""
    from runtime import Agent, ModelResponse, ScriptedModel, call
    from runtime.delegation import delegate_tool

    store = MemoryCommitStore()
    needy = call("delegate", "d", agent=f"{HERE}:needy_worker", input="publish")
    first_agent = Agent(
        name="first", model=ScriptedModel([ModelResponse(tool_calls=(needy,))]),
        tools=[delegate_tool()],
    )  # fmt: skip
    parked = await runner(first_agent, store).start("go", thread_id="a/c@x", run_id="y")
    assert isinstance(parked.run_state, AwaitingState)  # its child awaits a permission
    shared = parked.state["run"]["children"]["d"]
    child_before = await store.load(shared)
    assert isinstance(child_before.run_state, AwaitingState)

    def fails(request):
        raise RuntimeError("the model is down")

    collide = call("delegate", "c", agent=f"{HERE}:worker", input="task")
    second_agent = Agent(
        name="second", model=ScriptedModel([ModelResponse(tool_calls=(collide,)), fails]),
        tools=[delegate_tool()],
    )  # fmt: skip
    ended = await runner(second_agent, store).start("go", thread_id="a", run_id="x/d@y")
    assert ended.run_state.cause.kind == "failed"
    assert ended.state["run"]["children"]["c"] == shared
    assert (await store.load(shared)).run_state == child_before.run_state  # still awaiting


# ---- the in-process runner's hand-overs ---------------------------------------------------


async def test_a_lone_child_ended_at_rest_hands_its_outcome_up_on_recovery():
    """The lone child a parent awaits is cancelled at rest (nothing drives it): recovering
    the parent hands the parent the child's end, as a cluster's Supervisor would, instead
    of leaving it awaiting a ticket nobody can answer."""
    from runtime.control import control_engine
    from runtime.lifecycle import Cancelled

    store = MemoryCommitStore()
    r = runner(agents.lone_needy(), store)
    parent = await r.start("go", thread_id="p", run_id="pr")
    assert isinstance(parent.run_state, AwaitingState)
    (kid,) = await children_of(store, parent)
    await control_engine(store, owner="user#1").terminate(kid.thread_id, Cancelled())
    again = await r.recover("p")
    assert again.ended and again.run_state.cause.kind == "natural"
    (result,) = json.loads(again.messages[-1].text)
    assert "cancelled" in result


class _ParentEndedAfterItsRead:
    """The store; another client ends the parent right after the child's hand-over read
    the parent (still awaiting), before the hand-over resumes it."""

    def __init__(self, inner: MemoryCommitStore, parent: str) -> None:
        self.inner, self.parent, self.loads = inner, parent, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> object:
        from runtime.control import control_engine

        if thread == self.parent:
            self.loads += 1
            if self.loads == 2:  # the first: the hand-over's read; then: the parent's own
                await control_engine(self.inner, owner="client-2#1").terminate(thread)
        return await self.inner.load(thread)


async def test_a_child_s_resume_that_landed_is_not_refused_for_its_parent_s_sake():
    """The child's resume lands and the child ends; between the hand-over's read of the
    parent and its resume of it, another client ends the parent. The child's resume is
    still answered with the child's end, not refused: it was applied."""
    from runtime.lifecycle import answer

    inner = MemoryCommitStore()
    parent = await runner(agents.lone_needy(), inner).start("go", thread_id="p", run_id="pr")
    (kid,) = await children_of(inner, parent)
    approve = answer(kid.run_state.ticket, PermissionDecision(approve=True))
    racing = runner(agents.lone_needy(), _ParentEndedAfterItsRead(inner, "p"))  # type: ignore[arg-type]
    done = await racing.resume(approve)
    assert done.ended and done.thread_id == kid.thread_id
    assert done.run_state.cause.kind == "natural"  # the child's own end
    assert (await inner.load(ThreadId("p"))).run_state.cause.kind == "cancelled"


async def test_recovering_a_child_s_thread_drives_it_with_the_child_s_agent(monkeypatch):
    """A library user recovering every running thread after a crash, children among
    them: each is driven by its own agent (its parent link names it), not the runner's."""
    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    r = runner(agents.fanout_agent("slow_worker", 1, name="fan1"), store)
    started = asyncio.ensure_future(r.start("go", thread_id="p", run_id="pr"))

    async def child_in_its_tool() -> bool:
        kids = (await store.load(ThreadId("p"))).state["run"].get("children", {})
        return bool(kids) and (await store.load(next(iter(kids.values())))).batch is not None

    await until(child_in_its_tool, 10, what="the child in its tool")
    started.cancel()  # the process dies: nothing drives either Run now
    await asyncio.gather(started, return_exceptions=True)
    (child,) = (await store.load(ThreadId("p"))).state["run"]["children"].values()
    agents.BLOCK.set()
    done = await r.recover(child)
    assert done.run_state.cause.kind == "natural" and done.messages[-1].text == "slow done"


async def test_ending_a_parent_ends_its_children_whatever_the_system_s_id_limit():
    """Under ``Limits(id_chars=64)`` the derived child ids are cut to a digest: the parent's
    end still finds and cancels its own children, down to a grandchild awaiting a human
    (they were re-derived under the default limits, and the grandchild was left)."""
    from runtime.limits import Limits

    store = MemoryCommitStore()
    r = InProcessRunner(
        agents.nested_needy(),
        store,
        agent_ref=f"{HERE}:nested_needy",
        limits=Limits(id_chars=64),
    )
    parent = await r.start("go", thread_id="p", run_id="run-" + "a" * 32)
    assert isinstance(parent.run_state, AwaitingState)
    (child_thread,) = parent.state["run"]["children"].values()
    (grand_thread,) = (await store.load(child_thread)).state["run"]["children"].values()
    assert isinstance((await store.load(grand_thread)).run_state, AwaitingState)
    await r.engine().terminate(ThreadId("p"))
    for thread in ("p", child_thread, grand_thread):
        assert (await store.load(ThreadId(thread))).ended, thread


async def test_a_parent_recovered_again_and_again_rejoins_its_children_without_spending_attempts():
    """A parent that dies while its delegations are executing, more times than a call
    has attempts, rejoins the same children each time (``Reconnect``): its own deaths are
    no attempt of its children's, which run on (an attempt is spent only when a child's
    host is lost). Spending one per recovery ended the parent indeterminate on its
    third death and cancelled a healthy tree."""
    store = MemoryCommitStore()
    with pytest.raises(Crash):
        await runner(agents.fanout(), store).start(
            "go", thread_id="p", faults=FaultPlan(("during:tools", 1))
        )
    for _ in range(4):  # max_attempts is 3
        with pytest.raises(Crash):
            await runner(agents.fanout(), store).recover("p", faults=FaultPlan(("during:tools", 1)))
        calls = (await store.load("p")).batch.calls
        assert {(c.phase.kind, c.attempts) for c in calls} == {("executing", 1)}
    f = await runner(agents.fanout(), store).recover("p")
    assert f.run_state.cause.kind == "natural"
    assert json.loads(f.messages[-1].text) == [f"done: task {i}" for i in range(8)]
    for kid in await children_of(store, f):
        assert await activations(store, kid.thread_id) == 1


async def test_a_parent_is_not_dead_lettered_while_a_child_it_waits_on_runs_on(monkeypatch):
    """A parent's host dying again and again while the parent only waits on its
    children (its recoveries rejoin them, committing nothing: no progress) is recorded
    (``LOST_WAITING``), not counted toward its dead letter: that cancelled children that
    run on, or, counted and applied the moment they ended, dropped their answers. Once
    they have ended, losses count again (a Run taken back after they ended, and lost
    before it could take their answers, is not counted: ``children_run_on``)."""
    from actors.ownership import children_run_on, mark_lost  # imports ray, starts nothing
    from runtime.base import evolve
    from runtime.lifecycle import ThreadStatus
    from runtime.rules import LOST_WAITING

    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    agent = agents.fanout_agent("slow_worker", 2)
    runner = InProcessRunner(agent, store, agent_ref=f"{HERE}:{agent.name}")
    drive = asyncio.create_task(runner.start("go", thread_id="p"))

    async def children_waiting() -> bool:
        p = await store.load(ThreadId("p"))
        kids = p.state.get("run", {}).get("children", {})
        heads = [await store.load(ThreadId(t)) for t in kids.values()]
        return len(heads) == 2 and all(h.batch is not None for h in heads)

    await until(children_waiting, what="both children in their tool")
    owner = (await store.load(ThreadId("p"))).owner

    async def lose(n: int) -> str | None:
        nonlocal owner
        marked = await mark_lost(store, ThreadId("p"), f"host-{n}", lost_owner=owner, again=True)
        owner = f"host-{n}"
        return marked

    for n in range(4):  # past the dead letter's three
        assert await lose(n) == "lost", n
    p = await store.load(ThreadId("p"))
    assert (p.failed_recoveries, p.status.reason) == (0, LOST_WAITING)
    agents.BLOCK.set()  # the children end (their parent's drive, fenced, hears nothing)

    async def children_ended() -> bool:
        p = await store.load(ThreadId("p"))
        kids = p.state["run"]["children"].values()
        return all([(await store.load(ThreadId(t))).ended for t in kids])

    await until(children_ended, what="both children ended")
    # taken back (running) before they ended, lost before it took their answers: grace
    p = await store.load(ThreadId("p"))
    ended_at = max(
        [(await store.load(ThreadId(t))).status.since for t in p.state["run"]["children"].values()]
    )
    taken_back = [ThreadStatus(state="running", since=ended_at + d) for d in (-1, 1)]
    assert [await children_run_on(store, evolve(p, status=st)) for st in taken_back] == [
        True,
        False,
    ]
    # marked lost, never taken back since (as a recovery that keeps failing leaves it):
    # no grace for children that ended meanwhile, the losses count
    assert [await lose(n) for n in range(4, 7)] == ["lost", "lost", "dead_lettered"]
    ended = (await store.load(ThreadId("p"))).run_state
    assert isinstance(ended, EndedState) and ended.cause.kind == "failed"
    assert ended.cause.failure == "recovery"
    drive.cancel()
    with contextlib.suppress(BaseException):
        await drive


async def test_a_child_that_has_ended_answers_from_the_store_not_its_host() -> None:
    """A parent recovered under all-host kills asked each ended child's restarting host
    for an answer the store held (seconds each time, then killed again before it took
    it): the cluster's child runner reads an ended child's outcome from the store, and
    asks no host (none runs here: asking one would fail)."""
    from actors.children import RayChildRunner
    from actors.wire import SystemSpec
    from runtime.delegation import ChildRequest
    from runtime.ports import Finished

    store = MemoryCommitStore()
    f = await runner(agents.fanout_agent("worker", 1), store).start("go", thread_id="p")
    thread, run = child_ids(ThreadId("p"), RunId(f.run_id), CallId("d0"))
    request = ChildRequest(
        parent_thread=ThreadId("p"),
        parent_run=RunId(f.run_id),
        call_id=CallId("d0"),
        agent=f"{HERE}:worker",
        input="task 0",
        child_thread=thread,
        child_run=run,
        prompt_path=("fanout", "worker"),
        lineage=(f"{HERE}:worker",),
    )
    spec = SystemSpec(name="no-cluster", store_url="memory://")
    outcome = await RayChildRunner(spec, store).run(request)
    assert isinstance(outcome, Finished) and outcome.output.content == "done: task 0"


@pytest.mark.parametrize(
    "given",
    [{"max_parallel": True}, {"max_depth": "7"}, {"max_depth": -1}, {"max_total": -1}],
    ids=["bool", "text", "negative depth", "negative total"],
)
def test_delegation_limits_are_plain_integers(given):
    """``True`` read as 1 and ``"7"`` as 7 (Limits, Budget and Session refuse both)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DelegationLimits(**given)


async def test_a_child_recovered_after_its_parent_ended_replays_nothing():
    """The parent's end cancels its children; a child whose host was down then missed the
    cancel. Recovered, it replayed its tool call (a new attempt of a replay-safe effect)
    before its next Step's look at the parent, for a Run nobody awaited: a recovery
    looks at the parent first, and ends the child cancelled."""
    from runtime.control import control_engine
    from runtime.lifecycle import Cancelled

    agents.REPLAYED.clear()
    store = MemoryCommitStore()
    first = runner(agents.fanout_agent("replaying_worker", 1), store)
    first.children.faults = FaultPlan(("during:tools", 1))  # the child dies in its tool call
    with pytest.raises(Crash):
        await first.start("go", thread_id="p")
    ended = await control_engine(store, owner="elsewhere#1").terminate(ThreadId("p"), Cancelled())
    assert ended.ended
    (kid,) = await children_of(store, ended)
    assert kid.run_state.kind == "running" and kid.batch.calls[0].attempts == 1
    done = await runner(agents.fanout_agent("replaying_worker", 1), store).recover(kid.thread_id)
    assert done.run_state.cause.kind == "cancelled"
    assert agents.REPLAYED == []  # its tool was not run again
    assert done.batch is None or all(c.attempts == 1 for c in done.batch.calls)


async def test_a_child_s_cancel_is_asked_again_while_its_host_restarts(monkeypatch) -> None:
    """Ray refuses a call to a restarting actor at once: a parent's end that cancelled
    its child then gave the cancel up at that refusal, and the child, recovered by its
    host without it, ran on (awaiting a person until the Supervisor's orphan sweep, or
    in its tool). The cancel is asked again once the host is back."""
    from ray.exceptions import ActorUnavailableError

    import actors.children
    from actors.children import RayChildRunner
    from actors.wire import SystemSpec

    monkeypatch.setattr(actors.children, "BACK_POLL_S", (0.001, 0.01))
    asked: list[tuple[str, str | None]] = []

    class RestartingHost:
        class cancel_run:  # an actor method's handle, as Ray spells it
            @staticmethod
            async def remote(thread: str, run: str | None = None) -> str:
                asked.append((thread, run))
                if len(asked) < 3:
                    raise ActorUnavailableError("the host is restarting", b"\0" * 16)
                return "cancelled"

    children = RayChildRunner(SystemSpec(name="no-cluster", store_url="memory://"))
    monkeypatch.setattr(children, "host_for", lambda thread: RestartingHost)
    await children.cancel(ThreadId("kid"), RunId("kid-run"))
    assert asked == [("kid", "kid-run")] * 3  # asked until the restarted host answered
