"""A dedicated RunHost's retirement: from the moment it agrees to go, it starts no drive.

A dedicated host ends once its Run rests: the Supervisor kills it. Between the
Supervisor's look at the host ("nothing is driven there") and the kill, a resume or a
start could reach the host and start a drive, which the kill would then cut (the
resumed call recovered ``indeterminate`` instead of run). So the host agrees to go
itself, in one step with no await in it (``Admission.close``): only if no drive runs
there and no request that may start one is being handled. From then on such requests
wait at the door. The kill ends them with the host, and their callers ask again (a
new dedicated host is started under the same name). If no kill comes (the Supervisor
died, or a recovery of its own is on its way here), the door opens again after
``REOPEN_S``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from actors.drives import Drives

REOPEN_S = 30.0
"""How long a host that agreed to go waits for its end before it takes work again."""

M = TypeVar("M", bound=Callable[..., Awaitable[Any]])


class Admission:
    """The door of a host's requests that may start a drive."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.inside = 0
        """Requests past the door, not yet answered."""
        self._reopening: asyncio.Task[None] | None = None

    def close(self, drives: Drives, reopened: Callable[[], None]) -> bool:
        """Close the door if the host is idle: nothing driven, stopping or asked here."""
        busy = len(drives) or drives.replacing or drives.ending
        if self.inside or busy or not self.open.is_set():
            return False
        self.open.clear()
        self._reopening = asyncio.get_running_loop().create_task(self._reopen(reopened))
        return True

    async def _reopen(self, reopened: Callable[[], None]) -> None:
        await asyncio.sleep(REOPEN_S)  # still alive: nobody came to end this host
        self.open.set()
        reopened()


def admitted(method: M) -> M:
    """A request of a host that may start a drive: it waits while the door is closed.
    Once answered, a dedicated host left with nothing to drive asks to retire, whatever
    the answer was: one started for a resume that was refused (past its deadline, its
    ticket taken by another) or a recovery that found the Run overtaken lived on idle."""

    @functools.wraps(method)
    async def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        admission: Admission = self.admission
        await admission.open.wait()
        admission.inside += 1  # no await since the door was open: nothing slipped past
        try:
            return await method(self, *args, **kwargs)
        finally:
            admission.inside -= 1
            self._retire_if_idle()

    return entry  # type: ignore[return-value]
