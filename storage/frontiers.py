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
"""Threads held at most: a host's planned groups (``sql_txn.Plan``) need the frontier
of every Run it drives, so this is about how many Runs one host drives before its
groups start reading rows first (20,000 Runs on two hosts: 10,000 each)."""
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

    Ended and awaiting Runs are not kept: an ended one is rarely read again, and an
    awaiting one holds nothing in memory (ten thousand parked Runs must not fill every
    host's cache: ``benchmarks.parked``); the next way in reads the row first
    (``sql_txn.Plan`` meets a row the cache does not know), decoding it once.
    """

    def __init__(self, entries: int = DEFAULT_ENTRIES, chars: int = DEFAULT_CHARS) -> None:
        self.max_entries = entries
        self.max_chars = chars
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
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
        self._put(thread, _Entry(text, frontier, checksum or ""))
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
        self._put(thread, _Entry(text, head, checksum))
        return text, checksum

    def _get(self, thread: str) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(thread)
            if entry is not None:
                self._entries.move_to_end(thread)
            return entry

    def _put(self, thread: str, entry: _Entry) -> None:
        with self._lock:
            old = self._entries.pop(thread, None)
            if old is not None:
                self._chars -= len(old.text)
            resting = entry.frontier.ended or isinstance(entry.frontier.run_state, AwaitingState)
            if resting or len(entry.text) > self.max_chars:
                return
            self._entries[thread] = entry
            self._chars += len(entry.text)
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                _, evicted = self._entries.popitem(last=False)
                self._chars -= len(evicted.text)

    def __len__(self) -> int:
        return len(self._entries)
