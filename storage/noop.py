"""The no-op CommitStore (``noop://``): commits switched off, for the benchmark only.

``benchmarks.load --baseline same-dispatch`` runs Ratchet's own RunHosts, wave
dispatch and ToolExecutors against it, so that what the durable run costs beyond it
is what durability costs, and nothing else (the plain-Ray baseline has no shared
waves, no engine, no host). An append is admitted by the same rule as everywhere
(``runtime.rules.admit``) and folds into a frontier this process keeps; it returns a
receipt and writes nothing: no log, no hash chain kept, no disk, no server. Every
process that opens ``noop://`` has a store of its own: nothing survives the
process, nothing is shared between hosts, and the driver's store and the
Supervisor's stay empty — which is the point, and why the benchmark judges this arm
by the frontiers the hosts answer with and by the tool ledger, not by reading back.

It answers consistently for what it folded: ``load`` is the folded frontier,
``list_runs`` the Runs of its frontiers (so a host's reconciliation sees exactly the
Runs it drives, and the Supervisor, whose store is empty, sweeps nothing); ``read``
is always empty, as nothing was written.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from runtime.commit import DEFAULT_PAYLOAD_LIMIT, Frontier, Receipt, ThreadCommit, head_only
from runtime.ids import ThreadId
from runtime.integrity import check_page_limit
from runtime.ports import CommittedRecord, Lease, RunSummary
from runtime.rules import admit, check_claim, check_size, receipt_of, with_claim
from storage.leases import LeaseTable
from storage.summary import summaries_of


@dataclass
class _Folded:
    frontier: Frontier
    receipts: dict[str, Receipt] = field(default_factory=dict)
    """By operation id: a retried append gets its first receipt back, as from any store."""


class NoopCommitStore:
    """Appends fold into an in-process frontier and return a receipt; nothing is kept
    beyond this object (see the module's doc)."""

    def __init__(self, payload_limit: int = DEFAULT_PAYLOAD_LIMIT) -> None:
        self.payload_limit = payload_limit
        self.appends = 0
        """Appends admitted (a host's ``info`` reports it as ``store_appends``)."""
        self._threads: dict[str, _Folded] = {}
        self._lock = asyncio.Lock()
        self._leases = LeaseTable()

    def _thread(self, thread: ThreadId) -> _Folded:
        if thread not in self._threads:
            self._threads[thread] = _Folded(Frontier(thread_id=thread))
        return self._threads[thread]

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        check_size(commit, self.payload_limit)
        async with self._lock:
            t = self._thread(commit.thread_id)
            known = t.receipts.get(commit.operation_id)
            outcome = admit(t.frontier, commit, expected_version, epoch, known, claim)
            if isinstance(outcome, Receipt):
                return outcome
            receipt = receipt_of(commit, outcome.version)
            t.receipts[commit.operation_id] = receipt
            t.frontier = outcome
            self.appends += 1
            return receipt

    async def load(self, thread: ThreadId) -> Frontier:
        t = self._threads.get(thread)  # a look-up creates nothing
        return t.frontier if t is not None else Frontier(thread_id=thread)

    async def load_head(self, thread: ThreadId) -> Frontier:
        return head_only(await self.load(thread))

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        check_page_limit(limit)
        return []  # nothing was written

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        async with self._lock:
            t = self._thread(thread)
            check_claim(t.frontier, supersedes)
            t.frontier = with_claim(t.frontier, owner)
            return head_only(t.frontier)

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
        return 0  # no records to remove

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        return self._leases.hold(name, holder, ttl_s)

    async def drop_lease(self, name: str, holder: str) -> None:
        self._leases.drop(name, holder)

    async def close(self) -> None:
        return None


__all__ = ["NoopCommitStore"]
