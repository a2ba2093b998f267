"""The live bus: events of a Thread with offsets, so a client reconnects where it left off.

Two implementations with one API:

- ``EmbeddedBus``: in-process (one event loop), a bounded ring buffer per thread.
- ``RedisStreamBus``: one Redis Stream per thread (``P:stream:T``), capped with
  ``MAXLEN ~``; events are stored as JSON, never pickled.

``subscribe(thread, after=offset)`` yields ``BusEvent(offset, event)`` pairs: first
the retained events after ``offset``, then live ones as they are published.
``after=None`` means "only what is published from now on"; ``head(thread)`` gives
that offset up front, for a subscriber that must not miss what is published before
it first reads. Offsets are opaque strings that only grow within a thread (embedded:
a decimal counter; Redis: the stream entry id). A reconnecting client passes the
last offset it saw and receives each later event exactly once, unless the cap has
already dropped it. The bus is best effort by design: Facts are re-read from the
CommitStore by cursor, and a lost Delta costs nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from pydantic import TypeAdapter, ValidationError
from redis.typing import EncodableT, FieldT

from runtime.events import AgentEvent, Delta, Fact
from runtime.ids import ThreadId
from runtime.ports import BusEvent
from storage.redis_client import open_client, translated
from storage.url import redact

log = logging.getLogger("ratchet.storage.bus")

_EVENTS: TypeAdapter[Fact | Delta] = TypeAdapter(AgentEvent)
DEFAULT_CAPACITY = 10_000
"""Events retained per thread for reconnecting clients."""


# ---- embedded ---------------------------------------------------------------------------


@dataclass
class _Ring:
    items: deque[tuple[int, Fact | Delta]]
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    subscribers: int = 0

    def after(self, cursor: int) -> list[tuple[int, Fact | Delta]]:
        """Retained items with an offset above ``cursor``, oldest first."""
        newer: list[tuple[int, Fact | Delta]] = []
        for item in reversed(self.items):
            if item[0] <= cursor:
                break
            newer.append(item)
        newer.reverse()
        return newer

    def notify(self) -> None:
        # A fresh Event per publish: waiters of the old one wake, later ones wait anew.
        self.wakeup.set()
        self.wakeup = asyncio.Event()


class EmbeddedBus:
    """The default bus when no Redis is configured; lives in one process and one loop.

    Beyond ``max_threads`` rings, the least recently published thread that no started
    subscription is reading is forgotten, with its retained events (as the cap would).
    Offsets come from one counter shared by every thread, so they keep growing even
    when a ring is forgotten and later recreated.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_threads: int = 10_000) -> None:
        if capacity < 1 or max_threads < 1:
            raise ValueError("capacity and max_threads must be at least 1")
        self.capacity = capacity
        self.max_threads = max_threads
        self._rings: OrderedDict[str, _Ring] = OrderedDict()
        self._counter = itertools.count(1)
        self._last = 0
        self._closed = False

    async def publish(self, thread: ThreadId, events: Sequence[Fact | Delta]) -> None:
        if not events:
            return
        ring = self._ring(thread)
        for event in events:
            self._last = next(self._counter)
            ring.items.append((self._last, event))
        ring.notify()
        self._rings.move_to_end(thread)
        self._evict_idle()

    def subscribe(self, thread: ThreadId, after: str | None = None) -> AsyncIterator[BusEvent]:
        # The start is fixed now, not at the first iteration, so nothing published in
        # between is missed by a subscriber that asked for "only new ones".
        cursor = self._last if after is None else _embedded_offset(after)
        return self._follow(thread, cursor)

    async def head(self, thread: ThreadId) -> str:
        """An offset after which only events published from now on will come."""
        return str(self._last)

    async def close(self) -> None:
        """End every subscription (their iteration stops) and drop what is retained."""
        self._closed = True
        for ring in self._rings.values():
            ring.notify()
        self._rings.clear()

    async def _follow(self, thread: ThreadId, cursor: int) -> AsyncIterator[BusEvent]:
        ring = self._ring(thread)
        ring.subscribers += 1
        try:
            while not self._closed:
                wakeup = ring.wakeup
                newer = ring.after(cursor)
                for offset, event in newer:
                    cursor = offset
                    yield BusEvent(str(offset), event)
                if not newer and not self._closed:
                    await wakeup.wait()
        finally:
            ring.subscribers -= 1

    def _ring(self, thread: str) -> _Ring:
        ring = self._rings.get(thread)
        if ring is None:
            ring = self._rings[thread] = _Ring(deque(maxlen=self.capacity))
        return ring

    def _evict_idle(self) -> None:
        """Forget the least recently published threads nobody is following."""
        excess = len(self._rings) - self.max_threads
        if excess <= 0:
            return
        idle = (t for t, r in self._rings.items() if r.subscribers == 0)
        for thread in list(itertools.islice(idle, excess)):
            del self._rings[thread]


def _embedded_offset(after: str) -> int:
    try:
        return int(after)
    except ValueError:
        raise ValueError(f"embedded bus offsets are decimal integers, got {after!r}") from None


# ---- Redis Streams ----------------------------------------------------------------------


class RedisStreamBus:
    """A capped Redis Stream per thread; reconnecting clients resume from a stream id."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        where: str = "redis",
        prefix: str = "ratchet",
        capacity: int = DEFAULT_CAPACITY,
        ttl_s: int | None = 24 * 3600,
        block_ms: int = 1000,
        read_count: int = 500,
    ) -> None:
        self.client = client
        self.where = where
        self.prefix = prefix
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.block_ms = block_ms
        self.read_count = read_count

    @classmethod
    def connect(cls, url: str, *, block_ms: int = 1000, **options: Any) -> RedisStreamBus:
        """``options`` as the constructor's."""
        # The socket timeout must outlast a blocking read, or every quiet BLOCK would
        # surface as StoreUnavailable.
        client = open_client(url, socket_timeout=max(5.0, block_ms / 1000 + 2.0), what="Redis bus")
        return cls(client, where=redact(url), block_ms=block_ms, **options)

    def key(self, thread: str) -> str:
        return f"{self.prefix}:stream:{thread}"

    async def publish(self, thread: ThreadId, events: Sequence[Fact | Delta]) -> None:
        """One round trip per batch; raises StoreUnavailable (the engine logs and goes on).
        An event that cannot be encoded (a delta holding half a surrogate pair, as a
        gateway that splits an emoji across chunks sends) is left out alone, not its batch:
        the facts beside it still wake their followers."""
        encoded = [e for e in map(_encoded, events) if e is not None]
        if not encoded:
            return
        key = self.key(thread)
        with translated(self.where):
            async with self.client.pipeline(transaction=True) as pipe:
                for event in encoded:
                    fields: dict[FieldT, EncodableT] = {"e": event}
                    pipe.xadd(key, fields, maxlen=self.capacity, approximate=True)
                if self.ttl_s:
                    pipe.expire(key, self.ttl_s)  # streams of finished threads go away
                await pipe.execute()

    def subscribe(self, thread: ThreadId, after: str | None = None) -> AsyncIterator[BusEvent]:
        return self._follow(thread, after)

    async def close(self) -> None:
        with translated(self.where):
            await self.client.aclose()

    async def head(self, thread: ThreadId) -> str:
        """The newest entry's id: after it, only events published from now on will come."""
        # Resolving "$" once, up front, keeps events published between two blocking
        # reads: a second XREAD from "$" would skip them.
        with translated(self.where):
            last = await self.client.xrevrange(self.key(thread), count=1)
        return str(last[0][0]) if last else "0-0"

    async def _follow(self, thread: ThreadId, after: str | None) -> AsyncIterator[BusEvent]:
        key = self.key(thread)
        cursor = after if after is not None else await self.head(thread)
        while True:
            with translated(self.where):
                reply = await self.client.xread(
                    {key: cursor}, count=self.read_count, block=self.block_ms
                )
            for entry_id, fields in _entries(reply):
                cursor = entry_id
                event = _decode(key, entry_id, fields)
                if event is not None:
                    yield BusEvent(entry_id, event)


def _entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    """XREAD's entries for our one stream, under RESP2 (list) or RESP3 (dict)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (s[1] for s in reply)
    return [(str(entry_id), fields) for entries in streams for entry_id, fields in entries]


MAX_ENTRY_CHARS = 1 << 20
"""The largest entry a follower takes: a delta is a chunk of a stream (a Step's answer is
at most ``Limits.response_bytes``), a fact a note that the store has news. A larger one
was written by hand (anyone who can write to Redis can): skipped, never sent on whole
to every follower of the thread."""


def _decode(key: str, entry_id: str, fields: dict[str, str]) -> Fact | Delta | None:
    text = fields.get("e", "")
    if len(text) > MAX_ENTRY_CHARS:
        log.warning("skipping bus entry %s of %s: %d characters", entry_id, key, len(text))
        return None
    try:
        return _EVENTS.validate_json(text)
    except ValidationError as exc:
        log.warning("skipping unreadable bus entry %s of %s: %s", entry_id, key, exc)
        return None


def _encoded(event: Fact | Delta) -> str | None:
    try:
        return event.model_dump_json()
    except ValueError as exc:  # pydantic's serialization error: no JSON holds it
        log.warning("a %s event not published: %s", event.type, exc)
        return None
