"""A stdio MCP server's stdout, read a line at a time in linear time and bounded.

The SDK's stdio reader joins each chunk to the line read so far (``buffer + chunk``):
a line of n bytes costs it n²/64 KiB bytes copied (a 100 MB reply held the event
loop 84 s), and nothing bounds a line before it is parsed. Its server process is
spawned here with its stdout behind ``BoundedStdout``, which hands the reader whole
lines only (joined once), and ends at a line past ``MAX_LINE_BYTES``, as if the
server had closed its stdout: the session ends (the calls it had are Lost, the server
is stopped), and the next call opens a fresh one. (Not an error raised to the SDK's
reader: it would drain the pipe until the server, alive, closed it, the session held
open meanwhile.) Only servers ``mcp_transport.stdio_streams`` starts are so
read (``BOUNDED``); the SDK's reader is otherwise left as it is.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any, NoReturn

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

from runtime.limits import MIB

log = logging.getLogger("ratchet.mcp")

MAX_LINE_BYTES = 16 * MIB
"""The longest line (one JSON-RPC message) a stdio server may write: far more than any
tool result a Run keeps (``Limits.tool_result_bytes``) or a long tools/list page."""

BOUNDED: ContextVar[bool] = ContextVar("mcp_bounded_stdout", default=False)
"""Set while ``stdio_streams`` has the SDK spawn its server."""


class BoundedStdout(ByteReceiveStream):
    """A byte stream handing on whole lines only, each at most ``max_line`` bytes."""

    def __init__(self, inner: ByteReceiveStream, max_line: int = MAX_LINE_BYTES) -> None:
        self._inner = inner
        self._max_line = max_line
        self._held: list[bytes] = []
        """The line begun and not yet ended, as read."""
        self._size = 0
        self._refused = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._refused:
            raise anyio.EndOfStream
        while True:
            try:
                chunk = await self._inner.receive(max_bytes)
            except anyio.EndOfStream:
                if not self._held:
                    raise
                rest, self._held, self._size = b"".join(self._held), [], 0
                return rest  # an unended last line, as the SDK would have had it
            end = chunk.rfind(b"\n")
            first = chunk.find(b"\n")
            if self._size + (first if first >= 0 else len(chunk)) > self._max_line:
                self._refuse()
            if end < 0:
                self._held.append(chunk)
                self._size += len(chunk)
                continue
            # only the first line of a chunk can be long: the others are inside it, and a
            # chunk (64 KiB) is far shorter than the bound
            whole = b"".join((*self._held, chunk[: end + 1]))
            rest = chunk[end + 1 :]
            self._held, self._size = ([rest], len(rest)) if rest else ([], 0)
            return whole

    def _refuse(self) -> NoReturn:
        self._refused = True
        self._held, self._size = [], 0
        log.warning(
            "an MCP server wrote a line of more than %d bytes: its session is ended",
            self._max_line,
        )
        raise anyio.EndOfStream

    async def aclose(self) -> None:
        await self._inner.aclose()


class BoundedProcess(Process):
    """A server process whose stdout is read through ``BoundedStdout``."""

    def __init__(self, inner: Process) -> None:
        self._inner = inner
        stdout = inner.stdout
        self._stdout = None if stdout is None else BoundedStdout(stdout)

    def __getattr__(self, name: str) -> Any:  # what the SDK reads of the real one
        return getattr(self._inner, name)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def wait(self) -> int:
        return await self._inner.wait()

    def terminate(self) -> None:
        self._inner.terminate()

    def kill(self) -> None:
        self._inner.kill()

    def send_signal(self, signal: int) -> None:
        self._inner.send_signal(signal)  # type: ignore[arg-type]

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def returncode(self) -> int | None:
        return self._inner.returncode

    @property
    def stdin(self) -> ByteSendStream | None:
        return self._inner.stdin

    @property
    def stdout(self) -> ByteReceiveStream | None:
        return self._stdout

    @property
    def stderr(self) -> ByteReceiveStream | None:
        return self._inner.stderr


def bound_stdio_servers() -> None:
    """Have the SDK spawn stdio servers with a bounded stdout while ``BOUNDED`` is set
    (once per process; a test holds the SDK to the function this wraps)."""
    import mcp.client.stdio as sdk

    spawn = sdk._create_platform_compatible_process
    if getattr(spawn, "ratchet_bounded", False):
        return

    async def spawning(*args: Any, **kwargs: Any) -> Any:
        process = await spawn(*args, **kwargs)
        if BOUNDED.get() and isinstance(process, Process):
            return BoundedProcess(process)
        return process

    spawning.ratchet_bounded = True  # type: ignore[attr-defined]
    sdk._create_platform_compatible_process = spawning
