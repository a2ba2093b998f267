"""Lines from an MCP server that the SDK cannot parse, read again.

The SDK's stdio transport hands such a line to the session as an exception, which the
session logs and drops: the request it answers is never resolved, and its call waits
out its timeout. ``reread`` turns what Python's ``json`` can read into a message:

- strings holding an unpaired surrogate escape (``"\\ud83d"``, as ``JSON.stringify``
  writes a JS string cut mid-emoji) are kept, U+FFFD in the surrogate's place;
- any other reply to a request (one nested deeper than the SDK reads, say) becomes an
  error answer marked ``UNREADABLE``, so that its call ends at once (``McpReplyUnreadable``:
  the server answered, what it said is unknown); so does a reply that is JSON but not a
  JSON-RPC answer (a ``result`` that is no object, an error code that is no number), which
  the SDK refuses by its shape.

A line ``json`` cannot read either (nested deeper than Python recurses) is left to the
SDK, and its call to its timeout.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from typing import TYPE_CHECKING, Any

from runtime.limits import printable, utf8_problem

if TYPE_CHECKING:
    from mcp import MCPError
    from mcp.shared.message import SessionMessage

UNREADABLE = {"ratchet": "the reply could not be read", "mark": secrets.token_hex(16)}
"""The ``data`` of the error answer that stands in for an unreadable reply. Its mark is
this process's secret: a server that sends the same words is answering, not unreadable
(it would have had its answered call taken for lost, and run again)."""
_SDK_UNPARSED = ("Failed to parse SSE message: ", "Failed to parse JSON response: ")
"""How the SDK's streamable HTTP transport words a reply it could not parse."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def reread(item: SessionMessage | Exception) -> SessionMessage | Exception:
    """``item`` as a message if it is a line the SDK could not parse that Python can."""
    misshapen = _misshapen(item)
    if misshapen is not None:
        reply, why = misshapen
        return _unreadable(reply["id"], why)
    unparsed = _unparsed(item)
    if unparsed is None:
        return item
    line, why = unparsed
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        return item  # beyond Python's json too: left to the SDK
    with contextlib.suppress(ValueError, RecursionError):  # ValidationError is a ValueError
        if utf8_problem(json.dumps(raw, ensure_ascii=False)):
            return _message(_mended(raw))
    if isinstance(raw, dict) and "method" not in raw and _is_id(raw.get("id")):
        return _unreadable(raw["id"], why)
    return item


def http_answer(body: bytes | None, request_id: str | int, limit: int) -> bytes:
    """The JSON body of an HTTP server's response to request ``request_id`` as the SDK is
    to read it: as sent if it is an answer to that request; read again as above (bytes
    that are no UTF-8 made U+FFFD, as a stdio server's are) if the SDK cannot parse it;
    and an error answer marked ``UNREADABLE`` if it is still none (None: a body past
    ``limit`` bytes). The POST's body answers its request: an answer of another id is
    made this request's, as the SDK does an SSE stream's (it resolved nothing, and the
    call waited out its timeout)."""
    from mcp.shared.message import SessionMessage
    from mcp.types import JSONRPCError, JSONRPCResponse, jsonrpc_message_adapter
    from pydantic import ValidationError

    if body is None:
        return _body(_unreadable(request_id, f"a body of more than {limit} bytes"))
    item: SessionMessage | Exception
    try:
        item = SessionMessage(jsonrpc_message_adapter.validate_json(body, by_name=False))
    except ValidationError:
        try:  # a str, as the SDK reads a stdio line: ``reread`` finds the line in the error
            text = body.decode("utf-8", "replace")
            item = SessionMessage(jsonrpc_message_adapter.validate_json(text, by_name=False))
        except ValidationError as exc:
            item = reread(exc)
    else:
        message = item.message
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id == request_id:
            return body  # as sent: the common case, not written again
    if isinstance(item, Exception):  # beyond Python's json too (nested too deep, say)
        why = item.errors()[0]["msg"] if isinstance(item, ValidationError) else str(item)
        return _body(_unreadable(request_id, why))
    message = item.message
    if not isinstance(message, JSONRPCResponse | JSONRPCError):
        return _body(_unreadable(request_id, "no answer to the request"))
    message.id = request_id
    return _body(item)


def _body(item: SessionMessage) -> bytes:
    return item.message.model_dump_json(by_alias=True, exclude_unset=True).encode()


def unreadable(exc: MCPError) -> str | None:
    """Why a reply could not be read, if an error answer stands in for one: ours, or the
    SDK's for an SSE event it could not parse (told by its words, as ``transport_failed``
    tells the SDK's "connection closed": a server that says them itself is taken at
    them, and its call lost, not answered)."""
    from mcp.types import PARSE_ERROR

    said = str(exc.message)
    if exc.data == UNREADABLE:
        return said
    if exc.code == PARSE_ERROR and exc.data is None and said.startswith(_SDK_UNPARSED):
        return printable(f"the server's reply could not be read ({said})", 500)
    return None


def _unparsed(item: SessionMessage | Exception) -> tuple[str, str] | None:
    """The line behind a parse failure of the SDK's (pydantic's ``json_invalid``), and why."""
    if not isinstance(item, Exception):
        return None
    from pydantic import ValidationError

    if not isinstance(item, ValidationError):
        return None
    first = item.errors()[0]
    line = first.get("input")
    if first["type"] != "json_invalid" or not isinstance(line, str):
        return None
    return line, first["msg"]


def _misshapen(item: SessionMessage | Exception) -> tuple[dict[str, Any], str] | None:
    """A reply to a request that is JSON but none of JSON-RPC's messages, and why. The
    SDK reads a line as the union of those messages: each of its branches refuses the
    whole line, and the request's branch names it as the input that has no ``method``."""
    if not isinstance(item, Exception):
        return None
    from pydantic import ValidationError

    if not isinstance(item, ValidationError):
        return None
    errors = item.errors()
    whole = next(
        (
            e["input"]
            for e in errors
            if e["type"] == "missing"
            and tuple(e["loc"])[1:] == ("method",)
            and isinstance(e.get("input"), dict)
        ),
        None,
    )
    if whole is None or "method" in whole or not _is_id(whole.get("id")):
        return None  # a request or notification of the server's: no call waits for it
    why = next(
        (
            f"{'.'.join(map(str, tuple(e['loc'])[1:]))}: {e['msg']}"
            for e in errors
            if tuple(e["loc"])[:1] in (("JSONRPCResponse",), ("JSONRPCError",))
            and e["type"] != "missing"
        ),
        "not a JSON-RPC answer",
    )
    return whole, why


def _mended(value: Any) -> Any:
    """``value`` with every unpaired surrogate in its strings (keys too) made U+FFFD
    (``json.loads`` has joined the escapes that pair)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_mended(v) for v in value]
    if isinstance(value, dict):
        return {_mended(k): _mended(v) for k, v in value.items()}
    return value


def _is_id(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def _message(value: Any) -> SessionMessage:
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    return SessionMessage(jsonrpc_message_adapter.validate_python(value, by_name=False))


def _unreadable(request_id: str | int, why: str) -> SessionMessage:
    from mcp.shared.message import SessionMessage
    from mcp.types import PARSE_ERROR, ErrorData, JSONRPCError

    said = printable(f"the server's reply could not be read ({why})", 500)
    error = ErrorData(code=PARSE_ERROR, message=said, data=UNREADABLE)
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=request_id, error=error))
