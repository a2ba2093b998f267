"""The HTTP client a streamable-HTTP session talks through (the SDK's ``http_client``
hook), reading what the server sends within bounds.

The SDK reads a POST's JSON body whole before it parses it (``response.aread()``), as
httpx does any response it is not asked to stream: nothing bounded it, and a server
could send gigabytes, or gzip a few into kilobytes. ``BoundedClient.send`` reads each
such body itself, decoded, up to ``MAX_REPLY_BYTES``; an SSE stream is left to the SDK,
which bounds each event (``max_sse_event_size``, set to the same bound).

The JSON body of a POST that carried a request is that request's answer, and is handed
to the SDK as one (``mcp_reply.http_answer``): a reply past the bound, one no JSON-RPC
answer, or one the SDK cannot parse (nested too deep, say) becomes an error answer
marked unreadable, so that its call is lost at once rather than told it failed (the SDK
made a "parse error" of it, which the model saw as the tool's failure though the server
may have run it) or left waiting (an answer of another id, or none, resolved nothing).
"""

from __future__ import annotations

import json
from typing import Any

import httpx2

from runtime.adapters.mcp_reply import http_answer
from runtime.limits import MIB

MAX_REPLY_BYTES = 16 * MIB
"""The largest body (decoded) or SSE event an HTTP server may send: as ``mcp_lines``
allows a stdio server's line."""

_DROPPED = frozenset({"content-encoding", "content-length", "transfer-encoding"})
"""Headers that describe the body as sent, not as handed on (decoded, whole)."""


class BoundedClient(httpx2.AsyncClient):
    """An ``httpx2.AsyncClient`` whose responses, but SSE streams, are read within
    ``MAX_REPLY_BYTES``."""

    async def send(self, request: httpx2.Request, *, stream: bool = False, **kwargs: Any) -> Any:
        response = await super().send(request, stream=True, **kwargs)
        kind = response.headers.get("content-type", "").lower()
        if stream and (request.method != "POST" or kind.startswith("text/event-stream")):
            return response  # an SSE stream (its events bounded by the SDK), or a GET's
        body = await _read(response)
        asked = _request_id(request) if kind.startswith("application/json") else None
        if asked is not None and response.is_success:
            body = http_answer(body, asked, MAX_REPLY_BYTES)
        read = httpx2.Response(
            response.status_code,
            headers=[(k, v) for k, v in response.headers.multi_items() if k not in _DROPPED],
            content=body or b"",  # past the bound: the SDK reads an error of the status
            request=request,
            extensions=response.extensions,
            history=response.history,
        )
        read.next_request = response.next_request
        return read


async def _read(response: httpx2.Response) -> bytes | None:
    """The response's body, decoded, or None once it passes ``MAX_REPLY_BYTES``."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_bytes():  # decoded a MiB at a time at most
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                return None
            chunks.append(chunk)
    finally:
        await response.aclose()
    return b"".join(chunks)


def _request_id(request: httpx2.Request) -> str | int | None:
    """The id of the JSON-RPC request a POST carried (None for a notification)."""
    try:
        sent = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return None
    if not isinstance(sent, dict) or "method" not in sent:
        return None
    asked = sent.get("id")
    return asked if isinstance(asked, str | int) and not isinstance(asked, bool) else None
