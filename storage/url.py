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
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

from runtime.ports import CommitStore

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

SUPPORTED_SCHEMES = ("memory", "sqlite", "postgresql", "postgres", "redis", "rediss", "noop")
DEFAULT_STORE_URL = "sqlite:///ratchet-data/ratchet.db"
_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "credential", "auth")
"""Query parameters whose names hold one of these (or end in ``key``) are secrets."""
_NOT_SECRET = frozenset({"key_joins", "sslkey", "sslcert", "sslrootcert", "ssl_keyfile"})


class UnsupportedStoreUrl(ValueError):
    """A store URL no backend serves or its reader cannot read (also the Redis bus's
    URL: ``what``)."""

    def __init__(self, url: str, why: str | None = None, what: str = "store") -> None:
        schemes = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        # a reader's complaint may quote the URL whole (SQLAlchemy's "Invalid SQLite URL")
        why = _unquoted_secrets(why.replace(url, redact(url)), url) if why else None
        why = why or f"supported schemes: {schemes}"
        super().__init__(f"unsupported {what} URL {redact(url)!r}; {why}")


def _unquoted_secrets(why: str, url: str) -> str:
    """A reader's complaint with each quoted piece of the URL's credentials masked: one
    that mis-splits a password quotes a piece of it (a port ``'w'`` out of ``p@ss:w/rd``)."""
    _, sep, rest = url.partition("://")
    credentials = rest.rpartition("@")[0] if sep else url.partition(":")[2]
    return re.sub(r"'([^']*)'", lambda m: "'***'" if m[1] in credentials else m[0], why)


def redact(url: str) -> str:
    """The URL as its driver reads it, its password and every secret-named query value
    shown as ``***``; everything after the scheme masked if it cannot be read so.

    A SQL URL is read with SQLAlchemy's own parser, which takes an unencoded ``?``, ``#``
    or ``/`` in a password as part of it (``urlsplit`` cut the password there, and showed
    the rest as a path or a query); any other with ``urlsplit``, as redis-py reads it."""
    scheme, sep, _ = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return _masked(url)
    try:
        if scheme_of(url) in _SQL_SCHEMES:
            return _redact_sql(url)
        return _redact_split(url)
    except ValueError:  # unreadable: nothing of it is shown
        return f"{scheme}://***"


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_SQL_SCHEMES = ("sqlite", "postgresql", "postgres")


def _masked(url: str) -> str:
    """A URL with no ``://`` (``postgresql:/u:pw@h/db``): its scheme, if any, and ***."""
    head, colon, rest = url.partition(":")
    if not colon and "@" not in url:
        return url  # one word ("memory"): no password in it
    return f"{head}:***" if colon and _SCHEME.fullmatch(head) and rest else "***"


def _sql_url(url: str) -> URL:
    """A SQL URL as its drivers are given it (SQLAlchemy's parser); ValueError if it
    cannot be read."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url)
    except ArgumentError as exc:
        raise ValueError(str(exc)) from None


def _redact_sql(url: str) -> str:
    parsed = _sql_url(url)
    if url.count("@") > 1 or any(c in (parsed.username or "") for c in "?#=&"):
        # a password holding an unencoded "@" (SQLAlchemy ends it at the first one, the
        # rest read as the host), or a query read as the user: nothing of it is shown
        raise ValueError("credentials its reader splits")
    if parsed.password is None and not any(_secret(k) for k in parsed.query):
        return url  # nothing to hide: as written (SQLAlchemy renders ":" in a path as %3A)
    base = parsed.set(query={}).render_as_string(hide_password=True)
    pairs = [
        (key, value)
        for key, values in parsed.query.items()
        for value in (values if isinstance(values, tuple) else (values,))
    ]
    return base + _query(pairs)


def _redact_split(url: str) -> str:
    parts = urlsplit(url)
    if "@" in url[len(parts.scheme) + 3 + len(parts.netloc) :]:
        # an "@" past the host: a password with an unencoded "?", "#" or "/" was cut there
        raise ValueError("a password split by the URL's reader")
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    pairs = [(k, v) for k, _, v in (p.partition("=") for p in parts.query.split("&") if p)]
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{netloc}{parts.path}{_query(pairs)}{fragment}"


def _query(pairs: Sequence[tuple[str, str]]) -> str:
    """``?k=v&…`` as given, each secret-named parameter's value shown as ***."""
    shown = [f"{k}={'***' if _secret(unquote_plus(k)) else v}" for k, v in pairs]
    return "?" + "&".join(shown) if shown else ""


def _secret(key: str) -> bool:
    """Named for a secret: holding ``password``, ``secret``, ``token`` and the like
    (``sslpassword``, ``secretkey``), or ending in ``key`` (``api_key``, ``privatekey``);
    not ``key_joins``, an option of ours, or ``sslkey``, a path to a file."""
    name = key.lower()
    if name in _NOT_SECRET:
        return False
    return any(word in name for word in _SECRET_WORDS) or name.endswith("key")


def scheme_of(url: str) -> str:
    """The base scheme, without a driver suffix (``postgresql+asyncpg`` → ``postgresql``)."""
    return url.partition("://")[0].partition("+")[0].lower()


def store_identity(url: str) -> str:
    """The store a URL names, one spelling per store: what a system's name is made from
    (``cluster.config.system_name``), so that a new password or pool size, ``postgres://``
    for ``postgresql://`` or ``db`` for ``DB:5432`` still name the system whose Runs the
    store holds. Credentials and query options are left out; what picks the data is kept:

        postgresql://host:port/database   (default port 5432; no database: libpq's, the
                                           user's name; no host: ``?host=``, a socket)
        sqlite:///absolute/path            (symlinks resolved)
        redis://host:port/db               (rediss:// too; default port 6379, db 0)

    Any other (``memory://``, ``noop://``: one process's store) is itself. A URL its
    reader cannot read is ``UnsupportedStoreUrl``."""
    scheme = scheme_of(url)
    try:
        if scheme in ("postgresql", "postgres"):
            return _postgres_identity(url)
        if scheme == "sqlite":
            path = sqlite_path(url) or ""
            return f"sqlite:///{os.path.realpath(path) if path not in ('', ':memory:') else path}"
        if scheme in ("redis", "rediss"):
            return _redis_identity(url)
    except ValueError as exc:
        raise UnsupportedStoreUrl(url, f"{type(exc).__name__}: {exc}") from None
    return url


def _postgres_identity(url: str) -> str:
    """Where the driver connects, as SQLAlchemy's asyncpg dialect hands it the URL: its
    ``?host=``, ``?port=`` and ``?database=`` override the URL's own parts."""
    from storage.sql_engine import sqlalchemy_url

    sa_url, _ = sqlalchemy_url(url)
    _, given = sa_url.get_dialect()().create_connect_args(sa_url)
    hosts = given.get("host") or ""
    host = ",".join(hosts) if isinstance(hosts, list | tuple) else str(hosts)
    ports = given.get("port") or 5432
    port = ",".join(map(str, ports)) if isinstance(ports, list | tuple) else str(ports)
    database = given.get("database") or given.get("user") or ""  # asyncpg's default
    return f"postgresql://{host.lower()}:{port}/{database}"


def _redis_identity(url: str) -> str:
    parts = urlsplit(url)
    db = parse_qs(parts.query).get("db", [redis_db_path(parts.path) or "0"])[0]
    return f"redis://{parts.hostname or 'localhost'}:{parts.port or 6379}/{int(db)}"


def redis_db_path(path: str) -> str:
    """A Redis URL's path as redis-py reads a database number from it: unquoted, every
    "/" dropped (``/0/`` is 0, ``/%31`` is 1)."""
    return unquote(path).replace("/", "")


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


def check_store_url(url: str) -> None:
    """``UnsupportedStoreUrl`` unless some backend serves the URL and its reader reads it,
    options included: all that can be known of it without connecting (a client asks
    before it starts Ray; a store that then cannot be reached is a StoreError)."""
    if not isinstance(url, str):
        raise UnsupportedStoreUrl(repr(url), f"a store URL is text, not {type(url).__name__}")
    scheme = scheme_of(url)
    if "://" not in url or scheme not in SUPPORTED_SCHEMES:
        raise UnsupportedStoreUrl(url)
    if scheme in _SQL_SCHEMES:
        from sqlalchemy.exc import ArgumentError

        from storage.sql_engine import check_sql_url

        try:
            check_sql_url(url)
        except (ArgumentError, ValueError) as exc:
            raise UnsupportedStoreUrl(url, f"{type(exc).__name__}: {exc}") from None
    elif scheme in ("redis", "rediss"):
        from storage.redis_client import open_client

        open_client(url)  # made and dropped, never connected (UnsupportedStoreUrl)


async def open_store(url: str, *, create: bool = True, **opts: Any) -> CommitStore:
    """Connect the CommitStore the URL names; backends are imported only when chosen.

    ``create`` False (a reader's): a SQL database holding no Ratchet schema is
    ``NoStore`` and nothing is made in it. A Redis store writes only its layout and
    instance keys when it connects, and an in-memory one is always new."""
    check_store_url(url)
    scheme = scheme_of(url)
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
    # read first (``check_store_url``); an ArgumentError or ValueError the driver finds
    # only as it connects is the URL's too: said in one line, never a driver's traceback.
    # Failures to reach a server that is named right are StoreErrors, raised as they are.
    if scheme in ("sqlite", "postgresql", "postgres"):
        from sqlalchemy.exc import ArgumentError

        from runtime.errors import StoreError
        from storage.sql import SqlCommitStore

        if not create and scheme == "sqlite":
            await _sqlite_is_there(url)
        try:
            return await SqlCommitStore.connect(url, create=create, **opts)
        except (ArgumentError, ValueError) as exc:
            raise UnsupportedStoreUrl(url, f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:  # SQLite's folder or lock file: a file on the way, no right
            if scheme != "sqlite":  # to make it: this path's fault, not an outage
                raise
            why = f"{type(exc).__name__}: {exc}"
            raise StoreError(f"cannot open store {redact(url)}: {why}") from None
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
