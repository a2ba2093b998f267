"""Dead letters: a Run whose execution is lost 3 times in a row, with no progress between,
ends ``failed(recovery)`` instead of being retried for ever (``actors.ownership``), and
``ratchet runs --failed`` lists it.

The agent's model ends the RunHost process every time it is asked (``os._exit`` inside
the host, where inferences are streamed). Ray restarts the host, which marks the Run
lost and takes it back (its first reconciliation); the model kills it again. The third
loss ends the Run. The store is SQLite, so it outlives every host death.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from typer.testing import CliRunner

from cluster.cli import app
from runtime.lifecycle import EndedState

from .checks import check_log
from .conftest import wait_for
from .race_agents import asks

pytestmark = pytest.mark.ray
KILLER = "tests.ray.race_agents:host_killer"


async def _pid(host) -> int:
    return int((await host.info.remote())["pid"])


@pytest.mark.timeout(180)
async def test_a_run_that_kills_its_host_every_time_is_dead_lettered(make_system):
    client = await make_system(hosts=1, reconcile_s=0.5, heartbeat_s=0.25)
    host = client.hosts[0]
    fine = await client.start("tests.ray.agents:quick_agent", "hi", thread_id="fine-1")
    assert (await fine.result(timeout_s=60)).run_state.cause.kind == "natural"
    first_pid = await _pid(host)

    run_id = f"run-dl-{uuid.uuid4().hex[:8]}"
    handle = await client.start(KILLER, "go", thread_id="dl-1", run_id=run_id, host=0)
    done = await handle.result(timeout_s=150)
    state = done.run_state
    assert isinstance(state, EndedState), state
    cause = state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "recovery", "execution_lost")
    assert "3 times in a row" in cause.message, cause.message
    assert (done.status.state, done.status.reason) == ("failed", "execution_lost")

    # the model was asked exactly three times, each time in a new host process
    pids = asks(run_id)
    assert len(pids) == 3 and len(set(pids)) == 3 and pids[0] == first_pid, pids
    report = await check_log(client.store, "dl-1")
    assert report.statuses == [
        ("running", None),
        ("failed", "execution_lost"),  # loss 1, marked by the restarted host
        ("running", None),  # taken back
        ("failed", "execution_lost"),  # loss 2
        ("running", None),
        ("failed", "execution_lost"),  # loss 3: the dead letter
    ], report.statuses
    assert report.cause == "failed" and report.steps == 0  # never got past an inference

    # the host is back and drives nothing: an ended Run is never taken back again
    async def idle() -> bool:
        try:
            return await host.driving.remote() == [] and await _pid(host) not in pids
        except Exception:  # still restarting
            return False

    await wait_for(idle, timeout_s=60, what="the restarted host, idle")
    assert await client.runs("running") == []

    runner = CliRunner()
    url = client.spec.store_url
    failed = await asyncio.to_thread(runner.invoke, app, ["runs", "--failed", "--store", url])
    assert failed.exit_code == 0, failed.output
    assert "dl-1" in failed.output and "fine-1" not in failed.output, failed.output
    assert "1 runs" in failed.output and "failed" in failed.output, failed.output
    every = await asyncio.to_thread(runner.invoke, app, ["runs", "--store", url])
    assert every.exit_code == 0 and "fine-1" in every.output and "dl-1" in every.output
    assert asks(run_id) == pids  # nothing asked the model again
