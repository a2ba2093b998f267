"""Child Runs across the cluster: the ChildRunner a RunHost gives its engines (DESIGN §7).

A child is placed like any Run (the hosted pool, by a hash of its thread id) and
driven by that host's ``run_child``, which answers once the child is at rest. The
child's ids derive from (parent run, call id), so calling again after any crash —
the parent's, the child's, or a host's — reaches the same child: a live drive is
joined, a committed one is recovered, a finished one just answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ray.exceptions import RayActorError, RayError

from actors.wire import SystemSpec, host_index, unwrap
from runtime.delegation import CHILD_OUTCOME, ChildOutcome, ChildRequest, outcome_of
from runtime.errors import RatchetError
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState
from runtime.ports import CommitStore, Lost

log = logging.getLogger("ratchet.children")
T = TypeVar("T")
HOST_BACK_S = 60.0
"""How long a child's call is asked again while the child's host is dead or restarting."""
BACK_POLL_S = (0.05, 1.0)
"""The first and the longest pause between those asks."""


class RayChildRunner:
    def __init__(self, spec: SystemSpec, store: CommitStore | None = None) -> None:
        self.spec = spec
        self.store = store
        """The parent's host's store: a child that has ended answers from it."""
        self._hosts: dict[int, Any] = {}

    def host_for(self, thread: str) -> Any:
        from actors.run_host import hosted_host  # run_host imports this module

        index = host_index(thread, self.spec.hosts)
        if index not in self._hosts:
            self._hosts[index] = hosted_host(self.spec, index)
        return self._hosts[index]

    async def run(self, request: ChildRequest) -> ChildOutcome:
        """The child's outcome. Its host dead or restarting, the same call is asked again
        once it is back (for up to ``HOST_BACK_S``): it names the same child, which that
        host joins or recovers. Ray refuses a call to a restarting actor at once, so an
        attempt given up at the first refusal was spent while the host restarted, and
        one death spent every attempt of the parent's call."""
        ended = await self._ended(request)
        if ended is not None:
            return ended

        async def ask(host: Any) -> ChildOutcome:
            raw = unwrap(await host.run_child.remote(request.model_dump(mode="json")))
            return CHILD_OUTCOME.validate_python(raw)

        try:
            return await self._host_back(request.child_thread, ask)
        except RayError as exc:
            # dead past HOST_BACK_S, or its answer was lost: the child goes on, or
            # recovers on its own; the parent's durable_request policy reconnects to it
            return Lost(message=f"host of child {request.child_thread} lost: {exc}")

    async def _ended(self, request: ChildRequest) -> ChildOutcome | None:
        """The outcome of a child whose Run has ended, read from the store (verified);
        None: ask its host. A parent recovered under all-host kills asked the child's
        restarting host for an answer the store held, for seconds each time, and was
        killed again before it could take it."""
        if self.store is None:
            return None
        try:
            head = await self.store.load_head(request.child_thread)
            if head.run_id != request.child_run or not isinstance(head.run_state, EndedState):
                return None
            return outcome_of(await self.store.load(request.child_thread))
        except RatchetError:  # an outage, records that do not verify: the host's to say
            return None

    async def cancel(self, child_thread: ThreadId, child_run: RunId | None = None) -> None:
        """Its host dead or restarting, the cancel is asked again once it is back (for up
        to ``HOST_BACK_S``; the parent's end bounds it by ``CANCEL_CHILD_S``): the
        restarted host ends the child at rest, or tells the drive that recovered it. A
        cancel given up at Ray's first refusal was lost, and the child, recovered without
        it, replayed its tool for a parent that had ended (a child looks at its parent
        only before a Step)."""

        async def ask(host: Any) -> None:
            unwrap(await host.cancel_run.remote(child_thread, run=child_run))

        try:
            await self._host_back(child_thread, ask)
        except RayError as exc:
            log.warning("cancelling child %s: its host is gone (%s)", child_thread, exc)

    async def _host_back(self, child: ThreadId, ask: Callable[[Any], Awaitable[T]]) -> T:
        """``ask(host)`` of ``child``'s host; a host dead or restarting is asked again once
        it is back (Ray refuses a call to a restarting actor at once), for up to
        ``HOST_BACK_S``, then its RayActorError raised. Any RayError forgets the hosts
        looked up: one re-created under its name is looked up again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOST_BACK_S
        pause, longest = BACK_POLL_S
        while True:
            try:
                return await ask(self.host_for(child))
            except RayActorError:
                self._hosts.clear()
                if loop.time() >= deadline:
                    raise
            except RayError:
                self._hosts.clear()
                raise
            await asyncio.sleep(pause)  # Ray restarts it: a backoff, not a sync
            pause = min(pause * 2, longest)
