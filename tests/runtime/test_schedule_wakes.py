"""The Supervisor's wake pass (``actors.schedule.Alarms``), in process: Runs paused until
a time on a host that hangs hold only that host's slots, and a wake that does not land
is asked again with a backoff, not at every sweep."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import actors.deliveries
from actors.deliveries import PER_HOST
from actors.schedule import Alarms
from runtime import Agent
from runtime.engine import Engine
from runtime.errors import ModelRateLimited, ResumeRejected
from runtime.ids import ThreadId
from runtime.timeutil import now_us
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

SECOND_US = 1_000_000


class Limited:
    """A model that is always rate limited: each Run pauses until a moment from now."""

    async def stream(self, request: Any) -> Any:
        raise ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=0.0)
        yield  # an async generator that never yields


class Counting(MemoryCommitStore):
    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    async def load(self, thread: str) -> Any:
        self.loads += 1
        return await super().load(thread)


class Hung:
    """A host whose calls never answer (its process stopped, its loop blocked)."""

    def __init__(self) -> None:
        self.calls = 0
        hung = self

        class _Never:
            def remote(self, command: Any) -> Any:
                hung.calls += 1
                return asyncio.get_running_loop().create_future()

        self.resume_run = _Never()


class Answering:
    """A host that resumes Runs with ``engine`` (or refuses every resume: ``refuse``)."""

    def __init__(self, engine: Engine, refuse: bool = False) -> None:
        self.woken: list[str] = []
        host = self

        class _Resume:
            async def remote(self, command: Any) -> Any:
                if refuse:
                    raise ResumeRejected("deadline", "the ticket's deadline has not passed")
                host.woken.append(command.thread_id)
                return await engine.resume(command)

        self.resume_run = _Resume()


async def _paused(store: MemoryCommitStore, threads: list[str]) -> Engine:
    agent = Agent(name="limited", model=Limited(), rate_limit_wait_s=0.0)
    engine = Engine(agent, store, LocalToolRunner([]), owner="sys:host-0#1")
    for thread in threads:
        f = await engine.start(ThreadId(thread), "go")
        assert f.status.reason == "awaiting_pause", f.status
    return engine


async def test_a_hung_host_holds_only_its_own_slots_of_a_wake_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs due on a host that hangs, listed before one due on a host that answers: the
    pass sent the hung host as many calls as it had slots, each up to ``DELIVERY_S``,
    and the other host's Run waited for them all (every pass, until the host was
    restarted). Now a host has ``PER_HOST`` calls under way at most, and the others'
    Runs are woken meanwhile."""
    monkeypatch.setattr(actors.deliveries, "DELIVERY_S", 3600.0)
    store = MemoryCommitStore()
    stuck = [f"stuck-{i:02}" for i in range(12)]
    engine = await _paused(store, [*stuck, "free"])
    hung, answering = Hung(), Answering(engine)
    awaiting = sorted(await store.list_runs("awaiting"), key=lambda s: s.thread_id != "free")
    awaiting.reverse()  # the hung host's Runs first
    assert [s.thread_id for s in awaiting][-1] == "free"

    def host_of(frontier: Any) -> Any:
        return answering if frontier.thread_id == "free" else hung

    later = now_us() + 60 * SECOND_US  # every pause due
    passing = asyncio.create_task(Alarms().fire(store, awaiting, host_of, later))
    try:
        await until(lambda: answering.woken == ["free"], what="the free host's Run woken")
        assert hung.calls == PER_HOST and not passing.done()
    finally:
        passing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await passing


async def test_a_wake_that_does_not_land_is_asked_again_with_a_backoff() -> None:
    """A due Run its host refuses (its clock behind the Supervisor's, a thread it
    quarantined) was loaded whole and asked again at every sweep; now after 2 s, then
    twice as long each time, and at once when its version moves."""
    store = Counting()
    engine = await _paused(store, ["t"])
    refusing = Answering(engine, refuse=True)
    alarms = Alarms()
    awaiting = list(await store.list_runs("awaiting"))
    now = now_us() + 60 * SECOND_US
    store.loads = 0
    assert await alarms.fire(store, awaiting, lambda f: refusing, now) == (0, 0)
    assert store.loads == 1
    for _ in range(5):  # the next sweeps, within the backoff: nothing read, nothing asked
        assert await alarms.fire(store, awaiting, lambda f: refusing, now + SECOND_US) == (0, 0)
    assert store.loads == 1
    now += 2 * SECOND_US + 1
    assert await alarms.fire(store, awaiting, lambda f: refusing, now) == (0, 0)
    assert store.loads == 2
    # missed twice: 4 s now
    assert await alarms.fire(store, awaiting, lambda f: refusing, now + 3 * SECOND_US) == (0, 0)
    assert store.loads == 2
    answering = Answering(engine)
    now += 4 * SECOND_US + 1
    assert await alarms.fire(store, awaiting, lambda f: answering, now) == (1, 0)
    assert answering.woken == ["t"]
