"""Live output off the commit path: facts and deltas go to the bus from a queue.

A commit never waits for the bus. Each published batch is queued (bounded) and one
background task per publisher sends it on, in order; a bus that is slow, hung or down
only fills the queue, and once it is full new events are dropped (counted, logged
once a while). Nothing is lost by it that matters: facts are re-read from the store
by any follower (``runtime.stream``), and a lost delta costs a flicker of live text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

from runtime.events import Delta, Fact
from runtime.ids import ThreadId
from runtime.ports import LiveBus

log = logging.getLogger("ratchet.publish")
DEFAULT_CAPACITY = 10_000
"""Events queued at most; beyond it new ones are dropped."""
WARN_EVERY_S = 30.0


class Publisher:
    """One per process or runner: every engine of it offers its events here."""

    def __init__(self, bus: LiveBus, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a publisher's capacity must be at least 1")
        self.bus = bus
        self.capacity = capacity
        self.dropped = 0
        """Events dropped because the queue was full."""
        self.failed = 0
        """Batches the bus refused (published to nobody)."""
        self._queue: deque[tuple[ThreadId, Fact | Delta]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._warned = 0.0

    def offer(self, thread: ThreadId, events: Sequence[Fact | Delta]) -> None:
        """Queue ``events`` for the bus; never waits, never raises."""
        room = self.capacity - len(self._queue)
        if room < len(events):
            self.dropped += len(events) - max(room, 0)
            self._warn(f"live bus queue full; {self.dropped} events dropped so far")
            events = events[: max(room, 0)]
        self._queue.extend((thread, e) for e in events)
        if self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._pump())

    async def flush(self) -> None:
        """Wait until everything queued so far has been sent (or refused)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _pump(self) -> None:
        while self._queue:
            batch: dict[ThreadId, list[Fact | Delta]] = {}
            while self._queue:
                thread, event = self._queue.popleft()
                batch.setdefault(thread, []).append(event)
            for thread, events in batch.items():
                try:
                    await self.bus.publish(thread, events)
                except Exception as exc:  # best effort: followers re-read facts from the store
                    self.failed += 1
                    self._warn(f"live bus publish failed for {thread}: {exc}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(message)
