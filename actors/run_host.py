"""RunHost: an async Ray actor that drives many Runs, one Engine per Run (DESIGN §6).

A host holds only the Runs it is driving right now (``actors.drives``): when an
Engine's drive returns (the Run ended, or awaits a ResumeCommand) the Engine is
dropped. Agents are rebuilt here from their reference ``module:attr``; actor calls
carry strings. Every failure inside a Run is settled by its Engine; what a drive
cannot settle goes back to whoever asked — a start or resume refused, fenced or
racing another — as a typed error, never as success.

A drive still held here after another owner took its Run (this host was only slow)
does not answer for it: a cancel, stop, pause or resume that finds it stale
(``Drives.fenced``) stops it and acts as if there were no drive here.

Liveness: one heartbeat per host renews its lease with the Supervisor. Every
``reconcile_s`` the host compares what it owns with what it drives
(``actors.reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import Any

import ray

from actors.child_host import ChildHosting
from actors.children import RayChildRunner
from actors.drives import (
    Drive,
    Drives,
    FaultSpec,
    over_or,
    rested,
    starting,
)
from actors.heap import freeze_startup_heap
from actors.host_control import ControlHosting
from actors.host_recovery import RecoveryHosting, ref_of
from actors.reconcile import Reconciler
from actors.retiring import Admission, admitted
from actors.spare import replace_spare_if_restarted, restarted
from actors.store_actor import open_system_store
from actors.tool_executor import ExecutorPools
from actors.waves import WaveDispatcher
from actors.wire import (
    NAMESPACE,
    Placement,
    RunMeta,
    SystemSpec,
    asked_before,
    at_rest,
    checkpoint_store,
    live_bus,
    owner_id,
    remote_error,
)
from runtime import tracing_env
from runtime.commit import Frontier
from runtime.delegation import (
    parent_link,
)
from runtime.engine import RACES
from runtime.errors import (
    InvalidTransition,
    RatchetError,
    ResumeRejected,
)
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    ResumeCommand,
    validate_resume,
)
from runtime.publish import Publisher
from runtime.resume import check_command
from runtime.rules import check_repeated_start, ran_before
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.run_host")
FINISHING_S = 5.0
"""How long a start waits for this host's drive of the thread's previous Run to wind up."""
RETIRE_AGAIN_S = 5.0
"""How long a dedicated host at rest waits for the Supervisor to end it before it asks
again (the Supervisor answers False while a recovery of its Run is on its way)."""


class RunHost(ControlHosting, ChildHosting, RecoveryHosting):
    # Ray awaits an async actor's __init__ in the actor's own event loop
    async def __init__(self, spec: SystemSpec, host_id: str, kind: str = "hosted") -> None:  # type: ignore[misc]
        self.startup = {"init": time.time()}
        """Wall-clock marks of this incarnation's start (``info``; recovery figures)."""
        self.spec, self.host_id, self.kind = spec, host_id, kind
        self.owner = owner_id(host_id)
        self.store = await open_system_store(spec, who=f"RunHost {host_id}")
        self.waves = WaveDispatcher(ExecutorPools(spec))
        self.children = RayChildRunner(spec, self.store)
        bus = live_bus(spec)
        self.publisher = Publisher(bus) if bus is not None else None
        self.drives = Drives(
            spec,
            self.store,
            self.owner,
            self.waves,
            self.children,
            self.publisher,
            checkpoint_store(spec, self.store),
            self._retire_if_idle,
        )
        self.recovered = 0
        self._retire_asked: float | None = None
        """When this dedicated host last asked to be ended (None: never)."""
        self.admission = Admission()
        self.reconciler = Reconciler(
            host_id,
            self.owner,
            self.store,
            self.drives,
            functools.partial(self._recover, owner=self.owner),
            system=spec.name,
        )
        # requests wait for the first reconciliation: a retried start must not race the
        # recording of the crash (failed/execution_lost) for the Runs this host owned
        self._reconciled = asyncio.create_task(self._first_reconcile())
        self._background = {
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._reconcile_loop()),
        }
        freeze_startup_heap()
        self.startup["ready"] = time.time()

    # ---- the actor's interface ------------------------------------------------------

    @admitted
    async def start_run(
        self,
        agent_ref: str,
        thread: ThreadId,
        run_id: RunId,
        text: str,
        placement: str = "hosted",
        faults: FaultSpec | None = None,
        wait: bool = False,
        trace: dict[str, str] | None = None,  # the caller's span: the drive's parent
        new_thread: bool = False,
    ) -> Any:
        """Activate and drive a Run; returns once its first commit landed (or it ended),
        or with ``wait`` once this host's drive of it is over (``Ratchet.run``: one call
        where start and ``until_rest`` would take two). A second start of the same Run
        joins it; a start while another Run of the thread is active is InvalidTransition.
        ``new_thread``: the caller made the thread's id (``Engine.start``)."""
        await self._after_reclaim()
        kind: Placement = "dedicated" if placement == "dedicated" else "hosted"
        meta = RunMeta(agent_ref=agent_ref, placement=kind)
        try:
            await self.drives.loaded(agent_ref)  # off the loop, before the checks below
            message = meta.message_id(run_id)
            drive = self.drives.get(thread)
            if drive is not None and drive.run_id != run_id:
                repeat, drive = await self._finishing(thread, drive, run_id, message, text)
                if repeat:  # its Run is one the thread has moved past: the log has its end
                    return True
            joined = drive is not None
            if drive is None:
                go = starting(thread, text, run_id, meta.message_id(run_id), new_thread, trace)
                drive = self.drives.spawn(agent_ref, thread, run_id, go, faults=faults)
            stored = None
            try:
                started = await self.drives.first_commit(drive)
            except RatchetError:
                # a joined drive (a resume rejected, a recovery fenced) fails on its own:
                # this start shares its error only if the Run was never activated
                stored = await self.store.load(thread) if joined else None
                if stored is None or not ran_before(stored, message):
                    raise
                started = True
            if joined:  # a repeat only if it asked the same (as Engine.start checks)
                stored = stored or await self.store.load(thread)
                check_repeated_start(stored, message, text)
            if wait:
                await asyncio.wait({drive.task})  # its own errors stay with the drive
                return rested(drive.task) or started
            return started
        except InvalidTransition as exc:  # asked with another placement, it is a repeat
            if await self._asked_elsewhere(thread, run_id, agent_ref, text):
                return True  # its caller follows the Run in the store to its rest
            return remote_error(exc)
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            return remote_error(exc)

    async def _asked_elsewhere(
        self, thread: ThreadId, run_id: RunId, agent_ref: str, text: str
    ) -> bool:
        """A start refused as another ask of the Run (its input message names another
        placement) that asked the same input and agent: the same Run, asked through
        another door. Never an error of its own: the refusal stands."""
        try:
            return asked_before(await self.store.load(thread), run_id, agent_ref, text)
        except Exception:  # the store out or the thread corrupt: the refusal it met stands
            return False

    async def _finishing(
        self, thread: ThreadId, drive: Drive, run_id: RunId, message: str, text: str
    ) -> tuple[bool, Drive | None]:
        """This host drives another Run of ``thread``. A start of a Run the thread has moved
        past (it asked the same: ``check_repeated_start``) is a repeat: (True, None). Else,
        if that other Run has ended (its drive is winding up), wait for the drive to go; if
        it is active, the start is refused. A start of ``run_id`` that got in meanwhile is
        joined.

        A drive whose first commit has not landed is starting, not winding up: whether it
        lands decides. Taken for one winding up, a start racing it waited for its Run to
        end and then began a second Run on the thread (one Run's start is refused)."""
        frontier = await self.store.load(thread)
        if frontier.run_id != drive.run_id and not ran_before(frontier, message):
            await over_or(drive, drive.engine.committed, FINISHING_S)
            frontier = await self.store.load(thread)
        if ran_before(frontier, message):
            check_repeated_start(frontier, message, text, run_id)
            return True, None
        if frontier.run_id == drive.run_id and not at_rest(frontier):
            raise InvalidTransition(f"thread {thread} already has an active run {drive.run_id}")
        await asyncio.wait({drive.task}, timeout=FINISHING_S)
        now = self.drives.get(thread)
        if now is not None and now.run_id != run_id:
            raise InvalidTransition(f"thread {thread} is still being driven here")
        return False, now

    @admitted
    async def resume_run(self, command: ResumeCommand, trace: dict[str, str] | None = None) -> Any:
        """Apply a ResumeCommand; a rejected one raises ResumeRejected at the caller. Of two
        resumes of one ticket (through this host or any other) exactly one is applied."""
        await self._after_reclaim()
        try:
            command = check_command(command, self.spec.limits)
            frontier = await self._resumable(command)
            drive = self.drives.spawn(
                ref_of(frontier),
                command.thread_id,
                frontier.run_id,
                lambda e: tracing_env.within(trace, e.resume(command, frontier)),
                parent_link(frontier),
                after=self._after,
            )
            stopped = ResumeRejected("ticket", "the resume was stopped before it landed")
            return await self.drives.first_commit(drive, stopped)
        except Exception as exc:  # the caller gets it as its own type (RemoteError)
            return remote_error(exc)

    async def _resumable(self, command: ResumeCommand) -> Frontier:
        """The thread's frontier, validated for ``command``, with no drive of it here.

        A drive here that got in first (another resume of the ticket, through this host,
        whose commit had not landed when this one loaded the thread) decides the race:
        this one waits for that drive's first commit, or its end, and judges the stored
        thread again. Rejected at once, its caller would read the thread still awaiting
        on the ticket it was told someone else had taken."""
        thread = command.thread_id
        for _ in range(RACES):
            await self.drives.claimed(thread)  # one that claims nothing goes
            frontier = await self.store.load(thread)
            state = frontier.run_state
            ticket = state.ticket if isinstance(state, AwaitingState) else None
            validate_resume(ticket, command, now_us())
            await self.drives.loaded(ref_of(frontier))  # off the loop, before the checks
            local = self.drives.get(thread)
            if local is not None and self.drives.fenced(local, frontier):
                await self.drives.stop(thread, local, idle=False)
            local = self.drives.get(thread)
            if local is None:  # checked last: no await after it
                return frontier
            if local.engine.committed.is_set():  # it has landed: winding down, at rest
                await asyncio.wait({local.task}, timeout=FINISHING_S)
                continue
            with contextlib.suppress(Exception):  # its failure is its own caller's to hear
                await self.drives.first_commit(local)
        raise ResumeRejected("ticket", "the run is being driven here, not awaiting")

    async def _after_reclaim(self) -> None:
        with contextlib.suppress(Exception):  # its failures are logged where they happen
            await asyncio.shield(self._reconciled)

    async def driving(self) -> list[str]:
        return sorted(self.drives.table)

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
            "finished": self.drives.finished,
            "recovered": self.recovered,
            "reconciled": self.reconciler.passes,
            "quarantined": sorted(self.drives.quarantined),
            "waves_sent": self.waves.sent["waves"],
            "executor_calls": self.waves.sent["calls"],
            "executors_restarted": self.waves.restarted,  # taken for hung (actors.waves)
            # group commit (SQL stores): transactions with appends, the appends, the seconds
            # appends waited for their groups and the groups took to write
            **{f"store_{k}": getattr(self.store, k, None) for k in GROUP_COUNTS},
            "bus_dropped": self.publisher.dropped if self.publisher is not None else 0,
            "startup": self.startup,
        }

    async def ping(self) -> str:
        return self.host_id

    async def retire_now(self) -> bool:
        """The Supervisor ends this dedicated host: True if it is idle, and then it
        starts no drive any more (``actors.retiring``)."""
        return self.admission.close(self.drives, self._retire_if_idle)

    def _retire_if_idle(self) -> None:
        """A dedicated host with nothing left to drive ends; also one started only to
        cancel or stop its Run at rest. It asks until the Supervisor ends it: an ask
        lost with a Supervisor that died left the host running for good (the heartbeat
        asks again, ``RETIRE_AGAIN_S`` apart, while it is idle)."""
        busy = len(self.drives) or self.drives.replacing or self.drives.ending
        if self.kind == "dedicated" and not busy:
            self._retire_asked = time.monotonic()
            task = asyncio.create_task(self._retire())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _retire(self) -> None:
        """A dedicated host lives for its one Run."""
        with contextlib.suppress(Exception):  # no Supervisor, or it died: the heartbeat asks again
            supervisor = ray.get_actor(self.spec.supervisor_name, namespace=NAMESPACE)
            if await supervisor.retire.remote(self.host_id):
                self._retire_asked = None  # ended: this process is on its way out

    # ---- liveness and reconciliation -----------------------------------------------------

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
            asked = self._retire_asked
            if asked is not None and time.monotonic() - asked > RETIRE_AGAIN_S:
                self._retire_if_idle()  # not ended yet: the answer (or the asking) was lost
            await asyncio.sleep(self.spec.heartbeat_s)

    async def _first_reconcile(self) -> None:
        """At start: the Runs a previous incarnation of this host owned are taken back
        (Ray restarted it, or the whole system came up again). A dedicated host that Ray
        restarted and that took nothing back (its Run had come to rest, or was marked
        lost by the Supervisor, which sends it here again) asks to retire: no request
        came for it, so no answer would have told it to, and it lived on idle for good.
        A new one is not asked: the request it was started for is on its way."""
        try:
            await self.reconciler.once()
        finally:
            self.startup["reclaimed"] = time.time()
            if restarted():
                self._retire_if_idle()
            # after the recovery: starting a process meanwhile would slow it down
            replace_spare_if_restarted(self.spec.warm_spares)

    async def _reconcile_loop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self._reconciled)
        while True:
            await asyncio.sleep(self.spec.reconcile_s)
            try:
                await self.reconciler.once()
            except Exception as exc:  # the next pass tries again; Runs stay as committed
                log.warning("reconciling %s failed: %s", self.host_id, exc)


GROUP_COUNTS = ("groups", "appends", "waited_s", "written_s", "planned", "skipped")
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
