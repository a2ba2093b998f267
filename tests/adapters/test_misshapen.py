"""A provider reply whose parts are of the wrong type: the Run's committed failure says
what the provider sent, by its JSON shape, the same in every process (no memory
address, no pydantic URL), through the real SDKs against the fake provider."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

from runtime import Agent, InProcessRunner, ModelUnavailable
from runtime.adapters import AnthropicModel, OpenAICompatible
from runtime.adapters.shapes import unreadable
from storage.memory import MemoryCommitStore

from .conftest import API_KEY
from .fake_provider import (
    FakeProvider,
    Sse,
    event,
    message_end,
    message_start,
    openai_chunk,
    openai_stream,
)
from .helpers import collect, request

UNSTABLE = re.compile(r"0x[0-9a-fA-F]{4,}|https?://|For further information")

OPENAI = [
    ({"tool_calls": "abc"}, "tool_calls is a string, not a list"),
    ({"tool_calls": {"index": 0, "id": "x"}}, "tool_calls is an object, not a list"),
    ({"tool_calls": ["x"]}, "a tool call fragment is a string, not an object"),
    (
        {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "a", "arguments": 3}}]},
        "a tool call's function.arguments is an integer, not a string",
    ),
    ({"tool_calls": [{"index": [1], "id": "c"}]}, "a tool call fragment's index is a list, not"),
    ({"content": ["a"]}, "content is a list, not a string"),
    ({"refusal": 7}, "refusal is an integer, not a string"),
]


def _openai(provider: FakeProvider) -> OpenAICompatible:
    return OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY)


@pytest.mark.parametrize(
    ("delta", "said"),
    OPENAI,
    ids=["calls-str", "calls-object", "fragment-str", "arguments", "index", "content", "refusal"],
)
async def test_an_openai_chunk_of_the_wrong_shape_is_said_by_its_shape(
    provider, closing, delta, said
):
    """``tool_calls`` as a string was read a character at a time, and its failure quoted
    ``str.index``'s repr, memory address and all; a number where text goes, pydantic's
    error with its URL and the value quoted."""
    messages = []
    for _ in range(2):  # the same bytes, the same words
        provider.reply(openai_stream(openai_chunk(delta), finish_reason="tool_calls"))
        with pytest.raises(ModelUnavailable) as caught:
            await collect(closing(_openai(provider)), request())
        assert caught.value.code == "malformed_stream"
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert said in messages[0] and not UNSTABLE.search(messages[0]), messages[0]


def _block_start(block: object, index: object = 0) -> bytes:
    start = {"type": "content_block_start", "index": index, "content_block": block}
    return event("content_block_start", start)


def _block_delta(delta: object, index: object = 0) -> bytes:
    payload = {"type": "content_block_delta", "index": index, "delta": delta}
    return event("content_block_delta", payload)


ANTHROPIC = [
    (_block_start("x"), "a content block is a string, not an object"),
    (
        _block_start({"type": "tool_use", "id": 5, "name": "add", "input": {}}),
        "a tool_use block's id is an integer, not a string",
    ),
    (_block_start({"type": "text", "text": ["a"]}), "a text block's text is a list, not a string"),
    (_block_delta({"type": "text_delta", "text": 5}), "a text delta is an integer, not a string"),
    (_block_delta({"type": "text_delta", "text": "a"}, [0]), "a block's index is a list, not"),
    (
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": []}}),
        "a stop reason is a list, not a string",
    ),
]


@pytest.mark.parametrize(
    ("frame", "said"),
    ANTHROPIC,
    ids=["block", "tool-use-id", "block-text", "delta-text", "delta-index", "stop-reason"],
)
async def test_an_anthropic_event_of_the_wrong_shape_is_said_by_its_shape(
    provider, closing, frame, said
):
    provider.reply(Sse([message_start(), frame, *message_end()]))
    model = closing(AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(model, request())
    message = str(caught.value)
    assert caught.value.code == "malformed_stream"
    assert said in message and not UNSTABLE.search(message), message


async def test_the_committed_failure_of_a_misshapen_reply_says_its_shape(provider, closing):
    """After the last attempt the words are the Run's end, stored for good."""
    provider.reply(openai_stream(openai_chunk({"tool_calls": "abc"}), finish_reason="tool_calls"))
    agent = Agent(name="a", model=closing(_openai(provider)), inference_attempts=1)
    frontier = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
    cause = frontier.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "inference", "malformed_stream")
    assert cause.message == "openai: unreadable chunk: tool_calls is a string, not a list"


class _Text(BaseModel):
    text: str


def test_what_else_a_fold_fails_on_is_said_without_addresses_or_urls():
    with pytest.raises(ValueError) as validation:
        _Text.model_validate({"text": 5})
    assert unreadable(validation.value) == "text: Input should be a valid string"
    odd = AttributeError(f"{object()!r} has no attribute 'index'")
    assert unreadable(odd) == "<object object> has no attribute 'index'"
