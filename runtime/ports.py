"""The ports: small Protocols the engine drives; storage/ and actors/ implement them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal, NamedTuple, Protocol

from pydantic import Field

from runtime.base import Frozen
from runtime.batch import ToolOutput
from runtime.commit import Frontier, Receipt, ThreadCommit, check_start
from runtime.errors import Fenced
from runtime.events import Delta, Fact
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.lifecycle import ThreadStatus
from runtime.state import Command


class CommittedRecord(Frozen):
    seq: int
    commit: ThreadCommit


class RunSummary(Frozen):
    thread_id: ThreadId
    run_id: RunId
    state: Literal["running", "awaiting", "ended"]
    status: ThreadStatus
    version: int
    cause: str | None = None
    """End cause kind for ended runs."""


class CommitStore(Protocol):
    async def append(self, commit: ThreadCommit, expected_version: int, epoch: int) -> Receipt:
        """Append iff the thread is at ``expected_version`` and ``epoch`` is current."""

    async def load(self, thread: ThreadId) -> Frontier:
        """The committed frontier; an empty one (version 0) for an unknown thread."""

    async def read(self, thread: ThreadId, after_seq: int = 0) -> list[CommittedRecord]:
        """Committed records with seq > after_seq, in order."""

    async def claim(self, thread: ThreadId, owner: str) -> int:
        """Become the thread's owner; returns the new epoch, fencing every earlier one."""

    async def claim_frontier(
        self, thread: ThreadId, owner: str, starting: RunId | None = None
    ) -> Frontier:
        """``claim``, returning the frontier as claimed (its epoch is the new one), so the
        claimer need not load it after. With ``starting``, the claim is refused
        (``InvalidTransition``, nothing written) while another Run of the thread is not
        ended (``runtime.commit.check_start``)."""

    async def list_runs(
        self, state: Literal["running", "awaiting", "ended"] | None = None
    ) -> list[RunSummary]:
        """The latest Run of every thread, optionally only those in ``state``."""

    async def close(self) -> None: ...


async def claim_then_load(
    store: CommitStore, thread: ThreadId, owner: str, starting: RunId | None = None
) -> Frontier:
    """``claim_frontier`` in three steps, for a backend that cannot make it one: the start
    rule is checked on a load before the claim, and the claim is read back after it.
    Someone else's claim in between surfaces as Fenced, never as their epoch."""
    if starting is not None:
        check_start(await store.load(thread), starting)
    epoch = await store.claim(thread, owner)
    frontier = await store.load(thread)
    if frontier.epoch != epoch:
        raise Fenced(thread, epoch, frontier.epoch)
    return frontier


class BusEvent(NamedTuple):
    """One delivered event and the opaque offset to resume after it."""

    offset: str
    event: Fact | Delta


class LiveBus(Protocol):
    async def publish(self, thread: ThreadId, events: Sequence[Fact | Delta]) -> None:
        """Best effort; a lost Delta costs nothing, facts are re-read from the store."""

    async def head(self, thread: ThreadId) -> str:
        """The offset after which only events published from now on arrive."""

    def subscribe(self, thread: ThreadId, after: str | None = None) -> AsyncIterator[BusEvent]:
        """Events after the offset ``after`` (None: only new ones)."""


class StreamCheckpoint(Frozen):
    run_id: RunId
    step: int
    text: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()


class StreamCheckpointStore(Protocol):
    async def get(self, thread: ThreadId) -> StreamCheckpoint | None: ...
    async def put(self, thread: ThreadId, checkpoint: StreamCheckpoint) -> None: ...
    async def delete(self, thread: ThreadId) -> None: ...


# ---- tool execution ---------------------------------------------------------------------


class ToolInvocation(Frozen):
    """One call as an executor receives it: ids and validated data, never a function."""

    tool: str
    arguments: dict[str, Any]
    call_id: CallId
    operation_id: OperationId
    attempt: int
    run_id: RunId
    thread_id: ThreadId
    prompt_path: tuple[str, ...] = ()
    timeout_s: float | None = None


class Finished(Frozen):
    """The tool returned, or raised (then ``output.is_error``): the outcome is known."""

    kind: Literal["finished"] = "finished"
    output: ToolOutput
    commands: tuple[Command, ...] = ()


class Unavailable(Frozen):
    """UnavailableBeforeDispatch: nothing was dispatched, safe to retry."""

    kind: Literal["unavailable"] = "unavailable"
    message: str


class Lost(Frozen):
    """The executor died or timed out mid-call: the effect may have happened."""

    kind: Literal["lost"] = "lost"
    message: str


ToolOutcome = Annotated[Finished | Unavailable | Lost, Field(discriminator="kind")]


class ToolRunner(Protocol):
    async def run(self, invocations: Sequence[ToolInvocation]) -> list[ToolOutcome]:
        """Run one wave; one round trip; outcomes in the invocations' order."""
