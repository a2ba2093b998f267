"""The threads synchronous tools run in, and whether a call got one (``CallStart``).

A synchronous call cannot be interrupted: past its timeout it keeps its thread until it
ends. The threads so held are counted per pool, and once every thread of the pool in use
is held, the next call gets a fresh pool (``tool_threads``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

log = logging.getLogger("ratchet.tools")

SYNC_TOOL_THREADS = 32
"""Threads per process that run synchronous tools: at most this many at once."""
_threads: list[ThreadPoolExecutor] = []
_overdue: dict[ThreadPoolExecutor, int] = {}
"""Each pool's threads held by calls given up on (past their timeout): they cannot be
interrupted, and run on until their calls end."""
_overdue_lock = threading.Lock()
MAX_POOLS = 4
"""Pools whose threads calls given up on may hold at once (``tool_threads``)."""
_warned: list[bool] = []


def tool_threads() -> ThreadPoolExecutor:
    """The process's tool threads; a fresh pool once every thread of the one in use is
    held by a call given up on (the old one's threads end with their calls): else every
    synchronous call of the process was unavailable from then on, while the process
    answered its pings and was never restarted. At most ``MAX_POOLS`` pools hold such
    threads at once: past that (a tool that hangs for good, called again and again),
    calls wait for a thread of the one in use, and are unavailable at their timeout."""
    with _overdue_lock:
        current = _threads[0] if _threads else None
        if current is not None and _overdue.get(current, 0) < SYNC_TOOL_THREADS:
            return current
        if current is not None and len(_overdue) >= MAX_POOLS:
            if not _warned:
                _warned.append(True)
                log.warning(
                    "%d pools of tool threads are held by calls past their timeout: "
                    "synchronous calls now wait for one of them",
                    MAX_POOLS,
                )
            return current
        if current is not None:  # every thread held: its calls' ends still count it down
            _threads.pop().shutdown(wait=False)
        _threads.append(ThreadPoolExecutor(SYNC_TOOL_THREADS, thread_name_prefix="ratchet-tool"))
        return _threads[0]


class CallStart:
    """Whether a call began, decided once under a lock: a synchronous call that timed out
    while it waited for a tool thread (every one held by calls past their own timeout)
    never ran, and never will: it is unavailable (tried again), not lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Literal["started", "abandoned", "ended"] | None = None
        self._overdue = False
        self.pool: ThreadPoolExecutor | None = None
        """The tool threads a synchronous call was handed to."""

    def begin(self) -> bool:
        with self._lock:
            if self._state is None:
                self._state = "started"
            return self._state == "started"

    def abandon(self) -> bool:
        """True if the call had not begun: from now on it never does."""
        with self._lock:
            if self._state is None:
                self._state = "abandoned"
            return self._state == "abandoned"

    def given_up(self) -> None:
        """The call's outcome is decided while its thread may still run it: the thread
        counts as held (``tool_threads``) until the call ends."""
        with self._lock:  # held while counted: the call's end cannot count down first
            if self._state != "started" or self.pool is None:
                return
            self._overdue = True
            with _overdue_lock:
                _overdue[self.pool] = _overdue.get(self.pool, 0) + 1

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn`` in the tool thread, unless the call was given up before it got one."""
        if not self.begin():
            return None  # its caller has its outcome already
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._state, overdue = "ended", self._overdue
            if overdue and self.pool is not None:
                with _overdue_lock:
                    left = _overdue[self.pool] - 1
                    if left:
                        _overdue[self.pool] = left
                    else:
                        del _overdue[self.pool]
