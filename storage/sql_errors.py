"""The one translation of SQL driver errors into Ratchet's, for SQLite and PostgreSQL::

    unique violation of (thread_id, operation_id)   -> DuplicateOperation
    unique violation of (thread_id, seq) or of the
    thread row's key: someone wrote first           -> VersionConflict
    any other integrity violation (NOT NULL, CHECK,
    a trigger, a unique index not ours)             -> StoreError (the commit refused)
    connection refused / lost / reset, timeouts
    (the pool's wait for a connection too),
    server shutting down or starting, too many
    connections, deadlock, SQLite busy or locked,
    disk full (SQLite's "database or disk is full",
    PostgreSQL's 53100: space can be freed), a row
    lock waited for past lock_timeout (55P03)       -> StoreUnavailable
    any other driver error                          -> StoreError

A lock timeout is one thread's, not the store's: ``lock_timed_out`` tells it apart.

A unique violation is told by the key it names, never by other words of its message:
PostgreSQL's ``constraint_name`` (SQLSTATE 23505), SQLite's list of the key's columns
under its own unique or primary-key code ("UNIQUE constraint failed:
ratchet_commits.thread_id, ratchet_commits.seq"; a trigger raising those words has
another code). Errors arrive wrapped by SQLAlchemy, or as asyncpg raised them
(``Database.write_statement``), and are told apart the same way either way.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from runtime.errors import DuplicateOperation, StoreError, StoreUnavailable, VersionConflict

# SQLSTATE classes that mean "try again later", never "your data is wrong":
# 08 connection exception, 53 insufficient resources, 57 operator intervention
# (admin shutdown, cannot connect now), 40 transaction rollback (deadlock, serialization),
# 55P03 lock not available (a row another client holds past our lock_timeout).
_LOCK_TIMEOUT = "55P03"
_DEADLOCK = "40P01"
_TRANSIENT_SQLSTATE = ("08", "53", "57", "40", _LOCK_TIMEOUT)
_TRANSIENT_WORDS = (
    "database is locked",
    "database is busy",
    "database or disk is full",
    "connection",
    "closed",
)
"""SQLite's errors carry no SQLSTATE: these words of theirs mean "try again later"."""
_UNIQUE_KEYS = {
    "uq_ratchet_commits_operation": "operation",
    "ratchet_commits.thread_id, ratchet_commits.operation_id": "operation",
    "pk_ratchet_commits": "seq",
    "ratchet_commits.thread_id, ratchet_commits.seq": "seq",
    "ratchet_threads_pkey": "thread",
    "ratchet_threads.thread_id": "thread",
}
"""Our unique keys as PostgreSQL names them (the constraint) and SQLite (its columns)."""
_SQLITE_UNIQUE = "UNIQUE constraint failed: "
_SQLITE_UNIQUE_CODES = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")


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
    if _refused(exc):
        key = _unique_key(exc)
        if key == "operation":
            return DuplicateOperation(operation)
        if key is not None:
            return VersionConflict(thread, expected, actual)
        return StoreError(f"store {where} refused the commit: {_describe(exc)}")
    if _transient(exc):
        return StoreUnavailable(f"store {where} unavailable: {_describe(exc)}")
    return StoreError(f"store {where} failed: {_describe(exc)}")


def lock_timed_out(exc: BaseException | None) -> bool:
    """Whether ``exc`` (a driver's, wrapped or not) is a lock wait that ran past its
    ``lock_timeout``: a row held by another client, not an outage of the server."""
    return _in_state(exc, _LOCK_TIMEOUT)


def deadlocked(exc: BaseException | None) -> bool:
    """Whether ``exc`` is PostgreSQL breaking a deadlock (40P01): this transaction was
    rolled back so that another could go on; nothing of it was written."""
    return _in_state(exc, _DEADLOCK)


def _in_state(exc: BaseException | None, sqlstate: str) -> bool:
    if isinstance(exc, DBAPIError):
        return _sqlstate(exc) == sqlstate
    state = getattr(exc, "sqlstate", None)
    return exc is not None and _from_asyncpg(exc) and state == sqlstate


def _refused(exc: BaseException) -> bool:
    """An integrity violation (SQLSTATE class 23), wrapped or as asyncpg raised it."""
    if isinstance(exc, IntegrityError):
        return True
    state = getattr(exc, "sqlstate", None)
    return _from_asyncpg(exc) and isinstance(state, str) and state.startswith("23")


def _unique_key(exc: BaseException) -> str | None:
    """Which of our unique keys the violation is of; None for any other refusal."""
    orig = getattr(exc, "orig", None)
    layers = (exc, orig, getattr(orig, "__cause__", None))
    if any(getattr(layer, "sqlstate", None) == "23505" for layer in layers):  # PostgreSQL
        names = [getattr(layer, "constraint_name", None) for layer in layers]
        return next((_UNIQUE_KEYS.get(n) for n in names if isinstance(n, str)), None)
    code = getattr(orig, "sqlite_errorname", None)  # a trigger's RAISE has its own code
    words = str(orig)
    if code not in (None, *_SQLITE_UNIQUE_CODES) or not words.startswith(_SQLITE_UNIQUE):
        return None
    return _UNIQUE_KEYS.get(words.removeprefix(_SQLITE_UNIQUE).strip())


def _from_asyncpg(exc: BaseException) -> bool:
    """Raised by asyncpg itself, not wrapped (``Database.write_statement``)."""
    return type(exc).__module__.startswith("asyncpg")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        return _transient_answer(_sqlstate(exc), str(exc.orig))
    if isinstance(exc, PoolTimeout):  # every pooled connection out (a hung server holds them)
        return True
    if isinstance(exc, SQLAlchemyError):
        return False
    if _from_asyncpg(exc):
        state = getattr(exc, "sqlstate", None)
        return _transient_answer(state if isinstance(state, str) else None, str(exc))
    cause = exc.__cause__ or exc.__context__
    return cause is not None and _transient(cause)


def _transient_answer(state: str | None, message: str) -> bool:
    """A driver's error by its SQLSTATE, or by its words where it carries none."""
    if state is not None:
        return state.startswith(_TRANSIENT_SQLSTATE)
    return any(word in message.lower() for word in _TRANSIENT_WORDS)


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
