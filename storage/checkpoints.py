"""StreamCheckpointStore: in memory and on SQL. Best effort by contract (DESIGN §4).

A checkpoint only shortens the first recovered step, so every failure here —
server down, a record that no longer decodes — is logged and swallowed: ``get``
then answers None and the Run simply infers again. Nothing is ever raised into a Run.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime.ids import ThreadId
from runtime.ports import StreamCheckpoint
from storage.schema import checkpoints
from storage.sql_engine import translate, upsert_replace

log = logging.getLogger("ratchet.storage.checkpoints")


class MemoryCheckpointStore:
    """Checkpoints in a dict, kept encoded like the durable ones."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        text = self._data.get(thread)
        return _decode(thread, text) if text is not None else None

    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None:
        self._data[thread] = checkpoint.model_dump_json()

    async def delete(self, thread: ThreadId) -> None:
        self._data.pop(thread, None)


class SqlCheckpointStore:
    """Checkpoints in ``ratchet_checkpoints``; ``where`` is the redacted store URL."""

    def __init__(self, engine: AsyncEngine, where: str) -> None:
        self.engine = engine
        self.where = where

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        stmt = select(checkpoints.c.body).where(checkpoints.c.thread_id == thread)
        try:
            async with self.engine.connect() as conn:
                text = (await conn.execute(stmt)).scalar()
        except Exception as exc:
            _warn("get", thread, translate(exc, self.where))
            return None
        return _decode(thread, text) if text is not None else None

    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None:
        row = {
            "thread_id": thread,
            "body": checkpoint.model_dump_json(),
            "updated": time.time_ns() // 1000,
        }
        dialect = self.engine.dialect.name
        stmt = upsert_replace(dialect, checkpoints, "thread_id", ["body", "updated"])
        await self._write("put", thread, stmt.values(row))

    async def delete(self, thread: ThreadId) -> None:
        stmt = delete(checkpoints).where(checkpoints.c.thread_id == thread)
        await self._write("delete", thread, stmt)

    async def _write(self, what: str, thread: ThreadId, stmt: object) -> None:
        try:
            async with self.engine.begin() as conn:
                await conn.execute(stmt)  # type: ignore[call-overload]
        except Exception as exc:
            _warn(what, thread, translate(exc, self.where))


def _decode(thread: str, text: str) -> StreamCheckpoint | None:
    try:
        return StreamCheckpoint.model_validate_json(text)
    except ValidationError as exc:
        _warn("decode", thread, exc)
        return None


def _warn(what: str, thread: str, error: Exception) -> None:
    log.warning("stream checkpoint %s for thread %s failed (ignored): %s", what, thread, error)
