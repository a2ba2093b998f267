"""AnthropicModel over real HTTP, on the real ``anthropic`` SDK, against the fake server."""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
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
from runtime.adapters import AnthropicModel
from runtime.adapters.anthropic import usage_of
from runtime.adapters.usage import Usage
from runtime.errors import InputRefused
from runtime.ids import CallId
from runtime.inference import admit_response
from runtime.limits import DEFAULT_LIMITS
from runtime.messages import ContextMessage

from .conftest import API_KEY
from .fake_provider import (
    PING,
    FakeProvider,
    Sse,
    Stall,
    Status,
    anthropic_error,
    anthropic_stream,
    event,
    input_json,
    message_delta,
    message_end,
    message_start,
    text_block,
    tool_use_block,
)
from .helpers import ADD_SCHEMA, collect, failure, free_port, request


@pytest.fixture
def make(provider: FakeProvider, closing):
    """Builds an adapter on the test's server, closed after the test."""

    def build(**options) -> AnthropicModel:
        model = AnthropicModel("claude-test", base_url=provider.url, api_key=API_KEY, **options)
        return closing(model)

    return build


def use(call_id: str, arguments: str) -> ToolUse:
    return ToolUse(call_id=CallId(call_id), tool="add", arguments=arguments)


async def test_the_request_maps_system_blocks_tool_uses_and_merges_roles(provider, make):
    provider.reply(anthropic_stream(text_block(0, "ok")))
    history = (
        UserMessage(id="u1", text="add twice"),
        AssistantMessage(
            text="adding", tool_calls=(use("tu_a", '{"a":2,"b":3}'), use("tu_b", "{bad"))
        ),
        ToolResultMessage(call_id=CallId("tu_a"), tool="add", content="5"),
        ToolResultMessage(call_id=CallId("tu_b"), tool="add", content="bad JSON", is_error=True),
        ContextMessage(text="hook says: be brief"),
        AssistantMessage(text=""),  # nothing to say: left out
        UserMessage(id="u2", text="and again"),
    )
    await collect(make(max_tokens=77), request(*history, system="You add numbers."))

    (received,) = provider.received
    assert received.path == "/v1/messages"
    # how the key travels is the SDK's choice (x-api-key, or a bearer token in 2.x)
    sent = {received.headers.get("x-api-key"), received.headers.get("authorization")}
    assert sent & {API_KEY, f"Bearer {API_KEY}"}
    body = received.body
    assert (body["model"], body["max_tokens"], body["stream"]) == ("claude-test", 77, True)
    assert body["system"] == "You add numbers."
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "add twice"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "adding"},
                {"type": "tool_use", "id": "tu_a", "name": "add", "input": {"a": 2, "b": 3}},
                {"type": "tool_use", "id": "tu_b", "name": "add", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "tu_a", "content": "5", "is_error": False},
                {
                    "type": "tool_result",
                    "tool_use_id": "tu_b",
                    "content": "bad JSON",
                    "is_error": True,
                },
                {"type": "text", "text": "hook says: be brief"},
                {"type": "text", "text": "and again"},
            ],
        },
    ]
    assert body["tools"] == [
        {
            "name": "add",
            "description": ADD_SCHEMA["description"],
            "input_schema": ADD_SCHEMA["parameters"],
        }
    ]


async def test_committed_calls_the_api_would_refuse_are_sent_so_that_it_accepts_them(
    provider, make
):
    """A model's call ids may be anything (a repeat is renamed ``id#2``), its arguments
    may escape a lone surrogate or say NaN: committed, each would have failed every
    later request of the thread. Ids are sent as a digest (a call and its result the
    same), such arguments as {}."""
    provider.reply(anthropic_stream(text_block(0, "ok")))
    history = (
        UserMessage(id="u1", text="go"),
        AssistantMessage(
            tool_calls=(
                use("tu_a", '{"a": "\\ud800"}'),
                use("tu_a#2", '{"a": NaN}'),
                ToolUse(call_id=CallId("c 3"), tool="no such tool!", arguments="{}"),
            )
        ),
        ToolResultMessage(call_id=CallId("tu_a"), tool="add", content="1"),
        ToolResultMessage(call_id=CallId("tu_a#2"), tool="add", content="2"),
        ToolResultMessage(call_id=CallId("c 3"), tool="no such tool!", content="3"),
    )
    await collect(make(), request(*history))
    assistant, results = provider.received[0].body["messages"][1:]
    uses = assistant["content"]
    assert [u["input"] for u in uses] == [{}, {}, {}]
    ids = [u["id"] for u in uses]
    assert ids[0] == "tu_a" and len(set(ids)) == 3
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", x) for x in [*ids, uses[2]["name"]])
    assert [r["tool_use_id"] for r in results["content"]] == ids


async def test_tool_results_come_first_in_a_merged_user_message(provider, make):
    provider.reply(anthropic_stream(text_block(0, "ok")))
    history = (
        UserMessage(id="u1", text="go"),
        AssistantMessage(tool_calls=(use("tu_a", "{}"),)),
        ContextMessage(text="context before the result"),
        ToolResultMessage(call_id=CallId("tu_a"), tool="add", content=""),
    )
    await collect(make(), request(*history))
    last = provider.received[0].body["messages"][-1]
    assert last == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "tu_a", "is_error": False},
            {"type": "text", "text": "context before the result"},
        ],
    }


@pytest.mark.parametrize("tools", [None, ()], ids=["withheld", "none-defined"])
async def test_tools_and_an_empty_system_are_left_out(provider, make, tools):
    provider.reply(anthropic_stream(text_block(0, "ok")))
    await collect(make(), request(tools=tools))
    body = provider.received[0].body
    assert "tools" not in body and "system" not in body


async def test_text_and_tool_use_stream_as_deltas_then_one_response(provider, make):
    provider.reply(
        anthropic_stream(
            text_block(0, "Let me ", "add."),
            tool_use_block(1, "toolu_1", "add", "", '{"a": 1, ', '"b": 2}'),
            [PING],
            tool_use_block(2, "toolu_2", "add"),  # no input streamed: {}
            stop_reason="tool_use",
        )
    )
    deltas, response = await collect(make(), request())
    assert [(d.type, d.call_id, d.tool, d.text) for d in deltas] == [
        ("text_delta", None, None, "Let me "),
        ("text_delta", None, None, "add."),
        ("tool_call_delta", "toolu_1", "add", ""),
        ("tool_call_delta", "toolu_1", "add", ""),
        ("tool_call_delta", "toolu_1", "add", '{"a": 1, '),
        ("tool_call_delta", "toolu_1", "add", '"b": 2}'),
        ("tool_call_delta", "toolu_2", "add", ""),
    ]
    assert response.text == "Let me add."
    assert response.tool_calls == (use("toolu_1", '{"a": 1, "b": 2}'), use("toolu_2", "{}"))


@pytest.mark.parametrize("start", [[], "", 0, False, [1]])
async def test_a_tool_use_starting_with_an_input_that_is_no_object_keeps_it(provider, make, start):
    """A falsy one (``[]``, ``0``, ``""``) was taken for no input: the call ran with
    ``{}``, where ``[1]`` was refused as arguments that are no JSON object."""
    block = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": start}
    opened = {"type": "content_block_start", "index": 0, "content_block": block}
    stopped = {"type": "content_block_stop", "index": 0}
    frames = [event("content_block_start", opened), event("content_block_stop", stopped)]
    provider.reply(anthropic_stream(frames, stop_reason="tool_use"))
    _, response = await collect(make(), request())
    assert response.tool_calls == (use("toolu_1", json.dumps(start)),)


async def test_the_halves_of_a_character_cut_between_fragments_join(provider, make):
    """As the answer's text does (test_end_to_end): a half with no partner stays one,
    which the response's admission refuses, as before."""
    provider.reply(
        anthropic_stream(
            text_block(0, "half \ud83d"),
            tool_use_block(1, "toolu_1", "add", '{"a": "\ud83d', '\ude00"}'),
            stop_reason="tool_use",
        )
    )
    _, response = await collect(make(), request())
    assert response.tool_calls == (use("toolu_1", '{"a": "\U0001f600"}'),)
    with pytest.raises(InputRefused, match="utf8"):
        admit_response(response, DEFAULT_LIMITS)


async def test_thinking_streams_as_reasoning(provider, make):
    thinking = [
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "2+3=5"},
            },
        ),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ]
    provider.reply(anthropic_stream(thinking, text_block(1, "5")))
    deltas, response = await collect(make(), request())
    assert [(d.type, d.text) for d in deltas] == [("reasoning_delta", "2+3=5"), ("text_delta", "5")]
    assert response.text == "5"


async def test_event_types_it_does_not_know_are_skipped(provider, make):
    future = event("content_block_future", {"type": "content_block_future", "index": 0})
    provider.reply(anthropic_stream([future], text_block(1, "ok")))
    deltas, response = await collect(make(), request())
    assert [d.text for d in deltas] == ["ok"] and response.text == "ok"


def test_usage_adds_cache_reads_to_input_and_takes_the_final_output_count():
    from anthropic.types import MessageDeltaUsage
    from anthropic.types import Usage as StartUsage

    start = StartUsage(input_tokens=25, output_tokens=1, cache_read_input_tokens=10)
    end = MessageDeltaUsage(output_tokens=15)
    assert usage_of(start, end, "claude-test-2025") == Usage(
        input_tokens=35, output_tokens=15, cached_tokens=10, model="claude-test-2025"
    )
    assert usage_of(None, None, "") is None


# ---- errors ---------------------------------------------------------------------------

ERRORS = [
    pytest.param(
        Status(
            429,
            anthropic_error("rate_limit_error", "Number of requests has exceeded"),
            {"retry-after": "7"},
        ),
        ModelRateLimited,
        "rate_limit",
        "Number of requests has exceeded",
        id="429",
    ),
    pytest.param(
        Status(529, anthropic_error("overloaded_error", "Overloaded"), {"retry-after": "7"}),
        ModelRateLimited,
        "overloaded",
        "Overloaded",
        id="529",
    ),
    pytest.param(
        Status(500, anthropic_error("api_error", "Internal server error")),
        ModelUnavailable,
        "status_500",
        "Internal server error",
        id="500",
    ),
    pytest.param(
        Status(400, anthropic_error("invalid_request_error", "messages: roles must alternate")),
        ModelRefused,
        "invalid_request",
        "roles must alternate",
        id="400",
    ),
    pytest.param(
        Status(
            400,
            anthropic_error("invalid_request_error", "prompt is too long: 210000 tokens > 200000"),
        ),
        ModelRefused,
        "context_length",
        "prompt is too long",
        id="400-context",
    ),
    pytest.param(
        Status(401, anthropic_error("authentication_error", f"invalid x-api-key {API_KEY}")),
        ModelRefused,
        "auth",
        "invalid x-api-key",
        id="401",
    ),
    pytest.param(
        Status(404, anthropic_error("not_found_error", "model: claude-nope")),
        ModelRefused,
        "not_found",
        "model: claude-nope",
        id="404",
    ),
]


@pytest.mark.parametrize(("reply", "kind", "code", "says"), ERRORS)
async def test_an_error_status_becomes_its_typed_error(provider, make, reply, kind, code, says):
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


def error_event(type_: str, message: str) -> bytes:
    return event("error", anthropic_error(type_, message))


@pytest.mark.parametrize(
    ("type_", "kind", "code"),
    [
        ("overloaded_error", ModelRateLimited, "overloaded"),
        ("rate_limit_error", ModelRateLimited, "rate_limit"),
        ("api_error", ModelUnavailable, "server_error"),
        ("invalid_request_error", ModelRefused, "invalid_request"),
        ("something_new_error", ModelUnavailable, "stream_error"),
    ],
)
async def test_an_error_event_mid_stream_is_classified_by_its_type(
    provider, make, type_, kind, code
):
    provider.reply(Sse([message_start(), *text_block(0, "Hel"), error_event(type_, "it broke")]))
    with pytest.raises(ModelError) as caught:
        await collect(make(), request())
    assert type(caught.value) is kind and caught.value.code == code
    assert caught.value.status is None and "it broke" in str(caught.value)


STREAM_FAILURES = [
    pytest.param(
        Sse([message_start(), *text_block(0, "Hel")], ending="cut"), "stream_cut", id="cut"
    ),
    pytest.param(Sse([message_start(), *text_block(0, "Hel")]), "stream_cut", id="no-message-stop"),
    pytest.param(
        Sse(
            [message_start(), *text_block(0, "Hel"), b"event: content_block_delta\ndata: {oops\n\n"]
        ),
        "malformed_stream",
        id="not-json",
    ),
    pytest.param(
        Sse(
            [
                message_start(),
                *text_block(0, "Hel"),
                event("content_block_delta", {"type": "content_block_delta", "index": 0}),
            ]
        ),
        "malformed_stream",
        id="not-an-event",
    ),
    pytest.param(
        Sse(
            [
                message_start(),
                *text_block(0, "Hel"),
                b'event: content_block_delta\ndata: {"type": "content_block_delta", "\xff": 0}\n\n',
            ]
        ),
        "malformed_stream",
        id="not-utf8",
    ),
    pytest.param(
        Sse(
            [
                message_start(),
                *text_block(0, "Hel"),
                b'event: message_delta\ndata: {"type": "message_delta", "delta": {}, '
                b'"usage": {"output_tokens": ' + b"7" * 5000 + b"}}\n\n",
            ]
        ),
        "malformed_stream",
        id="usage-of-5000-digits",
    ),
]


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([*text_block(0, "Hel"), *message_end()], id="blocks"),
        pytest.param(message_end(), id="only-the-end"),
        pytest.param([event("message_stop", {"type": "message_stop"})], id="a-bare-stop"),
    ],
)
async def test_a_message_without_its_start_is_malformed(provider, make, frames):
    """Such a stream, even a bare ``message_stop``, was taken for an (empty) answer."""
    provider.reply(Sse([PING, *frames]))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream" and "before message_start" in str(caught.value)


@pytest.mark.parametrize(("reply", "code"), STREAM_FAILURES)
async def test_a_broken_stream_is_transient(provider, make, reply, code):
    provider.reply(reply)
    seen: list[ModelDelta] = []
    with pytest.raises(ModelUnavailable) as caught:
        async for item in make().stream(request()):
            seen.append(item)  # type: ignore[arg-type]
    assert type(caught.value) is ModelUnavailable and caught.value.code == code
    assert [d.text for d in seen] == ["Hel"]
    assert API_KEY not in str(caught.value)
    assert "set_int_max_str_digits" not in str(caught.value)  # advice to this process


async def test_a_server_that_never_answers_times_out(provider, make):
    provider.reply(Stall())
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(timeout_s=0.3), request())
    assert caught.value.code == "timeout"


async def test_a_stream_that_stalls_mid_way_times_out(provider, make):
    # the anthropic SDK lets the transport's read timeout escape mid-stream: still ours
    provider.reply(Sse([message_start(), *text_block(0, "Hel")], ending="hang"))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(timeout_s=0.3), request())
    assert caught.value.code == "timeout"


async def test_a_server_that_is_not_there_is_a_connection_error(closing):
    model = closing(
        AnthropicModel("claude-test", base_url=f"http://127.0.0.1:{free_port()}", api_key=API_KEY)
    )
    with pytest.raises(ModelUnavailable) as caught:
        await collect(model, request())
    assert caught.value.code == "connection" and API_KEY not in str(caught.value)


async def test_the_sdk_does_not_retry_on_its_own(provider):
    provider.reply(Status(529, anthropic_error("overloaded_error", "Overloaded")))
    client = anthropic.AsyncAnthropic(base_url=provider.url, api_key=API_KEY, max_retries=5)
    try:
        with pytest.raises(ModelRateLimited):
            await collect(AnthropicModel("claude-test", client=client), request())
    finally:
        await client.close()
    assert len(provider.received) == 1


async def test_the_repr_shows_no_key(make):
    shown = repr(make())
    assert "claude-test" in shown and API_KEY not in shown


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(
            [
                *tool_use_block(1, "toolu_a", "add", '{"a": 1}'),
                *tool_use_block(1, "toolu_b", "add"),
            ],
            id="a-block-started-twice",
        ),
        pytest.param(
            [input_json(5, '{"a": 1}')],
            id="input-for-a-block-never-started",
        ),
        pytest.param(
            [*tool_use_block(1, "toolu_a", "add", '{"a": 1}'), input_json(1, ', "b": 2}')],
            id="input-for-a-block-after-its-stop",
        ),
    ],
)
async def test_tool_use_events_out_of_the_documented_order_are_malformed(provider, make, frames):
    """Folded as they came, the first call would be dropped, or the input lost (the call
    run with {}): an attempt that failed, not a response that seems whole."""
    provider.reply(Sse([message_start(), *frames, *message_end("tool_use")]))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream"


@pytest.mark.parametrize("field", ["id", "name"])
async def test_a_tool_use_block_the_response_cannot_hold_is_a_malformed_stream(
    provider, make, field
):
    """A ``tool_use`` block whose id or name is null: not a response (malformed_stream,
    the attempt retried), never pydantic's ValidationError out of the adapter."""
    block = {"type": "tool_use", "id": "t1", "name": "add", "input": {}, field: None}
    start = {"type": "content_block_start", "index": 0, "content_block": block}
    stop = {"type": "content_block_stop", "index": 0}
    frames = [
        message_start(),
        event("content_block_start", start),
        event("content_block_stop", stop),
        *message_end("tool_use"),
    ]
    provider.reply(Sse(frames))
    with pytest.raises(ModelUnavailable) as caught:
        await collect(make(), request())
    assert caught.value.code == "malformed_stream"


@pytest.mark.parametrize(
    "after",
    [
        pytest.param(tool_use_block(1, "toolu_z", "add", '{"a": 6, "b": 6}'), id="a-call"),
        pytest.param([message_start(), *text_block(0, "second")], id="a-second-message"),
    ],
)
async def test_nothing_after_message_stop_is_taken(provider, make, after):
    """Events after the end were folded in: a call sent after ``message_stop`` was
    committed and run, and a second message's text joined the first's."""
    frames = [message_start(), *text_block(0, "final"), *message_end(), *after]
    provider.reply(Sse([*frames, *message_end()]))
    assert await failure(make(), ModelUnavailable) == "malformed_stream"


def _unstopped_call(stop_reason: str) -> Sse:
    """Text, then a ``tool_use`` block that gets no ``content_block_stop``."""
    block = {"type": "tool_use", "id": "toolu_w", "name": "add", "input": {}}
    start = {"type": "content_block_start", "index": 1, "content_block": block}
    return Sse(
        [
            message_start(),
            *text_block(0, "I am going to"),
            event("content_block_start", start),
            *message_end(stop_reason),
        ]
    )


@pytest.mark.parametrize(
    ("stop_reason", "kind", "code"),
    [
        ("max_tokens", ModelRefused, "max_tokens"),
        ("model_context_window_exceeded", ModelRefused, "max_tokens"),
        ("tool_use", ModelUnavailable, "malformed_stream"),
    ],
)
async def test_a_call_the_model_did_not_finish_is_never_taken(
    provider, make, stop_reason, kind, code
):
    """A ``tool_use`` block cut off before its ``content_block_stop`` was taken with the
    arguments so far (none: ``{}``) and run. Cut by max_tokens, asking again cannot
    help; with no such reason, the stream is not the API's."""
    provider.reply(_unstopped_call(stop_reason))
    assert await failure(make(), kind) == code


@pytest.mark.parametrize("arguments", ['{"a": 1', ""])
async def test_an_answer_cut_in_its_last_call_is_refused_though_the_block_stopped(
    provider, make, arguments
):
    """The API stops a block cut by max_tokens too: a last call with no input yet read
    as ``{}`` and ran; one with half its input failed only on its JSON."""
    provider.reply(
        anthropic_stream(
            text_block(0, "I will"),
            tool_use_block(1, "toolu_w", "add", *([arguments] if arguments else [])),
            stop_reason="max_tokens",
        )
    )
    assert await failure(make(), ModelRefused) == "max_tokens"


async def test_text_cut_after_a_whole_call_is_the_answer(provider, make):
    provider.reply(
        anthropic_stream(
            tool_use_block(0, "toolu_1", "add", '{"a": 1, "b": 2}'),
            text_block(1, "and then"),
            stop_reason="max_tokens",
        )
    )
    _, response = await collect(make(), request())
    assert response.tool_calls == (use("toolu_1", '{"a": 1, "b": 2}'),)


async def test_a_refusal_is_a_refusal_not_an_answer(provider, make):
    provider.reply(anthropic_stream(text_block(0, "I can"), stop_reason="refusal"))
    assert await failure(make(), ModelRefused) == "refusal"


@pytest.mark.parametrize("cut", [False, True])
async def test_an_answer_refused_after_it_was_made_is_still_counted(provider, make, cut):
    """A refusal or a cut at max_tokens is billed: its usage is recorded with the Run's
    end (it was lost with the error)."""
    from runtime import Agent, InProcessRunner
    from storage.memory import MemoryCommitStore

    reply = _unstopped_call("max_tokens") if cut else None
    provider.reply(reply or anthropic_stream(text_block(0, "I can"), stop_reason="refusal"))
    runner = InProcessRunner(Agent(name="a", model=make()), MemoryCommitStore())
    ended = await runner.start("go", thread_id="t")
    cause = ended.run_state.cause
    assert (cause.failure, cause.code) == ("inference", "max_tokens" if cut else "refusal")
    one = {"input_tokens": 35, "output_tokens": 15, "cached_tokens": 10, "inferences": 1}
    assert ended.state["run"]["usage"] == one == ended.state["thread"]["usage"]


async def test_two_blocks_with_one_call_id_stay_two_calls_from_their_start(provider, make):
    """Their live deltas shared the id, so a stream checkpoint folded them into one call
    (the second's name on the first's arguments), which a recovery ran."""
    from runtime.checkpoint import PartialOutput, plan_from_checkpoint
    from runtime.ids import RunId

    provider.reply(
        anthropic_stream(
            tool_use_block(0, "toolu_1", "add", '{"a": 1, "b": 2}'),
            tool_use_block(1, "toolu_1", "sub", '{"a": 3, "b": 4}'),
            stop_reason="tool_use",
        )
    )
    deltas, response = await collect(make(), request())
    assert [(c.call_id, c.tool, c.arguments) for c in response.tool_calls] == [
        ("toolu_1", "add", '{"a": 1, "b": 2}'),
        ("toolu_1#2", "sub", '{"a": 3, "b": 4}'),
    ]
    partial = PartialOutput(run_id=RunId("r"), step=1)
    for delta in deltas:
        partial.add(delta)
    plan = plan_from_checkpoint(partial.checkpoint(), RunId("r"), 1)
    assert plan.tool_calls == response.tool_calls


def test_a_negative_usage_count_is_not_summed_away():
    """A negative input count plus cache reads summed to a count that looked whole, and
    was recorded; kept negative, it is not believed."""
    from anthropic.types import Usage as StartUsage

    from runtime.usage import admitted_usage

    start = StartUsage(input_tokens=-1000, output_tokens=1, cache_read_input_tokens=2000)
    usage = usage_of(start, None, "claude-test")
    assert usage is not None and admitted_usage(usage) is None


@pytest.mark.parametrize("stop_reason", ["max_tokens", "refusal"])
async def test_a_refused_answer_is_said_at_its_stop_reason_before_the_stream_ends(
    provider, make, stop_reason
):
    """``Refusing`` comes with the ``message_delta`` (a stream stalled before its
    ``message_stop`` left a checkpoint of the cut call for a recovery to run)."""
    from runtime.models import Refusing

    frames = [message_start(), *tool_use_block(0, "toolu_w", "add", '{"a": 1, "b": 2}')]
    frames.append(message_end(stop_reason)[0])  # the message_delta alone, then a stall
    provider.reply(Sse(frames, ending="hang"))
    stream = make().stream(request())
    try:
        items = []
        while not any(isinstance(item, Refusing) for item in items):
            items.append(await asyncio.wait_for(anext(stream), 30))
        reason = "max_tokens" if stop_reason == "max_tokens" else "refusal"
        assert items[-1] == Refusing(reason=reason)
    finally:
        await stream.aclose()


@pytest.mark.parametrize(
    ("first", "second", "kind", "code"),
    [
        ("refusal", None, ModelRefused, "refusal"),
        ("refusal", "tool_use", ModelUnavailable, "malformed_stream"),
        ("max_tokens", "tool_use", ModelUnavailable, "malformed_stream"),
    ],
)
async def test_a_second_message_delta_undoes_no_stop_reason(
    provider, make, first, second, kind, code
):
    """A later delta's stop reason replaced the first: a refusal (said at once as
    ``Refusing``) was undone by a ``tool_use`` or a null, and the call ran."""
    frames = [message_start(), *tool_use_block(0, "toolu_1", "add", '{"a": 1, "b": 2}')]
    frames += [message_delta(reason, {"output_tokens": 9}) for reason in (first, second)]
    frames.append(event("message_stop", {"type": "message_stop"}))
    provider.reply(Sse(frames))
    assert await failure(make(), kind) == code


@pytest.mark.parametrize("later", ["bad", {"output_tokens": None}, None, {"output_tokens": -5}])
async def test_a_later_usage_of_the_wrong_shape_erases_no_earlier_count(provider, make, later):
    frames = [message_start(), *text_block(0, "hi")]
    frames += [message_delta("end_turn", {"output_tokens": 9}), message_delta(None, later)]
    frames.append(event("message_stop", {"type": "message_stop"}))
    provider.reply(Sse(frames))
    _, response = await collect(make(), request())
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (35, 9)
