"""What a replay check answers, from the recording (``runtime.replay_check``): the
model's responses, each attempt's outcome, the recorded failures and ends from outside.

``Feed`` knows where the replay stands (the way in it is making again, and how many of
its commits are made) and answers the engine's model, tool runner and child runner from
the recording there. Asked for what the recording does not have, it ends the way in
(``Halt``): with nothing, where the recording's driver died too; by feeding the engine
the cancel or stop the recording shows came from outside; else with a divergence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

from runtime.base import Frozen
from runtime.batch import ToolOutput
from runtime.commit import ThreadCommit
from runtime.delegation import ChildOutcome, ChildRequest, ChildWaiting
from runtime.engine import Engine
from runtime.errors import ModelRateLimited, ModelRefused
from runtime.faults import Unwind
from runtime.ids import CorrelationId, OperationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndedState,
    Failed,
    PauseTarget,
    ResumeTicket,
    Stopped,
    UserInputTarget,
)
from runtime.messages import AssistantMessage
from runtime.models import InferenceRequest, ModelDelta, ModelResponse, Usage
from runtime.ports import CommitStore, CommittedRecord, Finished, Lost, ToolInvocation, ToolOutcome
from runtime.replay_compare import Divergence, DivergenceKind, commit_text, divergence
from runtime.replay_log import WITHHELD, Attempted, Outcome, Recording, Way
from runtime.state import Command
from runtime.usage import TOKEN_FIELDS, step_usage

RATE_LIMIT_PAUSE_S = 1e9
"""A replayed rate limit asks for this long a wait: longer than any Run waits out."""
FED_STOP_WAIT_S = 5.0
"""How long a replay waits for its engine to take a cancel or stop it was fed."""
Hints = dict[Attempted, tuple[Command, ...]]
"""The state commands each attempt returned, as learned from the results commits."""


class ReplayNote(Frozen):
    """Something the replay noticed that is not a divergence of decisions."""

    run_id: str
    step: int
    text: str


class Halt(Unwind):
    """Ends a replay's way in: a divergence, or (None) the point where the recording's
    driver stopped. An Unwind, so that nothing in the engine settles it as the Run's
    failure, nor takes it for the model's or a hook's (as ``runtime.faults.Crash``)."""

    def __init__(self, found: Divergence | None, learned: Hints | None = None) -> None:
        super().__init__(found.line() if found is not None else "the recording stops here")
        self.found = found
        self.learned = learned


class Feed:
    """Where a replay stands in the recording, and what it answers from it."""

    def __init__(self, recording: Recording, hints: Hints) -> None:
        self.recording = recording
        self.hints = hints
        self.way = recording.ways[0]
        self.made = 0
        """Commits of the current way in made so far."""
        self.matched = 0
        self.engine: Engine | None = None
        self.inferences = 0
        self.calls = 0
        self.notes: dict[tuple[str, int, str], ReplayNote] = {}

    def begin(self, way: Way, engine: Engine) -> None:
        self.way, self.made, self.engine = way, 0, engine

    def next_expected(self) -> CommittedRecord | None:
        records = self.way.records
        return records[self.made] if self.made < len(records) else None

    def last_made(self) -> ThreadCommit | None:
        return self.way.records[self.made - 1].commit if self.made else self.way.before

    def next_seq(self) -> int:
        expected = self.next_expected()
        return expected.seq if expected is not None else self.way.records[-1].seq + 1

    # ---- the model ---------------------------------------------------------------------

    async def inference(self, request: InferenceRequest) -> ModelResponse:
        asked = f"an inference for step {request.step} of run {request.run_id}"
        expected = self.next_expected()
        if expected is None:
            await self.unanswered(asked, "unrecorded_inference")
        assert expected is not None
        _raise_recorded_failure(expected.commit)
        response = self.recording.responses.get((request.run_id, request.step))
        if response is None and _settled(expected.commit):
            # the model answered, but the Step failed before its commit landed (a state
            # conflict, a store refusal): the answer is not on record, so none is given
            # (what it used is, with the end)
            text = "no response is recorded (the Step failed first): an empty one fed"
            self._note(request.run_id, request.step, text)
            response = ModelResponse(usage=_recorded_usage(expected.commit))
        if response is None:
            after_results = (last := self.last_made()) is not None and last.label == "results"
            await self.unanswered(asked, "unrecorded_inference", outside_stop=after_results)
        assert response is not None
        self.inferences += 1
        self._note_request(request, response)
        ended = self._ended_as_answered(expected)
        if isinstance(ended, Stopped):
            fed_stop(self.driver(), ended.reason)
        elif ended is not None:
            self.driver().cancel()
        return response

    def _note_request(self, request: InferenceRequest, response: ModelResponse) -> None:
        if request.tools is None:
            return
        offered = {t.get("name") for t in request.tools}
        for use in response.tool_calls:
            if use is not WITHHELD and use.tool not in offered:
                text = f"the request no longer offers tool {use.tool!r}, which the response calls"
                self._note(request.run_id, request.step, text)

    def _note(self, run: str, step: int, text: str) -> None:
        self.notes.setdefault((run, step, text), ReplayNote(run_id=run, step=step, text=text))

    def _ended_as_answered(self, expected: CommittedRecord) -> Cancelled | Stopped | None:
        """How the recording's Run was ended from outside as the model answered (its
        calls were committed requested, and none ran, before the end), if it was."""
        i = self.made + 1
        after = self.way.records[i].commit if i < len(self.way.records) else None
        batch = expected.commit.batch
        if after is None or expected.commit.label != "inference" or batch is None:
            return None
        if any(c.phase.kind == "executing" for c in batch.calls):
            return None
        return _outside_end(after)

    # ---- tools and children ------------------------------------------------------------

    async def outcome(self, run: str, op: OperationId, attempt: int, tool: str) -> Outcome:
        recorded = self.recording.attempts.get((op, attempt))
        expected = self.next_expected()
        step, _, call = op.removeprefix(f"tool-batch:{run}:").partition(":")
        unrecorded = recorded is None or recorded.outcome is None
        if unrecorded and expected is not None and _settled(expected.commit):
            # it came back, but the Step failed before its results commit landed
            text = f"call {call}: no outcome is recorded (the Step failed first): an empty one fed"
            self._note(run, int(step) if step.isdigit() else -1, text)
            return Finished(output=ToolOutput(content=""))
        if unrecorded:
            asked = f"call {call} of {tool}, attempt {attempt}"
            in_flight = recorded is not None and recorded.ended_around
            await self.unanswered(asked, "unrecorded_call", outside_stop=in_flight)
        assert recorded is not None and recorded.outcome is not None
        self.calls += 1
        outcome = recorded.outcome
        commands = self.hints.get((op, attempt))
        if isinstance(outcome, Finished) and commands:
            outcome = outcome.model_copy(update={"commands": commands})
        return outcome

    async def unanswered(
        self, asked: str, what: DivergenceKind, *, outside_stop: bool = False
    ) -> NoReturn:
        """The code asks for ``asked``, which the recording does not answer here."""
        expected = self.next_expected()
        if expected is None:
            if self.way.cut_short:
                raise Halt(None)  # the recording's driver died here: so does this way in
            raise Halt(divergence(self.next_seq(), what, "nothing: the Run was at rest", asked))
        end = _outside_end(expected.commit)
        if isinstance(end, Cancelled) or (isinstance(end, Stopped) and outside_stop):
            engine = self.driver()
            engine.cancel() if isinstance(end, Cancelled) else fed_stop(engine, end.reason)
            await asyncio.sleep(FED_STOP_WAIT_S)  # the engine's guard interrupts this
            asked += f" (it did not take the {end.kind} it was fed)"
        raise Halt(
            divergence(expected.seq, what, commit_text(expected.commit), asked, expected.commit)
        )

    def driver(self) -> Engine:
        assert self.engine is not None
        return self.engine


def _raise_recorded_failure(expected: ThreadCommit) -> None:
    """Where the recording's model failed, the replay's fails alike."""
    state = expected.disposition
    if isinstance(state, EndedState) and isinstance(state.cause, Failed):
        cause = state.cause
        answered = any(isinstance(m, AssistantMessage) for m in expected.messages)
        if cause.failure == "inference" and not answered:
            # an answer refused after it was made recorded its usage with the end
            raise ModelRefused(cause.code, cause.message, usage=_recorded_usage(expected))
    if isinstance(state, AwaitingState):
        target = state.ticket.target
        if isinstance(target, PauseTarget) and target.reason == "rate_limit":
            raise ModelRateLimited("rate_limit", "replayed", retry_after_s=RATE_LIMIT_PAUSE_S)


def _recorded_usage(commit: ThreadCommit) -> Usage | None:
    """The usage a commit recorded (its run-scope counters), as the model reported it."""
    recorded = step_usage(commit.commands)
    if recorded is None:
        return None
    counted, model = recorded
    return Usage(**{f: counted.get(f, 0) for f in TOKEN_FIELDS}, model=model)


def _settled(commit: ThreadCommit) -> bool:
    """An end ``failed`` by the Run's own driver, not by its model: a settlement."""
    state = commit.disposition
    return (
        commit.claim is None
        and isinstance(state, EndedState)
        and isinstance(state.cause, Failed)
        and state.cause.failure != "inference"
    )


def _outside_end(commit: ThreadCommit) -> Cancelled | Stopped | None:
    """The cause of an end by the Run's own driver that may have come from outside."""
    state = commit.disposition
    if commit.claim is None and isinstance(state, EndedState):
        return state.cause if isinstance(state.cause, Cancelled | Stopped) else None
    return None


class ReplayModel:
    """The Model of a replay: the recording's responses."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        yield await self.feed.inference(request)


class ReplayTools:
    """The ToolRunner of a replay: the recording's outcomes; it never runs a tool."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    async def run(self, invocations: Sequence[ToolInvocation]) -> list[ToolOutcome]:
        out: list[ToolOutcome] = []
        for inv in invocations:
            outcome = await self.feed.outcome(inv.run_id, inv.operation_id, inv.attempt, inv.tool)
            out.append(
                Lost(message="a child's wait") if isinstance(outcome, ChildWaiting) else outcome
            )
        return out


class ReplayChildren:
    """The ChildRunner of a replay: the recorded outcome of each child; none starts."""

    def __init__(self, feed: Feed, store: CommitStore) -> None:
        self.feed = feed
        self.store = store

    async def run(self, request: ChildRequest) -> ChildOutcome:
        batch = (await self.store.load(request.parent_thread)).batch
        assert batch is not None
        call = batch.call(request.call_id)
        recorded = self.feed.recording.attempts.get((call.operation_id, call.attempts))
        expected = self.feed.next_expected()
        if recorded is not None and recorded.ended_around and expected is not None:
            cause = getattr(expected.commit.disposition, "cause", None)
            if cause is not None and cause.kind == "indeterminate":  # children that waited
                self.feed.calls += 1  # at once: the parent ended, sealing the calls
                return ChildWaiting(ticket=_waiting(request))
        outcome = await self.feed.outcome(
            request.parent_run, call.operation_id, call.attempts, call.tool
        )
        return (
            outcome
            if isinstance(outcome, Finished | Lost | ChildWaiting)
            else Lost(message=outcome.message)
        )

    async def cancel(self, child_thread: ThreadId, child_run: RunId | None = None) -> None:
        return None  # the children's threads are not replayed


def _waiting(request: ChildRequest) -> ResumeTicket:
    """A child's ticket, as its parent sees it (only its correlation is recorded)."""
    return ResumeTicket(
        correlation=CorrelationId(f"{request.child_run}:replayed"),
        run_id=request.child_run,
        thread_id=request.child_thread,
        target=UserInputTarget(),
    )


def fed_stop(engine: Engine, reason: str) -> None:
    """Stop the replaying engine with the recording's reason as it was kept: not a
    caller's, to be checked again (one recorded before blank reasons were refused, or a
    tool's own, replays as it was)."""
    engine.stop_reason = reason
    engine.cancel()
