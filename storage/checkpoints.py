"""StreamCheckpointStore: in memory and on SQL. Best effort by contract (DESIGN §4).

A checkpoint only shortens the first recovered step, so every failure here —
server down, a record that no longer decodes — is logged and swallowed: ``get``
then answers None and the Run simply infers again. Nothing is ever raised into a Run.

A checkpoint is not committed, yet what it holds is acted on (its complete tool calls
are run without asking the model again), so it is stored *sealed*: an HMAC-SHA-256 of
the thread id and the body, then the body (``seal``). One that does not match (edited
by hand, copied from another thread, or written by an earlier layout) is ignored. Where
checkpoints live beside the commit store (SQL, memory) the key is empty: the seal
catches edits, and whoever can write there can write commits too. In Redis, which a
system may share with clients that may not write its commits, the key is one the
commit store holds (``CheckpointKey``): a checkpoint forged there, its seal recomputed
without the key, is not acted on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy import Connection, bindparam, delete, select

from runtime.ids import ThreadId
from runtime.ports import StreamCheckpoint
from storage.schema import checkpoints
from storage.sql_engine import SQL_DIALECTS, Database, upsert_replace
from storage.sql_errors import translate

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("ratchet.storage.checkpoints")


class MemoryCheckpointStore:
    """Checkpoints in a dict, kept encoded like the durable ones."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        text = self._data.get(thread)
        return unseal(thread, text) if text is not None else None

    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None:
        self._data[thread] = seal(thread, checkpoint)

    async def delete(self, thread: ThreadId) -> None:
        self._data.pop(thread, None)


class SqlCheckpointStore:
    """Checkpoints in ``ratchet_checkpoints``; ``where`` is the redacted store URL.

    Given the store's ``Database``, writes share the store's writer (on SQLite its
    one writer thread and file lock, so they never contend for SQLite's lock with
    the store's own transactions); given a bare engine, they run over it.
    """

    def __init__(self, engine: AsyncEngine | Database, where: str) -> None:
        self.db = engine if isinstance(engine, Database) else Database(engine)
        self.where = where

    @property
    def engine(self) -> AsyncEngine:
        return self.db.engine

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        try:
            text = await self.db.read(_get_body, thread)
        except Exception as exc:
            _warn("get", thread, translate(exc, self.where))
            return None
        return unseal(thread, text) if text is not None else None

    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None:
        row = {
            "thread_id": thread,
            "body": seal(thread, checkpoint),
            "updated": time.time_ns() // 1000,
        }
        await self._write("put", thread, _put_body, row)

    async def delete(self, thread: ThreadId) -> None:
        await self._write("delete", thread, _delete_body, thread)

    async def _write(
        self, what: str, thread: ThreadId, body: Callable[..., None], arg: Any
    ) -> None:
        try:
            await self.db.write(body, arg)
        except Exception as exc:
            _warn(what, thread, translate(exc, self.where))


_c = checkpoints.c
_GET = select(_c.body).where(_c.thread_id == bindparam("thread"))
_DELETE = delete(checkpoints).where(_c.thread_id == bindparam("thread"))
_PUT = {d: upsert_replace(d, checkpoints, "thread_id", ["body", "updated"]) for d in SQL_DIALECTS}


def _get_body(conn: Connection, thread: ThreadId) -> str | None:
    text: str | None = conn.execute(_GET, {"thread": thread}).scalar()
    return text


def _put_body(conn: Connection, row: dict[str, Any]) -> None:
    with conn.begin():
        conn.execute(_PUT[conn.dialect.name], row)


def _delete_body(conn: Connection, thread: ThreadId) -> None:
    with conn.begin():
        conn.execute(_DELETE, {"thread": thread})


def _digest(thread: str, body: str, key: bytes) -> str:
    text = f"{thread}\n{body}".encode("utf-8", "surrogatepass")
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def seal(thread: str, checkpoint: StreamCheckpoint, key: bytes = b"") -> str:
    """The stored text of a checkpoint: its seal under ``key``, a newline, its JSON."""
    body = checkpoint.model_dump_json()
    return f"{_digest(thread, body, key)}\n{body}"


def unseal(thread: str, text: str, key: bytes = b"") -> StreamCheckpoint | None:
    """The checkpoint ``seal`` stored for ``thread`` under ``key``, or None (logged) if it
    is not one."""
    digest, _, body = text.partition("\n")
    if not hmac.compare_digest(
        digest.encode("utf-8", "surrogatepass"), _digest(thread, body, key).encode()
    ):
        _warn("check", thread, ValueError("its digest does not match: not acted on"))
        return None
    try:
        return StreamCheckpoint.model_validate_json(body)
    except ValidationError as exc:
        _warn("decode", thread, exc)
        return None


def _warn(what: str, thread: str, error: Exception) -> None:
    log.warning("stream checkpoint %s for thread %s failed (ignored): %s", what, thread, error)
