"""The AG-UI transcoder: Ratchet frames in, events the protocol's own models accept out."""

from __future__ import annotations

from typing import Any

from ag_ui.core import Event, EventType
from pydantic import TypeAdapter

from edge.agui import transcode_all
from runtime.events import Delta, Fact
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    Natural,
    ResumeTicket,
    ThreadStatus,
    ToolWaitTarget,
)
from runtime.stream import Frame, from_fact, parse_offset

EVENTS = TypeAdapter(Event)
RUN = "run-1"
TICKET = ResumeTicket(
    correlation="tool-batch:run-1:1:c1:permission",
    run_id=RUN,
    thread_id="t1",
    deadline_us=1_900_000_000_000_000,
    target=ToolWaitTarget(wait="permission", call_id="c1", tool="drop", arguments='{"n": 1}'),
)


def fact(seq: int, index: int, type_: str, **data: Any) -> Frame:
    return from_fact(Fact(type=type_, run_id=RUN, data=data, seq=seq, index=index))


def status(seq: int, index: int, state: str, reason: str | None = None) -> Frame:
    s = ThreadStatus(state=state, since=seq, reason=reason)
    return fact(seq, index, "status", **s.frame())


def delta(text: str, step: int = 1, attempt: int = 1) -> Frame:
    event = Delta(type="text_delta", run_id=RUN, step=step, attempt=attempt, text=text)
    return Frame(type="delta", event=event)


def round_trip(events: list[Any]) -> list[Any]:
    """Every event dumped as the wire has it and validated back by the protocol's models."""
    out = []
    for event in events:
        wire = event.model_dump(mode="json", by_alias=True)
        again = EVENTS.validate_python(wire)
        assert again.model_dump(mode="json", by_alias=True) == wire
        out.append(again)
    return out


A_RUN = [
    Frame(type="thread_status", status=ThreadStatus()),
    fact(1, 0, "run_started", input="drop it"),
    status(1, 1, "running"),
    delta("may "),
    delta("I?"),  # the first attempt breaks off here; the retry streams anew
    delta("may I", attempt=2),
    fact(2, 0, "assistant_message", text="may I?"),
    fact(2, 1, "tool_call", call_id="c1", tool="drop", arguments='{"n": 1}'),
    status(2, 2, "idle", "awaiting_permission"),
    fact(2, 3, "awaiting", ticket=TICKET.model_dump(mode="json")),
    fact(3, 0, "resumed", correlation=TICKET.correlation, kind="permission", approve=True),
    status(3, 1, "running"),
    fact(4, 0, "tool_result", kind="tool_result", call_id="c1", tool="drop", content="dropped"),
    fact(4, 1, "assistant_message", text="done"),
    status(4, 2, "idle", "natural"),
    fact(4, 3, "run_finished", cause=EndedState(run_id=RUN, cause=Natural()).cause.model_dump()),
]


def test_a_run_with_a_wait_becomes_two_agui_runs_that_validate():
    events = round_trip(transcode_all("t1", A_RUN))
    types = [e.type for e in events]
    T = EventType
    assert types == [
        T.RUN_STARTED, T.STATE_SNAPSHOT,
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT, T.TEXT_MESSAGE_END,  # the input
        T.STATE_SNAPSHOT,  # running
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT, T.TEXT_MESSAGE_CONTENT,  # attempt 1
        T.TEXT_MESSAGE_END,
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT,  # attempt 2 ...
        T.TEXT_MESSAGE_CONTENT, T.TEXT_MESSAGE_END,  # ... completed by the commit: "?"
        T.TOOL_CALL_START, T.TOOL_CALL_ARGS, T.TOOL_CALL_END,
        T.STATE_SNAPSHOT, T.RUN_FINISHED,  # awaiting: an interrupt
        T.RUN_STARTED, T.STATE_SNAPSHOT, T.STATE_SNAPSHOT,  # resumed
        T.TOOL_CALL_RESULT,
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT, T.TEXT_MESSAGE_END,
        T.STATE_SNAPSHOT, T.RUN_FINISHED,
    ]  # fmt: skip
    started, finished = events[0], events[18]
    assert (started.thread_id, started.run_id, started.protocol_version) == ("t1", RUN, "1.0")
    interrupt = finished.outcome.interrupts[0]
    assert finished.outcome.type == "interrupt"
    assert interrupt.id == TICKET.correlation and interrupt.reason == "permission"
    assert interrupt.tool_call_id == f"{RUN}:c1" == events[14].tool_call_id
    assert interrupt.metadata["ticket"]["target"]["call_id"] == "c1"
    assert events[12].delta == "?"  # only what the retry's stream lacked
    assert events[14].parent_message_id == events[10].message_id
    assert events[22].tool_call_id == f"{RUN}:c1" and events[22].content == "dropped"
    assert events[-1].outcome.type == "success"
    assert events[-2].snapshot["status"]["reason"] == "natural"


def test_a_delta_never_opens_a_run():
    """Anyone who can publish on the bus can send a delta naming any run: it opened a run
    the thread never had (RUN_STARTED while the thread was at rest, or inside another
    run). Text streams only inside the run a stored fact opened."""
    phantom = Delta(type="text_delta", run_id="phantom-run", step=1, attempt=1, text="boo")
    forged = Frame(type="delta", event=phantom)
    at_rest = [*A_RUN[:10], forged, *A_RUN[10:]]  # after the awaiting fact
    running = [*A_RUN[:3], forged, *A_RUN[3:]]  # inside the real run
    for frames in (at_rest, running, [Frame(type="thread_status", status=ThreadStatus()), forged]):
        events = round_trip(transcode_all("t1", frames))
        assert all(getattr(e, "run_id", RUN) == RUN for e in events)
        assert all(getattr(e, "delta", None) != "boo" for e in events)
    assert [e.type for e in transcode_all("t1", at_rest)] == [
        e.type for e in transcode_all("t1", A_RUN)
    ]


def test_deltas_of_a_step_already_committed_stream_nothing():
    """The bus is read from where it stood before the store was: a Step's last deltas
    can come after the fact that committed it. They opened a second message of that
    text (two answers for one Step); forged on the bus, one of text no store holds."""
    frames = [
        Frame(type="thread_status", status=ThreadStatus()),
        fact(1, 0, "run_started", input="go"),
        delta("first ", step=0),
        fact(2, 0, "assistant_message", text="first words"),
        delta("words", step=0),  # late: its Step is committed
        delta("FORGED", step=0, attempt=5),
        delta("next", step=1),  # the next Step streams as before
        fact(3, 0, "assistant_message", text="next one"),
        fact(
            3, 1, "run_finished", cause=EndedState(run_id=RUN, cause=Natural()).cause.model_dump()
        ),
    ]
    events = round_trip(transcode_all("t1", frames))
    texts: dict[str, str] = {}
    for e in events:
        if e.type == EventType.TEXT_MESSAGE_CONTENT:
            texts[e.message_id] = texts.get(e.message_id, "") + e.delta
    assert sorted(texts.values()) == ["first words", "go", "next one"]


def test_a_stream_joined_midway_opens_the_run_first():
    joined = [
        Frame(type="thread_status", status=ThreadStatus(state="running", since=5)),
        *A_RUN[12:],
    ]
    events = round_trip(transcode_all("t1", joined))
    assert [e.type for e in events[:3]] == [
        EventType.RUN_STARTED,
        EventType.STATE_SNAPSHOT,
        EventType.TOOL_CALL_RESULT,
    ]
    assert events[-1].type == EventType.RUN_FINISHED


def test_ends_that_are_not_success():
    cancelled = fact(2, 0, "run_finished", cause={"kind": "stopped", "reason": "budget"})
    failed = fact(2, 0, "run_failed", cause={"kind": "failed", "failure": "inference",
                                             "code": "auth", "message": "bad key"})  # fmt: skip
    start = [A_RUN[1]]
    stop = round_trip(transcode_all("t1", [*start, cancelled]))[-1]
    assert stop.type == EventType.RUN_FINISHED and stop.outcome.type == "cancelled"
    error = round_trip(transcode_all("t1", [*start, failed]))[-1]
    assert error.type == EventType.RUN_ERROR
    assert (error.message, error.code) == ("bad key", "auth")


def test_awaiting_user_input_and_its_resume_text():
    ticket = AwaitingState(
        run_id=RUN,
        ticket=ResumeTicket.model_validate(
            {
                "correlation": "ask:1",
                "run_id": RUN,
                "thread_id": "t1",
                "target": {"kind": "user_input", "prompt": "Which account?"},
            }
        ),
    ).ticket
    frames = [
        A_RUN[1],
        fact(2, 0, "awaiting", ticket=ticket.model_dump(mode="json")),
        fact(3, 0, "resumed", correlation="ask:1", kind="user_input", text="savings"),
    ]
    events = round_trip(transcode_all("t1", frames))
    interrupt = events[4].outcome.interrupts[0]
    assert (interrupt.reason, interrupt.message, interrupt.tool_call_id) == (
        "user_input",
        "Which account?",
        None,
    )
    assert events[5].type == EventType.RUN_STARTED
    assert events[-2].delta == "savings" and events[-3].role == "user"


async def test_a_stream_that_fails_after_it_started_ends_with_the_problem() -> None:
    """Once the response started no status can say it: the last event names the
    problem (a store unavailable past the follower's patience), as a Ratchet ``error``
    event and as an AG-UI CUSTOM event, never RUN_ERROR (the Run did not fail)."""
    import json

    from edge.streams import STREAM_ERROR, _agui_events, _ratchet_events
    from runtime.errors import StoreUnavailable

    async def failing() -> Any:
        yield Frame(type="thread_status", status=ThreadStatus(state="running", since=1))
        raise StoreUnavailable("store postgresql://db did not answer within 60s")

    ours = [event async for event in _ratchet_events(failing())]
    assert [e.event for e in ours] == ["thread_status", "error"]
    problem = json.loads(ours[-1].data)
    assert (problem["status"], problem["kind"]) == (503, "StoreUnavailable")
    assert "did not answer" in problem["detail"]

    from edge.agui import AguiState

    chunks = [chunk.decode() async for chunk in _agui_events(AguiState("t1"), failing())]
    last = EVENTS.validate_json(chunks[-1].removeprefix("data: ").strip())
    assert last.type == EventType.CUSTOM and last.name == STREAM_ERROR
    assert last.value["kind"] == "StoreUnavailable"
    parsed = [EVENTS.validate_json(c.split("data: ", 1)[1].strip()) for c in chunks]
    assert all(e.type != EventType.RUN_ERROR for e in parsed)


def test_a_lost_executions_text_ends_and_a_recovered_ones_is_a_message_of_its_own():
    """The execution streaming Step 1 is lost mid-text; the recovered one streams Step 1
    attempt 1 again. Its text is not appended to the dead one's (a message the store
    never vouched for): the first ends when the status leaves running, and the second
    opens under an id of its own."""
    frames = [
        Frame(type="thread_status", status=ThreadStatus()),
        fact(1, 0, "run_started", input="ask"),
        status(1, 1, "running"),
        delta("The answer"),
        status(2, 0, "failed", "execution_lost"),
        status(3, 0, "running"),
        delta("The answer is 42."),
    ]
    events = round_trip(transcode_all("t1", frames))
    texts = [e for e in events if e.type.name.startswith("TEXT_MESSAGE")][3:]  # after the input
    T = EventType
    assert [e.type for e in texts] == [
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT, T.TEXT_MESSAGE_END,  # the lost one
        T.TEXT_MESSAGE_START, T.TEXT_MESSAGE_CONTENT,  # the recovered one
    ]  # fmt: skip
    assert texts[0].message_id != texts[3].message_id
    assert texts[4].delta == "The answer is 42."


def _ids_sent(state: Any, frames: list[Frame]) -> list[str]:
    """The ``id:`` lines a stream sends for ``frames`` from ``state`` (one per frame that
    has events and an offset, on its last event), with each event validated."""
    from edge.agui import transcode

    sent = []
    for frame in frames:
        state, events = transcode(state, frame)
        round_trip(list(events))
        if events and frame.offset is not None:
            sent.append(frame.offset)
    return sent


def test_a_reconnect_sends_every_fact_after_its_cursor_that_one_stream_sends():
    """Reconnected after a cursor inside a run, a status fact that came next was never
    sent (no run was open yet on the new connection): its snapshot and its id were lost,
    while the stream that never reconnected sent them."""
    from edge.agui import AguiState, rejoined

    whole = _ids_sent(AguiState("t1"), A_RUN)
    facts = [f for f in A_RUN if f.offset is not None]
    for cursor in facts:
        at = parse_offset(cursor.offset)
        later = [f for f in facts if parse_offset(f.offset) > at]
        state = rejoined("t1", A_RUN[: A_RUN.index(cursor) + 1])
        first = Frame(type="thread_status", status=ThreadStatus(state="running", since=9))
        again = _ids_sent(state, [first, *later])
        expected = [o for o in whole if parse_offset(o) > parse_offset(cursor.offset)]
        assert again == expected, (cursor.offset, again, expected)


async def test_a_pruned_frame_is_an_event_of_its_own_on_both_wires() -> None:
    """The facts after a client's cursor were pruned: the Ratchet stream sends a
    ``pruned`` event, AG-UI a CUSTOM ``ratchet.pruned``, each naming the seq they went
    up to (the client is told, never handed the next Run's facts as if they came next)."""
    import json

    from edge.agui import PRUNED, AguiState
    from edge.streams import _agui_events, _ratchet_events

    async def pruned() -> Any:
        yield Frame(type="thread_status", status=ThreadStatus(state="idle", since=1))
        yield Frame(type="pruned", pruned_through=7)

    ours = [event async for event in _ratchet_events(pruned())]
    assert [e.event for e in ours] == ["thread_status", "pruned"]
    assert json.loads(ours[-1].data) == {"type": "pruned", "pruned_through": 7}
    assert ours[-1].id is None  # a reconnect from the same cursor is told again
    chunks = [chunk.decode() async for chunk in _agui_events(AguiState("t1"), pruned())]
    last = EVENTS.validate_json(chunks[-1].removeprefix("data: ").strip())
    assert last.type == EventType.CUSTOM and last.name == PRUNED
    assert last.value == {"pruned_through": 7}
