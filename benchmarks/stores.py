"""Fresh stores for one benchmark measurement, removed after; which servers answer."""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from storage.url import scheme_of

PG_SERVER = os.environ.get(
    "RATCHET_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_SERVER = os.environ.get("RATCHET_BENCH_REDIS", "redis://127.0.0.1:6379/13")


@dataclass
class PreparedStore:
    kind: str
    url: str
    cleanup: Callable[[], Awaitable[None]]


STORE_NAMES = ("sqlite", "postgres", "postgresql", "redis", "memory")
"""The stores ``prepare_store`` makes fresh; anything else is a store URL."""


async def prepare_store(spec: str, tmp: Path) -> PreparedStore:
    """``sqlite``/``postgres``/``redis``/``memory`` make a fresh store (dropped after);
    a full URL is used as given."""

    async def nothing() -> None:
        return None

    if spec == "sqlite":
        return PreparedStore("sqlite", f"sqlite:///{tmp}/w1-{uuid.uuid4().hex[:8]}.db", nothing)
    if spec == "memory":
        return PreparedStore("memory", "memory://", nothing)
    if spec in ("postgres", "postgresql"):
        return await _fresh_postgres(PG_SERVER)
    if spec == "redis":
        return await _fresh_redis(REDIS_SERVER)
    kind = scheme_of(spec)
    return PreparedStore("postgres" if kind.startswith("postgres") else kind, spec, nothing)


async def _fresh_postgres(server: str) -> PreparedStore:
    import asyncpg

    name = f"ratchet_w1_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()

    async def drop() -> None:
        conn = await asyncpg.connect(server)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await conn.close()

    return PreparedStore("postgres", server.rsplit("/", 1)[0] + f"/{name}", drop)


async def _fresh_redis(url: str) -> PreparedStore:
    """Redis has no databases to create: the benchmark owns one db index and flushes it."""
    import redis.asyncio as aioredis

    async def flush() -> None:
        from actors.store_instance import forget_first_instance

        client = aioredis.from_url(url)
        try:
            await client.flushdb()
        finally:
            await client.aclose()
        forget_first_instance(url)  # emptied on purpose: the next trial's is a new store

    await flush()
    return PreparedStore("redis", url, flush)


def store_answers(store: str) -> bool:
    import socket

    port = {"postgres": 5432, "redis": 6379}.get(store)
    if port is None:
        return True
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


__all__ = ["PG_SERVER", "REDIS_SERVER", "PreparedStore", "prepare_store", "store_answers"]
