"""Scale-out across nodes: W1 on a Ray cluster of N raylets on this machine.

    python -m benchmarks.nodes --nodes 3                     # PostgreSQL, a fresh database
    python -m benchmarks.nodes --nodes 3 --remove-node --json
    python -m benchmarks.nodes --nodes 2 --store sqlite --runs 20 --concurrency 5

A ``ray.cluster_utils.Cluster`` is started with a head and N-1 worker raylets (each
its own Ray node, all on this machine), and a Ratchet system is connected to it
with what ``SystemSpec`` already offers for placement: RunHost i gets a *soft*
node affinity to node i mod N (``host_options``), the ToolExecutors Ray's
``SPREAD`` strategy (``core_options``, which the Supervisor gets too: it lands on
any node). Soft, not a node's custom resource: a host pinned to a node could not be
restarted once the node is gone, and every Run hashed to it would wait for it; with
a soft affinity Ray restarts it on a surviving node, which is the recovery under
test.

Then W1 (``benchmarks.w1``: the same agent, ledger and warm-up) runs R Runs, at
most C at once. With ``--remove-node`` the worker node holding the most hosts and
executors is removed (``cluster.remove_node``: its raylet and every process on it
die) once a third of the Runs are done, and the load goes on. Every Run is then
read back through a new store connection and checked by ``benchmarks.verify``: no
lost commit, no ``never_replay`` effect twice, every call's effect in the ledger
as often as its attempts allow (exactly once without a removal). ``recovery_s``
is from the removal to the moment every Run in flight at the removal was at rest.

A Cluster is its own Ray instance: this runs in a process of its own, never
beside another ``ray.init`` (``run_nodes`` refuses to).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.wire import NAMESPACE
from benchmarks.stores import prepare_store
from benchmarks.verify import Verdict, quantile, verify
from benchmarks.w1 import WARMUP_RUNS, bounded, host_counts, run_durable, sharing
from benchmarks.w1_agent import W1, ledger_dir, new_ledger
from cluster.client import Ratchet
from cluster.config import LOCAL_SYSTEM_CONFIG
from runtime.patience import patiently
from storage.url import open_store, redact

REMOVE_AFTER = 1 / 3
"""The share of the timed Runs at rest when ``--remove-node`` removes a worker node."""
PLACEMENT_WAIT_S = 30.0
"""How long ``placement`` waits for each actor to answer where it runs."""
PLACEMENT_CPU = 0.001
"""What each host and executor asks for. Ray 2.60 places an actor that asks for no
resource at all on a node of its own choosing, whatever its soft affinity or ``SPREAD``
(measured: a soft affinity to the head held 1 time in 6); a token CPU makes both hold."""


@dataclass(frozen=True)
class NodesConfig:
    nodes: int = 2
    store: str = "postgres"
    runs: int = 200
    concurrency: int = 50
    steps: int = 5
    tools: int = 2
    hosts_per_node: int = 1
    executors_per_node: int = 1
    cpus_per_node: int = 2
    """Each raylet's ``num_cpus`` (Ratchet's actors ask for none: this sizes Ray's pools)."""
    remove_node: bool = False
    address: str | None = None
    """Join this running cluster (``ray.init(address)``) instead of starting one here."""
    timeout_s: float = 900.0

    @property
    def hosts(self) -> int:
        return self.nodes * self.hosts_per_node

    @property
    def executors(self) -> int:
        return self.nodes * self.executors_per_node


# ---- the cluster and where the system's actors go ------------------------------------------


@dataclass
class Nodes:
    """The nodes a measurement spreads the system over; index 0 is the driver's (the head)."""

    ids: list[str]
    cluster: Any = None
    """The ``ray.cluster_utils.Cluster`` started here (None: a cluster joined)."""
    handles: list[Any] = field(default_factory=list)

    def remove(self, index: int) -> None:
        """Kill node ``index``'s raylet and every process on it (blocks until done)."""
        self.cluster.remove_node(self.handles[index])

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


def start_cluster(cfg: NodesConfig) -> Nodes:
    """A head and ``nodes - 1`` workers on this machine; this process joins the head."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": cfg.cpus_per_node, "include_dashboard": False,
            "_system_config": LOCAL_SYSTEM_CONFIG}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    handles: list[Any] = [cluster.head_node]
    handles += [cluster.add_node(num_cpus=cfg.cpus_per_node) for _ in range(cfg.nodes - 1)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False,
             logging_level=logging.ERROR)  # fmt: skip
    return Nodes([h.node_id for h in handles], cluster, handles)


def join_cluster(cfg: NodesConfig, address: str) -> Nodes:
    """The first ``nodes`` alive nodes of a running cluster, this driver's first."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             logging_level=logging.ERROR)  # fmt: skip
    own = ray.get_runtime_context().get_node_id()
    listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    alive = sorted((n["NodeID"] for n in listed if n["Alive"]), key=lambda n: n != own)
    if len(alive) < cfg.nodes:
        ray.shutdown()
        raise RuntimeError(
            f"the cluster at {address} has {len(alive)} alive nodes, not {cfg.nodes}"
        )
    return Nodes(alive[: cfg.nodes])


def placement_options(node_ids: Sequence[str], hosts: int) -> dict[str, Any]:
    """``Ratchet.connect`` options spreading the system over ``node_ids``: host i prefers
    node i mod N (soft: Ray restarts it elsewhere if that node is gone); executors go
    round the nodes (``SPREAD``). Each asks for ``PLACEMENT_CPU``."""

    def prefer(node: str) -> dict[str, Any]:
        strategy = NodeAffinitySchedulingStrategy(node, soft=True)
        return {"num_cpus": PLACEMENT_CPU, "scheduling_strategy": strategy}

    affinity = tuple(prefer(node_ids[i % len(node_ids)]) for i in range(hosts))
    spread = {"num_cpus": PLACEMENT_CPU, "scheduling_strategy": "SPREAD"}
    return {"host_options": affinity, "core_options": spread}


async def placement(client: Ratchet, node_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Which node (by index; head = 0) runs how many hosts and executors, once each
    answers (within ``PLACEMENT_WAIT_S``; one Ray is still restarting after a node's
    removal is waited for, not left out: on a busy machine a restart takes seconds)."""
    index = {node: str(i) for i, node in enumerate(node_ids)}
    counts: dict[str, Counter[str]] = {str(i): Counter() for i in range(len(node_ids))}
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT_S

    async def node_of(ask: Callable[[], Any], key: str) -> None:
        while True:
            try:
                answer = await asyncio.wait_for(ask(), 10)
                counts[index.get(answer["node"], answer["node"])][key] += 1
                return
            except Exception:  # gone, or restarting: asked again until the deadline
                if asyncio.get_running_loop().time() > deadline:
                    return
                await asyncio.sleep(0.5)

    def executor(i: int) -> Any:
        name = client.spec.executor_name("default", i)
        return ray.get_actor(name, namespace=NAMESPACE).where.remote()

    for host in client.hosts:
        await node_of(host.info.remote, "hosts")
    for i in range(client.spec.executors):
        await node_of(functools.partial(executor, i), "executors")
    return {n: {"hosts": c["hosts"], "executors": c["executors"]} for n, c in counts.items()}


def _doomed(where: dict[str, dict[str, int]]) -> int:
    """The worker node holding the most hosts and executors (the last, of equals)."""
    workers = [int(n) for n in where if n != "0"]
    return max(workers, key=lambda n: (sum(where[str(n)].values()), n))


# ---- the load ------------------------------------------------------------------------------


@dataclass
class Load:
    wall_s: float = 0.0
    threads: list[tuple[str, str]] = field(default_factory=list)
    warmup: list[tuple[str, str]] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    placement: dict[str, dict[str, int]] = field(default_factory=dict)
    """Hosts and executors per node (index; head = 0) as the timed part began."""
    removed_at: float | None = None
    removed: dict[str, Any] | None = None


async def drive(client: Ratchet, cfg: NodesConfig, ref: str, nodes: Nodes) -> Load:
    """Warm up, then the timed Runs; a worker node removed once a third of them are done."""
    stamp = uuid.uuid4().hex[:8]
    load = Load()
    load.warmup = [(f"w1-{stamp}-w{i:05d}", f"run-{stamp}-w{i:05d}") for i in range(WARMUP_RUNS)]
    load.threads = [(f"w1-{stamp}-r{i:05d}", f"run-{stamp}-r{i:05d}") for i in range(cfg.runs)]
    await bounded(WARMUP_RUNS, WARMUP_RUNS, lambda i: _launch(client, ref, load.warmup[i], load))
    removal = asyncio.Event()
    load.placement = await placement(client, nodes.ids)  # the warm-up made the executors
    if cfg.remove_node:
        doomed = _doomed(load.placement)
        load.removed = {"node": doomed, **load.placement[str(doomed)]}

    async def one(i: int) -> None:
        await _launch(client, ref, load.threads[i], load)
        if len(load.ended) - WARMUP_RUNS >= cfg.runs * REMOVE_AFTER:
            removal.set()

    async def remove() -> None:
        await removal.wait()
        load.removed_at = time.time()
        # in a thread: it blocks until the raylet is gone, and the load must go on
        await asyncio.to_thread(nodes.remove, load.removed["node"])  # type: ignore[index]

    remover = asyncio.create_task(remove()) if cfg.remove_node else None
    began = time.perf_counter()
    try:
        await asyncio.wait_for(bounded(cfg.runs, cfg.concurrency, one), cfg.timeout_s)
    finally:
        load.wall_s = time.perf_counter() - began
        if remover is not None and not remover.done():
            remover.cancel()
    if remover is not None:
        with contextlib.suppress(asyncio.CancelledError):
            await remover
    return load


async def _launch(client: Ratchet, ref: str, ids: tuple[str, str], load: Load) -> None:
    thread, run = ids
    load.started[run] = time.time()
    await run_durable(client, ref, thread, run, "hosted")
    load.ended[run] = time.time()


def recovery_s(load: Load) -> float | None:
    """Removal → every Run in flight at the removal at rest (None: no removal)."""
    at = load.removed_at
    if at is None:
        return None
    caught = [load.ended[r] for r, t in load.started.items() if t < at < load.ended.get(r, 0.0)]
    return round(max(caught, default=at) - at, 3)


# ---- the measurement -----------------------------------------------------------------------


async def run_nodes(cfg: NodesConfig, say: Any = None) -> dict[str, Any]:
    """Start the cluster, run W1 on it (removing a node if asked), verify, report."""
    if ray.is_initialized():
        raise RuntimeError("benchmarks.nodes starts a Ray cluster of its own: run it alone")
    if cfg.remove_node and (cfg.nodes < 2 or cfg.address):
        raise ValueError("--remove-node needs 2 nodes or more, of a cluster started here")
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-nodes-"))
    prepared = await prepare_store(cfg.store, tmp)
    tag = new_ledger()
    params = W1(cfg.steps, cfg.tools, ledger=tag)
    nodes: Nodes | None = None
    try:
        if cfg.address:
            say(f"joining the cluster at {cfg.address}")
            nodes = join_cluster(cfg, cfg.address)
        else:
            say(f"starting {cfg.nodes} raylet(s)")
            nodes = start_cluster(cfg)
        result = await _measure(cfg, prepared.url, params, nodes, say)
    finally:
        if nodes is not None:
            nodes.close()
        await prepared.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ledger_dir(tag), ignore_errors=True)
    result["store"] = prepared.kind
    return result


async def _measure(
    cfg: NodesConfig, url: str, params: W1, nodes: Nodes, say: Any
) -> dict[str, Any]:
    spread = placement_options(nodes.ids, cfg.hosts)
    client = await Ratchet.connect(
        store_url=url, hosts=cfg.hosts, executors=cfg.executors, quiet=True, **spread
    )
    try:
        say(f"W1: {cfg.runs} Runs, {cfg.concurrency} at once, on {cfg.nodes} node(s)")
        load = await drive(client, cfg, params.ref, nodes)
        where = await placement(client, nodes.ids)
        grouping = sharing(await host_counts(client))
        supervisor: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            supervisor = (await asyncio.wait_for(client.supervisor_report(), 10))["counts"]
    finally:
        await client.shutdown()
    say("reading every Run back")
    store = await patiently(lambda: open_store(url))
    try:
        kills = [load.removed_at] if load.removed_at is not None else []
        verdict = await verify(store, params, [*load.warmup, *load.threads], kills,
                               strict=not cfg.remove_node)  # fmt: skip
    finally:
        await store.close()
    return report(cfg, load, where, grouping, supervisor, verdict)


def report(
    cfg: NodesConfig,
    load: Load,
    where: dict[str, dict[str, int]],
    grouping: tuple[float | None, float | None],
    supervisor: dict[str, Any],
    verdict: Verdict,
) -> dict[str, Any]:
    measured = cfg.runs + WARMUP_RUNS
    result: dict[str, Any] = {
        "scenario": "nodes",
        "nodes": cfg.nodes,
        "runs": cfg.runs,
        "concurrency": cfg.concurrency,
        "hosts": cfg.hosts,
        "executors": cfg.executors,
        "ok": verdict.ok(measured) and (not cfg.remove_node or load.removed_at is not None),
        "wall_s": round(load.wall_s, 3),
        "runs_per_s": round(cfg.runs / load.wall_s, 1),
        "placement": load.placement,
        "checked_runs": measured,
        "natural_runs": verdict.natural_runs,
        "commits": verdict.commits,
        "lost_commits": verdict.lost_commits,
        "duplicate_never_replay": verdict.duplicate_never_replay,
        "exactly_once_calls": verdict.exactly_once_calls,
        "ledger_violations": verdict.ledger_violations,
        "waves_per_executor_call": grouping[0],
        "commits_per_group": grouping[1],
    }
    if cfg.remove_node:
        result["removed"] = load.removed
        result["placement_after"] = where
        result["recovery"] = {
            "recovery_s": recovery_s(load),
            "recovered_runs": verdict.recovered_runs,
            "median_recovery_ms": quantile(verdict.recoveries_ms, 50),
            "max_recovery_ms": round(max(verdict.recoveries_ms, default=0.0), 1),
            "median_settled_ms": quantile(verdict.settled_ms, 50),
            "replayed_calls": verdict.replayed_calls,
            "indeterminate_calls": verdict.indeterminate_calls,
            "supervisor": supervisor,
        }
    if verdict.problems:
        result["problems"] = verdict.problems
    return result


# ---- the command ---------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> tuple[NodesConfig, bool]:
    summary = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nodes", description=summary)
    parser.add_argument("--nodes", type=int, default=2, help="raylets: the head and N-1 workers")
    parser.add_argument("--store", default="postgres", help="postgres | sqlite (fresh) or a URL")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tools", type=int, default=2)
    parser.add_argument("--hosts-per-node", type=int, default=1)
    parser.add_argument("--executors-per-node", type=int, default=1)
    parser.add_argument("--remove-node", action="store_true",
                        help="remove a worker node once a third of the Runs are done")  # fmt: skip
    parser.add_argument("--address", help="join this Ray cluster (auto, host:port): no raylets")
    parser.add_argument("--json", action="store_true", help="one JSON line last on stdout")
    args = parser.parse_args(argv)
    counts = (args.nodes, args.runs, args.concurrency, args.steps, args.hosts_per_node,
              args.executors_per_node)  # fmt: skip
    if min(counts) < 1 or args.tools < 0:
        parser.error("counts must be at least 1 (--tools at least 0)")
    if args.remove_node and (args.nodes < 2 or args.address):
        parser.error("--remove-node needs 2 nodes or more, of a cluster started here")
    cfg = NodesConfig(
        nodes=args.nodes, store=args.store, runs=args.runs, concurrency=args.concurrency,
        steps=args.steps, tools=args.tools, hosts_per_node=args.hosts_per_node,
        executors_per_node=args.executors_per_node, remove_node=args.remove_node,
        address=args.address,
    )  # fmt: skip
    return cfg, args.json


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when every Run checked out, 1 otherwise."""
    cfg, as_json = parse(argv)
    shown = {**asdict(cfg), "store": redact(cfg.store)}
    print(", ".join(f"{k}={v}" for k, v in shown.items()), file=sys.stderr)
    result = asyncio.run(run_nodes(cfg))
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        print(json.dumps(result, indent=2, default=str))
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "Nodes",
    "NodesConfig",
    "join_cluster",
    "main",
    "placement",
    "placement_options",
    "recovery_s",
    "run_nodes",
    "start_cluster",
]
