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
that kills its host every time, or that no host can rebuild, stops being retried.
"""

from __future__ import annotations

import logging

from runtime.commit import assemble_commit
from runtime.control import control_engine
from runtime.errors import Fenced, VersionConflict
from runtime.ids import ThreadId
from runtime.lifecycle import Failed, RunningState
from runtime.limits import printable
from runtime.ports import CommitStore, RunSummary
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.ownership")
EXECUTION_LOST = "execution_lost"
DEAD_LETTER_AFTER = 3
"""Losses in a row (no progress between them) after which a Run is ended failed(recovery)."""


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
) -> bool:
    """Commit ``failed/<reason>`` for a Run whose execution under ``lost_owner`` is gone,
    claiming it for ``owner`` in the same step; or end it ``failed(recovery)`` when this
    is its ``dead_letter_after``-th loss in a row. False (nothing written) if the thread
    is no longer ``lost_owner``'s running Run, or another claim won the race. A Run
    marked already is marked again only with ``again`` (a recovery of it failed)."""
    frontier = await store.load(thread)
    state = frontier.run_state
    if frontier.owner != lost_owner or not isinstance(state, RunningState):
        return False
    if frontier.status.state != "running" and not again:
        return False  # marked already; whoever marked it recovers it
    if frontier.failed_recoveries + 1 >= dead_letter_after:
        cause = Failed(
            failure="recovery",
            code=printable(reason.partition(":")[0], 80),
            message=printable(
                f"lost or failed to recover {dead_letter_after} times in a row; last: {reason}"
            ),
        )
        try:
            ended = await control_engine(store, owner=owner).terminate(
                thread, cause, supersedes=frontier.epoch
            )
        except (Fenced, VersionConflict) as exc:
            log.info("dead-lettering %s lost the race: %s", thread, exc)
            return False
        log.error("run %s on %s dead-lettered: %s", state.run_id, thread, cause.message)
        return ended.ended
    commit = assemble_commit(
        thread_id=thread,
        run_id=state.run_id,
        ordinal=frontier.next_ordinal,
        label="status",
        disposition=state,
        status=frontier.status.moved_to("failed", printable(reason, 500), now_us()),
        prev=frontier.head,
        epoch=frontier.epoch + 1,  # the claim this commit carries
        claim=owner,
    )
    try:
        await store.append(commit, frontier.version, frontier.epoch, claim=owner)
    except (Fenced, VersionConflict) as exc:  # someone newer took the thread over: theirs
        log.info("marking %s lost lost the race: %s", thread, exc)
        return False
    return True
