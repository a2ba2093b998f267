"""An inference attempt's deadline, and the close of its stream.

The attempt runs in the Run's own task, so the deadline is ``asyncio.timeout``'s to the
letter, and past it the attempt is nudged (cancelled again) until it ends: an attempt
that kept the deadline's cancellation to itself would hold the Run's Step as long as it
liked. ``runtime.inference`` uses both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import AsyncGeneratorType
from typing import Any

from runtime.signals import CANCEL_GRACE_S


async def closed(items: AsyncIterator[Any], deadline: AttemptDeadline) -> None:
    """Close an attempt's stream. A close that hangs is cut by the nudges (past the
    deadline); that cut is no outcome of the attempt, whose own (its answer, the model's
    error, its deadline) stands."""
    close = getattr(items, "aclose", None)
    if close is None:
        return
    if not (isinstance(items, AsyncGeneratorType) and items.ag_frame is None):
        deadline.nudge_from_grace()  # a close that runs code (not an exhausted generator)
    try:
        await close()
    except asyncio.CancelledError:
        if not deadline.only_ours():
            raise  # the Run's task is being cancelled: it goes on unwinding
    except Exception:  # a stream that fails to close has still ended
        pass


class AttemptDeadline:
    """An inference attempt's deadline (``async with``: ``asyncio.timeout``'s, to the
    letter), then the cancellations it is sent past the deadline and a grace, one every
    ``CANCEL_GRACE_S`` until it ends (``stop``): its task is the Run's, so an attempt that
    kept the deadline's to itself would hold the Run's Step for as long as it liked.
    Each nudge is taken back once the attempt ends, so that the task's count of
    cancellations asked is its callers' alone.

    One loop timer does all of it: set for the deadline, then for the nudges once the
    deadline passes, or once a close that may hang begins (``nudge_from_grace``); an
    attempt that ends in time and closes nothing that can wait arms no second timer (a
    timer apiece cost more than the rest of the attempt's deadline)."""

    __slots__ = ("_before", "_cancelling", "_grace_at", "_task", "_timer", "expired", "sent")

    def __init__(self, limit_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None, "the engine runs inside a task"
        self._task, self.sent, self._before = task, 0, task.cancelling()
        self._cancelling, self.expired = self._before, False
        loop = asyncio.get_running_loop()
        when = loop.time() + limit_s
        self._grace_at = when + CANCEL_GRACE_S
        self._timer: asyncio.TimerHandle | None = loop.call_at(when, self._expire)

    async def __aenter__(self) -> AttemptDeadline:
        self._cancelling = self._task.cancelling()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if not self.expired:  # in time: no timer until a close that may hang needs one
            self._cancel_timer()
        elif self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # no cancellation asked but the deadline's

    def _expire(self) -> None:
        self._task.cancel()
        self.expired = True
        self._timer = asyncio.get_running_loop().call_at(self._grace_at, self._nudge)

    def nudge_from_grace(self) -> None:
        """Nudge from the deadline's grace on, if not set to already."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(self._grace_at, self._nudge)

    def _nudge(self) -> None:
        self.sent += 1
        self._task.cancel()
        self._timer = asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self._nudge)

    def only_ours(self) -> bool:
        """Whether every cancellation the task was asked for since the attempt began is
        one of ours (a nudge)."""
        return self.sent > 0 and self._task.cancelling() == self._before + self.sent

    def ours(self) -> bool:
        """Whether the attempt ended on its deadline: past it, with every cancellation the
        task was asked for one of the deadline's or ours."""
        if not self.expired:
            return False
        self.stop()
        return self._task.cancelling() == self._before

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def stop(self) -> None:
        self._cancel_timer()
        for _ in range(self.sent):  # a nudge lands at the attempt's next wait, so in it
            self._task.uncancel()
        self.sent = 0
