"""Warm spare workers: a restarted RunHost starts in a process that was ready for it.

Spares are found the way Ray shows them: idle worker processes (``ray::IDLE``) of
this job (or of none yet) on this node (each imported ``actors.preload`` as it started).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import ray

from actors import spare

from .conftest import wait_for

pytestmark = pytest.mark.ray
AGENT = "cluster.demo_agent:agent"


def idle_spares() -> set[int]:
    """Pids of the idle workers this job's actors can be given on this machine: its
    own, and those Ray prestarted for no job yet."""
    ours = {f"RAY_JOB_ID={ray.get_runtime_context().get_job_id()}".encode(), b"RAY_JOB_ID=ffffffff"}
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"ray::IDLE"):
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if ours.intersection(environ):
            pids.add(int(proc.name))
    return pids


async def _has_spare() -> bool:
    return bool(idle_spares())


async def test_a_restarted_host_lands_on_a_spare_and_asks_for_the_next(make_system):
    client = await make_system()
    await client.run(AGENT, "order 1", host=0)  # the system's actors are all up
    if not idle_spares():  # the session's spare may have gone to another test's actor
        assert spare.request_spare()
    await wait_for(_has_spare, what="a spare worker")
    before = await client.hosts[0].info.remote()
    spares = idle_spares()
    killed_at = time.time()
    ray.kill(client.hosts[0], no_restart=False)

    async def restarted() -> bool:
        try:
            return (await client.hosts[0].info.remote())["pid"] != before["pid"]
        except ray.exceptions.RayActorError:
            return False

    await wait_for(restarted, what="the host's restart")
    after = await client.hosts[0].info.remote()
    # a warm process, idle before the kill: the spare seen, or another idle worker that
    # appeared between the look and the kill (Ray takes whichever idle worker it likes)
    import psutil  # vendored by Ray (ray/thirdparty_files): importable once ray is

    started = psutil.Process(after["pid"]).create_time()
    assert after["pid"] in spares or started < killed_at, "the restart started cold"
    # the restarted host asks for the spare that replaces the one it took
    await wait_for(_has_spare, what="the next spare")
    assert after["pid"] not in idle_spares()
    assert (await client.run(AGENT, "order 2", host=0)).run_state.kind == "ended"


def test_a_failed_request_disables_spares_quietly(monkeypatch, caplog):
    """An internal RPC that fails (another Ray version) costs one warning, then nothing."""
    monkeypatch.setattr(spare, "_failed", False)
    monkeypatch.setattr(ray._private.worker.global_worker, "node", None)
    with caplog.at_level(logging.WARNING, logger="ratchet.spare"):
        assert spare.request_spare() is False
        assert spare.request_spare() is False
    assert len([r for r in caplog.records if "no warm spare" in r.message]) == 1


def test_workers_are_preloaded(make_system):
    """Every worker of the instance imported actors.preload (Ray's preload_python_modules)."""

    @ray.remote(num_cpus=0)
    def preloaded() -> bool:
        return "actors.preload" in sys.modules and "sqlalchemy.ext.asyncio" in sys.modules

    assert ray.get(preloaded.remote())
