"""``benchmarks.nodes`` on two raylets: the system spreads over both, a worker node is
removed mid-load, and every Run still ends with nothing lost.

A ``ray.cluster_utils.Cluster`` is its own Ray instance, so the benchmark runs in a
child process (as ``tests/ray/test_node_loss.py`` does) and reports its JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.nodes import parse

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RUNS = 12


@pytest.mark.timeout(120)
def test_removing_a_worker_node_mid_load_loses_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RATCHET_LEDGER")}
    args = ["--nodes", "2", "--store", "sqlite", "--runs", str(RUNS), "--concurrency", "4"]
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.nodes", *args, "--remove-node", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])

    assert result["ok"] is True and result["nodes"] == 2, result
    assert result["natural_runs"] == result["checked_runs"] == RUNS + 4  # warm-up included
    assert result["lost_commits"] == result["duplicate_never_replay"] == 0
    assert result["ledger_violations"] == 0
    # one host per node, one executor per node: Ray kept to the placement asked for
    assert result["placement"] == {n: {"hosts": 1, "executors": 1} for n in ("0", "1")}
    assert result["removed"] == {"node": 1, "hosts": 1, "executors": 1}
    # after the removal, everything runs on the head again
    assert result["placement_after"]["0"] == {"hosts": 2, "executors": 2}
    assert result["recovery"]["recovery_s"] > 0


def test_removing_a_node_needs_a_worker_node() -> None:
    with pytest.raises(SystemExit):
        parse(["--nodes", "1", "--remove-node"])
    cfg, as_json = parse(["--nodes", "3", "--json"])
    assert (cfg.nodes, cfg.hosts, cfg.executors, cfg.store, as_json) == (3, 3, 3, "postgres", True)
