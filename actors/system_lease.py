"""Which Ray cluster serves a system: two clusters alive on one store must not both.

A system's name comes from the store its URL names (``cluster.config.system_name``:
never the credentials or options, ``storage.url.store_identity``), so that a
cluster started again after the whole cluster was lost takes up the Runs the old one
left: its hosts bear the old hosts' names and find Runs owned under them, which they
take as a dead incarnation's (``actors.reconcile``, the Supervisor's take-overs). Two
clusters alive at once on one store — two ``ratchet serve`` without ``--address``, each
starting a Ray of its own — would each take the other's Runs so, over and over, running
their tools on both sides, until the Runs were dead-lettered.

So a cluster holds its system's lease in the store (``CommitStore.hold_lease``, timed
by the store's clock), under a token every process of the cluster shares (kept in Ray's
KV): ``Ratchet.connect`` takes it before it starts the system's actors, waiting for a
dead cluster's lease to run out and refusing with ``SystemInUse`` if its holder renews
it; the Supervisor renews it every ``RENEW_S``; and a host or the Supervisor takes over
a Run not driven by its own cluster only while its cluster holds it. A cluster that
lost the lease (its store out longer than ``LEASE_TTL_S`` while another connected)
takes over nothing more and logs why; the other takes its Runs, fencing its drives.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import ray
from ray.experimental import internal_kv

from actors.wire import NAMESPACE
from runtime.errors import RatchetError, StoreLost, StoreUnavailable, SystemInUse
from runtime.ports import CommitStore

log = logging.getLogger("ratchet.system_lease")

LEASE_TTL_S = 15.0
"""How long a cluster's hold outlives its last renewal (a dead cluster's, the wait)."""
RENEW_S = 3.0
"""How often the Supervisor renews it: several times within ``LEASE_TTL_S``."""
_POLL_S = 0.5
_TOKEN_KEY = "cluster-token"


_TOKENS: dict[str, str] = {}
"""GCS address → the token read there: each process asks the GCS once per cluster (a
blocking call, which a slow GCS would make the event loop wait for)."""


def cluster_token() -> str:
    """This Ray cluster's token, the same in each of its processes (made by the first)."""
    gcs = ray.get_runtime_context().gcs_address
    if gcs not in _TOKENS:
        token = secrets.token_hex(8)
        internal_kv._internal_kv_put(_TOKEN_KEY, token, overwrite=False, namespace=NAMESPACE)
        held = internal_kv._internal_kv_get(_TOKEN_KEY, namespace=NAMESPACE)
        _TOKENS[gcs] = held.decode() if held is not None else token
    return _TOKENS[gcs]


def lease_name(system: str) -> str:
    return f"system:{system}"


async def hold_system(store: CommitStore, system: str) -> bool:
    """Take or renew the system's lease for this cluster: whether it holds it now."""
    token = cluster_token()
    lease = await store.hold_lease(lease_name(system), token, LEASE_TTL_S)
    return lease.holder == token


async def claim_system(store: CommitStore, system: str) -> None:
    """Hold the system's lease before its actors start, or SystemInUse.

    A lease held by another cluster is waited on until it runs out (its cluster died);
    seen renewed, its holder is alive: SystemInUse at once."""
    token = cluster_token()
    deadline = time.monotonic() + LEASE_TTL_S + 5.0
    left: float | None = None
    while True:
        lease = await store.hold_lease(lease_name(system), token, LEASE_TTL_S)
        if lease.holder == token:
            return
        if (left is not None and lease.expires_in_s > left + _POLL_S) or (
            time.monotonic() > deadline
        ):
            raise SystemInUse(system, lease.holder)
        if left is None:
            log.warning(
                "system %s is held by another Ray cluster (%s) for %.0f s more: waiting to "
                "see whether it renews its lease (it is alive) or not (it died)",
                system,
                lease.holder,
                lease.expires_in_s,
            )
        left = lease.expires_in_s
        await asyncio.sleep(min(_POLL_S, max(lease.expires_in_s, 0.01)))


async def release_system(store: CommitStore, system: str) -> None:
    """Give the lease up (the system's actors were shut down): best effort, as it runs
    out by itself."""
    try:
        await store.drop_lease(lease_name(system), cluster_token())
    except RatchetError as exc:
        log.warning("could not release the lease of system %s: %s", system, exc)


class LeaseKeeper:
    """The Supervisor's renewals, and what it reports of them."""

    def __init__(self, store: CommitStore, system: str) -> None:
        self.store = store
        self.system = system
        self.held = True
        """As last renewed (``Ratchet.connect`` took it before the Supervisor started)."""
        self.given_up = False
        """Given up by its cluster (``give_up``): not taken again until it is claimed anew
        (``keep``)."""
        self.checks = 0
        """Renewals due, given up or not (the report's: a test sees one came and went)."""
        self._renewed = -RENEW_S
        self._one_at_a_time = asyncio.Lock()

    async def renew(self, now: float) -> None:
        if now - self._renewed >= RENEW_S:
            await self.serves(now)

    async def serves(self, now: float | None = None) -> bool:
        """Renew it now: whether this cluster holds it (as last known, if the store did
        not answer). Asked before each take-over too: one learnt only at the next renewal
        would let a cluster that just lost the lease take a Run up to ``RENEW_S`` late."""
        async with self._one_at_a_time:
            self.checks += 1
            self._renewed = time.monotonic() if now is None else now  # a failure too
            if self.given_up:
                return False
            held = await self._held_now()
            if held and self.given_up:  # given up while this renewal was on its way
                await release_system(self.store, self.system)
                self.held = held = False
            return held

    async def give_up(self) -> None:
        """Renew it no more: the cluster is dropping it (``Ratchet.close``/``shutdown``).
        Set at once; then a renewal on its way is waited for (as long as the caller
        waits), and one that lands after the cluster dropped the lease drops what it took:
        a renewal takes a free lease, and the next cluster would wait ``LEASE_TTL_S``."""
        self.given_up, self.held = True, False
        async with self._one_at_a_time:
            pass

    def keep(self) -> None:
        """Renew it again: a client of this cluster claimed it anew (``Ratchet.connect``
        after a ``close`` in the same process); renewed at the next tick. Set at once, as
        ``give_up`` is: of the two, the one asked last holds."""
        if self.given_up:
            self.given_up, self._renewed = False, -RENEW_S

    async def _held_now(self) -> bool:
        try:
            held = await hold_system(self.store, self.system)
        except StoreUnavailable as exc:  # out for now: as it was, till the store answers
            log.warning("could not renew the lease of system %s: %s", self.system, exc)
            return self.held
        except StoreLost:  # the store's own: its caller says so (the Supervisor's report)
            self.held = False
            raise
        except RatchetError as exc:  # a lease that does not read (edited by hand): not ours
            log.error("the lease of system %s does not read: %s", self.system, exc)
            held = False
        if held != self.held and not self.given_up:  # a give-up is the cluster's own
            if held:
                log.warning("this cluster holds the lease of system %s again", self.system)
            else:
                log.error(
                    "system %s is served by another Ray cluster on the same store: this "
                    "cluster takes over no Run from now on",
                    self.system,
                )
        self.held = held
        return held
