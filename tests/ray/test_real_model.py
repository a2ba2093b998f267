"""A Run on each real adapter (OpenAI-compatible, Anthropic) across a host kill mid-stream.

The host is killed (SIGKILL) while the model's answer streams; Ray restarts it, the
Run is recovered, and the recovered Step goes on from the stream checkpoint the dead
host left in Redis: the provider is asked again with the partial text as context.
"""

from __future__ import annotations

import os
import signal

import pytest

from storage.checkpoint_key import CheckpointKey
from storage.redis_checkpoints import RedisCheckpointStore
from tests.adapters.fake_provider import (
    FakeProvider,
    Sse,
    anthropic_stream,
    message_start,
    openai_chunk,
    openai_stream,
    openai_text,
    text_block,
)

from .conftest import wait_for
from .model_agents import PROVIDER_ENV

pytestmark = [pytest.mark.ray, pytest.mark.redis]
AGENTS = "tests.ray.model_agents"


@pytest.fixture
async def provider():
    server = FakeProvider()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


PARTS = ("The answer ", "is ", "forty")


def openai_replies() -> tuple[Sse, Sse]:
    first = openai_stream(
        *(openai_chunk({"content": p}) for p in PARTS), finish_reason=None, done=False
    )
    return Sse(first.frames, ending="hang", gap_s=0.4), openai_text("forty-two.")


def anthropic_replies() -> tuple[Sse, Sse]:
    started = [message_start(), *text_block(0, *PARTS)[:-1]]  # no block stop, no message stop
    return Sse(started, ending="hang", gap_s=0.4), anthropic_stream(text_block(0, "forty-two."))


def system_prompt(body: dict) -> str:
    """The system prompt as each provider's request carries it."""
    if "system" in body:
        return str(body["system"])
    return str(body["messages"][0]["content"])


@pytest.mark.parametrize(
    ("agent", "replies"),
    [("openai_agent", openai_replies), ("anthropic_agent", anthropic_replies)],
    ids=["openai", "anthropic"],
)
async def test_a_host_killed_mid_stream_recovers_the_step_from_its_checkpoint(
    make_system, redis_url, provider, monkeypatch, agent, replies
):
    # the first answer streams slowly (a checkpoint is taken every 0.25 s), then stalls
    provider.reply(*replies())
    monkeypatch.setenv(PROVIDER_ENV, provider.url)  # the client builds the agent to check it
    env = {"runtime_env": {"env_vars": {PROVIDER_ENV: provider.url}}}
    client = await make_system(redis_url=redis_url, host_options=(env, env))
    key = CheckpointKey(client.store, client.spec.name)  # the system's, as its hosts read it
    checkpoints = RedisCheckpointStore.connect(redis_url, key=key)
    try:
        handle = await client.start(f"{AGENTS}:{agent}", "what is it?", host=0)

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
    assert system_prompt(provider.received[1].body) == "You answer."
    # the recovered Step was asked to go on from what the dead host had streamed
    assert any("interrupted after" in str(m.get("content")) for m in again)
    assert any("The answer is" in str(m.get("content")) for m in again)
