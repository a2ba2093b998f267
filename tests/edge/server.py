"""A real ``ratchet serve`` application on real uvicorn servers, in a thread of the test
process (which holds the session's Ray): the client and the servers share that
thread's event loop, as they share ``ratchet serve``'s."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import uvicorn

from cluster.client import Ratchet
from edge.app import create_app
from edge.options import ServeOptions
from edge.timely import TimelyH11
from tests.support.servers import wait_until


class ServerThread:
    def __init__(
        self, store_url: str, servers: Sequence[tuple[int, ServeOptions, tuple[str, ...]]]
    ) -> None:
        """``servers``: (port, options, the agents it may start; none: any) of each."""
        self.store_url = store_url
        self.wanted = list(servers)
        self.servers: list[uvicorn.Server] = []
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="edge-servers", daemon=True)

    def start(self) -> None:
        self._thread.start()
        wait_until(self._up, "the edge servers to start", timeout=60)

    def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the edge servers did not stop"

    def _up(self) -> bool:
        if self.failure is not None:
            raise AssertionError(f"the edge servers failed: {self.failure!r}")
        return len(self.servers) == len(self.wanted) and all(s.started for s in self.servers)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start() to the test that waits
            self.failure = exc

    async def _serve(self) -> None:
        client = await Ratchet.connect(store_url=self.store_url, quiet=True)
        try:
            servers = [
                _server(create_app(client, options, agents=agents), port)
                for port, options, agents in self.wanted
            ]
            self.servers = servers
            await asyncio.gather(*(s.serve() for s in servers))
        finally:
            await client.close()


def _server(app: Any, port: int) -> uvicorn.Server:
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=TimelyH11)
    return uvicorn.Server(config)
