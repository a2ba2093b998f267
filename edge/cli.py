"""``ratchet serve``: the HTTP service, as a typer command that ``cluster.cli`` registers.

Nothing heavy is imported until the command runs (``ratchet --help`` stays fast), and
the auth rule (``edge.options``) is checked before anything is: ``--no-auth`` off a
loopback address is refused at once, before Ray or the web framework load.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from cluster.cli_base import as_command, uncancelled
from edge.options import TOKENS_ENV, ServeOptions, ServeRefused, tokens_from


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind"),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to bind"),
    store: str | None = typer.Option(
        None, "--store", help="Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"
    ),
    redis: str | None = typer.Option(
        None, "--redis", help="Redis URL of the live bus (default: RATCHET_REDIS_URL, or none)"
    ),
    address: str | None = typer.Option(
        None, "--address", help="Ray cluster address (default: RAY_ADDRESS or local)"
    ),
    token: Annotated[
        list[str] | None,
        typer.Option(
            "--token",
            help=f"A bearer token callers must send (repeatable; also {TOKENS_ENV}, "
            "comma-separated)",
        ),
    ] = None,
    no_auth: bool = typer.Option(
        False, "--no-auth", help="Require no token: only on a loopback --host"
    ),
    cors_origin: Annotated[
        list[str] | None,
        typer.Option("--cors-origin", help="An origin CORS allows (repeatable; default: CORS off)"),
    ] = None,
    agent: Annotated[
        list[str] | None,
        typer.Option(
            "--agent",
            help="The only agents (MODULE:ATTR) callers may start (repeatable; one, or "
            "--any-agent, is required)",
        ),
    ] = None,
    any_agent: bool = typer.Option(
        False,
        "--any-agent",
        help="Let callers start any agent the server can import (loading a reference runs "
        "its module's code: only for trusted callers)",
    ),
    max_streams: int = typer.Option(
        256, "--max-streams", min=1, help="Streams open at once; one more is 503 TooManyStreams"
    ),
    hosts: int | None = typer.Option(
        None, "--hosts", min=1, help="RunHost actors of a system it starts (default 2)"
    ),
    executors: int | None = typer.Option(
        None, "--executors", min=1, help="ToolExecutor actors of a system it starts (default 2)"
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level"),
) -> None:
    """Serve the Runs of a Ratchet system over HTTP: REST, SSE and AG-UI streams.

    Every request needs `Authorization: Bearer TOKEN` with one of the tokens, unless the
    server runs with --no-auth on a loopback address. The OpenAPI schema is at
    /openapi.json.
    """
    options = ServeOptions(
        host=host,
        port=port,
        tokens=tokens_from(token or ()),
        no_auth=no_auth,
        cors_origins=tuple(cors_origin or ()),
        max_streams=max_streams,
    )
    connect = {"address": address, "store": store, "redis": redis}
    agents = tuple(agent or ()) if not any_agent else None
    as_command(_serve)(options, connect, agents, (hosts, executors), log_level)


async def _serve(
    options: ServeOptions,
    connect: dict[str, str | None],
    agents: tuple[str, ...] | None,
    pool: tuple[int | None, int | None],
    log_level: str,
) -> None:
    from cluster.cli_args import BadInput

    try:
        options = options.checked()
    except ServeRefused as exc:
        raise BadInput(str(exc)) from None
    if agents == ():  # loading a reference runs its module's code: allow none by default
        raise BadInput(
            "name the agents callers may start (--agent MODULE:ATTR, repeatable), "
            "or pass --any-agent"
        )
    try:
        import uvicorn

        from edge.app import create_app
        from edge.timely import TimelyH11
    except ImportError as exc:  # the base install has no web framework
        raise BadInput(
            f"ratchet serve needs the serve extra ({exc.name} is missing): "
            "pip install -e '.[serve]'"
        ) from None

    from actors.heap import freeze_startup_heap
    from cluster.client import Ratchet
    from runtime.agent import load_agent

    if os.getcwd() not in sys.path:  # as `ratchet run`: the user's modules are importable
        sys.path.insert(0, os.getcwd())
    for ref in agents or ():
        load_agent(ref)  # an allowed agent that cannot be imported fails now, not per call
    client = await Ratchet.connect(
        connect["address"],
        connect["store"],
        connect["redis"],
        hosts=pool[0],
        executors=pool[1],
        quiet=True,
    )
    try:
        app = create_app(client, options, agents=agents or ())
        freeze_startup_heap()  # Ray's client, FastAPI, the agents: out of every collection
        config = uvicorn.Config(
            app, host=options.host, port=options.port, log_level=log_level, http=TimelyH11
        )
        try:
            await uvicorn.Server(config).serve()
        except SystemExit as exc:
            # uvicorn shuts down on SIGTERM, then raises it again, and Ray's driver handler
            # makes it SystemExit(15): a stop asked for (a service manager's), so the
            # client closes and the command exits 0, not 15
            if exc.code != signal.SIGTERM:
                raise
    finally:
        await uncancelled(client.close())  # the SIGINT uvicorn raises again lands here


__all__ = ["serve"]
