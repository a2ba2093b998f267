"""Children at rest whose parent is gone, ended by the Supervisor's sweep.

A parent's end cancels its children (``runtime.committing``), each within a deadline:
a child whose host was down or hung then is left as it was. A running one looks at its
parent before each Step and ends itself; one at rest, awaiting a person, would wait for
ever. The sweep looks at each awaiting child at most once per ``ORPHAN_CHECK_S`` and
ends it ``cancelled`` when its parent no longer holds the Run that delegated to it, or
has ended that Run (compare-and-set, as any cancel at rest: ``Engine.terminate``).

Children are told apart by their derived thread ids (``runtime.delegation.child_ids``:
``…@…``, or a long one ending in ``~digest``); a thread id a caller chose that looks
alike costs one head read per check, nothing more: its committed link decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.deliveries import each
from runtime.delegation import parent_link
from runtime.errors import RatchetError
from runtime.ids import RunId, ThreadId
from runtime.ports import CommitStore, RunSummary

log = logging.getLogger("ratchet.orphans")
ORPHAN_CHECK_S = 60.0
"""How often the sweep looks again at one awaiting child's parent."""
End = Callable[[ThreadId, RunId], Awaitable[Any]]


def maybe_child(thread: str) -> bool:
    """A thread id ``child_ids`` could have derived."""
    return "@" in thread or "~" in thread


class Orphans:
    """What one Supervisor remembers of the awaiting children it looked at."""

    def __init__(self, store: CommitStore, end: End) -> None:
        self.store = store
        self.end = end
        self._next: dict[ThreadId, float] = {}
        """thread → monotonic time before which it is not looked at again."""

    async def sweep(self, awaiting: list[RunSummary]) -> int:
        """End the orphans among these awaiting Runs that are due a look; how many."""
        now = time.monotonic()
        children = {s.thread_id: s.run_id for s in awaiting if maybe_child(s.thread_id)}
        self._next = {t: at for t, at in self._next.items() if t in children}  # rested
        due = [t for t in children if self._next.get(t, 0.0) <= now]
        for thread in due:
            self._next[thread] = now + ORPHAN_CHECK_S

        async def one(thread: ThreadId) -> bool:
            try:
                return await self._end_if_orphaned(thread, children[thread])
            except RatchetError as exc:  # moved meanwhile, corrupt, store out: next look
                log.info("looking at the parent of %s: %s", thread, exc)
            except Exception:  # a host gone or slow: the child stays at rest, looked at again
                log.exception("looking at the parent of %s failed", thread)
            return False

        return await each(due, one)

    async def _end_if_orphaned(self, thread: ThreadId, run: RunId) -> bool:
        link = parent_link(await self.store.load_head(thread))
        if link is None:
            return False  # not a child: a thread id a caller chose
        parent = await self.store.load_head(link.thread)
        if parent.run_id == link.run and not parent.ended:
            return False  # its parent still waits for it (or runs, and will)
        log.warning("child %s outlived its parent's run %s: ending it", thread, link.run)
        await self.end(thread, run)
        return True
