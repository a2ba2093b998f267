"""Committing and ending a Run: the half of the Engine that writes (DESIGN §3, §10).

``Committing`` is the Engine's base: ``commit`` assembles a commit from the Run's
working copy, folds it, appends it (retrying while the store is out, for up to
``StoreRetry.give_up_after_s``) and hands its facts to the live bus off the commit
path; ``end`` commits an end, sealing the open batch; ``settle`` is the one way a
failure ends a Run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from runtime.agent import Agent
from runtime.batch import ActiveToolBatch, result_messages, seal
from runtime.commit import CommitLabel, Frontier, Receipt, ThreadCommit, assemble_commit
from runtime.context import Landing, RunContext, StoreRetry, wait_commands
from runtime.delegation import CHILDREN_KEY, ChildRunner, parent_link
from runtime.errors import (
    Fenced,
    HistoryLimitReached,
    PayloadTooLarge,
    RunEnded,
    StateConflict,
    StoreUnavailable,
    VersionConflict,
)
from runtime.events import Fact
from runtime.faults import FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.inference import Inference
from runtime.injection import carried_by_answer
from runtime.lifecycle import (
    AwaitingState,
    EndCause,
    EndedState,
    Failed,
    Natural,
    RunDisposition,
    RunningState,
    ThreadStatus,
    UserInputTarget,
)
from runtime.limits import Limits, history_size, state_size
from runtime.messages import Message
from runtime.plugin_env import guarded_end
from runtime.ports import CommitStore
from runtime.publish import Publisher
from runtime.rules import advance, stamp_facts, with_claim
from runtime.session import last_forced
from runtime.signals import OwnCancels
from runtime.state import Command
from runtime.timeutil import now_us
from runtime.tracing import RunTrace

log = logging.getLogger("ratchet.engine")
CANCEL_CHILD_S = 30.0
"""How long a parent's end waits for the cancel of one of its children (its host hung)."""
T = TypeVar("T")


class Committing:
    """What an Engine needs to write; the Engine sets these up."""

    root: Agent
    store: CommitStore
    owner: str
    faults: FaultPlan
    publisher: Publisher | None
    inference: Inference
    children: ChildRunner | None
    store_retry: StoreRetry
    committed: asyncio.Event
    end_landed: asyncio.Event
    limits: Limits
    trace: RunTrace | None = None
    """The span of the drive in progress, while tracing is on (``runtime.tracing``)."""

    async def end(
        self,
        ctx: RunContext,
        cause: EndCause,
        *,
        messages: tuple[Message, ...] = (),
        batch: ActiveToolBatch | None = None,
        commands: Sequence[Command] = (),
        claim: bool = False,
        facts: Sequence[Fact] = (),
    ) -> None:
        """Commit Ended: unfinished calls are sealed indeterminate and the batch finalized.
        ``commands`` that cannot merge (a wave's calls writing one exclusive key) are left
        out, not the end: it is refused before anything is written, and made again.

        A natural end passes the run-end guards here, whatever makes it (a model's
        answer, a session's turns over, a handler ending its session): decided where
        each end was made, one that forgot to ask (a handler's) bypassed a guard that
        refuses every end. ``messages``: what the end commits, its answer last."""
        if isinstance(cause, Natural):
            async with OwnCancels():  # a guard's, refusing the end
                cause = guarded_end(self.root, ctx, messages)
        open_batch_ = batch or ctx.frontier.batch
        sealed = seal(open_batch_) if open_batch_ is not None else None
        if sealed is not None and batch is None and not messages:
            messages = result_messages(sealed)
        ended = EndedState(run_id=ctx.run_id, cause=cause)
        end = functools.partial(
            self._commit,
            ctx,
            "ended",
            ended,
            claim=claim,
            messages=messages,
            batch=sealed,
            extra_facts=tuple(facts),
        )
        # an inference made and not committed: what it used is recorded with the end
        spent = tuple(c for c in ctx.spent if not any(c is given for given in commands))
        try:
            await end(commands=(*commands, *spent))
        except StateConflict:
            if not commands:
                raise
            await end(commands=ctx.spent)  # usage counters merge: they never conflict
        if cause.kind != "natural":
            await self._cancel_children(ctx)

    async def settle(self, ctx: RunContext, cause: Failed, error: BaseException) -> None:
        """End the Run ``cause`` from its committed frontier: the one way a failure ends a
        Run. Retried with backoff while the store is out (never dropped).

        The limits keep every end within the store's payload limit (an engine refuses a
        store whose limit is below ``Limits.commit_bytes``); should an end still be too
        large, it is committed with the batch sealed but its results unpublished, or,
        as the last resort, alone."""
        log.warning(
            "run %s on %s failed (%s/%s): %s",
            ctx.run_id,
            ctx.frontier.thread_id,
            cause.failure,
            cause.code,
            error,
            exc_info=cause.failure == "internal",
        )
        ctx.unstage()  # staged by a Step that did not land
        delay, smaller, stale = self.store_retry.first_delay_s, 0, False
        conflicts = 0
        while True:
            try:
                if stale:
                    ctx.frontier, stale = await self._reloaded(ctx), False
                    if ctx.frontier.ended:
                        await self._cancel_children(ctx)
                        return
                await self._end_within(ctx, cause, smaller)
                return
            except PayloadTooLarge:
                if smaller == 2:
                    raise
                smaller += 1
            except StoreUnavailable as exc:
                log.warning("settling %s: store unavailable (%s); retrying", ctx.run_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.store_retry.max_delay_s)
            except (VersionConflict, RunEnded):
                # RunEnded: an earlier attempt landed after all (its answer was lost, and
                # this attempt's commit, stamped later, hashes differently)
                conflicts += 1
                if conflicts > 1:  # again: back off, never spin on the store
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.store_retry.max_delay_s)
                stale = True

    async def _end_within(self, ctx: RunContext, cause: Failed, smaller: int) -> None:
        if smaller == 0:
            await self.end(ctx, cause)
            return
        open_batch_ = ctx.frontier.batch
        sealed = seal(open_batch_) if open_batch_ is not None and smaller == 1 else None
        ended = EndedState(run_id=ctx.run_id, cause=cause)
        await self._commit(ctx, "ended", ended, batch=sealed, commands=ctx.spent)
        await self._cancel_children(ctx)

    async def _reloaded(self, ctx: RunContext) -> Frontier:
        """The stored frontier, if this engine still owns the thread (else Fenced)."""
        frontier = await self._retrying(lambda: self.store.load(ctx.frontier.thread_id))
        if frontier.epoch != ctx.epoch:
            raise Fenced(frontier.thread_id, ctx.epoch, frontier.epoch)
        return frontier

    async def _cancel_children(self, ctx: RunContext) -> None:
        """Cancellation flows parent → child, after the parent's end is committed: every
        child at once, each within ``CANCEL_CHILD_S`` (a child's host that hangs must not
        hold its parent's drive, which has ended)."""
        children = ctx.frontier.state["run"].get(CHILDREN_KEY, {})
        if self.children is None or not children:
            return
        mine = (ctx.frontier.thread_id, ctx.run_id)
        runner = self.children

        async def cancel(call: str, child: str) -> None:
            # its own child's Run only, as the child's committed link says: the thread
            # may hold another Run (a thread id a caller chose), or none yet
            head = await self.store.load_head(ThreadId(child))
            link = parent_link(head)
            if link is not None and (link.thread, link.run, link.call_id) == (*mine, call):
                await runner.cancel(ThreadId(child), head.run_id)

        async def safely(call: str, child: str) -> None:
            try:
                await asyncio.wait_for(cancel(call, child), CANCEL_CHILD_S)
            except Exception as exc:  # a child left running ends at its next Step's look
                log.warning("cancelling child %s of %s failed: %r", child, ctx.run_id, exc)

        await asyncio.gather(*(safely(call, child) for call, child in children.items()))

    # ---- commits ----------------------------------------------------------------------

    async def commit(
        self,
        ctx: RunContext,
        label: CommitLabel,
        disposition: RunDisposition,
        *,
        claim: bool = False,
        landing: bool = False,
        **parts: Any,
    ) -> None:
        """Commit and fold into ``ctx``. With ``landing`` (a Step's results, before its
        next inference), return once the commit is folded and its append is under way,
        where the Run allows it (``lands_later``): the next commit, or anything else
        that relies on it (``landed``), waits for its receipt first, and should it not
        land, the working copy goes back to before it and the error is raised there."""
        await self._commit(ctx, label, disposition, claim=claim, landing=landing, **parts)

    lands_later: bool = False
    """Whether ``landing`` commits may be left under way: only where nothing between a
    Step's results and its next commit can act on them but the model call (no hooks,
    gates, end guards or session; the inference writes no stream checkpoint before they
    land). The Engine decides it."""

    chains: bool = False
    """Whether a commit may be queued behind one on its way (``_behind``): where
    ``lands_later`` and the store keeps each caller's appends in the order they were made
    (``ordered_appends``). The Engine decides it."""

    async def landed(self, ctx: RunContext) -> None:
        """Wait for the commit under way, if any; its error, if it did not land, with the
        working copy put back to before it."""
        landing = ctx.landing
        if landing is None:
            return
        ctx.landing = None
        try:
            await landing.task
        except BaseException:
            ctx.frontier, ctx.epoch = landing.frontier, landing.epoch
            ctx.history_bytes = landing.history_bytes
            raise

    def abandon_landing(self, ctx: RunContext) -> None:
        """A drive that stops early stops waiting for its commit under way (the store may
        still write it, as with any append whose caller went away)."""
        landing, ctx.landing = ctx.landing, None
        if landing is not None and not landing.task.done():
            landing.task.cancel()

    def _within_history(
        self, ctx: RunContext, messages: Sequence[Message], label: CommitLabel
    ) -> int:
        """The size ``messages`` add to the thread's history, or HistoryLimitReached if
        the commit would take the thread past a history limit (an end never is). A wait
        keeps one commit in hand for its resume: awaiting at the last commit, no resume
        could land, and the Run waited for ever, neither resumed nor ended (a wait for
        input keeps room in bytes too: ``_within_answer``)."""
        limits, f = self.limits, ctx.frontier
        room = 2 if label == "awaiting" else 1
        if f.version + room > limits.history_commits:
            kept = ", and a wait keeps one for its resume" if room > 1 else ""
            raise HistoryLimitReached(
                f"commit {f.version + 1} of thread {f.thread_id}",
                "history_commits",
                f"the limit is {limits.history_commits} commits per thread{kept}",
            )
        if ctx.history_bytes is None:
            ctx.history_bytes = history_size(f.messages)
        added = history_size(messages) if messages else 0
        if ctx.history_bytes + added > limits.history_bytes:
            raise HistoryLimitReached(
                f"the history of thread {f.thread_id}",
                "history_bytes",
                f"it would hold {ctx.history_bytes + added} bytes; the limit is "
                f"{limits.history_bytes}",
            )
        return added

    def _within_answer(self, ctx: RunContext, waiting: Frontier, added: int) -> None:
        """HistoryLimitReached if a wait for input leaves no room in ``history_bytes`` for
        what its answer writes ahead of its text (``carried_by_answer``). The Run knows
        those bytes now; past the limit with them alone, every answer was refused and the
        Run waited for ever, as at the last commit (``_within_history``)."""
        state = waiting.run_state
        if not isinstance(state, AwaitingState):
            return
        if not isinstance(state.ticket.target, UserInputTarget):
            return  # a tool's or a pause's answer writes no message
        assert ctx.history_bytes is not None  # measured by ``_within_history``
        size = ctx.history_bytes + added + history_size(carried_by_answer(waiting))
        if size > self.limits.history_bytes:
            raise HistoryLimitReached(
                f"the history of thread {waiting.thread_id}",
                "history_bytes",
                f"the answer to its wait would hold {size} bytes before its own text; "
                f"the limit is {self.limits.history_bytes}",
            )

    def _within_state(self, before: Frontier, after: Frontier) -> None:
        """HistoryLimitReached if the commit takes the thread's state past ``state_bytes``,
        or further past it (a limit lowered since: a commit that shrinks it lands)."""
        limit, size = self.limits.state_bytes, state_size(after.state)
        if size > limit and size > state_size(before.state):
            raise HistoryLimitReached(
                f"the state of thread {after.thread_id}",
                "state_bytes",
                f"it would hold {size} bytes; the limit is {limit}",
            )

    async def _commit(
        self,
        ctx: RunContext,
        label: CommitLabel,
        disposition: RunDisposition,
        *,
        claim: bool = False,
        messages: Sequence[Message] = (),
        batch: ActiveToolBatch | None = None,
        commands: Sequence[Command] = (),
        run_id: RunId | None = None,
        extra_facts: Sequence[Fact] = (),
        landing: bool = False,
    ) -> None:
        # the commit before this one has its receipt first, or (a store that keeps each
        # caller's appends in order) this one is queued behind it (``_behind``)
        before = ctx.landing if self.chains and not landing else None
        if before is None:
            await self.landed(ctx)
        f = ctx.frontier
        added = 0 if label == "ended" else self._within_history(ctx, messages, label)
        run = run_id or ctx.run_id
        status = _status_after(f.status, disposition, now_us())
        changed = status if status is not f.status else None  # moved_to keeps it if unchanged
        traced = () if self.trace is None else self.trace.stamp(f, run, label)
        waits = wait_commands(ctx, label)  # a hook's wait goes with the Step's next commit
        commit = assemble_commit(
            thread_id=f.thread_id,
            run_id=run,
            ordinal=0 if run != f.run_id else f.next_ordinal,
            label=label,
            disposition=disposition,
            messages=tuple(messages),
            commands=last_forced((*ctx.pending, *commands, *traced, *waits)),
            batch=batch,
            status=changed,
            extra_facts=tuple(extra_facts),
            prev=f.head,
            epoch=ctx.epoch + 1 if claim else ctx.epoch,
            claim=self.owner if claim else None,
        )
        base = with_claim(f, self.owner) if claim else f
        new_frontier = advance(base, commit, keep=True)  # a StateConflict ends the Run (settle)
        if label != "ended" and new_frontier.state is not base.state:
            self._within_state(base, new_frontier)
        if label == "awaiting":
            self._within_answer(ctx, new_frontier, added)
        owner = self.owner if claim else None
        self.faults.hit(f"before:{label}")
        append = functools.partial(self.store.append, commit, f.version, ctx.epoch, claim=owner)
        if landing and self.lands_later and label == "results":
            epoch, history_bytes = ctx.epoch, ctx.history_bytes
            _fold(ctx, new_frontier, added, run)
            task = asyncio.create_task(self._append(label, append, commit))
            ctx.landing = Landing(task, f, epoch, history_bytes)
            return
        if before is None:
            await self._append(label, append, commit)
        else:
            await self._behind(ctx, label, append, commit)
        _fold(ctx, new_frontier, added, run)
        if ctx.spent and any(c is ctx.spent[0] for c in commands):
            ctx.spent = ()  # the inference's usage is recorded
        if label in ("inference", "ended"):
            await self.inference.step_committed(f.thread_id)

    async def _behind(
        self,
        ctx: RunContext,
        label: CommitLabel,
        append: Callable[[], Awaitable[Receipt]],
        commit: ThreadCommit,
    ) -> None:
        """Append behind the commit on its way, without waiting for its receipt: the store
        keeps the two in order (often in one group), and this one, made at the version
        after that one, cannot land unless that one did. That one's error comes first (the
        working copy back to before it); a refusal of this one while that one was still
        being retried is asked again once it has landed."""
        task = asyncio.create_task(self._append(label, append, commit))  # queued behind it
        try:
            await self.landed(ctx)
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        try:
            await task
        except (VersionConflict, StoreUnavailable):
            await self._append(label, append, commit)

    async def _append(
        self, label: CommitLabel, append: Callable[[], Awaitable[Receipt]], commit: ThreadCommit
    ) -> None:
        """The append (retried while the store is out) and what its receipt lets go."""
        if self.trace is None:
            receipt = await self._retrying(append)
        else:  # the append as a span of its own
            receipt = await self.trace.commit(label, functools.partial(self._retrying, append))
        self.faults.hit(f"after:{label}")
        self.committed.set()
        if label == "ended":
            self.end_landed.set()
        if self.publisher is not None:  # stamping copies every fact: only for a listener
            self.publisher.offer(commit.thread_id, stamp_facts(commit, receipt.seq))

    async def _claimed(self, thread: ThreadId, supersedes: int) -> Frontier:
        """Claim ``thread`` (compare-and-set on ``supersedes``), retried while the store is
        out. A retry refused because the thread is already at ``supersedes + 1`` under
        this owner is the earlier attempt's answer, lost on the way: the claim is ours."""
        retried = False

        async def attempt() -> Frontier:
            nonlocal retried
            try:
                return await self.store.claim(thread, self.owner, supersedes)
            except StoreUnavailable:
                retried = True
                raise
            except Fenced:
                if not retried:
                    raise
                frontier = await self.store.load(thread)
                if frontier.epoch == supersedes + 1 and frontier.owner == self.owner:
                    return frontier
                raise

        return await self._retrying(attempt)

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        delay, deadline = self.store_retry.first_delay_s, None
        while True:
            try:
                return await op()
            except StoreUnavailable as exc:
                loop_time = asyncio.get_running_loop().time()
                deadline = deadline or loop_time + self.store_retry.give_up_after_s
                if loop_time >= deadline:
                    raise
                log.warning("store unavailable (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.store_retry.max_delay_s)


def _fold(ctx: RunContext, frontier: Frontier, added: int, run: RunId) -> None:
    """The working copy after a commit (its staged commands went with it)."""
    ctx.unstage()
    ctx.frontier = frontier
    if ctx.history_bytes is not None:
        ctx.history_bytes += added
    ctx.epoch = frontier.epoch
    ctx.execution.run_id = run


def _status_after(current: ThreadStatus, disposition: RunDisposition, now: int) -> ThreadStatus:
    if isinstance(disposition, RunningState):
        return current.moved_to("running", None, now)
    if isinstance(disposition, AwaitingState):
        target = disposition.ticket.target
        if isinstance(target, UserInputTarget) and target.side is not None:
            return current.moved_to("idle", "awaiting_human", now)  # a session's human side
        return current.moved_to("idle", f"awaiting_{disposition.ticket.payload_kind}", now)
    cause = disposition.cause
    if isinstance(cause, Failed):
        return current.moved_to("failed", cause.code, now)
    return current.moved_to("idle", cause.kind, now)
