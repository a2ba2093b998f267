"""User code that hangs, and user code that also swallows every cancellation it is sent
(a hook, a session's handler): what the engine must not be held by."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from runtime.commit import Frontier
from runtime.ids import ThreadId
from runtime.runner import InProcessRunner


def hanging(
    entered: asyncio.Event, released: asyncio.Event, *, swallows: bool = True
) -> Callable[[Any], Awaitable[str]]:
    """An async callable that sets ``entered`` and waits for ever; with ``swallows`` it
    catches each cancellation and waits again, until ``released`` is set (a test sets it
    at its end, so that the event loop's last cancellation ends it)."""

    async def hang(_: Any) -> str:
        entered.set()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not swallows or released.is_set():
                    raise

    return hang


async def stopped_once_entered(
    runner: InProcessRunner, entered: asyncio.Event, released: asyncio.Event
) -> Frontier:
    """Start a Run on a new thread ``t``, stop it once the hanging code is ``entered``;
    the Run as it ended. ``released`` is set at the end, whatever happened."""
    engine = runner.engine()
    run = asyncio.ensure_future(engine.start(ThreadId("t"), "go", new_thread=True))
    await asyncio.wait_for(entered.wait(), 10)
    engine.stop("operator stop")
    try:
        return await asyncio.wait_for(run, 10)
    finally:
        released.set()  # the code left behind takes the loop's last cancellation
