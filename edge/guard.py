"""The ASGI guard in front of every route: the bearer token, then the body's size.

It wraps the whole application (the OpenAPI schema, unknown paths, the console and any
websocket included), so no route can forget it. The one exception is ``public``: the
requests it names (the console's shell and assets, ``edge.console.is_public``, which
hold no data) are served without a token. Tokens are compared with
``hmac.compare_digest`` against every configured token (no early exit: the time taken
says nothing about which token nearly matched) and never logged or echoed. A body is
refused with 413 before it is read past ``max_body_bytes``: at once by its
Content-Length, or as it streams in without one (``BodyTooLarge``, answered by the
app's problem handler).
"""

from __future__ import annotations

import codecs
import hmac
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edge.options import is_loopback
from edge.problems import PROBLEM_JSON, problem_body


class BodyTooLarge(HTTPException):
    """A streamed body passed the cap. An HTTPException, so that the framework's body
    parsing lets it through (it turns any other error into a 400)."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        got = f"{size} bytes" if size is not None else "more"
        super().__init__(413, f"request body refused (body_bytes): {got}; the limit is {limit}")


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        tokens: tuple[str, ...],
        max_body_bytes: int,
        public: Callable[[str, str], bool] | None = None,
        origins: tuple[str, ...] = (),
    ) -> None:
        """``public(method, path)``: whether an HTTP request needs no token. With no
        tokens (``--no-auth``, loopback only) a request is served only if addressed to a
        loopback name and, from a browser, sent by the server's own page or one of
        ``origins`` (``--cors-origin``): see ``_local``."""
        self.app = app
        self._tokens = tuple(t.encode() for t in tokens)
        self.max_body_bytes = max_body_bytes
        self._public = public
        self._origins = frozenset(o.encode() for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        refused = None if self._tokens else self._local(headers)
        if refused is not None:
            if scope["type"] == "websocket":
                await receive()
                await send({"type": "websocket.close", "code": 1008})
                return
            await _problem(send, scope, 403, "NotLocal", refused)
            return
        if self._tokens and not self._open(scope, headers):
            if scope["type"] == "websocket":  # closed before it is accepted: HTTP 403
                await receive()
                await send({"type": "websocket.close", "code": 1008})
                return
            await _problem(send, scope, 401, "Unauthorized", "a valid bearer token is required")
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        refused_query = _query_problem(scope.get("query_string", b""))
        if refused_query is not None:
            limit, detail = refused_query
            await _problem(send, scope, 422, "InputRefused", detail, limit=limit)
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            detail = BodyTooLarge(self.max_body_bytes, int(length)).detail
            await _problem(send, scope, 413, "InputRefused", detail, limit="body_bytes")
            return
        if scope["method"] in BODILESS:
            # no route reads one: a body sent anyway is dropped as it arrives, never refused
            # midway (a stream's response has started by then, and would be cut)
            await self.app(scope, _dropped(receive), send)
            return
        await self.app(scope, self._capped(receive), send)

    def _open(self, scope: Scope, headers: dict[bytes, bytes]) -> bool:
        """A valid token, or an HTTP request the public rule names."""
        if self._authorised(headers.get(b"authorization", b"")):
            return True
        public = self._public
        return (
            public is not None
            and scope["type"] == "http"
            and public(scope["method"], scope["path"])
        )

    def _local(self, headers: dict[bytes, bytes]) -> str | None:
        """Why a request to a server with no token is refused, or None. Its loopback
        address keeps other machines out, not other web pages in a browser on this one:
        a page elsewhere can send a POST that needs no preflight (a cancel has no body),
        and one whose name it points at 127.0.0.1 (DNS rebinding) is, to the browser, on
        the server's own origin. So the ``Host`` must be a loopback name, and a browser's
        ``Origin``, if sent, the server's own or a ``--cors-origin``."""
        host = headers.get(b"host", b"")
        if not is_loopback(_hostname(host)):
            shown = host[:100].decode("latin-1")
            return f"no token here: only requests to a loopback name, not {shown!r}"
        origin = headers.get(b"origin")
        if origin is None or origin in self._origins:
            return None
        if origin not in (b"http://" + host, b"https://" + host):
            shown = origin[:100].decode("latin-1")
            return f"no token here: no page of another origin ({shown!r})"
        return None

    def _authorised(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        matches = [hmac.compare_digest(token.strip(), known) for known in self._tokens]
        return any(matches)

    def _capped(self, receive: Receive) -> Receive:
        seen = 0
        utf8 = codecs.getincrementaldecoder("utf-8")()

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                _check_utf8(utf8, body, not message.get("more_body", False))
            return message

        return capped


class NoSniff:
    """Every response is served as the type it names (JSON, problem JSON, an event
    stream), never sniffed into another: a browser that took a problem echoing a bad id
    for HTML would run what the id held. Outermost, so the guard's own refusals and a
    refused CORS preflight carry it too."""

    HEADER = (b"x-content-type-options", b"nosniff")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if all(name.lower() != self.HEADER[0] for name, _ in headers):
                    message = {**message, "headers": [*headers, self.HEADER]}
            await send(message)

        await self.app(scope, receive, sending)


class BodyNotUtf8(HTTPException):
    """A body that is not UTF-8, as the framework's own parse failure is answered (a 400
    whose cause is a UnicodeDecodeError: ``edge.problems`` makes it 422, ``utf8``)."""

    def __init__(self) -> None:
        super().__init__(400, "There was an error parsing the body")


def _check_utf8(decoder: codecs.IncrementalDecoder, chunk: bytes, last: bool) -> None:
    """Every body is JSON, which travels as UTF-8 (RFC 8259). Python's parser would take
    UTF-16 and UTF-32 too, by their byte patterns: such a text holds NUL bytes, which
    JSON in UTF-8 never does (a control character in a string is escaped)."""
    nul = chunk.find(b"\x00")
    if nul >= 0:
        why = "a NUL byte (UTF-16 or UTF-32 text?)"
        raise BodyNotUtf8() from UnicodeDecodeError("utf-8", chunk, nul, nul + 1, why)
    try:
        decoder.decode(chunk, final=last)
    except UnicodeDecodeError as exc:
        raise BodyNotUtf8() from exc


BODILESS = ("GET", "HEAD")
"""Methods whose routes read no body."""


def _query_problem(query: bytes) -> tuple[str, str] | None:
    """Why the query string is refused, as (limit, detail), or None.

    - a key given twice (``duplicate_key``): the framework keeps the last, a proxy or a
      log in front may read the first (``?run_id=a&run_id=b`` would name two Runs);
    - a key or value whose percent-decoded bytes are not UTF-8 (``utf8``): the framework
      turns them into U+FFFD, which then passed for an id (a cursor that names no thread
      listed an empty last page), where the same bytes in the path are refused.
    """
    seen: set[bytes] = set()
    for part in query.split(b"&"):  # as the framework splits it (``parse_qsl``)
        if not part:
            continue
        raw_key, _, raw_value = part.partition(b"=")
        key = unquote_to_bytes(raw_key.replace(b"+", b" "))  # run%5Fid is run_id there too
        shown = key.decode("utf-8", "replace")
        for text in (key, unquote_to_bytes(raw_value.replace(b"+", b" "))):
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                return "utf8", f"the query's {shown!r:.80} is not UTF-8 once percent-decoded"
        if key in seen:
            return "duplicate_key", f"the query names {shown!r:.80} twice: no route takes a list"
        seen.add(key)
    return None


_HOST = re.compile(r"(?:\[([0-9A-Fa-f:.]*)\]|([^:\[\]]*))(?::[0-9]{1,5})?")
"""A whole ``Host`` header: a bracketed IPv6 address or a name without a colon, then at
most a port."""


def _hostname(host: bytes) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` → ``::1``); ""
    unless the whole header is a name and at most a port: taking what came before its
    last colon read ``localhost:1@evil.example`` as ``localhost``."""
    matched = _HOST.fullmatch(host.decode("latin-1"))
    return "" if matched is None else matched[1] or matched[2] or ""


def _dropped(receive: Receive) -> Receive:
    async def dropped() -> Message:
        message = await receive()
        if message["type"] == "http.request" and message.get("body"):
            message = {**message, "body": b""}
        return message

    return dropped


async def _problem(
    send: Send, scope: Scope, status: int, kind: str, detail: str, **extra: Any
) -> None:
    """The problem response, sent as is: the guard answers before the framework runs."""
    payload = json.dumps(problem_body(status, kind, detail, scope.get("path"), **extra)).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(payload)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="ratchet"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
