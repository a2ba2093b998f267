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
process, or after ``Ratchet.handle(thread_id)`` (``cluster.handle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Literal, TypeVar

import ray
from ray.exceptions import RayActorError

from actors.run_host import dedicated_host, hosted_host
from actors.store_actor import RemoteCommitStore, open_local_store, open_system_store, store_actor
from actors.supervisor import supervisor_made
from actors.system_lease import claim_system
from actors.wire import NAMESPACE, AtRest, Placement, SystemSpec, asked_before, host_index, unwrap
from cluster import waiting
from cluster.config import (
    ClusterUnavailable,
    SystemShutDown,
    check_store_reach,
    connect_ray,
    owns_ray,
    redact,
    redis_url_from,
    store_url_from,
    system_name,
)
from cluster.handle import RunHandle, command_for
from cluster.joining import asked_options, joined
from cluster.letting_go import give_up_lease, kill_named, kill_system
from cluster.waiting import (
    checked_timeout,
    may_have_started,
    notice_or_rest,
    on_a_live_host,
    polled,
    rested_summaries,
    rests,
)
from runtime import tracing_env
from runtime.agent import load_agent
from runtime.commit import Frontier
from runtime.errors import StoreError, StoreUnavailable, SystemInUse
from runtime.history import fork, import_thread
from runtime.ids import RunId, ThreadId
from runtime.limits import STORED_IDS, check_id, check_text
from runtime.patience import patiently
from runtime.ports import CommitStore, RunSummary
from storage.url import UnsupportedStoreUrl

log = logging.getLogger("ratchet.client")
T = TypeVar("T")
WAIT_COUNT_S = 1.0
"""The end of a ``wait_all`` deadline kept for counting the Runs still running (a tenth
of it if that is less): the count must not take the waiter past its deadline."""
_OPEN: Counter[str] = Counter()
"""System name → clients of it open (or connecting) in this process: a process that
started its Ray gives the lease up when its last one closes, not its first."""


class Ratchet:
    """A connection to one Ratchet system (a store and its actors) on a Ray cluster."""

    def __init__(self, spec: SystemSpec, store: CommitStore, hosts: list[Any]) -> None:
        self.spec = spec
        self.store = store
        self.hosts = hosts
        self._agents: set[str] = set()
        """Agent references that resolved here once (``_start`` checks each once)."""
        self._closed = False

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        store_url: str | None = None,
        redis_url: str | None = None,
        *,
        hosts: int | None = None,
        executors: int | None = None,
        num_cpus: int | None = None,
        quiet: bool = False,
        **spec_options: Any,
    ) -> Ratchet:
        """Join (or start) Ray, then start the system's actors if they are not running.
        A system running already is joined with its own settings (``cluster.joining``:
        ConfigError if a setting asked for here is not one of them); one started here runs
        with those asked for, and the defaults (2 hosts, 2 executors) for the rest."""
        # URLs that cannot be read: refused before Ray starts (UnsupportedStoreUrl)
        bus = redis_url_from(redis_url)
        url = store_url_from(store_url)
        connect_ray(address, num_cpus=num_cpus, quiet=quiet)
        check_store_reach(url)  # a SQLite file, and a node on another machine
        asked = asked_options(spec_options, hosts=hosts, executors=executors)
        name = asked.pop("name", None) or system_name(url)
        options = {"redis_url": bus, "hosts": 2, "executors": 2, **asked}
        own = SystemSpec(name=name, store_url=url, **options)
        spec = await joined(own, asked)
        joining = spec is not own  # a running system's settings were adopted
        _OPEN[spec.name] += 1  # counted from here: a close meanwhile gives nothing up
        try:
            store = await _open_store(spec)
        except BaseException:
            _uncount(spec.name)
            raise
        try:  # before any actor starts: another live cluster on this store is refused
            await claim_system(store, spec.name)
        except BaseException as exc:  # refused or cancelled: the store opened here is closed
            _uncount(spec.name)
            await store.close()
            if isinstance(exc, SystemInUse) and spec.funnels_writes:
                kill_named([spec.store_name])  # it would hold the store open here, for nobody
            raise
        # one that lives on from a client this process closed renews the lease no more
        # (``close``): told to again, not waited for (a new one renews it anyway); one of
        # an older Ratchet has no such method, and never stopped renewing
        try:
            boss, made = supervisor_made(spec)
            if not (joining or made):  # another client started the system meanwhile:
                # its settings, the system's, make the hosts (``cluster.joining``)
                spec = await joined(spec, asked)
            with contextlib.suppress(AttributeError):
                boss.keep_lease.remote()
            pool = [hosted_host(spec, i) for i in range(spec.hosts)]
        except BaseException:
            await _connect_failed(spec, store)
            raise
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
        new_thread: bool = False,
    ) -> RunHandle:
        """Start a Run of the agent at ``module:attr``; returns once it is committed.

        ``host`` pins a hosted Run to one host of the pool (tests, benchmarks);
        ``faults`` arms a fault point in the driving engine (crash tests, the demo).
        ``new_thread``: ``thread_id`` was made for this Run (as it is when none is
        given), so its host activates it without reading the thread first; a thread that
        has records after all is read and the start goes on as without it.
        """
        handle, _ = await self._start(
            agent_ref, input, thread_id, placement, run_id, host, faults, new_thread=new_thread
        )
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
        new_thread: bool = False,
    ) -> Frontier:
        """Start a Run and return its frontier once it ends or awaits: ``start`` and
        ``result`` in one. A hosted Run takes one call to its host, which answers when
        its drive is over with the frontier its last commit wrote (the store had
        acknowledged it); otherwise — a host that died, a Run recovered elsewhere, a
        dedicated host — the store is followed until the Run rests. ``new_thread`` as
        for ``start``."""

        timeout_s = checked_timeout(timeout_s)  # before the Run is started
        thread = thread_id or f"thread-{uuid.uuid4().hex[:12]}"
        run = run_id or f"run-{uuid.uuid4().hex[:12]}"

        async def running() -> Frontier:
            # a dedicated host retires as its Run ends, so its answer could be lost:
            # there, the start is answered first and the end followed apart
            wait = placement == "hosted"
            fresh = new_thread or thread_id is None
            started = self._start(agent_ref, input, thread, placement, run, host, None, wait, fresh)
            pending = RunHandle(self, ThreadId(thread), RunId(run), placement)

            async def this_run_rests() -> Frontier | None:
                frontier = await patiently(pending.frontier)
                if not rests(frontier, pending.run_id):
                    return None
                # a Run under this id that another caller started with another input or
                # agent is not this start's: its host's refusal is waited for
                return frontier if asked_before(frontier, run, agent_ref, input) else None

            # a host that hangs mid-drive never answers: the store may hold the Run
            # ended, re-placed and finished by another host
            got = await notice_or_rest(started, this_run_rests)
            if got is None:
                return await pending.settled(host_done=True)
            handle, answer = got
            if isinstance(answer, AtRest):
                frontier = answer.frontier()
                if rests(frontier, handle.run_id):
                    return frontier
            return await handle.settled(host_done=wait)

        # either way the Run may go on: the ids its caller may not have made find it
        ids = may_have_started(RunId(run), ThreadId(thread))
        try:
            return await asyncio.wait_for(running(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"run still running after {timeout_s}s; {ids}") from None
        except StoreUnavailable as exc:
            if ids in str(exc):  # the start's own (``_start``) says so already
                raise
            raise StoreUnavailable(f"{exc}; {ids}") from exc

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
        new_thread: bool = False,
    ) -> tuple[RunHandle, Any]:
        """The Run's handle, and its host's answer (``AtRest`` when ``wait`` found it so)."""
        if agent_ref not in self._agents:
            # a bad reference fails here, clearly, not in a host; imported (and a factory
            # called) in a thread, once: a slow one must not hold this loop (a server's)
            await asyncio.to_thread(load_agent, agent_ref)
            self._agents.add(agent_ref)
        new_thread = new_thread or thread_id is None
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
            target = self.host_for(thread, placement, host)
            answer = target.start_run.remote(
                *args, fault, wait=wait, trace=trace, new_thread=new_thread
            )
            try:
                return unwrap(await answer)
            except RayActorError:  # restarting, or gone for good (with its system?)
                await self.host_failed(target)
                raise

        # the host may die before it answers (or be restarting): start is idempotent
        try:
            bound = None if wait else waiting.HOST_ANSWER_S  # a start that waits: its Run's time
            answer = await on_a_live_host(start_run, answer_s=bound)
        except SystemShutDown:  # nothing was started, nor will be: connect again
            raise
        except ClusterUnavailable as exc:  # it may have landed: the ids find it again
            raise ClusterUnavailable(f"{exc}; {may_have_started(run, thread)}") from exc
        except StoreUnavailable as exc:
            # the host's backoff ran out, but a commit of it still on its way to a hung
            # server lands when the server goes on (seen: the Run then ran to its end):
            # with ids made here, the caller could neither find that Run nor ask again
            raise StoreUnavailable(f"{exc}; {may_have_started(run, thread)}") from exc
        return RunHandle(self, thread, run, placement), answer

    def handle(self, thread_id: str, run_id: str | None = None) -> RunHandle:
        """A handle on the Run ``run_id`` of a thread, or (None) on whichever Run the
        thread holds when the handle is used. Cancel, stop and waits through a handle
        with a run id act on that Run only: a thread that moved on to a later Run
        keeps it. Ids no store takes are InputRefused here, as a start's are; they name
        what is stored, so they are held to ``STORED_IDS``, not to ``id_chars`` (a thread
        made before the system lowered it is still waited on, cancelled and resumed)."""
        thread = check_id("thread id", thread_id, STORED_IDS)
        run = None if run_id is None else check_id("run id", run_id, STORED_IDS)
        return RunHandle(self, ThreadId(thread), None if run is None else RunId(run), "hosted")

    def _still_up(self) -> None:
        """SystemShutDown if the system has no Supervisor: a host made on demand by name
        after another process shut the system down stayed, with its executors, for good."""
        try:
            ray.get_actor(self.spec.supervisor_name, namespace=NAMESPACE)
        except ValueError:
            raise SystemShutDown(
                f"system {self.spec.name} was shut down (it has no Supervisor): connect again"
            ) from None

    async def host_failed(self, target: Any) -> None:
        """A call to ``target`` failed as its host died (``RayActorError``): its caller
        asks again (SystemShutDown if the system is gone). A pool host dead for good
        (``host_max_restarts`` spent, or 0) is made again under its name, one that Ray
        is restarting found by it: a dead handle failed every call for its threads."""
        await asyncio.to_thread(self._still_up)  # GCS calls: not on this loop
        for index, host in enumerate(self.hosts):
            if host is target:
                again = await asyncio.to_thread(hosted_host, self.spec, index)
                try:  # shut down meanwhile: a host made now would outlive its system
                    await asyncio.to_thread(self._still_up)
                except SystemShutDown:
                    ray.kill(again)
                    raise
                if self.hosts[index] is target:  # not made again meanwhile by another call
                    self.hosts[index] = again

    def host_for(self, thread: str, placement: Placement, host: int | None = None) -> Any:
        """The host a Run of ``thread`` goes to: its dedicated host, pool host ``host``,
        or the pool host the thread hashes to."""
        if placement == "dedicated":
            self._still_up()
            return dedicated_host(self.spec, thread)
        index = host if host is not None else host_index(thread, self.spec.hosts)
        return self.hosts[index]

    async def runs(
        self, state: Literal["running", "awaiting", "ended"] | None = None
    ) -> list[RunSummary]:
        return await self.store.list_runs(state)

    async def fork(self, thread: str, at_seq: int, new_thread: str) -> Frontier:
        """Start ``new_thread`` (held to the system's ``id_chars``) as ``thread``'s history
        up to commit ``at_seq``, where its Run had ended (``runtime.history.fork``:
        ForkRefused names why not); its frontier, where a Run starts as on any thread."""
        new = ThreadId(new_thread)
        return await fork(self.store, ThreadId(thread), at_seq, new, self.spec.limits)

    async def import_thread(self, lines: Iterable[str], thread: str | None = None) -> Frontier:
        """An export's ``lines`` written as ``thread`` (default: the exported id), held to
        the system's limits (``runtime.history.import_thread``); its frontier."""
        target = None if thread is None else ThreadId(thread)
        return await import_thread(self.store, lines, target, self.spec.limits)

    async def wait_all(
        self, handles: Iterable[RunHandle], timeout_s: float | None = None
    ) -> list[RunSummary]:
        """Wait until every handle's Run is ended or awaiting.

        Each Run's host says when its drive is over; then one listing confirms them all
        from the store (and polls, with backoff, for any still running elsewhere). At
        ``timeout_s``, TimeoutError saying how many are still running, as far as the
        store tells within the deadline (the end of it is kept for that count:
        ``WAIT_COUNT_S``); a store that is out then is not waited for.
        """
        timeout_s, handles = checked_timeout(timeout_s), list(handles)
        wanted = {h.thread_id: h.run_id for h in handles}

        async def all_at_rest() -> list[RunSummary] | None:
            done = await rested_summaries(self.store, wanted)
            return done if len(done) == len(wanted) else None

        async def settled() -> list[RunSummary]:
            await asyncio.gather(*(h.until_host_done() for h in handles))
            return await polled(all_at_rest)

        if timeout_s is None:
            return await settled()
        deadline = asyncio.get_running_loop().time() + timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline - min(WAIT_COUNT_S, timeout_s / 10)):
                return await settled()
        try:
            async with asyncio.timeout_at(deadline):
                done = await rested_summaries(self.store, wanted)
        except (TimeoutError, StoreUnavailable):
            raise TimeoutError(
                f"{len(wanted)} of {len(wanted)} runs not known at rest: the store did not "
                "answer by the deadline"
            ) from None
        if len(done) == len(wanted):  # at rest in the part of the deadline kept for this
            return done
        raise TimeoutError(f"{len(wanted) - len(done)} of {len(wanted)} runs still running")

    async def supervisor_report(self) -> dict[str, Any]:
        """The Supervisor's report. Asked of the running one: starting one here would
        bring a system that was shut down back, lease and take-overs included."""
        try:
            handle = ray.get_actor(self.spec.supervisor_name, namespace=NAMESPACE)
        except ValueError:
            raise SystemShutDown(
                f"system {self.spec.name} has no Supervisor: it was shut down"
            ) from None
        result: dict[str, Any] = await handle.report.remote()
        return result

    async def close(self) -> None:
        """Close the client's store. A process that started its own Ray (which ends with
        it: ``ratchet run``, ``serve``) gives up the system's lease too when this is its
        last client of the system open and no host of the system drives a Run, so that
        the next cluster on the store need not wait it out (``actors.system_lease``);
        with Runs driven (a notebook that lives on, with its Ray) it is kept. Closing
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await _give_up_if_last(self.spec, self.store)
        finally:
            await self.store.close()

    async def shutdown(self) -> None:
        """Stop every actor of this system (the store's data stays), and give up its lease
        (another cluster may serve the store at once; after ``close``, through the store
        opened again for it)."""
        # the lease given up once the Supervisor renews it no more, and before the store
        # actor (if the store is behind one) goes: it is given up through it
        closed, self._closed = self._closed, True
        if not closed:
            _uncount(self.spec.name)
        try:
            db = self.store if not closed else await open_local_store(self.spec.store_url)
        except StoreError as exc:  # closed before, and the store is out: it runs out
            log.warning("could not open the store to give up the lease: %s", exc)
            kill_system(self.spec, but_store=True)
        else:
            try:
                await give_up_lease(self.spec, db, kill=True)
            finally:
                await db.close()
        kill_system(self.spec, but_store=False)

    def with_spec(self, **changes: Any) -> SystemSpec:
        return replace(self.spec, **changes)


async def _connect_failed(spec: SystemSpec, store: CommitStore) -> None:
    """A connect that failed after its claim (its word to keep the lease sent): as the
    last client of the system in a process that started its Ray, it gives the lease up
    as a close would. Else the Supervisor renewed it, with no client open, for as long
    as the process lived."""
    try:
        await _give_up_if_last(spec, store)
    finally:
        await store.close()


async def _give_up_if_last(spec: SystemSpec, store: CommitStore) -> None:
    """One client of the system fewer in this process; the last in a process that started
    its Ray (which ends with it) gives the lease up, if the system is idle and no client
    of it connected here meanwhile."""
    if _uncount(spec.name) and owns_ray():
        await give_up_lease(spec, store, closing=True, reopened=lambda: _OPEN[spec.name] > 0)


def _uncount(system: str) -> bool:
    """One client of ``system`` fewer open in this process: whether it was the last."""
    _OPEN[system] -= 1
    if _OPEN[system] > 0:
        return False
    del _OPEN[system]
    return True


async def _open_store(spec: SystemSpec) -> CommitStore:
    """The client's store. A StoreError or UnsupportedStoreUrl is raised as it is (a local
    path's too: a file where its folder should be); anything else (a store actor that did
    not start) is one clear StoreUnavailable."""
    try:
        if spec.funnels_writes:
            handle = store_actor(spec, create=True)
            proxy = RemoteCommitStore(handle)
            unwrap(await asyncio.wait_for(handle.ping.remote(), 60))  # StoreLost, if so
            return proxy
        return await open_system_store(spec)
    except (StoreError, UnsupportedStoreUrl):
        raise
    except Exception as exc:  # re-raised typed: a store that cannot be opened is out
        detail = str(getattr(exc, "cause", None) or exc).strip().splitlines()
        reason = detail[-1] if detail else type(exc).__name__
        raise StoreUnavailable(f"cannot open store {redact(spec.store_url)}: {reason}") from exc


__all__ = ["Ratchet", "RunHandle", "command_for"]
