"""The in-memory CommitStore: a real implementation for one process, not a mock.

It keeps records encoded, exactly as the durable backends do, so decoding and
corruption checks run the same code; it passes the same conformance suite.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from runtime.base import trusted
from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    advance,
    check_append,
    check_size,
    check_start,
    decode_commit,
    with_claim,
)
from runtime.errors import CorruptRecord
from runtime.ids import RunId, ThreadId
from runtime.ports import CommittedRecord, RunSummary
from storage.summary import summarize


@dataclass
class _Thread:
    frontier: Frontier
    log: list[str] = field(default_factory=list)
    """Encoded commits; log[i] has seq i + 1."""
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

    async def append(self, commit: ThreadCommit, expected_version: int, epoch: int) -> Receipt:
        check_size(commit, self.payload_limit)
        operation_id = commit.operation_id
        async with self._lock:
            t = self._thread(commit.thread_id)
            known = t.receipts.get(operation_id)
            receipt = check_append(t.frontier, commit, expected_version, epoch, known)
            if receipt is not None:
                return receipt
            frontier = advance(t.frontier, commit)
            receipt = trusted(  # of the admitted commit's own fields: valid already
                Receipt,
                thread_id=commit.thread_id,
                seq=frontier.version,
                operation_id=operation_id,
                payload_hash=commit.payload_hash,
            )
            t.log.append(commit.encoded)
            t.receipts[operation_id] = receipt
            t.frontier = frontier
            return receipt

    async def load(self, thread: ThreadId) -> Frontier:
        return self._thread(thread).frontier

    async def read(self, thread: ThreadId, after_seq: int = 0) -> list[CommittedRecord]:
        log = self._thread(thread).log
        return [
            CommittedRecord(seq=seq, commit=decode_commit(log[seq - 1], thread, seq))
            for seq in range(after_seq + 1, len(log) + 1)
        ]

    async def claim(self, thread: ThreadId, owner: str) -> int:
        return (await self.claim_frontier(thread, owner)).epoch

    async def claim_frontier(
        self, thread: ThreadId, owner: str, starting: RunId | None = None
    ) -> Frontier:
        async with self._lock:
            t = self._thread(thread)
            if starting is not None:
                check_start(t.frontier, starting)
            t.frontier = with_claim(t.frontier, owner)
            return t.frontier

    async def list_runs(
        self, state: Literal["running", "awaiting", "ended"] | None = None
    ) -> list[RunSummary]:
        summaries = (summarize(t.frontier) for t in self._threads.values())
        return [s for s in summaries if s is not None and (state is None or s.state == state)]

    async def close(self) -> None:
        return None

    def corrupt(self, thread: ThreadId, seq: int, text: str) -> None:
        """Test aid: overwrite a stored record, as a disk or a hand edit might."""
        log = self._thread(thread).log
        if not 1 <= seq <= len(log):
            raise CorruptRecord(thread, seq, "no such record")
        log[seq - 1] = text
