"""The in-memory CommitStore: a real implementation for one process, not a mock.

It keeps records encoded with their hashes, exactly as the durable backends do, so
decoding, the chain and the corruption checks run the same code; it passes the same
conformance suite. Its frontiers are kept as (immutable) heads, without messages: a
load takes the messages from the log (and a pruned thread's pruned history), as the
durable backends do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from runtime.commit import DEFAULT_PAYLOAD_LIMIT, Frontier, Receipt, ThreadCommit, head_only
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import (
    PrunedHistory,
    RawRecord,
    check_head,
    check_page_limit,
    history_digest,
    page_end,
    verified_records,
    whole_frontier,
)
from runtime.ports import CommittedRecord, Lease, RunSummary
from runtime.rules import admit, check_claim, check_size, receipt_of, with_claim
from storage.leases import LeaseTable
from storage.retention import Cut, prune_thread, stray_history
from storage.summary import summaries_of


@dataclass
class _Thread:
    frontier: Frontier
    log: list[RawRecord] = field(default_factory=list)
    """Encoded commits with their hashes; log[i] has seq pruned + i + 1."""
    receipts: dict[str, Receipt] = field(default_factory=dict)
    anchor: tuple[int, str] | None = None
    """After a prune: the seq and stored hash of the last record removed."""
    history: list[str] = field(default_factory=list)
    """After a prune: the texts of the messages of the records removed."""
    digest: str = ""
    """Their ``history_digest``."""

    @property
    def pruned(self) -> int:
        return 0 if self.anchor is None else self.anchor[0]


def _check_vouched(thread: ThreadId, t: _Thread) -> None:
    """A log whose frontier is gone (version 0: ``check_head`` takes it as empty) fails
    closed, for reads and for an append alike."""
    if t.frontier.version == 0 and t.log:
        raise CorruptRecord(thread, 1, "the log has records but the thread has no frontier")


class MemoryCommitStore:
    def __init__(self, payload_limit: int = DEFAULT_PAYLOAD_LIMIT) -> None:
        self.payload_limit = payload_limit
        self._threads: dict[str, _Thread] = {}
        self._lock = asyncio.Lock()
        self._leases = LeaseTable()

    def _thread(self, thread: ThreadId) -> _Thread:
        """The thread's entry, or a new one not kept yet (``_keep``: a refused request
        leaves nothing behind)."""
        return self._threads.get(thread) or _Thread(Frontier(thread_id=thread))

    def _keep(self, thread: ThreadId, t: _Thread) -> None:
        self._threads[thread] = t

    ordered_appends = True
    """One caller's appends apply in the order it made them (the lock is fair, and a call
    takes it before it first waits): an engine may queue a commit behind one on its way."""

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        check_size(commit, self.payload_limit)
        operation_id = commit.operation_id
        async with self._lock:
            t = self._thread(commit.thread_id)
            _check_vouched(commit.thread_id, t)  # not a new thread for a first commit either
            known = t.receipts.get(operation_id)
            outcome = admit(t.frontier, commit, expected_version, epoch, known, claim)
            if isinstance(outcome, Receipt):
                return outcome
            receipt = receipt_of(commit, outcome.version)
            t.log.append(RawRecord(receipt.seq, commit.encoded, commit.payload_hash))
            t.receipts[operation_id] = receipt
            t.frontier = head_only(outcome)
            self._keep(commit.thread_id, t)
            return receipt

    async def load(self, thread: ThreadId) -> Frontier:
        """The whole frontier: the head with the messages of the verified log."""
        head = await self.load_head(thread)
        t = self._threads.get(thread)
        if t is None or not head.version:
            return head
        records = await self.read(thread)
        pruned = None if t.anchor is None else PrunedHistory(t.history, t.digest)
        return whole_frontier(thread, head, records, pruned)

    async def held_history(self, thread: ThreadId) -> int:
        """The messages the thread's pruned history holds (``runtime.integrity.audit``)."""
        t = self._threads.get(thread)
        return 0 if t is None else len(t.history)

    async def load_head(self, thread: ThreadId) -> Frontier:
        """The frontier without its messages (``message_count`` of them)."""
        t = self._threads.get(thread)  # a look-up creates nothing
        if t is None:
            return Frontier(thread_id=thread)
        _check_vouched(thread, t)
        last = t.log[-1] if t.log else None
        at_head = last.payload_hash if last and last.seq == t.frontier.version else None
        if not t.log and t.anchor is not None and t.anchor[0] == t.frontier.version:
            at_head = t.anchor[1]  # pruned through its head
        check_head(thread, t.frontier, at_head)
        return t.frontier

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        check_page_limit(limit)
        t = self._threads.get(thread)
        if t is None:
            return []
        head = (t.frontier.version, t.frontier.head)
        end = page_end(after_seq, t.frontier.version, limit, t.pruned)
        stop = None if end >= t.frontier.version else end - t.pruned  # past it: corrupt
        rows = t.log[max(after_seq - t.pruned - 1, 0) : stop]
        return verified_records(thread, rows, after_seq, head, anchor=t.anchor, through=end)

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        async with self._lock:
            t = self._thread(thread)
            check_claim(t.frontier, supersedes)
            t.frontier = with_claim(t.frontier, owner)
            self._keep(thread, t)
            return t.frontier

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        return summaries_of((t.frontier for t in self._threads.values()), state, host)

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        return [ThreadId(t) for t in sorted(self._threads) if t > after][:limit]

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        return await prune_thread(self, thread, through_seq, self._cut)

    async def _cut(self, cut: Cut) -> bool:
        async with self._lock:
            t = self._threads.get(cut.thread)
            if t is None or t.pruned != cut.after:
                return False
            n = cut.removed
            if len(t.log) < n or t.log[n - 1].payload_hash != cut.hash:
                return False  # changed since the read: read (and verify) again
            if len(t.history) != cut.history:
                raise CorruptRecord(cut.thread, cut.after, stray_history(len(t.history), cut))
            del t.log[:n]
            for operation in cut.operations:
                t.receipts.pop(operation, None)
            t.anchor = (cut.through, cut.hash)
            t.history.extend(cut.messages)
            t.digest = history_digest(t.digest, cut.messages)
            return True

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        return self._leases.hold(name, holder, ttl_s)

    async def drop_lease(self, name: str, holder: str) -> None:
        self._leases.drop(name, holder)

    async def close(self) -> None:
        return None

    # ---- test aids: what a disk or a hand edit might do ------------------------------

    def corrupt(
        self, thread: ThreadId, seq: int, text: str | None = None, payload_hash: str | None = None
    ) -> None:
        """Overwrite a stored record's body and/or its stored hash."""
        log, i = self._stored(thread, seq)
        old = log[i]
        log[i] = RawRecord(
            seq, old.body if text is None else text, payload_hash or old.payload_hash
        )

    def delete(self, thread: ThreadId, seq: int) -> None:
        """Drop a stored record (later records keep their seq)."""
        log, i = self._stored(thread, seq)
        del log[i]

    def drop_frontier(self, thread: ThreadId) -> None:
        """Forget the thread's frontier, leaving its log (a thread row deleted by hand)."""
        self._thread(thread).frontier = Frontier(thread_id=thread)

    def corrupt_history(self, thread: ThreadId, index: int, text: str) -> None:
        """Overwrite a message of a pruned thread's pruned history (``index`` from 0)."""
        self._thread(thread).history[index] = text

    def set_anchor(self, thread: ThreadId, anchor: tuple[int, str] | None) -> None:
        """Overwrite a pruned thread's anchor (its row edited by hand)."""
        self._thread(thread).anchor = anchor

    def _stored(self, thread: ThreadId, seq: int) -> tuple[list[RawRecord], int]:
        """The log holding record ``seq``, and the record's index in it."""
        t = self._thread(thread)
        if not 1 <= seq - t.pruned <= len(t.log):
            raise CorruptRecord(thread, seq, "no such record")
        return t.log, seq - t.pruned - 1
