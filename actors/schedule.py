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
from typing import Any

from actors.deliveries import HostOf, HostOut, Pass
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


RETRY_S = (2.0, 300.0)
"""A wake that did not land (refused, a host out, a record that does not verify) is
asked again after the first of these, doubled each time up to the second: a Run its host
keeps refusing (a host's clock behind the Supervisor's, a thread quarantined) is not
loaded whole at every sweep."""


class Alarms:
    """When each timed Run at rest is due, by the version it was read at."""

    def __init__(self) -> None:
        self._known: dict[ThreadId, tuple[int, int | None]] = {}
        """thread → (version, due time or None), only for Runs listed at rest: the due
        time is the next try's once a wake at that version did not land."""
        self._missed: dict[ThreadId, int] = {}
        """thread → wakes in a row that did not land (at the version in ``_known``)."""

    async def fire(
        self,
        store: CommitStore,
        awaiting: list[RunSummary],
        host_of: HostOf,
        now_us: int,
        calls: Pass | None = None,
    ) -> tuple[int, int]:
        """Wake each of these Runs whose time has come (one call each, through ``calls``,
        the sweep's pass: a host that hangs holds only its own slots; the next sweep asks
        again): how many pauses were resumed and waits expired."""
        timed = {s.thread_id: s.version for s in awaiting if s.status.reason in TIMED}
        self._known = {t: k for t, k in self._known.items() if timed.get(t) == k[0]}
        self._missed = {t: n for t, n in self._missed.items() if t in self._known}
        wakes = calls if calls is not None else Pass()
        woken: dict[str, int] = {"pause": 0, "expired": 0}

        def unread_or_due(thread: ThreadId) -> bool:
            known = self._known.get(thread)
            return known is None or (known[1] is not None and known[1] <= now_us)

        async def one(thread: ThreadId) -> None:
            version = timed[thread]
            try:
                async with wakes.slots:
                    frontier = await store.load(thread)
                due = alarm(frontier)
                version = frontier.version
                self._known[thread] = (version, due[0] if due else None)
                if due is not None and due[0] <= now_us:
                    await _wake(wakes, host_of(frontier), frontier, due[1])
                    woken[due[1].kind] += 1
                self._missed.pop(thread, None)  # a later miss backs off from the first try
                return
            except (RatchetError, HostOut) as exc:  # resumed meanwhile, corrupt, store out
                log.info("waking %s: %s", thread, exc)
            except Exception:  # a host gone, slow or restarting: asked again later
                log.exception("waking %s failed", thread)
            self._missed[thread] = missed = self._missed.get(thread, 0) + 1
            retry_s = min(RETRY_S[0] * 2 ** min(missed - 1, 16), RETRY_S[1])
            self._known[thread] = (version, now_us + int(retry_s * 1_000_000))

        await asyncio.gather(*(one(t) for t in timed if unread_or_due(t)))
        return woken["pause"], woken["expired"]


async def _wake(calls: Pass, host: Any, frontier: Frontier, payload: ResumePayload) -> None:
    """Resume the Run at rest at ``frontier`` with ``payload`` through its host."""
    assert isinstance(frontier.run_state, AwaitingState)
    command = answer(frontier.run_state.ticket, payload)

    async def send() -> None:
        unwrap(await host.resume_run.remote(command))

    await calls.call(host, send)
