"""What each classified model failure does to a Run: a refusal ends it at once, a
transient failure is tried again, a rate limit is waited out within the Run's budget
and past it pauses the Run until the time the provider named."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import pytest

from runtime import (
    Agent,
    InferenceRequest,
    InProcessRunner,
    ModelDelta,
    ModelRateLimited,
    ModelRefused,
    ModelResponse,
    ModelUnavailable,
    answer,
    call,
    tool,
)
from runtime.lifecycle import Unpause
from runtime.timeutil import now_us
from storage.memory import MemoryCommitStore


class FailingModel:
    """Raises the errors planned for a Step, one per request, then answers it."""

    def __init__(
        self,
        errors: list[Exception],
        respond: Callable[[InferenceRequest], ModelResponse],
        at_step: int = 0,
    ) -> None:
        self.errors, self.respond, self.at_step = errors, respond, at_step
        self.requests: list[InferenceRequest] = []

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        self.requests.append(request)
        if request.step == self.at_step and self.errors:
            raise self.errors.pop(0)
        yield ModelDelta(text="partial ")
        yield self.respond(request)


def say(text: str) -> Callable[[InferenceRequest], ModelResponse]:
    return lambda request: ModelResponse(text=text)


def failure(f) -> tuple[str, str, str]:
    cause = f.run_state.cause
    return cause.failure, cause.code, cause.message


async def run(model, **agent) -> tuple[InProcessRunner, object]:
    runner = InProcessRunner(Agent(name="a", model=model, **agent), MemoryCommitStore())
    return runner, await runner.start("go", thread_id="t")


async def test_a_refused_request_ends_the_run_at_once_with_the_providers_message():
    model = FailingModel([ModelRefused("context_length", "too many tokens", status=400)], say("x"))
    _, f = await run(model, inference_attempts=5)
    assert failure(f) == ("inference", "context_length", "too many tokens")
    assert len(model.requests) == 1  # never asked again


async def test_a_transient_failure_is_tried_again_as_a_new_attempt():
    model = FailingModel([ModelUnavailable("status_500", "server error", status=500)], say("ok"))
    _, f = await run(model)
    assert f.run_state.cause.kind == "natural" and f.messages[-1].text == "ok"
    assert [r.attempt for r in model.requests] == [1, 2]


async def test_transient_failures_on_every_attempt_end_the_run_with_the_last_code():
    errors = [ModelUnavailable("timeout", "timed out"), ModelUnavailable("stream_cut", "cut")]
    _, f = await run(FailingModel(errors, say("never")))
    assert failure(f) == ("inference", "stream_cut", "cut")


async def test_a_rate_limit_within_the_budget_is_waited_out_without_using_an_attempt():
    limited = [ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=0.01)] * 3
    model = FailingModel(list(limited), say("ok"))
    _, f = await run(model, inference_attempts=1)
    assert f.run_state.cause.kind == "natural"
    assert [r.attempt for r in model.requests] == [1, 2, 3, 4]  # each try its own attempt


async def test_a_rate_limit_past_the_budget_pauses_the_run_until_the_named_time():
    @tool
    def noop() -> str:
        return "ok"

    hour = 3600.0
    limited = ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=hour)

    def respond(request: InferenceRequest) -> ModelResponse:
        if request.step == 0:
            return ModelResponse(tool_calls=(call("noop", "c1"),))
        return ModelResponse(text="done")

    # step 0 runs its tool; step 1 is rate limited for an hour: past the budget
    model = FailingModel([limited], respond, at_step=1)
    before = now_us()
    runner, f = await run(model, tools=[noop], rate_limit_wait_s=10)
    target = f.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "rate_limit")
    assert before + hour * 1e6 <= target.resume_at_us <= now_us() + hour * 1e6
    assert (f.status.state, f.status.reason) == ("idle", "awaiting_pause")
    done = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert done.run_state.cause.kind == "natural" and done.messages[-1].text == "done"
    assert [r.step for r in model.requests] == [0, 1, 1]  # the paused Step asked again


async def test_a_message_injected_before_a_paused_inference_is_sent_after_the_pause():
    """A hook injects a message, and the inference it would go with is rate limited past
    the budget: the pause committed the injection's removal without the message, which
    no model or history ever saw."""
    from runtime import Hook, HookOutput, InjectMessage

    asked: list[int] = []

    def step_start(h):  # once: the Step that starts again after the pause injects nothing
        asked.append(1)
        return HookOutput(reactions=[InjectMessage(text="policy: be brief")] * (len(asked) == 1))

    hour = 3600.0
    limited = ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=hour)
    model = FailingModel([limited], say("done"))
    runner, f = await run(model, rate_limit_wait_s=0, hooks=[Hook("StepStart", step_start)])
    assert f.run_state.ticket.target.reason == "rate_limit"
    done = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert done.run_state.cause.kind == "natural"
    sent = [m.text for m in model.requests[-1].messages if m.kind == "user"]
    assert "policy: be brief" in sent
    assert "policy: be brief" in [m.text for m in done.messages if m.kind == "user"]


class AlwaysLimited:
    """Rate limited on every request, with the same hint each time."""

    def __init__(self, hint: float | None) -> None:
        self.hint, self.requests = hint, 0

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        self.requests += 1
        raise ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=self.hint)
        yield  # an async generator that never yields


async def test_a_retry_after_of_zero_again_and_again_backs_off_and_pauses_the_run():
    """Waiting nothing would ask again at once, for ever, and never use the budget."""
    model = AlwaysLimited(0.0)
    _, f = await run(model, rate_limit_wait_s=1)
    target = f.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "rate_limit")
    assert model.requests == 3  # 0.25 s, then 0.5 s; the third wait is past the budget


async def test_an_absurd_retry_after_pauses_the_run_for_a_day_at_most():
    for hint in (1e308, float("inf"), float("nan"), 10**400):  # no float holds the last
        before = now_us()
        _, f = await run(AlwaysLimited(hint), rate_limit_wait_s=0)
        target = f.run_state.ticket.target
        assert (target.kind, target.reason) == ("pause", "rate_limit"), hint
        assert before < target.resume_at_us <= now_us() + 86_400 * 1_000_000, hint


async def test_a_hint_that_is_no_number_of_seconds_is_ignored_as_a_missing_one():
    """``retry_after_s="5"`` raised TypeError in the handler: the Run ended
    failed(internal) at once instead of backing off."""
    model = AlwaysLimited("5")  # type: ignore[arg-type]
    _, f = await run(model, rate_limit_wait_s=1.5)
    target = f.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "rate_limit")
    assert model.requests == 2  # 1 s of back-off as without a hint; the next is past the budget


async def test_a_model_error_whose_code_is_a_number_keeps_it():
    """``ModelRefused(400, ...)``: printing the code raised AttributeError, and the Run
    ended failed(internal) instead of failed(inference)."""
    for error, code in (
        (ModelRefused(400, "bad request"), "400"),  # type: ignore[arg-type]
        (ModelUnavailable(None, "gone"), "ModelUnavailable"),  # type: ignore[arg-type]
    ):
        _, f = await run(FailingModel([error] * 3, say("never")))
        assert failure(f)[:2] == ("inference", code)


class HoldsOnToItsCancellation:
    """A first attempt that keeps the deadline's cancellation to itself and waits on
    (``where="stream"``), or hangs in its cleanup as its stream is closed
    (``where="close"``); ``stop`` ends what is left of it with the test."""

    def __init__(self, where: str) -> None:
        self.where, self.requests, self.stop = where, 0, asyncio.Event()

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        self.requests += 1
        if request.attempt > 1:
            yield ModelResponse(text="second attempt")
            return
        try:
            yield ModelDelta(text="thinking")
            with contextlib.suppress(asyncio.CancelledError):  # the deadline's, kept
                await self.stop.wait()
            if self.where == "stream":
                await self.stop.wait()  # and on it waits
        finally:
            if self.where == "close":
                with contextlib.suppress(asyncio.CancelledError):
                    await self.stop.wait()
                await self.stop.wait()


@pytest.mark.parametrize("where", ["stream", "close"])
async def test_a_model_that_keeps_its_cancellation_is_cancelled_again(where: str) -> None:
    """inference_timeout_s bounds the whole attempt, its close included: the attempt was
    cancelled once, and a model that kept that to itself held the Run's Step as long as
    it liked."""
    model = HoldsOnToItsCancellation(where)
    try:
        async with asyncio.timeout(30):  # in this task, whose count of cancels is read below
            _, f = await run(model, inference_timeout_s=0.2)
    finally:
        model.stop.set()
    assert f.run_state.cause.kind == "natural" and f.messages[-1].text == "second attempt"
    assert model.requests == 2
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # every cancellation taken back


class _HangsClosing:
    """A stream (not a generator) whose ``aclose`` keeps the first cancellation to itself
    and waits on; it first yields ``first`` (or raises it)."""

    def __init__(self, first: object, stop: asyncio.Event) -> None:
        self.first, self.stop, self.closes = first, stop, 0

    def __aiter__(self) -> _HangsClosing:
        return self

    async def __anext__(self) -> object:
        if isinstance(self.first, BaseException):
            raise self.first
        if self.first is None:
            raise StopAsyncIteration
        item, self.first = self.first, None
        return item

    async def aclose(self) -> None:
        self.closes += 1
        with contextlib.suppress(asyncio.CancelledError):
            await self.stop.wait()
        await self.stop.wait()


class HangsClosing:
    def __init__(self, first: object) -> None:
        self.first, self.stop, self.streams = first, asyncio.Event(), []

    def stream(self, request: InferenceRequest) -> _HangsClosing:
        first = self.first if request.attempt == 1 else ModelResponse(text="second attempt")
        self.streams.append(_HangsClosing(first, self.stop))
        return self.streams[-1]


@pytest.mark.parametrize(
    ("first", "ends"),
    [
        (ModelResponse(text="answered"), ("natural", "answered")),
        # the close cut past the deadline: the refusal stands, not asked again
        (ModelRefused("context_length", "too long"), ("failed", "context_length")),
    ],
    ids=["answer", "refusal"],
)
async def test_a_close_that_hangs_is_cut_and_the_attempt_s_outcome_stands(first, ends) -> None:
    model = HangsClosing(first)
    try:
        async with asyncio.timeout(30):
            _, f = await run(model, inference_timeout_s=0.2)
    finally:
        model.stop.set()
    cause = f.run_state.cause
    said = f.messages[-1].text if cause.kind == "natural" else cause.code
    assert (cause.kind, said) == ends
    assert len(model.streams) == 1 and model.streams[0].closes == 1
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_stream_item_that_is_no_delta_is_named_in_the_failure():
    """A dict in the stream was passed over, and the attempt said the stream "ended
    without a complete response" instead."""

    class Odd:
        async def stream(self, request: InferenceRequest) -> AsyncIterator[object]:
            yield {"text": "hi"}
            yield ModelResponse(text="hi")

    _, f = await run(Odd(), inference_attempts=1)
    assert failure(f)[:2] == ("inference", "TypeError")
    assert "yielded a dict, not a ModelDelta" in failure(f)[2]


async def test_an_attempt_s_deadline_is_asyncio_timeout_s_with_one_timer() -> None:
    """``AttemptDeadline`` is ``asyncio.timeout`` to the letter: its expiry is a TimeoutError,
    a cancellation asked by anyone else stays one; in time, it leaves no timer set."""
    from runtime.attempts import AttemptDeadline

    deadline = AttemptDeadline(0.01)
    with pytest.raises(TimeoutError):
        async with deadline:
            await asyncio.sleep(1)
    assert deadline.ours() and deadline.expired
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0

    async def cancelled_meanwhile() -> None:
        deadline = AttemptDeadline(0.01)
        try:
            async with deadline:
                asyncio.get_running_loop().call_later(0.005, inner.cancel)
                await asyncio.sleep(1)
        finally:
            assert not deadline.ours()  # a real cancellation, not the deadline's
            deadline.stop()

    inner = asyncio.create_task(cancelled_meanwhile())
    with pytest.raises(asyncio.CancelledError):
        await inner

    deadline = AttemptDeadline(5)
    async with deadline:
        await asyncio.sleep(0)
    assert not deadline.expired and deadline._timer is None
    deadline.stop()


def _paused_for_s(f) -> float:
    """How long the committed rate-limit pause lasts (its time, from its commit's)."""
    target = f.run_state.ticket.target
    assert (target.kind, target.reason) == ("pause", "rate_limit")
    return (target.resume_at_us - f.status.since) / 1e6


async def test_rate_limit_pauses_in_a_row_grow_and_start_afresh_once_answered():
    """Each resume starts the backoff over, so a limit that lasts paused the Run for
    the same quarter of a second again and again: on a cluster it was woken at every
    sweep, two commits a time, until its thread's history was full. Now each pause in a
    row lasts twice the one before; an inference that answers ends the row."""
    model = AlwaysLimited(0.0)
    runner, f = await run(model, rate_limit_wait_s=0)
    pauses = [_paused_for_s(f)]
    for _ in range(3):
        f = await runner.resume(answer(f.run_state.ticket, Unpause()))
        pauses.append(_paused_for_s(f))
    assert pauses[0] < 1
    for before, after in itertools.pairwise(pauses):
        assert after >= 1.5 * before, pauses
    # the limit ends, then comes back at a later Step: its pause is short again
    limited = ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=0.0)

    def respond(request: InferenceRequest) -> ModelResponse:
        if request.step == 0:
            return ModelResponse(tool_calls=(call("noop", "c1"),))
        return ModelResponse(text="done")

    @tool
    def noop() -> str:
        return "ok"

    model2 = FailingModel([limited], respond, at_step=0)
    runner, f = await run(model2, tools=[noop], rate_limit_wait_s=0)
    first = _paused_for_s(f)
    model2.errors, model2.at_step = [limited], 1
    f = await runner.resume(answer(f.run_state.ticket, Unpause()))
    assert _paused_for_s(f) < 1.5 * first  # not a pause in a row: step 0 was answered
