"""The in-process engine benchmark, tiny: several Runs per thread, each round planned."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.engine_bench import one_trial


def test_later_runs_of_each_thread_are_counted_and_their_groups_planned(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ratchet.db"
    result = asyncio.run(one_trial(url, runs=6, concurrency=3, per_thread=3))
    assert result["runs_per_s"] > 0 and result["cpu_ms_per_run"] > 0
    # the second and third Run of each thread read it at rest first: planned all the same
    assert result["store_planned_share"] == 1.0


def test_the_host_heap_collects_as_a_run_host_does() -> None:
    """``--heap host``: the GC settings every actor runs with, not Python's defaults."""
    import gc
    import json

    import typer
    from typer.testing import CliRunner

    from actors.heap import GC_THRESHOLDS
    from benchmarks.engine_bench import main

    app = typer.Typer()
    app.command()(main)
    before = gc.get_threshold()
    try:
        ran = CliRunner().invoke(app, ["--runs", "4", "--trials", "1", "--heap", "host", "--json"])
        assert ran.exit_code == 0, ran.output
        assert json.loads(ran.output.strip().splitlines()[-1])["heap"] == "host"
        assert gc.get_threshold() == GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    refused = CliRunner().invoke(app, ["--heap", "bogus"])
    assert refused.exit_code == 2
