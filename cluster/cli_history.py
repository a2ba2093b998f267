"""``ratchet fork``, ``ratchet export`` and ``ratchet import``: a thread's history
(``runtime.history``), on the store directly (no Ray).

    ratchet fork THREAD --at SEQ --to NEW   NEW starts as THREAD up to commit SEQ
    ratchet export THREAD [--out FILE]      the thread as JSON lines (stdout by default)
    ratchet import FILE [--as THREAD]       write an export as a new thread (FILE - : stdin)

``register(app)`` adds them to a Typer app. ``cluster.cli`` is imported only when a
command runs (for its ``_cli`` wrapper and store opening), so either module may be
imported first. A refusal is one line on stderr and exit code 1, as for every command.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import typer

from cluster.cli_args import BadInput, thread_arg
from cluster.cli_view import console, print_rest
from runtime.history import export, fork, import_thread
from runtime.ids import ThreadId

_STORE_HELP = "Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"


def register(app: typer.Typer) -> None:
    """Add ``fork``, ``export`` and ``import`` to ``app``."""
    app.command("fork")(fork_command)
    app.command("export")(export_command)
    app.command("import")(import_command)


def fork_command(
    thread: str = typer.Argument(..., callback=thread_arg, help="The thread to fork"),
    at: int = typer.Option(
        ..., "--at", metavar="SEQ", help="The commit (seq) to fork at: a Run ended there"
    ),
    to: str = typer.Option(
        ..., "--to", metavar="NEW", help="The new thread's id (must not exist)", callback=thread_arg
    ),
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Start thread NEW as THREAD's history up to commit SEQ, where its Run had ended.

    THREAD is not changed. A commit where a Run was running or awaiting is refused."""
    from cluster.cli import _cli

    _cli(_fork)(thread, at, to, store)


async def _fork(thread: str, at: int, to: str, store: str | None) -> None:
    db = await _opened(store)
    try:
        frontier = await fork(db, ThreadId(thread), at, ThreadId(to))
    finally:
        await db.close()
    console.print(
        f"forked thread {thread} at seq {at} to {to} ({frontier.version} commits)",
        highlight=False,
        soft_wrap=True,
    )
    print_rest(to, frontier, prefix="  ")


def export_command(
    thread: str = typer.Argument(..., callback=thread_arg, help="The thread to export"),
    out: str | None = typer.Option(
        None, "--out", metavar="FILE", help="Write to FILE (default: stdout)"
    ),
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Write THREAD as JSON lines: a header, then each committed record as stored."""
    from cluster.cli import _cli

    _cli(_export)(thread, None if out is None else Path(out), store)


async def _export(thread: str, out: Path | None, store: str | None) -> None:
    db = await _opened(store)
    try:
        lines = await export(db, ThreadId(thread))
    finally:
        await db.close()
    if out is None:
        _write_lines(lines, _stdout())
        return
    # a file named FILE is whole: written under a name of its own (created exclusively,
    # so two exports to one FILE never write into each other, nor through a planted
    # link), then renamed
    try:
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    except OSError as exc:
        raise BadInput(f"cannot write {out}: {exc}") from None
    try:
        with os.fdopen(fd, "wb") as sink:
            _write_lines(lines, sink)
        os.replace(name, out)
    except OSError as exc:
        raise BadInput(f"cannot write {out}: {exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _write_lines(lines: Iterable[str], sink: BinaryIO) -> None:
    for line in lines:
        sink.write(line.encode() + b"\n")
    sink.flush()


def _stdout() -> BinaryIO:
    sys.stdout.flush()
    buffer: BinaryIO | None = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        raise BadInput("stdout takes no bytes here: give --out FILE")
    return buffer


def import_command(
    file: str = typer.Argument(..., help="An export (ratchet export), or - for stdin"),
    as_thread: str | None = typer.Option(
        None,
        "--as",
        metavar="THREAD",
        help="The new thread's id (default: the exported one; must not exist)",
        callback=thread_arg,
    ),
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Write an exported thread (FILE) into the store as a new thread.

    Every line is checked first: nothing is written unless all of it holds."""
    from cluster.cli import _cli

    _cli(_import)(file, as_thread, store)


async def _import(file: str, as_thread: str | None, store: str | None) -> None:
    lines = _read_lines(file)  # unreadable input fails before the store is opened
    db = await _opened(store, existing=False)  # a fixture into a new store, say
    try:
        frontier = await import_thread(
            db, lines, None if as_thread is None else ThreadId(as_thread)
        )
    finally:
        await db.close()
    thread = frontier.thread_id
    console.print(
        f"imported thread {thread} ({frontier.version} commits) from {file}",
        highlight=False,
        soft_wrap=True,
    )
    print_rest(thread, frontier, prefix="  ")


def _read_lines(file: str) -> list[bytes]:
    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as exc:
        raise BadInput(f"cannot read {file}: {exc}") from None
    return data.splitlines()


async def _opened(store: str | None, *, existing: bool = True) -> Any:
    from cluster.cli import _open

    return await _open(store, existing=existing)
