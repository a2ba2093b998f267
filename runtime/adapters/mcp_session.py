"""The sessions behind ``runtime.adapters.mcp``: one per process and server, opened by
the first call in the running event loop, shared by concurrent calls, and replaced by
a fresh one after it dies (never mended under a call) or hangs: a server that keeps its
pipe open but answers nothing is pinged once a call passes its deadline, and its session
ended if the ping goes unanswered (``PING_TIMEOUT_S``).

Which calls the session had handed to its transport is noted as they go
(``_NotingWrite``), so that a session that ends tells a call that cannot have reached
the server (``McpUnavailable``: sent again as usual) from one the server may have run
(``McpConnectionLost``: the call is Lost and its pinned recovery policy decides).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

from pydantic import ValidationError

from runtime.adapters.mcp_asked import ServerRequests
from runtime.adapters.mcp_reply import reread, unreadable
from runtime.adapters.mcp_schema import session_class
from runtime.adapters.mcp_transport import (
    FORGOTTEN,
    http_streams,
    stdio_streams,
    transport_failed,
    url_label,
)
from runtime.limits import printable
from runtime.tool_calls import cancelled_at_deadline
from runtime.tools import OutcomeUnknown, ToolContext, ToolResult, UnavailableBeforeDispatch

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp.shared.message import SessionMessage
    from mcp.types import CallToolResult, ContentBlock, RequestParamsMeta
    from mcp.types import Tool as ListedTool


log = logging.getLogger("ratchet.mcp")

CONTEXT_PARAM = "__ratchet_context__"
"""Where Tool.invoke hands a call its ToolContext (it replaces an argument of that name,
which no listed schema may declare)."""
OPEN_TIMEOUT_S = 30.0
"""How long a server may take to answer initialize and tools/list."""
MAX_LIST_PAGES = 100
"""Pages of ``tools/list`` read at most: a server that hands out cursors without end
(the same one again, say) would otherwise be listed for ever, its tools piling up."""
PING_TIMEOUT_S = 5.0
"""How long a server has to answer the ping sent once a call passes its deadline. One
that does not (deadlocked, stopped) keeps its pipe open, so nothing else would end its
session: it is ended, and the next call opens a fresh one (a stdio server is killed). A
server whose tool blocks its own event loop for longer looks hung too."""
CLOSE_WAIT_S = 10.0
"""How long ``aclose`` waits for a session to end before cancelling it: an HTTP server
stopped mid-read held it for the client's read timeout (300 s); a stdio server is
killed and reaped within a few seconds (the SDK's own bound)."""

_T = TypeVar("_T")


async def _ended(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for sessions to end, cancelling those still open after ``CLOSE_WAIT_S``."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


class McpUnavailable(UnavailableBeforeDispatch):
    """Nothing reached the MCP server: the call may be sent again."""


class McpConnectionLost(OutcomeUnknown):
    """The session ended while the server had the call: it may have run (the call is
    Lost: ``runtime.tool_calls.invoke_safely``)."""


class McpReplyUnreadable(OutcomeUnknown):
    """The server answered the call with a reply that cannot be read (``mcp_reply``): it
    may have run (the call is Lost)."""


# ---- servers and their sessions ---------------------------------------------------------


class McpServer:
    """An MCP server to list and call, and the one session per process its calls share.

    A copy sent to another process (pickled) carries no session: it opens its own."""

    def __init__(
        self,
        label: str,
        connect: Callable[[], AbstractAsyncContextManager[Any]],
        *,
        failing: str = "reached",
        open_timeout_s: float = OPEN_TIMEOUT_S,
    ) -> None:
        """Prefer ``stdio`` or ``http``. ``connect`` opens the transport's streams (a
        picklable callable, so that the server can be sent to another process)."""
        self.label = label
        self._connect = connect
        self._failing = failing
        self.open_timeout_s = open_timeout_s
        self._link: _Link | None = None
        self._ending: set[asyncio.Task[None]] = set()
        """Sessions replaced while still ending (a hung stdio server is killed as its
        session ends, seconds later): ``aclose`` waits for them too."""

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        cwd: str | None = None,
        open_timeout_s: float = OPEN_TIMEOUT_S,
    ) -> McpServer:
        """A subprocess speaking MCP on stdin/stdout; ``env`` is added to the few
        variables the SDK passes on (PATH, HOME, ...)."""
        connect = partial(
            stdio_streams, command, tuple(args), None if env is None else dict(env), cwd
        )
        label = " ".join((command, *args))
        return cls(label, connect, failing="started", open_timeout_s=open_timeout_s)

    @classmethod
    def http(
        cls,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        open_timeout_s: float = OPEN_TIMEOUT_S,
    ) -> McpServer:
        """A server speaking streamable HTTP at ``url``."""
        connect = partial(http_streams, url, dict(headers or {}))
        return cls(url_label(url), connect, open_timeout_s=open_timeout_s)

    def __repr__(self) -> str:
        return f"McpServer({self.label!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_link": None, "_ending": set()}

    @property
    def connected(self) -> bool:
        """Whether this process holds a live session to the server."""
        link = self._link
        return link is not None and link.pid == os.getpid() and link.live

    async def list_tools(self) -> list[ListedTool]:
        """Every tool the server lists, over a session of its own, closed after."""
        async with AsyncExitStack() as stack:
            return await self._listing(await self._open(stack, None))

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """One tools/call on this process's session, its operation id in ``_meta``."""
        from mcp import MCPError

        try:
            link, session = await self._session()
        except asyncio.CancelledError:
            if not cancelled_at_deadline():
                raise
            # its deadline came while the session was still opening: nothing was sent,
            # which only this call can tell (unavailable, tried again; not lost)
            why = f"the call was given up while its session to {self.label} was opening"
            raise McpUnavailable(why) from None
        meta = {"idempotency_key": ctx.operation_id, "attempt": ctx.attempt, "epoch": ctx.epoch}
        key = (str(ctx.operation_id), ctx.attempt)
        try:
            # an open map on the wire; the SDK types it as a TypedDict of its reserved keys
            result = await session.call_tool(name, arguments, meta=cast("RequestParamsMeta", meta))
        except asyncio.CancelledError:
            if cancelled_at_deadline():  # a slow tool, or a hung server: the ping tells
                link.check(session, self.label)
            raise
        except MCPError as exc:
            unread = unreadable(exc)
            if unread is not None:
                raise McpReplyUnreadable(f"MCP server {self.label}: {unread}") from exc
            if link.forgotten_call(key):  # the server answered 404 to the session: not run
                link.end()  # the next call opens a fresh session
                why = f"MCP server {self.label} no longer knows this session (restarted?)"
                raise McpUnavailable(why) from exc
            if not transport_failed(exc):  # the server answered, with an error
                return ToolResult(printable(f"MCP error {exc.code}: {exc.message}"), is_error=True)
            link.end()
            if key in link.sent:
                why = f"the session to MCP server {self.label} ended during the call"
                raise McpConnectionLost(why) from exc
            why = f"the session to MCP server {self.label} had ended before the call was sent"
            raise McpUnavailable(why) from exc
        except ValidationError as exc:  # a reply of the wrong shape (a content block of a
            # type the SDK does not know, "isError": null): it was sent, and may have run
            if key not in link.sent:
                raise McpUnavailable(f"the call to {self.label} could not be sent: {exc}") from exc
            why = f"MCP server {self.label} answered with a result of the wrong shape"
            raise McpReplyUnreadable(printable(f"{why}: {exc}")) from exc
        finally:
            link.sent.discard(key)
            link.request_ids.pop(key, None)
        return ToolResult(content=_result_text(result), is_error=result.is_error)

    async def aclose(self) -> None:
        """Close this process's session (a stdio server is stopped and reaped), waiting
        at most ``CLOSE_WAIT_S`` for each session to end before cancelling it."""
        link, self._link = self._link, None
        ending = [t for t in self._ending if t.get_loop() is asyncio.get_running_loop()]
        if link is None or link.pid != os.getpid() or link.loop.is_closed():
            await _ended(ending)
            return
        if link.loop is not asyncio.get_running_loop():
            link.loop.call_soon_threadsafe(link.ended.set)
            return
        link.ended.set()
        await _ended([link.task, *ending])

    async def _session(self) -> tuple[_Link, ClientSession]:
        loop = asyncio.get_running_loop()
        link = self._link
        if link is not None and link.serves(loop):
            await link.checked()
            link = self._link
        if link is None or not link.serves(loop):
            old = link
            if old is not None and old.pid == os.getpid() and not old.task.done():
                self._ending.add(old.task)  # still ending: a close waits for it
                old.task.add_done_callback(self._ending.discard)
            # made and started with no await in between: concurrent callers find this one
            link = self._link = _Link(loop)
            link.task = loop.create_task(self._hold(link), name=f"mcp session {self.label}")
        # shielded: one caller's cancellation must not cancel the opening its peers await
        return link, await asyncio.shield(link.ready)

    async def _hold(self, link: _Link) -> None:
        """Hold one session open until it ends or is closed: anyio's scopes must be left
        by the task that entered them, so no one caller can own the session."""
        try:
            async with AsyncExitStack() as stack:
                link.ready.set_result(await self._open(stack, link))
                link.live = True
                await link.ended.wait()
        except Exception as exc:
            if not link.ready.done():
                why = f"MCP server {self.label} cannot be {self._failing}"
                link.ready.set_exception(McpUnavailable(printable(f"{why}: {reason(exc)}")))
            else:  # the calls it failed learnt it from their own requests
                log.debug("session to MCP server %s ended: %s", self.label, reason(exc))
        finally:
            link.end()
            if not link.ready.done():  # cancelled while opening (its loop is closing)
                link.ready.set_exception(McpUnavailable(f"MCP server {self.label}: closed"))

    async def _open(self, stack: AsyncExitStack, link: _Link | None) -> ClientSession:
        """Start the transport and a session on ``stack``, initialized; a link's session
        is also listed, or the SDK would list it after a call, to check the result
        against the tool's outputSchema."""
        noting = FORGOTTEN.set(link.forgotten if link is not None else None)
        try:
            read, write = await stack.enter_async_context(self._connect())
        finally:
            FORGOTTEN.reset(noting)
        asked = ServerRequests(self.label)
        read = _WatchedRead(read, link.end if link is not None else _unwatched, asked)
        write = _NotingWrite(write, link, asked)
        session = await stack.enter_async_context(session_class()(read, write))
        await self._within(session.initialize())
        if link is not None:
            await self._listing(session)
        return session

    async def _listing(self, session: ClientSession) -> list[ListedTool]:
        """Every page of tools/list, within one ``open_timeout_s`` (not one per page: a
        server handing out pages slowly held its opening a hundred times as long)."""
        from mcp.types import PaginatedRequestParams

        async def pages() -> list[ListedTool]:
            page = await session.list_tools()
            tools, seen = list(page.tools), set[str]()
            while page.next_cursor:
                if page.next_cursor in seen or len(seen) + 1 >= MAX_LIST_PAGES:
                    raise ValueError(
                        f"tools/list handed out cursors past {MAX_LIST_PAGES} pages, or one twice"
                    )
                seen.add(page.next_cursor)
                cursor = PaginatedRequestParams(cursor=page.next_cursor)
                page = await session.list_tools(params=cursor)
                tools.extend(page.tools)
            return tools

        return await self._within(pages())

    async def _within(self, work: Coroutine[Any, Any, _T]) -> _T:
        try:
            return await asyncio.wait_for(work, self.open_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.open_timeout_s}s") from None


class _Link:
    """One session in one event loop of one process."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pid = os.getpid()
        self.ready: asyncio.Future[ClientSession] = loop.create_future()
        # a failed opening nobody awaits any more (its callers were cancelled) is no error
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.ended = asyncio.Event()
        """Set when the server's stream ends or the session is closed."""
        self.live = False
        self.sent: set[tuple[str, int]] = set()
        """(operation id, attempt) of each call whose request reached the transport."""
        self.request_ids: dict[tuple[str, int], object] = {}
        """Each call's JSON-RPC request id, while it is out."""
        self.forgotten: set[object] = set()
        """Request ids an HTTP server answered 404 for the session (``mcp_transport``)."""
        self.task: asyncio.Task[None]
        self.ping: asyncio.Task[None] | None = None
        """The ping sent after a call passed its deadline (``check``)."""

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self.loop is loop and self.pid == os.getpid() and not self.ended.is_set()

    def end(self) -> None:
        self.live = False
        self.ended.set()

    def forgotten_call(self, key: tuple[str, int]) -> bool:
        """Whether the server answered the call's request with a 404 for the session."""
        return key in self.request_ids and self.request_ids[key] in self.forgotten

    def check(self, session: ClientSession, label: str) -> None:
        """Ping the server (once at a time), ending the session if no answer comes within
        PING_TIMEOUT_S: a slow tool's server answers and keeps it, a hung one is replaced."""
        if (self.ping is None or self.ping.done()) and not self.ended.is_set():
            self.ping = self.loop.create_task(self._ping(session, label))

    async def checked(self) -> None:
        """Once the ping in flight, if any, is answered or given up: no call is sent to a
        session suspected of hanging before then (shielded: the ping is its peers' too)."""
        if self.ping is not None and not self.ping.done():
            await asyncio.shield(self.ping)

    async def _ping(self, session: ClientSession, label: str) -> None:
        try:
            await asyncio.wait_for(session.send_ping(), PING_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "MCP server %s did not answer a ping within %ss: a fresh session replaces it",
                label,
                PING_TIMEOUT_S,
            )
            self.end()
        except Exception as exc:  # an error answer is an answer; a closed session ends anyway
            log.debug("ping of MCP server %s: %s", label, reason(exc))


class _Stream:
    """A stream of the session's, passed through (``last_context`` included)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _WatchedRead(_Stream):
    """The session's read stream, telling its link when the server's stream ends (the
    SDK's dispatcher then fails the calls in flight; nothing else would notice), reading
    again the lines the SDK could not parse (``mcp_reply.reread``), and dropping the
    server's requests past those the session may answer at a time (``mcp_asked``)."""

    def __init__(self, inner: Any, on_end: Callable[[], None], asked: ServerRequests) -> None:
        super().__init__(inner)
        self._on_end = on_end
        self._asked = asked

    async def receive(self) -> SessionMessage | Exception:
        return await self._watch(self._inner.receive)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        return await self._watch(self._inner.__anext__)

    async def _watch(self, step: Callable[[], Awaitable[Any]]) -> SessionMessage | Exception:
        import anyio

        try:
            while True:
                item = reread(cast("SessionMessage | Exception", await step()))
                if self._asked.admit(item):
                    return item
        except (StopAsyncIteration, anyio.EndOfStream, anyio.ClosedResourceError):
            self._on_end()
            raise


def _unwatched() -> None:
    """A listing's session has no link to tell that its stream ended."""


class _NotingWrite(_Stream):
    """The session's write stream, noting each tools/call it hands to the transport: a
    call whose session then ends may have reached the server; one not handed over has not.
    A send the transport refuses ends the link: the session is closed. (A listing's
    session has no link: only its answers to the server's requests are noted.)"""

    def __init__(self, inner: Any, link: _Link | None, asked: ServerRequests) -> None:
        super().__init__(inner)
        self._link = link
        self._asked = asked

    async def send(self, item: SessionMessage, /) -> None:
        import anyio

        link = self._link
        key = None if link is None else _call_key(item)
        if link is not None and key is not None:
            link.sent.add(key)  # before the send: a cancelled send may still deliver
            link.request_ids[key] = getattr(item.message, "id", None)
        try:
            await self._inner.send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            if link is not None:
                if key is not None:  # refused whole: nothing left this process
                    link.sent.discard(key)
                link.end()
            raise
        finally:
            self._asked.answered(item)  # written, or never to be


def _call_key(item: SessionMessage) -> tuple[str, int] | None:
    from mcp.types import JSONRPCRequest

    message = item.message
    if not isinstance(message, JSONRPCRequest) or message.method != "tools/call":
        return None
    meta = (message.params or {}).get("_meta") or {}
    return str(meta.get("idempotency_key")), int(meta.get("attempt", 0))


def reason(exc: BaseException) -> str:
    """The innermost causes of a failure the SDK's task groups may have wrapped."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(reason(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _result_text(result: CallToolResult) -> str:
    """What the model sees of a CallToolResult: its text blocks, the others summarised;
    the structured content when there is no content at all."""
    if not result.content and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(_block_text(block) for block in result.content)


def _block_text(block: ContentBlock) -> str:
    from mcp.types import EmbeddedResource, ResourceLink, TextContent, TextResourceContents

    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, ResourceLink):
        return f"[resource link {block.name}: {block.uri}]"
    if isinstance(block, EmbeddedResource):
        resource = block.resource
        if isinstance(resource, TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        return f"[resource {resource.uri}: {resource.mime_type or 'binary'}, not shown]"
    return f"[{block.type} {block.mime_type}, {len(block.data)} base64 characters, not shown]"
