"""The SQL store's deadline: a caller gives up on a stuck group writer, not on a long
queue ahead of it, and a request whose caller gave up is not written; on PostgreSQL
the driver's own timeouts follow the store's and say which ran out, a row another
client holds locked stalls the groups behind its own for seconds only, and a store on
a hung server closes in seconds.

The writer is slowed or held by wrapping ``_commit_taken`` (the real transaction runs
after the wrapper lets it): a stand-in for a slow or hung server that leaves every
statement real. A hung server is a private PostgreSQL whose processes are stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Connection, text

from runtime.errors import StoreUnavailable
from runtime.ids import ThreadId
from storage.frontiers import FrontierCache
from storage.sql import SqlCommitStore
from storage.sql_engine import CLOSE_S, CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S
from storage.sql_statements import LOCK_TIMEOUT_S
from tests.storage.builders import activation, head, step
from tests.storage.conftest import make_store
from tests.support.servers import PrivatePostgres, private_postgres
from tests.support.waiting import until

DEADLINE_S = 0.6


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqlCommitStore]:
    backend = str(request.param)
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path}/deadline/ratchet.db"
    else:
        url = str(request.getfixturevalue("pg_conformance_url"))
    opened: SqlCommitStore = await make_store(backend, url)
    opened.timeout_s = DEADLINE_S
    try:
        yield opened
    finally:
        await opened.close()


def _before_each_group(store: SqlCommitStore, wait: Callable[[], Awaitable[object]]) -> None:
    real = store._commit_taken

    async def held(group: list[Any]) -> None:
        await wait()
        await real(group)

    store._commit_taken = held  # type: ignore[method-assign]


async def test_a_long_queue_behind_a_writer_that_progresses_is_not_an_outage(
    store: SqlCommitStore,
) -> None:
    """Ten groups of one, each a third of the deadline: the last caller waits three
    times the deadline in all, yet no group took longer than a third of it."""
    store.db.max_group = 1

    async def slow() -> None:
        await asyncio.sleep(DEADLINE_S / 3)  # the server's own time, not a wait on a test

    _before_each_group(store, slow)
    threads = [ThreadId(f"q-{i}") for i in range(10)]
    began = asyncio.get_running_loop().time()
    receipts = await asyncio.gather(*(store.append(activation(t, f"r-{t}"), 0, 0) for t in threads))
    assert [r.seq for r in receipts] == [1] * 10
    assert asyncio.get_running_loop().time() - began > 2 * DEADLINE_S  # the queue was long
    for thread in threads:
        assert (await store.load_head(thread)).version == 1


async def test_every_waiting_caller_gives_up_on_a_stuck_writer_and_the_store_recovers(
    store: SqlCommitStore,
) -> None:
    release = asyncio.Event()
    _before_each_group(store, release.wait)
    began = asyncio.get_running_loop().time()
    calls = [store.append(activation(f"s-{i}", f"r-{i}"), 0, 0) for i in range(5)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    waited = asyncio.get_running_loop().time() - began
    assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
    assert "did not answer" in str(outcomes[0])
    assert DEADLINE_S <= waited < 10 * DEADLINE_S
    release.set()  # the server answers again: the held group is written (its callers
    # heard StoreUnavailable: outcome unknown, a retry is idempotent) and new appends land
    receipt = await store.append(activation("s-after", "r-after"), 0, 0)
    assert receipt.seq == 1


async def test_a_request_whose_caller_gave_up_is_not_written(store: SqlCommitStore) -> None:
    release = asyncio.Event()
    taken: list[int] = []

    async def hold() -> None:
        taken.append(1)
        await release.wait()

    _before_each_group(store, hold)
    first = asyncio.create_task(store.append(activation("c-first", "r"), 0, 0))
    await until(lambda: bool(taken))  # the writer holds the first group
    second = asyncio.create_task(store.append(activation("c-gone", "r"), 0, 0))
    await until(lambda: store._queue.qsize() == 1)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    release.set()
    assert (await first).seq == 1
    third = await store.append(activation("c-third", "r"), 0, 0)
    assert third.seq == 1 and store.skipped == 1
    assert await store.read(ThreadId("c-gone")) == []


async def test_an_outage_fails_the_requests_queued_behind_its_group(
    store: SqlCommitStore,
) -> None:
    """Each would otherwise wait for a group of its own to meet the outage (a hung
    server: one driver timeout after another)."""
    release = asyncio.Event()
    groups: list[int] = []

    async def outage(*_: object) -> None:
        groups.append(1)
        await release.wait()
        raise StoreUnavailable("the server went away")

    real_write, real_planned = store._write, store._write_planned
    store._write = outage  # type: ignore[method-assign,assignment]
    store._write_planned = outage  # type: ignore[method-assign,assignment]
    first = asyncio.create_task(store.append(activation("o-first", "r"), 0, 0))
    await until(lambda: bool(groups))
    behind = [asyncio.create_task(store.append(activation(f"o-{i}", "r"), 0, 0)) for i in (1, 2)]
    await until(lambda: store._queue.qsize() == 2)
    release.set()
    outcomes = await asyncio.gather(first, *behind, return_exceptions=True)
    assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
    assert len(groups) == 1  # the two behind never reached the server
    store._write, store._write_planned = real_write, real_planned  # type: ignore[method-assign]
    assert (await store.append(activation("o-1", "r"), 0, 0)).seq == 1


async def test_a_hung_postgres_server_is_heard_within_the_deadline_and_nothing_is_lost() -> None:
    """The server's processes stopped (SIGSTOP): every append queued meanwhile hears
    StoreUnavailable once no group has moved for ``timeout_s``, not at the driver's
    command timeout; continued, the same appends retried land exactly once."""
    with private_postgres() as server:
        store = await SqlCommitStore.connect(server.url, timeout_s=DEADLINE_S * 2)
        try:
            assert (await store.append(activation("h-before", "r"), 0, 0)).seq == 1
            commits = [activation(f"h-{i}", "r") for i in range(3)]
            with _hung(server):
                began = asyncio.get_running_loop().time()
                outcomes = await asyncio.gather(
                    *(store.append(c, 0, 0) for c in commits), return_exceptions=True
                )
                waited = asyncio.get_running_loop().time() - began
            assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
            assert waited < 10 * DEADLINE_S  # the driver's own timeout is 30 s
            for commit in commits:  # retried after the outage: idempotent by operation id
                receipt = await _retrying(functools.partial(store.append, commit, 0, 0))
                assert receipt.seq == 1
            for commit in commits:
                assert len(await store.read(commit.thread_id)) == 1
        finally:
            await store.close()


async def test_closing_a_store_on_a_hung_postgres_server_cuts_its_connections() -> None:
    """asyncpg closes a connection by waiting for the server's goodbye, up to the
    command timeout, and the pool closes its connections one after another: a pool of
    ten on a stopped server took five minutes to close (a host's shutdown, the CLI)."""
    with private_postgres() as server:
        store = await SqlCommitStore.connect(server.url)
        await asyncio.gather(*(store.load_head(ThreadId(f"k-{i}")) for i in range(6)))
        assert store.engine.pool.checkedin() >= 3  # several connections to see off
        with _hung(server):
            began = asyncio.get_running_loop().time()
            await asyncio.wait_for(store.close(), CLOSE_S + 10)
            took = asyncio.get_running_loop().time() - began
        assert took < CLOSE_S + 2


async def test_a_statement_has_the_store_deadline_and_its_timeout_says_so(
    pg_conformance_url: str,
) -> None:
    """asyncpg's command timeout was 30 s whatever the store's ``timeout_s``: a statement
    over 30 s could never succeed, and one the store had given up on ran on."""
    store = await SqlCommitStore.connect(pg_conformance_url, timeout_s=1)
    try:
        assert await store.db.read(_sleep, 0.1) == 1
        assert await store.db.write(_sleep, 0.1) == 1
        for run in (store.db.read, store.db.write):
            with pytest.raises(TimeoutError, match="a statement had no answer within 1s"):
                await asyncio.wait_for(run(_sleep, 10), 5)
    finally:
        await store.close()


async def test_a_connection_a_hung_server_never_opens_is_named_as_such() -> None:
    """The read's StoreUnavailable came after the connect timeout (5 s) saying the store
    "did not answer within 60s"; the append's said "TimeoutError: " and nothing more."""
    with private_postgres() as server:
        store = await SqlCommitStore.connect(server.url)
        try:
            await store.engine.dispose()  # no connection to reuse: each call opens one
            with _hung(server):
                began = asyncio.get_running_loop().time()
                outcomes = await asyncio.wait_for(
                    asyncio.gather(
                        store.load_head(ThreadId("n-read")),
                        store.append(activation("n-append", "r"), 0, 0),
                        return_exceptions=True,
                    ),
                    DEFAULT_TIMEOUT_S / 2,
                )
                waited = asyncio.get_running_loop().time() - began
            for outcome in outcomes:
                assert isinstance(outcome, StoreUnavailable), outcome
                assert f"no connection within {CONNECT_TIMEOUT_S:g}s" in str(outcome)
            assert waited < 2 * CONNECT_TIMEOUT_S
        finally:
            await store.close()


@pytest.mark.parametrize("way", ["planned", "read-first"])
async def test_a_row_another_client_holds_locked_fails_its_own_group_only(
    pg_conformance_url: str, way: str
) -> None:
    """A client stopped inside its transaction holds thread X's row. The group waiting
    for it held up every group of the process behind it until the statement timeout,
    then failed them all as an outage; now it hears StoreUnavailable after
    ``LOCK_TIMEOUT_S`` and the appends queued behind it land."""
    store: SqlCommitStore = await make_store("postgres", pg_conformance_url)
    other = await asyncpg.connect(pg_conformance_url)
    try:
        x, y = ThreadId("lock-x"), ThreadId("lock-y")
        for thread in (x, y):
            await store.append(activation(thread, "r"), 0, 0)
        hx, hy = await head(store, x), await head(store, y)
        if way == "read-first":
            store._frontiers = FrontierCache()  # nothing to plan from: rows are read first
        holder = other.transaction()
        await holder.start()
        await other.execute("SELECT 1 FROM ratchet_threads WHERE thread_id = $1 FOR UPDATE", x)
        blocked = asyncio.create_task(store.append(step(x, "r", 1, prev=hx), 1, 0))
        waiting = await until(lambda: _waiting_on_a_lock(other), what="a group waiting on X")
        assert ("WITH moved" if way == "planned" else "FOR UPDATE") in waiting
        began = asyncio.get_running_loop().time()
        behind = store.append(step(y, "r", 1, prev=hy), 1, 0)
        assert (await asyncio.wait_for(behind, 3 * LOCK_TIMEOUT_S)).seq == 2
        assert asyncio.get_running_loop().time() - began < LOCK_TIMEOUT_S + 2
        with pytest.raises(StoreUnavailable, match="lock timeout"):
            await blocked
        await holder.rollback()  # the client goes on: X's append, retried, lands
        assert (await store.append(step(x, "r", 1, prev=hx), 1, 0)).seq == 2
        # the timeout was the transactions' own: the sessions keep the server's
        assert await store.db.write_statement("SHOW lock_timeout", [], lambda _: True) == "0"
        assert await store.db.read(_lock_timeout) == "0"
    finally:
        await other.close()
        await store.close()


async def _waiting_on_a_lock(conn: asyncpg.Connection) -> str | None:
    """The query of a session of this database waiting for a lock, if one is."""
    query: str | None = await conn.fetchval(
        "SELECT a.query FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE NOT l.granted AND a.datname = current_database() LIMIT 1"
    )
    return query


def _lock_timeout(conn: Connection) -> str:
    return str(conn.exec_driver_sql("SHOW lock_timeout").scalar_one())


def _sleep(conn: Connection, seconds: float) -> int:
    return int(conn.execute(text("SELECT 1 FROM pg_sleep(:s)"), {"s": seconds}).scalar_one())


@contextlib.contextmanager
def _hung(server: PrivatePostgres) -> Iterator[None]:
    """The server's processes stopped (SIGSTOP) while the block runs."""
    processes = _server_processes(server.data / "postmaster.pid")
    # a backend whose connection was just closed may be exiting as it is listed: once
    # the postmaster runs again it reaps it, and the signal finds no process (CI, once)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _server_processes(pid_file: Path) -> list[int]:
    postmaster = int(pid_file.read_text().split()[0])
    children = subprocess.run(
        ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
    ).stdout.split()
    return [postmaster, *map(int, children)]


async def _retrying(call: Callable[[], Awaitable[Any]], timeout_s: float = 60.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await call()
        except StoreUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)  # a retry's backoff, as the engine's


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_commit_its_caller_gave_up_on_never_lands_later(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Another client holds the database (SQLite: an exclusive transaction; PostgreSQL:
    the thread's row) past the caller's deadline, which hears StoreUnavailable. Let go,
    the transaction that had waited for it committed anyway, seconds later: a resume its
    caller was told had failed landed, and left its Run running with nothing to drive
    it. Now it is rolled back (Abandoned), and what comes after lands as usual."""
    thread, other_thread = ThreadId("gave-up"), ThreadId("after")
    if backend == "sqlite":
        path = tmp_path / "abandoned" / "ratchet.db"
        store: SqlCommitStore = await make_store(backend, f"sqlite:///{path}")
    else:
        store = await make_store(backend, str(request.getfixturevalue("pg_conformance_url")))
    try:
        await store.append(activation(thread, "r"), 0, 0)
        before = await head(store, thread)
        store._frontiers = FrontierCache()  # PostgreSQL: rows read first, in a transaction
        store.timeout_s = DEADLINE_S
        async with _holding(backend, store, thread):
            with pytest.raises(StoreUnavailable):
                await store.append(step(thread, "r", 1, prev=before), 1, 0)
        store.timeout_s = 30.0  # the writer may still be waiting out its lock wait
        assert (await store.append(activation(other_thread, "r"), 0, 0)).seq == 1
        # another commit in its place: had the one given up on landed, this one would be
        # refused (same operation, another payload); it queues behind it for the row
        assert (await store.append(step(thread, "r", 1, "again", prev=before), 1, 0)).seq == 2
        [_, second] = await store.read(thread)
        assert second.commit.messages[0].text == "again"
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def _holding(backend: str, store: SqlCommitStore, thread: ThreadId) -> AsyncIterator[None]:
    """Another client holds what the thread's next append needs, while the block runs."""
    if backend == "sqlite":
        import sqlite3

        holder = sqlite3.connect(str(store.db.engine.url.database), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    url = store.db.engine.url.render_as_string(hide_password=False)
    other = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        async with other.transaction():
            await other.execute(
                "SELECT 1 FROM ratchet_threads WHERE thread_id = $1 FOR UPDATE", thread
            )
            yield
    finally:
        await other.close()
