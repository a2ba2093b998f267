"""Fixtures of the MCP adapter's tests: a real stdio server per test, and the check that
no server process the test started outlives it (not even as a zombie)."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from runtime.adapters.mcp import McpServer
from tests.support.servers import wait_until

SERVER = str(Path(__file__).with_name("server.py"))
DEADLINE_S = 10.0


def started_pids(records: Path) -> list[int]:
    log = records / "started.log"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def alive(pid: int) -> bool:
    """True while the process exists, a zombie included (kill(pid, 0) reaches it too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """What the server processes record (``tests/mcp/server.py``)."""
    return tmp_path


@pytest.fixture
def stdio_server(records: Path) -> Callable[..., McpServer]:
    def make(**env: str) -> McpServer:
        return McpServer.stdio(sys.executable, [SERVER], env={"MCP_TEST_DIR": str(records), **env})

    return make


@pytest.fixture
async def server(stdio_server: Callable[..., McpServer], records: Path) -> AsyncIterator[McpServer]:
    made = stdio_server()
    yield made
    await made.aclose()


@pytest.fixture(autouse=True)
def no_server_outlives_its_test(records: Path) -> object:
    yield None
    wait_until(
        lambda: not any(alive(pid) for pid in started_pids(records)),
        "the MCP server processes to end",
        DEADLINE_S,
    )
