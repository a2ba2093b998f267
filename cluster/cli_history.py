"""``ratchet fork``, ``ratchet export`` and ``ratchet import``: a thread's history
(``runtime.history``), on the store directly. A fork and an import are held to the
limits the store's system runs with on the Ray cluster ``--address`` (else RAY_ADDRESS)
names, as ``ratchet run`` is; with neither, no Ray is asked and they are held to the
defaults (``cli_base.system_limits``).

    ratchet fork THREAD --at SEQ --to NEW   NEW starts as THREAD up to commit SEQ
    ratchet export THREAD [--out FILE]      the thread as JSON lines (stdout by default)
    ratchet import FILE [--as THREAD]       write an export as a new thread (FILE - : stdin)
    ... [--address ADDRESS]                 fork, import: the running system's limits
                                            (default: RAY_ADDRESS; neither: the defaults)

``register(app)`` adds them to a Typer app. A refusal is one line on stderr and exit
code 1, as for every command.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import typer

from cluster.cli_args import BadInput, thread_arg
from cluster.cli_base import (
    LIMITS_ADDRESS_HELP,
    as_command,
    lines_of,
    open_db,
    quiet_stdout,
    running_limits,
)
from cluster.cli_view import console, print_rest
from runtime.commit import DEFAULT_PAYLOAD_LIMIT
from runtime.history import export, fork, plan_import, write_import
from runtime.history_format import line_bytes
from runtime.ids import ThreadId

_STORE_HELP = "Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"
_ADDRESS_HELP = LIMITS_ADDRESS_HELP


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
    address: str | None = typer.Option(None, "--address", help=_ADDRESS_HELP),
) -> None:
    """Start thread NEW as THREAD's history up to commit SEQ, where its Run had ended.

    THREAD is not changed. A commit where a Run was running or awaiting is refused."""
    as_command(_fork)(thread, at, to, store, address)


async def _fork(thread: str, at: int, to: str, store: str | None, address: str | None) -> None:
    limits = await running_limits(store, address)
    db = await _opened(store)
    try:
        frontier = await fork(db, ThreadId(thread), at, ThreadId(to), limits)
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
    as_command(_export)(thread, None if out is None else Path(out), store)


async def _export(thread: str, out: Path | None, store: str | None) -> None:
    db = await _opened(store)
    try:
        lines = await export(db, ThreadId(thread))
    finally:
        await db.close()
    if out is None:
        try:
            _write_lines(lines, _stdout())
        except BrokenPipeError:  # the reader left (``| head``): as_command says nothing
            raise
        except OSError as exc:  # a full disk, say
            quiet_stdout()  # what the write left buffered fails no second time at exit
            raise BadInput(f"cannot write stdout: {exc}") from None
        return
    try:
        _write_file(lines, out)
    except OSError as exc:
        raise BadInput(f"cannot write {out}: {exc}") from None


def _write_file(lines: Iterable[str], out: Path) -> None:
    """FILE whole: written under a name of its own beside it (created exclusively, so two
    exports to one FILE never write into each other, nor through a planted link), then
    renamed over it, keeping its mode. Through a link, the file it names is replaced
    and the link stays. A device or a pipe (``/dev/stdout``, ``/dev/null``) is written
    as a shell's ``>`` writes it: renaming over one replaced it with a file."""
    try:
        info: os.stat_result | None = os.stat(out)  # through links
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "it is a directory")
    if info is not None and not stat.S_ISREG(info.st_mode):
        with open(out, "wb") as sink:
            _write_lines(lines, sink)
        return
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    fd, name = _partial(target)
    try:
        if info is not None:
            os.fchmod(fd, stat.S_IMODE(info.st_mode))
        with os.fdopen(fd, "wb") as sink:
            _write_lines(lines, sink)
        os.replace(name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _partial(target: Path) -> tuple[int, str]:
    """A new file beside ``target``, made with the mode a new file gets here (0666 less
    the umask; ``mkstemp`` makes 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        name = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.partial")
        try:
            return os.open(name, flags, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free name for the partial file", str(target))


def _write_lines(lines: Iterable[str], sink: BinaryIO) -> None:
    for line in lines:
        sink.write(line.encode() + b"\n")
    sink.flush()


def _stdout() -> BinaryIO:
    if sys.stdout is None:  # closed (>&-)
        raise BadInput("stdout is closed: give --out FILE")
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
    address: str | None = typer.Option(None, "--address", help=_ADDRESS_HELP),
) -> None:
    """Write an exported thread (FILE) into the store as a new thread.

    Every line is checked first: nothing is written unless all of it holds."""
    as_command(_import)(file, as_thread, store, address)


async def _import(file: str, as_thread: str | None, store: str | None, address: str | None) -> None:
    # held to the store's system's limits (``system_limits``) and to the payload limit
    # every store it opens has (``open_db``: the default, as a cluster's stores)
    limits = await running_limits(store, address)
    longest = line_bytes(DEFAULT_PAYLOAD_LIMIT)
    with _opened_input(file) as source:  # input refused before the store is opened (made)
        target = None if as_thread is None else ThreadId(as_thread)
        lines = lines_of(source, file, longest)
        plan = plan_import(lines, target, limits, DEFAULT_PAYLOAD_LIMIT)
    db = await _opened(store, existing=False)  # a fixture into a new store, say
    try:
        frontier = await write_import(db, plan)
    finally:
        await db.close()
    thread = frontier.thread_id
    console.print(
        f"imported thread {thread} ({frontier.version} commits) from {file}",
        highlight=False,
        soft_wrap=True,
    )
    print_rest(thread, frontier, prefix="  ")


@contextlib.contextmanager
def _opened_input(file: str) -> Iterator[BinaryIO]:
    if file == "-":
        stdin: BinaryIO | None = getattr(sys.stdin, "buffer", None)  # None: closed (<&-)
        if stdin is None:
            raise BadInput("cannot read -: stdin is closed")
        yield stdin
        return
    try:
        source = open(file, "rb")  # noqa: SIM115  (closed below, after the import)
    except OSError as exc:
        raise BadInput(f"cannot read {file}: {exc}") from None
    with source:
        yield source


async def _opened(store: str | None, *, existing: bool = True) -> Any:
    return await open_db(store, existing=existing)
