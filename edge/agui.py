"""Ratchet's thread stream as AG-UI events: a pure transcoder, frame by frame.

``transcode(state, frame)`` returns the next state and the AG-UI events (``ag_ui.core``
models) the frame becomes; it reads no clock and no store, so a stream always
transcodes the same way. Each Ratchet Run is an AG-UI run with the Run's id; a Run
that waits finishes its AG-UI run with an ``interrupt`` outcome (one Interrupt per
ticket, the ticket in its metadata), and its resume opens the next AG-UI run under the
same id, as AG-UI resumes an interrupted run.

    run_started fact        RUN_STARTED, STATE_SNAPSHOT (status), the input as a user
                            text message
    resumed fact            RUN_STARTED (and STATE_SNAPSHOT); a user_input resume's
                            text as a user text message
    text_delta              TEXT_MESSAGE_START (first of its Step's attempt), _CONTENT;
                            only inside the run a stored fact opened (a delta naming
                            another run, or none open, is dropped: the bus is no voucher)
    assistant_message fact  what streamed text lacked, TEXT_MESSAGE_END (a whole text
                            message if nothing streamed)
    tool_call fact          TOOL_CALL_START, TOOL_CALL_ARGS, TOOL_CALL_END
    tool_result fact        TOOL_CALL_RESULT
    status (thread_status)  STATE_SNAPSHOT {"thread_id", "status"}, inside a run
    awaiting fact           RUN_FINISHED, outcome interrupt
    run_finished fact       RUN_FINISHED, outcome success (natural, max_steps) or
                            cancelled (cancelled, stopped)
    run_failed fact         RUN_ERROR (failed, indeterminate)

A stream joined mid-run (a reconnect after an offset) opens the Run's AG-UI run at
its first event; a reconnect knows which run was open at its cursor (``rejoined``, from
the stored facts up to it), so a status fact next opens it too, and every fact after
the cursor that one unbroken stream sends, it sends, with its id. Ids are made from what
the facts carry, so a reconnected stream names things as the first one did: a tool
call is ``{run}:{call_id}`` (a model that repeats a call id in a later Step of the same
Run reuses it). Not transcoded: reasoning and
tool-call argument deltas (the committed tool_call fact carries the arguments whole).
A retried inference's partial text stays in the message its attempt opened (AG-UI has
no way to withdraw text); the retry streams into a new message. A delta of a Step whose
answer is committed is dropped (the live bus is read from where it stood before the
store was, so late deltas come after the fact that sent the text whole).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ag_ui.core import (
    BaseEvent,
    CustomEvent,
    Interrupt,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    RunStartedEvent,
    StateSnapshotEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)
from ag_ui.core.version import PROTOCOL_VERSION

from runtime.events import Delta, Fact
from runtime.lifecycle import ResumeTicket, ThreadStatus, ToolWaitTarget, UserInputTarget
from runtime.stream import Frame
from runtime.timeutil import utc_time

Events = tuple[BaseEvent, ...]
PRUNED = "ratchet.pruned"
"""The AG-UI ``CUSTOM`` event of a ``pruned`` frame (its value: ``{"pruned_through": N}``):
the facts after the cursor up to seq N were pruned, and none of them is sent."""


@dataclass(frozen=True)
class OpenText:
    """The assistant text message being streamed: whose Step and attempt, and its text."""

    message_id: str
    run_id: str
    step: int
    attempt: int
    text: str = ""


@dataclass(frozen=True)
class AguiState:
    thread_id: str
    run: str | None = None
    """The AG-UI run open now (a Ratchet run id), if any."""
    status: ThreadStatus | None = None
    """The last status seen: sent when a run opens, and on every change inside one."""
    text: OpenText | None = None
    parent: str | None = None
    """The id of the run's last assistant message: its tool calls' parent."""
    lapses: int = 0
    """Times the run stopped running (an execution lost, a wait): a recovered execution
    streams the same step and attempt numbers anew, under message ids of its own."""
    joining: str | None = None
    """A reconnect's: the run open at its cursor (``rejoined``), opened again at the first
    frame after it — a status fact's included, which outside a run is not sent."""
    answered: tuple[str, int] | None = None
    """A run and how many of its Steps' answers are committed (its assistant_message
    facts so far): a Step numbered below it streams nothing more. The live bus is read
    from where it stood before the store was, so a Step's last deltas can come after
    the fact that committed it, and opened a second message of text the first already
    held (or, forged on the bus, of text no store holds)."""


def rejoined(thread_id: str, before: Iterable[Frame]) -> AguiState:
    """The state a reconnect starts from: ``before`` (the stored frames up to its cursor)
    transcoded and their events dropped (the client has them). The run open at the
    cursor is to be opened again (a new connection starts its runs anew) at the next
    frame: a status fact there was dropped, its id never sent, while no fact of another
    kind had opened the run."""
    state = AguiState(thread_id)
    for frame in before:
        state, _ = transcode(state, frame)
    return replace(state, joining=state.run, run=None, text=None)


def transcode(state: AguiState, frame: Frame) -> tuple[AguiState, Events]:
    """The AG-UI events of one Ratchet frame, and the state after it."""
    if frame.type == "thread_status":
        state = replace(state, status=frame.status)
        fact = frame.event
        if state.run is None and isinstance(fact, Fact) and fact.run_id == state.joining:
            return _joined(state, fact.run_id)  # RUN_STARTED and this status's snapshot
        events: Events = (_snapshot(state),) if state.run is not None else ()
        if state.text is not None and (frame.status is None or frame.status.state != "running"):
            # the execution streaming it stopped: its text ends here, unfinished, and never
            # takes in a recovered execution's (which the store alone vouches for)
            state, ended = _end_text(state)
            state = replace(state, lapses=state.lapses + 1)
            events = (*ended, *events)
        return state, events
    if frame.type == "pruned":
        return state, (CustomEvent(name=PRUNED, value={"pruned_through": frame.pruned_through}),)
    event = frame.event
    if isinstance(event, Delta):
        return _delta(state, event)
    if isinstance(event, Fact) and frame.offset is not None:
        return _fact(state, event, frame.offset)
    return state, ()


def transcode_all(thread_id: str, frames: Iterable[Frame]) -> list[BaseEvent]:
    """Every event of a sequence of frames (for tests and one-shot conversions)."""
    state, out = AguiState(thread_id), list[BaseEvent]()
    for frame in frames:
        state, events = transcode(state, frame)
        out.extend(events)
    return out


# ---- live text ----------------------------------------------------------------------------


def _delta(state: AguiState, delta: Delta) -> tuple[AguiState, Events]:
    if delta.type != "text_delta" or state.run is None or delta.run_id != state.run:
        # text streams only inside the run a stored fact opened: a delta never opens one.
        # Anyone who can publish on the bus can send a delta naming any run, and it opened
        # a run the thread never had (a RUN_STARTED, while another was open or at rest).
        # A delta that outran its run's first fact is the committed message's text, sent
        # whole with it (``_assistant``).
        return state, ()
    answered = state.answered
    if answered is not None and answered[0] == delta.run_id and delta.step < answered[1]:
        return state, ()  # its Step is committed: the fact sent the text whole
    text = state.text
    same_step = text is not None and (text.run_id, text.step) == (delta.run_id, delta.step)
    if same_step and text is not None and delta.attempt < text.attempt:
        return state, ()  # a late fragment of an abandoned attempt
    events: list[BaseEvent] = []
    if text is None or not same_step or delta.attempt > text.attempt:
        state, ended = _end_text(state)
        events += ended
        message_id = f"{delta.run_id}:step{delta.step}:attempt{delta.attempt}"
        if state.lapses:
            message_id += f":after{state.lapses}"
        text = OpenText(message_id, delta.run_id, delta.step, delta.attempt)
        events.append(TextMessageStartEvent(message_id=message_id, role="assistant"))
    if delta.text:
        events.append(TextMessageContentEvent(message_id=text.message_id, delta=delta.text))
    return replace(state, text=replace(text, text=text.text + delta.text)), tuple(events)


def _end_text(state: AguiState) -> tuple[AguiState, Events]:
    if state.text is None:
        return state, ()
    return replace(state, text=None), (TextMessageEndEvent(message_id=state.text.message_id),)


def _whole_text(message_id: str, text: str, role: Any = "assistant") -> Events:
    return (
        TextMessageStartEvent(message_id=message_id, role=role),
        TextMessageContentEvent(message_id=message_id, delta=text),
        TextMessageEndEvent(message_id=message_id),
    )


# ---- committed facts ----------------------------------------------------------------------


def _fact(state: AguiState, fact: Fact, offset: str) -> tuple[AguiState, Events]:
    data = fact.data
    run = fact.run_id
    if fact.type == "run_started":
        state, ended = _end_text(state)
        state, events = _opened(replace(state, answered=(run, 0)), run)
        user = _whole_text(f"{run}:input", str(data.get("input", "")), "user")
        return state, ended + events + user
    state, opened = _joined(state, run)
    if fact.type == "resumed":
        if data.get("kind") != "user_input":
            return state, opened
        text = _whole_text(f"{data.get('correlation')}:input", str(data.get("text", "")), "user")
        return state, opened + text
    if fact.type == "assistant_message":
        before = state.answered[1] if state.answered and state.answered[0] == run else 0
        state = replace(state, answered=(run, before + 1))
        state, events = _assistant(state, str(data.get("text", "")), f"{run}:{offset}")
        return state, opened + events
    if fact.type == "tool_call":
        return state, opened + _tool_call(state, run, data)
    if fact.type == "tool_result":
        return state, (*opened, _tool_result(run, data))
    if fact.type in ("awaiting", "run_finished", "run_failed"):
        state, ended = _end_text(state)
        rest = _rest(state, fact)
        return replace(state, run=None, parent=None, joining=None), opened + ended + (rest,)
    return state, opened


def _opened(state: AguiState, run: str) -> tuple[AguiState, Events]:
    started = RunStartedEvent(
        thread_id=state.thread_id, run_id=run, protocol_version=PROTOCOL_VERSION
    )
    state = replace(state, run=run, parent=None, joining=None)
    return state, (started, _snapshot(state)) if state.status is not None else (started,)


def _joined(state: AguiState, run: str) -> tuple[AguiState, Events]:
    """The run ``run`` open: as it is, or opened now (the stream joined it midway, or a
    resume continues it)."""
    if state.run == run:
        return state, ()
    state, ended = _end_text(state)
    state, opened = _opened(state, run)
    return state, ended + opened


def _snapshot(state: AguiState) -> StateSnapshotEvent:
    status = state.status.model_dump(mode="json") if state.status is not None else None
    return StateSnapshotEvent(snapshot={"thread_id": state.thread_id, "status": status})


def _assistant(state: AguiState, text: str, fact_id: str) -> tuple[AguiState, Events]:
    """The committed text is the truth: streamed text that is a prefix of it is completed
    and closed; otherwise (nothing streamed, or deltas lost) it is sent whole."""
    open_text = state.text
    if open_text is not None and text.startswith(open_text.text):
        rest = text[len(open_text.text) :]
        events: Events = ()
        if rest:
            events = (TextMessageContentEvent(message_id=open_text.message_id, delta=rest),)
        state, ended = _end_text(state)
        return replace(state, parent=open_text.message_id), events + ended
    state, ended = _end_text(state)
    if not text:
        return replace(state, parent=None), ended
    return replace(state, parent=fact_id), ended + _whole_text(fact_id, text)


def _tool_call(state: AguiState, run: str, data: dict[str, Any]) -> Events:
    call_id = f"{run}:{data.get('call_id')}"
    arguments = str(data.get("arguments", ""))
    start = ToolCallStartEvent(
        tool_call_id=call_id,
        tool_call_name=str(data.get("tool", "")),
        parent_message_id=state.parent,
    )
    args = (ToolCallArgsEvent(tool_call_id=call_id, delta=arguments),) if arguments else ()
    return (start, *args, ToolCallEndEvent(tool_call_id=call_id))


def _tool_result(run: str, data: dict[str, Any]) -> ToolCallResultEvent:
    call_id = f"{run}:{data.get('call_id')}"
    return ToolCallResultEvent(
        message_id=f"{call_id}:result",
        tool_call_id=call_id,
        content=str(data.get("content", "")),
        role="tool",
        metadata={"is_error": True} if data.get("is_error") else None,
    )


def _rest(state: AguiState, fact: Fact) -> BaseEvent:
    """The event that closes the AG-UI run: the Run waits, ends, or failed."""
    thread, run = state.thread_id, fact.run_id
    if fact.type == "awaiting":
        ticket = ResumeTicket.model_validate(fact.data["ticket"])
        outcome = RunFinishedInterruptOutcome(interrupts=[_interrupt(ticket)])
        return RunFinishedEvent(thread_id=thread, run_id=run, outcome=outcome)
    cause: dict[str, Any] = fact.data.get("cause", {})
    kind = cause.get("kind")
    if fact.type == "run_failed":
        code = cause.get("code") if kind == "failed" else kind
        message = cause.get("message") or cause.get("reason") or str(kind)
        return RunErrorEvent(message=message, code=code, metadata={"cause": cause})
    ended: Any = (
        RunFinishedCancelledOutcome()
        if kind in ("cancelled", "stopped")
        else RunFinishedSuccessOutcome()
    )
    return RunFinishedEvent(thread_id=thread, run_id=run, outcome=ended, metadata={"cause": cause})


def _interrupt(ticket: ResumeTicket) -> Interrupt:
    target = ticket.target
    tool_call: str | None = None
    if isinstance(target, ToolWaitTarget):
        tool_call = f"{ticket.run_id}:{target.call_id}"
        message = f"{target.wait} for {target.tool}({target.arguments})"
    elif isinstance(target, UserInputTarget):
        message = target.prompt or "input wanted"
    else:
        message = f"paused ({target.reason})"
    expires = None
    if ticket.deadline_us is not None:
        moment = utc_time(ticket.deadline_us)
        expires = moment.isoformat() if moment else None
    return Interrupt(
        id=ticket.correlation,
        reason=ticket.payload_kind,
        message=message,
        tool_call_id=tool_call,
        expires_at=expires,
        metadata={"ticket": ticket.model_dump(mode="json")},
    )


__all__ = ["AguiState", "OpenText", "transcode", "transcode_all"]
