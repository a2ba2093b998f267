"""The same-dispatch arm (``--baseline same-dispatch``): Ratchet's own hosts and wave
dispatch on ``noop://``, a store that folds appends in-process and keeps nothing."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from benchmarks.load import bench_command
from benchmarks.trials import combine
from benchmarks.w1 import WARMUP_RUNS
from benchmarks.w1_agent import W1
from runtime.errors import VersionConflict
from runtime.ids import ThreadId
from storage.noop import NoopCommitStore
from storage.url import open_store
from tests.storage.builders import activation, head, step

THREAD = ThreadId("t-noop")


async def test_an_append_folds_into_the_frontier_and_nothing_is_written() -> None:
    store = await open_store("noop://w1-test")
    assert isinstance(store, NoopCommitStore)
    first = await store.append(activation(THREAD, "run-1", claim="host-0#1", epoch=1), 0, 0,
                               claim="host-0#1")  # fmt: skip
    second = step(THREAD, "run-1", 1, prev=await head(store, THREAD), epoch=1)
    receipt = await store.append(second, 1, 1)

    assert (first.seq, receipt.seq) == (1, 2)
    frontier = await store.load(THREAD)
    assert frontier.version == 2 and frontier.owner == "host-0#1" and frontier.epoch == 1
    assert [m.text for m in frontier.messages] == ["hello", "thinking"]  # type: ignore[union-attr]
    assert (await store.load_head(THREAD)).messages == ()
    assert await store.read(THREAD) == []  # no log: nothing was written
    assert [r.thread_id for r in await store.list_runs("running", host="host-0")] == [THREAD]
    assert store.appends == 2
    # the same rule as every store: a retry gets its receipt back, a stale writer a conflict
    assert await store.append(second, 1, 1) == receipt
    with pytest.raises(VersionConflict):
        await store.append(step(THREAD, "run-1", 2, prev=frontier.head, epoch=1), 1, 1)


async def test_nothing_persists_across_instances() -> None:
    store = await open_store("noop://w1-test")
    await store.append(activation(THREAD, "run-1"), 0, 0)
    await store.close()
    again = await open_store("noop://w1-test")  # the same URL: another process's store
    assert (await again.load(THREAD)).version == 0
    assert await again.list_runs() == [] and await again.thread_ids() == []


def test_trials_combine_the_same_dispatch_figures() -> None:
    def trial(rate: float, off: float) -> dict[str, object]:
        return {"ok": True, "runs_per_s": rate, "same_dispatch_ok": True,
                "same_dispatch_runs_per_s": off, "ratio_to_same_dispatch": round(rate / off, 3),
                "same_dispatch_commits": 10,
                "same_dispatch_cpu_ms_per_run": {"RunHost": off / 100}}  # fmt: skip

    result = combine([trial(100, 200), trial(150, 160), trial(120, 100)])
    assert result["same_dispatch_runs_per_s"] == 160
    assert result["ratio_to_same_dispatch"] == 0.938  # the median of the per-trial ratios
    assert result["same_dispatch_commits"] == 30
    assert result["same_dispatch_cpu_ms_per_run"] == {"RunHost": 1.6}
    assert [t["ratio_to_same_dispatch"] for t in result["per_trial"]] == [0.5, 0.938, 1.2]


@pytest.mark.parametrize(
    "args",
    [["--chaos"], ["--placement", "dedicated"], ["--no-baseline"], ["--baseline", "ray"]],
)
def test_the_arm_is_refused_where_it_cannot_hold(args: list[str]) -> None:
    app = typer.Typer()
    app.command()(bench_command)
    outcome = CliRunner().invoke(app, ["--baseline", "same-dispatch", *args])
    assert outcome.exit_code != 0
    assert "--baseline" in outcome.output or "--no-baseline" in outcome.output


RUNS, STEPS, TOOLS = 6, 2, 2


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_the_same_dispatch_arm_runs_w1_and_reports_its_ratio() -> None:
    app = typer.Typer()
    app.command()(bench_command)
    args = ["--runs", str(RUNS), "--concurrency", "3", "--steps", str(STEPS)]
    args += ["--tools", str(TOOLS), "--store", "sqlite", "--baseline", "same-dispatch", "--json"]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout.strip().splitlines()[-1])

    checked = RUNS + WARMUP_RUNS
    assert result["ok"] is True and result["same_dispatch_ok"] is True, result
    # every Run's answer held all its commits, and the hosts acknowledged no other
    assert result["same_dispatch_commits"] == checked * W1(STEPS, TOOLS).commits_per_run()
    rate = result["same_dispatch_runs_per_s"]
    assert rate > 0 and result["same_dispatch_wall_s"] > 0
    assert result["ratio_to_same_dispatch"] == pytest.approx(result["runs_per_s"] / rate, abs=2e-3)
    assert result["cpu_ratio_to_same_dispatch"] > 0
    assert 0 < result["same_dispatch_p50_step_ms"] <= result["same_dispatch_p99_step_ms"]
    assert result["same_dispatch_waves_per_executor_call"] >= 1
    assert any(kind.startswith("RunHost") for kind in result["same_dispatch_cpu_ms_per_run"])
    assert result["baseline_runs_per_s"] is None and result["ratio_to_baseline"] is None
