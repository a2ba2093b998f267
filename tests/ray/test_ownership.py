"""Ownership: every claim bumps the epoch, and a zombie owner cannot commit."""

from __future__ import annotations

import pytest
import ray

from actors.ownership import mark_lost
from actors.wire import unwrap
from runtime.commit import ThreadCommit
from runtime.errors import Fenced, VersionConflict
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import RunningState
from runtime.messages import UserMessage

from .checks import check_log
from .conftest import wait_for

pytestmark = pytest.mark.ray


def _activation(thread: str, epoch: int) -> ThreadCommit:
    run = RunId("run-z")
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=run,
        ordinal=0,
        label="activation",
        disposition=RunningState(run_id=run),
        messages=(UserMessage(id="m", text="hi"),),
        epoch=epoch,
    )


async def test_a_stale_epoch_is_fenced_through_the_store_actor(make_system):
    client = await make_system(sqlite_writer="actor")
    store = client.store
    thread = ThreadId("zombie-thread")
    old = (await store.claim(thread, "old-owner", 0)).epoch
    new = (await store.claim(thread, "new-owner", old)).epoch
    assert new == old + 1
    with pytest.raises(Fenced):  # a claim naming an epoch the thread has moved past
        await store.claim(thread, "late-owner", old)
    with pytest.raises(Fenced) as caught:
        await store.append(_activation(thread, old), 0, old)
    assert (caught.value.epoch, caught.value.current) == (old, new)
    with pytest.raises(VersionConflict):
        await store.append(_activation(thread, new), 5, new)
    receipt = await store.append(_activation(thread, new), 0, new)
    assert receipt.seq == 1


async def _napping_on_host0(client, ledger):
    """A Run on host 0 that is inside its first (3 s) tool call."""
    handle = await client.start("tests.ray.agents:napping_agent", "nap", host=0)
    prefix = f"tool-batch:{handle.run_id}:"

    async def napping() -> bool:
        return len(ledger.rows(prefix)) >= 1

    await wait_for(napping, what="the first nap")
    return handle


async def test_a_zombie_host_is_fenced_when_another_takes_its_run(make_system, ledger):
    client = await make_system()
    handle = await _napping_on_host0(client, ledger)
    # host 1 takes the Run over while host 0 (alive, now a zombie) is still in its tool
    assert unwrap(await client.hosts[1].recover_run.remote(handle.thread_id))

    async def zombie_gone() -> bool:
        return handle.thread_id not in await client.hosts[0].driving.remote()

    frontier = await handle.result(timeout_s=60)
    await wait_for(zombie_gone, what="host 0 to drop the fenced Run")
    assert frontier.run_state.cause.kind == "natural"
    assert frontier.owner.startswith(client.spec.host_name(1))
    report = await check_log(client.store, handle.thread_id)
    (nap,) = report.calls.values()
    assert nap.phase.kind == "completed" and nap.attempts == 2  # host 1's replay, not host 0's
    assert report.statuses[-1] == ("idle", "natural")
    info = await client.hosts[0].info.remote()
    assert info["driving"] == 0
    assert ray.get_actor(client.spec.host_name(0), namespace="ratchet") is not None


async def test_a_host_taken_for_lost_recovers_its_own_run_at_once(make_system, ledger):
    """The Supervisor settled a Run of a host that was only slow, and re-placed it on that
    same host: the host drops its fenced drive (stuck in a tool call) and recovers now."""
    client = await make_system()
    handle = await _napping_on_host0(client, ledger)
    lost = (await handle.frontier()).owner
    assert await mark_lost(client.store, handle.thread_id, "supervisor", lost_owner=lost)
    assert unwrap(await client.hosts[0].recover_run.remote(handle.thread_id))
    info = await client.hosts[0].info.remote()
    assert (info["recovered"], info["driving"]) == (1, 1)  # the stale drive is gone already
    frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    assert frontier.owner.startswith(client.spec.host_name(0))
    report = await check_log(client.store, handle.thread_id)
    (nap,) = report.calls.values()
    assert nap.phase.kind == "completed" and nap.attempts == 2
    assert report.statuses[-1] == ("idle", "natural") and report.lost == 1


async def test_a_fenced_drive_stops_and_its_wave_is_cancelled_on_the_executor(make_system, ledger):
    """Host 1 takes over a Run whose tool host 0 is waiting on: host 0's reconciliation
    sees the thread claimed past its drive and stops it now — its wave is cancelled
    where it runs — rather than at its next commit, a minute later."""
    client = await make_system(reconcile_s=0.3)
    handle = await client.start("tests.ray.agents:long_napping_agent", "nap", host=0)
    prefix = f"tool-batch:{handle.run_id}:"

    def notes() -> list[tuple[int, str]]:
        return [(attempt, note) for _, _, attempt, _, note in ledger.rows(prefix)]

    async def napping() -> bool:
        return (1, "started") in notes()

    await wait_for(napping, what="the first attempt's nap")
    assert unwrap(await client.hosts[1].recover_run.remote(handle.thread_id))

    async def cancelled_on_its_executor() -> bool:
        return (1, "cancelled") in notes()

    await wait_for(cancelled_on_its_executor, timeout_s=30, what="host 0's wave cancelled")
    frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    assert frontier.owner.startswith(client.spec.host_name(1))
    assert handle.thread_id not in await client.hosts[0].driving.remote()
    (nap,) = (await check_log(client.store, handle.thread_id)).calls.values()
    assert nap.phase.kind == "completed" and nap.attempts == 2  # host 1's replay
