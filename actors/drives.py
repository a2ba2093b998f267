"""The Runs one host process drives: one Engine and one task per thread.

Every failure inside a Run is settled by its Engine (``Engine.settle``); a drive never
settles a Run itself. What reaches a drive's task is what the engine could not settle
— fenced, refused, corrupt, the store out for too long — and it goes to whoever
awaits the drive (``first_commit``), never reported as success. The host's
reconciliation reads ``paused`` (drive it again) and ``quarantined`` (not until the
thread is listed again, its head verifying: ``actors.reconcile``).

**Which drives are stale.** Each engine reaches the store through a ``Holding``, which
notes the owner epoch the engine holds the thread at, from the moment its claim
landed (a recovery's ``claim``, or the claim its first commit carries). A drive is
fenced once the stored thread has moved past that epoch (``Drives.fenced``): another
owner claimed it, or ended the Run. A drive that holds no epoch yet has taken
nothing: its own compare-and-set decides, so it is never taken for stale.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors.waves import RayToolRunner, WaveDispatcher
from actors.wire import AtRest, SystemSpec
from runtime import tracing_env
from runtime.agent import Agent, AgentImports, load_agent
from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.delegation import ChildRunner, ParentLink
from runtime.engine import RACES, Engine
from runtime.errors import (
    CorruptRecord,
    Fenced,
    InvalidTransition,
    RatchetError,
    RunEnded,
    StoreLost,
    StoreUnavailable,
)
from runtime.faults import NO_FAULTS, FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.ports import (
    CommitStore,
    CommittedRecord,
    RunSummary,
    StreamCheckpointStore,
)
from runtime.publish import Publisher

log = logging.getLogger("ratchet.run_host")
FaultSpec = tuple[str, int, str]
"""(fault point, occurrence, action): action ``exit`` ends the process (os._exit)."""
Go = Callable[[Engine], Awaitable[Frontier]]
STOP_S = 5.0
"""How long stopping a fenced drive waits for its task to end before going on without it."""


def starting(
    thread: ThreadId,
    text: str,
    run_id: RunId,
    message_id: str,
    new_thread: bool,
    trace: dict[str, str] | None = None,
) -> Go:
    """A start's drive: ``Engine.start``, a child of the caller's span ``trace``."""
    return lambda e: tracing_env.within(
        trace, e.start(thread, text, run_id=run_id, message_id=message_id, new_thread=new_thread)
    )


class Holding:
    """An engine's store, noting the owner epoch the engine holds its thread at.

    Set when the engine's claim lands — ``claim`` (a recovery) or the first commit,
    which carries the claim of a start or a resume — and kept by its later commits,
    which all write at that epoch. Everything else passes through unchanged.
    """

    def __init__(self, store: CommitStore) -> None:
        self.store = store
        self.epoch: int | None = None
        self.claimed = asyncio.Event()
        """Set once ``epoch`` is."""

    def __getattr__(self, name: str) -> Any:  # e.g. payload_limit, read by the Engine
        return getattr(self.store, name)

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        receipt = await self.store.append(commit, expected_version, epoch, claim=claim)
        self.epoch = epoch + 1 if claim is not None else epoch
        self.claimed.set()
        return receipt

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        claimed = await self.store.claim(thread, owner, supersedes)
        self.epoch = claimed.epoch
        self.claimed.set()
        return claimed

    async def load(self, thread: ThreadId) -> Frontier:
        return await self.store.load(thread)

    async def load_head(self, thread: ThreadId) -> Frontier:
        return await self.store.load_head(thread)

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        return await self.store.read(thread, after_seq, limit)

    async def list_runs(self, state: Any = None, *, host: str | None = None) -> list[RunSummary]:
        return await self.store.list_runs(state, host=host)

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        return await self.store.thread_ids(after, limit)

    async def close(self) -> None:
        """The host owns the store: an engine's view has nothing to close."""


@dataclass
class Drive:
    engine: Engine
    task: asyncio.Task[Any]
    run_id: RunId | None
    holding: Holding

    @property
    def epoch(self) -> int | None:
        """The owner epoch this drive's engine holds the thread at; None: it has claimed
        nothing yet (its first compare-and-set decides whether it may go on)."""
        return self.holding.epoch


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
        tracing_env.configure_from_env()  # the host's OTEL_* (its runtime_env) asks for spans
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
        self._imports = AgentImports()
        self.paused: set[ThreadId] = set()
        """Drives stopped by a store outage that outlasted their backoff: driven again."""
        self.quarantined: set[ThreadId] = set()
        """Threads whose records do not verify: no engine here acts on them (until the
        reconciliation looks at one again: ``actors.reconcile``)."""
        self.replacing: set[ThreadId] = set()
        """Threads whose stale drive is being stopped (a dedicated host must not retire)."""
        self.ending: Counter[ThreadId] = Counter()
        """Threads whose Run a cancel or stop was promised to end, with how many such
        promises are pending: the host ends it from the store once the signalled drive is
        over (``ControlHosting._see_it_ended``), and the reconciler does not drive it
        again meanwhile (``thread in ending``)."""
        self.finished = 0

    def get(self, thread: ThreadId) -> Drive | None:
        return self.table.get(thread)

    def __contains__(self, thread: object) -> bool:
        return thread in self.table

    def __len__(self) -> int:
        return len(self.table)

    def agent(self, ref: str) -> tuple[Agent, RayToolRunner]:
        """The agent of ``ref`` and its tool runner, built once per process (imported here,
        on the loop, only if nobody awaited ``loaded`` for it first)."""
        if ref not in self.agents:
            self._keep(ref, load_agent(ref))
        return self.agents[ref]

    async def loaded(self, ref: str) -> None:
        """Import the agent of ``ref`` in a thread, once for every request that asks
        meanwhile: its module may list an MCP server's tools as it is imported, which on
        this loop would hold every Run of the host for as long as that server takes.
        Requests await it before their checks, so that the spawn after them (with no
        await between) finds it built; an import that fails raises here, and is tried
        again by the next request."""
        if ref in self.agents:
            return
        agent = await self._imports.load(ref)
        if ref not in self.agents:
            self._keep(ref, agent)

    def _keep(self, ref: str, agent: Agent) -> None:
        self.agents[ref] = (agent, RayToolRunner(ref, agent, self.waves))

    def engine(
        self, ref: str, faults: FaultPlan, link: ParentLink | None, store: CommitStore
    ) -> Engine:
        agent, tools = self.agent(ref)
        return Engine(
            agent,
            store,
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
        holding = Holding(self.store)
        engine = self.engine(ref, _faults(faults), link, holding)
        engine.stopped_only_when_told = True  # ``stop`` tells it first
        task = asyncio.create_task(self._run(thread, engine, go, after))
        task.add_done_callback(_retrieve)
        drive = Drive(engine, task, run_id, holding)
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

    async def first_commit(self, drive: Drive, stopped: RatchetError | None = None) -> Any:
        """Once the drive's first commit landed, or the drive is over: True; or the error
        that ended the drive before it committed anything (never reported as success) —
        ``stopped`` (default InvalidTransition) if the drive was stopped before that."""
        committed = asyncio.ensure_future(drive.engine.committed.wait())
        try:
            await asyncio.wait({drive.task, committed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            committed.cancel()
        if drive.task.done() and not drive.engine.committed.is_set():
            if drive.task.cancelled():  # never a CancelledError out of an actor call
                raise stopped or InvalidTransition(
                    f"the drive of run {drive.run_id} was stopped before its first commit"
                )
            drive.task.result()  # re-raise what ended the drive before its first commit
        return True

    async def claimed(self, thread: ThreadId) -> Drive | None:
        """This host's drive of ``thread`` once it holds the thread (its claim landed), or
        None once there is none. A drive that has claimed nothing yet may never claim —
        a repeated start of a Run that exists, a resume or a recovery that finds it at
        rest — and must not pass for the Run's driver: told to cancel, it would drop the
        signal and the Run would stay as it was. Its claim is one store call after its
        load, so this waits briefly (at most ``STOP_S`` per drive: then it is taken as
        it is)."""
        for _ in range(RACES):
            drive = self.table.get(thread)
            if drive is None or drive.epoch is not None:
                return drive
            await over_or(drive, drive.holding.claimed, STOP_S)
            if self.table.get(thread) is drive and drive.epoch is None:
                return drive  # slow to claim (the store out): it can be told meanwhile
        return self.table.get(thread)

    def fenced(self, drive: Drive, frontier: Frontier) -> bool:
        """Whether the stored ``frontier`` has moved past the epoch ``drive`` holds: another
        claim since (another owner's, or an end at rest). A drive holding none is not.

        Only a later epoch fences. A frontier from before the drive's own claim (a load
        that was in flight while the claim landed) is older, not another claim: taking
        it for one stopped a resume's drive after its commit and before its tool ran,
        so the thread's reconciliation recovered the approved call as indeterminate."""
        held = drive.epoch
        if held is None or frontier.epoch < held:
            return False
        return frontier.epoch > held or frontier.owner != self.owner

    async def stop(self, thread: ThreadId, drive: Drive, *, idle: bool = True) -> None:
        """Cancel a fenced drive here (its waves are cancelled on the executors). A drive
        that does not end within ``STOP_S`` is let go: fenced, it can commit nothing.
        ``idle``: tell the host once the thread is free (False when the caller goes on
        to act on the thread itself)."""
        self.replacing.add(thread)
        try:
            drive.engine.told_to_stop = True  # a cancellation of its own else fails its Run
            drive.task.cancel()
            _, running = await asyncio.wait({drive.task}, timeout=STOP_S)
            if running:
                log.warning("the fenced drive of %s did not stop within %gs", thread, STOP_S)
                if self.table.get(thread) is drive:
                    del self.table[thread]
        finally:
            self.replacing.discard(thread)
            self.paused.discard(thread)  # another owner has it: not ours to drive again
        if idle:
            self.on_idle()


def rested(task: asyncio.Task[Any]) -> AtRest | None:
    """The frontier a finished drive returned, if the Run rests (its final commit landed)."""
    if task.cancelled() or task.exception() is not None:
        return None
    frontier = task.result()
    state = frontier.run_state if isinstance(frontier, Frontier) else None
    if state is not None and state.kind != "running":
        return AtRest(frontier.model_dump_json())
    return None


FOLLOWED: tuple[type[RatchetError], ...] = (Fenced, RunEnded, StoreUnavailable)
"""A child's drive that ended so is settled by another (an owner, or this host again)."""

NOT_THE_RUNS: tuple[type[RatchetError], ...] = (*FOLLOWED, CorruptRecord, StoreLost)
"""Failures of a recovery that are not its Run's: another owner has it, it ended, the
store is out (a flapping server, a partition: tried again later), its records do not
verify (quarantined, not ended)."""


def counts_against_run(error: BaseException) -> bool:
    """Whether a recovery that failed with ``error`` counts towards its Run's dead letter
    (the one rule for a host's own recoveries, its reconciler and the Supervisor)."""
    return not isinstance(error, NOT_THE_RUNS)


async def over_or(drive: Drive, event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``drive`` is over or ``event`` is set, at most ``timeout_s``."""
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait(
            {drive.task, waiting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        waiting.cancel()


def drove(task: asyncio.Task[Any]) -> Frontier | None:
    """The frontier a child's finished drive returned; None when the store must say (the
    drive was stopped, fenced, or paused); else raises what ended it."""
    if task.cancelled():
        return None
    error = task.exception()
    if error is None:
        result: Frontier = task.result()
        return result
    if isinstance(error, FOLLOWED):
        return None
    raise error


def _faults(spec: FaultSpec | None) -> FaultPlan:
    if spec is None:  # the shared plan that records nothing: a drive's points went unread
        return NO_FAULTS
    return FaultPlan(crash_at=(spec[0], spec[1]), action=_exit if spec[2] == "exit" else None)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A drive's failure nobody awaited (a recovery's) is logged here, not lost."""
    if not task.cancelled() and task.exception() is not None:
        log.info("drive ended: %r", task.exception())


def _exit(where: str) -> None:
    log.warning("fault point %s: ending the host process", where)
    os._exit(17)
