"""StreamCheckpointStore: get/put/delete, and best effort when the server is gone or hung."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from runtime import Agent, Crash, Engine, LocalToolRunner, ModelDelta, ModelResponse
from runtime.checkpoint import SafeCheckpoints
from runtime.ids import RunId, ThreadId
from runtime.ports import StreamCheckpoint
from storage.checkpoints import MemoryCheckpointStore, SqlCheckpointStore
from storage.memory import MemoryCommitStore
from storage.redis_checkpoints import RedisCheckpointStore
from storage.schema import checkpoints
from storage.sql import SqlCommitStore
from storage.sql_engine import create_engine
from tests.storage.conftest import make_store
from tests.support.servers import PrivateRedis
from tests.support.waiting import until

T = ThreadId("t-checkpoint")
CP = StreamCheckpoint(run_id=RunId("r"), step=2, text="partial", tool_calls=({"id": "c1"},))


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def checkpoint_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryCheckpointStore()
        return
    url = (
        f"sqlite:///{tmp_path}/cp.db"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_conformance_url")
    )
    store: SqlCommitStore = await make_store(request.param, url)
    try:
        yield store.checkpoints()
    finally:
        await store.close()


async def test_put_get_replace_delete(checkpoint_store: Any) -> None:
    assert await checkpoint_store.get(T) is None
    await checkpoint_store.put(T, CP)
    assert await checkpoint_store.get(T) == CP
    newer = CP.model_copy(update={"text": "partial and more"})
    await checkpoint_store.put(T, newer)
    assert await checkpoint_store.get(T) == newer
    await checkpoint_store.delete(T)
    await checkpoint_store.delete(T)  # deleting twice is harmless
    assert await checkpoint_store.get(T) is None


async def test_undecodable_checkpoint_reads_as_none(tmp_path: Path) -> None:
    store = await SqlCommitStore.connect(f"sqlite:///{tmp_path}/cp.db")
    try:
        cps = store.checkpoints()
        await cps.put(T, CP)
        async with store.engine.begin() as conn:
            await conn.execute(update(checkpoints).values(body="{not json"))
        assert await cps.get(T) is None
    finally:
        await store.close()


async def test_unreachable_server_is_logged_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    url = "postgresql://ratchet:s3cret-pw@127.0.0.1:9/ratchet"
    cps = SqlCheckpointStore(create_engine(url), "postgresql://ratchet:***@127.0.0.1:9/ratchet")
    try:
        await cps.put(T, CP)
        assert await cps.get(T) is None
        await cps.delete(T)
    finally:
        await cps.engine.dispose()
    assert caplog.text.count("ignored") == 3
    assert "s3cret" not in caplog.text


FORGED_CALL = {"id": "forged", "name": "rm", "arguments": '{"path": "/"}'}


async def test_a_checkpoint_edited_by_hand_or_moved_is_not_acted_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint's complete tool calls are run on recovery without asking the model:
    one whose body was edited (its digest left as it was), or that was copied from
    another thread, is ignored, never acted on."""
    store = await SqlCommitStore.connect(f"sqlite:///{tmp_path}/cp.db")
    try:
        cps = store.checkpoints()
        await cps.put(T, CP)
        async with store.engine.begin() as conn:
            (stored,) = (await conn.execute(select(checkpoints.c.body))).scalars()
            digest, body = stored.split("\n", 1)
            forged = json.loads(body) | {"tool_calls": [FORGED_CALL]}
            edited = f"{digest}\n{json.dumps(forged)}"
            await conn.execute(update(checkpoints).values(body=edited))
        with caplog.at_level(logging.WARNING, logger="ratchet.storage.checkpoints"):
            assert await cps.get(T) is None
        assert "digest does not match" in caplog.text
        other = ThreadId("t-other")
        await cps.put(other, CP)
        async with store.engine.begin() as conn:
            moved = (
                await conn.execute(
                    select(checkpoints.c.body).where(checkpoints.c.thread_id == other)
                )
            ).scalar_one()
            await conn.execute(
                update(checkpoints).where(checkpoints.c.thread_id == T).values(body=moved)
            )
        assert await cps.get(T) is None  # another thread's checkpoint
    finally:
        await store.close()


@pytest.fixture
def redis_server(private_redis_server: PrivateRedis) -> PrivateRedis:
    return private_redis_server


class Counted:
    """The real store, counting the calls that reach it."""

    def __init__(self, inner: RedisCheckpointStore) -> None:
        self.inner = inner
        self.reached = 0

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        self.reached += 1
        return await self.inner.get(thread)

    async def put(self, thread: ThreadId, cp: StreamCheckpoint) -> None:
        self.reached += 1
        await self.inner.put(thread, cp)

    async def delete(self, thread: ThreadId) -> None:
        self.reached += 1
        await self.inner.delete(thread)


class Streaming:
    """Streams ``DELTAS`` words, 50 ms apart; ``at_word(i)`` runs before word i. Ends
    with the whole text, or dies (Crash) after word ``dies_after`` if given."""

    DELTAS = 60

    def __init__(self, at_word: Any = None, dies_after: int | None = None) -> None:
        self.at_word = at_word or (lambda i: None)
        self.dies_after = dies_after

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        for i in range(self.DELTAS):
            self.at_word(i)
            if i == self.dies_after:
                raise Crash("the process died mid-inference")
            await asyncio.sleep(0.05)
            yield ModelDelta(text=f"w{i} ")
        yield ModelResponse(text="".join(f"w{i} " for i in range(self.DELTAS)))


def streaming_engine(model: Streaming, safe: SafeCheckpoints) -> Engine:
    agent = Agent(name="cp", model=model)
    return Engine(agent, MemoryCommitStore(), LocalToolRunner(()), checkpoints=safe)


async def test_a_hung_redis_holds_up_a_streamed_step_once_not_at_every_checkpoint(
    redis_server: PrivateRedis,
) -> None:
    """Redis stopped (SIGSTOP) mid-stream: the one checkpoint write that meets it waits
    out its timeout, the rest are skipped, so the Step ends about one timeout later than
    it would have (a 3 s stream; every write waiting out 1 s would take over 12 s). Once
    Redis answers again and the cool-down is over, checkpoints are written again."""
    pid = redis_server._proc.pid  # type: ignore[union-attr]
    redis = RedisCheckpointStore.connect(redis_server.url)
    counted = Counted(redis)
    safe = SafeCheckpoints(counted, timeout_s=1.0, cool_down_s=6.0)
    stopped_at: list[int] = []

    def stop_at_word_10(i: int) -> None:
        if i == 10:
            stopped_at.append(counted.reached)
            os.kill(pid, signal.SIGSTOP)

    try:
        run = streaming_engine(Streaming(stop_at_word_10), safe).start("t1", "go")
        done = await asyncio.wait_for(run, 8.0)
        assert done.run_state.cause.kind == "natural"
        assert stopped_at[0] > 0 and counted.reached == stopped_at[0] + 1
    finally:
        os.kill(pid, signal.SIGCONT)
    await until(lambda: not safe.cooling(), 10.0, what="the cool-down to end")
    assert await safe.get(ThreadId("t1")) is None  # its delete was owed, and is made now
    assert await redis.get(ThreadId("t1")) is None
    with pytest.raises(Crash):
        await streaming_engine(Streaming(dies_after=20), safe).start("t2", "go")
    written = await redis.get(ThreadId("t2"))
    assert written is not None and written.text.startswith("w0 w1 ")
    await redis.close()
