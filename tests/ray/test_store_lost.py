"""A Redis store lost under a running cluster: processes that join afterwards fail
closed too, rather than take the empty database for a new store and split the cluster.
"""

from __future__ import annotations

import uuid

import pytest
import ray
import redis.asyncio as aioredis

from actors.store_instance import forget_first_instance
from actors.wire import NAMESPACE
from cluster.client import Ratchet
from runtime.errors import StoreLost
from runtime.lifecycle import EndedState
from tests.support.servers import private_redis

from .conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.redis]

AGENT = "tests.ray.agents:quick_agent"


@pytest.mark.timeout(180)
async def test_a_host_and_a_client_joining_after_the_loss_drive_nothing_on_the_empty_store():
    """Before, a host Ray restarted after a ``FLUSHDB`` (and a client connecting then)
    read the empty database's new token and drove a Run there, while every process
    connected before the loss answered ``StoreLost``."""
    with private_redis() as server:
        name = f"lost-{uuid.uuid4().hex[:6]}"
        client = await Ratchet.connect(store_url=server.url, name=name)
        later: Ratchet | None = None
        redis = aioredis.Redis.from_url(server.url)
        try:
            before = await client.run(AGENT, "before", host=1, timeout_s=60)
            assert isinstance(before.run_state, EndedState)
            old_pid = (await client.hosts[1].info.remote())["pid"]
            await redis.flushdb()
            ray.kill(client.hosts[1], no_restart=False)  # Ray restarts it after the loss

            async def restarted() -> bool:
                try:
                    return (await client.hosts[1].info.remote())["pid"] != old_pid
                except ray.exceptions.RayActorError:
                    return False

            await wait_for(restarted, timeout_s=60, what="host 1 to be restarted")
            with pytest.raises(StoreLost):  # a client connecting now: at connect
                later = await Ratchet.connect(store_url=server.url, name=name)
            with pytest.raises(StoreLost):  # the restarted host
                await client.run(AGENT, "after", thread_id="after-1", host=1, timeout_s=60)
            assert [key async for key in redis.scan_iter(match="*after-1*")] == []
            supervisor = ray.get_actor(client.spec.supervisor_name, namespace=NAMESPACE)

            async def reported() -> bool:
                return bool((await supervisor.report.remote())["store_lost"])

            await wait_for(reported, timeout_s=30, what="the Supervisor to report the loss")
        finally:
            for each in (later, client):
                if each is not None:
                    await each.shutdown()
            await redis.aclose()
            forget_first_instance(server.url)
