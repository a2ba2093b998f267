"""GroupWriter: how a SQL store's appends and claims reach its database, and its edge.

``storage.sql.SqlCommitStore`` is a GroupWriter: the port's methods are there, and
every driver call goes through ``_write`` or ``_read`` here, where the deadline and
the translation of the driver's errors (``storage.sql_errors.translate``) are.

**Group commit.** Appends and claims go into an in-process queue drained by group
writer tasks: whatever arrived while the previous transaction ran goes into the
next one (after a few event-loop turns, when the last group had company: see
``_drain``). Each request is still admitted on its own: the admission rules are pure
and run per request against the frontier as the earlier requests of the same
group left it (so a claim fences the appends queued behind it, exactly as if it
had run alone), and a refused append writes nothing and does not touch its
neighbours. Only a failure inside the database (a unique violation) aborts the
group's transaction; the group is then replayed with one SAVEPOINT per request, so
only the culprit fails. Outcomes are delivered after COMMIT returns — a request
that was admitted but whose transaction then failed gets ``StoreUnavailable``,
never a receipt or an epoch.

Each group is first tried as planned (``storage.sql_plan``): on PostgreSQL as one
statement, around the bodies; on SQLite inside ``sql_txn.transact``, under its
writer's lock.

Errors are translated in ``storage.sql_errors.translate``; messages name the store by
``redact(url)`` only. Every call has a deadline (``timeout_s``): a read that has not
answered by then, and an append or claim whose group writer has neither taken nor
finished a group for that long (a hung server or SQLite file lock), gets
StoreUnavailable; an append retried after it is harmless (idempotent by operation id).
On PostgreSQL it is also the driver's statement timeout, and a connection not opened
within ``CONNECT_TIMEOUT_S`` fails its call at once (``sql_engine``): the message says
which of the three ran out. A long queue behind a writer that keeps committing is not
an outage: a caller waits its turn while the groups ahead of it land (20,000 Runs on
one PostgreSQL writer waited 55 s per append, and a fixed deadline of 60 s turned that
into retries, recoveries and more load: benchmarks/README.md, eleventh round). A group
that meets an outage fails the requests queued behind it too, so an outage is heard at
once, not one group's driver timeout after another; a group that waited for a row
another client holds locked past ``sql_statements.LOCK_TIMEOUT_S`` hears
StoreUnavailable alone. The writer drops a request whose caller has given up (timed
out or cancelled) before its group is taken: that caller heard StoreUnavailable or
nothing, so not writing it is one of the outcomes it must already handle, and writing
it would only add load. A group the database refuses for a reason of its own (not an
outage) is written again request by request, so only the culprit fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from runtime.commit import Receipt
from runtime.errors import RatchetError, StoreError, StoreUnavailable
from runtime.rules import trace_checks
from storage.frontiers import FrontierCache
from storage.sql_engine import DEFAULT_TIMEOUT_S, Database
from storage.sql_errors import deadlocked, lock_timed_out, translate
from storage.sql_group import Abandoned, AppendRequest, Outcome, Request
from storage.sql_plan import Plan, pg_planned_args, plan_group
from storage.sql_statements import PG_PLANNED, pg_plan_refused
from storage.sql_txn import transact
from storage.url import redact

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("ratchet.storage.sql")

LINGER_TURNS = 10
"""Event-loop turns a group writer lets pass before it takes its group, when the last
group showed that several callers commit at once (see ``_drain``)."""


@dataclass
class Queued(Generic[R]):
    """A request waiting for its group, and the caller's future."""

    request: Request
    future: asyncio.Future[R] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    queued: float = field(default_factory=time.perf_counter)
    timer: asyncio.TimerHandle | None = None
    """The caller's deadline (``GroupWriter._expire``)."""


class GroupWriter:
    """The group writers of one SQL store, and its edge (the base of ``SqlCommitStore``).

    It belongs to the event loop that started its writers (``_start``).
    """

    def __init__(
        self, url: str, db: Database, group_commit: bool, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.db = db
        self.where = redact(url)
        self.timeout_s = timeout_s
        self.group_commit = group_commit
        self.groups = 0
        """Transactions that carried appends (with ``appends``: how well grouping works)."""
        self.appends = 0
        self.planned = 0
        """Groups written as planned (``sql_plan.Plan``), without reading their rows first."""
        self.waited_s = 0.0
        """Summed over appends: from the call to its group's transaction (queue and linger)."""
        self.written_s = 0.0
        """Summed over groups with appends: the transaction, commit and fsync included."""
        self.skipped = 0
        """Requests dropped before their group because their callers had given up."""
        self._progress = 0.0
        """Loop time a group writer last took or finished a group (see ``_submit``); a
        group that met an outage fails the queue behind it (``_fail_queued``)."""
        self._one_statement = db.dialect == "postgresql"
        """Planned groups go as one statement (``PG_PLANNED``), outside any body."""
        self._frontiers = FrontierCache()
        self._queue: asyncio.Queue[Queued[Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ordered_appends(self) -> bool:
        """Whether one caller's appends are written in the order it made them: one group
        writer takes requests in the order they were queued, and a call queues its request
        before it first waits (an engine then queues a commit behind one on its way)."""
        return len(self._tasks) == 1

    def _start(self) -> None:
        """Start the group writers (``Database.concurrency`` of them)."""
        self._tasks = [
            asyncio.create_task(self._drain(), name=f"group-commit {i} {self.where}")
            for i in range(self.db.concurrency)
        ]

    async def _stop(self) -> None:
        """Stop the group writers; the requests still queued hear StoreUnavailable."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while not self._queue.empty():
            _resolve(self._queue.get_nowait(), StoreUnavailable(f"store {self.where} closed"))

    # ---- group commit ---------------------------------------------------------------------

    async def _submit(self, item: Queued[R]) -> R:
        """Queue the request and wait for its outcome while the writers make progress:
        the deadline is ``timeout_s`` after the later of the call and the last time a
        writer took or finished a group, so a caller gives up on a writer that is stuck,
        never on the length of the queue ahead of it."""
        if not self._tasks:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._commit_group([item])
                    return await item.future
            except TimeoutError:
                raise self._unanswered() from None
        loop = asyncio.get_running_loop()
        called = loop.time()
        self._queue.put_nowait(item)
        # A timer per request, not a timed wait: asyncio.wait builds a waiter future, a
        # timer and two callbacks on every append (about 20 us more per await in a
        # microbenchmark, benchmarks/README.md, fourteenth round); the timer fires at
        # most once per timeout_s and only sets itself again while the writers progress.
        item.timer = loop.call_at(called + self.timeout_s, self._expire, item, called)
        try:
            return await item.future
        finally:
            item.timer.cancel()
            item.future.cancel()  # a caller that gave up: its request is dropped if queued

    def _expire(self, item: Queued[Any], called: float) -> None:
        """A request's deadline came: fail it unless a writer took or finished a group
        within ``timeout_s``, in which case the deadline moves to that moment's."""
        if item.future.done():
            return
        loop = item.future.get_loop()
        left = max(called, self._progress) + self.timeout_s - loop.time()
        if left > 0:
            item.timer = loop.call_later(left, self._expire, item, called)
        else:
            item.future.set_exception(self._unanswered())

    def _unanswered(self) -> StoreUnavailable:
        return StoreUnavailable(f"store {self.where} did not answer within {self.timeout_s:g}s")

    async def _drain(self) -> None:
        """A group writer: each transaction takes everything that queued meanwhile.

        When a group commits, its callers resume together, and each comes back with its
        next commit a few event-loop turns later. Taking the next group at once would
        split that cohort into several small transactions (and their Runs' next tool
        calls into several executor round trips), so when the last group had company,
        the writer first lets ``LINGER_TURNS`` turns pass. A turn costs microseconds;
        W1 (C=50) went from 5.7 to 11 or 12 commits per group, 4.1 to 3.5 ms of host CPU
        per Run, +15 to 25 % runs/s on PostgreSQL and SQLite (benchmarks/README.md,
        eighth round). It trades a little latency for CPU: in one process whose
        database has a core to itself (engine_bench), it saved 7 to 10 % of the CPU
        per Run and cost 9 to 12 % of the runs/s. A lone caller (the last group held
        one request) never waits.
        """
        last = 1
        while True:
            group = [await self._queue.get()]
            if last > 1:
                for _ in range(LINGER_TURNS):
                    await asyncio.sleep(0)
            while not self._queue.empty() and len(group) < self.db.max_group:
                group.append(self._queue.get_nowait())
            taken = [item for item in group if not item.future.done()]
            self.skipped += len(group) - len(taken)
            last = len(taken)
            if taken:
                await self._commit_group(taken)

    async def _commit_group(self, group: list[Queued[Any]]) -> None:
        """Commit a group and resolve every caller's future; never raises (but cancel)."""
        self._progress = asyncio.get_running_loop().time()
        try:
            await self._commit_taken(group)
        finally:
            self._progress = asyncio.get_running_loop().time()

    async def _commit_taken(self, group: list[Queued[Any]], again: bool = False) -> None:
        began = time.perf_counter()
        requests = [item.request for item in group]
        plan = self._plan(requests)
        try:
            if self._one_statement:
                outcomes, body_plan = await self._write_planned(plan), None
            else:  # SQLite tries the plan in the body, under its writer's lock
                outcomes, body_plan = None, plan
            if outcomes is None:
                outcomes = await self._write(
                    transact, requests, self.where, self._frontiers, body_plan, _waited(group)
                )
            if plan is not None and plan.held:
                self.planned += 1
                _trace_written(plan)
        except asyncio.CancelledError:
            for item in group:
                _resolve(item, StoreUnavailable(f"store {self.where} closed"))
            raise
        except Abandoned:
            # rolled back: those still waiting go again, alone (it is rare: a timeout)
            if rest := [item for item in group if not item.future.done()]:
                await self._commit_group(rest)
            return
        except StoreError as error:
            if len(group) > 1 and not isinstance(error, StoreUnavailable):
                # refused by the database for a reason of its own (a trigger, a check):
                # write each request alone, so only the culprit hears it
                log.warning("a group of %d requests failed (%s): one by one", len(group), error)
                for item in group:
                    await self._commit_group([item])
                return
            if deadlocked(error.__cause__) and not again:
                # PostgreSQL rolled this group back to let another go on (two groups
                # locking the same new threads): nothing was written; once more, at once
                await self._commit_taken(group, again=True)
                return
            log.warning("a group of %d requests failed: %s", len(group), error)
            outcomes = [_own_copy(error) for _ in group]
            cause = error.__cause__
            if isinstance(error, StoreUnavailable) and not (
                lock_timed_out(cause) or deadlocked(cause)
            ):
                self._fail_queued(error)
        appends = sum(isinstance(r, AppendRequest) for r in requests)
        if appends:
            self.groups += 1
            self.appends += appends
            self.written_s += time.perf_counter() - began
            self.waited_s += sum(
                began - item.queued for item in group if isinstance(item.request, AppendRequest)
            )
        for item, outcome in zip(group, outcomes, strict=True):
            if appends > 1 and isinstance(outcome, Receipt):  # for the commit's span
                outcome = outcome.model_copy(update={"group": appends})
            _resolve(item, outcome)

    def _fail_queued(self, error: StoreUnavailable) -> None:
        """An outage meets every request queued behind the group that met it: each
        would otherwise wait its own turn to meet it too (a server that hangs until
        the driver's command timeout, group after group), and its caller retries
        with backoff anyway. A row lock waited for past ``LOCK_TIMEOUT_S`` is no
        outage (another client holds one thread's row): only its group hears it."""
        while not self._queue.empty():
            _resolve(self._queue.get_nowait(), _own_copy(error))

    async def _write_planned(self, plan: Plan | None) -> list[Outcome] | None:
        """PostgreSQL: the plan in one statement; None if there is none or it did not
        hold (nothing was written, the read-first way goes next)."""
        if plan is None:
            return None
        try:
            await self.db.write_statement(PG_PLANNED.sql, pg_planned_args(plan), pg_plan_refused)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if pg_plan_refused(exc):
                return None
            raise translate(exc, self.where) from exc
        plan.held = True
        return plan.outcomes

    def _plan(self, requests: list[Request]) -> Plan | None:
        """The group's plan; a plan is only a shortcut, so anything it trips over is left
        to the read-first transaction to meet and report."""
        try:
            return plan_group(requests, self._frontiers)
        except Exception:
            log.exception("planning a group of %d requests failed", len(requests))
            return None

    async def _bounded(self, write: Awaitable[T]) -> T:
        """A write outside the group writers, given up after ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await write
        except TimeoutError:  # the driver's own are StoreUnavailable already (``_write``)
            raise self._unanswered() from None

    # ---- the edge: every driver call goes through one of these two -----------------------

    async def _write(self, body: Callable[..., T], *args: Any) -> T:
        try:
            return await self.db.write(body, *args)
        except StoreError:
            raise
        except Exception as exc:
            raise translate(exc, self.where) from exc

    async def _read(self, body: Callable[..., T], *args: Any) -> T:
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await self.db.read(body, *args)
        except StoreError:
            raise
        except TimeoutError as exc:
            if deadline.expired():
                raise self._unanswered() from None
            raise translate(exc, self.where) from exc  # the driver's: it names which ran out
        except Exception as exc:
            raise translate(exc, self.where) from exc


def _trace_written(plan: Plan) -> None:
    """The trace checks of a planned group, now that it is written (a test suite's
    hook, ``runtime.rules.TRACE_CHECKS``): a violation is the checker's to report, not
    the callers', whose commits landed."""
    try:
        trace_checks(plan.admitted)
    except Exception:
        log.exception("a trace check failed on a written group")


def _own_copy(error: StoreError) -> StoreError:
    """One exception object per caller: a shared one would gather every caller's traceback."""
    if type(error) not in (StoreError, StoreUnavailable):
        return error
    copy = type(error)(str(error))
    copy.__cause__ = error.__cause__
    return copy


def _waited(group: list[Queued[Any]]) -> Callable[[], bool]:
    """Whether every caller of the group still waits (asked on the writer's thread just
    before the commit: a future's ``done`` is one attribute read)."""
    return lambda: not any(item.future.done() for item in group)


def _resolve(item: Queued[Any], outcome: Outcome) -> None:
    """Deliver one caller's outcome (a caller that gave up has a cancelled future)."""
    if item.future.done():
        return
    if isinstance(outcome, RatchetError):
        item.future.set_exception(outcome)
    else:
        item.future.set_result(outcome)
