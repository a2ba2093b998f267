"""The pure rules every store shares: admission and the fold (DESIGN §3, §5).

``admit`` is the one admission rule (idempotency, the compare-and-set claim, fencing,
terminal-is-final, version, the hash chain) and ``advance`` the one fold; every
backend calls them inside its own transaction (or Lua script), so all backends agree
by construction. ``check_claim`` is the rule of a claim alone; ``with_claim`` the new
owner it makes. The records they work on are in ``runtime.commit``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from runtime.base import evolve, trusted
from runtime.commit import Frontier, Receipt, ThreadCommit, unstorable_text
from runtime.errors import (
    CommitRefused,
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    PayloadTooLarge,
    RunEnded,
    VersionConflict,
)
from runtime.events import Fact
from runtime.frozen import FrozenDict
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState
from runtime.limits import STORED_DEPTH, STORED_ID_CHARS
from runtime.messages import AssistantMessage, UserMessage
from runtime.state import apply_commands

LOST_WAITING = "execution_lost_waiting"
"""The status reason of a Run whose host was lost while the Run only waited on children
that run on (``actors.ownership``): the loss is on record, but it does not count toward
the Run's dead letter (``Frontier.failed_recoveries``): its host's deaths were not its
doing, and its children's answers are on their way."""

TraceCheck = Callable[[Frontier, ThreadCommit], None]
TRACE_CHECKS: list[TraceCheck] = []
"""Called by ``admit`` with (frontier, commit) for every commit a store admits (the
fold accepted it; the frontier is the one before it). The test suite's trace checker
is installed here in every process it starts, Ray workers included:
``RATCHET_TRACE_CHECK=module:function`` in the environment names it (read once, at
the first admission)."""
_trace_env_read = False


def _trace_checks() -> list[TraceCheck]:
    global _trace_env_read
    if not _trace_env_read:
        _trace_env_read = True
        ref = os.environ.get("RATCHET_TRACE_CHECK")
        if ref:
            module, _, name = ref.partition(":")
            TRACE_CHECKS.append(getattr(importlib.import_module(module), name))
    return TRACE_CHECKS


def check_claim(frontier: Frontier, supersedes: int) -> None:
    """A claim names the epoch it supersedes: refused if the thread has moved on."""
    if supersedes != frontier.epoch:
        raise Fenced(frontier.thread_id, supersedes, frontier.epoch)


def _check_receipt(frontier: Frontier, commit: ThreadCommit, known: Receipt) -> None:
    """A stored receipt is handed back to a retry as its commit's: it must be one of this
    thread's, for this operation, at a version the thread has reached (CorruptRecord
    otherwise: a receipt edited by hand, or planted under a future operation id)."""
    if (
        known.thread_id != commit.thread_id
        or known.operation_id != commit.operation_id
        or not 0 < known.seq <= frontier.version
    ):
        raise CorruptRecord(commit.thread_id, known.seq, "the stored receipt is not this thread's")


def admit(
    frontier: Frontier,
    commit: ThreadCommit,
    expected_version: int,
    epoch: int,
    known: Receipt | None,
    claim: str | None = None,
    deferred: list[tuple[Frontier, ThreadCommit]] | None = None,
) -> Receipt | Frontier:
    """The admission rule: the original receipt of a harmless retry, else the frontier
    the admitted commit folds to (claimed first by ``claim``, at epoch + 1, when given).

    ``deferred``: the admission is provisional (a planned group, which knows no stored
    receipts: the database's keys decide), so the trace checks are left to
    ``trace_checks`` once it is written, instead of run here.

    ``known`` is the receipt already stored under the commit's operation id, if any.
    Raises Fenced, DuplicateOperation, RunEnded, VersionConflict, InvalidTransition
    (including a commit that does not extend the chain head) or StateConflict.
    """
    if known is not None:
        _check_receipt(frontier, commit, known)
    if known is not None and known.payload_hash == commit.payload_hash:
        # a retried write that already landed: harmless, even if since fenced (the hash
        # covers the writer's epoch and claim, so this is the same writer's commit)
        return known
    if epoch != frontier.epoch:
        raise Fenced(commit.thread_id, epoch, frontier.epoch)
    if commit.epoch != (epoch + 1 if claim is not None else epoch) or commit.claim != claim:
        raise InvalidTransition(
            f"thread {commit.thread_id}: the commit names epoch {commit.epoch} and claim "
            f"{commit.claim!r}; its writer holds {epoch} and claims {claim!r}"
        )
    if frontier.ended and frontier.run_id == commit.run_id:
        raise RunEnded(commit.thread_id, commit.run_id)
    # a stale writer hears that the thread moved on, whatever else it got wrong
    if expected_version != frontier.version:
        raise VersionConflict(commit.thread_id, expected_version, frontier.version)
    if known is not None:
        raise DuplicateOperation(commit.operation_id)
    if commit.prev != frontier.head:
        raise InvalidTransition(
            f"thread {commit.thread_id}: the commit does not extend the head of its log"
        )
    if claim is not None:
        frontier = with_claim(frontier, claim)
    folded = advance(frontier, commit)  # refuses (InvalidTransition, StateConflict) first
    if deferred is not None:
        deferred.append((frontier, commit))
    else:
        trace_checks([(frontier, commit)])
    return folded


def trace_checks(admitted: list[tuple[Frontier, ThreadCommit]]) -> None:
    """Run the installed trace checks on admitted commits, each with its frontier."""
    for check in _trace_checks():
        for frontier, commit in admitted:
            check(frontier, commit)


def receipt_of(commit: ThreadCommit, seq: int) -> Receipt:
    """The receipt of an admitted commit that landed at ``seq`` (its fields are valid)."""
    return trusted(
        Receipt,
        thread_id=commit.thread_id,
        seq=seq,
        operation_id=commit.operation_id,
        payload_hash=commit.payload_hash,
    )


def check_size(commit: ThreadCommit, limit: int) -> None:
    """What every store checks of a commit before writing it: storable text, ids included
    (no unpaired surrogate), at most ``limit`` bytes, and nested no deeper than a record
    may be to decode again (``STORED_DEPTH``); CommitRefused or PayloadTooLarge otherwise.
    Its typed parts nest a few levels; only its free-form JSON (command values, fact data)
    can nest deeper, and that is what is measured."""
    text = commit.encoded
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise unstorable_text(commit, exc) from None
    if size > limit:
        raise PayloadTooLarge(size, limit)
    keys = len(commit.thread_id.encode()) + len(commit.operation_id.encode())
    if keys > KEY_BYTES:
        raise CommitRefused(
            f"commit {commit.operation_id[:80]}",
            "id_chars",
            f"its thread and operation ids take {keys} bytes together; a store's index "
            f"takes {KEY_BYTES}",
        )
    free_form = [c.value for c in commit.commands] + [f.data for f in commit.events]
    if _deeper_than(free_form, STORED_DEPTH - _RECORD_DEPTH):
        raise CommitRefused(
            f"commit {commit.operation_id}",
            "json_depth",
            f"the record nests deeper than {STORED_DEPTH} levels: it would not decode again",
        )


KEY_BYTES = STORED_ID_CHARS
"""A record's thread id and operation id together, in UTF-8: PostgreSQL's unique index on
the two refuses an entry past about 2,700 bytes, after the records before it were
written (a copied run id may be as long as any stored one, ``STORED_IDS``: a fork or an
import checks its copy against this before it writes, ``runtime.history_write.check_sizes``).
Ids within the default ``id_chars`` take at most about 2,070."""

_RECORD_DEPTH = 8
"""How deep a commit's own structure holds its free-form values (commands[i].value and
events[i].data sit 3 levels down; a frontier's state[scope][key] as many): a margin."""


def _deeper_than(values: list[Any], limit: int) -> bool:
    """Whether any of ``values`` nests more than ``limit`` levels of lists and dicts."""
    stack: list[tuple[Any, int]] = [(v, 1) for v in values if isinstance(v, dict | list | tuple)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))
    return False


_KEPT: OrderedDict[int, tuple[Frontier, ThreadCommit, Frontier]] = OrderedDict()
"""(frontier, commit, result) of the engines' folds (``advance(..., keep=True)``) whose
commit no store has folded yet, by the commit's id (the entry holds the commit: its id
is not reused while kept). Each is taken by the store's fold of the same commit; one that
never is (an append refused before its fold, or given up) is dropped when ``KEPT_FOLDS``
newer ones came. Its operations are single C calls, safe beside a store's writer thread."""

KEPT_FOLDS = 256
"""The engines' folds kept at most: each commit's stays from the engine's fold to its
store's, and a Run has two commits on their way at most (a Step's results landing, the
next commit queued behind them): room for a hundred Runs committing at once, beyond
which the oldest ones' stores fold again, as if nothing were kept. What an entry holds
is the engine's working copy, alive while its Run is; an entry never taken outlives
it until newer ones push it out, so the bound is kept small."""


def advance(frontier: Frontier, commit: ThreadCommit, *, keep: bool = False) -> Frontier:
    """Fold one admitted commit into the frontier.

    The engine folds each commit just before appending it (``keep``), and an in-process
    store then folds the same commit onto the same frontier: the engine's fold is kept
    until then, so the second one costs nothing, however many other Runs' commits came
    between. Both are immutable and the fold is pure, so the kept result is exactly what
    folding again would give — for the same objects, or for a frontier with the same
    identity (``_same``): the store's own copy of a new thread, say.
    """
    kept = _KEPT.pop(id(commit), None) if _KEPT else None
    if kept is not None and kept[1] is commit and _same(kept[0], frontier):
        before, _, folded = kept
        if len(before.messages) == len(frontier.messages):
            return folded
        if not frontier.messages:  # a store's head after the engine's whole frontier
            return evolve(folded, messages=(), schema_version=frontier.schema_version)
    result = _fold(frontier, commit)
    if keep:
        _KEPT[id(commit)] = (frontier, commit, result)
        if len(_KEPT) > KEPT_FOLDS:
            with contextlib.suppress(KeyError):  # emptied by another thread meanwhile
                _KEPT.popitem(last=False)
    return result


def _same(a: Frontier, b: Frontier) -> bool:
    """One frontier, though perhaps two objects: a thread's version and head determine
    its log (the hash chain), the fold of which is all of it but ownership and which of
    its messages the frontier holds (a store's head keeps none: ``advance``)."""
    return a is b or (
        a.version == b.version
        and a.head == b.head
        and a.thread_id == b.thread_id
        and a.epoch == b.epoch
        and a.owner == b.owner
    )


def _fold(frontier: Frontier, commit: ThreadCommit) -> Frontier:
    # every field is read once: reads on a record are not cheap, and this runs per commit
    run_id, ordinal, messages = commit.run_id, commit.ordinal, commit.messages
    new_run = run_id != frontier.run_id
    if new_run and frontier.run_state is not None and not frontier.ended:
        raise InvalidTransition(
            f"thread {commit.thread_id} already has an active run {frontier.run_id}"
        )
    if not new_run and ordinal != frontier.next_ordinal:
        raise InvalidTransition(
            f"run {run_id}: commit ordinal {ordinal}, expected {frontier.next_ordinal}"
        )
    state, batch, disposition = frontier.state, commit.batch, commit.disposition
    if new_run:
        state = FrozenDict(thread=state["thread"], run=FrozenDict())
    if isinstance(disposition, EndedState) or (batch is not None and batch.status == "finalized"):
        batch = None
    elif batch is None and not new_run:
        batch = frontier.batch
    commands, committed, count = commit.commands, frontier.messages, frontier.message_count
    inferences = sum(isinstance(m, AssistantMessage) for m in messages)
    if commit.label != "status":
        failed_recoveries = 0  # progress, or a new Run
    elif (
        commit.status is not None
        and commit.status.state == "failed"
        and commit.status.reason != LOST_WAITING
    ):
        failed_recoveries = frontier.failed_recoveries + 1
    else:
        failed_recoveries = frontier.failed_recoveries
    return evolve(
        frontier,
        version=frontier.version + 1,
        run_id=run_id,
        run_state=disposition,
        batch=batch,
        status=commit.status or frontier.status,
        state=apply_commands(state, commands) if commands else state,
        # a head stays a head; a whole history grows by the commit's messages
        messages=committed + messages if len(committed) == count else (),
        message_count=count + len(messages),
        run_start=count if new_run else frontier.run_start,
        steps=(0 if new_run else frontier.steps) + inferences,
        next_ordinal=ordinal + 1,
        head=commit.payload_hash,
        failed_recoveries=failed_recoveries,
    )


_last_claim: tuple[Frontier, str, Frontier] | None = None
"""(frontier, owner, result) of the latest ``with_claim``."""


def with_claim(frontier: Frontier, owner: str) -> Frontier:
    """A new owner: epoch + 1, which fences every earlier writer.

    An engine claims the frontier it folds its claiming commit onto, and an in-process
    store then claims the same frontier object for the same owner: the latest result is
    kept so both get one object, and the fold after it is remembered for both too (see
    ``advance``). Pure and immutable, as there.
    """
    global _last_claim
    last = _last_claim
    if last is not None and last[1] == owner and _same(last[0], frontier):
        return last[2]
    result = evolve(frontier, epoch=frontier.epoch + 1, owner=owner)
    _last_claim = (frontier, owner, result)
    return result


def replay(thread: ThreadId, commits: Iterable[ThreadCommit]) -> Frontier:
    """Rebuild a frontier from the log alone (tests compare it with the stored one)."""
    frontier = Frontier(thread_id=thread)
    for commit in commits:
        frontier = advance(frontier, commit)
    return frontier


def stamp_facts(commit: ThreadCommit, seq: int) -> tuple[Fact, ...]:
    """The commit's facts (derived and stored: ``ThreadCommit.facts``) with their stream
    offsets (seq, index)."""
    return tuple(evolve(fact, seq=seq, index=i) for i, fact in enumerate(commit.facts))


def ran_before(frontier: Frontier, message_id: str) -> bool:
    """Whether an earlier Run of the thread was started with this input message (its
    receipts may be pruned: the history keeps the message)."""
    return any(isinstance(m, UserMessage) and m.id == message_id for m in frontier.messages)


INPUT = ":input"
"""A Run's input message is named for its Run: ``RUN:input`` (the engine's own), or
``RUN:input|PLACEMENT|AGENT`` (the cluster's, which rebuilds the Run's agent and
placement from it in every process: ``actors.wire.RunMeta``)."""


def input_message_id(run_id: str, placement: str | None = None, agent: str | None = None) -> str:
    """The id of ``run_id``'s input message (with the cluster's placement and agent)."""
    own = f"{run_id}{INPUT}"  # a run id of the wrong type is refused by its check, later
    return own if placement is None or agent is None else f"{own}|{placement}|{agent}"


def input_meta(message_id: str) -> tuple[str, str, str] | None:
    """(``RUN:input``, placement, agent) of a cluster's input message id; None for any
    other. Read from the right: a run id may hold "|" (ids refuse only control
    characters), an agent reference cannot (no module or attribute is named so)."""
    parts = message_id.rsplit("|", 2)
    if len(parts) != 3 or not parts[0].endswith(INPUT):
        return None
    own, placement, agent = parts
    return own, placement, agent


def run_id_used(frontier: Frontier, run_id: str) -> bool:
    """Whether a Run of the thread was started under ``run_id``, whatever it was asked
    with: by its input message's id, in either form (``input_message_id``). The history
    keeps that message when a prune drops the Run's receipts, which alone made the store
    refuse the id again."""
    own = input_message_id(run_id)
    for m in frontier.messages:
        if isinstance(m, UserMessage) and (
            m.id == own or ((meta := input_meta(m.id)) is not None and meta[0] == own)
        ):
            return True
    return False


def check_repeated_start(
    frontier: Frontier, message_id: str, text: str, run_id: str | None = None
) -> None:
    """A start of a Run that exists is a repeat only if it asked the same: its input
    message (same id, same text) is the one the Run was started with. Anything else
    would be told it started a Run that is not what it asked for (InvalidTransition).
    ``run_id``: the Run asked for (the thread's, by default; or one before it)."""
    for message in reversed(frontier.messages):
        if isinstance(message, UserMessage) and message.id == message_id:
            if message.text == text:
                return
            break
    raise InvalidTransition(
        f"run {run_id or frontier.run_id} exists on thread {frontier.thread_id} with "
        "another input or agent; a new Run needs a new id"
    )
