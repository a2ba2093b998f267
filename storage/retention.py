"""Retention: pruning the commit logs of ended Runs, the rule every backend shares.

**The rule.** A prune removes a thread's records 1..N, where N is the seq of a Run's
``ended`` commit. Runs of a thread follow one another (a Run starts only once the one
before has ended, and an ended Run commits nothing more: ``runtime.rules.admit``), so
every record up to N belongs to a Run that had ended by N, and every record of a Run
still running or awaiting lies after N: nothing it needs goes. The frontier stays as
it is (it holds the state and the status), and the thread keeps the seq and stored
hash of record N beside it, its *anchor*: reads verify the records kept as a chain
from it (``runtime.integrity.verified_records``). The messages of the records removed
move, in the same atomic step, to the thread's *pruned history* beside the anchor (each
message's text once, and their ``history_digest``), so a load still has every Run's
messages (``runtime.integrity.whole_frontier``).

**One atomic cut, compare-and-set on the anchor.** ``prune_thread`` reads the log
(verified: a damaged log is never pruned, so the damage stays for ``ratchet verify``
to name), checks the rule and hands the backend a ``Cut``: remove the records after
the anchor as read, up to N, if the anchor is still that one and record N still has
the hash read. The cut does not depend on the thread's version: records never change,
so an ``ended`` record stays the end of a Run however far the thread has moved on,
and appends land after N meanwhile. Of two prunes of one thread the second finds the
anchor moved, reads again and removes only what is left (or nothing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from runtime.commit import Frontier
from runtime.errors import CorruptRecord, InvalidTransition, StoreError
from runtime.history import copy_under_way, forks_under_way
from runtime.ids import RunId, ThreadId
from runtime.integrity import history_mismatch, message_text
from runtime.lifecycle import EndedState
from runtime.ports import CommitStore, CommittedRecord

ATTEMPTS = 5
"""Cuts refused because another prune moved the anchor first, before giving up."""


class Cut(NamedTuple):
    """One prune as decided: what the backend removes, if the thread is still as read."""

    thread: ThreadId
    after: int
    """The anchor as read: the records after it are stored (0: the thread was never pruned)."""
    through: int
    """The seq of the ``ended`` record the prune ends with: the new anchor."""
    hash: str
    """The stored hash of the record at ``through``."""
    operations: tuple[str, ...]
    """The operation ids of the records removed (their receipts go with them)."""
    messages: tuple[str, ...] = ()
    """The texts of the messages of the records removed, in order (``message_text``):
    they join the thread's pruned history."""
    history: int = 0
    """The messages of the pruned history as read (those the anchor's digest covers):
    a thread that holds another number (an entry added by hand, one never pruned
    included) is CorruptRecord, not pruned into a history no load could verify."""

    @property
    def removed(self) -> int:
        return self.through - self.after


def plan_cut(
    thread: ThreadId, records: Sequence[CommittedRecord], through: int, history: int = 0
) -> Cut | None:
    """The cut that prunes through ``through``, from the thread's verified log as read;
    None when nothing up to it is left to remove. InvalidTransition if ``through`` is
    not the seq of an ``ended`` commit among the records kept."""
    anchor = records[0].seq - 1 if records else None
    if anchor is not None and through <= anchor:
        return None
    if anchor is None or through > records[-1].seq:
        raise InvalidTransition(f"thread {thread}: no record {through} to prune through")
    kept = records[: through - anchor]
    end = kept[-1]
    if not isinstance(end.commit.disposition, EndedState):
        raise InvalidTransition(
            f"thread {thread}: record {through} does not end a Run; only ended Runs are pruned"
        )
    ops = tuple(r.commit.operation_id for r in kept)
    texts = tuple(message_text(m) for r in kept for m in r.commit.messages)
    return Cut(thread, anchor, through, end.commit.payload_hash, ops, texts, history)


async def prune_thread(
    store: CommitStore,
    thread: ThreadId,
    through: int,
    cut: Callable[[Cut], Awaitable[bool]],
) -> int:
    """``CommitStore.prune`` on a backend whose ``cut`` applies a Cut atomically (False:
    the anchor moved since the read, nothing was removed)."""
    if through < 1:
        raise InvalidTransition(f"thread {thread}: cannot prune through seq {through}")
    for _ in range(ATTEMPTS):
        frontier, records, history = await read_for_prune(store, thread)
        if not records and through <= frontier.version:
            return 0  # pruned through its head, or empty
        planned = plan_cut(thread, records, through, history)
        if planned is None:
            return 0
        if await cut(planned):
            return planned.removed
    # a cut refused every time: other prunes, or a pruned history damaged by hand (its
    # next rows cannot be numbered); a load verifies the history and names that
    await store.load(thread)
    raise StoreError(f"thread {thread}: other prunes kept moving its anchor")


async def read_for_prune(
    store: CommitStore, thread: ThreadId
) -> tuple[Frontier, list[CommittedRecord], int]:
    """What a prune reads, and refuses before it cuts (``ratchet prune --dry-run`` too):
    the whole thread verified, its pruned history with it (``vouched_log`` checks the
    head and the records only: a history damaged by hand was pruned further), and not a
    copy being written (an import or fork run again completes it from where it stopped,
    knowing nothing of a prune: InvalidTransition), nor the source of a fork not whole yet
    (run again, it reads the source: InvalidTransition). Returns the frontier, the records
    kept and the messages the pruned history holds: all the frontier's but those of the
    records kept up to it (records appended since the load are not its)."""
    frontier = await store.load(thread)
    if (copying := copy_under_way(frontier)) is not None:
        raise InvalidTransition(copying)
    if forks := await forks_under_way(store, thread):
        raise InvalidTransition(f"thread {thread} is not pruned while it is copied: {forks[0]}")
    records = await store.read(thread)
    kept = sum(len(r.commit.messages) for r in records if r.seq <= frontier.version)
    return frontier, records, frontier.message_count - kept


async def read_for_dry_run(store: CommitStore, thread: ThreadId) -> None:
    """What ``ratchet prune --dry-run`` refuses as the prune would: ``read_for_prune``'s
    refusals, and a pruned history holding another number of messages than the anchor
    vouches for (the cut counts it in the store; a dry run that did not said the thread
    would be pruned, and the real one skipped it). Counted, then the log read again: a
    prune since moves the anchor with its rows, and the real prune reads again too."""
    frontier, records, vouched = await read_for_prune(store, thread)
    held_history = getattr(store, "held_history", None)  # every backend of ours has it
    if held_history is None or (held := await held_history(thread)) == vouched:
        return
    again = await store.read(thread)
    if (again[0].seq if again else None) == (records[0].seq if records else None):
        anchor = records[0].seq - 1 if records else frontier.version
        raise CorruptRecord(thread, anchor, history_mismatch(held, vouched))


def stray_history(held: int, cut: Cut) -> str:
    """Why a thread's pruned history is not what its anchor vouches for (``Cut.history``)."""
    return history_mismatch(held, cut.history)


# ---- choosing what to prune --------------------------------------------------------------


class RunLog(NamedTuple):
    """One Run whose records a thread still keeps."""

    run_id: RunId
    first: int
    """The seq of its first record kept."""
    end: int | None
    """The seq of its ``ended`` record; None while it has not ended."""
    ended_at: int | None
    """When it ended (µs since the epoch): the thread status's ``since`` after its
    ``ended`` commit; None if not ended, or if no record kept ever set a status."""


def run_logs(records: Sequence[CommittedRecord]) -> list[RunLog]:
    """The Runs of a verified log, in order."""
    runs: list[RunLog] = []
    since = 0
    for record in records:
        commit = record.commit
        if commit.status is not None:
            since = commit.status.since
        if not runs or runs[-1].run_id != commit.run_id:
            runs.append(RunLog(commit.run_id, record.seq, None, None))
        if isinstance(commit.disposition, EndedState):
            runs[-1] = runs[-1]._replace(end=record.seq, ended_at=since or None)
    return runs


def prune_point(runs: Sequence[RunLog], ended_before_us: int, keep_last: int = 0) -> int:
    """The seq to prune through: the end of the latest Run that, with every Run before
    it, ended before ``ended_before_us`` and is not among the last ``keep_last`` Runs
    (whether ended or not); 0: nothing to prune."""
    point = 0
    for run in runs[: max(len(runs) - keep_last, 0)]:
        if run.end is None or run.ended_at is None or run.ended_at >= ended_before_us:
            break
        point = run.end
    return point
