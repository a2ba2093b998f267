"""The store actor: one process owning the system's store; ``RemoteCommitStore`` is its proxy.

The in-memory store lives in one process, so every process of a system that uses it
goes through this actor. SQLite may too (``SystemSpec.sqlite_writer="actor"``): all
commits then funnel through one async actor whose group commit batches the appends
of every host. The default for SQLite is ``direct`` — each process opens the file and
group-commits its own Runs, its writer queueing on an inter-process file lock —
because a Ray call per commit cost more than the lock waits (benchmarks/README.md).
PostgreSQL and Redis take concurrent writers, so there each process opens its own
store (``open_system_store``).

Errors keep their types end to end: a RatchetError raised in the actor comes back
as a ``RemoteError`` value and is re-raised as itself; a dead or unreachable store
actor, one that does not answer within ``RemoteCommitStore.timeout_s``, or an answer
lost on the way (any Ray error but the actor's own task failing) is
``StoreUnavailable``, which the engine retries with backoff. The call may have been
carried out all the same: an append retried after a lost answer is harmless
(idempotent by operation id); a claim retried so is refused ``Fenced`` by its own
earlier claim, which the caller recognises by the stored owner and epoch.

**A restarted in-memory store is not the truth.** Ray restarts a crashed store actor,
and an in-memory store then starts empty: every Run it held is gone, and an empty
thread would look like one that never started. So a restarted actor over ``memory://``
answers every call with ``StoreLost``, and every host fails closed instead of starting
over on nothing. (SQLite behind the actor keeps its file: a restart changes nothing.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import ray
from ray.exceptions import RayError, RayTaskError

from actors.heap import freeze_startup_heap
from actors.spare import replace_spare_if_restarted, restarted
from actors.store_instance import held_to_first_instance
from actors.wire import NAMESPACE, RemoteError, SystemSpec, unwrap
from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.context import DEFAULT_RETRY, StoreRetry
from runtime.errors import CorruptRecord, RatchetError, StoreLost, StoreUnavailable
from runtime.ids import ThreadId
from runtime.integrity import check_page_limit
from runtime.ports import CommitStore, CommittedRecord, Lease, RunSummary
from storage.url import scheme_of

log = logging.getLogger("ratchet.store_actor")


async def open_local_store(url: str) -> CommitStore:
    """Open the backend named by ``url`` in this process, held to the store instance the
    cluster first saw (``actors.store_instance``)."""
    from storage.url import open_store

    return held_to_first_instance(await open_store(url), url)


class StoreActor:
    """Owns the system's store; every method returns a value or a RemoteError."""

    # Ray awaits an async actor's __init__ in the actor's own event loop
    async def __init__(self, url: str, warm_spares: bool = True) -> None:  # type: ignore[misc]
        self.store = await outlasting_outages(lambda: open_local_store(url), "the store actor")
        self.lost = scheme_of(url) == "memory" and restarted()
        """An in-memory store that Ray restarted: its contents are gone (see above)."""
        replace_spare_if_restarted(warm_spares)
        freeze_startup_heap()

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.lost:
            return RemoteError.of(
                StoreLost("the in-memory store restarted and lost every thread it held")
            )
        try:
            return await getattr(self.store, method)(*args, **kwargs)
        except RatchetError as exc:
            return RemoteError.of(exc)

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, claim: str | None
    ) -> Any:
        return await self._call("append", commit, expected_version, epoch, claim=claim)

    async def append_many(self, batch: list[tuple[str, int, int, str | None]]) -> list[Any]:
        """Appends of one host's loop tick, each as (encoded commit, version, epoch, claim).

        They run concurrently, so the store's group commit can put them in one
        transaction; each still succeeds or fails on its own.
        """
        return list(await asyncio.gather(*(self._append_encoded(*item) for item in batch)))

    async def _append_encoded(
        self, encoded: str, expected_version: int, epoch: int, claim: str | None
    ) -> Any:
        try:
            commit = ThreadCommit.model_validate_json(encoded)
        except ValueError as exc:  # a proxy bug, not bad user input: refuse, change nothing
            return RemoteError.of(CorruptRecord("(in transit)", 0, str(exc)))
        return await self._call("append", commit, expected_version, epoch, claim=claim)

    async def load(self, thread: ThreadId) -> Any:
        return await self._call("load", thread)

    async def load_head(self, thread: ThreadId) -> Any:
        return await self._call("load_head", thread)

    async def read(self, thread: ThreadId, after_seq: int, limit: int | None = None) -> Any:
        return await self._call("read", thread, after_seq, limit)

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Any:
        return await self._call("claim", thread, owner, supersedes)

    async def list_runs(self, state: str | None, host: str | None) -> Any:
        return await self._call("list_runs", state, host=host)

    async def thread_ids(self, after: str, limit: int) -> Any:
        return await self._call("thread_ids", after, limit)

    async def prune(self, thread: ThreadId, through_seq: int) -> Any:
        return await self._call("prune", thread, through_seq)

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Any:
        return await self._call("hold_lease", name, holder, ttl_s)

    async def drop_lease(self, name: str, holder: str) -> Any:
        return await self._call("drop_lease", name, holder)

    async def ping(self) -> Any:
        """True, or StoreLost for a restarted in-memory store (a connect fails at once)."""
        if self.lost:
            return RemoteError.of(
                StoreLost("the in-memory store restarted and lost every thread it held")
            )
        return True

    async def close(self) -> None:
        await self.store.close()


RemoteStoreActor = ray.remote(StoreActor)


def store_actor(spec: SystemSpec, create: bool = False) -> Any:
    """The system's store actor; ``create`` starts it when it is not running yet."""
    if not create:
        return ray.get_actor(spec.store_name, namespace=NAMESPACE)
    options: dict[str, Any] = {"num_cpus": 0, **spec.core_options}
    return RemoteStoreActor.options(
        name=spec.store_name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        max_concurrency=10_000,
        **options,
    ).remote(spec.store_url, spec.warm_spares)


class RemoteCommitStore:
    """The CommitStore port, carried out by the store actor.

    Appends made in the same event-loop tick travel in one actor call
    (``append_many``), encoded once as JSON: one Ray round trip for many Runs.
    """

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        """Every call's deadline: past it the caller hears StoreUnavailable (a hung actor)."""
        self._pending: list[tuple[tuple[str, int, int, str | None], asyncio.Future[Any]]] = []

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _send(
        self, batch: list[tuple[tuple[str, int, int, str | None], asyncio.Future[Any]]]
    ) -> None:
        try:
            results = await self._call("append_many", [item for item, _ in batch])
        except BaseException as exc:  # every caller hears the failure of the shared call
            for _, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        for (_, waiter), result in zip(batch, results, strict=True):
            if not waiter.done():
                waiter.set_result(result)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            ref = getattr(self.handle, method).remote(*args)
            async with asyncio.timeout(self.timeout_s):
                return unwrap(await ref)
        except RayTaskError as exc:  # the actor's own method raised: not a lost answer
            cause = exc.cause
            raise (cause if isinstance(cause, Exception) else exc) from None
        except RayError as exc:  # dead, restarting, unreachable, or its answer lost
            raise StoreUnavailable(f"store actor unreachable: {type(exc).__name__}") from exc
        except TimeoutError:
            raise StoreUnavailable(
                f"store actor did not answer within {self.timeout_s:g}s"
            ) from None

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(((commit.encoded, expected_version, epoch, claim), waiter))
        result: Receipt = unwrap(await waiter)
        return result

    async def load(self, thread: ThreadId) -> Frontier:
        result: Frontier = await self._call("load", thread)
        return result

    async def load_head(self, thread: ThreadId) -> Frontier:
        result: Frontier = await self._call("load_head", thread)
        return result

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        check_page_limit(limit)  # refused here, as a local store refuses it
        result: list[CommittedRecord] = await self._call("read", thread, after_seq, limit)
        return result

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        result: Frontier = await self._call("claim", thread, owner, supersedes)
        return result

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        result: list[RunSummary] = await self._call("list_runs", state, host)
        return result

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        result: list[ThreadId] = await self._call("thread_ids", after, limit)
        return result

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        removed: int = await self._call("prune", thread, through_seq)
        return removed

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        lease: Lease = await self._call("hold_lease", name, holder, ttl_s)
        return lease

    async def drop_lease(self, name: str, holder: str) -> None:
        await self._call("drop_lease", name, holder)

    async def close(self) -> None:
        """The actor owns the store; a proxy has nothing to close."""


async def open_system_store(spec: SystemSpec, *, who: str | None = None) -> CommitStore:
    """The store a process of the system should use (proxy, or its own connection).

    ``who``: an actor of the system opening it as it starts, which waits out an outage
    (``outlasting_outages``); a client (``who`` None) hears StoreUnavailable at once."""
    if spec.funnels_writes:
        return RemoteCommitStore(store_actor(spec))
    if who is None:
        return await open_local_store(spec.store_url)
    return await outlasting_outages(lambda: open_local_store(spec.store_url), who)


OUTAGE_LOG_S = 30.0
"""How often an actor waiting for its store says so again."""


async def outlasting_outages(
    open_store: Callable[[], Awaitable[CommitStore]], who: str, retry: StoreRetry = DEFAULT_RETRY
) -> CommitStore:
    """Open a store, waiting with backoff for as long as it is unavailable.

    An actor opens its store in its constructor, and Ray never restarts an actor whose
    constructor raised, whatever its ``max_restarts``: a host started, or restarted
    after a crash, while the store was out would be gone for good, and with it every
    Run of the threads its index serves (DESIGN §10: an outage pauses, it fails
    nothing). So the constructor waits; calls to the actor queue meanwhile and are
    served once the store answers. Only StoreUnavailable is waited out: a store that
    refuses (credentials, a schema from a newer release) fails the actor at once."""
    delay, said = retry.first_delay_s, -OUTAGE_LOG_S
    while True:
        try:
            return await open_store()
        except StoreUnavailable as exc:
            if time.monotonic() - said >= OUTAGE_LOG_S:
                log.warning("%s waits for its store, which is unavailable: %s", who, exc)
                said = time.monotonic()
            await asyncio.sleep(delay)  # the backoff of a retry, as the engine's
            delay = min(2 * delay, retry.max_delay_s)
