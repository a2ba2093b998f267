"""Warm spare worker processes, so that a restarted actor starts in milliseconds.

Ray restarts a crashed actor (``max_restarts``) in a worker process of its job. If
none is idle, it starts one: Python, Ray, then the actor's own imports (SQLAlchemy's
asyncio extension and a driver): 0.4 to 0.9 s on a 2-core machine, most of a host's
recovery time. Ray gives an actor an idle worker of the same job that has never run
anything, so one such worker kept ready per node (a *spare*) takes all of that off:
measured, a restart's kill → ``__init__`` drops from ~0.3 s to ~15 ms.

- ``warm_imports`` is the job's ``worker_process_setup_hook`` when Ratchet starts
  Ray itself: every worker imports what a RunHost, ToolExecutor and store need
  before it is handed an actor, so a spare is warm, not only started.
- ``request_spare`` asks the local raylet for one more such worker, kept alive an
  hour even while idle. ``Ratchet.connect`` asks for the first once the system's
  actors are up (``first_spare``: one starting meanwhile would take it); an actor
  that took a spare, or that Ray restarted (it took one or found none), asks for
  the next (``needs_successor``, then ``replace_spare``). So a node keeps about one
  spare, and an actor started cold for want of one asks nothing more.

Ray has no public call for this; the raylet's ``PrestartWorkers`` RPC (Ray ≥ 2.40)
is what its own libraries use. It is best effort: if the call fails (another Ray,
an unreachable raylet) it is logged once and restarts take the cold path.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import ray

log = logging.getLogger("ratchet.spare")
KEEP_ALIVE_S = 3600
"""An idle spare outlives Ray's idle-worker reaper this long (then Ray may reclaim it;
the next restart is cold and asks for a new one)."""
WARM_MODULES = (
    "actors.run_host",
    "actors.tool_executor",
    "actors.store_actor",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.dialects.postgresql.asyncpg",
    "sqlalchemy.dialects.sqlite.aiosqlite",
    "asyncpg",
    "aiosqlite",
    "redis.asyncio",
)
SETUP_HOOK = f"{__name__}.warm_imports"
IDLE_SPARE_S = 0.1
"""A worker idle this long between its imports and its actor was a spare: one started
on demand is handed its actor 2-7 ms after its imports (measured)."""
_failed = False
_warmed_at: float | None = None


def warm_imports() -> None:
    """Import what Ratchet's actors need (Ray's ``worker_process_setup_hook``).

    A module that is not installed is skipped: a hook that raised would fail every
    worker of the job.
    """
    global _warmed_at
    for name in WARM_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _warmed_at = time.monotonic()


def request_spare() -> bool:
    """Ask this node's raylet to start one idle worker for this job (best effort)."""
    global _failed
    if _failed:
        return False
    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        worker = ray._private.worker.global_worker
        node = worker.node
        channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON,
            job_id=worker.current_job_id.binary(),
            keep_alive_duration_secs=KEEP_ALIVE_S,
            num_workers=1,
        )
        # the same runtime env as the job's actors, or Ray would not hand them the spare
        request.runtime_env_info.CopyFrom(worker.core_worker.get_job_config().runtime_env_info)
        try:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
                request, timeout=5
            )
        finally:
            channel.close()
        return True
    except Exception as exc:  # an internal RPC: any failure means no spare, nothing more
        _failed = True
        log.warning("no warm spare worker (restarts take the cold path): %s", exc)
        return False


def restarted() -> bool:
    """Is this actor a restart by Ray (``max_restarts``) of one that crashed?"""
    with warnings.catch_warnings():  # Ray's own property trips its own deprecation warning
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def took_spare() -> bool:
    """Was this process a spare, idle and warm before its actor came to it?"""
    return _warmed_at is not None and time.monotonic() - _warmed_at > IDLE_SPARE_S


def needs_successor() -> bool:
    """Ask at the top of an actor's ``__init__``: should it ask for the next spare?"""
    return took_spare() or restarted()


async def replace_spare() -> None:
    """A restarted actor took a spare (or found none): ask for the next one."""
    await asyncio.to_thread(request_spare)


async def first_spare(actors: Sequence[Any], timeout_s: float = 60.0) -> None:
    """The first spare of this node, once ``actors`` are up (else one that is still
    waiting for a process would be handed the spare, and ask for no successor)."""
    try:
        ready = (actor.__ray_ready__.remote() for actor in actors)
        await asyncio.wait_for(asyncio.gather(*ready), timeout_s)
    except Exception as exc:  # not up (a resource no node has): no spare, nothing more
        log.info("no first spare worker: the system's actors are not up (%s)", exc)
        return
    await replace_spare()


def replace_spare_soon() -> None:
    """``replace_spare`` for a synchronous ``__init__``, which must not wait on the raylet."""
    threading.Thread(target=request_spare, name="ratchet-spare", daemon=True).start()


__all__ = [
    "KEEP_ALIVE_S",
    "SETUP_HOOK",
    "first_spare",
    "needs_successor",
    "replace_spare",
    "replace_spare_soon",
    "request_spare",
    "restarted",
    "took_spare",
    "warm_imports",
]
