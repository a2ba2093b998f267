"""The delegation side of a RunHost: it drives the child Runs its parents delegate to it,
and hands an ended child's outcome back to the parent awaiting it (a mixin of
``actors.run_host.RunHost``, whose drives, store and children it uses)."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.deliveries import deliver, failed_delegation
from actors.drives import Drives, drove, starting
from actors.retiring import Admission, admitted
from actors.wire import RunMeta, SystemSpec, at_rest, remote_error, run_meta
from runtime.commit import Frontier
from runtime.delegation import (
    CHILD_OUTCOME,
    ChildRequest,
    ParentLink,
    outcome_of,
    parent_link,
)
from runtime.engine import Engine
from runtime.errors import RatchetError, StoreUnavailable
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, PauseTarget
from runtime.patience import patiently
from runtime.ports import CommitStore
from runtime.timeutil import now_us

UNTRUSTED = "child {} cannot be trusted: its records did not verify on this host"
NOT_STARTED = "child {}'s start did not land (the store was out): the parent asks again"
OTHER_RUN = "the child's thread {} holds another run ({}), not this call's child"
PAUSED_LOOK_S = 15.0
"""How often a parent's call looks at the head of a child paused until a later time."""


class ChildHosting:
    spec: SystemSpec
    store: CommitStore
    drives: Drives
    children: Any  # actors.children.RayChildRunner
    admission: Admission
    _background: set[asyncio.Task[Any]]

    @admitted
    async def run_child(self, raw: dict[str, Any]) -> Any:
        """Drive (or join, or read back) a child Run; answer its outcome once it is at rest.
        A child that cannot run (agent, input, records that do not verify) is a failed
        tool result; one driven elsewhere (this drive stopped or fenced) is followed in
        the store; only a store outage or a bug of ours reaches the parent as an error."""
        try:
            request = ChildRequest.model_validate(raw)
            thread = request.child_thread
            if thread in self.drives.quarantined:
                return failed_delegation(UNTRUSTED.format(thread))
            await self.drives.loaded(request.agent)  # off the loop, before the check below
            drive = self.drives.get(thread)
            if drive is not None and drive.run_id not in (None, request.child_run):
                return failed_delegation(OTHER_RUN.format(thread, drive.run_id))
            if drive is None:
                message_id = RunMeta(agent_ref=request.agent).message_id(request.child_run)
                # its thread is made for it: new, but after a re-delegation
                go = starting(thread, request.input, request.child_run, message_id, True)
                drive = self.drives.spawn(
                    request.agent, thread, request.child_run, go, ParentLink.of(request),
                    after=self._after,
                )  # fmt: skip
            # waited on, not awaited: a parent that stops waiting cancels its children
            # explicitly, and a drive stopped here is not this call being cancelled
            await asyncio.wait({drive.task})
            frontier = drove(drive.task)
            if frontier is None or not answers(frontier):
                frontier = await self._untilat_rest(thread, request.child_run)
            if frontier is None:
                return failed_delegation(UNTRUSTED.format(thread))
            if frontier.run_id != request.child_run:  # never another Run's answer as its own
                return failed_delegation(OTHER_RUN.format(thread, frontier.run_id))
            return CHILD_OUTCOME.dump_python(outcome_of(frontier), mode="json")
        except StoreUnavailable as exc:  # the parent's drive pauses, and asks again later
            return remote_error(exc)
        except RatchetError as exc:  # corrupt, store lost, refused input, agent not built
            return failed_delegation(str(exc))
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            return remote_error(exc)

    async def _untilat_rest(self, thread: ThreadId, run: RunId) -> Frontier | None:
        """Another owner drives the child (or will recover it), or it is paused until a
        time: follow the store until it ``answers``. None once this host has quarantined
        the child (no engine here drives it again).

        A start that gave up before its activation landed (the store out longer than
        the engine's patience) leaves a thread with no Run, which nobody owns and so
        nobody recovers: that is the parent's to ask again (StoreUnavailable pauses its
        drive, and its recovery delegates the same child again)."""
        delay = 0.02
        while thread not in self.drives.quarantined:
            # a passing outage is waited out here: told to the parent, it would cost the
            # delegating call an attempt (its drive pauses and recovers)
            # the head says whether it answers (a paused child is followed for as long
            # as its pause): the whole log is read and verified only once it does
            frontier = await patiently(lambda: self.store.load_head(thread))
            if answers(frontier):
                frontier = await patiently(lambda: self.store.load(thread))
                if answers(frontier):  # still (a person may have answered meanwhile)
                    return frontier
            drive = self.drives.get(thread)
            if frontier.run_id != run and (drive is None or drive.task.done()):
                raise StoreUnavailable(NOT_STARTED.format(thread))
            await asyncio.sleep(next_look_s(frontier, delay))
            delay = min(delay * 2, 1.0)
        return None

    async def _after(self, engine: Engine, child: Frontier) -> None:
        """After a drive: a lone child that surfaced a human wait and has ended resumes
        its waiting parent — apart from the drive, which is over."""
        if engine.parent is not None:
            self._hand_back(child)

    def _hand_back(self, child: Frontier) -> None:
        """An ended child hands its outcome to the parent awaiting it, in the background."""
        link = parent_link(child)
        if link is None or not child.ended:
            return
        task = asyncio.create_task(
            deliver(self.store, child, link, self._host_of, self.spec.limits)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _host_of(self, frontier: Frontier) -> Any:
        """The host a Run is placed on (by its recorded placement)."""
        meta = run_meta(frontier)
        if meta is not None and meta.placement == "dedicated":
            from actors.run_host import dedicated_host  # run_host imports this module

            return dedicated_host(self.spec, frontier.thread_id)
        return self.children.host_for(frontier.thread_id)


def next_look_s(child: Frontier, delay_s: float) -> float:
    """When a parent's call following ``child`` in the store looks at its head again:
    after ``delay_s``, or, the child paused until a time, at that time, looking at least
    every ``PAUSED_LOOK_S`` meanwhile (a cancel or a person's early resume ends the wait
    sooner). Once a second, a parent waiting on a child paused for a day read its head
    86,400 times."""
    state = child.run_state
    if isinstance(state, AwaitingState):
        target = state.ticket.target
        if isinstance(target, PauseTarget) and target.resume_at_us is not None:
            left_s = (target.resume_at_us - now_us()) / 1_000_000
            return max(delay_s, min(left_s, PAUSED_LOOK_S))
    return delay_s


def answers(child: Frontier) -> bool:
    """Whether the child's state answers its parent's call: ended, or waiting for a
    person. A pause that names its time (a rate limit's) is the system's to end, not a
    person's: the Supervisor resumes the child then, and the parent's call waits it out
    as it waits for a child that runs. Taken for a person's wait, it ended a parent whose
    children ran at once ``indeterminate`` (one ticket cannot hold several waits), each
    child cancelled, for a rate limit of a second."""
    state = child.run_state
    if isinstance(state, AwaitingState):
        target = state.ticket.target
        return not (isinstance(target, PauseTarget) and target.resume_at_us is not None)
    return at_rest(child)


__all__ = ["UNTRUSTED", "ChildHosting", "answers"]
