"""Waits and resumes: committing a ticket, and the commit that answers one (DESIGN §2).

A wait is committed together with ``Awaiting(ticket)``; the Run then holds nothing.
A resume is validated against the committed ticket (``validate_resume``) and its
commit carries the resumer's claim (``resume_commit``): it lands only if the thread is
still at the version the ticket was read at, so of two racing resumes exactly one
lands and the other finds the ticket gone. A resume that cannot land within the
history limits whatever its caller sends (only an answer's own text is the caller's to
shorten) ends the Run ``failed(history_limit)`` instead: refused, it would be for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError

from runtime.batch import (
    ActiveToolBatch,
    Awaiting,
    ToolOutput,
    complete,
    finalize,
    mark_awaiting,
    mark_executing,
)
from runtime.commit import Frontier
from runtime.context import RunContext, StepServices
from runtime.errors import HistoryLimitReached, InputRefused
from runtime.events import Fact
from runtime.failures import failure_of
from runtime.gates import admit_outcome, relationships
from runtime.ids import CallId, CorrelationId
from runtime.injection import carried_by_answer, take_injected
from runtime.lifecycle import (
    AwaitingState,
    DelegationOutcome,
    ExternalResult,
    PauseTarget,
    PermissionDecision,
    ResumeCommand,
    ResumeTicket,
    ToolWaitTarget,
    UserInput,
    UserInputTarget,
    WaitExpired,
    check_payload,
    validate_resume,
)
from runtime.limits import (
    STORED_IDS,
    Limits,
    check_id,
    history_size,
    long_id_limits,
    printable,
)
from runtime.messages import Message, UserMessage
from runtime.ports import Finished
from runtime.session import human_answer
from runtime.state import Command
from runtime.timeutil import now_us
from runtime.usage import budget_granted

EXPIRED = {
    "permission": "blocked: no permission decision came before the wait's deadline",
    "external_result": "no result came before the wait's deadline",
    "scheduled_action": "not run: its schedule did not fire before the wait's deadline",
}
"""The model-visible error of a call whose wait expired (``WaitExpired``), by wait kind."""
log = logging.getLogger("ratchet.engine")


def check_command(command: ResumeCommand, limits: Limits) -> ResumeCommand:
    """``command``, validated again (``Given``: one built with ``model_construct``), fit
    to be checked against a ticket: its ids and its payload within the limits
    (InputRefused otherwise; nothing is read or written)."""
    try:
        command = ResumeCommand.model_validate(command)
    except ValidationError as exc:
        raise InputRefused("resume command", "type", printable(str(exc), 500)) from None
    # the ticket's ids name what is stored (``STORED_IDS``: a Run that waited since before
    # its system lowered id_chars, or an import's run id, is resumed); the request id is new
    long_ids = long_id_limits(STORED_IDS.id_chars)  # correlations embed operation ids
    check_id("correlation", command.correlation, long_ids)
    check_id("run id", command.run_id, STORED_IDS)
    check_id("thread id", command.thread_id, STORED_IDS)
    if command.call_id is not None:
        check_id("call id", command.call_id, STORED_IDS)
    if command.request_id is not None:
        check_id("request id", command.request_id, limits)
    check_payload(command.payload, limits)
    return command


async def await_call(
    services: StepServices, ctx: RunContext, batch: ActiveToolBatch, call_id: CallId
) -> None:
    """Commit the call's wait together with Awaiting(ticket): the Run then holds nothing."""
    call = batch.call(call_id)
    tool = services.agent.tool(call.tool)
    if isinstance(call.phase, Awaiting):
        wait, correlation = call.phase.wait, call.phase.correlation
    else:
        assert tool is not None and tool.wait is not None
        wait = tool.wait
        correlation = CorrelationId(f"{call.operation_id}:{wait}")
        batch = mark_awaiting(batch, call_id, wait, correlation)
    # the tool's deadline is for the wait it declares (a permission), never its child's
    deadline_s = tool.wait_deadline_s if tool is not None and wait == tool.wait else None
    ticket = ResumeTicket(
        correlation=correlation,
        run_id=ctx.run_id,
        thread_id=ctx.frontier.thread_id,
        deadline_us=None if deadline_s is None else now_us() + int(deadline_s * 1e6),
        target=ToolWaitTarget(wait=wait, call_id=call_id, tool=call.tool, arguments=call.arguments),
    )
    await services.commit(
        ctx, "awaiting", AwaitingState(run_id=ctx.run_id, ticket=ticket), batch=batch
    )


async def resume_commit(
    services: StepServices, ctx: RunContext, ticket: ResumeTicket, command: ResumeCommand
) -> CallId | None:
    """Commit the validated resume (Awaiting → Running) with the resumer's claim, before
    acting on it; returns the call to run now (an approval, a fired schedule), if any."""
    payload = command.payload
    data = {"correlation": ticket.correlation, **payload.model_dump(mode="json")}
    if command.request_id is not None:
        data["request_id"] = command.request_id
    resumed = Fact(type="resumed", run_id=ctx.run_id, data=data)
    target = ticket.target
    messages: tuple[Message, ...] = ()
    batch = ctx.frontier.batch
    run_now: CallId | None = None
    commands: tuple[Command, ...] = ()
    if not isinstance(target, ToolWaitTarget):
        # user input or a pause: new user text follows the last batch's results, so those
        # are published (and the batch finalized) in the same commit
        batch = None
        if isinstance(target, PauseTarget) and target.reason == "budget":
            commands = (budget_granted(ctx.frontier),)  # a new allowance from here
        if isinstance(payload, UserInput):
            prior = ctx.frontier.batch
            if prior is not None:
                batch = finalize(prior)
            user = UserMessage(id=f"{ticket.correlation}:input", text=payload.text)
            if isinstance(target, UserInputTarget) and target.side is not None:
                # a session's human side answered: its turn ends with this commit
                user, commands = human_answer(target, ctx.frontier, payload.text, user.id)
            # the results, then the messages injected before the wait, come before the
            # answer: the wait kept room for them (``Committing._within_answer``)
            _, commands = take_injected(ctx.run_id, ctx.frontier.state, commands)
            messages = (*carried_by_answer(ctx.frontier), user)
    else:
        assert batch is not None
        call_id = target.call_id
        if isinstance(payload, PermissionDecision) and not payload.approve:
            denied = f"blocked: permission denied{': ' + payload.note if payload.note else ''}"
            batch = _completed(services, batch, call_id, ToolOutput(content=denied, is_error=True))
        elif isinstance(payload, ExternalResult | DelegationOutcome):
            batch = _completed(services, batch, call_id, payload.output)
        elif isinstance(payload, WaitExpired):
            expired = EXPIRED.get(target.wait, "blocked: the wait expired")
            batch = _completed(services, batch, call_id, ToolOutput(content=expired, is_error=True))
        else:  # approved permission or a scheduled action fires: run the call now
            batch = mark_executing(batch, call_id)
            run_now = call_id
            # a call that delegates: its child's relationship lands with its executing
            commands = relationships(services, ctx, batch, [call_id])
    try:
        await services.commit(
            ctx,
            "resume",
            ctx.running(),
            claim=True,
            messages=messages,
            batch=batch,
            commands=commands,
            extra_facts=(resumed,),
        )
    except HistoryLimitReached as exc:
        required = messages[:-1] if isinstance(payload, UserInput) else messages
        ended = Fact(type="resume_ended", run_id=ctx.run_id, data=data)
        await _end_unresumable(services, ctx, exc, required, ended)
        return None
    return run_now


async def _end_unresumable(
    services: StepServices,
    ctx: RunContext,
    refused: HistoryLimitReached,
    required: Sequence[Message],
    ended: Fact,
) -> None:
    """A resume refused by a history limit: raised again if the caller's own text is what
    does not fit (the ticket stays for a shorter one); else what the runtime itself writes
    to resume (a grant, a handoff, the results an answer carries, the commit itself) does
    not fit, every resume would be refused and the Run would wait for ever, so it ends
    ``failed(history_limit, <limit>)``. It ends at rest as a cancel ends it: the end claims
    the thread at the version the ticket was read at, so of rivals (another resume, a
    cancel) one lands and the others are fenced, to find the ticket gone; and a replay
    meets an end made at rest (a way in of its own). The end records the resume it took
    (``ended``: a ``resume_ended`` fact, the ``resumed`` one's data): a caller asking
    again under the same request id hears that its resume was taken, and ended the
    Run, not that another resume or a cancel did."""
    if _answer_over(services.limits, ctx, refused, required):
        raise refused
    thread = ctx.frontier.thread_id
    log.warning("run %s on %s: its resume cannot land (%s)", ctx.run_id, thread, refused)
    ctx.unstage()  # staged for the resume commit, which did not land
    await services.end(ctx, failure_of(refused), claim=True, facts=(ended,))


def _answer_over(
    limits: Limits, ctx: RunContext, refused: HistoryLimitReached, required: Sequence[Message]
) -> bool:
    """Whether a refused resume would fit without the caller's own text: only that text
    is the caller's to shorten; the commit, the state it writes and what it carries are
    the runtime's."""
    if refused.limit != "history_bytes":
        return False
    held = ctx.history_bytes
    if held is None:
        held = history_size(ctx.frontier.messages)
    return held + history_size(required) <= limits.history_bytes


def _completed(
    services: StepServices, batch: ActiveToolBatch, call_id: CallId, output: ToolOutput
) -> ActiveToolBatch:
    """A result supplied by a resume is held to the limits a tool's own result is: over
    ``tool_result_bytes`` or past the Step's ``batch_result_bytes``, it becomes a
    model-visible error naming the limit."""
    admitted = admit_outcome(Finished(output=output), services.limits, batch)
    return complete(batch, call_id, admitted.output)


def validate_ticket(
    frontier: Frontier, command: ResumeCommand, recorded: bool = False
) -> ResumeTicket:
    """The committed ticket ``command`` answers; ResumeRejected (naming the axis) if not.

    ``recorded``: a replay's resume, which landed when it was made; its deadline is
    judged as it was then (an expiry after the deadline, any other answer before it),
    not by the replay's clock, which set the replayed ticket's deadline afresh.
    """
    state = frontier.run_state
    ticket = state.ticket if isinstance(state, AwaitingState) else None
    now = now_us()
    if recorded and ticket is not None and ticket.deadline_us is not None:
        now = ticket.deadline_us + isinstance(command.payload, WaitExpired)
    validate_resume(ticket, command, now)
    assert ticket is not None
    return ticket
