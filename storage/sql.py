"""SqlCommitStore: the CommitStore on SQLAlchemy 2 asyncio, for SQLite and PostgreSQL.

**An append** runs in one transaction: lock the thread row (PostgreSQL ``SELECT ...
FOR UPDATE``; SQLite ``BEGIN IMMEDIATE``, one writer), look up a receipt already
stored under the commit's operation id, apply ``check_append`` and ``advance``
from ``runtime.commit`` (the same pure rules every backend uses), insert the commit
row and write the new frontier into the thread row, so ``load`` reads one row and
never replays the log.

**Group commit.** Appends go into an in-process queue drained by group writer
tasks: whatever arrived while the previous transaction ran goes into the next one.
Each append is still admitted on its own: the admission rules are pure and run per
append against the frontier as the earlier appends of the same group left it, so
a refused append writes nothing and does not touch its neighbours. Only a failure
inside the database (a unique violation) aborts the group's transaction; the group
is then replayed with one SAVEPOINT per append, so only the culprit fails.
Outcomes are delivered after COMMIT returns — an append that was admitted but whose
transaction then failed gets ``StoreUnavailable``, never a receipt.

**Dialects.** The transaction bodies (``storage.sql_txn``) are written once against
a sync Connection and run by ``sql_engine.Writer``: on PostgreSQL in SQLAlchemy's
greenlet over asyncpg, with a few groups in flight (rows are locked in thread-id
order, so groups cannot deadlock); on SQLite on one dedicated writer thread — the
single-writer funnel DESIGN §5 asks for, so the process never contends for
SQLite's lock with itself. Reads use the async engine (aiosqlite / asyncpg); in
WAL mode SQLite readers do not wait for the writer.

Errors are translated in ``storage.sql_engine.translate``; messages name the
store by ``redact(url)`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import Select

from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    check_size,
    decode_commit,
)
from runtime.errors import CorruptRecord, StoreError, StoreUnavailable
from runtime.ids import ThreadId
from runtime.lifecycle import ThreadStatus
from runtime.ports import CommittedRecord, RunSummary
from storage.checkpoints import SqlCheckpointStore
from storage.schema import commits, migrate, threads
from storage.sql_engine import Writer, create_engine, translate
from storage.sql_txn import AppendRequest, DbRow, Outcome, claim_txn, decode_frontier, transact
from storage.url import redact

T = TypeVar("T")

log = logging.getLogger("ratchet.storage.sql")


@dataclass
class _Append(AppendRequest):
    future: asyncio.Future[Receipt] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SqlCommitStore:
    """CommitStore on SQLite or PostgreSQL; ``connect`` is the constructor to use.

    A store belongs to the event loop that connected it (its group writers run there).
    """

    def __init__(
        self, url: str, engine: AsyncEngine, payload_limit: int, group_commit: bool
    ) -> None:
        self.engine = engine
        self.where = redact(url)
        self.payload_limit = payload_limit
        self.group_commit = group_commit
        self.groups = 0
        """Transactions that carried appends (with ``appends``: how well grouping works)."""
        self.appends = 0
        self._writer = Writer(url, engine)
        self._queue: asyncio.Queue[_Append] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        group_commit: bool = True,
    ) -> SqlCommitStore:
        """Open the database, create or migrate the schema, start the group writer."""
        store = cls(url, create_engine(url), payload_limit, group_commit)
        try:
            version = await store._write(migrate)
        except StoreError:
            await store._dispose()
            raise
        if group_commit:
            store._tasks = [
                asyncio.create_task(store._drain(), name=f"group-commit {i} {store.where}")
                for i in range(store._writer.concurrency)
            ]
        log.info("connected to %s (schema version %d)", store.where, version)
        return store

    def checkpoints(self) -> SqlCheckpointStore:
        """The StreamCheckpointStore on the same database."""
        return SqlCheckpointStore(self.engine, self.where)

    # ---- the port ------------------------------------------------------------------------

    async def append(self, commit: ThreadCommit, expected_version: int, epoch: int) -> Receipt:
        check_size(commit, self.payload_limit)
        item = _Append(commit, expected_version, epoch)
        if not self._tasks:
            await self._commit_group([item])
        else:
            self._queue.put_nowait(item)
        return await item.future

    async def load(self, thread: ThreadId) -> Frontier:
        stmt = select(threads.c.version, threads.c.frontier).where(threads.c.thread_id == thread)
        rows = await self._select(stmt)
        if not rows:
            return Frontier(thread_id=thread)
        return decode_frontier(thread, rows[0].frontier, rows[0].version)

    async def read(self, thread: ThreadId, after_seq: int = 0) -> list[CommittedRecord]:
        stmt = (
            select(commits.c.seq, commits.c.body)
            .where(commits.c.thread_id == thread, commits.c.seq > after_seq)
            .order_by(commits.c.seq)
        )
        return [
            CommittedRecord(seq=r.seq, commit=decode_commit(r.body, thread, r.seq))
            for r in await self._select(stmt)
        ]

    async def claim(self, thread: ThreadId, owner: str) -> int:
        return await self._write(claim_txn, thread, owner)

    async def list_runs(
        self, state: Literal["running", "awaiting", "ended"] | None = None
    ) -> list[RunSummary]:
        c = threads.c
        stmt = select(c.thread_id, c.run_id, c.run_state, c.status, c.version, c.cause).where(
            c.run_state.is_not(None) if state is None else c.run_state == state
        )
        return [_summary(r) for r in await self._select(stmt.order_by(c.thread_id))]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while not self._queue.empty():
            _resolve(self._queue.get_nowait(), StoreUnavailable(f"store {self.where} closed"))
        await self._dispose()

    async def _dispose(self) -> None:
        await asyncio.to_thread(self._writer.close)
        await self.engine.dispose()

    # ---- group commit ---------------------------------------------------------------------

    async def _drain(self) -> None:
        """A group writer: each transaction takes everything that queued meanwhile."""
        while True:
            group = [await self._queue.get()]
            while not self._queue.empty() and len(group) < self._writer.max_group:
                group.append(self._queue.get_nowait())
            await self._commit_group(group)

    async def _commit_group(self, group: list[_Append]) -> None:
        """Commit a group and resolve every caller's future; never raises (but cancel)."""
        try:
            outcomes: list[Outcome] = await self._write(transact, group, self.where)
        except asyncio.CancelledError:
            for item in group:
                _resolve(item, StoreUnavailable(f"store {self.where} closed"))
            raise
        except StoreError as error:
            log.warning("a group of %d appends failed: %s", len(group), error)
            outcomes = [_own_copy(error) for _ in group]
        self.groups += 1
        self.appends += len(group)
        for item, outcome in zip(group, outcomes, strict=True):
            _resolve(item, outcome)

    # ---- the edge: every driver call goes through one of these two -----------------------

    async def _write(self, body: Callable[..., T], *args: Any) -> T:
        try:
            return await self._writer.run(body, *args)
        except StoreError:
            raise
        except Exception as exc:
            raise translate(exc, self.where) from exc

    async def _select(self, stmt: Select[Any]) -> list[DbRow]:
        try:
            async with self.engine.connect() as conn:
                return list((await conn.execute(stmt)).all())
        except Exception as exc:
            raise translate(exc, self.where) from exc


def _summary(row: DbRow) -> RunSummary:
    try:
        status = ThreadStatus.model_validate_json(row.status)
    except ValidationError as exc:
        raise CorruptRecord(row.thread_id, row.version, "stored run status") from exc
    return RunSummary(
        thread_id=row.thread_id,
        run_id=row.run_id,
        state=row.run_state,
        status=status,
        version=row.version,
        cause=row.cause,
    )


def _own_copy(error: StoreError) -> StoreError:
    """One exception object per caller: a shared one would gather every caller's traceback."""
    if type(error) not in (StoreError, StoreUnavailable):
        return error
    copy = type(error)(str(error))
    copy.__cause__ = error.__cause__
    return copy


def _resolve(item: _Append, outcome: Outcome) -> None:
    """Deliver one caller's outcome (a caller that gave up has a cancelled future)."""
    if item.future.done():
        return
    if isinstance(outcome, Receipt):
        item.future.set_result(outcome)
    else:
        item.future.set_exception(outcome)
