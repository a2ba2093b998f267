"""The replay check for upgrades (``runtime.replay_check``, ``runtime.testing``,
``ratchet replay``).

Threads are recorded for real with the in-process runner (``ScriptedModel`` and tools
that count how often they really ran): parallel waves, a serial call, a tool error, a
tool that writes state and injects a message, a permission wait and its resume, a
crash and its recovery at every fault point, cancels, two Runs on one thread. Replayed
against the same agent each is clean and runs no tool; replayed against changed code
each change is reported at the commit where it first decides otherwise.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cluster.cli_replay import register
from runtime import (
    Agent,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    ToolContext,
    ToolRecoveryPolicy,
    ToolResult,
    answer,
    call,
    tool,
)
from runtime.commit import Frontier
from runtime.errors import ModelRefused
from runtime.history import export
from runtime.hooks import Hook, HookOutput
from runtime.lifecycle import AwaitingState
from runtime.messages import ToolResultMessage
from runtime.plugins import CapabilityBound, Contributions, Plugin, PluginManifest
from runtime.ports import CommitStore
from runtime.replay_check import ReplayInputError, ReplayReport, replay
from runtime.state import Command
from runtime.testing import assert_replays
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

from .agents import Ledger, crash_matrix_agent

RAN: Counter[str] = Counter()
"""How often each tool really ran, in every test (a replay must never add to it)."""


def billing(**changes: Any) -> Agent:
    """The agent whose threads are recorded; ``changes`` are the "current code"."""
    tools = {t.id: t for t in _tools()}
    for name in changes.pop("without", ()):
        del tools[name]
    script = changes.pop("script", SCRIPT)
    return Agent(name="billing", model=ScriptedModel(script), tools=list(tools.values()), **changes)


def _tools() -> list[Any]:
    @tool(recovery=("replay_safe",))
    def lookup(key: str) -> str:
        RAN["lookup"] += 1
        return f"value of {key}"

    @tool(recovery=("never_replay",), concurrency="serial")
    def charge(amount: int) -> str:
        RAN["charge"] += 1
        return f"charged {amount}"

    @tool(recovery=("replay_safe",))
    def flaky(x: int) -> str:
        RAN["flaky"] += 1
        raise ValueError(f"flaky failed on {x}")

    @tool(recovery=("replay_safe",))
    def remember(fact: str, ctx: ToolContext) -> ToolResult:
        RAN["remember"] += 1
        assert ctx.execution is not None
        ctx.execution.inject_message(f"remember: {fact}")
        notes = Command(key="facts", merge="commutative", value=[fact])
        return ToolResult(content="noted", commands=[notes])

    @tool(needs_permission=True)
    def wire(amount: int) -> str:
        RAN["wire"] += 1
        return f"wired {amount}"

    return [lookup, charge, flaky, remember, wire]


SCRIPT = [
    ModelResponse(
        text="looking",
        tool_calls=(
            call("lookup", "c1", key="a"),
            call("lookup", "c2", key="b"),
            call("charge", "c3", amount=3),
        ),
    ),
    ModelResponse(
        text="noting",
        tool_calls=(call("flaky", "c4", x=1), call("remember", "c5", fact="gold")),
    ),
    ModelResponse(text="wiring", tool_calls=(call("wire", "c6", amount=9),)),
    ModelResponse(text="all done"),
]


async def record(
    agent: Agent, *inputs: str, store: CommitStore | None = None, approve: bool = True
) -> CommitStore:
    """Run each input as a Run of thread ``t``, answering permission waits."""
    store = store if store is not None else MemoryCommitStore()
    runner = InProcessRunner(agent, store)
    for n, text in enumerate(inputs, start=1):
        f = await runner.start(text, thread_id="t", run_id=f"r{n}")
        f = await _answer_waits(runner, f, approve)
    return store


async def _answer_waits(runner: InProcessRunner, f: Frontier, approve: bool) -> Frontier:
    while isinstance(f.run_state, AwaitingState):
        f = await runner.resume(answer(f.run_state.ticket, PermissionDecision(approve=approve)))
    return f


async def replayed(store: CommitStore, agent: Agent, thread: str = "t") -> ReplayReport:
    """A replay, checked to have run no tool."""
    before = dict(RAN)
    report = await replay(store, thread, agent)
    assert dict(RAN) == before, "a replay ran a tool"
    return report


async def labels(store: CommitStore, thread: str = "t") -> dict[int, str]:
    return {r.seq: r.commit.label for r in await store.read(thread)}


async def seq_of(store: CommitStore, label: str, nth: int = 1, thread: str = "t") -> int:
    return [s for s, lab in (await labels(store, thread)).items() if lab == label][nth - 1]


# ---- the same code replays cleanly -------------------------------------------------------


async def test_a_recorded_thread_replays_cleanly_without_running_a_tool():
    store = await record(billing(), "go")
    assert (await store.load("t")).run_state.cause.kind == "natural"
    report = await replayed(store, billing())
    assert report.clean, report.line()
    assert report.matched == report.commits == len(await store.read("t"))
    assert report.inferences == 4
    assert report.tool_calls == 6  # lookup twice, charge, flaky, remember, wire
    assert report.notes == ()
    assert "replay cleanly" in report.line()


async def test_a_denied_permission_and_a_model_failure_replay_cleanly():
    store = await record(billing(), "go", approve=False)
    assert (await replayed(store, billing())).clean

    def refused(request):
        raise ModelRefused("context_length", "the prompt is too long")

    failing = [SCRIPT[0], refused]
    store = await record(billing(script=failing), "go")
    cause = (await store.load("t")).run_state.cause
    assert (cause.kind, cause.code) == ("failed", "context_length")
    report = await replayed(store, billing(script=failing))
    assert report.clean, report.line()


async def test_a_refusal_with_its_usage_replays_cleanly():
    """The end of an answer refused after it was made records its usage; the replay's
    refusal carries the recorded usage, so its end is the same."""
    from runtime.models import Usage

    def refused(request):
        raise ModelRefused("refusal", "declined", usage=Usage(input_tokens=9, output_tokens=4))

    store = await record(billing(script=[refused]), "go")
    ended = await store.load("t")
    assert ended.state["run"]["usage"]["input_tokens"] == 9
    report = await replayed(store, billing(script=[refused]))
    assert report.clean, report.line()

    def broken(hook_input):  # the Run ends before the answer's commit: its usage with it
        raise RuntimeError("hook bug")

    answered = [ModelResponse(text="hi", usage=Usage(input_tokens=5, output_tokens=2))]
    hooked = billing(script=answered, hooks=[Hook("AfterInference", broken)])
    store = await record(hooked, "go")
    assert (await store.load("t")).state["run"]["usage"]["input_tokens"] == 5
    report = await replayed(store, billing(script=answered, hooks=[Hook("AfterInference", broken)]))
    assert report.clean, report.line()


async def test_a_two_run_thread_replays_each_run_in_order():
    store = await record(billing(), "first", "second")
    report = await replayed(store, billing())
    assert report.clean, report.line()
    assert report.runs == 2 and report.inferences == 8


async def test_the_model_is_replayed_so_its_script_and_prompt_may_change():
    store = await record(billing(), "go")
    other = billing(script=[ModelResponse(text="something else")], system="Be terse.")
    assert (await replayed(store, other)).clean


@pytest.mark.parametrize("point", ["StepEnd", "AfterTool"])
async def test_a_step_that_failed_before_its_commit_replays_cleanly(point):
    """Two hooks' commands on one exclusive key in one commit: the second hook fails
    (failed(hook, StateConflict)) and replays so. At StepEnd what the model answered
    is not on record; at AfterTool the end holds the tools' results."""
    clash = Hook(point, lambda h: HookOutput(commands=[Command(key="last", value=h.step)]))
    store = await record(billing(hooks=[clash]), "go")
    cause = (await store.load("t")).run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "hook", "StateConflict")
    report = await replayed(store, billing(hooks=[clash]))
    assert report.clean, report.line()
    if point == "AfterTool":
        assert not report.notes, report.notes
    else:
        assert report.notes and all(
            "no " in n.text and "is recorded" in n.text for n in report.notes
        )


# ---- crashes, recoveries, cancels ------------------------------------------------------


def _crash_points() -> list[tuple[str, int]]:
    plan = FaultPlan()
    asyncio.run(
        InProcessRunner(crash_matrix_agent(Ledger()), MemoryCommitStore()).start(
            "go", thread_id="t", faults=plan
        )
    )
    return plan.seen


CRASH_POINTS = _crash_points()


@pytest.mark.parametrize("point", CRASH_POINTS, ids=[f"{n}#{i}" for n, i in CRASH_POINTS])
async def test_a_recording_with_a_crash_and_its_recovery_replays_cleanly(point):
    ledger, store = Ledger(), MemoryCommitStore()
    runner = InProcessRunner(crash_matrix_agent(ledger), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", run_id="r", faults=FaultPlan(crash_at=point))
    if await store.read("t"):
        await InProcessRunner(crash_matrix_agent(ledger), store).recover("t")
    else:
        await InProcessRunner(crash_matrix_agent(ledger), store).start(
            "go", thread_id="t", run_id="r"
        )
    assert (await store.load("t")).ended
    ran = dict(ledger.runs)
    report = await replay(store, "t", crash_matrix_agent(ledger))
    assert report.clean, report.line()
    assert dict(ledger.runs) == ran, "a replay ran a tool"


async def test_a_crash_recorded_mid_run_replays_as_far_as_it_went():
    """A thread still running (its driver died, nobody recovered it yet) replays as far
    as it was committed."""
    store = MemoryCommitStore()
    runner = InProcessRunner(billing(), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("during:tools", 2)))
    report = await replayed(store, billing())
    assert report.clean and report.matched == report.commits


async def test_a_host_marking_a_lost_run_and_a_dead_letter_replay_cleanly():
    """What ``actors.ownership`` writes: a lost Run marked failed by the host that claims
    it, then recovered; and a Run lost too often, ended failed(recovery) at rest."""
    from runtime.commit import assemble_commit
    from runtime.lifecycle import Failed
    from runtime.timeutil import now_us

    for dead_letter in (False, True):
        ledger, store = Ledger(), MemoryCommitStore()
        runner = InProcessRunner(crash_matrix_agent(ledger), store)
        with pytest.raises(Crash):
            await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("during:tools", 1)))
        if dead_letter:
            lost = Failed(failure="recovery", code="execution_lost", message="lost 3 times")
            await runner.engine().terminate("t", lost)
        else:
            f = await store.load("t")
            mark = assemble_commit(
                thread_id=f.thread_id,
                run_id=f.run_id,
                ordinal=f.next_ordinal,
                label="status",
                disposition=f.run_state,
                status=f.status.moved_to("failed", "execution_lost", now_us()),
                prev=f.head,
                epoch=f.epoch + 1,
                claim="host-2#7",
            )
            await store.append(mark, f.version, f.epoch, claim="host-2#7")
            await runner.recover("t")
        assert (await store.load("t")).ended
        report = await replay(store, "t", crash_matrix_agent(ledger))
        assert report.clean, report.line()


async def test_a_recovery_that_now_decides_otherwise_is_reported():
    """lookup is recorded replay_safe and crashed while executing: its recovery ran it
    again. Code in which lookup supports only never_replay pins that mode instead."""
    ledger, store = Ledger(), MemoryCommitStore()
    runner = InProcessRunner(crash_matrix_agent(ledger), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("during:tools", 2)))
    await runner.recover("t")
    changed = crash_matrix_agent(ledger)
    changed = Agent(
        name=changed.name,
        model=changed.model,
        tools=changed.tools,
        policies={"lookup": ToolRecoveryPolicy(mode="never_replay")},
    )
    report = await replay(store, "t", changed)
    assert report.divergence is not None
    assert report.divergence.what == "policy_changed"
    assert report.divergence.seq == await seq_of(store, "inference")


@pytest.mark.parametrize("stop", [None, "operator says stop", ""])
async def test_a_cancel_or_stop_from_outside_while_a_tool_runs_is_fed_back(stop):
    """ "": a blank reason, recorded before a caller's were refused, replays as kept."""
    from runtime.replay_feed import fed_stop

    started, never = asyncio.Event(), asyncio.Event()

    @tool(recovery=("replay_safe",))
    async def slow(x: int) -> str:
        started.set()
        await never.wait()
        return "never"

    script = [ModelResponse(tool_calls=(call("slow", "c1", x=1),)), ModelResponse(text="-")]
    agent = Agent(name="slow", model=ScriptedModel(script), tools=[slow])
    store = MemoryCommitStore()
    engine = InProcessRunner(agent, store).engine()
    drive = asyncio.ensure_future(engine.start("t", "go", run_id="r1"))
    await until(started.is_set)
    if stop is None:
        engine.cancel()
    elif stop:
        engine.stop(stop)
    else:  # as an older release took it (a caller's stop reason unchecked)
        fed_stop(engine, stop)
    f = await drive
    assert f.run_state.cause.kind == ("cancelled" if stop is None else "stopped")
    assert (await replay(store, "t", agent)).clean


@pytest.mark.parametrize("stop", [False, True], ids=["cancel", "stop"])
async def test_a_cancel_or_stop_as_the_model_answered_is_fed_back(stop: bool):
    """(A stop was reported as a call that differs: only a cancel was fed back.)"""
    engines = []

    def answering(request):  # the cancel lands while the model's answer comes in
        if stop:
            engines[0].stop("operator says stop")
        else:
            engines[0].cancel()
        return SCRIPT[0]

    store = MemoryCommitStore()
    engines.append(InProcessRunner(billing(script=[answering]), store).engine())
    f = await engines[0].start("t", "go", run_id="r1")
    assert f.run_state.cause.kind == ("stopped" if stop else "cancelled")
    batch = (await store.read("t"))[1].commit.batch
    assert batch is not None and {c.phase.kind for c in batch.calls} == {"requested"}
    assert (await replayed(store, billing())).clean


async def test_a_tools_stop_is_fed_back():
    @tool(recovery=("replay_safe",))
    def enough(ctx: ToolContext) -> str:
        assert ctx.execution is not None
        ctx.execution.stop("the tool has seen enough")
        return "stopping"

    script = [ModelResponse(tool_calls=(call("enough", "c1"),)), ModelResponse(text="-")]
    agent = Agent(name="stopper", model=ScriptedModel(script), tools=[enough])
    store = MemoryCommitStore()
    f = await InProcessRunner(agent, store).start("go", thread_id="t")
    assert f.run_state.cause.kind == "stopped"
    assert (await replay(store, "t", agent)).clean


async def test_a_rate_limit_pause_and_its_unpause_replay_cleanly():
    from runtime.errors import ModelRateLimited
    from runtime.lifecycle import Unpause

    limited = [True]

    def sometimes(request):
        if limited.pop() if limited else False:
            raise ModelRateLimited("rate_limit", "slow down", retry_after_s=3600)
        return SCRIPT[-1]

    agent = billing(script=[sometimes])
    store = MemoryCommitStore()
    runner = InProcessRunner(agent, store)
    f = await runner.start("go", thread_id="t", run_id="r1")
    assert f.run_state.ticket.target.reason == "rate_limit"
    f = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert f.run_state.cause.kind == "natural"
    assert (await replayed(store, billing())).clean


async def test_waits_answered_and_expired_replay_by_their_recorded_deadlines(monkeypatch):
    """A replay makes each ticket afresh, its deadline from the replay's clock: an answer
    recorded just before a short deadline, and an expiry recorded past a long one, were
    refused when replayed (the replay's clock is past the first and before the second).
    The recording's resumes are judged as they were when they landed."""
    import runtime.resume
    from runtime.lifecycle import WaitExpired

    @tool(needs_permission=True, wait_deadline_s=1e-6)
    def soon(x: int) -> str:
        return "ran"

    @tool(needs_permission=True, wait_deadline_s=3600)
    def later(x: int) -> str:
        raise AssertionError("its wait expires")

    def agent() -> Agent:
        script = [
            ModelResponse(tool_calls=(call("soon", "c1", x=1),)),
            ModelResponse(tool_calls=(call("later", "c2", x=2),)),
            ModelResponse(text="done"),
        ]
        return Agent(name="deadlines", model=ScriptedModel(script), tools=[soon, later])

    store = MemoryCommitStore()
    runner = InProcessRunner(agent(), store)
    f = await runner.start("go", thread_id="t", run_id="r1")
    for payload, skew_us in ((PermissionDecision(approve=True), -1), (WaitExpired(), 1)):
        at = f.run_state.ticket.deadline_us + skew_us  # the resume lands this side of it
        with monkeypatch.context() as clock:
            clock.setattr(runtime.resume, "now_us", lambda at=at: at)
            f = await runner.resume(answer(f.run_state.ticket, payload))
    assert f.run_state.cause.kind == "natural"
    outputs = [m for m in f.messages if isinstance(m, ToolResultMessage)]
    assert outputs[0].content == "ran" and outputs[1].is_error
    assert (await replayed(store, agent())).clean


async def test_an_end_at_rest_and_a_manual_pause_replay_cleanly():
    agent = billing()
    store = MemoryCommitStore()
    runner = InProcessRunner(agent, store)
    f = await runner.start("go", thread_id="t", run_id="r1")
    assert isinstance(f.run_state, AwaitingState)
    await runner.engine().terminate("t")  # cancelled at rest, ticket and all
    assert (await store.load("t")).run_state.cause.kind == "cancelled"
    assert (await replayed(store, billing())).clean


# ---- changed code: the first divergence, where it is ----------------------------------


async def test_a_removed_tool_is_reported_where_its_call_is_committed():
    store = await record(billing(), "go")
    report = await replayed(store, billing(without=["charge"]))
    d = report.divergence
    assert d is not None and d.what == "tool_missing"
    assert (d.seq, d.label) == (await seq_of(store, "inference"), "inference")
    assert "charge" in d.expected and "no tool 'charge'" in d.got
    assert [n.text for n in report.notes] == [
        "the request no longer offers tool 'charge', which the response calls"
    ]


async def test_a_changed_recovery_mode_is_reported():
    store = await record(billing(), "go")
    changed = billing(policies={"lookup": ToolRecoveryPolicy(mode="never_replay")})
    d = (await replayed(store, changed)).divergence
    assert d is not None and d.what == "policy_changed"
    assert d.seq == await seq_of(store, "inference")
    assert "replay_safe" in d.expected and "never_replay" in d.got


def _writes(factor: int) -> Hook:
    def note_step(h):
        return HookOutput(commands=[Command(key=f"step_{h.step}", value=h.step * factor)])

    return Hook("StepEnd", note_step)


async def test_a_hook_that_now_writes_other_state_is_reported():
    store = await record(billing(hooks=[_writes(1)]), "go")
    assert (await replayed(store, billing(hooks=[_writes(1)]))).clean
    d = (await replayed(store, billing(hooks=[_writes(10)]))).divergence
    assert d is not None and d.what == "state_differs"
    # StepEnd of step 0 rides in step 1's inference commit; step 0 writes 0 either way
    assert d.seq == await seq_of(store, "inference", 3)
    assert "thread:step_1=1" in d.expected and "thread:step_1=10" in d.got


async def test_a_gate_that_now_denies_is_reported():
    store = await record(billing(), "go")
    no_wires = billing(gates=[lambda g: "no wires today" if g.tool == "wire" else None])
    d = (await replayed(store, no_wires)).divergence
    assert d is not None and d.what == "call_differs"
    assert d.seq == await seq_of(store, "inference", 3)
    assert "requested" in d.expected and "blocked: no wires today" in d.got


def _plugin() -> Plugin:
    return Plugin(
        PluginManifest(id="audit", version="1", bound=CapabilityBound(gates=True)),
        lambda: Contributions(gates=[lambda g: None]),
    )


async def test_a_plugin_set_that_resolves_otherwise_is_reported():
    store = await record(billing(), "go")
    d = (await replayed(store, billing(plugins=[_plugin()]))).divergence
    assert d is not None and (d.what, d.seq, d.label) == ("plugins_changed", 1, "activation")
    assert "audit" in d.got


async def test_a_run_end_guard_that_now_refuses_is_reported():
    store = await record(billing(), "go")
    refusing = billing(run_end_guards=[lambda end: "no summary was written"])
    d = (await replayed(store, refusing)).divergence
    assert d is not None and d.what == "end_differs"
    assert d.seq == await seq_of(store, "ended")
    assert d.expected == "ended(natural)"
    assert d.got == "ended(failed: hook/run_end_guard: no summary was written)"


async def test_a_lower_max_steps_is_reported_at_the_step_it_ends():
    store = await record(billing(), "go")
    d = (await replayed(store, billing(max_steps=2))).divergence
    assert d is not None and d.what == "end_differs"
    assert d.seq == await seq_of(store, "inference", 2)  # step 1: now the last, no tools
    assert d.expected == "running" and d.got == "ended(max_steps)"


async def test_a_max_steps_end_replays_cleanly_and_a_higher_one_diverges():
    store = await record(billing(max_steps=2), "go")
    assert (await store.load("t")).run_state.cause.kind == "max_steps"
    assert (await replayed(store, billing(max_steps=2))).clean
    d = (await replayed(store, billing(max_steps=3))).divergence
    assert d is not None and (d.what, d.expected) == ("end_differs", "ended(max_steps)")


async def test_a_hook_that_now_stops_the_run_is_reported_in_the_second_run():
    def stop_second(h):
        from runtime.execution import StopRun

        second = h.run_id == "r2"
        return HookOutput(reactions=[StopRun(reason="enough")] if second else [])

    store = await record(billing(), "first", "second")
    d = (await replayed(store, billing(hooks=[Hook("AfterTool", stop_second)]))).divergence
    assert d is not None and d.what == "end_differs" and d.run_id == "r2"
    assert (d.expected, d.got) == ("running", "ended(stopped: enough)")
    # the stop takes effect once r2's first Step (both its waves) is done: at step 1
    assert d.seq == await seq_of(store, "inference", 5)


async def test_a_tool_that_writes_other_state_is_not_the_codes_decision():
    """A tool's commands are fed back with its result: what it would write now is not
    asked (it never runs); the hooks' commands beside them are still checked."""

    def seen(value: int) -> Hook:
        def after(h):
            return HookOutput(commands=[Command(key=f"seen_{h.call.call_id}", value=value)])

        return Hook("AfterTool", after)

    after_tool = seen(1)
    store = await record(billing(hooks=[after_tool]), "go")
    assert (await replayed(store, billing(hooks=[after_tool]))).clean
    d = (await replayed(store, billing(hooks=[seen(2)]))).divergence
    assert d is not None and d.what == "state_differs"
    assert d.seq == await seq_of(store, "results")


async def test_a_hook_that_now_asks_for_input_is_reported():
    def ask(h):
        from runtime.execution import RequestInput

        return HookOutput(reactions=[RequestInput(prompt="which account?")] if h.step == 0 else [])

    store = await record(billing(), "go")
    d = (await replayed(store, billing(hooks=[Hook("StepEnd", ask)]))).divergence
    assert d is not None and d.what == "wait_differs"
    assert (d.expected, d.got) == ("running", "awaiting(user_input)")
    assert d.seq == await seq_of(store, "inference", 2)


# ---- delegation and sessions ---------------------------------------------------------


async def test_delegating_threads_replay_cleanly_and_start_no_child():
    from . import delegation_agents as kids

    for target, n in [("worker", 3), ("needy_worker", 2), ("needy_worker", 1)]:
        store = MemoryCommitStore()
        runner = InProcessRunner(kids.fanout_agent(target, n), store)
        await runner.start("go", thread_id="p", run_id="r1")
        for kid in await store.thread_ids():  # a lone child's human wait: answer it
            child = await store.load(kid)
            if kid != "p" and isinstance(child.run_state, AwaitingState):
                await runner.resume(
                    answer(child.run_state.ticket, PermissionDecision(approve=True))
                )
        threads = await store.thread_ids()
        report = await replay(store, "p", kids.fanout_agent(target, n))
        assert report.clean, (target, n, report.line())
        assert await store.thread_ids() == threads  # no child started
        for kid in threads:
            if kid != "p":
                child_agent = getattr(kids, target)
                assert (await replay(store, kid, child_agent)).clean, kid


async def test_a_parent_resumed_by_its_lone_child_replays_cleanly():
    """The parent's resume carries the child's outcome, which a live engine checks against
    the child's stored end; the replay's scratch store holds no child, and the recording
    vouches for it."""
    from . import delegation_agents as kids

    store = MemoryCommitStore()
    ref = f"{kids.HERE}:lone_needy"
    runner = InProcessRunner(kids.lone_needy(), store, agent_ref=ref)
    parked = await runner.start("go", thread_id="p", run_id="r1")
    (kid,) = [await store.load(t) for t in parked.state["run"]["children"].values()]
    await runner.resume(answer(kid.run_state.ticket, PermissionDecision(approve=True)))
    labels = [r.commit.label for r in await store.read("p")]
    assert labels == ["activation", "inference", "awaiting", "resume", "ended"]
    report = await replay(store, "p", kids.lone_needy(), lineage=[ref])
    assert report.clean, report.line()


async def test_sessions_replay_cleanly():
    from runtime import UserInput
    from runtime.agent import Session, SessionSide

    writer = ScriptedModel([ModelResponse(text="An old silent pond")] * 8)
    critic = ScriptedModel([ModelResponse(text="Shorter, please.")] * 8)
    critic_side = SessionSide(agent=Agent(name="critic", model=critic))
    handler = SessionSide(handler=lambda seen: "With frogs." if seen.turn < 3 else None)
    agents = [
        Agent(name="w", model=writer, session=Session(b=critic_side, max_session_turns=4)),
        Agent(name="w", model=writer, session=Session(b=handler)),
        Agent(
            name="w", model=writer, session=Session(b=SessionSide(human="?"), max_session_turns=3)
        ),
    ]
    for agent in agents:
        store = MemoryCommitStore()
        runner = InProcessRunner(agent, store)
        f = await runner.start("a haiku", thread_id="t")
        while isinstance(f.run_state, AwaitingState):
            f = await runner.resume(answer(f.run_state.ticket, UserInput(text="More autumn.")))
        assert f.run_state.cause.kind == "natural"
        assert (await replay(store, "t", agent)).clean


# ---- property-ish: many recorded scripts replay cleanly --------------------------------


ARGUMENTS = {
    "lookup": "key",
    "charge": "amount",
    "flaky": "x",
    "remember": "fact",
    "wire": "amount",
}


def _random_script(rng: random.Random) -> list[ModelResponse]:
    """Up to four Steps of one to four calls each (waves, serial calls, errors, state
    and injections, permission waits), then an answer."""
    script = []
    for step in range(rng.randint(0, 4)):
        calls = []
        for i in range(rng.randint(1, 4)):
            name = rng.choice(sorted(ARGUMENTS))
            value: Any = f"v{i}" if ARGUMENTS[name] in ("key", "fact") else i
            calls.append(call(name, f"s{step}c{i}", **{ARGUMENTS[name]: value}))
        script.append(ModelResponse(text=f"step {step}", tool_calls=tuple(calls)))
    script.append(ModelResponse(text="the end"))
    return script


@pytest.mark.parametrize("seed", range(12))
async def test_recordings_of_many_scripts_replay_cleanly(seed):
    rng = random.Random(seed)
    script = _random_script(rng)
    inputs = ["one", "two"][: rng.randint(1, 2)]
    store = await record(billing(script=script), *inputs, approve=rng.random() < 0.5)
    report = await replayed(store, billing(script=script))
    assert report.clean, report.line()


# ---- inputs, and the pytest helper -----------------------------------------------------


async def test_nothing_to_replay_is_refused():
    with pytest.raises(ReplayInputError, match="no recorded commits"):
        await replay(MemoryCommitStore(), "nope", billing())


async def test_a_pruned_thread_is_refused():
    store = await record(billing(), "first", "second")
    first_end = await seq_of(store, "ended")
    await store.prune("t", first_end)
    with pytest.raises(ReplayInputError, match="pruned"):
        await replay(store, "t", billing())


async def test_a_recording_whose_way_in_cannot_be_made_is_a_divergence():
    """A log that imports (its chain is whole) yet cannot have been written by a Run: a
    start without the user's message, an ended commit that leaves the Run running. The
    replay reports where (it raised StopIteration and a bare AssertionError)."""
    from runtime.commit import assemble_commit

    store = await record(billing(), "go")
    records = await store.read("t")
    first = records[0].commit
    no_input = assemble_commit(
        **{**_fields(first), "messages": ()}, prev=first.prev, epoch=first.epoch
    )
    report = await replay([no_input], "t", billing())
    assert (report.divergence.what, report.divergence.seq) == ("way_in_refused", 1)
    assert "has no user message" in report.divergence.got
    last = records[-1].commit
    not_an_end = assemble_commit(
        **{**_fields(last), "disposition": records[-2].commit.disposition},
        prev=last.prev,
        epoch=last.epoch,
    )
    report = await replay([r.commit for r in records[:-1]] + [not_an_end], "t", billing())
    assert report.divergence is not None and report.divergence.seq == len(records)


def _fields(commit: Any) -> dict[str, Any]:
    keep = ("thread_id", "run_id", "ordinal", "label", "disposition", "messages", "commands")
    return {name: getattr(commit, name) for name in (*keep, "batch", "status", "claim")}


async def test_assert_replays_takes_a_store_records_or_an_export(tmp_path: Path):
    store = await record(billing(), "go")
    await assert_replays(store, "t", billing())
    await assert_replays(await store.read("t"), "t", billing())
    lines = list(await export(store, "t"))
    await assert_replays(lines, "t", billing())
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    report = await assert_replays(path, "t", billing())
    assert report.clean
    with pytest.raises(AssertionError, match=r"diverges at seq \d+ \(inference\): tool_missing"):
        await assert_replays(str(path), "t", billing(without=["wire"]))


# ---- ratchet replay ----------------------------------------------------------------------


def cli_agent() -> Agent:
    return billing()


def cli_agent_without_wire() -> Agent:
    return billing(without=["wire"])


def _cli(*args: str) -> Any:
    app = typer.Typer()
    app.callback()(lambda: None)  # a group: the command keeps its name
    register(app)
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def recorded_store(tmp_path: Path) -> str:
    from storage.url import open_store

    url = f"sqlite:///{tmp_path / 'r.db'}"

    async def go() -> None:
        db = await open_store(url)
        try:
            await record(billing(), "go", store=db)
        finally:
            await db.close()

    asyncio.run(go())
    return url


AGENT = "tests.runtime.test_replay:cli_agent"


def test_cli_replay_exits_0_when_the_thread_replays_cleanly(recorded_store: str):
    result = _cli("replay", "t", "--agent", AGENT, "--store", recorded_store)
    assert result.exit_code == 0, result.output
    assert "replay cleanly" in result.stdout


def test_cli_replay_prints_the_divergence_as_one_line(recorded_store: str):
    result = _cli("replay", "t", "--agent", f"{AGENT}_without_wire", "--store", recorded_store)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tool_missing" in lines[0] and "seq " in lines[0]


def test_cli_replay_json(recorded_store: str, tmp_path: Path):
    result = _cli("replay", "t", "--agent", AGENT, "--store", recorded_store, "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["divergence"] is None and report["thread_id"] == "t"
    out = tmp_path / "t.jsonl"
    from cluster.cli_history import register as history

    app = typer.Typer()
    history(app)
    exported = CliRunner().invoke(
        app, ["export", "t", "--out", str(out), "--store", recorded_store]
    )
    assert exported.exit_code == 0, exported.output
    bad = _cli("replay", "t", "--agent", f"{AGENT}_without_wire", "--export", str(out), "--json")
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["divergence"]["what"] == "tool_missing"


@pytest.mark.parametrize(
    "args",
    [
        ("nope", "--agent", AGENT),
        ("t", "--agent", "tests.runtime.test_replay:no_such_agent"),
        ("t", "--agent", "not a reference"),
        ("t", "--agent", AGENT, "--export", "/nonexistent/t.jsonl"),
    ],
)
def test_cli_replay_bad_input_is_one_line(recorded_store: str, args: Sequence[str]):
    result = _cli("replay", *args, "--store", recorded_store)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr


async def test_a_hook_that_no_longer_asks_for_input_is_an_unrecorded_inference():
    """Recorded with a hook that made the Run wait; replayed without it, the code asks the
    model where the recording waited: unrecorded_inference, reported as such (the replay's
    stop was taken for the model's failure, retried, and reported as an end that differs)."""

    def ask(h):
        from runtime.execution import RequestInput

        return HookOutput(reactions=[RequestInput(prompt="which account?")] if h.step == 0 else [])

    store = MemoryCommitStore()  # the recording rests awaiting the input
    await InProcessRunner(billing(hooks=[Hook("StepEnd", ask)]), store).start("go", thread_id="t")
    d = (await replayed(store, billing())).divergence
    assert d is not None and d.what == "unrecorded_inference"
