"""Waiting out a store outage: the one retry loop of every reader that must not take
an outage for an answer (a follower, a client's wait, an edge route's read-back)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from runtime.errors import StoreUnavailable

T = TypeVar("T")
FIRST_S = 0.02
MOST_S = 0.5


async def patiently(
    op: Callable[[], Awaitable[T]], give_up_s: float = 60.0, log: logging.Logger | None = None
) -> T:
    """Retry ``op`` while the store is unavailable, up to ``give_up_s``: a store outage
    pauses a reader (as it pauses Runs); it is not an answer. ``log``: where each retry
    is told (at INFO)."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + give_up_s, FIRST_S
    while True:
        try:
            return await op()
        except StoreUnavailable as exc:
            if loop.time() > deadline:
                raise
            if log is not None:
                log.info("store unavailable (%s): asking again", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MOST_S)
