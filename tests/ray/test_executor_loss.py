"""A ToolExecutor dies mid-call: the pinned policy decides what its calls become."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from ray.exceptions import RayActorError

from actors.tool_executor import ExecutorPools
from runtime.messages import ToolResultMessage

from .checks import check_log
from .conftest import stopped, wait_for

pytestmark = pytest.mark.ray


async def both_inside(client, ledger) -> tuple[Any, str, set[int]]:
    """A blocking_agent Run with both of its calls inside an executor: its handle, the
    prefix of its ledger rows, and the pids of the executors that run them."""
    handle = await client.start("tests.ray.agents:blocking_agent", "go")
    prefix = f"tool-batch:{handle.run_id}:"

    async def both_started() -> bool:
        return len(ledger.rows(prefix)) >= 2

    await wait_for(both_started, what="both calls inside the executor")
    return handle, prefix, {row[3] for row in ledger.rows(prefix)}


async def test_executor_killed_mid_call(make_system, ledger):
    client = await make_system()
    handle, prefix, pids = await both_inside(client, ledger)
    assert len(pids) == 1, "one wave is one executor round trip"
    os.kill(pids.pop(), signal.SIGKILL)

    frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"  # the Run went on
    report = await check_log(client.store, handle.thread_id)
    by_tool = {c.tool: c for c in report.calls.values()}

    charge = by_tool["slow_charge"]  # never_replay: indeterminate, never re-run
    assert charge.phase.kind == "indeterminate"
    assert "executor lost" in charge.phase.reason
    fetch = by_tool["slow_fetch"]  # replay_safe: re-run with the same operation id
    assert fetch.phase.kind == "completed" and fetch.attempts == 2
    rows = ledger.rows(prefix)
    assert [(r[2]) for r in rows if r[1] == "slow_charge"] == [1]
    assert sorted((r[0], r[2]) for r in rows if r[1] == "slow_fetch") == [
        (fetch.operation_id, 1),
        (fetch.operation_id, 2),
    ]
    results = {m.call_id: m for m in frontier.messages if isinstance(m, ToolResultMessage)}
    assert results["c1"].is_error and "outcome unknown" in results["c1"].content
    assert not results["c2"].is_error and "attempt 2" in results["c2"].content


async def test_the_next_attempt_waits_for_a_pool_of_one_to_come_back(make_system, ledger):
    """A pool of one executor (a resource pool always is): its death mid-call is one lost
    attempt. Ray refuses calls to the restarting executor at once, and the replay-safe
    call's next attempts, sent straight away, were lost the same way: one death spent
    every attempt and the tool never ran again."""
    client = await make_system(executors=1)
    handle, prefix, (pid,) = await both_inside(client, ledger)
    os.kill(pid, signal.SIGKILL)
    frontier = await handle.result(timeout_s=120)
    report = await check_log(client.store, handle.thread_id)
    by_tool = {c.tool: c for c in report.calls.values()}
    assert by_tool["slow_charge"].phase.kind == "indeterminate"  # never_replay
    fetch = by_tool["slow_fetch"]
    assert fetch.phase.kind == "completed" and fetch.attempts == 2, fetch
    assert [r[2] for r in ledger.rows(prefix) if r[1] == "slow_fetch"] == [1, 2]
    assert frontier.run_state.cause.kind == "natural"


async def test_a_hung_executor_is_restarted_and_its_calls_settled_as_lost(make_system, ledger):
    """SIGSTOP the executor mid-call: Ray takes a stopped process for alive and the
    tools have no timeout, so the Run would wait for ever. The host pings the executor
    while its call is out; it misses its pings, is killed for Ray to restart, and its
    calls become what their policies say, as if it had died."""
    client = await make_system(lease_ttl_s=1.0, heartbeat_s=0.25)
    handle, _, (pid,) = await both_inside(client, ledger)
    with stopped(pid):
        frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    report = await check_log(client.store, handle.thread_id)
    by_tool = {c.tool: c for c in report.calls.values()}
    assert by_tool["slow_charge"].phase.kind == "indeterminate"  # never_replay
    assert by_tool["slow_fetch"].phase.kind == "completed" and by_tool["slow_fetch"].attempts == 2
    restarted = [(await h.info.remote())["executors_restarted"] for h in client.hosts]
    assert sum(restarted) >= 1, restarted


async def test_an_executor_busy_with_a_long_tool_answers_and_is_left_alone(make_system, ledger):
    """A tool that naps for several leases keeps its executor's loop free: the pings are
    answered, and nothing is restarted (only a hung executor is)."""
    client = await make_system(lease_ttl_s=0.5, heartbeat_s=0.25)
    frontier = await client.run("tests.ray.agents:napping_agent", "nap", timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    (row,) = ledger.rows(f"tool-batch:{frontier.run_id}:")
    assert row[2] == 1  # one attempt: the nap was never lost
    restarted = [(await h.info.remote())["executors_restarted"] for h in client.hosts]
    assert restarted == [0] * len(restarted)


async def test_an_executor_hung_before_it_ever_answered_is_restarted(make_system, ledger):
    """An executor stopped before any host heard it answer (hung while idle, say) was
    taken for one Ray still starts, and held every call routed to it for ever. Ray says
    it is alive (created, not pending or restarting): after a lease without an answer it
    is pinged like any other, and killed for Ray to restart when it misses."""
    client = await make_system(executors=1, lease_ttl_s=1.0, heartbeat_s=0.25)
    (executor,) = ExecutorPools(client.spec).pool({})  # the very actor the hosts will use
    pid = (await executor.where.remote())["pid"]
    with stopped(pid):
        handle = await client.start("tests.ray.agents:quick_agent", "hi")
        frontier = await handle.result(timeout_s=45)
    assert frontier.run_state.cause.kind == "natural"
    report = await check_log(client.store, handle.thread_id)
    (echo,) = report.calls.values()
    assert echo.phase.kind == "indeterminate"  # never_replay, its executor lost
    restarted = [(await h.info.remote())["executors_restarted"] for h in client.hosts]
    assert sum(restarted) == 1, restarted

    async def another_process() -> bool:
        try:
            return (await executor.where.remote())["pid"] != pid
        except RayActorError:  # still restarting
            return False

    await wait_for(another_process, what="the executor restarted in a new process")
