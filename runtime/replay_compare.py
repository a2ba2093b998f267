"""Comparing a replayed commit with the recorded one (``runtime.replay_check``).

Two commits agree when they record the same decisions: the Run, the commit point
(label), the disposition (an end's cause; a ticket's correlation and target), the
batch (each call's id, tool, arguments, pinned policy, phase and attempts), the
messages, the state commands and the run status (state and reason). What legitimately
differs between two executions is not compared: hashes and the chain, owner epochs and
claimants, timestamps (``status.since``, a ticket's deadline, a pause's ``resume_at``),
the trace context (``run:trace``) and the facts, which are derived from the rest.

``compare`` names the first difference, checked in that order, as a ``Divergence``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from runtime.base import Frozen
from runtime.batch import ActiveToolBatch, ToolCall
from runtime.commit import ThreadCommit
from runtime.lifecycle import AwaitingState, EndedState, ResumeTicket, RunDisposition
from runtime.limits import printable
from runtime.messages import Message
from runtime.state import Command
from runtime.tracing import TRACE_KEY

DivergenceKind = Literal[
    "run_differs",
    "end_differs",
    "wait_differs",
    "label_differs",
    "tool_missing",
    "policy_changed",
    "call_differs",
    "messages_differ",
    "plugins_changed",
    "state_differs",
    "status_differs",
    "extra_commit",
    "missing_commit",
    "unrecorded_inference",
    "unrecorded_call",
    "way_in_refused",
]
"""What differs first:

- ``run_differs``: the commit belongs to another Run or ordinal;
- ``end_differs``: one of the two ends the Run, or they end it with other causes (a
  run-end guard that now refuses, a lower ``max_steps``, a hook that stops);
- ``wait_differs``: one of the two awaits, or they await other tickets;
- ``label_differs``: another commit point (``executing`` where ``results`` was);
- ``tool_missing``: a recorded call names a tool the current agent does not have;
- ``policy_changed``: a call's pinned recovery policy differs (mode or attempts);
- ``call_differs``: a call differs otherwise (arguments, phase — a gate that now
  denies —, attempts, output), or the batch has other calls;
- ``messages_differ``: the commit carries other messages;
- ``plugins_changed``: the pinned plugins (``run:plugins``) differ;
- ``state_differs``: other state commands (a hook that now writes other state);
- ``status_differs``: another run status (state or reason);
- ``extra_commit``: the code commits where the recording has no commit;
- ``missing_commit``: the code comes to rest where the recording goes on;
- ``unrecorded_inference``, ``unrecorded_call``: the code asks for an inference or an
  executor attempt that the recording never made;
- ``way_in_refused``: a recorded way in (a resume, say) is refused by the replay.
"""
CLIP = 240
"""Longest ``expected`` or ``got`` text of a divergence."""


class Divergence(Frozen):
    """The first place where the current code decides otherwise than the recording."""

    seq: int
    """The thread version of the commit in question (the recorded one, or the one the
    replay was about to make)."""
    what: DivergenceKind
    expected: str
    """What the recording has there, short and printable."""
    got: str
    """What the current code did there instead."""
    run_id: str = ""
    label: str = ""
    """The recorded commit's label ("" if the recording has no commit there)."""

    def line(self) -> str:
        where = f"seq {self.seq}" + (f" ({self.label})" if self.label else "")
        return f"{where}: {self.what}: expected {self.expected}; got {self.got}"


Found = tuple[DivergenceKind, str, str] | None
ToolKnown = Callable[[str], bool]


def compare(seq: int, want: ThreadCommit, got: ThreadCommit, known: ToolKnown) -> Divergence | None:
    """The first difference between the recorded commit ``want`` and the replayed ``got``;
    ``known(tool)`` tells whether the current agent has a tool."""
    found = (
        _run(want, got)
        or _disposition(want.disposition, got.disposition)
        or _label(want, got)
        or _batch(want.batch, got.batch, known)
        or _messages(want.messages, got.messages)
        or _commands(want.commands, got.commands)
        or _status(want, got)
    )
    if found is None:
        return None
    what, expected, instead = found
    return divergence(seq, what, expected, instead, want)


def divergence(
    seq: int, what: DivergenceKind, expected: str, got: str, want: ThreadCommit | None = None
) -> Divergence:
    return Divergence(
        seq=seq,
        what=what,
        expected=clip(expected),
        got=clip(got),
        run_id=want.run_id if want is not None else "",
        label=want.label if want is not None else "",
    )


def clip(text: str) -> str:
    return printable(" ".join(text.split()), CLIP)


def _run(want: ThreadCommit, got: ThreadCommit) -> Found:
    if (want.run_id, want.ordinal) == (got.run_id, got.ordinal):
        return None
    return "run_differs", f"run {want.run_id} #{want.ordinal}", f"run {got.run_id} #{got.ordinal}"


def _disposition(want: RunDisposition, got: RunDisposition) -> Found:
    same_kind = want.kind == got.kind
    if isinstance(want, EndedState) or isinstance(got, EndedState):
        if same_kind and _dump(want) == _dump(got):
            return None
        return "end_differs", disposition_text(want), disposition_text(got)
    if isinstance(want, AwaitingState) or isinstance(got, AwaitingState):
        if same_kind and _ticket(want) == _ticket(got):
            return None
        return "wait_differs", disposition_text(want), disposition_text(got)
    return None


def _ticket(disposition: RunDisposition) -> Any:
    ticket: ResumeTicket | None = getattr(disposition, "ticket", None)
    if ticket is None:
        return None
    target = ticket.target.model_dump(mode="json", exclude={"resume_at_us"})
    return (ticket.correlation, ticket.run_id, ticket.thread_id, target)


def _label(want: ThreadCommit, got: ThreadCommit) -> Found:
    if want.label == got.label:
        return None
    return "label_differs", commit_text(want), commit_text(got)


def _batch(want: ActiveToolBatch | None, got: ActiveToolBatch | None, known: ToolKnown) -> Found:
    if want is None or got is None:
        if want is got:
            return None
        return "call_differs", batch_text(want), batch_text(got)
    shape = (want.batch_id, want.status, [c.call_id for c in want.calls])
    if shape != (got.batch_id, got.status, [c.call_id for c in got.calls]):
        return "call_differs", batch_text(want), batch_text(got)
    for w, g in zip(want.calls, got.calls, strict=True):
        if w == g:
            continue
        if not known(w.tool):
            return "tool_missing", call_text(w), f"no tool {w.tool!r} in the agent: {call_text(g)}"
        if w.policy != g.policy:
            return "policy_changed", call_text(w), call_text(g)
        return "call_differs", call_text(w), call_text(g)
    return None


def _messages(want: Sequence[Message], got: Sequence[Message]) -> Found:
    if _dumps(want) == _dumps(got):
        return None
    return "messages_differ", messages_text(want), messages_text(got)


def decisions(commands: Sequence[Command]) -> list[Command]:
    """The commands that record decisions: not ``run:trace``, which records the drive's
    trace context (``runtime.tracing``), new in every execution."""
    return [c for c in commands if not (c.scope == "run" and c.key == TRACE_KEY)]


def _commands(want: Sequence[Command], got: Sequence[Command]) -> Found:
    want, got = decisions(want), decisions(got)
    w, g = _dumps(want), _dumps(got)
    if w == g:
        return None
    differing = [c for c in [*want, *got] if (_dump(c) in w) != (_dump(c) in g)]
    plugins = any(c.scope == "run" and c.key == "plugins" for c in differing)
    return (
        "plugins_changed" if plugins else "state_differs",
        commands_text([c for c in want if _dump(c) not in g] or want),
        commands_text([c for c in got if _dump(c) not in w] or got),
    )


def _status(want: ThreadCommit, got: ThreadCommit) -> Found:
    def shown(commit: ThreadCommit) -> str:
        s = commit.status
        return "unchanged" if s is None else f"{s.state}" + (f" ({s.reason})" if s.reason else "")

    if shown(want) == shown(got):
        return None
    return "status_differs", shown(want), shown(got)


def _dump(record: Frozen) -> Any:
    return record.model_dump(mode="json")


def _dumps(records: Sequence[Frozen]) -> list[Any]:
    return [_dump(r) for r in records]


# ---- short printable summaries -------------------------------------------------------


def commit_text(commit: ThreadCommit) -> str:
    return f"{commit.label} commit, {disposition_text(commit.disposition)}"


def disposition_text(disposition: RunDisposition) -> str:
    if isinstance(disposition, EndedState):
        cause = disposition.cause
        detail = getattr(cause, "reason", None)
        if cause.kind == "failed":
            detail = f"{cause.failure}/{cause.code}: {cause.message}"
        return f"ended({cause.kind}" + (f": {detail}" if detail else "") + ")"
    if isinstance(disposition, AwaitingState):
        target = disposition.ticket.target
        extra = getattr(target, "call_id", None) or getattr(target, "reason", None) or ""
        return f"awaiting({disposition.ticket.payload_kind}" + (f" {extra}" if extra else "") + ")"
    return "running"


def batch_text(batch: ActiveToolBatch | None) -> str:
    if batch is None:
        return "no batch"
    return f"{batch.batch_id} {batch.status}: " + ", ".join(call_text(c) for c in batch.calls)


def call_text(call: ToolCall) -> str:
    policy = f"{call.policy.mode}, {call.policy.max_attempts} attempts"
    return f"call {call.call_id} {call.tool}({call.arguments}) {phase_text(call)} [{policy}]"


def phase_text(call: ToolCall) -> str:
    phase = call.phase
    if phase.kind == "executing":
        return f"executing({call.attempts})"
    if phase.kind == "awaiting":
        return f"awaiting({phase.wait})"
    if phase.kind == "completed":
        out = phase.output
        return f"completed({'error ' if out.is_error else ''}{out.content!r})"
    if phase.kind == "indeterminate":
        return f"indeterminate({phase.reason})"
    return phase.kind


def messages_text(messages: Sequence[Message]) -> str:
    if not messages:
        return "no messages"
    return " | ".join(_message_text(m) for m in messages)


def _message_text(message: Message) -> str:
    text = getattr(message, "text", None)
    if text is None:
        text = getattr(message, "content", "")
    calls = getattr(message, "tool_calls", ())
    called = " calls " + ", ".join(f"{c.tool}({c.arguments})" for c in calls) if calls else ""
    return f"{message.kind} {text!r}{called}"


def commands_text(commands: Sequence[Command]) -> str:
    if not commands:
        return "no state commands"
    return ", ".join(_command_text(c) for c in commands)


def _command_text(cmd: Command) -> str:
    if cmd.op == "remove":
        return f"{cmd.scope}:{cmd.key} removed"
    value = json.dumps(cmd.value, sort_keys=True, default=str)
    return f"{cmd.scope}:{cmd.key}={value} ({cmd.merge})"
