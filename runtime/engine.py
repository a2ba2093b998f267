"""The Step engine (DESIGN §3): drives one Run from its committed frontier.

Every transition is committed before anything relies on it. The engine holds no
truth of its own: it starts from ``store.load`` and after each commit folds that
commit into its copy of the frontier with the same pure function the stores use.
The same engine runs under the in-process runner and inside a Ray RunHost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.agent import Agent
from runtime.base import trusted
from runtime.batch import (
    ActiveToolBatch,
    CallSpec,
    ToolRecoveryPolicy,
    finalize,
    open_batch,
    seal,
)
from runtime.checkpoint import SafeCheckpoints
from runtime.commit import CommitLabel, Frontier, advance, assemble_commit, stamp_facts
from runtime.delegation import CHILDREN_KEY, ChildRunner, ParentLink
from runtime.errors import StateConflict, StoreUnavailable
from runtime.events import Delta, Fact
from runtime.faults import NO_FAULTS, FaultPlan
from runtime.hooks import ExecutionState, HookInput, HookPoint, HookResults, run_hooks
from runtime.ids import CorrelationId, RunId, ThreadId
from runtime.inference import infer, salvage, unique_calls
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndCause,
    EndedState,
    Failed,
    MaxSteps,
    Natural,
    PauseTarget,
    ResumeCommand,
    ResumeTicket,
    RunDisposition,
    RunningState,
    Stopped,
    ThreadStatus,
    validate_resume,
)
from runtime.messages import AssistantMessage, Message, ToolUse, UserMessage
from runtime.models import ModelResponse
from runtime.ports import CommitStore, LiveBus, StreamCheckpointStore, ToolRunner
from runtime.signals import CancelledSignal, CancelSignal, EndRun, RunOver, guarded
from runtime.state import Command
from runtime.timeutil import now_us
from runtime.toolbatch import Opening, advance_batch, apply_resume, result_messages

log = logging.getLogger("ratchet.engine")
T = TypeVar("T")


@dataclass(frozen=True)
class StoreRetry:
    """Backoff for StoreUnavailable: the Run pauses, it never records a guess."""

    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    give_up_after_s: float = 60.0


@dataclass
class RunContext:
    """The engine's working copy of one Run (never the truth: the store is)."""

    frontier: Frontier
    epoch: int
    execution: ExecutionState
    pending: list[Command] = field(default_factory=list)
    """Hook commands staged for the next commit."""
    step_ended: str | None = None
    """Batch id whose StepEnd hooks already ran (they run once per Step)."""

    _running: RunningState | None = field(default=None, init=False, repr=False)

    @property
    def run_id(self) -> RunId:
        assert self.frontier.run_id is not None
        return self.frontier.run_id

    def running(self) -> RunningState:
        """The Run's Running disposition: one record, reused by each commit that needs it."""
        run_id = self.run_id
        if self._running is None or self._running.run_id != run_id:
            self._running = RunningState(run_id=run_id)
        return self._running


class Engine:
    """Drives one Run. Create one per Run attempt; crash it by abandoning it."""

    def __init__(
        self,
        agent: Agent,
        store: CommitStore,
        tools: ToolRunner,
        *,
        bus: LiveBus | None = None,
        faults: FaultPlan = NO_FAULTS,
        owner: str | None = None,
        prompt_path: Sequence[str] | None = None,
        store_retry: StoreRetry = StoreRetry(),
        checkpoints: StreamCheckpointStore | None = None,
        checkpoint_interval_s: float = 0.25,
        children: ChildRunner | None = None,
        lineage: Sequence[str] | None = None,
        parent: ParentLink | None = None,
    ) -> None:
        self.agent = agent
        self.store = store
        self.tools = tools
        self.bus = bus
        self.faults = faults
        # 8 random hex digits, as uuid4().hex[:8] gave, without building a UUID per Run
        self.owner = owner or f"engine-{os.urandom(4).hex()}"
        self.prompt_path = tuple(prompt_path or (agent.name,))
        self.children = children
        self.lineage = tuple(lineage or (agent.name,))
        """Agent references from the root Run to this one (delegation cycle checks)."""
        self.parent = parent
        self.store_retry = store_retry
        self.cancel_event = CancelSignal()
        self.stop_reason: str | None = None
        self.pause_requested = False
        self.checkpoints = SafeCheckpoints(checkpoints)
        self.checkpoint_interval_s = checkpoint_interval_s
        self.use_checkpoint = False
        self.checkpointed = False

    # ---- control --------------------------------------------------------------------

    def cancel(self) -> None:
        """Checked before inference, while inference and tools are awaited, between steps."""
        self.cancel_event.set()

    def stop(self, reason: str) -> None:
        """Like cancel, but the Run ends ``stopped(reason)``."""
        self.stop_reason = reason
        self.cancel_event.set()

    def pause(self) -> None:
        """A manual pause: at the next Step boundary the Run commits Awaiting(pause)."""
        self.pause_requested = True

    async def terminate(self, thread: ThreadId, cause: EndCause | None = None) -> Frontier:
        """End a Run that no engine is driving (awaiting, or orphaned) with ``cause``.

        Claiming fences any previous owner; unfinished calls are sealed indeterminate and
        the ticket is cleared, so a late resume fails closed. An ended Run is returned as is.
        """
        ctx = await self._claim(thread)
        if isinstance(ctx.frontier.run_state, RunningState | AwaitingState):
            await self.end(ctx, cause or Cancelled())
        return ctx.frontier

    # ---- entry points -----------------------------------------------------------------

    async def start(
        self,
        thread: ThreadId,
        text: str,
        *,
        run_id: RunId | None = None,
        message_id: str | None = None,
    ) -> Frontier:
        """Activate a new Run with ``text`` as input and drive it. Idempotent by run id."""
        run_id = run_id or RunId(f"run-{uuid.uuid4().hex}")
        # the claim is refused while another Run is active: it would fence that Run's owner
        ctx = await self._claim(thread, starting=run_id)
        if ctx.frontier.run_id == run_id:
            return await self._drive(ctx)
        user = UserMessage(id=message_id or f"{run_id}:input", text=text)
        link = () if self.parent is None else (self.parent.command(),)
        await self._commit(
            ctx,
            "activation",
            RunningState(run_id=run_id),
            messages=(user,),
            commands=link,
            run_id=run_id,
        )
        return await self._drive(ctx)

    async def recover(self, thread: ThreadId) -> Frontier:
        """Claim the thread (fencing the previous owner) and continue from its frontier."""
        ctx = await self._claim(thread)
        self.use_checkpoint = True
        state = ctx.frontier.run_state
        if isinstance(state, RunningState) and ctx.frontier.status.state != "running":
            await self._commit(ctx, "status", state)
        return await self._drive(ctx)

    async def resume(self, command: ResumeCommand) -> Frontier:
        """Validate ``command`` against the committed ticket, apply it, and drive on.

        Raises ResumeRejected (naming the failed axis) and leaves the ticket intact.
        """
        # Validate before claiming: a rejected command must change nothing, and a claim
        # would fence whoever drives the Run now. Validate again on the claimed frontier.
        _validate(await self._retrying(lambda: self.store.load(command.thread_id)), command)
        ctx = await self._claim(command.thread_id)
        ticket = _validate(ctx.frontier, command)
        try:
            await apply_resume(self, ctx, ticket, command)
        except CancelledSignal:
            await self.end(ctx, self._control_cause(ctx))
        return await self._drive(ctx)

    async def _claim(self, thread: ThreadId, starting: RunId | None = None) -> RunContext:
        frontier = await self._retrying(
            lambda: self.store.claim_frontier(thread, self.owner, starting)
        )
        execution = ExecutionState(
            RunId(frontier.run_id or ""), thread, self.prompt_path, self.cancel_event
        )
        return RunContext(frontier=frontier, epoch=frontier.epoch, execution=execution)

    # ---- the loop ---------------------------------------------------------------------

    async def _drive(self, ctx: RunContext) -> Frontier:
        try:
            while True:
                f = ctx.frontier
                if isinstance(f.run_state, EndedState | AwaitingState) or f.run_state is None:
                    return f
                if self.cancel_event.is_set() or ctx.execution.stopped:
                    await self.end(ctx, self._control_cause(ctx))
                elif f.batch is not None and not f.batch.all_terminal:
                    await self._ending_on(ctx, advance_batch(self, ctx))
                elif self.pause_requested or ctx.execution.wait_request is not None:
                    await self._await_at_boundary(ctx)
                else:
                    await self._ending_on(ctx, self._step(ctx))
        except CancelledSignal:
            await self.end(ctx, self._control_cause(ctx))
        except RunOver:
            pass
        return ctx.frontier

    async def _ending_on(self, ctx: RunContext, work: Awaitable[None]) -> None:
        """Await a Step or a batch's advance; an EndRun it raises is committed as the end."""
        try:
            await work
        except EndRun as end:
            await self.end(ctx, end.cause)

    def _control_cause(self, ctx: RunContext) -> EndCause:
        reason = self.stop_reason or ctx.execution.stop_reason
        return Stopped(reason=reason) if reason is not None else Cancelled()

    async def _await_at_boundary(self, ctx: RunContext) -> None:
        """Commit Awaiting(user input or pause) between Steps; the Run then holds nothing."""
        target = ctx.execution.wait_request or PauseTarget(reason="manual")
        ctx.execution.wait_request = None
        self.pause_requested = False
        ticket = ResumeTicket(
            correlation=CorrelationId(f"{ctx.run_id}:{target.kind}:{ctx.frontier.next_ordinal}"),
            run_id=ctx.run_id,
            thread_id=ctx.frontier.thread_id,
            target=target,
        )
        await self._commit(ctx, "awaiting", AwaitingState(run_id=ctx.run_id, ticket=ticket))

    async def _step(self, ctx: RunContext) -> None:
        f = ctx.frontier
        prior = f.batch
        hooks = HookResults()
        if prior is not None and ctx.step_ended != prior.batch_id:
            ctx.step_ended = prior.batch_id
            await self.hooks(ctx, "StepEnd", hooks, step=prior.step)
            if ctx.execution.wait_request is not None or ctx.execution.stopped:
                ctx.pending.extend(hooks.commands)  # committed with the wait or the end
                return
        step = f.steps
        results = result_messages(prior)
        if step >= self.agent.max_steps:
            await self.end(ctx, MaxSteps(), messages=results, batch=prior, commands=hooks.commands)
            return
        await self.hooks(ctx, "StepStart", hooks, step=step)
        await self.hooks(ctx, "BeforeInference", hooks, step=step)
        last = step == self.agent.max_steps - 1
        salvaged = await salvage(self, ctx, step)
        if isinstance(salvaged, ModelResponse):
            response: ModelResponse | None = salvaged
        else:
            context = (*hooks.context, *([salvaged] if salvaged else []))
            response = await infer(self, ctx, step, (*f.messages, *results, *context), last)
        if response is None:
            return
        await self.hooks(ctx, "AfterInference", hooks, step=step, response=response)
        assistant = AssistantMessage(
            text=response.text, tool_calls=unique_calls(response.tool_calls)
        )
        messages: tuple[Message, ...] = (*results, assistant)
        if not assistant.tool_calls or last:
            if not assistant.tool_calls:
                await self.hooks(ctx, "StepEnd", hooks, step=step)
            cause = MaxSteps() if assistant.tool_calls else Natural()
            await self.end(ctx, cause, messages=messages, batch=prior, commands=hooks.commands)
            return
        batch = open_batch(ctx.run_id, step, [self._spec(c) for c in assistant.tool_calls])
        # the inference commit is made with the batch's first wave (see advance_batch)
        await advance_batch(self, ctx, Opening(batch, messages, tuple(hooks.commands)))

    def _spec(self, use: ToolUse) -> CallSpec:
        tool = self.agent.tool(use.tool)
        policy = self.agent.policy_for(tool) if tool else ToolRecoveryPolicy()
        # the parts of a validated ToolUse and a validated policy: not validated again
        return trusted(
            CallSpec, call_id=use.call_id, tool=use.tool, arguments=use.arguments, policy=policy
        )

    async def hooks(
        self,
        ctx: RunContext,
        point: HookPoint,
        into: HookResults,
        *,
        step: int,
        response: Any = None,
        call: Any = None,
    ) -> None:
        hooks = self.agent.hooks
        if not hooks or not any(h.point == point for h in hooks):
            return
        ctx.execution.step_count = step
        ctx.execution.message_history = ctx.frontier.messages
        hook_input = HookInput(
            point=point,
            run_id=ctx.run_id,
            thread_id=ctx.frontier.thread_id,
            step=step,
            state=ctx.frontier.state,
            execution=ctx.execution,
            response=response,
            call=call,
        )
        await run_hooks(self.agent.hooks, hook_input, into)

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` unless the cancellation signal fires first (CancelledSignal)."""
        return await guarded(self.cancel_event, work)

    # ---- commits ----------------------------------------------------------------------

    async def end(
        self,
        ctx: RunContext,
        cause: EndCause,
        *,
        messages: tuple[Message, ...] = (),
        batch: ActiveToolBatch | None = None,
        commands: Sequence[Command] = (),
    ) -> None:
        """Commit Ended: unfinished calls are sealed indeterminate and the batch finalized."""
        open_batch_ = batch or ctx.frontier.batch
        sealed = seal(open_batch_) if open_batch_ is not None else None
        if sealed is not None and batch is None and not messages:
            messages = result_messages(sealed)
        await self._commit(
            ctx,
            "ended",
            EndedState(run_id=ctx.run_id, cause=cause),
            messages=messages,
            batch=sealed,
            commands=commands,
        )
        if cause.kind != "natural":
            await self._cancel_children(ctx)

    async def _cancel_children(self, ctx: RunContext) -> None:
        """Cancellation flows parent → child, after the parent's end is committed."""
        children = ctx.frontier.state["run"].get(CHILDREN_KEY, {})
        if self.children is None or not children:
            return
        for child in children.values():
            try:
                await self.children.cancel(ThreadId(child))
            except Exception as exc:  # the child's own recovery settles it later
                log.warning("cancelling child %s of %s failed: %s", child, ctx.run_id, exc)

    async def commit(
        self, ctx: RunContext, label: CommitLabel, disposition: RunDisposition, **parts: Any
    ) -> None:
        await self._commit(ctx, label, disposition, **parts)

    async def _commit(
        self,
        ctx: RunContext,
        label: CommitLabel,
        disposition: RunDisposition,
        *,
        messages: Sequence[Message] = (),
        batch: ActiveToolBatch | None = None,
        commands: Sequence[Command] = (),
        run_id: RunId | None = None,
        extra_facts: Sequence[Fact] = (),
    ) -> None:
        f = ctx.frontier
        run = run_id or ctx.run_id
        all_commands = (*ctx.pending, *commands)
        messages = tuple(messages)
        status = _status_after(f.status, disposition, now_us())
        changed = status if status is not f.status else None  # moved_to keeps it if unchanged
        commit = assemble_commit(
            thread_id=f.thread_id,
            run_id=run,
            ordinal=0 if run != f.run_id else f.next_ordinal,
            label=label,
            disposition=disposition,
            messages=messages,
            commands=all_commands,
            batch=batch,
            status=changed,
            extra_facts=tuple(extra_facts),
        )
        try:
            new_frontier = advance(f, commit)
        except StateConflict as exc:
            if isinstance(disposition, EndedState) and not all_commands:
                raise
            ctx.pending.clear()
            await self.end(
                ctx, Failed(failure="state_conflict", code="state_conflict", message=str(exc))
            )
            raise RunOver from exc
        self.faults.hit(f"before:{label}")
        receipt = await self._retrying(lambda: self.store.append(commit, f.version, ctx.epoch))
        self.faults.hit(f"after:{label}")
        ctx.pending.clear()
        ctx.frontier = new_frontier
        ctx.execution.run_id = run
        if self.checkpointed and label in ("inference", "ended"):
            self.checkpointed = False  # the Step is committed: its checkpoint is spent
            await self.checkpoints.delete(ctx.frontier.thread_id)
        if self.bus is not None:  # stamping copies every fact: only for a listener
            await self.publish(ctx, stamp_facts(commit, receipt.seq))

    async def _retrying(self, op: Any) -> Any:
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

    async def publish(self, ctx: RunContext, events: Sequence[Fact | Delta]) -> None:
        if self.bus is None or not events:
            return
        try:
            await self.bus.publish(ctx.frontier.thread_id, events)
        except Exception as exc:  # the bus is best effort: facts are re-read from the store
            log.warning("live bus publish failed for %s: %s", ctx.frontier.thread_id, exc)


def _validate(frontier: Frontier, command: ResumeCommand) -> ResumeTicket:
    state = frontier.run_state
    ticket = state.ticket if isinstance(state, AwaitingState) else None
    validate_resume(ticket, command, now_us())
    assert ticket is not None
    return ticket


def _status_after(current: ThreadStatus, disposition: RunDisposition, now: int) -> ThreadStatus:
    if isinstance(disposition, RunningState):
        return current.moved_to("running", None, now)
    if isinstance(disposition, AwaitingState):
        return current.moved_to("idle", f"awaiting_{disposition.ticket.payload_kind}", now)
    cause = disposition.cause
    if isinstance(cause, Failed):
        return current.moved_to("failed", cause.code, now)
    return current.moved_to("idle", cause.kind, now)


__all__ = ["Engine", "RunContext", "StoreRetry", "finalize", "now_us"]
