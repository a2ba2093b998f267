"""A stdio server's stdout read a line at a time, bounded (``runtime.adapters.mcp_lines``)."""

from __future__ import annotations

import asyncio
import sys

import anyio
import pytest
from anyio.abc import ByteReceiveStream

from runtime.adapters.mcp import McpServer, mcp_tools
from runtime.adapters.mcp_lines import MAX_LINE_BYTES, BoundedStdout
from runtime.ports import Finished, Lost
from runtime.tool_calls import LocalToolRunner
from tests.mcp.conftest import DEADLINE_S, started_pids
from tests.mcp.test_mcp_tools import RAW_SERVER, invocation


class _Chunks(ByteReceiveStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)

    async def aclose(self) -> None:
        self.chunks.clear()


async def _read(chunks: list[bytes], max_line: int) -> list[bytes]:
    """What a BoundedStdout over ``chunks`` hands on, up to its end."""
    stream = BoundedStdout(_Chunks(chunks), max_line)
    out = []
    with pytest.raises(anyio.EndOfStream):
        while True:
            out.append(await stream.receive())
    return out


async def test_whole_lines_only_are_handed_on():
    out = await _read([b'{"a"', b":1}\n{", b'"b":2}\n{"c":3}\n', b"{", b"}"], max_line=8)
    assert out == [b'{"a":1}\n', b'{"b":2}\n{"c":3}\n', b"{}"]


async def test_a_line_past_the_bound_ends_the_stream_and_one_at_it_is_read():
    assert await _read([b"x" * 4, b"x" * 4, b"\n"], max_line=8) == [b"x" * 8 + b"\n"]
    assert await _read([b"ok\n", b"x" * 4, b"x" * 4, b"x\n", b"more\n"], max_line=8) == [b"ok\n"]
    # begun in the chunk that ends a short line
    assert await _read([b"ok\nxxxx", b"xxxxx\n", b"more\n"], max_line=8) == [b"ok\n"]


async def test_a_line_past_the_bound_ends_the_session_and_loses_its_call(records):
    """The SDK's reader joined each chunk to the line so far: a 100 MB reply held the
    host's event loop 84 s, and nothing bounded it. A line past ``MAX_LINE_BYTES`` ends
    the session: its call is Lost (the server may have run it), and the next call opens
    a fresh server and is answered."""
    assert MAX_LINE_BYTES <= 16 * 2**20  # raw_server's "huge" writes more than that
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env={"MCP_TEST_DIR": str(records)})
    try:
        runner = LocalToolRunner(mcp_tools(server))
        (lost,) = await asyncio.wait_for(runner.run([invocation("huge", "c1")]), DEADLINE_S)
        (after,) = await asyncio.wait_for(runner.run([invocation("snippet", "c2")]), DEADLINE_S)
    finally:
        await server.aclose()
    assert isinstance(lost, Lost), lost
    assert isinstance(after, Finished) and not after.output.is_error, after
    assert len(started_pids(records)) == 3  # the listing's, the ended session's, the fresh one


async def test_a_flood_of_the_server_s_requests_holds_a_bounded_number_of_tasks(records):
    """The SDK answers each request of the server's (a ping) in a task of its own: a
    server sending pings without reading their answers had a task per ping waiting to
    write (100,000 pings held 1 GB and 93,000 tasks). Past ``MAX_SERVER_REQUESTS``
    unanswered, its requests are dropped, and its answer to the call is still read."""
    from runtime.adapters.mcp_asked import MAX_SERVER_REQUESTS

    env = {"MCP_TEST_DIR": str(records), "MCP_TEST_PINGS": "20000"}
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env=env)
    most = 0

    async def count() -> None:
        nonlocal most
        while True:
            most = max(most, len(asyncio.all_tasks()))
            await asyncio.sleep(0.01)

    counting = asyncio.ensure_future(count())
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={"ping_flood": 120.0}))
        (flooded,) = await asyncio.wait_for(runner.run([invocation("ping_flood", "c1")]), 120)
    finally:
        counting.cancel()
        await server.aclose()
    assert isinstance(flooded, Finished) and flooded.output.content == "flooded", flooded
    assert most < MAX_SERVER_REQUESTS + 50, most


def test_the_server_s_requests_answered_are_forgotten():
    """Each id answered stayed in the count with 0, and the bound summed them all at every
    request: a flood the session kept answering cost ever more per request, and memory
    per id for the session's life."""
    from mcp.shared.message import SessionMessage
    from mcp.types import JSONRPCRequest, JSONRPCResponse

    from runtime.adapters.mcp_asked import ServerRequests

    asked = ServerRequests("test", bound=4)
    for i in range(10_000):
        request = SessionMessage(JSONRPCRequest(jsonrpc="2.0", id=i, method="ping"))
        assert asked.admit(request)
        asked.answered(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=i, result={})))
    assert not asked._open and asked._count == 0
    held = [SessionMessage(JSONRPCRequest(jsonrpc="2.0", id=7, method="ping")) for _ in range(5)]
    assert [asked.admit(m) for m in held] == [True] * 4 + [False]  # one id reused, bounded
    asked.answered(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=7, result={})))
    assert asked._open[7] == 3 and asked._count == 3
