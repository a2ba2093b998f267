"""ToolExecutor actors and the host-side ToolRunner that drives them (DESIGN §6).

Executors are stateless: a call names the agent by reference and the tool by id,
the executor rebuilds the agent (once per process) and runs the tool with
``invoke_safely``. Tools that declare Ray resources run in a pool whose actors
were created with exactly those resources, so they only ever run where the
resources exist. A wave is one actor round trip per pool it touches.

An executor that dies mid-call (``RayActorError``) or outlives the call's timeout
yields ``Lost`` for its calls: the effect may have happened, and the engine's
pinned policy decides (never_replay → indeterminate, replayable → re-run with the
same operation id).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.wire import NAMESPACE, SystemSpec
from runtime.agent import Agent, load_agent
from runtime.batch import ToolOutput
from runtime.errors import AgentImportError
from runtime.ports import Finished, Lost, ToolInvocation, ToolOutcome, Unavailable
from runtime.tools import Tool, invoke_safely

TIMEOUT_GRACE_S = 5.0
"""How long past a tool's own timeout the host waits before calling the executor lost."""
DEFAULT_POOL = "default"


class ToolExecutor:
    """Runs waves of tool calls; holds nothing but a cache of imported agents."""

    def __init__(self) -> None:
        self._agents: dict[str, Agent] = {}

    async def run(self, agent_ref: str, invocations: Sequence[ToolInvocation]) -> list[Any]:
        try:
            agent = self._agent(agent_ref)
        except AgentImportError as exc:
            return [Unavailable(message=f"executor cannot load agent: {exc}") for _ in invocations]
        return list(await asyncio.gather(*(self._one(agent, inv) for inv in invocations)))

    def _agent(self, ref: str) -> Agent:
        if ref not in self._agents:
            self._agents[ref] = load_agent(ref)
        return self._agents[ref]

    @staticmethod
    async def _one(agent: Agent, inv: ToolInvocation) -> ToolOutcome:
        tool = agent.tool(inv.tool)
        if tool is None:
            text = f"tool {inv.tool!r} is not deployed on this executor"
            return Finished(output=ToolOutput(content=text, is_error=True))
        return await invoke_safely(tool, inv)

    async def where(self) -> dict[str, Any]:
        """Where this executor runs and with what (for tests and diagnostics)."""
        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "resources": ctx.get_assigned_resources()}


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
        ).remote()

    def pick(self, resources: Mapping[str, float]) -> Any:
        pool = self.pool(resources)
        return pool[next(self._turn) % len(pool)]


class RayToolRunner:
    """The ToolRunner port on Ray: one executor round trip per wave and pool."""

    def __init__(self, agent_ref: str, agent: Agent, pools: ExecutorPools) -> None:
        self.agent_ref = agent_ref
        self.agent = agent
        self.pools = pools

    async def run(self, invocations: Sequence[ToolInvocation]) -> list[ToolOutcome]:
        groups: dict[str, list[int]] = {}
        resources: dict[str, Mapping[str, float]] = {}
        for i, inv in enumerate(invocations):
            needs = self._resources(inv.tool)
            key = pool_key(needs)
            groups.setdefault(key, []).append(i)
            resources[key] = needs
        outcomes: list[ToolOutcome | None] = [None] * len(invocations)
        parts = [
            self._round_trip(resources[key], [invocations[i] for i in idx])
            for key, idx in groups.items()
        ]
        for idx, results in zip(groups.values(), await asyncio.gather(*parts), strict=True):
            for i, outcome in zip(idx, results, strict=True):
                outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    def _resources(self, tool_id: str) -> Mapping[str, float]:
        tool: Tool | None = self.agent.tool(tool_id)
        return tool.resources if tool is not None else {}

    async def _round_trip(
        self, resources: Mapping[str, float], invocations: list[ToolInvocation]
    ) -> list[ToolOutcome]:
        executor = self.pools.pick(resources)
        ref = executor.run.remote(self.agent_ref, invocations)
        try:
            return list(await asyncio.wait_for(ref, _deadline(invocations)))
        except TimeoutError:
            ray.cancel(ref, force=False)
            return [Lost(message="executor did not answer before the call's timeout")] * len(
                invocations
            )
        except asyncio.CancelledError:  # the Run was cancelled: stop the tool where it runs
            ray.cancel(ref, force=False)
            raise
        except RayActorError as exc:
            message = f"executor died mid-call ({type(exc).__name__})"
            return [Lost(message=message)] * len(invocations)
        except RayTaskError as exc:  # the executor itself failed around the tools
            return [Lost(message=f"executor failed: {exc.cause!r}")] * len(invocations)


def _deadline(invocations: Sequence[ToolInvocation]) -> float | None:
    timeouts = [inv.timeout_s for inv in invocations]
    if any(t is None for t in timeouts):
        return None
    return max(t for t in timeouts if t is not None) + TIMEOUT_GRACE_S
