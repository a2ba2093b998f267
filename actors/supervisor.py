"""The Supervisor: one detached, named actor per system that notices lost RunHosts.

A host is lost when its lease expires (no heartbeat for ``lease_ttl_s``: a hung
process, a node that vanished, a restart that cannot be scheduled) or when Ray
reports it dead for good. Its Running threads are then taken over: marked
``failed/execution_lost`` and re-placed on a live host (``actors.take_overs``). Ray's
actor restart is the fast path and usually wins; this is the path for everything else.
A lost host that stays silent a lease longer is hung (Ray takes a stopped process for
alive): it is killed, so that Ray restarts it and the calls it held are asked again
(``actors.hung_hosts``).

Every ``reconcile_s`` the Supervisor also looks, through the owner index, for every
running Run of this system whose owner is not a live host (it died while this
Supervisor was down, or a re-placement failed) and does the same. The same sweep
hands an ended child's outcome to a parent still awaiting it, should the hand-over of
the child's host have been lost (``actors.deliveries``), resumes a Run paused until
a time that has come and expires a tool wait past its deadline (``actors.schedule``),
and ends a child, at rest or running, whose parent is gone (``actors.orphans``).

Take-overs run in the background, a few at a time (``actors.take_overs``): a hung
host delays only the Runs sent to it, never the watch. So do hand-overs, due pauses
and orphans' cancels (one pass under way at most, ``WAKE_AT_ONCE`` calls at a time and
``PER_HOST`` on one host: ``actors.deliveries.Pass``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import ActorAlreadyExistsError, ActorDiedError

from actors.children import RayChildRunner
from actors.deliveries import AWAITING_DELEGATION, Pass, redeliver
from actors.host_control import acting_for
from actors.hung_hosts import HungHosts
from actors.idle_hosts import PING_TIMEOUT_S, IdleHosts
from actors.orphans import Orphans
from actors.reconcile import RECOVERY_RETRY_S
from actors.schedule import Alarms
from actors.spare import replace_spare_if_restarted
from actors.store_actor import open_system_store
from actors.system_lease import LeaseKeeper
from actors.take_overs import TAKE_OVERS, TakeOvers
from actors.wire import NAMESPACE, SystemSpec, live_bus, run_meta
from runtime.commit import Frontier
from runtime.errors import StoreLost
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import Cancelled
from runtime.ports import RunSummary, host_of, refused_in
from runtime.publish import Publisher
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.supervisor")
EVENTS_KEPT = 1000
"""The latest lost and restarted hosts ``report`` shows (its counts have them all)."""


class Supervisor(TakeOvers, HungHosts, IdleHosts):
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
        self.orphans = Orphans(
            self.store, self._end_orphan, self.children.cancel, self.children.host_for
        )
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

    async def system_spec(self) -> SystemSpec:
        """The spec this system runs with, the one it was started with: what a client that
        joins it adopts (``cluster.joining``)."""
        return self.spec

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
        driven: list[RunSummary] = []  # running on a live host: a cancel reaches its drive
        for host, lost in zip(hosts, orphaned, strict=True):
            if lost:  # a live host reconciles its own Runs
                self.counts["orphans"] += self._take_over_all(by_host[host])
            else:
                driven.extend(by_host[host])
        # Runs at rest that wait for the system, not for a person: parents awaiting a
        # child's outcome (its hand-over may have been lost), Runs paused until a time and
        # waits past their deadline (in the background, one pass at a time: each is a
        # call to a host, which may hang)
        if self._waking is not None and not self._waking.done():
            return  # the last pass is still asking: this sweep's Runs are its too
        awaiting = [s for s in await self.store.list_runs("awaiting") if self._ours(s)]
        parents = [s.thread_id for s in awaiting if s.status.reason == AWAITING_DELEGATION]
        self._waking = asyncio.create_task(self._wake(parents, awaiting, driven))

    async def _wake(
        self, parents: list[ThreadId], awaiting: list[RunSummary], running: list[RunSummary]
    ) -> None:
        """Hand parents their children's outcomes, wake Runs whose time has come (a pause
        or a wait's deadline: ``actors.schedule``), and end children, awaiting or
        running, whose parent is gone (``actors.orphans``). One ``Pass`` for the three: a
        host that hangs holds only its own slots of it, and once one call to it failed it
        is asked nothing more until the next pass."""
        calls = Pass()
        try:
            handed, (unpaused, expired), ended = await asyncio.gather(
                redeliver(self.store, parents, self._host_of, self.spec.limits, calls),
                self.alarms.fire(self.store, awaiting, self._host_of, now_us(), calls),
                self.orphans.sweep(awaiting, running, calls),
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


RemoteSupervisor = ray.remote(Supervisor)


def supervisor(spec: SystemSpec) -> Any:
    """The system's Supervisor, started if it is not running."""
    return supervisor_made(spec)[0]


def supervisor_made(spec: SystemSpec) -> tuple[Any, bool]:
    """The system's Supervisor, started if it is not running; and whether this call made
    it. Of two processes starting one system at once, the name Ray registers first is the
    system's: the other is told so (``made`` False) without waiting for its construction,
    which the maker, whose spec it runs with, never has to."""
    try:
        return ray.get_actor(spec.supervisor_name, namespace=NAMESPACE), False
    except ValueError:
        pass
    try:
        made = RemoteSupervisor.options(
            name=spec.supervisor_name,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=1000,
            num_cpus=0,
            **{k: v for k, v in spec.core_options.items() if k != "num_cpus"},
        ).remote(spec)
    except ActorAlreadyExistsError:  # another process made it since the look above
        return ray.get_actor(spec.supervisor_name, namespace=NAMESPACE), False
    return made, True
