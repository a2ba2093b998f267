"""Problems built from errors the edge meets, without a server: what they show and how
large they may get (``edge.problems``)."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from edge.problems import ERRORS_SHOWN, internal_problem, status_of, validation_problem
from runtime.errors import HistoryLimitReached, InputRefused


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/threads/t/runs", "headers": []})


class _Start(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent: str


def _refused(body: dict[str, object]) -> RequestValidationError:
    try:
        _Start.model_validate(body)
    except ValidationError as exc:
        return RequestValidationError(exc.errors())
    raise AssertionError("the body was taken")


def test_a_body_of_many_unknown_keys_lists_a_few_and_counts_them_all() -> None:
    """45,000 unknown keys made a 422 of 4 MB, one error each, after half a second of
    the server's event loop."""
    body: dict[str, object] = {"agent": "a:b", **{str(i): 0 for i in range(45_000)}}
    answer = validation_problem(_request(), _refused(body))
    problem = json.loads(answer.body)
    assert answer.status_code == 422 and len(problem["errors"]) == ERRORS_SHOWN
    assert problem["detail"].endswith("(and 44999 more)")
    assert len(answer.body) < 10_000


def test_a_refused_input_is_not_echoed_back_in_a_message_or_a_location() -> None:
    """pydantic names an unknown key in the error's location, and a union's tag in its
    message: either can be the caller's megabyte (or its secret)."""
    huge = "A" * 300_000
    problem = json.loads(validation_problem(_request(), _refused({"agent": "a", huge: 1})).body)
    assert len(json.dumps(problem)) < 2_000
    assert all(len(str(part)) <= 200 for part in problem["errors"][0]["loc"])


def test_a_thread_at_its_history_limit_is_a_conflict_not_a_request_too_large() -> None:
    at_limit = HistoryLimitReached("the history of thread t", "history_bytes", "it is full")
    assert status_of(at_limit) == 409  # the body asking was tiny
    assert status_of(InputRefused("input", "input_bytes", "too long")) == 413


def test_an_internal_error_carries_nosniff_as_every_other_answer() -> None:
    """It is answered outside the app's middleware, where NoSniff adds the header."""
    answer = internal_problem(_request(), KeyError("a bug"))
    assert answer.status_code == 500
    assert answer.headers["x-content-type-options"] == "nosniff"
