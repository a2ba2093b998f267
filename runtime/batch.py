"""ActiveToolBatch: the durable record of one Step's tool calls, and its transition kernel.

Every function here is pure: it takes a batch and returns a new one, or raises
``InvalidTransition``. The model validator re-checks every invariant, so a batch
decoded from storage is as trustworthy as one built here (DESIGN §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, StrictBool, ValidationError, model_validator

from runtime.base import Frozen, Given, evolve, trusted
from runtime.errors import CorruptBatch, InvalidTransition
from runtime.ids import (
    SCHEMA_VERSION,
    BatchId,
    CallId,
    CorrelationId,
    OperationId,
    RunId,
    batch_id,
    call_operation_id,
)
from runtime.messages import ToolResultMessage

RecoveryMode = Literal["never_replay", "replay_safe", "idempotent", "durable_request"]
RECOVERY_MODES: tuple[RecoveryMode, ...] = (
    "never_replay",
    "replay_safe",
    "idempotent",
    "durable_request",
)
WaitKind = Literal["permission", "external_result", "scheduled_action", "delegation"]
SEALED_REASON = "owning run ended"


class ToolRecoveryPolicy(Frozen):
    """Pinned into the batch when a call is requested; recovery obeys it, not today's code."""

    mode: RecoveryMode = "never_replay"
    """never_replay: an interrupted attempt becomes indeterminate. The others may re-invoke."""
    max_attempts: int = Field(default=3, ge=1, le=100)
    """Executor attempts allowed in total, the first included."""


class ToolOutput(Given):
    content: str
    """What the model sees as the tool's result."""
    is_error: StrictBool = False
    """true or false (a caller's external result is held to it: "no" is no boolean)."""


class Requested(Frozen):
    """Durable; no executor attempt has been recorded."""

    kind: Literal["requested"] = "requested"


class Executing(Frozen):
    """An external effect may have started."""

    kind: Literal["executing"] = "executing"
    attempt: int = Field(ge=1)
    after_undispatched: bool = False
    """This attempt follows one that dispatched nothing (the tool raised
    UnavailableBeforeDispatch): the only way a never_replay call runs again."""


class Awaiting(Frozen):
    """The call owns a typed wait."""

    kind: Literal["awaiting"] = "awaiting"
    wait: WaitKind
    correlation: CorrelationId


class Completed(Frozen):
    """Terminal: the output the model will see."""

    kind: Literal["completed"] = "completed"
    output: ToolOutput


class Indeterminate(Frozen):
    """Terminal: the outcome cannot be classified; reconcile by operation id."""

    kind: Literal["indeterminate"] = "indeterminate"
    reason: str


CallPhase = Annotated[
    Requested | Executing | Awaiting | Completed | Indeterminate, Field(discriminator="kind")
]
TERMINAL_KINDS = frozenset({"completed", "indeterminate"})


class ToolCall(Frozen):
    call_id: CallId
    tool: str
    """Tool id as the model named it (may be unknown: then the call completes with an error)."""
    arguments: str
    """Raw JSON arguments from the model."""
    operation_id: OperationId
    """``{batch}:{call_id}``: handed to the tool so downstream systems can deduplicate."""
    policy: ToolRecoveryPolicy
    phase: CallPhase = Requested()
    attempts: int = Field(default=0, ge=0)
    """Executor attempts recorded so far."""

    @property
    def terminal(self) -> bool:
        return self.phase.kind in TERMINAL_KINDS

    def to_model_output(self) -> ToolOutput:
        """What the model sees for a terminal call."""
        if isinstance(self.phase, Completed):
            return self.phase.output
        if isinstance(self.phase, Indeterminate):
            return ToolOutput(
                content=f"tool outcome unknown ({self.phase.reason}); "
                f"operation id {self.operation_id}",
                is_error=True,
            )
        raise InvalidTransition(f"call {self.call_id} is not terminal")


class ActiveToolBatch(Frozen):
    schema_version: Literal[1] = SCHEMA_VERSION
    batch_id: BatchId
    run_id: RunId
    step: int = Field(ge=0)
    status: Literal["open", "finalized"] = "open"
    calls: tuple[ToolCall, ...]

    @model_validator(mode="after")
    def _invariants(self) -> ActiveToolBatch:
        check_invariants(self)
        return self

    def call(self, call_id: CallId) -> ToolCall:
        for call in self.calls:
            if call.call_id == call_id:
                return call
        raise InvalidTransition(f"batch {self.batch_id} has no call {call_id!r}")

    @property
    def all_terminal(self) -> bool:
        return all(call.terminal for call in self.calls)

    def awaiting_call(self) -> ToolCall | None:
        return next((c for c in self.calls if c.phase.kind == "awaiting"), None)


def check_invariants(batch: ActiveToolBatch) -> None:
    """Raise ValueError on any broken rule of DESIGN §2 (pydantic wraps it on decode).

    Runs whenever a batch is validated, so on every commit that carries one: plain
    loops, each attribute read once (reads on a record are not cheap).
    """
    calls = batch.calls
    if not calls:
        raise ValueError("a batch holds at least one call")
    ids, kinds = set(), []
    for call in calls:
        ids.add(call.call_id)
        kinds.append(call.phase.kind)
    if len(ids) != len(calls):
        raise ValueError("call ids in a batch must be unique")
    if kinds.count("awaiting") > 1:
        raise ValueError("at most one call of a batch awaits at a time")
    bid = batch.batch_id
    if bid != batch_id(batch.run_id, batch.step):
        raise ValueError("batch id does not match its run and step")
    for call in calls:
        _check_call(bid, call)
    if batch.status == "finalized" and not TERMINAL_KINDS.issuperset(kinds):
        raise ValueError("a finalized batch has only terminal calls")


def _check_call(batch: BatchId, call: ToolCall) -> None:
    call_id, attempts, phase = call.call_id, call.attempts, call.phase
    if call.operation_id != call_operation_id(batch, call_id):
        raise ValueError(f"call {call_id}: operation id does not match the batch")
    if attempts > call.policy.max_attempts:
        raise ValueError(f"call {call_id}: attempts exceed the pinned budget")
    kind = phase.kind
    if kind == "executing" and isinstance(phase, Executing) and phase.attempt != attempts:
        raise ValueError(f"call {call_id}: executing attempt disagrees with attempts")
    if kind == "requested" and attempts != 0:
        raise ValueError(f"call {call_id}: requested calls have no recorded attempt")


def decode_batch(text: str | bytes) -> ActiveToolBatch:
    """Decode and re-validate a persisted batch; fail closed on anything wrong."""
    try:
        return ActiveToolBatch.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptBatch(f"persisted batch failed validation: {exc}") from exc


# ---- the transition kernel ------------------------------------------------------------


class CallSpec(Frozen):
    """What the kernel needs to open a call."""

    call_id: CallId
    tool: str
    arguments: str
    policy: ToolRecoveryPolicy = ToolRecoveryPolicy()


def open_batch(run: RunId, step: int, specs: Sequence[CallSpec]) -> ActiveToolBatch:
    bid = batch_id(run, step)
    calls = tuple(
        ToolCall(
            call_id=s.call_id,
            tool=s.tool,
            arguments=s.arguments,
            operation_id=call_operation_id(bid, s.call_id),
            policy=s.policy,
        )
        for s in specs
    )
    try:
        return ActiveToolBatch(batch_id=bid, run_id=run, step=step, calls=calls)
    except ValidationError as exc:
        raise InvalidTransition(_first_error(exc)) from exc


def _replace(batch: ActiveToolBatch, call: ToolCall) -> ActiveToolBatch:
    if batch.status == "finalized":
        raise InvalidTransition(f"batch {batch.batch_id} is finalized")
    calls = tuple(call if c.call_id == call.call_id else c for c in batch.calls)
    # ``batch`` holds every invariant and only ``call`` changed (same id, open batch):
    # check what that can break, not the whole batch again. The kernel's hypothesis
    # machine checks every invariant after each transition.
    try:
        _check_call(batch.batch_id, call)
    except ValueError as exc:
        raise InvalidTransition(str(exc)) from exc
    if call.phase.kind == "awaiting" and sum(c.phase.kind == "awaiting" for c in calls) > 1:
        raise InvalidTransition("at most one call of a batch awaits at a time")
    return evolve(batch, calls=calls)


def _first_error(exc: ValidationError) -> str:
    return str(exc.errors()[0].get("msg", exc))


def mark_executing(
    batch: ActiveToolBatch, call_id: CallId, *, undispatched: bool = False
) -> ActiveToolBatch:
    """requested/awaiting → executing; executing(n) → executing(n+1) within the pinned budget.

    A never_replay call may only run again when its last attempt is known to have
    dispatched nothing (``undispatched``: the tool raised UnavailableBeforeDispatch).
    """
    call = batch.call(call_id)
    if call.terminal:
        raise InvalidTransition(f"call {call_id} is terminal")
    replaying = isinstance(call.phase, Executing) and not undispatched
    if replaying and call.policy.mode == "never_replay":
        raise InvalidTransition(f"call {call_id} is never_replay and may not run again")
    attempt = call.attempts + 1
    if attempt > call.policy.max_attempts:
        raise InvalidTransition(f"call {call_id} has used all {call.policy.max_attempts} attempts")
    retried = bool(undispatched) and isinstance(call.phase, Executing)
    # attempt: the batch's validated count (an int >= 0) plus one; retried: a bool
    phase = trusted(Executing, attempt=attempt, after_undispatched=retried)
    return _replace(batch, evolve(call, phase=phase, attempts=attempt))


def mark_awaiting(
    batch: ActiveToolBatch, call_id: CallId, wait: WaitKind, correlation: CorrelationId
) -> ActiveToolBatch:
    call = batch.call(call_id)
    if call.terminal or isinstance(call.phase, Awaiting):
        raise InvalidTransition(f"call {call_id} cannot start a wait from {call.phase.kind}")
    return _replace(batch, evolve(call, phase=Awaiting(wait=wait, correlation=correlation)))


def complete(batch: ActiveToolBatch, call_id: CallId, output: ToolOutput) -> ActiveToolBatch:
    """Install a terminal result; the same result again is a no-op, a different one an error."""
    call = batch.call(call_id)
    if isinstance(call.phase, Completed):
        if call.phase.output == output:
            return batch
        raise InvalidTransition(f"call {call_id} already completed with a different output")
    if isinstance(call.phase, Indeterminate):
        raise InvalidTransition(f"call {call_id} is indeterminate and cannot complete")
    return _replace(batch, evolve(call, phase=Completed(output=output)))


def mark_indeterminate(batch: ActiveToolBatch, call_id: CallId, reason: str) -> ActiveToolBatch:
    call = batch.call(call_id)
    if isinstance(call.phase, Indeterminate) and call.phase.reason == reason:
        return batch
    if call.terminal:
        raise InvalidTransition(f"call {call_id} is already {call.phase.kind}")
    return _replace(batch, evolve(call, phase=Indeterminate(reason=reason)))


def finalize(batch: ActiveToolBatch) -> ActiveToolBatch:
    """Close the publication barrier; only when every call is terminal. Idempotent."""
    if batch.status == "finalized":
        return batch
    if not batch.all_terminal:
        pending = [c.call_id for c in batch.calls if not c.terminal]
        raise InvalidTransition(f"cannot finalize {batch.batch_id}: calls {pending} not terminal")
    return evolve(batch, status="finalized")


def seal(batch: ActiveToolBatch, reason: str = SEALED_REASON) -> ActiveToolBatch:
    """On Run end: every unfinished call becomes indeterminate, then finalize. Idempotent."""
    for call in batch.calls:
        if not call.terminal:
            batch = mark_indeterminate(batch, call.call_id, reason)
    return finalize(batch)


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
