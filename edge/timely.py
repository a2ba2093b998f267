"""uvicorn's HTTP/1.1 protocol with a deadline for a caller between requests.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but only
until its next byte arrives, and a new connection has no deadline at all: a caller
with no token could open connections and send nothing, or a request's head one byte
at a time, or a body after the guard refused it with 401, and hold each socket for
good, until the server ran out of file descriptors (for its callers, its store and
its Ray client alike). Here a connection not within a request (its head not yet
received, or its answer sent) is closed ``HEAD_S`` after it was opened or answered,
however many bytes trickle in meanwhile. A request's body must then arrive whole within
``BODY_S`` of its head: a caller that passed the guard could otherwise send it a byte at
a time for good, holding the socket and the request's task. A request whose body is in
(or that has none) is left alone while it is answered (a stream that lasts hours among
them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_S = 30.0
"""Seconds a connection may take to send a request's head, counted from its opening or
from the answer to its previous request."""
BODY_S = 60.0
"""Seconds a request's body may take to arrive whole, counted from its head: the largest
body a route takes (``edge.app.max_body_bytes``, a few MiB at the default limits) at
some 100 KB/s."""


class TimelyH11(H11Protocol):
    head_s = HEAD_S
    body_s = BODY_S

    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._between_requests():
            self._disarm()  # a head arrived: the request is the app's (and the guard's)
            self._watch_body()

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._disarm()  # the connection is the websocket protocol's from now on
        super().handle_websocket_upgrade(event)
        self._unwatch_body()

    def on_response_complete(self) -> None:
        self._unwatch_body()  # answered: a body still coming is the head deadline's
        self._arm()  # first: a pipelined request the call below starts disarms it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unwatch_body()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_s, self._late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _watch_body(self) -> None:
        """The body deadline of the request now in, from its head on; gone once its
        body is whole (a request with none is whole with its head)."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            self._unwatch_body()
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_s, self._body_late, cycle)

    def _unwatch_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_late(self, cycle: Any) -> None:
        self._body_timer = None
        late = cycle is self.cycle and cycle.more_body and not cycle.response_complete
        if late and not self.transport.is_closing():
            self.transport.close()  # the app reading the body hears the caller left

    def _late(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


__all__ = ["BODY_S", "HEAD_S", "TimelyH11"]
