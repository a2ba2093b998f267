"""Run by test_node_loss in its own process: a two-node Ray cluster on one machine.

Every Run is placed on the RunHost of the worker node; the worker node is then
removed. That host cannot be restarted (it needs the node's resource), so its
lease expires, the Supervisor settles its Runs failed/execution_lost and
re-places them on the head node's host. Prints one JSON line with the findings.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster

from cluster.client import Ratchet
from cluster.demo_agent import EffectLedger
from tests.ray.checks import check_log, went_through_loss

RUNS = 6


async def main(workdir: str) -> dict[str, object]:
    os.environ["RATCHET_LEDGER"] = f"{workdir}/effects.db"
    ledger = EffectLedger(os.environ["RATCHET_LEDGER"])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"head": 10}, "include_dashboard": False},
    )
    worker = cluster.add_node(num_cpus=2, resources={"node2": 10})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ratchet", log_to_driver=False)
    try:
        return await scenario(cluster, worker, ledger, workdir)
    finally:
        ray.shutdown()
        cluster.shutdown()


async def scenario(cluster, worker, ledger, workdir) -> dict[str, object]:
    client = await Ratchet.connect(
        store_url=f"sqlite:///{workdir}/store.db",
        hosts=2,
        host_options=({"resources": {"head": 1}}, {"resources": {"node2": 1}}),
        core_options={"resources": {"head": 1}},
        lease_ttl_s=2.0,
        heartbeat_s=0.25,
    )
    doomed = await client.hosts[1].info.remote()
    survivor = await client.hosts[0].info.remote()
    handles = [
        await client.start("tests.ray.agents:napping_agent", f"nap {i}", host=1)
        for i in range(RUNS)
    ]
    prefixes = [f"tool-batch:{h.run_id}:" for h in handles]
    deadline = time.monotonic() + 30
    while not all(ledger.rows(p) for p in prefixes):
        assert time.monotonic() < deadline, "naps did not start"
        await asyncio.sleep(0.05)
    removed_at = time.monotonic()
    cluster.remove_node(worker)
    summaries = await client.wait_all(handles, timeout_s=120)
    resumed_after = time.monotonic() - removed_at
    reports = [await check_log(client.store, h.thread_id) for h in handles]
    owners = [(await h.frontier()).owner or "" for h in handles]
    supervisor = await client.supervisor_report()
    return {
        "doomed_node": doomed["node"],
        "worker_node": worker.node_id,
        "survivor_node": survivor["node"],
        "causes": sorted({s.cause for s in summaries}),
        "through_loss": [went_through_loss(r) for r in reports],
        "owners": owners,
        "survivor_host": client.spec.host_name(0),
        "hosts_lost": supervisor["counts"].get("hosts_lost", 0),
        "finished_after_s": round(resumed_after, 2),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
