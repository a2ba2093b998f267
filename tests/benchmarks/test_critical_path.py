"""The critical-path profile: spans taken apart into a Step's phases, on made-up spans and
on a tiny traced W1 through real RunHosts and executors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.critical_path import measure, step_phases, summarize
from benchmarks.w1 import WARMUP_RUNS, Config


def span(name: str, sid: str, parent: str | None, t0: float, t1: float, **attrs: Any) -> dict:
    return {
        "name": name,
        "context": {"span_id": sid},
        "parent_id": parent,
        "t0": t0 * 1000,  # ms → the µs the SDK's times parse to
        "t1": t1 * 1000,
        "attributes": attrs,
    }


def commit(label: str, sid: str, parent: str, t0: float, t1: float) -> dict:
    return span(f"ratchet.commit {label}", sid, parent, t0, t1, **{"ratchet.commit.label": label})


def test_phases_of_two_steps_whose_results_land_during_the_next_inference() -> None:
    spans = [
        span("ratchet.run", "run", None, 0, 100),
        span("ratchet.step", "s0", "run", 0, 45),
        span("chat m", "c0", "s0", 0, 20),
        commit("inference", "i0", "s0", 21, 23),
        span("execute_tool t", "x0", "s0", 24, 38),
        span("execute_tool t", "x1", "s0", 24, 39),
        commit("results", "r0", "s0", 43, 47),  # lands 2 ms past the Step's end
        span("ratchet.step", "s1", "run", 46, 70),
        span("chat m", "c1", "s1", 46, 66),
        commit("ended", "e1", "s1", 67, 69),
    ]
    phases = step_phases(spans)
    assert phases["inference"] == [20.0]
    assert phases["inference_commit"] == [2.0]
    assert phases["tools"] == [15.0]
    assert phases["results_commit"] == [4.0]
    # 45 ms of Step: 20 + 2 + 15 + the 2 ms of the results commit inside it = 39
    assert phases["engine"] == [6.0]
    assert phases["between"] == [1.0] and phases["step"] == [46.0]
    assert phases["last_inference"] == [20.0] and phases["last_ended_commit"] == [2.0]
    summary = summarize(phases)
    assert summary["tools"] == {"median_ms": 15.0, "mean_ms": 15.0, "steps": 1}


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_tiny_traced_w1_is_split_into_its_phases(tmp_path) -> None:
    runs, steps = 3, 3
    cfg = Config(runs=runs, concurrency=1, steps=steps, model_latency_ms=5.0, baseline="none")
    report = asyncio.run(measure(cfg, tmp_path / "spans.jsonl"))
    assert report["traced"]["ok"] is True
    phases = report["phases"]
    tool_steps = (runs + WARMUP_RUNS) * (steps - 1)
    for key in ("inference", "inference_commit", "tools", "results_commit", "engine"):
        assert phases[key]["steps"] == tool_steps, (key, phases[key])
    assert phases["last_ended_commit"]["steps"] == runs + WARMUP_RUNS
    assert phases["inference"]["median_ms"] >= 5.0  # the scripted model's own latency
    assert report["traced"]["group_write_ms"] > 0
