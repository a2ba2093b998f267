"""The Model port and a deterministic ScriptedModel for tests, demos and benchmarks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal, Protocol

from runtime.base import Frozen
from runtime.errors import ScriptExhausted
from runtime.ids import CallId, RunId
from runtime.limits import DEFAULT_LIMITS
from runtime.messages import RequestMessage, ToolUse


class InferenceRequest(Frozen):
    run_id: RunId
    step: int
    """Index of this Step within its Run (0-based)."""
    attempt: int
    messages: tuple[RequestMessage, ...]
    tools: tuple[dict[str, Any], ...] | None
    """Tool schemas, or None when tools are withheld (the last allowed step)."""
    system: str = ""
    """The agent's system prompt (``Agent.system``); an adapter sends it as the
    provider's system message."""
    json_depth: int = DEFAULT_LIMITS.json_depth
    """The Run's ``Limits.json_depth``. A past call whose arguments nest deeper was
    refused (answered with a tool error), and an adapter sends its arguments back as
    ``{}`` (``runtime.adapters.arguments``): a provider's parser may stop earlier."""


class ModelDelta(Frozen):
    type: Literal["text_delta", "reasoning_delta", "tool_call_delta"] = "text_delta"
    text: str
    """Text, or for ``tool_call_delta`` a fragment of the call's JSON arguments."""
    call_id: str | None = None
    """tool_call_delta only: the call the fragment belongs to."""
    tool: str | None = None
    """tool_call_delta only: the tool's name (on the call's first fragment at least)."""


class Refusing(ModelDelta):
    """Said by an adapter as soon as it knows the answer will be refused whatever follows
    (cut by its token limit inside its calls, declined), before the stream ends (the
    usage may still come): nothing streamed of it may be taken up, so its stream
    checkpoint is dropped at once. Anything that does not know it reads an empty text
    delta."""

    text: str = ""
    reason: str = ""


class Usage(Frozen):
    """What one inference used, as its provider counted it."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """Input tokens the provider served from its prompt cache (where it says)."""
    model: str = ""
    """The model id the provider answered with."""


class ModelResponse(Frozen):
    """The complete response: text, tool calls, or both."""

    text: str = ""
    tool_calls: tuple[ToolUse, ...] = ()
    usage: Usage | None = None
    """The provider's count of tokens, where it gives one (committed with the Step)."""


class Model(Protocol):
    def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        """Yield deltas, then exactly one ModelResponse last."""


def call(tool: str, call_id: str, **arguments: Any) -> ToolUse:
    """Shorthand for a scripted tool call."""
    return ToolUse(call_id=CallId(call_id), tool=tool, arguments=json.dumps(arguments))


ScriptEntry = ModelResponse | Callable[[InferenceRequest], ModelResponse]


class ScriptedModel:
    """Answers Step *n* of every Run with entry *n* of its script.

    Choosing by step (not by call count) keeps it deterministic across crashes: a
    recovered Run that asks again for Step *n* gets the same answer. ``consumed``
    tells whether every entry was served at least once.
    """

    def __init__(self, script: Sequence[ScriptEntry], latency_s: float = 0.0) -> None:
        if not script:
            raise ValueError("a script needs at least one response")
        self.script = tuple(script)
        self.latency_s = latency_s
        self.served: set[int] = set()

    @property
    def consumed(self) -> bool:
        return len(self.served) == len(self.script)

    def assert_consumed(self) -> None:
        left = sorted(set(range(len(self.script))) - self.served)
        if left:
            raise AssertionError(f"script entries {left} were never served")

    def respond(self, request: InferenceRequest) -> ModelResponse:
        if request.step >= len(self.script):
            raise ScriptExhausted(
                f"script has {len(self.script)} responses; step {request.step} asked for more"
            )
        self.served.add(request.step)
        entry = self.script[request.step]
        return entry(request) if callable(entry) else entry

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        response = self.respond(request)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        for word in _chunks(response.text):
            yield ModelDelta(text=word)
        yield response


def _chunks(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words) if text]
