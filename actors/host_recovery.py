"""The recovery side of a RunHost: take over a Run whose driver is gone and drive it
here (a mixin of ``actors.run_host.RunHost``, whose drives, store and reconciler use it).

A recovery acts only while its caller's judgement still holds (the Supervisor's epoch,
or this host's reconciler's owner): a claim that overtook it meanwhile is left alone. A
drive here that another owner fenced is stopped first, now, rather than at its next
commit. A recovery that fails before its first commit, for a reason of its own, counts
toward the Run's dead letter, so a Run that can never be recovered is not retried for
ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from actors.drives import Drive, Drives, counts_against_run
from actors.ownership import mark_lost
from actors.retiring import admitted
from actors.wire import remote_error, run_meta
from runtime.commit import Frontier
from runtime.delegation import parent_link
from runtime.engine import Engine
from runtime.errors import AgentImportError, RatchetError
from runtime.faults import Unwind
from runtime.ids import ThreadId
from runtime.ports import CommitStore
from runtime.publish import Publisher

log = logging.getLogger("ratchet.run_host")


class RecoveryHosting:
    store: CommitStore
    owner: str
    drives: Drives
    publisher: Publisher | None
    children: Any  # actors.children.RayChildRunner
    recovered: int
    _background: set[asyncio.Task[Any]]

    # the host's own (RunHost) and its delegation side's (ChildHosting): annotations
    # only, so that the methods of the classes after this one are the ones found
    _after_reclaim: Callable[[], Awaitable[None]]
    _retire_if_idle: Callable[[], None]
    _after: Callable[[Engine, Frontier], Awaitable[None]]

    @admitted
    async def recover_run(
        self, thread: ThreadId, agent_ref: str | None = None, epoch: int | None = None
    ) -> Any:
        """Take the thread over (claiming the epoch it is at) and continue it. ``epoch``:
        the owner epoch the caller decided from; if the thread was claimed past it since
        (the call was late, and another host has the Run now), nothing is done."""
        await self._after_reclaim()
        return await self._recover(thread, agent_ref, epoch)

    async def _recover(
        self,
        thread: ThreadId,
        agent_ref: str | None = None,
        epoch: int | None = None,
        owner: str | None = None,
    ) -> Any:
        """Drive the thread's Run again here, if the caller's judgement still holds: the
        Run is at ``epoch`` (the Supervisor's), or ``owner``'s (this host's reconciler,
        which judged from a listing that a claim may have overtaken since)."""

        def overtaken(frontier: Frontier) -> bool:
            return (epoch is not None and frontier.epoch != epoch) or (
                owner is not None and frontier.owner != owner
            )

        try:
            await self.drives.claimed(thread)  # a drive here that claims nothing is no driver
            frontier = await self.store.load(thread)
            if overtaken(frontier):
                return True  # another took it over meanwhile: not to be taken from it
            if (agent_ref or ref_of(frontier)) not in self.drives.agents:
                await self.drives.loaded(agent_ref or ref_of(frontier))  # off the loop
                frontier = await self.store.load(thread)  # as it is after that wait
                if overtaken(frontier):
                    return True
            stale = self.drives.get(thread)
            if stale is not None:
                if not self.drives.fenced(stale, frontier):
                    return True  # driven here, and still ours: nothing to recover
                # Someone claimed the thread past this drive (the Supervisor took this host
                # for lost while it was only slow): the drive is fenced and would only find
                # out at its next commit, which a long tool call can put off indefinitely.
                await self.drives.stop(thread, stale, idle=False)
                frontier = await self.store.load(thread)
                if thread in self.drives or overtaken(frontier):  # another got here first
                    return True
            ref = agent_ref or ref_of(frontier)
            link = parent_link(frontier)
            drive = self.drives.spawn(  # the frontier verified just now: not read again
                ref, thread, frontier.run_id, lambda e: e.recover(thread, frontier), link,
                after=self._after,
            )  # fmt: skip
            recovering_from = frontier.owner
            drive.task.add_done_callback(
                lambda task: self._recovery_ended(thread, drive, recovering_from)
            )
            self.recovered += 1
            return True
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            self._retire_if_idle()  # a dedicated host whose stale drive was dropped
            return remote_error(exc)

    def _recovery_ended(self, thread: ThreadId, drive: Drive, owner: str | None) -> None:
        """A recovery whose drive failed before its first commit, for a reason of its own
        (not stopped, fenced, paused by an outage, quarantined), counts towards the
        Run's dead letter, as one that could not start does: its caller was told it
        started, and the next pass would start it again, failing the same way, for ever."""
        task = drive.task
        if task.cancelled() or drive.engine.committed.is_set():
            return
        error = task.exception()
        # an Unwind too: on a host only the code it runs can raise one in a recovery (a
        # hook's or a model's ``Crash``), which would fail the same way at every pass
        if not isinstance(error, Exception | Unwind) or not counts_against_run(error):
            return
        log.warning("recovering %s failed before its first commit: %r", thread, error)
        lost_owner = self.owner if drive.epoch is not None else owner  # its claim landed?

        async def count() -> None:
            with contextlib.suppress(RatchetError):  # the store out: the next pass counts it
                await mark_lost(
                    self.store,
                    thread,
                    self.owner,
                    lost_owner=lost_owner,
                    reason=f"recovery_failed:{type(error).__name__}",
                    again=True,
                    publisher=self.publisher,
                    children=self.children,
                    unless=lambda: thread in self.drives,
                )

        task = asyncio.create_task(count())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def ref_of(frontier: Frontier) -> str:
    """The agent reference the Run was started with (every process rebuilds it from this)."""
    meta = run_meta(frontier)
    if meta is None:
        raise AgentImportError(f"thread {frontier.thread_id!r} records no agent reference")
    return meta.agent_ref
