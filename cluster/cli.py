"""The ``ratchet`` command line.

    ratchet demo                      the README's main job: no set-up, one crash, a summary
    ratchet run MODULE:AGENT "input"  start a Run on the cluster and print its transcript
    ratchet runs                      every thread's latest Run: state and status
    ratchet show THREAD               transcript, tool-batch phases, status

``runs`` and ``show`` read the store directly and need no Ray. Every expected
failure (a bad import path, an unreachable store or cluster) is one line on
stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from cluster.config import ClusterUnavailable, store_url_from
from cluster.report import analyse, phase_text
from runtime.agent import load_agent
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, EndedState
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage
from storage.url import UnsupportedStoreUrl, open_store, redact

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Ratchet: durable agent Runs on Ray."
)
console = Console()
errors = Console(stderr=True)

StoreOption = typer.Option(
    None, "--store", help="Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"
)
AddressOption = typer.Option(
    None, "--address", help="Ray cluster address (default: RAY_ADDRESS or local)"
)


def _cli(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., None]:
    """Run an async command; expected failures become one line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            asyncio.run(fn(*args, **kwargs))
        except (RatchetError, ClusterUnavailable, UnsupportedStoreUrl, TimeoutError) as exc:
            errors.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


@app.command()
def demo(
    runs: int = typer.Option(24, "--runs", "-n", min=1, max=2000, help="Concurrent Runs"),
    store: str | None = StoreOption,
    crash: bool = typer.Option(True, "--crash/--no-crash", help="Crash one host midway"),
) -> None:
    """Launch concurrent Runs of a scripted agent on local Ray; crash a host; summarise."""
    _cli(_demo)(runs, store, crash)


async def _demo(runs: int, store: str | None, crash: bool) -> None:
    from cluster.demo import render, run_demo

    url = store_url_from(store)
    console.print(f"[bold]ratchet demo[/bold]: {runs} Runs, store {redact(url)}")
    result = await run_demo(runs, url, console, crash=crash)
    render(result, console)
    if not result.all_finished or result.duplicates:
        raise typer.Exit(1)


@app.command()
def run(
    agent: str = typer.Argument(..., help="The agent as MODULE:ATTR"),
    text: str = typer.Argument(..., help="The user's input"),
    thread: str | None = typer.Option(None, "--thread", help="Thread id (default: a new one)"),
    placement: str = typer.Option("hosted", "--placement", help="hosted or dedicated"),
    store: str | None = StoreOption,
    address: str | None = AddressOption,
) -> None:
    """Start a Run of AGENT with TEXT and wait until it ends or awaits input."""
    if placement not in ("hosted", "dedicated"):
        errors.print("[red]error:[/red] --placement must be hosted or dedicated")
        raise typer.Exit(2)
    _cli(_run)(agent, text, thread, placement, store, address)


async def _run(
    agent: str,
    text: str,
    thread: str | None,
    placement: Literal["hosted", "dedicated"],
    store: str | None,
    address: str | None,
) -> None:
    from cluster.client import Ratchet

    if os.getcwd() not in sys.path:  # like python -m: the user's modules are importable
        sys.path.insert(0, os.getcwd())
    load_agent(agent)  # a bad import path fails before any cluster is started
    client = await Ratchet.connect(address, store, quiet=True)
    handle = await client.start(agent, text, thread_id=thread, placement=placement)
    console.print(f"run {handle.run_id} on thread {handle.thread_id}")
    await handle.result()
    await _show(handle.thread_id, store)
    await client.close()


@app.command()
def runs(
    state: str | None = typer.Option(None, "--state", help="running, awaiting or ended"),
    store: str | None = StoreOption,
) -> None:
    """List every thread's latest Run with its state and run status."""
    _cli(_runs)(state, store)


async def _runs(state: str | None, store: str | None) -> None:
    db = await _open(store)
    rows = await db.list_runs(state)
    await db.close()
    table = Table(title=f"{len(rows)} runs")
    for column in ("thread", "run", "state", "end", "status", "since", "version"):
        table.add_column(column)
    for r in rows:
        status = r.status.state + (f" ({r.status.reason})" if r.status.reason else "")
        table.add_row(
            r.thread_id,
            r.run_id,
            r.state,
            r.cause or "",
            status,
            _when(r.status.since),
            str(r.version),
        )
    console.print(table)


@app.command()
def show(thread: str = typer.Argument(...), store: str | None = StoreOption) -> None:
    """Show a thread: transcript, tool-batch phases per commit, and run status."""
    _cli(_show)(thread, store)


async def _show(thread: str, store: str | None) -> None:
    db = await _open(store)
    frontier = await db.load(ThreadId(thread))
    records = await db.read(ThreadId(thread))
    await db.close()
    if not records:
        raise RatchetError(f"thread {thread!r} has no commits in {redact(store_url_from(store))}")
    console.rule(f"thread {thread}")
    for message in frontier.messages:
        console.print(_message_line(message), highlight=False)
    console.rule("commits")
    for record in records:
        c = record.commit
        console.print(
            f"[dim]{record.seq:>3}[/dim] {c.label:<10} {c.disposition.kind}", highlight=False
        )
        for call in c.batch.calls if c.batch else ():
            console.print(f"      {call.call_id} {call.tool}: {phase_text(call)}", highlight=False)
    report = analyse(thread, records)
    console.rule("status")
    s = frontier.status
    state = frontier.run_state
    where = state.cause.kind if isinstance(state, EndedState) else state.kind if state else "-"
    if isinstance(state, AwaitingState):
        where += f" ({state.ticket.payload_kind}, correlation {state.ticket.correlation})"
    console.print(f"run {frontier.run_id}: {where}")
    console.print(f"status: {s.state} reason={s.reason} since={_when(s.since)}")
    history = " → ".join(f"{a}({b})" if b else a for a, b in report.statuses)
    console.print(f"status history: {history}", highlight=False)


def _message_line(message: Any) -> str:
    if isinstance(message, UserMessage):
        return f"[bold cyan]user[/]: {message.text}"
    if isinstance(message, AssistantMessage):
        calls = ", ".join(f"{c.tool}({c.arguments})" for c in message.tool_calls)
        return f"[bold green]assistant[/]: {message.text}" + (
            f"  [dim]→ {calls}[/]" if calls else ""
        )
    if isinstance(message, ToolResultMessage):
        tag = "[red]tool error[/]" if message.is_error else "[yellow]tool[/]"
        return f"{tag} {message.tool} ({message.call_id}): {message.content}"
    return str(message)


async def _open(store: str | None) -> Any:
    url = store_url_from(store)
    try:
        return await open_store(url)
    except RatchetError:
        raise
    except OSError as exc:
        raise ClusterUnavailable(f"cannot open store {redact(url)}: {exc}") from exc


def _when(since_us: int) -> str:
    if not since_us:
        return "-"
    return dt.datetime.fromtimestamp(since_us / 1e6, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


if __name__ == "__main__":
    app()
