"""The control side of a RunHost: cancel, stop and pause a Run, whether a drive here hears
the signal or the Run is at rest in the store (a mixin of ``actors.run_host.RunHost``,
whose drives, store and children it uses).

A drive still held here after another owner took its Run (this host was only slow)
does not answer for it: a request that finds it stale (``Drives.fenced``) stops it and
acts as if there were no drive here, through a path that carries its own claim.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from actors.drives import Drive, Drives, over_or
from actors.wire import SystemSpec, remote_error
from runtime.commit import Frontier
from runtime.control import control_engine
from runtime.engine import Engine
from runtime.errors import InputRefused
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndCause,
    EndedState,
    RunningState,
    Stopped,
)
from runtime.limits import check_reason
from runtime.patience import patiently
from runtime.ports import CommitStore
from runtime.publish import Publisher

log = logging.getLogger("ratchet.run_host")
ENDING_PATIENCE_S = 300.0
"""How long a host waits out a store outage to end a Run it told its caller it would end."""
SIGNAL_WAIT_S = 5.0
"""How long a cancel or stop told to a drive here waits for the drive to end the Run
before it answers "signalled". An answer of the end itself is durable: the end was
committed; a host that dies before it answers has its caller ask again, and the Run,
recovered by then, is ended by the host that has it."""


class SystemActor(Protocol):
    spec: SystemSpec
    store: CommitStore
    owner: str
    publisher: Publisher | None
    children: Any  # actors.children.RayChildRunner


def acting_for(actor: SystemActor) -> Engine:
    """A control engine that ends Runs for a host or the Supervisor: its store and
    owner (the end carries its claim), its publisher and children, the system's limits."""
    return control_engine(
        actor.store,
        owner=actor.owner,
        publisher=actor.publisher,
        children=actor.children,
        limits=actor.spec.limits,
    )


class ControlHosting:
    spec: SystemSpec
    store: CommitStore
    owner: str
    drives: Drives
    children: Any  # actors.children.RayChildRunner
    publisher: Publisher | None
    _background: set[asyncio.Task[Any]]

    # the host's own (RunHost) and its delegation side's (ChildHosting): annotations
    # only, so that the methods of the classes after this one are the ones found
    _retire_if_idle: Callable[[], None]
    _hand_back: Callable[[Frontier], None]

    async def cancel_run(self, thread: ThreadId, run: RunId | None = None) -> Any:
        """Cancel a Run driven here, or one at rest (awaiting, or running with no driver);
        ``run``: only that Run (a thread that moved on to another is ``not_running``)."""
        return await self._end_run(thread, run, Cancelled(), "cancelled", lambda e: e.cancel())

    async def stop_run(self, thread: ThreadId, reason: str, run: RunId | None = None) -> Any:
        """End a Run ``stopped(reason)``: signal its engine here, or end it at rest."""
        try:
            cause = Stopped(reason=check_reason(reason, self.spec.limits))
        except InputRefused as exc:
            return remote_error(exc)
        return await self._end_run(thread, run, cause, "stopped", lambda e: e.stop(reason))

    async def _end_run(
        self,
        thread: ThreadId,
        run: RunId | None,
        cause: EndCause,
        ended: str,
        signal: Callable[[Engine], None],
    ) -> Any:
        try:
            drive = await self._answering(thread)
            if drive is not None and run is not None and drive.run_id not in (None, run):
                drive = None  # it drives a later Run of the thread, not the one named
            if drive is not None and drive.engine.listening:  # no await since the check
                # told just so by a call before this one: that call ends the Run, not this
                first = not _told(drive.engine, cause)
                signal(drive.engine)
                self.drives.ending[thread] += 1  # not driven again by the reconciler meanwhile
                task = asyncio.create_task(self._see_it_ended(thread, run, cause, drive))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                if await self._drove_to(thread, drive, run, cause):
                    return ended if first else "not_running"
                return await self._fenced_out(thread, run, cause, ended if first else "", drive)
            # no drive, or one that came to rest meanwhile (it would not hear a signal)
            return ended if await self._end_stored(thread, run, cause) else "not_running"
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            return remote_error(exc)
        finally:
            self._retire_if_idle()

    async def _drove_to(
        self, thread: ThreadId, drive: Drive, run: RunId | None, cause: EndCause
    ) -> bool:
        """Whether ``drive`` ended the Run with ``cause`` within ``SIGNAL_WAIT_S``: its end
        landed (not waiting for its children's cancels after it), and the store says so."""
        await over_or(drive, drive.engine.end_landed, SIGNAL_WAIT_S)
        if not (drive.engine.end_landed.is_set() or drive.task.done()):
            return False
        try:
            frontier = await self.store.load(thread)
        except Exception:  # the store out: the caller was told, and hears "signalled"
            return False
        return _ended_with(frontier, run, drive, cause)

    async def _fenced_out(
        self, thread: ThreadId, run: RunId | None, cause: EndCause, ended: str, drive: Drive
    ) -> str:
        """A drive told to end its Run that has not within ``SIGNAL_WAIT_S`` (a model or a
        tool that ignores its cancellation, an end held up): the Run is ended from the
        store now, its claim fencing that drive, so that the answer (``ended``) is durable,
        not a promise held in this host's memory. "not_running" if the Run came to rest
        otherwise meanwhile (a stop that raced this cancel ended it: this call ended
        nothing), or as asked when ``ended`` is "" (a call before this one told the drive
        just so: that one ends it). "signalled" for a drive that has claimed nothing (the
        thread's Run is not yet its own), or with the store out (waited for
        ``SIGNAL_WAIT_S`` at most)."""
        if drive.epoch is None:
            return "signalled"
        run = run or drive.run_id
        try:
            async with asyncio.timeout(SIGNAL_WAIT_S):  # the store out: never a caller held
                if ended and await self._end_stored(thread, run, cause):
                    return ended
        except Exception as exc:  # its end may have landed (the drive slow to stop): see
            log.info("ending %s from the store after its drive was told: %s", thread, exc)
        try:
            async with asyncio.timeout(SIGNAL_WAIT_S):
                frontier = await self.store.load(thread)  # ended meanwhile, and how?
        except Exception:  # the promise stands: _see_it_ended keeps it
            return "signalled"
        if _ended_with(frontier, run, drive, cause):
            # by this call (its drive slow to stop), or by its drive just now
            return ended or "not_running"
        if frontier.run_id != run or not isinstance(
            frontier.run_state, RunningState | AwaitingState
        ):
            return "not_running"  # at rest otherwise, or the thread moved on past it
        return "signalled"

    async def _end_stored(self, thread: ThreadId, run: RunId | None, cause: EndCause) -> bool:
        """End the Run as the store has it (no drive here hears a signal); False if there
        was nothing to end, or it came to rest on its own meanwhile."""
        frontier = await self.store.load(thread)
        if run is not None and frontier.run_id != run:
            return False  # the Run named ended, and the thread moved on
        if not isinstance(frontier.run_state, RunningState | AwaitingState):
            return False
        # the end carries its claim: a driver elsewhere, if any, is fenced by it
        engine = acting_for(self)
        now = await engine.terminate(thread, cause, run=run)
        self._hand_back(now)
        if not engine.committed.is_set():
            return False
        # a drive spawned here meanwhile (a resume that landed first) is fenced by the end:
        # stopped now, not at its next commit, which a long tool call can put off
        drive = self.drives.get(thread)
        if drive is not None and self.drives.fenced(drive, now):
            await self.drives.stop(thread, drive, idle=False)
        return True

    async def _see_it_ended(
        self, thread: ThreadId, run: RunId | None, cause: EndCause, drive: Drive
    ) -> None:
        """The caller heard "signalled": once the drive told so is over, a Run it did not
        end is ended from the store, as one at rest is. A drive can go without ending it:
        one that never claimed (a repeated start, a resume that lost), a recovery that
        found the Run at rest, a drive fenced by another owner's take-over, one whose end
        met a store outage past its backoff. Waits out an outage for ``ENDING_PATIENCE_S``;
        the reconciler does not drive the thread again meanwhile (``Drives.ending``)."""
        if drive.epoch is not None:  # it held the thread: the Run it drove, never a later one
            run = run or drive.run_id
        try:
            if run is None:  # the Run the thread holds now, not one started after the drive
                run = (await patiently(lambda: self.store.load(thread), ENDING_PATIENCE_S)).run_id
            await asyncio.wait({drive.task})
            ended = await patiently(lambda: self._end_stored(thread, run, cause), ENDING_PATIENCE_S)
            if ended:
                log.info("%s ended from the store: its drive went without ending it", thread)
        except Exception:  # the Run stays as committed; its caller may ask again
            log.exception("ending %s after its drive went without ending it failed", thread)
        finally:
            self.drives.ending[thread] -= 1
            if self.drives.ending[thread] <= 0:
                del self.drives.ending[thread]
            self._retire_if_idle()

    async def pause_run(self, thread: ThreadId) -> Any:
        """A manual pause: the Run driven here awaits at its next Step boundary."""
        try:
            drive = await self._answering(thread)
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            return remote_error(exc)
        if drive is None or not drive.engine.listening:
            return "not_running"
        drive.engine.pause()
        return "signalled"

    async def _answering(self, thread: ThreadId) -> Drive | None:
        """This host's drive of ``thread``, if it still answers for the Run. A stale one
        (the thread claimed past it since) is stopped now: only the stored thread then
        decides, through a path that carries its own claim."""
        drive = await self.drives.claimed(thread)
        if drive is None or drive.epoch is None:  # slow to claim: it can be told
            return drive
        if not self.drives.fenced(drive, await self.store.load(thread)):
            return drive
        log.info("the drive of %s here is stale: stopping it", thread)
        await self.drives.stop(thread, drive, idle=False)
        return await self.drives.claimed(thread)  # one a request spawned meanwhile answers


def _told(engine: Engine, cause: EndCause) -> bool:
    """Whether the engine was told already to end its Run with ``cause``: cancelled, or
    stopped for the same reason (a stop for another reason changes how it ends)."""
    wanted = cause.reason if isinstance(cause, Stopped) else None
    return engine.cancel_event.is_set() and engine.stop_reason == wanted


def _ended_with(frontier: Frontier, run: RunId | None, drive: Drive, cause: EndCause) -> bool:
    """Whether the store has the Run asked for (or the drive's) ended with ``cause``."""
    if frontier.run_id not in {r for r in (run, drive.run_id) if r}:
        return False
    state = frontier.run_state
    return isinstance(state, EndedState) and state.cause == cause


__all__ = ["ControlHosting"]
