"""Agents and tools shared by the runtime tests."""

from __future__ import annotations

from collections import Counter

from runtime import Agent, ModelResponse, ScriptedModel, ToolContext, call, tool


class Ledger:
    """Side-effect ledger: how often each operation id really ran."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    def record(self, tool_id: str, ctx: ToolContext) -> None:
        self.runs[f"{tool_id}|{ctx.operation_id}"] += 1

    def count(self, tool_id: str) -> int:
        return sum(n for key, n in self.runs.items() if key.startswith(f"{tool_id}|"))


def crash_matrix_agent(ledger: Ledger, steps: int = 3) -> Agent:
    """A run of ``steps`` tool steps, each with one never_replay and one replay_safe call.

    The replay_safe call is serial, so it is a wave of its own: the first wave's
    ``executing`` rides in the inference commit, the second has its own commit.
    """

    @tool(recovery=("never_replay",))
    def charge(amount: int, ctx: ToolContext) -> str:
        ledger.record("charge", ctx)
        return f"charged {amount}"

    @tool(recovery=("replay_safe",), concurrency="serial")
    def lookup(key: str, ctx: ToolContext) -> str:
        ledger.record("lookup", ctx)
        return f"value of {key}"

    script = [
        ModelResponse(
            text=f"step {i}",
            tool_calls=(call("charge", f"c{i}a", amount=i), call("lookup", f"c{i}b", key=f"k{i}")),
        )
        for i in range(steps)
    ]
    script.append(ModelResponse(text="all done"))
    return Agent(name="crashy", model=ScriptedModel(script), tools=[charge, lookup])


@tool(needs_permission=True, wait_deadline_s=3600)
def answer_within_an_hour(x: int) -> str:
    """A permission wait whose deadline no test reaches by the clock."""
    return "ran"


@tool(needs_permission=True)
def answer_any_time(x: int) -> str:
    """A permission wait with no deadline."""
    return "ran"


@tool(recovery=("never_replay",))
def charge() -> str:
    return "charged"


@tool(recovery=("durable_request",))
def order() -> str:
    return "ordered"


SEALED_AND_REJOINED = (charge, order)
"""One wave of ``charge`` (never_replay: a recovery seals it) and ``order``
(durable_request: a recovery rejoins it, committing no ``executing`` again): crashed
during its tools, the sealed call's AfterTool hooks are staged for the wave's results
commit, which the rejoined call's hooks ride too."""
