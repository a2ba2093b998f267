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
