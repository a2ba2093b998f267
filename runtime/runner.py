"""The in-process runner: the Step engine on plain asyncio, no Ray (tests, library use)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from runtime import tracing_env
from runtime.agent import Agent, load_agent
from runtime.batch import ToolOutput
from runtime.commit import Frontier
from runtime.control import control_engine
from runtime.delegation import (
    ChildOutcome,
    ChildRequest,
    ParentLink,
    awaited_child,
    delivery,
    outcome_of,
    parent_link,
)
from runtime.engine import Engine
from runtime.errors import (
    AgentImportError,
    Fenced,
    InputRefused,
    InvalidTransition,
    ResumeRejected,
    RunEnded,
)
from runtime.faults import NO_FAULTS, FaultPlan
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import ResumeCommand, RunningState
from runtime.limits import DEFAULT_LIMITS, STORED_IDS, Limits, check_id
from runtime.ports import CommitStore, Finished, LiveBus, ToolRunner
from runtime.publish import Publisher
from runtime.resume import check_command
from runtime.tool_calls import LocalToolRunner


class InProcessRunner:
    """Start, recover and resume Runs of one agent against one store, in this process.

    Child Runs (delegation) run as tasks of the same loop; their agents are rebuilt by
    reference (``module:attr``) with ``resolve``.
    """

    def __init__(
        self,
        agent: Agent,
        store: CommitStore,
        *,
        tools: ToolRunner | None = None,
        bus: LiveBus | None = None,
        resolve: Callable[[str], Agent] = load_agent,
        agent_ref: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        _check_type("agent", agent, Agent)
        _check_type("limits", limits, Limits)
        tracing_env.configure_from_env()  # OTEL_* asks for spans: the SDK's provider, once
        self.agent = agent
        self.store = store
        self.tools = tools or LocalToolRunner(agent.deployed_tools)
        self.bus = bus
        self.publisher = Publisher(bus) if bus is not None else None
        """Every engine of this runner publishes through it, off the commit path."""
        self.limits = limits
        self.children = InProcessChildren(
            store, publisher=self.publisher, resolve=resolve, limits=limits
        )
        self.lineage = (agent_ref or agent.name,)

    def engine(self, faults: FaultPlan = NO_FAULTS) -> Engine:
        _check_type("faults", faults, FaultPlan)
        return Engine(
            self.agent,
            self.store,
            self.tools,
            publisher=self.publisher,
            faults=faults,
            children=self.children,
            lineage=self.lineage,
            limits=self.limits,
        )

    async def start(
        self,
        text: str,
        *,
        thread_id: str | None = None,
        run_id: str | None = None,
        faults: FaultPlan = NO_FAULTS,
        new_thread: bool = False,
    ) -> Frontier:
        """``new_thread``: ``thread_id`` was made for this Run, as it is when none is
        given (``Engine.start``)."""
        # an id given empty is refused (``check_id``), not taken for "make me one"
        thread = ThreadId(f"thread-{uuid.uuid4().hex}" if thread_id is None else thread_id)
        rid = None if run_id is None else RunId(run_id)
        new = True if thread_id is None else new_thread
        return await self.engine(faults).start(thread, text, run_id=rid, new_thread=new)

    async def recover(self, thread_id: str, faults: FaultPlan = NO_FAULTS) -> Frontier:
        """Drive a thread's Run on from its committed frontier: a child's with its own
        agent (its parent link says which); a parent awaiting a lone child that has ended
        meanwhile (cancelled or stopped at rest, say) is handed that child's outcome, as a
        cluster's Supervisor would hand it."""
        thread = ThreadId(check_id("thread id", thread_id, STORED_IDS))  # a stored thread's
        link = await self.children.link_of(thread)
        engine = self.engine(faults) if link is None else self.children.engine(link, faults)
        done = await engine.recover(thread)
        if link is not None:
            return await self._handed_up(done, link, faults)
        child = await self.children.ended_child_of(done)
        child_link = parent_link(child) if child is not None else None
        if child is not None and child_link is not None:  # its hand-over never came: now
            return await self._handed_up(child, child_link, faults, done)
        return done

    async def resume(self, command: ResumeCommand, faults: FaultPlan = NO_FAULTS) -> Frontier:
        """Resume a Run (or a child Run); a child that ends delivers its outcome upward."""
        command = check_command(command, self.limits)  # refused before the store is asked anything
        link = await self.children.link_of(command.thread_id)
        if link is None:
            return await self.engine(faults).resume(command)
        done = await self.children.engine(link, faults).resume(command)
        return await self._handed_up(done, link, faults)

    async def _handed_up(
        self,
        child: Frontier,
        link: ParentLink,
        faults: FaultPlan,
        answer: Frontier | None = None,
    ) -> Frontier:
        """Hand an ended child's outcome to the parent awaiting it, if it still does;
        ``answer`` (the child's frontier by default) is returned. The child's own resume
        landed whatever becomes of the hand-over: a parent that moved on meanwhile (a
        cancel) keeps what it did, and the resume is not reported as refused."""
        delivery = await self.children.delivery(child, link)
        if delivery is not None:
            try:
                parent = await self.resume(delivery, faults)
            except (ResumeRejected, Fenced, RunEnded):
                parent = None  # the parent moved on: it no longer waits for this child
            if answer is not None and parent is not None:
                return parent
        return answer if answer is not None else child


class InProcessChildren:
    """The ChildRunner of the in-process runner."""

    def __init__(
        self,
        store: CommitStore,
        *,
        publisher: Publisher | None = None,
        resolve: Callable[[str], Agent] = load_agent,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.resolve = resolve
        self.limits = limits
        self.faults = NO_FAULTS
        """Fault plan shared by every child engine (crash tests)."""

    def engine(self, link: ParentLink, faults: FaultPlan | None = None) -> Engine:
        agent = self.resolve(link.agent)
        return Engine(
            agent,
            self.store,
            LocalToolRunner(agent.deployed_tools),
            publisher=self.publisher,
            faults=faults or self.faults,
            children=self,
            prompt_path=link.prompt_path,
            lineage=link.lineage,
            parent=link,
            limits=self.limits,
        )

    async def run(self, request: ChildRequest) -> ChildOutcome:
        try:
            link = ParentLink.of(request)
            engine = self.engine(link)
        except AgentImportError as exc:
            return Finished(output=ToolOutput(content=f"delegation failed: {exc}", is_error=True))
        # start is idempotent by run id: after a crash it finds the same child, which this
        # runner (the only one driving here) then recovers
        try:
            frontier = await engine.start(  # its thread is made for it (Engine.start)
                request.child_thread, request.input, run_id=request.child_run, new_thread=True
            )
        except (InputRefused, InvalidTransition) as exc:  # nothing was started: the call fails
            return Finished(output=ToolOutput(content=f"delegation failed: {exc}", is_error=True))
        if isinstance(frontier.run_state, RunningState) and frontier.run_id == request.child_run:
            frontier = await self.engine(link).recover(request.child_thread)
        return outcome_of(frontier)

    async def cancel(self, child_thread: ThreadId, child_run: RunId | None = None) -> None:
        frontier = await self.store.load(child_thread)
        if frontier.run_state is None or frontier.ended:
            return
        engine = control_engine(
            self.store, publisher=self.publisher, children=self, limits=self.limits
        )
        await engine.terminate(child_thread, run=child_run)

    async def link_of(self, thread: ThreadId) -> ParentLink | None:
        return parent_link(await self.store.load(thread))

    async def ended_child_of(self, parent: Frontier) -> Frontier | None:
        """The lone child a parent awaits, if that child has ended (its outcome is due)."""
        thread = awaited_child(parent)
        child = await self.store.load(thread) if thread is not None else None
        return child if child is not None and child.ended else None

    async def delivery(self, child: Frontier, link: ParentLink) -> ResumeCommand | None:
        """The resume that hands an ended child's outcome to a parent awaiting it."""
        return delivery(child, await self.store.load(link.thread), self.limits)


def _check_type(name: str, value: object, kind: type) -> None:
    """A parameter of the wrong type is a ``TypeError`` naming it, not an
    ``AttributeError`` from deep inside the first Run."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
