"""ThreadCommit, the committed frontier, and the pure fold every store shares.

A store keeps, per thread, an append-only log of ThreadCommits and the frontier
they fold to. ``check_append`` is the one admission rule (idempotency, fencing,
terminal-is-final, version) and ``advance`` the one fold; every backend calls both
inside its own transaction, so all backends agree by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from runtime.base import Frozen, canonical_json, sha256_hex
from runtime.batch import ActiveToolBatch
from runtime.errors import (
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    PayloadTooLarge,
    RunEnded,
    VersionConflict,
)
from runtime.events import Fact
from runtime.ids import SCHEMA_VERSION, OperationId, RunId, ThreadId, commit_operation_id
from runtime.lifecycle import AwaitingState, EndedState, Natural, RunDisposition, ThreadStatus
from runtime.messages import AssistantMessage, Message
from runtime.state import Command, StateView, apply_commands, empty_state

DEFAULT_PAYLOAD_LIMIT = 1 << 20
"""Largest encoded commit, in bytes, that any backend accepts by default."""

CommitLabel = Literal[
    "activation", "inference", "executing", "results", "awaiting", "resume", "ended", "status"
]


class ThreadCommit(Frozen):
    """One atomic transition of a thread: lands whole or leaves nothing."""

    schema_version: Literal[1] = SCHEMA_VERSION
    thread_id: ThreadId
    run_id: RunId
    ordinal: int = Field(ge=0)
    """Position of this commit among its Run's commits; with the run it forms the op id."""
    label: CommitLabel
    """Which commit point wrote this (checked on replay, never trusted blindly)."""
    disposition: RunDisposition
    messages: tuple[Message, ...] = ()
    commands: tuple[Command, ...] = ()
    batch: ActiveToolBatch | None = None
    """The Run's batch after this commit; None leaves it unchanged; finalized clears it."""
    status: ThreadStatus | None = None
    """The thread's run status after this commit; None leaves it unchanged."""
    events: tuple[Fact, ...] = ()

    @model_validator(mode="after")
    def _legal(self) -> ThreadCommit:
        if self.disposition.run_id != self.run_id:
            raise ValueError("disposition belongs to another run")
        if isinstance(self.disposition, AwaitingState):
            ticket = self.disposition.ticket
            if ticket.run_id != self.run_id or ticket.thread_id != self.thread_id:
                raise ValueError("the ticket names another run or thread")
        if self.batch is not None and self.batch.run_id != self.run_id:
            raise ValueError("the batch belongs to another run")
        if isinstance(self.disposition, EndedState):
            if self.batch is not None and self.batch.status != "finalized":
                raise ValueError("an ended run's batch must be sealed and finalized")
            if isinstance(self.disposition.cause, Natural) and not any(
                isinstance(m, AssistantMessage) for m in self.messages
            ):
                raise ValueError("a natural end requires committed assistant output")
        return self

    @property
    def operation_id(self) -> OperationId:
        return commit_operation_id(self.run_id, self.ordinal)

    @cached_property
    def encoded(self) -> str:
        """Canonical JSON: encoded once, hashed and stored as is."""
        return canonical_json(self.model_dump(mode="json"))

    @cached_property
    def payload_hash(self) -> str:
        return sha256_hex(self.encoded)


def decode_commit(text: str | bytes, thread: str, seq: int) -> ThreadCommit:
    """Decode a stored commit, re-validating everything; fail closed with CorruptRecord."""
    try:
        return ThreadCommit.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, seq, str(exc.errors()[0].get("msg", exc))) from exc


class Receipt(Frozen):
    thread_id: ThreadId
    seq: int
    """The thread version this commit produced."""
    operation_id: OperationId
    payload_hash: str


class Frontier(Frozen):
    """Everything recovery needs, kept current by every append (no log replay on load)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    thread_id: ThreadId
    version: int = 0
    epoch: int = 0
    owner: str | None = None
    run_id: RunId | None = None
    run_state: RunDisposition | None = None
    batch: ActiveToolBatch | None = None
    """The open batch of the current Run, if any."""
    status: ThreadStatus = ThreadStatus()
    state: StateView = Field(default_factory=empty_state)
    messages: tuple[Message, ...] = ()
    run_start: int = 0
    """Index in ``messages`` where the current Run's messages begin."""
    steps: int = 0
    """Inferences committed by the current Run."""
    next_ordinal: int = 0

    @property
    def ended(self) -> bool:
        return isinstance(self.run_state, EndedState)


def check_append(
    frontier: Frontier,
    commit: ThreadCommit,
    expected_version: int,
    epoch: int,
    known: Receipt | None,
) -> Receipt | None:
    """The admission rule. Returns the original receipt for a harmless retry, else None.

    ``known`` is the receipt already stored under the commit's operation id, if any.
    """
    if known is not None and known.payload_hash == commit.payload_hash:
        return known  # a retried write that already landed: harmless, even if since fenced
    if epoch != frontier.epoch:
        raise Fenced(commit.thread_id, epoch, frontier.epoch)
    if known is not None:
        raise DuplicateOperation(commit.operation_id)
    if frontier.ended and frontier.run_id == commit.run_id:
        raise RunEnded(commit.thread_id, commit.run_id)
    if expected_version != frontier.version:
        raise VersionConflict(commit.thread_id, expected_version, frontier.version)
    return None


def check_size(commit: ThreadCommit, limit: int) -> None:
    size = len(commit.encoded.encode())
    if size > limit:
        raise PayloadTooLarge(size, limit)


def advance(frontier: Frontier, commit: ThreadCommit) -> Frontier:
    """Fold one admitted commit into the frontier."""
    new_run = commit.run_id != frontier.run_id
    if new_run and frontier.run_state is not None and not frontier.ended:
        raise InvalidTransition(
            f"thread {commit.thread_id} already has an active run {frontier.run_id}"
        )
    if not new_run and commit.ordinal != frontier.next_ordinal:
        raise InvalidTransition(
            f"run {commit.run_id}: commit ordinal {commit.ordinal}, "
            f"expected {frontier.next_ordinal}"
        )
    state = frontier.state
    if new_run:
        state = {"thread": state["thread"], "run": {}}
    batch = frontier.batch if not new_run else None
    if commit.batch is not None:
        batch = None if commit.batch.status == "finalized" else commit.batch
    if isinstance(commit.disposition, EndedState):
        batch = None
    inferences = sum(isinstance(m, AssistantMessage) for m in commit.messages)
    return frontier.model_copy(
        update={
            "version": frontier.version + 1,
            "run_id": commit.run_id,
            "run_state": commit.disposition,
            "batch": batch,
            "status": commit.status or frontier.status,
            "state": apply_commands(state, commit.commands),
            "messages": frontier.messages + commit.messages,
            "run_start": len(frontier.messages) if new_run else frontier.run_start,
            "steps": (0 if new_run else frontier.steps) + inferences,
            "next_ordinal": commit.ordinal + 1,
        }
    )


def with_claim(frontier: Frontier, owner: str) -> Frontier:
    """A new owner: epoch + 1, which fences every earlier writer."""
    return frontier.model_copy(update={"epoch": frontier.epoch + 1, "owner": owner})


def replay(thread: ThreadId, commits: Iterable[ThreadCommit]) -> Frontier:
    """Rebuild a frontier from the log alone (tests compare it with the stored one)."""
    frontier = Frontier(thread_id=thread)
    for commit in commits:
        frontier = advance(frontier, commit)
    return frontier


def stamp_facts(commit: ThreadCommit, seq: int) -> tuple[Fact, ...]:
    """The commit's facts with their stream offsets (seq, index)."""
    return tuple(
        fact.model_copy(update={"seq": seq, "index": i}) for i, fact in enumerate(commit.events)
    )
