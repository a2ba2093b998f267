"""Taking Runs over: the Supervisor's side that marks a lost host's Runs lost and
re-places them (a mixin of ``actors.supervisor.Supervisor``, whose leases, store and
counters it uses).

A Run whose owner is lost is marked ``failed/execution_lost`` by compare-and-set
(``actors.ownership.mark_lost``: only if the lost host still owns it, the claim in
the same commit fencing it, should it still be alive) and re-placed on a live host,
whose ``Engine.recover`` sets it running again. A recovery counts as failed when the
host refuses it or dies doing it; a Run whose recovery keeps failing is dead-lettered
(``failed(recovery)``) by ``mark_lost``.

Take-overs run in the background, ``TAKE_OVERS`` at a time, each re-placement within
``SystemSpec.recover_timeout_s``: a hung host delays only the Runs sent to it, never
the watch. What goes wrong with one Run stays with it: a thread whose records do not
verify is quarantined (not taken over until it is listed again, its head verifying,
and ``RECOVERY_RETRY_S`` has passed), any other error is logged and the Run tried
again at the next sweep; a store outage ends the pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors.children import RayChildRunner
from actors.drives import counts_against_run
from actors.host_book import HostBook
from actors.hung_hosts import exists
from actors.idle_hosts import PING_TIMEOUT_S
from actors.ownership import EXECUTION_LOST, mark_lost
from actors.run_host import dedicated_host, hosted_host
from actors.wire import NAMESPACE, RemoteError, RunMeta, pick_live, run_meta
from runtime.commit import Frontier
from runtime.errors import CorruptRecord, RatchetError, StoreLost, StoreUnavailable
from runtime.ids import ThreadId
from runtime.ports import RunSummary, host_of
from runtime.publish import Publisher

log = logging.getLogger("ratchet.supervisor")
TAKE_OVERS = 8
"""Take-overs under way at once (each one is a few store calls and one host call)."""


class TakeOvers(HostBook):
    children: RayChildRunner
    publisher: Publisher | None
    quarantined: set[ThreadId]
    """Threads whose records do not verify: not taken over (``_quarantine``)."""
    _quarantined_at: dict[ThreadId, float]
    _slots: asyncio.Semaphore
    """``TAKE_OVERS`` of them."""
    _background: set[asyncio.Task[Any]]
    _dead: Callable[[str], Awaitable[bool]]  # the Supervisor's: Ray reports it gone for good
    _expect: Callable[[str, str, float], None]  # actors.hung_hosts: a lease from now
    _forget: Callable[[str], None]  # actors.idle_hosts: no lease, nothing to restart

    def _quarantine(self, thread: ThreadId, now: float) -> None:
        """Never taken over while its records do not verify; looked at again once it is
        listed (its head verifies) and ``RECOVERY_RETRY_S`` has passed (a take-over that
        meets it corrupt quarantines it again)."""
        self.quarantined.add(thread)
        self._quarantined_at.setdefault(thread, now)

    def _take_over_all(self, runs: list[RunSummary], settled: str | None = None) -> int:
        """Take these Runs over in the background (a thread being taken over already, or
        quarantined, is left alone); how many were queued. ``settled`` counts those
        re-placed. None while another Ray cluster serves the system (``actors.system_lease``)."""
        if not self.lease.held:
            return 0
        todo = [s for s in runs if s.thread_id not in self._taking | self.quarantined]
        self._taking.update(s.thread_id for s in todo)
        task = asyncio.create_task(self._take_batch(todo, settled))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return len(todo)

    async def _take_batch(self, runs: list[RunSummary], settled: str | None) -> None:
        try:  # asked afresh: see LeaseKeeper.serves
            serves = not runs or await self.lease.serves()
        except StoreLost:  # the tick says so
            serves = False
        if not serves:
            self._taking.difference_update(s.thread_id for s in runs)
            return
        store_out = asyncio.Event()  # the store is out: the rest waits for the next pass

        async def one(summary: RunSummary) -> None:
            try:
                async with self._slots:
                    if not store_out.is_set() and await self._safely(summary, store_out):
                        self.counts[settled or "taken_over"] += 1
            finally:
                self._taking.discard(summary.thread_id)

        await asyncio.gather(*(one(s) for s in runs))

    async def _safely(self, summary: RunSummary, store_out: asyncio.Event) -> bool:
        """One take-over; what goes wrong with it stays with its Run."""
        thread = summary.thread_id
        try:
            return await self._take_over(summary)
        except CorruptRecord as exc:  # fail closed: no engine acts on it (DESIGN §5)
            log.error("thread %s cannot be trusted (%s); not taking it over", thread, exc)
            self._quarantined_at.pop(thread, None)  # the wait starts again
            self._quarantine(thread, time.monotonic())
        except StoreUnavailable as exc:
            log.warning("store unavailable taking %s over (%s); next sweep", thread, exc)
            store_out.set()
        except Exception:  # a bug, a host gone between two calls: tried again next sweep
            log.exception("taking %s over failed", thread)
        return False

    async def _take_over(self, summary: RunSummary) -> bool:
        """Mark a Run whose owner is lost (if still its owner's) and re-place it.

        One that another owner marked lost already is marked again if that owner is dead
        (its recovery died with it: that counts); if it is only silent (a lease expired:
        it may be slow, in the middle of that recovery) it is re-placed as it is, the new
        owner's claim fencing the old. One we marked is re-placed as it is (our
        re-placement timed out, or this Supervisor restarted): our recoveries of it that
        failed were counted when they failed."""
        thread, lost_owner = summary.thread_id, summary.owner
        marked_already = summary.status.state != "running"
        if not marked_already or (lost_owner != self.owner and await self._owner_dead(summary)):
            marked = await mark_lost(
                self.store,
                thread,
                self.owner,
                lost_owner=lost_owner,
                again=marked_already,
                publisher=self.publisher,
                children=self.children,
            )
            if marked != "lost":
                return False  # someone else has it now, or it ended (a dead letter, say)
            lost_owner = self.owner  # marked: ours now
        # Another may have claimed it since the listing was read (a recovery of ours that
        # timed out but went on, say): one sent now at that claim's epoch would fence a
        # drive nobody judged lost. The next sweep judges that owner afresh.
        frontier = await self.store.load(thread)
        if frontier.owner != lost_owner:
            log.info("%s is %s's now, not %s's: left to it", thread, frontier.owner, lost_owner)
            return False
        await self._replace(frontier)
        return True

    async def _owner_dead(self, summary: RunSummary) -> bool:
        """Whether the host process that owns the Run is gone: the host is dead, or it
        answers as another incarnation (Ray restarted it). Not known: False."""
        try:
            handle = ray.get_actor(host_of(summary.owner) or "", namespace=NAMESPACE)
            info: dict[str, Any] = await asyncio.wait_for(handle.info.remote(), PING_TIMEOUT_S)
        except (ValueError, ActorDiedError):
            return True
        except Exception:  # slow, restarting or unreachable
            return False
        return summary.owner != f"{info['host']}#{info['pid']}"

    async def _replace(self, frontier: Frontier) -> None:
        """Send the Run, as ``frontier`` (just loaded) has it, to a live host."""
        thread = frontier.thread_id
        meta = run_meta(frontier)
        if meta is None:
            log.error("thread %s records no agent reference; cannot re-place it", thread)
            return
        name, host = self._target(thread, meta)
        try:  # a host that is down or restarting is not sent it: no attempt to count
            await asyncio.wait_for(host.ping.remote(), PING_TIMEOUT_S)
        except Exception as exc:  # the Run stays as committed, for the next sweep
            log.info("host %s not answering (%r); %s waits for the next sweep", name, exc, thread)
            if meta.placement == "dedicated":
                if self._was_lost(name):
                    self._end_lost_dedicated(name, host)
                elif name not in self.kinds:  # never heard from: hung before this Supervisor
                    self._expect(name, "dedicated", time.monotonic())
            return
        self._recovering[name] += 1
        try:
            answer = await asyncio.wait_for(
                # at the epoch read here: a call that arrives late takes nothing from
                # a host that has the Run by then
                host.recover_run.remote(thread, meta.agent_ref, frontier.epoch),
                self.spec.recover_timeout_s,
            )
        except RayActorError as exc:  # the host answered, then died taking it over: counts
            log.warning("host %s died re-placing %s: %s", name, thread, exc)
            await self._recovery_failed(thread, EXECUTION_LOST)
            return
        except TimeoutError:  # hung or slow: the next sweep tries again, unless it is dead
            log.warning("re-placing %s on %s: no answer in time", thread, name)
            if await self._dead(name):
                await self._recovery_failed(thread, EXECUTION_LOST)
            return
        finally:
            self._recovering[name] -= 1
            if not self._recovering[name]:
                del self._recovering[name]
        if isinstance(answer, RemoteError):  # the host could not recover it: that counts
            log.warning("recovering %s failed: %s.%s", thread, answer.module, answer.name)
            if counts_against_run(answer.rebuild()):  # not a store out for that host, say
                await self._recovery_failed(thread, f"recovery_failed:{answer.name}")
            return
        self.counts["runs_replaced"] += 1

    def _was_lost(self, name: str) -> bool:
        """The host had come up (it sent a heartbeat) and its lease has run out since: a
        host that does not answer is then not one still starting."""
        return name in self.kinds and self.leases.get(name, 0.0) <= time.monotonic()

    def _end_lost_dedicated(self, name: str, host: Any) -> None:
        """A Run's dedicated host is the only host it can go to, and it was lost and does
        not answer now: a hung process (stopped, its loop blocked) would hold the Run for
        ever. It is ended, and the next sweep starts the Run a new one (its Run was
        marked lost, claimed from it: that process drives nothing of it any more)."""
        log.warning("dedicated host %s is lost and does not answer: ending it", name)
        self._forget(name)
        with contextlib.suppress(Exception):  # gone already
            ray.kill(host, no_restart=True)

    async def _recovery_failed(self, thread: ThreadId, reason: str) -> None:
        """A recovery of ours failed: it counts (if the Run is still ours as we marked it)."""
        with contextlib.suppress(RatchetError):  # not counted now: the next sweep retries
            await mark_lost(
                self.store,
                thread,
                self.owner,
                lost_owner=self.owner,
                reason=reason,
                again=True,
                publisher=self.publisher,
                children=self.children,
            )

    def _target(self, thread: ThreadId, meta: RunMeta) -> tuple[str, Any]:
        """The host to re-place a Run on: its name and handle."""
        if meta.placement == "dedicated":
            return self.spec.dedicated_name(thread), dedicated_host(self.spec, thread)
        now = time.monotonic()
        live = [h for h, t in self.leases.items() if t > now and self.kinds.get(h) == "hosted"]
        if not live:
            # no lease heard yet (the pool is still starting) or none left: any pool
            # host that exists, before bringing back one that is gone
            pool = [self.spec.host_name(i) for i in range(self.spec.hosts)]
            live = [name for name in pool if exists(name)]
        if live:
            name = pick_live(thread, live)
            return name, ray.get_actor(name, namespace=NAMESPACE)
        index = int(pick_live(thread, [str(i) for i in range(self.spec.hosts)]))
        return self.spec.host_name(index), hosted_host(self.spec, index)
