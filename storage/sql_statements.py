"""The SQL statements the write bodies run (``storage.sql_txn``, ``sql_plan``), built once.

Every statement has bound parameters, and a list travels as one parameter
(PostgreSQL: an array, ``= ANY``; SQLite: JSON, ``json_each``), so the statement text
never varies with the size of a group: SQLAlchemy's compiled cache and the drivers'
prepared statements serve every call. PostgreSQL's planned group (``PG_PLANNED``) is
written in asyncpg's own terms, which ``Database.write_statement`` sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    LargeBinary,
    String,
    and_,
    any_,
    bindparam,
    cast,
    false,
    func,
    literal_column,
    or_,
    select,
    true,
    union,
)
from sqlalchemy.sql.dml import Insert

from storage.schema import ROW_COLUMNS, commits, pruned_messages, threads
from storage.sql_engine import SQL_DIALECTS, upsert_ignore

_t, _c, _m = threads.c, commits.c, pruned_messages.c
_ANCHOR = (_t.pruned_through, _t.pruned_hash, _t.pruned_digest)
_IDS = ARRAY(String)


class _Many:
    """An executemany statement, compiled once per dialect and run with plain tuples.

    SQLAlchemy's per-row parameter processing costs more than the database's own
    work on the row; these rows hold only str, int and None, which every driver takes
    as they are. Driver errors still arrive as SQLAlchemy's (IntegrityError, …).
    """

    def __init__(self, stmt: Any, keys: Sequence[str]) -> None:
        self.stmt = stmt
        self.keys = list(keys)
        self._compiled: dict[tuple[str, str], tuple[str, list[str] | None]] = {}

    def __call__(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> int:
        """Run the statement once per row; returns the rows it changed in all."""
        sql, order = self._for(conn)
        if order is None:  # a named paramstyle: the driver takes the dicts
            result = conn.exec_driver_sql(sql, list(rows))
        else:
            result = conn.exec_driver_sql(sql, [tuple(row[k] for k in order) for row in rows])
        return int(result.rowcount)

    def _for(self, conn: Connection) -> tuple[str, list[str] | None]:
        dialect = conn.dialect
        key = (dialect.name, dialect.paramstyle)
        if key not in self._compiled:
            compiled = self.stmt.compile(dialect=dialect, column_keys=self.keys)
            order = compiled.positiontup
            self._compiled[key] = (str(compiled), None if order is None else list(order))
        return self._compiled[key]


_THREAD_COLUMNS = [c.name for c in ROW_COLUMNS if c.name != "thread_id"]
UPDATE_THREADS = _Many(
    threads.update().where(_t.thread_id == bindparam("b_thread")), [*_THREAD_COLUMNS, "b_thread"]
)
INSERT_COMMITS = _Many(commits.insert(), [c.name for c in commits.columns])
INSERT_THREADS = _Many(threads.insert(), [c.name for c in ROW_COLUMNS])
_at_head = commits.alias("at_head")
_HEAD_HASH = (
    select(_at_head.c.payload_hash)
    .where(_at_head.c.thread_id == _t.thread_id, _at_head.c.seq == _t.version)
    .scalar_subquery()
)
HEAD_KEPT = or_(
    _t.version == literal_column("0"),  # no bound parameter: ``_Many`` binds only its own
    and_(_t.pruned_through.is_not(None), _t.pruned_through == _t.version),  # never NULL
    func.coalesce(_t.head == _HEAD_HASH, false()),
)
"""The record at a thread row's version is stored, with the hash the row names as its
head (or pruned through it, or there is none yet). An append writes the next record
without reading the log; a head record deleted by hand would otherwise be written
past, leaving a gap every later read refuses, under a Run that went on as if whole.

A scalar subquery (one primary-key probe per row), not EXISTS: PostgreSQL may run an
EXISTS as a hashed subplan, a scan of the whole log per statement, which it chose for
the planned group's cached plan made while the tables were empty (its server CPU per
W1 Run went from 0.5 to 2.9 ms)."""
HEADLESS = select(_t.thread_id).where(
    _t.thread_id.in_(bindparam("ids", expanding=True)), ~HEAD_KEPT
)
"""Which of the thread rows ``ids`` have lost their head record (``HEAD_KEPT``)."""
LOGGED = select(_c.thread_id).where(_c.thread_id.in_(bindparam("ids", expanding=True))).distinct()
"""Which of the threads ``ids`` have records: for a thread whose row had to be made,
records no frontier vouches for (its row deleted by hand, say)."""
UPDATE_UNCHANGED = _Many(
    threads.update().where(
        _t.thread_id == bindparam("b_thread"),
        _t.version == bindparam("b_version"),
        _t.epoch == bindparam("b_epoch"),
        _t.owner.is_not_distinct_from(bindparam("b_owner")),
        HEAD_KEPT,
    ),
    [*_THREAD_COLUMNS, "b_thread", "b_version", "b_epoch", "b_owner"],
)
"""Update a thread row only if it is still at the version, epoch and owner a plan
started from, its head record kept (``HEAD_KEPT``)."""
LATEST_SEQ = select(func.max(_c.seq)).where(_c.thread_id == bindparam("thread"))
_tail = commits.alias("tail")
_LAST_SEQ = (
    select(func.max(_tail.c.seq))
    .where(_tail.c.thread_id == bindparam("thread"))
    .scalar_subquery()
    .label("last_seq")
)
"""The seq of the thread's last stored record, in the statement that reads its row: one
snapshot, in which an append has moved both or neither (``sql_reads.check_tail``)."""
LOAD = (
    select(_t.version, _t.frontier, _t.checksum, _t.head, _c.payload_hash, _LAST_SEQ, *_ANCHOR)
    .select_from(
        threads.outerjoin(commits, and_(_c.thread_id == _t.thread_id, _c.seq == _t.version))
    )
    .where(_t.thread_id == bindparam("thread"))
)
"""The thread row, with the stored hash of the record at its version (one statement)."""
HEAD = select(_t.version, _t.head, _LAST_SEQ, *_ANCHOR).where(_t.thread_id == bindparam("thread"))
ANCHOR = select(*_ANCHOR).where(_t.thread_id == bindparam("thread"))
DROP_UNUSED = threads.delete().where(
    _t.thread_id.in_(bindparam("ids", expanding=True)),
    _t.version == 0,
    _t.epoch == 0,
    _t.owner.is_(None),
)
"""Remove rows a group created to lock threads it then wrote nothing to (each request
refused): a row at version and epoch 0 and with no owner vouches for nothing."""
MOVE_ANCHOR = (
    threads.update()
    .where(
        _t.thread_id == bindparam("thread"),
        func.coalesce(_t.pruned_through, 0) == bindparam("after"),
        func.coalesce(_t.pruned_digest, "") == bindparam("digest_before"),
        _t.version >= bindparam("through"),
    )
    .values(
        pruned_through=bindparam("through"),
        pruned_hash=bindparam("hash"),
        pruned_digest=bindparam("digest"),
    )
)
"""A prune's compare-and-set: the anchor moves only if it is still where the prune read it."""
PRUNED_COUNT = select(func.count()).where(_m.thread_id == bindparam("thread"))
INSERT_PRUNED = pruned_messages.insert()
PRUNED_TEXTS = (
    select(_m.body)
    .where(_m.thread_id == bindparam("thread"), _m.idx < bindparam("count"))
    .order_by(_m.idx)
)
"""The first ``count`` messages of a thread's pruned history."""
HASH_AT = select(_c.payload_hash).where(
    _c.thread_id == bindparam("thread"), _c.seq == bindparam("seq")
)
DELETE_PRUNED = commits.delete().where(
    _c.thread_id == bindparam("thread"),
    _c.seq > bindparam("after"),
    _c.seq <= bindparam("through"),
)
READ = (
    select(_c.seq, _c.body, _c.payload_hash, _c.operation_id)
    .where(
        _c.thread_id == bindparam("thread"),
        _c.seq >= bindparam("first"),
        _c.seq <= bindparam("last"),
    )
    .order_by(_c.seq)
)
"""The records from ``first`` up to ``last``, the head read before (later ones may be a
concurrent append's)."""
UNVOUCHED = select(
    select(_t.version)
    .where(_t.thread_id == bindparam("thread"))
    .scalar_subquery()
    .label("version"),
    select(func.min(_c.seq))
    .where(_c.thread_id == bindparam("thread"))
    .scalar_subquery()
    .label("first_seq"),
)
"""The thread row's version (None: no row) and its first record's seq, in one snapshot:
asked only when a first look found no row, or one at version 0, which vouches for no
record (a row that has moved on since is the thread's first append, landed after the
look)."""
_LISTED = select(
    _t.thread_id,
    _t.run_id,
    _t.run_state,
    _t.status,
    _t.version,
    _t.cause,
    _t.owner,
    _t.host,
    _t.frontier,
    _t.checksum,
    _t.head,
    _c.payload_hash,
    *_ANCHOR,
).select_from(threads.outerjoin(commits, and_(_c.thread_id == _t.thread_id, _c.seq == _t.version)))
"""The index columns a listing filters on, and what vouches for them: the row's frontier
(as ``LOAD`` reads it), which each listed row is checked against."""  # fmt: skip
INDEX_ROW = _LISTED.add_columns(_t.epoch).where(_t.thread_id == bindparam("thread"))
"""A thread row's index columns for an audit, and its epoch: a copy of the frontier's
that planned writes compare (``UPDATE_UNCHANGED``), which the audit checks too."""
LIST_ALL = _LISTED.where(_t.run_state.is_not(None)).order_by(_t.thread_id)
LIST_STATE = _LISTED.where(_t.run_state == bindparam("state")).order_by(_t.thread_id)
LIST_HOST = _LISTED.where(_t.host == bindparam("host"), _t.run_state.is_not(None)).order_by(
    _t.thread_id
)
LIST_HOST_STATE = _LISTED.where(
    _t.host == bindparam("host"), _t.run_state == bindparam("state")
).order_by(_t.thread_id)

_ROWS_AFTER = select(_t.thread_id.label("thread_id")).where(_t.thread_id > bindparam("after"))
_LOGS_AFTER = select(_c.thread_id.label("thread_id")).where(_c.thread_id > bindparam("after"))
_ALL_AFTER = union(_ROWS_AFTER, _LOGS_AFTER).subquery()
THREAD_IDS = (
    select(_ALL_AFTER.c.thread_id).order_by(_ALL_AFTER.c.thread_id).limit(bindparam("limit"))
)
"""Every thread with a row or with records: a log whose row was deleted is listed too, so
that an audit of the whole store finds it (its load fails closed)."""
_RAW_AFTER = cast(bindparam("after", type_=LargeBinary), String)
_ALL_AFTER_RAW = union(
    select(_t.thread_id.label("thread_id")).where(_t.thread_id > _RAW_AFTER),
    select(_c.thread_id.label("thread_id")).where(_c.thread_id > _RAW_AFTER),
).subquery()
THREAD_IDS_SQLITE_RAW = (
    select(_ALL_AFTER_RAW.c.thread_id)
    .order_by(_ALL_AFTER_RAW.c.thread_id)
    .limit(bindparam("limit"))
)
"""``THREAD_IDS`` after a cursor that is not UTF-8 (SQLite lets a row's text hold any
bytes, which read back as lone surrogates): bound as its bytes, compared as text."""


def _pg_lock_statement() -> Any:
    """Lock thread rows ``ids`` in id order, each joined to its stored receipts of ``ops``.

    A LATERAL subquery probes every thread through the (thread_id, operation_id)
    index: a plain join lets the planner, with fresh or stale statistics, hash-join
    a sequential scan of the whole log (a LIMIT keeps it from flattening the LATERAL).
    """
    known = (
        select(_c.operation_id, _c.seq, _c.payload_hash)
        .where(_c.thread_id == _t.thread_id, _c.operation_id == any_(bindparam("ops", type_=_IDS)))
        .limit(bindparam("n_ops"))
        .lateral("known")
    )
    k = known.c
    return (
        select(
            _t.thread_id,
            _t.version,
            _t.frontier,
            _t.checksum,
            k.operation_id,
            k.seq,
            k.payload_hash,
        )
        .select_from(threads.outerjoin(known, true()))
        .where(_t.thread_id == any_(bindparam("ids", type_=_IDS)))
        .order_by(_t.thread_id)
        .with_for_update(of=threads)
    )


PG_LOCK = _pg_lock_statement()
# SQLite needs no row locks (BEGIN IMMEDIATE took the database's), and it looks
# receipts up by exact (thread, operation) pair, one index probe each: joining each
# thread to "any operation of the group" probes every thread for every operation,
# which grows with the square of the group (SQLite groups run to hundreds).
_IDS_JSON = func.json_each(bindparam("ids")).table_valued("value")
SQLITE_ROWS = select(_t.thread_id, _t.version, _t.frontier, _t.checksum).where(
    _t.thread_id.in_(select(_IDS_JSON.c.value))
)
_PAIRS = func.json_each(bindparam("pairs")).table_valued("value").alias("pairs")
SQLITE_RECEIPTS = select(_c.thread_id, _c.operation_id, _c.seq, _c.payload_hash).select_from(
    _PAIRS.join(
        commits,
        and_(
            _c.thread_id == func.json_extract(_PAIRS.c.value, "$[0]"),
            _c.operation_id == func.json_extract(_PAIRS.c.value, "$[1]"),
        ),
    )
)
INSERT_FRESH: dict[str, Insert] = {d: upsert_ignore(d, threads) for d in SQL_DIALECTS}


@dataclass(frozen=True)
class PgStatement:
    """A statement in asyncpg's own terms: its text with ``$n`` placeholders, and the
    names of the parameters in their order."""

    sql: str
    names: tuple[str, ...]

    def args(self, params: dict[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]


STALE_PLAN = "ratchet: stale plan"
"""What the planned statement fails with when a row moved (inside a 22P02 error)."""
LOCK_TIMEOUT_S = 3
"""How long a group's write transaction waits for a row lock another client holds
(PostgreSQL's ``lock_timeout``, SQLSTATE 55P03 past it). Groups lock their rows for
milliseconds; a lock held for seconds is a client stopped inside its transaction, and
waiting for it out to the statement timeout held up every group of the process behind
it, then failed them all as an outage (``GroupWriter._fail_queued``). Set for the
transaction only, so it holds behind PgBouncer and never outlives the group."""
PG_LOCK_TIMEOUT = f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_S}s'"
"""The read-first transaction's first statement (``sql_txn.transact``)."""


def _pg_planned_statement() -> PgStatement:
    """A planned group in one statement (PostgreSQL), its own transaction: every part
    travels as arrays, so the text never varies with the group. Rows are updated only
    where they are still at the plan's version, epoch and owner; data-modifying CTEs
    all run to completion, in one snapshot, and should fewer rows than planned have
    moved, the statement fails, so all of it rolls back.

    It fails by casting a text that is not a number (SQLSTATE 22P02, with
    ``STALE_PLAN`` in the message): a plain statement can abort itself that way,
    without a function in the schema. The text depends on the count, so PostgreSQL
    cannot fold it at plan time and evaluates it only in the branch that fails.
    Sent without BEGIN and COMMIT, the group costs one round trip instead of three.

    Having no BEGIN, it cannot ``SET LOCAL`` its ``LOCK_TIMEOUT_S``: each of its
    writes sets it itself (``set_config(..., true)``: for its own transaction) in an
    uncorrelated subquery of its condition, which PostgreSQL evaluates once, before
    the first row (an InitPlan under a one-time filter): whichever write runs first,
    no lock is waited for before the setting holds.
    """
    names: list[str] = []

    def param(name: str, sql_type: str) -> str:
        names.append(name)
        return f"${len(names)}::{sql_type}"

    def unnest(prefix: str, columns: Sequence[Any], extra: Sequence[Any] = ()) -> str:
        arrays = [param(f"{prefix}{c.name}", f"{_pg_type(c)}[]") for c in columns]
        arrays += [param(f"{prefix}b_{c.name}", f"{_pg_type(c)}[]") for c in extra]
        columns_as = [c.name for c in columns] + [f"b_{c.name}" for c in extra]
        return f"unnest({', '.join(arrays)}) AS v({', '.join(columns_as)})"

    bounded = f"(SELECT set_config('lock_timeout', '{LOCK_TIMEOUT_S}s', true)) IS NOT NULL"
    row_cols = list(ROW_COLUMNS)
    set_cols = ", ".join(f"{c} = v.{c}" for c in _THREAD_COLUMNS)
    thread_names = ", ".join(c.name for c in row_cols)
    commit_names = ", ".join(c.name for c in commits.columns)
    sql = (
        f"WITH moved AS (UPDATE {threads.name} AS t SET {set_cols}"
        f" FROM {unnest('u_', row_cols, (_t.version, _t.epoch, _t.owner))}"
        " WHERE t.thread_id = v.thread_id AND t.version = v.b_version"
        " AND t.epoch = v.b_epoch AND t.owner IS NOT DISTINCT FROM v.b_owner"
        " AND (t.version = 0 OR t.pruned_through IS NOT NULL AND t.pruned_through = t.version"
        f" OR (SELECT h.payload_hash FROM {commits.name} AS h"
        " WHERE h.thread_id = t.thread_id AND h.seq = t.version) = t.head)"  # HEAD_KEPT
        f" AND {bounded} RETURNING 1),"
        f" fresh AS (INSERT INTO {threads.name} ({thread_names})"
        f" SELECT {thread_names} FROM {unnest('f_', row_cols)} WHERE {bounded} RETURNING 1),"
        f" logged AS (INSERT INTO {commits.name} ({commit_names})"
        f" SELECT {commit_names} FROM {unnest('c_', list(commits.columns))}"
        f" WHERE {bounded} RETURNING 1)"
        f" SELECT CASE WHEN count(*) = {param('n_updates', 'BIGINT')} THEN count(*)"
        f" ELSE CAST('{STALE_PLAN}: ' || count(*) || ' rows as planned' AS BIGINT) END"
        " FROM moved"
    )
    return PgStatement(sql, tuple(names))


def _pg_type(column: Any) -> str:
    return "BIGINT" if isinstance(column.type, BigInteger) else "TEXT"


def pg_plan_refused(exc: BaseException) -> bool:
    """Whether the planned statement failed because the plan did not hold, not the
    server: a row moved, a row or commit already there, or a lock cycle PostgreSQL
    broke here (another group locked some of these rows in another order)."""
    state = getattr(exc, "sqlstate", None)
    if state == "22P02":
        return STALE_PLAN in str(exc)
    return state in ("23505", "40P01")


PG_PLANNED = _pg_planned_statement()
