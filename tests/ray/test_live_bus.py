"""With Redis configured, hosts publish facts and deltas live on Redis Streams."""

from __future__ import annotations

import asyncio

import pytest

from runtime.events import Delta, Fact
from storage.bus import RedisStreamBus

pytestmark = [pytest.mark.ray, pytest.mark.redis]


async def test_hosts_publish_committed_facts_and_live_deltas(make_system, redis_url):
    client = await make_system(redis_url=redis_url)
    handle = await client.start("tests.ray.agents:quick_agent", "hi")
    await handle.result(timeout_s=30)
    bus = RedisStreamBus.connect(redis_url, block_ms=200)
    seen: list[Fact | Delta] = []

    async def read_until_finished() -> None:
        async for item in bus.subscribe(handle.thread_id, after="0-0"):
            seen.append(item.event)
            if isinstance(item.event, Fact) and item.event.type == "run_finished":
                return

    try:
        await asyncio.wait_for(read_until_finished(), 20)
    finally:
        await bus.close()
    facts = [e for e in seen if isinstance(e, Fact)]
    stored = await handle.events()
    committed = [(f.type, f.seq, f.index) for f in stored]
    live = [(f.type, f.seq, f.index) for f in facts]
    assert live == committed  # the bus carries exactly the committed facts, stamped
    assert any(isinstance(e, Delta) and e.type == "text_delta" for e in seen)
