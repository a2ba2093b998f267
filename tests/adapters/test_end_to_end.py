"""A Run of an Agent on each real adapter, driven by the in-process runner against the
fake provider: a tool call Step, then an answer Step, ending ``natural``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime import Agent, EndedState, InProcessRunner, ToolResultMessage, answer, tool
from runtime.adapters import AnthropicModel, OpenAICompatible
from runtime.lifecycle import Unpause
from runtime.timeutil import now_us
from runtime.usage import Budget
from storage.memory import MemoryCommitStore

from .conftest import API_KEY
from .fake_provider import (
    Sse,
    Status,
    anthropic_stream,
    data,
    event,
    message_start,
    openai_call_args,
    openai_call_start,
    openai_chunk,
    openai_error,
    openai_stream,
    openai_text,
    text_block,
    tool_use_block,
)


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def run(model) -> tuple[object, ToolResultMessage]:
    agent = Agent(name="adder", model=model, tools=[add], system="You add numbers.")
    frontier = await InProcessRunner(agent, MemoryCommitStore()).start("add 2 and 3", thread_id="t")
    assert isinstance(frontier.run_state, EndedState)
    assert frontier.run_state.cause.kind == "natural"
    (result,) = [m for m in frontier.messages if isinstance(m, ToolResultMessage)]
    assert frontier.messages[-1].text == "It is 5."
    return frontier, result


async def test_a_run_on_openai_compatible_calls_a_tool_then_answers(provider, closing):
    provider.reply(
        openai_stream(
            openai_call_start(0, "call_add_1", "add"),
            openai_call_args(0, '{"a": 2,'),
            openai_call_args(0, ' "b": 3}'),
            finish_reason="tool_calls",
        ),
        openai_text("It is ", "5."),
    )
    model = closing(OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY))
    frontier, result = await run(model)
    assert (result.call_id, result.is_error) == ("call_add_1", False)
    # each Step's usage (31 in, 12 of them cached, 9 out) committed and totalled
    totals = {"input_tokens": 62, "output_tokens": 18, "cached_tokens": 24, "inferences": 2}
    assert frontier.state["run"]["usage"] == totals

    first, second = (r.body for r in provider.received)
    assert first["messages"][0] == {"role": "system", "content": "You add numbers."}
    assert [t["function"]["name"] for t in first["tools"]] == ["add"]
    assistant, tool_message = second["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == "call_add_1"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert tool_message == {"role": "tool", "tool_call_id": "call_add_1", "content": result.content}


async def test_a_run_on_anthropic_calls_a_tool_then_answers(provider, closing):
    provider.reply(
        anthropic_stream(
            tool_use_block(0, "toolu_add_1", "add", '{"a": 2,', ' "b": 3}'), stop_reason="tool_use"
        ),
        anthropic_stream(text_block(0, "It is ", "5.")),
    )
    model = closing(AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY))
    frontier, result = await run(model)
    assert (result.call_id, result.is_error) == ("toolu_add_1", False)
    # 25 fresh + 10 cache reads in, 15 out, each Step; the model id as the provider said
    totals = {"input_tokens": 70, "output_tokens": 30, "cached_tokens": 20, "inferences": 2}
    assert frontier.state["run"]["usage"] == totals
    assert frontier.state["run"]["model"] == "claude-test-2025"

    first, second = (r.body for r in provider.received)
    assert first["system"] == "You add numbers."
    assert [t["name"] for t in first["tools"]] == ["add"]
    assistant, user = second["messages"][-2:]
    assert assistant["content"] == [
        {"type": "tool_use", "id": "toolu_add_1", "name": "add", "input": {"a": 2, "b": 3}}
    ]
    assert user == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_add_1",
                "content": result.content,
                "is_error": False,
            }
        ],
    }


async def test_a_provider_rate_limit_pauses_the_run_until_its_retry_after(provider, closing):
    """429 with ``Retry-After: 30``: more than the Run may wait in memory, so it pauses at
    rest with the time it may go on; the resume asks again and the Run ends."""
    provider.reply(
        Status(429, openai_error("Rate limit reached", "requests"), {"retry-after": "30"}),
        openai_text("It is ", "5."),
    )
    model = closing(OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY))
    agent = Agent(name="adder", model=model, tools=[add], rate_limit_wait_s=5)
    runner = InProcessRunner(agent, MemoryCommitStore())
    before = now_us()
    paused = await runner.start("add 2 and 3", thread_id="t")
    target = paused.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "rate_limit")
    assert before + 30_000_000 <= target.resume_at_us <= now_us() + 30_000_000
    done = await runner.resume(answer(paused.run_state.ticket, Unpause()))
    assert done.run_state.cause.kind == "natural" and done.messages[-1].text == "It is 5."
    assert len(provider.received) == 2


async def test_a_refusal_ends_the_run_with_the_providers_code_and_message(provider, closing):
    provider.reply(
        Status(
            400,
            openai_error("maximum context length exceeded", "invalid", "context_length_exceeded"),
        )
    )
    model = closing(OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY))
    f = await InProcessRunner(
        Agent(name="a", model=model, inference_attempts=3), MemoryCommitStore()
    ).start("hi", thread_id="t")
    cause = f.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "inference", "context_length")
    assert "maximum context length" in cause.message and API_KEY not in cause.message
    assert len(provider.received) == 1  # never asked again


async def test_a_token_budget_pauses_on_the_providers_usage(provider, closing):
    """Each answer uses 40 tokens (the fake's usage chunk): with 60 allowed, the second
    inference would pass the budget, so the Run pauses before it."""
    provider.reply(
        openai_stream(
            openai_call_start(0, "call_1", "add"),
            openai_call_args(0, '{"a": 1, "b": 1}'),
            finish_reason="tool_calls",
        ),
        openai_text("It is 2."),
    )
    model = closing(OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY))
    agent = Agent(name="adder", model=model, tools=[add], budget=Budget(max_tokens=60))
    runner = InProcessRunner(agent, MemoryCommitStore())
    paused = await runner.start("add 1 and 1", thread_id="t")
    assert paused.run_state.ticket.target.reason == "budget"
    assert len(provider.received) == 1
    done = await runner.resume(answer(paused.run_state.ticket, Unpause()))
    assert done.messages[-1].text == "It is 2." and done.state["run"]["usage"]["inferences"] == 2


async def test_a_stream_held_open_by_keepalives_fails_its_attempt_past_the_deadline(
    provider, closing
):
    """Anthropic's ``ping`` events and an OpenAI-compatible server's SSE comments reset
    the SDK's read timeout and never reach the adapter: only the whole attempt's
    deadline (``Agent.inference_timeout_s``) ends such a stream."""
    provider.reply(
        Sse([message_start()], ending="keepalive", gap_s=0.05, keepalive=event("ping", {})),
        Sse([data(openai_chunk({"role": "assistant"}))], ending="keepalive", gap_s=0.05),
    )
    models = (
        AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY, timeout_s=5),
        OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY, timeout_s=5),
    )
    for model in models:
        agent = Agent(name="a", model=closing(model), inference_attempts=1, inference_timeout_s=1)
        f = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
        cause = f.run_state.cause
        assert (cause.kind, cause.failure, cause.code) == ("failed", "inference", "timeout")
        assert "inference_timeout_s" in cause.message


def _model(provider_kind: str, url: str, **options: object):
    if provider_kind == "openai":
        return OpenAICompatible("gpt-test", base_url=f"{url}/v1", api_key=API_KEY, **options)
    return AnthropicModel("claude-test", base_url=url, api_key=API_KEY, **options)


def _opening(provider_kind: str) -> list[bytes]:
    return [message_start()] if provider_kind == "anthropic" else []


async def _one_attempt_ends(closing, provider_kind: str, url: str) -> Any:
    """How a Run of one inference attempt, its events bounded at 1 MiB, ends."""
    model = closing(_model(provider_kind, url, max_event_bytes=1 << 20))
    agent = Agent(name="a", model=model, inference_attempts=1, inference_timeout_s=60)
    f = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
    return f.run_state.cause


@pytest.mark.parametrize("provider_kind", ["openai", "anthropic"])
async def test_an_event_that_never_ends_fails_its_attempt_at_its_bound(
    provider, closing, provider_kind
):
    """The SDKs hold an event's bytes until its blank line: a ``data:`` line that never
    ended grew the process by about 80 MB a second until ``inference_timeout_s`` (600 s
    by default). The body is counted as it is read, inflated (a compressed event of 2
    MiB is 2 KiB on the wire)."""
    endless = Sse([*_opening(provider_kind), b'data: {"x": "'], ending="keepalive",
                  keepalive=b"x" * 65536)  # fmt: skip
    inflated = b'data: {"x": "' + b"x" * (2 << 20) + b'"}\n\n'
    compressed = Sse([*_opening(provider_kind), inflated], gzip=True)
    provider.reply(endless, compressed)
    for _ in range(2):
        cause = await _one_attempt_ends(closing, provider_kind, provider.url)
        assert (cause.kind, cause.failure, cause.code) == (
            "failed",
            "inference",
            "malformed_stream",
        )
        assert f"{provider_kind}: a server-sent event over 1048576 bytes" == cause.message


@pytest.mark.parametrize("provider_kind", ["openai", "anthropic"])
async def test_an_event_the_sdk_holds_is_bounded_as_the_sdk_splits_it(
    provider, closing, provider_kind
):
    """The decoders end an event at LF LF, CR CR or CRLF CRLF only: comment lines
    joined by LF CR were taken for events of their own while the SDK held them all (64
    MiB so sent held a Run's host for minutes). And an event of many short lines costs
    the decoder a copy of the event per line: its lines are bounded too."""
    lf_cr = [b": " + b"x" * 60_000 + b"\n\r"] * 40  # 2.4 MB, one event to the SDK
    short = [b": c\n" * 1_000]  # 4 KB: under the byte bound, 1,000 lines
    provider.reply(Sse([*_opening(provider_kind), *lf_cr]), Sse([*_opening(provider_kind), *short]))
    messages = [
        f"{provider_kind}: a server-sent event over {n}" for n in ("1048576 bytes", "256 lines")
    ]
    for message in messages:
        cause = await _one_attempt_ends(closing, provider_kind, provider.url)
        assert (cause.failure, cause.code, cause.message) == (
            "inference",
            "malformed_stream",
            message,
        )


@pytest.mark.parametrize("provider_kind", ["openai", "anthropic"])
async def test_the_bound_is_on_each_event_not_on_the_stream(provider, closing, provider_kind):
    comments = [b": " + b"x" * 60_000 + b"\r\n\r\n"] * 40  # 2.4 MB in all, CRLF ends
    if provider_kind == "openai":
        answer_frames = openai_text("It is ", "5.").frames
    else:
        answer_frames = anthropic_stream(text_block(0, "It is ", "5.")).frames
    provider.reply(Sse([*comments, *answer_frames]))
    model = closing(_model(provider_kind, provider.url, max_event_bytes=64_000))
    agent = Agent(name="a", model=model, inference_attempts=1)
    f = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
    assert f.run_state.cause.kind == "natural", f.run_state
    assert f.messages[-1].text == "It is 5."


@pytest.mark.parametrize("provider_kind", ["openai", "anthropic"])
async def test_a_character_cut_between_two_chunks_is_one_character_in_the_answer(
    provider, closing, provider_kind
):
    """A gateway may cut an emoji between two chunks, each JSON-escaped alone: each half
    parses as a lone surrogate, which no store can hold, so the joined answer failed
    its attempt, and the Run with it; joined, the halves are the one character again."""
    halves = ("smile \ud83d", "\ude00 ok")
    if provider_kind == "openai":
        provider.reply(openai_text(*halves))
        model = OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY)
    else:
        provider.reply(anthropic_stream(text_block(0, *halves)))
        model = AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY)
    agent = Agent(name="a", model=closing(model), inference_attempts=1)
    frontier = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
    assert frontier.run_state.cause.kind == "natural", frontier.run_state
    assert frontier.messages[-1].text == "smile \U0001f600 ok"


HOSTILE_USAGE = {"prompt_tokens": 2**100, "completion_tokens": -3, "total_tokens": 1}


@pytest.mark.parametrize(
    ("usage", "model_id"),
    [(HOSTILE_USAGE, "gpt-test-2024"), ({"prompt_tokens": 5, "completion_tokens": 2}, "m\ud800")],
    ids=["counts-past-int64-and-negative", "model-id-a-lone-surrogate"],
)
async def test_an_inference_span_says_only_the_usage_the_run_committed(
    provider, closing, usage, model_id
):
    """A provider's usage is checked before it is committed (``admitted_usage``); the
    inference span was given it unchecked: a count past 2**63 or a model id holding a
    lone surrogate cannot be encoded by OTLP, whose exporter then drops the whole batch
    of spans (other Runs' too), and the span said counts the Run never took."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from runtime import tracing

    frames = [
        data(openai_chunk({"role": "assistant", "content": "hi"})),
        data(openai_chunk({}, "stop")),
        data(openai_chunk(usage=usage) | {"model": model_id}),
        data("[DONE]"),
    ]
    provider.reply(Sse(frames))
    exporter = InMemorySpanExporter()
    spans = TracerProvider()
    spans.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(spans)
    try:
        model = closing(
            OpenAICompatible("gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY)
        )
        agent = Agent(name="a", model=model, inference_attempts=1)
        f = await InProcessRunner(agent, MemoryCommitStore()).start("hi", thread_id="t")
    finally:
        tracing.disable()
    assert f.run_state.cause.kind == "natural"
    [span] = [s for s in exporter.get_finished_spans() if s.name == "chat gpt-test"]
    committed = f.state["run"].get("usage")
    said = {k: v for k, v in span.attributes.items() if k.startswith("gen_ai.usage.")}
    if committed is None:  # not believed: not counted, and not said either
        assert said == {}
    else:
        assert said == {
            "gen_ai.usage.input_tokens": committed["input_tokens"],
            "gen_ai.usage.output_tokens": committed["output_tokens"],
        }
        assert span.attributes["gen_ai.response.model"] == f.state["run"]["model"]
    for value in span.attributes.values():
        assert not isinstance(value, int) or -(2**63) <= value < 2**63
        assert not isinstance(value, str) or value.encode("utf-8")
