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

_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r", b"\n\r")
"""An event ends at an empty line: two line ends in a row (LF, CR or CRLF). ``\\n\\r``
also starts ``\\n\\r\\n``; taken for an end where it is not one, it only lets more in."""


class EventTooLarge(Exception):
    """One server-sent event (or a body with no blank line) passed its bound."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"a server-sent event over {limit} bytes")
        self.limit = limit


class _EventBytes:
    """Counts the bytes since the last event's end, across the chunks of a body."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.since = 0
        self.last = b""

    def feed(self, chunk: bytes) -> None:
        # the last bytes before it too, so an end cut between two chunks is found whole;
        # an end wholly among them was counted with their chunk
        window = self.last + chunk
        after = len(self.last)
        for pattern in _ENDS:
            at = window.rfind(pattern)
            if at >= 0:
                after = max(after, at + len(pattern))
        self.since = len(window) - after if after > len(self.last) else self.since + len(chunk)
        self.last = window[-3:]
        if self.since > self.limit:
            raise EventTooLarge(self.limit)


def event_bound_hook(limit: int) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """An httpx ``response`` event hook bounding every event of the body as it is read.
    A hook, not a transport: it holds whatever transport the client picks (a proxy's
    from the environment included). The SDKs read the body with ``aiter_bytes``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_event_bytes is a positive number of bytes, not {limit!r}")

    async def bound(response: Any) -> None:
        read = response.aiter_bytes

        async def bounded(chunk_size: int | None = None) -> AsyncIterator[bytes]:
            events = _EventBytes(limit)
            async for chunk in read(chunk_size):
                events.feed(chunk)
                yield chunk

        response.aiter_bytes = bounded

    return bound


__all__ = ["MAX_EVENT_BYTES", "EventTooLarge", "event_bound_hook"]
