"""Several trials of one W1 measurement, combined into one result.

W1 at its defaults times 1 to 2 s of work: on a shared 2-core machine one such
window can be stalled by another tenant, and the baseline's alone varies by a
third between runs. ``--trials N`` repeats the arms (durable, and each baseline) N
times in the same Ray instance, in reverse order every other trial so a drift in the
machine's speed falls on each alike, and reports the median of each rate and of the
per-trial ratios; counts add up, and ``ok`` holds only if every trial was ok.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

MEDIAN = (
    "wall_s", "runs_per_s", "steps_per_s", "commits_per_run", "p50_step_ms", "p99_step_ms",
    "idle_rss_mb", "rss_per_active_run_kb", "waves_per_executor_call", "commits_per_group",
    "median_recovery_ms", "median_settled_ms", "baseline_wall_s", "baseline_runs_per_s",
    "baseline_p50_step_ms", "baseline_p99_step_ms", "ratio_to_baseline",
    "cpu_ratio_to_baseline", "same_dispatch_wall_s", "same_dispatch_runs_per_s",
    "same_dispatch_p50_step_ms", "same_dispatch_p99_step_ms",
    "same_dispatch_waves_per_executor_call", "ratio_to_same_dispatch",
    "cpu_ratio_to_same_dispatch", "store_wait_ms_per_append", "group_write_ms",
)  # fmt: skip
TOTAL = (
    "commits", "lost_commits", "duplicate_never_replay", "checked_runs", "natural_runs",
    "exactly_once_calls", "ledger_violations", "kills", "host_kills", "executor_kills",
    "recovered_runs", "replayed_calls", "indeterminate_calls", "same_dispatch_commits",
)  # fmt: skip
LARGEST = ("peak_rss_mb", "peak_rss_total_mb", "peak_active_runs", "max_recovery_ms")
MEDIAN_BY_KIND = ("cpu_ms_per_run", "baseline_cpu_ms_per_run", "same_dispatch_cpu_ms_per_run")
ALL_OK = ("ok", "baseline_ok", "same_dispatch_ok")
PER_TRIAL = ("ok", "runs_per_s", "baseline_runs_per_s", "ratio_to_baseline",
             "cpu_ratio_to_baseline", "same_dispatch_runs_per_s", "ratio_to_same_dispatch",
             "cpu_ratio_to_same_dispatch", "p50_step_ms")  # fmt: skip


def combine(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result for several trials of the same configuration (see the module's doc)."""
    if not trials:
        raise ValueError("no trials to combine")
    if len(trials) == 1:
        return dict(trials[0])
    result = dict(trials[0])
    for key in MEDIAN:
        if key in result:
            result[key] = _median([t.get(key) for t in trials])
    for key in TOTAL:
        if key in result:
            result[key] = sum(t[key] for t in trials)
    for key in LARGEST:
        if key in result:
            result[key] = max(t[key] for t in trials)
    for key in MEDIAN_BY_KIND:
        if key in result:
            result[key] = _median_by_kind([t[key] for t in trials])
    for key in ALL_OK:
        if key in result:
            result[key] = all(t[key] for t in trials)
    for key in ("problems", "same_dispatch_problems"):
        problems = [p for t in trials for p in t.get(key, [])]
        if problems:
            result[key] = problems[:10]
    result["trials"] = len(trials)
    result["per_trial"] = [{k: t.get(k) for k in PER_TRIAL} for t in trials]
    return result


def _median(values: Sequence[Any]) -> Any:
    """The median of the values present (to 3 places); None when none is."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return round(statistics.median(present), 3)


def _median_by_kind(maps: Sequence[dict[str, float]]) -> dict[str, float]:
    kinds = {kind for m in maps for kind in m}
    medians = {kind: round(statistics.median(m.get(kind, 0.0) for m in maps), 2) for kind in kinds}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


__all__ = ["combine"]
