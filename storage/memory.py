"""The in-memory CommitStore: a real implementation for one process, not a mock.

It keeps records encoded with their hashes, exactly as the durable backends do, so
decoding, the chain and the corruption checks run the same code; it passes the same
conformance suite. Its frontiers are kept as (immutable) objects.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    admit,
    check_claim,
    check_size,
    receipt_of,
    with_claim,
)
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import RawRecord, check_head, verified_records
from runtime.ports import CommittedRecord, RunSummary, host_of
from storage.summary import summarize


@dataclass
class _Thread:
    frontier: Frontier
    log: list[RawRecord] = field(default_factory=list)
    """Encoded commits with their hashes; log[i] has seq i + 1."""
    receipts: dict[str, Receipt] = field(default_factory=dict)


class MemoryCommitStore:
    def __init__(self, payload_limit: int = DEFAULT_PAYLOAD_LIMIT) -> None:
        self.payload_limit = payload_limit
        self._threads: dict[str, _Thread] = {}
        self._lock = asyncio.Lock()

    def _thread(self, thread: ThreadId) -> _Thread:
        if thread not in self._threads:
            self._threads[thread] = _Thread(Frontier(thread_id=thread))
        return self._threads[thread]

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        check_size(commit, self.payload_limit)
        operation_id = commit.operation_id
        async with self._lock:
            t = self._thread(commit.thread_id)
            known = t.receipts.get(operation_id)
            outcome = admit(t.frontier, commit, expected_version, epoch, known, claim)
            if isinstance(outcome, Receipt):
                return outcome
            receipt = receipt_of(commit, outcome.version)
            t.log.append(RawRecord(receipt.seq, commit.encoded, commit.payload_hash))
            t.receipts[operation_id] = receipt
            t.frontier = outcome
            return receipt

    async def load(self, thread: ThreadId) -> Frontier:
        t = self._threads.get(thread)  # a look-up creates nothing
        if t is None:
            return Frontier(thread_id=thread)
        if t.frontier.version == 0 and t.log:  # check_head takes version 0 as empty
            raise CorruptRecord(thread, 1, "the log has records but the thread has no frontier")
        last = t.log[-1] if t.log else None
        check_head(
            thread,
            t.frontier,
            last.payload_hash if last and last.seq == t.frontier.version else None,
        )
        return t.frontier

    async def read(self, thread: ThreadId, after_seq: int = 0) -> list[CommittedRecord]:
        t = self._threads.get(thread)
        if t is None:
            return []
        rows = t.log[max(after_seq, 1) - 1 :]
        return verified_records(thread, rows, after_seq, (t.frontier.version, t.frontier.head))

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        async with self._lock:
            t = self._thread(thread)
            check_claim(t.frontier, supersedes)
            t.frontier = with_claim(t.frontier, owner)
            return t.frontier

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        summaries = (summarize(t.frontier) for t in self._threads.values())
        return [
            s
            for s in summaries
            if s is not None
            and (state is None or s.state == state)
            and (host is None or host_of(s.owner) == host)
        ]

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        return [ThreadId(t) for t in sorted(self._threads) if t > after][:limit]

    async def close(self) -> None:
        return None

    # ---- test aids: what a disk or a hand edit might do ------------------------------

    def corrupt(
        self, thread: ThreadId, seq: int, text: str | None = None, payload_hash: str | None = None
    ) -> None:
        """Overwrite a stored record's body and/or its stored hash."""
        log = self._stored(thread, seq)
        old = log[seq - 1]
        log[seq - 1] = RawRecord(
            seq, old.body if text is None else text, payload_hash or old.payload_hash
        )

    def delete(self, thread: ThreadId, seq: int) -> None:
        """Drop a stored record (later records keep their seq)."""
        del self._stored(thread, seq)[seq - 1]

    def drop_frontier(self, thread: ThreadId) -> None:
        """Forget the thread's frontier, leaving its log (a thread row deleted by hand)."""
        self._thread(thread).frontier = Frontier(thread_id=thread)

    def _stored(self, thread: ThreadId, seq: int) -> list[RawRecord]:
        log = self._thread(thread).log
        if not 1 <= seq <= len(log):
            raise CorruptRecord(thread, seq, "no such record")
        return log
