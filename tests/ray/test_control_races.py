"""A host's cancel, stop and recover met by its own drives mid-way (no Ray: a bare RunHost
over the in-memory store, the interleavings forced by stores that hold a load).

A drive that has claimed nothing yet may never claim (a repeated start of a Run that
exists, a resume or a recovery that finds it at rest): it must not pass for the Run's
driver. A cancel told to such a drive was dropped with it, and the Run stayed awaiting
while its caller heard "signalled".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from typing import Any

import pytest

from actors.drives import Drives, starting
from actors.retiring import Admission
from actors.run_host import RunHost
from actors.wire import RunMeta, SystemSpec, unwrap
from cluster.client import command_for
from runtime import Agent, ModelResponse, ScriptedModel, call, tool
from runtime.control import control_engine
from runtime.engine import Engine
from runtime.errors import InvalidTransition, ResumeRejected
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, Cancelled, EndedState, PermissionDecision, Stopped
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore
from tests.support.stores import AppendsOut
from tests.support.waiting import until

from .agents import permission_agent

OWNER = "control-host#1"
TOOLS = LocalToolRunner(permission_agent.tools)


class _Held:
    """A store that holds some of its calls until the test lets them go."""

    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner = inner
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _hold(self) -> None:
        if not self.release.is_set():
            self.entered.set()
            await self.release.wait()


class _HeldLoad(_Held):
    """A store whose next ``load`` waits until the test lets it go."""

    async def load(self, thread: ThreadId) -> Any:
        await self._hold()
        return await self.inner.load(thread)


class _HeldWait(_Held):
    """A store whose append of a Run's wait (the ``awaiting`` commit) waits until the
    test lets it go."""

    async def append(self, commit: Any, *args: Any, **kwargs: Any) -> Any:
        if commit.label == "awaiting":
            await self._hold()
        return await self.inner.append(commit, *args, **kwargs)


class _EndedBeforeTerminate:
    """A store whose second ``load`` of the thread is preceded by another end of its Run
    (a stop through another host, landing between the cancel's look and its end)."""

    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner, self.loads = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        self.loads += 1
        if self.loads == 2:
            await control_engine(self.inner, owner="other-host#1").terminate(
                thread, Stopped(reason="elsewhere")
            )
        return await self.inner.load(thread)


def _host(store: Any, drives_store: Any) -> RunHost:
    host = object.__new__(RunHost)
    host.spec = SystemSpec(name="control", store_url="memory://")
    host.store, host.owner, host.kind = store, OWNER, "hosted"
    host.publisher = host.children = None
    host._background = set()
    host.admission = Admission()
    host.drives = Drives(host.spec, drives_store, OWNER, *[None] * 4, lambda: None)
    host.drives.engine = lambda ref, faults, link, holding: Engine(  # type: ignore[method-assign]
        permission_agent, holding, TOOLS, owner=OWNER
    )
    imported = host.drives.loaded

    async def loaded(ref: str) -> None:  # "ref" names no module: the engine above is the agent
        if ref != "ref":
            await imported(ref)

    host.drives.loaded = loaded  # type: ignore[method-assign]
    return host


async def _parked(store: MemoryCommitStore, thread: str) -> Any:
    run = RunId(f"run-{thread}")
    frontier = await Engine(permission_agent, store, TOOLS, owner=OWNER).start(
        ThreadId(thread), "go", run_id=run, message_id=RunMeta(agent_ref="ref").message_id(run)
    )
    assert isinstance(frontier.run_state, AwaitingState)
    return frontier


async def test_a_cancel_met_by_a_repeated_start_ends_the_awaiting_run():
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-repeat")
    held = _HeldLoad(store)
    host = _host(store, held)
    thread, run = parked.thread_id, parked.run_id
    # a client's start of the same Run, again: its drive will find the Run and claim nothing
    host.drives.spawn("ref", thread, run, starting(thread, "go", run, f"{run}:input", False))
    await held.entered.wait()
    cancel = asyncio.ensure_future(
        host._end_run(thread, None, Cancelled(), "cancelled", lambda e: e.cancel())
    )
    # the cancel's first step was scheduled before the load's wake-up (asyncio runs
    # ready callbacks in order): it meets the drive while the drive is still in its load
    held.release.set()
    assert await cancel == "cancelled"
    frontier = await store.load(thread)
    assert isinstance(frontier.run_state, EndedState)
    assert frontier.run_state.cause.kind == "cancelled"


async def test_a_cancel_told_to_a_drive_that_never_claims_still_ends_the_run(monkeypatch):
    """The store holds the repeated start's load past the host's wait for a claim
    (``drives.STOP_S``): the cancel is told to that drive ("signalled"), which then finds
    the Run exists and goes without claiming, the signal with it. The host ends the Run
    from the store once that drive is over, as its caller was told it would end."""
    import actors.drives

    monkeypatch.setattr(actors.drives, "STOP_S", 0.01)
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-unclaimed")
    held = _HeldLoad(store)
    host = _host(store, held)
    thread, run = parked.thread_id, parked.run_id
    drive = host.drives.spawn(
        "ref", thread, run, starting(thread, "go", run, f"{run}:input", False)
    )
    await held.entered.wait()
    answer = await host._end_run(thread, None, Cancelled(), "cancelled", lambda e: e.cancel())
    assert answer == "signalled"  # told to the drive, which has claimed nothing
    held.release.set()
    await asyncio.wait_for(asyncio.wait({drive.task}), 10)
    assert drive.epoch is None  # it went without claiming

    async def ended() -> bool:
        return isinstance((await store.load(thread)).run_state, EndedState)

    await until(ended, 10, what="the Run ended from the store")
    assert (await store.load(thread)).run_state.cause.kind == "cancelled"


async def test_a_cancel_that_meets_the_drive_as_it_comes_to_rest_ends_the_run():
    """The cancel finds the Run's drive (it holds the thread), then looks at the store;
    meanwhile the drive commits the Run's wait and returns. Signalled then, the drive
    would not hear it, and the Run would rest awaiting while its caller heard
    "signalled": the cancel ends it at rest instead."""
    store = MemoryCommitStore()
    held, waiting = _HeldLoad(store), _HeldWait(store)
    host = _host(held, waiting)  # the cancel's loads are held, and the drive's wait
    thread, run = ThreadId("ctl-resting"), RunId("run-ctl-resting")
    message = RunMeta(agent_ref="ref").message_id(run)
    drive = host.drives.spawn("ref", thread, run, starting(thread, "go", run, message, False))
    await asyncio.wait_for(waiting.entered.wait(), 10)  # claimed, its wait on its way
    cancel = asyncio.ensure_future(
        host._end_run(thread, None, Cancelled(), "cancelled", lambda e: e.cancel())
    )
    await asyncio.wait_for(held.entered.wait(), 10)  # the cancel took it for the driver
    waiting.release.set()
    rested = await asyncio.wait_for(asyncio.shield(drive.task), 10)
    assert isinstance(rested.run_state, AwaitingState)  # the wait landed, unheard
    held.release.set()
    assert await asyncio.wait_for(cancel, 10) == "cancelled"
    frontier = await store.load(thread)
    assert isinstance(frontier.run_state, EndedState)
    assert frontier.run_state.cause.kind == "cancelled"


async def test_a_cancel_that_finds_the_run_ended_meanwhile_says_it_ended_nothing():
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-ended")
    host = _host(_EndedBeforeTerminate(store), store)
    answer = await host._end_run(
        parked.thread_id, None, Cancelled(), "cancelled", lambda e: e.cancel()
    )
    assert answer == "not_running"
    assert (await store.load(parked.thread_id)).run_state.cause.kind == "stopped"


async def test_a_late_recovery_takes_nothing_from_the_run_s_new_owner():
    """The Supervisor asked this host to recover a Run at epoch e; the call came late,
    after another host had claimed the Run: that host keeps it."""
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-late")
    seen = parked.epoch
    await store.claim(parked.thread_id, "new-owner#1", seen)
    host = _host(store, store)
    assert await host._recover(parked.thread_id, "ref", seen) is True
    frontier = await store.load(parked.thread_id)
    assert (frontier.owner, frontier.epoch) == ("new-owner#1", seen + 1)
    assert not host.drives.table


async def test_a_host_agrees_to_retire_only_when_nothing_may_start_a_drive_there():
    """The Supervisor ends an idle dedicated host; a resume that reached the host before
    must not start a drive the kill then cuts (its approved call would be lost)."""
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-retire")
    held = _HeldLoad(store)
    host = _host(held, store)
    approve = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
    resume = asyncio.ensure_future(host.resume_run(approve))
    await held.entered.wait()  # the resume is in its load: it has started no drive yet
    assert await host.retire_now() is False
    held.release.set()
    assert unwrap(await resume) is True
    await asyncio.wait({host.drives.get(parked.thread_id).task})
    assert await host.retire_now() is True  # idle now: from here it starts nothing
    again = asyncio.ensure_future(
        host.start_run("ref", parked.thread_id, RunId("run-next"), "next")
    )
    await asyncio.sleep(0)  # one loop turn: the start takes its first step, to the door
    assert not again.done() and not host.drives.table and host.admission.inside == 0
    again.cancel()  # as the kill would end it
    with contextlib.suppress(asyncio.CancelledError):
        await again
    assert (await store.load(parked.thread_id)).run_state.cause.kind == "natural"


async def test_a_repeated_start_is_one_only_if_it_asked_the_same():
    """A start of a Run that exists returns it (whoever drives it) only if it asked for
    the same input and agent; another input under the same run id is refused, in the
    engine and where a host joins the Run's drive."""
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-again")
    thread, run = parked.thread_id, parked.run_id
    message = RunMeta(agent_ref="ref").message_id(run)
    engine = Engine(permission_agent, store, TOOLS, owner=OWNER)
    again = await engine.start(thread, "go", run_id=run, message_id=message)
    assert again.version == parked.version
    for text, mid in [
        ("something else", message),
        ("go", RunMeta(agent_ref="other").message_id(run)),
    ]:
        with pytest.raises(InvalidTransition, match="another input"):
            await engine.start(thread, text, run_id=run, message_id=mid)
    # the host: a start of the same Run while a drive of it is on its way joins it
    held = _HeldLoad(store)
    host = _host(store, held)
    host.drives.spawn("ref", thread, run, starting(thread, "go", run, message, False))
    await asyncio.wait_for(held.entered.wait(), 10)
    joined = asyncio.ensure_future(host.start_run("ref", thread, run, "something else"))
    held.release.set()
    with pytest.raises(InvalidTransition, match="another input"):
        unwrap(await asyncio.wait_for(joined, 10))
    assert (await store.load(thread)).version == parked.version  # nothing was written


class _FirstLoadHeld(_Held):
    """A store whose first ``load`` waits until the test lets it go; the rest pass."""

    async def load(self, thread: ThreadId) -> Any:
        if not self.entered.is_set():
            await self._hold()
        return await self.inner.load(thread)


class _HeldResume(_Held):
    """A store whose append of a resume waits until the test lets it go."""

    async def append(self, commit: Any, *args: Any, **kwargs: Any) -> Any:
        if commit.label.startswith("resume"):
            await self._hold()
        return await self.inner.append(commit, *args, **kwargs)


async def test_a_resume_that_lost_to_one_in_flight_here_is_told_once_the_winner_landed():
    """Two resumes of one ticket through one host, both loading the thread before either
    drive was spawned: the second meets the first's drive before its commit lands. Told
    "rejected" then, its caller read the thread still awaiting on that ticket (found in
    CI by test_races). It now waits for that drive's first commit and judges the store."""
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-resume")
    thread = parked.thread_id
    command = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
    loads, appends = _FirstLoadHeld(store), _HeldResume(store)
    host = _host(loads, appends)
    # a bare host has no reconciliation to wait for and no parent to hand an end to
    host._after_reclaim = _nothing  # type: ignore[method-assign]
    host._after = None
    seen = asyncio.Event()
    first_commit = host.drives.first_commit

    async def watched(drive: Any, *args: Any) -> Any:
        if drive.run_id == parked.run_id and not args:  # a drive of another way in
            seen.set()
        return await first_commit(drive, *args)

    host.drives.first_commit = watched  # type: ignore[method-assign]
    second = asyncio.ensure_future(host.resume_run(command))
    await loads.entered.wait()  # the second has begun its load: the ticket is there
    first = asyncio.ensure_future(host.resume_run(command))
    await appends.entered.wait()  # the first's drive is spawned, its resume held
    loads.release.set()
    waiting = asyncio.ensure_future(seen.wait())
    try:
        await asyncio.wait({second, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if second.done():  # told before the winner landed: what the store says now
        state = (await store.load(thread)).run_state
        pytest.fail(f"told {second.result()!r} while the thread is {state.kind}")
    appends.release.set()
    assert await first is True
    with pytest.raises(ResumeRejected, match="ticket"):
        unwrap(await second)
    assert not isinstance((await store.load(thread)).run_state, AwaitingState)
    drive = host.drives.get(thread)
    if drive is not None:  # the winner's drive goes on to its end: let it
        await drive.task


async def _nothing() -> None:
    return None


class _ClaimedBeforeLoad:
    """A store whose next ``load`` of the thread is preceded by another host's claim (a
    Supervisor's re-placement landing between the reconciler's listing and its look)."""

    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner, self.claimed = inner, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        if self.claimed is None:
            head = await self.inner.load_head(thread)
            self.claimed = await self.inner.claim(thread, "other-host#1", supersedes=head.epoch)
        return await self.inner.load(thread)


async def test_a_reconciler_overtaken_by_another_claim_leaves_the_run_to_it():
    """This host's reconciler lists a Run it owns and does not drive, marks it, and means
    to drive it again; another host claims it before the look. Driving it now would
    fence that host's drive: the recovery sees the owner changed and does nothing."""
    from actors.reconcile import Reconciler
    from runtime import Crash, FaultPlan

    store = MemoryCommitStore()
    thread, run = ThreadId("ctl-overtaken"), RunId("run-ctl-overtaken")
    crashing = Engine(
        permission_agent, store, TOOLS, owner=OWNER, faults=FaultPlan(("before:inference", 1))
    )
    with pytest.raises(Crash):
        await crashing.start(
            thread, "go", run_id=run, message_id=RunMeta(agent_ref="ref").message_id(run)
        )
    overtaking = _ClaimedBeforeLoad(store)
    host = _host(overtaking, store)
    recover = functools.partial(host._recover, owner=OWNER)
    await Reconciler("control-host", OWNER, store, host.drives, recover).once()
    assert overtaking.claimed is not None  # the claim landed between listing and look
    assert thread not in host.drives
    head = await store.load_head(thread)
    assert (head.owner, head.epoch) == ("other-host#1", overtaking.claimed.epoch)


async def test_a_repeated_start_that_joins_a_drive_failing_on_its_own_is_told_by_the_store():
    """A repeated start of an awaiting Run joins this host's drive of that Run, a resume
    that its ticket then rejects: the start is a repeat of a Run that exists (answered
    as one), not that resume's ResumeRejected."""
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-join")
    held = _HeldLoad(store)
    host = _host(store, held)
    thread, run = parked.thread_id, parked.run_id
    ticket = parked.run_state.ticket
    wrong = command_for(ticket, PermissionDecision(approve=True)).model_copy(
        update={"correlation": "guess"}
    )
    resume = host.drives.spawn("ref", thread, run, lambda e: e.resume(wrong))
    await held.entered.wait()
    start = asyncio.ensure_future(host.start_run("ref", thread, run, "go"))
    held.release.set()
    assert await asyncio.wait_for(start, 10) is True
    assert isinstance(resume.task.exception(), ResumeRejected)
    assert (await store.load(thread)).run_state == parked.run_state  # nothing moved


# ---- a cancel told to a drive that goes without ending the Run --------------------------

GATE = asyncio.Event()


@tool(recovery=("replay_safe",))
async def gated() -> str:
    """Runs until the test lets it go (a recovery runs it again, and waits too)."""
    await GATE.wait()
    return "let go"


GATED = Agent(
    name="gated",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("gated", "g1"),)), ModelResponse(text="finished anyway")]
    ),
    tools=[gated],
)


def _gated_host(store: Any, drives_store: Any, **engine: Any) -> RunHost:
    host = _host(store, drives_store)
    tools = LocalToolRunner(GATED.tools)
    host.drives.engine = lambda ref, faults, link, holding: Engine(  # type: ignore[method-assign]
        GATED, holding, tools, owner=OWNER, **engine
    )
    return host


async def _in_its_tool(store: Any, thread: str) -> None:
    async def running_a_call() -> bool:
        return (await store.load(ThreadId(thread))).batch is not None

    await until(running_a_call, 10, what="the Run in its tool call")


async def _ended_as(store: Any, thread: str, kind: str) -> None:
    async def ended() -> bool:
        return isinstance((await store.load(ThreadId(thread))).run_state, EndedState)

    await until(ended, 10, what="the Run ended")
    assert (await store.load(ThreadId(thread))).run_state.cause.kind == kind


class _TakenOverBeforeTheEnd:
    """The drives' store: just before the signalled drive's end lands, another host (the
    Supervisor's pick, which took this one for lost) claims the Run and drives it on."""

    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner, self.other = inner, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, commit: Any, *args: Any, **kwargs: Any) -> Any:
        if commit.label == "ended" and self.other is None:
            other = Engine(GATED, self.inner, LocalToolRunner(GATED.tools), owner="other#2")
            self.other = asyncio.ensure_future(other.recover(commit.thread_id))
            epoch = (await self.inner.load(commit.thread_id)).epoch

            async def claimed() -> bool:
                return (await self.inner.load(commit.thread_id)).epoch > epoch

            await until(claimed, 10, what="the other host's claim")
        return await self.inner.append(commit, *args, **kwargs)


async def test_a_cancel_whose_drive_was_taken_over_ends_the_run_from_the_store():
    """The drive told to cancel is fenced by another host's take-over as it commits the
    end (it stops, Fenced): the host ends the Run from the store, its end fencing the new
    owner in turn, before it answers: "cancelled" is durable, not a promise in memory."""
    GATE.clear()
    store = MemoryCommitStore()
    taken = _TakenOverBeforeTheEnd(store)
    host = _gated_host(store, taken)
    assert await host.start_run("ref", ThreadId("ctl-taken"), RunId("r-taken"), "go") is True
    await _in_its_tool(store, "ctl-taken")
    assert await host.cancel_run(ThreadId("ctl-taken")) == "cancelled"
    await _ended_as(store, "ctl-taken", "cancelled")  # the other host is still in its tool
    GATE.set()
    with contextlib.suppress(Exception):  # fenced in turn
        await asyncio.wait_for(taken.other, 10)
    assert (await store.load(ThreadId("ctl-taken"))).run_state.cause.kind == "cancelled"


class StubbornModel:
    """A model (a hostile one, or an SDK stuck in a C call) that swallows its
    cancellation: its drive cannot end the Run until the test lets the stream go."""

    def __init__(self) -> None:
        self.streaming, self.release = asyncio.Event(), asyncio.Event()

    async def stream(self, request: Any) -> Any:
        self.streaming.set()
        while not self.release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.release.wait()
        yield ModelResponse(text="went on")


async def test_a_cancel_its_drive_cannot_carry_out_is_durable_before_it_is_answered(
    monkeypatch,
):
    """The Run's model ignores its cancellation, so its drive cannot end the Run: once
    ``SIGNAL_WAIT_S`` has passed the host ends it from the store, its claim fencing that
    drive. The answer is "cancelled", already committed: a host that dies right after
    (another host recovering the Run) finds it at rest. Before, the answer was
    "signalled", a promise held in this host's memory that died with it."""
    import actors.drives
    import actors.host_control

    monkeypatch.setattr(actors.host_control, "SIGNAL_WAIT_S", 0.5)
    # the fenced drive does not stop (it swallows that cancellation too) within the time
    # left to answer: the end, committed, is the answer all the same
    monkeypatch.setattr(actors.drives, "STOP_S", 1.0)
    model = StubbornModel()
    stubborn = Agent(name="stubborn", model=model)
    store = MemoryCommitStore()
    host = _host(store, store)
    host.drives.engine = lambda ref, faults, link, holding: Engine(  # type: ignore[method-assign]
        stubborn, holding, LocalToolRunner([]), owner=OWNER
    )
    thread = ThreadId("ctl-stubborn")
    try:
        assert await host.start_run("ref", thread, RunId("r-stubborn"), "go") is True
        await asyncio.wait_for(model.streaming.wait(), 10)
        assert await host.cancel_run(thread) == "cancelled"
        assert (await store.load(thread)).run_state.cause.kind == "cancelled"
        other = Engine(stubborn, store, LocalToolRunner([]), owner="other#2")
        recovered = await asyncio.wait_for(other.recover(thread), 10)  # this host "died"
        assert recovered.run_state.cause.kind == "cancelled"
    finally:
        model.release.set()
    assert "went on" not in [getattr(m, "text", None) for m in recovered.messages]


RACED: list[asyncio.Event] = []
"""The gate of ``held_call``, made by the test that uses it (an event is its loop's)."""


@tool(recovery=("replay_safe",))
async def held_call() -> str:
    """Runs until the test lets it go; takes its cancellation."""
    await RACED[-1].wait()
    return "let go"


HELD = Agent(
    name="held",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("held_call", "h1"),)), ModelResponse(text="went on")]
    ),
    tools=[held_call],
)


async def test_a_cancel_and_a_stop_racing_end_the_run_once_and_the_loser_ended_nothing():
    """Both are told to the Run's drive; it ends with the first, and the other call finds
    it at rest with another cause: that one ended nothing ("not_running"), where it
    was told "signalled", a promise of an end that would never come."""
    RACED.append(asyncio.Event())
    store = MemoryCommitStore()
    host = _host(store, store)
    host.drives.engine = lambda ref, faults, link, holding: Engine(  # type: ignore[method-assign]
        HELD, holding, LocalToolRunner(HELD.tools), owner=OWNER
    )
    thread = ThreadId("ctl-raced")
    try:
        assert await host.start_run("ref", thread, RunId("r-raced"), "go") is True
        await _in_its_tool(store, thread)
        answers = await asyncio.gather(host.cancel_run(thread), host.stop_run(thread, "budget"))
    finally:
        RACED[-1].set()
    kind = (await store.load(thread)).run_state.cause.kind
    assert sorted(answers) == sorted([kind, "not_running"]), (answers, kind)


@pytest.mark.parametrize("twice", ["cancel", "stop"])
async def test_two_calls_asking_the_same_end_at_once_end_the_run_once(twice: str):
    """Two cancels (or two stops for one reason) told to the Run's drive at once: both
    answered "cancelled", where one ended it and the other ended nothing."""
    RACED.append(asyncio.Event())
    store = MemoryCommitStore()
    host = _host(store, store)
    host.drives.engine = lambda ref, faults, link, holding: Engine(  # type: ignore[method-assign]
        HELD, holding, LocalToolRunner(HELD.tools), owner=OWNER
    )
    thread = ThreadId(f"ctl-twice-{twice}")

    def ask() -> Any:
        return host.cancel_run(thread) if twice == "cancel" else host.stop_run(thread, "budget")

    try:
        assert await host.start_run("ref", thread, RunId("r-twice"), "go") is True
        await _in_its_tool(store, thread)
        answers = await asyncio.gather(ask(), ask())
    finally:
        RACED[-1].set()
    kind = (await store.load(thread)).run_state.cause.kind
    assert kind == ("cancelled" if twice == "cancel" else "stopped")
    assert sorted(answers) == sorted([kind, "not_running"]), answers


async def test_a_signalled_cancel_outlives_a_store_outage_past_the_backoff():
    """The cancelled drive's end meets an outage longer than its backoff (the drive stops,
    paused): the reconciler does not drive the Run again meanwhile, and once the store is
    back the host ends it from the store, as it told its caller."""
    from actors.reconcile import Reconciler
    from runtime.context import StoreRetry

    GATE.clear()
    store = AppendsOut(MemoryCommitStore())
    quick = StoreRetry(first_delay_s=0.01, max_delay_s=0.05, give_up_after_s=0.2)
    host = _gated_host(store, store, store_retry=quick)
    host.reconciler = Reconciler(
        "control-host", OWNER, store, host.drives, functools.partial(host._recover, owner=OWNER)
    )
    assert await host.start_run("ref", ThreadId("ctl-out"), RunId("r-out"), "go") is True
    await _in_its_tool(store, "ctl-out")
    drive = host.drives.get(ThreadId("ctl-out"))
    assert drive is not None
    store.down = True
    assert await host.cancel_run(ThreadId("ctl-out")) == "signalled"  # its end is not in
    await asyncio.wait_for(asyncio.wait({drive.task}), 10)  # it gave up on the store
    assert ThreadId("ctl-out") in host.drives.ending
    await host.reconciler.once()  # not driven again: its end was promised
    assert ThreadId("ctl-out") not in host.drives
    store.down = False
    GATE.set()
    await _ended_as(store, "ctl-out", "cancelled")


# ---- an agent slow to build ---------------------------------------------------------------

SLOW_MAY_RETURN = threading.Event()


def slow_agent() -> Agent:
    """A factory that returns once the test lets it (its module listing an MCP server's
    tools, say); on the host's event loop it would hold every other request there."""
    if not SLOW_MAY_RETURN.wait(timeout=20):
        raise RuntimeError("never let go")
    return GATED


def quick_agent() -> Agent:
    return GATED


async def test_an_agent_slow_to_build_holds_back_only_its_own_starts():
    SLOW_MAY_RETURN.clear()
    GATE.clear()
    store = MemoryCommitStore()
    host = _gated_host(store, store)
    slow = asyncio.ensure_future(
        host.start_run(f"{__name__}:slow_agent", ThreadId("ctl-slow"), RunId("r-slow"), "go")
    )
    quick = await asyncio.wait_for(
        host.start_run(f"{__name__}:quick_agent", ThreadId("ctl-quick"), RunId("r-q"), "go"), 10
    )
    assert quick is True and not slow.done()  # answered while the other agent builds
    SLOW_MAY_RETURN.set()
    assert await asyncio.wait_for(slow, 20) is True
    GATE.set()


async def test_a_cancel_told_to_a_refused_start_of_the_next_run_ends_the_awaiting_one(
    monkeypatch,
):
    """The thread's Run awaits; a start of the next Run is loading (it will be refused:
    one Run is active). A cancel naming no Run, told to that start's drive (it claims
    nothing), ends the awaiting Run once that drive is over, as its caller was told."""
    import actors.drives

    monkeypatch.setattr(actors.drives, "STOP_S", 0.01)
    store = MemoryCommitStore()
    parked = await _parked(store, "ctl-next")
    held = _HeldLoad(store)
    host = _host(store, held)
    thread, following = parked.thread_id, RunId("run-next")
    drive = host.drives.spawn(
        "ref", thread, following, starting(thread, "again", following, f"{following}:input", False)
    )
    await held.entered.wait()
    answer = await host._end_run(thread, None, Cancelled(), "cancelled", lambda e: e.cancel())
    assert answer == "signalled"
    held.release.set()
    await asyncio.wait_for(asyncio.wait({drive.task}), 10)
    await _ended_as(store, thread, "cancelled")


async def test_a_start_asked_again_after_the_thread_moved_on_is_its_repeat_on_a_host():
    """A RunHost drives the thread's next Run; the start of the one before is asked again
    (its answer was lost): the repeat, not "already has an active run"."""
    GATE.clear()
    store = MemoryCommitStore()
    host = _gated_host(store, store)
    thread = ThreadId("ctl-again")
    GATE.set()
    assert await host.start_run("ref", thread, RunId("r1"), "first", wait=True)
    assert (await store.load(thread)).ended
    GATE.clear()
    assert await host.start_run("ref", thread, RunId("r2"), "second") is True  # driven here
    assert await host.start_run("ref", thread, RunId("r1"), "first") is True
    refused = await host.start_run("ref", thread, RunId("r1"), "not the first")
    with pytest.raises(InvalidTransition, match="another input"):
        unwrap(refused)
    GATE.set()


async def test_a_child_call_never_joins_another_run_driven_on_the_child_s_thread():
    """The child's derived thread is being driven here for another Run (a caller chose
    that thread id): the parent's call fails naming it, rather than joining that drive
    and taking its answer for its own child's."""
    from runtime.delegation import CHILD_OUTCOME, ChildRequest

    GATE.clear()
    store = MemoryCommitStore()
    host = _gated_host(store, store)
    thread = ThreadId("ctl-child")
    assert await host.start_run("ref", thread, RunId("other"), "not a child") is True
    request = ChildRequest(
        parent_thread=ThreadId("parent"),
        parent_run=RunId("parent-run"),
        call_id="d0",
        agent="ref",
        input="task",
        child_thread=thread,
        child_run=RunId("the-child"),
        prompt_path=("p", "c"),
        lineage=("ref",),
    )
    try:
        answer = await asyncio.wait_for(host.run_child(request.model_dump()), 10)
    finally:
        GATE.set()
    outcome = CHILD_OUTCOME.validate_python(answer)
    assert outcome.kind == "finished" and outcome.output.is_error
    assert "holds another run (other)" in outcome.output.content
