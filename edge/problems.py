"""Every error the service answers is an RFC 9457 problem (``application/problem+json``).

    {"type": "urn:ratchet:problem:ResumeRejected", "title": "Resume rejected",
     "status": 409, "detail": "resume rejected on payload: expected ...",
     "kind": "ResumeRejected", "instance": "/threads/t1/resume", "axis": "payload"}

``kind`` is the RatchetError's class name when the runtime refused (its message is the
detail: Ratchet's errors are written for callers and never hold a credential), and
otherwise names the HTTP-level problem: ``Unauthorized``, ``ThreadNotFound``,
``ValidationError``, ``NotFound``, ``InternalError``. Extra members: ``axis``
(ResumeRejected: the axis of the ticket that did not match), ``limit`` (InputRefused:
the limit broken) and ``errors`` (ValidationError: pydantic's list).

What status each RatchetError gets is decided here, once (``status_of``).
"""

from __future__ import annotations

import logging
import re
import sys
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from cluster.config import ClusterUnavailable
from edge.strict_json import DuplicateKey
from runtime.errors import (
    AgentImportError,
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    HistoryLimitReached,
    InputRefused,
    InvalidTransition,
    PayloadTooLarge,
    RatchetError,
    ResumeRejected,
    RunEnded,
    RunSuperseded,
    StoreError,
    StoreLost,
    StoreUnavailable,
    SystemInUse,
    VersionConflict,
)
from runtime.limits import printable, too_many_digits

log = logging.getLogger("ratchet.edge")
PROBLEM_JSON = "application/problem+json"

_STATUS: tuple[tuple[type[Exception], int], ...] = (
    # most specific first: the first class an error is an instance of decides
    (ResumeRejected, 409),
    (InvalidTransition, 409),
    (RunEnded, 409),
    (RunSuperseded, 409),
    (VersionConflict, 409),
    (Fenced, 409),
    (DuplicateOperation, 409),
    (AgentImportError, 422),
    (PayloadTooLarge, 413),
    (StoreUnavailable, 503),
    (SystemInUse, 503),
    (StoreLost, 503),
    (CorruptRecord, 500),
    (StoreError, 503),  # StoreTooNew and the like: this server's store cannot serve now
    (ClusterUnavailable, 503),
    (TimeoutError, 504),
)


class Problem(BaseModel):
    """An RFC 9457 problem, as every error response of the service carries it."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    kind: str
    """The RatchetError's class name, or the HTTP-level problem's name."""
    instance: str | None = None
    axis: str | None = None
    """ResumeRejected: the ticket's axis that did not match (``payload``, ``call_id``, …)."""
    limit: str | None = None
    """InputRefused: the limit (a field of ``runtime.limits.Limits``) or rule broken."""


class HttpProblem(Exception):
    """A problem the edge itself finds (no RatchetError names it): an unknown thread, a
    missing token, a malformed stream offset."""

    def __init__(self, status: int, kind: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail, self.extra = status, kind, detail, extra


def status_of(exc: Exception) -> int:
    if isinstance(exc, HistoryLimitReached):  # the thread's, not the request's size
        return 409
    if isinstance(exc, InputRefused):
        # a size over its limit is "too large"; bad text, depth or type is unprocessable
        return 413 if exc.limit.endswith("_bytes") else 422
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def problem_response(
    status: int,
    kind: str,
    detail: str,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body = problem_body(status, kind, detail, instance, **extra)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def problem_body(
    status: int, kind: str, detail: str, instance: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": f"urn:ratchet:problem:{kind}",
        "title": _title(kind),
        "status": status,
        "detail": detail,
        "kind": kind,
    }
    if instance is not None:
        body["instance"] = instance
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _title(kind: str) -> str:
    """``ResumeRejected`` → ``Resume rejected``: the same for every problem of its kind."""
    words = re.findall(r"[A-Z][a-z]*|[a-z]+|\d+", kind) or [kind]
    return " ".join([words[0], *(w.lower() for w in words[1:])])


def ratchet_problem(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, ResumeRejected):
        extra["axis"] = exc.axis
    if isinstance(exc, InputRefused):
        extra["limit"] = exc.limit
    if status >= 500:
        log.warning("%s on %s: %s", type(exc).__name__, request.url.path, exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    return problem_response(
        status, type(exc).__name__, str(exc), request.url.path, headers=headers, **extra
    )


def http_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpProblem)
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return problem_response(
        exc.status, exc.kind, exc.detail, request.url.path, headers=headers, **exc.extra
    )


def validation_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    every = exc.errors()
    errors = [_plain(e) for e in every[:ERRORS_SHOWN]]
    for error in errors:  # pydantic's checks of a text's length or pattern meet it first
        if error.get("type") == "string_unicode":
            where = ".".join(str(p) for p in error.get("loc", ()))
            unpaired = "not valid Unicode text (an unpaired surrogate)"
            return ratchet_problem(request, InputRefused(where, "utf8", unpaired))
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    detail = f"{where}: {first.get('msg', 'invalid')}" if first else "invalid request"
    more = f" (and {len(every) - 1} more)" if len(every) > 1 else ""
    return problem_response(422, "ValidationError", detail + more, request.url.path, errors=errors)


ERRORS_SHOWN = 20
"""pydantic's errors a 422 lists (its detail counts them all): a body of 45,000 unknown
keys made a 4 MB answer of one error each."""
_SHOWN_CHARS = 200


def _plain(error: Any) -> dict[str, Any]:
    """pydantic's error without the input it refused (it may be huge, or a secret) and
    without its context objects (not JSON); its message and the keys of its location
    cut short, since both can hold the input (a union's tag, an unknown key)."""
    loc = [p[:_SHOWN_CHARS] if isinstance(p, str) else p for p in error.get("loc", ())]
    plain = {"type": error.get("type"), "loc": loc, "msg": str(error.get("msg", ""))}
    plain["msg"] = printable(plain["msg"], _SHOWN_CHARS)
    return {k: v for k, v in plain.items() if k in error}


def starlette_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    refused = _unparsed(exc)
    if refused is not None:  # a body the framework could not parse: the rule it broke
        return ratchet_problem(request, refused)
    phrase = HTTPStatus(exc.status_code).phrase
    kind = "".join(word.capitalize() for word in re.split(r"[\s-]+", phrase))
    detail = exc.detail if isinstance(exc.detail, str) else phrase
    return problem_response(
        exc.status_code, kind, detail, request.url.path, headers=dict(exc.headers or {})
    )


def _unparsed(exc: HTTPException) -> InputRefused | None:
    """FastAPI answers a JSON body it cannot parse for any reason but its syntax with a
    bare 400 ("There was an error parsing the body"); the reason is its cause: bytes
    that are not UTF-8, a key an object repeats (``edge.strict_json``), nesting past the
    parser's recursion, or an integer longer than
    Python converts (``sys.get_int_max_str_digits``, a plain ValueError)."""
    if exc.status_code != 400:
        return None
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return InputRefused("request body", "utf8", f"not UTF-8: {cause.reason}")
    if isinstance(cause, DuplicateKey):
        return InputRefused("request body", "duplicate_key", str(cause))
    if isinstance(cause, RecursionError):
        return InputRefused("request body", "json_depth", "JSON nested too deep to parse")
    if cause is not None and too_many_digits(cause):
        digits = sys.get_int_max_str_digits()  # not the cause's text: it advises a setting
        return InputRefused("request body", "type", f"an integer of over {digits} digits")
    return None


def internal_problem(request: Request, exc: Exception) -> JSONResponse:
    """A bug of ours: the log has the traceback, the caller only that it happened."""
    if isinstance(exc, RatchetError | ClusterUnavailable | TimeoutError):
        return ratchet_problem(request, exc)
    log.error("unexpected error on %s", request.url.path, exc_info=exc)
    return problem_response(
        500,
        "InternalError",
        "an internal error; the server's log has it",
        request.url.path,
        # answered outside the app's middleware (Starlette's ServerErrorMiddleware), so
        # without what NoSniff adds to every other response
        headers={"X-Content-Type-Options": "nosniff"},
    )


PROBLEM_RESPONSE: dict[str, Any] = {
    "description": "An RFC 9457 problem",
    "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route's problems (401 is every route's)."""
    return {status: PROBLEM_RESPONSE for status in sorted({401, *statuses})}


__all__ = [
    "PROBLEM_JSON",
    "HttpProblem",
    "Problem",
    "problem_body",
    "problem_response",
    "problems",
    "status_of",
]
