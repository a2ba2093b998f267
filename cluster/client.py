"""The cluster client: connect, start Runs, follow them, cancel and resume them.

    rt = await Ratchet.connect()                      # local Ray + SQLite by default
    handle = await rt.start("my_pkg.agents:helper", "summarise the report")
    frontier = await handle.result()                  # Ended or Awaiting
    for fact in await handle.events(): ...
    async for frame in handle.stream(after="3:0"): ... # status frames, facts, deltas
    await handle.respond(PermissionDecision(approve=True))  # answer the committed ticket
    await handle.cancel(); await handle.stop("over budget")

Everything a handle knows comes from the store (committed facts and the frontier),
never from a host: a handle works the same after its host crashed, from another
process, or after ``Ratchet.handle(thread_id)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from typing import Any, Literal, TypeVar

import ray
from ray.exceptions import RayActorError, RayError

from actors.run_host import dedicated_host, hosted_host
from actors.store_actor import RemoteCommitStore, open_system_store, store_actor
from actors.supervisor import supervisor
from actors.wire import NAMESPACE, AtRest, Placement, SystemSpec, host_index, run_meta, unwrap
from cluster.config import (
    ClusterUnavailable,
    connect_ray,
    redact,
    redis_url_from,
    store_url_from,
    system_name,
)
from cluster.stream import follow_thread
from cluster.waiting import on_a_live_host, patiently, polled, rests
from runtime import tracing_env
from runtime.agent import load_agent
from runtime.commit import Frontier
from runtime.errors import ResumeRejected, StoreError, StoreUnavailable
from runtime.events import Fact
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndedState,
    ResumeCommand,
    ResumePayload,
    ResumeTicket,
    Stopped,
    ThreadStatus,
    answer,
    validate_resume,
)
from runtime.limits import check_id, check_text
from runtime.ports import CommitStore, RunSummary
from runtime.resume import check_command
from runtime.rules import stamp_facts
from runtime.stream import Frame
from runtime.timeutil import now_us

log = logging.getLogger("ratchet.client")
T = TypeVar("T")


class Ratchet:
    """A connection to one Ratchet system (a store and its actors) on a Ray cluster."""

    def __init__(self, spec: SystemSpec, store: CommitStore, hosts: list[Any]) -> None:
        self.spec = spec
        self.store = store
        self.hosts = hosts

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        store_url: str | None = None,
        redis_url: str | None = None,
        *,
        hosts: int = 2,
        executors: int = 2,
        num_cpus: int | None = None,
        quiet: bool = False,
        **spec_options: Any,
    ) -> Ratchet:
        """Join (or start) Ray, then start the system's actors if they are not running."""
        connect_ray(address, num_cpus=num_cpus, quiet=quiet)
        url = store_url_from(store_url)
        spec = SystemSpec(
            name=spec_options.pop("name", None) or system_name(url),
            store_url=url,
            redis_url=redis_url_from(redis_url),
            hosts=hosts,
            executors=executors,
            **spec_options,
        )
        store = await _open_store(spec)
        supervisor(spec)
        pool = [hosted_host(spec, i) for i in range(spec.hosts)]
        return cls(spec, store, pool)

    # ---- starting and addressing Runs ---------------------------------------------------

    async def start(
        self,
        agent_ref: str,
        input: str,
        *,
        thread_id: str | None = None,
        placement: Placement = "hosted",
        run_id: str | None = None,
        host: int | None = None,
        faults: tuple[str, int, str] | None = None,
    ) -> RunHandle:
        """Start a Run of the agent at ``module:attr``; returns once it is committed.

        ``host`` pins a hosted Run to one host of the pool (tests, benchmarks);
        ``faults`` arms a fault point in the driving engine (crash tests, the demo).
        """
        handle, _ = await self._start(agent_ref, input, thread_id, placement, run_id, host, faults)
        return handle

    async def run(
        self,
        agent_ref: str,
        input: str,
        *,
        thread_id: str | None = None,
        placement: Placement = "hosted",
        run_id: str | None = None,
        host: int | None = None,
        timeout_s: float | None = None,
    ) -> Frontier:
        """Start a Run and return its frontier once it ends or awaits: ``start`` and
        ``result`` in one. A hosted Run takes one call to its host, which answers when
        its drive is over with the frontier its last commit wrote (the store had
        acknowledged it); otherwise — a host that died, a Run recovered elsewhere, a
        dedicated host — the store is followed until the Run rests."""

        async def run() -> Frontier:
            # a dedicated host retires as its Run ends, so its answer could be lost:
            # there, the start is answered first and the end followed apart
            wait = placement == "hosted"
            handle, answer = await self._start(
                agent_ref, input, thread_id, placement, run_id, host, None, wait=wait
            )
            if isinstance(answer, AtRest):
                frontier = answer.frontier()
                if rests(frontier, handle.run_id):
                    return frontier
            return await handle.settled(host_done=wait)

        try:
            return await asyncio.wait_for(run(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"run still running after {timeout_s}s") from None

    async def _start(
        self,
        agent_ref: str,
        input: str,
        thread_id: str | None,
        placement: Placement,
        run_id: str | None,
        host: int | None,
        faults: tuple[str, int, str] | None,
        wait: bool = False,
    ) -> tuple[RunHandle, Any]:
        """The Run's handle, and its host's answer (``AtRest`` when ``wait`` found it so)."""
        load_agent(agent_ref)  # a bad reference fails here, clearly, not in a host
        thread = ThreadId(thread_id or f"thread-{uuid.uuid4().hex[:12]}")
        run = RunId(run_id or f"run-{uuid.uuid4().hex[:12]}")
        # bad input is refused here, before any host is asked or anything written
        limits = self.spec.limits
        check_id("thread id", thread, limits)
        check_id("run id", run, limits)
        check_text("input", input, limits.input_bytes, "input_bytes")
        args = (agent_ref, thread, run, input, placement)
        armed, trace = [faults], tracing_env.carrier()  # the caller's span: the Run's parent

        async def start_run() -> Any:
            fault, armed[0] = armed[0], None  # a repeated start is not armed again
            target = self._host_for(thread, placement, host)
            return unwrap(await target.start_run.remote(*args, fault, wait=wait, trace=trace))

        # the host may die before it answers (or be restarting): start is idempotent
        answer = await on_a_live_host(start_run)
        return RunHandle(self, thread, run, placement), answer

    def handle(self, thread_id: str) -> RunHandle:
        """A handle on the latest Run of a thread (its run id is read lazily)."""
        return RunHandle(self, ThreadId(thread_id), None, "hosted")

    def _host_for(self, thread: str, placement: Placement, host: int | None = None) -> Any:
        if placement == "dedicated":
            return dedicated_host(self.spec, thread)
        index = host if host is not None else host_index(thread, self.spec.hosts)
        return self.hosts[index]

    async def runs(
        self, state: Literal["running", "awaiting", "ended"] | None = None
    ) -> list[RunSummary]:
        return await self.store.list_runs(state)

    async def fork(self, thread: str, at_seq: int, new_thread: str) -> Frontier:
        """Start ``new_thread`` as ``thread``'s history up to commit ``at_seq``, where its
        Run had ended (``runtime.history.fork``: ForkRefused names why not); a Run can then
        be started on it like on any thread. Returns the new thread's frontier."""
        from runtime.history import fork

        return await fork(self.store, ThreadId(thread), at_seq, ThreadId(new_thread))

    async def wait_all(
        self, handles: Iterable[RunHandle], timeout_s: float | None = None
    ) -> list[RunSummary]:
        """Wait until every handle's Run is ended or awaiting.

        Each Run's host says when its drive is over; then one listing confirms them all
        from the store (and polls, with backoff, for any still running elsewhere).
        """
        handles = list(handles)
        wanted = {h.thread_id: h.run_id for h in handles}

        async def all_at_rest() -> list[RunSummary] | None:
            rows = {r.thread_id: r for r in await patiently(self.store.list_runs)}
            done = [rows[t] for t, run in wanted.items() if _at_rest(rows.get(t), run)]
            return done if len(done) == len(wanted) else None

        async def settled() -> list[RunSummary]:
            await asyncio.gather(*(h.until_host_done() for h in handles))
            return await polled(all_at_rest)

        try:
            return await asyncio.wait_for(settled(), timeout_s)
        except TimeoutError:
            rows = {r.thread_id: r for r in await patiently(self.store.list_runs)}
            left = sum(not _at_rest(rows.get(t), run) for t, run in wanted.items())
            raise TimeoutError(f"{left} of {len(wanted)} runs still running") from None

    async def supervisor_report(self) -> dict[str, Any]:
        result: dict[str, Any] = await supervisor(self.spec).report.remote()
        return result

    async def close(self) -> None:
        await self.store.close()

    async def shutdown(self) -> None:
        """Stop every actor of this system (the store's data stays)."""
        await self.close()
        prefix = f"{self.spec.name}:"
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix):
                try:
                    ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                except ValueError:
                    continue

    def with_spec(self, **changes: Any) -> SystemSpec:
        return replace(self.spec, **changes)


class RunHandle:
    """Follow one Run through the store."""

    def __init__(
        self, client: Ratchet, thread_id: ThreadId, run_id: RunId | None, placement: Placement
    ) -> None:
        self.client = client
        self.thread_id = thread_id
        self.run_id = run_id
        self.placement = placement

    async def frontier(self) -> Frontier:
        return await self.client.store.load(self.thread_id)

    async def result(self, timeout_s: float | None = None) -> Frontier:
        """The frontier once the Run is Ended or Awaiting.

        The host driving the Run says when its drive is over (no polling while it
        runs); the store then confirms. A Run recovered elsewhere, or whose host died,
        is followed by polling the store with backoff.
        """
        try:
            return await asyncio.wait_for(self.settled(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"run on {self.thread_id} still running after {timeout_s}s"
            ) from None

    async def settled(self, host_done: bool = False) -> Frontier:
        """``result`` without a deadline; ``host_done``: the host already said so."""
        if not host_done:
            await self.until_host_done()

        async def at_rest() -> Frontier | None:
            frontier = await self.frontier()
            return frontier if rests(frontier, self.run_id) else None

        return await polled(at_rest)

    async def until_host_done(self) -> None:
        """Wait for the host this Run was placed on to finish driving it, if it does."""
        if self.placement == "dedicated":
            try:  # a dedicated host retires with its Run: never start one just to ask
                name = self.client.spec.dedicated_name(self.thread_id)
                host = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return
        else:
            host = self.client._host_for(self.thread_id, "hosted")
        # a dead or restarting host, or one driving nothing here: the store decides
        with contextlib.suppress(RayError):
            await host.until_rest.remote(self.thread_id)

    async def status(self) -> ThreadStatus:
        return (await self.frontier()).status

    async def events(self, after_seq: int = 0) -> list[Fact]:
        """Committed facts after ``after_seq``, in commit order (a resumable cursor)."""
        records = await self.client.store.read(self.thread_id, after_seq)
        return [fact for r in records for fact in stamp_facts(r.commit, r.seq)]

    async def ticket(self) -> ResumeTicket | None:
        """The committed ResumeTicket, while the Run awaits; otherwise None."""
        state = (await self.frontier()).run_state
        return state.ticket if isinstance(state, AwaitingState) else None

    def stream(self, after: str | None = None, *, until_rest: bool = True) -> AsyncIterator[Frame]:
        """Frames of the thread after the cursor ``after`` (``"seq:index"``, None: all).

        First a ``thread_status`` snapshot, then every committed fact after the cursor
        (from the store), then live deltas and facts (Redis bus when the system has
        one, else the store is polled), with a status frame on every change. Ends when
        the Run is at rest (awaiting or ended) unless ``until_rest`` is False. Reconnect
        with the ``offset`` of the last frame seen: no fact is lost or repeated.
        """
        return follow_thread(
            self.client.store,
            self.thread_id,
            after,
            redis_url=self.client.spec.redis_url,
            until_rest=until_rest,
        )

    async def cancel(self) -> str:
        """Cancel the Run wherever it is (a Run at rest is ended here and now).

        ``"signalled"``: its driver was told (it ends ``cancelled`` at the next check);
        ``"cancelled"``: it was at rest and is now ended; ``"not_running"``: nothing to do.
        """
        return await self._end_on_host("cancel_run", (), Cancelled, "cancelled")

    async def stop(self, reason: str) -> str:
        """End the Run ``stopped(reason)``; returns like ``cancel``."""
        return await self._end_on_host("stop_run", (reason,), Stopped, "stopped")

    async def _end_on_host(
        self, method: str, args: tuple[Any, ...], cause: type[Any], ended_word: str
    ) -> str:
        """Have the Run's host cancel or stop it.

        A dedicated host retires once it is idle, and may die before its answer is
        sent: asked again, a new host finds nothing running. The frontier then says
        whether the Run ended as asked (by the first call, or meanwhile)."""
        placement = await self._placement()
        calls = 0

        async def end_run() -> Any:
            nonlocal calls
            calls += 1
            host = self.client._host_for(self.thread_id, placement)
            return unwrap(await getattr(host, method).remote(self.thread_id, *args))

        result: str = await on_a_live_host(end_run)
        if result == "not_running" and calls > 1:
            state = (await self.frontier()).run_state
            if isinstance(state, EndedState) and isinstance(state.cause, cause):
                return ended_word
        return result

    async def resume(self, command: ResumeCommand, *, host: int | None = None) -> None:
        """Deliver a ResumeCommand; raises ResumeRejected (the ticket stays) on a mismatch.

        The command is checked here first against this thread's committed ticket, in the
        order of DESIGN §2 (a command for another thread fails on ``thread``), then again
        by the host, which is authoritative. ``host`` picks a host of the pool; if the
        chosen host dies before it answered, the committed ``resumed`` fact says whether
        this resume landed (each call carries its own ``request_id``): if another one
        did, this one is ResumeRejected; if none did, it goes to the next host. Every
        ResumeRejected is checked against that fact too: a resume with this request id
        that landed (through a host that died before it answered, or another call with
        the same ``request_id``) is this call's success, not a rejection.
        """
        check_command(command, self.client.spec.limits)  # InputRefused: nothing is sent
        if command.request_id is None:
            command = command.model_copy(update={"request_id": uuid.uuid4().hex})
        try:
            await self._resume(command, host)
        except ResumeRejected:
            if await self._applied(command):
                return  # this request's resume landed: the rejection was of a repeat
            raise

    async def _resume(self, command: ResumeCommand, index: int | None) -> None:
        validate_resume(_ticket_of(await self.frontier()), command, now_us())
        placement = await self._placement()
        for _ in range(max(len(self.client.hosts), 1) + 1):
            target = self.client._host_for(self.thread_id, placement, index)
            try:
                unwrap(await target.resume_run.remote(command, trace=tracing_env.carrier()))
                return
            except RayActorError:
                ticket = await self.ticket()
                if ticket is None or ticket.correlation != command.correlation:
                    await self._landed(command)  # returns if it was ours, else raises
                    return
                if placement == "dedicated":
                    continue  # a dedicated host is re-created under the same name
                current = (
                    index
                    if index is not None
                    else host_index(self.thread_id, self.client.spec.hosts)
                )
                index = (current + 1) % self.client.spec.hosts
        raise ClusterUnavailable(f"no host accepted the resume of {self.thread_id}")

    async def _landed(self, command: ResumeCommand) -> None:
        """The ticket is gone: whose resume was applied? Ours: return; else ResumeRejected."""
        applied = await self._applied(command)
        if applied:
            return
        if applied is False:
            raise ResumeRejected("ticket", "another resume of this ticket was applied")
        raise ResumeRejected("ticket", "the run stopped awaiting without this resume")

    async def _applied(self, command: ResumeCommand) -> bool | None:
        """Whose resume of the command's ticket the log holds: True ours (its request id),
        False another's, None none."""
        for fact in reversed(await self.events()):
            if fact.type == "resumed" and fact.data.get("correlation") == command.correlation:
                return bool(fact.data.get("request_id") == command.request_id)
        return None

    async def respond(self, payload: ResumePayload, *, host: int | None = None) -> ResumeCommand:
        """Answer the committed ticket with ``payload`` (ids and call id taken from it)."""
        ticket = await self.ticket()
        if ticket is None:
            state = (await self.frontier()).run_state
            raise ResumeRejected("ticket", f"thread {self.thread_id!r} is {_where(state)}")
        command = command_for(ticket, payload)
        await self.resume(command, host=host)
        return command

    async def _placement(self) -> Placement:
        meta = run_meta(await self.frontier())
        return meta.placement if meta is not None else self.placement


def command_for(ticket: ResumeTicket, payload: ResumePayload) -> ResumeCommand:
    """The ResumeCommand answering ``ticket`` with ``payload``."""
    return answer(ticket, payload)


# ---- helpers ----------------------------------------------------------------------------


def _ticket_of(frontier: Frontier) -> ResumeTicket | None:
    state = frontier.run_state
    return state.ticket if isinstance(state, AwaitingState) else None


def _where(state: Any) -> str:
    if state is None:
        return "unknown (no run was ever started on it)"
    if isinstance(state, EndedState):
        return f"not awaiting: run {state.run_id} ended {state.cause.kind}"
    return f"not awaiting: run {state.run_id} is {state.kind}"


def _at_rest(row: RunSummary | None, run: RunId | None) -> bool:
    if row is None or (run is not None and row.run_id != run):
        return False
    return row.state in ("ended", "awaiting")


async def _open_store(spec: SystemSpec) -> CommitStore:
    """The client's store; a store that cannot be opened is one clear StoreUnavailable."""
    try:
        if spec.funnels_writes:
            handle = store_actor(spec, create=True)
            proxy = RemoteCommitStore(handle)
            unwrap(await asyncio.wait_for(handle.ping.remote(), 60))  # StoreLost, if so
            return proxy
        return await open_system_store(spec)
    except StoreError:
        raise
    except Exception as exc:  # re-raised typed: a store that cannot be opened is out
        detail = str(getattr(exc, "cause", None) or exc).strip().splitlines()
        reason = detail[-1] if detail else type(exc).__name__
        raise StoreUnavailable(f"cannot open store {redact(spec.store_url)}: {reason}") from exc
