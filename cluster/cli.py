"""The ``ratchet`` command line.

    ratchet demo                      the README's main job: no set-up, one crash, a summary
    ratchet run MODULE:AGENT "input"  start a Run on the cluster and print its transcript
    ratchet runs                      every thread's latest Run: state, status, steps, agent
                                      (--state, --status, --agent, --failed; pages of
                                      --limit N (50), the next after --after CURSOR)
    ratchet show THREAD               transcript, tool-batch phases, status
    ratchet verify THREAD | --all     audit the store: hashes, the chain, the frontiers
    ratchet resume THREAD --approve   answer the Run's ticket (--deny, --input TEXT,
                                      --result JSON, --fire, --unpause, --expire)
    ratchet cancel THREAD             end the Run cancelled
    ratchet stop THREAD --reason TEXT end the Run stopped(reason)
    ratchet watch THREAD [--after O]  follow the live stream until the Run is at rest
    ratchet fork THREAD --at SEQ --to NEW  a new thread from a prefix of THREAD's log
    ratchet export THREAD [--out FILE]     the thread's log as JSON lines
    ratchet import FILE [--as THREAD]      a thread from an export (checked first)
    ratchet prune --ended-before DATE      remove the logs of Runs ended before DATE
    ratchet replay THREAD --agent M:A      re-run its decisions on this code; first divergence
    ratchet serve                     the HTTP service (edge/: REST, SSE, AG-UI)

``runs``, ``show``, ``verify``, ``watch``, ``fork``, ``export``, ``import``, ``prune`` and
``replay`` read the store (and the Redis bus) directly and need no Ray (``fork``,
``import`` and ``show``, given ``--address`` or RAY_ADDRESS, ask the system running
there for its limits, as ``run`` and ``resume`` do: ``cli_base.system_limits``). Every expected
failure (a bad import path, an unreachable store or cluster, an unknown thread, a
resume the ticket rejects, bad input) is one line on stderr and exit code 1, never a
traceback.

``runs``, ``show`` and ``watch`` take ``--json``: one JSON object per line, valid UTF-8
(``cluster.cli_json``). ``runs --json`` prints one object per thread
(``cluster.cli_runs.RunRow.json``) and last ``{"next": CURSOR or null}``; ``show
--json`` the thread's object, its messages and its commits (``cli_json.show_objects``);
``watch --json`` each stream frame as it arrives (``runtime.stream.Frame`` as JSON).
A reader that goes away (``| head``) ends the command quietly, exit code 141.
Thread and run ids are never cut, in any terminal width, so each pastes as printed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Literal

import typer

from cluster import cli_base
from cluster.cli_args import BadInput, awaiting_ticket, payload_from, text_arg, thread_arg
from cluster.cli_base import as_command, errors, frontier_of, open_db, running_limits, uncancelled
from cluster.cli_json import emit, show_objects
from cluster.cli_runs import DEFAULT_LIMIT, cursor, run_page, run_query, run_row
from cluster.cli_verify import verify_store
from cluster.cli_view import (
    WatchView,
    console,
    print_rest,
    print_runs,
    print_thread,
    run_tree,
)
from cluster.config import redis_url_from, store_url_from
from cluster.report import analyse
from runtime.agent import load_agent
from runtime.errors import RatchetError, ResumeEnded
from runtime.ids import ThreadId
from runtime.lifecycle import (
    EndedState,
    validate_resume,
)
from runtime.limits import check_id, check_text
from runtime.resume import check_command
from runtime.stream import check_cursor, parse_offset
from storage.url import redact

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Ratchet: durable agent Runs on Ray."
)

StoreOption = typer.Option(
    None, "--store", help="Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"
)
AddressOption = typer.Option(
    None, "--address", help="Ray cluster address (default: RAY_ADDRESS or local)"
)
RedisOption = typer.Option(
    None, "--redis", help="Redis URL of the live bus (default: RATCHET_REDIS_URL, or none)"
)
JsonOption = typer.Option(False, "--json", help="One JSON object per line, for scripts")


@app.command()
def demo(
    runs: int = typer.Option(24, "--runs", "-n", min=1, max=2000, help="Concurrent Runs"),
    store: str | None = StoreOption,
    crash: bool = typer.Option(True, "--crash/--no-crash", help="Crash one host midway"),
) -> None:
    """Launch concurrent Runs of a scripted agent on local Ray; crash a host; summarise."""
    as_command(_demo)(runs, store, crash)


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
    agent: str = typer.Argument(..., help="The agent as MODULE:ATTR", callback=text_arg),
    text: str = typer.Argument(..., help="The user's input", callback=text_arg),
    thread: str | None = typer.Option(
        None, "--thread", help="Thread id (default: a new one)", callback=thread_arg
    ),
    placement: str = typer.Option("hosted", "--placement", help="hosted or dedicated"),
    store: str | None = StoreOption,
    address: str | None = AddressOption,
    redis: str | None = RedisOption,
) -> None:
    """Start a Run of AGENT with TEXT and wait until it ends or awaits input."""
    if placement not in ("hosted", "dedicated"):
        errors.print("[red]error:[/red] --placement must be hosted or dedicated")
        raise typer.Exit(2)
    as_command(_run)(agent, text, thread, placement, store, address, redis)


async def _run(
    agent: str,
    text: str,
    thread: str | None,
    placement: Literal["hosted", "dedicated"],
    store: str | None,
    address: str | None,
    redis: str | None = None,
) -> None:
    from cluster.client import Ratchet

    if os.getcwd() not in sys.path:  # like python -m: the user's modules are importable
        sys.path.insert(0, os.getcwd())
    load_agent(agent)  # a bad import path fails before any cluster is started
    # and input the system refuses, before it is started (or joined): by the limits it
    # runs with, if it is running (``cluster.joining``), else the defaults it starts with
    redis_url_from(redis)  # a URL that cannot be read: refused before Ray starts
    limits = await running_limits(store, address)
    check_text("input", text, limits.input_bytes, "input_bytes")
    if thread is not None:
        check_id("thread id", thread, limits)
    client = await Ratchet.connect(address, store, redis, quiet=True)
    try:  # a start refused (bad input, say) gives the lease up too: the next run waits not
        handle = await client.start(agent, text, thread_id=thread, placement=placement)
        console.print(f"run {handle.run_id} on thread {handle.thread_id}", markup=False)
        await handle.result()
        await _show(handle.thread_id, store, False, address)
    finally:
        await uncancelled(client.close())  # a second Ctrl-C does not cut the close short


@app.command()
def runs(
    state: str | None = typer.Option(None, "--state", help="running, awaiting or ended"),
    status: str | None = typer.Option(
        None, "--status", help="idle, running or failed: the thread's run status"
    ),
    agent: str | None = typer.Option(
        None,
        "--agent",
        help="Only Runs started with this agent reference (MODULE:ATTR)",
        callback=text_arg,
    ),
    failed: bool = typer.Option(
        False, "--failed", help="Only Runs that ended failed (dead letters among them)"
    ),
    limit: int = typer.Option(DEFAULT_LIMIT, "--limit", help="At most this many threads"),
    after: str | None = typer.Option(
        None, "--after", help="The next page: the cursor the last page printed"
    ),
    as_json: bool = JsonOption,
    store: str | None = StoreOption,
) -> None:
    """List every thread's latest Run, in thread-id order, a page at a time."""
    as_command(_runs)((state, status, agent, failed, limit, after), as_json, store)


async def _runs(flags: tuple[Any, ...], as_json: bool, store: str | None) -> None:
    query = run_query(*flags)  # bad input fails before the store is opened
    db = await open_db(store)
    try:
        rows, last = await run_page(db, query)
    finally:
        await db.close()
    next_cursor = None if last is None else cursor(last)
    if as_json:
        for row in rows:
            emit(row.json())
        emit({"next": next_cursor})
        return
    print_runs(rows, next_cursor)


@app.command()
def show(
    thread: str = typer.Argument(..., callback=thread_arg),
    as_json: bool = JsonOption,
    store: str | None = StoreOption,
    address: str | None = typer.Option(None, "--address", help=cli_base.LIMITS_ADDRESS_HELP),
) -> None:
    """Show a thread: transcript, tool-batch phases per commit, and run status."""
    as_command(_show)(thread, store, as_json, address)


async def _show(thread: str, store: str | None, as_json: bool, address: str | None) -> None:
    limits, said = await cli_base.shown_limits(store, address)
    db = await open_db(store)
    frontier = await db.load(ThreadId(thread))
    records = await db.read(ThreadId(thread))
    tree = await run_tree(db, frontier)
    await db.close()
    row = run_row(frontier)
    if not records or row is None:
        if frontier.version:  # a frontier whose every record was pruned
            raise RatchetError(
                f"thread {thread!r} keeps no records: pruned through seq {frontier.version}"
                f" (its last Run, {frontier.run_id}, ended {frontier.status.reason})"
            )
        raise RatchetError(f"thread {thread!r} has no commits in {redact(store_url_from(store))}")
    report = analyse(thread, records)
    if as_json:
        for obj in show_objects(row.json(), frontier, records, report, limits):
            emit(obj)
        return
    print_thread(frontier, records, report, tree, (limits, said))


@app.command()
def verify(
    thread: str | None = typer.Argument(None, callback=thread_arg, help="The thread to audit"),
    every: bool = typer.Option(False, "--all", help="Audit every thread of the store"),
    store: str | None = StoreOption,
) -> None:
    """Audit stored threads: each record against its hash, the hash chain, seq continuity,
    the frontier against its checksum and against a replay of its log. Exits 1 naming
    each bad thread and seq."""
    as_command(verify_store)(thread, every, store)


# ---- control: resume, cancel, stop, watch -----------------------------------------------


@app.command()
def resume(
    thread: str = typer.Argument(..., callback=thread_arg, help="The thread whose Run awaits"),
    approve: bool = typer.Option(False, "--approve", help="Grant the permission it waits for"),
    deny: bool = typer.Option(False, "--deny", help="Refuse it (the model sees 'blocked')"),
    note: str = typer.Option(
        "", "--note", help="A note with --approve or --deny", callback=text_arg
    ),
    text: str | None = typer.Option(
        None, "--input", help="Text for a Run awaiting user input", callback=text_arg
    ),
    result: str | None = typer.Option(
        None,
        "--result",
        help="JSON output of a client-executed tool (a string stays as is)",
        callback=text_arg,
    ),
    is_error: bool = typer.Option(False, "--error", help="With --result: the tool failed"),
    fire: bool = typer.Option(False, "--fire", help="Fire the scheduled action it waits for"),
    unpause: bool = typer.Option(False, "--unpause", help="Continue a paused Run"),
    expire: bool = typer.Option(False, "--expire", help="End a tool wait past its deadline"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the Run rests again"),
    store: str | None = StoreOption,
    address: str | None = AddressOption,
    redis: str | None = RedisOption,
) -> None:
    """Answer the ticket of THREAD's awaiting Run with exactly one payload flag."""
    as_command(_resume)(
        thread,
        (approve, deny, note, text, result, is_error, fire, unpause, expire),
        wait,
        store,
        address,
        redis,
    )


async def _resume(
    thread: str,
    flags: tuple[Any, ...],
    wait: bool,
    store: str | None,
    address: str | None,
    redis: str | None,
) -> None:
    from cluster.client import Ratchet, command_for

    payload = payload_from(flags)
    frontier = await frontier_of(thread, store)
    ticket = awaiting_ticket(frontier)
    command = command_for(ticket, payload)
    # a wrong flag fails here, before any cluster; the deadline, and what follows it on a
    # ticket that has one, are the host's to judge by its clock (``validate_resume``)
    validate_resume(ticket, command, None)
    # a payload the system refuses, before it is started (or joined): as ``_run``'s input
    check_command(command, await running_limits(store, address))
    client = await Ratchet.connect(address, store, redis, quiet=True)
    try:
        handle = client.handle(thread)
        try:
            await handle.resume(command)
        except ResumeEnded:  # taken, but what resuming writes is past the thread's limits
            ended = await client.handle(thread, ticket.run_id).view()  # as its end left it
            print_rest(thread, ended, "the resume could not land: ")
            raise typer.Exit(1) from None
        console.print(
            f"resumed run {ticket.run_id} on thread {thread}: {payload.kind}",
            markup=False,
            highlight=False,
        )
        if wait:
            print_rest(thread, await handle.result())
    finally:
        await client.close()


@app.command()
def cancel(
    thread: str = typer.Argument(..., callback=thread_arg),
    store: str | None = StoreOption,
    address: str | None = AddressOption,
    redis: str | None = RedisOption,
) -> None:
    """Cancel THREAD's Run: a live one at its next check, an awaiting one at once."""
    as_command(_control)(thread, None, store, address, redis)


@app.command()
def stop(
    thread: str = typer.Argument(..., callback=thread_arg),
    reason: str = typer.Option(
        ..., "--reason", help="Recorded as stopped(reason)", callback=text_arg
    ),
    store: str | None = StoreOption,
    address: str | None = AddressOption,
    redis: str | None = RedisOption,
) -> None:
    """End THREAD's Run stopped(REASON)."""
    if not reason.strip():
        errors.print("[red]error:[/red] --reason must not be empty", highlight=False)
        raise typer.Exit(1)
    as_command(_control)(thread, reason, store, address, redis)


async def _control(
    thread: str, reason: str | None, store: str | None, address: str | None, redis: str | None
) -> None:
    from cluster.client import Ratchet

    frontier = await frontier_of(thread, store)
    if isinstance(frontier.run_state, EndedState):
        print_rest(thread, frontier, prefix="nothing to do: ")
        return
    client = await Ratchet.connect(address, store, redis, quiet=True)
    try:
        handle = client.handle(thread, frontier.run_id)  # that Run, never a later one
        outcome = await (handle.cancel() if reason is None else handle.stop(reason))
        if outcome == "not_running":
            print_rest(thread, await handle.frontier(), prefix="nothing to do: ")
            return
        print_rest(thread, await handle.result())
    finally:
        await client.close()


@app.command()
def watch(
    thread: str = typer.Argument(..., callback=thread_arg),
    after: str | None = typer.Option(
        None, "--after", help="Only facts after this offset SEQ:INDEX (as printed)"
    ),
    as_json: bool = JsonOption,
    store: str | None = StoreOption,
    redis: str | None = RedisOption,
) -> None:
    """Follow THREAD live: status frames, facts and streamed text, until the Run rests."""
    as_command(_watch)(thread, after, store, redis, as_json)


async def _watch(
    thread: str, after: str | None, store: str | None, redis: str | None, as_json: bool = False
) -> None:
    from cluster.stream import StreamText, follow_thread

    try:
        parse_offset(after)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    bus = redis_url_from(redis)  # a URL that cannot be read is refused before the store opens
    db = await open_db(store)
    try:
        try:
            check_cursor(after, (await frontier_of(thread, store, db)).version)
        except ValueError as exc:  # past the thread's last commit: another thread's cursor
            raise BadInput(str(exc)) from None
        frames = follow_thread(db, ThreadId(thread), after, redis_url=bus)
        async with contextlib.aclosing(frames):
            if as_json:  # each frame as the stream serves it, and nothing else
                async for frame in frames:
                    emit(frame.model_dump(mode="json"))
                return
            view = WatchView(StreamText())
            async for frame in frames:
                view.show(frame)
            view.close_line()
        print_rest(thread, await db.load(ThreadId(thread)), prefix="at rest: ")
    finally:
        await db.close()


def _register_bench() -> None:
    from benchmarks.load import bench_command

    app.command(
        "bench", help="Load-test: workload W1 with a no-durability baseline in the same run."
    )(bench_command)


_register_bench()


def _register_history() -> None:
    from cluster.cli_history import register
    from cluster.cli_prune import register as register_prune
    from cluster.cli_replay import register as register_replay

    register(app)
    register_prune(app)
    register_replay(app)


_register_history()


def _register_serve() -> None:
    from edge.cli import serve  # imports no web framework until the command runs

    app.command("serve")(serve)


_register_serve()

if __name__ == "__main__":
    app()
