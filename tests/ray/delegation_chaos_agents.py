"""Agents for delegation under kills and cancels (``tests.ray.delegation_chaos_agents:NAME``)."""

from __future__ import annotations

import asyncio
import json

from runtime.agent import Agent
from runtime.delegation import delegate_tool
from runtime.models import InferenceRequest, ModelResponse, ScriptedModel, call
from runtime.tools import tool

HERE = "tests.ray.delegation_chaos_agents"


def _results(request: InferenceRequest) -> ModelResponse:
    contents = [m.content for m in request.messages if m.kind == "tool_result"]
    return ModelResponse(text=json.dumps(contents))


def _fanout(name: str, target: str, n: int) -> Agent:
    calls = tuple(
        call("delegate", f"d{i}", agent=f"{HERE}:{target}", input=f"task {i}") for i in range(n)
    )
    return Agent(
        name=name,
        model=ScriptedModel([ModelResponse(tool_calls=calls), _results]),
        tools=[delegate_tool()],
    )


@tool
async def sleep_long() -> str:
    await asyncio.sleep(600)
    return "slept"


@tool(recovery=("replay_safe",))
async def sleep_replayable() -> str:
    await asyncio.sleep(600)
    return "slept"


sleeper = Agent(
    name="sleeper",
    model=ScriptedModel([ModelResponse(tool_calls=(call("sleep_long", "s"),)), _results]),
    tools=[sleep_long],
)
"""Stays ten minutes in its tool: it ends when it is cancelled."""

replayer = Agent(
    name="replayer",
    model=ScriptedModel([ModelResponse(tool_calls=(call("sleep_replayable", "s"),)), _results]),
    tools=[sleep_replayable],
)
"""The same with a replay-safe tool: a recovery runs it again."""

patient = Agent(
    name="patient",
    model=ScriptedModel([ModelResponse(text="patient done")], latency_s=1.5),
)


def sleepers() -> Agent:
    return _fanout("sleepers", "sleeper", 3)


def one_replayer() -> Agent:
    return _fanout("one_replayer", "replayer", 1)


def middle() -> Agent:
    return _fanout("middle", "patient", 1)


def top() -> Agent:
    """Three deep: top → middle → patient."""
    return _fanout("top", "middle", 1)
