"""A group of appends and claims, and its pure half: admitting each request on its own.

What each request asks (``AppendRequest``, ``ClaimRequest``) and what it gets back
(``Outcome``); the columns a frontier is written to its thread row with
(``thread_row``); and ``Group``, which admits a group's requests in order against the
rows a transaction locked (``storage.sql_txn``) or the frontiers a plan starts from
(``storage.sql_plan``), with ``runtime.rules``' pure rules, as every backend does.
Nothing here touches the database. ``Abandoned`` is how a transaction that would
commit for a caller who gave up rolls back, planned or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.errors import CorruptRecord, RatchetError, StoreError, StoreUnavailable
from runtime.ids import ThreadId
from runtime.ports import host_of
from runtime.rules import admit, check_claim, receipt_of, with_claim
from storage.frontiers import FrontierCache
from storage.sql_reads import DbRow
from storage.summary import listing

Outcome = Receipt | Frontier | StoreError | RatchetError
"""A request's outcome: a Receipt (append), the frontier as claimed (claim), or its
refusal."""


@dataclass
class AppendRequest:
    commit: ThreadCommit
    expected: int
    epoch: int
    claim: str | None = None
    """The owner that claims the thread (superseding ``epoch``) with this append."""

    @property
    def thread(self) -> ThreadId:
        return self.commit.thread_id


@dataclass
class ClaimRequest:
    thread: ThreadId
    owner: str
    supersedes: int
    """The owner epoch the claim replaces (compare-and-set)."""


Request = AppendRequest | ClaimRequest
Known = dict[tuple[str, str], Receipt]
"""Stored receipts by (thread, operation id)."""


def thread_row(frontier: Frontier, cache: FrontierCache) -> dict[str, Any]:
    """The thread row's columns for a frontier (copies of it, for queries and locking)."""
    state, cause = listing(frontier)
    text, checksum = cache.encode(frontier.thread_id, frontier)
    return {
        "version": frontier.version,
        "epoch": frontier.epoch,
        "owner": frontier.owner,
        "frontier": text,
        "run_id": frontier.run_id,
        "run_state": state,
        "cause": cause,
        "status": frontier.status.model_dump_json(),
        "updated": time.time_ns() // 1000,
        "head": frontier.head,
        "checksum": checksum,
        "host": host_of(frontier.owner),
    }


class Group:
    """The pure half of one transaction: admits each request on its own, in order."""

    def __init__(
        self,
        rows: dict[str, DbRow],
        known: Known,
        cache: FrontierCache,
        frontiers: dict[str, Frontier] | None = None,
        deferred: list[tuple[Frontier, ThreadCommit]] | None = None,
        headless: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.rows = rows
        self.headless = headless
        """Threads whose row's head record is gone (``HEADLESS``), or whose row was made
        over records already stored (``LOGGED``): no append goes past them."""
        self.known = known
        self.cache = cache
        self.frontiers: dict[str, Frontier] = frontiers or {}
        self.deferred = deferred
        """Provisional admissions' (frontier, commit), for the trace checks (``admit``)."""
        self.touched: set[str] = set()
        self.new_commits: list[dict[str, Any]] = []

    def admit(self, request: Request) -> Outcome:
        try:
            if isinstance(request, ClaimRequest):
                return self._claim(request)
            return self._append(request)
        except RatchetError as exc:  # this request is refused; its neighbours go on
            return exc

    def _claim(self, request: ClaimRequest) -> Frontier:
        thread = request.thread
        frontier = self.frontier(thread)
        check_claim(frontier, request.supersedes)
        frontier = with_claim(frontier, request.owner)
        self.frontiers[thread] = frontier
        self.touched.add(thread)
        return frontier

    def _append(self, request: AppendRequest) -> Receipt:
        commit = request.commit
        thread, operation = commit.thread_id, commit.operation_id
        if thread in self.headless:
            version = self.rows[thread].version
            if not version:
                raise CorruptRecord(thread, 1, "the log has records no frontier vouches for")
            raise CorruptRecord(thread, version, "the record at the frontier's head is gone")
        known = self.known.get((thread, operation))
        outcome = admit(
            self.frontier(thread),
            commit,
            request.expected,
            request.epoch,
            known,
            request.claim,
            self.deferred,
        )
        if isinstance(outcome, Receipt):
            return outcome
        frontier = outcome
        receipt = receipt_of(commit, frontier.version)
        self.known[(thread, operation)] = receipt
        self.frontiers[thread] = frontier
        self.touched.add(thread)
        self.new_commits.append(
            {
                "thread_id": thread,
                "seq": receipt.seq,
                "operation_id": receipt.operation_id,
                "payload_hash": receipt.payload_hash,
                "label": commit.label,
                "body": commit.encoded,
            }
        )
        return receipt

    def frontier(self, thread: str) -> Frontier:
        if thread not in self.frontiers:
            row = self.rows[thread]
            self.frontiers[thread] = self.cache.decode(
                thread, row.frontier, row.version, row.checksum
            )
        return self.frontiers[thread]

    def changed(self) -> list[dict[str, Any]]:
        """The new thread rows, in id order (encoding caches each new frontier)."""
        return [
            {"b_thread": t, **thread_row(self.frontiers[t], self.cache)}
            for t in sorted(self.touched)
        ]


class Abandoned(StoreUnavailable):
    """A caller of the group gave up before its transaction committed: rolled back.

    The transaction may wait long past its callers' deadline (SQLite's busy wait on a
    lock another process holds, 30 s; a PostgreSQL row lock): committed then, a commit
    its caller had been told was not made (``StoreUnavailable``) landed anyway, and
    a Run whose caller had given up was left running with nothing to drive it. The
    writer commits the group again without the requests given up on."""


Wanted = Callable[[], bool]
"""Whether every caller of a group still waits for it (asked just before it commits)."""


def still_wanted(wanted: Wanted | None) -> None:
    if wanted is not None and not wanted():
        raise Abandoned("a caller gave up before its group committed")
