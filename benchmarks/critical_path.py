"""Where a durable Step's time goes: W1 with tracing on, its spans taken apart.

``python -m benchmarks.critical_path --store sqlite --concurrency 1`` runs W1 once on
a fresh store with every process writing its spans to one file
(``RATCHET_TRACE_FILE``), then splits each Step of each Run into the phases of its
critical path, from the start of its inference to the start of the next Step's:

- ``inference``: the ``chat`` span (the scripted model's latency, ``--model-latency-ms``);
- ``inference_commit``: the ``ratchet.commit inference`` span — the append that opens
  the batch and marks the first wave executing, from the call to its receipt (queue,
  the group writer's linger, the transaction with its fsync);
- ``tools``: first ``execute_tool`` start to last end — the executor round trip
  through the wave dispatcher, the tools' own latency (``--tool-latency-ms``) included;
- ``results_commit``: the ``ratchet.commit results`` span (where it lands while the next
  inference runs, only its part inside the Step span is on the critical path);
- ``engine``: what else the Step span holds (gates, planning, folding, encoding, and
  the wait for a results commit still on its way when the inference commit is made);
- ``between``: from the Step span's end to the next inference's start (the loop, the
  next Step's hooks and checks, the event loop's other Runs).

and the last Step's ``inference`` and ``ended_commit``. The store's own counters add
what its appends waited for their group (queue and linger) and what a group took to
write. Spans cost CPU themselves (about 2 ms per W1 Run, ``Tracing cost`` in
benchmarks/README.md), which shows up in ``engine`` and ``between``; measure
throughput with ``benchmarks.load``, untraced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.w1 import Config, run_w1
from runtime.tracing_env import TRACE_FILE_ENV

PHASES = ("inference", "inference_commit", "tools", "results_commit", "engine", "between")


def _us(stamp: str) -> float:
    """A span's ISO-8601 time (the SDK's JSON) in microseconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e6


def read_spans(path: Path) -> list[dict[str, Any]]:
    spans = []
    for line in path.read_text().splitlines():
        if line.strip():
            span = json.loads(line)
            span["t0"], span["t1"] = _us(span["start_time"]), _us(span["end_time"])
            spans.append(span)
    return spans


def _extent(spans: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    if not spans:
        return None
    return min(s["t0"] for s in spans), max(s["t1"] for s in spans)


def step_phases(spans: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Each phase's durations in ms, one per Step that had it (see the module's doc)."""
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        children[span.get("parent_id")].append(span)
    phases: dict[str, list[float]] = defaultdict(list)
    for runs in [s for s in children.get(None, []) if s["name"] == "ratchet.run"]:
        steps = sorted(
            (s for s in children[runs["context"]["span_id"]] if s["name"] == "ratchet.step"),
            key=lambda s: s["t0"],
        )
        for i, step in enumerate(steps):
            parts = children[step["context"]["span_id"]]
            chat = _extent([p for p in parts if p["name"].startswith("chat")])
            tools = _extent([p for p in parts if p["name"].startswith("execute_tool")])
            commits = {p["attributes"].get("ratchet.commit.label"): p for p in parts
                       if p["name"].startswith("ratchet.commit")}  # fmt: skip
            if chat is None:
                continue
            took = {"inference": chat[1] - chat[0]}
            if tools is not None:
                took["tools"] = tools[1] - tools[0]
            for label in ("inference", "results", "ended"):
                if label in commits:
                    took[f"{label}_commit"] = commits[label]["t1"] - commits[label]["t0"]
            if tools is None:  # the last Step: its inference and its end
                for key in ("inference", "ended_commit"):
                    if key in took:
                        phases[f"last_{key}"].append(took[key] / 1000)
                continue
            # a results commit that lands during the next inference (runtime.committing,
            # ``landing``) is on the critical path only for its part inside the Step span
            inside = dict(took)
            if "results" in commits:
                inside["results_commit"] = max(
                    0.0, min(commits["results"]["t1"], step["t1"]) - commits["results"]["t0"]
                )
            took["engine"] = (step["t1"] - chat[0]) - sum(inside.values())
            if i + 1 < len(steps):
                following = _extent([p for p in children[steps[i + 1]["context"]["span_id"]]
                                     if p["name"].startswith("chat")])  # fmt: skip
                if following is not None:
                    took["between"] = following[0] - step["t1"]
                    took["step"] = following[0] - chat[0]
            for key, value in took.items():
                phases[key].append(value / 1000)
    return phases


def summarize(phases: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and mean (ms) and count of each phase."""
    out = {}
    for key in (*PHASES, "step", "last_inference", "last_ended_commit"):
        values = phases.get(key, [])
        if values:
            out[key] = {
                "median_ms": round(statistics.median(values), 3),
                "mean_ms": round(statistics.fmean(values), 3),
                "steps": len(values),
            }
    return out


async def measure(cfg: Config, trace_file: Path) -> dict[str, Any]:
    # the system's actors write their spans there (a Ray instance already running, the
    # test suite's, has its workers' environment set already: runtime_env it is)
    env = {"runtime_env": {"env_vars": {TRACE_FILE_ENV: str(trace_file)}}}
    cfg.spec_options = {"host_options": (env,) * cfg.hosts, "core_options": env}
    console = Console(stderr=True)
    from benchmarks.load import progress_bar

    with progress_bar(console) as progress:
        result = await run_w1(cfg, console, progress)
    phases = summarize(step_phases(read_spans(trace_file)))
    keep = ("store", "concurrency", "runs", "ok", "runs_per_s", "p50_step_ms", "p99_step_ms",
            "commits_per_group", "store_wait_ms_per_append", "group_write_ms",
            "waves_per_executor_call", "model_latency_ms", "tool_latency_ms")  # fmt: skip
    return {"traced": {k: result.get(k) for k in keep}, "phases": phases}


def render(report: dict[str, Any], console: Console) -> None:
    traced = report["traced"]
    console.print(
        f"W1 {traced['store']} C={traced['concurrency']} R={traced['runs']} (traced): "
        f"{traced['runs_per_s']} runs/s, p50 Step {traced['p50_step_ms']} ms, "
        f"{traced['commits_per_group']} commits per group, an append waits "
        f"{traced['store_wait_ms_per_append']} ms for its group, a group writes in "
        f"{traced['group_write_ms']} ms, ok={traced['ok']}"
    )
    for key, value in report["phases"].items():
        console.print(f"  {key:<18} median {value['median_ms']:>8.3f} ms  "
                      f"mean {value['mean_ms']:>8.3f} ms  ({value['steps']} Steps)")  # fmt: skip


def parse(argv: Sequence[str] | None) -> tuple[Config, bool]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.critical_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--store", default="sqlite")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--model-latency-ms", type=float, default=20.0)
    p.add_argument("--tool-latency-ms", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.runs < 1 or a.concurrency < 1:
        p.error("--runs and --concurrency must be at least 1")
    cfg = Config(runs=a.runs, concurrency=a.concurrency, store=a.store,
                 model_latency_ms=a.model_latency_ms, tool_latency_ms=a.tool_latency_ms,
                 baseline="none")  # fmt: skip
    return cfg, a.json


def main(argv: Sequence[str] | None = None) -> int:
    cfg, as_json = parse(argv)
    with tempfile.TemporaryDirectory(prefix="ratchet-critical-") as tmp:
        report = asyncio.run(measure(cfg, Path(tmp) / "spans.jsonl"))
    render(report, Console(stderr=True))
    if as_json:
        print(json.dumps(report))
    return 0 if report["traced"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
