"""The thread stream a client follows: status snapshot, committed facts, then live events.

``follow`` gives, in order: a ``thread_status`` snapshot frame; every committed fact
after the client's cursor (re-read from the store, so nothing is lost while it was
away); then live deltas and facts from the bus, with a status frame on every change.
Facts carry their offset ``"seq:index"``; a client reconnects with the last offset it
saw and receives each later fact exactly once. Without a bus the store is polled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

from runtime.base import Frozen
from runtime.commit import stamp_facts
from runtime.events import Delta, Fact
from runtime.ids import ThreadId
from runtime.lifecycle import ThreadStatus
from runtime.ports import CommitStore, LiveBus

REST_FACTS = frozenset({"awaiting", "run_finished", "run_failed"})


class Frame(Frozen):
    type: Literal["thread_status", "fact", "delta"]
    offset: str | None = None
    """For facts: ``"seq:index"``, the cursor to reconnect after."""
    status: ThreadStatus | None = None
    event: Fact | Delta | None = None


def fact_offset(fact: Fact) -> str:
    return f"{fact.seq}:{fact.index}"


def parse_offset(offset: str | None) -> tuple[int, int]:
    """``"seq:index"`` → (seq, index); None → before everything. Bad input raises ValueError."""
    if offset is None:
        return (0, -1)
    seq, sep, index = offset.partition(":")
    if not sep or not seq.isdigit() or not index.isdigit():
        raise ValueError(f"stream offset {offset!r} must look like 'SEQ:INDEX'")
    return (int(seq), int(index))


async def follow(
    store: CommitStore,
    thread: ThreadId,
    after: str | None = None,
    *,
    bus: LiveBus | None = None,
    until_rest: bool = True,
    poll_s: float = 0.05,
) -> AsyncIterator[Frame]:
    """Frames for ``thread`` after the cursor ``after``; stops at rest if ``until_rest``."""
    cursor = parse_offset(after)
    frontier = await store.load(thread)
    yield Frame(type="thread_status", status=frontier.status)
    head = await bus.head(thread) if bus is not None else None
    at_rest = False
    async for fact in _stored_facts(store, thread, cursor):
        cursor = (fact.seq, fact.index)
        at_rest = fact.type in REST_FACTS
        yield from_fact(fact)
    if until_rest and (at_rest or _rests(frontier, cursor)):
        return
    live = _live(store, thread, cursor, bus, head, poll_s)
    async for frame in live:
        yield frame
        event = frame.event
        if until_rest and isinstance(event, Fact) and event.type in REST_FACTS:
            return


def _rests(frontier: Any, cursor: tuple[int, int]) -> bool:
    """The thread is at rest and the client has seen everything committed."""
    state = frontier.run_state
    return state is not None and state.kind != "running" and cursor[0] >= frontier.version


def from_fact(fact: Fact) -> Frame:
    if fact.type == "status":
        return Frame(
            type="thread_status",
            offset=fact_offset(fact),
            status=ThreadStatus.model_validate(fact.data["status"]),
            event=fact,
        )
    return Frame(type="fact", offset=fact_offset(fact), event=fact)


async def _stored_facts(
    store: CommitStore, thread: ThreadId, cursor: tuple[int, int]
) -> AsyncIterator[Fact]:
    for record in await store.read(thread, after_seq=max(cursor[0] - 1, 0)):
        for fact in stamp_facts(record.commit, record.seq):
            if (fact.seq, fact.index) > cursor:
                yield fact


async def _live(
    store: CommitStore,
    thread: ThreadId,
    cursor: tuple[int, int],
    bus: LiveBus | None,
    head: str | None,
    poll_s: float,
) -> AsyncIterator[Frame]:
    if bus is None:
        async for frame in _poll(store, thread, cursor, poll_s):
            yield frame
        return
    async for item in bus.subscribe(thread, after=head):
        event = item.event
        if not isinstance(event, Fact):
            yield Frame(type="delta", event=event)
            continue
        if (event.seq, event.index) <= cursor:
            continue  # already delivered from the store
        if _gap(cursor, event):
            # the bus is best effort: fill what it dropped from the store, in order
            async for fact in _stored_facts(store, thread, cursor):
                if (fact.seq, fact.index) >= (event.seq, event.index):
                    break
                cursor = (fact.seq, fact.index)
                yield from_fact(fact)
        cursor = (event.seq, event.index)
        yield from_fact(event)


def _gap(cursor: tuple[int, int], event: Fact) -> bool:
    """Could a fact lie between the cursor and this one? (Commits without facts leave
    harmless seq gaps; a store read settles it.)"""
    if event.seq == cursor[0]:
        return event.index > cursor[1] + 1
    return event.seq > cursor[0] + 1 or event.index > 0


async def _poll(
    store: CommitStore, thread: ThreadId, cursor: tuple[int, int], poll_s: float
) -> AsyncIterator[Frame]:
    delay = poll_s
    while True:
        got = False
        async for fact in _stored_facts(store, thread, cursor):
            cursor, got = (fact.seq, fact.index), True
            yield from_fact(fact)
        delay = poll_s if got else min(delay * 2, 1.0)
        await asyncio.sleep(delay)


class LiveText:
    """Client-side view of streamed text: a retried inference replaces its partial text."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], tuple[int, str]] = {}

    def add(self, delta: Delta) -> None:
        key = (delta.run_id, delta.step)
        attempt, text = self._parts.get(key, (delta.attempt, ""))
        if delta.attempt > attempt:
            text = ""  # a newer attempt of the same Step starts over
        elif delta.attempt < attempt:
            return  # a late delta of an abandoned attempt
        self._parts[key] = (delta.attempt, text + delta.text)

    def text(self, run_id: str, step: int) -> str:
        return self._parts.get((run_id, step), (0, ""))[1]
