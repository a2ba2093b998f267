"""Carrying out an open ActiveToolBatch: the opening commit, waves, the executor (DESIGN §3).

``advance_batch`` brings every call of the open batch to a terminal phase or to one
committed wait: the gates (``runtime.gates.plan``) decide what is ready, the ready
calls run in waves (``run_wave``: commit ``executing``, one executor round trip,
commit the results), and a waiting call commits its ticket (``runtime.resume``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime import tracing
from runtime.batch import (
    ActiveToolBatch,
    ToolCall,
    ToolOutput,
    complete,
    mark_awaiting,
    mark_executing,
    mark_indeterminate,
)
from runtime.context import RunContext, StepServices
from runtime.delegation import ChildRequest, ChildWaiting, child_ids
from runtime.errors import HistoryLimitReached, StateConflict
from runtime.execution import ExecutionSnapshot, InjectMessage, ToolRequest, snapshot
from runtime.failures import failure_of
from runtime.gates import admit_outcome, delegates, plan, relationships, waves
from runtime.hooks import HookFailed, HookResults
from runtime.ids import CallId
from runtime.injection import inject_commands, live_history
from runtime.lifecycle import IndeterminateEnd
from runtime.limits import printable
from runtime.messages import Message
from runtime.ports import Finished, Lost, ToolInvocation, ToolOutcome, Unavailable
from runtime.resume import await_call
from runtime.session import stage_forced
from runtime.signals import CancelledSignal, EndRun, OwnCancels
from runtime.state import Command


@dataclass(frozen=True)
class Opening:
    """A Step's inference commit, not yet made: the batch it opens and what rides with it."""

    batch: ActiveToolBatch
    messages: tuple[Message, ...]
    commands: tuple[Command, ...]
    refused: Mapping[CallId, str] = field(default_factory=dict)
    """Calls whose arguments the model sent could not be kept (``admit_response``)."""


async def advance_batch(
    services: StepServices, ctx: RunContext, opening: Opening | None = None
) -> None:
    """Bring every call of the open batch to a terminal phase, or to one committed wait.

    With ``opening`` the batch is not committed yet: the gates run first and the
    inference commit carries their verdicts and the first wave's ``executing`` marks,
    one commit where there were two. Nothing is lost by it: ``executing`` promises only
    that the effect may have begun, and no effect begins before that commit returns.
    """
    batch = opening.batch if opening is not None else ctx.frontier.batch
    assert batch is not None
    refused = opening.refused if opening is not None else None
    async with OwnCancels():  # a gate's, denying its call
        planned = plan(services, ctx.frontier.state, batch, refused)
    batch = planned.batch
    if planned.sealed:  # their AfterTool hooks, before anything commits the seal
        hooks = HookResults(handed=ctx.handed)
        await _after_tool(services, ctx, batch, planned.sealed, hooks, ())
        ctx.pending.extend(hooks.commands)  # with the next commit
        ctx.handed = hooks.handed  # which may be a wave's results commit (a rejoined call
        # is not committed executing again): its hooks then share this output's budget
    ready_waves = waves(services.agent, batch, planned.ready)
    if opening is not None:
        # cancelled as the model answered, or stopped by an AfterInference hook
        ending = services.ending
        first = [] if ending or not ready_waves else ready_waves[0]
        batch = await _commit_opening(services, ctx, opening, batch, first)
        if ending:
            return  # the loop ends the Run next; its calls are sealed without running
    for i, wave in enumerate(ready_waves):
        marked = opening is not None and i == 0
        batch = await run_wave(
            services, ctx, batch, wave, marked=marked, parsed=planned.parsed, joined=planned.joined
        )
        if batch.awaiting_call() is not None:
            # a lone child surfaced a human wait: the later waves wait for its outcome
            # (they run on the resume). One of them delegating to a child that waits too
            # would make a second awaiting call, which a batch cannot hold
            break
    lone_child = batch.awaiting_call()
    waiter = lone_child.call_id if lone_child is not None else planned.waiter
    if waiter is not None:
        await await_call(services, ctx, batch, waiter)
    elif batch != ctx.frontier.batch:
        await services.commit(ctx, "results", ctx.running(), batch=batch)


async def _commit_opening(
    services: StepServices,
    ctx: RunContext,
    opening: Opening,
    batch: ActiveToolBatch,
    wave: Sequence[CallId],
) -> ActiveToolBatch:
    """The inference commit, with the calls of ``wave`` (possibly none) marked executing."""
    for call_id in wave:
        batch = mark_executing(batch, call_id)
    await services.commit(
        ctx,
        "inference",
        ctx.running(),
        messages=opening.messages,
        batch=batch,
        commands=(*opening.commands, *relationships(services, ctx, batch, wave)),
    )
    return batch


async def run_wave(
    services: StepServices,
    ctx: RunContext,
    batch: ActiveToolBatch,
    wave: list[CallId],
    *,
    marked: bool = False,
    parsed: dict[CallId, dict[str, Any]] | None = None,
    joined: set[CallId] | frozenset[CallId] = frozenset(),
) -> ActiveToolBatch:
    """Commit executing for the wave, run it in one round trip, commit its results.

    ``parsed`` holds arguments the gates validated; each serves one invocation only, so
    a retried call gets freshly parsed arguments, as the first attempt did. ``joined``:
    calls whose committed attempt goes on (a recovered delegation rejoins its child), run
    at first without a new attempt, and not committed again if they are all the wave.
    """
    parsed = {} if parsed is None else parsed
    commands: list[Command] = []
    undispatched: set[CallId] = set()
    members = list(wave)
    while wave:
        marking = [] if marked else [c for c in wave if c not in joined]
        unmarked = batch  # should the commit be refused: no attempt starts in the end
        for call_id in marking:
            batch = mark_executing(batch, call_id, undispatched=call_id in undispatched)
        if marking or commands:
            # the delegation relationship is committed with executing, before any child starts;
            # so are the commands of calls that finished beside those retried now: the
            # batch committed here holds those calls completed, and a recovery from it
            # would never run them again
            try:
                await services.commit(
                    ctx,
                    "executing",
                    ctx.running(),
                    batch=batch,
                    commands=(*commands, *relationships(services, ctx, batch, marking)),
                )
            except (StateConflict, HistoryLimitReached) as refused:  # the finished calls'
                # commands clash, or overflow the state: the Run ends with their results
                raise EndRun(failure_of(refused), unmarked) from refused
            commands.clear()
        marked, joined = False, frozenset()  # a call retried after a loss: a new attempt
        services.faults.hit("during:tools")
        with tracing.tool_calls(services.trace, batch, wave) as spans:  # no-op: untraced
            work = _dispatch(services, ctx, batch, wave, parsed, spans)
            outcomes = await services.guard(work)
            waits = _parallel_waits(wave, outcomes)
            retry: list[CallId] = []
            undispatched = set()
            for call_id, outcome in zip(wave, outcomes, strict=True):
                if waits and isinstance(outcome, ChildWaiting):
                    continue  # left executing: the end seals it unknown
                batch = _record(
                    services, ctx, batch, call_id, outcome, retry, undispatched, commands
                )
            spans.done(batch, outcomes)
            if waits:  # the calls that finished beside them are kept in the end
                raise EndRun(IndeterminateEnd(reason=waits), batch, commands)
            _no_child_given_up(services, batch, wave, commands)
        wave = retry
    if batch.awaiting_call() is not None:
        # a lone child that surfaced a human wait: its wait is committed together with
        # the ticket (advance_batch), not in a results commit before it; so are the
        # commands of the calls that finished beside it
        ctx.pending.extend(commands)
        return batch
    hooks = HookResults(alongside=commands, handed=ctx.handed)  # what ``pending`` holds
    await _after_tool(services, ctx, batch, members, hooks, commands)
    # a tool's force_turn and then one of its hooks': the hook's counts (``last_forced``)
    try:  # the next inference may begin before this lands (Committing.commit, ``landing``)
        await services.commit(
            ctx,
            "results",
            ctx.running(),
            landing=True,
            batch=batch,
            commands=(*commands, *hooks.commands),
        )
    except (StateConflict, HistoryLimitReached) as refused:  # the tools' own commands clash,
        # or take the state past state_bytes: refused, unwritten; their results are kept
        raise EndRun(failure_of(refused), batch) from refused
    return batch


async def _after_tool(
    services: StepServices,
    ctx: RunContext,
    batch: ActiveToolBatch,
    call_ids: Sequence[CallId],
    hooks: HookResults,
    kept: Sequence[Command],
) -> None:
    """The AfterTool hooks of ``call_ids``, their commands into ``hooks``. A hook that
    fails ends the Run, and so does a cancel or stop while they run: what the tools did
    (``batch``, and ``kept``: their commands) is kept in its end."""
    if not services.agent.hooks:  # else skip even building each call's arguments
        return
    try:
        for call_id in call_ids:
            call = batch.call(call_id)
            await services.hooks(ctx, "AfterTool", hooks, step=batch.step, call=call)
    except HookFailed as failed:
        raise EndRun(failure_of(failed), batch, kept) from failed
    except CancelledSignal:
        raise EndRun(services.control_cause(ctx), batch, kept) from None


async def _dispatch(
    services: StepServices,
    ctx: RunContext,
    batch: ActiveToolBatch,
    wave: list[CallId],
    parsed: dict[CallId, dict[str, Any]],
    spans: tracing.ToolSpans,
) -> list[ToolOutcome | ChildWaiting]:
    """One executor round trip for ordinary calls; every child of the wave at once."""
    agent = services.agent
    children = [c for c in wave if delegates(agent, batch, c)]
    ordinary = [c for c in wave if c not in children]
    seen = snapshot(ctx.execution) if ordinary else None
    invocations = [
        _invocation(services, ctx, batch, c, parsed.pop(c, None), seen) for c in ordinary
    ]
    invocations = spans.carried(invocations)  # each call's span travels with it
    runs: list[Awaitable[Any]] = [services.tools.run(invocations)] if invocations else []
    child_runner = services.children
    assert child_runner is not None or not children
    runs += [
        child_runner.run(_child_request(services, ctx, batch, c))  # type: ignore[union-attr]
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
    services: StepServices, ctx: RunContext, batch: ActiveToolBatch, call_id: CallId
) -> ChildRequest:
    args = json.loads(batch.call(call_id).arguments)
    thread, run = child_ids(ctx.frontier.thread_id, ctx.run_id, call_id, services.limits.id_chars)
    return ChildRequest(
        parent_thread=ctx.frontier.thread_id,
        parent_run=ctx.run_id,
        call_id=call_id,
        agent=args["agent"],
        input=args["input"],
        child_thread=thread,
        child_run=run,
        prompt_path=(*services.prompt_path, args["agent"].rpartition(":")[2]),
        lineage=(*services.lineage, args["agent"]),
    )


def _parallel_waits(wave: list[CallId], outcomes: Sequence[object]) -> str | None:
    """Why the parent must end indeterminate, or None: one ticket cannot hold several
    correlations, so a child that needs a human while siblings ran in parallel ends it."""
    children = sum(isinstance(o, ChildWaiting) for o in outcomes)
    if children and len(wave) > 1:
        return "a child running in parallel needs a human"
    return None


def _record(
    services: StepServices,
    ctx: RunContext,
    batch: ActiveToolBatch,
    call_id: CallId,
    outcome: object,
    retry: list[CallId],
    undispatched: set[CallId],
    commands: list[Command],
) -> ActiveToolBatch:
    """One call's outcome into the batch (or onto the retry list)."""
    call = batch.call(call_id)
    budget_left = call.attempts < call.policy.max_attempts
    if isinstance(outcome, ChildWaiting):  # a lone child surfaces its wait to the parent
        return mark_awaiting(batch, call_id, "delegation", outcome.ticket.correlation)
    if isinstance(outcome, Finished):
        agent = services.agent
        declared = agent.resolved.tool_keys.get(call.tool) if agent.resolved else None
        admitted = admit_outcome(outcome, services.limits, batch, declared, commands)
        commands.extend(admitted.commands)
        _requested(ctx, call, admitted.requests, commands, services.root.session is not None)
        return complete(batch, call_id, admitted.output)
    if isinstance(outcome, Lost):
        if call.policy.mode != "never_replay" and budget_left:
            retry.append(call_id)
            return batch
        return mark_indeterminate(batch, call_id, printable(f"executor lost: {outcome.message}"))
    if not isinstance(outcome, Unavailable):  # a runner's bug: never taken for "not sent"
        raise TypeError(f"call {call_id}: a tool runner answered {type(outcome).__name__}")
    if budget_left:  # nothing dispatched: safe to retry under any policy
        retry.append(call_id)
        undispatched.add(call_id)
        return batch
    text = f"tool unavailable after {call.attempts} attempts: {outcome.message}"
    return complete(batch, call_id, ToolOutput(content=printable(text), is_error=True))


def _no_child_given_up(
    services: StepServices, batch: ActiveToolBatch, wave: list[CallId], commands: list[Command]
) -> None:
    """A delegating call whose attempts ran out (its child's host lost each time) ends the
    Run indeterminate, as a recovery that finds it so does: a child the parent gave up on
    must not run on without it (the end cancels the children), nor be delegated again."""
    for call_id in wave:
        phase = batch.call(call_id).phase
        if phase.kind == "indeterminate" and delegates(services.agent, batch, call_id):
            reason = f"delegation {call_id}: {phase.reason}"
            raise EndRun(IndeterminateEnd(reason=reason), batch, commands)


def _requested(
    ctx: RunContext,
    call: ToolCall,
    requests: Sequence[ToolRequest],
    commands: list[Command],
    root_session: bool,
) -> None:
    """What a finished call asked of its Run: injections are staged with its result, the
    rest applied to the ExecutionState (the loop acts on it after the results commit)."""
    texts = [r.text for r in requests if isinstance(r, InjectMessage)]
    source = f"tool:{call.operation_id}:{call.attempts}"
    commands.extend(inject_commands(ctx.frontier.version, source, texts))
    for request in requests:
        if not isinstance(request, InjectMessage):
            ctx.execution.react(request)
    if root_session:
        stage_forced(ctx.execution, commands)  # a forced turn survives a crash from here


def _invocation(
    services: StepServices,
    ctx: RunContext,
    batch: ActiveToolBatch,
    call_id: CallId,
    arguments: dict[str, Any] | None,
    seen: ExecutionSnapshot | None,
) -> ToolInvocation:
    call = batch.call(call_id)
    tool = services.agent.tool(call.tool)
    assert tool is not None
    if tool.sees_history:
        seen = snapshot(ctx.execution, live_history(ctx.frontier, ctx.pending))
    return ToolInvocation(
        tool=call.tool,
        arguments=tool.parse(call.arguments, services.limits) if arguments is None else arguments,
        call_id=call_id,
        operation_id=call.operation_id,
        attempt=call.attempts,
        epoch=ctx.epoch,
        run_id=ctx.run_id,
        thread_id=ctx.frontier.thread_id,
        prompt_path=services.prompt_path,
        timeout_s=tool.timeout_s,
        execution=seen,
    )
