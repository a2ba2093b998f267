"""A stdio MCP server written by hand, for replies the SDK's server would never write:
``snippet`` answers with text holding an unpaired surrogate escape (as ``JSON.stringify``
writes a JS string cut mid-emoji), ``deep`` with structured content nested deeper than
the SDK reads, ``not_an_object`` with a ``result`` of 42, ``code_of_text`` with an
error whose code is text (JSON, but no JSON-RPC answer) and ``declined`` with a server
error of code -32000 (the code the SDK gives its own "connection closed"), and
``forged`` with an error whose data is the words the adapter marks an unreadable
reply with, and ``not_utf8`` with text holding the bytes 0xFF 0xFE (no UTF-8).
``wrong_shape`` answers with a content block of a type MCP does not have, and
``backtracks`` with structured content its outputSchema's pattern takes exponential time
on. ``huge`` answers with a line of more than 16 MiB (``mcp_lines.MAX_LINE_BYTES``).
``stall`` sleeps ten minutes, deaf to its stdin closing. ``ping_flood`` sends
``MCP_TEST_PINGS`` pings (100,000 unless set) before it answers, reading none of
their answers meanwhile. With ``MCP_TEST_TWICE`` set it
lists ``snippet`` twice. It appends its pid to
``MCP_TEST_DIR/started.log``, as ``server.py`` does."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TOOLS = [
    {"name": name, "description": name, "inputSchema": {"type": "object", "properties": {}}}
    for name in (
        *("snippet", "deep", "not_an_object", "code_of_text", "declined", "forged", "stall"),
        *("not_utf8", "wrong_shape", "huge", "ping_flood", "backtracks"),
    )
]
TOOLS[-1]["outputSchema"] = {  # a pattern that backtracks for ever on "aaa…a!"
    "type": "object",
    "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
}
WRONG_SHAPE = '{"content":[{"type":"video","url":"x"}]}'
BACKTRACKS = '{"content":[],"structuredContent":{"s":"' + "a" * 40 + '!"}}'
SNIPPET = '{"content":[{"type":"text","text":"charged; note: caf\\ud83d \\ud83d\\ude00"}]}'
NOT_UTF8 = '{"content":[{"type":"text","text":"caf\udcff\udcfe"}]}'  # written as raw bytes
HUGE = '{"content":[{"type":"text","text":"' + "x" * 16 * 2**20 + '"}]}'
DEEP = '{"content":[],"structuredContent":{"x":' + "[" * 300 + "]" * 300 + "}}"


def answer(request: dict[str, object]) -> str:
    method = request["method"]
    if method == "initialize":
        params = request["params"]
        assert isinstance(params, dict)
        info = {"name": "raw", "version": "1"}
        result = json.dumps(
            {
                "protocolVersion": params["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": info,
            }
        )
    elif method == "tools/list":
        twice = TOOLS[:1] if os.environ.get("MCP_TEST_TWICE") else []  # a name listed twice
        result = json.dumps({"tools": [*TOOLS, *twice]})
    elif method == "tools/call":
        params = request["params"]
        assert isinstance(params, dict)
        errors = {"code_of_text": '{"code":"E1","message":"x"}'}
        errors["declined"] = '{"code":-32000,"message":"card declined"}'
        said = '{"ratchet":"the reply could not be read"}'
        errors["forged"] = '{"code":-32700,"message":"no","data":' + said + "}"
        if params["name"] == "stall":  # busy, deaf to its stdin closing: only a kill ends it
            (Path(os.environ["MCP_TEST_DIR"]) / "stalling").touch()
            time.sleep(600)
        if params["name"] == "ping_flood":  # pings, never reading their answers, then its own
            flood = int(os.environ.get("MCP_TEST_PINGS", "100000"))
            for n in range(flood):
                sys.stdout.write(f'{{"jsonrpc":"2.0","id":"p{n}","method":"ping"}}\n')
            sys.stdout.flush()
        if params["name"] in errors:
            error = errors[str(params["name"])]
            return '{"jsonrpc":"2.0","id":' + json.dumps(request["id"]) + ',"error":' + error + "}"
        replies = {"snippet": SNIPPET, "deep": DEEP, "not_an_object": "42", "not_utf8": NOT_UTF8}
        replies |= {"wrong_shape": WRONG_SHAPE, "backtracks": BACKTRACKS, "huge": HUGE}
        replies["ping_flood"] = '{"content":[{"type":"text","text":"flooded"}]}'
        result = replies[str(params["name"])]
    else:
        result = "{}"
    return '{"jsonrpc":"2.0","id":' + json.dumps(request["id"]) + ',"result":' + result + "}"


if __name__ == "__main__":
    with (Path(os.environ["MCP_TEST_DIR"]) / "started.log").open("a") as started:
        started.write(f"{os.getpid()}\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "id" in request and "method" in request:  # not a notification, nor an answer
            # surrogateescape: NOT_UTF8's two escapes go out as the bytes they stand for
            sys.stdout.buffer.write((answer(request) + "\n").encode("utf-8", "surrogateescape"))
            sys.stdout.buffer.flush()
