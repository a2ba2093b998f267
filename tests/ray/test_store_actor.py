"""The store actor funnels SQLite writes when asked to; when it dies, Runs pause and go on."""

from __future__ import annotations

import pytest
import ray

from actors.store_actor import store_actor
from cluster.demo_agent import NEVER_REPLAY_TOOLS

from .checks import check_log, never_twice
from .conftest import wait_for

pytestmark = pytest.mark.ray


async def test_runs_survive_a_store_actor_restart(make_system, ledger):
    client = await make_system(sqlite_writer="actor")
    handles = [await client.start("cluster.demo_agent:agent", f"order {i}") for i in range(8)]

    async def midway() -> bool:
        versions = [r.version for r in await client.runs()]
        return sum(v >= 3 for v in versions) >= 4

    await wait_for(midway, what="runs past their first executing commit")
    ray.kill(store_actor(client.spec), no_restart=False)  # StoreUnavailable → backoff → retry
    summaries = await client.wait_all(handles, timeout_s=90)
    assert {s.cause for s in summaries} == {"natural"}
    for h in handles:
        report = await check_log(client.store, h.thread_id)
        assert report.lost == 0  # a store outage pauses Runs; it loses no execution
    never_twice(ledger, [h.run_id for h in handles], NEVER_REPLAY_TOOLS)


async def test_the_store_actor_reads_a_page(make_system):
    """``read``'s ``limit`` reaches the store behind the actor (a page, not the log)."""
    client = await make_system(sqlite_writer="actor")
    assert type(client.store).__name__ == "RemoteCommitStore"
    handle = await client.start("cluster.demo_agent:agent", "order 1")
    await client.wait_all([handle], timeout_s=90)
    whole = await client.store.read(handle.thread_id)
    assert len(whole) >= 3
    assert await client.store.read(handle.thread_id, 1, 2) == whole[1:3]
    with pytest.raises(ValueError, match="limit"):
        await client.store.read(handle.thread_id, 0, 0)
