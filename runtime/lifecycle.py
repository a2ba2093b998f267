"""RunState, EndCause, ResumeTicket, ResumeCommand and ThreadStatus (DESIGN §2, §9)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, ValidationError

from runtime.base import Frozen, Given
from runtime.batch import ToolOutput, WaitKind
from runtime.errors import InputRefused, ResumeRejected
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.limits import Limits, check_json_value, check_text, printable

# ---- end causes -----------------------------------------------------------------------


class Natural(Frozen):
    """The model answered without tool calls; requires committed assistant output."""

    kind: Literal["natural"] = "natural"


class MaxSteps(Frozen):
    kind: Literal["max_steps"] = "max_steps"


class Cancelled(Frozen):
    kind: Literal["cancelled"] = "cancelled"


class Stopped(Frozen):
    kind: Literal["stopped"] = "stopped"
    reason: str


FailureKind = Literal[
    "inference",
    "capability_bound",
    "state_conflict",
    "store",
    "hook",
    "recovery",
    "history_limit",
    "internal",
]
"""What failed: the model (``inference``), plugin resolution (``capability_bound``),
state commands of one commit (``state_conflict``), the store refusing a commit
(``store``, e.g. ``payload_too_large``), a hook (``hook``), recovering a lost Run again
and again (``recovery``: a dead letter), or Ratchet itself (``internal``: a bug)."""


class Failed(Frozen):
    kind: Literal["failed"] = "failed"
    failure: FailureKind
    code: str
    """A short code: the error's type, or the limit or rule it broke."""
    message: str


class IndeterminateEnd(Frozen):
    kind: Literal["indeterminate"] = "indeterminate"
    reason: str


EndCause = Annotated[
    Natural | MaxSteps | Cancelled | Stopped | Failed | IndeterminateEnd,
    Field(discriminator="kind"),
]

# ---- resume tickets -------------------------------------------------------------------


class ToolWaitTarget(Frozen):
    """A tool call waiting for permission, an external result, a schedule or a child."""

    kind: Literal["tool_call"] = "tool_call"
    wait: WaitKind
    call_id: CallId
    tool: str
    arguments: str


class UserInputTarget(Frozen):
    kind: Literal["user_input"] = "user_input"
    prompt: str = ""
    side: Literal["a", "b"] | None = None
    """A session's human-backed side whose turn it is (the status reason is then
    ``awaiting_human``); None: input a hook or the caller asked for."""


PauseReason = Literal["manual", "rate_limit", "budget"]


class PauseTarget(Frozen):
    kind: Literal["pause"] = "pause"
    reason: PauseReason = "manual"
    resume_at_us: int | None = None
    """When the Run may go on (microseconds since the epoch): on a cluster the
    Supervisor resumes it then; None: only a caller's ``Unpause`` does."""


ResumeTarget = Annotated[
    ToolWaitTarget | UserInputTarget | PauseTarget, Field(discriminator="kind")
]
RunWait = Annotated[UserInputTarget | PauseTarget, Field(discriminator="kind")]
"""A wait of the Run itself, not of one of its calls: taken between Steps."""


class ResumeTicket(Frozen):
    """Committed with Awaiting: the one typed correlation that may resume the Run."""

    correlation: CorrelationId
    run_id: RunId
    thread_id: ThreadId
    deadline_us: int | None = None
    """Microseconds since the epoch after which a resume is rejected; None: no deadline."""
    target: ResumeTarget

    @property
    def payload_kind(self) -> str:
        """The ResumeCommand payload kind this ticket accepts."""
        if isinstance(self.target, ToolWaitTarget):
            return self.target.wait
        return self.target.kind


class PermissionDecision(Given):
    kind: Literal["permission"] = "permission"
    approve: StrictBool
    """true or false, nothing that reads as either ("yes", 1): a decision authorises."""
    note: str = ""


class ExternalResult(Given):
    kind: Literal["external_result"] = "external_result"
    output: ToolOutput


class ScheduledFire(Given):
    kind: Literal["scheduled_action"] = "scheduled_action"


class DelegationOutcome(Given):
    kind: Literal["delegation"] = "delegation"
    output: ToolOutput


class UserInput(Given):
    kind: Literal["user_input"] = "user_input"
    text: str


class Unpause(Given):
    kind: Literal["pause"] = "pause"


class WaitExpired(Given):
    """Ends a tool call's wait whose deadline (``wait_deadline_s``) has passed: the call
    completes with a model-visible error and the Run goes on. Accepted only after the
    deadline, by the host's clock; on a cluster the Supervisor sends it."""

    kind: Literal["expired"] = "expired"


ResumePayload = Annotated[
    PermissionDecision
    | ExternalResult
    | ScheduledFire
    | DelegationOutcome
    | UserInput
    | Unpause
    | WaitExpired,
    Field(discriminator="kind"),
]


class ResumeCommand(Given):
    correlation: CorrelationId
    run_id: RunId
    thread_id: ThreadId
    payload: ResumePayload
    call_id: CallId | None = None
    """Required when the ticket targets a tool call."""
    request_id: str | None = None
    """The caller's own id for this resume, recorded in the ``resumed`` fact: a caller
    whose answer was lost (its host died) can tell whether its resume, or another
    one, was applied. Not checked against the ticket."""


def validate_resume(
    ticket: ResumeTicket | None, command: ResumeCommand, now_us: int | None
) -> None:
    """Check a command against the committed ticket in the fixed order of DESIGN §2.

    Raises ResumeRejected naming the first axis that fails; the ticket is untouched.
    ``now_us`` None: a client's pre-check, whose clock is not the one that decides (the
    host's is). It stops before the deadline of a ticket that has one: the later axes
    are the host's to judge, after the deadline, or a late resume would be refused on
    its payload by the client and on its deadline by the host. ``WaitExpired`` turns the
    deadline axis round: it is accepted only once a ticket's deadline has passed.
    """
    if ticket is None:
        raise ResumeRejected("ticket", "the run is not awaiting (no committed ticket)")
    if command.correlation != ticket.correlation:
        raise ResumeRejected("correlation", f"expected {ticket.correlation!r}")
    if command.run_id != ticket.run_id:
        raise ResumeRejected("run", f"ticket belongs to run {ticket.run_id!r}")
    if command.thread_id != ticket.thread_id:
        raise ResumeRejected("thread", f"ticket belongs to thread {ticket.thread_id!r}")
    expiry = isinstance(command.payload, WaitExpired)
    if ticket.deadline_us is None:
        if expiry:
            raise ResumeRejected("deadline", "the ticket has no deadline to expire")
    elif now_us is None:
        return
    elif now_us > ticket.deadline_us and not expiry:
        raise ResumeRejected("deadline", "the ticket's deadline has passed")
    elif now_us <= ticket.deadline_us and expiry:
        raise ResumeRejected("deadline", "the ticket's deadline has not passed")
    if expiry:
        if ticket.payload_kind == "delegation":  # its wait ends with its child's end
            raise ResumeRejected("payload", "a delegation's wait does not expire")
    elif command.payload.kind != ticket.payload_kind:
        raise ResumeRejected(
            "payload", f"expected a {ticket.payload_kind} payload, got {command.payload.kind}"
        )
    if isinstance(ticket.target, ToolWaitTarget) and command.call_id != ticket.target.call_id:
        raise ResumeRejected("call_id", f"ticket waits on call {ticket.target.call_id!r}")


# ---- run state (= run disposition) ----------------------------------------------------


class RunningState(Frozen):
    kind: Literal["running"] = "running"
    run_id: RunId


class AwaitingState(Frozen):
    kind: Literal["awaiting"] = "awaiting"
    run_id: RunId
    ticket: ResumeTicket


class EndedState(Frozen):
    kind: Literal["ended"] = "ended"
    run_id: RunId
    cause: EndCause


RunState = Annotated[RunningState | AwaitingState | EndedState, Field(discriminator="kind")]
"""The only stored lifecycle value. A commit's RunDisposition has the same shape, so
"awaiting without a ticket" and "a ticket on running/ended" cannot be built."""
RunDisposition = RunState


# ---- thread run status ----------------------------------------------------------------

StatusState = Literal["idle", "running", "failed"]


class ThreadStatus(Frozen):
    """The thread seen from outside: is an execution in flight, how did the last one end."""

    state: StatusState = "idle"
    since: int = 0
    """Microseconds since the epoch of the last change of state or reason."""
    reason: str | None = None
    """Raw stop reason code of the last transition out of running; opaque to clients."""

    def moved_to(self, state: StatusState, reason: str | None, now_us: int) -> ThreadStatus:
        """The next status; ``since`` changes only when state or reason change."""
        if state == self.state and reason == self.reason:
            return self
        return ThreadStatus(state=state, since=now_us, reason=reason)

    def frame(self) -> dict[str, object]:
        return {"type": "thread_status", "status": self.model_dump(mode="json")}


def answer(ticket: ResumeTicket, payload: ResumePayload) -> ResumeCommand:
    """The ResumeCommand that answers ``ticket`` with ``payload`` (its ids copied over).
    A payload that is not one (built with ``model_construct``, a field of the wrong type)
    is ``InputRefused`` ("type"), as it is in a command (``resume.check_command``)."""
    target = ticket.target
    try:
        return ResumeCommand(
            correlation=ticket.correlation,
            run_id=ticket.run_id,
            thread_id=ticket.thread_id,
            payload=payload,
            call_id=target.call_id if isinstance(target, ToolWaitTarget) else None,
        )
    except ValidationError as exc:
        raise InputRefused("resume payload", "type", printable(str(exc), 500)) from None


def check_payload(payload: ResumePayload, limits: Limits) -> None:
    """A resume payload within the limits (InputRefused otherwise). A ``user_input``
    is its text, held to ``input_bytes`` as a Run's input is (``resume_payload_bytes``,
    below it by default, refused the text the limits document)."""
    if isinstance(payload, UserInput):
        check_text("user input", payload.text, limits.input_bytes, "input_bytes")
        return
    check_json_value(
        "resume payload",
        payload.model_dump(mode="python"),
        limits.resume_payload_bytes,
        "resume_payload_bytes",
        limits,
    )
    if isinstance(payload, ExternalResult | DelegationOutcome):
        content = payload.output.content
        check_text("tool result", content, limits.tool_result_bytes, "tool_result_bytes")
