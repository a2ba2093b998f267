"""Building requests and reading an adapter's stream, for the adapter tests."""

from __future__ import annotations

from typing import Any

from runtime import InferenceRequest, ModelDelta, ModelError, ModelResponse, RunId
from runtime.messages import RequestMessage, UserMessage

ADD_SCHEMA: dict[str, Any] = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


def request(
    *messages: RequestMessage,
    tools: tuple[dict[str, Any], ...] | None = (ADD_SCHEMA,),
    system: str = "",
) -> InferenceRequest:
    history = messages or (UserMessage(id="u1", text="hi"),)
    return InferenceRequest(
        run_id=RunId("run-1"), step=0, attempt=1, messages=history, tools=tools, system=system
    )


async def collect(model: Any, req: InferenceRequest) -> tuple[list[ModelDelta], ModelResponse]:
    """Every item of one stream, checked to be deltas then exactly one response last."""
    items = [item async for item in model.stream(req)]
    assert items and isinstance(items[-1], ModelResponse)
    deltas = items[:-1]
    assert all(isinstance(d, ModelDelta) for d in deltas)
    return deltas, items[-1]


async def failure(model: Any, kind: type[ModelError]) -> str:
    """The code of the error of exactly ``kind`` that one stream of ``model`` ends with."""
    try:
        await collect(model, request())
    except ModelError as exc:
        assert type(exc) is kind, repr(exc)
        return exc.code
    raise AssertionError(f"the stream ended without {kind.__name__}")


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
