"""What a recorded thread says, for a replay check (``runtime.replay_check``): the ways
in that wrote its log, and what to feed back — the model's responses, each attempt's
outcome, the resumes. Pure functions of the committed log.

**Ways in.** Each engine that wrote the log wrote a run of consecutive commits. A commit
carrying a claim begins one: a start's activation, a resume, an end at rest
(``terminate``: a cancel, a stop, a dead letter) or a host's mark of a lost Run. So does
a commit under a newer owner epoch that carries no claim: a recovery claims the thread
before it commits. A way in whose last commit leaves its Run running was cut short: its
driver died, or was lost, there.

**Attempts.** An executor attempt of a call begins where the call is committed
``executing(n)``; what it came back with is read from the next commit of the same way
in that changes the call: a result (``Finished``), ``executor lost`` (``Lost``), the
next attempt (``Lost``, or ``Unavailable`` when nothing was dispatched), a child's wait.
An attempt whose call changes next in another way in never came back (its driver died).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter

from runtime.batch import SEALED_REASON, Awaiting, Completed, Executing, Indeterminate, ToolCall
from runtime.commit import ThreadCommit
from runtime.delegation import PARENT_KEY, ChildWaiting, ParentLink
from runtime.errors import RatchetError
from runtime.execution import InjectMessage
from runtime.ids import CallId, OperationId, RunId
from runtime.injection import INJECTED_KEY
from runtime.lifecycle import (
    AwaitingState,
    ResumeCommand,
    ResumePayload,
    ResumeTicket,
    RunningState,
    ToolWaitTarget,
    UserInputTarget,
)
from runtime.messages import AssistantMessage, ToolUse
from runtime.models import ModelResponse, Usage
from runtime.ports import CommittedRecord, Finished, Lost, Unavailable
from runtime.state import Command
from runtime.usage import TOKEN_FIELDS, step_usage

WayKind = Literal["start", "resume", "recover", "terminate", "mark"]
"""``start``: an activation; ``resume``: a ResumeCommand landed; ``recover``: a driver
took a running Run over; ``terminate``: a Run was ended at rest (or from elsewhere);
``mark``: a host marked a lost Run ``failed`` and claimed it (``actors.ownership``)."""
_CLAIMING: Mapping[str, WayKind] = {
    "activation": "start",
    "resume": "resume",
    "ended": "terminate",
    "status": "mark",
}
WITHHELD = ToolUse(call_id=CallId("replay:withheld"), tool="replay:withheld", arguments="{}")
"""Stands for the calls a model made on its last allowed Step: they were dropped, never
committed, and the Run ended ``max_steps`` because there were some."""
Outcome = Finished | Lost | Unavailable | ChildWaiting
Attempted = tuple[OperationId, int]
"""(operation id, attempt): one executor attempt of one call."""
_PAYLOAD: TypeAdapter[ResumePayload] = TypeAdapter(ResumePayload)
_EXHAUSTED = re.compile(r"tool unavailable after (\d+) attempts: (.*)", re.DOTALL)
_LOST = "executor lost: "


class ReplayInputError(RatchetError):
    """A recording that cannot be replayed: no commits, or a log no way in could write."""


@dataclass(frozen=True)
class Way:
    """The commits one engine wrote, from one way into the thread."""

    kind: WayKind
    records: tuple[CommittedRecord, ...]
    before: ThreadCommit | None = None
    """The commit before this way's first (None for the thread's first)."""

    @property
    def first(self) -> ThreadCommit:
        return self.records[0].commit

    @property
    def cut_short(self) -> bool:
        """Its driver stopped while the Run was running (a crash, a lost host)."""
        return isinstance(self.records[-1].commit.disposition, RunningState)


@dataclass(frozen=True)
class Attempt:
    """One executor attempt of a call, as the recording has it."""

    tool: str
    outcome: Outcome | None
    """What it came back with; None: it never came back in the recording."""
    ended_around: bool = False
    """The Run's end sealed the call while this attempt ran: ended from outside."""
    finished_at: int = 0
    """Seq of the commit that holds its outcome."""


@dataclass(frozen=True)
class Recording:
    """A recorded thread, read for a replay."""

    records: tuple[CommittedRecord, ...]
    ways: tuple[Way, ...]
    responses: Mapping[tuple[RunId, int], ModelResponse]
    """Per (run, step): the model's response as committed."""
    attempts: Mapping[Attempted, Attempt]
    finished_in: Mapping[int, tuple[Attempted, ...]]
    """Per seq of a results commit: the attempts whose outcome it holds, in the order
    the engine recorded them (each retry round in turn, each in call order)."""
    links: Mapping[RunId, ParentLink] = field(default_factory=dict)
    """The parent link of each Run that is a child Run (from its activation)."""

    @classmethod
    def of(cls, records: Sequence[CommittedRecord]) -> Recording:
        if not records:
            raise ReplayInputError("the recording has no commits")
        ways = ways_in(records)
        attempts, finished_in = recorded_attempts(ways)
        return cls(
            records=tuple(records),
            ways=ways,
            responses=recorded_responses(records),
            attempts=attempts,
            finished_in=finished_in,
            links=_links(records),
        )


def ways_in(records: Sequence[CommittedRecord]) -> tuple[Way, ...]:
    """Cut the log into the ways in that wrote it (ReplayInputError if it cannot be)."""
    if records[0].seq != 1:  # pruned (``storage.retention``): the history is not whole
        raise ReplayInputError(
            f"the thread keeps its records from seq {records[0].seq} only (pruned): "
            "a replay needs its whole log"
        )
    ways: list[tuple[WayKind, list[CommittedRecord], ThreadCommit | None]] = []
    epoch, before = -1, None
    for record in records:
        commit = record.commit
        if commit.claim is not None or commit.label in ("activation", "resume"):
            # (an imported copy keeps only its first claim: these two still begin a way)
            kind = _CLAIMING.get(commit.label)
            if kind is None:
                raise ReplayInputError(
                    f"seq {record.seq}: a {commit.label} commit carries a claim, "
                    "which no way into a thread makes"
                )
            ways.append((kind, [record], before))
        elif not ways:
            raise ReplayInputError(
                f"seq {record.seq}: the log does not begin with a Run's activation"
            )
        elif commit.epoch != epoch:
            ways.append(("recover", [record], before))
        else:
            ways[-1][1].append(record)
        epoch, before = commit.epoch, commit
    if ways[0][0] != "start":
        raise ReplayInputError("the log does not begin with a Run's activation")
    return tuple(Way(kind, tuple(recs), prior) for kind, recs, prior in ways)


# ---- the model's responses ----------------------------------------------------------


def recorded_responses(
    records: Iterable[CommittedRecord],
) -> dict[tuple[RunId, int], ModelResponse]:
    """Each Step's response, keyed by (run, step): its assistant message and the usage
    committed with it. A Step is the n-th assistant message of its Run."""
    out: dict[tuple[RunId, int], ModelResponse] = {}
    steps: dict[RunId, int] = {}
    for record in records:
        commit = record.commit
        for message in commit.messages:
            if not isinstance(message, AssistantMessage):
                continue
            step = steps.get(commit.run_id, 0)
            steps[commit.run_id] = step + 1
            calls = message.tool_calls
            if not calls and _ended_max_steps(commit):
                calls = (WITHHELD,)  # the model made calls; they were dropped
            out[(commit.run_id, step)] = ModelResponse(
                text=message.text, tool_calls=calls, usage=_usage(commit)
            )
    return out


def _ended_max_steps(commit: ThreadCommit) -> bool:
    cause = getattr(commit.disposition, "cause", None)
    return cause is not None and cause.kind == "max_steps"


def _usage(commit: ThreadCommit) -> Usage | None:
    found = step_usage(commit.commands)
    if found is None:
        return None
    counted, model = found
    return Usage(**{f: int(counted.get(f, 0)) for f in TOKEN_FIELDS}, model=model)


def _links(records: Iterable[CommittedRecord]) -> dict[RunId, ParentLink]:
    links = {}
    for record in records:
        commit = record.commit
        if commit.label != "activation":
            continue
        for cmd in commit.commands:
            if cmd.scope == "run" and cmd.key == PARENT_KEY and cmd.op == "set":
                links[commit.run_id] = ParentLink.model_validate(cmd.value)
    return links


# ---- each attempt's outcome ---------------------------------------------------------


@dataclass
class _Seen:
    """The last committed phase of one call, and where its open attempt began."""

    kind: str
    attempts: int
    way: int


def recorded_attempts(
    ways: Sequence[Way],
) -> tuple[dict[Attempted, Attempt], dict[int, tuple[Attempted, ...]]]:
    """Every executor attempt of the recording, and per results commit the attempts
    whose outcomes it holds (in the order the engine recorded them)."""
    attempts: dict[Attempted, Attempt] = {}
    began: dict[Attempted, int] = {}
    seen: dict[OperationId, _Seen] = {}
    for w, way in enumerate(ways):
        for record in way.records:
            batch = record.commit.batch
            if batch is None:
                continue
            for call in batch.calls:
                _track(call, w, record, seen, attempts, began)
    finished: dict[int, list[Attempted]] = {}
    for key, attempt in attempts.items():
        if isinstance(attempt.outcome, Finished):
            finished.setdefault(attempt.finished_at, []).append(key)
    # the engine records a wave's outcomes round by round (a retry is a later round),
    # each round in call order: the round is the commit that marked the attempt executing
    order = {key: (began[key], i) for i, key in enumerate(attempts)}
    return attempts, {
        seq: tuple(sorted(keys, key=order.__getitem__)) for seq, keys in finished.items()
    }


def _track(
    call: ToolCall,
    way: int,
    record: CommittedRecord,
    seen: dict[OperationId, _Seen],
    attempts: dict[Attempted, Attempt],
    began: dict[Attempted, int],
) -> None:
    op, phase = call.operation_id, call.phase
    last = seen.get(op)
    if last is not None and (last.kind, last.attempts) == (phase.kind, call.attempts):
        return  # unchanged by this commit
    if last is not None and last.kind == "executing":
        key = (op, last.attempts)
        if last.way == way:
            sealed = isinstance(phase, Indeterminate) and phase.reason == SEALED_REASON
            outcome = _came_back(call, record)
            attempts[key] = Attempt(call.tool, outcome, sealed, record.seq)
        else:  # its driver died with it
            attempts[key] = Attempt(call.tool, None)
    if isinstance(phase, Executing):
        began[(op, call.attempts)] = record.seq
        attempts.setdefault((op, call.attempts), Attempt(call.tool, None))
    seen[op] = _Seen(phase.kind, call.attempts, way)


def _came_back(call: ToolCall, record: CommittedRecord) -> Outcome | None:
    """What the attempt that just ended came back with, read from ``call`` as ``record``
    has it next."""
    phase = call.phase
    if isinstance(phase, Executing):  # tried again at once: lost, or never dispatched
        if phase.after_undispatched:
            return Unavailable(message="nothing was dispatched (replayed)")
        return Lost(message="the executor was lost (replayed)")
    if isinstance(phase, Completed):
        output = phase.output
        exhausted = _EXHAUSTED.fullmatch(output.content) if output.is_error else None
        if exhausted is not None and int(exhausted.group(1)) == call.attempts:
            return Unavailable(message=exhausted.group(2))
        texts = _injected_by(record.commit.commands, f"tool:{call.operation_id}:{call.attempts}")
        requests = tuple(InjectMessage(text=t) for t in texts)
        return Finished(output=output, requests=requests)
    if isinstance(phase, Indeterminate) and phase.reason.startswith(_LOST):
        return Lost(message=phase.reason[len(_LOST) :])
    if isinstance(phase, Awaiting) and phase.wait == "delegation":
        commit = record.commit
        ticket = ResumeTicket(
            correlation=phase.correlation,
            run_id=commit.run_id,
            thread_id=commit.thread_id,
            target=UserInputTarget(),
        )
        return ChildWaiting(ticket=ticket)
    return None


def _injected_by(commands: Sequence[Command], source: str) -> list[str]:
    """The texts ``source`` injected, as staged by ``runtime.injection.inject_commands``
    (entry ids ``{version:012d}:{source}:{i:04d}``)."""
    return [
        str(entry.get("text", ""))
        for index in _inject_commands(commands, source)
        for entry in _entries(commands[index])
    ]


def _inject_commands(commands: Sequence[Command], source: str) -> list[int]:
    """Indices of the commands that stage ``source``'s injected messages."""
    return [
        i
        for i, cmd in enumerate(commands)
        if cmd.key == INJECTED_KEY
        and cmd.scope == "run"
        and any(str(e.get("id", ""))[13:-5] == source for e in _entries(cmd))
    ]


def _entries(cmd: Command) -> list[dict[str, Any]]:
    value = cmd.value
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


# ---- resumes ------------------------------------------------------------------------


def resume_command(way: Way) -> ResumeCommand:
    """The ResumeCommand a recorded resume commit applied: its payload from the commit's
    ``resumed`` fact, its ids from the ticket it answered."""
    commit, before = way.first, way.before
    fact = next((e for e in commit.facts if e.type == "resumed"), None)
    ticket = (
        before.disposition.ticket
        if before and isinstance(before.disposition, AwaitingState)
        else None
    )
    if fact is None or ticket is None:
        raise ReplayInputError(
            f"{commit.label} commit of run {commit.run_id}: no ticket it answered"
        )
    data = dict(fact.data)
    correlation = data.pop("correlation", ticket.correlation)
    request_id = data.pop("request_id", None)
    target = ticket.target
    return ResumeCommand(
        correlation=correlation,
        run_id=commit.run_id,
        thread_id=commit.thread_id,
        payload=_PAYLOAD.validate_python(data),
        call_id=target.call_id if isinstance(target, ToolWaitTarget) else None,
        request_id=request_id,
    )


# ---- a tool's state commands --------------------------------------------------------


def tools_commands(
    want: Sequence[Command], got: Sequence[Command], slots: Sequence[Attempted]
) -> dict[Attempted, tuple[Command, ...]] | None:
    """The state commands of a results commit that its tools returned, per attempt.

    A results commit carries, in order, what was staged before it, each finished
    call's commands and injected messages (round by round, call by call), then the
    AfterTool hooks' commands; the log does not say which is whose. ``got`` is the same
    commit made by the replay with the tools' commands left out: what ``want`` holds
    besides ``got``, in order, is the tools'. Each goes to the attempt whose place it
    fills between the injected messages, so that the replay orders them as the
    recording did. None if ``got`` is not ``want`` with some commands left out, or the
    commands left cannot be placed (they come after the last call's injections: an
    AfterTool hook's that the current code no longer writes).
    """
    missing, matched = [], 0
    for i, cmd in enumerate(want):
        if matched < len(got) and got[matched] == cmd:
            matched += 1
        else:
            missing.append(i)
    if matched != len(got) or not missing or not slots:
        return None
    bounds = [_first(_inject_commands(want, f"tool:{op}:{a}")) for op, a in slots]
    placed: dict[Attempted, list[Command]] = {}
    current = 0
    for i in missing:
        before = [k for k, b in enumerate(bounds) if b is not None and b < i]
        after = [k for k, b in enumerate(bounds) if b is not None and b > i]
        low = max(current, before[-1] + 1 if before else 0)
        high = after[0] if after else len(slots) - 1
        if low > high:
            return None
        current = low
        placed.setdefault(slots[low], []).append(want[i])
    return {key: tuple(cmds) for key, cmds in placed.items()}


def _first(indices: Sequence[int]) -> int | None:
    return indices[0] if indices else None
