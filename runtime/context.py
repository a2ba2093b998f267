"""What the parts of a Step share: the Run's working copy, and the small set of services
the batch helpers need from whoever drives it (the Engine provides them).

The helpers (``runtime.toolbatch``, ``runtime.resume``) take a ``StepServices`` rather
than the Engine, so the import graph has no circle: engine → toolbatch → context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import TypeAdapter

from runtime.agent import Agent
from runtime.commit import CommitLabel, Frontier
from runtime.delegation import ChildRunner
from runtime.events import Fact
from runtime.execution import ExecutionState
from runtime.faults import FaultPlan
from runtime.hooks import HookPoint, HookResults
from runtime.ids import RunId
from runtime.lifecycle import (
    AwaitingState,
    EndCause,
    PauseTarget,
    RunDisposition,
    RunningState,
    RunWait,
    UserInputTarget,
)
from runtime.limits import Limits
from runtime.ports import ToolRunner
from runtime.state import Command

if TYPE_CHECKING:
    from runtime.tracing import RunTrace

STEP_ENDED = "step_ended"
"""Run-state key: the batch id whose Step's StepEnd hooks ran last."""
WAIT_KEY = "wait_request"
"""Run-state key: the wait (user input, a pause) a hook asked for in the middle of a
Step, not yet taken at the Step boundary (``wait_commands``)."""
_RUN_WAIT: TypeAdapter[UserInputTarget | PauseTarget] = TypeAdapter(RunWait)

T = TypeVar("T")


@dataclass(frozen=True)
class StoreRetry:
    """Backoff for StoreUnavailable: the Run pauses, it never records a guess."""

    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    give_up_after_s: float = 60.0
    """After this long a drive stops (its host drives it again later); settling a Run's
    end never gives up."""


DEFAULT_RETRY = StoreRetry()


@dataclass
class RunContext:
    """The engine's working copy of one Run (never the truth: the store is)."""

    frontier: Frontier
    epoch: int
    execution: ExecutionState
    pending: list[Command] = field(default_factory=list)
    """Hook commands staged for the next commit."""
    handed: int = 0
    """What the hooks whose output ``pending`` holds handed it (``HookResults.handed``):
    hooks run before that commit start their count from it, so all the hooks' output
    one commit carries is held to ``input_bytes`` together (the AfterTool hooks of calls
    a recovery sealed ride the results commit of the wave run after them)."""
    step_ended: str | None = None
    """Batch id whose StepEnd hooks already ran (they run once per Step).

    Kept across a wait those hooks asked for in the run state's ``STEP_ENDED``, which
    is committed with the wait (``RunContext.ended_step``)."""

    history_bytes: int | None = None
    """The thread's history size (``runtime.limits.history_size``), measured once per
    drive at its first commit and kept current by each commit after it."""

    landing: Landing | None = None
    """A commit folded into this copy whose receipt has not come back yet
    (``Committing.commit(..., landing=True)``): the next commit waits for it first."""

    spent: tuple[Command, ...] = ()
    """The usage of an inference made whose commit has not landed: an end before it (a
    hook that raises, the commit refused past a limit) carries it, so that what the
    provider counted is recorded (``Committing.end``)."""

    _running: RunningState | None = field(default=None, init=False, repr=False)

    def ends_step(self, batch_id: str) -> bool:
        """Whether the StepEnd hooks of ``batch_id``'s Step are still to run."""
        return batch_id not in (self.step_ended, self.frontier.state["run"].get(STEP_ENDED))

    def unstage(self) -> None:
        """What was staged went with a commit, or is dropped: nothing is staged now."""
        self.pending.clear()
        self.handed = 0

    def pause_step(
        self, target: PauseTarget | UserInputTarget, commands: Sequence[Command]
    ) -> None:
        """Pause before this Step's inference (the hooks' ``commands`` are committed with
        the wait); the Step starts over on the resume, its StepEnd hooks not again."""
        self.execution.wait_request = target
        self.pending.extend(commands)
        if self.frontier.batch is not None:
            self.ended_step(self.frontier.batch.batch_id, ())

    def ended_step(self, batch_id: str, commands: Sequence[Command]) -> None:
        """The StepEnd hooks of ``batch_id``'s Step ran before a wait or an end: their
        ``commands`` and a note that the Step ended are committed with it, so a resume
        does not end that Step a second time."""
        self.pending.extend(commands)
        self.pending.append(Command(key=STEP_ENDED, scope="run", value=batch_id))

    @property
    def run_id(self) -> RunId:
        assert self.frontier.run_id is not None
        return self.frontier.run_id

    def running(self) -> RunningState:
        """The Run's Running disposition: one record, reused by each commit that needs it."""
        run_id = self.run_id
        if self._running is None or self._running.run_id != run_id:
            self._running = RunningState(run_id=run_id)
        return self._running


def held_wait(frontier: Frontier) -> UserInputTarget | PauseTarget | None:
    """The wait a hook asked for that ``frontier`` holds, still to be taken: a resume or
    a recovery drives on from the store, never from the ExecutionState of the drive that
    ran the hook (an ended Run's is no one's: a start begins without it)."""
    if not isinstance(frontier.run_state, RunningState | AwaitingState):
        return None
    value = frontier.state["run"].get(WAIT_KEY)
    return None if value is None else _RUN_WAIT.validate_python(value)


def wait_commands(ctx: RunContext, label: CommitLabel) -> tuple[Command, ...]:
    """What a commit records of the Run's own wait: it brings ``WAIT_KEY`` to the
    ExecutionState's ``wait_request``. A hook's wait is thus set by the commit that
    carries the rest of its output (a call's wait resumed, or a crash, before the Step
    boundary keeps it), and removed by the awaiting commit that takes it (the boundary
    clears the request first), so it is taken once. An activation starts the Run's state
    afresh, and an end has no boundary left: neither records it."""
    if label in ("activation", "ended"):
        return ()
    target = ctx.execution.wait_request
    held = ctx.frontier.state["run"].get(WAIT_KEY)
    if target is None:
        return () if held is None else (Command(key=WAIT_KEY, scope="run", op="remove"),)
    value = target.model_dump(mode="json")
    return () if held == value else (Command(key=WAIT_KEY, scope="run", value=value),)


@dataclass(frozen=True)
class Landing:
    """A commit on its way to the store, and the working copy as it was before it (what
    the Run goes back to should the commit not land)."""

    task: asyncio.Task[None]
    frontier: Frontier
    epoch: int
    history_bytes: int | None


def has_landed(ctx: RunContext) -> bool:
    """Whether everything folded into ``ctx`` is in the store: no commit is on its way,
    or the one on its way has its receipt."""
    landing = ctx.landing
    if landing is None:
        return True
    task = landing.task
    return task.done() and not task.cancelled() and task.exception() is None


class StepServices(Protocol):
    """What carrying out a Step's batch needs from its driver."""

    root: Agent
    """The Run's agent (``agent`` is the one whose turn it is, in a session)."""
    agent: Agent
    tools: ToolRunner
    children: ChildRunner | None
    faults: FaultPlan
    limits: Limits
    prompt_path: tuple[str, ...]
    lineage: tuple[str, ...]
    trace: RunTrace | None
    """The drive's span (None: the drive is not traced)."""

    @property
    def ending(self) -> bool:
        """Cancelled or stopped: the Run ends at its next check."""

    async def commit(
        self,
        ctx: RunContext,
        label: CommitLabel,
        disposition: RunDisposition,
        *,
        claim: bool = False,
        landing: bool = False,
        **parts: Any,
    ) -> None:
        """Commit (and fold into ``ctx``); ``claim``: the commit also claims the thread;
        ``landing``: return once the commit is folded and on its way, where nothing
        before the next commit relies on its receipt (``Committing.commit``)."""

    async def hooks(
        self,
        ctx: RunContext,
        point: HookPoint,
        into: HookResults,
        *,
        step: int,
        response: Any = None,
        call: Any = None,
    ) -> None: ...

    async def guard(self, work: Awaitable[T]) -> T:
        """``work``, unless the cancellation signal fires first (CancelledSignal)."""

    async def guard_apart(self, work: Awaitable[T]) -> T:
        """``guard`` for user code that may hold on to its cancellation: in a task of its
        own, left behind if it does not take the signal's cancellation in time."""

    def control_cause(self, ctx: RunContext) -> EndCause:
        """How the Run ends now that it was cancelled or stopped."""

    async def end(
        self, ctx: RunContext, cause: EndCause, *, claim: bool = False, facts: Sequence[Fact] = ()
    ) -> None:
        """Commit the Run's end (``Committing.end``); ``claim``: the end claims the thread,
        as a Run ended at rest by an engine not driving it is (a cancel's); ``facts``:
        what it records besides."""


__all__: Sequence[str] = ("RunContext", "StepServices", "StoreRetry")
