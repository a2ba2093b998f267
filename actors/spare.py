"""Warm spare worker processes, so that a restarted actor starts in milliseconds.

Ray restarts a crashed actor (``max_restarts``) in a worker process of its job. If
none is idle, it starts one: Python, Ray, then the actor's own imports (SQLAlchemy's
asyncio extension and a driver): 0.4 to 0.9 s on a 2-core machine, most of a host's
recovery time. Ray gives an actor an idle worker of the same job that has never run
anything, so one such worker kept ready per node (a *spare*) takes all of that off:
kill → the restarted RunHost's ``__init__`` drops from 0.40-0.46 s to 0.04-0.07 s
(``python -m benchmarks.ray_recovery``, 2 cores).

- ``actors.preload`` is in Ray's ``preload_python_modules`` when Ratchet starts Ray
  itself: every worker imports what a RunHost, ToolExecutor and store need before
  it takes work, so a spare is warm, not only started. (A job runtime env with a
  ``worker_process_setup_hook`` did the same, but made every worker start 0.3 s
  slower: the runtime env agent is asked for each.)
- ``request_spare`` asks the local raylet for one more such worker, kept alive an
  hour even while idle. An actor that Ray restarted (it took a spare, or found none)
  asks for the next (``replace_spare_if_restarted``): a node that has seen a crash keeps about
  one spare. There is none before the first crash, whose restart is cold (0.4-0.6 s
  to ``__init__`` here): asked for at startup, a spare was started while the
  system's first Runs ran and cut a short W1 benchmark's throughput by a third.
  (Another actor of the job created meanwhile may take the spare; the next
  restart is then cold, and asks again.)

Ray has no public call for this, so this uses the raylet's ``PrestartWorkers`` RPC
(Ray ≥ 2.40, internal). It is best effort: if the call fails (another Ray, an
unreachable raylet) it is logged once and restarts take the cold path.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import ray

log = logging.getLogger("ratchet.spare")
KEEP_ALIVE_S = 3600
"""An idle spare outlives Ray's idle-worker reaper this long (then Ray may reclaim it;
the next restart is cold and asks for a new one)."""
_failed = False


def request_spare() -> bool:
    """Ask this node's raylet to start one idle worker for this job (best effort)."""
    global _failed
    if _failed:
        return False
    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        # Ray's private API, untyped: what a raylet is asked, in its own words
        pb2: Any = node_manager_pb2
        common: Any = common_pb2
        grpc: Any = node_manager_pb2_grpc
        worker: Any = ray._private.worker.global_worker
        node = worker.node
        channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
        request = pb2.PrestartWorkersRequest(
            language=common.PYTHON,
            job_id=worker.current_job_id.binary(),
            keep_alive_duration_secs=KEEP_ALIVE_S,
            num_workers=1,
        )
        # the same runtime env as the job's actors, or Ray would not hand them the spare
        request.runtime_env_info.CopyFrom(worker.core_worker.get_job_config().runtime_env_info)
        try:
            grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=5)
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


def replace_spare_if_restarted(enabled: bool = True) -> None:
    """A restarted actor took a spare (or found none): ask for the next one, from a
    thread, so that the actor's ``__init__`` or recovery does not wait on the raylet."""
    if enabled and restarted():
        threading.Thread(target=request_spare, name="ratchet-spare", daemon=True).start()


__all__ = [
    "KEEP_ALIVE_S",
    "replace_spare_if_restarted",
    "request_spare",
    "restarted",
]
