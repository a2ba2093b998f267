"""SQL driver errors as both databases really raise them, in Ratchet's vocabulary.

``storage.sql_errors`` tells a unique violation by the key it names, never by the words
of its message: only our own unique keys mean "someone wrote first" (VersionConflict,
DuplicateOperation); any other refusal (NOT NULL, a CHECK on the thread table, a unique
index not ours) fails the commit's Run with StoreError. The violations here are real,
wrapped by SQLAlchemy and, on PostgreSQL, raw from asyncpg too (as the planned group's
one statement meets them). A full disk is an outage, not a refusal: space can be freed,
so an append that meets it is StoreUnavailable, leaves nothing, and lands when retried
once there is room (SQLite at a real page limit on its writer's connection, PostgreSQL
raising its own SQLSTATE 53100, disk_full, from a trigger).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Connection, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import IntegrityError

from runtime import (
    Agent,
    Command,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    ToolResult,
    call,
    tool,
)
from runtime.errors import DuplicateOperation, StoreError, StoreUnavailable, VersionConflict
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState
from storage.schema import commits, threads
from storage.sql import SqlCommitStore
from storage.sql_errors import translate
from tests.storage.builders import activation, step
from tests.storage.test_db_failures import _agent, _replays

BAD_ROW = "BAD-ROW"


@contextlib.asynccontextmanager
async def _installed(store: SqlCommitStore, install: list[str], remove: list[str]) -> Any:
    """DDL of a test's own, dropped again (the PostgreSQL database serves the session)."""
    async with store.engine.begin() as conn:
        for statement in install:
            await conn.execute(text(statement))
    try:
        yield
    finally:
        async with store.engine.begin() as conn:
            for statement in remove:
                await conn.execute(text(statement))


# ---- refusals: only a unique key of ours is a conflict -----------------------------------


def _row(thread: str, **values: Any) -> dict[str, Any]:
    row = {"version": 0, "epoch": 0, "frontier": "{}", "updated": 0, "run_id": f"run-{thread}"}
    return row | {"thread_id": thread} | values


def _commit(seq: int, operation: str | None) -> dict[str, Any]:
    body = {"payload_hash": "h", "label": "activation", "body": "{}"}
    return {"thread_id": "t", "seq": seq, "operation_id": operation} | body


REFUSALS: list[tuple[str, Any, type]] = [
    ("duplicate operation id", commits.insert().values(_commit(9, "op-1")), DuplicateOperation),
    ("duplicate seq", commits.insert().values(_commit(1, "op-2")), VersionConflict),
    ("duplicate thread row", threads.insert().values(_row("t", run_id="r")), VersionConflict),
    ("a unique index not ours", threads.insert().values(_row("u", run_id="run-t")), StoreError),
    ("NOT NULL on the thread row", threads.insert().values(_row("v", frontier=None)), StoreError),
    ("NOT NULL on the operation id", commits.insert().values(_commit(2, None)), StoreError),
]
_NOT_OURS = "CREATE UNIQUE INDEX test_one_thread_per_run ON ratchet_threads (run_id)"


@pytest.mark.parametrize(("case", "statement", "expected"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_each_integrity_error_is_told_by_the_key_it_names(
    sql_store: SqlCommitStore, case: str, statement: Any, expected: type
) -> None:
    async with _installed(sql_store, [_NOT_OURS], ["DROP INDEX test_one_thread_per_run"]):
        async with sql_store.engine.begin() as conn:
            await conn.execute(threads.insert().values(_row("t")))
            await conn.execute(commits.insert().values(_commit(1, "op-1")))
        with pytest.raises(IntegrityError) as info:
            async with sql_store.engine.begin() as conn:
                await conn.execute(statement)
        assert type(translate(info.value, "store")) is expected, (case, str(info.value.orig))
        if sql_store.db.dialect != "postgresql":
            return
        sql = str(
            statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
        )
        url = sql_store.engine.url.set(drivername="postgresql")
        raw = await asyncpg.connect(url.render_as_string(hide_password=False))
        try:
            with pytest.raises(asyncpg.PostgresError) as unwrapped:
                await raw.execute(sql)
        finally:
            await raw.close()
        assert type(translate(unwrapped.value, "store")) is expected, (case, "asyncpg")


async def test_a_check_the_thread_row_fails_is_a_refusal_not_a_conflict(
    sql_store: SqlCommitStore,
) -> None:
    """The CHECK names ``ratchet_threads``: that is no version conflict (someone wrote
    first), so the Run whose frontier it refuses fails (store) and its neighbours land."""
    if sql_store.db.dialect == "postgresql":
        install = [
            "ALTER TABLE ratchet_threads ADD CONSTRAINT ratchet_threads_no_bad_row"
            f" CHECK (frontier NOT LIKE '%{BAD_ROW}%')"
        ]
        remove = ["ALTER TABLE ratchet_threads DROP CONSTRAINT ratchet_threads_no_bad_row"]
    else:  # no ALTER TABLE ... ADD CHECK: a trigger raising what a CHECK says
        install = [
            f"CREATE TRIGGER bad_row_{when} BEFORE {when} ON ratchet_threads"
            f" WHEN NEW.frontier LIKE '%{BAD_ROW}%' BEGIN SELECT RAISE(ABORT,"
            " 'CHECK constraint failed: ratchet_threads.frontier'); END"
            for when in ("INSERT", "UPDATE")
        ]
        remove = ["DROP TRIGGER bad_row_INSERT", "DROP TRIGGER bad_row_UPDATE"]
    async with _installed(sql_store, install, remove):
        refused = InProcessRunner(_noting(f"here is the {BAD_ROW}"), sql_store)
        clean = [InProcessRunner(_agent("clean"), sql_store) for _ in range(4)]
        done = await asyncio.gather(
            refused.start("go", thread_id="refused"),
            *(runner.start("go", thread_id=f"clean-{i}") for i, runner in enumerate(clean)),
        )
    first = done[0].run_state
    assert isinstance(first, EndedState) and first.cause.kind == "failed"
    assert (first.cause.failure, first.cause.code) == ("store", "StoreError")
    records = await _replays(sql_store, "refused")
    assert not any(BAD_ROW in r.commit.encoded for r in records)
    assert records[-1].commit.label == "ended"
    for i, frontier in enumerate(done[1:]):
        assert isinstance(frontier.run_state, EndedState)
        assert frontier.run_state.cause.kind == "natural"
        await _replays(sql_store, f"clean-{i}")


def _noting(note: str) -> Agent:
    """One tool call whose result also puts ``note`` in the Run's state: from its results
    commit on, every frontier row of the thread holds it (a result's text alone leaves
    the row with the end, and the results and the end may share one group)."""

    @tool
    def fetch(key: str) -> ToolResult:
        return ToolResult(content="fetched", commands=[Command(key="note", value=note)])

    model = ScriptedModel(
        [
            ModelResponse(text="fetching", tool_calls=(call("fetch", "c1", key="k"),)),
            ModelResponse(text="done"),
        ]
    )
    return Agent(name="noter", model=model, tools=[fetch])


# ---- a full disk: an outage, retried ------------------------------------------------------


def _cap_pages(conn: Connection, full: bool) -> None:
    """The writer's connection may not grow the file past its size now (or any more)."""
    pages = conn.exec_driver_sql("PRAGMA page_count").scalar() if full else 1 << 30
    conn.exec_driver_sql(f"PRAGMA max_page_count = {pages}")


@contextlib.asynccontextmanager
async def _full_disk(store: SqlCommitStore) -> AsyncIterator[None]:
    if store.db.dialect == "sqlite":
        await store.db.write(_cap_pages, True)
        try:
            yield
        finally:
            await store.db.write(_cap_pages, False)
        return
    function = (
        "CREATE FUNCTION test_disk_full() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION"
        " 'could not extend file: No space left on device' USING ERRCODE = 'disk_full';"
        " END $$ LANGUAGE plpgsql"
    )
    trigger = (
        "CREATE TRIGGER test_disk_full BEFORE INSERT ON ratchet_commits"
        " FOR EACH ROW EXECUTE FUNCTION test_disk_full()"
    )
    remove = ["DROP TRIGGER test_disk_full ON ratchet_commits", "DROP FUNCTION test_disk_full"]
    async with _installed(store, [function, trigger], remove):
        yield


async def test_a_full_disk_is_an_outage_and_the_retry_lands(sql_store: SqlCommitStore) -> None:
    thread = ThreadId("full")
    first = await sql_store.append(activation(thread, "run", epoch=1, claim="me"), 0, 0, claim="me")
    big = step(thread, "run", 1, "x" * 50_000, prev=first.payload_hash, epoch=1)
    async with _full_disk(sql_store):
        for _ in range(2):  # on PostgreSQL the planned statement, then the read-first way
            with pytest.raises(StoreUnavailable):
                await sql_store.append(big, 1, 1)
        assert (await sql_store.load(thread)).version == 1
        assert len(await sql_store.read(thread)) == 1
    receipt = await sql_store.append(big, 1, 1)
    assert receipt.seq == 2
    await _replays(sql_store, "full")
