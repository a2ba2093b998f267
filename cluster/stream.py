"""Following a thread's stream from a client: the store, plus the Redis bus when there is one.

``follow_thread`` wraps ``runtime.stream.follow`` (which falls back to the store while
the bus is down or hung, and fills from the store whatever the bus missed);
``StreamText`` assembles streamed text across retries and recoveries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from runtime.events import Delta, Fact
from runtime.ids import ThreadId
from runtime.ports import CommitStore
from runtime.stream import Frame, LiveText, follow, parse_offset

log = logging.getLogger("ratchet.client")
IDLE_CHECK_S = 2.0
"""With a live bus: after this long without a frame, the store is asked whether the
bus missed a fact (it is best effort)."""


async def follow_thread(
    store: CommitStore,
    thread: ThreadId,
    after: str | None = None,
    *,
    redis_url: str | None = None,
    until_rest: bool = True,
    idle_check_s: float = IDLE_CHECK_S,
) -> AsyncGenerator[Frame, None]:
    """``runtime.stream.follow`` over the Redis bus when there is one, else the store."""
    parse_offset(after)  # a malformed cursor is a ValueError before anything is opened
    bus = live_bus(redis_url)
    try:
        frames = follow(
            store, thread, after, bus=bus, until_rest=until_rest, idle_check_s=idle_check_s
        )
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
    finally:
        await close_bus(bus)


def live_bus(redis_url: str | None) -> Any:
    if not redis_url:
        return None
    from storage.bus import RedisStreamBus

    return RedisStreamBus.connect(redis_url, block_ms=500)


async def close_bus(bus: Any) -> None:
    if bus is not None:
        with contextlib.suppress(Exception):
            await bus.close()


class StreamText:
    """The text a followed thread streams, per (run, step), built from its frames.

    ``LiveText`` replaces the partial text of a retried inference (a newer attempt of
    the same Step). A Run whose execution was lost infers its Step again under a new
    engine, whose attempts start over; so when the thread goes running again, the
    text of Steps not yet committed starts over too. A Step is committed once its
    ``assistant_message`` fact has been seen: each model Step commits one, so a Run's
    Steps below the number of its assistant messages seen are committed, whether their
    deltas came before that fact or after it (the deltas come live, the facts from the
    store). Following from an offset, earlier facts are not counted: fewer Steps are
    known to be committed, never more.
    """

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], LiveText] = {}
        self._pending: set[tuple[str, int]] = set()
        self._answered: dict[str, int] = {}
        """Assistant messages seen per run: its Steps below this are committed."""
        self._running = False

    def add(self, frame: Frame) -> tuple[str, int] | None:
        """Take one frame; returns the (run, step) whose text changed, if any."""
        event = frame.event
        if frame.type == "thread_status" and frame.status is not None:
            running = frame.status.state == "running"
            if running and not self._running:  # a new execution: uncommitted text is void
                for key in self._pending:
                    self._parts.pop(key, None)
                self._pending.clear()
            self._running = running
        elif isinstance(event, Fact) and event.type == "assistant_message":
            self._answered[event.run_id] = self._answered.get(event.run_id, 0) + 1
            self._pending = {key for key in self._pending if key[0] != event.run_id}
        elif isinstance(event, Delta) and event.type == "text_delta":
            key = (event.run_id, event.step)
            self._parts.setdefault(key, LiveText()).add(event)
            if event.step >= self._answered.get(event.run_id, 0):
                self._pending.add(key)
            return key
        return None

    def text(self, run_id: str, step: int) -> str:
        part = self._parts.get((run_id, step))
        return part.text(run_id, step) if part is not None else ""
