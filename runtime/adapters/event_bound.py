"""A bound on the bytes of one server-sent event, for the HTTP clients the adapters make.

The SDKs' SSE decoders hold an event's bytes until the blank line that ends it, and
no Ratchet limit sees them before: ``response_bytes`` counts the deltas an event
yields, the SDK's read timeout never fires while bytes keep coming, and only
``Agent.inference_timeout_s`` (600 s by default) ended an attempt whose provider sent
a ``data:`` line that never ends, at about 80 MB a second on loopback. So the body is
counted as the SDK reads it (decoded: a compressed body is counted once inflated),
and an event past the bound fails the attempt (``ModelUnavailable("malformed_stream")``,
retried like any broken stream). An error body is counted the same way: it holds no
blank line, so all of it is one event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

MAX_EVENT_BYTES = 8 * 1024 * 1024
"""The default bound. An event whole enough for the largest answer Ratchet takes fits:
``response_bytes`` and ``reasoning_bytes`` of characters (1.2 M) sent in one event, each
escaped as six bytes (``\\uXXXX``), is 7 MB."""

_ENDS = (b"\r\r", b"\n\n", b"\r\n\r\n")
"""The ends of an event as both SDKs' decoders find them (``_aiter_chunks``): the bytes
held so far end with two line ends in a row. Any other end (``\n\r`` is one to the
standard) is none to them: they go on holding the bytes, so the count goes on too."""

MAX_EVENT_LINES = 256
"""Lines in one event. The decoders join an event's lines one at a time (``data +=
line``: a copy of all before it per line), so an event of many short lines costs time
quadratic in its size under the byte bound (8 MiB of four-byte lines held the event
loop for minutes). A provider's event has a few lines (``event:``, ``data:``). An error
body's lines are not counted: it is read whole (a proxy's HTML page), never decoded."""


class EventTooLarge(Exception):
    """One server-sent event (or a body with no blank line) passed its bound."""

    def __init__(self, limit: int, unit: str = "bytes") -> None:
        super().__init__(f"a server-sent event over {limit} {unit}")
        self.limit = limit


class _EventBytes:
    """Counts the bytes and lines of the event under way as the SDKs' decoders hold
    them, across the chunks of a body: line by line, as they split each chunk."""

    def __init__(self, limit: int, lines: int | None = MAX_EVENT_LINES) -> None:
        self.limit, self.max_lines = limit, lines
        self.since = 0
        self.lines = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        for line in chunk.splitlines(keepends=True):
            self.tail = (self.tail + line)[-4:]
            if self.tail.endswith(_ENDS):  # the decoder hands the event on and starts over
                self.since = self.lines = 0
                self.tail = b""
                continue
            self.since += len(line.rstrip(b"\r\n"))  # its text: an end cut short is no text
            self.lines += 1
            if self.since > self.limit:
                raise EventTooLarge(self.limit)
            if self.max_lines is not None and self.lines > self.max_lines:
                raise EventTooLarge(self.max_lines, "lines")


def event_bound_hook(limit: int) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """An httpx ``response`` event hook bounding every event of the body as it is read.
    A hook, not a transport: it holds whatever transport the client picks (a proxy's
    from the environment included). The SDKs read the body with ``aiter_bytes``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_event_bytes is a positive number of bytes, not {limit!r}")

    async def bound(response: Any) -> None:
        read = response.aiter_bytes

        async def bounded(chunk_size: int | None = None) -> AsyncIterator[bytes]:
            decoded = response.status_code < 400  # as events, whatever its content type says
            events = _EventBytes(limit, MAX_EVENT_LINES if decoded else None)
            async for chunk in read(chunk_size):
                events.feed(chunk)
                yield chunk

        response.aiter_bytes = bounded

    return bound


__all__ = ["MAX_EVENT_BYTES", "MAX_EVENT_LINES", "EventTooLarge", "event_bound_hook"]
