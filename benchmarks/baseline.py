"""The no-durability baseline: W1 on plain Ray, nothing committed anywhere.

The same agent (same ScriptedModel, same tools, same ledger records) driven the
obvious way: each Run is an asyncio task inside one of H async host actors
(hosted), or in an actor of its own (dedicated); each Step's tool calls go to one
of E ToolExecutor actors in one round trip (the same ``ToolExecutor`` class the
durable system uses). What the durable run costs beyond this is what durability
costs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import ray

from actors.heap import freeze_startup_heap
from actors.tool_executor import RemoteToolExecutor
from actors.wire import host_index
from runtime.agent import Agent, load_agent
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.messages import AssistantMessage, Message, ToolResultMessage, UserMessage
from runtime.models import InferenceRequest, ModelResponse
from runtime.ports import Finished, ToolInvocation


class BaselineHost:
    """Drives Runs as asyncio tasks; keeps nothing once a Run returns."""

    def __init__(self, agent_ref: str, executors: list[Any]) -> None:
        self.agent_ref = agent_ref
        self.agent: Agent = load_agent(agent_ref)
        self.executors = executors
        self.turn = itertools.count()
        self.schemas = tuple(t.schema() for t in self.agent.tools)
        freeze_startup_heap()  # as a RunHost does: the comparison is of durability alone

    async def ping(self) -> bool:
        return True

    async def run(self, thread: str, run_id: str, text: str) -> str:
        agent = self.agent
        messages: list[Message] = [UserMessage(id=f"{run_id}:input", text=text)]
        for step in range(agent.max_steps):
            last = step == agent.max_steps - 1
            request = InferenceRequest(
                run_id=RunId(run_id),
                step=step,
                attempt=1,
                messages=tuple(messages),
                tools=None if last else self.schemas,
            )
            response = await _infer(agent, request)
            messages.append(AssistantMessage(text=response.text, tool_calls=response.tool_calls))
            if not response.tool_calls or last:
                return response.text
            invocations = [
                ToolInvocation(
                    tool=use.tool,
                    arguments=json.loads(use.arguments),
                    call_id=CallId(use.call_id),
                    operation_id=OperationId(f"tool-batch:{run_id}:{step}:{use.call_id}"),
                    attempt=1,
                    run_id=RunId(run_id),
                    thread_id=ThreadId(thread),
                )
                for use in response.tool_calls
            ]
            executor = self.executors[next(self.turn) % len(self.executors)]
            outcomes = await executor.run.remote(self.agent_ref, invocations)
            for use, outcome in zip(response.tool_calls, outcomes, strict=True):
                content = outcome.output.content if isinstance(outcome, Finished) else "lost"
                messages.append(
                    ToolResultMessage(call_id=use.call_id, tool=use.tool, content=content)
                )
        return ""


async def _infer(agent: Agent, request: InferenceRequest) -> ModelResponse:
    response: ModelResponse | None = None
    async for item in agent.model.stream(request):
        if isinstance(item, ModelResponse):
            response = item
    assert response is not None
    return response


RemoteBaselineHost = ray.remote(BaselineHost)
ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 10_000}


class Baseline:
    """The baseline's actors: H hosts (hosted) and E executors, started and warmed up."""

    def __init__(self, agent_ref: str, hosts: int, executors: int, placement: str) -> None:
        self.agent_ref = agent_ref
        self.placement = placement
        self.executors = [
            RemoteToolExecutor.options(**ACTOR_OPTIONS).remote()  # type: ignore[attr-defined]
            for _ in range(executors)
        ]
        self.hosts = [self._host() for _ in range(hosts)] if placement == "hosted" else []

    def _host(self) -> Any:
        return RemoteBaselineHost.options(**ACTOR_OPTIONS).remote(  # type: ignore[attr-defined]
            self.agent_ref, self.executors
        )

    async def ready(self) -> None:
        await asyncio.gather(*(h.ping.remote() for h in self.hosts))
        await asyncio.gather(*(e.where.remote() for e in self.executors))

    async def run(self, thread: str, run_id: str, text: str) -> str:
        if self.placement == "hosted":
            host = self.hosts[host_index(thread, len(self.hosts))]
            result: str = await host.run.remote(thread, run_id, text)
            return result
        host = self._host()  # one actor per Run, gone with it
        try:
            result = await host.run.remote(thread, run_id, text)
        finally:
            ray.kill(host)
        return result

    def close(self) -> None:
        for actor in [*self.hosts, *self.executors]:
            ray.kill(actor)
