"""How the provider adapters turn SDK failures into Ratchet's model errors, in one place.

    ModelError (runtime.errors), by ``code``:
    ├── ModelRefused          permanent: the Run ends failed(inference, code) at once
    │   ├── invalid_request     400, 422, or an ``invalid_request_error`` event
    │   ├── context_length      a 400 whose code or message says the prompt is too long
    │   ├── auth                401, 403 (and their error types)
    │   ├── not_found           404: most often an unknown model id
    │   ├── request_too_large   413
    │   ├── insufficient_quota  OpenAI's 429 for an exhausted balance: a bill, not a rate
    │   ├── billing             402
    │   └── status_4xx          any other 4xx
    └── ModelUnavailable      transient: a new attempt
        ├── timeout             the SDK's or the transport's timeout, 408
        ├── connection          no response at all (refused, reset, DNS)
        ├── stream_cut          the stream dropped, or ended before its end marker
        ├── malformed_stream    a chunk that is not JSON or not the documented shape
        ├── status_5xx          a 5xx (status_500, status_503, ...)
        ├── server_error        an ``api_error``/``server_error`` event mid-stream
        ├── stream_error        a mid-stream error event of a type not listed here
        └── ModelRateLimited    backs off (``retry_after_s`` from Retry-After), then pauses
            ├── rate_limit      429, or a ``rate_limit_error`` event
            └── overloaded      Anthropic's 529, or an ``overloaded_error`` event

Both SDKs (openai, anthropic) share one shape of exceptions: ``APIStatusError`` with
``status_code``, ``body`` and ``response``; ``APITimeoutError`` under
``APIConnectionError``; ``APIError`` with a ``body`` for an error event inside a 200
stream (the anthropic SDK raises an ``APIStatusError`` of status 200 for one). The
anthropic SDK lets the transport's (httpx2) errors escape while a stream is read, so
those classes are named too. ``SdkErrors`` carries the classes of one SDK, so this
module imports no SDK: the adapter builds it when it is constructed.

The decision itself (``classify``) is pure: a status, the provider's error type and
code, its message and the Retry-After hint in; one ModelError out. Every message goes
through ``scrub`` so that no credential reaches a log or a committed failure.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

from pydantic import ValidationError

from runtime.adapters.event_bound import EventTooLarge
from runtime.errors import ModelError, ModelRateLimited, ModelRefused, ModelUnavailable
from runtime.limits import too_many_digits
from runtime.models import ModelDelta, ModelResponse


@dataclass(frozen=True)
class SdkErrors:
    """The exception classes of one provider SDK and the credentials to keep out of
    messages."""

    provider: str
    """Names the provider at the head of every message (``openai``, ``anthropic``)."""
    status: type[Exception]
    api: type[Exception]
    timeout: type[Exception]
    connection: type[Exception]
    transport_timeout: type[Exception]
    transport: type[Exception]
    secrets: tuple[str, ...] = ()


# The provider's error type (Anthropic ``error.type``) or code (OpenAI ``error.code`` /
# ``error.type``), for an error that arrives without an HTTP status of its own.
_BY_ERROR_TYPE: dict[str, tuple[type[ModelError], str]] = {
    "overloaded_error": (ModelRateLimited, "overloaded"),
    "rate_limit_error": (ModelRateLimited, "rate_limit"),
    "rate_limit_exceeded": (ModelRateLimited, "rate_limit"),
    "insufficient_quota": (ModelRefused, "insufficient_quota"),
    "invalid_request_error": (ModelRefused, "invalid_request"),
    "context_length_exceeded": (ModelRefused, "context_length"),
    "authentication_error": (ModelRefused, "auth"),
    "permission_error": (ModelRefused, "auth"),
    "not_found_error": (ModelRefused, "not_found"),
    "request_too_large": (ModelRefused, "request_too_large"),
    "billing_error": (ModelRefused, "billing"),
    "api_error": (ModelUnavailable, "server_error"),
    "server_error": (ModelUnavailable, "server_error"),
    "timeout_error": (ModelUnavailable, "timeout"),
}

_BY_STATUS: dict[int, tuple[type[ModelError], str]] = {
    400: (ModelRefused, "invalid_request"),
    401: (ModelRefused, "auth"),
    402: (ModelRefused, "billing"),
    403: (ModelRefused, "auth"),
    404: (ModelRefused, "not_found"),
    408: (ModelUnavailable, "timeout"),
    413: (ModelRefused, "request_too_large"),
    422: (ModelRefused, "invalid_request"),
    429: (ModelRateLimited, "rate_limit"),
    529: (ModelRateLimited, "overloaded"),
}

# OpenAI says context_length_exceeded; Anthropic "prompt is too long"; vLLM and other
# gateways "maximum context length" in a plain 400.
_CONTEXT_LENGTH = re.compile(
    r"context[ _]length|prompt is too long|maximum context|context window|too many tokens",
    re.IGNORECASE,
)
_KEY_LIKE = re.compile(r"\b(sk-[A-Za-z0-9_\-]{2})[A-Za-z0-9_\-*]{6,}")


def classify(
    status: int | None,
    error_type: str | None,
    message: str,
    *,
    error_code: str | None = None,
    retry_after_s: float | None = None,
) -> ModelError:
    """The ModelError for a provider's failure. ``status`` is None (or below 400) for an
    error event inside a stream: then the provider's type decides alone."""
    kind, code = _decide(status, error_type, error_code, message)
    if issubclass(kind, ModelRateLimited):
        return kind(code, message, status=status, retry_after_s=retry_after_s)
    return kind(code, message, status=status)


def _decide(
    status: int | None, error_type: str | None, error_code: str | None, message: str
) -> tuple[type[ModelError], str]:
    named = [t for t in (error_code, error_type) if t]
    if status is None or status < 400:
        for name in named:
            if name in _BY_ERROR_TYPE:
                return _with_context_length(_BY_ERROR_TYPE[name], message)
        return ModelUnavailable, "stream_error"
    if status == 429 and "insufficient_quota" in named:
        return ModelRefused, "insufficient_quota"
    if status in _BY_STATUS:
        return _with_context_length(_BY_STATUS[status], message, named)
    if status >= 500:
        return ModelUnavailable, f"status_{status}"
    return ModelRefused, f"status_{status}"


def _with_context_length(
    decided: tuple[type[ModelError], str], message: str, named: list[str] | None = None
) -> tuple[type[ModelError], str]:
    if decided[1] != "invalid_request":
        return decided
    if "context_length_exceeded" in (named or []) or _CONTEXT_LENGTH.search(message):
        return ModelRefused, "context_length"
    return decided


class Fold(Protocol):
    """What an adapter folds its SDK's stream into: deltas as they come, then one response."""

    def add(self, item: Any) -> list[ModelDelta]: ...

    def response(self) -> ModelResponse: ...


async def folded(
    opening: Awaitable[Any], fold: Fold, sdk: SdkErrors
) -> AsyncIterator[ModelDelta | ModelResponse]:
    """The Model port's stream for an SDK's: its items folded into deltas, then the
    response; the SDK's failures, opening or mid-stream, as ModelErrors."""
    started = False
    try:
        stream = await opening
        started = True
        async with stream:
            async for item in stream:
                for delta in fold.add(item):
                    yield delta
        response = fold.response()
    except ModelError:
        raise
    except Exception as exc:  # translated if it is the SDK's, else raised as it is
        error = translate(exc, sdk, streaming=started)
        if error is None:
            raise
        raise error from exc
    yield response


def translate(exc: BaseException, sdk: SdkErrors, *, streaming: bool) -> ModelError | None:
    """The ModelError for an exception an SDK call raised, or None if it is none of the
    SDK's (the caller lets it propagate). ``streaming``: the response had begun."""
    # raised as the body is read, and wrapped by one SDK as a connection error
    too_large = exc if isinstance(exc, EventTooLarge) else exc.__cause__
    if isinstance(too_large, EventTooLarge):
        return ModelUnavailable("malformed_stream", _message(sdk, None, str(too_large)))
    if isinstance(exc, sdk.status):
        return _from_status(exc, sdk)
    if isinstance(exc, (sdk.timeout, sdk.transport_timeout)):
        return ModelUnavailable("timeout", _message(sdk, None, "the request timed out"))
    if isinstance(exc, (sdk.connection, sdk.transport)):
        if streaming:
            return ModelUnavailable(
                "stream_cut", _message(sdk, None, f"stream dropped: {_why(exc)}")
            )
        return ModelUnavailable("connection", _message(sdk, None, f"cannot connect: {_why(exc)}"))
    if isinstance(exc, sdk.api):
        body = getattr(exc, "body", None)
        return _from_body(None, body, sdk, fallback=str(exc))
    if isinstance(exc, json.JSONDecodeError):
        message = _message(sdk, None, f"chunk is not JSON: {exc}")
        return ModelUnavailable("malformed_stream", message)
    if isinstance(exc, UnicodeDecodeError):  # a chunk's bytes (the SDK decodes each alone)
        message = _message(sdk, None, f"a chunk is not UTF-8: {exc.reason}")
        return ModelUnavailable("malformed_stream", message)
    if too_many_digits(exc):  # its text advises a setting of this process: not said
        digits = sys.get_int_max_str_digits()
        message = _message(sdk, None, f"a chunk holds a number of over {digits} digits")
        return ModelUnavailable("malformed_stream", message)
    if isinstance(exc, RecursionError | ValidationError):
        # JSON nested past the SDK's parser, or parts the response cannot hold (a call
        # whose id or name is null): what the provider sent is not a response
        what = "nested too deep" if isinstance(exc, RecursionError) else "not a response"
        return ModelUnavailable("malformed_stream", _message(sdk, None, f"the stream is {what}"))
    return None


def _why(exc: BaseException) -> str:
    """The SDK's words and the transport's under them ("Connection error." alone says
    little)."""
    cause = exc.__cause__
    return f"{exc} ({cause})" if cause is not None and str(cause) != str(exc) else str(exc)


def _from_status(exc: Exception, sdk: SdkErrors) -> ModelError:
    status: int | None = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    retry_after = None
    if status is not None and status >= 400 and response is not None:
        retry_after = retry_after_seconds(response.headers, datetime.now(UTC))
    return _from_body(status, getattr(exc, "body", None), sdk, str(exc), retry_after)


def _from_body(
    status: int | None,
    body: object,
    sdk: SdkErrors,
    fallback: str,
    retry_after_s: float | None = None,
) -> ModelError:
    error = error_fields(body)
    text = error.get("message") or _shown(body) or fallback
    message = _message(sdk, status if status and status >= 400 else None, text, error.get("type"))
    return classify(
        status if status and status >= 400 else None,
        error.get("type"),
        message,
        error_code=error.get("code"),
        retry_after_s=retry_after_s,
    )


def error_fields(body: object) -> dict[str, str]:
    """``message``, ``type`` and ``code`` of a provider's error body, as far as it has them:
    OpenAI ``{"error": {...}}`` (the SDK may have unwrapped it already), Anthropic
    ``{"type": "error", "error": {...}}``."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        body = body["error"]
    if not isinstance(body, Mapping):
        return {}
    return {k: str(body[k]) for k in ("message", "type", "code") if body.get(k) is not None}


def _shown(body: object) -> str:
    """A body of no known error shape, shortened: it may be all a gateway says."""
    if isinstance(body, str):
        return body[:500]
    if isinstance(body, Mapping):
        return json.dumps(body, default=str)[:500]
    return ""


def _message(sdk: SdkErrors, status: int | None, text: str, error_type: str | None = None) -> str:
    head = sdk.provider if status is None else f"{sdk.provider} {status}"
    if error_type:
        head = f"{head} {error_type}"
    return scrub(f"{head}: {text}", sdk.secrets)


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` without any of ``secrets`` and without anything shaped like an API key
    (a gateway may echo the key it was sent in its error message)."""
    for secret in secrets:
        if len(secret) >= 4:  # a placeholder key like "unused" needs no hiding, "x" can't be
            text = text.replace(secret, "[redacted]")
    return _KEY_LIKE.sub(r"\1…[redacted]", text)


def retry_after_seconds(headers: Mapping[str, Any], now: datetime) -> float | None:
    """The provider's hint of how long to wait: ``retry-after-ms`` (OpenAI), else
    ``Retry-After`` as seconds or as an HTTP date (RFC 9110 §10.2.3); None if absent or
    unreadable. A date in the past means no wait."""
    millis = _number(headers.get("retry-after-ms"))
    if millis is not None:
        return max(millis / 1000.0, 0.0)
    value = headers.get("retry-after")
    if not isinstance(value, str) or not value.strip():
        return None
    seconds = _number(value)
    if seconds is not None:
        return max(seconds, 0.0)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):  # a year past 2**31 ...
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=UTC)
    return max((when - now).total_seconds(), 0.0)


_DECIMAL = re.compile(r"[+-]?[0-9]+(\.[0-9]+)?")
"""A count of seconds as the header writes it (RFC 9110: digits; a fraction is read too).
Python's ``float`` reads more — ``1_000``, ``1e3``, ``inf`` — that no server means."""


def _number(value: object) -> float | None:
    if not isinstance(value, str) or not _DECIMAL.fullmatch(value.strip()):
        return None
    number = float(value.strip())
    return number if math.isfinite(number) else None  # 400 digits read as inf
