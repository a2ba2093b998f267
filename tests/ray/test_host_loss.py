"""A RunHost dies mid-Run; every Run still finishes and the log stays honest.

Fast path: Ray restarts the host, which settles its lost Runs
failed/execution_lost and recovers them. Slow path: a host that does not come
back is noticed by the Supervisor (Ray reports it dead), which does the same and
re-places the Runs on a live host.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from actors.wire import host_index
from cluster.demo_agent import NEVER_REPLAY_TOOLS

from .checks import check_log, never_twice, went_through_loss
from .conftest import actor_gone, stopped, wait_for

pytestmark = pytest.mark.ray
AGENT = "cluster.demo_agent:agent"
RUNS = 6


async def _some_call_executing(client, handles) -> bool:
    for h in handles:
        batch = (await h.frontier()).batch
        if batch is not None and any(c.phase.kind == "executing" for c in batch.calls):
            return True
    return False


async def _start_on_host0(client, faults=None):
    return [
        await client.start(AGENT, f"order {i}", host=0, faults=faults if i == 0 else None)
        for i in range(RUNS)
    ]


async def _check_all(client, handles, ledger):
    summaries = await client.wait_all(handles, timeout_s=90)
    assert {s.cause for s in summaries} == {"natural"}
    reports = [await check_log(client.store, h.thread_id) for h in handles]
    never_twice(ledger, [h.run_id for h in handles], NEVER_REPLAY_TOOLS)
    lost = [r for r in reports if r.lost]
    assert lost, "the kill should have interrupted at least one Run"
    for report in lost:
        assert went_through_loss(report), report.statuses
    for report in reports:
        assert report.statuses[-1] == ("idle", "natural")
    return reports


async def test_ray_kill_of_a_host_mid_run(make_system, ledger):
    client = await make_system()
    handles = await _start_on_host0(client)
    await wait_for(lambda: _some_call_executing(client, handles), what="a call executing")
    ray.kill(client.hosts[0], no_restart=False)
    await _check_all(client, handles, ledger)


@pytest.mark.parametrize(
    ("point", "occurrence"), [("after:inference", 2), ("before:results", 1), ("after:inference", 1)]
)
async def test_host_process_exits_at_a_commit_point(make_system, ledger, point, occurrence):
    client = await make_system()
    handles = await _start_on_host0(client, faults=(point, occurrence, "exit"))
    reports = await _check_all(client, handles, ledger)
    crashed = reports[0]
    assert crashed.lost == 1
    if point == "before:results":  # both first-wave calls ran; only the replay_safe one re-ran
        by_tool = {c.tool: c for c in crashed.calls.values() if c.operation_id.endswith(":c1")}
        assert by_tool["lookup_order"].attempts == 2
        assert [c.tool for c in crashed.indeterminate] == ["reserve_stock"]


async def test_supervisor_replaces_runs_of_a_host_that_stays_dead(make_system, ledger):
    client = await make_system(host_max_restarts=0, lease_ttl_s=2.0, heartbeat_s=0.25)
    handles = await _start_on_host0(client)
    await wait_for(lambda: _some_call_executing(client, handles), what="a call executing")
    ray.kill(client.hosts[0], no_restart=True)
    await wait_for(lambda: _dead(client.hosts[0]), what="host 0 to be dead")
    # what the kill interrupted: a Run already at rest keeps host 0 as its last owner
    interrupted = [h for h in handles if (await h.frontier()).status.state != "idle"]
    assert interrupted, "the kill should have interrupted at least one Run"
    await _check_all(client, handles, ledger)
    report = await client.supervisor_report()
    assert report["counts"].get("hosts_lost", 0) >= 1
    # on a host that is alive, even when the kill came before any lease was heard
    for h in interrupted:
        owner = (await h.frontier()).owner or ""
        assert not owner.startswith(client.spec.host_name(0)), (owner, report)


async def _dead(host) -> bool:
    try:
        await host.ping.remote()
    except ray.exceptions.RayActorError:
        return True
    return False


@pytest.mark.timeout(180)
async def test_a_dedicated_run_whose_host_hangs_ends_on_a_new_one(make_system, ledger):
    """SIGSTOP the Run's dedicated host (Ray takes a stopped process for alive): its
    lease runs out and the Supervisor marks the Run lost, but the only host it can go
    to is that one, which never answers. The Supervisor ends it, and the next sweep
    starts the Run a new dedicated host, where it ends (it stayed running for ever)."""
    client = await make_system(hosts=1, reconcile_s=0.5, heartbeat_s=0.25, lease_ttl_s=2.0)
    thread = "hung-dedicated"
    handle = await client.start(
        "tests.ray.agents:napping_agent", "go", thread_id=thread, placement="dedicated"
    )
    first = ray.get_actor(client.spec.dedicated_name(thread), namespace="ratchet")
    pid = (await first.info.remote())["pid"]
    await wait_for(lambda: _some_call_executing(client, [handle]), what="the nap to start")
    with stopped(pid):
        frontier = await handle.result(timeout_s=120)
    assert frontier.run_state.kind == "ended" and frontier.run_state.cause.kind == "natural"
    assert not frontier.owner.endswith(f"#{pid}")  # ended by another process
    await check_log(client.store, thread)


@pytest.mark.timeout(180)
async def test_a_start_sent_to_a_hung_pool_host_runs_once_the_supervisor_restarts_it(
    make_system, ledger
):
    """SIGSTOP pool host 0, then start a Run there: Ray takes the stopped process for
    alive, so the start would wait for ever. Its lease runs out, it stays silent, and
    the Supervisor kills it; Ray restarts it and the client's start, asked again of the
    new process, runs the Run to its end."""
    client = await make_system(hosts=2, reconcile_s=0.5, heartbeat_s=0.25, lease_ttl_s=2.0)
    pid = (await client.hosts[0].info.remote())["pid"]
    with stopped(pid):
        frontier = await client.run("tests.ray.agents:quick_agent", "hello", host=0, timeout_s=120)
    assert frontier.run_state.kind == "ended" and frontier.run_state.cause.kind == "natural"
    assert not frontier.owner.endswith(f"#{pid}")  # driven by the new process
    report = await client.supervisor_report()
    assert report["counts"].get("hosts_restarted", 0) >= 1, report
    assert (await client.hosts[0].info.remote())["pid"] != pid
    await check_log(client.store, frontier.thread_id)


async def test_a_dedicated_host_restarted_after_its_run_ended_retires(make_system):
    """The dedicated host dies just after its Run's end landed, before it was ended: Ray
    restarts it, and the new process found nothing to drive, so nothing told it to
    retire. It lived on idle for good (a Ray process per such crash); now it asks to
    retire once its first reconciliation is done."""
    client = await make_system(heartbeat_s=0.25)
    thread = "dedicated-dies-at-its-end"
    handle = await client.start(
        "tests.ray.agents:quick_agent",
        "hi",
        thread_id=thread,
        placement="dedicated",
        faults=("after:ended", 1, "exit"),  # once the Run's end landed
    )
    name = client.spec.dedicated_name(thread)
    actor_id = ray.get_actor(name, namespace="ratchet")._actor_id.hex()
    frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    await wait_for(actor_gone(name), timeout_s=30, what="the restarted host to retire")
    assert ray._private.state.actors(actor_id)["NumRestarts"] == 1  # it did exit


async def test_a_pool_host_dead_for_good_is_made_again_for_the_next_call(make_system):
    """``host_max_restarts=0``: a pool host that dies stays dead, and the client kept its
    handle, so every start, cancel or stop of a thread that hashes to it was asked of
    the dead actor for 60 s and failed ``ClusterUnavailable``, for good. The client
    makes the pool host again under its name (as ``connect`` and a parent's child
    runner do) and asks the new one."""
    client = await make_system(host_max_restarts=0)
    thread = next(t for t in (f"dead-pool-{i}" for i in range(64)) if host_index(t, 2) == 0)
    for ask in ("run", "cancel"):
        dead = client.hosts[0]
        ray.kill(dead, no_restart=True)
        await wait_for(lambda: _dead(dead), what="host 0 to be dead")  # noqa: B023
        if ask == "run":
            frontier = await asyncio.wait_for(
                client.run("tests.ray.agents:quick_agent", "hi", thread_id=thread), 30
            )
            assert frontier.run_state.cause.kind == "natural"
            assert frontier.owner.startswith(client.spec.host_name(0))
        else:  # the Run has ended: nothing to cancel, said by the new host 0
            assert await asyncio.wait_for(client.handle(thread).cancel(), 30) == "not_running"
        assert client.hosts[0] is not dead
