"""A child at rest whose parent is gone is ended by the Supervisor's sweep
(``actors.orphans``); one whose parent still waits for it is left alone."""

from __future__ import annotations

import pytest

from actors.orphans import ORPHAN_CHECK_S, Orphans
from runtime import InProcessRunner
from runtime.control import control_engine
from runtime.lifecycle import AwaitingState, Cancelled, EndedState
from storage.memory import MemoryCommitStore
from tests.runtime import delegation_agents as agents

pytestmark = pytest.mark.ray


async def _parent_awaiting_its_child(store: MemoryCommitStore, thread: str):
    agent = agents.fanout_agent("needy_worker", 1)
    runner = InProcessRunner(agent, store, agent_ref=f"{agents.HERE}:{agent.name}")
    parent = await runner.start("go", thread_id=thread)
    assert isinstance(parent.run_state, AwaitingState)
    (child,) = parent.state["run"]["children"].values()
    return parent, await store.load(child)


async def test_an_awaiting_child_whose_parent_ended_is_ended_and_no_other():
    store = MemoryCommitStore()
    gone, orphan = await _parent_awaiting_its_child(store, "gone")
    _, kept = await _parent_awaiting_its_child(store, "kept")
    # the parent ends, and its cancel of the child is lost (its host down, say)
    await control_engine(store).terminate(gone.thread_id)
    assert isinstance((await store.load(orphan.thread_id)).run_state, AwaitingState)

    async def end(thread, run):
        await control_engine(store).terminate(thread, Cancelled(), run=run)

    orphans = Orphans(store, end)
    awaiting = await store.list_runs("awaiting")
    assert await orphans.sweep(awaiting) == 1
    ended = (await store.load(orphan.thread_id)).run_state
    assert isinstance(ended, EndedState) and ended.cause.kind == "cancelled"
    assert isinstance((await store.load(kept.thread_id)).run_state, AwaitingState)
    # looked at once per ORPHAN_CHECK_S: the next sweep at once asks nothing of the store
    assert ORPHAN_CHECK_S > 1 and await orphans.sweep(await store.list_runs("awaiting")) == 0


async def test_a_running_child_whose_parent_ended_is_cancelled_through_its_host(monkeypatch):
    """A parent's host killed between its end and its children's cancels left them
    running; each looks at its parent only before a Step, and a Step in a tool with no
    deadline (or waiting on a child of its own that is in one) lasts for ever. The sweep
    looks at running children too, and cancels an orphan through its host (which tells
    its drive): one whose parent still runs is left alone."""
    import asyncio
    import contextlib

    from runtime.ids import ThreadId
    from tests.support.waiting import until

    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    store = MemoryCommitStore()
    agent = agents.fanout_agent("slow_worker", 1)
    runner = InProcessRunner(agent, store, agent_ref=f"{agents.HERE}:{agent.name}")
    drives = [asyncio.create_task(runner.start("go", thread_id=t)) for t in ("gone", "kept")]

    async def children_in_their_tools() -> bool:
        running = await store.list_runs("running")
        return sum(s.thread_id.startswith(("gone/", "kept/")) for s in running) == 2

    await until(children_in_their_tools)
    await control_engine(store, owner="elsewhere#1").terminate(ThreadId("gone"), Cancelled())
    cancelled: list[tuple[str, str]] = []

    async def cancel(thread, run):
        cancelled.append((thread, run))

    async def end(thread, run):
        raise AssertionError(f"{thread} runs: it is cancelled through its host")

    orphans = Orphans(store, end, cancel)
    running = await store.list_runs("running")
    assert await orphans.sweep([], running) == 1
    ((thread, run),) = cancelled
    assert thread.startswith("gone/") and run.startswith((await store.load("gone")).run_id)
    assert await orphans.sweep([], await store.list_runs("running")) == 0  # once a while
    for drive in drives:
        drive.cancel()
        with contextlib.suppress(BaseException):
            await drive


async def test_the_supervisor_s_sweep_cancels_a_running_orphan_on_a_live_host(monkeypatch):
    """The Supervisor hands its sweep the running children of live hosts (a dead host's
    are taken over, and a recovered child looks at its parent first)."""
    import asyncio
    import contextlib
    import time
    from collections import Counter

    from actors.schedule import Alarms
    from actors.supervisor import Supervisor
    from actors.system_lease import LeaseKeeper
    from actors.wire import SystemSpec
    from runtime.delegation import ParentLink, child_ids
    from runtime.engine import Engine
    from runtime.ids import CallId, RunId, ThreadId
    from runtime.tool_calls import LocalToolRunner
    from tests.support.waiting import until

    monkeypatch.setattr(agents, "BLOCK", asyncio.Event())  # one of this test's loop
    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    owner = f"{spec.host_name(0)}#1"
    worker = agents.slow_worker
    tasks = []
    for parent in ("gone", "kept"):  # each parent's Run in its tool, then its child's
        engine = Engine(worker, store, LocalToolRunner(worker.deployed_tools), owner=owner)
        tasks.append(
            asyncio.create_task(engine.start(ThreadId(parent), "go", run_id=RunId(parent)))
        )
        kid, kid_run = child_ids(ThreadId(parent), RunId(parent), CallId("d0"))
        link = ParentLink(
            thread=ThreadId(parent), run=RunId(parent), call_id=CallId("d0"),
            agent=f"{agents.HERE}:slow_worker", prompt_path=("p", "slow_worker"),
            lineage=(f"{agents.HERE}:slow_worker",),
        )  # fmt: skip
        child = Engine(
            worker, store, LocalToolRunner(worker.deployed_tools), owner=owner, parent=link
        )
        tasks.append(asyncio.create_task(child.start(kid, "task", run_id=kid_run)))

    async def all_in_their_tools() -> bool:
        return len(await store.list_runs("running")) == 4

    await until(all_in_their_tools)
    await control_engine(store, owner="elsewhere#1").terminate(ThreadId("gone"), Cancelled())
    cancelled: list[str] = []

    async def cancel(thread, run):
        cancelled.append(thread)

    bare = object.__new__(Supervisor)  # the sweep only: no actor, no hosts
    bare.spec, bare.owner, bare.store = spec, spec.supervisor_name, store
    bare.counts, bare.quarantined, bare._taking = Counter(), set(), set()
    bare.leases = {spec.host_name(0): time.monotonic() + 3600}  # its host is live
    bare._quarantined_at, bare._waking = {}, None
    bare.orphans, bare.alarms = Orphans(store, bare._end_orphan, cancel), Alarms()
    bare.lease = LeaseKeeper(store, spec.name)
    await bare._sweep()
    assert bare._waking is not None
    await bare._waking
    assert cancelled == [child_ids(ThreadId("gone"), RunId("gone"), CallId("d0"))[0]]
    assert bare.counts["orphan_children_ended"] == 1
    for task in tasks:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def test_a_running_orphan_whose_host_hangs_does_not_hold_the_sweep(monkeypatch):
    """The sweep's cancel of a running orphan waited on its host's answer with no bound:
    a host that hangs held the Supervisor's wake pass for ever, and with it every pause's
    wake and every outcome's hand-over. It is given up after ``ORPHAN_CANCEL_S`` and the
    orphan looked at again later."""
    import asyncio

    monkeypatch.setattr("actors.orphans.ORPHAN_CANCEL_S", 0.2)
    store = MemoryCommitStore()
    gone, orphan = await _parent_awaiting_its_child(store, "gone")
    await control_engine(store).terminate(gone.thread_id)
    asked = []

    async def hung_cancel(thread, run):
        asked.append(thread)
        await asyncio.Event().wait()  # a host that never answers

    async def end(thread, run):
        raise AssertionError("a running orphan is cancelled through its host")

    orphans = Orphans(store, end, hung_cancel)
    listed = await store.list_runs("awaiting")  # taken as running on a live host
    assert await asyncio.wait_for(orphans.sweep([], listed), 10) == 0
    assert asked == [orphan.thread_id]


async def test_orphans_ended_from_the_store_hold_no_slot_of_the_pass():
    """Ending an orphan at rest cancels its own children on hosts not known here (each
    within CANCEL_CHILD_S): it held a slot of the pass meanwhile, and eight such orphans
    whose children sat on one dead host held every slot, every other host's wakes and
    hand-overs waiting behind them."""
    import asyncio

    from actors.deliveries import WAKE_AT_ONCE, Pass
    from tests.support.waiting import until

    store = MemoryCommitStore()
    for i in range(WAKE_AT_ONCE):
        gone, _ = await _parent_awaiting_its_child(store, f"gone{i}")
        await control_engine(store).terminate(gone.thread_id)
    ending, stuck = [], asyncio.Event()

    async def end(thread, run):  # as a cancel of its children on a dead host: it waits
        ending.append(thread)
        await stuck.wait()

    calls = Pass()
    listed = await store.list_runs("awaiting")
    sweep = asyncio.create_task(Orphans(store, end).sweep(listed, (), calls))
    try:
        await until(lambda: len(ending) == WAKE_AT_ONCE, 10)

        async def hand_over():
            return "handed"

        assert await asyncio.wait_for(calls.call("another host", hand_over), 5) == "handed"
    finally:
        stuck.set()
        assert await asyncio.wait_for(sweep, 10) == WAKE_AT_ONCE
