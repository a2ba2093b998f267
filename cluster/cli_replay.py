"""``ratchet replay``: the replay check for upgrades (``runtime.replay_check``), on the
store directly (no Ray).

    ratchet replay THREAD --agent MODULE:ATTR [--store URL] [--export FILE] [--json]

Re-runs THREAD's recorded decisions against the current code of the agent, feeding back
the committed model responses, tool outcomes and resumes (no model is asked, no tool
runs), and compares each commit the code makes with the recorded one. Exit code 0: the
thread replays cleanly; 1: the first divergence, as one line on stderr (bad input is
one line too). ``--json`` prints the report (``ReplayReport``) as one JSON object.

``register(app)`` adds the command to a Typer app.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from cluster.cli_args import BadInput, text_arg, thread_arg
from cluster.cli_base import as_command, errors, lines_of, open_db
from cluster.cli_json import emit
from cluster.cli_view import console
from runtime.agent import load_agent
from runtime.replay_check import ReplayReport, Source, replay

_STORE_HELP = "Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"


def register(app: typer.Typer) -> None:
    """Add ``replay`` to ``app``."""
    app.command("replay")(replay_command)


def replay_command(
    thread: str = typer.Argument(..., callback=thread_arg, help="The recorded thread"),
    agent: str = typer.Option(
        ...,
        "--agent",
        metavar="MODULE:ATTR",
        help="The agent's current code, by reference",
        callback=text_arg,
    ),
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
    export: str | None = typer.Option(
        None, "--export", metavar="FILE", help="Read the thread from an export, not the store"
    ),
    as_json: bool = typer.Option(False, "--json", help="The report as one JSON object"),
) -> None:
    """Replay THREAD's recorded decisions against AGENT's current code, without effects.

    Exit 0 if every commit the code makes agrees with the recording; 1 with the first
    divergence (seq, what, expected, got) on stderr."""
    as_command(_replay)(thread, agent, store, export, as_json)


async def _replay(
    thread: str, ref: str, store: str | None, export: str | None, as_json: bool
) -> None:
    if os.getcwd() not in sys.path:  # like python -m: the user's modules are importable
        sys.path.insert(0, os.getcwd())
    agent = load_agent(ref)  # a bad reference fails before the store is opened
    if export is not None:
        report = await replay(_exported(export), thread, agent, lineage=(ref,))
    else:
        db = await open_db(store)
        try:
            report = await replay(db, thread, agent, lineage=(ref,))
        finally:
            await db.close()
    _print(report, as_json)
    if report.divergence is not None:
        errors.print(f"diverged: {report.line()}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _exported(file: str) -> Source:
    from runtime.history_format import parse_export

    try:
        with Path(file).open("rb") as source:  # a line at a time, each bounded
            return list(parse_export(lines_of(source, file)).records)
    except OSError as exc:
        raise BadInput(f"cannot read {file}: {exc}") from None


def _print(report: ReplayReport, as_json: bool) -> None:
    if as_json:
        emit(report.model_dump(mode="json"))
        return
    if report.divergence is None:
        console.print(report.line(), markup=False, highlight=False, soft_wrap=True)
    for note in report.notes:
        text = f"note: run {note.run_id} step {note.step}: {note.text}"
        console.print(text, markup=False, highlight=False, soft_wrap=True)


__all__ = ["register", "replay_command"]
