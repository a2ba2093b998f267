"""Stream checkpoints on Ray: a host dies mid-inference; the recovered Step uses the
complete tool call it had streamed instead of asking the model again."""

from __future__ import annotations

import pytest

from runtime.lifecycle import EndedState
from runtime.messages import ToolResultMessage
from tests.ray.checkpoint_agents import asked

pytestmark = [pytest.mark.ray, pytest.mark.redis]


async def test_a_complete_streamed_tool_call_survives_the_host(make_system, redis_url):
    client = await make_system(redis_url=redis_url)
    handle = await client.start("tests.ray.checkpoint_agents:agent", "find a")
    f = await handle.result(timeout_s=60)
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    assert asked(handle.run_id) == ["0", "1"]  # Step 0 was never asked again
    assert f.messages[1].text == "Looking it up. "  # the checkpointed partial text
    (result,) = [m for m in f.messages if isinstance(m, ToolResultMessage)]
    assert result.content == "value of a"
    statuses = [
        (r.commit.status.state, r.commit.status.reason)
        for r in await client.store.read(handle.thread_id)
        if r.commit.status
    ]
    assert ("failed", "execution_lost") in statuses
