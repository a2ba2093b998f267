"""Load generator: workload W1 on a Ratchet system, beside a no-durability baseline.

W1: R Runs in total, at most C at once; each Run is S model Steps of a scripted
model that asks for K tool calls on Steps 1..S-1 and answers with final text on
Step S; the tools return a small string. Defaults R=200, C=50, S=5, K=2.

    python -m benchmarks.load                               # SQLite, hosted, baseline
    python -m benchmarks.load --store postgres --json
    python -m benchmarks.load --baseline both --trials 3   # plain Ray and commits off
    python -m benchmarks.load --chaos --runs 1000
    python -m benchmarks.load --runs 5000 --concurrency 5000 \\
        --model-latency-ms 20 --tool-latency-ms 10           # W1-io, the scale scenario
    python -m benchmarks.load --scenario store              # the store's raw limit
    python -m benchmarks.load --plot throughput.png         # sweep C per store, plot

Correctness is part of every run: after the timed part every Run is read back
from the store through a new connection; ``ok`` holds only if every Run ended
naturally with its expected final text, every thread's log has no gap and
replays to its stored frontier, and the side-effect ledger (one O_APPEND file per
process, written by the tools themselves) holds every tool call's operation id
exactly once — under ``--chaos``: every completed call at least once, replayed
calls at most once per attempt, and never a ``never_replay`` call twice.

Beside it, in the same Ray instance and interleaved per trial (``--baseline``): plain
Ray, what a user would write (``benchmarks.baseline``: ``ratio_to_baseline``), and
Ratchet's own hosts and wave dispatch with commits switched off
(``benchmarks.same_dispatch``: ``ratio_to_same_dispatch``, what durability costs).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ray
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.same_dispatch import run_same_dispatch
from benchmarks.stores import STORE_NAMES, store_answers
from benchmarks.trials import combine
from benchmarks.w1 import Config, run_baseline, run_store_limit, run_w1
from cluster.config import ClusterUnavailable
from runtime.errors import RatchetError
from storage.url import SUPPORTED_SCHEMES as SCHEMES
from storage.url import UnsupportedStoreUrl, redact, scheme_of

BASELINES = ("plain", "same-dispatch", "both", "none")
SAME_DISPATCH = "same-dispatch"
"""The sweep's name for the same-dispatch series."""

# ---- sweeps and the plot -------------------------------------------------------------------

SWEEP_CONCURRENCY = (1, 5, 10, 25, 50, 100)


async def run_sweep(
    cfg: Config, stores: Sequence[str], levels: Sequence[int], console: Console, progress: Progress
) -> list[dict[str, Any]]:
    """One point per store (and each baseline) and level of C: the median runs/s of
    ``cfg.trials`` trials, which alternate between the series."""
    points = []
    for c in levels:
        point = replace(cfg, concurrency=c, chaos=False)
        series = ["baseline"] if cfg.plain_baseline else []
        series += [SAME_DISPATCH] if cfg.same_dispatch else []
        series += list(stores)
        trials: dict[str, list[dict[str, Any]]] = {name: [] for name in series}
        for _ in range(cfg.trials):
            for name in series:
                trials[name].append(await _sweep_trial(point, name, console, progress))
        for name in series:
            rates = [t["runs_per_s"] for t in trials[name] if t["runs_per_s"] is not None]
            rate = round(statistics.median(rates), 1) if rates else None
            ok = all(t["ok"] for t in trials[name])
            points.append({"store": name, "concurrency": c, "runs_per_s": rate, "ok": ok,
                           "per_trial": trials[name]})  # fmt: skip
            console.log(f"{name} C={c}: {rate} runs/s ok={ok}")
    return points


async def _sweep_trial(
    point: Config, name: str, console: Console, progress: Progress
) -> dict[str, Any]:
    if name == "baseline":
        base = await run_baseline(point, progress)
        return {"runs_per_s": base["baseline_runs_per_s"], "ok": base["baseline_ok"]}
    if name == SAME_DISPATCH:
        off = await run_same_dispatch(point, progress)
        return {"runs_per_s": off["same_dispatch_runs_per_s"], "ok": off["same_dispatch_ok"]}
    try:
        result = await run_w1(replace(point, store=name), console, progress)
    except Exception as exc:  # one failed point must not lose the sweep
        console.log(f"[red]{name} C={point.concurrency} failed: {exc!r}")
        return {"runs_per_s": None, "ok": False, "error": repr(exc)}
    return {"runs_per_s": result["runs_per_s"], "ok": result["ok"]}


def plot(points: Sequence[dict[str, Any]], path: str, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in points:
        if p.get("runs_per_s") is not None:
            series[p["store"]].append((p["concurrency"], p["runs_per_s"]))
    for name, values in series.items():
        xs, ys = zip(*sorted(values), strict=True)
        style = {"linestyle": "--", "color": "black"} if name == "baseline" else {}
        if name == SAME_DISPATCH:
            style = {"linestyle": ":", "color": "gray"}
        label = {"baseline": "plain Ray, no durability",
                 SAME_DISPATCH: "Ratchet, commits off"}.get(name, f"Ratchet on {name}")  # fmt: skip
        ax.plot(xs, ys, marker="o", label=label, **style)
    ax.set_xscale("log")
    ax.set_xlabel("concurrent Runs (C)")
    ax.set_ylabel("Runs / s")
    ax.set_title(
        f"W1 ({cfg.runs} Runs, {cfg.steps} steps, {cfg.tools} tools/step, {cfg.placement}, "
        f"{cfg.hosts} hosts / {cfg.executors} executors"
        + (f"; median of {cfg.trials} trials)" if cfg.trials > 1 else ")"),
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- output -------------------------------------------------------------------------------


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"W1 on {result.get('store')}", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key == "problems":
            continue
        style = ""
        if key == "ok":
            style = "[green]" if value else "[red]"
        table.add_row(key, f"{style}{value}")
    console.print(table)
    for problem in result.get("problems", []):
        console.print(f"[red]{problem}")


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


async def bench(cfg: Config, scenario: str, plot_file: str | None, console: Console) -> Any:
    if scenario == "store":
        return await run_store_limit(cfg)
    with progress_bar(console) as progress:
        if plot_file:
            stores = [s for s in ("sqlite", "postgres") if store_answers(s)]
            points = await run_sweep(cfg, stores, SWEEP_CONCURRENCY, console, progress)
            plot(points, plot_file, cfg)
            Path(plot_file).with_suffix(".json").write_text(json.dumps(points, indent=1))
            ok = all(p["ok"] for p in points)
            return {"scenario": "sweep", "ok": ok, "plot": plot_file, "points": points}
        trials = []
        for trial in range(cfg.trials):
            # the arms run in reverse order every other trial: a drift in the machine's
            # speed then falls on each alike
            trials.append(await _w1_beside_baselines(cfg, console, progress, trial % 2 == 1))
        return combine(trials)


async def _w1_beside_baselines(
    cfg: Config, console: Console, progress: Progress, reverse: bool
) -> dict[str, Any]:
    """One trial: durable W1, then each baseline asked for (reversed: the other way)."""
    arms: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]] = [
        ("durable", lambda: run_w1(cfg, console, progress))
    ]
    if cfg.plain_baseline:
        arms.append(("plain", lambda: run_baseline(cfg, progress)))
    if cfg.same_dispatch:
        arms.append(("same", lambda: run_same_dispatch(cfg, progress)))
    measured = {name: await arm() for name, arm in (arms[::-1] if reverse else arms)}
    result = measured["durable"]
    result.update(baseline_runs_per_s=None, ratio_to_baseline=None, ratio_to_same_dispatch=None)
    if "plain" in measured:
        result.update(measured["plain"])
        _ratios(result, "baseline")
    if "same" in measured:
        result.update(measured["same"])
        _ratios(result, "same_dispatch")
    return result


def _ratios(result: dict[str, Any], arm: str) -> None:
    """``ratio_to_<arm>`` of runs/s, and ``cpu_ratio_to_<arm>``: the arm's CPU per Run
    over ours (CPU is what the two cores run out of; it is steadier than wall time on a
    shared machine: other tenants stall both alike, but not in the same second)."""
    result[f"ratio_to_{arm}"] = round(result["runs_per_s"] / result[f"{arm}_runs_per_s"], 3)
    ours = sum(result["cpu_ms_per_run"].values())
    theirs = sum(result[f"{arm}_cpu_ms_per_run"].values())
    result[f"cpu_ratio_to_{arm}"] = round(theirs / ours, 3) if ours else None


def finite(value: float) -> float:
    """A number option that is a number: NaN passes every range check."""
    if value != value:
        raise typer.BadParameter("not a number")
    return value


def bench_command(
    runs: int = typer.Option(200, "--runs", min=1, max=10**7, help="R: Runs in total"),
    concurrency: int = typer.Option(
        50, "--concurrency", min=1, max=10**5, help="C: Runs at most at once"
    ),
    steps: int = typer.Option(5, "--steps", min=1, max=1000, help="S: model Steps per Run"),
    tools: int = typer.Option(
        2, "--tools", min=0, max=64, help="K: tool calls per Step (Steps 1..S-1)"
    ),
    model_latency_ms: float = typer.Option(
        0.0, "--model-latency-ms", min=0, max=3_600_000, callback=finite
    ),
    tool_latency_ms: float = typer.Option(
        0.0, "--tool-latency-ms", min=0, max=3_600_000, callback=finite
    ),
    store: str = typer.Option(
        "sqlite",
        "--store",
        help="sqlite | postgres | redis | memory (a fresh store, removed after) or a store URL",
    ),
    placement: str = typer.Option("hosted", "--placement", help="hosted | dedicated"),
    hosts: int = typer.Option(2, "--hosts", min=1, max=256, help="RunHosts in the hosted pool"),
    executors: int = typer.Option(
        2, "--executors", min=1, max=256, help="ToolExecutors in the pool"
    ),
    sqlite_writer: str = typer.Option(
        "direct", "--sqlite-writer", help="direct (each host writes) | actor (one store actor)"
    ),
    chaos: bool = typer.Option(False, "--chaos", help="kill a RunHost or ToolExecutor often"),
    chaos_interval_s: float = typer.Option(
        2.0, "--chaos-interval-s", min=0.01, max=3600, callback=finite
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="plain (default: plain Ray) | same-dispatch (Ratchet, commits off) | both | none",
    ),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="--baseline none"),
    trials: int = typer.Option(
        1, "--trials", min=1, help="repeat W1 and its baseline (each --plot point) N times"
    ),
    scenario: str = typer.Option("w1", "--scenario", help="w1 | store (the store's raw limit)"),
    plot_file: str | None = typer.Option(
        None, "--plot", help="sweep C for each store and the baseline; write a PNG"
    ),
    seed: int = typer.Option(7, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line last on stdout"),
    nodes: int = typer.Option(
        0,
        "--nodes",
        help="W1 on a ray.cluster_utils.Cluster of N raylets on this machine "
        "(benchmarks.nodes); --remove-node removes one mid-load",
    ),
    remove_node: bool = typer.Option(False, "--remove-node", help="with --nodes"),
) -> None:
    """Run workload W1 (or the store's raw limit) and report throughput and correctness."""
    if nodes:  # a cluster of its own: the scale-out benchmark (benchmarks/nodes.py)
        from benchmarks.nodes import main as nodes_main

        argv = ["--nodes", str(nodes), "--store", store, "--runs", str(runs)]
        argv += ["--concurrency", str(concurrency), "--steps", str(steps), "--tools", str(tools)]
        argv += (["--remove-node"] if remove_node else []) + (["--json"] if as_json else [])
        raise typer.Exit(nodes_main(argv))
    if remove_node:
        raise typer.BadParameter("--remove-node removes one of --nodes N")
    if placement not in ("hosted", "dedicated"):
        raise typer.BadParameter("--placement must be hosted or dedicated")
    if sqlite_writer not in ("direct", "actor"):
        raise typer.BadParameter("--sqlite-writer must be direct or actor")
    if scenario not in ("w1", "store"):
        raise typer.BadParameter("--scenario must be w1 or store")
    if store not in STORE_NAMES and ("://" not in store or scheme_of(store) not in SCHEMES):
        raise typer.BadParameter(
            f"--store is one of {', '.join(STORE_NAMES)} or a store URL, not {redact(store)!r:.80}"
        )
    if trials > 1 and scenario != "w1":
        raise typer.BadParameter("--trials repeats W1 measurements: not with --scenario store")
    baseline = _baseline_arms(baseline, no_baseline, chaos, placement)
    cfg = Config(
        runs=runs, concurrency=concurrency, steps=steps, tools=tools,
        model_latency_ms=model_latency_ms, tool_latency_ms=tool_latency_ms, store=store,
        placement=placement, hosts=hosts, executors=executors, sqlite_writer=sqlite_writer,
        chaos=chaos,
        chaos_interval_s=chaos_interval_s, seed=seed, baseline=baseline, trials=trials,
    )  # fmt: skip
    console = Console(stderr=as_json)
    console.print(f"[dim]{_describe(cfg, scenario)}")
    ours = not ray.is_initialized()
    try:
        result = asyncio.run(bench(cfg, scenario, plot_file, console))
    except (RatchetError, UnsupportedStoreUrl, ClusterUnavailable) as exc:
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()  # before printing: nothing of Ray's may print after the JSON line
    if result.get("scenario") == "sweep":
        console.print(f"plot written to {plot_file}")
    else:
        render(result, console)
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        sys.stdout.flush()
    if not result.get("ok", True):
        raise typer.Exit(1)


def _baseline_arms(baseline: str | None, no_baseline: bool, chaos: bool, placement: str) -> str:
    """``--baseline`` checked against the other options: the arms to measure beside W1."""
    if no_baseline and baseline not in (None, "none"):
        raise typer.BadParameter(f"--no-baseline and --baseline {baseline} contradict each other")
    arms = "none" if no_baseline else baseline or "plain"
    if arms not in BASELINES:
        raise typer.BadParameter(f"--baseline must be one of {', '.join(BASELINES)}")
    if arms in (SAME_DISPATCH, "both") and (chaos or placement != "hosted"):
        # nothing survives a host of that arm, and a dedicated Run is followed in the
        # driver's store, which holds nothing there
        raise typer.BadParameter("--baseline same-dispatch runs hosted and without --chaos")
    return arms


def _describe(cfg: Config, scenario: str) -> str:
    if scenario == "store":
        return f"store limit: {redact(cfg.store)}, {cfg.concurrency} writers"
    what = {**asdict(cfg), "store": redact(cfg.store)}
    return ", ".join(f"{k}={v}" for k, v in what.items() if k not in ("seed", "timeout_s"))


def cli() -> None:
    typer.run(bench_command)


if __name__ == "__main__":
    cli()


__all__ = ["SWEEP_CONCURRENCY", "bench", "bench_command", "plot", "run_sweep"]
