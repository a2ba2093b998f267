"""Verifying what a store hands back: the hash chain of a log, and a frontier's checksum.

Every backend reads raw rows — (seq, body, stored hash) — and passes them through
``verified_records`` before anything above it sees a commit; a stored frontier's text
goes through ``check_frontier_text``. Whatever does not hold fails closed with
``CorruptRecord`` naming the thread and the sequence: a byte flipped in a body, a
stored hash replaced, a record deleted or reordered, a chain that does not link, a
log that does not reach the frontier's head, a frontier edited behind its checksum.

``audit`` is what ``ratchet verify`` runs per thread: the checks above, plus a replay
of the whole log compared with the stored frontier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from runtime.commit import Frontier, advance, decode_commit, replay
from runtime.errors import CorruptRecord, StoreError
from runtime.ids import ThreadId
from runtime.ports import CommitStore, CommittedRecord


class RawRecord(NamedTuple):
    seq: int
    body: str
    payload_hash: str
    operation_id: str | None = None
    """The operation id stored beside the body (SQL), checked against the body's."""


def body_hash(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


def verified_records(
    thread: str,
    rows: Iterable[RawRecord],
    after: int,
    head: tuple[int, str] | None,
    *,
    exact: bool = True,
) -> list[CommittedRecord]:
    """The records with seq > ``after``, each checked against its hash and the chain.

    ``rows`` hold the stored records from seq ``after`` on (the record at ``after`` too,
    when ``after`` > 0: it anchors the chain), in seq order. ``head`` is the stored
    frontier's (version, head hash), when the caller read it: the log must reach it,
    and end there if ``exact`` (a reader whose head and rows are one snapshot); records
    past it are allowed otherwise (they landed between the two reads).
    """
    records: list[CommittedRecord] = []
    expected = max(after, 1)
    prev: str | None = "" if after == 0 else None
    at_head: str | None = None
    for seq, body, stored, operation in rows:
        if seq != expected:
            missing = expected if seq > expected else seq
            raise CorruptRecord(thread, missing, "the log has a gap or a repeated seq here")
        if body_hash(body) != stored:
            raise CorruptRecord(thread, seq, "the body does not match its stored hash")
        commit = decode_commit(body, thread, seq)
        if commit.thread_id != thread:
            raise CorruptRecord(thread, seq, f"the record belongs to thread {commit.thread_id!r}")
        if operation is not None and operation != commit.operation_id:
            raise CorruptRecord(thread, seq, "the stored operation id is not the record's")
        if seq == 1:
            prev = ""  # a thread's first commit has no predecessor
        chained = commit.schema_version >= 2  # schema 1 records predate the chain
        if chained and prev is not None and commit.prev != prev:
            raise CorruptRecord(thread, seq, "the hash chain is broken before this record")
        if seq > after:
            records.append(CommittedRecord(seq=seq, commit=commit))
        if head is not None and seq == head[0]:
            at_head = stored
        prev, expected = stored, seq + 1
    if head is not None:
        _check_tail(thread, head, expected - 1, at_head, max(after, 1), exact)
    return records


def _check_tail(
    thread: str,
    head: tuple[int, str],
    last: int,
    at_head: str | None,
    first: int,
    exact: bool,
) -> None:
    version, head_hash = head
    if version < first:  # the cursor is at or past the head: nothing of it was to be read
        if exact and last >= first and last > version:
            raise CorruptRecord(thread, version + 1, "the log runs past the frontier's head")
        return
    if last < version:
        raise CorruptRecord(thread, last + 1, f"the log ends at {last}, the frontier at {version}")
    if exact and last > version:
        raise CorruptRecord(thread, version + 1, "the log runs past the frontier's head")
    if at_head != head_hash:
        raise CorruptRecord(thread, version, "the record at the head is not the frontier's head")


def check_head(thread: str, frontier: Frontier, at_version: str | None) -> None:
    """A loaded frontier against the stored hash of the record at its version (one key
    lookup): the head it names must be that record, which must exist."""
    if frontier.version == 0:
        return
    if at_version is None:
        raise CorruptRecord(thread, frontier.version, "the record at the frontier's head is gone")
    if at_version != frontier.head:
        raise CorruptRecord(thread, frontier.version, "the frontier's head is not its last record")


def frontier_checksum(text: str) -> str:
    return body_hash(text)


def check_frontier_text(thread: str, version: int, text: str, checksum: str | None) -> None:
    """A stored frontier's text against the checksum stored beside it."""
    if checksum is None or frontier_checksum(text) != checksum:
        raise CorruptRecord(thread, version, "the stored frontier does not match its checksum")


class Problem(NamedTuple):
    thread: str
    seq: int
    detail: str

    def __str__(self) -> str:
        return f"thread {self.thread!r} seq {self.seq}: {self.detail}"


async def audit(store: CommitStore, thread: ThreadId) -> list[Problem]:
    """Everything wrong with one stored thread (empty: it verifies)."""
    try:  # the log first: what it finds wrong is the cause of what a load would
        records = await store.read(thread)
        frontier = await store.load(thread)
    except CorruptRecord as exc:
        return [Problem(thread, exc.seq, _detail(exc))]
    except StoreError as exc:
        return [Problem(thread, 0, f"unreadable: {exc}")]
    if frontier.version == 0 and frontier.epoch == 0 and not records:
        return [Problem(thread, 0, "no such thread in this store")]
    return _compare(thread, frontier, records)


def _compare(thread: str, frontier: Frontier, records: Sequence[CommittedRecord]) -> list[Problem]:
    if not records:
        return [] if frontier.version == 0 else [Problem(thread, 1, "the log is empty")]
    try:
        rebuilt = replay(ThreadId(thread), [r.commit for r in records])
    except Exception as exc:  # a log the fold refuses is corrupt, whatever the reason
        return [Problem(thread, _failing_seq(thread, records), f"the log does not replay: {exc}")]
    ownership = {"epoch", "owner"}
    if rebuilt.model_dump(exclude=ownership) != frontier.model_dump(exclude=ownership):
        return [Problem(thread, frontier.version, "the frontier is not the fold of its log")]
    return []


def _failing_seq(thread: str, records: Sequence[CommittedRecord]) -> int:
    """The seq of the first record the fold refuses."""
    frontier = Frontier(thread_id=ThreadId(thread))
    for record in records:
        try:
            frontier = advance(frontier, record.commit)
        except Exception:
            return record.seq
    return records[-1].seq


def _detail(exc: CorruptRecord) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if ": " in text else text
