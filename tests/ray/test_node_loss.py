"""Node loss with ray.cluster_utils.Cluster: Runs on a removed node resume on the other.

The cluster needs its own Ray instance, so the scenario runs in a child process
(``node_loss_child.py``) and reports back one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_runs_on_a_removed_node_resume_on_the_other(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RATCHET_LEDGER")}
    child = subprocess.run(
        [sys.executable, "-m", "tests.ray.node_loss_child", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    assert child.returncode == 0 and lines, child.stdout[-3000:] + child.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["doomed_node"] == result["worker_node"] != result["survivor_node"]
    assert result["causes"] == ["natural"]
    assert all(result["through_loss"]), result
    assert all(o.startswith(result["survivor_host"]) for o in result["owners"]), result
    assert result["hosts_lost"] >= 1
