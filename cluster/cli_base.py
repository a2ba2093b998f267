"""What every ``ratchet`` command shares: its async wrapper (an expected failure is one
line on stderr and exit code 1), the stderr console, and opening the store it reads.

The command modules (``cluster.cli`` and the ``cli_*`` modules it registers, and
``edge.cli``) import these from here, not from each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, BinaryIO, TypeVar

import typer

from cluster.cli_args import BadInput
from cluster.cli_view import Terminal, escape
from cluster.config import ClusterUnavailable, store_url_from
from runtime.commit import Frontier
from runtime.errors import RatchetError
from runtime.history_format import MAX_LINE_BYTES
from runtime.ids import ThreadId
from runtime.limits import DEFAULT_LIMITS, Limits
from storage.url import UnsupportedStoreUrl, open_store, redact

errors = Terminal(stderr=True)
T = TypeVar("T")


def as_command(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., None]:
    """Run an async command; expected failures become one line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            asyncio.run(fn(*args, **kwargs))
        except (
            RatchetError,
            ClusterUnavailable,
            UnsupportedStoreUrl,
            TimeoutError,
            BadInput,
        ) as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader left (``| head``): nothing more to say
            quiet_stdout()
            raise typer.Exit(141) from None

    return wrapper


async def uncancelled(closing: Awaitable[T]) -> T:
    """``closing`` run to its end though the task awaiting it is cancelled meanwhile; the
    cancellation is raised after. ``ratchet serve`` stopped with Ctrl-C: uvicorn shuts
    down, then raises the SIGINT again, and asyncio's handler cancelled the client's
    close at its first await, so the lease was not given up and the next cluster on the
    store waited it out. (A close is bounded: ``cluster.letting_go.GIVE_UP_S`` and the
    store's deadlines.)"""
    task = asyncio.ensure_future(closing)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # it was cancelled itself, not the task awaiting it
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


async def frontier_of(thread: str, store: str | None, db: Any = None) -> Frontier:
    """The thread's frontier; an unknown thread is one clear error."""
    own = db is None
    db = db if db is not None else await open_db(store)
    try:
        frontier: Frontier = await db.load(ThreadId(thread))
    finally:
        if own:
            await db.close()
    if frontier.version == 0:
        raise RatchetError(f"thread {thread!r} has no commits in {redact(store_url_from(store))}")
    return frontier


def lines_of(source: BinaryIO, name: str, longest: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """An export a line at a time, each read no further than a line may be long
    (``longest``: ``runtime.history_format.line_bytes``): a line that breaks a rule is
    refused before the rest is read (all of it was read first: ``/dev/zero`` filled the
    memory, a stream of garbage never ended)."""
    try:
        while line := source.readline(longest + 3):
            yield line
    except OSError as exc:
        raise BadInput(f"cannot read {name}: {exc}") from None


DEFAULTS_SAID = "default limits"
LIMITS_ADDRESS_HELP = (
    "Ray cluster the store's system runs on: held to the limits it runs with (default: "
    "RAY_ADDRESS; with neither, no Ray: the default limits)"
)


async def running_limits(store: str | None, address: str | None) -> Limits:
    """The limits of the store's system as it runs (``system_limits``)."""
    return (await system_limits(store, address))[0]


async def system_limits(store: str | None, address: str | None) -> tuple[Limits, str]:
    """The limits of the store's system as it runs on the Ray cluster at ``address``, else
    RAY_ADDRESS's (joined as ``Ratchet.connect`` joins it; nothing of the system is
    started: ``cluster.joining``), and what they are, for the user: ``DEFAULTS_SAID`` (no
    cluster named and none joined: no Ray is asked; or no system running there, which
    the command line starts with the defaults), else the running system's. One rule for
    every command that holds what it writes or shows to a system's limits (``run``,
    ``resume``, ``fork``, ``import``, ``show``): a fork or an import held to the defaults
    while ``run`` joined the system through RAY_ADDRESS refused what that system takes
    (a long thread id, a long history) and took what it refuses."""
    import ray

    from actors.wire import SystemSpec
    from cluster.config import connect_ray, system_name
    from cluster.joining import running_spec

    if address is None and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        return DEFAULT_LIMITS, DEFAULTS_SAID  # a Ray started here runs no system yet
    url = store_url_from(store)
    connect_ray(address, quiet=True)
    spec = SystemSpec(system_name(url), url)
    running = await running_spec(spec.supervisor_name)
    if running is None:
        return DEFAULT_LIMITS, f"{DEFAULTS_SAID}: system {spec.name} is not running"
    return running.limits, f"the limits system {spec.name} runs with"


async def shown_limits(store: str | None, address: str | None) -> tuple[Limits, str]:
    """``system_limits`` for a command that only shows them: a cluster that does not
    answer costs it the system's limits (the defaults, saying why), not the command."""
    try:
        return await system_limits(store, address)
    except ClusterUnavailable as exc:
        return DEFAULT_LIMITS, f"{DEFAULTS_SAID}: {exc}"


async def open_db(store: str | None, *, existing: bool = True) -> Any:
    """The store the command reads; ``existing``: the store must be there already (a
    command that only reads, or writes into a thread, never makes a store at a mistyped
    path or URL: no SQLite file or its directories, no schema in a database)."""
    return await open_store(store_url_from(store), create=not existing)
