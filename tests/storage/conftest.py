"""Backends for the CommitStore conformance suite, each isolated per test.

memory: a fresh store. sqlite: a fresh file in tmp_path. postgres: one database
for the session, created fresh and truncated before each test. redis: a
dedicated db number, FLUSHDB before each test.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text, update

from runtime.ids import ThreadId
from runtime.ports import CommitStore
from storage.memory import MemoryCommitStore
from storage.schema import commits, threads
from storage.sql import SqlCommitStore
from tests.conftest import IN_CI
from tests.support.servers import PrivateRedis, private_redis

BACKENDS = ["memory", "sqlite", "postgres", "redis"]
REDIS_TEST_DB = 9
"""A db number of the shared server that only these tests use (flushed per test)."""

Corruptor = Callable[[ThreadId, int, str], Awaitable[None]]


async def _admin_async(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _admin(url: str, sql: str) -> None:
    """Run one admin statement on its own loop in a thread (callers may be inside a loop)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _admin_async(url, sql)).result(timeout=60)


@pytest.fixture(scope="session")
def pg_conformance_url(postgres_url: str) -> Iterator[str]:
    """A fresh database of the shared server, dropped at the end of the session."""
    name = f"ratchet_conf_{uuid.uuid4().hex[:10]}"
    _admin(postgres_url, f"CREATE DATABASE {name}")
    yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    _admin(postgres_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_TEST_DB}"


async def _redis_store(url: str) -> CommitStore:
    from storage.redis_client import open_client
    from storage.redis_store import RedisCommitStore  # another helper's module

    client = open_client(url)  # emptied before the store connects: emptied after, it is
    await client.flushdb()  # a store whose contents were lost (StoreLost)
    await client.aclose()
    return await RedisCommitStore.connect(url)


async def _postgres_store(url: str) -> SqlCommitStore:
    store = await SqlCommitStore.connect(url)
    async with store.engine.begin() as conn:
        tables = "ratchet_threads, ratchet_commits, ratchet_pruned_messages, ratchet_checkpoints"
        tables += ", ratchet_leases"
        await conn.execute(text(f"TRUNCATE {tables}"))
    return store


async def make_store(backend: str, url: str) -> Any:
    if backend == "memory":
        return MemoryCommitStore()
    if backend == "sqlite":
        return await SqlCommitStore.connect(url)
    if backend == "postgres":
        return await _postgres_store(url)
    return await _redis_store(url)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Resolved outside the event loop: the server fixtures are synchronous."""
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/store/ratchet.db"
    if backend == "postgres":
        return str(request.getfixturevalue("pg_conformance_url"))
    return str(request.getfixturevalue("redis_test_url"))


@pytest.fixture
async def store(backend: str, backend_url: str) -> AsyncIterator[Any]:
    s = await make_store(backend, backend_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """A fresh SQL store on each database in turn."""
    backend = str(request.param)
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path}/sql.db"
    else:
        url = str(request.getfixturevalue("pg_conformance_url"))
    s = await make_store(backend, url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def corrupt(store: Any, backend: str) -> Corruptor:
    """Overwrite a stored commit record behind the store's back, as a disk might."""

    async def run(thread: ThreadId, seq: int, body: str) -> None:
        if backend == "memory":
            store.corrupt(thread, seq, body)
        elif backend == "redis":
            await store.client.lset(f"ratchet:thread:{thread}:log", seq - 1, body)
        else:
            async with store.engine.begin() as conn:
                stmt = update(commits).where(commits.c.thread_id == thread, commits.c.seq == seq)
                await conn.execute(stmt.values(body=body))

    return run


@pytest.fixture
def corrupt_frontier(store: Any, backend: str) -> Corruptor:
    """Overwrite a thread's stored frontier; the memory store keeps none encoded."""

    async def run(thread: ThreadId, _seq: int, body: str) -> None:
        if backend == "memory":
            pytest.skip("the memory store keeps its frontier as an object: nothing to corrupt")
        elif backend == "redis":
            await store.client.hset(f"ratchet:thread:{thread}:meta", "frontier", body)
        else:
            async with store.engine.begin() as conn:
                stmt = update(threads).where(threads.c.thread_id == thread)
                await conn.execute(stmt.values(frontier=body))

    return run


@pytest.fixture
def private_redis_server() -> Iterator[PrivateRedis]:
    """A redis-server of the test's own (own port, temporary directory), for tests that
    stop or hang it; in CI (CI=true) a missing redis-server fails, elsewhere it skips."""
    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server is not installed (CI=true: a missing service fails)")
        pytest.skip("redis-server is not installed")
    with private_redis() as s:
        yield s
