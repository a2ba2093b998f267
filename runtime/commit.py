"""ThreadCommit and the committed frontier: the records every store keeps.

A store keeps, per thread, an append-only log of ThreadCommits and the frontier
they fold to. The rules they share — ``admit``, the one admission rule, and
``advance``, the one fold — are in ``runtime.rules``; every backend calls them inside
its own transaction (or Lua script), so all backends agree by construction.

**The hash chain.** A commit names the hash of the commit before it (``prev``; ""
for a thread's first), and its own hash is the SHA-256 of its canonical JSON, so
each hash covers the whole log before it. The frontier keeps the head (``head``);
an append that does not extend the head is refused, and a store verifies the chain
whenever it reads the log (``runtime.integrity``).

**Ownership is compare-and-set.** Every writer holds the thread's owner epoch; a
claim names the epoch it supersedes and is refused (``Fenced``) if the thread has
moved on. An append may carry its own claim (``claim=owner``): the first commit of a
start, a resume, a cancel or a settlement then lands together with the new owner,
or not at all.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError, model_validator

from runtime.base import Frozen, canonical_model_json, evolve, is_plain, sha256_hex, trusted
from runtime.batch import ActiveToolBatch, check_invariants
from runtime.errors import CommitRefused, CorruptRecord
from runtime.events import Fact
from runtime.facts import facts_of
from runtime.frozen import FrozenDict, freeze
from runtime.ids import OperationId, RunId, ThreadId, commit_operation_id
from runtime.lifecycle import AwaitingState, EndedState, Natural, RunDisposition, ThreadStatus
from runtime.messages import AssistantMessage, Message
from runtime.state import SESSION_KEY, Command, StateView, empty_state

DEFAULT_PAYLOAD_LIMIT = 1 << 20
"""Largest encoded commit, in bytes, that any backend accepts by default."""

CommitLabel = Literal[
    "activation",
    "inference",
    "executing",
    "results",
    "awaiting",
    "resume",
    "turn",
    "ended",
    "status",
]
"""``turn``: a session's handler-backed side took its turn (``runtime.session``)."""


COMMIT_SCHEMA: Literal[3] = 3
"""Schema of the commits written now: 3 stores only the facts ``facts_of`` cannot derive
from the commit's own fields (``events``: a ``resumed``, say), so a message's text is in
its body once; 2 carries ``prev`` (the hash chain) and every fact; 1, written before the
chain, is still read (its records are checked against their own hash)."""
FRONTIER_SCHEMA: Literal[3] = 3
"""Schema of the frontiers stored now: 3 leaves the messages out (they are in the log:
``message_count`` says how many there are); 2 held the whole history, and still reads."""


Count = Annotated[int, Field(ge=0, lt=2**63)]
"""A count or position the stores keep in a BIGINT column: one past it, edited into a
record or a frontier with its hash made again, read fine and then failed every write as
the database's overflow, a store error retried at every sweep, never a corrupt thread."""


class ThreadCommit(Frozen):
    """One atomic transition of a thread: lands whole or leaves nothing."""

    schema_version: Literal[1, 2, 3] = COMMIT_SCHEMA
    thread_id: ThreadId
    run_id: RunId
    ordinal: Count
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
    """The facts stored with the commit: from schema 3 only those ``facts_of`` does not
    derive from its fields (``facts`` is all of them, whatever the schema)."""
    prev: str = ""
    """Hash of the thread's previous commit ("" for its first): the hash chain. Schema 1
    records, written before the chain, have none (and are not checked against it)."""
    epoch: Count = 0
    """The owner epoch of its writer (after the commit's own claim, if it carries one).
    Part of the hash, so two owners never write the same bytes: a fenced writer whose
    commit equals its successor's is refused, not taken for a harmless retry."""
    claim: str | None = None
    """The owner this commit claims the thread for, if it carries a claim: two claimants
    racing from one epoch name the same next epoch, and this keeps their bytes apart."""

    @model_validator(mode="after")
    def _legal(self) -> ThreadCommit:
        _check_legal(self)
        return self

    @property
    def operation_id(self) -> OperationId:
        return commit_operation_id(self.run_id, self.ordinal)

    @cached_property
    def free_form_plain(self) -> bool:
        """Whether command values and fact data, the commit's only free-form parts, are
        plain JSON (``is_plain``). Typed fields hold str, int, bool, None and records
        only (a test holds the schema to that), so this decides the encoder's path."""
        return is_plain([c.value for c in self.commands]) and is_plain(
            [e.data for e in self.events]
        )

    @cached_property
    def facts(self) -> tuple[Fact, ...]:
        """Every fact of the commit, in order: the derived ones (``facts_of``), then the
        stored ones. Records before schema 3 stored both; the facts are read from them."""
        if self.schema_version < 3:
            return self.events
        derived = facts_of(self.run_id, self.label, self.messages, self.status, self.disposition)
        return (*derived, *self.events) if self.events else derived

    @cached_property
    def encoded(self) -> str:
        """Canonical JSON: encoded once, hashed and stored as is."""
        return canonical_model_json(self, plain=self.free_form_plain)

    @cached_property
    def payload_hash(self) -> str:
        """Taken before anything is stored (``advance``): text no store can hold as
        UTF-8 is refused here, whatever part of the commit carries it (the texts a user
        or a model gives are refused earlier, by name; this catches the rest, such as an
        agent's own configuration: a plugin id, a session's prompt)."""
        try:
            return sha256_hex(self.encoded)
        except UnicodeEncodeError as exc:
            raise unstorable_text(self, exc) from None


def unstorable_text(commit: ThreadCommit, exc: UnicodeEncodeError) -> CommitRefused:
    """The refusal of a commit whose encoding holds an unpaired surrogate, with the text
    before it (escaped), so that the part of the commit carrying it can be told."""
    around = commit.encoded[max(0, exc.start - 60) : exc.start + 1]
    return CommitRefused(
        f"commit {commit.operation_id}",
        "utf8",
        f"an unpaired surrogate at {exc.start}, in ...{around!a}",
    )


def _check_legal(commit: ThreadCommit) -> None:
    """The rules of a commit beyond its fields' types (raises ValueError)."""
    disposition, run_id = commit.disposition, commit.run_id
    if disposition.run_id != run_id:
        raise ValueError("disposition belongs to another run")
    if isinstance(disposition, AwaitingState):
        ticket = disposition.ticket
        if ticket.run_id != run_id or ticket.thread_id != commit.thread_id:
            raise ValueError("the ticket names another run or thread")
    batch = commit.batch
    if batch is not None and batch.run_id != run_id:
        raise ValueError("the batch belongs to another run")
    if isinstance(disposition, EndedState):
        if batch is not None and batch.status != "finalized":
            raise ValueError("an ended run's batch must be sealed and finalized")
        if (
            isinstance(disposition.cause, Natural)
            and not any(isinstance(m, AssistantMessage) for m in commit.messages)
            and not closes_session(commit)
        ):
            raise ValueError("a natural end requires committed assistant output")


def closes_session(commit: ThreadCommit) -> bool:
    """A session's natural end follows its last turn, committed before it
    (``runtime.session``): it carries the session's close instead of an answer."""
    return any(
        c.scope == "thread"
        and c.key == SESSION_KEY
        and isinstance(c.value, dict)
        and c.value.get("ended") is True
        for c in commit.commands
    )


_LABELS: frozenset[str] = frozenset(get_args(CommitLabel))
_COMMANDS = TypeAdapter(tuple[Command, ...])


def assemble_commit(
    *,
    thread_id: ThreadId,
    run_id: RunId,
    ordinal: int,
    label: CommitLabel,
    disposition: RunDisposition,
    messages: tuple[Message, ...] = (),
    commands: tuple[Command, ...] = (),
    batch: ActiveToolBatch | None = None,
    status: ThreadStatus | None = None,
    extra_facts: tuple[Fact, ...] = (),
    prev: str = "",
    epoch: int = 0,
    claim: str | None = None,
) -> ThreadCommit:
    """The engine's commit, storing ``extra_facts`` (its ``facts`` are those derived
    from it by ``facts_of``, then these): the same commit as ``ThreadCommit(...)``, at a
    fraction of the cost.

    Its parts are records the engine made and validated as it made them; the
    constructor would re-check each nested record's type, which costs more than all the
    rest of a commit's work. What is not already known to hold is checked here: the
    label and ordinal, the commit's rules (``_legal``) and the batch invariants, as the
    constructor and a decode would. Commands may come from hooks as any object, so
    unless they are all Commands they are validated (and coerced) as the constructor
    would. Only command values and extra facts are looked at for the encoder
    (``free_form_plain``).
    """
    if label not in _LABELS:
        raise ValueError(f"unknown commit label {label!r}")
    if ordinal < 0:
        raise ValueError(f"commit ordinal {ordinal} is negative")
    if not all(type(c) is Command for c in commands):
        commands = _COMMANDS.validate_python(commands)
    if batch is not None:
        check_invariants(batch)
    commit = trusted(
        ThreadCommit,
        thread_id=thread_id,
        run_id=run_id,
        ordinal=ordinal,
        label=label,
        disposition=disposition,
        messages=messages,
        commands=commands,
        batch=batch,
        status=status,
        events=extra_facts,
        prev=prev,
        epoch=epoch,
        claim=claim,
    )
    _check_legal(commit)
    commit.__dict__["free_form_plain"] = is_plain(  # warm the cache with what is known
        [c.value for c in commands]
    ) and is_plain([f.data for f in extra_facts])
    return commit


def decode_commit(text: str | bytes, thread: str, seq: int) -> ThreadCommit:
    """Decode a stored commit, re-validating everything; fail closed with CorruptRecord.

    The record *is* its stored text (the caller verified it against its stored hash):
    the decoded commit keeps that text as its encoding, so its hash is the stored one —
    also for records of schema 1, whose re-encoding today would add fields they lack."""
    try:
        commit = ThreadCommit.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, seq, str(exc.errors()[0].get("msg", exc))) from exc
    commit.__dict__["encoded"] = text if isinstance(text, str) else text.decode()
    return commit


class Receipt(Frozen):
    thread_id: ThreadId
    seq: int
    """The thread version this commit produced."""
    operation_id: OperationId
    payload_hash: str
    group: int = 1
    """Commits the store wrote in the same transaction as this one (its group writer's
    group; 1 for a store without one, and for a retried commit found as already written)."""


def _frozen_state(value: StateView) -> StateView:
    frozen: StateView = value if type(value) is FrozenDict else freeze(value)
    return frozen


class Frontier(Frozen):
    """Everything recovery needs, kept current by every append (no log replay on load).

    **Its head and its history.** A store keeps the frontier without its messages (its
    *head*: ``message_count`` says how many there are) and the messages once, in the
    log; ``CommitStore.load`` gives the whole frontier, messages included. A frontier
    holds its history when ``len(messages) == message_count`` (``has_history``); a head
    alone (``head_only``, what the stores admit appends against) holds none, and the
    fold keeps it so: it never holds a part of the history.
    """

    schema_version: Literal[1, 2, 3] = FRONTIER_SCHEMA
    thread_id: ThreadId
    version: Count = 0
    epoch: Count = 0
    owner: str | None = None
    run_id: RunId | None = None
    run_state: RunDisposition | None = None
    batch: ActiveToolBatch | None = None
    """The open batch of the current Run, if any."""
    status: ThreadStatus = ThreadStatus()
    state: Annotated[StateView, AfterValidator(_frozen_state)] = Field(default_factory=empty_state)
    """Deeply immutable (``runtime.frozen``): nobody who reads it can change it."""
    messages: tuple[Message, ...] = ()
    """The thread's messages, every Run's, in order; empty in a head (see above), and
    never stored from schema 3 on."""
    message_count: Count = 0
    """How many messages the thread holds (its history's length, stored in the head)."""
    run_start: Count = 0
    """Index in ``messages`` where the current Run's messages begin."""
    steps: Count = 0
    """Inferences committed by the current Run."""
    next_ordinal: Count = 0
    head: str = ""
    """Hash of the latest commit ("" before the first): the head of the hash chain."""
    failed_recoveries: Count = 0
    """Executions of the current Run lost or failed to recover in a row: status commits
    that settled it ``failed`` with no progress between them (``actors.ownership``
    ends the Run ``failed(recovery)`` when this reaches its limit)."""

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data: object) -> object:
        """A frontier stored before schema 3 holds its messages and no count of them."""
        if isinstance(data, dict) and "message_count" not in data:
            return {**data, "message_count": len(data.get("messages") or ())}
        return data

    @property
    def ended(self) -> bool:
        return isinstance(self.run_state, EndedState)

    @property
    def has_history(self) -> bool:
        return len(self.messages) == self.message_count


def head_only(frontier: Frontier) -> Frontier:
    """The frontier without its messages, at the current schema: what a store keeps
    (and checksums)."""
    if frontier.messages or frontier.schema_version != FRONTIER_SCHEMA:
        return evolve(frontier, messages=(), schema_version=FRONTIER_SCHEMA)
    return frontier


def with_history(frontier: Frontier, messages: tuple[Message, ...]) -> Frontier:
    """A head with its whole history (the caller read and verified ``messages``)."""
    if len(messages) != frontier.message_count:
        raise ValueError(f"{len(messages)} messages for a head of {frontier.message_count}")
    return evolve(frontier, messages=messages)


def whole_of(frontier: Frontier | None, thread: str) -> Frontier | None:
    """``frontier`` if it is ``thread``'s whole frontier (a head has no messages)."""
    if frontier is None or frontier.thread_id != thread:
        return None
    return frontier if len(frontier.messages) == frontier.message_count else None


_HEAD_FIELDS = {"messages"}


def frontier_text(frontier: Frontier) -> str:
    """The stored text of a frontier (schema 3): its head, never its messages."""
    return head_only(frontier).model_dump_json(exclude=_HEAD_FIELDS)
