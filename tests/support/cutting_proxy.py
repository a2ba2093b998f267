"""A TCP proxy in front of a server that cuts a connection right after forwarding a request
holding a marker, before the answer reaches the client: the request ran, its answer is
lost (what a dropped connection does to a caller mid-command)."""

from __future__ import annotations

import asyncio
import contextlib


class CuttingProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut_on: bytes | None = None
        """The marker of the next request to cut after (None: forward everything)."""
        self.cuts = 0
        self.forwarded = asyncio.Event()
        """Set once a cut request reached the server."""
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        server, to_server = await asyncio.open_connection("127.0.0.1", self.target_port)
        mute, dropped = asyncio.Event(), asyncio.Event()

        async def up() -> None:
            with contextlib.suppress(Exception):
                while data := await client.read(65536):
                    to_server.write(data)
                    await to_server.drain()
                    if self.cut_on is not None and self.cut_on in data:
                        self.cut_on = None
                        self.cuts += 1
                        mute.set()  # no answer reaches the client from now on
                        self.forwarded.set()
                        return

        async def down() -> None:
            with contextlib.suppress(Exception):
                while data := await server.read(65536):
                    if mute.is_set():
                        dropped.set()  # the server's answer: it ran the request
                        continue
                    to_client.write(data)
                    await to_client.drain()

        answers = asyncio.ensure_future(down())
        await up()
        if mute.is_set():  # the server runs the request, then both sides are dropped
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dropped.wait(), 5)
        answers.cancel()
        for writer in (to_client, to_server):
            with contextlib.suppress(Exception):
                writer.close()
