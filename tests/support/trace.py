"""The trace checker: which commit may follow which committed frontier (DESIGN §2-4).

``legal_next(before, commit)`` is a pure relation written from the design, not from
the engine, so the engine cannot agree with itself by construction: it returns the
reasons ``commit`` may not follow ``before`` (empty: legal). ``check`` is what the
suite installs in every process (``RATCHET_TRACE_CHECK``, see ``runtime.rules``):
``admit`` calls it with the frontier as the store sees it, once its own rules and the
fold accepted the commit.

The rules, each named in the reason it reports:
- the hash chain, the thread, the ordinals, one Run at a time, ``ended`` absorbing;
- the Run's disposition machine and what each commit label may carry;
- the batch of a Step: its id, its fixed call set, the call phase machine, at most one
  wait, finalize only when all terminal, sealing at the end;
- publication: results reach the messages once, whole, in call order, before the
  next inference (or input) and whenever their batch is finalized or dropped;
- waits: a call awaits exactly when the Run's ticket targets it, and a resume
  releases it as its wait kind allows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtime.batch import ActiveToolBatch, Awaiting, Executing, ToolCall
from runtime.commit import Frontier, ThreadCommit, closes_session
from runtime.ids import batch_id, call_operation_id
from runtime.lifecycle import AwaitingState, EndedState, MaxSteps, Natural, ToolWaitTarget
from runtime.messages import AssistantMessage, Message, ToolResultMessage, UserMessage

LOG_ENV = "RATCHET_TRACE_LOG"

_LEAVES = {"activation": ("running", "ended"), "awaiting": ("awaiting",), "ended": ("ended",)}
"""The dispositions a commit of each label may leave: running for the labels not named,
the one it found for a status commit."""

_MESSAGE_SHAPES = {
    "activation": "u+",
    "inference": "t*u*at*",
    "resume": "t*u*",
    "ended": "t*u*a?t*",
    "turn": "u",
}
"""Messages a label may carry, one letter per kind (user, assistant, tool result):
results of the finished batch come first, then messages injected during it
(``runtime.injection``), then the one new input or answer, then the results of a batch
opened and finalized by the same commit. Other labels carry none."""
_KIND_LETTER = {"user": "u", "assistant": "a", "tool_result": "t"}

_OPENING_PHASES = {"requested", "executing", "completed"}
"""Phases a call may have in the commit that opens its batch: requested, the first wave
marked executing, or completed by a gate; an end may also seal calls indeterminate."""

_RESUMED_PHASES = {"permission": ("executing", "completed"), "scheduled_action": ("executing",)}
"""What a resume makes of the call it releases, by wait kind: approved or denied, the
result supplied or the child's outcome delivered (completed), the schedule fired. A wait
past its deadline that expired is completed whatever its kind."""


@dataclass(frozen=True)
class _Move:
    """One commit against its frontier, with the batches it touches."""

    before: Frontier
    commit: ThreadCommit
    new_run: bool
    prior: ActiveToolBatch | None
    """The open batch the commit starts from (the frontier's, for the same Run)."""
    current: ActiveToolBatch | None
    """``prior`` as this commit leaves it."""
    opened: ActiveToolBatch | None
    """A new Step's batch that this commit opens."""

    @property
    def assistant(self) -> AssistantMessage | None:
        return next((m for m in self.commit.messages if isinstance(m, AssistantMessage)), None)


def legal_next(before: Frontier, commit: ThreadCommit) -> list[str]:
    """The reasons ``commit`` may not follow ``before``; empty when it may."""
    move = _move(before, commit)
    rules = (
        _chain,
        _run_sequence,
        _disposition,
        _messages,
        _status,
        _opening,
        _calls,
        _label_carries,
        _sealing,
        _publication,
        _waits,
    )
    return [reason for rule in rules for reason in rule(move)]


def _move(before: Frontier, commit: ThreadCommit) -> _Move:
    new_run = before.run_id is None or commit.run_id != before.run_id
    prior = None if new_run else before.batch
    carried = commit.batch
    same = carried is not None and prior is not None and carried.batch_id == prior.batch_id
    current = carried if same else prior
    opened = carried if carried is not None and not same else None
    return _Move(before, commit, new_run, prior, current, opened)


# ---- the log: chain, thread, runs, ordinals ---------------------------------------------


def _chain(m: _Move) -> Iterator[str]:
    if m.commit.thread_id != m.before.thread_id:
        yield f"chain: commit of thread {m.commit.thread_id} on thread {m.before.thread_id}"
    if m.commit.schema_version >= 2 and m.commit.prev != m.before.head:
        yield f"chain: prev {m.commit.prev[:12]!r} does not extend head {m.before.head[:12]!r}"


def _run_sequence(m: _Move) -> Iterator[str]:
    before, commit = m.before, m.commit
    if m.new_run:
        if before.run_state is not None and not before.ended:
            yield f"runs: run {commit.run_id} starts while {before.run_id} is still active"
        if commit.label != "activation":
            yield f"runs: a new run starts with an activation, not {commit.label!r}"
        if commit.ordinal != 0:
            yield f"ordinal: a new run starts at ordinal 0, not {commit.ordinal}"
        return
    if before.ended:
        yield f"ended: run {commit.run_id} has ended; nothing may follow for it"
    if commit.label == "activation":
        yield f"runs: activation of run {commit.run_id}, which already has commits"
    if commit.ordinal != before.next_ordinal:
        yield f"ordinal: {commit.ordinal} follows {before.next_ordinal - 1} in the run"


# ---- the Run's disposition and what a label carries --------------------------------------


def _disposition(m: _Move) -> Iterator[str]:
    commit, was = m.commit, None if m.new_run else m.before.run_state
    now, label = commit.disposition, commit.label
    if label == "status":
        if now != was:
            yield "status: a status commit leaves the disposition as it found it"
        return
    if now.kind not in _LEAVES.get(label, ("running",)):
        yield f"label: a {label} commit cannot leave the run {now.kind}"
    if label == "resume" and (was is None or was.kind != "awaiting"):
        yield "disposition: only an awaiting run is resumed"
    if was is not None and was.kind == "awaiting" and label not in ("resume", "ended"):
        yield f"disposition: an awaiting run leaves its wait only by resume or end, not {label}"
    if isinstance(now, AwaitingState):
        ticket = now.ticket
        if ticket.run_id != commit.run_id or ticket.thread_id != commit.thread_id:
            yield "disposition: the ticket names another run or thread"


def _messages(m: _Move) -> Iterator[str]:
    commit = m.commit
    shape = "".join(_KIND_LETTER[msg.kind] for msg in commit.messages)
    if not re.fullmatch(_MESSAGE_SHAPES.get(commit.label, ""), shape):
        yield f"messages: a {commit.label} commit cannot carry messages shaped {shape!r}"
    yield from _input_once(m)
    assistant, disposition = m.assistant, commit.disposition
    natural = isinstance(disposition, EndedState) and isinstance(disposition.cause, Natural)
    if natural and (assistant is None or assistant.tool_calls) and not closes_session(commit):
        yield "end: a natural end carries an assistant answer without tool calls"
    at_max_steps = isinstance(disposition, EndedState) and isinstance(disposition.cause, MaxSteps)
    if assistant is not None and assistant.tool_calls and m.opened is None and not at_max_steps:
        yield "batch: the model's tool calls are committed without opening their batch"


def _input_once(m: _Move) -> Iterator[str]:
    seen = {msg.id for msg in m.before.messages if isinstance(msg, UserMessage)}
    for msg in m.commit.messages:
        if isinstance(msg, UserMessage):
            if msg.id in seen:
                yield f"input: message {msg.id!r} is delivered twice"
            seen.add(msg.id)


def _status(m: _Move) -> Iterator[str]:
    commit, was = m.commit, m.before.status
    if commit.label == "status":
        if commit.status is None:
            yield "status: a status commit carries the new status"
        if commit.messages or commit.commands or commit.batch is not None:
            yield "status: a status commit changes only the run status"
    now = commit.status
    unchanged = now is not None and (now.state, now.reason) == (was.state, was.reason)
    if unchanged and now is not None and now.since != was.since:
        yield "status: since changed while state and reason did not"
    if isinstance(commit.disposition, EndedState) and (now or was).state == "running":
        yield "status: the end of a run settles its running status (idle or failed)"


# ---- the Step's batch -----------------------------------------------------------------------


def _opening(m: _Move) -> Iterator[str]:
    batch, commit = m.opened, m.commit
    if batch is None:
        return
    yield from _identity(m, batch)
    if commit.label not in ("inference", "ended"):
        yield f"batch: a {commit.label} commit cannot open a new step's batch"
    expected_step = 0 if m.new_run else m.before.steps
    if batch.step != expected_step:
        yield f"batch: step {batch.step} opened after {expected_step} inferences"
    if m.prior is not None and not m.prior.all_terminal:
        yield f"batch: {batch.batch_id} replaces {m.prior.batch_id}, which has calls unfinished"
    if _uses(m.assistant) != _asks(batch):
        yield f"batch: {batch.batch_id} holds other calls than the model's answer asked for"
    for call in batch.calls:
        yield from _opening_call(call, ended=commit.label == "ended")


def _opening_call(call: ToolCall, *, ended: bool) -> Iterator[str]:
    phase, allowed = call.phase, _OPENING_PHASES | ({"indeterminate"} if ended else set())
    if phase.kind not in allowed:
        yield f"call {call.call_id}: opened {phase.kind}"
    first_attempt = isinstance(phase, Executing) and phase.attempt == 1
    if call.attempts != (1 if first_attempt else 0):
        yield f"call {call.call_id}: opened with {call.attempts} attempts"
    if isinstance(phase, Executing) and phase.after_undispatched:
        yield f"call {call.call_id}: a first attempt follows no undispatched one"


def _identity(m: _Move, batch: ActiveToolBatch) -> Iterator[str]:
    if (batch.run_id, batch.batch_id) != (m.commit.run_id, batch_id(m.commit.run_id, batch.step)):
        yield f"batch: id {batch.batch_id} is not tool-batch:{{run}}:{{step}}"
    for call in batch.calls:
        if call.operation_id != call_operation_id(batch.batch_id, call.call_id):
            yield f"call {call.call_id}: operation id {call.operation_id} is not {{batch}}:{{call}}"
    if not batch.calls or len({c.call_id for c in batch.calls}) != len(batch.calls):
        yield f"batch: {batch.batch_id} is empty or repeats a call id"
    kinds = [c.phase.kind for c in batch.calls]
    if kinds.count("awaiting") > 1:
        yield f"batch: {kinds.count('awaiting')} calls of {batch.batch_id} await at once"
    if batch.status == "finalized" and not batch.all_terminal:
        yield f"batch: {batch.batch_id} is finalized with calls unfinished"


def _pairs(m: _Move) -> list[tuple[ToolCall, ToolCall]]:
    """(before, after) of each call of a batch the commit carries on, in call order."""
    if m.prior is None or m.current is None or m.current is m.prior:
        return []
    return list(zip(m.prior.calls, m.current.calls, strict=False))


def _calls(m: _Move) -> Iterator[str]:
    prior, current = m.prior, m.current
    if prior is None or current is None or current is prior:
        return
    yield from _identity(m, current)
    if [_pinned(c) for c in prior.calls] != [_pinned(c) for c in current.calls]:
        yield f"batch: the calls of {prior.batch_id} changed within the step"
        return
    for old, new in _pairs(m):
        yield from _phase_move(old, new, m.commit.label)


def _pinned(call: ToolCall) -> tuple[Any, ...]:
    return (call.call_id, call.tool, call.arguments, call.policy, call.operation_id)


def _phase_move(old: ToolCall, new: ToolCall, label: str) -> Iterator[str]:
    """One call's step through the phase machine of DESIGN §2."""
    name, was, now = f"call {old.call_id}", old.phase, new.phase
    if new.attempts < old.attempts:
        yield f"{name}: attempts went down from {old.attempts} to {new.attempts}"
    if new.attempts > new.policy.max_attempts:
        yield f"{name}: {new.attempts} attempts exceed the pinned {new.policy.max_attempts}"
    if was == now:
        if new.attempts != old.attempts:
            yield f"{name}: attempts changed without a new attempt"
        return
    if old.terminal:
        yield f"{name}: {was.kind} is terminal, yet it became {now.kind}"
    elif now.kind == "requested":
        yield f"{name}: {was.kind} was turned back into requested"
    elif isinstance(now, Executing):
        yield from _new_attempt(old, now, label)
    elif isinstance(now, Awaiting) and isinstance(was, Awaiting):
        yield f"{name}: an awaiting call cannot start another wait"
    elif new.attempts != old.attempts:
        yield f"{name}: attempts changed on the way to {now.kind}"


def _new_attempt(old: ToolCall, now: Executing, label: str) -> Iterator[str]:
    name, was = f"call {old.call_id}", old.phase
    if now.attempt != old.attempts + 1:
        yield f"{name}: attempt {now.attempt} does not follow {old.attempts}"
    if isinstance(was, Awaiting) and label != "resume":
        yield f"{name}: only a resume turns a wait into an attempt, not a {label} commit"
    if isinstance(was, Executing):
        if old.policy.mode == "never_replay" and not now.after_undispatched:
            yield f"{name}: never_replay runs again only after an undispatched attempt"
    elif now.after_undispatched:
        yield f"{name}: after_undispatched, but no attempt came before"


def _label_carries(m: _Move) -> Iterator[str]:
    """What a batch change of each label is: an attempt, a result, a wait, a seal."""
    label, pairs = m.commit.label, _pairs(m)
    attempts = [n for o, n in pairs if n.attempts > o.attempts]
    finished = [n for o, n in pairs if n.terminal and not o.terminal]
    waiting = [n for o, n in pairs if n.phase.kind == "awaiting" and o.phase.kind != "awaiting"]
    changed = [n for o, n in pairs if n.phase != o.phase]
    if label == "executing" and not attempts:
        yield "label: an executing commit marks at least one new attempt"
    if label == "results" and not finished:
        yield "label: a results commit finishes at least one call"
    if label in ("results", "ended", "awaiting", "inference") and attempts:
        yield f"label: a {label} commit starts no attempt"
    if label != "awaiting" and waiting:
        yield f"label: a {label} commit cannot start a wait"
    if label == "inference" and changed:
        yield "label: an inference commit only finalizes the finished batch it carries on"


def _sealing(m: _Move) -> Iterator[str]:
    """An end leaves no call unfinished: the open batch is sealed and finalized."""
    prior, sealed = m.prior, m.current
    if not isinstance(m.commit.disposition, EndedState) or prior is None or prior.all_terminal:
        return
    if sealed is prior or sealed is None or sealed.status != "finalized":
        yield f"end: {prior.batch_id} has calls unfinished and is not sealed and finalized"


# ---- publication -------------------------------------------------------------------------


def _publication(m: _Move) -> Iterator[str]:
    leading, trailing = _result_groups(m.commit.messages)
    published = m.prior is not None and _published(m.before, m.prior)
    if leading:
        yield from _publishes(m.current, leading, published)
    if trailing:
        yield from _publishes(m.opened, trailing, False)
    sees = any(isinstance(msg, AssistantMessage | UserMessage) for msg in m.commit.messages)
    if sees and m.prior is not None:
        if not m.prior.all_terminal:
            yield f"publication: new input or answer while {m.prior.batch_id} is unfinished"
        elif not (published or leading):
            yield f"publication: new input or answer before {m.prior.batch_id}'s results"
    if m.prior is not None and _closes(m) and not (published or leading):
        yield f"publication: {m.prior.batch_id} is closed without publishing its results"
    if m.opened is not None and m.opened.status == "finalized" and not trailing:
        yield f"publication: {m.opened.batch_id} is finalized without publishing its results"


def _result_groups(
    messages: tuple[Message, ...],
) -> tuple[list[ToolResultMessage], list[ToolResultMessage]]:
    """The tool results before the commit's first answer, and those after it."""
    kinds = [msg.kind for msg in messages]
    cut = kinds.index("assistant") if "assistant" in kinds else len(messages)
    results = [msg for msg in messages if isinstance(msg, ToolResultMessage)]
    leading = [msg for msg in messages[:cut] if isinstance(msg, ToolResultMessage)]
    return leading, results[len(leading) :]


def _publishes(
    batch: ActiveToolBatch | None, results: list[ToolResultMessage], again: bool
) -> Iterator[str]:
    if batch is None:
        yield "publication: tool results published, but no batch holds them"
        return
    if again:
        yield f"publication: {batch.batch_id}'s results are published a second time"
    if not batch.all_terminal:
        yield f"publication: half of {batch.batch_id} is published, calls are unfinished"
        return
    expected = [_result_of(c) for c in batch.calls]
    got = [(r.call_id, r.tool, r.content, r.is_error) for r in results]
    if got != expected:
        ids, got_ids = [e[0] for e in expected], [g[0] for g in got]
        what = f"got {got_ids}" if got_ids != ids else "their tools or outputs differ"
        yield f"publication: not exactly {batch.batch_id}'s results in call order: {what}"


def _result_of(call: ToolCall) -> tuple[str, str, str, bool]:
    output = call.to_model_output()
    return (call.call_id, call.tool, output.content, output.is_error)


def _published(before: Frontier, batch: ActiveToolBatch) -> bool:
    """Whether results of ``batch`` follow the latest answer that asked for its calls
    (a model may ask for the same calls in several steps)."""
    run, ids = before.messages[before.run_start :], {c.call_id for c in batch.calls}
    for i in range(len(run) - 1, -1, -1):
        if _uses(run[i]) == _asks(batch):
            return any(isinstance(r, ToolResultMessage) and r.call_id in ids for r in run[i + 1 :])
    return False


def _uses(msg: Message | None) -> list[tuple[str, str, str]]:
    """The calls an answer asks for, as (id, tool, arguments)."""
    if not isinstance(msg, AssistantMessage):
        return []
    return [(u.call_id, u.tool, u.arguments) for u in msg.tool_calls]


def _asks(batch: ActiveToolBatch) -> list[tuple[str, str, str]]:
    return [(c.call_id, c.tool, c.arguments) for c in batch.calls]


def _closes(m: _Move) -> bool:
    """Whether the commit finalizes, replaces or drops the prior batch."""
    if isinstance(m.commit.disposition, EndedState) or m.opened is not None:
        return True
    return m.current is not None and m.current.status == "finalized"


# ---- waits -------------------------------------------------------------------------------


def _waits(m: _Move) -> Iterator[str]:
    disposition, batch = m.commit.disposition, m.opened or m.current  # the batch it leaves
    if isinstance(disposition, EndedState):
        return  # the end drops the batch; _sealing holds it to having no call left waiting
    target = _tool_target(disposition)
    waiting = None if batch is None else batch.awaiting_call()
    if waiting is not None and (target is None or target.call_id != waiting.call_id):
        yield f"wait: call {waiting.call_id} awaits, but the run's ticket does not target it"
    if target is not None and isinstance(disposition, AwaitingState):
        yield from _ticket_holds(disposition, target, batch)
    if m.commit.label == "resume" and not m.new_run:
        yield from _released(m)


def _tool_target(disposition: object) -> ToolWaitTarget | None:
    if isinstance(disposition, AwaitingState):
        target = disposition.ticket.target
        return target if isinstance(target, ToolWaitTarget) else None
    return None


def _ticket_holds(
    disposition: AwaitingState, target: ToolWaitTarget, batch: ActiveToolBatch | None
) -> Iterator[str]:
    call = _find(batch, target.call_id)
    if call is None:
        yield f"wait: the ticket waits on call {target.call_id}, which no open batch holds"
        return
    if call.phase != Awaiting(wait=target.wait, correlation=disposition.ticket.correlation):
        yield f"wait: call {call.call_id} does not await {target.wait} under the ticket"
    if (call.tool, call.arguments) != (target.tool, target.arguments):
        yield f"wait: the ticket names another tool or arguments than call {call.call_id}"


def _released(m: _Move) -> Iterator[str]:
    target = _tool_target(m.before.run_state)
    if target is None:
        return
    call = _find(m.current, target.call_id)
    expired = any(f.type == "resumed" and f.data.get("kind") == "expired" for f in m.commit.facts)
    allowed = ("completed",) if expired else _RESUMED_PHASES.get(target.wait, ("completed",))
    if call is None or call.phase.kind not in allowed:
        kind = "missing" if call is None else call.phase.kind
        yield f"resume: a {target.wait} resume leaves call {target.call_id} {kind}"


def _find(batch: ActiveToolBatch | None, call_id: str) -> ToolCall | None:
    return next((c for c in (batch.calls if batch else ()) if c.call_id == call_id), None)


# ---- the suite's hook --------------------------------------------------------------------


class TraceViolation(AssertionError):
    """A store admitted (was about to admit) a commit the design does not allow."""

    def __init__(self, commit: ThreadCommit, reasons: list[str]) -> None:
        self.reasons = tuple(reasons)
        self.thread_id, self.run_id, self.label = commit.thread_id, commit.run_id, commit.label
        super().__init__(
            f"illegal {commit.label} commit #{commit.ordinal} of run {commit.run_id} "
            f"on thread {commit.thread_id}: " + "; ".join(reasons)
        )


def check(before: Frontier, commit: ThreadCommit) -> None:
    """Raise TraceViolation for an illegal commit, logging each reason (RATCHET_TRACE_LOG).

    ``admit`` calls this only for commits its rules and the fold accepted: a commit a
    store refuses is no part of any trace.
    """
    reasons = legal_next(before, commit)
    if not reasons:
        return
    path = os.environ.get(LOG_ENV)
    if path:
        _log(path, before, commit, reasons)
    raise TraceViolation(commit, reasons)


def _log(path: str, before: Frontier, commit: ThreadCommit, reasons: list[str]) -> None:
    # one write(2) per line on an O_APPEND descriptor: lines of processes sharing the
    # file never interleave
    seen = before.model_dump(mode="json", include=_LOGGED_FRONTIER)
    seen["last_messages"] = [m.model_dump(mode="json") for m in before.messages[-4:]]
    where = {"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST")}
    ids = {"thread_id": commit.thread_id, "run_id": commit.run_id, "label": commit.label}
    body = {**ids, "ordinal": commit.ordinal, **where, "before": seen}
    body["commit"] = json.loads(commit.encoded)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for reason in reasons:
            os.write(fd, (json.dumps({"reason": reason, **body}) + "\n").encode())
    finally:
        os.close(fd)


_LOGGED_FRONTIER = {"version", "run_id", "run_state", "batch", "steps", "status"}
