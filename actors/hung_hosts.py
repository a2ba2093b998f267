"""Hung hosts: the Supervisor's side that restarts them (a mixin of
``actors.supervisor.Supervisor``, whose leases, store and counters it uses).

Ray takes a stopped process, or one whose event loop is blocked, for alive: a call
sent to it (a start that hashes to it, a resume, a wait) is never answered. A host
lost by its lease is noted; one still silent a lease later, and that does not answer
a ping, is killed so that Ray restarts it, and the calls it held fail and are asked
again of the new process (``cluster.waiting.on_a_live_host``). Its Runs were taken
over when it was lost. Not while the store is out: a host restarted then waits for
it in its constructor, answering nothing, and would be killed again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from actors.host_book import HostBook
from actors.wire import NAMESPACE
from runtime.errors import StoreUnavailable
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.supervisor")


class HungHosts(HostBook):
    events: deque[dict[str, Any]]
    _alive: Callable[[str, float], Awaitable[bool]]  # the Supervisor's: a lease, or an answer

    def _expect_pool(self, now: float) -> None:
        """A pool host not heard from yet is given a lease from the moment it is seen to
        exist: one that hangs before its first heartbeat is lost like any other (else a
        start that hashes to it would wait for ever)."""
        for i in range(self.spec.hosts):
            name = self.spec.host_name(i)
            if name not in self.kinds and exists(name):
                self._expect(name, "hosted", now)

    def _expect(self, name: str, kind: str, now: float) -> None:
        """A host not heard from yet gets a lease from ``now``: one still silent when it
        runs out is lost (a dedicated one that does not answer then is ended, as is one
        that hung after its heartbeats), one that comes up renews it by its heartbeat."""
        self.leases[name] = now + self.spec.lease_ttl_s
        self.kinds[name] = kind

    async def _restart_hung(self, now: float) -> None:
        """A host lost by its lease that stays silent a lease longer is hung (stopped, its
        loop blocked): Ray takes its process for alive, so a call sent to it (a start
        that hashes to it, a resume, a wait) would never be answered. Its Runs were taken
        over when it was lost; the process is killed and Ray restarts it (a dedicated
        host's next sweep starts it anew), and the calls it held fail and are asked again
        of the new process (``cluster.waiting.on_a_live_host``)."""
        due = [h for h, t in self._silent.items() if now - t >= self.spec.lease_ttl_s]
        if not due or not await self._store_answers():
            return  # a host restarted in an outage waits for the store in its constructor
        for host_id in due:
            del self._silent[host_id]
        answering = await asyncio.gather(*(self._alive(h, now) for h in due))
        for host_id, alive in zip(due, answering, strict=True):
            if alive:
                continue
            try:
                handle = ray.get_actor(host_id, namespace=NAMESPACE)
            except ValueError:  # gone already: a host of that name is a new one
                self.kinds.pop(host_id, None)
                continue
            log.warning("host %s is lost and still does not answer: restarting it", host_id)
            self.counts["hosts_restarted"] += 1
            self.events.append({"host": host_id, "why": "hung: restarted", "at": now_us()})
            with contextlib.suppress(Exception):  # dead meanwhile: nothing to restart
                ray.kill(handle, no_restart=False)

    async def _store_answers(self) -> bool:
        try:
            await self.store.list_runs("running", host=self.owner)
        except StoreUnavailable:
            return False
        return True


def exists(name: str) -> bool:
    """A named actor Ray knows (alive, or restarting)."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True
