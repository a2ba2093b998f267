"""Waking Runs at rest when their time comes: a pause that names a time (a rate
limit's ``Retry-After``, say) is resumed with ``Unpause``, and a tool call's wait whose
``wait_deadline_s`` has passed is ended with ``WaitExpired`` (the call completes with a
model-visible error and the Run goes on).

Such a Run holds nothing in memory; the Supervisor's sweep finds it among the Runs at
rest and, once its time has passed, resumes it through its host. A caller's own answer
may race it: the resume is compare-and-set on the ticket, so one lands and the other is
refused. When a Run is due is read from its frontier once per committed version
(``Alarms``): thousands of Runs parked on a permission cost one load each, not one per
sweep.
"""

from __future__ import annotations

import asyncio
import logging

from actors.deliveries import DELIVERY_S, HostOf, each
from actors.wire import unwrap
from runtime.commit import Frontier
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.lifecycle import (
    AwaitingState,
    PauseTarget,
    ResumePayload,
    ToolWaitTarget,
    Unpause,
    WaitExpired,
    answer,
)
from runtime.ports import CommitStore, RunSummary

log = logging.getLogger("ratchet.schedule")
AWAITING_PAUSE = "awaiting_pause"
"""The status reason of a paused Run."""
TIMED = frozenset(
    {AWAITING_PAUSE, "awaiting_permission", "awaiting_external_result", "awaiting_scheduled_action"}
)
"""The status reasons of the waits that may name a time: pauses and a tool's waits
(a delegation's ends with its child; user input has no deadline)."""


def alarm(frontier: Frontier) -> tuple[int, ResumePayload] | None:
    """When this Run at rest is due and what wakes it: a pause's resume time
    (``Unpause``), or a tool wait's deadline (``WaitExpired``, accepted only once that
    has passed); None: only a caller wakes it."""
    state = frontier.run_state
    if not isinstance(state, AwaitingState):
        return None
    ticket = state.ticket
    if isinstance(ticket.target, PauseTarget) and ticket.target.resume_at_us is not None:
        return ticket.target.resume_at_us, Unpause()
    target, deadline = ticket.target, ticket.deadline_us
    if isinstance(target, ToolWaitTarget) and target.wait != "delegation" and deadline is not None:
        return deadline + 1, WaitExpired()
    return None


class Alarms:
    """When each timed Run at rest is due, by the version it was read at."""

    def __init__(self) -> None:
        self._known: dict[ThreadId, tuple[int, int | None]] = {}
        """thread → (version, due time or None), only for Runs listed at rest."""

    async def fire(
        self, store: CommitStore, awaiting: list[RunSummary], host_of: HostOf, now_us: int
    ) -> tuple[int, int]:
        """Wake each of these Runs whose time has come (one call each, several at once;
        the next sweep asks again): how many pauses were resumed and waits expired."""
        timed = {s.thread_id: s.version for s in awaiting if s.status.reason in TIMED}
        self._known = {t: k for t, k in self._known.items() if timed.get(t) == k[0]}
        woken: dict[str, int] = {"pause": 0, "expired": 0}

        def unread_or_due(thread: ThreadId) -> bool:
            known = self._known.get(thread)
            return known is None or (known[1] is not None and known[1] <= now_us)

        async def one(thread: ThreadId) -> bool:
            try:
                frontier = await store.load(thread)
                due = alarm(frontier)
                self._known[thread] = (frontier.version, due[0] if due else None)
                host = host_of(frontier) if due is not None and due[0] <= now_us else None
                if due is None or host is None:
                    return False
                assert isinstance(frontier.run_state, AwaitingState)
                command = answer(frontier.run_state.ticket, due[1])
                async with asyncio.timeout(DELIVERY_S):
                    unwrap(await host.resume_run.remote(command))
                woken[due[1].kind] += 1
                return True
            except RatchetError as exc:  # resumed meanwhile (refused), corrupt, store out
                log.info("waking %s: %s", thread, exc)
            except Exception:  # a host gone, slow or restarting: the next sweep asks again
                log.exception("waking %s failed", thread)
            return False

        await each([t for t in timed if unread_or_due(t)], one)
        return woken["pause"], woken["expired"]
