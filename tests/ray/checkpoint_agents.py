"""An agent whose first inference dies with its host mid-stream (stream checkpoints on Ray).

The model writes one line per inference it is asked for, next to the effect ledger, so
the test can tell whether a recovered Step asked the model again.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from runtime import Agent, ModelDelta, ModelResponse, ToolContext, call, tool


def _dir() -> Path:
    return Path(os.environ["RATCHET_LEDGER"]).parent


def asked(run_id: str) -> list[str]:
    path = _dir() / f"asked-{run_id.replace('/', '_')}"
    return path.read_text().splitlines() if path.exists() else []


def _note(tag: str, step: int) -> None:
    with open(_dir() / f"asked-{tag}", "a") as log:
        log.write(f"{step}\n")


@tool(recovery=("replay_safe",))
def lookup(key: str, ctx: ToolContext) -> str:
    return f"value of {key}"


class DiesMidStream:
    """Step 0, first time ever for a Run: stream text and a complete tool call, then the
    host process ends (os._exit) before the response completes. Its latency is part of
    the workload: the engine checkpoints on deltas that arrive over time."""

    async def stream(self, request):  # type: ignore[no-untyped-def]
        tag = request.run_id.replace("/", "_")
        _note(tag, request.step)
        crashed = _dir() / f"crashed-{tag}"
        if request.step == 0 and not crashed.exists():
            yield ModelDelta(text="Looking it up. ")
            await asyncio.sleep(0.3)
            yield ModelDelta(type="tool_call_delta", call_id="c1", tool="lookup", text='{"key": ')
            await asyncio.sleep(0.3)
            yield ModelDelta(type="tool_call_delta", call_id="c1", text='"a"}')
            await asyncio.sleep(0.3)
            yield ModelDelta(text="")  # one more delta: the checkpoint now holds the whole call
            crashed.touch()
            os._exit(23)
        if request.step == 0:
            yield ModelResponse(text="asked again", tool_calls=(call("lookup", "c1", key="a"),))
        else:
            yield ModelResponse(text="the value is known")


agent = Agent(name="dies_mid_stream", model=DiesMidStream(), tools=[lookup])
