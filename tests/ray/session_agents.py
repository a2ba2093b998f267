"""Session agents for the Ray tests: a human side, and a model side whose tool runs on
the executors (deployed there through the session agent's reference)."""

from __future__ import annotations

from runtime import Agent, ModelResponse, ScriptedModel, ToolContext, call, tool
from runtime.agent import Session, SessionSide


@tool(recovery=("replay_safe",))
def side_probe(ctx: ToolContext) -> str:
    e = ctx.execution
    return f"{e.current_side}:{'/'.join(e.prompt_path)}"


def _critic(request):
    if request.messages[-1].kind != "tool_result":
        return ModelResponse(tool_calls=(call("side_probe", f"p{request.step}"),))
    return ModelResponse(text=f"critic heard {request.messages[-1].content}")


critic = Agent(name="critic", model=ScriptedModel([_critic] * 16), tools=[side_probe])

debate_agent = Agent(
    name="writer",
    model=ScriptedModel([ModelResponse(text="a draft")] * 16),
    session=Session(b=SessionSide(agent=critic), max_session_turns=2),
)

chat_agent = Agent(
    name="writer",
    model=ScriptedModel([ModelResponse(text="a draft")] * 16),
    session=Session(b=SessionSide(human="Your reply?"), max_session_turns=3),
)
