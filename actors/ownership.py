"""Runs whose execution was lost: finding them by owner, marking them, dead-lettering them.

Seed §4.3: a thread must never stay ``running`` once its executor is gone. Whoever
notices the loss — the Supervisor (a host's lease expired), a RunHost (a previous
incarnation of itself owned the Run, or recovering it failed) — calls ``mark_lost``.
It is compare-and-set: it acts only if the thread is still owned by the owner it
named (so a healthy owner that took the thread since the listing is never fenced),
and its status commit carries the claim. A later ``Engine.recover`` sets the Run
running again.

**Dead letters.** Each such status commit counts (``Frontier.failed_recoveries``,
reset by any progress). The ``DEAD_LETTER_AFTER``-th loss in a row ends the Run
``failed(recovery)`` with the last reason instead (``ratchet runs --failed``): a Run
that kills its host every time, or that no host can rebuild, stops being retried. A
loss while the Run only waits on children that run on (``children_run_on``) is marked
``LOST_WAITING`` and not counted: its host's deaths are not its doing, and a dead
letter would cancel the children and drop the answers they are about to give.
A failed recovery counts too, whether it failed in the host (``again``) or took its
host down with it before the Run was running again: the Run is then still marked
lost, by an owner that is gone, and whoever finds it so marks it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from runtime.commit import Frontier, ThreadCommit, assemble_commit
from runtime.context import RunContext
from runtime.control import control_engine
from runtime.delegation import CHILDREN_KEY, ChildRunner
from runtime.engine import RACES, Engine
from runtime.errors import CorruptRecord, Fenced, RunEnded, VersionConflict
from runtime.execution import ExecutionState
from runtime.ids import ThreadId
from runtime.lifecycle import Failed, RunningState
from runtime.limits import printable
from runtime.ports import CommitStore, RunSummary
from runtime.publish import Publisher
from runtime.rules import LOST_WAITING
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.ownership")
EXECUTION_LOST = "execution_lost"
DEAD_LETTER_AFTER = 3
"""Losses in a row (no progress between them) after which a Run is ended failed(recovery)."""
Marked = Literal["lost", "dead_lettered"]
"""What ``mark_lost`` wrote: ``lost`` — the Run is settled failed and claimed by the
caller, who recovers it now; ``dead_lettered`` — it is ended, nothing is left to recover."""


async def running_owned_by(store: CommitStore, host_id: str) -> list[RunSummary]:
    """The Running threads whose current owner belongs to ``host_id`` (the owner index)."""
    return await store.list_runs("running", host=host_id)


async def mark_lost(
    store: CommitStore,
    thread: ThreadId,
    owner: str,
    *,
    lost_owner: str | None,
    reason: str = EXECUTION_LOST,
    again: bool = False,
    dead_letter_after: int = DEAD_LETTER_AFTER,
    publisher: Publisher | None = None,
    children: ChildRunner | None = None,
    unless: Callable[[], bool] | None = None,
) -> Marked | None:
    """Commit ``failed/<reason>`` for a Run whose execution under ``lost_owner`` is gone,
    claiming it for ``owner`` in the same step; or end it ``failed(recovery)`` when this
    is its ``dead_letter_after``-th loss in a row. None (nothing written) if the thread
    is no longer ``lost_owner``'s running Run, or another claim won the race. A Run
    marked already is marked again only with ``again`` (a recovery of it failed, or
    died with the owner that marked it): each failed attempt is counted once, by
    whoever saw it fail, since only one caller's compare-and-set on the owner wins.

    Each decision is one append at the version it was made from; if the thread moved
    meanwhile (say the lost owner, still alive, made progress, which resets the count)
    the decision is made again from where the thread is now. ``unless`` is asked after
    each load: a host marking its own Run passes "a drive of it started here", which a
    request may spawn at any time. A drive spawned before the load is seen; one spawned
    after it claims from the epoch this mark claims from, so one compare-and-set wins.
    """
    for _ in range(RACES):
        frontier = await store.load(thread)
        state = frontier.run_state
        if frontier.owner != lost_owner or not isinstance(state, RunningState):
            return None
        if unless is not None and unless():
            return None
        if frontier.status.state != "running" and not again:
            return None  # marked already; whoever marked it recovers it
        try:
            waiting = await children_run_on(store, frontier)
            if not waiting and frontier.failed_recoveries + 1 >= dead_letter_after:
                engine = control_engine(store, owner=owner, publisher=publisher, children=children)
                await _dead_letter(engine, frontier, state, reason, dead_letter_after)
                return "dead_lettered"
            commit = _lost(frontier, state, owner, LOST_WAITING if waiting else reason)
            await store.append(commit, frontier.version, frontier.epoch, claim=owner)
            return "lost"
        except (Fenced, VersionConflict, RunEnded) as exc:  # it moved: decide again from there
            log.info("marking %s lost raced a commit (%s); looking again", thread, exc)
    log.warning("thread %s kept moving; not marked lost", thread)
    return None


async def children_run_on(store: CommitStore, frontier: Frontier) -> bool:
    """Whether a child of one of the Run's executing delegations is still running or
    awaiting, or ended after the Run (running) was last taken back: then the Run only
    waits on it, or has not yet had the chance to take its answer (a recovered Run only
    rejoins its children), and runs none of its own code. A Run marked lost and not taken
    back since (its recovery failing) gets no such grace. A child that does not verify
    is taken for ended long ago."""
    batch = frontier.batch
    if batch is None:
        return False
    children = frontier.state.get("run", {}).get(CHILDREN_KEY, {})
    running = frontier.status.state == "running"  # taken back (or never lost) since then
    for call in batch.calls:
        thread = children.get(call.call_id) if isinstance(children, dict) else None
        if call.phase.kind != "executing" or not isinstance(thread, str):
            continue
        try:
            child = await store.load_head(ThreadId(thread))
        except CorruptRecord:
            continue
        if child.run_state is not None and not child.ended:
            return True
        if running and child.ended and child.status.since > frontier.status.since:
            return True  # it ended after the Run was taken back: no chance to take it yet
    return False


def _lost(frontier: Frontier, state: RunningState, owner: str, reason: str) -> ThreadCommit:
    """The status commit that settles a Run ``failed/<reason>`` and claims it for ``owner``."""
    return assemble_commit(
        thread_id=frontier.thread_id,
        run_id=state.run_id,
        ordinal=frontier.next_ordinal,
        label="status",
        disposition=state,
        status=frontier.status.moved_to("failed", printable(reason, 500), now_us()),
        prev=frontier.head,
        epoch=frontier.epoch + 1,  # the claim this commit carries
        claim=owner,
    )


async def _dead_letter(
    engine: Engine, frontier: Frontier, state: RunningState, reason: str, after: int
) -> None:
    """End the Run ``failed(recovery)`` by one append at ``frontier``'s version and epoch
    (``Engine.terminate`` would retry on a conflict, ending a Run that has just made
    progress); the end claims the thread, cancels its children and is published."""
    cause = Failed(
        failure="recovery",
        code=printable(reason.partition(":")[0], 80),
        message=printable(f"lost or failed to recover {after} times in a row; last: {reason}"),
    )
    await engine.store.read(frontier.thread_id)  # no engine acts on a log that does not verify
    execution = ExecutionState(state.run_id, frontier.thread_id, (), engine.cancel_event)
    ctx = RunContext(frontier=frontier, epoch=frontier.epoch, execution=execution)
    await engine.end(ctx, cause, claim=True)
    log.error("run %s on %s dead-lettered: %s", state.run_id, frontier.thread_id, cause.message)
