"""A local HTTP server that speaks OpenAI's and Anthropic's streaming wire formats.

The formats are the providers' documented ones, from their API references:

- OpenAI Chat Completions streaming (API reference, "Create chat completion" with
  ``stream: true`` and "The chat completion chunk object",
  https://platform.openai.com/docs/api-reference/chat-streaming): server-sent events of
  data only, ``data: {chat.completion.chunk JSON}\\n\\n``; a tool call's first fragment
  carries ``index``, ``id``, ``type`` and ``function.name``, the next ones ``index`` and
  ``function.arguments`` pieces; the last choice chunk has a ``finish_reason``; with
  ``stream_options.include_usage`` one more chunk has ``choices: []`` and ``usage``; then
  ``data: [DONE]``. Errors: ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes).
- Anthropic Messages streaming (https://docs.anthropic.com/en/docs/build-with-claude/streaming):
  named events ``message_start``, then per content block ``content_block_start`` /
  ``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``,
  ``ping`` anywhere, then ``message_delta`` (``stop_reason``, ``usage``) and
  ``message_stop``; an ``error`` event may come mid-stream. Errors:
  ``{"type": "error", "error": {"type", "message"}}``
  (https://docs.anthropic.com/en/api/errors), 529 for ``overloaded_error``.

Each request takes the next scripted reply; the server records what it received so a
test can assert what an adapter sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"


@dataclass(frozen=True)
class Sse:
    """A 200 event stream of ``frames``, then ``ending``: ``eof`` ends the body; ``cut``
    closes the connection without ending it (a dropped stream); ``hang`` sends nothing
    more until the server stops (a stalled stream); ``keepalive`` sends ``keepalive``
    every ``gap_s`` until the server stops (a stream held open, which no SDK's read
    timeout ends: Anthropic's ``ping`` events, an SSE comment line)."""

    frames: Sequence[bytes]
    ending: Literal["eof", "cut", "hang", "keepalive"] = "eof"
    gap_s: float = 0.0
    """A pause between frames, as a model that generates slowly has."""
    keepalive: bytes = b": keepalive\n\n"
    gzip: bool = False
    """The body sent gzip-compressed (``Content-Encoding: gzip``)."""


@dataclass(frozen=True)
class Status:
    """An error status with a JSON body."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stall:
    """Answer nothing until the server stops (the client's timeout must fire)."""


Reply = Sse | Status | Stall


@dataclass(frozen=True)
class Received:
    path: str
    headers: Mapping[str, str]
    """Lower-cased names."""
    body: dict[str, Any]


class FakeProvider:
    """One server on 127.0.0.1, on a port of its own (bound to port 0)."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.received: list[Received] = []
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_post(OPENAI_PATH, self._handle)
        app.router.add_post(ANTHROPIC_PATH, self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self.port = 0

    def reply(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        self._release.set()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received(request.path, headers, await request.json()))
        if not self.replies:
            return web.json_response({"error": {"message": "no reply scripted"}}, status=500)
        reply = self.replies.popleft()
        if isinstance(reply, Status):
            return web.json_response(dict(reply.body), status=reply.status, headers=reply.headers)
        if isinstance(reply, Stall):
            await self._release.wait()
            return web.json_response({}, status=500)
        return await self._stream(request, reply)

    async def _stream(self, request: web.Request, reply: Sse) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if reply.gzip:
            response.enable_compression(web.ContentCoding.gzip)
        await response.prepare(request)
        for i, frame in enumerate(reply.frames):
            if i and reply.gap_s:
                await asyncio.sleep(reply.gap_s)  # the server's pace, not a test's wait
            await response.write(frame)
        if reply.ending == "hang":
            await self._release.wait()
        while reply.ending == "keepalive" and not self._release.is_set():
            await response.write(reply.keepalive)
            with contextlib.suppress(TimeoutError):  # the server's pace
                await asyncio.wait_for(self._release.wait(), reply.gap_s)
        if reply.ending == "cut":
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response


# ---- OpenAI ---------------------------------------------------------------------------


def openai_chunk(
    delta: Mapping[str, Any] | None = None,
    finish_reason: str | None = None,
    *,
    usage: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``usage`` the final usage chunk (no choices)."""
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "gpt-test-2024",
        "system_fingerprint": "fp_1",
        "choices": [],
    }
    if usage is not None:
        chunk["usage"] = dict(usage)
    else:
        chunk["choices"] = [
            {
                "index": 0,
                "delta": dict(delta or {}),
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ]
    return chunk


USAGE = {
    "prompt_tokens": 31,
    "completion_tokens": 9,
    "total_tokens": 40,
    "prompt_tokens_details": {"cached_tokens": 12},
}


def data(payload: Mapping[str, Any] | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n".encode()


def openai_stream(
    *chunks: Mapping[str, Any], finish_reason: str | None = "stop", done: bool = True
) -> Sse:
    """A role chunk, ``chunks``, the finishing chunk, the usage chunk and ``[DONE]``."""
    frames = [data(openai_chunk({"role": "assistant", "content": ""}))]
    frames += [data(c) for c in chunks]
    if finish_reason is not None:
        frames.append(data(openai_chunk({}, finish_reason)))
        frames.append(data(openai_chunk(usage=USAGE)))
    if done:
        frames.append(data("[DONE]"))
    return Sse(frames)


def openai_text(*parts: str) -> Sse:
    return openai_stream(*(openai_chunk({"content": p}) for p in parts))


def openai_call_start(index: int, call_id: str, name: str) -> dict[str, Any]:
    fragment = {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return openai_chunk({"tool_calls": [fragment]})


def openai_call_args(index: int, arguments: str) -> dict[str, Any]:
    return openai_chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


def openai_error(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


# ---- Anthropic ------------------------------------------------------------------------


def event(name: str, payload: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def message_start() -> bytes:
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-test-2025",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 25,
            "output_tokens": 1,
            "cache_read_input_tokens": 10,
            "cache_creation_input_tokens": 0,
        },
    }
    return event("message_start", {"type": "message_start", "message": message})


def text_block(index: int, *parts: str) -> list[bytes]:
    start = {"type": "content_block_start", "index": index}
    frames = [
        event("content_block_start", {**start, "content_block": {"type": "text", "text": ""}})
    ]
    for part in parts:
        delta = {"type": "text_delta", "text": part}
        frames.append(
            event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        )
    frames.append(event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return frames


def input_json(index: int, fragment: str) -> bytes:
    """One ``input_json_delta`` of the tool_use block at ``index``."""
    delta = {"type": "input_json_delta", "partial_json": fragment}
    return event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def tool_use_block(index: int, use_id: str, name: str, *fragments: str) -> list[bytes]:
    block = {"type": "tool_use", "id": use_id, "name": name, "input": {}}
    start = {"type": "content_block_start", "index": index, "content_block": block}
    frames = [event("content_block_start", start)]
    frames += [input_json(index, fragment) for fragment in fragments]
    frames.append(event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return frames


PING = event("ping", {"type": "ping"})


def message_delta(stop_reason: str | None, usage: object) -> bytes:
    delta = {"stop_reason": stop_reason, "stop_sequence": None}
    return event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})


def message_end(stop_reason: str = "end_turn") -> list[bytes]:
    return [
        message_delta(stop_reason, {"output_tokens": 15}),
        event("message_stop", {"type": "message_stop"}),
    ]


def anthropic_stream(*blocks: list[bytes], stop_reason: str = "end_turn") -> Sse:
    frames = [message_start(), PING]
    for block in blocks:
        frames += block
    return Sse(frames + message_end(stop_reason))


def anthropic_error(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}, "request_id": "req_1"}
