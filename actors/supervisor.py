"""The Supervisor: one detached, named actor per system that notices lost RunHosts.

A host is lost when its lease expires (no heartbeat for ``lease_ttl_s``: a hung
process, a node that vanished, a restart that cannot be scheduled) or when Ray
reports it dead for good. Its Running threads are then marked ``failed/execution_lost``
by compare-and-set (``actors.ownership.mark_lost``: only if the lost host still owns
them, the claim in the same commit fencing it, should it still be alive) and
re-placed on a live host, whose ``Engine.recover`` sets them running again. Ray's
actor restart is the fast path and usually wins; this is the path for everything else.

Every ``reconcile_s`` the Supervisor also looks, through the owner index, for every
running Run of this system whose owner is not a live host (it died while this
Supervisor was down, or a re-placement failed) and does the same. A Run whose
recovery keeps failing is dead-lettered (``failed(recovery)``) by ``mark_lost``.
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

from actors.ownership import mark_lost
from actors.run_host import dedicated_host, hosted_host
from actors.spare import replace_spare_if_restarted
from actors.store_actor import open_system_store
from actors.wire import NAMESPACE, RemoteError, SystemSpec, pick_live, run_meta
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.ports import RunSummary, host_of
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.supervisor")
PING_TIMEOUT_S = 2.0


class Supervisor:
    async def __init__(self, spec: SystemSpec) -> None:
        replace_spare_if_restarted(spec.warm_spares)
        self.spec = spec
        self.owner = spec.supervisor_name
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
            except Exception:  # the next tick tries again; Runs stay as committed
                log.exception("supervisor tick failed")
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _tick(self) -> None:
        now = time.monotonic()
        expired = [h for h, t in self.leases.items() if t <= now]
        # a host whose heartbeat is late but which answers is slow, not lost (a loaded
        # machine delays heartbeats): its lease is renewed, its Runs stay with it
        answering = await asyncio.gather(*(self._alive(h, now) for h in expired))
        for host_id, alive in zip(expired, answering, strict=True):
            if alive:
                self.leases[host_id] = now + self.spec.lease_ttl_s
        expired = [h for h, alive in zip(expired, answering, strict=True) if not alive]
        dead = await self._dead_hosts([h for h in self.leases if h not in expired])
        for host_id in [*expired, *dead]:
            self.leases.pop(host_id, None)
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
        runs = await self.store.list_runs("running", host=host_id)
        log.warning("host %s lost (%s): %d running runs", host_id, why, len(runs))
        settled = 0
        for summary in runs:
            settled += await self._take_over(summary)
        self.counts["hosts_lost"] += 1
        self.counts["runs_settled"] += settled
        self.events.append({"host": host_id, "why": why, "runs": len(runs), "at": now_us()})

    async def _take_over(self, summary: RunSummary) -> bool:
        """Mark a Run whose owner is lost (if still its owner's) and re-place it."""
        if summary.status.state == "running":
            marked = await mark_lost(
                self.store, summary.thread_id, self.owner, lost_owner=summary.owner
            )
            if not marked:
                return False  # someone else has it now, or it ended
        await self._replace(summary.thread_id)
        return True

    async def _replace(self, thread: ThreadId) -> None:
        meta = run_meta(await self.store.load(thread))
        if meta is None:
            log.error("thread %s records no agent reference; cannot re-place it", thread)
            return
        if meta.placement == "dedicated":
            host = dedicated_host(self.spec, thread)
        else:
            host = self._live_hosted(thread)
        try:
            answer = await host.recover_run.remote(thread, meta.agent_ref)
        except Exception as exc:  # the next sweep tries again
            log.warning("re-placing %s failed: %s", thread, exc)
            return
        if isinstance(answer, RemoteError):  # the host could not recover it: that counts
            log.warning("recovering %s failed: %s.%s", thread, answer.module, answer.name)
            with contextlib.suppress(RatchetError):
                await mark_lost(
                    self.store,
                    thread,
                    self.owner,
                    lost_owner=self.owner,
                    reason=f"recovery_failed:{answer.name}",
                    again=True,
                )
            return
        self.counts["runs_replaced"] += 1

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

    async def _sweep(self) -> None:
        """Every running Run of this system whose owner is not a live host (the owner
        index: the listing carries each Run's owner; no frontier is loaded)."""
        now = time.monotonic()
        by_host: dict[str, list[RunSummary]] = {}
        for summary in await self.store.list_runs("running"):
            host = host_of(summary.owner) or ""
            if host.startswith(f"{self.spec.name}:"):  # this system's hosts, and this actor
                by_host.setdefault(host, []).append(summary)
        for host, runs in sorted(by_host.items()):
            if host != self.owner and await self._alive(host, now):
                continue  # a live host reconciles its own Runs
            for summary in runs:
                self.counts["orphans"] += 1
                await self._take_over(summary)

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
