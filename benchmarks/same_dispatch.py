"""The same-dispatch baseline: W1 on Ratchet itself with commits switched off.

The plain-Ray baseline (``benchmarks.baseline``) is what a user would write: one
executor round trip per Step per Run. The durable path does more than commit: its
``WaveDispatcher`` sends the tool waves of many Runs in one executor call, and the
Runs go through RunHosts and engines. So ``ratio_to_baseline`` mixes a dispatch the
baseline lacks into what durability costs. This arm runs the same system — the
client, RunHosts, engines, wave dispatch, ToolExecutors, Supervisor, heartbeats and
reconciliation, through the same ``Ratchet.run`` calls as the durable arm — on
``noop://`` (``storage.noop``): an append is admitted and folds into a frontier the
host process keeps, and nothing is written. ``ratio_to_same_dispatch`` is then what
the store's commits and the reads they need cost on Ratchet's own dispatch.

Nothing can be read back (every process has a store of its own, and the driver's is
empty), so a Run is judged by the frontier its host answers with and by the ledger
(``benchmarks.verify.verify_answers``). Hosted placement only (a dedicated Run is
followed through the driver's store), and not under chaos: nothing survives a host.
"""

from __future__ import annotations

import shutil
import uuid
from typing import Any

from rich.progress import Progress

from benchmarks.verify import quantile, verify_answers
from benchmarks.w1 import WARMUP_RUNS, Config, drive_durable, host_counts, per_run_ms, sharing
from benchmarks.w1_agent import ledger_dir, new_ledger
from cluster.client import Ratchet

ANSWER_TIMEOUT_S = 120.0
"""A host that answers nothing at rest for this long has failed the Run (the driver's
store, where ``Ratchet.run`` would otherwise look, never hears of it)."""


async def run_same_dispatch(cfg: Config, progress: Progress) -> dict[str, Any]:
    """W1 on RunHosts over ``noop://``: the ``same_dispatch_*`` figures."""
    if cfg.placement != "hosted" or cfg.chaos:
        raise ValueError("the same-dispatch arm runs hosted and without chaos")
    tag = new_ledger()
    params = cfg.params(tag)
    # a system of its own per measurement: its actors are named after the store URL
    client = await Ratchet.connect(
        store_url=f"noop://w1-{uuid.uuid4().hex[:8]}",
        hosts=cfg.hosts,
        executors=cfg.executors,
        quiet=True,
    )
    try:
        timed = await drive_durable(
            client, cfg, params.ref, progress, "commits off", ANSWER_TIMEOUT_S
        )
        counts = await host_counts(client)
        verdict = verify_answers(
            params,
            [*timed.warmup, *timed.threads],
            timed.answers,
            counts["store_appends"],
            timed_runs={run for _, run in timed.threads},
        )
    finally:
        await client.shutdown()
        shutil.rmtree(ledger_dir(tag), ignore_errors=True)
    waves, _ = sharing(counts)
    result: dict[str, Any] = {
        "same_dispatch_ok": verdict.ok(cfg.runs + WARMUP_RUNS),
        "same_dispatch_wall_s": round(timed.wall_s, 3),
        "same_dispatch_runs_per_s": round(cfg.runs / timed.wall_s, 1),
        "same_dispatch_p50_step_ms": quantile(verdict.step_ms, 50),
        "same_dispatch_p99_step_ms": quantile(verdict.step_ms, 99),
        "same_dispatch_cpu_ms_per_run": per_run_ms(timed.cpu_s, cfg.runs),
        "same_dispatch_waves_per_executor_call": waves,
        "same_dispatch_commits": verdict.commits,
    }
    if verdict.problems:
        result["same_dispatch_problems"] = verdict.problems
    return result


__all__ = ["ANSWER_TIMEOUT_S", "run_same_dispatch"]
