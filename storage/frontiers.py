"""Stored frontiers: decoding, encoding, and the per-process cache that makes both cheap.

Decoding a frontier re-validates the whole of it (message history included) and
encoding it writes the whole history again; both grow with the thread and were the
largest CPU costs of a load and of a group transaction. Yet most of the time the
text in the row is the text this process wrote a moment ago, and the new frontier
differs from the last by a few appended messages.

``FrontierCache`` keeps, per thread, the last text seen, the frontier decoded from
it and (when this process encoded it) the JSON of its messages. A frontier is
reused only when the row's text is *equal* to the cached text: a row rewritten by
another process, left by a rolled-back transaction or edited by hand has other
text, and is decoded (and fails closed with CorruptRecord) exactly as if there were
no cache. Every stored frontier has a checksum beside it (``runtime.integrity``):
text that does not match its checksum is CorruptRecord, cached or not. Frontiers are
immutable, so one object can be shared. Encoding reuses the cached messages JSON
when the old messages are a prefix of the new ones, and encodes only the rest of the
frontier and the new messages.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

from pydantic import TypeAdapter, ValidationError

from runtime.commit import Frontier
from runtime.errors import CorruptRecord
from runtime.integrity import check_frontier_text, frontier_checksum
from runtime.messages import Message

DEFAULT_ENTRIES = 4096
DEFAULT_CHARS = 64 << 20
"""Text held by the cache at most (the decoded objects take a few times more)."""

_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)
_ALL_BUT_MESSAGES = {"messages"}


def decode_frontier(thread: str, text: str, version: int) -> Frontier:
    """A stored frontier, re-validated; fails closed with CorruptRecord."""
    try:
        frontier = Frontier.model_validate_json(text)
    except ValidationError as exc:
        detail = str(exc.errors()[0].get("msg", exc))
        raise CorruptRecord(thread, version, f"stored frontier: {detail}") from exc
    if frontier.thread_id != thread or frontier.version != version:
        raise CorruptRecord(thread, version, "stored frontier names another thread or version")
    return frontier


class _Entry(NamedTuple):
    text: str
    frontier: Frontier
    messages: str | None
    """The JSON array of ``frontier.messages`` as it appears in ``text``, if known."""
    checksum: str


class FrontierCache:
    """Frontiers by thread, least recently used evicted; safe to share between threads.

    Ended Runs are not kept: they are rarely read again, and a thread's next Run
    starts with a claim that reads the row first (``sql_txn.Plan`` meets a row the
    cache does not know), decoding it once.
    """

    def __init__(self, entries: int = DEFAULT_ENTRIES, chars: int = DEFAULT_CHARS) -> None:
        self.max_entries = entries
        self.max_chars = chars
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def decode(self, thread: str, text: str, version: int, checksum: str | None) -> Frontier:
        """The frontier stored as ``text`` (with ``checksum``) in the row at ``version``."""
        entry = self._get(thread)
        if (
            entry is not None
            and entry.checksum == checksum
            and entry.frontier.version == version
            and entry.text == text
        ):
            return entry.frontier
        check_frontier_text(thread, version, text, checksum)
        frontier = decode_frontier(thread, text, version)
        self._put(thread, _Entry(text, frontier, None, checksum or ""))
        return frontier

    def known(self, thread: str) -> Frontier | None:
        """The frontier this process last wrote or read for ``thread``."""
        entry = self._get(thread)
        return None if entry is None else entry.frontier

    def encode(self, thread: str, frontier: Frontier) -> tuple[str, str]:
        """The text to store for ``frontier`` and its checksum; remembered as decoding to it."""
        messages = _messages_json(frontier, self._get(thread))
        head = frontier.model_dump_json(exclude=_ALL_BUT_MESSAGES)
        text = f'{head[:-1]},"messages":{messages}}}'
        checksum = frontier_checksum(text)
        self._put(thread, _Entry(text, frontier, messages, checksum))
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
            if entry.frontier.ended or len(entry.text) > self.max_chars:
                return
            self._entries[thread] = entry
            self._chars += len(entry.text)
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                _, evicted = self._entries.popitem(last=False)
                self._chars -= len(evicted.text)

    def __len__(self) -> int:
        return len(self._entries)


def _messages_json(frontier: Frontier, prior: _Entry | None) -> str:
    """The messages array's JSON, reusing ``prior``'s when its messages are a prefix."""
    messages = frontier.messages
    if prior is not None and prior.messages is not None:
        old = prior.frontier.messages
        n = len(old)
        # A fold appends to the same tuple of message objects, so this is an identity
        # comparison per item in C; equal messages would encode equally anyway.
        if messages[:n] == old:
            if len(messages) == n:
                return prior.messages
            tail = ",".join(_MESSAGE.dump_json(m).decode() for m in messages[n:])
            return f"{prior.messages[:-1]}{',' if n else ''}{tail}]"
    return "[" + ",".join(_MESSAGE.dump_json(m).decode() for m in messages) + "]"
