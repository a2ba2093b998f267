"""ToolExecutor actors and the pools a host process sends waves to (DESIGN §6).

Executors are stateless: a wave names the agent by reference and the tool by id,
the executor rebuilds the agent (once per process) and runs the tool with
``invoke_safely``. Tools that declare Ray resources run in a pool whose actors
were created with exactly those resources, so they only ever run where the
resources exist. The host side (coalescing waves, losing them with their executor)
is ``actors.waves``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from collections.abc import AsyncIterator, Container, Mapping, Sequence
from typing import Any

import ray

from actors.heap import freeze_startup_heap
from actors.spare import replace_spare_if_restarted
from actors.wire import NAMESPACE, SystemSpec
from runtime import tracing_env
from runtime.agent import Agent, AgentImports
from runtime.batch import ToolOutput
from runtime.errors import AgentImportError
from runtime.limits import printable
from runtime.ports import Finished, Lost, ToolInvocation, ToolOutcome, Unavailable
from runtime.tool_calls import invoke_safely, run_calls

DEFAULT_POOL = "default"


class ToolExecutor:
    """Runs waves of tool calls; holds nothing but a cache of imported agents."""

    def __init__(self, warm_spares: bool = True) -> None:
        tracing_env.configure_from_env()  # OTEL_* (the actor's runtime_env) asks for spans
        self._agents: dict[str, Agent] = {}
        self._imports = AgentImports()
        self._waves: dict[str, asyncio.Task[list[Any]]] = {}
        """Waves running here, by id, so a host can cancel one (actors.waves)."""
        replace_spare_if_restarted(warm_spares)
        freeze_startup_heap()

    @ray.method(num_returns="streaming")
    async def run_waves(
        self, waves: Sequence[tuple[str, str, Sequence[ToolInvocation]]]
    ) -> AsyncIterator[list[tuple[str, list[Any]]]]:
        """Run many Runs' waves concurrently; yield each batch of finished ones at once."""
        running: dict[asyncio.Task[list[Any]], tuple[str, int]] = {}
        for wave_id, agent_ref, invocations in waves:
            task = asyncio.ensure_future(self.run(agent_ref, invocations))
            running[task] = (wave_id, len(invocations))
            self._waves[wave_id] = task
        pending = set(running)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finished = [(running[t][0], _answer(t, running[t][1])) for t in done]
                if finished := [(w, outcomes) for w, outcomes in finished if outcomes]:
                    yield finished
        finally:
            for task in pending:
                task.cancel()
            for wave_id, _ in running.values():
                self._waves.pop(wave_id, None)

    async def run_wave(
        self, wave_id: str, agent_ref: str, invocations: Sequence[ToolInvocation]
    ) -> list[Any]:
        """One wave alone, as a plain call: a streaming call costs about 1.5 ms more per
        round trip (a 10 ms tool: 14.2 against 15.6 ms here), which a lone Run pays."""
        task = asyncio.ensure_future(self.run(agent_ref, invocations))
        self._waves[wave_id] = task
        try:
            return await task
        finally:
            self._waves.pop(wave_id, None)

    async def cancel_waves(self, wave_ids: Sequence[str]) -> None:
        for wave_id in wave_ids:
            task = self._waves.get(wave_id)
            if task is not None:
                task.cancel()

    async def run(self, agent_ref: str, invocations: Sequence[ToolInvocation]) -> list[Any]:
        agent = self._agents.get(agent_ref)
        if agent is None:
            try:
                agent = await self._load(agent_ref)
            except AgentImportError as exc:
                message = f"executor cannot load agent: {exc}"
                return [Unavailable(message=message) for _ in invocations]
        return await run_calls([self._one(agent, inv) for inv in invocations])

    async def _load(self, ref: str) -> Agent:
        """Import the agent off this loop, once for all the waves that ask meanwhile."""
        agent = await self._imports.load(ref)
        self._agents[ref] = agent
        return agent

    @staticmethod
    async def _one(agent: Agent, inv: ToolInvocation) -> ToolOutcome:
        tool = agent.deployed_tool(inv.tool)
        if tool is None:
            text = f"tool {inv.tool!r} is not deployed on this executor"
            return Finished(output=ToolOutput(content=text, is_error=True))
        return await tracing_env.within(inv.trace_context, invoke_safely(tool, inv))

    async def ping(self) -> str:
        """Answered by the event loop: a host takes an executor that does not for hung."""
        return "pong"

    async def where(self) -> dict[str, Any]:
        """Where this executor runs and with what (for tests and diagnostics)."""
        ctx = ray.get_runtime_context()
        return {
            "node": ctx.get_node_id(),
            "resources": ctx.get_assigned_resources(),  # type: ignore[no-untyped-call]
            "pid": os.getpid(),
        }


def _answer(task: asyncio.Task[list[Any]], calls: int) -> list[Any]:
    """A finished wave's outcomes; a wave cancelled by its host answers nothing, and one
    that failed around its tools (a bug of ours) is lost, alone: its calls may have run,
    and the other waves of the call are answered as they finish."""
    if task.cancelled():
        return []
    error = task.exception()
    if error is None:
        return task.result()
    try:
        what = printable(f"{type(error).__name__}: {error}")
    except BaseException:
        what = type(error).__name__
    return [Lost(message=f"the executor failed around the wave: {what}")] * calls


RemoteToolExecutor = ray.remote(ToolExecutor)


def pool_key(resources: Mapping[str, float]) -> str:
    """A name for the pool serving exactly these resources."""
    if not resources:
        return DEFAULT_POOL
    parts = (f"{k}={v:g}" for k, v in sorted(resources.items()))
    return re.sub(r"[^A-Za-z0-9_=.-]", "_", ",".join(parts))


def pool_options(resources: Mapping[str, float]) -> dict[str, Any]:
    custom = {k: v for k, v in resources.items() if k not in ("num_cpus", "num_gpus")}
    options: dict[str, Any] = {"num_cpus": resources.get("num_cpus", 0)}
    if "num_gpus" in resources:
        options["num_gpus"] = resources["num_gpus"]
    if custom:
        options["resources"] = custom
    return options


class ExecutorPools:
    """The executor pools one process uses, created on first use (named, shared)."""

    def __init__(self, spec: SystemSpec) -> None:
        self.spec = spec
        self._pools: dict[str, list[Any]] = {}
        self._turn = itertools.count()

    def pool(self, resources: Mapping[str, float]) -> list[Any]:
        key = pool_key(resources)
        if key not in self._pools:
            self._pools[key] = [self._create(key, resources, i) for i in range(self._size(key))]
        return self._pools[key]

    def _size(self, key: str) -> int:
        # a resource pool holds scarce resources: one actor, unless it is the default pool
        return self.spec.executors if key == DEFAULT_POOL else 1

    def _create(self, key: str, resources: Mapping[str, float], index: int) -> Any:
        options = pool_options(resources)
        if key == DEFAULT_POOL:
            options.update(self.spec.core_options)
        return RemoteToolExecutor.options(
            name=self.spec.executor_name(key, index),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=10_000,
            **options,
        ).remote(self.spec.warm_spares)

    def pick(self, resources: Mapping[str, float], avoid: Container[Any] = ()) -> Any:
        """The pool's next executor in turn, passing over those in ``avoid`` (seen dead,
        restarting) while another is left."""
        pool = self.pool(resources)
        first = next(self._turn)
        for i in range(len(pool)):
            executor = pool[(first + i) % len(pool)]
            if executor not in avoid:
                return executor
        return pool[first % len(pool)]
