"""Handing an ended child's outcome to the parent that awaits it (DESIGN §7).

A lone child that surfaced a human wait leaves its parent at rest, ``awaiting`` a
``delegation`` ticket; nothing in the parent's drive is left to ask for the answer.
Whoever ends the child hands it over: the host whose drive ended it, or the host that
ended it at rest (a cancel or a stop), in the background, asking again while the
parent still awaits it (``deliver``). A hand-over can still be lost — the host died
between the child's end and the parent's resume, or the child was ended by a tool
outside any host — so the Supervisor's sweep also looks for parents awaiting a child
that has ended (``redeliver``). Of several hand-overs of one ticket only one lands:
the resume is compare-and-set on the ticket, and the others are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from actors.wire import unwrap
from runtime.batch import ToolOutput
from runtime.commit import Frontier
from runtime.delegation import CHILD_OUTCOME, ParentLink, awaited_child, delivery
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.limits import Limits
from runtime.ports import CommitStore, Finished

log = logging.getLogger("ratchet.deliveries")
T = TypeVar("T")
DELIVERY_S = 30.0
"""The deadline of one call handing an ended child's outcome to its parent's host."""
WAKE_AT_ONCE = 8
"""Calls to hosts (hand-overs, resumes of due pauses, cancels of orphans) and store
reads a pass of the Supervisor's sweep has under way at once (``Pass``)."""
PER_HOST = WAKE_AT_ONCE // 2
"""Calls a pass has under way at once on one host: a host that hangs holds only these
slots (each up to its deadline) while the other hosts' Runs are served."""
DELIVERING_S = 600.0
"""How long a child's host keeps asking while its parent still awaits the outcome."""
AWAITING_DELEGATION = "awaiting_delegation"
"""The status reason of a parent at rest until a child's outcome comes."""
HostOf = Callable[[Frontier], Any]
"""The host actor a Run is placed on (by its recorded placement), or None if unknown."""


def failed_delegation(why: str) -> Any:
    """A delegation that failed, as the parent's tool call reads it."""
    failed = Finished(output=ToolOutput(content=f"delegation failed: {why}", is_error=True))
    return CHILD_OUTCOME.dump_python(failed, mode="json")


async def deliver(
    store: CommitStore, child: Frontier, link: ParentLink, host_of: HostOf, limits: Limits
) -> None:
    """Resume the parent with the ended child's outcome, asking again (each call with
    a deadline) while the parent still awaits it."""
    loop = asyncio.get_running_loop()
    give_up, delay = loop.time() + DELIVERING_S, 0.05
    while True:
        try:
            # nothing to do once delivered (by an earlier call), or not awaited
            await _hand_over(child, await store.load(link.thread), host_of, limits)
            return
        except Exception as exc:  # a host or the store out: asked again until give_up
            if loop.time() > give_up:
                log.error("delivering %s to its parent failed: %s", child.thread_id, exc)
                return
            log.info("delivering %s to its parent: %r; again", child.thread_id, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def redeliver(
    store: CommitStore,
    parents: list[ThreadId],
    host_of: HostOf,
    limits: Limits,
    calls: Pass | None = None,
) -> int:
    """For each of these threads that awaits a child which has ended, hand the child's
    outcome over (one call each, through ``calls``, the sweep's pass: a parent's host
    that hangs holds only its own slots; the next sweep asks again); how many were handed."""
    calls = calls if calls is not None else Pass()

    async def one(thread: ThreadId) -> bool:
        try:
            async with calls.slots:
                parent = await store.load(thread)
                child = awaited_child(parent)
                ended = await store.load(child) if child is not None else None
            if ended is not None and await _hand_over(ended, parent, host_of, limits, calls):
                log.warning("the outcome of child %s had not reached %s: handed", child, thread)
                return True
        except (RatchetError, HostOut) as exc:  # refused (delivered meanwhile), corrupt, store out
            log.info("handing %s its child's outcome: %s", thread, exc)
        except Exception:  # a host gone, slow or restarting: the next sweep asks again
            log.exception("handing %s its child's outcome failed", thread)
        return False

    return sum(await asyncio.gather(*(one(t) for t in parents)))


class Pass:
    """The calls to hosts of one pass of the Supervisor's sweep (hand-overs, wakes of
    due Runs, cancels of orphans): ``WAKE_AT_ONCE`` under way at once (a store read
    takes one of ``slots`` too), at most ``PER_HOST`` of them on one host, and a host
    that failed one (no answer within its deadline, or gone) is asked nothing more in
    this pass. A host that hangs so holds only its own slots, each for one deadline,
    while the other hosts' Runs are served: the pass ends within about one deadline of
    its other work, and the next sweep (which starts none while one is under way) is
    not held up by it."""

    def __init__(self) -> None:
        self.slots = asyncio.Semaphore(WAKE_AT_ONCE)
        self._hosts: dict[Any, asyncio.Semaphore] = {}  # a Ray handle hashes by actor id
        self._failing: set[Any] = set()

    async def call(
        self, host: Any, send: Callable[[], Awaitable[T]], deadline_s: float | None = None
    ) -> T:
        """``send()`` (a call to ``host``) within ``deadline_s`` (``DELIVERY_S``); HostOut
        if no host is known or it failed another call of this pass. A RatchetError is the
        host's answer (refused, its store out): the host is asked again in this pass."""
        if host is None:
            raise HostOut("no host is known for it")
        # the host's slot is waited for holding no slot of the pass: the Runs of a host
        # that hangs queue behind its own slots, not in front of every other host's Runs
        async with self._hosts.setdefault(host, asyncio.Semaphore(PER_HOST)), self.slots:
            if host in self._failing:
                raise HostOut("its host failed another call of this pass")
            try:
                async with asyncio.timeout(DELIVERY_S if deadline_s is None else deadline_s):
                    return await send()
            except RatchetError:
                raise
            except Exception:
                self._failing.add(host)
                raise


class HostOut(Exception):
    """A call of a pass was not sent: no host is known for its Run, or its host failed
    another call of this pass (the Run is asked again later)."""


async def _hand_over(
    child: Frontier, parent: Frontier, host_of: HostOf, limits: Limits, calls: Pass | None = None
) -> bool:
    """Resume ``parent`` with ``child``'s outcome if it awaits exactly that: whether asked
    (through ``calls``, a sweep's pass, if given; else within ``DELIVERY_S``)."""
    command = delivery(child, parent, limits)
    host = host_of(parent) if command is not None else None
    if command is None or host is None:
        return False

    async def send() -> None:
        unwrap(await host.resume_run.remote(command))

    if calls is not None:
        await calls.call(host, send)
    else:
        async with asyncio.timeout(DELIVERY_S):
            await send()
    return True
