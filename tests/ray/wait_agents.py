"""Agents that wait, for the Ray wait and control tests (``tests.ray.wait_agents:name``).

Hosts rebuild agents by reference in any process, so nothing here keeps state in
memory: a hook decides from the committed state whether it already asked, and a
flaky model decides from the request's attempt number.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence

from runtime.agent import Agent
from runtime.hooks import Hook, HookInput, HookOutput
from runtime.models import InferenceRequest, ModelDelta, ModelResponse, ScriptedModel, call
from runtime.state import Command
from runtime.tools import ToolContext, tool

from .agents import _book, echo

LONG_S = 30.0


def _two_steps(
    first: ModelResponse, last: str = "finished", latency_s: float = 0.0
) -> ScriptedModel:
    return ScriptedModel((first, ModelResponse(text=last)), latency_s=latency_s)


@tool(wait="external_result")
def measure(x: int) -> str:
    """Client-executed: the caller supplies the output."""
    raise AssertionError("a client-executed tool never runs on our side")


external_agent = Agent(
    name="external",
    model=_two_steps(ModelResponse(text="measure it", tool_calls=(call("measure", "c1", x=7),))),
    tools=(measure,),
)


@tool(wait="scheduled_action")
def remind(note: str, ctx: ToolContext) -> str:
    """Runs when the schedule fires."""
    _book().record(ctx, "remind")
    return f"reminded: {note}"


scheduled_agent = Agent(
    name="scheduled",
    model=_two_steps(ModelResponse(text="later", tool_calls=(call("remind", "c1", note="tea"),))),
    tools=(remind,),
)


@tool(needs_permission=True, wait_deadline_s=1e-6)
def too_late(x: int) -> str:
    """Its ticket's deadline (a microsecond) has passed before any resume can arrive."""
    return "ran"


deadline_agent = Agent(
    name="deadline",
    model=_two_steps(ModelResponse(tool_calls=(call("too_late", "c1", x=1),))),
    tools=(too_late,),
)


def _once(key: str, wait: str) -> Hook:
    """At the first StepEnd only (the committed run state remembers), ask or pause."""

    def at_step_end(hook_input: HookInput) -> HookOutput | None:
        if hook_input.state["run"].get(key):
            return None
        if wait == "input":
            hook_input.execution.request_input("Which account?")
        else:
            hook_input.execution.pause()
        return HookOutput(commands=(Command(key=key, scope="run", value=True),))

    return Hook(point="StepEnd", fn=at_step_end, name=f"{wait}-once")


_ECHO_FIRST = ModelResponse(text="echo first", tool_calls=(call("echo", "c1", text="hi"),))
input_agent = Agent(
    name="asking", model=_two_steps(_ECHO_FIRST), tools=(echo,), hooks=(_once("asked", "input"),)
)
pause_agent = Agent(
    name="pausing", model=_two_steps(_ECHO_FIRST), tools=(echo,), hooks=(_once("paused", "pause"),)
)

slow_model_agent = Agent(
    name="slow-model",
    model=_two_steps(ModelResponse(text="thought long"), latency_s=LONG_S),
)


@tool(recovery=("replay_safe",))
async def long_nap(seconds: float, ctx: ToolContext) -> str:
    _book().record(ctx, "long_nap")
    await asyncio.sleep(seconds)
    return "rested"


long_nap_agent = Agent(
    name="long-nap",
    model=_two_steps(
        ModelResponse(text="nap", tool_calls=(call("long_nap", "c1", seconds=LONG_S),))
    ),
    tools=(long_nap,),
)


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words) if text]


class FlakyStreamModel:
    """Step 1's first attempt streams partial text, then the connection fails."""

    def __init__(self, script: Sequence[ModelResponse], partial: str) -> None:
        self.script = tuple(script)
        self.partial = partial

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        response = self.script[request.step]
        if request.step == 1 and request.attempt == 1:
            for word in _words(self.partial):
                yield ModelDelta(text=word)
            raise ConnectionError("model connection reset mid-stream")
        for word in _words(response.text):
            yield ModelDelta(text=word)
        yield response


ANSWER = "the answer is 42"
flaky_text_agent = Agent(
    name="flaky-text",
    model=FlakyStreamModel(
        (
            ModelResponse(text="let me check", tool_calls=(call("echo", "c1", text="check"),)),
            ModelResponse(text=ANSWER, tool_calls=(call("echo", "c2", text="42"),)),
            ModelResponse(text="all done"),
        ),
        partial="the answer might ",
    ),
    tools=(echo,),
)
"""Crash it at ("before:inference", 2): step 1 is then streamed twice in full."""


def gate_path(thread_id: str) -> str:
    """The file that opens ``gate`` for a thread (next to the effect ledger)."""
    book = _book()
    return str(book.path.parent / f"gate-{thread_id}")


def _until_exists(path: str, give_up_s: float = 120.0) -> None:
    deadline = time.monotonic() + give_up_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


@tool(recovery=("replay_safe",))
async def gate(ctx: ToolContext) -> str:
    """Holds the Run until the test opens the gate, so a watcher can join in time."""
    await asyncio.to_thread(_until_exists, gate_path(ctx.thread_id))
    return "open"


gated_flaky_agent = Agent(
    name="gated-flaky",
    model=FlakyStreamModel(
        (
            ModelResponse(text="one moment", tool_calls=(call("gate", "c1"),)),
            ModelResponse(text=ANSWER, tool_calls=(call("echo", "c2", text="42"),)),
            ModelResponse(text="all done"),
        ),
        partial="the answer might ",
    ),
    tools=(gate, echo),
)
"""Step 0 waits at the gate; step 1 streams partial text, fails, and streams again."""

failing_agent = Agent(
    name="failing",
    model=ScriptedModel((ModelResponse(text="one", tool_calls=(call("echo", "c1", text="x"),)),)),
    tools=(echo,),
)
"""Its script ends after step 0: step 1 fails the Run (failed/ScriptExhausted)."""
