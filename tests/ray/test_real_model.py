"""A Run on the OpenAI-compatible adapter across a host kill mid-stream.

The host is killed (SIGKILL) while the model's answer streams; Ray restarts it, the
Run is recovered, and the recovered Step goes on from the stream checkpoint the dead
host left in Redis: the provider is asked again with the partial text as context.
"""

from __future__ import annotations

import os
import signal

import pytest

from storage.redis_checkpoints import RedisCheckpointStore
from tests.adapters.fake_provider import FakeProvider, openai_chunk, openai_stream, openai_text

from .conftest import wait_for
from .model_agents import PROVIDER_ENV

pytestmark = [pytest.mark.ray, pytest.mark.redis]
AGENT = "tests.ray.model_agents:openai_agent"


@pytest.fixture
async def provider():
    server = FakeProvider()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_a_host_killed_mid_stream_recovers_the_step_from_its_checkpoint(
    make_system, redis_url, provider, monkeypatch
):
    # the first answer streams slowly (a checkpoint is taken every 0.25 s), then stalls
    first = openai_stream(
        *(openai_chunk({"content": p}) for p in ("The answer ", "is ", "forty")),
        finish_reason=None,
        done=False,
    )
    provider.reply(type(first)(first.frames, ending="hang", gap_s=0.4), openai_text("forty-two."))
    monkeypatch.setenv(PROVIDER_ENV, provider.url)  # the client builds the agent to check it
    env = {"runtime_env": {"env_vars": {PROVIDER_ENV: provider.url}}}
    client = await make_system(redis_url=redis_url, host_options=(env, env))
    checkpoints = RedisCheckpointStore.connect(redis_url)
    try:
        handle = await client.start(AGENT, "what is it?", host=0)

        async def checkpointed() -> bool:
            cp = await checkpoints.get(handle.thread_id)
            return cp is not None and "is" in cp.text

        await wait_for(checkpointed, what="the partial answer to be checkpointed")
        info = await client.hosts[0].info.remote()
        os.kill(info["pid"], signal.SIGKILL)  # mid-stream: the provider still holds it
        done = await handle.result(timeout_s=120)
    finally:
        await checkpoints.close()
    assert done.run_state.cause.kind == "natural"
    assert done.messages[-1].text == "forty-two."
    assert len(provider.received) == 2
    again = provider.received[1].body["messages"]
    assert again[0] == {"role": "system", "content": "You answer."}
    # the recovered Step was asked to go on from what the dead host had streamed
    assert any("interrupted after" in str(m.get("content")) for m in again)
    assert any("The answer is" in str(m.get("content")) for m in again)
