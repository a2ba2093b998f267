"""A ``ratchet serve`` application over the in-memory store, on a real uvicorn server in
a thread: the edge as a caller meets it (sockets, the guard, the streams), without Ray.
Its threads are Runs that ended, made in process before the server starts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from actors.wire import SystemSpec
from cluster.handle import RunHandle
from edge.app import create_app
from edge.options import ServeOptions
from edge.timely import TimelyH11
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.ids import RunId, ThreadId
from storage.memory import MemoryCommitStore
from tests.support.servers import free_port, wait_until


class SlowStore:
    """The in-memory store whose loads take ``delay_s``, as a real store's round trip
    does: time for other requests to come in meanwhile."""

    def __init__(self, inner: MemoryCommitStore, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        await asyncio.sleep(self.delay_s)
        return await self.inner.load(thread)


@dataclass
class MemoryClient:
    """What the routes use of ``cluster.client.Ratchet``: its store, spec and handles."""

    store: Any
    spec: SystemSpec = field(default_factory=lambda: SystemSpec(name="edge", store_url="memory://"))
    hosts: tuple[Any, ...] = ()

    def handle(self, thread_id: str, run_id: str | None = None) -> RunHandle:
        run = None if run_id is None else RunId(run_id)
        return RunHandle(self, ThreadId(thread_id), run, "hosted")  # type: ignore[arg-type]


@dataclass
class Served:
    url: str
    port: int
    app: FastAPI


@contextmanager
def served(
    options: ServeOptions,
    threads: tuple[str, ...] = ("t1",),
    load_delay_s: float = 0.0,
    http: type[TimelyH11] = TimelyH11,
) -> Iterator[Served]:
    store = MemoryCommitStore()
    client = MemoryClient(SlowStore(store, load_delay_s) if load_delay_s else store)
    app = create_app(client, options)  # type: ignore[arg-type]
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http)
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    async def main() -> None:
        for thread in threads:
            agent = Agent(name="once", model=ScriptedModel([ModelResponse(text="done")]))
            await InProcessRunner(agent, store).start("go", thread_id=thread, run_id=f"r-{thread}")
        await server.serve()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the test waiting for the start
            failure.append(exc)

    runner = threading.Thread(target=run, name="edge-memory-server", daemon=True)
    runner.start()

    def up() -> bool:
        if failure:
            raise AssertionError(f"the edge server failed: {failure[0]!r}")
        return server.started

    wait_until(up, "the edge server to start")
    try:
        yield Served(f"http://127.0.0.1:{port}", port, app)
    finally:
        server.should_exit = True
        runner.join(timeout=30)
