"""Stored frontiers: decoding, encoding, and the per-process cache that makes both cheap.

A stored frontier is its head (``runtime.commit.frontier_text``, schema 3): the
messages are in the log, so a frontier's text and the work of encoding, checksumming
and decoding it do not grow with the thread's history. A frontier stored before
schema 3 holds its messages; it still decodes, and is kept as its head.

``FrontierCache`` keeps, per thread, the last text seen and the head decoded from it.
A head is reused only when the row's text is *equal* to the cached text: a row
rewritten by another process, left by a rolled-back transaction or edited by hand has
other text, and is decoded (and fails closed with CorruptRecord) exactly as if there
were no cache. Every stored frontier has a checksum beside it (``runtime.integrity``):
text that does not match its checksum is CorruptRecord, cached or not. Frontiers are
immutable, so one object can be shared.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

from pydantic import ValidationError

from runtime.commit import Frontier, frontier_text, head_only
from runtime.errors import CorruptRecord
from runtime.integrity import check_frontier_text, frontier_checksum
from runtime.lifecycle import AwaitingState

DEFAULT_ENTRIES = 16384
"""Threads held at most: a host's planned groups (``sql_plan.Plan``) need the frontier
of every Run it drives, so this is about how many Runs one host drives before its
groups start reading rows first (20,000 Runs on two hosts: 10,000 each)."""
DEFAULT_RESTING = 1024
"""Heads of threads at rest (ended or awaiting) held at most, apart from the rest, and
only as read: the thread is about to be acted on (its next Run's start, a resume)."""
DEFAULT_CHARS = 64 << 20
"""Text held by the cache at most (the decoded objects take a few times more)."""


def decode_frontier(thread: str, text: str, version: int) -> Frontier:
    """A stored frontier, re-validated; fails closed with CorruptRecord. One stored
    before schema 3 comes with its messages (``decode_head`` drops them)."""
    try:
        frontier = Frontier.model_validate_json(text)
    except ValidationError as exc:
        detail = str(exc.errors()[0].get("msg", exc))
        raise CorruptRecord(thread, version, f"stored frontier: {detail}") from exc
    if frontier.thread_id != thread or frontier.version != version:
        raise CorruptRecord(thread, version, "stored frontier names another thread or version")
    return frontier


def decode_head(thread: str, text: str, version: int) -> Frontier:
    """The head of a stored frontier (``decode_frontier`` without the messages)."""
    return head_only(decode_frontier(thread, text, version))


class _Entry(NamedTuple):
    text: str
    frontier: Frontier
    """A head (no messages)."""
    checksum: str


class FrontierCache:
    """Frontiers by thread, least recently used evicted; safe to share between threads.

    A thread at rest (its Run ended or awaiting) is not kept as written: an awaiting Run
    holds nothing in memory (ten thousand parked Runs must not fill every host's cache:
    ``benchmarks.parked``). It is kept as *read*, apart and at most ``resting`` of them:
    whoever reads a thread at rest is about to act on it (the start of its next Run, a
    resume), and that commit's group can then be planned (``sql_plan.plan_group``): a
    thread the cache does not know is planned as new, so one such Run sent its whole
    group the read-first way.
    """

    def __init__(
        self,
        entries: int = DEFAULT_ENTRIES,
        chars: int = DEFAULT_CHARS,
        resting: int = DEFAULT_RESTING,
    ) -> None:
        self.max_entries = entries
        self.max_chars = chars
        self.max_resting = resting
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._resting: OrderedDict[str, _Entry] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def decode(self, thread: str, text: str, version: int, checksum: str | None) -> Frontier:
        """The head stored as ``text`` (with ``checksum``) in the row at ``version``."""
        entry = self._get(thread)
        if (
            entry is not None
            and entry.checksum == checksum
            and entry.frontier.version == version
            and entry.text == text
        ):
            return entry.frontier
        check_frontier_text(thread, version, text, checksum)
        frontier = decode_head(thread, text, version)
        self._put(thread, _Entry(text, frontier, checksum or ""), read=True)
        return frontier

    def known(self, thread: str) -> Frontier | None:
        """The head this process last wrote or read for ``thread``."""
        entry = self._get(thread)
        return None if entry is None else entry.frontier

    def encode(self, thread: str, frontier: Frontier) -> tuple[str, str]:
        """The text to store for ``frontier`` (its head) and its checksum; remembered as
        decoding to it."""
        head = head_only(frontier)
        text = frontier_text(head)
        checksum = frontier_checksum(text)
        self._put(thread, _Entry(text, head, checksum), read=False)
        return text, checksum

    def _get(self, thread: str) -> _Entry | None:
        with self._lock:
            for entries in (self._entries, self._resting):
                entry = entries.get(thread)
                if entry is not None:
                    entries.move_to_end(thread)
                    return entry
            return None

    def _put(self, thread: str, entry: _Entry, *, read: bool) -> None:
        with self._lock:
            for entries in (self._entries, self._resting):
                old = entries.pop(thread, None)
                if old is not None:
                    self._chars -= len(old.text)
            if len(entry.text) > self.max_chars:
                return
            if not (entry.frontier.ended or isinstance(entry.frontier.run_state, AwaitingState)):
                entries, most = self._entries, self.max_entries
            elif read:
                entries, most = self._resting, self.max_resting
            else:
                return
            entries[thread] = entry
            self._chars += len(entry.text)
            while len(entries) > most:
                self._evict(entries)
            while self._chars > self.max_chars:  # the resting go first
                self._evict(self._resting if self._resting else self._entries)

    def _evict(self, entries: OrderedDict[str, _Entry]) -> None:
        _, evicted = entries.popitem(last=False)
        self._chars -= len(evicted.text)

    def __len__(self) -> int:
        return len(self._entries) + len(self._resting)
