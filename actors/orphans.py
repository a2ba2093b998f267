"""Children at rest whose parent is gone, ended by the Supervisor's sweep.

A parent's end cancels its children (``runtime.committing``), each within a deadline:
a child whose host was down or hung then, or every child of a parent whose host died
between its end and the cancels, is left as it was. One at rest, awaiting a person,
would wait for ever; a running one looks at its parent before each Step and ends
itself, but a Step can last for ever (a tool with no deadline, or a wait on a child of
its own that is in one). The sweep looks at each such child at most once per
``ORPHAN_CHECK_S`` and, when its parent no longer holds the Run that delegated to it or
has ended that Run, ends it ``cancelled``: one at rest from the store (compare-and-set,
as any cancel at rest: ``Engine.terminate``), a running one through its host, which
tells its drive (its tool calls are cancelled where they run) or ends it at rest.

Children are told apart by their derived thread ids (``runtime.delegation.child_ids``:
``…@…``, or a long one ending in ``~digest``); a thread id a caller chose that looks
alike costs one head read per check, nothing more: its committed link decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from actors.deliveries import DELIVERY_S, HostOut, Pass
from runtime.delegation import parent_link
from runtime.errors import RatchetError
from runtime.ids import RunId, ThreadId
from runtime.ports import CommitStore, RunSummary

log = logging.getLogger("ratchet.orphans")
ORPHAN_CHECK_S = 60.0
"""How often the sweep looks again at one awaiting child's parent."""
ORPHAN_CANCEL_S = DELIVERY_S
"""How long the sweep waits for a running orphan's host to take its cancel: one that
hangs held the Supervisor's wake pass for ever (no pause resumed, no outcome handed
over after it); the orphan is looked at again ``ORPHAN_CHECK_S`` later."""
End = Callable[[ThreadId, RunId], Awaitable[Any]]
HostFor = Callable[[ThreadId], Any]
"""The host a running child's cancel goes to (the key its calls of a pass count on)."""


def maybe_child(thread: str) -> bool:
    """A thread id ``child_ids`` could have derived."""
    return "@" in thread or "~" in thread


class Orphans:
    """What one Supervisor remembers of the children (at rest or running) it looked at."""

    def __init__(
        self,
        store: CommitStore,
        end: End,
        cancel: End | None = None,
        host_for: HostFor | None = None,
    ) -> None:
        self.store = store
        self.end = end
        """Ends an awaiting child (from the store)."""
        self.cancel = cancel
        """Cancels a running child (through its host); None: running ones are not looked at."""
        self.host_for = host_for
        """The host ``cancel`` reaches for a child; None: every cancel counts as one host's."""
        self._next: dict[ThreadId, float] = {}
        """thread → monotonic time before which it is not looked at again."""

    async def sweep(
        self,
        awaiting: Sequence[RunSummary],
        running: Sequence[RunSummary] = (),
        calls: Pass | None = None,
    ) -> int:
        """End the orphans among these awaiting (and running) Runs that are due a look
        (a running one's cancel through ``calls``, the sweep's pass: a host that hangs
        holds only its own slots); how many."""
        calls = calls if calls is not None else Pass()
        now = time.monotonic()
        live = {s.thread_id for s in running} if self.cancel is not None else set()
        listed = [*awaiting, *(s for s in running if s.thread_id in live)]
        children = {s.thread_id: s.run_id for s in listed if maybe_child(s.thread_id)}
        self._next = {t: at for t, at in self._next.items() if t in children}  # rested
        due = [t for t in children if self._next.get(t, 0.0) <= now]
        for thread in due:
            self._next[thread] = now + ORPHAN_CHECK_S

        async def one(thread: ThreadId) -> bool:
            try:
                return await self._end_if_orphaned(thread, children[thread], thread in live, calls)
            except (RatchetError, HostOut) as exc:  # moved meanwhile, corrupt, store out: next look
                log.info("looking at the parent of %s: %s", thread, exc)
            except Exception:  # a host gone or slow: the child stays at rest, looked at again
                log.exception("looking at the parent of %s failed", thread)
            return False

        return sum(await asyncio.gather(*(one(t) for t in due)))

    async def _end_if_orphaned(
        self, thread: ThreadId, run: RunId, running: bool, calls: Pass
    ) -> bool:
        async with calls.slots:
            link = parent_link(await self.store.load_head(thread))
            if link is None:
                return False  # not a child: a thread id a caller chose
            parent = await self.store.load_head(link.thread)
            if parent.run_id == link.run and not parent.ended:
                return False  # its parent still waits for it (or runs, and will)
        log.warning("child %s outlived its parent's run %s: ending it", thread, link.run)
        if not (running and self.cancel is not None):
            # from the store, holding no slot of the pass: its own children's cancels go
            # to hosts unknown here (each within CANCEL_CHILD_S), and orphans whose
            # children sit on one dead host held every slot, every other host's wakes
            # and hand-overs behind them
            await self.end(thread, run)
            return True
        cancel = self.cancel
        host = self.host_for(thread) if self.host_for is not None else cancel
        await calls.call(host, lambda: cancel(thread, run), ORPHAN_CANCEL_S)
        return True
