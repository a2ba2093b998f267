"""Tracing's surroundings: the SDK set up from ``OTEL_*``, and the trace context carried
from process to process (no span is made here: ``runtime.tracing`` makes them).

**Set-up.** A process that drives Runs or runs their tools (the in-process runner's,
a RunHost, a ToolExecutor) calls ``configure_from_env`` once: when the environment
asks for spans, the SDK's own environment configuration builds the tracer provider
(``opentelemetry.sdk._configuration``, as ``opentelemetry-instrument`` does).

**Propagation.** ``carrier()`` is the current span's context as W3C headers
(``opentelemetry.propagate``: ``OTEL_PROPAGATORS``, by default ``tracecontext`` and
``baggage``); the cluster client sends it with a start or a resume, the engine sends
each tool call's in ``ToolInvocation.trace_context``. ``continued`` and ``within`` make
such headers the parent of what runs inside them: a RunHost's drive, a tool wherever
it runs, the Run an HTTP request starts. None of it imports ``opentelemetry`` until
there is something to carry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from collections.abc import Awaitable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar

from runtime import tracing, tracing_guard
from runtime.tracing import SCOPE, sdk_disabled

log = logging.getLogger("ratchet.tracing")
T = TypeVar("T")

TRACE_FILE_ENV = "RATCHET_TRACE_FILE"
"""A debugging aid: every span of the process, one JSON object a line, appended here."""
_configured = False


def configure_from_env() -> None:
    """Set up the SDK's tracer provider from the ``OTEL_*`` environment, once per process.

    Only if tracing is asked for (``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT``
    or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``RATCHET_TRACE_FILE``), not disabled
    (``OTEL_SDK_DISABLED``), ``opentelemetry-sdk`` is installed and the process has no
    tracer provider yet (an application's own set-up wins). The SDK reads the rest:
    exporters by name, sampler, resource, OTLP endpoint, headers and protocol. An
    endpoint without ``OTEL_TRACES_EXPORTER`` means ``otlp``, as with the distro.
    """
    global _configured
    if _configured:
        return
    _configured = True
    env = os.environ
    names = env.get("OTEL_TRACES_EXPORTER", "").strip()
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    path = env.get(TRACE_FILE_ENV)
    if sdk_disabled() or not (names or endpoint or path):
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk._configuration import _initialize_components
    except ImportError:
        log.warning("tracing asked for, but opentelemetry-sdk is not installed: no spans")
        return
    except Exception as exc:  # the SDK reads OTEL_SPAN_*_LIMIT as it is imported
        log.warning("tracing not configured from the environment: %s", exc)
        return
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    try:
        file = _file_processor(path) if path else None
    except Exception as exc:  # a path that is no file to append to: no file spans, said once
        log.warning("no spans written to %s=%r: %s", TRACE_FILE_ENV, path, exc)
        if not (names or endpoint):
            return
        file = None
    try:
        _initialize_components(
            trace_exporter_names=[] if names or not endpoint else ["otlp"],
            resource_attributes=_resource(env),
        )
        provider: Any = trace.get_tracer_provider()  # the SDK's, just set
        if file is not None:
            provider.add_span_processor(file)
    except Exception as exc:  # a missing exporter package, a bad value: no spans, said once
        log.warning("tracing not configured from the environment: %s", exc)
        return
    tracing.decide_again()  # the next drive looks at the new provider


def _resource(env: Mapping[str, str]) -> dict[str, Any]:
    named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return {"process.pid": os.getpid(), **({} if named else {"service.name": SCOPE})}


def _file_processor(path: str) -> Any:
    """The SDK's console exporter, writing each span as one JSON line to ``path`` (many
    processes may share the file: each line is appended whole, flushed at once)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    # a regular file only: each span is written as it ends, on the loop that ended it,
    # and a pipe nobody reads blocked the process at its open, one that fills at a write
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError("not a regular file")
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115  (open for the process's life)
    exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
    return SimpleSpanProcessor(exporter)


# ---- propagation -----------------------------------------------------------------------


def carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers (``traceparent``), or None if there is
    none: what a caller sends with a start or a resume."""
    if "opentelemetry.context" not in sys.modules:
        return None
    from opentelemetry import trace

    if not trace.get_current_span().get_span_context().is_valid:
        return None
    return tracing_guard.injected() or None


@contextlib.contextmanager
def continued(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Inside, the context ``headers`` carry (W3C ``traceparent``) is the current one."""
    carried = tracing_guard.extracted(headers) if headers and "traceparent" in headers else None
    if carried is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(carried)
    try:
        yield
    finally:
        context.detach(token)


def within(
    headers: Mapping[str, str] | None, work: Coroutine[Any, Any, T]
) -> Coroutine[Any, Any, T]:
    """``work``, awaited as a child of the context ``headers`` carry (itself if none)."""
    if not headers:
        return work
    return _within(headers, work)


async def _within(headers: Mapping[str, str], work: Awaitable[T]) -> T:
    with continued(headers):
        return await work
