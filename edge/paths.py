"""A thread id in a request's path, taken from the path as it was sent.

A thread id may hold any character the id rule allows (``runtime.limits.check_id``),
``/`` among them (a delegated child's thread id has one). A client sends it as one
percent-encoded path segment (``encodeURIComponent``, ``quote(id, safe="")``), but the
ASGI server decodes the whole path before the router sees it: ``/threads/x%2Fcommits``
would be routed as thread ``x``'s log, and bytes that are not UTF-8 would become U+FFFD.
So ``ThreadPaths`` reads the segment from the raw path, decodes it strictly (422
``InputRefused(utf8)`` otherwise), keeps it in the scope for ``routes.thread_of``, and
routes on the segment as sent (which holds no ``/``).
"""

from __future__ import annotations

import json
from urllib.parse import quote, unquote, unquote_to_bytes

from starlette.types import ASGIApp, Receive, Scope, Send

from edge.problems import PROBLEM_JSON, problem_body

THREAD_KEY = "ratchet.thread"
"""The scope key of the decoded thread id (``routes.thread_of`` reads it)."""
_PREFIX = b"/threads/"
_CONSOLE = b"/console/threads/"
"""The console's thread page: the same shell for every thread, but its address names
the thread its script shows, so bytes that are not UTF-8 are refused there too."""


class ThreadPaths:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" else None
        if raw and raw.startswith(_CONSOLE) and _strict(raw[len(_CONSOLE) :]) is None:
            await _refuse(send, raw)
            return
        if not raw or not raw.startswith(_PREFIX):
            await self.app(scope, receive, send)
            return
        segment, slash, rest = raw[len(_PREFIX) :].partition(b"/")
        thread = _strict(segment)
        if thread is None:
            await _refuse(send, raw)
            return
        routed = "/threads/" + quote(thread, safe="")
        if slash:  # the rest is decoded as the server decodes a path
            routed += "/" + unquote(rest.decode("ascii", "replace"))
        await self.app({**scope, THREAD_KEY: thread, "path": routed}, receive, send)


def _strict(segment: bytes) -> str | None:
    """The percent-decoded segment, if its bytes are UTF-8."""
    try:
        return unquote_to_bytes(segment).decode("utf-8")
    except UnicodeDecodeError:
        return None


async def _refuse(send: Send, raw: bytes) -> None:
    detail = "thread id refused (utf8): the path's bytes are not UTF-8"
    path = raw.decode("ascii", "backslashreplace")
    body = problem_body(422, "InputRefused", detail, path, limit="utf8")
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": 422, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


__all__ = ["THREAD_KEY", "ThreadPaths"]
