"""The cluster client: connect, start Runs, follow them, cancel and resume them.

    rt = await Ratchet.connect()                      # local Ray + SQLite by default
    handle = await rt.start("my_pkg.agents:helper", "summarise the report")
    frontier = await handle.result()                  # Ended or Awaiting
    for fact in await handle.events(): ...

Everything a handle knows comes from the store (committed facts and the frontier),
never from a host: a handle works the same after its host crashed, from another
process, or after ``Ratchet.handle(thread_id)``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any, Literal, TypeVar

import ray
from ray.exceptions import RayActorError

from actors.run_host import dedicated_host, hosted_host
from actors.store_actor import RemoteCommitStore, open_system_store, store_actor
from actors.supervisor import supervisor
from actors.wire import NAMESPACE, Placement, SystemSpec, host_index, run_meta, unwrap
from cluster.config import (
    connect_ray,
    redact,
    redis_url_from,
    store_url_from,
    system_name,
)
from runtime.agent import load_agent
from runtime.commit import Frontier, stamp_facts
from runtime.errors import StoreError, StoreUnavailable
from runtime.events import Fact
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, EndedState, ResumeCommand, ThreadStatus
from runtime.ports import CommitStore, RunSummary

T = TypeVar("T")
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5


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
        load_agent(agent_ref)  # a bad reference fails here, clearly, not in a host
        thread = ThreadId(thread_id or f"thread-{uuid.uuid4().hex[:12]}")
        run = RunId(run_id or f"run-{uuid.uuid4().hex[:12]}")
        target = self._host_for(thread, placement, host)
        args = (agent_ref, thread, run, input, placement)
        try:
            unwrap(await target.start_run.remote(*args, faults))
        except RayActorError:  # the host died before the first commit: start is idempotent
            unwrap(await self._host_for(thread, placement, host).start_run.remote(*args, None))
        return RunHandle(self, thread, run, placement)

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

    async def wait_all(
        self, handles: Iterable[RunHandle], timeout_s: float | None = None
    ) -> list[RunSummary]:
        """Wait until every handle's Run is ended or awaiting: one listing per poll."""
        wanted = {h.thread_id: h.run_id for h in handles}
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        delay = POLL_FIRST_S
        while True:
            rows = {r.thread_id: r for r in await _patiently(self.store.list_runs)}
            done = [rows[t] for t, run in wanted.items() if _at_rest(rows.get(t), run)]
            if len(done) == len(wanted):
                return done
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{len(wanted) - len(done)} of {len(wanted)} runs still running")
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

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
        """The frontier once the Run is Ended or Awaiting (polling the store with backoff)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        delay = POLL_FIRST_S
        while True:
            frontier = await self.frontier()
            run = self.run_id or frontier.run_id
            if frontier.run_id == run and isinstance(
                frontier.run_state, EndedState | AwaitingState
            ):
                return frontier
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"run on {self.thread_id} still running after {timeout_s}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    async def status(self) -> ThreadStatus:
        return (await self.frontier()).status

    async def events(self, after_seq: int = 0) -> list[Fact]:
        """Committed facts after ``after_seq``, in commit order (a resumable cursor)."""
        records = await self.client.store.read(self.thread_id, after_seq)
        return [fact for r in records for fact in stamp_facts(r.commit, r.seq)]

    async def stream(self, after_seq: int = 0) -> AsyncIterator[Fact | dict[str, Any]]:
        """A status snapshot frame first, then committed facts as they commit (by cursor),
        each status change as a ``thread_status`` frame too; ends when the Run is at rest.
        """
        frontier = await self.frontier()
        yield frontier.status.frame()
        delay = POLL_FIRST_S
        while True:
            facts = await self.events(after_seq)
            for fact in facts:
                after_seq = max(after_seq, fact.seq)
                yield fact.data if fact.type == "status" else fact
            frontier = await self.frontier()
            if frontier.version <= after_seq and _settled(frontier, self.run_id):
                return
            delay = POLL_FIRST_S if facts else min(delay * 2, POLL_MAX_S)
            await asyncio.sleep(delay)

    async def cancel(self) -> str:
        """Cancel the Run wherever it is (a Run at rest is ended here and now)."""
        placement = await self._placement()
        result: str = unwrap(
            await self.client._host_for(self.thread_id, placement).cancel_run.remote(self.thread_id)
        )
        return result

    async def resume(self, command: ResumeCommand) -> None:
        """Deliver a ResumeCommand; raises ResumeRejected (the ticket stays) on a mismatch."""
        placement = await self._placement()
        host = self.client._host_for(self.thread_id, placement)
        unwrap(await host.resume_run.remote(command))

    async def _placement(self) -> Placement:
        meta = run_meta(await self.frontier())
        return meta.placement if meta is not None else self.placement


async def _patiently(op: Callable[[], Awaitable[T]], give_up_s: float = 60.0) -> T:
    """A store outage pauses a follower (as it pauses Runs); it is not an answer."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + give_up_s, POLL_FIRST_S
    while True:
        try:
            return await op()
        except StoreUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)


def _settled(frontier: Frontier, run: RunId | None) -> bool:
    if run is not None and frontier.run_id != run:
        return False
    return isinstance(frontier.run_state, EndedState | AwaitingState)


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
            await asyncio.wait_for(handle.ping.remote(), 60)
            return proxy
        return await open_system_store(spec)
    except StoreError:
        raise
    except Exception as exc:
        detail = str(getattr(exc, "cause", None) or exc).strip().splitlines()
        reason = detail[-1] if detail else type(exc).__name__
        raise StoreUnavailable(f"cannot open store {redact(spec.store_url)}: {reason}") from exc
