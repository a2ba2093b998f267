"""A small parked benchmark through its real CLI: every Run parks undriven, then ends once."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from benchmarks.parked import WARMUP_RUNS, parked_command

pytestmark = pytest.mark.ray

RUNS, HOSTS = 20, 2


@pytest.mark.timeout(120)
def test_parked_runs_hold_no_drive_and_each_tool_runs_once() -> None:
    app = typer.Typer()
    app.command()(parked_command)
    args = ["--runs", str(RUNS), "--concurrency", "8", "--store", "sqlite", "--json"]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout.strip().splitlines()[-1])

    checked = RUNS + WARMUP_RUNS
    assert result["ok"] is True, result
    assert result["runs"] == RUNS and result["checked_runs"] == checked
    assert result["driven_while_parked"] == 0
    assert result["natural_runs"] == checked
    assert result["exactly_once_calls"] == checked
    assert result["lost_commits"] == 0 and result["ledger_violations"] == 0
    assert result["park_all_s"] > 0 and result["resume_all_s"] > 0
    for key in ("idle", "peak_starting", "parked", "peak_resuming"):
        rss = result[f"host_rss_{key}_mb"]
        assert len(rss) == HOSTS and all(mb > 0 for mb in rss), (key, rss)
    assert "problems" not in result
