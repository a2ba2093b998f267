"""The Engine's hook calls (``runtime.hooks``): one input per call, the ExecutionState
made current first (step counts, live history), what the hooks inject or force staged
with their commands; and the StepEnd hooks, once per Step."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from runtime.agent import Agent
from runtime.batch import ActiveToolBatch
from runtime.committing import Committing
from runtime.context import RunContext
from runtime.execution import ExecutionView
from runtime.hooks import HookInput, HookPoint, HookResults, run_hooks
from runtime.injection import inject_commands, live_history
from runtime.lifecycle import Cancelled, EndCause, Stopped
from runtime.messages import Message
from runtime.session import closing, counted, stage_forced
from runtime.signals import CancelSignal, guarded, guarded_apart

T = TypeVar("T")


class Hooking(Committing):
    """The Engine's base (below ``runtime.sides.Sides``): how it calls hooks."""

    root: Agent
    agent: Agent
    stop_reason: str | None
    cancel_event: CancelSignal

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` unless the cancellation signal fires first (CancelledSignal)."""
        return await guarded(self.cancel_event, work)

    async def guard_apart(self, work: Awaitable[T]) -> T:
        """``guard`` for user code that may hold on to its cancellation (``guarded_apart``)."""
        return await guarded_apart(self.cancel_event, work)

    def control_cause(self, ctx: RunContext) -> EndCause:
        """How a Run stopped or cancelled (from outside, by a hook or by a tool) ends."""
        if ctx.execution.session_stopped and self.root.session is not None:
            ctx.pending.append(closing())  # stop_session: no later Run continues it
        reason = self.stop_reason if self.stop_reason is not None else ctx.execution.stop_reason
        return Stopped(reason=reason) if reason is not None else Cancelled()

    async def _held_before_inference(
        self,
        ctx: RunContext,
        prior: ActiveToolBatch | None,
        results: tuple[Message, ...],
        hooks: HookResults,
    ) -> bool:
        """A StepStart or BeforeInference hook stopped the Run, or asked for input or a
        pause: the Step's inference does not run. A stop ends the Run now, with the
        finished Step's results; a wait is committed before this Step, which starts over
        on the resume."""
        execution = ctx.execution
        if execution.stopped:
            cause = self.control_cause(ctx)
            await self.end(ctx, cause, messages=results, batch=prior, commands=hooks.commands)
            return True
        if execution.wait_request is not None:
            ctx.pause_step(execution.wait_request, hooks.commands)
            return True
        return False

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
        execution = ctx.execution
        counted(execution, self.root, ctx.frontier, step)
        execution.show_history(
            lambda: live_history(ctx.frontier, (*ctx.pending, *into.commands), execution.injected)
        )
        hook_input = HookInput(
            point=point,
            run_id=ctx.run_id,
            thread_id=ctx.frontier.thread_id,
            step=step,
            state=ctx.frontier.state,  # immutable: hooks return commands instead
            execution=ExecutionView(execution),
            response=response,
            call=call,
        )
        try:
            # a hook that hangs must not hold a Run that is cancelled or stopped
            await self.guard_apart(
                run_hooks(self.agent.hooks, hook_input, execution, into, self.limits, ctx.pending)
            )
        finally:  # what the hooks injected is staged with their commands
            source = f"{step:06d}:{point}:{call.call_id if call is not None else '-'}"
            into.commands.extend(inject_commands(ctx.frontier.version, source, execution.injected))
            execution.injected.clear()
            if self.root.session is not None:
                stage_forced(execution, into.commands)

    async def _end_step(self, ctx: RunContext, hooks: HookResults) -> str | None:
        """Run the StepEnd hooks of the Step whose batch just finished, once per Step:
        the batch id if they ran now."""
        prior = ctx.frontier.batch
        if prior is None or not ctx.ends_step(prior.batch_id):
            return None
        ctx.step_ended = prior.batch_id
        await self.hooks(ctx, "StepEnd", hooks, step=prior.step)
        return prior.batch_id
