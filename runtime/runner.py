"""The in-process runner: the Step engine on plain asyncio, no Ray (tests, library use)."""

from __future__ import annotations

import uuid

from runtime.agent import Agent
from runtime.commit import Frontier
from runtime.engine import Engine
from runtime.faults import NO_FAULTS, FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import ResumeCommand
from runtime.ports import CommitStore, LiveBus, ToolRunner
from runtime.tools import LocalToolRunner


class InProcessRunner:
    """Start, recover and resume Runs of one agent against one store, in this process."""

    def __init__(
        self,
        agent: Agent,
        store: CommitStore,
        *,
        tools: ToolRunner | None = None,
        bus: LiveBus | None = None,
    ) -> None:
        self.agent = agent
        self.store = store
        self.tools = tools or LocalToolRunner(agent.tools)
        self.bus = bus

    def engine(self, faults: FaultPlan = NO_FAULTS) -> Engine:
        return Engine(self.agent, self.store, self.tools, bus=self.bus, faults=faults)

    async def start(
        self,
        text: str,
        *,
        thread_id: str | None = None,
        run_id: str | None = None,
        faults: FaultPlan = NO_FAULTS,
    ) -> Frontier:
        thread = ThreadId(thread_id or f"thread-{uuid.uuid4().hex}")
        rid = RunId(run_id) if run_id else None
        return await self.engine(faults).start(thread, text, run_id=rid)

    async def recover(self, thread_id: str, faults: FaultPlan = NO_FAULTS) -> Frontier:
        return await self.engine(faults).recover(ThreadId(thread_id))

    async def resume(self, command: ResumeCommand, faults: FaultPlan = NO_FAULTS) -> Frontier:
        return await self.engine(faults).resume(command)
