"""Hostile replies over streamable HTTP (``raw_http_server``, run as a subprocess)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runtime.adapters.mcp import McpServer, mcp_tools
from runtime.ports import Finished, Lost, ToolOutcome
from runtime.tool_calls import LocalToolRunner
from tests.mcp.conftest import DEADLINE_S
from tests.mcp.test_mcp_tools import invocation
from tests.support.servers import answers, free_port
from tests.support.waiting import until

RAW_HTTP_SERVER = str(Path(__file__).with_name("raw_http_server.py"))


@pytest.fixture
async def raw_http(records: Path) -> AsyncIterator[McpServer]:
    port = free_port()
    env = {**os.environ, "MCP_TEST_DIR": str(records)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, RAW_HTTP_SERVER, str(port), env=env
    )
    server = McpServer.http(f"http://127.0.0.1:{port}/mcp")
    try:
        await until(lambda: answers(port), DEADLINE_S)
        yield server
    finally:
        await server.aclose()
        process.kill()
        await asyncio.wait_for(process.wait(), DEADLINE_S)


async def _calls(server: McpServer, *tools: str) -> list[ToolOutcome]:
    runner = LocalToolRunner(mcp_tools(server, timeouts=dict.fromkeys(tools, 60.0)))
    calls = [invocation(tool, f"c{i}") for i, tool in enumerate(tools)]
    return await asyncio.wait_for(runner.run(calls), 60)


async def test_an_http_reply_past_the_bound_is_lost_not_read_whole(raw_http):
    """The SDK read a JSON reply whole before it parsed it, with no bound: a server could
    send gigabytes (or gzip a few into kilobytes), and the host held them all. A reply
    past ``MAX_REPLY_BYTES`` (after decoding) is cut where it passes it, and its call is
    lost (the server may have run it); the session serves the next call."""
    huge, endless, bomb, after = await _calls(raw_http, "huge", "endless", "gzip_bomb", "snippet")
    for lost in (huge, endless, bomb):
        assert isinstance(lost, Lost) and "could not be read" in lost.message, lost
        assert "more than 16777216 bytes" in lost.message, lost
    assert isinstance(after, Finished) and not after.output.is_error, after


async def test_an_http_reply_the_sdk_cannot_parse_is_mended_or_lost(raw_http):
    """A JSON reply the SDK could not parse was an error result the model saw ("MCP error
    -32700: Failed to parse JSON response"), though the server may have run the call: a
    never_replay tool would be called again. It is read as over stdio (``mcp_reply``):
    unpaired surrogates and bytes that are no UTF-8 are mended, anything else unreadable
    (too deep, no JSON-RPC answer, an SSE event of either) is lost. The body answers its
    POST's request: one of another id is taken as its answer, and a body that is no
    answer (a notification) is unreadable; either left the call waiting out its timeout."""
    tools = ("snippet", "not_utf8", "other_id", "deep", "too_deep", "not_an_object", "sse_deep")
    snippet, not_utf8, other_id, *unreadable = await _calls(raw_http, *tools, "no_answer")
    assert isinstance(snippet, Finished), snippet
    assert snippet.output.content == "charged; note: caf\ufffd \U0001f600"
    assert isinstance(not_utf8, Finished) and not_utf8.output.content == "caf\ufffd\ufffd"
    assert isinstance(other_id, Finished) and not other_id.output.is_error, other_id
    for lost in unreadable:
        assert isinstance(lost, Lost) and "could not be read" in lost.message, lost
