"""Configuration from arguments or the environment, and connecting to Ray.

RAY_ADDRESS          an existing Ray cluster ("auto", "ray://…", "host:port");
                     unset: start a local Ray instance (nothing to set up)
RATCHET_STORE_URL    the CommitStore (default: a SQLite file under ./ratchet-data)
RATCHET_REDIS_URL    Redis for the live bus, when there is one
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import ray

from actors.wire import NAMESPACE, stable_hash
from storage.url import (
    UnsupportedStoreUrl,
    check_store_url,
    default_store_url,
    redact,
    scheme_of,
    store_identity,
)

LOCAL_SYSTEM_CONFIG = {
    "timeout_ms_task_wait_for_death_info": 100,
    "kill_worker_timeout_milliseconds": 1000,
    "preload_python_modules": ["actors.preload"],
}
"""Ray settings for a local instance this process starts.

``timeout_ms_task_wait_for_death_info``: when a call to an actor fails because its
process died, Ray holds the error for up to this long (default 1000 ms) waiting for
the GCS to say why: every client retrying a start on a killed host, and every host
asking a killed executor, waited a second more, though Ray had the actor restarted
in well under half that. The error is a RayActorError either way, only possibly less
precise.

``kill_worker_timeout_milliseconds``: how long a raylet waits for a worker it was told
to kill to exit before it sends SIGKILL (default 5000 ms). A hung RunHost or
ToolExecutor (a stopped process, a blocked event loop) never exits by itself, so the
Supervisor's kill of one took five seconds more to free its Runs' restart; nothing of
Ratchet's relies on a worker's graceful exit (every transition is committed first).

``preload_python_modules``: every worker imports what Ratchet's actors need before
it takes work (``actors.preload``), so a warm spare (``actors.spare``) is imported as
well as started, and a restarted RunHost's ``__init__`` opens the store at once.

On a cluster of your own, start the head with ``ray start --head --system-config=``
and this JSON object."""


class ClusterUnavailable(RuntimeError):
    """Ray could not be started or reached."""


class SystemShutDown(ClusterUnavailable):
    """The system was shut down (``Ratchet.shutdown``, by this client or another): none of
    its actors answers again; a client connected anew starts them again."""


def store_url_from(store_url: str | None) -> str:
    """The store URL to use, with a relative SQLite path made absolute: every Ray worker
    must open the same file, whatever its working directory. Its folder is made by what
    writes the store (``storage.sql_sqlite``), not here: a command that only reads makes
    nothing where no store is. One no backend can read is refused here, before Ray
    starts (``UnsupportedStoreUrl``, not a StoreUnavailable to retry)."""
    url = store_url or default_store_url()
    check_store_url(url)
    if scheme_of(url) != "sqlite":
        return url
    head, sep, path = url.partition(":///")
    if not sep or path.startswith("/") or path in ("", ":memory:"):
        return url
    try:
        resolved = Path(path).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop on the way (RuntimeError)
        raise UnsupportedStoreUrl(url, f"its path cannot be resolved: {exc}") from None
    return f"{head}:///{resolved}"


def redis_url_from(redis_url: str | None) -> str | None:
    """The live bus's URL, if any; one redis-py cannot read is refused here, before any
    actor is given it (``UnsupportedStoreUrl``)."""
    url = redis_url or os.environ.get("RATCHET_REDIS_URL") or None
    if url is not None:
        from storage.redis_client import open_client

        open_client(url, what="Redis bus")  # made and dropped, never connected
    return url


def system_name(store_url: str) -> str:
    """One system per store: the actors of two stores on one cluster never mix, and every
    spelling of one store's URL (``storage.url.store_identity``) names the same system."""
    return f"ratchet-{stable_hash(store_identity(store_url)) % 16**8:08x}"


def check_store_reach(store_url: str) -> None:
    """A SQLite store is a file on this machine: refused (``UnsupportedStoreUrl``) on a
    Ray cluster with a node on another machine (``ray://`` to a remote cluster, a
    multi-node cluster), where each node's processes would open a file of their own at
    that path, splitting the system's Runs and leases between them. Asked of the nodes
    alive now: one that joins later is not seen (README, "The store")."""
    if scheme_of(store_url) != "sqlite":
        return
    listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    here: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    elsewhere = nodes_elsewhere(listed, here)
    if elsewhere:
        raise UnsupportedStoreUrl(
            store_url,
            f"a SQLite store is a file on this machine, and this Ray cluster has nodes "
            f"on {', '.join(elsewhere)}: use a postgresql:// or redis:// store",
        )


def nodes_elsewhere(nodes: list[dict[str, Any]], here: str) -> list[str]:
    """The addresses of alive nodes (``ray.nodes()``) that are not this machine's."""
    local = {here, "127.0.0.1", "localhost"}
    return sorted({n["NodeManagerAddress"] for n in nodes if n.get("Alive")} - local)


def connect_ray(address: str | None, *, num_cpus: int | None = None, quiet: bool = False) -> None:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local one."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    options: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False}
    if quiet:
        options.update(log_to_driver=False, logging_level=logging.ERROR)
    if address is None:
        options["_system_config"] = LOCAL_SYSTEM_CONFIG
        if num_cpus is not None:
            options["num_cpus"] = num_cpus
    if address is not None:
        _check_reachable(address)
    try:  # no address: a Ray of its own ("local"), never one found running on the machine
        # (Ray's default; joining one is ``--address auto``, as the README says)
        ray.init(address=address or "local", **options)
    except Exception as exc:
        where = address or "a local Ray instance"
        raise ClusterUnavailable(f"cannot connect to {where}: {exc}".splitlines()[0]) from exc


def owns_ray() -> bool:
    """Whether this process started the Ray it is connected to (which ends with it)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return ray.is_initialized() and bool(getattr(node, "head", False))


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast on a dead address (ray.init would retry for minutes)."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local" and friends: ray.init decides quickly itself
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterUnavailable(f"cannot reach the Ray cluster at {address}: {exc}") from exc


__all__ = [
    "LOCAL_SYSTEM_CONFIG",
    "ClusterUnavailable",
    "SystemShutDown",
    "check_store_reach",
    "connect_ray",
    "redact",
    "redis_url_from",
    "store_url_from",
    "system_name",
]
