"""The shared classification, as a pure decision: status and provider type in, error out."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from runtime import ModelRateLimited, ModelRefused, ModelUnavailable
from runtime.adapters.errors import classify, error_fields, retry_after_seconds, scrub

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    ("status", "error_type", "error_code", "message", "kind", "code"),
    [
        (400, "invalid_request_error", None, "bad", ModelRefused, "invalid_request"),
        (
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "x",
            ModelRefused,
            "context_length",
        ),
        (400, None, None, "maximum context length is 4096 tokens", ModelRefused, "context_length"),
        (401, None, None, "no", ModelRefused, "auth"),
        (403, "permission_error", None, "no", ModelRefused, "auth"),
        (404, None, "model_not_found", "no", ModelRefused, "not_found"),
        (408, None, None, "slow", ModelUnavailable, "timeout"),
        (409, None, None, "conflict", ModelRefused, "status_409"),
        (413, "request_too_large", None, "big", ModelRefused, "request_too_large"),
        (422, None, None, "bad", ModelRefused, "invalid_request"),
        (429, None, "rate_limit_exceeded", "slow down", ModelRateLimited, "rate_limit"),
        (
            429,
            "insufficient_quota",
            "insufficient_quota",
            "pay",
            ModelRefused,
            "insufficient_quota",
        ),
        (500, None, None, "boom", ModelUnavailable, "status_500"),
        (502, None, None, "bad gateway", ModelUnavailable, "status_502"),
        (529, "overloaded_error", None, "Overloaded", ModelRateLimited, "overloaded"),
        (None, "overloaded_error", None, "Overloaded", ModelRateLimited, "overloaded"),
        (None, "api_error", None, "oops", ModelUnavailable, "server_error"),
        (None, "invalid_request_error", None, "prompt is too long", ModelRefused, "context_length"),
        (None, None, None, "?", ModelUnavailable, "stream_error"),
    ],
)
def test_classify(status, error_type, error_code, message, kind, code):
    error = classify(status, error_type, message, error_code=error_code, retry_after_s=3.0)
    assert type(error) is kind and error.code == code and error.status == status
    assert str(error) == message
    if kind is ModelRateLimited:
        assert error.retry_after_s == 3.0


def test_a_rate_limit_crosses_process_boundaries_with_its_hint():
    error = classify(429, None, "slow down", retry_after_s=7.5)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ModelRateLimited and vars(copy) == vars(error)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after": format_datetime(NOW + timedelta(seconds=30), usegmt=True)}, 30.0),
        ({"retry-after": format_datetime(NOW - timedelta(seconds=30), usegmt=True)}, 0.0),
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "1_000"}, None),  # float() reads these; no server means them
        ({"retry-after": "1e3"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": " 12 "}, 12.0),
        ({"retry-after": "9" * 400}, None),
        ({"retry-after": "Mon, 01 Jan 2147483648 00:00:00 GMT"}, None),  # OverflowError
        ({"retry-after": "Mon, 99999999999 Jan 2000 00:00:00 GMT"}, None),
        ({}, None),
    ],
)
def test_retry_after(headers, expected):
    assert retry_after_seconds(headers, NOW) == expected


def test_scrub_removes_the_key_and_anything_shaped_like_one():
    assert scrub("bad key sk-live-abc123", ("sk-live-abc123",)) == "bad key [redacted]"
    shown = scrub("Incorrect API key provided: sk-proj-0123456789abcdef", ())
    assert "0123456789abcdef" not in shown and shown.startswith("Incorrect API key provided: sk-pr")


def test_error_fields_reads_both_providers_bodies():
    openai_body = {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}
    anthropic_body = {"type": "error", "error": {"type": "overloaded_error", "message": "m"}}
    assert error_fields(openai_body) == {"message": "m", "type": "t", "code": "c"}
    assert error_fields(anthropic_body) == {"message": "m", "type": "overloaded_error"}
    assert error_fields("plain text") == {} and error_fields(None) == {}


def test_an_event_s_bytes_are_counted_across_chunks_from_its_blank_line():
    """An event ends at an empty line, LF, CR or CRLF, also one cut between two chunks;
    only the bytes since the last end count."""
    from runtime.adapters.event_bound import EventTooLarge, _EventBytes

    for ending in (b"\n\n", b"\r\r", b"\r\n\r\n"):
        for cut in range(len(ending) + 1):
            events = _EventBytes(10)
            events.feed(b"data: 12" + ending[:cut])
            events.feed(ending[cut:] + b"data: 12")  # 8 bytes of the next event
            assert events.since == 8, (ending, cut)
    events = _EventBytes(10)
    events.feed(b"data: 1234")
    with pytest.raises(EventTooLarge, match="a server-sent event over 10 bytes"):
        events.feed(b"\n5")  # one line end: the same event, 12 bytes
