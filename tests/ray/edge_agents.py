"""Agents for the host edge tests (``tests.ray.edge_agents:name``).

Every tool records its attempts in the EffectLedger (``tests.ray.agents``), which is
how a test knows where a Run is without sleeping.
"""

from __future__ import annotations

import asyncio
import json

from runtime.agent import Agent
from runtime.delegation import DelegationLimits, delegate_tool
from runtime.models import InferenceRequest, ModelResponse, ScriptedModel, call
from runtime.tools import ToolContext, tool

from .agents import BLOCK_S, _book, drop_table, long_nap

HERE = "tests.ray.edge_agents"


@tool(recovery=("replay_safe",))
async def doze(ctx: ToolContext) -> str:
    """replay_safe: every attempt records that it started, then blocks for a minute."""
    _book().record(ctx, "doze", note="started")
    await asyncio.sleep(BLOCK_S)
    return "woke"


dozing_agent = Agent(
    name="dozing",
    model=ScriptedModel(
        (ModelResponse(text="doze", tool_calls=(call("doze", "c1"),)), ModelResponse(text="woke"))
    ),
    tools=(doze,),
)
"""Stays inside its tool on every attempt, wherever it is driven, until it is ended."""


nap_then_ask_agent = Agent(
    name="nap-then-ask",
    model=ScriptedModel(
        (
            ModelResponse(text="nap", tool_calls=(call("long_nap", "c1"),)),
            ModelResponse(text="may I?", tool_calls=(call("drop_table", "c2", name="users"),)),
            ModelResponse(text="as you wished"),
        )
    ),
    tools=(long_nap, drop_table),
)
"""Naps a minute on its first attempt only (a replay returns at once), then awaits a
permission: a Run taken over mid-nap comes to rest at its new owner quickly."""


worker = Agent(name="edge-worker", model=ScriptedModel((ModelResponse(text="worked"),)))


def _results(request: InferenceRequest) -> ModelResponse:
    contents = [m.content for m in request.messages if m.kind == "tool_result"]
    return ModelResponse(text=json.dumps(contents))


def _delegating(name: str, child: str) -> Agent:
    """One delegation (call id ``d0``) to ``child`` (named in its limits: it may be of
    another module); answers with the tool results."""
    first = ModelResponse(tool_calls=(call("delegate", "d0", agent=child, input="task"),))
    return Agent(
        name=name,
        model=ScriptedModel((first, _results)),
        tools=(delegate_tool(),),
        delegation=DelegationLimits(agents=(child,)),
    )


parent_of_napper = _delegating("parent-of-napper", "tests.ray.agents:long_napping_agent")
parent_of_worker = _delegating("parent-of-worker", f"{HERE}:worker")


class _LimitedOnce:
    """Rate limited for ``WAIT_S`` on its first request of each Run, then serves. The Run
    pauses and is resumed on the host that holds it (hosted placement is by thread), so
    the note of which Runs were limited may live in the host process."""

    WAIT_S = 1.5

    def __init__(self) -> None:
        self.limited: set[str] = set()

    async def stream(self, request: InferenceRequest):  # type: ignore[no-untyped-def]
        from runtime.errors import ModelRateLimited

        if request.run_id not in self.limited:
            self.limited.add(request.run_id)
            raise ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=self.WAIT_S)
        yield ModelResponse(text="served")


rate_limited_agent = Agent(name="rate_limited", model=_LimitedOnce(), rate_limit_wait_s=0.0)
"""Pauses ``awaiting(pause(rate_limit))`` at once: it may not wait in the Run at all."""


asks_twice_agent = Agent(
    name="asks-twice",
    model=ScriptedModel(
        (
            ModelResponse(text="may I?", tool_calls=(call("drop_table", "c1", name="scratch"),)),
            ModelResponse(text="and?", tool_calls=(call("drop_table", "c2", name="production"),)),
            ModelResponse(text="as you wished"),
        )
    ),
    tools=(drop_table,),
)
"""Asks permission for one call, then for another: an answer to the first, asked again
under its request id, must never answer the second."""


rate_limited_twins = Agent(
    name="rate-limited-twins",
    model=ScriptedModel(
        (
            ModelResponse(
                tool_calls=tuple(
                    call("delegate", f"d{i}", agent=f"{HERE}:rate_limited_agent", input="task")
                    for i in range(2)
                )
            ),
            _results,
        )
    ),
    tools=(delegate_tool(),),
    delegation=DelegationLimits(agents=(f"{HERE}:rate_limited_agent",)),
)
"""Two children at once, each paused by a rate limit before it answers."""
