"""The Supervisor: one detached, named actor per system that notices lost RunHosts.

A host is lost when its lease expires (no heartbeat for ``lease_ttl_s``: a hung
process, a node that vanished, a restart that cannot be scheduled) or when Ray
reports it dead for good. Its Running threads are then marked ``failed/execution_lost``
by compare-and-set (``actors.ownership.mark_lost``: only if the lost host still owns
them, the claim in the same commit fencing it, should it still be alive) and
re-placed on a live host, whose ``Engine.recover`` sets them running again. Ray's
actor restart is the fast path and usually wins; this is the path for everything else.
A lost host that stays silent a lease longer is hung (Ray takes a stopped process for
alive): it is killed, so that Ray restarts it and the calls it held are asked again.

Every ``reconcile_s`` the Supervisor also looks, through the owner index, for every
running Run of this system whose owner is not a live host (it died while this
Supervisor was down, or a re-placement failed) and does the same. A Run whose
recovery keeps failing is dead-lettered (``failed(recovery)``) by ``mark_lost``: a
recovery counts as failed when the host refuses it or dies doing it. The same sweep
hands an ended child's outcome to a parent still awaiting it, should the hand-over of
the child's host have been lost (``actors.deliveries``), resumes a Run paused until
a time that has come and expires a tool wait past its deadline (``actors.schedule``),
and ends a child at rest whose parent is
gone (``actors.orphans``).

Take-overs run in the background, ``TAKE_OVERS`` at a time, each re-placement within
``SystemSpec.recover_timeout_s``: a hung host delays only the Runs sent to it, never
the watch. So do hand-overs and due pauses (``WAKE_AT_ONCE`` calls at a time, one
pass under way at most). What goes wrong with one Run stays with it: a thread whose records do not
verify is quarantined (not taken over until it is listed again, its head verifying, and
``RECOVERY_RETRY_S`` has passed), any other error is
logged and the Run tried again at the next sweep; a store outage ends the pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors.children import RayChildRunner
from actors.deliveries import AWAITING_DELEGATION, redeliver
from actors.drives import counts_against_run
from actors.host_control import acting_for
from actors.hung_hosts import HungHosts, exists
from actors.idle_hosts import PING_TIMEOUT_S, IdleHosts
from actors.orphans import Orphans
from actors.ownership import EXECUTION_LOST, mark_lost
from actors.reconcile import RECOVERY_RETRY_S
from actors.run_host import dedicated_host, hosted_host
from actors.schedule import Alarms
from actors.spare import replace_spare_if_restarted
from actors.store_actor import open_system_store
from actors.system_lease import LeaseKeeper
from actors.wire import (
    NAMESPACE,
    RemoteError,
    RunMeta,
    SystemSpec,
    live_bus,
    pick_live,
    run_meta,
)
from runtime.commit import Frontier
from runtime.errors import CorruptRecord, RatchetError, StoreLost, StoreUnavailable
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import Cancelled
from runtime.ports import RunSummary, host_of, refused_in
from runtime.publish import Publisher
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.supervisor")
TAKE_OVERS = 8
"""Take-overs under way at once (each one is a few store calls and one host call)."""
EVENTS_KEPT = 1000
"""The latest lost and restarted hosts ``report`` shows (its counts have them all)."""


class Supervisor(HungHosts, IdleHosts):
    # Ray awaits an async actor's __init__ in the actor's own event loop
    async def __init__(self, spec: SystemSpec) -> None:  # type: ignore[misc]
        replace_spare_if_restarted(spec.warm_spares)
        self.spec = spec
        self.owner = spec.supervisor_name
        self.store = await open_system_store(spec, who="the Supervisor")
        # what a dead letter needs: its children are cancelled, its end is published
        self.children = RayChildRunner(spec)
        bus = live_bus(spec)
        self.publisher = Publisher(bus) if bus is not None else None
        self.leases: dict[str, float] = {}
        """host id → monotonic time its lease expires."""
        self.kinds: dict[str, str] = {}
        self.counts: Counter[str] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.quarantined: set[ThreadId] = set()
        """Threads whose records do not verify: not taken over (``_quarantine``)."""
        self._quarantined_at: dict[ThreadId, float] = {}
        self._taking: set[ThreadId] = set()
        """Threads with a take-over queued or under way (one at a time per thread)."""
        self._recovering: Counter[str] = Counter()
        """host id → our ``recover_run`` calls in flight there (such a host never retires)."""
        self._slots = asyncio.Semaphore(TAKE_OVERS)
        self._background: set[asyncio.Task[Any]] = set()
        self._waking: asyncio.Task[None] | None = None
        """The pass handing outcomes over and waking Runs that are due, if under way."""
        self.orphans = Orphans(self.store, self._end_orphan)
        self.alarms = Alarms()
        self.lease = LeaseKeeper(self.store, spec.name)
        self._kept = 0
        self.store_lost = False
        """Whether the store answered StoreLost (its contents gone: ``report`` says so)."""
        self._silent: dict[str, float] = {}
        """Hosts lost by their lease, not dead → when: one silent a lease longer is hung."""
        self._started = self._last_sweep = time.monotonic()
        self._task = asyncio.create_task(self._watch())
        self._renewing = asyncio.create_task(self._keep_lease())

    async def heartbeat(self, host_id: str, kind: str) -> None:
        self.leases[host_id] = time.monotonic() + self.spec.lease_ttl_s
        self.kinds[host_id] = kind
        self._silent.pop(host_id, None)

    async def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "live": sorted(h for h, t in self.leases.items() if t > now),
            "counts": dict(self.counts),
            "events": list(self.events),
            "quarantined": sorted(self.quarantined),
            "taking": len(self._taking),
            "serves": self.lease.held,
            "lease_checks": self.lease.checks,
            "store_lost": self.store_lost,
        }

    # ---- the watch ---------------------------------------------------------------

    async def _watch(self) -> None:
        await self._every_heartbeat(self._tick, "supervisor tick failed")

    async def _keep_lease(self) -> None:
        """The system's lease, renewed in a task of its own: a tick that waits on slow
        work (a sweep over many Runs, hosts that do not answer) must not let it lapse."""
        renew = lambda: self.lease.renew(time.monotonic())  # noqa: E731
        await self._every_heartbeat(renew, "renewing the system's lease failed")

    async def _every_heartbeat(self, work: Callable[[], Awaitable[None]], failed: str) -> None:
        while True:
            try:
                await work()
            except StoreLost as exc:  # for good: said once, and in the report
                if not self.store_lost:
                    log.error("the store is lost; nothing is taken over: %s", exc)
                self.store_lost = True
            except Exception:  # the next round tries again; Runs stay as committed
                log.exception(failed)
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _tick(self) -> None:
        now = time.monotonic()
        self._expect_pool(now)
        expired = [h for h, t in self.leases.items() if t <= now]
        # a host whose heartbeat is late but which answers is slow, not lost (a loaded
        # machine delays heartbeats): its lease is renewed, its Runs stay with it
        answering = await asyncio.gather(*(self._alive(h, now) for h in expired))
        for host_id, alive in zip(expired, answering, strict=True):
            if alive:
                self.leases[host_id] = now + self.spec.lease_ttl_s
        expired = [h for h, alive in zip(expired, answering, strict=True) if not alive]
        dead = await self._dead_hosts([h for h in self.leases if h not in expired])
        await self._restart_hung(now)
        self._silent.update((h, now) for h in expired)  # before a store outage ends the tick
        for host_id in [*expired, *dead]:
            self.leases.pop(host_id, None)
            if host_id in dead:  # gone for good: a host of that name is a new one
                self.kinds.pop(host_id, None)
            await self._host_lost(host_id, "lease expired" if host_id in expired else "dead")
        if now - self._last_sweep >= self.spec.reconcile_s:
            self._last_sweep = now
            await self._sweep()

    async def _dead_hosts(self, hosts: list[str]) -> list[str]:
        """Hosts Ray reports dead for good (a restarting host is not dead)."""
        verdicts = await asyncio.gather(*(self._dead(h) for h in hosts))
        return [h for h, d in zip(hosts, verdicts, strict=True) if d]

    async def _dead(self, host_id: str) -> bool:
        try:
            handle = ray.get_actor(host_id, namespace=NAMESPACE)
            await asyncio.wait_for(handle.ping.remote(), PING_TIMEOUT_S)
        except (ValueError, ActorDiedError):  # gone, and Ray will not bring it back
            return True
        except Exception:  # slow, restarting or unreachable: the lease decides
            return False
        return False

    async def _host_lost(self, host_id: str, why: str) -> None:
        runs = await self._running(host_id)
        log.warning("host %s lost (%s): %d running runs", host_id, why, len(runs))
        self.counts["hosts_lost"] += 1
        self.events.append({"host": host_id, "why": why, "runs": len(runs), "at": now_us()})
        self._take_over_all(runs, settled="runs_settled")

    async def _sweep(self) -> None:
        """Every running Run of this system whose owner is not a live host (the owner
        index: the listing carries each Run's owner; no frontier is loaded). None while
        another Ray cluster serves the system: waking a Run claims it too."""
        if not self.lease.held:
            return
        now = time.monotonic()
        by_host: dict[str, list[RunSummary]] = {}
        for summary in await self._running():
            if self._ours(summary):
                by_host.setdefault(host_of(summary.owner) or "", []).append(summary)
        hosts = sorted(by_host)
        orphaned = await asyncio.gather(*(self._orphaned(h, now) for h in hosts))
        for host, lost in zip(hosts, orphaned, strict=True):
            if lost:  # a live host reconciles its own Runs
                self.counts["orphans"] += self._take_over_all(by_host[host])
        # Runs at rest that wait for the system, not for a person: parents awaiting a
        # child's outcome (its hand-over may have been lost), Runs paused until a time and
        # waits past their deadline (in the background, one pass at a time: each is a
        # call to a host, which may hang)
        if self._waking is not None and not self._waking.done():
            return  # the last pass is still asking: this sweep's Runs are its too
        awaiting = [s for s in await self.store.list_runs("awaiting") if self._ours(s)]
        parents = [s.thread_id for s in awaiting if s.status.reason == AWAITING_DELEGATION]
        self._waking = asyncio.create_task(self._wake(parents, awaiting))

    async def _wake(self, parents: list[ThreadId], awaiting: list[RunSummary]) -> None:
        """Hand parents their children's outcomes, wake Runs whose time has come (a pause
        or a wait's deadline: ``actors.schedule``), and end awaiting children whose parent
        is gone (``actors.orphans``)."""
        try:
            handed, (unpaused, expired), ended = await asyncio.gather(
                redeliver(self.store, parents, self._host_of, self.spec.limits),
                self.alarms.fire(self.store, awaiting, self._host_of, now_us()),
                self.orphans.sweep(awaiting),
            )
            self.counts["outcomes_handed"] += handed
            self.counts["pauses_resumed"] += unpaused
            self.counts["waits_expired"] += expired
            self.counts["orphan_children_ended"] += ended
        except Exception:  # the next sweep asks again; Runs stay as committed
            log.exception("waking Runs at rest failed")

    async def _end_orphan(self, thread: ThreadId, run: RunId) -> None:
        """End a child at rest whose parent is gone, as a cancel at rest would."""
        await acting_for(self).terminate(thread, Cancelled(), run=run)

    async def _running(self, host: str | None = None) -> list[RunSummary]:
        """The running Runs (of ``host``); a thread whose index entry does not verify is
        not listed, and is quarantined here (reported, not taken over)."""
        runs = await self.store.list_runs("running", host=host)
        now = time.monotonic()
        for thread in refused_in(runs):
            self._quarantine(thread, now)
        for summary in runs:  # listed: its entry and head verify now (repaired by hand)
            since = self._quarantined_at.get(summary.thread_id)
            if since is not None and now - since > RECOVERY_RETRY_S:
                self.quarantined.discard(summary.thread_id)
                del self._quarantined_at[summary.thread_id]
        return runs

    def _quarantine(self, thread: ThreadId, now: float) -> None:
        """Never taken over while its records do not verify; looked at again once it is
        listed (its head verifies) and ``RECOVERY_RETRY_S`` has passed (a take-over that
        meets it corrupt quarantines it again)."""
        self.quarantined.add(thread)
        self._quarantined_at.setdefault(thread, now)

    def _ours(self, summary: RunSummary) -> bool:
        """Owned by this system's hosts (or this actor)."""
        return (host_of(summary.owner) or "").startswith(f"{self.spec.name}:")

    def _host_of(self, frontier: Frontier) -> Any:
        meta = run_meta(frontier)
        return None if meta is None else self._target(frontier.thread_id, meta)[1]

    async def _orphaned(self, host: str, now: float) -> bool:
        """Runs of ``host`` have no live owner: it is this Supervisor (a re-placement of
        ours did not finish) or a host that is not alive."""
        return host == self.owner or not await self._alive(host, now)

    async def _alive(self, host: str, now: float) -> bool:
        """A lease, or (none heard: this Supervisor restarted, or the host is new) an answer."""
        if self.leases.get(host, 0.0) > now:
            return True
        try:
            handle = ray.get_actor(host, namespace=NAMESPACE)
            await asyncio.wait_for(handle.ping.remote(), PING_TIMEOUT_S)
        except Exception:  # gone, restarting or hung: its Runs are taken over (CAS)
            return False
        return True

    # ---- taking Runs over -----------------------------------------------------------

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


RemoteSupervisor = ray.remote(Supervisor)


def supervisor(spec: SystemSpec) -> Any:
    """The system's Supervisor, started if it is not running."""
    return RemoteSupervisor.options(
        name=spec.supervisor_name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_concurrency=1000,
        num_cpus=0,
        **{k: v for k, v in spec.core_options.items() if k != "num_cpus"},
    ).remote(spec)
