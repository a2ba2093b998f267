"""Ray benchmark: host kill → first commit of the resumed Run; memory per hosted Run.

Kill to resume: Runs nap inside a replay_safe tool on RunHost 0; the host is
killed (``ray.kill``, Ray restarts it: the fast path); for every interrupted Run
we take the committed status change back to ``running`` — the first commit of
the resumed Run — and subtract the kill's wall-clock time. Medians over kills.

Memory: the RSS of one RunHost process with N Runs in flight (all napping in
their tool), minus its RSS idle, divided by N.

    python -m benchmarks.ray_recovery [--store sqlite|postgres] --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from cluster.client import Ratchet, RunHandle
from cluster.report import EXECUTION_LOST
from runtime.agent import Agent
from runtime.models import ModelResponse, ScriptedModel, call
from runtime.tools import tool

NAP_S = 3.0


@tool(recovery=("replay_safe",))
async def nap(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "rested"


agent = Agent(
    name="napper",
    model=ScriptedModel(
        (
            ModelResponse(text="nap", tool_calls=(call("nap", "c1", seconds=NAP_S),)),
            ModelResponse(text="rested"),
        )
    ),
    tools=(nap,),
)
AGENT_REF = "benchmarks.ray_recovery:agent"
sleeper = Agent(
    name="sleeper",
    model=ScriptedModel(
        (
            ModelResponse(text="nap", tool_calls=(call("nap", "c1", seconds=120.0),)),
            ModelResponse(text="rested"),
        )
    ),
    tools=(nap,),
)
SLEEPER_REF = "benchmarks.ray_recovery:sleeper"


async def _all_executing(handles: list[RunHandle], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        frontiers = [await h.frontier() for h in handles]
        if all(f.batch and f.batch.calls[0].phase.kind == "executing" for f in frontiers):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("runs did not reach their tool")
        await asyncio.sleep(0.05)


async def _resumed_at_us(client: Ratchet, thread: str) -> int | None:
    """``since`` of the first ``running`` status after execution_lost."""
    lost = False
    for record in await client.store.read(thread):  # type: ignore[arg-type]
        status = record.commit.status
        if status is None:
            continue
        if status.reason == EXECUTION_LOST:
            lost = True
        elif lost and status.state == "running":
            return status.since
    return None


async def kill_to_resume(
    client: Ratchet, runs: int, kills: int
) -> tuple[list[float], dict[str, list[float]]]:
    """Kill-to-resume delays (s), and where each restart spent its time: from the kill
    to the new incarnation's ``__init__`` (Ray's restart, the process's imports), to the
    end of ``__init__`` (opening the store), to the end of reclaiming the lost Runs."""
    delays: list[float] = []
    phases: dict[str, list[float]] = {"init": [], "ready": [], "reclaimed": []}
    for _ in range(kills):
        handles = [await client.start(AGENT_REF, "nap", host=0) for _ in range(runs)]
        await _all_executing(handles)
        killed_us = time.time_ns() // 1000
        ray.kill(client.hosts[0], no_restart=False)
        await client.wait_all(handles, timeout_s=120)
        for h in handles:
            resumed = await _resumed_at_us(client, h.thread_id)
            if resumed is not None:
                delays.append((resumed - killed_us) / 1e6)
        startup = (await client.hosts[0].info.remote())["startup"]
        for phase, marks in phases.items():
            if phase in startup:
                marks.append(startup[phase] - killed_us / 1e6)
    return delays, phases


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def memory_per_run(client: Ratchet, runs: int) -> dict[str, float]:
    host = client.hosts[1]
    info = await host.info.remote()
    idle_kb = _rss_kb(info["pid"])
    gate = asyncio.Semaphore(50)

    async def start(i: int) -> RunHandle:
        async with gate:
            return await client.start(SLEEPER_REF, "nap", host=1, thread_id=f"mem-{i}")

    handles = await asyncio.gather(*(start(i) for i in range(runs)))
    # in their tool, all of them (the check must not count Runs whose nap is over)
    await _all_executing(handles, timeout_s=120)
    busy_kb = _rss_kb(info["pid"])
    for h in handles:
        await h.cancel()
    return {
        "runs": runs,
        "host_rss_idle_mb": round(idle_kb / 1024, 1),
        "host_rss_busy_mb": round(busy_kb / 1024, 1),
        "kb_per_run": round((busy_kb - idle_kb) / runs, 1),
    }


async def main(runs: int, kills: int, memory_runs: int, store: str) -> dict[str, Any]:
    # imported here: hosts import this module for its agents, and must not pay for this
    from benchmarks.stores import prepare_store

    prepared = await prepare_store(store, Path(tempfile.mkdtemp(prefix="ratchet-bench-")))
    try:
        client = await Ratchet.connect(store_url=prepared.url, num_cpus=4, quiet=True)
        delays, phases = await kill_to_resume(client, runs, kills)
        memory = await memory_per_run(client, memory_runs) if memory_runs else None
        await client.shutdown()
    finally:
        await prepared.cleanup()
    return {
        "store": prepared.kind,
        "kill_to_resume_s": {
            "median": statistics.median(delays),
            "p90": sorted(delays)[int(0.9 * (len(delays) - 1))],
            "samples": len(delays),
            "kills": kills,
            "runs_per_kill": runs,
            "host_restart_s": {  # medians, from the kill
                phase: round(statistics.median(m), 3) for phase, m in phases.items() if m
            },
        },
        "memory": memory,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="Runs in flight per kill")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--memory-runs", type=int, default=500, help="0: no memory check")
    parser.add_argument("--store", default="sqlite", help="sqlite | postgres (fresh) or a URL")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.runs < 1 or args.kills < 1 or args.memory_runs < 0:
        parser.error("--runs and --kills must be at least 1, --memory-runs at least 0")
    result = asyncio.run(main(args.runs, args.kills, args.memory_runs, args.store))
    print(json.dumps(result, indent=None if args.json else 2))
