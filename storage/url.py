"""Store selection by URL, and the one function that keeps credentials out of logs.

    memory://                       MemoryCommitStore (one process, tests)
    sqlite:///relative/path.db      SqlCommitStore on SQLite (the embedded default)
    sqlite:////absolute/path.db
    postgresql://user:pw@host/db    SqlCommitStore on PostgreSQL (also postgres://)
    redis://host:port/db            RedisCommitStore
    noop://[name]                   NoopCommitStore (benchmarks: commits switched off,
                                    nothing kept beyond the process that opened it)

Every log line and error message that names a store uses ``redact(url)``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit

from runtime.ports import CommitStore

SUPPORTED_SCHEMES = ("memory", "sqlite", "postgresql", "postgres", "redis", "rediss", "noop")
DEFAULT_STORE_URL = "sqlite:///ratchet-data/ratchet.db"
_SECRET_WORDS = ("password", "passwd", "secret", "token", "key")


class UnsupportedStoreUrl(ValueError):
    """A store URL no backend serves or its reader cannot read (also the Redis bus's
    URL: ``what``)."""

    def __init__(self, url: str, why: str | None = None, what: str = "store") -> None:
        schemes = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        super().__init__(
            f"unsupported {what} URL {redact(url)!r}; {why or f'supported schemes: {schemes}'}"
        )


def redact(url: str) -> str:
    """The URL with its password (and any secret-looking query value) replaced by ***."""
    try:
        parts = urlsplit(url)
        netloc = _redact_netloc(parts)
    except ValueError:
        return "<unparseable store url>"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if netloc == parts.netloc and not any(_secret(k) for k, _ in pairs):
        return url  # nothing to hide: keep the URL exactly as written
    query = urlencode([(k, "***" if _secret(k) else v) for k, v in pairs], safe="/:")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _redact_netloc(parts: SplitResult) -> str:
    if parts.password is None:
        return parts.netloc
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return f"{name}:***@{host}"


def _secret(key: str) -> bool:
    return any(word in key.lower() for word in _SECRET_WORDS)


def scheme_of(url: str) -> str:
    """The base scheme, without a driver suffix (``postgresql+asyncpg`` → ``postgresql``)."""
    return url.partition("://")[0].partition("+")[0].lower()


def sqlite_path(url: str) -> str | None:
    """The file a SQLite store URL names; None if it names none (or cannot be read)."""
    from sqlalchemy.engine import make_url  # a SQLite URL's reader: SQLAlchemy's own

    try:
        return make_url(url).database or None
    except Exception:  # a malformed URL: opening the store says what is wrong with it
        return None


def default_store_url() -> str:
    """RATCHET_STORE_URL, else a SQLite file under the working directory."""
    return os.environ.get("RATCHET_STORE_URL") or DEFAULT_STORE_URL


async def open_store(url: str, *, create: bool = True, **opts: Any) -> CommitStore:
    """Connect the CommitStore the URL names; backends are imported only when chosen.

    ``create`` False (a reader's): a SQL database holding no Ratchet schema is
    ``NoStore`` and nothing is made in it. A Redis store writes only its layout and
    instance keys when it connects, and an in-memory one is always new."""
    if not isinstance(url, str):
        raise UnsupportedStoreUrl(repr(url), f"a store URL is text, not {type(url).__name__}")
    scheme = scheme_of(url)
    if "://" not in url or scheme not in SUPPORTED_SCHEMES:
        raise UnsupportedStoreUrl(url)
    timeout = opts.get("timeout_s")
    if timeout is not None and not (
        isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < 1e6
    ):  # 0 gave up on every statement at once, and a start retried for a minute
        raise ValueError(f"timeout_s is a positive number of seconds, not {timeout!r:.80}")
    if scheme == "memory":
        from storage.memory import MemoryCommitStore

        return MemoryCommitStore(**opts)
    if scheme == "noop":
        from storage.noop import NoopCommitStore

        return NoopCommitStore(**opts)
    # a URL its reader cannot read ("sqlite://host/x": SQLAlchemy's ArgumentError; a port
    # "abc", an option of the wrong value: ValueError) is this URL's fault: said in one
    # line, never a driver's traceback (Redis URLs: ``open_client``). Failures to reach
    # a server that is named right are StoreErrors, raised as they are.
    if scheme in ("sqlite", "postgresql", "postgres"):
        from sqlalchemy.exc import ArgumentError

        from storage.sql import SqlCommitStore

        if not create and scheme == "sqlite":
            await _sqlite_is_there(url)
        try:
            return await SqlCommitStore.connect(url, create=create, **opts)
        except (ArgumentError, ValueError) as exc:
            raise UnsupportedStoreUrl(url, f"{type(exc).__name__}: {exc}") from None
    from storage.redis_store import RedisCommitStore

    store: CommitStore = await RedisCommitStore.connect(url, **opts)  # open_client checks
    return store


async def _sqlite_is_there(url: str) -> None:
    """NoStore unless the file holds something: as it opens, SQLite makes a missing file
    (not its folders), and its WAL setting writes a header into an empty one."""
    from storage.errors import NoStore

    path = sqlite_path(url)
    if path is None:  # malformed: connecting says what is wrong with it
        return
    try:
        size = (await asyncio.to_thread(os.stat, path)).st_size
    except FileNotFoundError:
        raise NoStore(redact(url), "the file does not exist") from None
    except OSError:  # unreadable, a folder on the way that is a file: connecting says so
        return
    if size == 0:
        raise NoStore(redact(url), "the file is empty")
