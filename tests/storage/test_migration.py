"""A store written before the hash chain (SQL schema 3, the older Redis layout) upgrades.

The old data is built honestly: real Runs on the memory store, their commits dumped
with ``schema_version`` 1 and without the fields schema 1 did not have (``prev``, the
writer's epoch), their frontiers likewise (no ``head``, no ``failed_recoveries``), each
body stored with the SHA-256 of its exact text. The SQL database gets migrations 1-3
only, and the thread table the shape schema 3 gave it (migration 1 creates today's
tables, so the columns migration 4 adds are dropped again). Then connecting must
migrate, every read and load must verify, ``ratchet verify --all`` must pass, the
Runs must go on (a recovery, a resume, a new Run: each new commit chains from the
stored head), and a second connect must change nothing; a store of a newer schema is
refused, untouched. The Redis layout's upgrade, on the same old data: test_redis_upgrade.py.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Connection, inspect, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from runtime import Agent, Crash, FaultPlan, InProcessRunner, ModelResponse, ScriptedModel
from runtime.base import canonical_json
from runtime.commit import Frontier
from runtime.errors import StoreUnavailable
from runtime.ids import ThreadId
from runtime.integrity import frontier_checksum
from runtime.lifecycle import AwaitingState, PermissionDecision, answer
from runtime.ports import host_of
from storage.errors import StoreTooNew
from storage.memory import MemoryCommitStore
from storage.schema import MIGRATIONS, SCHEMA_VERSION, commits, schema_version, threads
from storage.sql import SqlCommitStore
from storage.summary import listing
from tests.storage.test_integrity import permission_agent
from tests.storage.test_verify_cli import ratchet

OLD_COMMIT_KEYS = frozenset(
    {"thread_id", "run_id", "ordinal", "label", "disposition", "messages", "commands"}
    | {"batch", "status", "events"}
)
OLD_FRONTIER_KEYS = frozenset(
    {"thread_id", "version", "epoch", "owner", "run_id", "run_state", "batch", "status"}
    | {"state", "messages", "run_start", "steps", "next_ordinal"}
)
WAITING, CRASHED, DONE, CLAIMED = (
    ThreadId(t) for t in ("t-waiting", "t-crashed", "t-done", "t-claimed")
)


def sha(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


# ---- the old data -------------------------------------------------------------------------


@dataclass
class Old:
    """One thread as a schema-3 store held it."""

    frontier: Frontier
    """Today's frontier of the same Runs (its head is today's, not the old store's)."""
    bodies: list[str]
    operations: list[str]
    labels: list[str]

    @property
    def thread(self) -> ThreadId:
        return self.frontier.thread_id

    def frontier_json(self, *, ownerless: bool = False) -> dict[str, Any]:
        dump = self.frontier.model_dump(mode="json")
        data = {k: v for k, v in dump.items() if k in OLD_FRONTIER_KEYS}
        if ownerless:  # Redis kept the epoch and owner beside the frontier text
            data.update(epoch=0, owner=None)
        return {"schema_version": 1, **data}

    @property
    def head(self) -> str:
        return sha(self.bodies[-1]) if self.bodies else ""


def old_body(encoded: str) -> str:
    data = {k: v for k, v in json.loads(encoded).items() if k in OLD_COMMIT_KEYS}
    return canonical_json({"schema_version": 1, **data})


async def as_old(store: MemoryCommitStore, thread: ThreadId) -> Old:
    """A thread of the memory store as the old stores held it."""
    records = await store.read(thread)
    return Old(
        await store.load(thread),
        [old_body(r.commit.encoded) for r in records],
        [r.commit.operation_id for r in records],
        [r.commit.label for r in records],
    )


async def old_threads(ran: list[str], *, claimed: bool = True) -> list[Old]:
    """Real Runs: one awaiting permission, one whose driver died, one ended, and a thread
    only claimed (no Run yet)."""
    store = MemoryCommitStore()
    await InProcessRunner(permission_agent(ran), store).start("go", thread_id=WAITING)
    with pytest.raises(Crash):
        await InProcessRunner(permission_agent(ran), store).start(
            "go", thread_id=CRASHED, faults=FaultPlan(crash_at=("after:results", 1))
        )
    done = Agent(name="done", model=ScriptedModel([ModelResponse(text="hello")]))
    await InProcessRunner(done, store).start("hi", thread_id=DONE)
    names = [WAITING, CRASHED, DONE]
    if claimed:
        await store.claim(CLAIMED, "host-a#1", 0)
        names.append(CLAIMED)
    olds = [await as_old(store, name) for name in names]
    assert [o.frontier.run_state and o.frontier.run_state.kind for o in olds][:3] == [
        "awaiting",
        "running",
        "ended",
    ]
    return olds


# ---- continuing on the upgraded store -----------------------------------------------------


async def check_verified(store: Any, olds: list[Old]) -> None:
    for old in olds:
        frontier = await store.load(old.thread)  # whole, at the schema of this code
        assert (frontier.schema_version, frontier.head) == (3, old.head)
        same = {"schema_version", "head"}
        assert frontier.model_dump(exclude=same) == old.frontier.model_dump(exclude=same)
        records = await store.read(old.thread)
        assert [r.commit.schema_version for r in records] == [1] * len(old.bodies)
        assert [r.commit.operation_id for r in records] == old.operations


async def go_on(store: Any, ran: list[str], olds: list[Old]) -> None:
    """Recover the crashed Run, approve the waiting one, start a new Run on the ended
    thread: each first new commit names the stored head of its thread."""
    before = {o.thread: o for o in olds}
    waiting = (await store.load(WAITING)).run_state
    assert isinstance(waiting, AwaitingState)
    approve = answer(waiting.ticket, PermissionDecision(approve=True))
    done = await InProcessRunner(permission_agent(ran), store).resume(approve)
    assert done.ended and ran == ["SAFE"]
    recovered = await InProcessRunner(permission_agent(ran), store).recover(CRASHED)
    assert recovered.version > 3 and isinstance(recovered.run_state, AwaitingState)
    again = Agent(name="again", model=ScriptedModel([ModelResponse(text="again")]))
    assert (await InProcessRunner(again, store).start("more", thread_id=DONE)).ended
    for thread in (WAITING, CRASHED, DONE):
        old = before[thread]
        records = await store.read(thread)
        first_new = records[len(old.bodies)].commit
        assert (first_new.schema_version, first_new.prev) == (3, old.head)


async def verify_all(url: str, threads_: int) -> None:
    result = await ratchet("verify", "--all", "--store", url)
    assert result.exit_code == 0, result.output
    assert f"{threads_} threads audited, 0 with problems" in result.stdout


Upgraded = Callable[[str, list[str]], Awaitable[tuple[Any, list[Old]]]]
"""Writes the old data at a URL and connects: the store upgraded, the old threads."""


async def verifies_and_runs_go_on(url: str, upgraded: Upgraded) -> None:
    """``ratchet verify --all`` passes on the upgraded store; after ``go_on`` every old
    thread ends in a schema-2 commit, and it passes again."""
    ran: list[str] = []
    store, olds = await upgraded(url, ran)
    try:
        await verify_all(url, len(olds))
        await go_on(store, ran, olds)
    finally:
        await store.close()
    await verify_all(url, len(olds))


# ---- SQL: schema 3 ------------------------------------------------------------------------


def _schema_3(conn: Connection) -> None:
    schema_version.create(conn)
    for version, step in MIGRATIONS[:3]:
        step(conn)
        conn.execute(schema_version.insert().values(version=version, applied=0))
    # migration 1 creates today's tables; schema 3's thread row had none of these
    conn.execute(text("DROP INDEX ix_ratchet_threads_host"))
    for column in ("head", "checksum", "host"):
        conn.execute(text(f"ALTER TABLE {threads.name} DROP COLUMN {column}"))


def _schema_3_rows(conn: Connection, olds: list[Old]) -> None:
    for old in olds:
        f = old.frontier
        state, cause = listing(f)
        row = {"thread_id": f.thread_id, "version": f.version, "epoch": f.epoch}
        row |= {"owner": f.owner, "frontier": json.dumps(old.frontier_json())}
        row |= {"run_id": f.run_id, "run_state": state, "cause": cause, "updated": 0}
        conn.execute(threads.insert().values({**row, "status": f.status.model_dump_json()}))
        for seq, (body, op, label) in enumerate(
            zip(old.bodies, old.operations, old.labels, strict=True), 1
        ):
            values = {"thread_id": f.thread_id, "seq": seq, "operation_id": op, "label": label}
            conn.execute(
                commits.insert().values({**values, "payload_hash": sha(body), "body": body})
            )


def _dump(conn: Connection) -> Any:
    tables = (threads, commits, schema_version)
    return [sorted(tuple(r) for r in conn.execute(select(t))) for t in tables]


async def write_schema_3(url: str, olds: list[Old]) -> None:
    engine = create_async_engine(_driver(url))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_schema_3)
            await conn.run_sync(_schema_3_rows, olds)
            columns = await conn.run_sync(lambda c: inspect(c).get_columns(threads.name))
            assert {"head", "checksum", "host"}.isdisjoint(c["name"] for c in columns)
    finally:
        await engine.dispose()


def _driver(url: str) -> str:
    scheme = "sqlite+aiosqlite" if url.startswith("sqlite") else "postgresql+asyncpg"
    return f"{scheme}://{url.partition('://')[2]}"


@pytest.fixture(params=["sqlite", "postgres"])
async def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh, empty database: a SQLite file, or a PostgreSQL database of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/old.db"
        return
    admin = str(request.getfixturevalue("postgres_url"))
    name = f"ratchet_mig_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
        yield admin.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await conn.close()


async def migrated_sql(url: str, ran: list[str]) -> tuple[SqlCommitStore, list[Old]]:
    olds = await old_threads(ran)
    await write_schema_3(url, olds)
    return await SqlCommitStore.connect(url), olds


async def test_a_schema_3_store_migrates_and_verifies(sql_url: str) -> None:
    store, olds = await migrated_sql(sql_url, [])
    try:
        async with store.engine.connect() as conn:
            versions = (await conn.execute(select(schema_version.c.version))).scalars().all()
            rows = {r.thread_id: r for r in await conn.execute(select(threads))}
        assert sorted(versions) == [1, 2, 3, 4, 5, 6, 7] and SCHEMA_VERSION == 7
        assert (await store.hold_lease("system:x", "c1", 30.0)).holder == "c1"  # 7: leases
        for old in olds:
            row = rows[old.thread]
            assert (row.head, row.host) == (old.head, host_of(old.frontier.owner))
            assert row.checksum == frontier_checksum(row.frontier)
        await check_verified(store, olds)
    finally:
        await store.close()


async def test_a_migrated_store_verifies_and_its_runs_go_on(sql_url: str) -> None:
    await verifies_and_runs_go_on(sql_url, migrated_sql)


async def test_connecting_again_changes_nothing(sql_url: str) -> None:
    olds = await old_threads([])
    await write_schema_3(sql_url, olds)
    await (await SqlCommitStore.connect(sql_url)).close()
    engine = create_async_engine(_driver(sql_url))
    try:
        async with engine.connect() as conn:
            migrated = await conn.run_sync(_dump)
        await (await SqlCommitStore.connect(sql_url)).close()
        async with engine.connect() as conn:
            assert await conn.run_sync(_dump) == migrated
    finally:
        await engine.dispose()


async def test_one_bad_old_frontier_does_not_keep_the_store_shut(sql_url: str) -> None:
    """Fail closed per thread: the thread whose old frontier does not decode is
    CorruptRecord (and ``verify`` names it); the store opens and the others verify."""
    olds = await old_threads([], claimed=False)
    await write_schema_3(sql_url, olds)
    engine = create_async_engine(_driver(sql_url))
    try:
        async with engine.begin() as conn:
            stmt = threads.update().where(threads.c.thread_id == DONE)
            await conn.execute(stmt.values(frontier='{"thread_id": "t-done", "version": "x"}'))
    finally:
        await engine.dispose()
    store = await SqlCommitStore.connect(sql_url)
    try:
        await check_verified(store, [o for o in olds if o.thread != DONE])
    finally:
        await store.close()
    result = await ratchet("verify", "--all", "--store", sql_url)
    assert result.exit_code == 1 and f"thread '{DONE}' seq 2:" in result.stderr


async def test_a_store_of_a_newer_schema_is_refused(sql_url: str) -> None:
    """A store migrated by a later Ratchet: this one must not write it by older rules."""
    await (await SqlCommitStore.connect(sql_url)).close()
    engine = create_async_engine(_driver(sql_url))
    try:
        async with engine.begin() as conn:
            newer = schema_version.insert().values(version=SCHEMA_VERSION + 1, applied=0)
            await conn.execute(newer)
            before = await conn.run_sync(_dump)
        with pytest.raises(StoreTooNew) as info:
            await SqlCommitStore.connect(sql_url)
        assert (info.value.found, info.value.known) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
        words = f"store schema {SCHEMA_VERSION + 1} is newer than this Ratchet ({SCHEMA_VERSION})"
        assert str(info.value) == f"{words}: upgrade Ratchet"
        assert not isinstance(info.value, StoreUnavailable)  # retrying will not help
        async with engine.connect() as conn:
            assert await conn.run_sync(_dump) == before
    finally:
        await engine.dispose()
