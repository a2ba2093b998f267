"""StreamCheckpointStore on Redis: best effort, so every failure is logged, never raised.

A checkpoint holds the partial text and tool-call arguments of an interrupted
inference (DESIGN §4). Losing one only costs a repeated inference, so a Run must
never fail because this store did: ``get`` answers None, ``put``/``delete`` do
nothing, and a warning says why.

Key: ``P:checkpoint:T`` (a string holding the sealed StreamCheckpoint JSON, as
``storage.checkpoints.seal`` writes it: a checkpoint's tool calls are acted on), expiring after
``ttl_s`` so checkpoints of abandoned Runs do not accumulate. Sealed under the system's
``CheckpointKey`` (``storage.checkpoint_key``), read from the commit store: Redis may be
shared with clients that may not write the system's commits. Without one (``key=None``)
the seal is a digest, which catches edits and not forgeries.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from runtime.ids import ThreadId
from runtime.ports import StreamCheckpoint
from storage.checkpoint_key import CheckpointKey
from storage.checkpoints import seal, unseal
from storage.redis_client import open_client, translated
from storage.url import redact

log = logging.getLogger("ratchet.storage.checkpoints")
T = TypeVar("T")

DEFAULT_CHECKPOINT_TTL_S = 24 * 3600


class RedisCheckpointStore:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        where: str = "redis",
        prefix: str = "ratchet",
        ttl_s: int | None = DEFAULT_CHECKPOINT_TTL_S,
        key: CheckpointKey | None = None,
    ) -> None:
        self.client = client
        self.where = where
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.key = key

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        prefix: str = "ratchet",
        ttl_s: int | None = DEFAULT_CHECKPOINT_TTL_S,
        key: CheckpointKey | None = None,
    ) -> RedisCheckpointStore:
        """No round trip: an unreachable server shows up as logged misses, not an error."""
        return cls(open_client(url), where=redact(url), prefix=prefix, ttl_s=ttl_s, key=key)

    async def _sealing_key(self) -> bytes | None:
        return b"" if self.key is None else await self.key.current()

    def _key(self, thread: str) -> str:
        return f"{self.prefix}:checkpoint:{thread}"

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        key = await self._sealing_key()
        if key is None:
            return None
        text = await self._best_effort("get", thread, lambda: self.client.get(self._key(thread)))
        return unseal(thread, text, key) if isinstance(text, str) else None  # decoded replies

    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None:
        key = await self._sealing_key()
        if key is None:
            return
        text = seal(thread, checkpoint, key)
        await self._best_effort(
            "put", thread, lambda: self.client.set(self._key(thread), text, ex=self.ttl_s)
        )

    async def delete(self, thread: ThreadId) -> None:
        await self._best_effort("delete", thread, lambda: self.client.delete(self._key(thread)))

    async def close(self) -> None:
        await self._best_effort("close", ThreadId("-"), self.client.aclose)

    async def _best_effort(
        self, what: str, thread: ThreadId, op: Callable[[], Awaitable[T]]
    ) -> T | None:
        try:
            with translated(self.where):
                return await op()
        except Exception as exc:  # best effort by contract: a checkpoint never fails a Run
            log.warning("stream checkpoint %s for %s failed: %s", what, thread, exc)
            return None
