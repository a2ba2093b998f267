"""Resuming paused Runs when their time comes (a rate limit's ``Retry-After``, say).

A Run that paused with ``PauseTarget.resume_at_us`` holds nothing in memory; the
Supervisor's sweep finds it among the Runs at rest, paused, and once that time has
passed resumes it with ``Unpause`` through its host. A caller's own ``Unpause`` may race
it: the resume is compare-and-set on the ticket, so one lands and the other is refused.
"""

from __future__ import annotations

import asyncio
import logging

from actors.deliveries import DELIVERY_S, HostOf, each
from actors.wire import unwrap
from runtime.commit import Frontier
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, PauseTarget, Unpause, answer
from runtime.ports import CommitStore

log = logging.getLogger("ratchet.schedule")
AWAITING_PAUSE = "awaiting_pause"
"""The status reason of a paused Run."""


def due(frontier: Frontier, now_us: int) -> bool:
    """A paused Run whose resume time has come."""
    state = frontier.run_state
    if not isinstance(state, AwaitingState) or not isinstance(state.ticket.target, PauseTarget):
        return False
    at = state.ticket.target.resume_at_us
    return at is not None and at <= now_us


async def fire_due(store: CommitStore, paused: list[ThreadId], host_of: HostOf, now_us: int) -> int:
    """Resume each of these paused Runs whose time has come (one call each, several
    at once; the next sweep asks again); how many were resumed."""

    async def one(thread: ThreadId) -> bool:
        try:
            frontier = await store.load(thread)
            host = host_of(frontier) if due(frontier, now_us) else None
            if host is None:
                return False
            assert isinstance(frontier.run_state, AwaitingState)
            command = answer(frontier.run_state.ticket, Unpause())
            async with asyncio.timeout(DELIVERY_S):
                unwrap(await host.resume_run.remote(command))
            return True
        except RatchetError as exc:  # resumed meanwhile (refused), corrupt, store out
            log.info("resuming paused %s: %s", thread, exc)
        except Exception:  # a host gone, slow or restarting: the next sweep asks again
            log.exception("resuming paused %s failed", thread)
        return False

    return await each(paused, one)
