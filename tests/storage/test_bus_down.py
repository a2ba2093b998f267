"""The live bus is off the commit path (``runtime.publish``): a Redis bus that is stopped,
restarted or hung (SIGSTOP) never slows or stops a Run's commits, and a ``follow`` over
it falls back to the store and returns to the bus, losing and repeating no fact.

Each test has a private redis-server (``tests.support.servers``) so it can stop it.
Progress is measured in commits and conditions (with deadlines), never in timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from runtime import Agent, Delta, Fact, InProcessRunner, ModelDelta, ModelResponse, call, tool
from runtime.errors import StoreError
from runtime.rules import stamp_facts
from runtime.stream import Frame, follow
from storage.bus import RedisStreamBus
from storage.memory import MemoryCommitStore
from storage.redis_client import open_client
from tests.support.servers import PrivateRedis
from tests.support.waiting import until

DEADLINE_S = 20.0
STEPS = 6
FOLLOW = {"idle_check_s": 0.2, "bus_retry_s": 0.1, "bus_timeout_s": 0.2, "poll_s": 0.02}


@pytest.fixture
def server(private_redis_server: PrivateRedis) -> PrivateRedis:
    return private_redis_server


@pytest.fixture
async def bus(server: PrivateRedis) -> AsyncIterator[RedisStreamBus]:
    b = RedisStreamBus.connect(server.url, block_ms=100)
    yield b
    with contextlib.suppress(StoreError):
        await b.close()


class GatedModel:
    """Step n waits for ``gates[n]`` (if given), streams two deltas, then calls a tool;
    the last Step answers. The deltas say which Step they belong to."""

    def __init__(self, gates: list[asyncio.Event] | None = None) -> None:
        self.gates = gates

    async def stream(self, request: Any) -> Any:
        step = request.step
        if self.gates is not None:
            await self.gates[step].wait()
        for part in ("working ", f"on step {step}"):
            yield ModelDelta(text=part)
        if step == STEPS - 1:
            yield ModelResponse(text="all done")
        else:
            yield ModelResponse(text=f"step {step}", tool_calls=(call("noop", f"c{step}"),))


@tool
def noop() -> str:
    return "ok"


def runner(store: Any, bus: Any = None, gates: list[asyncio.Event] | None = None) -> Any:
    agent = Agent(name="a", model=GatedModel(gates), tools=[noop], max_steps=STEPS)
    return InProcessRunner(agent, store, bus=bus)


async def reference_labels() -> list[str]:
    """The commits of the same Run with no bus at all."""
    store = MemoryCommitStore()
    await runner(store).start("go", thread_id="t", run_id="r")
    return [r.commit.label for r in await store.read("t")]


async def collect(frames: AsyncIterator[Frame], into: list[Frame]) -> list[Frame]:
    async for frame in frames:
        into.append(frame)
    return into


async def committed_offsets(store: Any) -> list[str]:
    return [
        f"{f.seq}:{f.index}" for r in await store.read("t") for f in stamp_facts(r.commit, r.seq)
    ]


def fact_offsets(frames: list[Frame]) -> list[str]:
    return [f.offset for f in frames if f.offset is not None]


def deltas_of(frames: list[Frame], step: int) -> list[str]:
    return [f.event.text for f in frames if isinstance(f.event, Delta) and f.event.step == step]


def has_fact(frames: list[Frame], kind: str, call_id: str) -> bool:
    return any(
        isinstance(f.event, Fact)
        and f.event.type == kind
        and f.event.data.get("call_id") == call_id
        for f in frames
    )


async def eventually(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    await until(check, DEADLINE_S, what=what, interval_s=0.01)


class Admin:
    """A client of its own on the private server: who is blocked reading, pausing writes."""

    def __init__(self, url: str) -> None:
        self.client = open_client(url)

    async def follower_on_bus(self) -> bool:
        """True once a client is blocked in XREAD: a follower reads the bus."""
        try:
            clients = await self.client.client_list()
        except Exception:  # the server is not up (yet); a raw client raises driver errors
            return False
        return any(c.get("cmd") == "xread" for c in clients)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()


@pytest.fixture
async def admin(server: PrivateRedis) -> AsyncIterator[Admin]:
    a = Admin(server.url)
    yield a
    await a.close()


async def release(gates: list[asyncio.Event], frames: list[Frame], steps: range) -> None:
    """Let each Step run once the follower has seen the one before."""
    for step in steps:
        gates[step].set()
        await eventually(lambda s=step: has_fact(frames, "tool_call", f"c{s}"), f"step {step}")


async def test_a_run_whose_bus_is_gone_commits_everything_and_is_followed_from_the_store(
    server, bus
):
    await asyncio.to_thread(server.stop)  # for good
    store = MemoryCommitStore()
    gates = [asyncio.Event() for _ in range(STEPS)]
    run = runner(store, bus, gates)
    frames: list[Frame] = []
    watch = asyncio.create_task(collect(follow(store, "t", bus=bus, **FOLLOW), frames))
    started = asyncio.create_task(run.start("go", thread_id="t", run_id="r"))
    for step, gate in enumerate(gates[:-1]):  # each Step is followed while the Run goes on
        gate.set()
        await eventually(lambda s=step: has_fact(frames, "tool_call", f"c{s}"), f"step {step}")
    gates[-1].set()
    done = await asyncio.wait_for(started, DEADLINE_S)
    assert done.run_state.cause.kind == "natural"
    # the same commits as a Run with no bus, and the bus really was tried and refused
    assert [r.commit.label for r in await store.read("t")] == await reference_labels()
    await asyncio.wait_for(run.publisher.flush(), DEADLINE_S)
    assert run.publisher.failed > 0 and run.publisher.dropped == 0
    await asyncio.wait_for(watch, DEADLINE_S)
    assert fact_offsets(frames) == await committed_offsets(store)
    assert not any(f.type == "delta" for f in frames)  # deltas only ever come from the bus


async def test_a_bus_stopped_and_started_mid_stream_is_returned_to_with_no_fact_lost(
    server, bus, admin
):
    store = MemoryCommitStore()
    gates = [asyncio.Event() for _ in range(STEPS)]
    run = runner(store, bus, gates)
    on_bus = admin.follower_on_bus
    frames: list[Frame] = []
    watch = asyncio.create_task(collect(follow(store, "t", bus=bus, **FOLLOW), frames))
    started = asyncio.create_task(run.start("go", thread_id="t", run_id="r"))

    await eventually(on_bus, "the follower reads the bus")
    gates[0].set()
    await eventually(lambda: has_fact(frames, "tool_call", "c0"), "step 0 followed")
    assert "".join(deltas_of(frames, 0)) == "working on step 0"  # live, through the bus

    await asyncio.to_thread(server.stop)
    gates[1].set()
    await eventually(lambda: has_fact(frames, "tool_call", "c1"), "step 1 from the store")
    assert deltas_of(frames, 1) == []  # published to nobody: the bus was down

    await asyncio.to_thread(server.start)
    await eventually(on_bus, "the follower is back on the bus")
    gates[2].set()
    await eventually(lambda: deltas_of(frames, 2), "deltas arrive again")
    for gate in gates[3:]:
        gate.set()
    done = await asyncio.wait_for(started, DEADLINE_S)
    await asyncio.wait_for(watch, DEADLINE_S)
    assert done.run_state.cause.kind == "natural"
    assert "".join(deltas_of(frames, 2)) == "working on step 2"
    assert fact_offsets(frames) == await committed_offsets(store)  # none lost, none twice


async def test_a_hung_bus_holds_up_no_commit_and_is_returned_to_when_it_wakes(server, bus, admin):
    pid = server._proc.pid  # type: ignore[union-attr]
    store = MemoryCommitStore()
    gates = [asyncio.Event() for _ in range(STEPS)]
    run = runner(store, bus, gates)
    frames: list[Frame] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        watch = asyncio.create_task(collect(follow(store, "t", bus=bus, **FOLLOW), frames))
        started = asyncio.create_task(run.start("go", thread_id="t", run_id="r"))
        await release(gates, frames, range(3))  # followed from the store
        # three Steps committed while the bus has not answered a single publish
        labels = [r.commit.label for r in await store.read("t")]
        assert len(labels) >= 6 and labels == (await reference_labels())[: len(labels)]
        publisher = run.publisher
        assert publisher.failed == 0 and publisher._task is not None and not publisher._task.done()
        assert not any(f.type == "delta" for f in frames)
    finally:
        os.kill(pid, signal.SIGCONT)
    await eventually(admin.follower_on_bus, "the follower is back on the bus")
    gates[3].set()
    await eventually(lambda: deltas_of(frames, 3), "deltas arrive again")
    for gate in gates[4:]:
        gate.set()
    assert (await asyncio.wait_for(started, DEADLINE_S)).run_state.cause.kind == "natural"
    await asyncio.wait_for(watch, DEADLINE_S)
    assert fact_offsets(frames) == await committed_offsets(store)  # none lost, none twice
    # what was queued while it hung reached the bus too, in order, each fact once
    await asyncio.wait_for(run.publisher.flush(), DEADLINE_S)
    assert run.publisher.failed == 0
    assert await facts_on_bus(bus) == await committed_offsets(store)


async def test_facts_published_late_are_not_repeated_to_a_follower_that_filled_in(
    server, bus, admin
):
    """Writes paused (CLIENT PAUSE WRITE): the bus answers reads but publishes stall, so
    the follower, on a quiet bus, fills in from the store; the stalled facts then arrive
    on the bus after it has delivered them, and must not be delivered again."""
    store = MemoryCommitStore()
    gates = [asyncio.Event() for _ in range(STEPS)]
    run = runner(store, bus, gates)
    frames: list[Frame] = []
    watch = asyncio.create_task(collect(follow(store, "t", bus=bus, **FOLLOW), frames))
    started = asyncio.create_task(run.start("go", thread_id="t", run_id="r"))
    await eventually(admin.follower_on_bus, "the follower reads the bus")
    await admin.client.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    try:
        await release(gates, frames, range(3))  # from the store, while the bus is quiet
        assert run.publisher.failed == 0
    finally:
        await admin.client.execute_command("CLIENT", "UNPAUSE")
    await asyncio.wait_for(run.publisher.flush(), DEADLINE_S)  # the late facts are on the bus
    await release(gates, frames, range(3, STEPS - 1))
    gates[-1].set()
    assert (await asyncio.wait_for(started, DEADLINE_S)).run_state.cause.kind == "natural"
    await asyncio.wait_for(watch, DEADLINE_S)
    assert fact_offsets(frames) == await committed_offsets(store)
    assert await facts_on_bus(bus) == await committed_offsets(store)
    assert deltas_of(frames, 3)  # the follower stayed on the bus throughout


async def facts_on_bus(bus: RedisStreamBus) -> list[str]:
    """Every fact the thread's stream holds, up to the Run's end."""
    got: list[str] = []
    async with asyncio.timeout(DEADLINE_S):
        async for item in bus.subscribe("t", after="0-0"):
            if isinstance(item.event, Fact):
                got.append(f"{item.event.seq}:{item.event.index}")
                if item.event.type == "run_finished":
                    return got
    return got
