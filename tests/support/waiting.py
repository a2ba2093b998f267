"""Waiting on a condition with a deadline: tests never sleep to synchronise."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def until(
    check: Callable[[], T | Awaitable[T]],
    timeout_s: float = 10.0,
    *,
    what: str = "the condition",
    interval_s: float = 0.005,
) -> T:
    """Poll ``check`` (plain or async) until it returns something true, and return that;
    AssertionError naming ``what`` once ``timeout_s`` has passed. ``interval_s`` 0 only
    yields to the event loop between polls (a condition other tasks of it make true)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(interval_s)
