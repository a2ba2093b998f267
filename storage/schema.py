"""Every SQL table of Ratchet, and its migration path (SQLite and PostgreSQL alike).

Migrations: a versioned migration table, not alembic. ``ratchet_schema_version``
holds one row per applied migration; ``MIGRATIONS`` is an ordered list of
(version, step) and ``migrate`` applies, in one transaction, every step above the
highest recorded version, and refuses a store whose recorded version is higher
than its own. A new schema change is a new entry at the end of the
list — never an edit of an old one. We chose this over alembic because the schema
is three tables, it must migrate on connect in an embedded SQLite file with no
tool installed, and the same few lines run on both dialects. On PostgreSQL an
advisory lock serialises concurrent migrators (several hosts connecting at once);
SQLite's BEGIN IMMEDIATE does the same there.

Tables:
- ``ratchet_threads``: one row per thread; ``frontier`` is the JSON of the current
  Frontier's head, without its messages (kept current by every append, so neither an
  append nor ``load`` replays the log, and the row does not grow with the history) and
  ``checksum`` its SHA-256 (a load verifies it); ``head`` is the hash of the latest
  commit; the other columns are copies for locking, listing and fencing queries, and
  ``host`` (the owner's host, ``runtime.ports.host_of``) with ``run_state`` is the
  owner index hosts and the Supervisor reconcile by. ``pruned_through`` and
  ``pruned_hash`` are the retention anchor (``storage.retention``): the seq and stored
  hash of the last record a prune removed (NULL: none was), and ``pruned_digest`` the
  ``history_digest`` of the pruned history (below). Only a prune writes them:
  the appends write the columns of ``ROW_COLUMNS`` alone (a planned append compares
  version, epoch and owner only, so a column it rewrote would undo a prune).
- ``ratchet_commits``: the append-only log; (thread_id, seq) is the optimistic
  version rule, (thread_id, operation_id) the idempotency rule; ``body`` is the
  commit's canonical JSON exactly as hashed, ``payload_hash`` its SHA-256, which the
  next commit's body names (the hash chain, ``runtime.integrity``).
  A record holds its messages: the log is where a thread's history is kept, once.
- ``ratchet_pruned_messages``: a pruned thread's *pruned history*, the messages of the
  records a prune removed (``body``: one message's JSON; ``idx`` from 0 in thread
  order), written by the prune that removes them.
- ``ratchet_checkpoints``: best-effort stream checkpoints, one per thread.
- ``ratchet_leases``: store leases (``CommitStore.hold_lease``): a Ray cluster's hold on
  its system name (``actors.system_lease``); ``expires_at`` in seconds since the epoch
  by the database's clock (``storage.sql_lease``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Double,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    inspect,
    select,
    text,
)

from runtime.errors import CorruptRecord
from runtime.integrity import frontier_checksum, history_digest, message_text
from runtime.ports import host_of
from storage.errors import NoStore, StoreTooNew
from storage.frontiers import decode_frontier

metadata = MetaData()

threads = Table(
    "ratchet_threads",
    metadata,
    Column("thread_id", String, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("owner", String, nullable=True),
    Column("frontier", Text, nullable=False),
    Column("run_id", String, nullable=True),
    Column("run_state", String, nullable=True, index=True),
    Column("cause", String, nullable=True),
    Column("status", Text, nullable=True),
    Column("updated", BigInteger, nullable=False),
    Column("head", String, nullable=True),
    Column("checksum", String, nullable=True),
    Column("host", String, nullable=True),
    Column("pruned_through", BigInteger, nullable=True),
    Column("pruned_hash", String, nullable=True),
    Column("pruned_digest", String, nullable=True),
    Index("ix_ratchet_threads_host", "host", "run_state"),
)
ANCHOR_COLUMNS = ("pruned_through", "pruned_hash", "pruned_digest")
ROW_COLUMNS = [c for c in threads.columns if c.name not in ANCHOR_COLUMNS]
"""The thread row's columns an append writes (all but the retention anchor)."""

commits = Table(
    "ratchet_commits",
    metadata,
    Column("thread_id", String, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("operation_id", String, nullable=False),
    Column("payload_hash", String, nullable=False),
    Column("label", String, nullable=False),
    Column("body", Text, nullable=False),
    PrimaryKeyConstraint("thread_id", "seq", name="pk_ratchet_commits"),
    UniqueConstraint("thread_id", "operation_id", name="uq_ratchet_commits_operation"),
)

pruned_messages = Table(
    "ratchet_pruned_messages",
    metadata,
    Column("thread_id", String, nullable=False),
    Column("idx", BigInteger, nullable=False),
    Column("body", Text, nullable=False),
    PrimaryKeyConstraint("thread_id", "idx", name="pk_ratchet_pruned_messages"),
)

checkpoints = Table(
    "ratchet_checkpoints",
    metadata,
    Column("thread_id", String, primary_key=True),
    Column("body", Text, nullable=False),
    Column("updated", BigInteger, nullable=False),
)

leases = Table(
    "ratchet_leases",
    metadata,
    Column("name", String, primary_key=True),
    Column("holder", String, nullable=False),
    Column("expires_at", Double, nullable=False),
)

schema_version = Table(
    "ratchet_schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied", BigInteger, nullable=False),
)

Step = Callable[[Connection], None]


def _v1_initial(conn: Connection) -> None:
    metadata.create_all(conn, checkfirst=True)


def _v2_thread_rows_leave_room(conn: Connection) -> None:
    """PostgreSQL: every append rewrites its thread's row; with room left on the row's
    page the new version goes there and no index changes (a HOT update). W1 measured
    ~8% less server CPU per Run. SQLite rewrites rows in place: nothing to do."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"ALTER TABLE {threads.name} SET (fillfactor = 50)"))


def _v3_lz4_for_long_text(conn: Connection) -> None:
    """PostgreSQL 14+ built with lz4: frontiers and commit bodies past ~2 kB are
    compressed with lz4 instead of pglz (new values; the rows already there stay as
    they are). pglz_compress was 12 % of the server's CPU under W1; with lz4 the
    server spends 0.22 to 0.26 instead of 0.27 to 0.30 ms per Run of engine_bench
    (interleaved, three each). Elsewhere: nothing to do."""
    if conn.dialect.name != "postgresql":
        return
    offered = conn.execute(
        text(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
    ).scalar()
    if offered:
        for table, column in ((threads.name, "frontier"), (commits.name, "body")):
            conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION lz4"))


_V4_FRONTIER = 2
"""The frontier schema migration 4 writes (with the messages: schema 6 leaves them out
of the frontiers written after it, and reads these as they are)."""


def _v4_chain_checksums_owner_index(conn: Connection) -> None:
    """The hash chain and the owner index (issue "No Run left behind").

    New columns ``head``, ``checksum`` and ``host`` with an index on (host, run_state);
    every stored frontier is rewritten at schema 2 with its head (the stored hash of
    the commit at its version) and its checksum. Commits stay as they were: schema 1
    records are verified against their own hash, and the chain starts with the first
    commit written after this migration (its ``prev`` is the head set here).
    """
    have = {c["name"] for c in inspect(conn).get_columns(threads.name)}
    for name in ("head", "checksum", "host"):
        if name not in have:
            conn.execute(text(f"ALTER TABLE {threads.name} ADD COLUMN {name} TEXT"))
    indexes = {i["name"] for i in inspect(conn).get_indexes(threads.name)}
    if "ix_ratchet_threads_host" not in indexes:
        conn.execute(
            text(f"CREATE INDEX ix_ratchet_threads_host ON {threads.name} (host, run_state)")
        )
    _c, _t = commits.c, threads.c
    rows = conn.execute(select(_t.thread_id, _t.version, _t.frontier, _t.owner)).all()
    for thread, version, stored, owner in rows:
        try:
            frontier = decode_frontier(thread, stored, version)
        except CorruptRecord:
            continue  # left without a checksum: a load of this thread alone fails closed
        if frontier.schema_version >= _V4_FRONTIER:
            continue  # written by this schema already
        head = conn.execute(
            select(_c.payload_hash).where(_c.thread_id == thread, _c.seq == version)
        ).scalar()
        upgraded = frontier.model_copy(
            update={"schema_version": _V4_FRONTIER, "head": head or ""}
        ).model_dump_json()
        conn.execute(
            threads.update()
            .where(_t.thread_id == thread)
            .values(
                frontier=upgraded,
                head=head or "",
                checksum=frontier_checksum(upgraded),
                host=host_of(owner),
            )
        )


def _v5_retention_anchor(conn: Connection) -> None:
    """Retention (``ratchet prune``): the anchor columns ``pruned_through`` and
    ``pruned_hash``, NULL in every existing row (nothing pruned). Adding a nullable
    column rewrites no row on either database."""
    have = {c["name"] for c in inspect(conn).get_columns(threads.name)}
    kinds = {"pruned_through": "BIGINT", "pruned_hash": "TEXT"}
    for name in kinds:
        if name not in have:
            conn.execute(text(f"ALTER TABLE {threads.name} ADD COLUMN {name} {kinds[name]}"))


def _v6_incremental_history(conn: Connection) -> None:
    """Incremental history: each message is kept once, in the record that committed it,
    and the frontier row holds the head alone (appends write schema 3 frontiers; the
    schema 2 frontiers already there read as they are, and lose their messages at their
    next append). Records removed by a prune took their messages with them, which only
    the frontier kept: for every pruned thread, they are copied from its frontier into
    ``ratchet_pruned_messages`` with their digest (``pruned_digest``), checked against
    the records kept. A thread whose frontier or records do not decode is left without
    (its load fails closed, as migration 4 leaves a row it cannot upgrade)."""
    pruned_messages.create(conn, checkfirst=True)
    have = {c["name"] for c in inspect(conn).get_columns(threads.name)}
    if "pruned_digest" not in have:
        conn.execute(text(f"ALTER TABLE {threads.name} ADD COLUMN pruned_digest TEXT"))
    _c, _t = commits.c, threads.c
    rows = conn.execute(
        select(_t.thread_id, _t.version, _t.frontier, _t.pruned_through).where(
            _t.pruned_through.is_not(None)
        )
    ).all()
    for thread, version, stored, through in rows:
        kept = conn.execute(
            select(_c.body).where(_c.thread_id == thread, _c.seq > through).order_by(_c.seq)
        ).scalars()
        try:
            frontier = decode_frontier(thread, stored, version)
            count = sum(len(json.loads(body).get("messages", ())) for body in kept)
        except (CorruptRecord, ValueError, AttributeError):
            continue
        before = len(frontier.messages) - count
        if before < 0 or frontier.message_count != len(frontier.messages):
            continue
        texts = [message_text(m) for m in frontier.messages[:before]]
        if texts:
            conn.execute(
                pruned_messages.insert(),
                [{"thread_id": thread, "idx": i, "body": t} for i, t in enumerate(texts)],
            )
        conn.execute(
            threads.update()
            .where(_t.thread_id == thread)
            .values(pruned_digest=history_digest("", texts))
        )


def _v7_leases(conn: Connection) -> None:
    """Store leases: which Ray cluster serves a system name (``actors.system_lease``)."""
    leases.create(conn, checkfirst=True)


MIGRATIONS: list[tuple[int, Step]] = [
    (1, _v1_initial),
    (2, _v2_thread_rows_leave_room),
    (3, _v3_lz4_for_long_text),
    (4, _v4_chain_checksums_owner_index),
    (5, _v5_retention_anchor),
    (6, _v6_incremental_history),
    (7, _v7_leases),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]
_PG_MIGRATION_LOCK = 0x52415443  # "RATC": any constant shared by every Ratchet migrator


def migrate(conn: Connection, where: str = "", create: bool = True) -> int:
    """Apply pending migrations in one transaction; returns the schema version.

    A store whose schema is newer than this code is refused (``StoreTooNew``), and
    nothing is written: by the rules of an older schema this code would corrupt it.
    ``create`` False: a database with no schema at all is ``NoStore`` and stays as it
    was (a reader mistyping a URL must not leave tables in whatever database it named)."""
    with conn.begin():
        if not create and not inspect(conn).has_table(schema_version.name):
            raise NoStore(where)
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})"))
        schema_version.create(conn, checkfirst=True)
        current = conn.execute(select(func.max(schema_version.c.version))).scalar() or 0
        if current > SCHEMA_VERSION:
            raise StoreTooNew(current, SCHEMA_VERSION)
        for version, step in MIGRATIONS:
            if version > current:
                step(conn)
                applied = time.time_ns() // 1000
                conn.execute(schema_version.insert().values(version=version, applied=applied))
    return SCHEMA_VERSION
