"""A tiny W1 through the real CLI: the JSON line is last, ``ok`` and its counts agree."""

from __future__ import annotations

import asyncio
import io
import json
import statistics
from pathlib import Path

import pytest
import typer
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from benchmarks.load import _describe, bench_command, plot, run_sweep
from benchmarks.w1 import WARMUP_RUNS, Config
from benchmarks.w1_agent import W1

pytestmark = pytest.mark.ray

RUNS, STEPS, TOOLS = 6, 2, 2


@pytest.mark.timeout(180)
def test_tiny_w1_is_ok_and_consistent() -> None:
    app = typer.Typer()
    app.command()(bench_command)
    args = ["--runs", str(RUNS), "--concurrency", "3", "--steps", str(STEPS)]
    args += ["--tools", str(TOOLS), "--store", "sqlite", "--no-baseline", "--json"]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout.strip().splitlines()[-1])

    checked = RUNS + WARMUP_RUNS
    per_run = W1(steps=STEPS, tools=TOOLS).commits_per_run()
    assert result["ok"] is True, result
    assert result["runs"] == RUNS and result["checked_runs"] == checked
    assert result["natural_runs"] == checked
    assert result["commits"] == checked * per_run
    assert result["commits_per_run"] == per_run
    assert result["exactly_once_calls"] == checked * (STEPS - 1) * TOOLS
    assert result["lost_commits"] == 0
    assert result["duplicate_never_replay"] == 0
    assert result["ledger_violations"] == 0
    assert result["runs_per_s"] == pytest.approx(RUNS / result["wall_s"], rel=0.02)
    assert result["steps_per_s"] == pytest.approx(RUNS * STEPS / result["wall_s"], rel=0.02)
    assert 0 < result["p50_step_ms"] <= result["p99_step_ms"]
    assert result["peak_rss_mb"] > 0
    # a group holds at most one commit of each Run in flight (3, or the warm-up's)
    assert 1 <= result["commits_per_group"] <= max(3, WARMUP_RUNS)
    assert result["baseline_runs_per_s"] is None and result["ratio_to_baseline"] is None


@pytest.mark.timeout(240)
def test_trials_repeat_w1_and_its_baseline() -> None:
    app = typer.Typer()
    app.command()(bench_command)
    args = ["--runs", "4", "--concurrency", "2", "--steps", "2", "--tools", "1"]
    args += ["--store", "sqlite", "--trials", "2", "--json"]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout.strip().splitlines()[-1])

    assert result["ok"] is True and result["baseline_ok"] is True, result
    assert result["trials"] == 2 and len(result["per_trial"]) == 2
    assert result["checked_runs"] == 2 * (4 + WARMUP_RUNS)
    ratios = [t["ratio_to_baseline"] for t in result["per_trial"]]
    assert result["ratio_to_baseline"] == pytest.approx(sum(ratios) / 2, abs=0.001)


def test_trials_are_refused_where_they_mean_nothing() -> None:
    app = typer.Typer()
    app.command()(bench_command)
    outcome = CliRunner().invoke(app, ["--scenario", "store", "--trials", "3"])
    assert outcome.exit_code != 0
    assert "--trials repeats W1 measurements" in outcome.output


@pytest.mark.parametrize(
    "args",
    [
        ["--runs", "0"],
        ["--runs", "99999999999999999999"],  # hung building its Runs
        ["--concurrency", "0"],  # hung: no Run could start
        ["--concurrency", "-5"],
        ["--steps", "0"],
        ["--tools", "-1"],
        ["--hosts", "0"],  # ZeroDivisionError once Ray was up
        ["--executors", "0"],
        ["--model-latency-ms", "nan"],
        ["--tool-latency-ms", "inf"],
        ["--chaos-interval-s", "0"],
        ["--store", "bogus"],
        ["--store", ""],
    ],
)
def test_options_out_of_range_are_usage_errors_before_ray_starts(args: list[str]) -> None:
    app = typer.Typer()
    app.command()(bench_command)
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 2, outcome.output  # a usage error: nothing was started


def test_a_store_url_in_a_usage_error_or_the_settings_line_hides_its_password() -> None:
    app = typer.Typer()
    app.command()(bench_command)
    outcome = CliRunner().invoke(app, ["--store", "mysql://app:hunter2@db/r"])
    assert outcome.exit_code == 2 and "hunter2" not in outcome.output, outcome.output
    cfg = Config(store="postgresql://app:hunter2@db/r")
    for scenario in ("w1", "store"):
        assert "hunter2" not in _describe(cfg, scenario)


@pytest.mark.timeout(240)
def test_a_sweep_point_is_the_median_of_its_trials(tmp_path: Path) -> None:
    cfg = Config(runs=2, concurrency=1, steps=1, tools=1, trials=3)
    console = Console(file=io.StringIO())
    with Progress(console=console) as progress:
        # one level of C keeps it short: the trials of one point are what it is about
        points = asyncio.run(run_sweep(cfg, ["sqlite"], (1,), console, progress))

    assert [(p["store"], p["concurrency"]) for p in points] == [("baseline", 1), ("sqlite", 1)]
    for point in points:
        assert point["ok"] is True, point
        rates = [t["runs_per_s"] for t in point["per_trial"]]
        assert len(rates) == 3 and point["runs_per_s"] == round(statistics.median(rates), 1)
    plot(points, str(tmp_path / "sweep.png"), cfg)
    assert (tmp_path / "sweep.png").stat().st_size > 0
