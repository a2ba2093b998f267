"""SQLite lets any column hold a value of any type: a row edited by hand to hold a BLOB
where text belongs, or text where a number does, is that thread's CorruptRecord (left
out of a listing, named by an audit), never an AttributeError, TypeError or ValueError
out of the read, nor another thread's failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import audit_thread
from storage.schema import commits, pruned_messages, threads
from storage.sql import SqlCommitStore

from .test_integrity import make_victim

BAD, GOOD = ThreadId("typed-bad"), ThreadId("typed-good")  # listed in this order
EDITS = {
    "frontier-blob": f"UPDATE {threads.name} SET frontier = x'00ff' WHERE thread_id = :t",
    "version-text": f"UPDATE {threads.name} SET version = 'abc' WHERE thread_id = :t",
    "pruned-text": f"UPDATE {threads.name} SET pruned_through = 'x' WHERE thread_id = :t",
    "body-blob": f"UPDATE {commits.name} SET body = x'00ff' WHERE thread_id = :t AND seq = 2",
    "seq-text": f"UPDATE {commits.name} SET seq = 'two' WHERE thread_id = :t AND seq = 2",
    # text that is not UTF-8: the driver's decoding failed the whole statement
    "frontier-bytes": f"UPDATE {threads.name} SET frontier = CAST(x'7b22ff' AS TEXT) "
    "WHERE thread_id = :t",
    "status-bytes": f"UPDATE {threads.name} SET status = CAST(x'7b22ff' AS TEXT) "
    "WHERE thread_id = :t",
    "body-bytes": f"UPDATE {commits.name} SET body = CAST(x'7b22ff' AS TEXT) "
    "WHERE thread_id = :t AND seq = 2",
}
ROW_EDITS = ("frontier", "version", "status")
"""Edits of the thread row, which a listing reads (the others are of the log)."""


@pytest.fixture
async def sqlite(tmp_path: Path) -> AsyncIterator[SqlCommitStore]:
    store = await SqlCommitStore.connect(f"sqlite:///{tmp_path}/typed.db")
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("edit", list(EDITS))
async def test_a_value_of_the_wrong_type_is_that_threads_corrupt_record(
    sqlite: SqlCommitStore, edit: str
) -> None:
    await make_victim(sqlite, BAD)
    await make_victim(sqlite, GOOD)
    async with sqlite.engine.begin() as conn:
        await conn.execute(text(EDITS[edit]), {"t": BAD})
    sqlite._frontiers = type(sqlite._frontiers)()  # another process: nothing cached
    if edit != "status-bytes":  # a load reads no status: the listing's column
        with pytest.raises(CorruptRecord):
            await sqlite.load(BAD)
    if not edit.startswith(ROW_EDITS):  # the log, or its anchor
        with pytest.raises(CorruptRecord):
            await sqlite.read(BAD)
    listed = [s.thread_id for s in await sqlite.list_runs()]  # the listing reads rows only
    assert listed == ([GOOD] if edit.startswith(ROW_EDITS) else [BAD, GOOD])
    assert (await audit_thread(sqlite, BAD)).problems
    assert not (await audit_thread(sqlite, GOOD)).problems
    assert (await sqlite.load(GOOD)).version == 5


@pytest.mark.parametrize("value", ["CAST(body AS BLOB)", "CAST(x'7b22ff' AS TEXT)"])
async def test_a_pruned_message_of_the_wrong_type_is_that_threads_corrupt_record(
    sqlite: SqlCommitStore, value: str
) -> None:
    """The pruned history is hashed for its digest: a BLOB there was an AttributeError
    out of the load, a StoreError the edge answered 503 (as if to be tried again)."""
    for said in ("one", "two"):  # a prune keeps at least the last Run
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text=said)]))
        await InProcessRunner(agent, sqlite).start(said, thread_id=BAD)
    assert await sqlite.prune(BAD, 2)
    edit = f"UPDATE {pruned_messages.name} SET body = {value} WHERE thread_id = :t AND idx = 0"
    async with sqlite.engine.begin() as conn:
        await conn.execute(text(edit), {"t": BAD})
    sqlite._frontiers = type(sqlite._frontiers)()
    with pytest.raises(CorruptRecord, match="pruned"):
        await sqlite.load(BAD)
    assert (await audit_thread(sqlite, BAD)).problems


async def test_a_thread_id_that_is_not_utf8_is_audited_and_skipped_not_a_whole_command(
    sqlite: SqlCommitStore, tmp_path: Path
) -> None:
    """A thread id edited to bytes that are not UTF-8 reads back with lone surrogates,
    which the driver cannot send back: the listing pages past it (its cursor goes as its
    bytes), `verify --all` names it among the others, and `prune` skips it, naming it,
    and goes through the rest (both stopped at it, printing nothing of the others)."""
    import asyncio

    from typer.testing import CliRunner

    from cluster.cli import app

    await make_victim(sqlite, BAD)
    await make_victim(sqlite, GOOD)
    for table in (threads.name, commits.name):
        async with sqlite.engine.begin() as conn:
            await conn.execute(
                text(
                    f"UPDATE {table} SET thread_id = CAST(x'7a7aff' AS TEXT) WHERE thread_id = :t"
                ),
                {"t": GOOD},
            )
    ids = await sqlite.thread_ids()
    assert len(ids) == 2 and "zz\udcff" in ids
    assert await sqlite.thread_ids(after="zz\udcff") == []  # past it, not an error
    url = f"sqlite:///{tmp_path}/typed.db"
    verify = await asyncio.to_thread(CliRunner().invoke, app, ["verify", "--all", "--store", url])
    assert "2 threads audited, 1 with problems" in verify.stdout, verify.output
    prune = ["prune", "--ended-before", "2100-01-01", "--store", url]
    pruned = await asyncio.to_thread(CliRunner().invoke, app, prune)
    assert "skipped: thread 'zz\\udcff'" in pruned.stderr, pruned.output
    assert "2 threads scanned" in pruned.stdout and "1 skipped" in pruned.stdout, pruned.output
