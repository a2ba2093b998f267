"""Requests an MCP server sends its client (ping, sampling, roots/list), held to a bound.

The SDK's session answers each in a task of its own, spawned as the request is read: a
server that sends them faster than it reads the answers (or reads none) had a task per
request waiting to write its answer, without bound (100,000 pings, 6 MB, held 1 GB and
93,000 tasks on the host's loop for the minute they took). A session answers at most
``MAX_SERVER_REQUESTS`` at a time; a request past them is dropped unread, and the server,
which asked, waits for an answer it will not get.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcp.shared.message import SessionMessage

log = logging.getLogger("ratchet.mcp")

MAX_SERVER_REQUESTS = 64
"""The server's requests a session answers at a time (a live server has one or two)."""


class ServerRequests:
    """The ids of the server's requests a session is answering."""

    def __init__(self, label: str, bound: int = MAX_SERVER_REQUESTS) -> None:
        self._label = label
        self._bound = bound
        self._open: Counter[object] = Counter()
        """Each id the session is answering, and how many times (a server may reuse one)."""
        self._count = 0
        """The requests being answered: ``_open``'s total, kept (summing it at every
        request made a flood's checks cost more with every request answered)."""
        self._dropped = 0

    def admit(self, item: SessionMessage | Exception) -> bool:
        """Whether to hand ``item`` (as read) to the session: not a request of the
        server's past the bound."""
        from mcp.types import JSONRPCRequest

        message = getattr(item, "message", None)
        if not isinstance(message, JSONRPCRequest):
            return True
        if self._count < self._bound:
            self._open[message.id] += 1
            self._count += 1
            return True
        if self._dropped == 0:
            log.warning(
                "MCP server %s sent more than %d requests unanswered: more are dropped",
                self._label,
                self._bound,
            )
        self._dropped += 1
        return False

    def answered(self, item: SessionMessage) -> None:
        """Note an answer the session has written (or failed to write)."""
        from mcp.types import JSONRPCError, JSONRPCResponse

        message = item.message
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id in self._open:
            self._count -= 1
            self._open[message.id] -= 1
            if not self._open[message.id]:  # ids answered are forgotten: a flood's ids
                del self._open[message.id]  # (each answered) held memory and each look
