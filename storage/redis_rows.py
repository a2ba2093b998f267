"""Decoding what the Redis store reads (``storage.redis_store``): rows, receipts,
summaries, a frontier head, the log as verified records."""

from __future__ import annotations

import re

from pydantic import ValidationError

from runtime.base import evolve
from runtime.commit import (
    Frontier,
    Receipt,
    head_only,
)
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import (
    RawRecord,
    check_frontier_text,
    check_head,
    page_end,
    verified_records,
)
from runtime.limits import printable
from runtime.ports import CommittedRecord, RunSummary

META = [
    "frontier",
    "version",
    "epoch",
    "owner",
    "checksum",
    "head",
    "pruned",
    "pruned_hash",
    "pruned_digest",
]
"""The meta fields a load reads (a snapshot the first eight)."""


def verified_frontier(
    thread: str,
    text: str | None,
    version: str | None,
    epoch: str | None,
    owner: str | None,
    checksum: str | None,
    head: str | None,
    n: int,
    last: str | None,
    anchor: tuple[int, str] | None,
) -> Frontier:
    """The stored frontier, as one atomic read found it with the head stored beside it,
    the hash list's length ``n`` and last entry, and the anchor of a pruned thread (the
    list begins after it); fails closed on any mismatch."""
    frontier = decode_frontier(thread, text, version, epoch, owner, checksum)
    pruned = anchor[0] if anchor else 0
    if frontier.version == 0 and (n or pruned):  # check_head takes version 0 as empty
        raise CorruptRecord(thread, 1, "the log has records but the thread has no frontier")
    at_head = last if n else anchor[1] if anchor else None
    check_head(thread, frontier, at_head if pruned + n == frontier.version else None)
    if frontier.version and head != frontier.head:
        raise CorruptRecord(thread, frontier.version, "the stored head is not the frontier's")
    return frontier


def decode_frontier(
    thread: str,
    text: str | None,
    version: str | None,
    epoch: str | None,
    owner: str | None,
    checksum: str | None,
) -> Frontier:
    """The stored frontier with the epoch and owner kept beside it (a claim moves them
    alone); fails closed on any mismatch.

    The frontier text holds the epoch and owner of the append that wrote it, and epochs
    only grow: the epoch beside it is at least that one, and the same epoch names the
    same owner (a claim moves both). So an epoch edited by hand — lowered to re-admit a
    fenced writer, or set alone — is caught; texts of an earlier layout hold epoch 0."""
    stored_version = number_of(thread, "version", version)
    current = number_of(thread, "owner epoch", epoch)
    if text is None:
        if stored_version:
            raise CorruptRecord(thread, stored_version, "the stored frontier is missing")
        if owner is not None and current == 0:
            raise CorruptRecord(thread, 0, "an owner at epoch 0")
        return Frontier(thread_id=ThreadId(thread), epoch=current, owner=owner)
    check_frontier_text(thread, stored_version, text, checksum)
    try:
        frontier = Frontier.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, stored_version, f"stored frontier: {first_error(exc)}") from exc
    if frontier.thread_id != thread or frontier.version != stored_version:
        raise CorruptRecord(thread, stored_version, "stored frontier names another thread/version")
    if current < frontier.epoch or (current == frontier.epoch and owner != frontier.owner):
        raise CorruptRecord(thread, stored_version, "the owner epoch is not the frontier's")
    # a layout 3 frontier holds messages
    return evolve(head_only(frontier), epoch=current, owner=owner)


def anchor_of(thread: str, pruned: str | None, pruned_hash: str | None) -> tuple[int, str] | None:
    """A pruned thread's anchor, as stored in its meta (None: never pruned)."""
    through = number_of(thread, "pruned seq", pruned)
    if not through:
        return None
    if not pruned_hash:
        raise CorruptRecord(thread, through, "the pruned thread names no anchor hash")
    return through, pruned_hash


def read_rows(
    thread: str,
    after_seq: int,
    first: int,
    bodies: list[str],
    sums: list[str],
    stored: tuple[int, str],
    anchor: tuple[int, str] | None,
    limit: int | None = None,
) -> list[CommittedRecord]:
    """The records read (from seq ``first`` on), verified; with ``limit``, those of the
    page (``page_end``: the lists were read a record past it, the head not known yet)."""
    end = page_end(after_seq, stored[0], limit, anchor[0] if anchor else 0)
    if end < stored[0]:  # a page short of the head: what was read past it is not its
        bodies, sums = bodies[: max(end - first + 1, 0)], sums[: max(end - first + 1, 0)]
    paired = min(len(bodies), len(sums))
    pairs = zip(bodies, sums, strict=False)  # unequal lengths are reported below
    rows = [RawRecord(first + i, b, h) for i, (b, h) in enumerate(pairs)]
    if len(bodies) != len(sums):  # what pairs up is checked first: it names the culprit
        verified_records(thread, rows[:paired], after_seq, None, anchor=anchor)
        raise CorruptRecord(thread, first + paired, "the log and its hashes differ in length")
    return verified_records(thread, rows, after_seq, stored, anchor=anchor, through=end)


WHOLE = re.compile(r"0|[1-9][0-9]{0,15}")
"""A counter as the scripts write it (``tostring``): ASCII digits, no sign, no padding."""
EXACT_BELOW = 2**53
"""The scripts count in Lua's doubles: from here on, ``epoch + 1`` is written rounded
(``1.2345678901235e+14``) and compared inexactly."""


def number_of(thread: str, name: str, text: str | None) -> int:
    """A counter of the thread's meta as the scripts read it, or CorruptRecord: Python's
    ``int`` takes what Lua's ``tonumber`` does not (other scripts' digits, ``0_1``), and
    a counter past ``EXACT_BELOW`` the scripts cannot add to exactly."""
    if text is None:
        return 0
    if WHOLE.fullmatch(text) is None or int(text) >= EXACT_BELOW:
        raise CorruptRecord(thread, 0, f"stored {name} {printable(text, 40)!r} is not a count")
    return int(text)


def decode_receipt(thread: str, text: str) -> Receipt:
    try:
        return Receipt.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, 0, f"stored receipt: {first_error(exc)}") from exc


def decode_summary(thread: str, text: str) -> RunSummary:
    try:
        return RunSummary.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, 0, f"run index entry: {first_error(exc)}") from exc


def first_error(exc: ValidationError) -> str:
    return str(exc.errors()[0].get("msg", exc))
