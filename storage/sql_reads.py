"""The SQL read bodies, one statement each (and a second where a prune raced them).

Written against a sync Connection like the write bodies (``storage.sql_txn``) and run
by ``storage.sql_engine.Database`` on its readers. Every read is verified
(``runtime.integrity``): a head against its checksum and the stored hash at its
version, a log against its hashes, chain and head; a log no thread row vouches for
fails closed.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection

from runtime.commit import Frontier
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import (
    PrunedHistory,
    RawRecord,
    check_head,
    page_end,
    verified_records,
    whole_frontier,
)
from runtime.lifecycle import ThreadStatus
from runtime.limits import utf8_problem
from runtime.ports import CommittedRecord, RunSummary, host_of
from storage.frontiers import FrontierCache
from storage.retention import ATTEMPTS
from storage.sql_statements import (
    ANCHOR,
    HEAD,
    INDEX_ROW,
    LIST_ALL,
    LIST_HOST,
    LIST_HOST_STATE,
    LIST_STATE,
    LOAD,
    PRUNED_COUNT,
    PRUNED_TEXTS,
    READ,
    THREAD_IDS,
    THREAD_IDS_SQLITE_RAW,
    UNVOUCHED,
)
from storage.summary import kept, summarize, vouched

DbRow = Any
"""A SQLAlchemy result row (its column types are not tracked)."""


def load_head_body(conn: Connection, thread: ThreadId, cache: FrontierCache) -> Frontier:
    """The frontier's head (no messages): the thread row alone, checked against its
    checksum and the stored hash of the record at its version."""
    return _head(conn, thread, conn.execute(LOAD, {"thread": thread}).first(), cache)


def load_body(conn: Connection, thread: ThreadId, cache: FrontierCache) -> Frontier:
    """The whole frontier: the head, with the messages of its verified log and, for a
    pruned thread, of its pruned history (``whole_frontier``). A prune between the row
    and the records removes records the row's anchor does not account for: read again,
    as ``read_body`` does."""
    for _ in range(ATTEMPTS - 1):
        row = conn.execute(LOAD, {"thread": thread}).first()
        head = _head(conn, thread, row, cache, tail=False)
        if not head.version:
            return head
        try:
            return _whole(conn, thread, head, row)
        except CorruptRecord:
            now = conn.execute(ANCHOR, {"thread": thread}).first()
            if row is None or now is None or now.pruned_through == row.pruned_through:
                raise
    row = conn.execute(LOAD, {"thread": thread}).first()
    head = _head(conn, thread, row, cache, tail=False)
    return _whole(conn, thread, head, row) if head.version else head


def _head(
    conn: Connection, thread: ThreadId, row: DbRow, cache: FrontierCache, *, tail: bool = True
) -> Frontier:
    """The row's checked head; ``tail``: and no record past it (a caller that reads the
    records checks that after them, so a gap among them is named first)."""
    if row is None or row.version == 0:
        _check_unvouched(conn, thread)
    if row is None:
        return Frontier(thread_id=thread)
    if tail:
        check_tail(thread, row)
    return checked_head(thread, row, cache)


def check_tail(thread: ThreadId, row: DbRow) -> None:
    """CorruptRecord if the log runs past the thread row that was read with its last seq
    in one statement (``LOAD``, ``HEAD``): an append writes both in one transaction, so
    a record past the row is one no frontier vouches for (planted, or the row put back
    to an earlier one by hand), and every append after it would fail."""
    last, version = row.last_seq, row.version
    if last is None:
        return
    if type(last) is not int or type(version) is not int:
        raise CorruptRecord(thread, 0, "the thread row or its log holds a value of the wrong type")
    if last > version:
        raise CorruptRecord(thread, last, f"a record past the frontier's head (version {version})")


def checked_head(thread: ThreadId, row: DbRow, cache: FrontierCache) -> Frontier:
    """The head a thread row stores, checked against its checksum and against the stored
    hash of the record at its version (or the prune's anchor at it)."""
    frontier = cache.decode(thread, row.frontier, row.version, row.checksum)
    at_head = row.payload_hash
    if at_head is None and row.pruned_through is not None and row.pruned_through == row.version:
        at_head = row.pruned_hash  # pruned through its head
    check_head(thread, frontier, at_head)
    if row.head != frontier.head:
        raise CorruptRecord(thread, row.version, "the stored head is not the frontier's")
    return frontier


def _whole(conn: Connection, thread: ThreadId, head: Frontier, row: DbRow) -> Frontier:
    """``head`` with its history, the records read under the row's own anchor. The
    pruned history only grows, so its first messages are those the anchor's digest
    covers, whatever a prune added since."""
    records = _read_under(conn, thread, 0, row)
    pruned = None
    if row.pruned_through is not None:
        before = head.message_count - sum(len(r.commit.messages) for r in records)
        texts = conn.execute(PRUNED_TEXTS, {"thread": thread, "count": before}).scalars().all()
        pruned = PrunedHistory(list(texts), row.pruned_digest)
    return whole_frontier(thread, head, records, pruned)


def read_body(
    conn: Connection, thread: ThreadId, after_seq: int, limit: int | None = None
) -> list[CommittedRecord]:
    """The log after ``after_seq`` up to the head (or ``limit`` records of it: a page,
    ``runtime.integrity.page_end``), verified. The head is read first: the
    log only grows, so every record up to it is there when the records are read (two
    statements, each its own snapshot), and records past it, a concurrent append's, are
    not read. A log that no thread row vouches for (none, version 0, no head) fails
    closed. A prune between the two statements removes records the head's anchor does
    not account for: a log that fails under an anchor that has moved since is read again
    (an anchor only moves forward, and a cut happens once)."""
    for _ in range(ATTEMPTS - 1):
        head = conn.execute(HEAD, {"thread": thread}).first()
        try:
            return _read_under(conn, thread, after_seq, head, limit)
        except CorruptRecord:
            now = conn.execute(ANCHOR, {"thread": thread}).first()
            if head is None or now is None or now.pruned_through == head.pruned_through:
                raise
    head = conn.execute(HEAD, {"thread": thread}).first()
    return _read_under(conn, thread, after_seq, head, limit)


def _read_under(
    conn: Connection, thread: ThreadId, after_seq: int, head: DbRow, limit: int | None = None
) -> list[CommittedRecord]:
    if head is None or head.version == 0:
        _check_unvouched(conn, thread)
        return []
    if head.head is None:  # a row migration 4 could not upgrade
        raise CorruptRecord(thread, head.version, "the thread row names no head")
    anchored = head.pruned_through is None or type(head.pruned_through) is int
    if type(head.version) is not int or not anchored:  # SQLite's columns take any type
        raise CorruptRecord(thread, 0, "the thread row holds a value of the wrong type")
    if head.pruned_through is not None and not 1 <= head.pruned_through <= head.version:
        raise CorruptRecord(thread, 0, f"the thread's anchor {head.pruned_through} is no seq")
    anchor = None
    if head.pruned_through is not None:
        anchor = (int(head.pruned_through), str(head.pruned_hash))
    first = max(after_seq, 1, (anchor[0] + 1) if anchor else 0)
    end = page_end(after_seq, head.version, limit, anchor[0] if anchor else 0)
    bounds = {"thread": thread, "first": first, "last": end}
    rows = conn.execute(READ, bounds).all()  # all: an open cursor would hold its snapshot
    raw = (RawRecord(r.seq, r.body, r.payload_hash, r.operation_id) for r in rows)
    stored = (head.version, head.head)
    records = verified_records(thread, raw, after_seq, stored, anchor=anchor, through=end)
    check_tail(thread, head)
    return records


def _check_unvouched(conn: Connection, thread: ThreadId) -> None:
    """A first look found no thread row, or one at version 0: CorruptRecord if records
    are stored all the same (``check_head`` and ``verified_records`` take version 0 for
    an empty thread). A row found at a later version now is an append landed since."""
    found = conn.execute(UNVOUCHED, {"thread": thread}).one()
    if found.first_seq is not None and not found.version:
        raise CorruptRecord(thread, found.first_seq, "the log has records no frontier vouches for")


def thread_ids_body(conn: Connection, after: str, limit: int) -> list[ThreadId]:
    """A page of thread ids after ``after``. On SQLite an id may be bytes that are not
    UTF-8 (written by hand: it reads back with lone surrogates), and the driver cannot
    send that as text: such a cursor goes as its bytes, so the listing goes past it."""
    statement: Any = THREAD_IDS
    cursor: str | bytes = after
    if conn.dialect.name == "sqlite" and utf8_problem(after) is not None:
        statement = THREAD_IDS_SQLITE_RAW
        cursor = after.encode("utf-8", "surrogateescape")
    rows = conn.execute(statement, {"after": cursor, "limit": limit})
    return [ThreadId(r.thread_id) for r in rows]


def list_body(conn: Connection, state: str | None, host: str | None) -> list[DbRow]:
    if host is not None:
        if state is None:
            return list(conn.execute(LIST_HOST, {"host": host}))
        return list(conn.execute(LIST_HOST_STATE, {"host": host, "state": state}))
    if state is None:
        return list(conn.execute(LIST_ALL))
    return list(conn.execute(LIST_STATE, {"state": state}))


def listed_runs(
    rows: list[DbRow], cache: FrontierCache, state: str | None, host: str | None
) -> list[RunSummary]:
    """The Runs of the listed rows, each checked against its frontier (a row that does
    not verify is left out: ``storage.summary.kept``)."""
    return kept((functools.partial(summary_of, r, cache) for r in rows), state, host)  # type: ignore[arg-type]


def held_history_body(conn: Connection, thread: ThreadId) -> int:
    """How many messages the thread's pruned history holds, as stored (an audit's)."""
    return int(conn.execute(PRUNED_COUNT, {"thread": thread}).scalar() or 0)


def index_problem_body(conn: Connection, thread: ThreadId, cache: FrontierCache) -> str | None:
    """What is wrong with the thread's run index entry or its epoch and owner columns
    (None: they are its frontier's). No read trusts those two, but a planned write's
    fencing compares them (``UPDATE_UNCHANGED``) in place of the frontier: edited by
    hand, ``ratchet verify`` named neither."""
    row = conn.execute(INDEX_ROW, {"thread": thread}).first()
    if row is None:
        return None  # no row: the audit's load says why
    try:
        head = checked_head(thread, row, cache)
        if (row.epoch, row.owner) != (head.epoch, head.owner):
            said = f"epoch {row.epoch!r}, owner {row.owner!r}"
            return f"the thread row says {said}; its frontier {head.epoch}, {head.owner!r}"
        if row.run_state is None and row.run_id is None:  # a thread with no Run, it says
            if summarize(head) is not None:
                return "the run index names no Run; its frontier has one (hidden from listings)"
            return None
        summary_of(row, cache)
    except CorruptRecord as exc:
        return str(exc)
    return None


def summary_of(row: DbRow, cache: FrontierCache) -> RunSummary:
    """A listed thread row as a RunSummary: its index columns, as the head the row
    vouches for has them (``storage.summary.vouched``); CorruptRecord if they differ."""
    thread = ThreadId(row.thread_id)
    try:
        listed = RunSummary(
            thread_id=thread,
            run_id=row.run_id,
            state=row.run_state,
            status=ThreadStatus.model_validate_json(row.status),
            version=row.version,
            cause=row.cause,
            owner=row.owner,
        )
    except ValidationError as exc:
        raise CorruptRecord(thread, row.version or 0, "the run index entry") from exc
    vouched(listed, checked_head(thread, row, cache))
    if row.host != host_of(listed.owner):  # the owner index picks rows by it
        raise CorruptRecord(thread, row.version or 0, "the run index's host is not its owner's")
    return listed
