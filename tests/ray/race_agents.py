"""Agents for the race and dead-letter tests (``tests.ray.race_agents:name``).

``host_killer``: its model ends the process it is asked in — a RunHost, where the
engine streams inferences — every time (``os._exit``), so no recovery of its Run can
ever make progress. Each ask is first written to a file beside the EffectLedger
(``asks``), which survives the process's death. Anywhere but in a RunHost (the test
process, a client) the model refuses with an error instead: a test must not end itself.

``charging_agent``: one never_replay call, counted in this process (``CHARGES``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import ray

from runtime.agent import Agent
from runtime.models import InferenceRequest, ModelDelta, ModelResponse, ScriptedModel, call
from runtime.tools import ToolContext, tool


def asks_path() -> Path:
    ledger = os.environ.get("RATCHET_LEDGER")
    assert ledger, "RATCHET_LEDGER is not set"
    return Path(ledger).with_name("host-killer-asks.txt")


def asks(run_id: str) -> list[int]:
    """The pid of every process the killer model was asked in, for ``run_id``, in order."""
    path = asks_path()
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [int(pid) for run, pid in rows if run == run_id]


def _in_run_host() -> bool:
    if not ray.is_initialized():
        return False
    name = ray.get_runtime_context().get_actor_name() or ""
    return ":host:" in name or ":dedicated:" in name


class HostKillingModel:
    """Every inference ends the RunHost process asking for it."""

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        if not _in_run_host():
            raise RuntimeError("the host killer only kills RunHosts")
        fd = os.open(asks_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{request.run_id} {os.getpid()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os._exit(1)
        yield ModelResponse(text="never reached")  # makes this an async generator


host_killer = Agent(name="host-killer", model=HostKillingModel())


CHARGES: list[str] = []
"""Operation ids ``charge`` ran for, in this process (the in-process race test)."""


@tool
def charge(order: str, ctx: ToolContext) -> str:
    """never_replay: an effect that must happen at most once per operation id."""
    CHARGES.append(ctx.operation_id)
    return f"charged {order}"


charging_agent = Agent(
    name="charging",
    model=ScriptedModel(
        (
            ModelResponse(text="charging", tool_calls=(call("charge", "c1", order="o-1"),)),
            ModelResponse(text="charged"),
        )
    ),
    tools=(charge,),
)


class UntilFileModel:
    """Answers (and the Run ends, natural) ``ms`` milliseconds after the file its Run's
    input names (``"path|ms"``) exists: a test makes the Runs' own ends fall around what
    it releases at that moment."""

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        path, _, ms = str(getattr(request.messages[-1], "text", "")).partition("|")
        for _ in range(2400):  # 120 s at most
            if await asyncio.to_thread(os.path.exists, path):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(int(ms or 0) / 1000)
        yield ModelResponse(text="released")


until_file_agent = Agent(name="until-file", model=UntilFileModel())
