"""Concurrent terminal-only child delegation across the cluster (DESIGN §7)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from actors.wire import host_index
from cluster.cli_view import run_tree
from runtime.control import control_engine
from runtime.delegation import child_ids
from runtime.ids import CallId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    PermissionDecision,
    ResumeCommand,
    Stopped,
)
from tests.ray.conftest import wait_for

HERE = "tests.runtime.delegation_agents"
EXPECTED = [f"done: task {i}" for i in range(8)]


async def children_of(store, parent) -> list:
    return [await store.load(t) for t in parent.state["run"].get("children", {}).values()]


async def activations(store, thread) -> int:
    return sum(r.commit.label == "activation" for r in await store.read(thread))


async def test_a_parent_fans_out_to_eight_concurrent_children(make_system):
    client = await make_system()
    handle = await client.start(f"{HERE}:fanout_patient", "go")
    f = await handle.result(timeout_s=120)
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    assert json.loads(f.messages[-1].text) == EXPECTED  # results in model order
    kids = await children_of(client.store, f)
    assert len(kids) == 8
    starts, ends = [], []
    for kid in kids:
        statuses = [
            r.commit.status for r in await client.store.read(kid.thread_id) if r.commit.status
        ]
        starts.append(statuses[0].since)
        ends.append(statuses[-1].since)
    assert max(starts) < min(ends), "children did not overlap (committed timestamps)"
    tree = await run_tree(client.store, f)  # what `ratchet show` prints
    assert len(tree) == 9 and tree[0].endswith("[natural]")
    assert all(line.startswith("  └ ") and line.endswith("[natural]") for line in tree[1:])


@pytest.mark.parametrize(
    "point",
    [
        ("during:tools", 1),  # relationship committed, no child started yet
        ("before:results", 1),
    ],  # every child finished, the parent has not consumed them
)
async def test_the_parents_host_dies_and_every_child_runs_once(make_system, point):
    client = await make_system()
    handle = await client.start(f"{HERE}:fanout", "go", faults=(*point, "exit"))
    f = await handle.result(timeout_s=120)
    assert f.run_state.cause.kind == "natural"
    assert json.loads(f.messages[-1].text) == EXPECTED
    kids = await children_of(client.store, f)
    assert len(kids) == 8
    for kid in kids:
        assert await activations(client.store, kid.thread_id) == 1
        assert kid.run_state.cause.kind == "natural"
    assert sum(m.kind == "tool_result" for m in f.messages) == 8


async def test_one_death_of_a_child_s_host_does_not_spend_its_parent_s_call(make_system):
    """The child's host is killed mid-child; the parent's host lives. Ray refuses calls to
    the restarting host at once: each attempt of the parent's call was given up at that
    refusal, all three within the restart, and the parent ended indeterminate (its child
    cancelled) although the restarted host recovered the child."""
    client = await make_system()
    hosts = client.spec.hosts
    for i in range(64):  # a parent and its child on different hosts
        thread, run = ThreadId(f"cross-{i}"), RunId(f"cross-run-{i}")
        kid, _ = child_ids(thread, run, CallId("d0"))
        if host_index(kid, hosts) != host_index(thread, hosts):
            break
    handle = await client.start(f"{HERE}:lone_patient", "go", thread_id=thread, run_id=run)

    async def child_started() -> bool:
        return (await client.store.load_head(kid)).version > 0

    await wait_for(child_started, what="the child's first commit")
    info = await client.hosts[host_index(kid, hosts)].info.remote()
    os.kill(info["pid"], signal.SIGKILL)  # within the child's one-second inference
    f = await handle.result(timeout_s=120)
    assert f.run_state.cause.kind == "natural", f.run_state
    assert json.loads(f.messages[-1].text) == ["done: task 0"]
    child = await client.store.load(kid)
    assert child.run_state.cause.kind == "natural"
    labels = [r.commit.label for r in await client.store.read(thread)]
    assert labels == ["activation", "inference", "results", "ended"]  # no attempt spent


async def test_a_lone_child_waiting_for_a_human_resumes_its_parent_when_done(make_system):
    client = await make_system()
    handle = await client.start(f"{HERE}:lone_needy", "go")
    f = await handle.result(timeout_s=60)
    assert isinstance(f.run_state, AwaitingState)
    assert f.run_state.ticket.target.wait == "delegation"
    (kid,) = await children_of(client.store, f)
    ticket = kid.run_state.ticket
    await client.handle(kid.thread_id).resume(
        ResumeCommand(
            correlation=ticket.correlation,
            run_id=ticket.run_id,
            thread_id=ticket.thread_id,
            call_id=ticket.target.call_id,
            payload=PermissionDecision(approve=True),
        )
    )

    async def parent_ended() -> bool:
        return (await client.store.load(handle.thread_id)).ended

    await wait_for(parent_ended, timeout_s=60, what="the child's outcome to resume the parent")
    parent = await client.store.load(handle.thread_id)
    assert parent.run_state.cause.kind == "natural"
    assert json.loads(parent.messages[-1].text) == ["needy done"]


async def test_a_hundred_parents_with_four_children_each_finish(make_system):
    client = await make_system()
    handles = [await client.start(f"{HERE}:fanout4", f"p{i}") for i in range(100)]
    rows = await client.wait_all(handles, timeout_s=240)
    assert [r.cause for r in rows] == ["natural"] * 100
    listed = await client.store.list_runs("ended")
    assert len(listed) == 500  # 100 parents + 400 children, each exactly once


async def _a_parent_awaiting_its_needy_child(client):
    handle = await client.start(f"{HERE}:lone_needy", "go")
    f = await handle.result(timeout_s=60)
    assert isinstance(f.run_state, AwaitingState)
    assert f.run_state.ticket.target.wait == "delegation"
    (kid,) = await children_of(client.store, f)
    assert isinstance(kid.run_state, AwaitingState)
    return handle, kid


async def _parent_answer(client, handle) -> str:
    async def parent_ended() -> bool:
        return (await client.store.load(handle.thread_id)).ended

    await wait_for(parent_ended, timeout_s=60, what="the child's outcome to resume the parent")
    parent = await client.store.load(handle.thread_id)
    assert parent.run_state.cause.kind == "natural"
    (answer,) = json.loads(parent.messages[-1].text)
    return answer


async def test_cancelling_a_waiting_child_at_rest_answers_its_parent(make_system):
    """A child ended at rest (no drive ends it) still hands its end to the parent that
    awaits it: the parent does not wait for good."""
    client = await make_system()
    handle, kid = await _a_parent_awaiting_its_needy_child(client)
    assert await client.handle(kid.thread_id).cancel() == "cancelled"
    answer = await _parent_answer(client, handle)
    assert answer.startswith("child run ended without an answer") and "cancelled" in answer


async def test_a_child_ended_outside_any_host_still_answers_its_parent(make_system):
    """The hand-over can be lost (the child's host died right after the child's end, or
    a tool ended it outside any host): the Supervisor's sweep finds the parent awaiting
    a child that has ended and hands the outcome over."""
    client = await make_system()
    handle, kid = await _a_parent_awaiting_its_needy_child(client)
    ended = await control_engine(client.store, owner="an-operator").terminate(
        kid.thread_id, Stopped(reason="by hand")
    )
    assert ended.ended
    answer = await _parent_answer(client, handle)
    assert answer.startswith("child run ended without an answer") and "by hand" in answer


async def test_children_at_once_paused_by_a_rate_limit_do_not_end_their_parent(make_system):
    """A pause that names its time (a provider's rate limit) is the system's to end, not a
    person's: two children at once, each paused a second and a half, were taken for
    children waiting for a human, and their parent ended ``indeterminate`` with both
    cancelled. The parent's calls wait them out, as for children that run."""
    client = await make_system()
    handle = await client.start("tests.ray.edge_agents:rate_limited_twins", "go")
    f = await handle.result(timeout_s=120)
    assert f.run_state.cause.kind == "natural", f.run_state
    assert json.loads(f.messages[-1].text) == ["served", "served"]
    for kid in await children_of(client.store, f):
        assert kid.run_state.cause.kind == "natural"
        assert await activations(client.store, kid.thread_id) == 1
        labels = [r.commit.label for r in await client.store.read(kid.thread_id)]
        assert "awaiting" in labels  # it did pause, and was resumed
