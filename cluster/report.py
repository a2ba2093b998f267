"""Reading a thread's committed log back: what happened, and what recovery did.

Used by ``ratchet show``, by the demo's summary and by the Ray tests; it looks
only at committed records, never at a process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.batch import ToolCall
from runtime.events import Fact
from runtime.lifecycle import (
    EndedState,
    PauseTarget,
    ResumeTicket,
    ThreadStatus,
    ToolWaitTarget,
    UserInputTarget,
)
from runtime.ports import CommittedRecord

EXECUTION_LOST = "execution_lost"


@dataclass
class RunReport:
    thread_id: str
    run_id: str = ""
    cause: str | None = None
    commits: int = 0
    steps: int = 0
    statuses: list[tuple[str, str | None]] = field(default_factory=list)
    """Every committed status change, in order: (state, reason)."""
    calls: dict[str, ToolCall] = field(default_factory=dict)
    """Each call's last committed form, by operation id."""

    @property
    def lost(self) -> int:
        """How often the Run's execution was lost (and then recovered, if it went on)."""
        return sum(1 for _, reason in self.statuses if reason == EXECUTION_LOST)

    @property
    def indeterminate(self) -> list[ToolCall]:
        return [c for c in self.calls.values() if c.phase.kind == "indeterminate"]

    @property
    def replayed(self) -> list[ToolCall]:
        """Calls that were invoked again with the same operation id."""
        return [c for c in self.calls.values() if c.attempts > 1]

    @property
    def finished(self) -> bool:
        return self.cause is not None


def analyse(thread_id: str, records: Sequence[CommittedRecord]) -> RunReport:
    """Fold the latest Run's commits of a thread into a report."""
    report = RunReport(thread_id=thread_id)
    for record in records:
        commit = record.commit
        if commit.run_id != report.run_id:
            report = RunReport(thread_id=thread_id, run_id=commit.run_id, statuses=report.statuses)
        report.commits += 1
        report.steps += sum(m.kind == "assistant" for m in commit.messages)
        if commit.status is not None:
            report.statuses.append((commit.status.state, commit.status.reason))
        if commit.batch is not None:
            for call in commit.batch.calls:
                report.calls[call.operation_id] = call
        if isinstance(commit.disposition, EndedState):
            report.cause = commit.disposition.cause.kind
    return report


def phase_text(call: ToolCall) -> str:
    phase = call.phase
    if phase.kind == "executing":
        return f"executing(attempt {phase.attempt})"
    if phase.kind == "awaiting":
        return f"awaiting({phase.wait})"
    if phase.kind == "completed":
        return "completed (error)" if phase.output.is_error else "completed"
    if phase.kind == "indeterminate":
        return f"indeterminate ({phase.reason})"
    return phase.kind


# ---- one line per fact, ticket and status (``ratchet watch``, ``ratchet show``) ---------


def status_text(status: ThreadStatus) -> str:
    return status.state + (f" ({status.reason})" if status.reason else "")


def ticket_text(ticket: ResumeTicket) -> str:
    """What the Run waits for, e.g. ``permission for drop_table({"name": "users"}) [c1]``."""
    target = ticket.target
    if isinstance(target, ToolWaitTarget):
        return f"{target.wait} for {target.tool}({target.arguments}) [{target.call_id}]"
    if isinstance(target, UserInputTarget):
        return f"user_input: {target.prompt!r}" if target.prompt else "user_input"
    if isinstance(target, PauseTarget):
        return f"pause ({target.reason})"
    return ticket.payload_kind


def cause_text(cause: Mapping[str, Any]) -> str:
    kind = str(cause.get("kind", "?"))
    if kind == "stopped":
        return f"stopped: {cause.get('reason', '')}"
    if kind == "failed":
        return f"failed ({cause.get('failure')}/{cause.get('code')}): {cause.get('message', '')}"
    if kind == "indeterminate":
        return f"indeterminate: {cause.get('reason', '')}"
    return kind


def fact_text(fact: Fact) -> str:
    """One line for a committed fact."""
    data = fact.data
    kind = fact.type
    if kind == "run_started":
        return f"run_started {fact.run_id}: {data.get('input', '')!r}"
    if kind == "assistant_message":
        return f"assistant: {data.get('text', '')}"
    if kind == "tool_call":
        return f"tool_call [{data.get('call_id')}] {data.get('tool')}({data.get('arguments')})"
    if kind == "tool_result":
        error = "error: " if data.get("is_error") else ""
        return (
            f"tool_result [{data.get('call_id')}] {data.get('tool')}: {error}{data.get('content')}"
        )
    if kind == "awaiting":
        return f"awaiting {ticket_text(ResumeTicket.model_validate(data['ticket']))}"
    if kind in ("run_finished", "run_failed"):
        return f"{kind}: {cause_text(data.get('cause', {}))}"
    if kind in ("resumed", "resume_ended"):
        extra = {k: v for k, v in data.items() if k not in ("kind", "correlation")}
        detail = f" {json.dumps(extra, sort_keys=True)}" if extra else ""
        took = "resumed" if kind == "resumed" else "resume could not land, the run ended"
        return f"{took} ({data.get('kind')}){detail}"
    if kind == "status":
        return f"status {status_text(ThreadStatus.model_validate(data['status']))}"
    return f"{kind} {json.dumps(data, sort_keys=True)}"
