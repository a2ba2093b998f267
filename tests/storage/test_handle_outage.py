"""A Run's handle follows the store: a store outage of a moment pauses it (as it
pauses Runs and streams), it is not the Run's answer."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.wire import SystemSpec
from cluster.handle import RunHandle
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.errors import StoreUnavailable
from runtime.ids import RunId, ThreadId
from storage.memory import MemoryCommitStore


class _Blips:
    """The store, whose next ``blips`` loads fail StoreUnavailable."""

    def __init__(self, inner: MemoryCommitStore, blips: int) -> None:
        self.inner, self.blips = inner, blips

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: Any) -> Any:
        if self.blips:
            self.blips -= 1
            raise StoreUnavailable("a blip (test)")
        return await self.inner.load(thread)


class _Client:  # what a handle asks of its client once its host has answered
    def __init__(self, store: Any) -> None:
        self.spec = SystemSpec(name="t", store_url="memory://")
        self.store = store


async def test_a_handle_waits_out_a_store_outage_of_a_moment() -> None:
    """It raised StoreUnavailable at the first failed load (client.run did too)."""
    store = MemoryCommitStore()
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    await InProcessRunner(agent, store).start("go", thread_id="th", run_id="r1")
    blips = _Blips(store, 3)
    handle = RunHandle(_Client(blips), ThreadId("th"), RunId("r1"), "hosted")  # type: ignore[arg-type]
    frontier = await asyncio.wait_for(handle.settled(host_done=True), 30)
    assert frontier.run_id == "r1" and frontier.run_state.kind == "ended"
    assert blips.blips == 0
