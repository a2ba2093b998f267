"""What of a past call goes back to the provider, and how a reply of the wrong shape is
told: through the real SDKs against the fake provider, asserting on the bodies it got."""

from __future__ import annotations

import json

import pytest

from runtime import Agent, InProcessRunner, ToolResultMessage, UserMessage, tool
from runtime.adapters import AnthropicModel, OpenAICompatible
from runtime.ids import CallId
from runtime.limits import DEFAULT_LIMITS, MAX_JSON_DEPTH, Limits
from runtime.messages import AssistantMessage, ToolUse
from storage.memory import MemoryCommitStore

from .conftest import API_KEY
from .fake_provider import (
    FakeProvider,
    anthropic_stream,
    openai_call_args,
    openai_call_start,
    openai_stream,
    openai_text,
    text_block,
    tool_use_block,
)
from .helpers import collect, request


def nested(depth: int) -> str:
    """Arguments that nest ``depth`` deep: an object holding ``depth - 1`` lists."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def _model(kind: str, provider: FakeProvider) -> AnthropicModel | OpenAICompatible:
    if kind == "openai":
        return OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY)
    return AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY)


def _sent(kind: str, body: dict) -> list[object]:
    """The arguments of every past call in a request body, as the provider reads them."""
    if kind == "openai":
        return [
            json.loads(call["function"]["arguments"])
            for m in body["messages"]
            for call in m.get("tool_calls") or ()
        ]
    return [
        block["input"]
        for m in body["messages"]
        if m["role"] == "assistant"
        for block in m["content"]
        if block["type"] == "tool_use"
    ]


def _answer(kind: str, *text: str):
    return openai_text(*text) if kind == "openai" else anthropic_stream(text_block(0, *text))


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_past_arguments_nested_past_the_depth_limit_go_back_as_an_empty_object(
    provider, closing, kind
):
    """Ratchet refused them (the call was answered with a tool error saying why); sent
    back as the model wrote them, a provider whose parser stops earlier refused every
    later request of the thread: the Run failed over its own model's earlier output.
    Within the limit they go back as they were."""
    limit = DEFAULT_LIMITS.json_depth
    depths = [limit, limit + 1, MAX_JSON_DEPTH + 1, 2_000]
    calls = tuple(
        ToolUse(call_id=CallId(f"c{i}"), tool="add", arguments=nested(d))
        for i, d in enumerate(depths)
    )
    results = tuple(
        ToolResultMessage(call_id=c.call_id, tool="add", content="refused", is_error=True)
        for c in calls
    )
    provider.reply(_answer(kind, "ok"))
    history = (UserMessage(id="u1", text="go"), AssistantMessage(tool_calls=calls), *results)
    await collect(closing(_model(kind, provider)), request(*history))
    sent = _sent(kind, provider.received[0].body)
    assert sent == [json.loads(nested(limit)), {}, {}, {}]
    # a request may say a deeper limit than any Run has: past MAX_JSON_DEPTH is cut still
    provider.reply(_answer(kind, "ok"))
    deeper = request(*history).model_copy(update={"json_depth": 10_000})
    await collect(closing(_model(kind, provider)), deeper)
    assert _sent(kind, provider.received[1].body)[2:] == [{}, {}]


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_call_refused_for_its_depth_under_the_runs_limit_goes_back_empty(
    provider, closing, kind
):
    """The limit is the Run's own (``Limits.json_depth``, here 8): a call nested 10 deep
    is refused with a tool error the model sees, and the next request carries it as
    ``{}``; one within the limit that the tool ran goes back as the model sent it."""
    deep, fine = nested(10), '{"a": 2, "b": 3}'
    if kind == "openai":
        provider.reply(
            openai_stream(
                openai_call_start(0, "call_1", "add"),
                openai_call_args(0, deep),
                openai_call_start(1, "call_2", "add"),
                openai_call_args(1, fine),
                finish_reason="tool_calls",
            )
        )
    else:
        provider.reply(
            anthropic_stream(
                tool_use_block(0, "call_1", "add", deep),
                tool_use_block(1, "call_2", "add", fine),
                stop_reason="tool_use",
            )
        )
    provider.reply(_answer(kind, "done"))
    agent = Agent(name="adder", model=closing(_model(kind, provider)), tools=[add])
    runner = InProcessRunner(agent, MemoryCommitStore(), limits=Limits(json_depth=8))
    frontier = await runner.start("add", thread_id="t")
    assert frontier.run_state.cause.kind == "natural"
    refused, ran = [m for m in frontier.messages if isinstance(m, ToolResultMessage)]
    assert refused.is_error and "json_depth" in refused.content
    assert (ran.is_error, ran.content) == (False, "5")
    assert _sent(kind, provider.received[1].body) == [{}, {"a": 2, "b": 3}]
