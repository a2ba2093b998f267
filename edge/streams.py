"""The thread's stream over SSE, as Ratchet frames or as AG-UI events.

``GET /threads/{thread}/stream`` sends ``RunHandle.stream`` frame by frame: first a
``thread_status`` snapshot, then every committed fact after the cursor, then live
deltas and facts, a status frame on every change. Each SSE event's ``event:`` is the
frame's type, its ``data:`` the frame's JSON, and a fact's ``id:`` is its offset
``SEQ:INDEX``: a client that reconnects with ``Last-Event-ID`` (as EventSource does by
itself) gets every fact after it exactly once. The cursor is ``Last-Event-ID`` if
sent, else ``?after=``, else the beginning. ``?until_rest=true`` ends the stream once
the Run is at rest; by default it follows the thread's later Runs too.

The same stream as AG-UI events (``edge.agui``) is ``GET /threads/{thread}/agui``, or
``/stream`` asked with ``Accept: application/vnd.ag-ui+json``: each event is
``data: <event JSON>`` as AG-UI's encoder writes it, and the last event of each fact
carries the fact's offset as its ``id:``, so it reconnects the same way.

A store outage pauses a stream (``runtime.stream.STORE_PATIENCE_S``); one that outlasts
it, or a record that does not verify, ends the stream with a last event naming the
problem (``event: error`` with the problem JSON; in AG-UI a ``CUSTOM`` event named
``ratchet.stream_error``, never ``RUN_ERROR``: the Run did not fail).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from ag_ui.core import CustomEvent
from ag_ui.encoder import EventEncoder
from fastapi import APIRouter, Header, Query, Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from edge.agui import AguiState, rejoined, transcode
from edge.problems import HttpProblem, problem_body, problems, status_of
from edge.routes import Client, Thread, known
from edge.strict_json import StrictJsonRoute
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.patience import patiently
from runtime.rules import stamp_facts
from runtime.stream import STORE_PATIENCE_S, Frame, check_cursor, from_fact, parse_offset

log = logging.getLogger("ratchet.edge")
router = APIRouter(route_class=StrictJsonRoute)
STREAM_ERROR = "ratchet.stream_error"
"""The AG-UI ``CUSTOM`` event's name that ends a stream early (its value: the problem)."""
AGUI_MEDIA_TYPE = "application/vnd.ag-ui+json"
"""Asked for in ``Accept``, ``/stream`` answers with AG-UI events (still as SSE)."""
PING_S = 15
SEND_TIMEOUT_S = 60.0
"""A client that stops reading without going away is dropped once one send has waited
this long (sse-starlette's ``send_timeout``): it would hold its follower forever."""
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}

After = Annotated[
    str | None,
    Query(max_length=64, description="Only facts after this offset SEQ:INDEX"),
]
UntilRest = Annotated[bool, Query(description="End the stream when the Run is at rest")]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)]


@router.get(
    "/threads/{thread}/stream",
    responses={**SSE_RESPONSE, **problems(404, 422, 503)},
    response_class=EventSourceResponse,
    summary="The thread's stream (SSE): status snapshot, facts, live deltas",
)
async def stream(
    request: Request,
    client: Client,
    thread: Thread,
    after: After = None,
    until_rest: UntilRest = False,
    last_event_id: LastEventId = None,
    accept: Annotated[str | None, Header()] = None,  # bounded by the server's header limit
) -> EventSourceResponse:
    cursor = last_event_id or after
    agui = accept is not None and AGUI_MEDIA_TYPE in accept
    return await _response(request, client, thread, cursor, until_rest, agui=agui)


@router.get(
    "/threads/{thread}/agui",
    responses={**SSE_RESPONSE, **problems(404, 422, 503)},
    response_class=EventSourceResponse,
    summary="The thread's stream as AG-UI events (SSE)",
)
async def agui_stream(
    request: Request,
    client: Client,
    thread: Thread,
    after: After = None,
    until_rest: UntilRest = False,
    last_event_id: LastEventId = None,
) -> EventSourceResponse:
    cursor = last_event_id or after
    return await _response(request, client, thread, cursor, until_rest, agui=True)


class OpenStreams:
    """The streams a server has open, up to ``ServeOptions.max_streams``."""

    def __init__(self, most: int) -> None:
        self.most, self.open = most, 0

    def take(self) -> Slot:
        """A place for one more stream; 503 TooManyStreams if the server has as many
        open as it takes. Taken at once, before the request's first await: checked then
        and counted only once the response was read, a burst of requests all passed the
        check (40 streams open on a server that takes 2)."""
        if self.open >= self.most:
            detail = f"this server has {self.open} streams open, as many as it takes"
            raise HttpProblem(503, "TooManyStreams", detail)
        self.open += 1
        return Slot(self)


class Slot:
    """One stream's place among a server's ``OpenStreams``, given back once (whichever
    comes first: the request refused before its response, or its response's end)."""

    def __init__(self, streams: OpenStreams) -> None:
        self._streams: OpenStreams | None = streams

    def free(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams.open -= 1


class _SlotResponse(EventSourceResponse):
    """An SSE response that gives its stream's slot back when it ends, however it ends:
    its events all sent, the client gone, or never read at all (a HEAD is answered
    without the stream, and a client may leave before the first event)."""

    def __init__(self, events: AsyncIterator[Any], slot: Slot) -> None:
        super().__init__(events, ping=PING_S, send_timeout=SEND_TIMEOUT_S)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.free()


async def _response(
    request: Request,
    client: Client,
    thread: Thread,
    after: str | None,
    until_rest: bool,
    *,
    agui: bool,
) -> EventSourceResponse:
    """The stream's response; checked before it starts, so a bad cursor, an unknown
    thread or a server with too many streams open is a problem, not a stream that
    breaks off. Its slot is taken first: an AG-UI reconnect reads the thread's log."""
    try:
        parse_offset(after)
    except ValueError as exc:
        raise HttpProblem(422, "ValidationError", str(exc)) from None
    slots: OpenStreams = request.app.state.streams
    slot = slots.take()
    try:
        frontier = await known(client, thread)
        try:
            check_cursor(after, frontier.version)
        except ValueError as exc:
            raise HttpProblem(422, "ValidationError", str(exc)) from None
        frames = client.handle(thread).stream(after, until_rest=until_rest)
        if agui:
            events = _agui_events(await _agui_state(client, thread, after), frames)
            return _SlotResponse(events, slot)
        return _SlotResponse(_ratchet_events(frames), slot)
    except BaseException:
        slot.free()
        raise


async def _ratchet_events(frames: AsyncIterator[Frame]) -> AsyncIterator[ServerSentEvent]:
    async with _closing(frames):
        try:
            async for frame in frames:
                yield ServerSentEvent(data=frame_json(frame), event=frame.type, id=frame.offset)
        except RatchetError as exc:
            yield ServerSentEvent(data=json.dumps(stream_problem(exc)), event="error")


def stream_problem(exc: RatchetError) -> dict[str, Any]:
    """Why a stream ended early, once its response had started (a store unavailable past
    the follower's patience, a record that does not verify): the problem a request
    would have been answered with, as the stream's last event. The client reconnects
    with the last offset it saw, and loses and repeats nothing."""
    log.warning("a stream ended early: %s: %s", type(exc).__name__, exc)
    return problem_body(status_of(exc), type(exc).__name__, str(exc))


def frame_json(frame: Frame) -> str:
    """The frame without its empty members (a snapshot has no offset, no event); what is
    inside is left whole, so its status object is the one ``GET /threads/{thread}`` has."""
    members = {k: v for k, v in frame.model_dump(mode="json").items() if v is not None}
    return line_safe(json.dumps(members, ensure_ascii=False, separators=(",", ":")))


_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def line_safe(text: str) -> str:
    """JSON text with the characters some readers take for line breaks (U+0085, U+2028,
    U+2029: Python's ``str.splitlines``, older JavaScript) escaped. SSE itself breaks
    lines only at CR and LF, but a client that split an event's data at these would
    cut it in two. In JSON they can stand only inside a string, where the escape reads
    back as the same character."""
    return text.translate(_LINE_BREAKS)


async def _agui_state(client: Any, thread: str, cursor: str | None) -> AguiState:
    """Where an AG-UI stream starts: for a reconnect, the state at its cursor, from the
    thread's stored facts up to it (``agui.rejoined``; the log kept is read once)."""
    if cursor is None:
        return AguiState(thread_id=thread)
    upto = parse_offset(cursor)
    records = await patiently(lambda: client.store.read(ThreadId(thread)), STORE_PATIENCE_S)
    facts = (f for r in records for f in stamp_facts(r.commit, r.seq))
    return rejoined(thread, (from_fact(f) for f in facts if (f.seq, f.index) <= upto))


async def _agui_events(state: AguiState, frames: AsyncIterator[Frame]) -> AsyncIterator[bytes]:
    encoder = EventEncoder()
    async with _closing(frames):
        try:
            async for frame in frames:
                state, events = transcode(state, frame)
                for i, event in enumerate(events):
                    chunk = line_safe(encoder.encode(event))
                    if frame.offset is not None and i == len(events) - 1:
                        chunk = f"id: {frame.offset}\n{chunk}"  # reconnect after this fact
                    yield chunk.encode()
        except RatchetError as exc:  # the stream failed, not the Run: no RUN_ERROR
            ended = CustomEvent(name=STREAM_ERROR, value=stream_problem(exc))
            yield encoder.encode(ended).encode()


@contextlib.asynccontextmanager
async def _closing(frames: AsyncIterator[Frame]) -> AsyncIterator[None]:
    """Close the follower (and its bus connection) when the client goes away."""
    try:
        yield
    finally:
        close = getattr(frames, "aclose", None)
        if close is not None:
            await close()
