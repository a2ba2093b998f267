"""The MCP server the adapter's tests talk to: a real stdio (or streamable HTTP) server
written with the SDK's server API, run as a subprocess.

It records what the tests check on the server's side in ``MCP_TEST_DIR``: each process
appends its pid to ``started.log`` (so the tests can tell that none outlives them), and
``hang`` writes ``hang.pid`` once it is inside the call. ``record`` answers with the
``_meta`` it received. ``MCP_TEST_DOTTED=1`` adds a tool whose name no model provider
accepts; while ``MCP_TEST_DIR/refuse`` exists, the server exits as soon as it starts,
and while ``MCP_TEST_DIR/hold`` does, it waits (up to 30 s) before it serves.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

RECORDS = Path(os.environ["MCP_TEST_DIR"])
server = MCPServer("ratchet-test", log_level="WARNING")


@server.tool()
def record(note: str, ctx: Context) -> str:
    """Answers with the note, the request's _meta and this server's pid."""
    meta = dict(ctx.request_context.meta or {})
    return json.dumps({"note": note, "meta": meta, "pid": os.getpid()})


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    with (RECORDS / "add.log").open("a") as log:  # the tests check it was never called
        log.write(f"{a}+{b}\n")
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ToolError(f"failed on purpose: {reason}")


@server.tool()
async def hang() -> str:
    """Never answers: the tests kill the server while it is inside this call."""
    (RECORDS / "hang.pid").write_text(str(os.getpid()))
    await anyio.sleep_forever()
    return "unreachable"


if os.environ.get("MCP_TEST_DOTTED") == "1":

    @server.tool(name="files.read")
    def files_read(path: str) -> str:
        """A name with a dot: MCP allows it, model providers do not."""
        return path


if __name__ == "__main__":
    with (RECORDS / "started.log").open("a") as started:
        started.write(f"{os.getpid()}\n")
    if (RECORDS / "refuse").exists():
        sys.exit(3)
    held = time.monotonic()
    while (RECORDS / "hold").exists() and time.monotonic() - held < 30:  # a slow start
        time.sleep(0.02)
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
