"""OpenTelemetry spans of Runs: the one place Ratchet makes spans (DESIGN §12).

With tracing on, each drive of a Run (a start, a recovery, a resume) is a span tree::

    ratchet.run                 thread, run id, agent, way in; at the end its state
      ratchet.step              the Step's number
        chat {model}            one per inference attempt (GenAI conventions)
        execute_tool {tool}     one per call attempt: operation id, attempt, outcome
        ratchet.commit {label}  one per commit: label, the version it made

A drive records its span's W3C traceparent in the Run's state (``run:trace``, the last
``KEEP`` drives) with the first commit it makes anyway, so a later drive of the same
Run — recovered after a crash, or resumed after a wait — links to the earlier ones.

**On or off.** Tracing is on when an OpenTelemetry SDK tracer provider is set (the
global one, or ``enable(provider)``) and ``OTEL_SDK_DISABLED`` is not ``true``; it is
decided once, at a process's first drive, and again only after ``enable``, ``disable``
or ``runtime.tracing_env.configure_from_env``. Off, the engine's calls here return at
once: no span, no context object, no attribute, nothing added to a commit. Nothing
imports ``opentelemetry`` until tracing is asked for, so ``import runtime`` costs what
it did. The set-up from ``OTEL_*`` and the context carried between processes are
``runtime.tracing_env``'s.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from runtime.limits import printable
from runtime.state import Command
from runtime.tracing_guard import current, ended, injected, propagator, started
from runtime.usage import admitted_usage

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from runtime.batch import ActiveToolBatch
    from runtime.commit import Frontier, Receipt
    from runtime.ids import CallId
    from runtime.models import InferenceRequest
    from runtime.ports import ToolInvocation

log = logging.getLogger("ratchet.tracing")
P = ParamSpec("P")
T = TypeVar("T")

TRACE_KEY = "trace"
"""Run-state key: the W3C traceparents of the Run's drives, oldest first."""
KEEP = 8
"""How many drives' traceparents a Run keeps (a later drive links to each)."""
SCOPE = "ratchet"
ATTRIBUTE_ID_CHARS = 1024
"""The most of a caller's id a drive's span shows before the engine has checked it."""


class _Switch:
    decided = False
    tracer: Tracer | None = None


_switch = _Switch()


def enable(provider: TracerProvider | None = None) -> None:
    """Trace from now on into ``provider`` (None: the global tracer provider)."""
    from opentelemetry import trace

    _switch.tracer = (provider or trace.get_tracer_provider()).get_tracer(SCOPE)
    _switch.decided = True


def disable() -> None:
    """Make no span from now on (until ``enable``)."""
    _switch.tracer, _switch.decided = None, True


def active() -> bool:
    """Whether drives started now make spans."""
    return _tracer() is not None


def decide_again() -> None:
    """Look at the tracer provider again at the next drive (one was just set up)."""
    _switch.decided = False


def _tracer() -> Tracer | None:
    if not _switch.decided:
        _decide()
    return _switch.tracer


def _decide() -> None:
    _switch.decided, _switch.tracer = True, None
    if sdk_disabled() or "opentelemetry.trace" not in sys.modules:
        return  # nobody imported the API: no provider can have been set
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        _switch.tracer = provider.get_tracer(SCOPE)


def sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


# ---- a drive ---------------------------------------------------------------------------


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Drivable(Protocol):
    """An Engine, as far as tracing its drives goes (typed so: no import circle)."""

    trace: RunTrace | None

    @property
    def root(self) -> _Named: ...


class _Working(Protocol):
    """A RunContext: the Run's working copy."""

    @property
    def frontier(self) -> Frontier: ...


E = TypeVar("E", bound=Drivable)


def drive(
    way: Callable[Concatenate[E, P], Awaitable[Frontier]],
) -> Callable[Concatenate[E, P], Coroutine[Any, Any, Frontier]]:
    """Decorate a way into a Run (``Engine.start``, ``recover``, ``resume``): with
    tracing on, the drive is a ``ratchet.run`` span, current while it runs."""
    name = way.__name__

    @functools.wraps(way)
    async def traced(engine: E, /, *args: P.args, **kwargs: P.kwargs) -> Frontier:
        tracer = _tracer()
        if tracer is None:
            return await way(engine, *args, **kwargs)
        first = args[0] if args else None
        if name == "resume":
            thread, run = getattr(first, "thread_id", None), getattr(first, "run_id", None)
        else:
            thread, run = first, kwargs.get("run_id")
        return await _driven(
            tracer, engine, name, thread, run, lambda: way(engine, *args, **kwargs)
        )

    return traced


async def _driven(
    tracer: Tracer,
    engine: Drivable,
    way: str,
    thread: object,
    run: object,
    go: Callable[[], Awaitable[Frontier]],
) -> Frontier:
    attributes = {"ratchet.agent": engine.root.name, "ratchet.run.way": way}
    # the caller's ids, before the engine has checked them: made exportable (a lone
    # surrogate fails an OTLP batch's encoding, dropping other Runs' spans with it) and
    # short; a drive that comes to rest sets the frontier's own (``_rested``)
    if isinstance(thread, str):
        attributes["ratchet.thread.id"] = printable(thread, ATTRIBUTE_ID_CHARS)
    if isinstance(run, str):
        attributes["ratchet.run.id"] = printable(run, ATTRIBUTE_ID_CHARS)
    with current(tracer, "ratchet.run", attributes=attributes) as span:
        if not span.get_span_context().is_valid:  # refused by a span processor: untraced
            return await go()
        engine.trace = RunTrace(tracer, span)
        try:
            frontier = await go()
        finally:
            engine.trace = None
        _rested(span, frontier)
        return frontier


def _rested(span: Span, frontier: Frontier) -> None:
    """The drive's outcome on its span: the Run's state, its end cause, ERROR if failed."""
    from opentelemetry.trace import StatusCode

    span.set_attribute("ratchet.thread.id", frontier.thread_id)
    if frontier.run_id is not None:
        span.set_attribute("ratchet.run.id", frontier.run_id)
    state = frontier.run_state
    if state is None:
        return
    span.set_attribute("ratchet.run.state", state.kind)
    cause = getattr(state, "cause", None)
    if cause is not None:
        span.set_attribute("ratchet.run.cause", cause.kind)
        if cause.kind == "failed":
            span.set_status(StatusCode.ERROR, f"{cause.failure}/{cause.code}")


class RunTrace:
    """One drive's span, and what its first commit records of it."""

    def __init__(self, tracer: Tracer, span: Span) -> None:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.span = span
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers, set_span_in_context(span))
        self.traceparent = headers["traceparent"]
        self.stamped = False
        """The drive's traceparent is committed: later commits carry nothing."""
        self._offered: tuple[str, ...] | None = None

    def stamp(self, frontier: Frontier, run_id: str, label: str) -> tuple[Command, ...]:
        """The command recording this drive in ``run:trace``, for the drive's first
        commit (a ``status`` commit carries nothing but the status: the next one)."""
        self._offered = None
        if self.stamped or label == "status":
            return ()
        self.span.set_attribute("ratchet.run.id", run_id)
        run = frontier.state["run"] if run_id == frontier.run_id else {}
        self._offered = earlier = tuple(run.get(TRACE_KEY, ()))
        value = [*earlier[-(KEEP - 1) :], self.traceparent]
        return (Command(key=TRACE_KEY, scope="run", value=value),)

    async def commit(self, label: str, append: Callable[[], Awaitable[Receipt]]) -> Receipt:
        """``append``, as a ``ratchet.commit {label}`` span."""
        from opentelemetry.trace import SpanKind

        with current(
            self.tracer,
            f"ratchet.commit {label}",
            kind=SpanKind.CLIENT,
            attributes={"ratchet.commit.label": label},
        ) as span:
            receipt = await append()
            span.set_attribute("ratchet.commit.version", receipt.seq)
            span.set_attribute("ratchet.commit.group_size", receipt.group)
        if self._offered is not None:  # this commit recorded the drive: link the earlier
            self.stamped = True
            for earlier in self._offered:
                _link(self.span, earlier)
            self._offered = None
        return receipt

    async def step(self, number: int, work: Awaitable[T]) -> T:
        with current(self.tracer, "ratchet.step", attributes={"ratchet.step": number}):
            return await work


def _link(span: Span, traceparent: object) -> None:
    """Link ``span`` to an earlier drive's span, named by its committed traceparent."""
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not isinstance(traceparent, str):
        return
    earlier = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    context = get_current_span(earlier).get_span_context()
    if context.is_valid:
        span.add_link(context, {"ratchet.link": "earlier_drive"})


def step(driven: Drivable, ctx: _Working, work: Awaitable[T]) -> Awaitable[T]:
    """``work`` (a Step, or carrying on a recovered Step's open batch) as a
    ``ratchet.step`` span; itself when the drive is not traced."""
    trace = driven.trace
    if trace is None:
        return work
    frontier = ctx.frontier
    batch = frontier.batch
    number = batch.step if batch is not None and not batch.all_terminal else frontier.steps
    return trace.step(number, work)


# ---- inference and tools ---------------------------------------------------------------


def inference(
    trace: RunTrace | None,
    model: object,
    ctx: _Working,
    request: InferenceRequest,
    work: Awaitable[T],
) -> Awaitable[T]:
    """One inference attempt as a GenAI ``chat {model}`` span, in the tracer of the drive
    ``trace`` is (tracing switched on during an untraced drive makes no orphan span);
    ``work`` itself when the drive is not traced."""
    if trace is None:
        return work
    return _inference(trace.tracer, model, request, ctx.frontier.thread_id, work)


async def _inference(
    tracer: Tracer, model: object, request: InferenceRequest, thread: str, work: Awaitable[T]
) -> T:
    from opentelemetry.trace import SpanKind

    name = getattr(model, "model", None)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.conversation.id": thread,
        "ratchet.step": request.step,
        "ratchet.inference.attempt": request.attempt,
    }
    for attribute, value in (
        ("gen_ai.request.model", name),
        ("gen_ai.provider.name", getattr(model, "provider_name", None)),
        ("gen_ai.request.max_tokens", getattr(model, "max_tokens", None)),
    ):
        if isinstance(value, str | int) and value:
            attributes[attribute] = value
    span_name = f"chat {name}" if isinstance(name, str) and name else "chat"
    with current(tracer, span_name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        try:
            response = await work
        except BaseException as exc:
            code = getattr(exc, "code", None)
            span.set_attribute("error.type", code if isinstance(code, str) else type(exc).__name__)
            raise
        # as the Run commits it: a provider's own report may hold a count past 2**63 or
        # a model id with a lone surrogate, which OTLP cannot encode (its exporter drops
        # the whole batch, other Runs' spans too), or counts the Run did not believe
        usage = admitted_usage(getattr(response, "usage", None))
        if usage is not None:
            if usage.model:
                span.set_attribute("gen_ai.response.model", usage.model)
            span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
        return response


class ToolCalls:
    """The ``execute_tool`` spans of one wave's calls, from dispatch to the recorded
    outcome; a call's context travels with its invocation (``carried``)."""

    def __init__(self, tracer: Tracer, batch: ActiveToolBatch, wave: Sequence[CallId]) -> None:
        from opentelemetry.trace import SpanKind

        self.spans: dict[CallId, Span] = {}
        for call_id in wave:
            call = batch.call(call_id)
            self.spans[call_id] = started(
                tracer,
                f"execute_tool {call.tool}",
                kind=SpanKind.INTERNAL,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": call.tool,
                    "gen_ai.tool.call.id": call_id,
                    "ratchet.operation.id": call.operation_id,
                    "ratchet.tool.attempt": call.attempts,
                },
            )

    def carried(self, invocations: list[ToolInvocation]) -> list[ToolInvocation]:
        """The invocations, each with its call's span as ``trace_context``."""
        from opentelemetry.trace import set_span_in_context

        if propagator() is None:
            return invocations
        carried = []
        for invocation in invocations:
            headers = injected(set_span_in_context(self.spans[invocation.call_id]))
            carried.append(invocation.model_copy(update={"trace_context": headers or None}))
        return carried

    def done(self, batch: ActiveToolBatch, outcomes: Sequence[object]) -> None:
        """End each call's span with its outcome as recorded in ``batch``: ``completed``,
        ``lost`` (tried again), ``indeterminate``, ``unavailable`` or ``awaiting``."""
        from opentelemetry.trace import StatusCode

        for (call_id, span), outcome in zip(self.spans.items(), outcomes, strict=True):
            kind = getattr(outcome, "kind", None)
            if kind == "finished":
                verdict = "completed"
            elif kind == "lost":
                lost = batch.call(call_id).phase.kind == "indeterminate"
                verdict = "indeterminate" if lost else "lost"
            else:
                verdict = "unavailable" if kind == "unavailable" else "awaiting"
            span.set_attribute("ratchet.tool.outcome", verdict)
            output = getattr(outcome, "output", None)
            failed = verdict not in ("completed", "awaiting") or bool(
                getattr(output, "is_error", 0)
            )
            if failed:
                span.set_attribute(
                    "error.type", "tool_error" if verdict == "completed" else verdict
                )
                span.set_status(StatusCode.ERROR)
            ended(span)
        self.spans = {}

    def __enter__(self) -> ToolCalls:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> None:
        from opentelemetry.trace import StatusCode

        for span in self.spans.values():  # the wave did not get its outcomes
            if error is not None:
                span.record_exception(error)
                span.set_attribute("error.type", type(error).__name__)
                span.set_status(StatusCode.ERROR)
            ended(span)
        self.spans = {}


class _NoToolCalls:
    """Tracing off: nothing to start, carry or end."""

    def carried(self, invocations: list[ToolInvocation]) -> list[ToolInvocation]:
        return invocations

    def done(self, batch: ActiveToolBatch, outcomes: Sequence[object]) -> None:
        return None

    def __enter__(self) -> _NoToolCalls:
        return self

    def __exit__(self, *_: object) -> None:
        return None


NO_TOOL_CALLS = _NoToolCalls()


ToolSpans = ToolCalls | _NoToolCalls


def tool_calls(trace: RunTrace | None, batch: ActiveToolBatch, wave: Sequence[CallId]) -> ToolSpans:
    """The spans of a wave's calls, started now in the drive's tracer (a no-op when the
    drive is not traced)."""
    if trace is None:
        return NO_TOOL_CALLS
    return ToolCalls(trace.tracer, batch, wave)
