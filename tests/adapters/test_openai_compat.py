"""OpenAICompatible over real HTTP, on the real ``openai`` SDK, against the fake server."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import openai
import pytest

from runtime import (
    AssistantMessage,
    ModelDelta,
    ModelError,
    ModelRateLimited,
    ModelRefused,
    ModelUnavailable,
    ToolResultMessage,
    ToolUse,
    UserMessage,
)
from runtime.adapters import OpenAICompatible
from runtime.adapters.openai_compat import PLACEHOLDER_KEY, usage_of
from runtime.adapters.usage import Usage
from runtime.errors import InputRefused
from runtime.ids import CallId
from runtime.inference import admit_response
from runtime.limits import DEFAULT_LIMITS
from runtime.messages import ContextMessage

from .conftest import API_KEY
from .fake_provider import (
    USAGE,
    FakeProvider,
    Sse,
    Stall,
    Status,
    data,
    openai_call_args,
    openai_call_start,
    openai_chunk,
    openai_error,
    openai_stream,
    openai_text,
)
from .helpers import ADD_SCHEMA, collect, free_port, request


@pytest.fixture
def make(provider: FakeProvider, closing):
    """Builds an adapter on the test's server, closed after the test."""

    def build(**options) -> OpenAICompatible:
        model = OpenAICompatible(
            "gpt-test", base_url=f"{provider.url}/v1", api_key=API_KEY, **options
        )
        return closing(model)

    return build


async def test_the_request_maps_system_roles_tool_calls_results_and_schemas(provider, make):
    provider.reply(openai_text("ok"))
    history = (
        UserMessage(id="u1", text="add 2 and 3"),
        AssistantMessage(
            text="adding",
            tool_calls=(ToolUse(call_id=CallId("call_a"), tool="add", arguments='{"a":2,"b":3}'),),
        ),
        ToolResultMessage(call_id=CallId("call_a"), tool="add", content="5"),
        AssistantMessage(
            tool_calls=(ToolUse(call_id=CallId("call_b"), tool="add", arguments="{bad"),)
        ),
        ToolResultMessage(call_id=CallId("call_b"), tool="add", content="bad JSON", is_error=True),
        ContextMessage(text="hook says: be brief"),
    )
    model = make(max_tokens=64, temperature=0.25, extra_body={"top_k": 5})
    await collect(model, request(*history, system="You add numbers."))

    (received,) = provider.received
    assert received.path == "/v1/chat/completions"
    assert received.headers["authorization"] == f"Bearer {API_KEY}"
    body = received.body
    assert (body["model"], body["stream"], body["stream_options"]) == (
        "gpt-test",
        True,
        {"include_usage": True},
    )
    assert (body["max_tokens"], body["temperature"], body["top_k"]) == (64, 0.25, 5)
    assert body["messages"] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": "adding",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_b",
                    "type": "function",
                    # not a JSON object: sent as {} (a server such as vLLM parses it again)
                    "function": {"name": "add", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "error: bad JSON"},
        {"role": "user", "content": "hook says: be brief"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": ADD_SCHEMA["description"],
                "parameters": ADD_SCHEMA["parameters"],
            },
        }
    ]


@pytest.mark.parametrize("tools", [None, ()], ids=["withheld", "none-defined"])
async def test_tools_are_left_out_when_withheld_or_empty(provider, tools, make):
    provider.reply(openai_text("ok"))
    await collect(make(), request(tools=tools))
    body = provider.received[0].body
    assert "tools" not in body
    assert "max_tokens" not in body and "temperature" not in body
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # no empty system message


async def test_text_streams_as_deltas_then_one_response(provider, make):
    provider.reply(openai_text("Hel", "lo ", "there"))
    deltas, response = await collect(make(), request())
    assert [(d.type, d.text) for d in deltas] == [
        ("text_delta", "Hel"),
        ("text_delta", "lo "),
        ("text_delta", "there"),
    ]
    assert response.text == "Hello there" and response.tool_calls == ()


async def test_tool_call_fragments_group_by_call_and_come_back_in_index_order(provider, make):
    provider.reply(
        openai_stream(
            openai_chunk({"content": "Let me add."}),
            openai_call_start(1, "call_second", "add"),
            openai_call_start(0, "call_first", "add"),
            openai_call_args(0, '{"a": 1, '),
            openai_call_args(1, '{"a": 10, "b": 20}'),
            openai_call_args(0, '"b": 2}'),
            finish_reason="tool_calls",
        )
    )
    deltas, response = await collect(make(), request())
    calls = [(d.call_id, d.tool, d.text) for d in deltas if d.type == "tool_call_delta"]
    assert calls == [
        ("call_second", "add", ""),
        ("call_first", "add", ""),
        ("call_first", "add", '{"a": 1, '),
        ("call_second", "add", '{"a": 10, "b": 20}'),
        ("call_first", "add", '"b": 2}'),
    ]
    assert response.text == "Let me add."
    assert response.tool_calls == (
        ToolUse(call_id=CallId("call_first"), tool="add", arguments='{"a": 1, "b": 2}'),
        ToolUse(call_id=CallId("call_second"), tool="add", arguments='{"a": 10, "b": 20}'),
    )


async def test_the_halves_of_a_character_cut_between_fragments_join(provider, make):
    """As the answer's text does (test_end_to_end): a half with no partner stays one,
    which the response's admission refuses, as before."""
    provider.reply(
        openai_stream(
            openai_chunk({"content": "half \ud83d"}),
            openai_call_start(0, "call_1", "add"),
            openai_call_args(0, '{"a": "\ud83d'),
            openai_call_args(0, '\ude00"}'),
            finish_reason="tool_calls",
        )
    )
    _, response = await collect(make(), request())
    assert response.tool_calls[0].arguments == '{"a": "\U0001f600"}'
    with pytest.raises(InputRefused, match="utf8"):
        admit_response(response, DEFAULT_LIMITS)


async def test_reasoning_of_a_compatible_server_streams_as_reasoning_deltas(provider, make):
    provider.reply(
        openai_stream(
            openai_chunk({"reasoning_content": "2+3 is 5"}), openai_chunk({"content": "5"})
        )
    )
    deltas, response = await collect(make(), request())
    assert [(d.type, d.text) for d in deltas] == [
        ("reasoning_delta", "2+3 is 5"),
        ("text_delta", "5"),
    ]
    assert response.text == "5"


def test_usage_is_read_from_the_final_chunk():
    from openai.types.chat import ChatCompletionChunk

    final = ChatCompletionChunk.model_validate(openai_chunk(usage=USAGE))
    assert usage_of(final) == Usage(
        input_tokens=31, output_tokens=9, cached_tokens=12, model="gpt-test-2024"
    )
    assert usage_of(ChatCompletionChunk.model_validate(openai_chunk({"content": "x"}))) is None


@pytest.mark.parametrize(
    "odd",
    [
        {"prompt_tokens": None, "completion_tokens": "n/a", "total_tokens": 1.5},
        {"prompt_tokens": 1e400, "completion_tokens": True, "prompt_tokens_details": None},
    ],
    ids=["null-and-text", "huge-and-bool"],
)
async def test_usage_a_server_reports_oddly_does_not_fail_the_inference(provider, make, odd):
    """The SDK builds stream chunks without validating them: usage is bookkeeping, and a
    count that is not an int is taken as 0, not the inference's failure."""
    frames = [
        data(openai_chunk({"role": "assistant", "content": "hi"})),
        data(openai_chunk({}, "stop")),
        data(openai_chunk(usage=odd) | {"model": None}),
        data("[DONE]"),
    ]
    provider.reply(Sse(frames))
    _, response = await collect(make(), request())
    assert response.text == "hi"
    assert response.usage == Usage(input_tokens=0, output_tokens=0, cached_tokens=0, model="")


# ---- errors ---------------------------------------------------------------------------

ERRORS = [
    pytest.param(
        Status(
            429,
            openai_error("Rate limit reached for requests", "requests", "rate_limit_exceeded"),
            {"retry-after": "7"},
        ),
        ModelRateLimited,
        "rate_limit",
        "Rate limit reached",
        id="429",
    ),
    pytest.param(
        Status(
            429,
            openai_error(
                "You exceeded your current quota", "insufficient_quota", "insufficient_quota"
            ),
        ),
        ModelRefused,
        "insufficient_quota",
        "exceeded your current quota",
        id="429-quota",
    ),
    pytest.param(
        Status(500, openai_error("The server had an error", "server_error")),
        ModelUnavailable,
        "status_500",
        "The server had an error",
        id="500",
    ),
    pytest.param(
        Status(503, {"detail": "upstream down"}),
        ModelUnavailable,
        "status_503",
        "upstream down",
        id="503-foreign-body",
    ),
    pytest.param(
        Status(400, openai_error("Invalid value for 'messages'", "invalid_request_error")),
        ModelRefused,
        "invalid_request",
        "Invalid value for 'messages'",
        id="400",
    ),
    pytest.param(
        Status(
            400,
            openai_error(
                "This model's maximum context length is 8192 tokens",
                "invalid_request_error",
                "context_length_exceeded",
            ),
        ),
        ModelRefused,
        "context_length",
        "maximum context length is 8192",
        id="400-context",
    ),
    pytest.param(
        # a gateway that echoes the key it was sent
        Status(
            401,
            openai_error(
                f"Incorrect API key provided: {API_KEY}", "invalid_request_error", "invalid_api_key"
            ),
        ),
        ModelRefused,
        "auth",
        "Incorrect API key provided",
        id="401",
    ),
    pytest.param(
        Status(
            404,
            openai_error(
                "The model `gpt-nope` does not exist", "invalid_request_error", "model_not_found"
            ),
        ),
        ModelRefused,
        "not_found",
        "does not exist",
        id="404",
    ),
]


@pytest.mark.parametrize(("reply", "kind", "code", "says"), ERRORS)
async def test_an_error_status_becomes_its_typed_error(provider, reply, kind, code, says, make):
    provider.reply(reply)
    with pytest.raises(ModelError) as caught:
        await collect(make(), request())
    error = caught.value
    assert type(error) is kind and error.code == code
    assert error.status == reply.status
    assert says in str(error)
    assert API_KEY not in str(error) and API_KEY not in repr(error.args)
    if kind is ModelRateLimited:
        assert error.retry_after_s == 7.0


async def test_retry_after_as_an_http_date(provider, make):
    when = datetime.now(UTC) + timedelta(seconds=120)
    provider.reply(
        Status(
            429, openai_error("slow down", "requests"), {"retry-after": format_datetime(when, True)}
        )
    )
    with pytest.raises(ModelRateLimited) as caught:
        await collect(make(), request())
    assert caught.value.retry_after_s is not None and 100 < caught.value.retry_after_s <= 120


UNINDEXED = {"index": "x", "id": "c2", "type": "function", "function": {"name": "add"}}
STREAM_FAILURES = [
    pytest.param(
        Sse([data(openai_chunk({"content": "Hel"}))], ending="cut"),
        "stream_cut",
        id="connection-cut",
    ),
    pytest.param(
        openai_stream(openai_chunk({"content": "Hel"}), finish_reason=None, done=False),
        "stream_cut",
        id="ended-without-finish",
    ),
    pytest.param(
        Sse([data(openai_chunk({"content": "Hel"})), b"data: {not json\n\n"]),
        "malformed_stream",
        id="not-json",
    ),
    pytest.param(
        Sse([data(openai_chunk({"content": "Hel"})), data({"choices": 7})]),
        "malformed_stream",
        id="not-a-chunk",
    ),
    pytest.param(
        Sse([data(openai_chunk({"content": "Hel"})), b'data: {"choices": "\xff"}\n\n']),
        "malformed_stream",
        id="not-utf8",
    ),
    pytest.param(
        Sse(
            [
                data(openai_chunk({"content": "Hel"})),
                b'data: {"choices": [], "usage": {"prompt_tokens": ' + b"7" * 5000 + b"}}\n\n",
            ]
        ),
        "malformed_stream",
        id="usage-of-5000-digits",
    ),
    pytest.param(
        Sse(
            [
                data(openai_chunk({"content": "Hel"})),
                data(openai_error("overloaded", "server_error")),
            ]
        ),
        "server_error",
        id="error-event",
    ),
    pytest.param(
        Sse(
            [
                data(openai_chunk({"content": "Hel"})),
                data(openai_chunk({"tool_calls": [{**UNINDEXED}]})),
            ]
        ),
        "malformed_stream",
        id="unindexed-call",
    ),
]


@pytest.mark.parametrize(("reply", "code"), STREAM_FAILURES)
async def test_a_broken_stream_is_transient(provider, reply, code, make):
    provider.reply(reply)
    seen: list[ModelDelta] = []
    with pytest.raises(ModelUnavailable) as caught:
        async for item in make().stream(request()):
            seen.append(item)  # type: ignore[arg-type]
    assert type(caught.value) is ModelUnavailable and caught.value.code == code
    assert [d.text for d in seen] == ["Hel"]  # the deltas before the break were streamed
    assert API_KEY not in str(caught.value)
    assert "set_int_max_str_digits" not in str(caught.value)  # advice to this process


async def test_a_mid_stream_rate_limit_event_is_rate_limited(provider, make):
    event = openai_error("Rate limit reached", "requests", "rate_limit_exceeded")
    provider.reply(Sse([data(openai_chunk({"content": "x"})), data(event)]))
    with pytest.raises(ModelRateLimited) as caught:
        await collect(make(), request())
    assert caught.value.code == "rate_limit" and "Rate limit reached" in str(caught.value)


async def test_a_server_that_never_answers_times_out(provider, make):
    provider.reply(Stall())
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(timeout_s=0.3), request())
    assert caught.value.code == "timeout"


async def test_a_server_that_is_not_there_is_a_connection_error(closing):
    url = f"http://127.0.0.1:{free_port()}/v1"
    model = closing(OpenAICompatible("gpt-test", base_url=url, api_key=API_KEY))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(model, request())
    assert caught.value.code == "connection" and API_KEY not in str(caught.value)


async def test_the_sdk_does_not_retry_on_its_own(provider):
    provider.reply(Status(500, openai_error("boom", "server_error")), openai_text("late"))
    client = openai.AsyncOpenAI(base_url=f"{provider.url}/v1", api_key=API_KEY, max_retries=5)
    try:
        with pytest.raises(ModelUnavailable):
            await collect(OpenAICompatible("gpt-test", client=client), request())
    finally:
        await client.close()
    assert len(provider.received) == 1  # Ratchet's engine decides whether to ask again
    assert client.max_retries == 5  # the caller's client is left as it was


# ---- configuration --------------------------------------------------------------------


async def test_base_url_and_key_come_from_the_environment(provider, monkeypatch, closing):
    monkeypatch.setenv("OPENAI_BASE_URL", f"{provider.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env-0000000000")
    provider.reply(openai_text("ok"))
    await collect(closing(OpenAICompatible("gpt-test")), request())
    assert provider.received[0].headers["authorization"] == "Bearer sk-from-env-0000000000"


async def test_a_gateway_without_a_key_gets_a_placeholder(provider, monkeypatch, closing):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    provider.reply(openai_text("ok"))
    await collect(closing(OpenAICompatible("llama", base_url=f"{provider.url}/v1")), request())
    assert provider.received[0].headers["authorization"] == f"Bearer {PLACEHOLDER_KEY}"


def test_no_key_and_no_gateway_is_refused_at_construction(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="api_key"):
        OpenAICompatible("gpt-test")


async def test_the_repr_shows_no_key(make):
    shown = repr(make())
    assert "gpt-test" in shown and API_KEY not in shown


def test_chunk_json_of_the_fake_server_is_what_the_sdk_parses():
    # guards the fake server itself: its chunks validate as the SDK's own type
    from openai.types.chat import ChatCompletionChunk

    for chunk in (openai_call_start(0, "c", "add"), openai_chunk({}, "stop")):
        ChatCompletionChunk.model_validate(json.loads(json.dumps(chunk)))


async def test_a_second_call_id_at_one_index_is_malformed(provider, make):
    """Folded as it came, the two calls would merge into one, its arguments run together."""
    provider.reply(
        openai_stream(
            openai_call_start(0, "call_a", "add"),
            openai_call_args(0, '{"a": 1, "b": 2}'),
            openai_call_start(0, "call_b", "add"),
            finish_reason="tool_calls",
        )
    )
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream"


async def test_a_history_holding_what_the_api_refuses_goes_on_the_wire_as_it_accepts(
    provider, make
):
    """A model called a tool named ``functions.add`` under a 60-character id (it was told
    the tool is unknown). Sent back as they are, OpenAI refuses every later request of
    the thread (400: names are ``^[a-zA-Z0-9_-]{1,64}$``, call ids at most 40): they go
    as digests, the same for a call and its result."""
    provider.reply(openai_text("ok"))
    long_id = "call_" + "x" * 55
    history = (
        UserMessage(id="u1", text="add"),
        AssistantMessage(
            tool_calls=(ToolUse(call_id=CallId(long_id), tool="functions.add", arguments="{}"),)
        ),
        ToolResultMessage(call_id=CallId(long_id), tool="functions.add", content="unknown"),
    )
    await collect(make(), request(*history))
    sent = provider.received[0].body["messages"]
    (call,) = sent[1]["tool_calls"]
    name, call_id = call["function"]["name"], call["id"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name) and name != "functions.add"
    assert len(call_id) <= 40 and sent[2]["tool_call_id"] == call_id


@pytest.mark.parametrize("usage", [5, "n/a", [], True, {"prompt_tokens_details": 7}])
async def test_usage_of_the_wrong_type_does_not_fail_the_inference(provider, make, usage):
    """Usage is bookkeeping: a server's odd usage chunk never throws its answer away."""
    frames = [
        data(openai_chunk({"role": "assistant", "content": "hi"})),
        data(openai_chunk({}, "stop")),
        data({**openai_chunk(usage={}), "usage": usage}),
        data("[DONE]"),
    ]
    provider.reply(Sse(frames))
    _, response = await collect(make(), request())
    assert response.text == "hi"


async def test_calls_sent_whole_without_an_index_are_calls(provider, make):
    """Gemini's OpenAI-compatible endpoint sends each call in one fragment, unindexed."""
    calls = [
        {"id": f"function-call-{n}", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": n, "b": 1})}}
        for n in (1, 2)
    ]  # fmt: skip
    frames = [
        data(openai_chunk({"role": "assistant", "tool_calls": calls[:1]})),
        data(openai_chunk({"tool_calls": calls[1:]})),
        data(openai_chunk({}, "tool_calls")),
        data("[DONE]"),
    ]
    provider.reply(Sse(frames))
    _, response = await collect(make(), request())
    assert [(u.call_id, json.loads(u.arguments)["a"]) for u in response.tool_calls] == [
        ("function-call-1", 1),
        ("function-call-2", 2),
    ]


async def test_a_chunk_the_sdk_cannot_parse_or_hold_is_a_malformed_stream(provider, make):
    deep = "[" * 100_000 + "]" * 100_000
    chunk = '{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[]'
    frames = [
        data(openai_chunk({"role": "assistant", "content": "x"})),
        f'data: {chunk},"junk":{deep}}}\n\n'.encode(),
        data(openai_chunk({}, "stop")),
        data("[DONE]"),
    ]
    provider.reply(Sse(frames))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream"


async def test_two_calls_with_one_id_stay_two_calls_from_their_first_fragment(provider, make):
    """Their live deltas shared the id, so a stream checkpoint folded them into one call
    (the second's name on the first's arguments), which a recovery ran."""
    provider.reply(
        openai_stream(
            openai_call_start(0, "call_1", "add"),
            openai_call_args(0, '{"a": 1, "b": 2}'),
            openai_call_start(1, "call_1", "add"),
            openai_call_args(1, '{"a": 3, "b": 4}'),
            finish_reason="tool_calls",
        )
    )
    deltas, response = await collect(make(), request())
    assert [d.call_id for d in deltas if d.type == "tool_call_delta"] == [
        "call_1",
        "call_1",
        "call_1#2",
        "call_1#2",
    ]
    assert [(c.call_id, c.arguments) for c in response.tool_calls] == [
        ("call_1", '{"a": 1, "b": 2}'),
        ("call_1#2", '{"a": 3, "b": 4}'),
    ]


async def test_a_call_sent_without_an_id_takes_none_another_call_has(provider, make):
    """A call with no id went by ``call_<index>``, which another call's own id could
    be: their deltas merged, and a checkpoint cut there was recovered as one call (the
    later name on both argument texts), which the model never made."""
    nameless = {"index": 1, "type": "function", "function": {"name": "mul", "arguments": ""}}
    provider.reply(
        openai_stream(
            openai_call_start(0, "call_1", "add"),
            openai_call_args(0, '{"a": 1, "b": 2}'),
            openai_chunk({"tool_calls": [nameless]}),
            openai_call_args(1, '{"a": 3, "b": 4}'),
            finish_reason="tool_calls",
        )
    )
    deltas, response = await collect(make(), request())
    ids = [d.call_id for d in deltas if d.type == "tool_call_delta"]
    assert ids == ["call_1", "call_1", "call_1#2", "call_1#2"]
    assert [(c.call_id, c.tool) for c in response.tool_calls] == [
        ("call_1", "add"),
        ("call_1#2", "mul"),
    ]


async def test_a_call_whose_id_comes_late_keeps_the_id_it_got_by_index(provider, make):
    """Its first fragment had no id (``call_0``), a later one had ``x``: the deltas
    named two calls, so a stream checkpoint cut there was recovered as two complete
    calls the model never made, while the answer had one."""
    late = {"index": 0, "id": "x", "function": {"arguments": '"b": 2}'}}
    provider.reply(
        openai_stream(
            openai_chunk({"tool_calls": [{"index": 0, "type": "function",
                          "function": {"name": "add", "arguments": '{"a": 1, '}}]}),
            openai_chunk({"tool_calls": [late]}),
            finish_reason="tool_calls",
        )
    )  # fmt: skip
    deltas, response = await collect(make(), request())
    assert {d.call_id for d in deltas if d.type == "tool_call_delta"} == {"call_0"}
    assert [(c.call_id, c.arguments) for c in response.tool_calls] == [
        ("call_0", '{"a": 1, "b": 2}')
    ]


async def test_a_chunk_of_too_many_call_fragments_is_malformed_before_it_is_folded(provider, make):
    """One event can hold half a million fragments, each a new call: folding them took
    time quadratic in their number (hours for 8 MiB), all before a limit was asked."""
    from runtime.adapters.openai_compat import MAX_CHUNK_FRAGMENTS

    many = [{"index": i} for i in range(MAX_CHUNK_FRAGMENTS + 1)]
    provider.reply(openai_stream(openai_chunk({"tool_calls": many}), finish_reason="tool_calls"))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream" and "1025 tool call fragments" in str(
        caught.value
    )


@pytest.mark.parametrize("arguments", ['{"a": NaN}', '{"a": -Infinity}', '{"a": "\\ud800"}'])
async def test_past_arguments_that_are_not_strict_json_go_back_as_an_empty_object(
    provider, make, arguments
):
    """Python's json reads them; a server that parses the history strictly would refuse
    every later request of the thread over one failed call."""
    provider.reply(openai_text("ok"))
    history = (
        UserMessage(id="u1", text="add"),
        AssistantMessage(
            tool_calls=(ToolUse(call_id=CallId("c1"), tool="add", arguments=arguments),)
        ),
        ToolResultMessage(call_id=CallId("c1"), tool="add", content="bad", is_error=True),
    )
    await collect(make(), request(*history))
    (call,) = provider.received[0].body["messages"][1]["tool_calls"]
    assert call["function"]["arguments"] == "{}"


async def test_calls_cut_at_the_length_limit_are_refused_not_run(provider, make):
    """A call cut by max_tokens reads whole when it streamed no arguments (``{}``) or was
    cut just after a closing brace: it ran, with arguments the model never finished. The
    refusal carries the usage reported (it is billed)."""
    provider.reply(
        openai_stream(
            openai_chunk({"content": "I will wipe"}),
            openai_call_start(0, "call_1", "wipe"),
            finish_reason="length",
        )
    )
    with pytest.raises(ModelRefused) as caught:
        await collect(make(), request())
    assert caught.value.code == "max_tokens"
    assert (caught.value.usage.input_tokens, caught.value.usage.output_tokens) == (31, 9)
    provider.reply(openai_stream(openai_chunk({"content": "cut"}), finish_reason="length"))
    _, response = await collect(make(), request())  # text alone is what was said
    assert response.text == "cut" and response.tool_calls == ()


async def test_a_length_cut_in_the_calls_is_said_before_the_stream_ends(provider, make):
    """``Refusing`` comes with the finish chunk, the usage and the end still to come (a
    stream stalled there left a checkpoint of the cut call for a recovery to run)."""
    from runtime.models import Refusing

    provider.reply(
        Sse(
            [
                data(openai_chunk({"role": "assistant", "content": ""})),
                data(openai_call_start(0, "call_1", "charge")),
                data(openai_call_args(0, '{"amount": 7}')),
                data(openai_chunk({}, "length")),
            ],
            ending="hang",
        )
    )
    stream = make().stream(request())
    try:
        items = []
        while not any(isinstance(item, Refusing) for item in items):
            items.append(await asyncio.wait_for(anext(stream), 30))
        assert items[-1] == Refusing(reason="max_tokens")
    finally:
        await stream.aclose()


@pytest.mark.parametrize(
    "after",
    [
        [openai_call_args(0, "2}"), openai_chunk({}, "tool_calls")],  # "length" then more
        [openai_call_start(1, "call_2", "charge"), openai_call_args(1, '{"amount": 1}')],
        [openai_chunk({"content": "and more"})],
        [openai_chunk({}, "tool_calls")],
    ],
    ids=["args-then-another-finish", "a-call", "text", "another-finish"],
)
async def test_output_after_the_choice_finished_is_malformed(provider, make, after):
    """Deltas after a finish were taken, and the last finish won: a call whose arguments
    the stream said were cut (``length``) ran as finished by a later chunk."""
    frames = [
        openai_call_start(0, "call_1", "charge"),
        openai_call_args(0, '{"amount": 4'),
        openai_chunk({}, "length"),
        *after,
    ]
    provider.reply(openai_stream(*frames, finish_reason="stop"))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream"


async def test_a_usage_chunk_of_the_wrong_shape_erases_no_earlier_count(provider, make):
    provider.reply(
        Sse(
            [
                data(openai_chunk({"role": "assistant", "content": "hi"})),
                data(openai_chunk({}, "stop")),
                data(openai_chunk(usage={"prompt_tokens": 3, "completion_tokens": 2})),
                data({**openai_chunk(usage={}), "usage": "bad"}),
                data("[DONE]"),
            ]
        )
    )
    _, response = await collect(make(), request())
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (3, 2)


@pytest.mark.parametrize(
    ("later", "counts"),
    [
        ({"prompt_tokens": None, "completion_tokens": 1}, (3, 1)),
        ({"prompt_tokens": -1, "completion_tokens": 2}, (3, 2)),
        ({"prompt_tokens": "x"}, (3, 2)),
    ],
)
async def test_a_later_usage_chunk_keeps_each_earlier_count_it_does_not_give(
    provider, make, later, counts
):
    """A null or negative count in a later chunk erased the earlier chunk's (or every
    count: a negative one made the whole usage unbelieved)."""
    provider.reply(
        Sse(
            [
                data(openai_chunk({"role": "assistant", "content": "hi"})),
                data(openai_chunk({}, "stop")),
                data(openai_chunk(usage={"prompt_tokens": 3, "completion_tokens": 2})),
                data(openai_chunk(usage=later)),
                data("[DONE]"),
            ]
        )
    )
    _, response = await collect(make(), request())
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == counts
