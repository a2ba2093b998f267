"""A client that joins a running system takes the system's settings, not its own defaults.

A system runs with the spec it was started with: its Supervisor holds it (made with it,
and remade with it on every restart) and answers it (``Supervisor.system_spec``). A
client used to build its own spec from its arguments and the defaults, so a second
Python process, ``ratchet run`` or ``ratchet serve`` joining a system started with
raised limits refused what the system takes (a 300-character thread id, an import past
the default caps), and one joining a system with lowered limits sent what its hosts
refuse. ``joined`` asks the Supervisor once and returns the running spec; a setting the
client asked for that the system does not run with is a ConfigError naming it, never a
quiet divergence. With no Supervisor running, the client's spec is the one that starts
the system, and nothing is asked.

Two clients that start one system at the same moment both find no Supervisor; each asks
Ray to make it by name, and the system runs with the spec of the one made first. The
other (``actors.supervisor.supervisor_made``: it made none) asks that Supervisor once more
(``joined`` again) and adopts its spec, or is refused as any joining client is: it
kept its own, made hosts with it and routed its Runs by a pool size the system did not
have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors.wire import NAMESPACE, SystemSpec
from cluster.config import ClusterUnavailable
from runtime.errors import ConfigError
from runtime.limits import Limits

WHERE_REACHED = ("store_url", "redis_url")
"""Settings that say where a client reaches the store and the bus: its own, kept."""
ANSWER_S = 60.0
"""How long a joining client waits for the Supervisor to say its spec (one that is
still starting answers once it has opened the store)."""


def asked_options(spec_options: Mapping[str, Any], **given: Any) -> dict[str, Any]:
    """The settings a client asked for: its spec options, and each of ``given`` that is
    not None (``hosts``, ``executors``: None is "whatever the system has", the defaults
    when it starts). The store's and the bus's URLs are where this client reaches them
    (another host name, other credentials): its own, never compared."""
    return {**spec_options, **{k: v for k, v in given.items() if v is not None}}


async def joined(spec: SystemSpec, asked: Mapping[str, Any]) -> SystemSpec:
    """The spec of ``spec``'s system as it runs (with this client's store URL, the same
    store by its identity), or ``spec`` itself if it is not running; ConfigError if ``asked``
    holds a setting it does not run with."""
    running = await running_spec(spec.supervisor_name)
    if running is None:
        return spec
    return adopt(spec, running, asked)


async def running_spec(supervisor_name: str) -> SystemSpec | None:
    """The spec the named Supervisor runs with; None if there is none, or it is going
    (a system being shut down: the client starts it anew), or older than this method."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ANSWER_S
    while True:
        try:  # a GCS call: not on this loop (a server's)
            handle = await asyncio.to_thread(ray.get_actor, supervisor_name, namespace=NAMESPACE)
        except ValueError:
            return None
        try:
            left = max(deadline - loop.time(), 0.1)
            running: object = await asyncio.wait_for(handle.system_spec.remote(), left)
            return running if isinstance(running, SystemSpec) else None
        except (AttributeError, ActorDiedError):
            return None  # older than this method, or gone for good: none to join
        except RayActorError:  # restarting, or unreachable for a moment: it runs
            if loop.time() < deadline:
                await asyncio.sleep(0.2)
                continue
        except TimeoutError:
            pass
        raise ClusterUnavailable(
            f"the Supervisor {supervisor_name} did not say its settings in {ANSWER_S:.0f} s"
        )


def adopt(spec: SystemSpec, running: SystemSpec, asked: Mapping[str, Any]) -> SystemSpec:
    """``running`` for a client that built ``spec`` from ``asked``: ConfigError naming each
    asked setting the system does not run with."""
    conflicts = tuple(
        _difference(option, value, getattr(running, option))
        for option, value in asked.items()
        if option not in WHERE_REACHED and value != getattr(running, option)
    )
    if conflicts:
        raise ConfigError(spec.name, conflicts)
    bus = spec.redis_url if spec.redis_url is not None else running.redis_url
    return replace(running, store_url=spec.store_url, redis_url=bus)


def _difference(option: str, asked: Any, running: Any) -> str:
    if isinstance(asked, Limits) and isinstance(running, Limits):
        pairs = ((f.name, getattr(running, f.name), getattr(asked, f.name)) for f in fields(Limits))
        return "; ".join(f"limits.{n}: running {r!r}, asked {a!r}" for n, r, a in pairs if r != a)
    return f"{option}: running {running!r:.200}, asked {asked!r:.200}"
