"""The thread stream a client follows: status snapshot, committed facts, then live events.

``follow`` gives, in order: a ``thread_status`` snapshot frame; every committed fact
after the client's cursor (re-read from the store, so nothing is lost while it was
away); then live deltas and facts from the bus, with a status frame on every change.
Facts carry their offset ``"seq:index"``; a client reconnects with the last offset it
saw and receives each later fact exactly once. Without a bus the store is polled.
Every fact served is read from the store, which verifies its records: a fact on the
bus only says that a commit landed, and the stream then reads it (deltas, which no
store holds, are the one thing served from the bus as they come).

The bus is best effort, the store is the truth. A bus that fails or does not answer
(down, hung) makes the stream follow the store instead, trying the bus again every
``bus_retry_s``; when it answers the stream goes back to it, catching up from the
store first. A bus that is up but quiet for ``idle_check_s`` while the store holds
facts after the cursor (a publish was lost) is filled from the store. Facts are
deduplicated by offset throughout, so none is lost or repeated; only deltas published
while the bus was away are missed.

A thread pruned (``storage.retention``) past the cursor no longer keeps the facts after
it up to its anchor: the follower says so with a ``pruned`` frame (``pruned_through``:
the seq they went up to) where they would have come, never a silent gap, and goes on
with the facts kept. One that waited for an end that was pruned stops there, its last
frames ``pruned`` and the thread's status. (A cursor inside the last record pruned is
taken as having seen it whole: the store keeps no count of that record's facts.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from runtime.base import Frozen
from runtime.events import Delta, Fact
from runtime.ids import ThreadId
from runtime.lifecycle import ThreadStatus
from runtime.limits import joined
from runtime.patience import patiently
from runtime.ports import BusEvent, CommitStore, LiveBus
from runtime.rules import stamp_facts

log = logging.getLogger("ratchet.stream")
REST_FACTS = frozenset({"awaiting", "run_finished", "run_failed"})
STORE_PATIENCE_S = 60.0
"""How long a follower waits out a store outage (it pauses, as the Runs do) before it
ends with StoreUnavailable."""


class Frame(Frozen):
    type: Literal["thread_status", "fact", "delta", "pruned"]
    offset: str | None = None
    """For facts: ``"seq:index"``, the cursor to reconnect after."""
    status: ThreadStatus | None = None
    event: Fact | Delta | None = None
    pruned_through: int | None = None
    """For ``pruned``: the facts after the cursor up to this seq were pruned, and are
    not served (a reconnect from the same cursor is told again: it still misses them)."""


class _Gap(NamedTuple):
    """Records after the cursor's, up to ``through``, that the store no longer keeps."""

    through: int


_PAST = 1 << 62
"""A fact index past any record's: the cursor after a gap is past its last record."""


def _served(item: Fact | _Gap) -> tuple[Frame, tuple[int, int]]:
    """The frame of a stored item, and the cursor after it."""
    if isinstance(item, _Gap):
        return Frame(type="pruned", pruned_through=item.through), (item.through, _PAST)
    return from_fact(item), (item.seq, item.index)


def _moved_on(frame: Frame, cursor: tuple[int, int]) -> tuple[int, int]:
    """The cursor after a frame a live source served."""
    if frame.offset is not None:
        return parse_offset(frame.offset)
    if frame.pruned_through is not None:
        return (frame.pruned_through, _PAST)
    return cursor


def fact_offset(fact: Fact) -> str:
    return f"{fact.seq}:{fact.index}"


def parse_offset(offset: str | None) -> tuple[int, int]:
    """``"seq:index"`` → (seq, index); None → before everything. Bad input raises ValueError."""
    if offset is None:
        return (0, -1)
    if not isinstance(offset, str):
        raise ValueError(f"stream offset {offset!r:.60} must be text like 'SEQ:INDEX'")
    seq, sep, index = offset.partition(":")
    if not sep or not _digits(seq) or not _digits(index):
        raise ValueError(f"stream offset {offset!r} must look like 'SEQ:INDEX'")
    if len(seq) > 18 or len(index) > 18:  # a store's integers are 64-bit
        raise ValueError(f"stream offset {offset[:60]!r}: SEQ and INDEX are below 10**18")
    return (int(seq), int(index))


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` takes superscripts and other scripts' digits."""
    return text.isascii() and text.isdigit()


def check_cursor(offset: str | None, version: int) -> tuple[int, int]:
    """The parsed cursor, if it lies within a thread at ``version``; else ValueError. A
    thread's version only grows, so a cursor past it names another thread (or a fork
    with fewer commits), and following it would wait for facts it can never be after."""
    cursor = parse_offset(offset)
    if cursor[0] > version:
        raise ValueError(
            f"stream offset {offset!r} is past the thread's last commit (seq {version})"
        )
    return cursor


async def follow(
    store: CommitStore,
    thread: ThreadId,
    after: str | None = None,
    *,
    bus: LiveBus | None = None,
    until_rest: bool = True,
    poll_s: float = 0.05,
    idle_check_s: float = 2.0,
    bus_retry_s: float = 1.0,
    bus_timeout_s: float = 1.0,
) -> AsyncGenerator[Frame, None]:
    """Frames for ``thread`` after the cursor ``after``; stops at rest if ``until_rest``."""
    parse_offset(after)  # a malformed cursor fails before the store is asked
    terms = _Terms(idle_check_s, bus_retry_s, bus_timeout_s, until_rest)
    frontier = await patiently(lambda: store.load(thread), STORE_PATIENCE_S, log)
    cursor = check_cursor(after, frontier.version)
    yield Frame(type="thread_status", status=frontier.status)
    # the bus's head before the store is read: whatever is published from here on, the
    # deltas of an inference running now among it, comes from the bus
    head = await _bus_head(bus, thread, terms) if bus is not None else None
    at_rest = moved = False
    async for fact in _stored_facts(store, thread, cursor, frontier.version):
        frame, cursor = _served(fact)
        if isinstance(fact, _Gap):
            yield frame
            continue
        at_rest = fact.type in REST_FACTS
        moved = fact.seq > frontier.version  # committed after the load: it is stale
        yield frame
        if until_rest and at_rest and moved:
            return  # the rest that came after the load: not a later Run's, started since
    if until_rest and (at_rest or (not moved and _rests(frontier))):
        return
    live = _live(store, thread, cursor, bus, head, poll_s, terms)
    async with contextlib.aclosing(live):
        try:
            async for frame in live:
                yield frame
                event = frame.event
                if until_rest and isinstance(event, Fact) and event.type in REST_FACTS:
                    return
        except _KeptAllSeen as rested:  # the status is what the store keeps of the end
            if rested.gap is not None:
                yield _served(rested.gap)[0]
            yield Frame(type="thread_status", status=rested.status)


def _rests(frontier: Any) -> bool:
    """The thread was at rest when loaded. Called when nothing committed since (the read
    after the load found nothing later): the client has every fact the store keeps,
    whether its cursor reached the head or the records up to it were pruned."""
    state = frontier.run_state
    return state is not None and state.kind != "running"


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
    store: CommitStore, thread: ThreadId, cursor: tuple[int, int], version: int = 0
) -> AsyncIterator[Fact | _Gap]:
    """The facts kept after ``cursor``, first a ``_Gap`` if records after the cursor's
    were pruned. ``version``: a head read before the log (the records up to it that the
    read does not return were pruned), 0 if none was."""
    after = max(cursor[0] - 1, 0)
    records = await patiently(lambda: store.read(thread, after_seq=after), STORE_PATIENCE_S, log)
    # a read after ``after`` returns the records kept from there: any it skips past the
    # cursor's own record went with a prune (records are contiguous and never removed
    # otherwise), and the reader must hear of them, not find the next Run's facts silently
    first = records[0].seq if records else version + 1
    if first > cursor[0] + 1:
        yield _Gap(first - 1)
    for record in records:
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
    terms: _Terms,
) -> AsyncGenerator[Frame, None]:
    """Live frames: from the bus while it answers, else from the store. ``head`` is the
    bus's head taken before the store was read (None: the bus did not answer then)."""
    while True:
        if bus is not None and head is not None:
            # catch up from the store first: facts committed before the head
            async for fact in _stored_facts(store, thread, cursor):
                frame, cursor = _served(fact)
                yield frame
            async for frame in _from_bus(store, thread, cursor, bus, head, terms):
                cursor = _moved_on(frame, cursor)
                yield frame
            log.info("live bus unavailable for %s: following the store", thread)
        async for frame in _poll(store, thread, cursor, poll_s, terms, bus):
            cursor = _moved_on(frame, cursor)
            yield frame
        head = await _bus_head(bus, thread, terms) if bus is not None else None


@dataclass(frozen=True)
class _Terms:
    idle_check_s: float
    bus_retry_s: float
    bus_timeout_s: float
    until_rest: bool


class _KeptAllSeen(Exception):
    """The thread is at rest and the store keeps no fact after the cursor, although its
    end was never served: the records up to it were pruned while the client followed."""

    def __init__(self, status: ThreadStatus, gap: _Gap | None) -> None:
        super().__init__(status.state)
        self.status, self.gap = status, gap


async def _check_pruned(
    store: CommitStore, thread: ThreadId, cursor: tuple[int, int], until_rest: bool
) -> _Gap | None:
    """Called when a read after ``cursor`` found nothing: the gap, if the records after
    it were pruned through the head (a read of the log alone cannot tell that from no
    commit since), and, for a follower that stops at rest, _KeptAllSeen if the thread
    rests. The head is read first: any record up to it is then read back, or was pruned."""
    head = await patiently(lambda: store.load_head(thread), STORE_PATIENCE_S, log)
    kept: list[Fact | _Gap] = []
    if head.version > cursor[0]:  # else nothing was committed past the cursor: no read
        kept = [item async for item in _stored_facts(store, thread, cursor, head.version)]
    if any(isinstance(item, Fact) for item in kept):
        return None  # committed since: the next read serves them (and a gap before them)
    gap = next((item for item in kept if isinstance(item, _Gap)), None)
    if until_rest and _rests(head):
        raise _KeptAllSeen(head.status, gap)
    return gap


async def _bus_head(bus: LiveBus, thread: ThreadId, terms: _Terms) -> str | None:
    """The bus's head for ``thread``, or None if it fails or does not answer in time."""
    try:
        return await asyncio.wait_for(bus.head(thread), terms.bus_timeout_s)
    except Exception as exc:  # a bus down or hung: the store serves meanwhile
        log.debug("live bus head for %s failed: %r", thread, exc)
        return None


async def _from_bus(
    store: CommitStore,
    thread: ThreadId,
    cursor: tuple[int, int],
    bus: LiveBus,
    head: str,
    terms: _Terms,
) -> AsyncIterator[Frame]:
    """Frames until the bus fails: its deltas, and the store's facts whenever the bus
    announces one or is quiet for ``idle_check_s``."""
    queue: asyncio.Queue[BusEvent | BaseException] = asyncio.Queue(maxsize=1024)
    pump = asyncio.create_task(_pump(bus.subscribe(thread, after=head), queue))
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), terms.idle_check_s)
            except TimeoutError:  # quiet: did the bus miss a fact?
                got = False
                async for fact in _stored_facts(store, thread, cursor):
                    (frame, cursor), got = _served(fact), True
                    yield frame
                if not got and (
                    gap := await _check_pruned(store, thread, cursor, terms.until_rest)
                ):
                    frame, cursor = _served(gap)
                    yield frame
                continue
            if isinstance(item, BaseException):
                return  # the bus failed: the caller follows the store
            event = item.event
            if not isinstance(event, Fact):
                yield Frame(type="delta", event=event)
                continue
            if (event.seq, event.index) <= cursor:
                continue  # already delivered from the store
            # The bus says a commit landed; the facts served are the store's, read from
            # the cursor up to the one announced (which also fills whatever the bus
            # dropped): a fact only the bus holds (forged, or from a commit that never
            # was) is never served. The whole commit announced, at once (the bus has its
            # facts together: one read per commit, not per fact); not past it: deltas
            # published after a later commit landed still come before that commit's facts.
            announced = event.seq
            async for fact in _stored_facts(store, thread, cursor):
                if isinstance(fact, Fact) and fact.seq > announced:
                    break  # (a gap is served whatever its end: the facts in it are gone)
                frame, cursor = _served(fact)
                yield frame
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump


async def _pump(
    events: AsyncIterator[BusEvent], queue: asyncio.Queue[BusEvent | BaseException]
) -> None:
    try:
        async for item in events:
            await queue.put(item)
        await queue.put(EOFError("the bus subscription ended"))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # delivered to the reader, which falls back to the store
        await queue.put(exc)


async def _poll(
    store: CommitStore,
    thread: ThreadId,
    cursor: tuple[int, int],
    poll_s: float,
    terms: _Terms,
    bus: LiveBus | None,
) -> AsyncIterator[Frame]:
    """Facts from the store; returns (to try the bus again) every ``bus_retry_s``."""
    delay = poll_s
    loop = asyncio.get_running_loop()
    retry_at = loop.time() + terms.bus_retry_s
    while True:
        got = False
        async for fact in _stored_facts(store, thread, cursor):
            (frame, cursor), got = _served(fact), True
            yield frame
        if bus is not None and loop.time() >= retry_at:
            return
        quiet = not got and delay >= 1.0  # for a while: pruned under the follower?
        if quiet and (gap := await _check_pruned(store, thread, cursor, terms.until_rest)):
            frame, cursor = _served(gap)
            yield frame
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
        # the halves of a character cut between two deltas, made one (runtime.limits.joined)
        return joined((self._parts.get((run_id, step), (0, ""))[1],))
