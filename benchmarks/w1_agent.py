"""The W1 agent, addressed by reference with its parameters in the name.

``benchmarks.w1_agent:w1_s5_k2_m0_t0_l<tag>`` is an agent of S=5 model Steps, K=2
tool calls per Step (Steps 1..S-1), model latency 0 ms, tool latency 0 ms, whose
tools and model record into the ledger directory ``<tmp>/ratchet-w1-<tag>``. The
module resolves such names itself (``__getattr__``), so every process that
rebuilds the agent by reference — RunHosts, ToolExecutors, a restarted host, the
baseline's actors — builds exactly the same one, with nothing to pass through the
environment.

The ledger: one file per process, opened ``O_APPEND``; each line is written with
a single ``write`` (it survives the death of the process that wrote it). Lines:

    m <run_id> <step> <unix time>                      an inference began
    t <operation_id> <tool> <attempt> <unix time>      a tool's effect happened
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.agent import Agent
from runtime.models import InferenceRequest, ModelResponse, ScriptedModel, call
from runtime.tools import Tool, ToolContext, tool

NAME = re.compile(r"^w1_s(\d+)_k(\d+)_m(\d+(?:\.\d+)?)_t(\d+(?:\.\d+)?)(?:_l([0-9a-z]+))?$")
READ_TOOL = "w1_read"
"""replay_safe: re-run with the same operation id after a lost executor."""
WRITE_TOOL = "w1_write"
"""never_replay: an interrupted call becomes indeterminate, never runs twice."""
NEVER_REPLAY = (WRITE_TOOL,)


@dataclass(frozen=True)
class W1:
    steps: int = 5
    tools: int = 2
    model_latency_ms: float = 0.0
    tool_latency_ms: float = 0.0
    ledger: str | None = None
    """Ledger tag (``ratchet-w1-<tag>`` under the temp dir); None records nothing."""

    @property
    def name(self) -> str:
        tail = f"_l{self.ledger}" if self.ledger else ""
        m, t = _num(self.model_latency_ms), _num(self.tool_latency_ms)
        return f"w1_s{self.steps}_k{self.tools}_m{m}_t{t}{tail}"

    @property
    def ref(self) -> str:
        return f"{__name__}:{self.name}"

    @classmethod
    def parse(cls, name: str) -> W1 | None:
        match = NAME.match(name)
        if match is None:
            return None
        s, k, m, t, tag = match.groups()
        return cls(int(s), int(k), float(m), float(t), tag)

    def final_text(self, run_id: str) -> str:
        return f"W1 done: {run_id} after {self.steps} steps"

    def call_id(self, step: int, k: int) -> str:
        return f"s{step}c{k}"

    def tool_of(self, k: int) -> str:
        return READ_TOOL if k % 2 == 0 else WRITE_TOOL

    def operation_ids(self, run_id: str) -> list[str]:
        """Every tool call's operation id of one Run, as the engine derives them."""
        return [
            f"tool-batch:{run_id}:{step}:{self.call_id(step, k)}"
            for step in range(self.steps - 1)
            for k in range(self.tools)
        ]

    def commits_per_run(self) -> int:
        """Activation, (inference marking the one wave executing, results) per tool
        Step, the natural end."""
        return 2 + 2 * (self.steps - 1) if self.tools else 2 + (self.steps - 1)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def ledger_dir(tag: str) -> Path:
    return Path(tempfile.gettempdir()) / f"ratchet-w1-{tag}"


def new_ledger() -> str:
    """A fresh ledger tag, its directory created."""
    tag = uuid.uuid4().hex[:12]
    ledger_dir(tag).mkdir(parents=True, exist_ok=False)
    return tag


_files: dict[str, int] = {}


def record(tag: str | None, *fields: object) -> None:
    """Append one line to this process's ledger file (one write: kill-safe)."""
    if not tag:
        return
    fd = _files.get(tag)
    if fd is None:
        path = ledger_dir(tag) / f"{os.getpid()}-{uuid.uuid4().hex[:6]}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _files[tag] = fd
    os.write(fd, (" ".join(map(str, fields)) + "\n").encode())


def read_ledger(tag: str) -> list[list[str]]:
    """Every complete line of every process's ledger file."""
    lines: list[list[str]] = []
    for path in sorted(ledger_dir(tag).glob("*.log")):
        for line in path.read_text().splitlines():
            if line:
                lines.append(line.split(" "))
    return lines


def _tools(params: W1) -> tuple[Tool, Tool]:
    latency = params.tool_latency_ms / 1000
    tag = params.ledger

    @tool(name=READ_TOOL, recovery=("replay_safe", "never_replay"))
    async def read(n: int, ctx: ToolContext) -> str:
        """Look something up (no side effect: safe to run again)."""
        if latency:
            await asyncio.sleep(latency)
        record(tag, "t", ctx.operation_id, READ_TOOL, ctx.attempt, time.time())
        return f"value {n}"

    @tool(name=WRITE_TOOL)
    async def write(n: int, ctx: ToolContext) -> str:
        """Write something (an effect: never replayed)."""
        if latency:
            await asyncio.sleep(latency)
        record(tag, "t", ctx.operation_id, WRITE_TOOL, ctx.attempt, time.time())
        return f"wrote {n}"

    return read, write


def build(params: W1) -> Agent:
    def tool_step(step: int) -> Callable[[InferenceRequest], ModelResponse]:
        def respond(request: InferenceRequest) -> ModelResponse:
            record(params.ledger, "m", request.run_id, step, time.time())
            calls = tuple(
                call(params.tool_of(k), params.call_id(step, k), n=k) for k in range(params.tools)
            )
            return ModelResponse(text=f"step {step}", tool_calls=calls)

        return respond

    def final(request: InferenceRequest) -> ModelResponse:
        record(params.ledger, "m", request.run_id, params.steps - 1, time.time())
        return ModelResponse(text=params.final_text(request.run_id))

    script = [tool_step(i) for i in range(params.steps - 1)] + [final]
    return Agent(
        name="w1",
        model=ScriptedModel(script, latency_s=params.model_latency_ms / 1000),
        tools=_tools(params),
        max_steps=params.steps,
    )


_built: dict[str, Agent] = {}


def __getattr__(name: str) -> Agent:
    params = W1.parse(name)
    if params is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        _built[name] = build(params)
    return _built[name]


agent = build(W1())
"""``benchmarks.w1_agent:agent``: W1 with the defaults and no ledger."""
