"""The recovery decision (DESIGN §4): a pure function of the committed frontier.

A restarted driver calls ``decide`` and carries out what it returns. It never
looks at a process, a stream connection or a future: only committed facts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from runtime.base import Frozen, trusted
from runtime.batch import ActiveToolBatch, RecoveryMode, ToolCall
from runtime.commit import Frontier
from runtime.ids import CallId
from runtime.lifecycle import AwaitingState, EndCause, EndedState, ResumeTicket

Supports = Callable[[str, RecoveryMode], bool]
"""supports(tool_id, mode): does the tool (as deployed now) still support the mode?"""

INTERRUPTED = "interrupted while executing; the effect may have happened"


class NoRun(Frozen):
    kind: Literal["no_run"] = "no_run"


class ContinueStep(Frozen):
    """Running with no open batch: infer the next Step."""

    kind: Literal["continue_step"] = "continue_step"


class ReturnTerminus(Frozen):
    kind: Literal["return_terminus"] = "return_terminus"
    cause: EndCause


class WaitForResume(Frozen):
    kind: Literal["wait_for_resume"] = "wait_for_resume"
    ticket: ResumeTicket


class KeepTerminal(Frozen):
    kind: Literal["keep"] = "keep"
    call_id: CallId


class RunGates(Frozen):
    """Requested: run the gates again, commit executing, then the executor."""

    kind: Literal["run_gates"] = "run_gates"
    call_id: CallId


class Replay(Frozen):
    """Executing under a replayable policy: commit the next attempt, re-invoke, same op id."""

    kind: Literal["replay"] = "replay"
    call_id: CallId
    attempt: int


class Reconnect(Frozen):
    """Executing under ``durable_request`` (a delegation): its attempt goes on. The same
    call names the same child, which runs on whatever became of its parent: asking for
    it again joins the child, it does not start another or spend an attempt (only an
    attempt that ends lost does: its child's host died)."""

    kind: Literal["reconnect"] = "reconnect"
    call_id: CallId


class MarkIndeterminate(Frozen):
    kind: Literal["mark_indeterminate"] = "mark_indeterminate"
    call_id: CallId
    reason: str


class WaitOnCall(Frozen):
    kind: Literal["wait_on_call"] = "wait_on_call"
    call_id: CallId


CallAction = KeepTerminal | RunGates | Replay | Reconnect | MarkIndeterminate | WaitOnCall
RunAction = NoRun | ContinueStep | ReturnTerminus | WaitForResume


class Decision(Frozen):
    run: RunAction
    calls: tuple[CallAction, ...] = ()
    """For an open batch: one action per call, in model order (recovered before inference)."""


def decide(frontier: Frontier, supports: Supports) -> Decision:
    state = frontier.run_state
    if state is None:
        return Decision(run=NoRun())
    if isinstance(state, EndedState):
        return Decision(run=ReturnTerminus(cause=state.cause))
    calls = plan_calls(frontier.batch, supports) if frontier.batch is not None else ()
    if isinstance(state, AwaitingState):
        return Decision(run=WaitForResume(ticket=state.ticket), calls=calls)
    return Decision(run=ContinueStep(), calls=calls)


def plan_calls(batch: ActiveToolBatch, supports: Supports) -> tuple[CallAction, ...]:
    return tuple(_plan_call(call, supports) for call in batch.calls)


def _plan_call(call: ToolCall, supports: Supports) -> CallAction:
    # every action is made of the call's own fields (a validated batch's: a call id, an
    # int attempt count within its pinned budget) and reasons written here: a live Step
    # plans each call of its batch this way, so they are not validated again
    phase, call_id = call.phase.kind, call.call_id
    if phase in ("completed", "indeterminate"):
        return trusted(KeepTerminal, call_id=call_id)
    if phase == "requested":
        return trusted(RunGates, call_id=call_id)
    if phase == "awaiting":
        return trusted(WaitOnCall, call_id=call_id)
    mode = call.policy.mode
    if mode == "never_replay":
        return trusted(MarkIndeterminate, call_id=call_id, reason=INTERRUPTED)
    if not supports(call.tool, mode):
        reason = f"tool no longer supports the pinned mode {mode}"
        return trusted(MarkIndeterminate, call_id=call_id, reason=reason)
    if mode == "durable_request":
        return trusted(Reconnect, call_id=call_id)
    if call.attempts >= call.policy.max_attempts:
        reason = f"all {call.policy.max_attempts} attempts used"
        return trusted(MarkIndeterminate, call_id=call_id, reason=reason)
    return trusted(Replay, call_id=call_id, attempt=call.attempts + 1)
