"""A Redis outage in the middle of a Run: it pauses, retries, and completes intact.

A private redis-server (own port and directory, AOF with ``appendfsync always``)
is stopped by the first tool while it runs, so the next commit finds no server.
The engine sees StoreUnavailable and backs off; a concurrent task restarts the
server on the same port and directory once the first failure was observed; the
Run then completes, and its log replays to exactly the stored frontier.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime import Agent, EndedState, InProcessRunner, ModelResponse, ScriptedModel, call, tool
from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.errors import StoreUnavailable
from runtime.ids import ThreadId
from runtime.rules import replay
from storage.redis_store import RedisCommitStore
from tests.support.servers import PrivateRedis

DEADLINE_S = 30.0


@pytest.fixture
def server(private_redis_server: PrivateRedis) -> PrivateRedis:
    return private_redis_server


class Watched:
    """The real store, plus a signal when it first reports the outage to the engine."""

    def __init__(self, inner: RedisCommitStore) -> None:
        self.inner = inner
        self.unavailable = 0
        self.failed = asyncio.Event()

    async def _watch(self, op: Any) -> Any:
        try:
            return await op
        except StoreUnavailable:
            self.unavailable += 1
            self.failed.set()
            raise

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, **claim: Any
    ) -> Receipt:
        return await self._watch(self.inner.append(commit, expected_version, epoch, **claim))

    async def load(self, thread: ThreadId) -> Frontier:
        return await self._watch(self.inner.load(thread))

    async def load_head(self, thread: ThreadId) -> Frontier:
        return await self._watch(self.inner.load_head(thread))

    async def read(self, thread: ThreadId, after_seq: int = 0) -> Any:
        return await self._watch(self.inner.read(thread, after_seq))

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        return await self._watch(self.inner.claim(thread, owner, supersedes))

    async def list_runs(self, state: Any = None, **host: Any) -> Any:
        return await self._watch(self.inner.list_runs(state, **host))

    async def close(self) -> None:
        await self.inner.close()


def outage_agent(server: PrivateRedis, effects: list[str]) -> Agent:
    @tool(recovery=("never_replay",))
    def charge(amount: int) -> str:
        effects.append(f"charge {amount}")
        if len(effects) == 1:
            server.stop()  # the server goes away between this call's commits
        return f"charged {amount}"

    @tool(recovery=("never_replay",))
    def notify(who: str) -> str:
        effects.append(f"notify {who}")
        return f"told {who}"

    script = [
        ModelResponse(text="charging", tool_calls=(call("charge", "c1", amount=5),)),
        ModelResponse(text="notifying", tool_calls=(call("notify", "c2", who="ann"),)),
        ModelResponse(text="all done"),
    ]
    return Agent(name="outage", model=ScriptedModel(script), tools=[charge, notify])


async def restart_after_first_failure(server: PrivateRedis, store: Watched) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await store.failed.wait()
        await asyncio.to_thread(server.start)  # same port, same directory, same AOF


async def test_a_run_rides_out_a_redis_outage_and_completes_intact(
    server: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    store = Watched(await RedisCommitStore.connect(server.url))
    assert "not durable" not in caplog.text  # AOF with appendfsync always
    effects: list[str] = []
    runner = InProcessRunner(outage_agent(server, effects), store)
    restarter = asyncio.create_task(restart_after_first_failure(server, store))
    async with asyncio.timeout(DEADLINE_S):
        final = await runner.start("go", thread_id="t-outage")
        await restarter
    assert store.unavailable >= 1  # the Run really met the outage and retried
    assert isinstance(final.run_state, EndedState) and final.run_state.cause.kind == "natural"
    assert effects == ["charge 5", "notify ann"]  # no never_replay effect ran twice

    thread = ThreadId("t-outage")
    records = await store.read(thread)
    assert [r.seq for r in records] == list(range(1, final.version + 1))  # no gap
    ops = [r.commit.operation_id for r in records]
    assert len(set(ops)) == len(ops)  # nothing committed twice
    loaded = await store.load(thread)
    assert loaded.model_copy(update={"epoch": 0, "owner": None}) == replay(
        thread, [r.commit for r in records]
    )
    assert loaded.model_copy(update={"epoch": 0, "owner": None}) == final.model_copy(
        update={"epoch": 0, "owner": None}
    )
    await store.close()
