"""Idle hosts: the Supervisor's side that lets hosts and the system's lease go (a mixin
of ``actors.supervisor.Supervisor``, whose leases, store and counters it uses).

A dedicated host whose Run is over retires once nothing is driven there and no Run of
its own is running in the store. The system's lease is given up on a client's word
(``cluster.client``): at a shutdown at once, at a close only if every host is idle so
(a process that lives on with its Ray, a notebook's, keeps its hosts driving) and no
client said to keep it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib

import ray

from actors.host_book import HostBook
from actors.wire import NAMESPACE

PING_TIMEOUT_S = 2.0


class IdleHosts(HostBook):
    _kept: int
    """Words to keep the lease so far: a give-up that began before the last one is moot."""

    async def retire(self, host_id: str) -> bool:
        """A dedicated host whose Run is over: forget its lease and end the process, if it
        is idle still (nothing driven there, no running Run of its own in the store, no
        recovery of ours on its way to it). False if not: it asks again once idle."""
        if not await self._idle(host_id) or self._recovering[host_id]:
            return False
        try:  # the host agrees to go, and from then on starts no drive (actors.retiring)
            handle = ray.get_actor(host_id, namespace=NAMESPACE)
            agreed: bool = await asyncio.wait_for(handle.retire_now.remote(), PING_TIMEOUT_S)
        except ValueError:  # gone already
            agreed = True
        except Exception:  # slow to answer, or restarting: it asks again once idle
            return False
        if not agreed or self._recovering[host_id]:  # checked after the last await
            return False  # a recovery of ours waits at its door: it opens again
        self._forget(host_id)
        with contextlib.suppress(ValueError):  # gone already
            ray.kill(handle, no_restart=True)
        return True

    def _forget(self, host_id: str) -> None:
        """A host this Supervisor ends for good: no lease, and nothing to restart."""
        self.leases.pop(host_id, None)
        self.kinds.pop(host_id, None)
        self._silent.pop(host_id, None)

    async def _idle(self, host_id: str) -> bool:
        try:
            handle = ray.get_actor(host_id, namespace=NAMESPACE)
            driving: bool = await asyncio.wait_for(handle.driving.remote(), PING_TIMEOUT_S)
        except ValueError:  # gone already: nothing to end
            return True
        except Exception:  # slow to answer, or restarting: not idle, as far as we know
            return False
        return not driving and not await self.store.list_runs("running", host=host_id)

    async def give_up_lease(self, when_idle: bool = False) -> bool:
        """Renew the system's lease no more (``actors.system_lease.LeaseKeeper.give_up``);
        whether it was given up. ``when_idle`` (a client's close: the process that started
        this Ray may live on, a notebook's, and the system's actors with it): only if no
        host of the system drives a Run or holds one running in the store, and no
        take-over is under way; else another cluster could take the store and recover
        Runs driven here."""
        kept = self._kept
        if when_idle and not await self._all_idle():
            return False
        if self._kept != kept:  # a client connected meanwhile: its word to keep it stands
            return False
        await self.lease.give_up()
        return True

    async def _all_idle(self) -> bool:
        if self._taking or any(self._recovering.values()):
            return False
        hosts = {*self.kinds, *(self.spec.host_name(i) for i in range(self.spec.hosts))}
        try:
            idle = await asyncio.gather(*(self._idle(host) for host in hosts))
        except Exception:  # the store did not answer a listing: not idle, as far as we know
            return False
        return all(idle) and not self._taking

    async def keep_lease(self) -> None:
        """Renew it again: a client claimed it anew (``LeaseKeeper.keep``)."""
        self._kept += 1
        self.lease.keep()
