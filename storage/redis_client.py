"""The Redis edge every Redis-backed part shares: pooled clients and error translation.

**Errors.** Driver exceptions are translated in ``translated`` and nowhere else::

    redis.AuthenticationError, AuthorizationError, NOPERM       -> StoreError
    redis.ConnectionError, redis.TimeoutError, OSError,
    LOADING / READONLY / OOM / TRYAGAIN / MASTERDOWN / MISCONF  -> StoreUnavailable
    any other redis.RedisError                                  -> StoreError

Messages name the server by its redacted URL: a password never reaches a log line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from runtime.errors import CorruptRecord, InputRefused, StoreError, StoreUnavailable
from storage.url import UnsupportedStoreUrl, redact, redis_db_path

_REFUSED: tuple[type[BaseException], ...] = (
    rex.AuthenticationError,
    rex.AuthorizationError,
    rex.NoPermissionError,
)
_TRANSIENT: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.MasterDownError,
    OSError,
)


@contextmanager
def translated(where: str, thread: str | None = None) -> Iterator[None]:
    """The one place where redis-py exceptions become Ratchet's; ``thread``: the one
    thread whose keys the commands read (a key of the wrong type is its CorruptRecord)."""
    try:
        yield
    except _REFUSED as exc:  # wrong credentials do not heal by retrying
        raise StoreError(f"redis at {where} refused access: {_describe(exc)}") from exc
    except _TRANSIENT as exc:
        raise StoreUnavailable(f"redis at {where} unavailable: {_describe(exc)}") from exc
    except rex.ResponseError as exc:
        # MISCONF: the server cannot persist, so it refuses writes until it can again.
        if str(exc).startswith("MISCONF"):
            raise StoreUnavailable(f"redis at {where} cannot persist: {_describe(exc)}") from exc
        if thread is not None and "WRONGTYPE" in str(exc):  # a key edited by hand
            raise CorruptRecord(thread, 0, f"a key holds a value of the wrong type: {exc}") from exc
        raise StoreError(f"redis at {where} refused a command: {_describe(exc)}") from exc
    except rex.RedisError as exc:
        raise StoreError(f"redis at {where} failed: {_describe(exc)}") from exc
    except UnicodeEncodeError as exc:  # a key or value no command can carry (a lone surrogate)
        raise InputRefused(
            "a thread id or value", "utf8", f"not valid Unicode text: {exc.reason}"
        ) from exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def open_client(
    url: str, *, socket_timeout: float = 5.0, connect_timeout: float = 2.0, what: str = "store"
) -> aioredis.Redis:
    """A pooled client that fails fast: the caller's own backoff decides when to retry.

    redis-py sends no command twice here (``retries=0``): a command whose answer was lost
    may have run, and a script run twice answers for its second run (a claim that landed
    was reported ``Fenced``, a bus event published twice). Its callers retry what is safe
    to retry (an append by its operation id, a claim by its owner and epoch). A pooled
    connection that died with a restarted server is found out as it is taken from the
    pool (redis-py checks that it is not closed) and opened again.
    """
    with translated(redact(url)), _readable(url, what):
        _check_db(url)
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            # bytes that are not UTF-8 (written by hand) decode to lone surrogates, which
            # every check of a record refuses (CorruptRecord, for that thread alone),
            # rather than a UnicodeDecodeError out of whatever read met them; and a key
            # named so round-trips to the same bytes
            encoding_errors="surrogateescape",
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
        )
        # options only a connection reads (``ssl_cert_reqs`` on ``redis://``) are read now,
        # not at the first command: a connection made, never opened
        client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        return client


def _check_db(url: str) -> None:
    """A path is a database number or nothing: redis-py reads ``/13x`` or ``/notanumber``
    as no number, and would use database 0, another store's, without a word."""
    db = redis_db_path(urlsplit(url).path)
    if db and not (db.isdigit() and db.isascii()):
        raise ValueError("its path is not a database number (redis://host:port/N)")


@contextmanager
def _readable(url: str, what: str) -> Iterator[None]:
    """A URL redis-py cannot read (its scheme, ``[::1``, a port or an option of the wrong
    value) is ``UnsupportedStoreUrl``, in one line, never the driver's traceback. Nothing
    is connected yet: a RedisError here is the URL's too (``rediss://…?ssl_cert_reqs=``
    of no known value)."""
    try:
        yield
    except (ValueError, TypeError, rex.RedisError) as exc:
        raise UnsupportedStoreUrl(url, f"{type(exc).__name__}: {exc}", what) from None
