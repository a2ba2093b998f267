"""The Runs one host process drives: one Engine and one task per thread.

Every failure inside a Run is settled by its Engine (``Engine.settle``); a drive never
settles a Run itself. What reaches a drive's task is what the engine could not settle
— fenced, refused, corrupt, the store out for too long — and it goes to whoever
awaits the drive (``first_commit``), never reported as success. The host's
reconciliation reads ``paused`` (drive it again) and ``quarantined`` (never again).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors.waves import RayToolRunner, WaveDispatcher
from actors.wire import AtRest, SystemSpec
from runtime.agent import Agent, load_agent
from runtime.commit import Frontier
from runtime.delegation import ChildRunner, ParentLink
from runtime.engine import Engine
from runtime.errors import CorruptRecord, InvalidTransition, StoreLost, StoreUnavailable
from runtime.faults import FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.ports import CommitStore, StreamCheckpointStore
from runtime.publish import Publisher

log = logging.getLogger("ratchet.run_host")
FaultSpec = tuple[str, int, str]
"""(fault point, occurrence, action): action ``exit`` ends the process (os._exit)."""
Go = Callable[[Engine], Awaitable[Frontier]]


@dataclass
class Drive:
    engine: Engine
    task: asyncio.Task[Any]
    run_id: RunId | None


class Drives:
    """The drive table of one host process, and how drives start and end."""

    def __init__(
        self,
        spec: SystemSpec,
        store: CommitStore,
        owner: str,
        waves: WaveDispatcher,
        children: ChildRunner,
        publisher: Publisher | None,
        checkpoints: StreamCheckpointStore | None,
        on_idle: Callable[[], None],
    ) -> None:
        self.spec = spec
        self.store = store
        self.owner = owner
        self.waves = waves
        self.children = children
        self.publisher = publisher
        self.checkpoints = checkpoints
        self.on_idle = on_idle
        self.table: dict[ThreadId, Drive] = {}
        self.agents: dict[str, tuple[Agent, RayToolRunner]] = {}
        self.paused: set[ThreadId] = set()
        """Drives stopped by a store outage that outlasted their backoff: driven again."""
        self.quarantined: set[ThreadId] = set()
        """Threads whose records do not verify: no engine here acts on them again."""
        self.replacing: set[ThreadId] = set()
        """Threads whose stale drive is being stopped (a dedicated host must not retire)."""
        self.finished = 0

    def get(self, thread: ThreadId) -> Drive | None:
        return self.table.get(thread)

    def __contains__(self, thread: object) -> bool:
        return thread in self.table

    def __len__(self) -> int:
        return len(self.table)

    def agent(self, ref: str) -> tuple[Agent, RayToolRunner]:
        if ref not in self.agents:
            agent = load_agent(ref)
            self.agents[ref] = (agent, RayToolRunner(ref, agent, self.waves))
        return self.agents[ref]

    def engine(self, ref: str, faults: FaultPlan, link: ParentLink | None = None) -> Engine:
        agent, tools = self.agent(ref)
        return Engine(
            agent,
            self.store,
            tools,
            publisher=self.publisher,
            faults=faults,
            owner=self.owner,
            children=self.children,
            checkpoints=self.checkpoints,
            parent=link,
            lineage=link.lineage if link else (ref,),
            prompt_path=link.prompt_path if link else None,
            limits=self.spec.limits,
        )

    def spawn(
        self,
        ref: str,
        thread: ThreadId,
        run_id: RunId | None,
        go: Go,
        link: ParentLink | None = None,
        faults: FaultSpec | None = None,
        after: Callable[[Engine, Frontier], Awaitable[None]] | None = None,
    ) -> Drive:
        """Start driving ``thread``; ``after`` runs once the drive returned a frontier."""
        # one drive per thread and host: a second engine here would fence the first
        if thread in self.table:
            raise InvalidTransition(f"thread {thread} is already being driven here")
        engine = self.engine(ref, _faults(faults), link)
        task = asyncio.create_task(self._run(thread, engine, go, after))
        task.add_done_callback(_retrieve)
        drive = Drive(engine, task, run_id)
        self.table[thread] = drive
        return drive

    async def _run(
        self,
        thread: ThreadId,
        engine: Engine,
        go: Go,
        after: Callable[[Engine, Frontier], Awaitable[None]] | None,
    ) -> Frontier:
        try:
            frontier = await go(engine)
            if after is not None:
                await after(engine, frontier)
            return frontier
        except StoreUnavailable as exc:  # the engine's own backoff ran out: drive it again
            log.warning("store unavailable for %s (%s); driving it again later", thread, exc)
            self.paused.add(thread)
            raise
        except (CorruptRecord, StoreLost) as exc:  # fail closed: no engine acts on it here
            log.error("thread %s cannot be trusted (%s); not driving it again", thread, exc)
            self.quarantined.add(thread)
            raise
        finally:
            self._drop(thread, engine)

    def _drop(self, thread: ThreadId, engine: Engine) -> None:
        drive = self.table.get(thread)
        if drive is not None and drive.engine is engine:
            del self.table[thread]
            self.finished += 1
            self.on_idle()

    async def first_commit(self, drive: Drive) -> Any:
        """Once the drive's first commit landed, or the drive is over: True; or the error
        that ended the drive before it committed anything (never reported as success)."""
        committed = asyncio.ensure_future(drive.engine.committed.wait())
        try:
            await asyncio.wait({drive.task, committed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            committed.cancel()
        if drive.task.done() and not drive.engine.committed.is_set():
            drive.task.result()  # re-raise what ended the drive before its first commit
        return True

    async def stop(self, thread: ThreadId, drive: Drive) -> None:
        """Cancel a fenced drive here (its waves are cancelled on the executors)."""
        self.replacing.add(thread)
        try:
            drive.task.cancel()
            await asyncio.wait({drive.task})
        finally:
            self.replacing.discard(thread)


def rested(task: asyncio.Task[Any]) -> AtRest | None:
    """The frontier a finished drive returned, if the Run rests (its final commit landed)."""
    if task.cancelled() or task.exception() is not None:
        return None
    frontier = task.result()
    state = frontier.run_state if isinstance(frontier, Frontier) else None
    if state is not None and state.kind != "running":
        return AtRest(frontier.model_dump_json())
    return None


def _faults(spec: FaultSpec | None) -> FaultPlan:
    if spec is None:
        return FaultPlan()
    return FaultPlan(crash_at=(spec[0], spec[1]), action=_exit if spec[2] == "exit" else None)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A drive's failure nobody awaited (a recovery's) is logged here, not lost."""
    if not task.cancelled() and task.exception() is not None:
        log.info("drive ended: %r", task.exception())


def _exit(where: str) -> None:
    log.warning("fault point %s: ending the host process", where)
    os._exit(17)
