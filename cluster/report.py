"""Reading a thread's committed log back: what happened, and what recovery did.

Used by ``ratchet show``, by the demo's summary and by the Ray tests; it looks
only at committed records, never at a process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.batch import ToolCall
from runtime.lifecycle import EndedState
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
