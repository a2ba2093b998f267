"""The SQL transaction bodies, written once against a sync Connection.

``SqlCommitStore`` runs them through ``storage.sql_engine.Writer`` (a greenlet over
asyncpg on PostgreSQL, the writer thread on SQLite). Each body owns its
transaction(s); statements compose inside them (``append_txn`` is also what the
SAVEPOINT fallback runs per append).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection, and_, bindparam, func, select, true
from sqlalchemy.exc import IntegrityError

from runtime.commit import Frontier, Receipt, ThreadCommit, advance, check_append, with_claim
from runtime.errors import CorruptRecord, RatchetError, StoreError
from runtime.ids import OperationId, ThreadId
from storage.schema import commits, threads
from storage.sql_engine import translate, upsert_ignore
from storage.summary import summarize

Outcome = Receipt | StoreError | RatchetError
DbRow = Any
"""A SQLAlchemy result row (its column types are not tracked)."""


@dataclass
class AppendRequest:
    commit: ThreadCommit
    expected: int
    epoch: int


def decode_frontier(thread: str, text: str, version: int) -> Frontier:
    """A stored frontier, re-validated; fails closed with CorruptRecord."""
    try:
        frontier = Frontier.model_validate_json(text)
    except ValidationError as exc:
        detail = str(exc.errors()[0].get("msg", exc))
        raise CorruptRecord(thread, version, f"stored frontier: {detail}") from exc
    if frontier.thread_id != thread or frontier.version != version:
        raise CorruptRecord(thread, version, "stored frontier names another thread or version")
    return frontier


def thread_row(frontier: Frontier) -> dict[str, Any]:
    """The thread row's columns for a frontier (copies of it, for queries and locking)."""
    summary = summarize(frontier)
    return {
        "version": frontier.version,
        "epoch": frontier.epoch,
        "owner": frontier.owner,
        "frontier": frontier.model_dump_json(),
        "run_id": frontier.run_id,
        "run_state": summary.state if summary else None,
        "cause": summary.cause if summary else None,
        "status": frontier.status.model_dump_json(),
        "updated": time.time_ns() // 1000,
    }


class Group:
    """The pure half of one transaction: admits each append on its own, in order."""

    def __init__(self, rows: dict[str, DbRow], known: dict[tuple[str, str], Receipt]):
        self.rows = rows
        self.known = known
        self.frontiers: dict[str, Frontier] = {}
        self.new_commits: list[dict[str, Any]] = []

    def admit(self, request: AppendRequest) -> Outcome:
        try:
            return self._admit(request.commit, request.expected, request.epoch)
        except RatchetError as exc:  # this append is refused; its neighbours go on
            return exc

    def _admit(self, commit: ThreadCommit, expected: int, epoch: int) -> Receipt:
        thread = commit.thread_id
        frontier = self.frontier(thread)
        known = self.known.get((thread, commit.operation_id))
        receipt = check_append(frontier, commit, expected, epoch, known)
        if receipt is not None:
            return receipt
        frontier = advance(frontier, commit)
        receipt = Receipt(
            thread_id=thread,
            seq=frontier.version,
            operation_id=commit.operation_id,
            payload_hash=commit.payload_hash,
        )
        self.known[(thread, commit.operation_id)] = receipt
        self.frontiers[thread] = frontier
        self.new_commits.append(
            {
                "thread_id": thread,
                "seq": receipt.seq,
                "operation_id": receipt.operation_id,
                "payload_hash": receipt.payload_hash,
                "label": commit.label,
                "body": commit.encoded,
            }
        )
        return receipt

    def frontier(self, thread: str) -> Frontier:
        if thread not in self.frontiers:
            row = self.rows[thread]
            self.frontiers[thread] = decode_frontier(thread, row.frontier, row.version)
        return self.frontiers[thread]

    def changed(self) -> list[dict[str, Any]]:
        touched = {c["thread_id"] for c in self.new_commits}
        return [{"b_thread": t, **thread_row(self.frontiers[t])} for t in sorted(touched)]


UPDATE_THREAD = threads.update().where(threads.c.thread_id == bindparam("b_thread"))


def transact(conn: Connection, group: Sequence[AppendRequest], where: str) -> list[Outcome]:
    """One transaction for the whole group; on a database refusal, one SAVEPOINT each."""
    try:
        with conn.begin():
            return append_txn(conn, group)
    except IntegrityError:
        # The database refused a write the pure rules admitted: find the culprit.
        with conn.begin():
            return [_isolated(conn, request, where) for request in group]


def _isolated(conn: Connection, request: AppendRequest, where: str) -> Outcome:
    thread = request.commit.thread_id
    try:
        with conn.begin_nested():
            return append_txn(conn, [request])[0]
    except IntegrityError as exc:
        latest = select(func.max(commits.c.seq)).where(commits.c.thread_id == thread)
        return translate(
            exc,
            where,
            thread=thread,
            operation=request.commit.operation_id,
            expected=request.expected,
            actual=conn.execute(latest).scalar() or 0,
        )


def append_txn(conn: Connection, group: Sequence[AppendRequest]) -> list[Outcome]:
    """Lock, admit each append on its own, then write what was admitted."""
    ops = {r.commit.operation_id for r in group}
    rows, known = lock(conn, {r.commit.thread_id for r in group}, ops)
    pure = Group(rows, known)
    outcomes = [pure.admit(request) for request in group]
    if pure.new_commits:
        conn.execute(commits.insert(), pure.new_commits)
        conn.execute(UPDATE_THREAD, pure.changed())
    return outcomes


def claim_txn(conn: Connection, thread: ThreadId, owner: str) -> int:
    with conn.begin():
        rows, _ = lock(conn, [thread], ())
        row = rows[thread]
        frontier = with_claim(decode_frontier(thread, row.frontier, row.version), owner)
        conn.execute(UPDATE_THREAD, [{"b_thread": thread, **thread_row(frontier)}])
        return frontier.epoch


Locked = tuple[dict[str, DbRow], dict[tuple[str, str], Receipt]]


def lock(conn: Connection, ids: Iterable[str], ops: Iterable[str]) -> Locked:
    """Lock the thread rows in id order (no deadlock between groups), creating new ones.

    Returns the rows and the receipts already stored under ``ops`` (one query).
    """
    wanted = [ThreadId(t) for t in sorted(ids)]
    ops = sorted(ops)
    rows, known = _lock_existing(conn, wanted, ops)
    missing = [t for t in wanted if t not in rows]
    if missing:
        fresh = [{"thread_id": t, **thread_row(Frontier(thread_id=t))} for t in missing]
        conn.execute(upsert_ignore(conn.dialect.name, threads), fresh)
        more_rows, more_known = _lock_existing(conn, missing, ops)
        rows.update(more_rows)
        known.update(more_known)
    return rows, known


def _lock_existing(conn: Connection, ids: Sequence[str], ops: Sequence[str]) -> Locked:
    t = threads.c
    c = _receipts_of_each_thread(conn.dialect.name, ops)
    stmt = (
        select(t.thread_id, t.version, t.frontier, c.operation_id, c.seq, c.payload_hash)
        .select_from(threads.outerjoin(c.table, c.on))
        .where(t.thread_id.in_(ids))
        .order_by(t.thread_id)
        .with_for_update(of=threads)
    )
    rows: dict[str, DbRow] = {}
    known: dict[tuple[str, str], Receipt] = {}
    for r in conn.execute(stmt):
        rows[r.thread_id] = r
        if r.operation_id is not None:
            known[(r.thread_id, r.operation_id)] = Receipt(
                thread_id=r.thread_id,
                seq=r.seq,
                operation_id=OperationId(r.operation_id),
                payload_hash=r.payload_hash,
            )
    return rows, known


@dataclass(frozen=True)
class _ReceiptJoin:
    table: Any
    on: Any
    operation_id: Any
    seq: Any
    payload_hash: Any


def _receipts_of_each_thread(dialect: str, ops: Sequence[str]) -> _ReceiptJoin:
    """The stored receipts of ``ops``, joined to each locked thread row.

    PostgreSQL gets a LATERAL subquery so every thread is probed through the
    (thread_id, operation_id) index: a plain join lets the planner, with fresh or
    stale statistics, hash-join a sequential scan of the whole log. SQLite always
    plans nested loops over that index, and has no LATERAL.
    """
    c = commits.c
    if dialect != "postgresql":
        on = and_(c.thread_id == threads.c.thread_id, c.operation_id.in_(ops))
        return _ReceiptJoin(commits, on, c.operation_id, c.seq, c.payload_hash)
    sub = (
        select(c.operation_id, c.seq, c.payload_hash)
        .where(c.thread_id == threads.c.thread_id, c.operation_id.in_(ops))
        .limit(max(1, len(ops)))  # a LIMIT keeps the planner from flattening the LATERAL
        .lateral("known")
    )
    k = sub.c
    return _ReceiptJoin(sub, true(), k.operation_id, k.seq, k.payload_hash)
