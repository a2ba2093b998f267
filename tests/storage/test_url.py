"""Store selection by URL, and credentials kept out of every message."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import asyncpg
import pytest

from storage.errors import NoStore
from storage.memory import MemoryCommitStore
from storage.sql import SqlCommitStore
from storage.url import (
    DEFAULT_STORE_URL,
    UnsupportedStoreUrl,
    default_store_url,
    open_store,
    redact,
)


def test_redact_hides_passwords_and_secret_query_values() -> None:
    assert redact("postgresql://bob:hunter2@db:5432/app") == "postgresql://bob:***@db:5432/app"
    assert redact("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert "hunter2" not in redact("postgresql://db/app?password=hunter2&sslmode=require")
    assert redact("sqlite:///ratchet-data/ratchet.db") == "sqlite:///ratchet-data/ratchet.db"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # SQLAlchemy reads a password up to the first "@", and past ?, # or /: urlsplit
        # cut it there. One holding an "@" (the rest read as the host) is masked whole
        ("postgresql://user:p@ss@host/db", "postgresql://***"),
        ("postgres://app:hunter2@prod@db.internal/app", "postgres://***"),
        ("postgresql://h?user=me&password=S3CRET&x=a@b", "postgresql://***"),
        ("postgresql://app:pa?ss@db:5432/r", "postgresql://app:***@db:5432/r"),
        ("postgresql://app:pa#ss@db:5432/r", "postgresql://app:***@db:5432/r"),
        ("postgresql://app:pa/ss@db:5432/r", "postgresql://app:***@db:5432/r"),
        # redis-py reads with urlsplit: an "@" past its host is a password it cut
        ("redis://:pa?ss@cache:6379/0", "redis://***"),
        ("redis://:pa#ss@cache:6379/0", "redis://***"),
        # no "://", or nothing its reader can read: nothing after the scheme is shown
        ("postgresql:/app:pass@db/r", "postgresql:***"),
        ("postgresql:app:pass@db/r", "postgresql:***"),
        ("postgresql://app:p@ss:w/rd@db/r", "postgresql://***"),
        ("postgresql://app:pass@[::1/r", "postgresql://***"),
        ("app:pass@db", "app:***"),
        # only parameters named for a secret are masked, and *** is shown as it is
        (
            "postgresql://db/r?key_joins=off&api_key=pass",
            "postgresql://db/r?key_joins=off&api_key=***",
        ),
        ("postgresql://u@h/db?secretkey=pass", "postgresql://u@h/db?secretkey=***"),
        ("redis://h/0?privatekey=pass", "redis://h/0?privatekey=***"),
        ("postgresql://h/db?sslkey=/etc/k.pem", "postgresql://h/db?sslkey=/etc/k.pem"),
        (
            "postgresql://db/r?sslpassword=pass&sslmode=require",
            "postgresql://db/r?sslpassword=***&sslmode=require",
        ),
        (
            "redis://cache/0?password=pass&socket_timeout=1",
            "redis://cache/0?password=***&socket_timeout=1",
        ),
        ("memory", "memory"),
    ],
)
def test_redact_reads_a_url_as_its_driver_does(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert "pa" not in shown.replace("password", "")


@pytest.mark.parametrize(
    "url", ["postgresql:/app:pass@db/r", "postgresql://app:p@ss:w/rd@db/r", "redis://:pass?x@h/0"]
)
async def test_a_url_that_cannot_be_read_shows_no_piece_of_its_password(url: str) -> None:
    """The scheme's reader quoted a piece of a password it mis-split (``'w'``, a port)."""
    with pytest.raises(UnsupportedStoreUrl) as refused:
        await open_store(url)
    for piece in ("pass", "'w'", "ss:w", "rd@"):
        assert piece not in str(refused.value)


async def test_a_password_the_driver_reads_whole_is_never_logged(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``?`` in a password: ``connected to`` and ``store.where`` showed it whole."""
    head, _, rest = postgres_url.partition("@")
    url = f"{head}:pa?ss@{rest}"  # the test server trusts: any password is taken
    caplog.set_level("INFO")
    store = await open_store(url)
    try:
        assert "pa?ss" not in store.where  # type: ignore[attr-defined]
    finally:
        await store.close()
    assert "connected to" in caplog.text and "pa?ss" not in caplog.text


async def test_unknown_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedStoreUrl) as info:
        await open_store("mysql://root:hunter2@db/app")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "hunter2" not in message
    for scheme in ("memory://", "sqlite://", "postgresql://", "redis://"):
        assert scheme in message


def test_default_url_is_a_sqlite_file_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATCHET_STORE_URL", raising=False)
    assert default_store_url() == DEFAULT_STORE_URL == "sqlite:///ratchet-data/ratchet.db"
    monkeypatch.setenv("RATCHET_STORE_URL", "memory://")
    assert default_store_url() == "memory://"


async def test_open_store_chooses_the_backend(tmp_path: Path, postgres_url: str) -> None:
    assert isinstance(await open_store("memory://"), MemoryCommitStore)
    for url in (f"sqlite:///{tmp_path}/a.db", postgres_url):
        store = await open_store(url, payload_limit=1234)
        try:
            assert isinstance(store, SqlCommitStore) and store.payload_limit == 1234
        finally:
            await store.close()


async def test_open_store_redis(redis_url: str) -> None:
    store = await open_store(redis_url)
    try:
        assert type(store).__name__ == "RedisCommitStore"
    finally:
        await store.close()


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await conn.close()
    return {row["tablename"] for row in rows}


async def test_a_reader_makes_no_store_where_there_is_none(tmp_path: Path, postgres_url: str):
    """``create=False`` (what the CLI's reading commands open with): an empty database
    is ``NoStore`` and stays empty. It was given a schema: ``ratchet runs --store
    postgresql://`` made six tables in libpq's default database."""
    empty = tmp_path / "empty.db"
    empty.touch()
    name = f"ratchet_nostore_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_url)
    await admin.execute(f"CREATE DATABASE {name}")
    database = postgres_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        for url, why in ((f"sqlite:///{empty}", "the file is empty"), (database, "no Ratchet")):
            with pytest.raises(NoStore, match=f"no store at {url}: .*{why}"):
                await open_store(url, create=False)
        with pytest.raises(NoStore, match="the file does not exist"):
            await open_store(f"sqlite:///{tmp_path}/none.db", create=False)
        assert empty.stat().st_size == 0 and await _tables(database) == set()
        await (await open_store(database)).close()  # a writer makes it; then readers open it
        await (await open_store(database, create=False)).close()
        assert "ratchet_threads" in await _tables(database)
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
async def test_sqlite_needs_a_file(url: str) -> None:
    with pytest.raises(ValueError, match="memory://"):
        await open_store(url)


def test_postgres_pool_size_is_ours_to_set_and_checked():
    import pytest as _pytest

    from storage.sql_engine import DEFAULT_PG_POOL, create_engine

    assert create_engine("postgresql://u@127.0.0.1/db").pool.size() == DEFAULT_PG_POOL
    assert create_engine("postgresql://u@127.0.0.1/db?pool_size=3").pool.size() == 3
    with _pytest.raises(ValueError, match="pool_size"):
        create_engine("postgresql://u@127.0.0.1/db?pool_size=lots")


def test_postgres_key_joins_can_be_left_to_the_server():
    from storage.sql_engine import KEY_LOOKUPS_ONLY, pg_connect_args, sqlalchemy_url

    _, ours = sqlalchemy_url("postgresql://u@127.0.0.1/db")
    assert pg_connect_args(ours)["server_settings"] == KEY_LOOKUPS_ONLY
    url, ours = sqlalchemy_url("postgresql://u@127.0.0.1/db?key_joins=off")
    assert "server_settings" not in pg_connect_args(ours)
    assert "key_joins" not in str(url)  # ours, not passed to the driver
    _, ours = sqlalchemy_url("postgresql://u@127.0.0.1/db?key_joins=maybe")
    with pytest.raises(ValueError, match="key_joins"):
        pg_connect_args(ours)


@pytest.mark.parametrize("option", ["sslmode", "ssl"])
def test_sslmode_is_asyncpgs_ssl(option: str) -> None:
    """libpq's ``?sslmode=`` failed every connection with a driver TypeError."""
    from storage.sql_engine import sqlalchemy_url

    url, _ = sqlalchemy_url(f"postgresql://u@127.0.0.1/db?{option}=Verify-Full")
    assert dict(url.query) == {"ssl": "verify-full"}


async def test_a_store_opens_with_sslmode(postgres_url: str) -> None:
    for mode in ("prefer", "disable"):  # the test server may or may not serve TLS
        store = await open_store(f"{postgres_url}?sslmode={mode}")
        await store.close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sqlite://", "a SQLite store needs a file path"),
        ("sqlite:///", "a SQLite store needs a file path"),
        ("sqlite:///{tmp}/s.db?synchronous=bogus", "synchronous"),
        ("postgresql://postgres@127.0.0.1/hzx?pool_size=0", "pool_size"),
        ("postgresql://postgres@127.0.0.1/hzx?key_joins=maybe", "key_joins"),
        ("postgresql://postgres@127.0.0.1/hzx?sslmode=bogus", "sslmode"),  # a TypeError
        ("postgresql://postgres@127.0.0.1/hzx?ssl=require&sslmode=disable", "only one"),
        ("postgresql://postgres:sekrit@127.0.0.1:abc/x", "invalid literal for int()"),
        ("redis://[::1", "Invalid IPv6 URL"),
        ("redis://127.0.0.1:1/13?socket_timeout=abc", "socket_timeout"),
        ("redis://127.0.0.1:1/13?ssl_cert_reqs=bogus", "ssl_cert_reqs"),
        ("rediss://127.0.0.1:1/13?ssl_cert_reqs=bogus", "Certificate Requirements"),
        # redis-py took a path it could not read as no number: database 0, silently
        ("redis://127.0.0.1:1/13x", "not a database number"),
        ("redis://127.0.0.1:1/notanumber", "not a database number"),
    ],
)
async def test_a_url_its_reader_cannot_read_is_unsupported_in_one_line(
    tmp_path: Path, url: str, says: str
) -> None:
    """Each was a ValueError or TypeError from the driver (a traceback from every
    command) where the scheme was right and the rest could not be read."""
    with pytest.raises(UnsupportedStoreUrl, match="unsupported store URL") as refused:
        await open_store(url.format(tmp=tmp_path))
    assert says in str(refused.value) and "sekrit" not in str(refused.value)
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240  (a listing of an empty folder)


def test_a_bus_url_that_cannot_be_read_is_refused_before_anything_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.config import redis_url_from

    for url in ("bogus://x", "redis://[::1", "redis://h/0?ssl_cert_reqs=bogus"):
        with pytest.raises(UnsupportedStoreUrl, match="unsupported Redis bus URL"):
            redis_url_from(url)
        monkeypatch.setenv("RATCHET_REDIS_URL", url)
        with pytest.raises(UnsupportedStoreUrl, match="unsupported Redis bus URL"):
            redis_url_from(None)
    assert redis_url_from("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"


async def test_a_sqlite_path_that_cannot_be_made_is_a_store_error(tmp_path: Path) -> None:
    """A file where its folder should be: a FileExistsError left the store (the CLI's
    readers called it ClusterUnavailable: "Ray could not be started or reached")."""
    from typer.testing import CliRunner

    from cluster.cli import app
    from runtime.errors import StoreError, StoreUnavailable

    (tmp_path / "afile").write_text("not a folder")
    url = f"sqlite:///{tmp_path}/afile/r.db"
    for create in (True, False):
        with pytest.raises(StoreError, match=r"cannot open store .*FileExistsError") as refused:
            await open_store(url, create=create)
        assert not isinstance(refused.value, StoreUnavailable)  # nothing to wait out
    done = await asyncio.to_thread(CliRunner().invoke, app, ["runs", "--store", url])
    assert done.exit_code == 1 and "cannot open store" in done.stderr, done.output
    assert "Traceback" not in done.output and (tmp_path / "afile").is_file()


def test_a_reader_s_complaint_quoting_the_url_shows_it_redacted() -> None:
    """SQLAlchemy's "Invalid SQLite URL: ..." quotes the URL whole, query and all."""
    from storage.url import UnsupportedStoreUrl, check_store_url

    with pytest.raises(UnsupportedStoreUrl) as refused:
        check_store_url("sqlite://host/db?password=S3CRET")
    assert "S3CRET" not in str(refused.value)


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0/", "redis://h:6379/%31", "postgresql://u@h/db?ssl=verify_full"]
)
def test_urls_their_drivers_read_are_taken(url: str) -> None:
    """redis-py reads ``/0/`` as database 0 and ``/%31`` as 1; asyncpg reads
    ``verify_full`` as ``verify-full``."""
    from storage.url import check_store_url

    check_store_url(url)
