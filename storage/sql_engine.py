"""Engines for SQLite and PostgreSQL, and the one translation of driver errors.

Dialect differences are kept here as small overrides: URL mapping, SQLite's
pragmas and BEGIN IMMEDIATE, how a transaction body runs (``Writer``), the upsert
construct. Error translation::

    IntegrityError on (thread_id, operation_id)     -> DuplicateOperation
    IntegrityError on (thread_id, seq) or others    -> VersionConflict
    connection refused / lost / reset, timeouts,
    server shutting down or starting, too many
    connections, deadlock, SQLite busy or locked    -> StoreUnavailable
    any other driver error                          -> StoreError

Nothing above storage/ ever sees a sqlalchemy, asyncpg or sqlite3 exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql.dml import Insert

from runtime.errors import DuplicateOperation, StoreError, StoreUnavailable, VersionConflict
from storage.url import redact, scheme_of

# SQLSTATE classes that mean "try again later", never "your data is wrong":
# 08 connection exception, 53 insufficient resources, 57 operator intervention
# (admin shutdown, cannot connect now), 40 transaction rollback (deadlock, serialization).
_TRANSIENT_SQLSTATE = ("08", "53", "57", "40")
_TRANSIENT_WORDS = ("database is locked", "database is busy", "connection", "closed")
_SYNCHRONOUS = ("off", "normal", "full", "extra")


OUR_OPTIONS = ("synchronous", "pool_size")
"""Query options of a store URL that are ours, not the driver's."""
DEFAULT_PG_POOL = 10
"""Connections per process (plus as many overflow). Every host of a cluster opens its
own pool, and PostgreSQL allows 100 connections by default: keep each pool modest."""


def sqlalchemy_url(url: str) -> tuple[URL, dict[str, str]]:
    """Map our URL onto an async driver URL; returns it and our own options from the query."""
    scheme = scheme_of(url)
    parsed = make_url(url.replace("postgres://", "postgresql://", 1))
    ours = {k: str(v) for k, v in parsed.query.items() if k in OUR_OPTIONS}
    parsed = parsed.difference_update_query(list(ours))
    if scheme == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError("a SQLite store needs a file path; use memory:// for one in memory")
        return parsed.set(drivername="sqlite+aiosqlite"), ours
    if scheme in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg"), ours
    raise ValueError(f"not a SQL store URL: {redact(url)}")


def create_engine(url: str) -> AsyncEngine:
    """The async engine every read uses (and, on PostgreSQL, every write)."""
    sa_url, ours = sqlalchemy_url(url)
    if sa_url.get_backend_name() == "sqlite":
        engine = create_async_engine(sa_url, connect_args={"timeout": 30})
        _configure_sqlite(engine.sync_engine, _synchronous(ours), immediate=False)
        return engine
    pool = _pool_size(ours)
    return create_async_engine(
        sa_url,
        # Group commit keeps at most a few write transactions in flight per process,
        # so a modest pool serves many Runs (``?pool_size=N`` on the URL changes it).
        pool_size=pool,
        max_overflow=pool,
        # Reconnection after an outage costs a refused connect, not a hang.
        connect_args={"timeout": 5, "command_timeout": 30},
    )


def _pool_size(ours: dict[str, str]) -> int:
    raw = ours.get("pool_size", str(DEFAULT_PG_POOL))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"pool_size must be a positive integer, not {raw!r}")
    return int(raw)


def _synchronous(ours: dict[str, str]) -> str:
    synchronous = ours.get("synchronous", "full").lower()
    if synchronous not in _SYNCHRONOUS:
        raise ValueError(f"sqlite synchronous must be one of {_SYNCHRONOUS}")
    return synchronous


def _configure_sqlite(engine: Engine, synchronous: str, immediate: bool) -> None:
    if engine.url.database:
        Path(engine.url.database).parent.mkdir(parents=True, exist_ok=True)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below), so the driver must not.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # The writer takes the lock at BEGIN, so its reads and writes see one snapshot
        # and it never fails to upgrade a read lock; readers stay deferred (WAL).
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


T = TypeVar("T")


class Writer:
    """Runs a synchronous transaction body ``fn(connection, *args)`` for the store.

    The body is written once, against a sync Connection. On PostgreSQL it runs in
    SQLAlchemy's greenlet over the async engine (each statement awaits asyncpg); on
    SQLite it runs on one dedicated thread with the stdlib driver — the single
    writer SQLite wants, and one thread hop per transaction instead of several per
    statement.
    """

    def __init__(self, url: str, engine: AsyncEngine, concurrency: int = 4) -> None:
        self.engine = engine
        self.concurrency = concurrency
        """Group transactions in flight at once (SQLite: 1, its one writer thread)."""
        self.max_group = 16
        """Most appends per transaction. On PostgreSQL several smaller groups in flight
        beat one large one (measured: ~7k vs ~4k commits/s with 50 writers): the
        server works on one while the client prepares the next."""
        self._sqlite: Engine | None = None
        self._thread: ThreadPoolExecutor | None = None
        sa_url, ours = sqlalchemy_url(url)
        if sa_url.get_backend_name() == "sqlite":
            sync_url = sa_url.set(drivername="sqlite+pysqlite")
            self._sqlite = sa_create_engine(sync_url, connect_args={"timeout": 30})
            _configure_sqlite(self._sqlite, _synchronous(ours), immediate=True)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ratchet-sqlite-writer")
            self.concurrency = 1
            self.max_group = 256

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._sqlite is None:
            async with self.engine.connect() as conn:
                return await conn.run_sync(fn, *args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._on_thread, fn, args)

    def _on_thread(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        assert self._sqlite is not None
        with self._sqlite.connect() as conn:
            return fn(conn, *args)

    def close(self) -> None:
        """Let a transaction in flight finish, then release the thread and its engine."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self._sqlite is not None:
            self._sqlite.dispose()


def upsert_ignore(dialect: str, table: Any) -> Insert:
    """INSERT ... ON CONFLICT DO NOTHING, in the engine's dialect."""
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    return sqlite.insert(table).on_conflict_do_nothing()


def upsert_replace(dialect: str, table: Any, key: str, columns: list[str]) -> Insert:
    """INSERT ... ON CONFLICT (key) DO UPDATE SET columns = excluded.columns."""
    module: Any = postgresql if dialect == "postgresql" else sqlite
    stmt = module.insert(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=[key], set_={c: stmt.excluded[c] for c in columns}
    )
    return stmt  # type: ignore[no-any-return]


def translate(
    exc: BaseException,
    where: str,
    *,
    thread: str = "?",
    operation: str = "?",
    expected: int = -1,
    actual: int = -1,
) -> StoreError:
    """The one translation of a driver exception into Ratchet's error vocabulary."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, IntegrityError):
        if "operation" in str(exc.orig):
            return DuplicateOperation(operation)
        return VersionConflict(thread, expected, actual)
    if _transient(exc):
        return StoreUnavailable(f"store {where} unavailable: {_describe(exc)}")
    return StoreError(f"store {where} failed: {_describe(exc)}")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        state = _sqlstate(exc)
        if state is not None:
            return state.startswith(_TRANSIENT_SQLSTATE)
        return any(word in str(exc.orig).lower() for word in _TRANSIENT_WORDS)
    if isinstance(exc, SQLAlchemyError):
        return False
    cause = exc.__cause__ or exc.__context__
    return cause is not None and _transient(cause)


def _sqlstate(exc: DBAPIError) -> str | None:
    for candidate in (exc.orig, getattr(exc.orig, "__cause__", None)):
        state = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if isinstance(state, str):
            return state
    return None


def _describe(exc: BaseException) -> str:
    """Type and first line of the driver's message (never a URL: drivers do not echo it)."""
    inner = getattr(exc, "orig", None) or exc
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return f"{type(inner).__name__}: {first}"[:300]
