"""Finding the Runs a lost owner held, and settling them ``failed/execution_lost``.

Seed §4.3: a thread must never stay ``running`` once its executor is gone. Whoever
notices the loss (the Supervisor, or a RunHost restarted by Ray) first claims the
thread — epoch + 1, so the lost owner, should it still be alive, is fenced — and
then commits the status change. A later ``Engine.recover`` sets it running again.
"""

from __future__ import annotations

import asyncio
import logging

from actors.wire import owned_by
from runtime.commit import Frontier, ThreadCommit
from runtime.errors import Fenced, VersionConflict
from runtime.facts import derive_facts
from runtime.ids import ThreadId
from runtime.lifecycle import RunningState
from runtime.ports import CommitStore
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.ownership")
EXECUTION_LOST = "execution_lost"
LOAD_CONCURRENCY = 64


async def running_owned_by(store: CommitStore, host_id: str) -> list[Frontier]:
    """Frontiers of the Running threads whose current owner belongs to ``host_id``."""
    runs = await store.list_runs("running")
    gate = asyncio.Semaphore(LOAD_CONCURRENCY)

    async def load(thread: ThreadId) -> Frontier:
        async with gate:
            return await store.load(thread)

    frontiers = await asyncio.gather(*(load(r.thread_id) for r in runs))
    return [f for f in frontiers if owned_by(f.owner, host_id)]


async def settle_lost(
    store: CommitStore, thread: ThreadId, owner: str, reason: str = EXECUTION_LOST
) -> bool:
    """Fence the previous owner and commit ``failed/<reason>``; False if not needed."""
    epoch = await store.claim(thread, owner)
    frontier = await store.load(thread)
    state = frontier.run_state
    if not isinstance(state, RunningState) or frontier.status.state != "running":
        return False
    status = frontier.status.moved_to("failed", reason, now_us())
    commit = ThreadCommit(
        thread_id=thread,
        run_id=state.run_id,
        ordinal=frontier.next_ordinal,
        label="status",
        disposition=state,
        status=status,
    )
    commit = commit.model_copy(update={"events": derive_facts(commit, frontier)})
    try:
        await store.append(commit, frontier.version, epoch)
    except (Fenced, VersionConflict) as exc:  # someone newer took the thread over: theirs
        log.info("settling %s lost the race: %s", thread, exc)
        return False
    return True
