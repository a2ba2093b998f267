"""Carrying out an open ActiveToolBatch: gates, waves, the executor, results (DESIGN §3).

The plan comes from the pure recovery decision (``plan_calls``), so a live Step
and a recovered one take the same path: requested calls run their gates, an
interrupted ``executing`` call follows its pinned policy, terminal calls are kept.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.base import trusted
from runtime.batch import (
    ActiveToolBatch,
    Awaiting,
    ToolOutput,
    complete,
    finalize,
    mark_awaiting,
    mark_executing,
    mark_indeterminate,
)
from runtime.delegation import (
    CHILDREN_KEY,
    ChildRequest,
    ChildWaiting,
    child_ids,
    refusal,
)
from runtime.events import Fact
from runtime.hooks import HookResults
from runtime.ids import CallId, CorrelationId
from runtime.lifecycle import (
    AwaitingState,
    DelegationOutcome,
    ExternalResult,
    IndeterminateEnd,
    PermissionDecision,
    ResumeCommand,
    ResumeTicket,
    ToolWaitTarget,
    UserInput,
)
from runtime.messages import Message, ToolResultMessage, UserMessage
from runtime.ports import Finished, Lost, ToolInvocation, ToolOutcome
from runtime.recovery import MarkIndeterminate, Replay, RunGates, WaitOnCall, plan_calls
from runtime.signals import EndRun
from runtime.state import Command, StateView
from runtime.timeutil import now_us

if TYPE_CHECKING:
    from runtime.engine import Engine, RunContext


@dataclass(frozen=True)
class Opening:
    """A Step's inference commit, not yet made: the batch it opens and what rides with it."""

    batch: ActiveToolBatch
    messages: tuple[Message, ...]
    commands: tuple[Command, ...]


async def advance_batch(engine: Engine, ctx: RunContext, opening: Opening | None = None) -> None:
    """Bring every call of the open batch to a terminal phase, or to one committed wait.

    With ``opening`` the batch is not committed yet: the gates run first and the
    inference commit carries their verdicts and the first wave's ``executing`` marks,
    one commit where there were two. Nothing is lost by it: ``executing`` promises only
    that the effect may have begun, and no effect begins before that commit returns.
    """
    batch = opening.batch if opening is not None else ctx.frontier.batch
    assert batch is not None
    ready: list[CallId] = []
    waiter: CallId | None = None
    parsed: dict[CallId, dict[str, Any]] = {}  # arguments the gates validated, for the wave
    for action in plan_calls(batch, lambda tool, mode: _supports(engine, tool, mode)):
        if isinstance(action, MarkIndeterminate):
            if _delegates(engine, batch, action.call_id):
                raise EndRun(
                    IndeterminateEnd(reason=f"delegation {action.call_id}: {action.reason}")
                )
            batch = mark_indeterminate(batch, action.call_id, action.reason)
        elif isinstance(action, Replay):
            ready.append(action.call_id)
        elif isinstance(action, WaitOnCall):
            waiter = waiter or action.call_id
        elif isinstance(action, RunGates):
            batch, verdict = _gate(engine, ctx.frontier.state, batch, action.call_id, parsed)
            if verdict == "ready":
                ready.append(action.call_id)
            elif verdict == "wait" and waiter is None:
                waiter = action.call_id  # one wait at a time; later ones stay requested
    waves = _waves(engine, batch, ready)
    if opening is not None:
        # cancelled as the model answered, or stopped by an AfterInference hook
        ending = engine.cancel_event.is_set() or ctx.execution.stopped
        first = [] if ending or not waves else waves[0]
        batch = await _commit_opening(engine, ctx, opening, batch, first)
        if ending:
            return  # the loop ends the Run next; its calls are sealed without running
    for i, wave in enumerate(waves):
        marked = opening is not None and i == 0
        batch = await run_wave(engine, ctx, batch, wave, marked=marked, parsed=parsed)
    lone_child = batch.awaiting_call()
    waiter = lone_child.call_id if lone_child is not None else waiter
    if waiter is not None:
        await _await_call(engine, ctx, batch, waiter)
    elif batch != ctx.frontier.batch:
        await engine.commit(ctx, "results", ctx.running(), batch=batch)


async def _commit_opening(
    engine: Engine,
    ctx: RunContext,
    opening: Opening,
    batch: ActiveToolBatch,
    wave: Sequence[CallId],
) -> ActiveToolBatch:
    """The inference commit, with the calls of ``wave`` (possibly none) marked executing."""
    for call_id in wave:
        batch = mark_executing(batch, call_id)
    await engine.commit(
        ctx,
        "inference",
        ctx.running(),
        messages=opening.messages,
        batch=batch,
        commands=(*opening.commands, *_relationships(engine, ctx, batch, wave)),
    )
    return batch


def _supports(engine: Engine, tool_id: str, mode: str) -> bool:
    tool = engine.agent.tool(tool_id)
    return tool is not None and tool.supports(mode)  # type: ignore[arg-type]


def _gate(
    engine: Engine,
    ctx_state: StateView,
    batch: ActiveToolBatch,
    call_id: CallId,
    parsed: dict[CallId, dict[str, Any]],
) -> tuple[ActiveToolBatch, str]:
    """Validate a requested call; bad input becomes a model-visible error, never a crash.

    The validated arguments go into ``parsed``, so the executor's invocation need not
    parse them again.
    """
    call = batch.call(call_id)
    tool = engine.agent.tool(call.tool)
    if tool is None:
        known = ", ".join(t.id for t in engine.agent.tools) or "none"
        return _fail(batch, call_id, f"unknown tool {call.tool!r}; available tools: {known}")
    try:
        parsed[call_id] = tool.parse(call.arguments)
    except ValueError as exc:
        return _fail(batch, call_id, str(exc))
    if tool.delegates:
        why = _delegation_refusal(engine, ctx_state, batch, call_id)
        if why is not None:
            return _fail(batch, call_id, why)
    if not tool.supports(call.policy.mode):
        return _fail(
            batch,
            call_id,
            f"tool {tool.id} does not support recovery mode "
            f"{call.policy.mode} (it declares {list(tool.recovery)})",
        )
    return batch, "wait" if tool.wait is not None else "ready"


def _delegates(engine: Engine, batch: ActiveToolBatch, call_id: CallId) -> bool:
    if not engine.agent.delegating:
        return False
    tool = engine.agent.tool(batch.call(call_id).tool)
    return tool is not None and tool.delegates


def _delegation_refusal(
    engine: Engine, state: StateView, batch: ActiveToolBatch, call_id: CallId
) -> str | None:
    if engine.children is None:
        return "delegation is not available: this runner has no child runner"
    delegations = [c.call_id for c in batch.calls if _delegates(engine, batch, c.call_id)]
    earlier = delegations[: delegations.index(call_id)]
    # children already committed, plus earlier calls of this batch that were not refused
    started = set(state["run"].get(CHILDREN_KEY, {})) | {
        c for c in earlier if batch.call(c).phase.kind != "completed"
    }
    target = json.loads(batch.call(call_id).arguments)["agent"]
    return refusal(
        engine.agent.delegation,
        depth=len(engine.prompt_path),
        lineage=engine.lineage,
        agent=target,
        started=len(started),
        in_batch=len(earlier) + 1,
    )


def _fail(batch: ActiveToolBatch, call_id: CallId, text: str) -> tuple[ActiveToolBatch, str]:
    return complete(batch, call_id, ToolOutput(content=text, is_error=True)), "done"


def _waves(engine: Engine, batch: ActiveToolBatch, ready: Sequence[CallId]) -> list[list[CallId]]:
    """Consecutive parallel-safe calls share a wave; a serial call runs alone."""
    current: list[CallId] = []
    waves: list[list[CallId]] = []
    for call_id in ready:
        tool = engine.agent.tool(batch.call(call_id).tool)
        if tool is not None and tool.concurrency == "parallel":
            current.append(call_id)
            continue
        if current:
            waves.append(current)
            current = []
        waves.append([call_id])
    if current:
        waves.append(current)
    return waves


async def run_wave(
    engine: Engine,
    ctx: RunContext,
    batch: ActiveToolBatch,
    wave: list[CallId],
    *,
    marked: bool = False,
    parsed: dict[CallId, dict[str, Any]] | None = None,
) -> ActiveToolBatch:
    """Commit executing for the wave, run it in one round trip, commit its results.

    ``parsed`` holds arguments the gates validated; each serves one invocation only, so
    a retried call gets freshly parsed arguments, as the first attempt did.
    """
    parsed = {} if parsed is None else parsed
    commands: list[Command] = []
    undispatched: set[CallId] = set()
    members = list(wave)
    while wave:
        if not marked:
            for call_id in wave:
                batch = mark_executing(batch, call_id, undispatched=call_id in undispatched)
            # the delegation relationship is committed with executing, before any child starts
            await engine.commit(
                ctx,
                "executing",
                ctx.running(),
                batch=batch,
                commands=_relationships(engine, ctx, batch, wave),
            )
        marked = False
        engine.faults.hit("during:tools")
        outcomes = await engine.guard(_dispatch(engine, ctx, batch, wave, parsed))
        _refuse_parallel_waits(engine, wave, outcomes)
        retry: list[CallId] = []
        undispatched = set()
        for call_id, outcome in zip(wave, outcomes, strict=True):
            batch = _settle(batch, call_id, outcome, retry, undispatched, commands)
        wave = retry
    hooks = HookResults()
    if engine.agent.hooks:  # else skip even building each call's arguments
        for call_id in members:
            await engine.hooks(ctx, "AfterTool", hooks, step=batch.step, call=batch.call(call_id))
    await engine.commit(
        ctx,
        "results",
        ctx.running(),
        batch=batch,
        commands=(*commands, *hooks.commands),
    )
    return batch


async def _dispatch(
    engine: Engine,
    ctx: RunContext,
    batch: ActiveToolBatch,
    wave: list[CallId],
    parsed: dict[CallId, dict[str, Any]],
) -> list[ToolOutcome | ChildWaiting]:
    """One executor round trip for ordinary calls; every child of the wave at once."""
    children = [c for c in wave if _delegates(engine, batch, c)]
    ordinary = [c for c in wave if c not in children]
    invocations = [_invocation(engine, ctx, batch, c, parsed.pop(c, None)) for c in ordinary]
    runs: list[Awaitable[Any]] = [engine.tools.run(invocations)] if invocations else []
    assert engine.children is not None or not children
    runs += [
        engine.children.run(_child_request(engine, ctx, batch, c))  # type: ignore[union-attr]
        for c in children
    ]
    # gather wraps each awaitable in a task of its own; a lone one needs none
    results = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
    by_call: dict[CallId, ToolOutcome | ChildWaiting] = {}
    if invocations:
        by_call.update(zip(ordinary, results.pop(0), strict=True))
    by_call.update(zip(children, results, strict=True))
    return [by_call[c] for c in wave]


def _child_request(
    engine: Engine, ctx: RunContext, batch: ActiveToolBatch, call_id: CallId
) -> ChildRequest:
    args = json.loads(batch.call(call_id).arguments)
    thread, run = child_ids(ctx.frontier.thread_id, ctx.run_id, call_id)
    return ChildRequest(
        parent_thread=ctx.frontier.thread_id,
        parent_run=ctx.run_id,
        call_id=call_id,
        agent=args["agent"],
        input=args["input"],
        child_thread=thread,
        child_run=run,
        prompt_path=(*engine.prompt_path, args["agent"].rpartition(":")[2]),
        lineage=(*engine.lineage, args["agent"]),
    )


def _relationships(
    engine: Engine, ctx: RunContext, batch: ActiveToolBatch, wave: Sequence[CallId]
) -> tuple[Command, ...]:
    started = {
        c: child_ids(ctx.frontier.thread_id, ctx.run_id, c)[0]
        for c in wave
        if _delegates(engine, batch, c)
    }
    if not started:
        return ()
    return (Command(key=CHILDREN_KEY, scope="run", merge="disjoint", value=dict(started)),)


def _refuse_parallel_waits(engine: Engine, wave: list[CallId], outcomes: Sequence[object]) -> None:
    """One ticket cannot hold several correlations: a child that needs a human while
    siblings run in parallel ends the parent indeterminate."""
    children = sum(isinstance(o, ChildWaiting) for o in outcomes)
    if children and len(wave) > 1:
        raise EndRun(IndeterminateEnd(reason="a child running in parallel needs a human"))


def _settle(
    batch: ActiveToolBatch,
    call_id: CallId,
    outcome: object,
    retry: list[CallId],
    undispatched: set[CallId],
    commands: list[Command],
) -> ActiveToolBatch:
    call = batch.call(call_id)
    budget_left = call.attempts < call.policy.max_attempts
    if isinstance(outcome, ChildWaiting):  # a lone child surfaces its wait to the parent
        return mark_awaiting(batch, call_id, "delegation", outcome.ticket.correlation)
    if isinstance(outcome, Finished):
        commands.extend(outcome.commands)
        return complete(batch, call_id, outcome.output)
    if isinstance(outcome, Lost):
        if call.policy.mode != "never_replay" and budget_left:
            retry.append(call_id)
            return batch
        return mark_indeterminate(batch, call_id, f"executor lost: {outcome.message}")
    if budget_left:  # Unavailable: nothing dispatched, safe to retry under any policy
        retry.append(call_id)
        undispatched.add(call_id)
        return batch
    text = f"tool unavailable after {call.attempts} attempts: {outcome.message}"  # type: ignore[attr-defined]
    return complete(batch, call_id, ToolOutput(content=text, is_error=True))


def _invocation(
    engine: Engine,
    ctx: RunContext,
    batch: ActiveToolBatch,
    call_id: CallId,
    arguments: dict[str, Any] | None,
) -> ToolInvocation:
    call = batch.call(call_id)
    tool = engine.agent.tool(call.tool)
    assert tool is not None
    return ToolInvocation(
        tool=call.tool,
        arguments=tool.parse(call.arguments) if arguments is None else arguments,
        call_id=call_id,
        operation_id=call.operation_id,
        attempt=call.attempts,
        run_id=ctx.run_id,
        thread_id=ctx.frontier.thread_id,
        prompt_path=engine.prompt_path,
        timeout_s=tool.timeout_s,
    )


async def _await_call(
    engine: Engine, ctx: RunContext, batch: ActiveToolBatch, call_id: CallId
) -> None:
    """Commit the call's wait together with Awaiting(ticket): the Run then holds nothing."""
    call = batch.call(call_id)
    if isinstance(call.phase, Awaiting):
        wait, correlation = call.phase.wait, call.phase.correlation
    else:
        tool = engine.agent.tool(call.tool)
        assert tool is not None and tool.wait is not None
        wait = tool.wait
        correlation = CorrelationId(f"{call.operation_id}:{wait}")
        batch = mark_awaiting(batch, call_id, wait, correlation)
    tool = engine.agent.tool(call.tool)
    deadline_s = tool.wait_deadline_s if tool is not None else None
    ticket = ResumeTicket(
        correlation=correlation,
        run_id=ctx.run_id,
        thread_id=ctx.frontier.thread_id,
        deadline_us=None if deadline_s is None else now_us() + int(deadline_s * 1e6),
        target=ToolWaitTarget(wait=wait, call_id=call_id, tool=call.tool, arguments=call.arguments),
    )
    await engine.commit(
        ctx, "awaiting", AwaitingState(run_id=ctx.run_id, ticket=ticket), batch=batch
    )


async def apply_resume(
    engine: Engine, ctx: RunContext, ticket: ResumeTicket, command: ResumeCommand
) -> None:
    """Commit the validated resume (Awaiting → Running) before acting on it."""
    running = ctx.running()
    payload = command.payload
    resumed = Fact(
        type="resumed",
        run_id=ctx.run_id,
        data={"correlation": ticket.correlation, **payload.model_dump(mode="json")},
    )
    target = ticket.target
    if not isinstance(target, ToolWaitTarget):
        await _resume_at_boundary(engine, ctx, ticket, payload, resumed)
        return
    batch = ctx.frontier.batch
    assert batch is not None
    call_id = target.call_id
    if isinstance(payload, PermissionDecision) and not payload.approve:
        denied = f"blocked: permission denied{': ' + payload.note if payload.note else ''}"
        batch = complete(batch, call_id, ToolOutput(content=denied, is_error=True))
    elif isinstance(payload, ExternalResult | DelegationOutcome):
        batch = complete(batch, call_id, payload.output)
    else:  # approved permission or a scheduled action fires: run the call now
        batch = mark_executing(batch, call_id)
        await engine.commit(ctx, "resume", running, batch=batch, extra_facts=(resumed,))
        await run_wave(engine, ctx, batch, [call_id], marked=True)
        return
    await engine.commit(ctx, "resume", running, batch=batch, extra_facts=(resumed,))


async def _resume_at_boundary(
    engine: Engine, ctx: RunContext, ticket: ResumeTicket, payload: object, resumed: Fact
) -> None:
    """Resume a user-input or pause wait. New user text follows the last batch's results,
    so those are published (and the batch finalized) in the same commit."""
    messages: tuple[Message, ...] = ()
    batch = None
    if isinstance(payload, UserInput):
        prior = ctx.frontier.batch
        if prior is not None:
            batch = finalize(prior)
            messages = result_messages(prior)
        messages = (*messages, UserMessage(id=f"{ticket.correlation}:input", text=payload.text))
    await engine.commit(
        ctx,
        "resume",
        ctx.running(),
        messages=messages,
        batch=batch,
        extra_facts=(resumed,),
    )


def result_messages(batch: ActiveToolBatch | None) -> tuple[ToolResultMessage, ...]:
    """A terminal batch's results, in the model's call order (made of the batch's
    validated fields, so not validated again)."""
    if batch is None:
        return ()
    return tuple(
        trusted(
            ToolResultMessage,
            call_id=c.call_id,
            tool=c.tool,
            content=out.content,
            is_error=out.is_error,
        )
        for c in batch.calls
        for out in (c.to_model_output(),)
    )
