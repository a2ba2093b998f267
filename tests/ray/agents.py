"""Agents for the Ray tests, addressed by reference (``tests.ray.agents:name``).

Every tool writes to the EffectLedger named by RATCHET_LEDGER (set before Ray
starts, so every worker inherits it), which survives any process death.
"""

from __future__ import annotations

import asyncio

import ray

from cluster.demo_agent import EffectLedger, ledger
from runtime.agent import Agent
from runtime.models import ModelResponse, ScriptedModel, call
from runtime.tools import ToolContext, tool

BLOCK_S = 60.0


def _book() -> EffectLedger:
    book = ledger()
    assert book is not None, "RATCHET_LEDGER is not set"
    return book


@tool
async def slow_charge(order: str, ctx: ToolContext) -> str:
    """never_replay; the first attempt blocks until its executor is killed."""
    _book().record(ctx, "slow_charge")
    await asyncio.sleep(BLOCK_S)
    return "charged"


@tool(recovery=("replay_safe",))
async def slow_fetch(order: str, ctx: ToolContext) -> str:
    """replay_safe; blocks on the first attempt only."""
    _book().record(ctx, "slow_fetch")
    if ctx.attempt == 1:
        await asyncio.sleep(BLOCK_S)
    return f"fetched {order} on attempt {ctx.attempt}"


blocking_agent = Agent(
    name="blocking",
    model=ScriptedModel(
        (
            ModelResponse(
                text="both at once",
                tool_calls=(
                    call("slow_charge", "c1", order="B-1"),
                    call("slow_fetch", "c2", order="B-1"),
                ),
            ),
            ModelResponse(text="done, whatever happened"),
        )
    ),
    tools=(slow_charge, slow_fetch),
)


@tool(recovery=("replay_safe",))
async def nap(seconds: float, ctx: ToolContext) -> str:
    """replay_safe; sleeps on every attempt (for takeover tests)."""
    _book().record(ctx, "nap")
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


napping_agent = Agent(
    name="napping",
    model=ScriptedModel(
        (
            ModelResponse(text="nap", tool_calls=(call("nap", "c1", seconds=3.0),)),
            ModelResponse(text="rested"),
        )
    ),
    tools=(nap,),
)


@tool
def echo(text: str) -> str:
    return text


quick_agent = Agent(
    name="quick",
    model=ScriptedModel(
        (
            ModelResponse(text="echo", tool_calls=(call("echo", "c1", text="hi"),)),
            ModelResponse(text="said hi"),
        )
    ),
    tools=(echo,),
)


@tool(resources={"special": 1})
def where_special() -> dict[str, object]:
    """Needs the custom resource ``special``: runs only on an executor holding it."""
    ctx = ray.get_runtime_context()
    return {"resources": ctx.get_assigned_resources(), "actor": ctx.get_actor_name()}


@tool
def where_plain() -> dict[str, object]:
    ctx = ray.get_runtime_context()
    return {"resources": ctx.get_assigned_resources(), "actor": ctx.get_actor_name()}


resource_agent = Agent(
    name="resourceful",
    model=ScriptedModel(
        (
            ModelResponse(
                text="where?",
                tool_calls=(call("where_special", "c1"), call("where_plain", "c2")),
            ),
            ModelResponse(text="found out"),
        )
    ),
    tools=(where_special, where_plain),
)


@tool(needs_permission=True)
def drop_table(name: str, ctx: ToolContext) -> str:
    """Needs a human's permission: the Run awaits it, holding nothing in any host."""
    _book().record(ctx, "drop_table")
    return f"dropped {name}"


permission_agent = Agent(
    name="careful",
    model=ScriptedModel(
        (
            ModelResponse(text="may I?", tool_calls=(call("drop_table", "c1", name="users"),)),
            ModelResponse(text="as you wished"),
        )
    ),
    tools=(drop_table,),
)


@tool(recovery=("replay_safe",))
async def long_nap(ctx: ToolContext) -> str:
    """replay_safe: the first attempt naps a minute and records it if it is cancelled
    where it runs (on its executor); later attempts return at once."""
    _book().record(ctx, "long_nap", note="started")
    if ctx.attempt > 1:
        return f"rested on attempt {ctx.attempt}"
    try:
        await asyncio.sleep(BLOCK_S)
    except asyncio.CancelledError:
        _book().record(ctx, "long_nap", note="cancelled")
        raise
    return "rested a minute"


long_napping_agent = Agent(
    name="long-napping",
    model=ScriptedModel(
        (
            ModelResponse(text="nap", tool_calls=(call("long_nap", "c1"),)),
            ModelResponse(text="rested"),
        )
    ),
    tools=(long_nap,),
)

slow_model_agent = Agent(
    name="slow-model",
    model=ScriptedModel(
        (
            ModelResponse(text="echo", tool_calls=(call("echo", "c1", text="hi"),)),
            ModelResponse(text="said hi"),
        ),
        latency_s=0.5,
    ),
    tools=(echo,),
)
"""Ends within about a second, each answer of its model taking half a second."""
