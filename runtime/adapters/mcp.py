"""MCP servers' tools as Ratchet tools, on the ``mcp`` SDK (extra ``ratchet[mcp]``).

``mcp_tools(McpServer.stdio("uvx", ["some-server"]))`` lists the server's tools once,
when it is called, and returns one ``Tool`` per MCP tool: its id is the MCP name, the
model sees the server's ``inputSchema`` as given, and arguments are checked against
that JSON Schema before anything is sent. Each call carries its operation id in the
request's ``_meta`` (``{"idempotency_key", "attempt", "epoch"}``) so that a server can
deduplicate a call Ratchet sends again.

An ``McpServer`` keeps, in each process, one session to its server, opened by the first
call in the running event loop and shared by every concurrent call. A session that dies
is not mended under a call: that call ends as below, and the next call opens a fresh
one. A server that hangs (deadlocked, stopped) ends nothing by itself: once a call
passes its deadline the server is pinged, and its session ended if no answer comes
within ``PING_TIMEOUT_S`` (5 s; calls wait for the answer before they are sent, so the
next goes to a fresh server; a slow tool's live server answers and keeps its session).
How each failure ends::

    listing (mcp_tools), when the agent is built
    └── ToolDefinitionError   the server cannot be listed; a name no model provider
                              accepts; an override or include naming no listed tool;
                              an inputSchema that is no JSON Schema; a description
                              and inputSchema past MAX_DEFINITION_BYTES (256 KiB)
    a call
    ├── ValueError (parse)    the arguments break the inputSchema: the model sees why,
    │                         and the server is never asked
    ├── ToolResult            the server answered: its content, and its isError (a
    │                         JSON-RPC error answer is an is_error result too)
    ├── McpUnavailable        nothing reached the server: it cannot be started or
    │   (UnavailableBeforeDispatch)   reached, or its session had ended before the
    │                         request was handed to the transport (retried as usual)
    ├── McpConnectionLost     the session ended while the server had the request: it
    │   (OutcomeUnknown)      may have run; the call is Lost and its pinned recovery
    │                         policy decides (never_replay: indeterminate)
    └── McpReplyUnreadable    the server's reply cannot be read (a stdio line the SDK
        (OutcomeUnknown)      drops, nested too deep, say; an HTTP body past 16 MiB
                              or no answer to its POST's request): Lost at once, not
                              waited out; one whose only fault is an unpaired
                              surrogate escape is kept instead, U+FFFD in its place
                              (mcp_reply, mcp_http)

The SDK is imported when a server is listed or called, never with this module.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from pydantic import RootModel, create_model, model_validator

from runtime.batch import RECOVERY_MODES, RecoveryMode
from runtime.errors import ToolDefinitionError
from runtime.limits import printable
from runtime.tools import TOOL_NAME, Tool, ToolResult

if TYPE_CHECKING:
    from mcp.types import Tool as ListedTool

from runtime.adapters.mcp_schema import schema_validator
from runtime.adapters.mcp_session import (
    CONTEXT_PARAM,
    McpConnectionLost,
    McpReplyUnreadable,
    McpServer,
    McpUnavailable,
    reason,
)

__all__ = ["McpConnectionLost", "McpReplyUnreadable", "McpServer", "McpUnavailable", "mcp_tools"]

_T = TypeVar("_T")
DEFAULT_CALL_TIMEOUT_S = 300.0
"""A call's timeout unless ``timeouts`` names one (None there: none). The SDK resolves a
request only with its answer: a reply that even Python's json cannot read (nested deeper
than it recurses) is logged and dropped (``mcp_reply``), and the call would wait for ever."""

MAX_DEFINITION_BYTES = 256 * 1024
"""The most a listed tool's description and inputSchema may take (as JSON): each goes
to the model with every inference of every Run that has the tool, and its schema is
checked against each call."""

# ---- tools --------------------------------------------------------------------------------


def mcp_tools(
    server: McpServer,
    *,
    recovery: Mapping[str, Sequence[RecoveryMode]] | None = None,
    timeouts: Mapping[str, float | None] | None = None,
    include: Iterable[str] | None = None,
) -> list[Tool]:
    """The server's tools (those in ``include``, if given), in the order it lists them.

    Lists the server now, once: agents are built at import time in each process, so
    this blocks (up to ``open_timeout_s``); inside a running event loop the listing runs
    on a loop of its own in a worker thread. ``recovery`` and ``timeouts`` are per tool
    name; a tool's recovery modes default to ``("never_replay",)``, its timeout to
    ``DEFAULT_CALL_TIMEOUT_S``."""
    recovery, timeouts = dict(recovery or {}), dict(timeouts or {})
    wanted = None if include is None else list(include)
    try:
        listed = _blocking(server.list_tools)
    except Exception as exc:
        why = f"cannot list the tools of MCP server {server.label}: {reason(exc)}"
        raise ToolDefinitionError(printable(why)) from exc
    _check_names(server, [t.name for t in listed], [*recovery, *timeouts, *(wanted or ())])
    return [
        _tool(server, t, *_options(t.name, recovery, timeouts))
        for t in listed
        if wanted is None or t.name in wanted
    ]


def _blocking(work: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work())
    # this thread's loop is busy running the caller: a private loop in a thread of its own
    with ThreadPoolExecutor(1, thread_name_prefix="ratchet-mcp-list") as pool:
        return pool.submit(lambda: asyncio.run(work())).result()


def _check_names(server: McpServer, names: list[str], asked: list[str]) -> None:
    twice = sorted(name for name, n in Counter(names).items() if n > 1)
    if twice:
        raise ToolDefinitionError(f"MCP server {server.label} lists {twice} more than once")
    unknown = sorted(set(asked) - set(names))
    if unknown:
        raise ToolDefinitionError(
            f"MCP server {server.label} lists no tool named {unknown}; it lists {names}"
        )


def _options(
    name: str, recovery: Mapping[str, Sequence[str]], timeouts: Mapping[str, float | None]
) -> tuple[tuple[RecoveryMode, ...], float | None]:
    modes = recovery.get(name, ("never_replay",))
    chosen = (modes,) if isinstance(modes, str) else tuple(modes)
    unknown = [m for m in chosen if m not in RECOVERY_MODES]
    if not chosen or unknown:
        raise ToolDefinitionError(f"MCP tool {name}: unknown or empty recovery modes {unknown}")
    seconds = timeouts.get(name, DEFAULT_CALL_TIMEOUT_S)
    if seconds is not None and not seconds > 0:
        raise ToolDefinitionError(f"MCP tool {name}: timeout must be positive, not {seconds!r}")
    return cast("tuple[RecoveryMode, ...]", chosen), seconds


def _tool(
    server: McpServer, listed: ListedTool, recovery: tuple[RecoveryMode, ...], timeout: float | None
) -> Tool:
    name = listed.name
    if not TOOL_NAME.fullmatch(name):
        raise ToolDefinitionError(
            f"MCP tool {name!r} of {server.label}: a tool name must be 1 to 64 letters, "
            "digits, '_' or '-' (what model providers accept); leave it out with include="
        )
    schema = dict(listed.input_schema)
    size = len(json.dumps([listed.description, schema]))  # before the schema is checked
    if size > MAX_DEFINITION_BYTES:
        raise ToolDefinitionError(
            f"MCP tool {name} of {server.label}: its description and inputSchema take {size} "
            f"bytes, past {MAX_DEFINITION_BYTES}; leave it out with include="
        )

    async def call_tool(**arguments: Any) -> ToolResult:
        ctx = arguments.pop(CONTEXT_PARAM)
        return await server.call(name, arguments, ctx)

    tool = Tool(
        id=name,
        fn=call_tool,
        args_model=_args_model(name, schema),
        context_param=CONTEXT_PARAM,
        recovery=recovery,
        concurrency="parallel",
        timeout_s=timeout,
        description=listed.description or "",
    )
    # the model sees the server's schema as given, not one derived from the args model
    model_schema = {"name": name, "description": tool.description, "parameters": schema}
    object.__setattr__(tool, "_schema", model_schema)
    return tool


class _SchemaArguments(RootModel[dict[str, Any]]):
    """A call's arguments, checked against the MCP tool's inputSchema (JSON Schema)."""

    validator: ClassVar[Any] = None
    """A jsonschema validator of the tool's inputSchema (set on each tool's subclass)."""

    @model_validator(mode="after")
    def _conforms(self) -> _SchemaArguments:
        try:
            errors = sorted(type(self).validator.iter_errors(self.root), key=_error_path)
        except Exception as exc:  # an unresolvable $ref, say: only a ValueError is the model's
            raise ValueError(f"the inputSchema cannot be checked: {exc}") from exc
        if errors:
            raise ValueError("; ".join(f"{_error_path(e)}: {e.message}" for e in errors[:5]))
        return self


def _error_path(error: Any) -> str:
    return str(error.json_path)


def _args_model(name: str, schema: dict[str, Any]) -> type[_SchemaArguments]:
    # jsonschema comes with the mcp SDK (which checks results against outputSchema)
    from jsonschema import SchemaError

    if schema.get("type") != "object":
        raise ToolDefinitionError(f"MCP tool {name}: its inputSchema is not of type object")
    try:
        validator = schema_validator(schema)
    except SchemaError as exc:
        raise ToolDefinitionError(f"MCP tool {name}: invalid inputSchema: {exc.message}") from exc
    except RecursionError:
        raise ToolDefinitionError(
            f"MCP tool {name}: its inputSchema nests too deep to be checked"
        ) from None
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):  # what a schema of another draft may allow
        raise ToolDefinitionError(
            f"MCP tool {name}: its inputSchema's properties are not an object"
        )
    if CONTEXT_PARAM in properties:
        raise ToolDefinitionError(f"MCP tool {name}: an argument is named {CONTEXT_PARAM}")
    model = create_model(f"{name}_args", __base__=_SchemaArguments)
    model.validator = validator
    return model
