"""Store leases held in one process: the in-memory and the no-op stores' own.

What a lease is for (a Ray cluster's hold on its system name: ``actors.system_lease``)
is told there; each durable store keeps them in its own database, by its own clock
(``storage.sql_lease``, the Redis store's ``LEASE_LUA``).
"""

from __future__ import annotations

import time

from runtime.ports import Lease

MAX_LEASE_AHEAD_S = 600.0
"""No holder sets a lease to run out further ahead than this (the system lease lasts
15 s): an expiry beyond it was edited by hand (a year 3000, NaN, text on SQLite) or
written before the clock stepped back, and it is no lease (taken as an expired one)."""


class LeaseTable:
    """name → (holder, expiry on this process's monotonic clock)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, float]] = {}

    def hold(self, name: str, holder: str, ttl_s: float) -> Lease:
        now = time.monotonic()
        current = self._held.get(name)
        if (
            current is None
            or current[0] == holder
            or not now < current[1] <= now + MAX_LEASE_AHEAD_S
        ):
            current = self._held[name] = (holder, now + ttl_s)
        return Lease(current[0], current[1] - now)

    def drop(self, name: str, holder: str) -> None:
        if name in self._held and self._held[name][0] == holder:
            del self._held[name]
