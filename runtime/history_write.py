"""The one write path of a fork and an import: the source's records re-made for the new
thread (``remade``), checked as the store will check them (``folded``,
``check_sizes``), then appended (``write_copy``). ``runtime.history`` decides what to
copy and refuses what it must; everything here is the same for both.

**The writer.** The new thread is written by one owner, the fork or the import
(``runtime.history.fork_owner``, ``import_owner``): its first record carries the
claim (epoch 0 → 1), and so does every record that carried one in the source; where
the source's epoch moved without a claim in the record (a recovery claims the thread,
then commits), the writer claims the thread before that record. The copy keeps the
source's shape of ownership — where each way in began, which a replay reads — but
not its claimants: those owners never owned the new thread.

**Interrupted.** ``write_copy`` finds the prefix an earlier run of the same fork or
import wrote (``_written``) and appends the rest; a thread written by anyone else is
``thread_exists``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.base import evolve
from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    assemble_commit,
)
from runtime.errors import (
    Fenced,
    InputRefused,
    PayloadTooLarge,
    RatchetError,
    RunEnded,
    VersionConflict,
)
from runtime.facts import facts_of
from runtime.history_format import HistoryRefused
from runtime.ids import ThreadId
from runtime.injection import carried_by_answer
from runtime.lifecycle import AwaitingState, RunDisposition, UserInputTarget
from runtime.limits import STORED_IDS, Limits, check_id, history_size, state_size
from runtime.ports import CommitStore
from runtime.reserved import reserved_problem
from runtime.rules import admit, check_size, receipt_of, with_claim

Refuse = Callable[[int, str, str], HistoryRefused]
"""Makes the caller's error from (seq of the source record, reason, detail); seq 0: not
about a record (the thread written to)."""


def remade(
    commits: Sequence[ThreadCommit], thread: ThreadId, owner: str, refuse: Refuse
) -> list[ThreadCommit]:
    """``commits`` re-made for ``thread``, written by ``owner``: its claim on the first
    and on each that carried one, a new epoch wherever the source's moved, the chain
    recomputed. A ticket is re-addressed to ``thread``; all else — run ids, ordinals,
    labels, messages, commands, batches, status — is kept."""
    planned: list[ThreadCommit] = []
    prev, epoch, source_epoch = "", 0, None
    for seq, commit in enumerate(commits, start=1):
        try:  # an id no caller could have given (a control character, say): not copied;
            # a stored one's length (``STORED_IDS``), whatever its system's id_chars was
            check_id("run id", commit.run_id, STORED_IDS)
        except InputRefused as exc:
            raise refuse(seq, exc.limit, str(exc)) from None
        claims = not planned or commit.claim is not None
        if claims or commit.epoch != source_epoch:
            epoch += 1
        source_epoch = commit.epoch
        made = remake(commit, thread, prev, epoch=epoch, claim=owner if claims else None)
        if made is None:
            raise refuse(seq, "record", "its facts are not the ones its parts make")
        planned.append(made)
        prev = made.payload_hash
    return planned


def remake(
    commit: ThreadCommit, thread: ThreadId, prev: str, *, epoch: int, claim: str | None
) -> ThreadCommit | None:
    """One commit re-made for ``thread`` (None: its facts are not derived from it, which
    no engine writes: such a record is refused, not copied blindly)."""
    extra = commit.events  # from schema 3 on, the commit stores only these
    if commit.schema_version < 3:
        derived = facts_of(
            commit.run_id, commit.label, commit.messages, commit.status, commit.disposition
        )
        if commit.events[: len(derived)] != derived:
            return None
        extra = commit.events[len(derived) :]
    return assemble_commit(
        thread_id=thread,
        run_id=commit.run_id,
        ordinal=commit.ordinal,
        label=commit.label,
        disposition=_readdressed(commit.disposition, thread),
        messages=commit.messages,
        commands=commit.commands,
        batch=commit.batch,
        status=commit.status,
        extra_facts=extra,
        prev=prev,
        epoch=epoch,
        claim=claim,
    )


def _readdressed(disposition: RunDisposition, thread: ThreadId) -> RunDisposition:
    if isinstance(disposition, AwaitingState):
        return evolve(disposition, ticket=evolve(disposition.ticket, thread_id=thread))
    return disposition


def folded(
    planned: Sequence[ThreadCommit],
    thread: ThreadId,
    owner: str,
    refuse: Refuse,
    limits: Limits,
) -> Frontier:
    """The frontier the store will fold ``planned`` to (what it would refuse, refused
    here, before anything is written): each commit admitted as ``write_copy`` appends it,
    by the store's own rule — a commit of a Run after its end, an operation id seen
    before, are refused here too, not half-way through the writing. The thread is held
    to the history limits of the system it is written for (``within_limits``)."""
    frontier = Frontier(thread_id=thread)
    known: dict[str, Receipt] = {}
    held, checked = 0, 0  # history bytes so far; the last commit the runtime checks
    state: Any = None  # the state that commit left
    for seq, commit in enumerate(planned, start=1):
        try:
            if commit.claim is None and commit.epoch != frontier.epoch:
                frontier = with_claim(frontier, owner)  # claimed before it, as write_copy does
            seen = known.get(commit.operation_id)
            admitted = admit(frontier, commit, seq - 1, frontier.epoch, seen, commit.claim)
        except (RatchetError, ValueError) as exc:
            raise refuse(seq, "replay", f"the log does not replay: {exc}") from None
        if not isinstance(admitted, Frontier):  # the same commit as an earlier one
            raise refuse(seq, "replay", "the log repeats an earlier commit")
        problem = reserved_problem(admitted.state, commit.commands)
        if problem is not None:  # no Run wrote it: the runtime and the CLI would choke on it
            raise refuse(seq, "reserved_state", problem)
        frontier = admitted
        known[commit.operation_id] = receipt_of(commit, seq)
        held += history_size(commit.messages) if commit.messages else 0
        if commit.label != "ended":
            _within_history(commit, seq, held, limits, refuse)
            checked, state = seq, frontier.state
    if checked:
        _within_state(checked, state, limits, refuse)
    _within_answer(frontier, len(planned), held, limits, refuse)
    return frontier


def _within_answer(waiting: Frontier, seq: int, held: int, limits: Limits, refuse: Refuse) -> None:
    """The runtime's rule for a wait for input (``committing``'s ``_within_answer``):
    room in ``history_bytes`` for what its answer writes ahead of its text
    (``carried_by_answer``). Copied past it, every answer was refused and the Run waited
    for ever."""
    state = waiting.run_state
    if not (isinstance(state, AwaitingState) and isinstance(state.ticket.target, UserInputTarget)):
        return
    size = held + history_size(carried_by_answer(waiting))
    if size > limits.history_bytes:
        raise refuse(
            seq,
            "history_bytes",
            f"the answer to its wait for input would hold {size} bytes before its own text, "
            f"past this system's limit of {limits.history_bytes}",
        )


def _within_history(
    commit: ThreadCommit, seq: int, held: int, limits: Limits, refuse: Refuse
) -> None:
    """The runtime's rule for a commit other than a Run's end (``committing``: an end
    always lands, past any limit): within ``history_bytes`` and ``history_commits``, an
    awaiting commit with one commit kept for its resume. Copied past them, the thread
    holds what no Run of the system could have left it: its awaiting Run, answered, ends
    ``failed(history_limit)`` with the answer never applied, and every start on it is
    refused."""
    room = 1 if commit.label == "awaiting" else 0
    if seq + room > limits.history_commits:
        kept = " (and a wait keeps one for its resume)" if room else ""
        raise refuse(
            seq,
            "history_commits",
            f"commit {seq}{kept} is past this system's limit of {limits.history_commits} "
            "commits per thread (only a Run's end is committed past it)",
        )
    if held > limits.history_bytes:
        raise refuse(
            seq,
            "history_bytes",
            f"the thread's history holds {held} bytes here, past this system's limit of "
            f"{limits.history_bytes} (only a Run's end is committed past it)",
        )


def _within_state(seq: int, state: Any, limits: Limits, refuse: Refuse) -> None:
    """``state_bytes``, measured once: where the last commit the runtime checks (any but
    a Run's end) left the state. A thread copied past it goes on with no Run: the first
    commit that grows its state (a Step's usage, say) ends the Run ``failed(history_limit,
    state_bytes)``."""
    size = state_size(state)
    if size > limits.state_bytes:
        raise refuse(
            seq,
            "state_bytes",
            f"the thread's state holds {size} bytes here, past this system's limit of "
            f"{limits.state_bytes}",
        )


def payload_limit_of(store: CommitStore) -> int:
    """The largest commit ``store`` takes: not part of the port, the stores that have a
    limit say so (as ``check_room`` reads); the default for one that does not."""
    limit = getattr(store, "payload_limit", None)
    return (
        limit if isinstance(limit, int) and not isinstance(limit, bool) else DEFAULT_PAYLOAD_LIMIT
    )


def check_sizes(store: CommitStore, planned: Sequence[ThreadCommit], refuse: Refuse) -> None:
    limit = payload_limit_of(store)
    for seq, commit in enumerate(planned, start=1):
        # what every store checks before it writes (``check_size``), before one is written:
        # a record refused half way through left a thread of the records before it
        try:
            check_size(commit, limit)
        except PayloadTooLarge as exc:
            raise refuse(seq, "too_large", f"{exc.size} bytes; the store takes {limit}") from None
        except InputRefused as exc:
            raise refuse(seq, exc.limit, str(exc)) from None


async def write_copy(
    store: CommitStore,
    thread: ThreadId,
    planned: Sequence[ThreadCommit],
    owner: str,
    refuse: Refuse,
) -> Frontier:
    """Append what of ``planned`` the thread does not hold yet, each at the version and
    epoch it must find: a record with a claim claims the thread for ``owner`` with it
    (the first: epoch 0 → 1), one at a new epoch without a claim is preceded by a claim.
    A refused append is looked into: another run of this same fork or import went ahead
    (go on from where it is), or someone else wrote the thread (thread_exists)."""
    version, epoch = await _written(store, thread, planned, owner, refuse)
    while version < len(planned):
        commit = planned[version]
        try:
            if commit.claim is not None:
                await store.append(commit, version, epoch, claim=owner)
            else:
                if commit.epoch != epoch:
                    epoch = (await store.claim(thread, owner, supersedes=epoch)).epoch
                await store.append(commit, version, epoch)
            version, epoch = version + 1, commit.epoch
        except (VersionConflict, Fenced, RunEnded):  # RunEnded: another run of this
            # copy wrote the same end first (PostgreSQL's lock saw it before its receipt)
            ahead = await _written(store, thread, planned, owner, refuse)
            if ahead <= (version, epoch):  # refused what it says it lacks: not ours
                raise
            version, epoch = ahead
    return await store.load(thread)


def _epochs_at(planned: Sequence[ThreadCommit], held: int) -> tuple[int, ...]:
    """The epochs a thread holding ``planned[:held]`` may be at: its last record's, or
    the next record's if this writer claims the thread before appending it."""
    now = planned[held - 1].epoch
    following = planned[held] if held < len(planned) else None
    if following is not None and following.claim is None and following.epoch != now:
        return (now, following.epoch)
    return (now,)


async def _written(
    store: CommitStore,
    thread: ThreadId,
    planned: Sequence[ThreadCommit],
    owner: str,
    refuse: Refuse,
) -> tuple[int, int]:
    """How many of ``planned`` the thread holds already, and its epoch: (0, 0) for a
    thread nobody wrote, the prefix an interrupted run of this same fork or import
    wrote (its claim for the next record perhaps made); else thread_exists."""
    frontier = await store.load(thread)
    if frontier.version == 0 and frontier.epoch == 0:
        return 0, 0
    n = frontier.version
    if frontier.owner == owner and 0 < n <= len(planned):
        kept = await store.read(thread)  # all n records, or those after a prune's anchor
        whole = not kept or kept[0].seq == 1
        same = frontier.head == planned[n - 1].payload_hash and all(
            r.commit.payload_hash == planned[r.seq - 1].payload_hash for r in kept
        )
        # pruned since: only a copy written whole (a prune refuses one under way)
        if same and (whole or n == len(planned)) and frontier.epoch in _epochs_at(planned, n):
            return n, frontier.epoch
    raise refuse(
        0,
        "thread_exists",
        f"thread {thread!r} exists (version {frontier.version}, owner {frontier.owner!r}): "
        "pick a new id",
    )
