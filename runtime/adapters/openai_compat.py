"""``OpenAICompatible``: the Model port on the Chat Completions streaming API.

Speaks to OpenAI and to any server with the same wire format (vLLM, Ollama, LiteLLM,
llama.cpp ...) through the official ``openai`` SDK (``pip install ratchet[openai]``),
imported only when an adapter is constructed.

The request, from an ``InferenceRequest``:

- ``system`` → a first ``system`` message (none when the prompt is empty);
- ``UserMessage`` and hook ``ContextMessage`` → ``user`` messages;
- ``AssistantMessage`` → ``assistant`` with ``tool_calls`` ``[{id, type: function,
  function: {name, arguments}}]`` (``arguments`` as the model sent them, or ``{}`` as
  ``runtime.adapters.arguments`` decides); its ``content`` is null when it has calls and
  no text (OpenAI refuses an empty string next to calls, and null without them);
- ``ToolResultMessage`` → ``tool`` with ``tool_call_id``; a failed call's content is sent
  as ``"error: <content>"``, since the format has no error flag and the model must
  be able to tell a failure from a result;
- tool schemas → ``tools: [{type: function, function: {name, description,
  parameters}}]``, left out when withheld (``request.tools is None``) or empty (OpenAI
  refuses an empty list).

The stream: ``delta.content`` → ``text_delta``; ``reasoning_content``/``reasoning`` (an
extra field of vLLM, DeepSeek, OpenRouter) → ``reasoning_delta``; each fragment of
``delta.tool_calls[i]`` → ``tool_call_delta`` named by the call's id and tool (both
arrive on the call's first fragment); then one ``ModelResponse`` with the calls in
index order. A stream that ends without a ``finish_reason`` was cut (ModelUnavailable).
A ``length`` finish with tool calls may have cut the last call short (the format marks
no call's end): asking again cannot help, so it is ``ModelRefused("max_tokens")`` and no
call of it runs. Two calls with one id get distinct ids (``call_1``, ``call_1#2``) from
their first fragment, so their live deltas and a stream checkpoint keep them apart; a
call whose id comes only on a later fragment keeps the one it got by index
(``call_<index>``) throughout. A chunk of more than ``MAX_CHUNK_FRAGMENTS`` call
fragments is ``malformed_stream``, as is a part of a type the format does not give it
(``tool_calls`` that is no list, ``content`` that is no text), said by its shape
(``runtime.adapters.shapes``).

Retries are Ratchet's (``Agent.inference_attempts``, rate-limit backoff), so the SDK's
are off. ``timeout_s`` bounds connecting and every wait for the next chunk, not the
whole stream; ``max_event_bytes`` one server-sent event as it arrives
(``runtime.adapters.event_bound``; on the client the adapter makes, not one passed
in). Usage: ``runtime.adapters.usage``, returned on the response.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from runtime.adapters.arguments import sent_arguments
from runtime.adapters.errors import SdkErrors, folded
from runtime.adapters.event_bound import MAX_EVENT_BYTES, event_bound_hook
from runtime.adapters.names import wire_id, wire_name
from runtime.adapters.shapes import unreadable, wire_index, wire_list, wire_object, wire_text
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
    from openai import AsyncOpenAI, AsyncStream
    from openai.types.chat import (
        ChatCompletionChunk,
        ChatCompletionMessageParam,
        ChatCompletionToolParam,
    )
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

PLACEHOLDER_KEY = "unused"
"""The key sent to a gateway (``base_url`` given) when none is configured: the SDK needs
one, and vLLM or Ollama accept any."""


class OpenAICompatible:
    """A Model on an OpenAI-compatible Chat Completions endpoint, streamed.

    Its client's pooled connections belong to the event loop that opened them: use an
    adapter on one loop (an actor's, a runner's), and ``aclose`` it there when done.
    """

    provider_name = "openai"
    """``gen_ai.provider.name`` on its inference spans (``runtime.tracing``)."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        client: AsyncOpenAI | None = None,
        timeout_s: float = 60,
        max_tokens: int | None = None,
        temperature: float | None = None,
        extra_body: dict[str, Any] | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        import httpx2
        import openai

        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.extra_body = dict(extra_body) if extra_body else None
        self._owns_client = client is None
        if client is None:
            client = _client(openai, base_url, api_key, timeout_s, max_event_bytes)
        else:  # the engine retries; two layers of retries would multiply the waits
            client = client.with_options(max_retries=0)
        self._client = client
        self._errors = SdkErrors(
            provider="openai",
            status=openai.APIStatusError,
            api=openai.APIError,
            timeout=openai.APITimeoutError,
            connection=openai.APIConnectionError,
            transport_timeout=httpx2.TimeoutException,
            transport=httpx2.RequestError,
            secrets=(client.api_key,) if client.api_key else (),
        )

    async def aclose(self) -> None:
        """Close the connections of the client this adapter made (one passed in is the
        caller's to close)."""
        if self._owns_client:
            await self._client.close()

    def __repr__(self) -> str:  # never the key
        return f"OpenAICompatible(model={self.model!r}, base_url={str(self._client.base_url)!r})"

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        fold = ChatFold()
        async for item in folded(self._open(request), fold, self._errors):
            yield item
        log.debug("openai usage for %s step %d: %r", request.run_id, request.step, fold.usage)

    async def _open(self, request: InferenceRequest) -> AsyncStream[ChatCompletionChunk]:
        from openai import omit

        tools = chat_tools(request.tools)
        return await self._client.chat.completions.create(
            model=self.model,
            messages=cast("list[ChatCompletionMessageParam]", chat_messages(request)),
            stream=True,
            stream_options={"include_usage": True},
            tools=cast("list[ChatCompletionToolParam]", tools) if tools else omit,
            max_tokens=omit if self.max_tokens is None else self.max_tokens,
            temperature=omit if self.temperature is None else self.temperature,
            extra_body=self.extra_body,
        )


def _client(
    sdk: Any, base_url: str | None, api_key: str | None, timeout_s: float, max_event_bytes: int
) -> AsyncOpenAI:
    base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
    api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
    if api_key is None and base_url is not None:
        api_key = PLACEHOLDER_KEY
    if api_key is None:
        raise ValueError("OpenAICompatible needs api_key=, OPENAI_API_KEY, or a base_url")
    hooks = {"response": [event_bound_hook(max_event_bytes)]}
    client: AsyncOpenAI = sdk.AsyncOpenAI(
        api_key=api_key,
        base_url=base_url,
        timeout=timeout_s,
        max_retries=0,
        http_client=sdk.DefaultAsyncHttpxClient(event_hooks=hooks),
    )
    return client


# ---- the request ----------------------------------------------------------------------


def chat_messages(request: InferenceRequest) -> list[dict[str, Any]]:
    """The Chat Completions ``messages`` of a request: its system prompt and history."""
    system = request.system
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    out.extend(_chat_message(m, request.json_depth) for m in request.messages)
    return out


def _chat_message(message: RequestMessage, json_depth: int) -> dict[str, Any]:
    if isinstance(message, UserMessage | ContextMessage):
        return {"role": "user", "content": message.text}
    if isinstance(message, AssistantMessage):
        return _assistant(message, json_depth)
    assert isinstance(message, ToolResultMessage)
    content = f"error: {message.content}" if message.is_error else message.content
    return {"role": "tool", "tool_call_id": wire_id(message.call_id), "content": content}


def _assistant(message: AssistantMessage, json_depth: int) -> dict[str, Any]:
    if not message.tool_calls:
        return {"role": "assistant", "content": message.text}
    calls = [
        {
            "id": wire_id(use.call_id),
            "type": "function",
            "function": {
                "name": wire_name(use.tool),
                "arguments": sent_arguments(use.arguments, json_depth),
            },
        }
        for use in message.tool_calls
    ]
    return {"role": "assistant", "content": message.text or None, "tool_calls": calls}


def chat_tools(tools: tuple[dict[str, Any], ...] | None) -> list[dict[str, Any]]:
    """The ``tools`` list for Ratchet's tool schemas (empty when withheld)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("parameters", {"type": "object", "properties": {}}),
            },
        }
        for t in tools or ()
    ]


# ---- the stream -----------------------------------------------------------------------

MAX_CHUNK_FRAGMENTS = 1024
"""Tool call fragments in one chunk: a chunk is folded whole before ``tool_calls`` and
``response_bytes`` are asked about its deltas, and one 8 MiB event holds half a million
(a provider sends one per chunk, or a few calls whole)."""


@dataclass
class _Call:
    raw_id: str = ""
    """The id the model gave the call."""
    id: str = ""
    """The id it goes by: ``raw_id``, or ``raw_id#2``... when an earlier call has that
    (``call_<index>`` when the model gave none)."""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class ChatFold:
    """Folds a stream's chunks into deltas as they come and the response at the end."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: str | None = None
    reported: Reported = field(default_factory=Reported)
    cached: Reported = field(default_factory=Reported)
    model: str = ""
    ids: set[str] = field(default_factory=set, repr=False)
    """Every call's id so far (``distinct_id`` asks for them once per call)."""

    def add(self, chunk: ChatCompletionChunk) -> list[ModelDelta]:
        try:
            return self._add(chunk)
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # JSON, not a chunk
            message = f"openai: unreadable chunk: {unreadable(exc)}"
            raise ModelUnavailable("malformed_stream", message) from exc

    def _add(self, chunk: ChatCompletionChunk) -> list[ModelDelta]:
        if chunk.usage is not None:  # one of the wrong shape counts nothing, erases nothing
            self.reported.add(chunk.usage, USAGE_FIELDS)
            self.cached.add(getattr(chunk.usage, "prompt_tokens_details", None), CACHED)
            self.model = model_name(getattr(chunk, "model", None))
        deltas: list[ModelDelta] = []
        for choice in wire_list(chunk.choices, "choices"):
            wire_object(choice, "a choice")
            if choice.index != 0:  # one choice is asked for (n=1); ignore any other
                continue
            finished = self.finish_reason
            if choice.delta is not None:
                wire_object(choice.delta, "a choice's delta")
                deltas.extend(self._delta(choice.delta))
            if finished is not None and (
                deltas or (choice.finish_reason and choice.finish_reason != finished)
            ):  # a call sent after the end, or an end said again otherwise
                raise ModelUnavailable(
                    "malformed_stream", f"openai: output after the choice finished ({finished})"
                )
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
                if self.cut_in_calls() and finished is None:
                    deltas.append(Refusing(reason="max_tokens"))
        return deltas

    def _delta(self, delta: ChoiceDelta) -> list[ModelDelta]:
        out: list[ModelDelta] = []
        reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
        if isinstance(reasoning, str) and reasoning:
            out.append(ModelDelta(type="reasoning_delta", text=reasoning))
        for text in (wire_text(delta.content, "content"), wire_text(delta.refusal, "refusal")):
            if text:
                self.text.append(text)
                out.append(ModelDelta(text=text))
        fragments = wire_list(delta.tool_calls, "tool_calls")
        if len(fragments) > MAX_CHUNK_FRAGMENTS:  # folded whole before any limit is asked
            raise ModelUnavailable(
                "malformed_stream",
                f"openai: a chunk of {len(fragments)} tool call fragments "
                f"(at most {MAX_CHUNK_FRAGMENTS})",
            )
        for fragment in fragments:
            wire_object(fragment, "a tool call fragment")
            index = self._index_of(fragment)
            call = self.calls.setdefault(index, _Call())
            raw_id = wire_text(fragment.id, "a tool call's id")
            if raw_id and call.raw_id and raw_id != call.raw_id:  # two at one index
                raise ModelUnavailable(
                    "malformed_stream",
                    f"openai: call {raw_id!r} at the index of {call.raw_id!r}",
                )
            if raw_id and not call.raw_id:
                call.raw_id = raw_id  # a late one: the call keeps the id it goes by
            if not call.id:
                # a gateway that sends no id gets one by index, so the deltas still group;
                # distinct from every other call's, a real "call_1" included
                call.id = distinct_id(call.raw_id or f"call_{index}", self.ids)
                self.ids.add(call.id)
            function = fragment.function
            name = arguments = ""
            if function is not None:
                wire_object(function, "a tool call's function")
                name = wire_text(function.name, "a tool call's function.name")
                arguments = wire_text(function.arguments, "a tool call's function.arguments")
            call.name = call.name or name
            call.arguments.append(arguments)
            out.append(
                ModelDelta(type="tool_call_delta", call_id=call.id, tool=call.name, text=arguments)
            )
        return out

    def _index_of(self, fragment: Any) -> int:
        """The call a fragment belongs to: its ``index``, as the documented shape numbers
        every call. Without one (Gemini's OpenAI-compatible endpoint sends each call
        whole, unindexed), a fragment with an id other than the last call's begins the
        next call, and one without an id goes on with the last; any other index is not
        this protocol (malformed_stream)."""
        index = fragment.index
        if index is not None:
            return wire_index(index, "a tool call fragment's index")
        if not self.calls:
            return 0
        last = max(self.calls)
        starts = fragment.id and fragment.id != self.calls[last].raw_id
        return last + 1 if starts else last

    @property
    def usage(self) -> Usage | None:
        if not self.reported.any:
            return None
        return Usage(
            input_tokens=self.reported.count("prompt_tokens"),
            output_tokens=self.reported.count("completion_tokens"),
            cached_tokens=self.cached.count("cached_tokens"),
            model=self.model,
        )

    def cut_in_calls(self) -> bool:
        """The answer was cut by its token limit with calls in it: the last may be cut
        short, and reads whole all the same (no arguments yet, ``{}``)."""
        return self.finish_reason == "length" and bool(self.calls)

    def response(self) -> ModelResponse:
        if self.finish_reason is None:
            raise ModelUnavailable("stream_cut", "openai: the stream ended before a finish_reason")
        if self.cut_in_calls():  # as ``Refusing`` said it: one decision
            raise ModelRefused(
                "max_tokens",
                "openai: the answer was cut (length) in its calls; raise max_tokens",
                usage=self.usage,
            )
        uses = tuple(
            ToolUse(
                call_id=CallId(call.id),
                tool=call.name,
                # no argument text at all means no arguments: the tool gets {}
                arguments=joined(call.arguments) or "{}",
            )
            for _, call in sorted(self.calls.items())
        )
        return ModelResponse(text=joined(self.text), tool_calls=uses, usage=self.usage)


USAGE_FIELDS = ("prompt_tokens", "completion_tokens")
CACHED = ("cached_tokens",)


def usage_of(chunk: ChatCompletionChunk) -> Usage | None:
    """The usage a chunk reports (the last one, with ``include_usage``), if any. The SDK
    builds chunks unvalidated: "usage" may be 5, "n/a" or a list, which is bookkeeping
    gone wrong, not a reason to throw the model's answer away."""
    fold = ChatFold()
    fold.add(chunk)
    return fold.usage
