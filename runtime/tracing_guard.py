"""Tracing that no tracing set-up can break a Run with.

The SDK calls an application's span processors as a span starts and ends, and the API
its global text-map propagator as a context is carried, and both let what those raise
through, to whoever started the span or carried the context: here, a Run. What they
raise costs spans or a carried context (said once a process), never the Run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("ratchet.tracing")

_said = False
"""What tracing's set-up raised was logged (once a process)."""
_propagate: Any = None
"""``opentelemetry.propagate`` once imported; False where its import failed."""


def started(tracer: Tracer, name: str, **options: Any) -> Span:
    try:
        return tracer.start_span(name, **options)
    except Exception as exc:  # a span processor's on_start: the span is lost, not the Run
        _broken(exc)
        from opentelemetry.trace import INVALID_SPAN

        return INVALID_SPAN


def ended(span: Span) -> None:
    try:
        span.end()
    except Exception as exc:  # a span processor's on_end: the span is lost, not the Run
        _broken(exc)


@contextlib.contextmanager
def current(tracer: Tracer, name: str, **options: Any) -> Iterator[Span]:
    """``tracer.start_as_current_span``: an error inside is recorded on the span, which
    is ended when the block is left."""
    from opentelemetry.trace import use_span

    span = started(tracer, name, **options)
    try:
        with use_span(span, end_on_exit=False):
            yield span
    finally:
        ended(span)


def _broken(exc: Exception) -> None:
    global _said
    if not _said:
        _said = True
        log.warning("tracing's set-up raised (spans or their links are missing): %r", exc)


def injected(context: Any = None) -> dict[str, str]:
    """The W3C headers that carry ``context`` (the current one if None); none where no
    propagator is installed or it raised."""
    propagate = propagator()
    if propagate is None:
        return {}
    headers: dict[str, str] = {}
    try:
        propagate.inject(headers, context=context)
    except Exception as exc:  # the application's propagator: no context is carried
        _broken(exc)
        return {}
    return headers


def extracted(headers: Mapping[str, str]) -> Any:
    """The context ``headers`` carry, or None where no propagator is installed or it
    raised (the work then goes on in the current context)."""
    propagate = propagator()
    if propagate is None:
        return None
    try:
        return propagate.extract(headers)
    except Exception as exc:  # the application's propagator: the work is not continued
        _broken(exc)
        return None


def propagator() -> Any:
    """``opentelemetry.propagate``, or None where ``OTEL_PROPAGATORS`` names one that is
    not installed (its import raises): then no context is carried, said once."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate
        except Exception as exc:  # it reads OTEL_PROPAGATORS as it is imported: carry none
            log.warning("no trace context carried between processes: %s", exc)
            _propagate = False
        else:
            _propagate = propagate
    return _propagate or None
