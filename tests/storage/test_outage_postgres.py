"""A PostgreSQL outage in the middle of a Run: it pauses, retries, completes intact.

A private PostgreSQL (own temp dir and port) is stopped by the first tool while it
runs, so the commit of that tool's result finds no server. The engine sees
StoreUnavailable and backs off; a concurrent task restarts the server on the same
port and data directory once the engine's first retry was observed (a log record,
not a timer). The Run then completes, and its log replays to the stored frontier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import pytest

from runtime import Agent, EndedState, ModelResponse, ScriptedModel, call, tool
from runtime.engine import Engine, StoreRetry
from runtime.ids import ThreadId
from runtime.rules import replay
from runtime.tool_calls import LocalToolRunner
from storage.sql import SqlCommitStore
from tests.support.servers import PrivatePostgres, private_postgres

DEADLINE_S = 30.0
T = ThreadId("outage-thread")


class RetrySeen(logging.Handler):
    """Signals once the engine logged ``wanted`` "store unavailable; retrying" records."""

    def __init__(self, wanted: int) -> None:
        super().__init__(logging.WARNING)
        self.event = asyncio.Event()
        self.count = 0
        self.wanted = wanted

    def emit(self, record: logging.LogRecord) -> None:
        if "store unavailable" in record.getMessage():
            self.count += 1
            if self.count >= self.wanted:
                self.event.set()


@pytest.fixture
def server() -> Iterator[PrivatePostgres]:
    with private_postgres() as s:
        yield s


@pytest.fixture
async def store(server: PrivatePostgres) -> AsyncIterator[SqlCommitStore]:
    s = await SqlCommitStore.connect(server.url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(params=[1, 3], ids=["restart-at-first-retry", "restart-at-third-retry"])
def retries(request: pytest.FixtureRequest) -> Iterator[RetrySeen]:
    """Restart at the first retry (a dead pooled connection), or at the third
    (connections refused while the server is down)."""
    handler = RetrySeen(request.param)
    engine_log = logging.getLogger("ratchet.engine")
    engine_log.addHandler(handler)
    try:
        yield handler
    finally:
        engine_log.removeHandler(handler)


def outage_agent(server: PrivatePostgres, effects: list[str]) -> Agent:
    @tool(recovery=("never_replay",))
    async def charge(amount: int) -> str:
        effects.append(f"charge {amount}")
        if len(effects) == 1:  # the server goes away between this call's commits
            await asyncio.to_thread(server.stop)
        return f"charged {amount}"

    script = [
        ModelResponse(text=f"step {i}", tool_calls=(call("charge", f"c{i}", amount=i),))
        for i in range(3)
    ]
    script.append(ModelResponse(text="all charged"))
    return Agent(name="outage", model=ScriptedModel(script), tools=[charge])


async def test_run_survives_a_postgres_outage(
    server: PrivatePostgres, store: SqlCommitStore, retries: RetrySeen
) -> None:
    effects: list[str] = []
    agent = outage_agent(server, effects)
    fast = StoreRetry(first_delay_s=0.05, max_delay_s=0.5, give_up_after_s=DEADLINE_S)
    engine = Engine(agent, store, LocalToolRunner(agent.tools), store_retry=fast)

    async def restart_after_first_retry() -> None:
        await retries.event.wait()
        await asyncio.to_thread(server.start)

    restarter = asyncio.create_task(restart_after_first_retry())
    final = await asyncio.wait_for(engine.start(T, "charge three times"), DEADLINE_S)
    await asyncio.wait_for(restarter, DEADLINE_S)

    assert retries.count >= retries.wanted  # the Run saw StoreUnavailable and backed off
    assert isinstance(final.run_state, EndedState) and final.run_state.cause.kind == "natural"
    assert effects == ["charge 0", "charge 1", "charge 2"]  # each effect exactly once
    records = await store.read(T)
    assert [r.seq for r in records] == list(range(1, final.version + 1))  # no gap
    ops = [r.commit.operation_id for r in records]
    assert len(set(ops)) == len(ops)  # nothing written twice
    stored = await store.load(T)
    assert stored == final
    rebuilt = replay(T, [r.commit for r in records])
    ownership = {"epoch", "owner"}
    assert rebuilt.model_dump(exclude=ownership) == stored.model_dump(exclude=ownership)


async def test_a_stream_follower_waits_out_a_postgres_outage(
    server: PrivatePostgres, store: SqlCommitStore
) -> None:
    """A follower whose read meets the outage asks again with backoff rather than end
    (``runtime.stream.STORE_PATIENCE_S``); once the server is back it goes on and
    serves the facts committed after it, the Run's end among them."""
    from runtime import InProcessRunner, PermissionDecision
    from runtime.events import Fact
    from runtime.lifecycle import answer
    from runtime.stream import Frame, follow
    from tests.ray.agents import permission_agent
    from tests.support.waiting import until

    runner = InProcessRunner(permission_agent, store)
    parked = await runner.start("clean up", thread_id="t-follow-outage")
    seen: list[Frame] = []

    def facts() -> list[str]:
        return [f.event.type for f in seen if isinstance(f.event, Fact)]

    async def consume() -> None:
        async for frame in follow(store, parked.thread_id, until_rest=False, poll_s=0.01):
            seen.append(frame)

    paused = RetrySeen(1)
    paused.setLevel(logging.INFO)
    stream_log = logging.getLogger("ratchet.stream")
    level = stream_log.level
    stream_log.setLevel(logging.INFO)
    stream_log.addHandler(paused)
    follower = asyncio.create_task(consume())
    try:
        await until(lambda: "awaiting" in facts(), DEADLINE_S, what="the parked Run's facts")
        await asyncio.to_thread(server.stop)
        await asyncio.wait_for(paused.event.wait(), DEADLINE_S)  # it met the outage
        await asyncio.to_thread(server.start)
        ticket = parked.run_state.ticket  # type: ignore[union-attr]
        final = await runner.resume(answer(ticket, PermissionDecision(approve=True)))
        assert isinstance(final.run_state, EndedState)
        await until(lambda: "run_finished" in facts(), DEADLINE_S, what="the end, streamed")
        assert not follower.done()  # still following, as until_rest=False asks
        offsets = [f.offset for f in seen if f.offset is not None]
        assert len(offsets) == len(set(offsets))  # nothing served twice across the outage
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        stream_log.removeHandler(paused)
        stream_log.setLevel(level)
