"""The SQL bodies, written once against a sync Connection.

``SqlCommitStore`` runs them through ``storage.sql_engine.Database`` (a greenlet over
asyncpg on PostgreSQL, a dedicated thread on SQLite). A write body owns its
transaction(s); statements (``storage.sql_statements``) compose inside them
(``group_txn`` is also what the SAVEPOINT fallback runs per request). The read bodies
are in ``storage.sql_reads``. PostgreSQL's planned group is no body: it is one statement in
asyncpg's own terms (``PG_PLANNED``), which ``Database.write_statement`` sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.errors import (
    CorruptRecord,
    RatchetError,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from runtime.ids import OperationId, ThreadId
from runtime.integrity import (
    history_digest,
)
from runtime.ports import host_of
from runtime.rules import admit, check_claim, receipt_of, with_claim
from storage.frontiers import FrontierCache
from storage.retention import Cut, stray_history
from storage.schema import ROW_COLUMNS, commits
from storage.sql_errors import translate
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
    INSERT_THREADS,
    LATEST_SEQ,
    LOGGED,
    MOVE_ANCHOR,
    PG_LOCK,
    PG_LOCK_TIMEOUT,
    PG_PLANNED,
    PRUNED_COUNT,
    SQLITE_RECEIPTS,
    SQLITE_ROWS,
    UPDATE_THREADS,
    UPDATE_UNCHANGED,
)
from storage.summary import listing

Outcome = Receipt | Frontier | StoreError | RatchetError
"""A request's outcome: a Receipt (append), the frontier as claimed (claim), or its
refusal."""


@dataclass
class AppendRequest:
    commit: ThreadCommit
    expected: int
    epoch: int
    claim: str | None = None
    """The owner that claims the thread (superseding ``epoch``) with this append."""

    @property
    def thread(self) -> ThreadId:
        return self.commit.thread_id


@dataclass
class ClaimRequest:
    thread: ThreadId
    owner: str
    supersedes: int
    """The owner epoch the claim replaces (compare-and-set)."""


Request = AppendRequest | ClaimRequest
Known = dict[tuple[str, str], Receipt]
"""Stored receipts by (thread, operation id)."""
Locked = tuple[dict[str, DbRow], Known]
Pairs = Sequence[tuple[str, str]]
"""(thread, operation id) of each append of a group."""


def thread_row(frontier: Frontier, cache: FrontierCache) -> dict[str, Any]:
    """The thread row's columns for a frontier (copies of it, for queries and locking)."""
    state, cause = listing(frontier)
    text, checksum = cache.encode(frontier.thread_id, frontier)
    return {
        "version": frontier.version,
        "epoch": frontier.epoch,
        "owner": frontier.owner,
        "frontier": text,
        "run_id": frontier.run_id,
        "run_state": state,
        "cause": cause,
        "status": frontier.status.model_dump_json(),
        "updated": time.time_ns() // 1000,
        "head": frontier.head,
        "checksum": checksum,
        "host": host_of(frontier.owner),
    }


class Group:
    """The pure half of one transaction: admits each request on its own, in order."""

    def __init__(
        self,
        rows: dict[str, DbRow],
        known: Known,
        cache: FrontierCache,
        frontiers: dict[str, Frontier] | None = None,
        deferred: list[tuple[Frontier, ThreadCommit]] | None = None,
        headless: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.rows = rows
        self.headless = headless
        """Threads whose row's head record is gone (``HEADLESS``), or whose row was made
        over records already stored (``LOGGED``): no append goes past them."""
        self.known = known
        self.cache = cache
        self.frontiers: dict[str, Frontier] = frontiers or {}
        self.deferred = deferred
        """Provisional admissions' (frontier, commit), for the trace checks (``admit``)."""
        self.touched: set[str] = set()
        self.new_commits: list[dict[str, Any]] = []

    def admit(self, request: Request) -> Outcome:
        try:
            if isinstance(request, ClaimRequest):
                return self._claim(request)
            return self._append(request)
        except RatchetError as exc:  # this request is refused; its neighbours go on
            return exc

    def _claim(self, request: ClaimRequest) -> Frontier:
        thread = request.thread
        frontier = self.frontier(thread)
        check_claim(frontier, request.supersedes)
        frontier = with_claim(frontier, request.owner)
        self.frontiers[thread] = frontier
        self.touched.add(thread)
        return frontier

    def _append(self, request: AppendRequest) -> Receipt:
        commit = request.commit
        thread, operation = commit.thread_id, commit.operation_id
        if thread in self.headless:
            version = self.rows[thread].version
            if not version:
                raise CorruptRecord(thread, 1, "the log has records no frontier vouches for")
            raise CorruptRecord(thread, version, "the record at the frontier's head is gone")
        known = self.known.get((thread, operation))
        outcome = admit(
            self.frontier(thread),
            commit,
            request.expected,
            request.epoch,
            known,
            request.claim,
            self.deferred,
        )
        if isinstance(outcome, Receipt):
            return outcome
        frontier = outcome
        receipt = receipt_of(commit, frontier.version)
        self.known[(thread, operation)] = receipt
        self.frontiers[thread] = frontier
        self.touched.add(thread)
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
            self.frontiers[thread] = self.cache.decode(
                thread, row.frontier, row.version, row.checksum
            )
        return self.frontiers[thread]

    def changed(self) -> list[dict[str, Any]]:
        """The new thread rows, in id order (encoding caches each new frontier)."""
        return [
            {"b_thread": t, **thread_row(self.frontiers[t], self.cache)}
            for t in sorted(self.touched)
        ]


# ---- planned groups ----------------------------------------------------------------------


@dataclass
class Plan:
    """A group admitted ahead of its transaction, against the frontiers this process
    last wrote or read (``FrontierCache``), so the transaction only checks and writes.

    It holds only if every thread row is still at the version, epoch and owner of the
    frontier the plan started from (a thread the cache does not know must have no row
    yet); the transaction checks that with the writes themselves and otherwise falls
    back to ``group_txn``. Those three columns determine the whole frontier: every
    append moves the version, every claim the epoch and owner, and the frontier at a
    version is the fold of the log up to it, which never changes. (A cached frontier
    whose own transaction rolled back is a version or an epoch ahead of its row; the
    retry that follows goes the read-first way and caches the row.) Comparing the
    frontier text itself cost PostgreSQL a decompression of the stored text per row,
    and with stale statistics, a hash of every row's.
    """

    outcomes: list[Outcome]
    fresh: list[dict[str, Any]]
    """Rows of threads with no row yet."""
    updates: list[dict[str, Any]]
    """New rows of known threads, each with the version, epoch and owner of the row it
    replaces (``b_version``, ``b_epoch``, ``b_owner``)."""
    new_commits: list[dict[str, Any]]
    admitted: list[tuple[Frontier, ThreadCommit]]
    """Each admitted commit with its frontier: trace-checked once the plan held (a
    plan knows no stored receipts, so a commit it admits may still be refused)."""
    held: bool = False
    """Whether the plan's own transaction committed (else ``transact`` ran the group)."""


class Stale(Exception):
    """A planned group met a row that changed since the plan read it."""


class Abandoned(StoreUnavailable):
    """A caller of the group gave up before its transaction committed: rolled back.

    The transaction may wait long past its callers' deadline (SQLite's busy wait on a
    lock another process holds, 30 s; a PostgreSQL row lock): committed then, a commit
    its caller had been told was not made (``StoreUnavailable``) landed anyway, and
    a Run whose caller had given up was left running with nothing to drive it. The
    writer commits the group again without the requests given up on."""


Wanted = Callable[[], bool]
"""Whether every caller of a group still waits for it (asked just before it commits)."""


def _still(wanted: Wanted | None) -> None:
    if wanted is not None and not wanted():
        raise Abandoned("a caller gave up before its group committed")


def plan_group(group: Sequence[Request], cache: FrontierCache) -> Plan | None:
    """Admit the group against cached frontiers; None where only the database can tell
    (a request refused: a retried append's receipt, a fenced writer, …)."""
    base: dict[str, Frontier | None] = {r.thread: cache.known(r.thread) for r in group}
    frontiers = {t: Frontier(thread_id=ThreadId(t)) if f is None else f for t, f in base.items()}
    admitted: list[tuple[Frontier, ThreadCommit]] = []
    pure = Group({}, {}, cache, frontiers, admitted)
    outcomes = [pure.admit(request) for request in group]
    if any(isinstance(o, RatchetError) for o in outcomes):
        return None
    fresh, updates = [], []
    for row in pure.changed():
        old = base[row["b_thread"]]
        if old is None:
            fresh.append({"thread_id": row.pop("b_thread"), **row})
        else:
            updates.append(
                {**row, "b_version": old.version, "b_epoch": old.epoch, "b_owner": old.owner}
            )
    return Plan(outcomes, fresh, updates, pure.new_commits, admitted)


def planned_txn(conn: Connection, plan: Plan, wanted: Wanted | None = None) -> list[Outcome]:
    """Write a planned group in one transaction; Stale (rolled back) if any row moved.

    A row that exists where the plan expected none, or a commit already stored, is the
    database's IntegrityError (also rolled back): either way ``transact`` runs next.
    PostgreSQL writes its plans with ``PG_PLANNED`` instead, in one statement.
    """
    with conn.begin():
        if plan.fresh:
            INSERT_THREADS(conn, plan.fresh)
        if plan.updates and UPDATE_UNCHANGED(conn, plan.updates) != len(plan.updates):
            raise Stale
        if plan.new_commits:
            INSERT_COMMITS(conn, plan.new_commits)
        _still(wanted)
    plan.held = True
    return plan.outcomes


def pg_planned_args(plan: Plan) -> list[Any]:
    """``PG_PLANNED``'s arguments for a plan."""
    # thread rows in id order: the UPDATE then locks them as the read-first path does
    updates = sorted(plan.updates, key=lambda r: r["b_thread"])
    params: dict[str, Any] = {"n_updates": len(updates)}
    for c in ROW_COLUMNS:
        key = "b_thread" if c.name == "thread_id" else c.name
        params[f"u_{c.name}"] = [r[key] for r in updates]
        params[f"f_{c.name}"] = [r[c.name] for r in plan.fresh]
    for name in ("b_version", "b_epoch", "b_owner"):
        params[f"u_{name}"] = [r[name] for r in updates]
    for c in commits.columns:
        params[f"c_{c.name}"] = [r[c.name] for r in plan.new_commits]
    return PG_PLANNED.args(params)


# ---- write bodies -----------------------------------------------------------------------


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
            _still(wanted)
            return outcomes
    except IntegrityError:
        # The database refused a write the pure rules admitted: find the culprit.
        with conn.begin():
            _bounded_lock_waits(conn)
            outcomes = [_isolated(conn, request, where, cache) for request in group]
            _still(wanted)
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
