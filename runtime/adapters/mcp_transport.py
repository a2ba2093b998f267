"""The transports behind ``runtime.adapters.mcp_session``, and how their failures read.

``stdio_streams`` and ``http_streams`` open a server's streams (picklable through
``functools.partial``, so a server can be sent to another process). Over HTTP a 404 to
the session is noted by request id (``FORGOTTEN``): the server no longer knows the
session and ran nothing, though the SDK hands the call an error a server's own could
be. ``transport_failed`` tells the SDK's own "connection closed" from a server's error
of the same code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from mcp import MCPError


log = logging.getLogger("ratchet.mcp")


@asynccontextmanager
async def stdio_streams(
    command: str, args: tuple[str, ...], env: dict[str, str] | None, cwd: str | None
) -> AsyncIterator[Any]:
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from runtime.adapters.mcp_lines import BOUNDED, bound_stdio_servers

    command, args = _dying_with_this_process(command, args, env, cwd)
    # "replace": a byte that is no UTF-8 reads as U+FFFD. The SDK's default ("strict")
    # ended its reader of the server's stdout, and the session, open still, answered no
    # call again: each waited out its timeout, the server's answers lost with it
    params = StdioServerParameters(
        command=command, args=[*args], env=env, cwd=cwd, encoding_error_handler="replace"
    )
    bound_stdio_servers()
    async with contextlib.AsyncExitStack() as stack:
        spawning = BOUNDED.set(True)
        try:
            streams = await stack.enter_async_context(stdio_client(params))
        finally:
            BOUNDED.reset(spawning)
        yield streams


_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before the line above
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_this_process(
    command: str, args: tuple[str, ...], env: dict[str, str] | None, cwd: str | None
) -> tuple[str, tuple[str, ...]]:
    """On Linux, the server started through a few lines that have the kernel kill it
    when this process dies, then become the server (``exec``: same pid, nothing left
    between). The SDK starts it in a session of its own, so nothing else reaches it: a
    process killed with ``kill -9`` (an executor Ray restarts) left its servers running
    for good, a hung one included. A command that cannot be found is left as it is, for
    the SDK to say so."""
    from mcp.client.stdio import get_default_environment

    path = (get_default_environment() | (env or {})).get("PATH", os.defpath)  # the SDK's
    found = shutil.which(
        os.path.join(cwd or "", command) if os.sep in command else command, path=path
    )
    if not sys.platform.startswith("linux") or found is None:
        log.debug("MCP server %r started as it is: not found on its PATH", command)
        return command, args
    # -I -S: the server's environment (PYTHONPATH, PYTHONHOME) is not the wrapper's
    return sys.executable, ("-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), command, *args)


FORGOTTEN: ContextVar[set[object] | None] = ContextVar("mcp_forgotten", default=None)
"""Where an HTTP transport notes the requests its server answered 404 for the session
(set by the session that opens it: ``mcp_session._Link.forgotten``)."""


@asynccontextmanager
async def http_streams(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    from runtime.adapters.mcp_http import MAX_REPLY_BYTES, BoundedClient

    forgotten = FORGOTTEN.get()

    async def noted(response: httpx2.Response) -> None:
        """A 404 to a request of a session: the server no longer knows it (restarted, or
        it ended the session), and ran nothing. The SDK hands the call an error the
        server's own could be; its request id, noted here, tells them apart."""
        request = response.request
        if forgotten is None or response.status_code != 404 or request.method != "POST":
            return
        if "mcp-session-id" in request.headers:
            with contextlib.suppress(ValueError, AttributeError):
                forgotten.add(json.loads(request.content).get("id"))

    timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's: a response may stream for long
    async with (
        BoundedClient(
            headers=headers, timeout=timeout, event_hooks={"response": [noted]}
        ) as client,
        streamable_http_client(
            url, http_client=client, max_sse_event_size=MAX_REPLY_BYTES
        ) as streams,
    ):
        yield streams


def url_label(url: str) -> str:
    """The URL without what may hold a credential (userinfo, query, fragment)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def transport_failed(exc: MCPError) -> bool:
    """Whether an error is the SDK's word that the connection failed, not the server's.

    The SDK gives its own "connection closed" the code -32000, which JSON-RPC leaves to
    servers (-32000 to -32099): a live server's -32000 "card declined" is its answer.
    The SDK's are told by their words — over stdio raised when the stream ends, over
    HTTP also put in the stream as if the server had sent them (``streamable_http``:
    a connection cut, an SSE stream that ended without the answer). A server that says
    these words of itself is taken at them: its call is lost, not answered."""
    from mcp.types import CONNECTION_CLOSED

    said = str(exc.message)
    return bool(exc.code == CONNECTION_CLOSED) and (
        said == "Connection closed" or said.startswith(("SSE stream ended", "SSE stream failed"))
    )
