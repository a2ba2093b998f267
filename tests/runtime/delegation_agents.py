"""Agents addressed by reference (``tests.runtime.delegation_agents:NAME``) in delegation tests."""

from __future__ import annotations

import asyncio
import json

from runtime import Agent, ModelResponse, ScriptedModel, call, tool
from runtime.agent import Session, SessionSide
from runtime.delegation import DelegationLimits, delegate_tool
from runtime.hooks import Hook
from runtime.messages import ToolUse, UserMessage

HERE = "tests.runtime.delegation_agents"
PROMPT_PATHS: list[tuple[str, ...]] = []
BLOCK = asyncio.Event()
"""Set to release the ``slow_worker`` children (tests reset it)."""


def _input(request) -> str:
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


def _record_path(hook_input):
    PROMPT_PATHS.append(hook_input.execution.prompt_path)


worker = Agent(
    name="worker",
    model=ScriptedModel([lambda r: ModelResponse(text=f"done: {_input(r)}")], latency_s=0.01),
    hooks=[Hook(point="StepStart", fn=_record_path)],
)


@tool
async def wait_forever() -> str:
    await BLOCK.wait()
    return "released"


slow_worker = Agent(
    name="slow_worker",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("wait_forever", "w"),)), ModelResponse(text="slow done")]
    ),
    tools=[wait_forever],
)


@tool(needs_permission=True)
def publish(x: int) -> str:
    return "published"


needy_worker = Agent(
    name="needy_worker",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("publish", "p", x=1),)), ModelResponse(text="needy done")]
    ),
    tools=[publish],
)


long_winded_worker = Agent(
    name="long_winded_worker",
    model=ScriptedModel(
        [
            ModelResponse(tool_calls=(call("publish", "p", x=1),)),
            ModelResponse(text="w" * (40 * 1024)),  # a model's answer past tool_result_bytes
        ]
    ),
    tools=[publish],
)
"""A lone child that asks a human first, then answers more than its parent's call holds."""


def fanout_agent(
    target: str, n: int, limits: DelegationLimits | None = None, name: str = "fanout"
) -> Agent:
    calls = tuple(
        call("delegate", f"d{i}", agent=f"{HERE}:{target}", input=f"task {i}") for i in range(n)
    )
    return _batch_agent(name, calls, limits=limits)


def _batch_agent(
    name: str, calls: tuple, tools: tuple = (), limits: DelegationLimits | None = None
) -> Agent:
    """Asks for ``calls`` in one batch, then answers with their results (JSON)."""
    return Agent(
        name=name,
        model=ScriptedModel(
            [ModelResponse(tool_calls=calls), lambda r: ModelResponse(text=json.dumps(_results(r)))]
        ),
        tools=[delegate_tool(), *tools],
        delegation=limits or DelegationLimits(),
    )


def _results(request) -> list[str]:
    return [m.content for m in request.messages if m.kind == "tool_result"]


def fanout() -> Agent:
    return fanout_agent("worker", 8)


def self_delegating() -> Agent:
    return fanout_agent("self_delegating", 1, name="self_delegating")


def deep() -> Agent:
    """Delegates to itself with cycles allowed, until the depth limit refuses."""
    return fanout_agent("deep", 1, DelegationLimits(max_depth=3, allow_cycles=True), name="deep")


def _then_results(use: ToolUse) -> ScriptedModel:
    return ScriptedModel(
        [ModelResponse(tool_calls=(use,)), lambda r: ModelResponse(text=json.dumps(_results(r)))]
    )


def deep_long_ids() -> Agent:
    """Delegates to itself eight levels deep, each call id as long as OpenAI's: each
    level's ids hold the parent's, so by depth 4 they would pass ``id_chars``."""
    use = call("delegate", "call_" + "x" * 24, agent=f"{HERE}:deep_long_ids", input="deeper")
    return Agent(
        name="deep_long_ids",
        model=ScriptedModel(
            [
                ModelResponse(tool_calls=(use,)),
                lambda r: ModelResponse(text=json.dumps(_results(r))),
            ]
        ),
        tools=[delegate_tool()],
        delegation=DelegationLimits(max_depth=8, allow_cycles=True),
    )


def surrogate_input() -> Agent:
    """Asks a child to start with text no store can hold (a lone surrogate, escaped)."""
    use = ToolUse(
        call_id="d0",
        tool="delegate",
        arguments=json.dumps({"agent": f"{HERE}:worker", "input": "\ud800"}),  # escaped
    )
    return Agent(
        name="surrogate_input",
        model=ScriptedModel(
            [
                ModelResponse(tool_calls=(use,)),
                lambda r: ModelResponse(text=json.dumps(_results(r))),
            ]
        ),
        tools=[delegate_tool()],
    )


def fanout4() -> Agent:
    """Four children per parent (the 100 x 4 scenario)."""
    return fanout_agent("worker", 4, name="fanout4")


def lone_needy() -> Agent:
    return fanout_agent("needy_worker", 1, name="lone_needy")


patient_worker = Agent(
    name="patient_worker",
    model=ScriptedModel([lambda r: ModelResponse(text=f"done: {_input(r)}")], latency_s=1.0),
)


def lone_patient() -> Agent:
    """One child whose inference takes a second: time to kill its host mid-Run."""
    return fanout_agent("patient_worker", 1, name="lone_patient")


def fanout_patient() -> Agent:
    """Eight children whose inference takes a second: overlap shows in the timestamps."""
    return fanout_agent("patient_worker", 8, name="fanout_patient")


SEEN_INPUTS: list[list[str]] = []


def _sees(request) -> ModelResponse:
    inputs = [m.text for m in request.messages if isinstance(m, UserMessage)]
    SEEN_INPUTS.append(inputs)
    return ModelResponse(text=f"saw {json.dumps(inputs)}")


seeing_worker = Agent(name="seeing_worker", model=ScriptedModel([_sees]))
"""Answers with every user input its model was shown: a child's history is its own."""


def delegating(call_id: str, task: str) -> Agent:
    """Delegates ``task`` to the seeing worker under the model's call id ``call_id``."""
    use = call("delegate", call_id, agent=f"{HERE}:seeing_worker", input=task)
    return Agent(name="delegating", model=_then_results(use), tools=[delegate_tool()])


LONG_CALL = "call_" + "Q" * 30  # about as long as a real model's call ids

needy_grandchild = Agent(
    name="needy_grandchild",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("publish", LONG_CALL, x=1),)), ModelResponse(text="gc")]
    ),
    tools=[publish],
)
middle = Agent(
    name="middle",
    model=_then_results(
        ToolUse(
            call_id=LONG_CALL,
            tool="delegate",
            arguments=json.dumps({"agent": f"{HERE}:needy_grandchild", "input": "x"}),
        )
    ),
    tools=[delegate_tool()],
)


def nested_needy() -> Agent:
    """Parent → child → grandchild, the grandchild awaiting a permission."""
    use = ToolUse(
        call_id=LONG_CALL,
        tool="delegate",
        arguments=json.dumps({"agent": f"{HERE}:middle", "input": "y"}),
    )
    return Agent(name="nested", model=_then_results(use), tools=[delegate_tool()])


def _delegate(agent: str, input: str) -> str:
    """Hand a task to another agent, once a human approved it."""
    raise RuntimeError("delegation calls are run by the engine, never directly")


def _asked_first(name: str, wait_deadline_s: float | None = None) -> Agent:
    return Agent(
        name=name,
        model=ScriptedModel(
            [
                ModelResponse(
                    tool_calls=(call("delegate", "d1", agent=f"{HERE}:needy_worker", input="x"),)
                ),
                lambda r: ModelResponse(text=json.dumps(_results(r))),
            ]
        ),
        tools=[
            tool(
                _delegate,
                name="delegate",
                recovery=("durable_request",),
                needs_permission=True,
                wait_deadline_s=wait_deadline_s,
            ).with_delegation()
        ],
        delegation=DelegationLimits(),
    )


asked_first = _asked_first("asked_first")
"""Delegates once a human approved the call: its child starts from the resume."""
asked_first_by_a_deadline = _asked_first("asked_first_by_a_deadline", wait_deadline_s=60)
"""The same, its approval due within a minute."""


mixed = _batch_agent(
    "mixed",
    (
        call("delegate", "d0", agent=f"{HERE}:worker", input="quick"),
        call("delegate", "d1", agent=f"{HERE}:needy_worker", input="publish"),
    ),
)
"""Two children in one wave: one answers, one needs a human."""


def _critic_step(request) -> ModelResponse:
    if request.messages[-1].kind == "tool_result":
        return ModelResponse(text="critic done")
    return ModelResponse(tool_calls=(call("delegate", "d", agent=f"{HERE}:debate", input="again"),))


debate = Agent(
    name="debate",
    model=ScriptedModel([ModelResponse(text="a speaks")] * 8),
    session=Session(
        b=SessionSide(
            agent=Agent(
                name="critic",
                model=ScriptedModel([_critic_step] * 8),
                tools=[delegate_tool()],
                delegation=DelegationLimits(max_depth=3, allow_cycles=True),
            )
        ),
        max_session_turns=2,
    ),
    delegation=DelegationLimits(max_depth=3, allow_cycles=True),
)
"""A session whose side b delegates to the session again: the depth limit ends it."""


RESET: list[int] = []


def reset_everything():
    """A function of an agents module that is no agent factory (it says not what it
    returns): a model naming it must not have it called."""
    RESET.append(1)
    return worker


@tool(concurrency="serial")
def note(x: int) -> str:
    return "noted"


needy_twice_in_turn = _batch_agent(
    "needy_twice_in_turn",
    (
        call("delegate", "d0", agent=f"{HERE}:needy_worker", input="first"),
        call("note", "s", x=1),
        call("delegate", "d1", agent=f"{HERE}:needy_worker", input="second"),
    ),
    tools=(note,),
)
"""Two lone children in waves of their own (a serial call between them), each asking a
human first."""


REPLAYED: list[str] = []
"""Each invocation of ``replayable``: a recovered child that replays it runs it again."""


@tool(recovery=("replay_safe",))
def replayable(x: int) -> str:
    REPLAYED.append("ran")
    return "effect made"


replaying_worker = Agent(
    name="replaying_worker",
    model=ScriptedModel(
        [ModelResponse(tool_calls=(call("replayable", "r", x=1),)), ModelResponse(text="made")]
    ),
    tools=[replayable],
)
"""A child whose one tool call is replayed by a recovery (``replay_safe``)."""
