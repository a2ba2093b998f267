"""``benchmarks.ray_recovery`` refuses counts that cannot measure anything, before Ray starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["--kills", "0"], ["--runs", "0"], ["--memory-runs", "-1"]])
def test_counts_that_measure_nothing_are_refused(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ray_recovery", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--runs and --kills must be at least 1, --memory-runs at least 0" in done.stderr
