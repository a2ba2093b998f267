"""RunHost: an async Ray actor that drives many Runs, one Engine per Run (DESIGN §6).

A host holds only the Runs it is driving right now: when an Engine's drive returns
(the Run ended, or awaits a ResumeCommand) the Engine is dropped. Agents are
rebuilt here from their reference ``module:attr``; actor calls carry strings.

Liveness: one heartbeat per host renews its lease with the Supervisor. When Ray
restarts a crashed host (the fast path), the new incarnation finds the Runs whose
owner was this host, settles them ``failed/execution_lost`` and recovers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from actors.children import RayChildRunner
from actors.heap import freeze_startup_heap
from actors.ownership import running_owned_by, settle_lost
from actors.spare import replace_spare_if_restarted, restarted
from actors.store_actor import open_system_store
from actors.tool_executor import ExecutorPools
from actors.waves import RayToolRunner, WaveDispatcher
from actors.wire import (
    NAMESPACE,
    AtRest,
    Placement,
    RemoteError,
    RunMeta,
    SystemSpec,
    owner_id,
    run_meta,
    unwrap,
)
from runtime.agent import Agent, load_agent
from runtime.batch import ToolOutput
from runtime.commit import Frontier
from runtime.delegation import (
    CHILD_OUTCOME,
    ChildRequest,
    ParentLink,
    delivery,
    outcome_of,
    parent_link,
)
from runtime.engine import Engine
from runtime.errors import (
    AgentImportError,
    Fenced,
    InvalidTransition,
    RatchetError,
    ResumeRejected,
    RunEnded,
    StoreUnavailable,
)
from runtime.faults import FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    ResumeCommand,
    RunningState,
    Stopped,
    validate_resume,
)
from runtime.ports import Finished, LiveBus, StreamCheckpointStore
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.run_host")
STORE_PAUSE_S = 5.0
"""How long a Run whose store stayed unavailable rests before this host tries again."""
REFUSALS = (InvalidTransition, ResumeRejected, AgentImportError)
"""Errors that refuse a request before anything executes: they go back to the caller."""
FaultSpec = tuple[str, int, str]
"""(fault point, occurrence, action): action ``exit`` ends the process (os._exit)."""


class _Observed(FaultPlan):
    """A FaultPlan that also reports the first commit of a drive."""

    def __init__(self, spec: FaultSpec | None) -> None:
        crash_at = (spec[0], spec[1]) if spec else None
        action = _exit if spec and spec[2] == "exit" else None
        super().__init__(crash_at=crash_at, action=action)
        self.committed = asyncio.Event()

    def hit(self, name: str) -> None:
        super().hit(name)
        if name.startswith("after:"):
            self.committed.set()


def _rested(task: asyncio.Task[Any]) -> AtRest | None:
    """The frontier a finished drive returned, if the Run rests (its final commit landed)."""
    if task.cancelled() or task.exception() is not None:
        return None
    frontier = task.result()
    if isinstance(frontier, Frontier) and _at_rest(frontier):
        return AtRest(frontier.model_dump_json())
    return None


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A refusal nobody awaited (a recovery's) is logged here, not lost."""
    if not task.cancelled() and task.exception() is not None:
        log.info("drive refused: %s", task.exception())


def _exit(where: str) -> None:
    log.warning("fault point %s: ending the host process", where)
    os._exit(17)


@dataclass
class _Drive:
    engine: Engine
    task: asyncio.Task[Any]
    faults: _Observed


class RunHost:
    async def __init__(self, spec: SystemSpec, host_id: str, kind: str = "hosted") -> None:
        self.startup = {"init": time.time()}
        """Wall-clock marks of this incarnation's start (``info``; recovery figures)."""
        self.spec, self.host_id, self.kind = spec, host_id, kind
        self.owner = owner_id(host_id)
        self.store = await open_system_store(spec)
        self.waves = WaveDispatcher(ExecutorPools(spec))
        self.children = RayChildRunner(spec)
        self.bus = _live_bus(spec)
        self.checkpoints = _checkpoint_store(spec)
        self.agents: dict[str, tuple[Agent, RayToolRunner]] = {}
        self.drives: dict[ThreadId, _Drive] = {}
        self.finished = 0
        self.recovered = 0
        self._background = {asyncio.create_task(self._heartbeat())}
        self._reclaimed: asyncio.Task[None] | None = None
        self._replacing: set[ThreadId] = set()
        """Threads whose stale drive is being replaced: a dedicated host must not retire."""
        if restarted():
            # requests wait for it: a retried start must not race the recording of the
            # crash (failed/execution_lost) for the Runs this host owned
            self._reclaimed = asyncio.create_task(self._reclaim())
        freeze_startup_heap()
        self.startup["ready"] = time.time()

    # ---- the actor's interface ------------------------------------------------------

    async def start_run(
        self,
        agent_ref: str,
        thread: ThreadId,
        run_id: RunId,
        text: str,
        placement: str = "hosted",
        faults: FaultSpec | None = None,
        wait: bool = False,
    ) -> Any:
        """Activate and drive a Run; returns once its first commit landed (or it ended),
        or with ``wait`` once this host's drive of it is over (``Ratchet.run``: one call
        where start and ``until_rest`` would take two)."""
        await self._after_reclaim()
        kind: Placement = "dedicated" if placement == "dedicated" else "hosted"
        meta = RunMeta(agent_ref=agent_ref, placement=kind)
        try:
            drive = self.drives.get(thread) or self._spawn(
                agent_ref,
                thread,
                faults,
                lambda e: e.start(thread, text, run_id=run_id, message_id=meta.message_id(run_id)),
            )
            started = await self._first_commit(drive)
            if wait:
                await asyncio.wait({drive.task})  # its own errors stay with the drive
                return _rested(drive.task) or started
            return started
        except RatchetError as exc:
            return RemoteError.of(exc)

    async def recover_run(self, thread: ThreadId, agent_ref: str | None = None) -> Any:
        """Take the thread over (fencing its previous owner) and continue it."""
        await self._after_reclaim()
        return await self._recover(thread, agent_ref)

    async def _recover(self, thread: ThreadId, agent_ref: str | None = None) -> Any:
        try:
            frontier = await self.store.load(thread)
            stale = self.drives.get(thread)
            if stale is not None:
                if frontier.owner == self.owner:
                    return True  # driven here, and still ours: nothing to recover
                # Someone claimed the thread past this drive (the Supervisor took this host
                # for lost while it was only slow): the drive is fenced and would only find
                # out at its next commit, which a long tool call can put off indefinitely.
                self._replacing.add(thread)
                try:
                    stale.task.cancel()
                    await asyncio.wait({stale.task})
                finally:
                    self._replacing.discard(thread)
                if thread in self.drives:  # a concurrent recovery got here first
                    return True
                frontier = await self.store.load(thread)
            ref = agent_ref or _ref_of(frontier)
            self._spawn(ref, thread, None, lambda e: e.recover(thread), parent_link(frontier))
            self.recovered += 1
            return True
        except RatchetError as exc:
            self._retire_if_idle()  # a dedicated host whose stale drive was dropped
            return RemoteError.of(exc)

    async def resume_run(self, command: ResumeCommand) -> Any:
        """Apply a ResumeCommand; a rejected one raises ResumeRejected at the caller."""
        await self._after_reclaim()
        try:
            if command.thread_id in self.drives:
                raise ResumeRejected("ticket", "the run is running, not awaiting")
            # Validate before Engine.resume claims: a claim on a Run driven elsewhere
            # would fence its driver, and a rejected resume must change nothing.
            frontier = await self.store.load(command.thread_id)
            state = frontier.run_state
            ticket = state.ticket if isinstance(state, AwaitingState) else None
            validate_resume(ticket, command, now_us())
            drive = self._spawn(
                _ref_of(frontier),
                command.thread_id,
                None,
                lambda e: e.resume(command),
                parent_link(frontier),
            )
            return await self._first_commit(drive)
        except RatchetError as exc:
            return RemoteError.of(exc)

    async def cancel_run(self, thread: ThreadId) -> Any:
        """Cancel a Run driven here, or one at rest (awaiting, or running with no driver)."""
        drive = self.drives.get(thread)
        if drive is not None:
            drive.engine.cancel()
            return "signalled"
        try:
            return await self._cancel_at_rest(thread)
        except RatchetError as exc:
            return RemoteError.of(exc)
        finally:
            self._retire_if_idle()

    async def stop_run(self, thread: ThreadId, reason: str) -> Any:
        """End a Run ``stopped(reason)``: signal its engine here, or end it at rest."""
        drive = self.drives.get(thread)
        if drive is not None:
            drive.engine.stop(reason)
            return "signalled"
        try:
            frontier = await self.store.load(thread)
            if frontier.run_state is None or frontier.ended:
                return "not_running"
            engine = self._engine(_ref_of(frontier), FaultPlan(), parent_link(frontier))
            await engine.terminate(thread, Stopped(reason=reason))
            return "stopped"
        except RatchetError as exc:
            return RemoteError.of(exc)
        finally:
            self._retire_if_idle()

    async def pause_run(self, thread: ThreadId) -> str:
        """A manual pause: the Run driven here awaits at its next Step boundary."""
        drive = self.drives.get(thread)
        if drive is None:
            return "not_running"
        drive.engine.pause()
        return "signalled"

    async def _after_reclaim(self) -> None:
        if self._reclaimed is not None:
            with contextlib.suppress(Exception):  # its failures are logged where they happen
                await asyncio.shield(self._reclaimed)

    async def run_child(self, raw: dict[str, Any]) -> Any:
        """Drive (or join, or read back) a child Run; answer its outcome once it is at rest."""
        try:
            request = ChildRequest.model_validate(raw)
            thread = request.child_thread
            drive = self.drives.get(thread)
            if drive is None:
                meta = RunMeta(agent_ref=request.agent)
                message_id = meta.message_id(request.child_run)
                drive = self._spawn(
                    request.agent,
                    thread,
                    None,
                    lambda e: e.start(
                        thread, request.input, run_id=request.child_run, message_id=message_id
                    ),
                    ParentLink.of(request),
                )
            # shielded: a parent that stops waiting cancels its children explicitly
            frontier = await asyncio.shield(drive.task)
            if frontier is None or frontier.run_state is None or not _at_rest(frontier):
                frontier = await self._until_at_rest(thread)
            return CHILD_OUTCOME.dump_python(outcome_of(frontier), mode="json")
        except AgentImportError as exc:
            failed = Finished(output=ToolOutput(content=f"delegation failed: {exc}", is_error=True))
            return CHILD_OUTCOME.dump_python(failed, mode="json")
        except RatchetError as exc:
            return RemoteError.of(exc)

    async def _until_at_rest(self, thread: ThreadId) -> Frontier:
        """Another owner drives the child: follow the store until it rests."""
        delay = 0.02
        while True:
            frontier = await self.store.load(thread)
            if frontier.run_state is not None and _at_rest(frontier):
                return frontier
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _deliver(self, child: Frontier) -> None:
        """A lone child that surfaced a human wait has ended: resume its waiting parent."""
        link = parent_link(child)
        if link is None or not child.ended:
            return
        parent = await self.store.load(link.thread)
        command = delivery(child, parent)
        if command is None:
            return
        parent_meta = run_meta(parent)
        if parent_meta is not None and parent_meta.placement == "dedicated":
            host = dedicated_host(self.spec, link.thread)
        else:
            host = self.children.host_for(link.thread)
        unwrap(await host.resume_run.remote(command))

    async def driving(self) -> list[str]:
        return sorted(self.drives)

    async def until_rest(self, thread: ThreadId) -> bool:
        """Return once this host's drive of ``thread`` is over: True; False at once when
        this host is not driving it (the caller then reads the store).

        A completion notice, not a result: the caller reads the outcome from the store,
        which is the only truth (the drive may have stopped because it was fenced).
        """
        drive = self.drives.get(thread)
        if drive is None:
            return False
        await asyncio.wait({drive.task})  # never raises: the drive's own errors stay there
        return True

    async def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "host": self.host_id,
            "pid": os.getpid(),
            "node": ctx.get_node_id(),
            "driving": len(self.drives),
            "finished": self.finished,
            "recovered": self.recovered,
            "waves_sent": self.waves.sent["waves"],
            "executor_calls": self.waves.sent["calls"],
            # group commit (SQL stores): transactions that carried appends, and the appends
            "store_groups": getattr(self.store, "groups", None),
            "store_appends": getattr(self.store, "appends", None),
            "startup": self.startup,
        }

    async def ping(self) -> str:
        return self.host_id

    # ---- driving ---------------------------------------------------------------------

    def _agent(self, ref: str) -> tuple[Agent, RayToolRunner]:
        if ref not in self.agents:
            agent = load_agent(ref)
            self.agents[ref] = (agent, RayToolRunner(ref, agent, self.waves))
        return self.agents[ref]

    def _engine(self, ref: str, faults: FaultPlan, link: ParentLink | None = None) -> Engine:
        agent, tools = self._agent(ref)
        return Engine(
            agent,
            self.store,
            tools,
            bus=self.bus,
            faults=faults,
            owner=self.owner,
            children=self.children,
            checkpoints=self.checkpoints,
            parent=link,
            lineage=link.lineage if link else (ref,),
            prompt_path=link.prompt_path if link else None,
        )

    def _spawn(
        self,
        ref: str,
        thread: ThreadId,
        faults: FaultSpec | None,
        go: Any,
        link: ParentLink | None = None,
    ) -> _Drive:
        # one drive per thread and host: a second engine here would fence the first
        assert thread not in self.drives, f"{thread} is already driven here"
        plan = _Observed(faults)
        engine = self._engine(ref, plan, link)
        task = asyncio.create_task(self._run(thread, engine, go))
        task.add_done_callback(_retrieve)
        drive = _Drive(engine, task, plan)
        self.drives[thread] = drive
        return drive

    async def _run(self, thread: ThreadId, engine: Engine, go: Any) -> Any:
        try:
            frontier = await go(engine)
            if engine.parent is not None:
                try:
                    await self._deliver(frontier)
                except Exception as exc:  # the parent stays awaiting; a later resume delivers
                    log.warning("delivering %s to its parent failed: %s", thread, exc)
            return frontier
        except (Fenced, RunEnded) as exc:  # a newer owner has the Run, or it is over
            log.info("run on %s taken over or over: %s", thread, exc)
        except REFUSALS:
            raise  # nothing was executing: the caller hears why (see _first_commit)
        except StoreUnavailable as exc:  # the engine's own backoff ran out: pause, retry
            log.warning("store unavailable for %s (%s); recovering again later", thread, exc)
            self._later(thread, engine)
        except Exception as exc:  # seed §4.3: settle the status even when execution throws
            log.exception("run on %s failed unexpectedly", thread)
            self._background.add(asyncio.create_task(self._settle(thread, type(exc).__name__)))
        finally:
            self._drop(thread, engine)
        return None

    def _later(self, thread: ThreadId, engine: Engine) -> None:
        ref = next((r for r, (a, _) in self.agents.items() if a is engine.agent), None)

        async def again() -> None:
            await asyncio.sleep(STORE_PAUSE_S)
            await self.recover_run(thread, ref)

        self._background.add(asyncio.create_task(again()))

    async def _settle(self, thread: ThreadId, code: str) -> None:
        with contextlib.suppress(RatchetError):
            await settle_lost(self.store, thread, self.owner, reason=f"execution_error:{code}")

    def _drop(self, thread: ThreadId, engine: Engine) -> None:
        drive = self.drives.get(thread)
        if drive is not None and drive.engine is engine:
            del self.drives[thread]
            self.finished += 1
            self._retire_if_idle()

    def _retire_if_idle(self) -> None:
        """A dedicated host with nothing left to drive ends; also one started only to
        cancel or stop its Run at rest."""
        if self.kind == "dedicated" and not self.drives and not self._replacing:
            self._background.add(asyncio.create_task(self._retire()))

    async def _first_commit(self, drive: _Drive) -> Any:
        committed = asyncio.ensure_future(drive.faults.committed.wait())
        try:
            await asyncio.wait({drive.task, committed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            committed.cancel()
        if drive.task.done():
            drive.task.result()  # re-raise what ended the drive before its first commit
        return True

    async def _cancel_at_rest(self, thread: ThreadId) -> str:
        """End a Run no engine here drives; the claim fences a driver elsewhere, if any."""
        frontier = await self.store.load(thread)
        if not isinstance(frontier.run_state, RunningState | AwaitingState):
            return "not_running"
        engine = self._engine(_ref_of(frontier), FaultPlan(), parent_link(frontier))
        await engine.terminate(thread, Cancelled())
        return "cancelled"

    # ---- liveness and the fast path ------------------------------------------------------

    async def _heartbeat(self) -> None:
        supervisor = None
        while True:
            try:
                if supervisor is None:
                    supervisor = ray.get_actor(self.spec.supervisor_name, namespace=NAMESPACE)
                await supervisor.heartbeat.remote(self.host_id, self.kind)
            except Exception as exc:  # no supervisor (yet): hosts still work without one
                log.debug("heartbeat failed: %s", exc)
                supervisor = None
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _reclaim(self) -> None:
        """Restarted by Ray: the Runs this host owned were lost with its previous process.

        They are settled and recovered concurrently, so the store's group commit
        batches the settlements instead of paying one transaction after another.
        """
        lost = await running_owned_by(self.store, self.host_id)
        await asyncio.gather(*(self._reclaim_one(frontier) for frontier in lost))
        self.startup["reclaimed"] = time.time()
        # after the recovery: starting a process meanwhile would slow it down
        replace_spare_if_restarted(self.spec.warm_spares)

    async def _reclaim_one(self, frontier: Frontier) -> None:
        thread = frontier.thread_id
        meta = run_meta(frontier)
        if thread in self.drives or meta is None:
            return
        with contextlib.suppress(Fenced):
            await settle_lost(self.store, thread, self.owner)
        await self._recover(thread, meta.agent_ref)  # not recover_run: it waits for us

    async def _retire(self) -> None:
        """A dedicated host lives for its one Run."""
        with contextlib.suppress(Exception):
            supervisor = ray.get_actor(self.spec.supervisor_name, namespace=NAMESPACE)
            await supervisor.retire.remote(self.host_id)


def _live_bus(spec: SystemSpec) -> LiveBus | None:
    """Redis Streams when Redis is configured; otherwise clients read facts from the store."""
    if not spec.redis_url:
        return None
    from storage.bus import RedisStreamBus

    return RedisStreamBus.connect(spec.redis_url)


def _checkpoint_store(spec: SystemSpec) -> StreamCheckpointStore | None:
    """Stream checkpoints live in Redis when it is configured (best effort either way)."""
    if not spec.redis_url:
        return None
    from storage.redis_checkpoints import RedisCheckpointStore

    return RedisCheckpointStore.connect(spec.redis_url)


RemoteRunHost = ray.remote(RunHost)


def _host_options(spec: SystemSpec, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "lifetime": "detached",
        "max_restarts": spec.host_max_restarts,
        "max_task_retries": 0,
        "max_concurrency": 10_000,
        "num_cpus": 0,
        **extra,
    }


def hosted_host(spec: SystemSpec, index: int) -> Any:
    """The index-th RunHost of the hosted pool (created if it is not running)."""
    extra = dict(spec.host_options[index]) if index < len(spec.host_options) else {}
    name = spec.host_name(index)
    options = _host_options(spec, name, extra)
    return RemoteRunHost.options(**options).remote(spec, name, "hosted")


def dedicated_host(spec: SystemSpec, thread: str, extra: dict[str, Any] | None = None) -> Any:
    """A RunHost of its own for one Run."""
    name = spec.dedicated_name(thread)
    options = _host_options(spec, name, dict(extra or {}))
    return RemoteRunHost.options(**options).remote(spec, name, "dedicated")


def _at_rest(frontier: Frontier) -> bool:
    return frontier.run_state is not None and frontier.run_state.kind != "running"


def _ref_of(frontier: Frontier) -> str:
    """The agent reference the Run was started with (every process rebuilds it from this)."""
    meta = run_meta(frontier)
    if meta is None:
        raise AgentImportError(f"thread {frontier.thread_id!r} records no agent reference")
    return meta.agent_ref
