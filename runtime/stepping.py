"""One Step of a Run (DESIGN §3): the Step's hooks, its inference, then the batch of
tool calls the model asked for (``runtime.toolbatch``) or the Run's end.

``Stepping`` is the Engine's base for the Step loop: ``_loop`` decides, between Steps,
whether the Run ends, waits, advances a batch or takes its next Step; the Engine's
``_drive`` settles whatever escapes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from runtime import tracing
from runtime.base import trusted
from runtime.batch import CallSpec, ToolRecoveryPolicy, open_batch, result_messages, seal
from runtime.context import RunContext
from runtime.delegation import ParentLink, parent_gone
from runtime.execution import ExecutionState
from runtime.hooks import HookResults
from runtime.ids import CallId, CorrelationId
from runtime.inference import Admitted
from runtime.injection import restaged, take_injected
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndedState,
    MaxSteps,
    Natural,
    PauseTarget,
    ResumeTicket,
    RunningState,
)
from runtime.messages import AssistantMessage, Message, ToolUse
from runtime.plugin_env import refusal
from runtime.ports import ToolRunner
from runtime.session import counted, stepped, view
from runtime.sides import Sides
from runtime.signals import CancelledSignal, CancelSignal, EndRun, PauseRun, RunOver
from runtime.toolbatch import Opening, advance_batch
from runtime.usage import over_budget, usage_commands

T = TypeVar("T")


class Stepping(Sides):
    """The Step loop: the Engine drives it, one Step at a time."""

    tools: ToolRunner
    lineage: tuple[str, ...]
    cancel_event: CancelSignal
    parent: ParentLink | None
    pause_requested: bool
    listening: bool
    _execution: ExecutionState | None

    @property
    def ending(self) -> bool:
        """Cancelled or stopped: the Run ends at its next check."""
        stopped = self._execution is not None and self._execution.stopped
        return self.cancel_event.is_set() or stopped

    async def _loop(self, ctx: RunContext, first: Callable[[], Awaitable[None]] | None) -> None:
        try:
            root = self.root
            refused = refusal(root.resolved, root.plugins_refused, ctx.frontier)
            if refused is not None and isinstance(ctx.frontier.run_state, RunningState):
                await self.end(ctx, refused)  # with these plugins this Run may not execute
                return
            if first is not None:
                await self._ending_on(ctx, first())
            while True:
                f = ctx.frontier
                if isinstance(f.run_state, AwaitingState) and self.ending:
                    # told to end while its wait was being committed: the caller heard
                    # "signalled", so the Run ends here rather than rest awaiting
                    await self.end(ctx, self.control_cause(ctx))
                    return
                if isinstance(f.run_state, EndedState | AwaitingState) or f.run_state is None:
                    self.listening = False  # no await between the check above and this
                    return
                if root.session is not None:
                    self._use_side(ctx)
                if self.ending:
                    await self.end(ctx, self.control_cause(ctx))
                elif f.batch is not None and not f.batch.all_terminal:
                    await self._ending_on(ctx, tracing.step(self, ctx, advance_batch(self, ctx)))
                elif self.pause_requested or ctx.execution.wait_request is not None:
                    # the Step that just finished ends (its StepEnd hooks) before the wait
                    hooks = HookResults()
                    ended = await self._end_step(ctx, hooks)
                    if ended is not None:
                        ctx.ended_step(ended, hooks.commands)
                    if not ctx.execution.stopped:
                        await self._await_at_boundary(ctx)
                elif self.parent is not None and await parent_gone(self.store, self.parent):
                    await self.end(ctx, Cancelled())  # its parent ended without cancelling it
                else:
                    await self._ending_on(ctx, tracing.step(self, ctx, self._step(ctx)))
        except CancelledSignal:
            await self.end(ctx, self.control_cause(ctx))
        except RunOver:
            pass

    async def _ending_on(self, ctx: RunContext, work: Awaitable[None]) -> None:
        """Await a Step or a batch's advance; an EndRun it raises is committed as the end."""
        try:
            await work
        except EndRun as end:
            if end.batch is None:
                await self.end(ctx, end.cause)
            else:  # its finished calls keep their results; the rest are sealed
                published = result_messages(seal(end.batch))
                await self.end(
                    ctx, end.cause, messages=published, batch=end.batch, commands=end.commands
                )

    async def _await_at_boundary(self, ctx: RunContext) -> None:
        """Commit Awaiting(user input or pause) between Steps; the Run then holds nothing
        (a hook's wait, held in the run state since its commit, is removed with this one)."""
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
        ended = await self._end_step(ctx, hooks)
        if ended is not None and (ctx.execution.wait_request or ctx.execution.stopped):
            ctx.ended_step(ended, hooks.commands)  # committed with the wait or the end
            return
        root, side, step = self.root, ctx.execution.current_side, f.steps
        counted(ctx.execution, root, f, step)
        if root.session is not None and await self._other_turn(ctx, side, hooks.commands):
            return  # the session ended, or a handler or human took the turn
        results = result_messages(prior)
        if step >= root.max_steps:
            await self.end(ctx, MaxSteps(), messages=results, batch=prior, commands=hooks.commands)
            return
        if over_budget(root.budget, f):
            ctx.pause_step(PauseTarget(reason="budget"), hooks.commands)
            return
        await self.hooks(ctx, "StepStart", hooks, step=step)
        await self.hooks(ctx, "BeforeInference", hooks, step=step)
        if await self._held_before_inference(ctx, prior, results, hooks):
            return  # a hook stopped the Run, or asked for input or a pause
        # messages injected so far join the history now, after the results; a pause
        # before they land commits them staged still (their removal alone lost them)
        staging = tuple(hooks.commands)
        injected, staged = take_injected(ctx.run_id, f.state, hooks.commands)
        hooks.commands[:] = staged
        last = step == root.max_steps - 1
        salvaged = await self.inference.salvage(ctx, step)
        if isinstance(salvaged, Admitted):
            response = salvaged
        else:
            context = (*hooks.context, *([salvaged] if salvaged else []))
            history = (*f.messages, *results, *injected, *context)
            if root.session is not None:  # each side's model sees the session its way
                history = view(history, side)
            try:
                response = await self.inference.infer(ctx, step, history, last, self.trace)
            except PauseRun as pause:
                ctx.pause_step(pause.target, staging)
                return
        ctx.spent = usage_commands(response.usage)  # recorded even if the Run ends here
        await self.hooks(ctx, "AfterInference", hooks, step=step, response=response)
        # Tools were withheld on the last Step: calls the model makes anyway are dropped,
        # never committed without results (every provider refuses a history with a
        # tool call left unanswered); the Run ends max_steps.
        calls = () if last else response.tool_calls
        # the admitted response's parts are checked text and records: not validated again
        answered = side if root.session is not None else None
        assistant = trusted(AssistantMessage, text=response.text, tool_calls=calls, side=answered)
        messages: tuple[Message, ...] = (*results, *injected, assistant)
        # the Step's record of what it used, and (in a session) that this side took a Step
        usage = (*ctx.spent, *stepped(root, f, side))
        hooks.commands[:] = restaged(hooks.commands)  # AfterInference's wait for the next
        if not calls:
            if not response.tool_calls:
                await self.hooks(ctx, "StepEnd", hooks, step=step)
                # what they inject is staged after this commit's removal of what it writes
                # into the history: one policy for the key, or the hand-over fails
                hooks.commands[:] = restaged(hooks.commands)
                if root.session is not None:  # the answer ends this side's turn
                    await self._hand_over(ctx, side, messages, prior, (*hooks.commands, *usage))
                    return
            if ctx.execution.stopped:  # a hook stopped it after its last answer
                cause = self.control_cause(ctx)
            else:
                cause = MaxSteps() if response.tool_calls else Natural()  # guarded by end
            commands = (*hooks.commands, *usage)
            await self.end(ctx, cause, messages=messages, batch=prior, commands=commands)
            return
        batch = open_batch(ctx.run_id, step, [self._spec(c) for c in assistant.tool_calls])
        # the inference commit is made with the batch's first wave (see advance_batch)
        refused: dict[CallId, str] = dict(response.refused)
        refused.update((CallId(c), f"denied: {why}") for c, why in hooks.denied.items())
        opening = Opening(batch, messages, (*hooks.commands, *usage), refused)
        await advance_batch(self, ctx, opening)

    def _spec(self, use: ToolUse) -> CallSpec:
        tool = self.agent.tool(use.tool)
        policy = self.agent.policy_for(tool) if tool else ToolRecoveryPolicy()
        # the parts of a validated ToolUse and a validated policy: not validated again
        return trusted(
            CallSpec, call_id=use.call_id, tool=use.tool, arguments=use.arguments, policy=policy
        )


__all__ = ["Stepping"]
