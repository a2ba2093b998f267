"""An engine that only ends Runs: what cancels or stops a Run no engine here drives, or
dead-letters one (``actors.ownership``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from runtime.agent import Agent
from runtime.delegation import ChildRunner
from runtime.engine import Engine
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.models import ModelResponse
from runtime.ports import CommitStore
from runtime.publish import Publisher


class _NoModel:
    """The model of an engine that only ends Runs: it is never asked."""

    async def stream(self, request: object) -> AsyncIterator[ModelResponse]:
        raise RuntimeError("a control engine never infers")
        yield ModelResponse()  # pragma: no cover - makes this an async generator


def control_engine(
    store: CommitStore,
    *,
    owner: str | None = None,
    publisher: Publisher | None = None,
    children: ChildRunner | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Engine:
    """An engine that only ends Runs (``terminate``): it never infers nor runs a tool.
    ``limits``: the system's (a thread id it accepted is one this engine accepts)."""
    agent = Agent(name="control", model=_NoModel())
    return Engine(
        agent, store, _NO_TOOLS, owner=owner, publisher=publisher, children=children, limits=limits
    )


class _NoTools:
    async def run(self, invocations: Sequence[Any]) -> list[Any]:
        raise RuntimeError("a control engine never runs a tool")


_NO_TOOLS = _NoTools()
