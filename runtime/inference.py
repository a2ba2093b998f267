"""One inference of a Step: the stream checkpoint, the model call, live deltas, retries,
and what of the model's output may be committed (``admit_response``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from runtime import tracing
from runtime.agent import Agent, is_seconds
from runtime.attempts import AttemptDeadline, closed
from runtime.base import evolve, trusted
from runtime.checkpoint import PartialOutput, SafeCheckpoints, plan_from_checkpoint
from runtime.context import RunContext, has_landed
from runtime.errors import (
    InputRefused,
    ModelError,
    ModelRateLimited,
    ModelRefused,
    ModelUnavailable,
)
from runtime.events import Delta
from runtime.faults import Unwind
from runtime.ids import CallId, ThreadId, distinct_id
from runtime.lifecycle import Failed, PauseTarget, ResumeTicket
from runtime.limits import (
    CONTROL_CHARS,
    Limits,
    check_id,
    check_text,
    escaped_char,
    live_piece,
    printable,
    raised,
    said,
    short_code,
    stored_size,
    utf8_problem,
)
from runtime.messages import (
    AssistantMessage,
    ContextMessage,
    ToolResultMessage,
    ToolUse,
    UserMessage,
)
from runtime.models import InferenceRequest, ModelDelta, ModelResponse, Refusing
from runtime.signals import CancelledSignal, EndRun, PauseRun, cancelling
from runtime.timeutil import now_us
from runtime.usage import admitted_usage, usage_commands

log = logging.getLogger("ratchet.engine")
T = TypeVar("T")
MAX_RETRY_AFTER_S = 86_400.0
"""The longest wait a rate limit's hint is taken for."""
MAX_REPAUSE_S = 3_600.0
"""The longest a rate-limit pause grows to by following others in a row (a provider's
own hint may ask longer)."""
Guard = Callable[[Awaitable[Any]], Awaitable[Any]]
Publish = Callable[[ThreadId, Sequence[Delta]], None]


class Inference:
    """Asks the model for a Step; owned by one engine (it keeps the checkpoint's state)."""

    def __init__(
        self,
        agent: Agent,
        limits: Limits,
        checkpoints: SafeCheckpoints,
        checkpoint_interval_s: float,
        guard: Guard,
        is_cancelled: Callable[[], bool],
        publish: Publish | None,
    ) -> None:
        self.agent = agent
        self.limits = limits
        self.checkpoints = checkpoints
        self.checkpoint_interval_s = checkpoint_interval_s
        self.guard = guard
        self.is_cancelled = is_cancelled
        self.publish = publish
        self.use_checkpoint = False
        """Set by a recovery: the first Step may use the stream checkpoint."""
        self.checkpointed = False
        self.rate_limit_waited = 0.0
        """Seconds this engine's Run has spent waiting out rate limits."""
        self.paused_s = 0.0
        """How long the rate-limit pause this engine's Run was resumed from lasted, until
        an inference answers: a pause in a row with it lasts twice as long."""

    async def salvage(self, ctx: RunContext, step: int) -> Admitted | ContextMessage | None:
        """On the first Step after recovery only: what the stream checkpoint offers (a
        checkpoint is not trusted: one that breaks the limits is not used)."""
        if not self.use_checkpoint:
            return None
        self.use_checkpoint = False
        cp = await self.checkpoints.get(ctx.frontier.thread_id)
        self.checkpointed = cp is not None
        try:
            salvaged = plan_from_checkpoint(cp, ctx.run_id, step)
            if isinstance(salvaged, ModelResponse):
                return admit_response(salvaged, self.limits)
            if salvaged is not None:
                check_text(
                    "checkpoint", salvaged.text, self.limits.model_text_bytes, "model_text_bytes"
                )
        except (InputRefused, ValueError, TypeError, RecursionError) as exc:
            # ValueError: a malformed record, or arguments that are not JSON
            log.warning("stream checkpoint of %s not used: %r", ctx.run_id, exc)
            return None
        return salvaged

    async def step_committed(self, thread: ThreadId) -> None:
        """The Step's inference is committed: its checkpoint is spent."""
        await self._spend(thread)

    async def _spend(self, thread: ThreadId) -> None:
        """Delete the checkpoint this engine wrote (or took up). An attempt that failed
        spends its own too: a recovery must never take up what the runtime threw away (a
        complete tool call of a stream that was cut, or of a response refused, would be
        committed and run without the model being asked again)."""
        if self.checkpointed:
            self.checkpointed = False
            await self.checkpoints.delete(thread)

    async def infer(
        self,
        ctx: RunContext,
        step: int,
        history: tuple[Any, ...],
        last: bool,
        trace: tracing.RunTrace | None = None,
    ) -> Admitted:
        """Ask the model, streaming deltas live. Every failure of an attempt — the model
        raising, or answering what cannot be committed — is the model's: the inference is
        tried again, and after the last attempt the Run ends failed(inference)."""
        error: BaseException | None = None
        attempt = failures = 0
        while failures < self.agent.inference_attempts:
            if self.is_cancelled():
                raise CancelledSignal
            attempt += 1
            request = _request(self.agent, ctx, step, attempt, history, last, self.limits)
            try:
                streamed = self._stream(ctx, request)
                work = tracing.inference(trace, self.agent.model, ctx, request, streamed)
                response = await self.guard(work)
                self.paused_s = 0.0  # the rate limit is over: a later one starts afresh
                return admit_response(response, self.limits)
            except CancelledSignal:
                raise
            except ModelRefused as exc:  # asking again cannot help: the Run ends now
                await self._spend(ctx.frontier.thread_id)
                # an answer refused after it was made (a refusal, a cut) is billed: its
                # usage goes with the end
                ctx.spent = usage_commands(admitted_usage(exc.usage))
                raise EndRun(_failed(exc)) from None
            except ModelRateLimited as exc:  # wait it out, within the Run's budget
                await self._spend(ctx.frontier.thread_id)
                await self._back_off(ctx, exc, attempt)
                continue
            except asyncio.CancelledError as exc:
                if cancelling():
                    raise  # the Run's task is being cancelled: it goes on unwinding
                error = exc  # the model raised it on its own: its failure
                log.warning("inference attempt %d of run %s failed: %r", attempt, ctx.run_id, exc)
            except Unwind:
                raise  # a crash test's Crash, a replay's Halt: nothing settles
            except BaseException as exc:  # a model failure of any kind is the model's, not ours
                # (SystemExit and the like included: asyncio would re-raise them out of
                # the event loop, stopping every Run of the process)
                error = exc
                log.warning(
                    "inference attempt %d of run %s failed: %s", attempt, ctx.run_id, raised(exc)
                )
            await self._spend(ctx.frontier.thread_id)
            failures += 1
        assert error is not None
        raise EndRun(_failed(error))

    def resumed_from(self, ticket: ResumeTicket, paused_at_us: int) -> None:
        """The Run is resumed from ``ticket``'s wait, committed at ``paused_at_us``: a
        rate-limit pause's length is kept (``paused_s``)."""
        target = ticket.target
        if isinstance(target, PauseTarget) and target.reason == "rate_limit":
            lasted = ((target.resume_at_us or 0) - paused_at_us) / 1_000_000
            self.paused_s = min(max(lasted, 0.0), MAX_REPAUSE_S)  # clocks may have jumped

    async def _back_off(self, ctx: RunContext, limited: ModelRateLimited, attempt: int) -> None:
        """Wait as the provider asks (else 1, 2, 4 … s, at most 60); a wait past the Run's
        budget pauses the Run ``awaiting(pause(rate_limit))`` until then instead (twice
        as long as the pause it was resumed from, if it was: ``resumed_from``).

        The provider's hint is held between a floor that grows with the attempts (0.25,
        0.5, 1 … s: a "Retry-After: 0" answered again and again must not spin, nor wait
        nothing against the budget) and a day (a hint of 1e308 s is no time to resume at)."""
        hint = limited.retry_after_s
        backoff = min(2.0 ** min(attempt - 1, 6), 60.0)
        # a hint that is no number of seconds ("5", NaN, -1) is as none
        wait = min(max(hint, backoff / 4), MAX_RETRY_AFTER_S) if is_seconds(hint) else backoff
        log.info("run %s rate limited (%s): waiting %.1fs", ctx.run_id, limited.code, wait)
        if self.rate_limit_waited + wait > self.agent.rate_limit_wait_s:
            # a pause that follows one in a row is twice as long (each resume starts the
            # backoff over): a limit that lasts is asked ever less often, not at each
            # of the Supervisor's sweeps, two commits a time, until the history is full
            pause = max(wait, min(2 * self.paused_s, MAX_REPAUSE_S))
            resume_at = now_us() + int(pause * 1_000_000)
            raise PauseRun(PauseTarget(reason="rate_limit", resume_at_us=resume_at))
        self.rate_limit_waited += wait
        await self.guard(asyncio.sleep(wait))  # a cancel ends the wait

    async def _stream(self, ctx: RunContext, request: InferenceRequest) -> ModelResponse:
        """One attempt, within ``Agent.inference_timeout_s``; a close of its stream that
        hangs is cut ``CANCEL_GRACE_S`` past that. It runs in the Run's own task (a task
        of its own would cost the Step loop turns, and a fast model's commit its share
        of the results' group); a model that holds on to the deadline's cancellation
        (catches it, then waits on, or hangs closing its connection) is cancelled again
        every ``CANCEL_GRACE_S``. One that swallows every cancellation holds its Run, as
        a model that blocks the event loop holds every Run of the process."""
        limit = self.agent.inference_timeout_s
        items = self.agent.model.stream(request)
        deadline = AttemptDeadline(limit)
        try:
            try:
                async with deadline:
                    return await self._streamed(ctx, request, items)
            finally:  # an attempt given up closes its stream (and the provider's connection)
                await closed(items, deadline)
        except (TimeoutError, asyncio.CancelledError):
            if not deadline.ours():
                raise  # the model's own TimeoutError, or a real cancellation
            raise ModelUnavailable(
                "timeout", f"the inference took over {limit:g}s (inference_timeout_s)"
            ) from None
        finally:
            deadline.stop()

    async def _streamed(
        self, ctx: RunContext, request: InferenceRequest, items: AsyncIterator[Any]
    ) -> ModelResponse:
        response: ModelResponse | None = None
        partial = PartialOutput(run_id=request.run_id, step=request.step)
        checkpointing = self.checkpoints.store is not None  # else the partial is never read
        clock = asyncio.get_running_loop().time
        last_put = clock()
        halves: dict[tuple[str, str | None], str] = {}  # a character cut between chunks
        thread = ctx.frontier.thread_id
        streamed, most = 0, self.limits.response_bytes
        reasoned, most_reasoning = 0, self.limits.reasoning_bytes
        calls: dict[str | None, str] = {}  # the calls streamed so far, by id: their tool
        async for item in items:
            if isinstance(item, ModelResponse):
                response = item
                continue
            if isinstance(item, Refusing):  # a recovery must not take up its calls
                checkpointing = False
                await self._spend(thread)
                continue
            if not isinstance(item, ModelDelta):  # said now, not "ended without a response"
                raise TypeError(
                    f"the model stream yielded a {type(item).__name__:.80}, "
                    "not a ModelDelta or a ModelResponse"
                )
            # a stream longer than a response may be fails its attempt now, not once it
            # ends: each delta costs every follower of the thread (a character is a byte
            # at least, so the count of characters is a bound); every item counts one at
            # least, so that endless empty deltas or pings are cut too. Reasoning is no
            # part of the response (never committed): it has a bound of its own
            size = len(item.text) if isinstance(item, ModelDelta) else 0
            if isinstance(item, ModelDelta) and item.type == "reasoning_delta":
                reasoned += size
                size = 0
            elif isinstance(item, ModelDelta) and item.type == "tool_call_delta":
                size += _named(calls, item)
            streamed += max(size, 1)
            if streamed > most:
                raise InputRefused(
                    "model output", "response_bytes", f"streamed over {most} characters"
                )
            if reasoned > most_reasoning:
                raise InputRefused(
                    "model reasoning", "reasoning_bytes", f"over {most_reasoning} characters"
                )
            # calls (``_named`` took each id) are refused as they stream, not once thousands came
            if len(calls) > self.limits.tool_calls:
                raise InputRefused(
                    "model output", "tool_calls", f"over {self.limits.tool_calls} calls streamed"
                )
            if checkpointing:
                partial.add(item)
                # a checkpoint only of an inference whose input is committed: a recovery
                # takes it up, and must not beside results that never landed
                if clock() - last_put >= self.checkpoint_interval_s and has_landed(ctx):
                    await self.checkpoints.put(thread, partial.checkpoint())
                    self.checkpointed, last_put = True, clock()
            if self.publish is not None:
                key = (item.type, item.call_id)
                text, halves[key] = live_piece(halves.get(key, ""), item.text)
                if text or not item.text:  # not a chunk that was only a held half
                    delta = Delta(
                        type=item.type,
                        run_id=request.run_id,
                        step=request.step,
                        attempt=request.attempt,
                        text=text,
                    )
                    self.publish(thread, (delta,))
        if response is None:
            raise RuntimeError("the model stream ended without a complete response")
        return response


def _named(calls: dict[str | None, str], delta: ModelDelta) -> int:
    """The characters of a call's id and tool name that ``delta`` streams first: the id as
    its call first comes, the name as it first comes or changes. They are the provider's
    text as much as the arguments (an 8 MiB id per call was held, checkpointed and
    streamed until the response renamed it at its end), so ``response_bytes`` counts
    them too; a response's usual ids and names are a few dozen characters."""
    tool = delta.tool or ""
    known = calls.get(delta.call_id)
    if known is None:
        calls[delta.call_id] = tool
        return len(delta.call_id or "") + len(tool)
    if tool and tool is not known and tool != known:
        calls[delta.call_id] = tool
        return len(tool)
    return 0


_MESSAGE_TYPES = frozenset({UserMessage, AssistantMessage, ToolResultMessage, ContextMessage})


def _request(
    agent: Agent,
    ctx: RunContext,
    step: int,
    attempt: int,
    history: tuple[Any, ...],
    last: bool,
    limits: Limits,
) -> InferenceRequest:
    """The request; validated only if the history holds something other than our records.

    Validating committed messages again would cost more than the rest of building the
    request (it grows with the conversation); hook context that is not a ContextMessage
    record yet is validated (and coerced) as before. Each request gets its own copy of
    the tool schemas, as validation would give it, so a model cannot alter them.
    """
    tools = None if last else tuple(dict(t.schema()) for t in agent.tools)
    parts = {
        "run_id": ctx.run_id,
        "step": step,
        "attempt": attempt,
        "tools": tools,
        "system": agent.system,
        "json_depth": limits.json_depth,
    }
    if all(type(m) in _MESSAGE_TYPES for m in history):
        return trusted(InferenceRequest, messages=history, **parts)
    return InferenceRequest(messages=history, **parts)


def _failed(error: BaseException) -> Failed:
    """The end of a Run whose inference failed: the provider's code where it gave one."""
    if isinstance(error, ModelError):
        # a model's own error class may say 400 where a text is meant: its code is still
        # its code (anything else that is no text names the error's class)
        given: object = error.code
        if isinstance(given, int) and not isinstance(given, bool):
            code = str(given)
        else:
            code = given if isinstance(given, str) else type(error).__name__
    else:
        code = error.limit if isinstance(error, InputRefused) else type(error).__name__
    return Failed(failure="inference", code=short_code(code), message=said(error))


# ---- what of a response may be committed --------------------------------------------


class Admitted(ModelResponse):
    """A response fit to commit; ``refused`` holds, per call id, why that call's arguments
    were not kept (they are committed as ``{}``, and the call completes with the reason
    as a model-visible error instead of running)."""

    refused: dict[CallId, str] = {}


def admit_response(response: ModelResponse, limits: Limits) -> Admitted:
    """Check a model's response against the limits (``runtime.limits``).

    The text must be storable and within ``model_text_bytes``, and there may be at most
    ``tool_calls`` calls; otherwise this raises InputRefused (the attempt failed). A call
    whose id or tool name cannot be stored is renamed; arguments that cannot be stored
    or are over ``tool_arguments_bytes`` are refused for that call alone. Call ids that
    repeat are made unique.
    """
    if not isinstance(response, ModelResponse):
        raise TypeError(f"a model answers a ModelResponse, not {type(response).__name__}")
    check_text("model text", response.text, limits.model_text_bytes, "model_text_bytes")
    total = stored_size(response.text) + sum(
        stored_size(c.arguments) for c in response.tool_calls if isinstance(c.arguments, str)
    )
    if total > limits.response_bytes:
        raise InputRefused(
            "model output",
            "response_bytes",
            f"{total} bytes of text and arguments; the limit is {limits.response_bytes}",
        )
    if len(response.tool_calls) > limits.tool_calls:
        raise InputRefused(
            "model output",
            "tool_calls",
            f"{len(response.tool_calls)} tool calls; the limit is {limits.tool_calls}",
        )
    calls: list[ToolUse] = []
    refused: dict[int, str] = {}
    for i, use in enumerate(response.tool_calls):
        call_id = use.call_id if _storable_id(use.call_id, limits) else CallId(f"call-{i + 1}")
        name = use.tool if _storable_id(use.tool, limits) else _shown(use.tool, limits)
        arguments = use.arguments
        problem = _arguments_problem(arguments, limits)
        if problem is not None:
            refused[i] = f"arguments refused {problem}"
            arguments = "{}"
        same = (call_id, name, arguments) == (use.call_id, use.tool, use.arguments)
        if not same:  # each part checked above: text, not validated again
            use = trusted(ToolUse, call_id=call_id, tool=name, arguments=arguments)
        calls.append(use)
    unique = unique_calls(calls, limits)
    # every part is checked text now (the response's own record, or renamed above)
    return trusted(
        Admitted,
        text=response.text,
        tool_calls=unique,
        refused={unique[i].call_id: why for i, why in refused.items()},
        usage=admitted_usage(response.usage) if response.usage is not None else None,
    )


def _storable_id(value: str, limits: Limits) -> bool:
    if type(value) is str and value.isascii() and value.isprintable():  # the usual case
        return 0 < len(value) <= limits.id_chars
    try:
        check_id("id", value, limits)
    except InputRefused:
        return False
    return True


def _shown(name: str, limits: Limits) -> str:
    """A tool name that cannot be stored as given, made storable (it names no tool)."""
    shown = printable(name, limits.id_chars).encode("ascii", "backslashreplace").decode()
    shown = CONTROL_CHARS.sub(escaped_char, shown)
    return shown[: limits.id_chars] or "unnamed"


def _arguments_problem(arguments: str, limits: Limits) -> str | None:
    """Why the arguments cannot be kept, as "(rule): detail"; None if they can."""
    problem = utf8_problem(arguments)
    if problem is not None:
        return f"(utf8): {problem}"
    size = stored_size(arguments)
    if size > limits.tool_arguments_bytes:
        return f"(tool_arguments_bytes): {size} bytes; the limit is {limits.tool_arguments_bytes}"
    return None


def unique_calls(calls: Sequence[ToolUse], limits: Limits) -> tuple[ToolUse, ...]:
    """Models sometimes repeat a call id; rename repeats so every call stays addressable
    (and resumable: a renamed id stays within ``id_chars``)."""
    seen: set[str] = set()
    out = []
    for use in calls:
        cid = distinct_id(use.call_id or "call", seen, limits.id_chars)
        seen.add(cid)
        out.append(use if cid == use.call_id else evolve(use, call_id=CallId(cid)))
    return tuple(out)
