"""Engines for SQLite and PostgreSQL, and where transaction bodies run.

Dialect differences are kept here as small overrides: URL mapping, SQLite's
pragmas and BEGIN IMMEDIATE (``storage.sql_sqlite``), where a transaction body runs
(``Database``), the upsert construct. Driver errors are translated in ``storage.sql_errors``.

Nothing above storage/ ever sees a sqlalchemy, asyncpg or sqlite3 exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.sql.dml import Insert

from storage.sql_sqlite import DedicatedThread, configure_sqlite, sqlite_engine, synchronous_of
from storage.url import redact, scheme_of

if TYPE_CHECKING:  # the asyncio extension costs a process ~0.2 s to import: SQLite hosts
    from sqlalchemy.ext.asyncio import (  # never load it (see Database.engine)
        AsyncConnection,
        AsyncEngine,
    )

SQL_DIALECTS = ("sqlite", "postgresql")
OUR_OPTIONS = ("synchronous", "pool_size", "key_joins")
"""Query options of a store URL that are ours, not the driver's."""
DEFAULT_PG_POOL = 10
"""Connections per process (plus as many overflow). Every host of a cluster opens its
own pool, and PostgreSQL allows 100 connections by default: keep each pool modest."""
DEFAULT_TIMEOUT_S = 60.0
"""How long a store call may take before its caller hears StoreUnavailable; on
PostgreSQL also the driver's timeout for a statement (its ``command_timeout``), so that
one setting governs: a statement allowed less than the call could never succeed."""
CONNECT_TIMEOUT_S = 5.0
"""How long opening a PostgreSQL connection may take (the store's timeout if that is
shorter): reconnecting during an outage costs a refused connect, not a hang."""
CLOSE_S = 3.0
"""How long closing a PostgreSQL store waits for its connections to be seen off. asyncpg
closes a connection by telling the server and waiting for its goodbye, up to the
command timeout, and the pool closes them one after another: on a hung server
(stopped, partitioned) a pool of ten took five minutes. Past this, the connections
still open are cut without a word (``Database._cut``)."""


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
        return _ssl_mode(parsed).set(drivername="postgresql+asyncpg"), ours
    raise ValueError(f"not a SQL store URL: {redact(url)}")


SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""libpq's ``sslmode`` words, which asyncpg's ``ssl`` takes too."""


def _ssl_mode(parsed: URL) -> URL:
    """``?sslmode=`` (libpq's, in every PostgreSQL URL) as asyncpg's ``?ssl=``, either
    checked here: asyncpg knows no ``sslmode`` (a TypeError at the first connection) and
    fails an unknown ``ssl`` only as it connects."""
    # asyncpg reads "verify_full" as "verify-full" too
    given = {
        str(parsed.query[k]).lower().replace("_", "-")
        for k in ("ssl", "sslmode")
        if k in parsed.query
    }
    if not given:
        return parsed
    mode = given.pop()
    if given or mode not in SSL_MODES:
        raise ValueError(f"ssl/sslmode must be one of {', '.join(SSL_MODES)}, and only one")
    return parsed.difference_update_query(["sslmode"]).update_query_dict({"ssl": mode})


def check_sql_url(url: str) -> None:
    """What an engine reads of the URL, read now, before anything connects (ValueError or
    SQLAlchemy's ArgumentError): its parts, our options and the driver's ``ssl``."""
    sa_url, ours = sqlalchemy_url(url)
    if sa_url.get_backend_name() != "sqlite":
        _pool_size(ours)
        _key_joins(ours)
        return
    synchronous_of(ours)
    sync_url = sa_url.set(drivername="sqlite")  # what the dialect refuses as it connects
    with warnings.catch_warnings():  # an unknown option: said once, as the engine opens
        warnings.simplefilter("ignore")
        sync_url.get_dialect()().create_connect_args(sync_url)  # ("sqlite://host/x.db")


def create_engine(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> AsyncEngine:
    """The async engine: every statement on PostgreSQL; on SQLite, only for tests and tools.
    ``timeout_s`` bounds each PostgreSQL statement (``pg_connect_args``)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    sa_url, ours = sqlalchemy_url(url)
    if sa_url.get_backend_name() == "sqlite":
        engine = create_async_engine(sa_url, connect_args={"timeout": 30})
        configure_sqlite(engine.sync_engine, synchronous_of(ours), begin="BEGIN")
        return engine
    pool = _pool_size(ours)
    return create_async_engine(
        sa_url,
        # Group commit keeps at most a few write transactions in flight per process,
        # so a modest pool serves many Runs (``?pool_size=N`` on the URL changes it).
        pool_size=pool,
        max_overflow=pool,
        connect_args=pg_connect_args(ours, timeout_s),
    )


def pg_connect_args(ours: dict[str, str], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """asyncpg's connect arguments for our options of a PostgreSQL store URL, its
    statements bounded by the store's ``timeout_s``."""
    args: dict[str, Any] = {
        "timeout": min(CONNECT_TIMEOUT_S, timeout_s),
        "command_timeout": timeout_s,
    }
    if _key_joins(ours):
        args["server_settings"] = KEY_LOOKUPS_ONLY
    return args


KEY_LOOKUPS_ONLY = {"enable_hashjoin": "off", "enable_mergejoin": "off"}
"""Session settings of the store's PostgreSQL connections. Every statement of ours
finds its rows by key, a few at a time, so a nested loop over an index is always the
right join; but the thread table grows by a row per new thread and its statistics
lag behind, and with them PostgreSQL hashed a sequential scan of the whole table for
each planned group's UPDATE (``sql_plan``). W1: server CPU per Run 1.4 -> 1.0 ms.
They travel as startup parameters, which PgBouncer refuses unless told to ignore
them: ``?key_joins=off`` on the store URL leaves the server's settings alone (and the
plan mode of held write connections: ``Database._generic``)."""


def _key_joins(ours: dict[str, str]) -> bool:
    raw = ours.get("key_joins", "on").lower()
    if raw not in ("on", "off"):
        raise ValueError(f"key_joins must be on or off, not {raw!r}")
    return raw == "on"


def _pool_size(ours: dict[str, str]) -> int:
    raw = ours.get("pool_size", str(DEFAULT_PG_POOL))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"pool_size must be a positive integer, not {raw!r}")
    return int(raw)


T = TypeVar("T")


class Database:
    """Where the store runs its transaction bodies, ``fn(connection, *args)``.

    A body is written once, against a sync Connection. On PostgreSQL it runs in
    SQLAlchemy's greenlet over the async engine (each statement awaits asyncpg);
    reads use autocommit connections, one statement and one round trip each; and a
    statement that is its own transaction can skip both (``write_statement``).

    On SQLite a body runs on one of two dedicated threads with the stdlib driver,
    each keeping one connection open — one thread hop per body instead of several
    per statement, and no pool checkout. The writer thread is the single writer
    SQLite wants: it opens each transaction with BEGIN IMMEDIATE (its reads and
    writes see one snapshot and never fail to upgrade a lock) and holds an
    inter-process lock (``flock`` on ``<database>.writer-lock``) around each body, so
    the writers of several processes on one file queue in the kernel and the next
    wakes the moment the previous commits, instead of sleeping in SQLite's busy
    handler (1, 2, 5, 10 … ms steps). A process stopped inside a write transaction
    therefore stalls the other writers until it resumes or dies (the kernel drops
    its lock). The reader thread runs in autocommit; each read body is one
    statement, one snapshot, and in WAL mode it never waits for the writer.
    """

    def __init__(
        self,
        engine: AsyncEngine | None = None,
        writer: DedicatedThread | None = None,
        reader: DedicatedThread | None = None,
        *,
        url: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Bodies run over ``engine`` unless dedicated threads are given (``open`` does,
        with ``url`` instead of an engine: see ``engine``). ``timeout_s``: the driver's
        statement timeout the engine was made with (``create_engine``)."""
        self._engine = engine
        self._url = url
        self.timeout_s = timeout_s
        self.concurrency = 1
        """Group transactions in flight at once. SQLite has one writer thread. On
        PostgreSQL a second group in flight lets the server commit one while the client
        prepares the next, but halves the groups: each transaction costs the server
        ~1 ms of CPU, on the cores the Runs share. W1 (R=200, C=50 on 2 cores) measured
        1.8 -> 1.2 transactions per Run, server CPU 1.9 -> 1.3 ms per Run, +14% runs/s
        with one."""
        self.max_group = 32 if writer is None else 256
        """Most requests per group transaction (store_bench, 50 writers on PostgreSQL:
        groups of 32 cost ~0.2 ms of client CPU per commit, of 16 ~0.28)."""
        self._writer = writer
        self._reader = reader
        self._held: list[AsyncConnection] = []
        """Connections ``write_statement`` keeps between statements."""
        self.generic_plans = False
        """Whether held connections plan statements generically (``_generic``); a store
        opened by URL (``open``) does unless ``?key_joins=off``."""
        self.dialect = "sqlite"
        """The database's SQLAlchemy dialect name."""
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()
        """The asyncpg connections of the pool, for ``_cut`` (gone once collected)."""
        if writer is None:
            async_engine = self.engine
            self.dialect = async_engine.dialect.name
            if self.dialect == "postgresql":
                event.listen(async_engine.sync_engine, "connect", self._opened_one)
            self._reads = async_engine.execution_options(isolation_level="AUTOCOMMIT")
            # Reads beyond what the pool holds beside the writers would open overflow
            # connections, which the pool closes again on return: a connect (and asyncpg's
            # type introspection) per read under load. Waiting here for a slot is cheaper.
            pool_size = getattr(async_engine.pool, "size", lambda: 5)()
            self._read_slots = asyncio.Semaphore(max(1, pool_size - self.concurrency))

    @property
    def engine(self) -> AsyncEngine:
        """The SQLAlchemy async engine on this database. With dedicated threads (SQLite)
        it serves only tests and tools, so it is built on first use: a restarted host
        then starts without importing its machinery."""
        if self._engine is None:
            assert self._url is not None, "a Database needs an engine or a URL"
            self._engine = create_engine(self._url, self.timeout_s)
        return self._engine

    @classmethod
    def open(cls, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Database:
        """The database a store URL names, with the threads SQLite wants; a PostgreSQL
        statement that has not answered within ``timeout_s`` fails (TimeoutError)."""
        sa_url, ours = sqlalchemy_url(url)
        if sa_url.get_backend_name() != "sqlite":
            db = cls(create_engine(url, timeout_s), timeout_s=timeout_s)
            db.generic_plans = _key_joins(ours)  # off: the server's settings are left alone
            return db
        sync_url = sa_url.set(drivername="sqlite+pysqlite")
        synchronous = synchronous_of(ours)
        writer = sqlite_engine(sync_url, synchronous, "BEGIN IMMEDIATE")
        reader = sqlite_engine(sync_url, synchronous, None)
        return cls(
            None,
            DedicatedThread(writer, "ratchet-sqlite-writer", f"{sa_url.database}.writer-lock"),
            DedicatedThread(reader, "ratchet-sqlite-reader", None),
            url=url,
            timeout_s=timeout_s,
        )

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a read body: a single statement (it gets no transaction of its own)."""
        if self._reader is not None:
            return await self._reader.run(fn, *args)
        async with self._read_slots, self._checked_out(self._reads) as conn:
            return await conn.run_sync(fn, *args)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a write body; the body opens and commits its own transaction(s)."""
        if self._writer is not None:
            return await self._writer.run(fn, *args)
        async with self._checked_out(self.engine) as conn:
            return await conn.run_sync(fn, *args)

    @contextlib.asynccontextmanager
    async def _checked_out(self, engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
        """A connection of the pool for the block; a timeout named (``_timed_out``)."""
        connected = False
        try:
            async with engine.connect() as conn:
                connected = True
                yield conn
        except TimeoutError as exc:
            raise self._timed_out(connected) from exc

    def _timed_out(self, connected: bool) -> TimeoutError:
        """asyncpg's timeouts come bare (``TimeoutError()``), its connect's and its
        statements' alike: name the one that ran out (the store's message quotes it)."""
        if connected:
            return TimeoutError(f"a statement had no answer within {self.timeout_s:g}s")
        return TimeoutError(f"no connection within {min(CONNECT_TIMEOUT_S, self.timeout_s):g}s")

    async def write_statement(
        self, sql: str, args: Sequence[Any], usable: Callable[[BaseException], bool]
    ) -> Any:
        """One statement as its own transaction, sent straight to asyncpg (PostgreSQL);
        returns its first value. One round trip where a body takes three (BEGIN, the
        statement, COMMIT), each also going through SQLAlchemy's adaptation and its
        greenlet: W1 spent ~8 % of a RunHost's CPU writing those to the socket.

        Errors come as asyncpg raises them. Unless ``usable(error)`` says it was an
        answer that leaves the connection as it was, the connection is dropped from
        the pool: a break mid-statement must not hand the next group a dead one.
        """
        # Connections stay checked out between statements: a checkout and its return
        # pass through the pool's events and two greenlet switches (50 writers
        # appending: client CPU per append 0.030 -> 0.028 ms).
        held = bool(self._held)
        try:
            conn = self._held.pop() if held else await self.engine.connect()
        except TimeoutError as exc:
            raise self._timed_out(connected=False) from exc
        try:
            driver = await _driver(conn)
            if held and self.generic_plans and not conn.info.get(GENERIC):
                await self._generic(conn, driver)
            value = await driver.fetchval(sql, *args)
        except BaseException as exc:
            if usable(exc):
                await self._keep(conn)
            else:
                await _drop(conn)
            if isinstance(exc, TimeoutError):
                raise self._timed_out(connected=True) from exc
            raise
        await self._keep(conn)
        return value

    async def _generic(self, conn: AsyncConnection, driver: Any) -> None:
        """Have a held connection plan its statements generically, before its next one.

        PostgreSQL plans a prepared statement anew at every call unless its generic plan
        looks no dearer, and the planned group's never does (the planner counts an
        unnested array parameter as 10 rows): planning took 0.30 ms of its 0.65 ms on
        the server. The setting is the session's, so it is undone before the
        connection goes back to the pool, whose reads keep the default (``_release``);
        it is made on a connection's second statement, once it is held, so that one
        taken for a single statement costs no round trip more. ``?key_joins=off``
        (behind PgBouncer, where a session may be another client's next) leaves it
        alone. Made before the statement: a cancellation here has written nothing."""
        conn.info[GENERIC] = True  # first: a SET cut short leaves the mark, so it is reset
        await driver.execute(GENERIC_PLANS)

    async def _keep(self, conn: AsyncConnection) -> None:
        """Hold as many connections as groups go at once; return the rest to the pool."""
        if len(self._held) < self.concurrency:
            self._held.append(conn)
        else:
            await self._release(conn)

    async def _release(self, conn: AsyncConnection) -> None:
        """A held connection back to the pool, planning as any other (else dropped)."""
        if not conn.info.get(GENERIC):
            await conn.close()
            return
        try:
            await (await _driver(conn)).execute(DEFAULT_PLANS)
            del conn.info[GENERIC]
        except BaseException as exc:
            await _drop(conn)
            if not isinstance(exc, Exception):
                raise
            return
        await conn.close()

    async def close(self) -> None:
        """Let bodies in flight finish, then release the threads and the engines; the
        connections a server has not seen off within ``CLOSE_S`` are cut."""
        for thread in (self._writer, self._reader):
            if thread is not None:
                await asyncio.to_thread(thread.close)
        letting_go = asyncio.ensure_future(self._let_go())
        try:
            await asyncio.wait({letting_go}, timeout=CLOSE_S)
        finally:
            if not letting_go.done():  # a hung server (or our caller gave up)
                self._cut()
        await letting_go

    async def _let_go(self) -> None:
        while self._held:  # for good: the engine closes the pool's connections next
            await _drop(self._held.pop())
        if self._engine is not None:
            await self._engine.dispose()

    def _cut(self) -> None:
        """Abort every connection still open, without waiting for the server: a close
        waiting for the server's goodbye then returns at once, and the closes after it
        find their connections closed already."""
        for driver in list(self._opened):
            driver.terminate()

    def _opened_one(self, dbapi_conn: Any, _record: Any) -> None:
        self._opened.add(dbapi_conn.driver_connection)


GENERIC_PLANS = "SET plan_cache_mode = force_generic_plan"
DEFAULT_PLANS = "RESET plan_cache_mode"
GENERIC = "ratchet_generic_plans"
"""The mark, in a pooled connection's ``info``, of a session that plans generically."""


async def _driver(conn: AsyncConnection) -> Any:
    """The asyncpg connection under a checked-out SQLAlchemy one."""
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None, "a checked-out connection has its driver's"
    return driver


async def _drop(conn: AsyncConnection) -> None:
    """Close ``conn`` for good: a connection in doubt never goes back to the pool."""
    with contextlib.suppress(Exception):
        await conn.invalidate()
    with contextlib.suppress(Exception):
        await conn.close()


def _dialect(name: str) -> Any:
    """The SQLAlchemy dialect package (imported on use: a process loads only its own)."""
    if name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql
    from sqlalchemy.dialects import sqlite

    return sqlite


def upsert_ignore(dialect: str, table: Any) -> Insert:
    """INSERT ... ON CONFLICT DO NOTHING, in the engine's dialect."""
    return _dialect(dialect).insert(table).on_conflict_do_nothing()  # type: ignore[no-any-return]


def upsert_replace(dialect: str, table: Any, key: str, columns: list[str]) -> Insert:
    """INSERT ... ON CONFLICT (key) DO UPDATE SET columns = excluded.columns."""
    stmt = _dialect(dialect).insert(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=[key], set_={c: stmt.excluded[c] for c in columns}
    )
    return stmt  # type: ignore[no-any-return]
