"""A Run's handle follows the store: a store outage of a moment pauses it (as it
pauses Runs and streams), it is not the Run's answer; and a host that hangs is not
waited for once the store holds the Run at rest."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

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


class _HungHost:
    """A host stopped or blocked: its notice never comes."""

    class _Never:
        def remote(self, *args: Any, **kwargs: Any) -> Any:
            return asyncio.get_running_loop().create_future()

    until_rest = _Never()


class _Client:  # what a handle asks of its client
    def __init__(self, store: Any) -> None:
        self.spec = SystemSpec(name="t", store_url="memory://", hosts=1)
        self.store = store

    def host_for(self, thread: str, placement: str, host: int | None = None) -> Any:
        return _HungHost()


async def _ended(store: Any) -> None:
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    await InProcessRunner(agent, store).start("go", thread_id="th", run_id="r1")


async def test_a_run_ended_elsewhere_while_its_host_hangs_is_seen_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Supervisor re-placed the Run of a hung host and another host ended it: a
    handle waited for the hung host's notice for ever."""
    monkeypatch.setattr("cluster.waiting.HOST_CHECK_S", 0.05)
    store = MemoryCommitStore()
    await _ended(store)
    handle = RunHandle(_Client(store), ThreadId("th"), RunId("r1"), "hosted")  # type: ignore[arg-type]
    frontier = await handle.result(timeout_s=30)
    assert frontier.run_id == "r1" and frontier.run_state.kind == "ended"


async def test_a_handle_waits_out_a_store_outage_of_a_moment() -> None:
    """It raised StoreUnavailable at the first failed load (client.run did too)."""
    store = MemoryCommitStore()
    await _ended(store)
    blips = _Blips(store, 3)
    handle = RunHandle(_Client(blips), ThreadId("th"), RunId("r1"), "hosted")  # type: ignore[arg-type]
    frontier = await asyncio.wait_for(handle.settled(host_done=True), 30)
    assert frontier.run_id == "r1" and frontier.run_state.kind == "ended"
    assert blips.blips == 0
