"""The Supervisor's wake pass, in process, with fake hosts: hand-overs of children's
outcomes (``actors.deliveries.redeliver``), wakes of due Runs (``actors.schedule``) and
cancels of running orphans (``actors.orphans``) are sent through one ``Pass``, at most
``PER_HOST`` calls under way on one host: a host that hangs holds only its own slots,
and one that failed a call is asked nothing more in that pass."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections import Counter
from typing import Any

import pytest

import actors.deliveries
import actors.orphans
from actors.deliveries import PER_HOST, redeliver
from actors.orphans import Orphans
from actors.schedule import Alarms
from actors.supervisor import Supervisor
from actors.wire import SystemSpec
from runtime import InProcessRunner
from runtime.control import control_engine
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, Cancelled
from runtime.limits import Limits
from runtime.timeutil import now_us
from storage.memory import MemoryCommitStore
from tests.runtime import delegation_agents as agents
from tests.runtime.test_schedule_wakes import _paused
from tests.support.waiting import until


class Host:
    """A host that answers every call at once (``hang`` False), or never."""

    def __init__(self, hang: bool) -> None:
        self.asked: list[str] = []
        host = self

        class _Call:
            def remote(self, command: Any, run: Any = None) -> Any:
                thread = command if isinstance(command, str) else command.thread_id
                host.asked.append(thread)
                answer = asyncio.get_running_loop().create_future()
                if not hang:
                    answer.set_result(None)
                return answer

        self.resume_run = self.cancel_run = _Call()


async def _parents(store: MemoryCommitStore, threads: list[str]) -> list[tuple[str, str]]:
    """Parents at rest awaiting a child that has ended (its hand-over lost): (parent,
    child) for each."""
    agent = agents.fanout_agent("needy_worker", 1)
    runner = InProcessRunner(agent, store, agent_ref=f"{agents.HERE}:{agent.name}")
    pairs = []
    for thread in threads:
        parent = await runner.start("go", thread_id=thread)
        assert parent.status.reason == "awaiting_delegation", parent.status
        (child,) = parent.state["run"]["children"].values()
        pairs.append((thread, child))
    return pairs


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_hung_host_holds_only_its_own_slots_of_the_hand_overs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parents on a host that hangs, listed before one on a host that answers: the
    hand-overs took ``WAKE_AT_ONCE`` slots regardless of host, so the hung host's
    calls held every slot for ``DELIVERY_S`` and the other parent waited for them
    all. Now the hung host has ``PER_HOST`` calls under way, and the other parent's
    outcome is handed over meanwhile."""
    monkeypatch.setattr(actors.deliveries, "DELIVERY_S", 3600.0)
    store = MemoryCommitStore()
    stuck = [f"stuck-{i:02}" for i in range(12)]
    pairs = await _parents(store, [*stuck, "free"])
    for _, child in pairs:  # each child ended, and its host's hand-over lost
        await control_engine(store).terminate(ThreadId(child), Cancelled())
    hung, free = Host(hang=True), Host(hang=False)

    def host_of(frontier: Any) -> Any:
        return free if frontier.thread_id == "free" else hung

    parents = [ThreadId(p) for p, _ in pairs]
    passing = asyncio.create_task(redeliver(store, parents, host_of, Limits()))
    try:
        await until(lambda: free.asked == ["free"], what="the free host's parent handed")
        assert len(hung.asked) == PER_HOST and not passing.done()
    finally:
        await _stop(passing)


async def test_a_host_that_failed_a_hand_over_is_asked_nothing_more_in_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every parent on a host that hangs: each hand-over waited its ``DELIVERY_S`` in
    turn, ``WAKE_AT_ONCE`` at a time (a pass of N parents lasted N/8 deadlines, and the
    next sweep started none meanwhile). Now the host's first calls fail and the rest
    are not sent: the pass ends after one deadline."""
    monkeypatch.setattr(actors.deliveries, "DELIVERY_S", 0.2)
    store = MemoryCommitStore()
    pairs = await _parents(store, [f"stuck-{i:02}" for i in range(12)])
    for _, child in pairs:
        await control_engine(store).terminate(ThreadId(child), Cancelled())
    hung = Host(hang=True)
    parents = [ThreadId(p) for p, _ in pairs]
    handed = await asyncio.wait_for(redeliver(store, parents, lambda f: hung, Limits()), 30)
    assert handed == 0 and len(hung.asked) == PER_HOST
    for parent in parents:  # nothing lost: each still awaits, for the next pass
        assert isinstance((await store.load(parent)).run_state, AwaitingState)


async def test_a_hung_host_holds_only_its_own_slots_of_the_orphans_cancels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Running orphans on a host that hangs, listed before one on a host that answers:
    their cancels held every slot of the sweep for ``ORPHAN_CANCEL_S``. Now only the
    hung host's own, and the other orphan is cancelled meanwhile."""
    monkeypatch.setattr(actors.orphans, "ORPHAN_CANCEL_S", 3600.0)
    store = MemoryCommitStore()
    pairs = await _parents(store, [f"stuck-{i:02}" for i in range(12)] + ["free"])
    for parent, _ in pairs:  # each parent ended, and its cancel of its child lost
        await control_engine(store).terminate(ThreadId(parent), Cancelled())
    hung, free = Host(hang=True), Host(hang=False)
    free_child = pairs[-1][1]

    def host_for(thread: ThreadId) -> Any:
        return free if thread == free_child else hung

    async def cancel(thread: ThreadId, run: RunId) -> None:
        await host_for(thread).cancel_run.remote(thread, run=run)

    async def end(thread: ThreadId, run: RunId) -> None:
        raise AssertionError("a running orphan is cancelled through its host")

    children = {child for _, child in pairs}
    listed = [s for s in await store.list_runs("awaiting") if s.thread_id in children]
    listed.sort(key=lambda s: s.thread_id == free_child)  # the hung host's first
    orphans = Orphans(store, end, cancel, host_for)
    passing = asyncio.create_task(orphans.sweep([], listed))
    try:
        await until(lambda: free.asked == [free_child], what="the free host's orphan")
        assert len(hung.asked) == PER_HOST and not passing.done()
    finally:
        await _stop(passing)


async def test_the_supervisor_s_wake_pass_bounds_each_host_across_its_three_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Supervisor's pass hands outcomes over and wakes due pauses at once: a host
    that hangs is sent ``PER_HOST`` calls of the pass in all (not as many per kind),
    and another host's parent and paused Run are served meanwhile."""
    monkeypatch.setattr(actors.deliveries, "DELIVERY_S", 3600.0)
    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    pairs = await _parents(store, [f"stuck-{i:02}" for i in range(6)] + ["free"])
    for _, child in pairs:
        await control_engine(store).terminate(ThreadId(child), Cancelled())
    await _paused(store, [f"paused-{i:02}" for i in range(6)] + ["free-paused"])
    hung, free = Host(hang=True), Host(hang=False)
    bare = object.__new__(Supervisor)  # the pass only: no actor, no hosts
    bare.spec, bare.store, bare.counts = spec, store, Counter()
    bare.alarms = Alarms()
    bare.orphans = Orphans(store, bare._end_orphan)
    bare._host_of = lambda f: free if f.thread_id.startswith("free") else hung  # type: ignore[method-assign]
    awaiting = list(await store.list_runs("awaiting"))
    awaiting.sort(key=lambda s: s.thread_id.startswith("free"))  # the hung host's first
    parents = [s.thread_id for s in awaiting if s.status.reason == "awaiting_delegation"]

    later = now_us() + 3600 * 1_000_000  # every pause due
    monkeypatch.setattr(importlib.import_module("actors.supervisor"), "now_us", lambda: later)
    passing = asyncio.create_task(bare._wake(parents, awaiting, []))
    try:
        await until(
            lambda: sorted(free.asked) == ["free", "free-paused"], what="the free host served"
        )
        assert len(hung.asked) == PER_HOST and not passing.done()
    finally:
        await _stop(passing)
