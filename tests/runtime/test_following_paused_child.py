"""A parent's call following a child in the store (``ChildHosting._untilat_rest``)
while the child is paused until a time: its head is looked at when that time comes,
and every ``PAUSED_LOOK_S`` meanwhile (a cancel or an early resume), not once a second
for the whole pause."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import actors.child_host
from actors.child_host import ChildHosting
from runtime import Agent
from runtime.control import control_engine
from runtime.engine import Engine
from runtime.errors import ModelRateLimited
from runtime.ids import ThreadId
from runtime.lifecycle import Cancelled, EndedState
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore
from tests.support.waiting import until


class LimitedForADay:
    """A model rate limited for a day: its Run pauses until then."""

    async def stream(self, request: Any) -> Any:
        raise ModelRateLimited("rate_limit", "come back tomorrow", status=429, retry_after_s=86_400)
        yield  # an async generator that never yields


class Reads(MemoryCommitStore):
    """Records when each head was read (the loop's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[float] = []

    async def load_head(self, thread: str) -> Any:
        self.heads.append(asyncio.get_running_loop().time())
        return await super().load_head(thread)


class _NoDrives:
    quarantined: set[str] = set()

    def get(self, thread: str) -> None:
        return None


async def test_a_child_paused_for_a_day_is_looked_at_every_paused_look_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its head was read at 20 ms, 40 ms … then every second for the day; now once per
    ``PAUSED_LOOK_S``, and its cancel still ends the parent's wait."""
    monkeypatch.setattr(actors.child_host, "PAUSED_LOOK_S", 0.5)
    store = Reads()
    agent = Agent(name="limited", model=LimitedForADay(), rate_limit_wait_s=0.0)
    engine = Engine(agent, store, LocalToolRunner([]), owner="sys:host-0#1")
    paused = await engine.start(ThreadId("kid"), "go")
    assert paused.status.reason == "awaiting_pause", paused.status
    following = ChildHosting()
    following.store, following.drives = store, _NoDrives()  # type: ignore[assignment]
    store.heads.clear()
    task = asyncio.create_task(following._untilat_rest(ThreadId("kid"), paused.run_id))
    await until(lambda: len(store.heads) >= 3, what="three looks at the paused child")
    first, second, third = store.heads[:3]
    assert second - first >= 0.45 and third - second >= 0.45, store.heads
    await control_engine(store).terminate(ThreadId("kid"), Cancelled())
    ended = await asyncio.wait_for(task, 10)
    assert ended is not None and isinstance(ended.run_state, EndedState)
