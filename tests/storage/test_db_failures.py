"""A commit that fails inside the database, mid-transaction, leaves nothing behind.

The conformance suite's "fails midway" test sends commits the pure rules refuse before
any I/O. These make the database itself refuse a commit half-way through its
transaction — a trigger raising on the commit's row (SQLite and PostgreSQL), a
connection killed while the transaction waits (PostgreSQL) — and check that nothing of
it remains, that its neighbours in the same group commit land, that the Run it belonged
to comes to rest (a refused commit ends the Run failed(store); a killed connection is an
outage, retried), and that the log still replays to the frontier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call, tool
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState
from runtime.rules import replay
from storage.sql import SqlCommitStore
from tests.storage.conftest import make_store

POISON = "POISON-PILL"
SLOW = "SLOW-COMMIT"


@pytest.fixture
async def sql_store(sql_store: SqlCommitStore) -> AsyncIterator[SqlCommitStore]:
    """conftest's store on each database, with the poison trigger."""
    await _install_poison(sql_store)
    try:
        yield sql_store
    finally:
        await _remove_poison(sql_store)


async def _install_poison(store: SqlCommitStore) -> None:
    """A trigger that refuses any commit whose body holds POISON — inside the
    transaction, after the thread row of the same group may have been written."""
    async with store.engine.begin() as conn:
        if store.db.dialect == "sqlite":
            await conn.execute(
                text(
                    "CREATE TRIGGER poison BEFORE INSERT ON ratchet_commits"
                    f" WHEN NEW.body LIKE '%{POISON}%'"
                    " BEGIN SELECT RAISE(ABORT, 'poisoned by the test'); END"
                )
            )
            return
        await conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION ratchet_poison() RETURNS trigger AS $$"
                f" BEGIN IF NEW.body LIKE '%{POISON}%' THEN"
                " RAISE EXCEPTION 'poisoned by the test'; END IF;"
                " IF NEW.body LIKE '%" + SLOW + "%'"
                " AND EXISTS (SELECT 1 FROM ratchet_test_flags WHERE name = 'slow') THEN"
                " PERFORM pg_sleep(60); END IF;"
                " RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        await conn.execute(text("CREATE TABLE IF NOT EXISTS ratchet_test_flags (name text)"))
        await conn.execute(
            text(
                "CREATE TRIGGER poison BEFORE INSERT ON ratchet_commits"
                " FOR EACH ROW EXECUTE FUNCTION ratchet_poison()"
            )
        )


async def _remove_poison(store: SqlCommitStore) -> None:
    async with store.engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER IF EXISTS poison" + _on(store)))
        if store.db.dialect == "postgresql":
            await conn.execute(text("DROP TABLE IF EXISTS ratchet_test_flags"))


def _on(store: SqlCommitStore) -> str:
    return " ON ratchet_commits" if store.db.dialect == "postgresql" else ""


def _agent(result: str) -> Agent:
    @tool
    def fetch(key: str) -> str:
        return result

    model = ScriptedModel(
        [
            ModelResponse(text="fetching", tool_calls=(call("fetch", "c1", key="k"),)),
            ModelResponse(text="done"),
        ]
    )
    return Agent(name="fetcher", model=model, tools=[fetch])


async def _replays(store: SqlCommitStore, thread: str) -> list[Any]:
    records = await store.read(ThreadId(thread))
    stored = await store.load(ThreadId(thread))
    ownership = {"epoch", "owner"}
    rebuilt = replay(ThreadId(thread), [r.commit for r in records])
    assert rebuilt.model_dump(exclude=ownership) == stored.model_dump(exclude=ownership)
    return records


async def test_a_commit_the_database_refuses_leaves_nothing_and_fails_only_its_run(
    sql_store: SqlCommitStore,
) -> None:
    poisoned = InProcessRunner(_agent(f"here is the {POISON}"), sql_store)
    clean = [InProcessRunner(_agent("clean"), sql_store) for _ in range(4)]
    done = await asyncio.gather(  # one group commit holds them all, the culprit among them
        poisoned.start("go", thread_id="poisoned"),
        *(runner.start("go", thread_id=f"clean-{i}") for i, runner in enumerate(clean)),
    )
    first = done[0].run_state
    assert isinstance(first, EndedState) and first.cause.kind == "failed"
    assert (first.cause.failure, first.cause.code) == ("store", "StoreError")
    assert "refused" in first.cause.message or "poisoned" in first.cause.message
    records = await _replays(sql_store, "poisoned")
    assert not any(POISON in r.commit.encoded for r in records)  # nothing of it stored
    assert records[-1].commit.label == "ended"  # the Run came to rest
    for frontier in done[1:]:
        assert isinstance(frontier.run_state, EndedState)
        assert frontier.run_state.cause.kind == "natural"
    for i in range(4):
        await _replays(sql_store, f"clean-{i}")


async def test_a_connection_killed_mid_transaction_is_retried_and_lands_once(
    pg_conformance_url: str,
) -> None:
    store = await make_store("postgres", pg_conformance_url)
    await _install_poison(store)
    admin = await asyncpg.connect(pg_conformance_url)
    try:
        await admin.execute("INSERT INTO ratchet_test_flags VALUES ('slow')")
        task = asyncio.create_task(InProcessRunner(_agent(SLOW), store).start("go", thread_id="s"))
        pid = await _sleeping_backend(admin)
        await admin.execute("DELETE FROM ratchet_test_flags")  # the retry will not sleep
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        frontier = await asyncio.wait_for(task, 60)
        assert isinstance(frontier.run_state, EndedState)
        assert frontier.run_state.cause.kind == "natural"  # an outage, not a failure
        records = await _replays(store, "s")
        with_result = [r for r in records if SLOW in r.commit.encoded]
        assert [r.commit.label for r in with_result] == ["results", "ended"]  # landed once
    finally:
        await admin.close()
        await _remove_poison(store)
        await store.close()


async def _sleeping_backend(admin: asyncpg.Connection, timeout_s: float = 30.0) -> int:
    """The pid of the backend whose commit transaction sleeps in the trigger."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        pid = await admin.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
            " AND pid <> pg_backend_pid() LIMIT 1"
        )
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.02)
    raise AssertionError("no commit transaction reached the sleeping trigger")
