"""Verifying what a store hands back: the hash chain of a log, and a frontier's checksum.

Every backend reads raw rows — (seq, body, stored hash) — and passes them through
``verified_records`` before anything above it sees a commit; a stored frontier's text
goes through ``check_frontier_text``. Whatever does not hold fails closed with
``CorruptRecord`` naming the thread and the sequence: a byte flipped in a body, a
stored hash replaced, a record deleted or reordered, a chain that does not link, a
log that does not reach the frontier's head, a frontier edited behind its checksum.

**The history** (the thread's messages) is kept once: in the records that committed
them, and for a pruned thread, those of the records removed in its *pruned history*
(one stored text per message, kept beside the anchor with ``history_digest`` of them
all). ``whole_frontier`` puts a stored head together with its history: the records
kept (verified as above) and the pruned history, which must match its digest; a count
that does not add up to the head's ``message_count`` fails closed too.

``audit`` is what ``ratchet verify`` runs per thread: the checks above, plus a replay
of the whole log compared with the stored frontier.

**Pruned threads** (``CommitStore.prune``, retention) keep the seq and stored hash of
the last record removed beside their frontier, the *anchor*: their log is verified as
a chain from it (the first record kept must name its hash), and a frontier whose head
is the anchor itself names it. An audit cannot rebuild such a frontier from seq 1; it
folds the records kept onto what the frontier says came before them, and reports the
thread as pruned through the anchor's seq, which is no problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NamedTuple

from pydantic import TypeAdapter, ValidationError

from runtime.commit import Frontier, ThreadCommit, decode_commit, with_history
from runtime.errors import CorruptRecord, StoreError
from runtime.ids import ThreadId
from runtime.messages import Message
from runtime.ports import CommitStore, CommittedRecord
from runtime.rules import advance, replay

_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


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
    anchor: tuple[int, str] | None = None,
    through: int | None = None,
) -> list[CommittedRecord]:
    """The records with seq > ``after``, each checked against its hash and the chain.

    ``rows`` hold the stored records from seq ``after`` on (the record at ``after`` too,
    when ``after`` > 0: it anchors the chain), in seq order. ``head`` is the stored
    frontier's (version, head hash), when the caller read it: the log must reach it,
    and end there if ``exact`` (a reader whose head and rows are one snapshot); records
    past it are allowed otherwise (they landed between the two reads).

    ``anchor`` is a pruned thread's (seq, stored hash) of the last record removed: when
    ``after`` is not past it, ``rows`` begin at the record after it, whose ``prev``
    must be that hash, and a head at the anchor's seq must be that hash.

    ``through`` is a page's last seq (``page_end``): ``rows`` end there. A page short of
    the head is verified as the chain from the record before it (or the anchor, or seq
    1) to its last record, which must be there; the head is checked by the page that
    reaches it.
    """
    records: list[CommittedRecord] = []
    floor = max(after, 1)
    expected = floor
    prev: str | None = "" if after == 0 else None
    at_head: str | None = None
    if anchor is not None and anchor[0] > 0 and after <= anchor[0]:
        floor, expected, prev = anchor[0], anchor[0] + 1, anchor[1]
        if head is not None and head[0] < anchor[0]:
            raise CorruptRecord(thread, anchor[0], "the log is pruned past the frontier's head")
        if head is not None and head[0] == anchor[0]:
            at_head = anchor[1]
    for seq, body, stored, operation in rows:
        if type(seq) is not int or type(body) is not str or type(stored) is not str:
            at = seq if type(seq) is int else expected
            raise CorruptRecord(thread, at, "the record holds a value of the wrong type")
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
    if head is not None and through is not None and through < head[0]:
        if expected - 1 != through:  # rows end elsewhere than the page: a gap, or a bug
            ends = f"the log ends at {expected - 1}, the page at {through}"
            raise CorruptRecord(thread, expected, ends)
        return records
    if head is not None:
        _check_tail(thread, head, expected - 1, at_head, floor, exact)
    return records


def page_end(after: int, version: int, limit: int | None, pruned: int = 0) -> int:
    """The last seq of a page of at most ``limit`` records after ``after`` (None: no
    limit) of a log at ``version`` whose records up to ``pruned`` were pruned: the
    records a bounded read fetches, whatever the log's length."""
    if limit is None:
        return version
    return min(version, max(after, pruned) + limit)


def check_page_limit(limit: int | None) -> None:
    """A read's ``limit``: None, or a count of records of 1 or more (ValueError)."""
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"a read's limit must be a whole number of records, 1 or more: {limit!r}")


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


def message_text(message: Message) -> str:
    """A message as a pruned history stores it (JSON)."""
    return _MESSAGE.dump_json(message).decode()


def history_digest(before: str, texts: Iterable[str]) -> str:
    """The digest of a pruned history: ``before`` (that of the texts before them, "" for
    none) chained over ``texts``, so a prune extends it by what it removes alone."""
    digest = before
    for text in texts:
        digest = body_hash(digest + body_hash(text))
    return digest


class PrunedHistory(NamedTuple):
    """A pruned thread's history as stored: the messages of the records removed."""

    texts: Sequence[str]
    """The stored texts, in order (a read may find more than it needs: a prune since)."""
    digest: str | None
    """``history_digest`` of them as stored beside the anchor read with the records."""


def whole_frontier(
    thread: str,
    head: Frontier,
    records: Sequence[CommittedRecord],
    pruned: PrunedHistory | None,
) -> Frontier:
    """``head`` with its history: the pruned history's first messages (a pruned thread),
    then those of ``records``, the verified log kept up to the head (from the anchor
    read with ``pruned``); CorruptRecord unless they add up to ``head.message_count`` and
    the pruned texts match their digest."""
    at_head = next((r for r in reversed(records) if r.seq == head.version), None)
    if at_head is not None:
        _agrees(thread, head, at_head.commit)
    kept = [m for r in records if r.seq <= head.version for m in r.commit.messages]
    before = head.message_count - len(kept)
    if before < 0 or (before and pruned is None):
        raise CorruptRecord(thread, head.version, "the log holds other messages than its head")
    if pruned is None:
        return with_history(head, tuple(kept))
    texts = pruned.texts[:before]
    if any(type(text) is not str for text in texts):  # a SQLite BLOB: not hashable as text
        wrong = "a pruned message holds a value of the wrong type"
        raise CorruptRecord(thread, head.version, wrong)
    if len(texts) < before or history_digest("", texts) != (pruned.digest or ""):
        raise CorruptRecord(thread, head.version, "the pruned history does not match its digest")
    return with_history(head, (*(_message(thread, head.version, t) for t in texts), *kept))


def _agrees(thread: str, head: Frontier, last: ThreadCommit) -> None:
    """The head against its last record, as folding that record made it: a frontier
    edited with its checksum made again (a Run ended in the log, running in the head) was
    driven on, and its next commits hid the edit from every later check."""
    if (
        head.run_id != last.run_id
        or head.run_state != last.disposition
        or head.next_ordinal != last.ordinal + 1
    ):
        wrong = "the stored frontier does not match its last record (its Run, state or ordinal)"
        raise CorruptRecord(thread, head.version, wrong)


def _message(thread: str, version: int, text: str) -> Message:
    try:
        return _MESSAGE.validate_json(text)
    except ValidationError as exc:
        detail = str(exc.errors()[0].get("msg", exc))
        raise CorruptRecord(thread, version, f"a pruned message: {detail}") from exc


def frontier_checksum(text: str) -> str:
    return body_hash(text)


def check_frontier_text(thread: str, version: int, text: str, checksum: str | None) -> None:
    """A stored frontier's text against the checksum stored beside it. SQLite lets a
    column hold a value of any type (a BLOB, text in an integer column): such a row is
    corrupt too, not an AttributeError or TypeError out of the read."""
    if type(version) is not int or type(text) is not str:
        seq = version if type(version) is int else 0
        raise CorruptRecord(thread, seq, "the thread row holds a value of the wrong type")
    if type(checksum) is not str or frontier_checksum(text) != checksum:
        raise CorruptRecord(thread, version, "the stored frontier does not match its checksum")


class Problem(NamedTuple):
    thread: str
    seq: int
    detail: str

    def __str__(self) -> str:
        return f"thread {self.thread!r} seq {self.seq}: {self.detail}"


class Audit(NamedTuple):
    """What ``audit_thread`` found."""

    problems: list[Problem]
    """Everything wrong with the thread (empty: it verifies)."""
    pruned_through: int = 0
    """The records up to this seq were pruned (retention; 0: none were): not a problem,
    but the frontier could be checked only against the records after it."""


async def audit(store: CommitStore, thread: ThreadId) -> list[Problem]:
    """Everything wrong with one stored thread (empty: it verifies)."""
    return (await audit_thread(store, thread)).problems


async def audit_thread(store: CommitStore, thread: ThreadId) -> Audit:
    """``audit``, saying also how far the thread's log was pruned."""
    try:  # the log first: what it finds wrong is the cause of what a load would
        records = await store.read(thread)
        frontier = await store.load(thread)
        if records and frontier.version > records[-1].seq:
            # appended to between the two (a live thread): the records the frontier
            # folds, and no more, so that the audit compares one moment of the thread
            later = await store.read(thread, records[-1].seq)
            records = [*records, *(r for r in later if r.seq <= frontier.version)]
    except CorruptRecord as exc:
        return Audit([Problem(thread, exc.seq, _detail(exc))])
    except StoreError as exc:
        return Audit([Problem(thread, 0, f"unreadable: {exc}")])
    if frontier.version == 0 and frontier.epoch == 0 and not records:
        return Audit([Problem(thread, 0, "no such thread in this store")])
    # a verified read begins after the anchor: a log that begins later, or none at all
    # under a frontier with a version, is a pruned one (an unpruned one would not verify)
    pruned = records[0].seq - 1 if records else frontier.version
    found = _compare(thread, frontier, records) if pruned == 0 else []
    if pruned:
        found = _compare_suffix(thread, frontier, records)
    held_history = getattr(store, "held_history", None)  # every backend of ours has it
    if not found and held_history is not None:
        detail = await _stray_history(store, held_history, thread, frontier, records)
        found = [] if detail is None else [Problem(thread, pruned, detail)]
    # a store with indexes beside the log (the SQL run index; Redis's run and owner
    # indexes and receipts) says whether they still say what the verified thread does:
    # one changed by hand would hide a Run from the sweeps that recover it (asked of a
    # thread whose log verified: a forged log is the cause of what they then disagree on)
    index_problem = getattr(store, "index_problem", None)
    detail = await index_problem(thread) if not found and index_problem is not None else None
    if detail is not None:
        found = [Problem(thread, frontier.version, detail)]
    return Audit(found, pruned)


def history_mismatch(held: int, vouched: int) -> str:
    """Why a thread's pruned history is not what its anchor vouches for."""
    return f"the pruned history holds {held} messages; its anchor vouches for {vouched}"


async def _stray_history(
    store: CommitStore,
    held_history: Callable[[ThreadId], Awaitable[int]],
    thread: ThreadId,
    frontier: Frontier,
    records: Sequence[CommittedRecord],
) -> str | None:
    """A pruned history holding more (or fewer) messages than the head vouches for: rows
    put there by hand, on a thread never pruned too. A load reads only the vouched ones,
    but the next prune would number its messages after them (``CorruptRecord`` there).
    Counted, then the log read again: a prune since moves its anchor with its rows, and
    leaves this audit nothing to judge."""
    kept = sum(len(r.commit.messages) for r in records if r.seq <= frontier.version)
    vouched = frontier.message_count - kept
    try:
        held = await held_history(thread)
        if held == vouched:
            return None
        again = await store.read(thread)
    except StoreError as exc:
        return f"unreadable pruned history: {exc}"
    if (again[0].seq if again else None) != (records[0].seq if records else None):
        return None  # pruned meanwhile
    return history_mismatch(held, vouched)


def _compare(thread: str, frontier: Frontier, records: Sequence[CommittedRecord]) -> list[Problem]:
    if not records:
        return [] if frontier.version == 0 else [Problem(thread, 1, "the log is empty")]
    try:
        rebuilt = replay(ThreadId(thread), [r.commit for r in records])
    except Exception as exc:  # a log the fold refuses is corrupt, whatever the reason
        return [Problem(thread, _failing_seq(thread, records), f"the log does not replay: {exc}")]
    ownership = {"epoch", "owner", "schema_version"}
    if rebuilt.model_dump(exclude=ownership) != frontier.model_dump(exclude=ownership):
        return [Problem(thread, frontier.version, "the frontier is not the fold of its log")]
    return []


def _compare_suffix(
    thread: str, frontier: Frontier, records: Sequence[CommittedRecord]
) -> list[Problem]:
    """A pruned thread's frontier against the records kept: they begin a Run (a prune
    ends at a Run's end), so folded onto the messages the frontier holds from before
    them, they determine all of it but the thread's state (folded onto what is gone)
    and, unless they set it, its status."""
    if not records:
        return []  # the load checked the head against the anchor
    first = records[0]
    if first.commit.ordinal != 0:
        return [Problem(thread, first.seq, "the log is pruned inside a Run")]
    before = len(frontier.messages) - sum(len(r.commit.messages) for r in records)
    if before < 0:
        return [Problem(thread, frontier.version, "the frontier holds fewer messages than its log")]
    base = Frontier(
        thread_id=ThreadId(thread),
        version=first.seq - 1,
        head=first.commit.prev,
        messages=frontier.messages[:before],
    )
    try:
        rebuilt = _fold_onto(base, [r.commit for r in records])
    except Exception as exc:  # a log the fold refuses is corrupt, whatever the reason
        return [Problem(thread, first.seq, f"the log does not replay: {exc}")]
    ignore = {"epoch", "owner", "state", "schema_version"}
    if not any(r.commit.status is not None for r in records):
        ignore.add("status")
    same = rebuilt.model_dump(exclude=ignore) == frontier.model_dump(exclude=ignore)
    if not same or rebuilt.state["run"] != frontier.state["run"]:
        return [Problem(thread, frontier.version, "the frontier is not the fold of its log")]
    return []


def _fold_onto(base: Frontier, commits: Iterable[ThreadCommit]) -> Frontier:
    frontier = base
    for commit in commits:
        frontier = advance(frontier, commit)
    return frontier


def _failing_seq(thread: str, records: Sequence[CommittedRecord]) -> int:
    """The seq of the first record the fold refuses."""
    frontier = Frontier(thread_id=ThreadId(thread))
    for record in records:
        try:
            frontier = advance(frontier, record.commit)
        except Exception:  # only which record: the caller reports the refusal itself
            return record.seq
    return records[-1].seq


def _detail(exc: CorruptRecord) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if ": " in text else text
