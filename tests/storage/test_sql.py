"""What only the SQL backends have: group commit, the SAVEPOINT fallback, SQLite setup."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from runtime.errors import (
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from runtime.ids import ThreadId
from storage.schema import SCHEMA_VERSION, commits, schema_version
from storage.sql import SqlCommitStore
from storage.sql_errors import translate
from storage.sql_writer import LINGER_TURNS
from tests.storage.builders import activation, ended, head, step
from tests.storage.conftest import make_store


@pytest.fixture(params=["sqlite", "postgres"])
def sql_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sql_url(sql_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if sql_backend == "sqlite":
        return f"sqlite:///{tmp_path}/sql/ratchet.db"
    return str(request.getfixturevalue("pg_conformance_url"))


@pytest.fixture
async def sql_store(sql_backend: str, sql_url: str) -> AsyncIterator[SqlCommitStore]:
    store = await make_store(sql_backend, sql_url)
    try:
        yield store
    finally:
        await store.close()


async def _activate_many(store: SqlCommitStore, n: int) -> list[object]:
    threads = [ThreadId(f"g-{i:03d}") for i in range(n)]
    return list(
        await asyncio.gather(*(store.append(activation(t, f"r-{t}"), 0, 0) for t in threads))
    )


async def test_concurrent_appends_share_transactions(sql_store: SqlCommitStore) -> None:
    receipts = await _activate_many(sql_store, 60)
    assert len(receipts) == 60
    assert sql_store.appends == 60
    assert sql_store.groups < sql_store.appends  # grouped, not one transaction each


async def _append_after_turns(store: SqlCommitStore, thread: str, turns: int) -> object:
    for _ in range(turns):
        await asyncio.sleep(0)  # event-loop turns, not time: the writer lingers in turns
    return await store.append(activation(ThreadId(thread), f"r-{thread}"), 0, 0)


async def test_a_group_writer_lingers_for_company_only_after_a_group_that_had_some(
    sql_store: SqlCommitStore,
) -> None:
    turns = LINGER_TURNS // 2
    await _append_after_turns(sql_store, "alone-0", 0)  # the last group held one request
    groups = sql_store.groups
    await asyncio.gather(
        _append_after_turns(sql_store, "alone-1", 0),
        _append_after_turns(sql_store, "alone-2", turns),
    )
    assert sql_store.groups == groups + 2  # a lone caller is not kept waiting

    await _activate_many(sql_store, 2)  # two at once: the last group had company
    groups = sql_store.groups
    await asyncio.gather(
        _append_after_turns(sql_store, "cohort-1", 0),
        _append_after_turns(sql_store, "cohort-2", turns),
    )
    assert sql_store.groups == groups + 1  # the latecomer joined the group
    assert sql_store.appends == 7


async def test_database_refusal_fails_only_the_culprit(sql_store: SqlCommitStore) -> None:
    bad, good = ThreadId("bad"), [ThreadId(f"good-{i}") for i in range(5)]
    await sql_store.append(activation(bad, "run-bad"), 0, 0)
    h = await head(sql_store, bad)
    # A row the frontier does not know about: the pure rules admit seq 2, the
    # primary key refuses it, and the group is replayed with one SAVEPOINT each.
    async with sql_store.engine.begin() as conn:
        stray = step(bad, "run-bad", 9, "stray")
        await conn.execute(
            commits.insert().values(
                thread_id=bad, seq=2, operation_id="stray", payload_hash=stray.payload_hash,
                label="inference", body=stray.encoded,
            )
        )  # fmt: skip
    outcomes = await asyncio.gather(
        sql_store.append(step(bad, "run-bad", 1, prev=h), 1, 0),
        *(sql_store.append(activation(t, f"run-{t}"), 0, 0) for t in good),
        return_exceptions=True,
    )
    # a record past the head that no frontier vouches for: corrupt, not a conflict
    # (retried, it would meet that record for ever)
    assert isinstance(outcomes[0], CorruptRecord) and outcomes[0].seq == 2
    assert [getattr(o, "seq", None) for o in outcomes[1:]] == [1] * 5
    # and a load names it too (the row and its last seq read in one statement)
    with pytest.raises(CorruptRecord, match="past the frontier's head") as info:
        await sql_store.load(bad)
    assert info.value.seq == 2


async def test_without_group_commit_concurrent_writers_still_serialise(sql_url: str) -> None:
    if sql_url.startswith("postgresql"):
        await (await make_store("postgres", sql_url)).close()  # truncates
    store = await SqlCommitStore.connect(sql_url, group_commit=False)
    try:
        await _activate_many(store, 20)
        assert store.groups == store.appends == 20
        assert len(await store.list_runs("running")) == 20
    finally:
        await store.close()


async def test_sqlite_file_is_created_in_wal_mode_and_migrated_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/deep/er/ratchet.db"
    for _ in range(2):  # a second connect finds the schema current and changes nothing
        store = await SqlCommitStore.connect(url)
        async with store.engine.connect() as conn:
            mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar()
            versions = (
                await conn.execute(select(func.count()).select_from(schema_version))
            ).scalar()
        await store.close()
        assert mode == "wal" and versions == SCHEMA_VERSION == 7
    assert (tmp_path / "deep" / "er" / "ratchet.db").exists()


async def test_postgres_rows_leave_room_for_hot_updates_and_joins_use_keys(
    pg_conformance_url: str,
) -> None:
    store = await make_store("postgres", pg_conformance_url)
    try:
        async with store.engine.connect() as conn:
            options = await conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'ratchet_threads'")
            )
            assert "fillfactor=50" in options.scalar_one()
            # long text compresses with lz4 where the server offers it (Debian's does)
            for table, column in (("ratchet_threads", "frontier"), ("ratchet_commits", "body")):
                compression = await conn.execute(
                    text(
                        "SELECT CAST(attcompression AS text) FROM pg_attribute"
                        " WHERE attname = :column AND attrelid = CAST(:table AS regclass)"
                    ),
                    {"table": table, "column": column},
                )
                assert compression.scalar_one() == "l"
            # every statement finds rows by key: never a hashed scan of a whole table
            for setting in ("enable_hashjoin", "enable_mergejoin"):
                assert (await conn.execute(text(f"SHOW {setting}"))).scalar_one() == "off"
    finally:
        await store.close()
    joiner = "&" if "?" in pg_conformance_url else "?"
    plain = await SqlCommitStore.connect(f"{pg_conformance_url}{joiner}key_joins=off")
    try:  # behind PgBouncer, which refuses unknown startup parameters
        async with plain.engine.connect() as conn:
            assert (await conn.execute(text("SHOW enable_hashjoin"))).scalar_one() == "on"
    finally:
        await plain.close()


async def test_held_write_connections_plan_generically_and_the_pool_keeps_the_default(
    pg_conformance_url: str,
) -> None:
    store = await make_store("postgres", pg_conformance_url)
    db = store.db
    try:
        thread = ThreadId("gp-00")
        receipt = await store.append(activation(thread, "r-gp"), 0, 0)
        for version in range(1, 8):  # one group, and one statement, each
            receipt = await store.append(
                step(thread, "r-gp", version, prev=receipt.payload_hash), version, 0
            )
        assert store.planned >= 8 and len(db._held) == 1  # written by write_statement
        held = db._held[0]
        driver = (await held.get_raw_connection()).driver_connection
        assert await driver.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        generic = "SELECT coalesce(sum(generic_plans), 0) FROM pg_prepared_statements"
        assert await driver.fetchval(generic) > 0  # the group statement was planned once
        # more held than groups go at once: the extra one goes back to the pool reset
        db._held[0] = await store.engine.connect()
        await db._keep(held)
        assert held.closed  # returned to the pool; its session, asked directly:
        assert await driver.fetchval("SHOW plan_cache_mode") == "auto"
        receipt = await store.append(step(thread, "r-gp", 8, prev=receipt.payload_hash), 8, 0)
        assert (await store.load(thread)).version == 9  # and the store goes on writing
    finally:
        await store.close()
    joiner = "&" if "?" in pg_conformance_url else "?"
    plain = await SqlCommitStore.connect(f"{pg_conformance_url}{joiner}key_joins=off")
    try:  # behind PgBouncer a session may be another client's next: left alone
        receipt = await plain.append(activation(ThreadId("gp-plain"), "r-gp-plain"), 0, 0)
        await plain.append(
            step(ThreadId("gp-plain"), "r-gp-plain", 1, prev=receipt.payload_hash), 1, 0
        )
        driver = (await plain.db._held[0].get_raw_connection()).driver_connection
        assert await driver.fetchval("SHOW plan_cache_mode") == "auto"
    finally:
        await plain.close()


# ---- planned groups: admitted from the cache, checked by the writes ------------------


@pytest.fixture
async def two_stores(
    sql_backend: str, sql_url: str
) -> AsyncIterator[tuple[SqlCommitStore, SqlCommitStore]]:
    """Two stores on one database, as two host processes have: each its own cache."""
    first = await make_store(sql_backend, sql_url)  # PostgreSQL: emptied first
    second = await SqlCommitStore.connect(sql_url)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


async def test_groups_are_planned_without_reading_their_rows(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    store, _ = two_stores
    threads = [ThreadId(f"p-{i:02d}") for i in range(20)]
    receipts = await asyncio.gather(*(store.append(activation(t, f"r-{t}"), 0, 0) for t in threads))
    await asyncio.gather(
        *(
            store.append(step(t, f"r-{t}", 1, prev=r.payload_hash), 1, 0)
            for t, r in zip(threads, receipts, strict=True)
        )
    )
    assert store.planned == store.groups > 0  # new threads and known ones alike
    for t in threads:
        frontier = await store.load(t)
        assert frontier.version == 2 and frontier.messages[-1].text == "thinking"


async def test_the_next_run_of_a_thread_read_at_rest_is_planned(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    """A thread at rest is not kept as written, but as read (the next Run's start reads
    it): that Run's activation is planned, not sent the read-first way with its whole
    group. A thread another process moved since the read fails the plan, never the
    answer: the read-first way decides."""
    store, theirs = two_stores
    threads = [ThreadId(f"rest-{i:02d}") for i in range(10)]
    starts = await asyncio.gather(*(store.append(activation(t, "r1"), 0, 0) for t in threads))
    ends = await asyncio.gather(
        *(
            store.append(ended(t, "r1", 1, prev=r.payload_hash), 1, 0)
            for t, r in zip(threads, starts, strict=True)
        )
    )
    for t in threads:
        assert (await store.load(t)).ended
    planned, groups = store.planned, store.groups
    await asyncio.gather(
        *(
            store.append(activation(t, "r2", prev=r.payload_hash), 2, 0)
            for t, r in zip(threads, ends, strict=True)
        )
    )
    assert store.planned - planned == store.groups - groups > 0
    for t in threads:
        frontier = await theirs.load(t)
        assert (frontier.version, frontier.run_id) == (3, "r2")
    # read at rest here, then moved on by another process: the plan must not hold
    moved = ThreadId("rest-moved")
    first = await store.append(activation(moved, "r1"), 0, 0)
    done = await store.append(ended(moved, "r1", 1, prev=first.payload_hash), 1, 0)
    assert (await store.load(moved)).ended
    await theirs.append(activation(moved, "r2", prev=done.payload_hash), 2, 0)
    planned = store.planned
    with pytest.raises(VersionConflict):
        await store.append(activation(moved, "r3", prev=done.payload_hash), 2, 0)
    assert store.planned == planned
    assert (await theirs.load(moved)).run_id == "r2"


async def test_a_row_another_process_changed_makes_the_plan_fall_back(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    mine, theirs = two_stores
    thread = ThreadId("contested")
    first = await mine.append(activation(thread, "r"), 0, 0)
    assert (await theirs.claim(thread, "someone-else", 0)).epoch == 1  # mine's cache: stale
    planned = mine.planned
    with pytest.raises(Fenced):
        await mine.append(step(thread, "r", 1, prev=first.payload_hash), 1, 0)
    assert mine.planned == planned  # the plan did not hold; the read-first path refused
    frontier = await theirs.load(thread)
    assert (frontier.version, frontier.epoch, frontier.owner) == (1, 1, "someone-else")
    current = step(thread, "r", 1, prev=first.payload_hash, epoch=1)
    await mine.append(current, 1, 1)  # at the current epoch it lands
    assert (await theirs.load(thread)).version == 2


async def test_a_claim_on_a_row_another_process_moved_on_keeps_its_progress(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    mine, theirs = two_stores
    thread = ThreadId("moved-on")
    first = await mine.append(activation(thread, "r"), 0, 0)  # mine caches version 1
    # same epoch and owner, version 2
    await theirs.append(step(thread, "r", 1, prev=first.payload_hash), 1, 0)
    claimed = await mine.claim(thread, "me", 0)  # planned on version 1: must not hold
    assert (claimed.version, claimed.epoch, claimed.steps) == (2, 1, 1)
    assert (await theirs.load(thread)).version == 2


async def test_a_row_the_cache_never_saw_makes_the_plan_fall_back(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    mine, theirs = two_stores
    thread = ThreadId("elsewhere")
    assert (await theirs.claim(thread, "them", 0)).epoch == 1
    await theirs.append(activation(thread, "r", epoch=1), 0, 1)
    planned = mine.planned
    # planned as a new thread (epoch 0), the row exists: the read-first path decides
    with pytest.raises(Fenced):
        await mine.claim(thread, "me", 0)
    assert mine.planned == planned  # the plan did not hold
    assert (await mine.claim(thread, "me", 1)).epoch == 2  # the row is known now
    frontier = await theirs.load(thread)
    assert (frontier.version, frontier.epoch, frontier.owner) == (1, 2, "me")


async def test_a_start_the_cache_cannot_judge_is_judged_on_the_row(
    two_stores: tuple[SqlCommitStore, SqlCommitStore],
) -> None:
    mine, theirs = two_stores
    thread = ThreadId("busy")
    first = await theirs.append(activation(thread, "r1"), 0, 0)
    # planned as a new thread, the row exists: read first, the active Run refuses it
    with pytest.raises((InvalidTransition, VersionConflict)):
        await mine.append(activation(thread, "r2", epoch=1, claim="me"), 0, 0, claim="me")
    frontier = await theirs.load(thread)
    assert (frontier.epoch, frontier.run_id) == (0, "r1")
    done = await theirs.append(ended(thread, "r1", 1, prev=first.payload_hash), 1, 0)
    second = activation(thread, "r2", prev=done.payload_hash, epoch=1, claim="me")
    await mine.append(second, 2, 0, claim="me")
    claimed = await theirs.load(thread)
    assert (claimed.epoch, claimed.version, claimed.run_id, claimed.owner) == (1, 3, "r2", "me")


async def test_a_plan_that_fails_leaves_the_group_to_the_read_first_path(
    two_stores: tuple[SqlCommitStore, SqlCommitStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = two_stores

    def broken(*_: object) -> None:
        raise RuntimeError("a planning bug")

    monkeypatch.setattr("storage.sql_writer.plan_group", broken)
    receipt = await store.append(activation(ThreadId("t"), "r"), 0, 0)
    assert receipt.seq == 1 and store.planned == 0 and store.groups == 1


async def test_unreachable_server_is_unavailable_and_secret_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "postgresql://ratchet:s3cret-pw@127.0.0.1:9/ratchet"  # port 9: nothing listens
    with pytest.raises(StoreUnavailable) as info:
        await SqlCommitStore.connect(url)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    assert "s3cret" not in caplog.text


class _PgError(Exception):
    """Stands in for an asyncpg error: only its SQLSTATE matters to the translation."""

    def __init__(self, sqlstate: str, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def asyncpg_error(name: str, message: str) -> Exception:
    """asyncpg's own exception, as ``Database.write_statement`` lets it through."""
    from asyncpg import exceptions

    return getattr(exceptions, name)(message)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked")),
         StoreUnavailable),
        (OperationalError("SELECT 1", {}, _PgError("57P01", "terminating connection")),
         StoreUnavailable),
        (DBAPIError("SELECT 1", {}, _PgError("40P01", "deadlock detected")), StoreUnavailable),
        (DBAPIError("SELECT 1", {}, _PgError("55P03", "lock timeout")), StoreUnavailable),
        (asyncpg_error("LockNotAvailableError", "lock timeout"), StoreUnavailable),
        (ConnectionRefusedError(111, "Connect call failed"), StoreUnavailable),
        (asyncpg_error("ConnectionDoesNotExistError", "closed mid-operation"), StoreUnavailable),
        (asyncpg_error("InterfaceError", "connection is closed"), StoreUnavailable),
        (asyncpg_error("AdminShutdownError", "terminating connection"), StoreUnavailable),
        (asyncpg_error("UndefinedTableError", "relation does not exist"), StoreError),
        (TimeoutError(), StoreUnavailable),
        # every pooled connection checked out (a hung server holds them): try again later
        (PoolTimeout("QueuePool limit of size 10 overflow 10 reached"), StoreUnavailable),
        (ProgrammingError("SELECT", {}, _PgError("42P01", "relation does not exist")),
         StoreError),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError(
            "UNIQUE constraint failed: ratchet_commits.thread_id, ratchet_commits.operation_id")),
         DuplicateOperation),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError(
            "UNIQUE constraint failed: ratchet_commits.thread_id, ratchet_commits.seq")),
         VersionConflict),
    ],
)  # fmt: skip
def test_driver_errors_translate_into_ours(error: Exception, expected: type) -> None:
    translated = translate(error, "postgresql://u:***@db/x")
    assert type(translated) is expected
    assert "u:***@db" in str(translated) or expected in (DuplicateOperation, VersionConflict)


def test_only_a_plan_that_did_not_hold_leaves_the_group_to_the_read_first_path() -> None:
    from asyncpg import exceptions as pg

    from storage.sql_statements import STALE_PLAN, pg_plan_refused

    stale = pg.InvalidTextRepresentationError(f'invalid input syntax: "{STALE_PLAN}: 1 of 2"')
    refused = [stale, pg.UniqueViolationError("duplicate key"), pg.DeadlockDetectedError("cycle")]
    failed = [
        pg.InvalidTextRepresentationError("invalid input syntax for type bigint"),
        pg.AdminShutdownError("terminating connection"),
        pg.InterfaceError("connection is closed"),
        OSError("reset"),
    ]
    assert all(pg_plan_refused(e) for e in refused)
    assert not any(pg_plan_refused(e) for e in failed)


async def test_a_planned_commit_is_trace_checked_once_written_and_only_then(
    sql_store: SqlCommitStore,
) -> None:
    """A plan knows no stored receipts, so its admission is provisional: a reused run id
    on a thread read at rest is admitted by the plan and refused by the database's key
    (DuplicateOperation, read first). Only commits that were written are checked."""
    from runtime import rules

    seen: list[tuple[str, int]] = []

    def recorder(frontier: Any, commit: Any) -> None:
        seen.append((commit.run_id, frontier.version))

    rules.TRACE_CHECKS.append(recorder)
    try:
        t = ThreadId("reused")
        prev = ""
        for version, run in ((0, "r1"), (2, "r2")):
            start = await sql_store.append(activation(t, run, prev=prev), version, 0)
            end = await sql_store.append(ended(t, run, 1, prev=start.payload_hash), version + 1, 0)
            prev = end.payload_hash
        assert (await sql_store.load(t)).ended  # read at rest: the plan knows the thread
        planned = sql_store.planned
        with pytest.raises(DuplicateOperation):
            await sql_store.append(activation(t, "r1", prev=prev), 4, 0)
        assert sql_store.planned == planned
        assert ("r1", 4) not in seen  # the refused activation is no part of the trace
        assert [v for _, v in seen] == [0, 1, 2, 3]  # every written commit was checked
    finally:
        rules.TRACE_CHECKS.remove(recorder)
