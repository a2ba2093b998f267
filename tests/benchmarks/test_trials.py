"""How several trials of W1 become one result (``--trials``)."""

from __future__ import annotations

import pytest

from benchmarks.trials import combine


def _trial(rate: float, base: float, ok: bool = True, **more: object) -> dict[str, object]:
    return {
        "store": "sqlite",
        "ok": ok,
        "baseline_ok": True,
        "runs_per_s": rate,
        "baseline_runs_per_s": base,
        "ratio_to_baseline": round(rate / base, 3),
        "commits": 100,
        "lost_commits": 0,
        "peak_rss_mb": 900.0 + rate,
        "cpu_ms_per_run": {"RunHost": rate / 10, "driver": 1.0},
        **more,
    }


def test_rates_are_medians_counts_add_up_and_the_largest_peak_is_kept() -> None:
    result = combine([_trial(100, 200), _trial(150, 160), _trial(120, 100)])
    assert result["runs_per_s"] == 120
    assert result["baseline_runs_per_s"] == 160
    # the median of the per-trial ratios (0.5, 0.938, 1.2), not a ratio of medians
    assert result["ratio_to_baseline"] == 0.938
    assert result["commits"] == 300 and result["lost_commits"] == 0
    assert result["peak_rss_mb"] == 1050.0
    assert result["cpu_ms_per_run"] == {"RunHost": 12.0, "driver": 1.0}
    assert result["trials"] == 3
    assert [t["runs_per_s"] for t in result["per_trial"]] == [100, 150, 120]
    assert result["ok"] is True and result["store"] == "sqlite"


def test_one_bad_trial_makes_the_result_not_ok_and_keeps_its_problems() -> None:
    bad = _trial(90, 100, ok=False, problems=["run-x: no end"], lost_commits=1)
    result = combine([_trial(100, 100), bad])
    assert result["ok"] is False
    assert result["lost_commits"] == 1
    assert result["problems"] == ["run-x: no end"]


def test_a_single_trial_is_returned_as_it_was() -> None:
    one = _trial(100, 125)
    assert combine([one]) == one


def test_no_trials_is_an_error() -> None:
    with pytest.raises(ValueError, match="no trials"):
        combine([])
