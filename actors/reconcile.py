"""A host's reconciliation: what it owns (the store's owner index) against what it drives.

Every pass (at start, then every ``SystemSpec.reconcile_s``):

- a Run this host owns but does not drive is driven again: a previous incarnation's
  (Ray restarted the host, or the system came up again) or one whose drive stopped
  (a bug; ``paused`` drives, stopped by a long store outage, are not counted) is first
  marked lost (``actors.ownership.mark_lost``, which dead-letters a Run lost too often).
  One a previous incarnation had marked lost already is marked again: its recovery
  died with that incarnation, and that counts. One this incarnation marked is not
  (its failed recovery was counted when it failed);
- a drive of a Run that another owner has claimed since is stopped now, rather than at
  its next commit (which a long tool call can put off indefinitely): its waves are
  cancelled on the executors;
- a thread whose records do not verify is quarantined: no engine here acts on it.
  One listed again (its head verifies: repaired by hand, say) is looked at again after
  ``RECOVERY_RETRY_S``, doubling, and driven if it verifies whole.

A recovery that fails here (its agent cannot be imported: a deploy under way, a server
its module asks for restarting) counts towards the Run's dead letter, and is tried
again only after ``RECOVERY_RETRY_S``, doubling up to ``RECOVERY_RETRY_MAX_S``: a Run
is not dead-lettered by three passes a few seconds apart over a passing outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.drives import Drives, counts_against_run
from actors.ownership import EXECUTION_LOST, mark_lost, running_owned_by
from actors.system_lease import hold_system
from actors.wire import RemoteError
from runtime.errors import CorruptRecord, RatchetError
from runtime.ids import ThreadId
from runtime.ports import CommitStore, RunSummary

log = logging.getLogger("ratchet.run_host")
RECOVERY_RETRY_S = 30.0
"""How long after a failed recovery a host tries the Run again (then twice as long)."""
RECOVERY_RETRY_MAX_S = 300.0


class Reconciler:
    def __init__(
        self,
        host_id: str,
        owner: str,
        store: CommitStore,
        drives: Drives,
        recover: Callable[[ThreadId], Awaitable[Any]],
        *,
        system: str | None = None,
    ) -> None:
        self.host_id = host_id
        self.system = system
        """The system whose lease gates taking another incarnation's Runs (None: none
        does, for a host outside a cluster)."""
        self.owner = owner
        self.store = store
        self.drives = drives
        self.recover = recover
        self.passes = 0
        """Passes made (a host's ``info`` reports them as ``reconciled``)."""
        self.serves = True
        """Whether its cluster held the system's lease when it last looked."""
        self.retry: dict[ThreadId, tuple[float, float]] = {}
        """thread → (monotonic time before which its recovery is not tried again, the
        wait after the next failure): Runs whose recovery failed here."""

    async def once(self) -> None:
        owned = await running_owned_by(self.store, self.host_id)
        ours = {s.thread_id for s in owned if s.owner == self.owner}
        self.retry = {t: r for t, r in self.retry.items() if t in ours}  # ended, or taken
        # a paused drive whose Run another owner took, or that ended, is not ours to resume
        self.drives.paused &= ours
        await self._stop_fenced(ours)
        if any(s.owner != self.owner for s in owned) and not await self._cluster_serves():
            owned = [s for s in owned if s.owner == self.owner]
        await asyncio.gather(*(self._take_back(s) for s in owned))
        self.passes += 1

    async def _cluster_serves(self) -> bool:
        """Whether this cluster holds its system's lease (``actors.system_lease``): a Run
        another incarnation owns may be another live cluster's, not a dead one's."""
        serves = self.system is None or await hold_system(self.store, self.system)
        if not serves and self.serves:  # said once, not at every pass
            log.error(
                "host %s takes over no Run of another incarnation: another Ray cluster "
                "serves system %s on the same store",
                self.host_id,
                self.system,
            )
        self.serves = serves
        return serves

    async def _stop_fenced(self, ours: set[ThreadId]) -> None:
        for thread, drive in list(self.drives.table.items()):
            # a drive that holds no epoch yet has claimed nothing: its own CAS decides
            if thread in ours or drive.epoch is None or drive.task.done():
                continue
            frontier = await self.store.load(thread)
            # claimed by another owner since (it may even have ended the Run): fenced
            if self.drives.fenced(drive, frontier) and self.drives.get(thread) is drive:
                log.info("drive of %s was fenced by %s: stopping it", thread, frontier.owner)
                await self.drives.stop(thread, drive)

    async def _take_back(self, summary: RunSummary) -> None:
        """A running Run this host owns but does not drive: drive it again."""
        thread = summary.thread_id
        drives = self.drives
        if (
            thread in drives
            or thread in drives.replacing
            or thread in drives.ending  # a promised end comes first (host_control)
            or self._backing_off(thread)
        ):
            return
        if thread in drives.quarantined:
            # listed, so its head verifies: a thread repaired by hand (an index key put
            # back) is driven again. Still corrupt, its recovery quarantines it again,
            # and the next look waits twice as long (RECOVERY_RETRY_S, doubling)
            drives.quarantined.discard(thread)
            self._back_off(thread)
        try:
            ours = summary.owner == self.owner
            marked_already = summary.status.state != "running"
            if not (ours and (marked_already or thread in drives.paused)):
                marked = await mark_lost(
                    self.store,
                    thread,
                    self.owner,
                    lost_owner=summary.owner,
                    reason="execution_stopped" if ours else EXECUTION_LOST,
                    again=marked_already,
                    publisher=drives.publisher,
                    children=drives.children,
                    unless=lambda: thread in drives,  # a request spawned a drive since
                )
                if marked != "lost":
                    return  # another owner has it, or it was dead-lettered: nothing to do
            drives.paused.discard(thread)
            if thread in drives:  # a request spawned a drive meanwhile
                return
            result = await self.recover(thread)
            if isinstance(result, RemoteError):
                self._back_off(thread)
                if counts_against_run(result.rebuild()):
                    await self._recovery_failed(thread, result)
                else:  # the store out for this host, say: as a paused drive, not counted
                    log.info("recovering %s: %s, not counted", thread, result.name)
                    drives.paused.add(thread)
            else:
                self.retry.pop(thread, None)
        except CorruptRecord as exc:
            log.error("thread %s cannot be trusted (%s); not driving it for now", thread, exc)
            drives.quarantined.add(thread)
            self._back_off(thread)

    def _backing_off(self, thread: ThreadId) -> bool:
        retry = self.retry.get(thread)
        return retry is not None and time.monotonic() < retry[0]

    def _back_off(self, thread: ThreadId) -> None:
        wait = self.retry.get(thread, (0.0, RECOVERY_RETRY_S))[1]
        self.retry[thread] = (time.monotonic() + wait, min(wait * 2, RECOVERY_RETRY_MAX_S))

    async def _recovery_failed(self, thread: ThreadId, error: RemoteError) -> None:
        """Recovering failed before a drive could start (e.g. its agent cannot be built
        here): that counts towards its dead letter."""
        with contextlib.suppress(RatchetError):
            await mark_lost(
                self.store,
                thread,
                self.owner,
                lost_owner=self.owner,
                reason=f"recovery_failed:{error.name}",
                again=True,
                publisher=self.drives.publisher,
                children=self.drives.children,
                unless=lambda: thread in self.drives,
            )
