"""The Supervisor: one detached, named actor per system that notices lost RunHosts.

A host is lost when its lease expires (no heartbeat for ``lease_ttl_s``: a hung
process, a node that vanished and a restart that cannot be scheduled) or when Ray
reports it dead for good. Its Running threads are then claimed (fencing the lost
owner, should it still be alive), settled ``failed/execution_lost``, and re-placed
on a live host, whose ``Engine.recover`` sets them running again. Ray's actor
restart is the fast path and usually wins; this is the path for everything else.

Runs settled but not yet re-placed (the Supervisor itself crashed in between) are
found by a slower sweep of Runs whose status has been ``execution_lost`` a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from actors.ownership import EXECUTION_LOST, running_owned_by, settle_lost
from actors.run_host import dedicated_host, hosted_host
from actors.spare import replace_spare_if_restarted
from actors.store_actor import open_system_store
from actors.wire import NAMESPACE, RunMeta, SystemSpec, pick_live, run_meta
from runtime.ids import ThreadId
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.supervisor")
OWNER = "supervisor"
PING_TIMEOUT_S = 2.0


class Supervisor:
    async def __init__(self, spec: SystemSpec) -> None:
        replace_spare_if_restarted(spec.warm_spares)
        self.spec = spec
        self.store = await open_system_store(spec)
        self.leases: dict[str, float] = {}
        """host id → monotonic time its lease expires."""
        self.kinds: dict[str, str] = {}
        self.counts: Counter[str] = Counter()
        self.events: list[dict[str, Any]] = []
        self._started = self._last_sweep = time.monotonic()
        self._task = asyncio.create_task(self._watch())

    async def heartbeat(self, host_id: str, kind: str) -> None:
        self.leases[host_id] = time.monotonic() + self.spec.lease_ttl_s
        self.kinds[host_id] = kind

    async def retire(self, host_id: str) -> None:
        """A dedicated host whose Run is over: forget its lease and end the process."""
        self.leases.pop(host_id, None)
        self.kinds.pop(host_id, None)
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(host_id, namespace=NAMESPACE), no_restart=True)

    async def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "live": sorted(h for h, t in self.leases.items() if t > now),
            "counts": dict(self.counts),
            "events": list(self.events),
        }

    # ---- the watch ---------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("supervisor tick failed")
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _tick(self) -> None:
        now = time.monotonic()
        expired = [h for h, t in self.leases.items() if t <= now]
        dead = await self._dead_hosts([h for h in self.leases if h not in expired])
        for host_id in [*expired, *dead]:
            self.leases.pop(host_id, None)
            await self._host_lost(host_id, "lease expired" if host_id in expired else "dead")
        if now - self._last_sweep > 5 * self.spec.lease_ttl_s:
            self._last_sweep = now
            await self._sweep_orphans()

    async def _dead_hosts(self, hosts: list[str]) -> list[str]:
        """Hosts Ray reports dead for good (a restarting host is not dead)."""

        async def dead(host_id: str) -> bool:
            try:
                handle = ray.get_actor(host_id, namespace=NAMESPACE)
                await asyncio.wait_for(handle.ping.remote(), PING_TIMEOUT_S)
            except (ValueError, ActorDiedError):  # gone, and Ray will not bring it back
                return True
            except Exception:  # slow, restarting or unreachable: the lease decides
                return False
            return False

        verdicts = await asyncio.gather(*(dead(h) for h in hosts))
        return [h for h, d in zip(hosts, verdicts, strict=True) if d]

    async def _host_lost(self, host_id: str, why: str) -> None:
        frontiers = await running_owned_by(self.store, host_id)
        log.warning("host %s lost (%s): %d running runs", host_id, why, len(frontiers))
        settled = 0
        for frontier in frontiers:
            if await settle_lost(self.store, frontier.thread_id, OWNER):
                settled += 1
            await self._replace(frontier.thread_id, run_meta(frontier))
        self.counts["hosts_lost"] += 1
        self.counts["runs_settled"] += settled
        self.events.append({"host": host_id, "why": why, "runs": len(frontiers), "at": now_us()})

    async def _replace(self, thread: ThreadId, meta: RunMeta | None) -> None:
        if meta is None:
            log.error("thread %s records no agent reference; cannot re-place it", thread)
            return
        if meta.placement == "dedicated":
            host = dedicated_host(self.spec, thread)
        else:
            host = self._live_hosted(thread)
        try:
            await host.recover_run.remote(thread, meta.agent_ref)
            self.counts["runs_replaced"] += 1
        except Exception as exc:  # the sweep will try again
            log.warning("re-placing %s failed: %s", thread, exc)

    def _live_hosted(self, thread: ThreadId) -> Any:
        now = time.monotonic()
        live = [h for h, t in self.leases.items() if t > now and self.kinds.get(h) == "hosted"]
        if not live:
            # no lease heard yet (the pool is still starting) or none left: any pool
            # host that exists, before bringing back one that is gone
            pool = [self.spec.host_name(i) for i in range(self.spec.hosts)]
            live = [name for name in pool if _exists(name)]
        if live:
            return ray.get_actor(pick_live(thread, live), namespace=NAMESPACE)
        index = int(pick_live(thread, [str(i) for i in range(self.spec.hosts)]))
        return hosted_host(self.spec, index)

    async def _sweep_orphans(self) -> None:
        """Runs nobody is driving any more, found from the store alone.

        Settled as lost long enough ago that no host can be recovering them; or
        running under a host of this system that holds no lease (it died while
        this Supervisor was down, so no expiry was ever seen).
        """
        grace_us = int(2 * self.spec.lease_ttl_s * 1_000_000)
        settled_long_ago, unleased = [], set()
        watching = time.monotonic() - self._started > 2 * self.spec.lease_ttl_s
        for summary in await self.store.list_runs("running"):
            status = summary.status
            if status.state == "failed" and status.reason == EXECUTION_LOST:
                if now_us() - status.since >= grace_us:
                    settled_long_ago.append(summary.thread_id)
            elif status.state == "running" and watching:
                host = (await self.store.load(summary.thread_id)).owner or ""
                host_id = host.split("#", 1)[0]
                if host_id.startswith(f"{self.spec.name}:") and host_id not in self.leases:
                    unleased.add(host_id)
        for thread in settled_long_ago:
            self.counts["orphans"] += 1
            await self._replace(thread, run_meta(await self.store.load(thread)))
        for host_id in sorted(unleased):
            await self._host_lost(host_id, "no lease")


def _exists(name: str) -> bool:
    """A named actor Ray knows (alive, or restarting)."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


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
