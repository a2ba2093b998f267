"""The SQL write bodies, written once against a sync Connection.

``SqlCommitStore`` runs them through ``storage.sql_engine.Database`` (a greenlet over
asyncpg on PostgreSQL, a dedicated thread on SQLite). A write body owns its
transaction(s); statements (``storage.sql_statements``) compose inside them
(``group_txn`` is also what the SAVEPOINT fallback runs per request). The read bodies
are in ``storage.sql_reads``; a group's pure admission in ``storage.sql_group``; the
planned write a group tries first in ``storage.sql_plan``. PostgreSQL's planned group
is no body: it is one statement in asyncpg's own terms (``PG_PLANNED``), which
``Database.write_statement`` sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from runtime.commit import Frontier, Receipt
from runtime.errors import CorruptRecord, VersionConflict
from runtime.ids import OperationId, ThreadId
from runtime.integrity import history_digest
from storage.frontiers import FrontierCache
from storage.retention import Cut, stray_history
from storage.sql_errors import translate
from storage.sql_group import (
    AppendRequest,
    ClaimRequest,
    Group,
    Known,
    Outcome,
    Request,
    Wanted,
    still_wanted,
    thread_row,
)
from storage.sql_plan import Plan, Stale, planned_txn
from storage.sql_reads import DbRow
from storage.sql_statements import (
    ANCHOR,
    DELETE_PRUNED,
    DROP_UNUSED,
    HASH_AT,
    HEAD,
    HEADLESS,
    INSERT_COMMITS,
    INSERT_FRESH,
    INSERT_PRUNED,
    LATEST_SEQ,
    LOGGED,
    MOVE_ANCHOR,
    PG_LOCK,
    PG_LOCK_TIMEOUT,
    PRUNED_COUNT,
    SQLITE_RECEIPTS,
    SQLITE_ROWS,
    UPDATE_THREADS,
)

Locked = tuple[dict[str, DbRow], Known]
Pairs = Sequence[tuple[str, str]]
"""(thread, operation id) of each append of a group."""


def transact(
    conn: Connection,
    group: Sequence[Request],
    where: str,
    cache: FrontierCache,
    plan: Plan | None = None,
    wanted: Wanted | None = None,
) -> list[Outcome]:
    """One transaction for the whole group; on a database refusal, one SAVEPOINT each.

    With a ``plan`` (SQLite) its transaction is tried first, and this one only if it
    fails. On PostgreSQL a row lock held past ``LOCK_TIMEOUT_S`` fails the transaction
    (``_bounded_lock_waits``). ``wanted`` is asked just before each commit: Abandoned
    (rolled back) if a caller gave up meanwhile.
    """
    if plan is not None:
        try:
            return planned_txn(conn, plan, wanted)
        except (Stale, IntegrityError):
            pass
    try:
        with conn.begin():
            _bounded_lock_waits(conn)
            outcomes = group_txn(conn, group, cache)
            still_wanted(wanted)
            return outcomes
    except IntegrityError:
        # The database refused a write the pure rules admitted: find the culprit.
        with conn.begin():
            _bounded_lock_waits(conn)
            outcomes = [_isolated(conn, request, where, cache) for request in group]
            still_wanted(wanted)
            return outcomes


def _bounded_lock_waits(conn: Connection) -> None:
    """PostgreSQL: the transaction's lock waits end at ``LOCK_TIMEOUT_S`` (55P03)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(PG_LOCK_TIMEOUT)


def _isolated(conn: Connection, request: Request, where: str, cache: FrontierCache) -> Outcome:
    try:
        with conn.begin_nested():
            return group_txn(conn, [request], cache)[0]
    except IntegrityError as exc:
        if isinstance(request, ClaimRequest):
            return translate(exc, where, thread=request.thread)
        latest = conn.execute(LATEST_SEQ, {"thread": request.thread}).scalar() or 0
        refused = translate(
            exc,
            where,
            thread=request.thread,
            operation=request.commit.operation_id,
            expected=request.expected,
            actual=latest,
        )
        if isinstance(refused, VersionConflict) and latest > request.expected == _version(
            conn, request.thread
        ):
            # the row is still at the version the append was admitted at, and a record
            # lies past it: no thread row vouches for that record (put there by hand),
            # and every append would meet it, for ever (a drive retrying would spin)
            return CorruptRecord(
                request.thread, request.expected + 1, "the log runs past the frontier's head"
            )
        return refused


def _version(conn: Connection, thread: ThreadId) -> int:
    row = conn.execute(HEAD, {"thread": thread}).first()
    return -1 if row is None else int(row.version)


def group_txn(conn: Connection, group: Sequence[Request], cache: FrontierCache) -> list[Outcome]:
    """Lock, admit each request on its own, then write what was admitted."""
    pairs = [(r.thread, r.commit.operation_id) for r in group if isinstance(r, AppendRequest)]
    rows, known, created = lock(conn, {r.thread for r in group}, pairs, cache)
    appended = sorted({thread for thread, _ in pairs if thread in rows})
    headless = set(conn.execute(HEADLESS, {"ids": appended}).scalars()) if appended else set()
    if created:  # a row made here over records already stored: none of them vouched for
        headless |= set(conn.execute(LOGGED, {"ids": created}).scalars())
    pure = Group(rows, known, cache, headless=headless)
    outcomes = [pure.admit(request) for request in group]
    if pure.new_commits:
        INSERT_COMMITS(conn, pure.new_commits)
    if pure.touched:
        # Encoding caches each new frontier under the text written here; should this
        # transaction roll back, the row keeps its old text and the entry never matches.
        UPDATE_THREADS(conn, pure.changed())
    unused = [t for t in created if t not in pure.touched]
    if unused:  # a refused request writes nothing, not even the row it was locked by
        conn.execute(DROP_UNUSED, {"ids": unused})
    return outcomes


def lock(
    conn: Connection, ids: Iterable[str], pairs: Pairs, cache: FrontierCache
) -> tuple[dict[str, DbRow], Known, list[str]]:
    """Lock the thread rows in id order, creating new ones (after: a deadlock between
    two groups making the same threads is possible, and tried again by the store).

    Returns the rows, the receipts already stored under the ``pairs``, and the threads
    whose rows had to be created (their rows go again if nothing is written to them).
    A row found missing that another transaction made meanwhile (on PostgreSQL: its
    first commit landed between this lock and this insert) is no row of this one's: its
    records are vouched for by it, and the requests on it meet a version they were not
    admitted at (a typed loss, not a corrupt thread).
    """
    wanted = sorted(ids)
    rows, known = _lock_existing(conn, wanted, pairs)
    missing = [t for t in wanted if t not in rows]
    if missing:
        fresh = [{"thread_id": t, **thread_row(Frontier(thread_id=t), cache)} for t in missing]
        conn.execute(INSERT_FRESH[conn.dialect.name], fresh)
        # Read back what is there now: on PostgreSQL another transaction may have
        # created (and may be writing) the row first; FOR UPDATE waits for it.
        more_rows, more_known = _lock_existing(conn, missing, pairs)
        rows.update(more_rows)
        known.update(more_known)
    made = [t for t in missing if t in rows and rows[t].version == 0]
    return rows, known, made


def _lock_existing(conn: Connection, ids: list[str], pairs: Pairs) -> Locked:
    """The rows of ``ids`` that exist, and the receipts of ``pairs`` on those threads."""
    if conn.dialect.name == "postgresql":
        ops = sorted({op for _, op in pairs})
        params = {"ids": ids, "ops": ops, "n_ops": max(1, len(ops))}
        result = list(conn.execute(PG_LOCK, params))  # a row per thread and receipt found
        rows = {r.thread_id: r for r in result}
        return rows, _receipts(r for r in result if r.operation_id is not None)
    rows = {r.thread_id: r for r in conn.execute(SQLITE_ROWS, {"ids": json.dumps(ids)})}
    probe = [pair for pair in pairs if pair[0] in rows]
    if not probe:
        return rows, {}
    return rows, _receipts(conn.execute(SQLITE_RECEIPTS, {"pairs": json.dumps(probe)}))


def _receipts(found: Iterable[DbRow]) -> Known:
    return {
        (r.thread_id, r.operation_id): Receipt(
            thread_id=r.thread_id,
            seq=r.seq,
            operation_id=OperationId(r.operation_id),
            payload_hash=r.payload_hash,
        )
        for r in found
    }


# ---- retention ---------------------------------------------------------------------------


class _Moved(Exception):
    """The anchor moved since the prune read the log: roll its cut back."""


def prune_txn(conn: Connection, cut: Cut) -> bool:
    """Remove the records of ``cut``, add their messages to the pruned history and move
    the anchor (with the history's digest), in one transaction; False (and nothing
    removed) if the anchor is no longer where the prune read it. The anchor's row is
    updated last, so appends to the thread wait for its lock only while the transaction
    commits (PostgreSQL); SQLite's one writer waits for the whole of it. Two prunes at
    once add the same places of the history: the second fails on its key and reads again."""
    params = {"thread": cut.thread, "after": cut.after, "through": cut.through}
    try:
        with conn.begin():
            # gone (another prune) or changed (tampered with): the prune reads again,
            # and that read verifies the log
            if conn.execute(HASH_AT, {"thread": cut.thread, "seq": cut.through}).scalar() != (
                cut.hash
            ):
                raise _Moved
            anchor = conn.execute(ANCHOR, {"thread": cut.thread}).first()
            if anchor is None or (anchor.pruned_through or 0) != cut.after:
                raise _Moved
            before = anchor.pruned_digest or ""
            start = conn.execute(PRUNED_COUNT, {"thread": cut.thread}).scalar() or 0
            if start != cut.history:
                # rows a prune committed since the anchor was read came with its anchor
                # (each statement reads what is committed by then: PostgreSQL); an
                # anchor still as read means these rows were put there by hand
                now = conn.execute(ANCHOR, {"thread": cut.thread}).first()
                if now is None or (now.pruned_through or 0) != cut.after:
                    raise _Moved
                raise CorruptRecord(cut.thread, cut.after, stray_history(start, cut))
            if cut.messages:
                texts = enumerate(cut.messages, start)
                rows = [{"thread_id": cut.thread, "idx": i, "body": t} for i, t in texts]
                conn.execute(INSERT_PRUNED, rows)
            conn.execute(DELETE_PRUNED, params)
            digest = history_digest(before, cut.messages)
            moved = {**params, "hash": cut.hash, "digest_before": before, "digest": digest}
            if conn.execute(MOVE_ANCHOR, moved).rowcount != 1:
                raise _Moved
    except (_Moved, IntegrityError):
        return False
    return True
