"""The cancellation signal, racing work against it, and the exceptions the engine's
parts use to tell the Step loop what happened (they never escape it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from runtime.batch import ActiveToolBatch
from runtime.lifecycle import EndCause, PauseTarget
from runtime.state import Command

T = TypeVar("T")


class CancelledSignal(Exception):
    """The cancellation signal won a race against inference or tools."""


class RunOver(Exception):
    """The Run reached a terminal commit inside a helper: the loop just returns."""


class OwnTaskCancelled(RuntimeError):
    """Code the Run runs in its own task (a model's stream, say) cancelled that task:
    where nothing else may cancel it (a RunHost's drive), the Run fails with this."""

    def __init__(self) -> None:
        super().__init__(
            "code the Run runs (a model's stream, say) cancelled the task the Run runs in"
        )


class EndRun(Exception):
    """Carrying out a Step decided that the Run must end with ``cause``; ``batch``: the
    Step's batch as it is now, should it hold calls finished since its last commit (their
    results are kept in the end, not sealed as unknown), and ``commands`` what those
    calls wrote to the state."""

    def __init__(
        self,
        cause: EndCause,
        batch: ActiveToolBatch | None = None,
        commands: Sequence[Command] = (),
    ) -> None:
        super().__init__(cause.kind)
        self.cause = cause
        self.batch = batch
        self.commands = tuple(commands)


class PauseRun(Exception):
    """Carrying out a Step decided that the Run must pause at this Step's start
    (``target``: a rate limit that outlasted the Run's backoff budget, say)."""

    def __init__(self, target: PauseTarget) -> None:
        super().__init__(target.reason)
        self.target = target


CANCEL_GRACE_S = 1.0
"""How long work past its deadline (a tool call's ``timeout_s``, an inference attempt's
``inference_timeout_s``) has to take its cancellation before it is left behind (a
cooperative one unwinds, and its cleanup runs, before its Run goes on)."""


async def let_go(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and give it ``CANCEL_GRACE_S`` to end. One that holds on to its
    cancellation (swallows it, or hangs in its cleanup) is left behind: whatever it ends
    with is dropped, and the Run goes on without it."""
    task.cancel()
    try:
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    finally:  # this wait cancelled too: the task is left behind all the same
        task.add_done_callback(_forget)


def _forget(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def cancels_asked() -> int:
    """The cancellations of the running task asked for and not yet taken back (0 outside
    a task): compared before and after user code run synchronously in it."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


async def drop_own_cancel(asked: int) -> bool:
    """Whether user code run synchronously in this task (a gate, a run-end guard, a
    session's handler) cancelled it since it had ``asked`` cancellations: the one it left
    pending is taken here and dropped. Left, it landed at the task's next wait and was
    taken for the host stopping the drive: the Run stayed running, to be cancelled again
    at each recovery. One asked by anyone else meanwhile still lands."""
    task = asyncio.current_task()
    if task is None or task.cancelling() <= asked:
        return False
    try:
        await asyncio.sleep(0)  # the pending cancellation lands here (Python 3.11 keeps
        # it pending through ``uncancel``: only delivering it clears it)
    except asyncio.CancelledError:
        if task.uncancel() > asked:
            raise  # asked again meanwhile, or by someone else: a real cancellation
    return True


class OwnCancels:
    """Around user code run synchronously in the Run's task (a gate, a run-end guard, a
    session's handler): a cancellation of the task it asked for is dropped on the way
    out, whether it returned or raised (``dropped`` says whether there was one). The
    two halves in one place: a handler that cancelled its task and then raised left
    the pending cancellation to land at the settling commit's wait."""

    __slots__ = ("asked", "dropped")

    def __init__(self) -> None:
        self.asked = 0
        self.dropped = False

    async def __aenter__(self) -> OwnCancels:
        self.asked = cancels_asked()
        return self

    async def __aexit__(self, *_: object) -> None:
        if cancels_asked() > self.asked:  # rare: only then a wait (this runs per wave)
            self.dropped = await drop_own_cancel(self.asked)


async def take_back_cancels() -> None:
    """Take back every cancellation of the running task asked for (one pending is
    delivered first, and dropped): the caller knows none of them was a real one."""
    task = asyncio.current_task()
    assert task is not None, "the engine runs inside a task"
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)  # a cancellation pending lands here (delivering it clears it)
    while task.uncancel() > 0:
        pass


def cancelling() -> bool:
    """Whether the running task is being cancelled: a CancelledError is then a real
    cancellation, else user code (a tool, a hook, a model) raised one on its own."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class CancelSignal(asyncio.Event):
    """A Run's cancellation event, which also calls the wakers of the races in progress."""

    def __init__(self) -> None:
        super().__init__()
        self._wakers: set[Callable[[], None]] = set()

    def set(self) -> None:
        super().set()
        for wake in tuple(self._wakers):
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when the signal fires (now, if it is set already)."""
        self._wakers.add(wake)
        if self.is_set():
            wake()

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._wakers.discard(wake)


async def guarded(signal: CancelSignal, work: Awaitable[T]) -> T:
    """Await ``work`` unless ``signal`` fires first; then raise CancelledSignal.

    The work runs in the calling task rather than a task of its own (a task, its
    scheduling and the wake-ups cost more than the Step's bookkeeping around each
    inference and wave): the signal cancels the calling task from the loop, which
    unwinds the work where it waits, and the CancelledError is turned into
    CancelledSignal here. The cancellation is requested from a callback of the loop,
    never while the task runs, so it always lands on a wait of the work (or on nothing,
    if the work finished first: then its result stands, as when a task wins the race).
    A cancellation of the task from elsewhere stays a CancelledError. Work that swallows
    its cancellation is cancelled again every ``CANCEL_GRACE_S`` until it ends: a hook or
    a session's handler holding on to it held its Run past a cancel or a stop.
    """
    task = asyncio.current_task()
    assert task is not None, "the engine runs inside a task"
    interrupts = _Interrupts(task)
    signal.watch(interrupts.wake)
    try:
        result = await work
    except BaseException:
        if interrupts.sent and interrupts.take_back() == 0:
            raise CancelledSignal from None  # the unwound work's error is moot
        raise
    finally:
        signal.unwatch(interrupts.wake)
        interrupts.stop()
    if interrupts.sent:  # the work swallowed the cancellation: the signal still came first
        interrupts.take_back()
        raise CancelledSignal
    return result


class _Interrupts:
    """The signal's cancellations of a guarded task: the first once it fires (from a
    callback of the loop), then one every ``CANCEL_GRACE_S`` until the work ends. An
    object, not closures: a closure that schedules itself again refers to itself, a
    cycle per guarded call that only the cycle collector frees."""

    __slots__ = ("_again", "_loop", "_pending", "_task", "sent")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task, self._loop = task, asyncio.get_running_loop()
        self._pending: asyncio.Handle | None = None
        self._again: asyncio.TimerHandle | None = None
        self.sent = 0

    def wake(self) -> None:
        if self._pending is None:
            self._pending = self._loop.call_soon(self._interrupt)

    def _interrupt(self) -> None:
        self.sent += 1
        self._task.cancel()
        self._again = self._loop.call_later(CANCEL_GRACE_S, self._interrupt)

    def stop(self) -> None:
        if self._again is not None:
            self._again.cancel()
        if self._pending is not None and not self.sent:
            self._pending.cancel()
        self._again = self._pending = None

    def take_back(self) -> int:
        """Take back the cancellations sent; how many the task has left (asked of it
        from elsewhere)."""
        left = self._task.cancelling()
        for _ in range(self.sent):
            left = self._task.uncancel()
        return left


async def guarded_apart(signal: CancelSignal, work: Awaitable[T]) -> T:
    """``guarded`` for user code that may hold on to its cancellation for good (a hook, a
    session's handler): the work runs in a task of its own, which the signal cancels and
    leaves behind if it has not ended ``CANCEL_GRACE_S`` later (``let_go``). The Run's own
    task is never held: a task per call, where ``guarded`` makes none."""
    apart = asyncio.ensure_future(work)
    try:
        await guarded(signal, asyncio.wait({apart}))  # a wait its cancel does not pass on
    except BaseException:
        await let_go(apart)
        raise
    return apart.result()
