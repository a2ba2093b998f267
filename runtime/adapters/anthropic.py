"""``AnthropicModel``: the Model port on Anthropic's Messages API, streamed.

Uses the official ``anthropic`` SDK (``pip install ratchet[anthropic]``), imported only
when an adapter is constructed, and reads its raw event stream
(``messages.create(stream=True)``) so that every delta is ours to forward.

The request, from an ``InferenceRequest``:

- ``system`` → ``system=`` (left out when empty);
- ``UserMessage`` and hook ``ContextMessage`` → ``user`` text blocks;
- ``AssistantMessage`` → ``assistant``: a text block, then a ``tool_use`` block
  ``{id, name, input}`` per call, ``input`` being the raw arguments parsed (``{}`` when
  they are no strict JSON object or nest deeper than the Run's ``json_depth``: the engine
  has already answered such a call with a tool error, ``runtime.adapters.arguments``);
- ``ToolResultMessage`` → a ``user`` message of ``tool_result`` blocks ``{tool_use_id,
  content, is_error}``;
- messages of the same role in a row are merged into one, since the API requires the
  roles to alternate; in a merged user message the ``tool_result`` blocks come first, as
  the API requires of the message answering a tool use. A message with nothing to say
  (an empty text, no calls) is left out: the API refuses empty content;
- tool schemas → ``tools: [{name, description, input_schema}]``, left out when withheld.

The events: ``content_block_start`` opens a text or ``tool_use`` block (its id and
name); ``content_block_delta`` carries ``text_delta`` → ``text_delta``,
``input_json_delta`` → ``tool_call_delta``, ``thinking_delta`` → ``reasoning_delta``;
``message_delta`` the stop reason and output usage; ``message_stop`` ends it. A stream
that ends before ``message_stop`` was cut (ModelUnavailable); an ``error`` event is
classified by its type (``overloaded_error`` → ModelRateLimited, ...). Event types this
adapter does not know (``ping``, future ones) are skipped, as the API reference asks.
A part of a type the format does not give it (a block's ``index`` that is no integer, a
``text_delta`` whose text is no string) is ``malformed_stream``, said by its shape
(``runtime.adapters.shapes``).

Nothing the model did not finish saying is taken: a message event before
``message_start`` (even a bare ``message_stop``: no answer at all) or after
``message_stop`` (a second message, a call sent after the end) is ``malformed_stream``;
so is a ``tool_use`` block that never got its ``content_block_stop``, unless the stop
reason says the answer was cut (``max_tokens``, ``model_context_window_exceeded``):
then asking again cannot help, and it is ``ModelRefused("max_tokens")`` — as it is when
the answer so cut ends in a ``tool_use`` block, stopped or not (the API stops a cut
block too, its input unfinished). A stop reason
of ``refusal`` (the API's safety classifiers stepped in) is ``ModelRefused("refusal")``.
Two blocks with one call id get distinct ids (``toolu_1``, ``toolu_1#2``) from their
start, so their live deltas and a stream checkpoint keep them apart.

Not done: prompt caching (``cache_control``), extended thinking (thinking blocks are
streamed as reasoning but not sent back, so do not enable ``thinking`` with tools).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from runtime.adapters.arguments import sent_arguments
from runtime.adapters.errors import SdkErrors, folded
from runtime.adapters.event_bound import MAX_EVENT_BYTES, event_bound_hook
from runtime.adapters.names import wire_name
from runtime.adapters.shapes import unreadable, wire_index, wire_object, wire_str, wire_text
from runtime.adapters.usage import Reported, Usage, log, model_name
from runtime.errors import ModelRefused, ModelUnavailable
from runtime.ids import CallId, distinct_id
from runtime.limits import joined
from runtime.messages import (
    AssistantMessage,
    ContextMessage,
    RequestMessage,
    ToolResultMessage,
    ToolUse,
    UserMessage,
)
from runtime.models import InferenceRequest, ModelDelta, ModelResponse, Refusing

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic, AsyncStream
    from anthropic.types import MessageParam, RawMessageStreamEvent, ToolParam


class AnthropicModel:
    """A Model on Anthropic's Messages API, streamed.

    Its client's pooled connections belong to the event loop that opened them: use an
    adapter on one loop (an actor's, a runner's), and ``aclose`` it there when done.
    """

    provider_name = "anthropic"
    """``gen_ai.provider.name`` on its inference spans (``runtime.tracing``)."""

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: AsyncAnthropic | None = None,
        max_tokens: int = 1024,
        timeout_s: float = 60,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        import anthropic
        import httpx2

        self.model = model
        self.max_tokens = max_tokens
        self._owns_client = client is None
        if client is None:
            # credentials and ANTHROPIC_BASE_URL from the environment are the SDK's to find
            hooks = {"response": [event_bound_hook(max_event_bytes)]}
            client = anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url,
                timeout=timeout_s,
                max_retries=0,
                http_client=anthropic.DefaultAsyncHttpxClient(event_hooks=hooks),
            )
        else:  # the engine retries; two layers of retries would multiply the waits
            client = client.with_options(max_retries=0)
        self._client = client
        secrets = tuple(s for s in (client.api_key, client.auth_token) if s)
        self._errors = SdkErrors(
            provider="anthropic",
            status=anthropic.APIStatusError,
            api=anthropic.APIError,
            timeout=anthropic.APITimeoutError,
            connection=anthropic.APIConnectionError,
            transport_timeout=httpx2.TimeoutException,
            transport=httpx2.RequestError,
            secrets=secrets,
        )

    async def aclose(self) -> None:
        """Close the connections of the client this adapter made (one passed in is the
        caller's to close)."""
        if self._owns_client:
            await self._client.close()

    def __repr__(self) -> str:  # never the key
        return f"AnthropicModel(model={self.model!r}, base_url={str(self._client.base_url)!r})"

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        fold = MessagesFold()
        async for item in folded(self._open(request), fold, self._errors):
            yield item
        log.debug("anthropic usage for %s step %d: %r", request.run_id, request.step, fold.usage)

    async def _open(self, request: InferenceRequest) -> AsyncStream[RawMessageStreamEvent]:
        from anthropic import omit

        tools = anthropic_tools(request.tools)
        return await self._client.messages.create(
            model=self.model,
            max_tokens=self.max_tokens,
            messages=cast(
                "list[MessageParam]", anthropic_messages(request.messages, request.json_depth)
            ),
            system=request.system or omit,
            tools=cast("list[ToolParam]", tools) if tools else omit,
            stream=True,
        )


# ---- the request ----------------------------------------------------------------------


def anthropic_messages(
    messages: tuple[RequestMessage, ...], json_depth: int
) -> list[dict[str, Any]]:
    """The Messages API ``messages`` of a history: alternating roles, content blocks
    (``json_depth``: the Run's, ``InferenceRequest.json_depth``)."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        role, blocks = _blocks(message, json_depth)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        if turn["role"] == "user":  # tool results first, each group in its own order
            turn["content"].sort(key=lambda b: b["type"] != "tool_result")
    return turns


def _blocks(message: RequestMessage, json_depth: int) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(message, UserMessage | ContextMessage):
        return "user", _text(message.text)
    if isinstance(message, AssistantMessage):
        uses = [
            {
                "type": "tool_use",
                "id": wire_name(u.call_id),
                "name": wire_name(u.tool),
                "input": _input(u, json_depth),
            }
            for u in message.tool_calls
        ]
        return "assistant", _text(message.text) + uses
    assert isinstance(message, ToolResultMessage)
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": wire_name(message.call_id)}
    if message.content:  # the API refuses an empty text; no content is allowed
        result["content"] = message.content
    result["is_error"] = message.is_error
    return "user", [result]


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}] if text else []


def _input(use: ToolUse, json_depth: int) -> dict[str, Any]:
    """A past call's ``tool_use.input``: its arguments parsed, or ``{}`` where they cannot
    be sent (``runtime.adapters.arguments``). Parsed by Python's json, which keeps an
    integer of any size as it is (orjson reads one past 64 bits as a float)."""
    parsed: dict[str, Any] = json.loads(sent_arguments(use.arguments, json_depth))
    return parsed


def anthropic_tools(tools: tuple[dict[str, Any], ...] | None) -> list[dict[str, Any]]:
    """The ``tools`` list for Ratchet's tool schemas (empty when withheld)."""
    return [
        {
            "name": t["name"],
            "description": t.get("description", ""),
            "input_schema": t.get("parameters", {"type": "object", "properties": {}}),
        }
        for t in tools or ()
    ]


# ---- the stream -----------------------------------------------------------------------


@dataclass
class _Use:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    started_with: str = ""
    """``content_block_start``'s ``input`` as JSON, for a call that streams no input."""
    stopped: bool = False
    """Its ``content_block_stop`` came: the model finished the call."""


MESSAGE_EVENTS = frozenset(
    {"message_start", "content_block_start", "content_block_delta", "content_block_stop"}
    | {"message_delta", "message_stop"}
)
"""The events of a message: none may follow its ``message_stop``."""
CUT_SHORT = frozenset({"max_tokens", "model_context_window_exceeded"})
"""Stop reasons of an answer cut before the model finished it."""


@dataclass
class MessagesFold:
    """Folds a stream's events into deltas as they come and the response at the end."""

    text: list[str] = field(default_factory=list)
    uses: dict[int, _Use] = field(default_factory=dict)
    started: bool = False
    last_block: int = -1
    """The highest index a block started at: the block an answer cut short ends in."""
    stopped: bool = False
    stop_reason: str | None = None
    model: str = ""
    reported: Reported = field(default_factory=Reported)

    def add(self, event: RawMessageStreamEvent) -> list[ModelDelta]:
        try:
            return self._add(event)
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # JSON, not an event
            message = f"anthropic: unreadable event: {unreadable(exc)}"
            raise ModelUnavailable("malformed_stream", message) from exc

    def _add(self, event: RawMessageStreamEvent) -> list[ModelDelta]:
        if self.stopped and event.type in MESSAGE_EVENTS:
            message = f"anthropic: {event.type} after message_stop"
            raise ModelUnavailable("malformed_stream", message)
        if not self.started and event.type in MESSAGE_EVENTS - {"message_start"}:
            # a message is its message_start's (model, input usage): one without it,
            # even a bare message_stop, is not an empty answer
            message = f"anthropic: {event.type} before message_start"
            raise ModelUnavailable("malformed_stream", message)
        if event.type == "message_start":
            if self.started:
                raise ModelUnavailable("malformed_stream", "anthropic: a second message_start")
            self.started = True
            self.model = event.message.model
            self.reported.add(event.message.usage, USAGE_FIELDS)
        elif event.type == "content_block_start":
            wire_object(event.content_block, "a content block")
            return self._start(wire_index(event.index, "a block's index"), event.content_block)
        elif event.type == "content_block_delta":
            wire_object(event.delta, "a content block delta")
            return self._delta(wire_index(event.index, "a block's index"), event.delta)
        elif event.type == "content_block_stop":
            index = wire_index(event.index, "a block's index")
            if index in self.uses:
                self.uses[index].stopped = True
        elif event.type == "message_delta":
            self.reported.add(event.usage, USAGE_FIELDS)  # cumulative: the newest count wins
            wire_object(event.delta, "a message delta")
            reason = event.delta.stop_reason
            return self._stop_reason(None if reason is None else wire_str(reason, "a stop reason"))
        elif event.type == "message_stop":
            self.stopped = True
        return []

    def _stop_reason(self, reason: Any) -> list[ModelDelta]:
        """A ``message_delta``'s stop reason. A second one may repeat the first or give
        none; one that says another would undo a refusal already said (``Refusing``)."""
        if reason is None or reason == self.stop_reason:
            return []
        if self.stop_reason is not None:
            raise ModelUnavailable(
                "malformed_stream",
                f"anthropic: stop_reason {reason!r} after {self.stop_reason!r}",
            )
        self.stop_reason = reason
        refused = self.refused_reason()
        return [] if refused is None else [Refusing(reason=refused)]

    def _start(self, index: int, block: Any) -> list[ModelDelta]:
        self.last_block = max(self.last_block, index)
        if block.type == "text" and (text := wire_text(block.text, "a text block's text")):
            self.text.append(text)
            return [ModelDelta(text=text)]
        if block.type == "tool_use":
            if index in self.uses:  # a block starts once: a second would drop the first call
                raise ModelUnavailable(
                    "malformed_stream", f"anthropic: content block {index} started twice"
                )
            taken = {use.id for use in self.uses.values()}
            raw_id = wire_str(block.id, "a tool_use block's id")
            name = wire_str(block.name, "a tool_use block's name")
            use = _Use(id=distinct_id(raw_id, taken), name=name, started_with=_json(block.input))
            self.uses[index] = use
            return [ModelDelta(type="tool_call_delta", call_id=use.id, tool=use.name, text="")]
        return []

    def _delta(self, index: int, delta: Any) -> list[ModelDelta]:
        if delta.type == "text_delta":
            text = wire_str(delta.text, "a text delta")
            self.text.append(text)
            return [ModelDelta(text=text)]
        if delta.type == "input_json_delta":
            use = self.uses.get(index)
            if use is None or use.stopped:  # the documented order: start, deltas, stop
                when = "never started" if use is None else "after its stop"
                raise ModelUnavailable(
                    "malformed_stream", f"anthropic: input for content block {index}, {when}"
                )
            partial = wire_str(delta.partial_json, "an input_json_delta's partial_json")
            use.arguments.append(partial)
            return [ModelDelta(type="tool_call_delta", call_id=use.id, tool=use.name, text=partial)]
        if delta.type == "thinking_delta":
            thinking = wire_str(delta.thinking, "a thinking delta")
            return [ModelDelta(type="reasoning_delta", text=thinking)]
        return []

    def _unfinished(self) -> list[str]:
        unfinished = [use.id for use in self.uses.values() if not use.stopped]
        if self.stop_reason in CUT_SHORT and self.last_block in self.uses:
            # the API stops every block, a cut one too: a call in the last block is cut
            unfinished.append(self.uses[self.last_block].id)
        return unfinished

    def refused_reason(self) -> str | None:
        """Why the answer will be refused, once its stop reason says (``Refusing``)."""
        if self.stop_reason in CUT_SHORT and self._unfinished():
            return "max_tokens"
        return "refusal" if self.stop_reason == "refusal" else None

    def response(self) -> ModelResponse:
        if not self.stopped:
            raise ModelUnavailable("stream_cut", "anthropic: the stream ended before message_stop")
        unfinished = self._unfinished()
        refused = self.refused_reason()  # as ``Refusing`` said it: one decision
        if refused == "max_tokens":
            raise ModelRefused(
                "max_tokens",
                f"anthropic: the answer was cut ({self.stop_reason}) inside tool call "
                f"{unfinished[0]!r}; raise max_tokens",
                usage=self.usage,
            )
        if refused == "refusal":
            message = "anthropic: the model declined (stop_reason refusal)"
            raise ModelRefused("refusal", message, usage=self.usage)
        if unfinished:
            raise ModelUnavailable(
                "malformed_stream", f"anthropic: tool call {unfinished[0]!r} was never stopped"
            )
        uses = tuple(
            ToolUse(
                call_id=CallId(use.id),
                tool=use.name,
                arguments=joined(use.arguments) or use.started_with or "{}",
            )
            for _, use in sorted(self.uses.items())
        )
        return ModelResponse(text=joined(self.text), tool_calls=uses, usage=self.usage)

    @property
    def usage(self) -> Usage | None:
        return _usage(self.reported, self.model)


def _json(value: object) -> str:
    """A block's starting input as argument text: none for the ``{}`` a streamed call
    starts with (its arguments follow as deltas); anything else as it is, so that a
    falsy non-object (``[]``, ``0``, ``""``) is refused as arguments, not run as ``{}``."""
    return "" if value is None or value == {} else json.dumps(value)


USAGE_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def usage_of(start: Any, end: Any, model: str) -> Usage | None:
    """The usage of a message from its ``message_start`` and ``message_delta`` usage
    (the latter's counts are cumulative, so they win where given)."""
    reported = Reported()
    reported.add(start, USAGE_FIELDS)
    reported.add(end, USAGE_FIELDS)
    return _usage(reported, model)


def _usage(reported: Reported, model: str) -> Usage | None:
    if not reported.any:
        return None
    count = reported.count
    cached = count("cache_read_input_tokens")
    parts = (count("input_tokens"), cached, count("cache_creation_input_tokens"))
    # a negative part would vanish into the sum: kept negative, it is not believed
    # (runtime.usage.admitted_usage)
    total_in = sum(parts) if min(parts) >= 0 else min(parts)
    return Usage(
        input_tokens=total_in,
        output_tokens=count("output_tokens"),
        cached_tokens=cached,
        model=model_name(model),
    )
