"""``ratchet demo``: many concurrent Runs on local Ray and SQLite, one host crashed midway.

One Run carries a fault point that ends its RunHost's process (``os._exit``) right
after a commit; Ray restarts the host, which finds the Runs it owned, settles them
``failed/execution_lost`` and recovers them from the committed frontier. The
summary is read back from the committed log and from the effect ledger.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster.cli_base import uncancelled
from cluster.client import Ratchet, RunHandle
from cluster.config import ClusterUnavailable
from cluster.demo_agent import NEVER_REPLAY_TOOLS, EffectLedger
from cluster.report import EXECUTION_LOST, RunReport, analyse

AGENT_REF = "cluster.demo_agent:agent"
CRASH_POINT = ("after:inference", 1, "exit")
"""The crashing Run ends its host right after its first inference commit, which marks
the Step's first wave of calls executing: they are in flight when the host dies."""
STAGGER_S = 0.06


@dataclass
class DemoResult:
    reports: list[RunReport]
    duplicates: list[str]
    seconds: float

    @property
    def all_finished(self) -> bool:
        return all(r.cause == "natural" for r in self.reports)


async def run_demo(
    runs: int, store_url: str | None, console: Console, crash: bool = True
) -> DemoResult:
    ledger_path = os.path.join(os.getcwd(), "ratchet-data", "demo-effects.db")
    os.environ.setdefault("RATCHET_LEDGER", ledger_path)  # before Ray starts its workers
    began = time.monotonic()
    with console.status("starting local Ray, the store actor and 2 RunHosts…"):
        client = await Ratchet.connect(store_url=store_url, quiet=True, hosts=2, executors=2)
    try:  # ended early (an error, Ctrl-C): the lease is given up all the same
        # made once the store answered: a bad --store leaves no ledger file behind
        try:
            ledger = EffectLedger(os.environ["RATCHET_LEDGER"])
        except (OSError, sqlite3.Error) as exc:  # ./ratchet-data a file, say
            raise ClusterUnavailable(f"cannot open the demo's ledger: {exc}") from None
        return await _demo(client, ledger, runs, console, crash, began)
    finally:
        await uncancelled(client.close())


async def _demo(
    client: Ratchet, ledger: EffectLedger, runs: int, console: Console, crash: bool, began: float
) -> DemoResult:
    if crash:
        console.print("[dim]Ray will report the crashed RunHost worker below: that is the crash.")
    stamp = uuid.uuid4().hex[:6]
    crash_index = runs * 2 // 3 if crash else -1
    starting = asyncio.gather(
        *(_start(client, stamp, i, CRASH_POINT if i == crash_index else None) for i in range(runs))
    )
    # interrupted (Ctrl-C, SIGTERM) before the starts were awaited: their error is this
    # one's, not asyncio's "exception was never retrieved" with its tracebacks
    starting.add_done_callback(lambda done: done.cancelled() or done.exception())
    threads = {f"demo-{stamp}-{i:02d}" for i in range(runs)}
    await _follow(client, threads, console, crash_index >= 0)
    handles = await starting
    reports = [analyse(h.thread_id, await client.store.read(h.thread_id)) for h in handles]
    ours = {f"tool-batch:{r.run_id}:" for r in reports}
    duplicates = [
        op for op in ledger.duplicates(NEVER_REPLAY_TOOLS) if op.rsplit(":", 2)[0] + ":" in ours
    ]
    return DemoResult(reports, duplicates, time.monotonic() - began)


async def _start(
    client: Ratchet, stamp: str, i: int, faults: tuple[str, int, str] | None
) -> RunHandle:
    # Staggered starts spread the Runs over their Steps, so the crash finds some
    # in a never_replay call and some in a replay_safe one.
    await asyncio.sleep(i * STAGGER_S)
    return await client.start(
        AGENT_REF,
        f"Handle order A-1 for customer {i}",
        thread_id=f"demo-{stamp}-{i:02d}",  # the same names _follow watches
        faults=faults,
    )


async def _follow(client: Ratchet, threads: set[str], console: Console, crashing: bool) -> None:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("runs finished", total=len(threads), note="")
        while True:
            rows = [r for r in await client.runs() if r.thread_id in threads]
            done = sum(r.state == "ended" for r in rows)
            progress.update(task, completed=done, note=await _note(client, crashing))
            if done == len(threads):
                return
            await asyncio.sleep(0.1)


async def _note(client: Ratchet, crashing: bool) -> str:
    """What the hosts are doing: a crashed host does not answer until Ray restarts it."""
    down, recovered = 0, 0
    for host in client.hosts:
        try:
            info = await asyncio.wait_for(host.info.remote(), 0.2)
        except Exception:  # a progress note only: a host that does not answer counts as down
            down += 1
            continue
        recovered += info["recovered"]
    if down:
        return f"[red]{down} host down, Ray is restarting it"
    if recovered:
        return f"[green]host restarted: {recovered} runs recovered"
    return "[yellow]one host will crash midway" if crashing else ""


def render(result: DemoResult, console: Console) -> None:
    table = Table(title="Runs", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("thread", "end", "steps", "crash", "indeterminate", "replayed"):
        table.add_column(column, no_wrap=True)
    for r in result.reports:
        table.add_row(
            r.thread_id,
            r.cause or "[red]not ended",
            str(r.steps),
            "[yellow]recovered" if r.lost else "-",
            ", ".join(c.tool for c in r.indeterminate) or "-",
            ", ".join(f"{c.tool} x{c.attempts}" for c in r.replayed) or "-",
        )
    console.print(table)
    console.print(_summary(result))
    example = next((r.thread_id for r in result.reports if r.lost), result.reports[0].thread_id)
    console.print(f"[dim]inspect a Run: ratchet show {example}[/dim]")


def _summary(result: DemoResult) -> Table:
    reports = result.reports
    recovered = [r for r in reports if r.lost]
    summary = Table(title="Summary", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    finished = sum(r.cause == "natural" for r in reports)
    ok = "[green]" if result.all_finished else "[red]"
    summary.add_row("runs finished (natural end)", f"{ok}{finished} / {len(reports)}")
    summary.add_row("runs whose host crashed and were recovered", str(len(recovered)))
    summary.add_row(
        "  status went running → failed(execution_lost) → running → idle",
        str(sum(_went_through_loss(r) for r in recovered)),
    )
    summary.add_row("tool calls committed", str(sum(len(r.calls) for r in reports)))
    summary.add_row(
        "  never_replay calls → indeterminate (the model saw an error)",
        str(sum(len(r.indeterminate) for r in reports)),
    )
    summary.add_row(
        "  replay_safe calls re-run with the same operation id",
        str(sum(len(r.replayed) for r in reports)),
    )
    dup = "[green]0" if not result.duplicates else f"[red]{len(result.duplicates)}"
    summary.add_row("never_replay effects that happened twice", dup)
    summary.add_row("wall time", f"{result.seconds:.1f} s")
    return summary


def _went_through_loss(report: RunReport) -> bool:
    states = [(s, reason == EXECUTION_LOST) for s, reason in report.statuses]
    try:
        i = states.index(("failed", True))
    except ValueError:
        return False
    return (
        states[i - 1][0] == "running"
        and states[i + 1][0] == "running"
        and (report.statuses[-1][0] == "idle")
    )
