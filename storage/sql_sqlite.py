"""SQLite's side of the SQL store: the pragmas every connection opens with (WAL, the
``synchronous`` level, a busy timeout, text read leniently), BEGIN IMMEDIATE, and the
dedicated thread with its one connection where the store's transaction bodies run
(``storage.sql_engine.Database`` picks it for a SQLite URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

T = TypeVar("T")

SYNCHRONOUS = ("off", "normal", "full", "extra")


def synchronous_of(ours: dict[str, str]) -> str:
    synchronous = ours.get("synchronous", "full").lower()
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"sqlite synchronous must be one of {SYNCHRONOUS}")
    return synchronous


def configure_sqlite(engine: Engine, synchronous: str, begin: str | None) -> None:
    """Pragmas on connect; ``begin`` is what a transaction opens with (None: autocommit)."""
    if engine.url.database:
        Path(engine.url.database).parent.mkdir(parents=True, exist_ok=True)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # We issue BEGIN ourselves (below), so the driver must not.
        dbapi_conn.isolation_level = None
        # text that is not UTF-8 (written by hand) reads as lone surrogates, which every
        # check of a record refuses (that thread's CorruptRecord), not as an error of the
        # whole statement, a listing's included
        _raw(dbapi_conn).text_factory = _lenient_text
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    if begin is not None:

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql(begin)


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _raw(dbapi_conn: Any) -> Any:
    """The sqlite3 connection under SQLAlchemy's aiosqlite adapter (or itself)."""
    inner = getattr(dbapi_conn, "_connection", dbapi_conn)  # the aiosqlite connection
    return getattr(inner, "_conn", inner)  # its sqlite3 connection


def sqlite_engine(url: URL, synchronous: str, begin: str | None) -> Engine:
    engine = sa_create_engine(url, connect_args={"timeout": 30})
    configure_sqlite(engine, synchronous, begin)
    return engine


class DedicatedThread:
    """One thread and one open connection; runs bodies one at a time, in arrival order."""

    def __init__(self, engine: Engine, name: str, lock_path: str | None) -> None:
        self._engine = engine
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._conn: Connection | None = None
        self._lock_path = lock_path
        self._lock_fd: int | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._conn is None:
            self._conn = self._engine.connect()
        conn = self._conn
        try:
            with self._exclusive():
                return fn(conn, *args)
        except SQLAlchemyError:
            self._drop()  # a driver failure may leave the connection unusable: reopen next time
            raise
        finally:
            self._settle()

    def _settle(self) -> None:
        """End what a body left open: a read's transaction is SQLAlchemy's bookkeeping only
        (the driver runs in autocommit), a write body's was committed or rolled back."""
        if self._conn is None or not self._conn.in_transaction():
            return
        try:
            self._conn.rollback()
        except SQLAlchemyError:
            self._drop()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self._lock_path is None:
            yield
            return
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._conn.close()
            self._conn = None

    def _release(self) -> None:
        self._drop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._engine.dispose()

    def close(self) -> None:
        """Finish what is queued, then close the connection on its own thread."""
        with contextlib.suppress(RuntimeError):  # already shut down
            self._executor.submit(self._release).result()
        self._executor.shutdown(wait=True)
