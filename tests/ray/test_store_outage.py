"""An actor that starts while its store is down waits for it, and then serves.

Ray never restarts an actor whose constructor raised, whatever its ``max_restarts``
(ray-project/ray#14211): a RunHost restarted after a crash while PostgreSQL was down
used to die for good in its constructor, and every Run of the threads its index
serves was then unreachable (``ClusterUnavailable``).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import pytest
import ray

from actors.store_actor import outlasting_outages
from cluster.client import Ratchet
from runtime.context import StoreRetry
from runtime.errors import StoreError, StoreUnavailable
from runtime.lifecycle import EndedState
from tests.support.servers import private_postgres

from .conftest import wait_for

AGENT = "tests.ray.agents:quick_agent"
FAST = StoreRetry(first_delay_s=0.001, max_delay_s=0.002)


@pytest.mark.timeout(180)
async def test_a_host_restarted_while_postgres_is_down_serves_once_it_is_back():
    with private_postgres() as server:
        client = await Ratchet.connect(store_url=server.url, name=f"outage-{uuid.uuid4().hex[:6]}")
        try:
            before = await client.run(AGENT, "before", host=1, timeout_s=60)
            assert isinstance(before.run_state, EndedState)
            old_pid = (await client.hosts[1].info.remote())["pid"]
            server.stop()
            ray.kill(client.hosts[1], no_restart=False)  # Ray restarts it into the outage
            await wait_for(
                lambda: _said_in_worker_logs(f"RunHost {client.spec.host_name(1)} waits"),
                timeout_s=30,
                what="the restarted host's constructor to meet the outage",
            )
            server.start()
            after = await client.run(AGENT, "after", host=1, timeout_s=120)
            assert isinstance(after.run_state, EndedState)
            assert after.run_state.cause.kind == "natural"
            assert (await client.hosts[1].info.remote())["pid"] != old_pid
        finally:
            await client.shutdown()


@pytest.mark.timeout(300)
async def test_a_start_that_meets_an_outage_names_the_ids_to_ask_again_with():
    """A start whose host's backoff ran out hears StoreUnavailable; a commit of it still
    on its way to a hung server lands when the server goes on (the Run then ran to its
    end, its caller told it had failed). The ids it made were not in the error: the
    caller could neither find that Run nor ask again for it. Now they are, and asked
    again with them the start is the same Run's."""
    with private_postgres() as server:
        client = await Ratchet.connect(store_url=server.url, name=f"outage-{uuid.uuid4().hex[:6]}")
        try:
            for host in (0, 1):  # every host up (one starting now would wait for the store)
                await client.run(AGENT, "before", host=host, timeout_s=60)
            server.stop()
            with pytest.raises(StoreUnavailable, match="may have started") as caught:
                await client.start(AGENT, "during")
            ids = re.search(r"run '([^']+)' on thread '([^']+)'", str(caught.value))
            assert ids is not None, caught.value
            run, thread = ids.groups()
            server.start()
            again = await client.start(AGENT, "during", thread_id=thread, run_id=run)
            done = await again.result(timeout_s=120)
            assert isinstance(done.run_state, EndedState) and done.run_id == run
            activations = [r for r in await client.store.read(again.thread_id) if r.seq == 1]
            assert [r.commit.run_id for r in activations] == [run]
        finally:
            await client.shutdown()


async def _said_in_worker_logs(text: str) -> bool:
    return await asyncio.to_thread(_said, text)


def _said(text: str) -> bool:
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return any(text in path.read_text(errors="replace") for path in logs.glob("worker-*.err"))


async def test_an_unavailable_store_is_waited_for():
    tries = []

    async def opening() -> object:
        tries.append(1)
        if len(tries) < 4:
            raise StoreUnavailable("down")
        return "store"

    assert await outlasting_outages(opening, "a test", FAST) == "store"  # type: ignore[arg-type]
    assert len(tries) == 4


async def test_a_store_that_refuses_is_not_waited_for():
    async def refusing() -> object:
        raise StoreError("wrong credentials")

    with pytest.raises(StoreError, match="wrong credentials"):
        await outlasting_outages(refusing, "a test", FAST)  # type: ignore[arg-type]
