"""Letting a system go: its lease given up as its last client closes or it is shut down,
and its actors killed (``cluster.client.Ratchet.close`` and ``shutdown``).

The lease is dropped only once the Supervisor renews it no more. Dropped while it still
did, its next renewal took the free lease again, and the next cluster on the store
waited ``LEASE_TTL_S`` for a lease nobody held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import RayError

from actors.system_lease import release_system
from actors.wire import NAMESPACE, SystemSpec
from runtime.ports import CommitStore

log = logging.getLogger("ratchet.client")
GIVE_UP_S = 5.0
"""How long a close or shutdown waits for the Supervisor to stop renewing the lease, and
then for the store to drop it."""


async def give_up_lease(
    spec: SystemSpec,
    db: CommitStore,
    *,
    kill: bool = False,
    closing: bool = False,
    reopened: Callable[[], bool] = lambda: False,
) -> None:
    """Drop the system's lease once the Supervisor renews it no more. A Supervisor that
    does not answer in time (hung, gone) is not waited for: the drop is best effort
    anyway. ``closing``: only if the Supervisor finds the system idle, and no client of
    this process ``reopened`` it meanwhile (``close``). ``kill``: the system's actors but
    the store's go first (``shutdown``)."""
    handle, given = None, not closing
    # none, dead, hung, failing (RayError), or of an older Ratchet without the method
    # or its argument (AttributeError, TypeError)
    try:
        handle = ray.get_actor(spec.supervisor_name, namespace=NAMESPACE)
        async with asyncio.timeout(GIVE_UP_S):
            asking: Any = handle.give_up_lease  # an older one takes no argument
            asked: Any = asking.remote(when_idle=True) if closing else asking.remote()
            given = bool(await asked)
    except (ValueError, RayError, TimeoutError, AttributeError, TypeError) as exc:
        if closing:
            log.warning(
                "the Supervisor of system %s gave no word within %g s on whether the system "
                "is idle (%s): its lease is kept, and runs out once this Ray ends",
                spec.name,
                GIVE_UP_S,
                type(exc).__name__,
            )
    if closing and not given:
        return  # Runs driven here (or no word): the lease stays, renewed
    if closing and reopened() and handle is not None:
        # a client of this process connected meanwhile (its claim renewed the lease, its
        # word to keep it may have come first): the lease stays, renewed
        with contextlib.suppress(AttributeError):
            handle.keep_lease.remote()
        return
    if kill:
        kill_system(spec, but_store=True)
    try:  # bounded as the rest of a close: a hung store must not hold the process
        async with asyncio.timeout(GIVE_UP_S):
            await release_system(db, spec.name)
    except TimeoutError:
        log.warning(
            "the store did not answer the release of system %s's lease within %g s: it runs "
            "out by itself",
            spec.name,
            GIVE_UP_S,
        )


def kill_system(spec: SystemSpec, *, but_store: bool) -> None:
    """Kill the system's actors: the Supervisor first, which makes hosts, then every other
    one listed after it went (a host made meanwhile, a dedicated one started by another
    client, is killed too)."""
    kill_named([spec.supervisor_name])
    prefix, store = f"{spec.name}:", spec.store_name
    for _ in range(2):  # once more for an actor made as the first pass ran
        kill_named(
            entry["name"]
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == NAMESPACE
            and entry["name"].startswith(prefix)
            and not (but_store and entry["name"] == store)
        )


def kill_named(names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(ValueError):  # gone already
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
