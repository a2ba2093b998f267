"""SqlCommitStore: the CommitStore on SQLAlchemy 2, for SQLite and PostgreSQL.

**An append** runs in one transaction: lock the thread row (PostgreSQL ``SELECT ...
FOR UPDATE``; SQLite ``BEGIN IMMEDIATE``, one writer), look up a receipt already
stored under the commit's operation id, apply ``admit`` from ``runtime.commit`` (the
same pure rules every backend uses: an append's own claim, fencing, version, the
hash chain, the fold), insert the commit row and write the new frontier's head
(without messages) and its checksum into the thread row: an append writes its commit
and a row that does not grow with the history. ``load_head`` reads that row alone;
``load`` adds the messages from the verified log (``sql_reads.load_body``).
**A claim** locks the row the same way, checks the epoch it supersedes
(``check_claim``) and writes the row back with the epoch bumped (``with_claim``).
Every read is verified (``runtime.integrity``): a load checks the frontier against
its checksum, a read checks each record's hash, the chain and the head.

**Group commit** (``storage.sql_writer``): appends and claims go into an in-process
queue drained by group writer tasks, a transaction for whatever arrived meanwhile,
each request still admitted on its own.

**Planned groups.** A group is first admitted before its transaction, on the event
loop, against the frontiers this process last wrote or read, and that transaction only
writes, each thread row on condition that it is still as the plan found it; should
any row have moved, the group is written the read-first way, locking its rows as an
append above does (``storage.sql_plan``).

**A prune** (``storage.retention``) is a transaction of its own on the writer, beside
the groups: it deletes the records of its cut and moves the thread row's anchor
(``pruned_through``, ``pruned_hash``) only if the anchor is still where the prune read
it. No append writes those two columns, so a planned write, which compares version,
epoch and owner only, never undoes a prune; a read that meets a log a prune cut
between its two statements reads again (``sql_reads.read_body``).

**Decoded frontiers are cached** per process (``storage.frontiers``), keyed by the
exact stored text, so neither a group transaction nor a load re-validates a
frontier this process wrote — a row written by anyone else is decoded afresh —
and a new frontier's text reuses the encoded message history of the one it
was folded from.

**Dialects.** The bodies (``storage.sql_txn``) are written once against a sync
Connection and run by ``sql_engine.Database``: on PostgreSQL in SQLAlchemy's
greenlet over asyncpg (planned groups go around it), one group in flight per
process (``Database.concurrency``; the groups of several processes lock the rows
there are in thread-id order, but make the missing ones after, so two groups making the
same new threads can deadlock: PostgreSQL rolls one back, which is tried once more at
once); on SQLite on a dedicated writer
thread — the single-writer funnel DESIGN §5 asks for, serialised across processes
by a file lock — and reads on a dedicated reader thread, which in WAL mode never
waits for the writer.

Errors are translated in ``storage.sql_errors.translate``; messages name the store by
``redact(url)`` only. Every call has a deadline (``timeout_s``; what it means for a
queued append: ``storage.sql_writer``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from runtime.commit import DEFAULT_PAYLOAD_LIMIT, Frontier, Receipt, ThreadCommit
from runtime.errors import StoreError
from runtime.ids import ThreadId
from runtime.integrity import check_page_limit
from runtime.ports import CommittedRecord, Lease, RunSummary
from runtime.rules import check_size
from storage.checkpoints import SqlCheckpointStore
from storage.retention import Cut, prune_thread
from storage.schema import migrate
from storage.sql_engine import DEFAULT_TIMEOUT_S, Database
from storage.sql_group import AppendRequest, ClaimRequest
from storage.sql_lease import drop_body, hold_body
from storage.sql_reads import (
    held_history_body,
    index_problem_body,
    list_body,
    listed_runs,
    load_body,
    load_head_body,
    read_body,
    thread_ids_body,
)
from storage.sql_txn import prune_txn
from storage.sql_writer import GroupWriter, Queued

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("ratchet.storage.sql")


class SqlCommitStore(GroupWriter):
    """CommitStore on SQLite or PostgreSQL; ``connect`` is the constructor to use.

    A store belongs to the event loop that connected it (its group writers run there).
    """

    def __init__(
        self,
        url: str,
        db: Database,
        payload_limit: int,
        group_commit: bool,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(url, db, group_commit, timeout_s)
        self.payload_limit = payload_limit

    @property
    def engine(self) -> AsyncEngine:
        """The SQLAlchemy AsyncEngine on the same database (for tests and tools)."""
        return self.db.engine

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        group_commit: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        create: bool = True,
    ) -> SqlCommitStore:
        """Open the database, create or migrate the schema, start the group writers;
        ``create`` False: a database with no schema is ``NoStore``, left untouched."""
        store = cls(url, Database.open(url, timeout_s), payload_limit, group_commit, timeout_s)
        try:
            version = await store._write(migrate, store.where, create)
        except StoreError:
            await store.db.close()
            raise
        if group_commit:
            store._start()
        log.info("connected to %s (schema version %d)", store.where, version)
        return store

    def checkpoints(self) -> SqlCheckpointStore:
        """The StreamCheckpointStore on the same database."""
        return SqlCheckpointStore(self.db, self.where)

    # ---- the port ------------------------------------------------------------------------

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        check_size(commit, self.payload_limit)
        item: Queued[Receipt] = Queued(AppendRequest(commit, expected_version, epoch, claim))
        return await self._submit(item)

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        item: Queued[Frontier] = Queued(ClaimRequest(thread, owner, supersedes))
        return await self._submit(item)

    async def load(self, thread: ThreadId) -> Frontier:
        """The whole frontier: its head with the messages of the verified log (and of
        a pruned thread's pruned history): reads the whole log."""
        return await self._read(load_body, thread, self._frontiers)

    async def load_head(self, thread: ThreadId) -> Frontier:
        """The frontier without its messages (``message_count`` of them): one row."""
        return await self._read(load_head_body, thread, self._frontiers)

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        check_page_limit(limit)
        return await self._read(read_body, thread, after_seq, limit)

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        rows = await self._read(list_body, state, host)
        return listed_runs(rows, self._frontiers, state, host)

    async def index_problem(self, thread: ThreadId) -> str | None:
        """What is wrong with the thread's run index entry (``runtime.integrity.audit``)."""
        return await self._read(index_problem_body, thread, self._frontiers)

    async def held_history(self, thread: ThreadId) -> int:
        """The messages the thread's pruned history holds (``runtime.integrity.audit``)."""
        return await self._read(held_history_body, thread)

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        return await self._read(thread_ids_body, after, limit)

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        return await prune_thread(self, thread, through_seq, self._cut)

    async def _cut(self, cut: Cut) -> bool:
        """One transaction on the writer, beside the group writers' (``prune_txn``)."""
        return await self._bounded(self._write(prune_txn, cut))

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        return await self._bounded(self._write(hold_body, name, holder, ttl_s))

    async def drop_lease(self, name: str, holder: str) -> None:
        await self._bounded(self._write(drop_body, name, holder))

    async def close(self) -> None:
        await self._stop()
        await self.db.close()
