"""The ports: small Protocols the engine drives; storage/ and actors/ implement them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Annotated, Any, Literal, NamedTuple, Protocol

from pydantic import Field

from runtime.base import Frozen
from runtime.batch import ToolOutput
from runtime.commit import Frontier, Receipt, ThreadCommit
from runtime.events import Delta, Fact
from runtime.execution import ExecutionSnapshot, ToolRequest
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
    owner: str | None = None
    """The thread's current owner (a RunHost's is ``host#pid``)."""


class Listing(list[RunSummary]):
    """What ``CommitStore.list_runs`` answers: the entries that verify, and the threads
    whose entries did not (``refused``: left out and logged), so that a sweep can report
    and quarantine them rather than never hear of them."""

    refused: tuple[ThreadId, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[RunSummary], refused: Iterable[ThreadId] = ()) -> Listing:
        listing = cls(entries)
        listing.refused = tuple(refused)
        return listing


def refused_in(listing: Sequence[RunSummary]) -> tuple[ThreadId, ...]:
    """The threads a listing left out as not verifying (none for a plain list)."""
    return listing.refused if isinstance(listing, Listing) else ()


class CommitStore(Protocol):
    """The committed log and frontier of every thread. Whatever it hands back it has
    verified (``runtime.integrity``): anything that does not hold is CorruptRecord.

    A store may say ``ordered_appends = True``: one caller's appends are applied in the
    order the caller made them (each call queues its request before it first waits).
    An engine then queues a commit behind one still on its way instead of waiting for
    that one's receipt (``runtime.committing``); without it, it waits."""

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        """Append iff the thread is at ``expected_version`` and ``epoch`` is its owner
        epoch. With ``claim``, the writer supersedes ``epoch`` and becomes the owner
        ``claim`` at epoch + 1 in the same atomic step (``runtime.rules.admit``)."""

    async def load(self, thread: ThreadId) -> Frontier:
        """The committed frontier, its messages included; an empty one (version 0) for an
        unknown thread. The messages are kept once, in the log (and a pruned thread's
        pruned history): a load reads and verifies the whole log, as ``read`` does."""

    async def load_head(self, thread: ThreadId) -> Frontier:
        """The committed frontier without its messages (``message_count`` says how many
        there are), checked as ``load`` checks it but for the log: it reads no history.
        What a claim answers is a head too."""

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        """Committed records with seq > after_seq, in order, verified against the chain.
        With ``limit`` (1 or more, else ValueError), at most that many: a page, whose
        work is bounded by it, not by the log's length. A page is verified as the chain
        from the record before it (or the anchor, or seq 1) to its last record, which
        must be there; the frontier's head is checked by the page that reaches it."""

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        """Become the thread's owner if its owner epoch is still ``supersedes`` (else
        Fenced, nothing written); returns the frontier's head as claimed (epoch + 1)."""

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        """The latest Run of every thread, optionally only those in ``state`` and those
        whose owner belongs to ``host`` (``host_of``); the stores keep an index of both."""

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        """Every thread the store holds, in id order, ``limit`` at a time after ``after``
        (for audits and maintenance: nothing is decoded, so a corrupt row is listed too)."""

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        """Retention: remove the thread's records up to ``through_seq``, in one atomic
        step; returns how many went (0: none were left to remove). ``through_seq`` must
        be the seq of a Run's ``ended`` commit (else InvalidTransition, nothing removed):
        every record removed then belongs to a Run that had ended, and nothing of a Run
        still active goes. The frontier stays as it is, and the seq and stored hash of
        the last record removed stay beside it, so the records kept are verified as a
        chain from it. Receipts of removed records go with them (a retry of one is no
        longer recognised). Safe beside appends and other prunes of the same thread."""

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Hold the lease ``name`` for ``ttl_s`` from now, by the store's clock, if it is
        free, expired or ``holder``'s already (then renewed); else leave it as it is.
        Answers who holds it now, and for how much longer. One atomic step: of callers
        racing for a free lease, one holds it. A lease that runs out further ahead than
        ``storage.leases.MAX_LEASE_AHEAD_S`` (600 s) was set by hand (or before the
        clock stepped back) and is taken as an expired one: hold none longer."""

    async def drop_lease(self, name: str, holder: str) -> None:
        """Give the lease ``name`` up, if ``holder`` holds it."""

    async def close(self) -> None: ...


class Lease(NamedTuple):
    """Who holds a store lease (``CommitStore.hold_lease``) and for how much longer."""

    holder: str
    expires_in_s: float


def host_of(owner: str | None) -> str | None:
    """The host part of an owner name: a RunHost owns as ``host#pid``."""
    return None if owner is None else owner.split("#", 1)[0]


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
    epoch: int = 0
    """The owner epoch of the engine that sent it: with the operation id, what lets a
    downstream system refuse a zombie (an older epoch) after a takeover."""
    execution: ExecutionSnapshot | None = None
    """The Run's ExecutionState as the call was sent (the tool's ``ctx.execution``)."""
    trace_context: dict[str, str] | None = None
    """The call's ``execute_tool`` span as W3C headers (``traceparent``), while tracing is
    on: the tool runs as its child, wherever it runs (``runtime.tracing.within``)."""


class Finished(Frozen):
    """The tool returned, or raised (then ``output.is_error``): the outcome is known."""

    kind: Literal["finished"] = "finished"
    output: ToolOutput
    commands: tuple[Command, ...] = ()
    requests: tuple[ToolRequest, ...] = ()
    """What the tool asked of its Run (``ctx.execution.stop()``, ...), applied when the
    result is committed."""

    @classmethod
    def refused(cls, error: Exception) -> Finished:
        """What the model is shown of an outcome that cannot be committed (over a limit,
        not storable text): an error naming why; its commands and requests dropped."""
        return cls(output=ToolOutput(content=f"tool output refused: {error}", is_error=True))


async def vouched_log(
    store: CommitStore, thread: ThreadId
) -> tuple[Frontier, list[CommittedRecord]]:
    """The thread's head and records, for a whole-log operation (prune, fork, export,
    replay). ``read`` verifies only the records' chain; the head is checked first
    (``load_head``: the frontier's checksum, its owner epoch, the hash of the record at
    its version), so a thread whose frontier does not verify is CorruptRecord here,
    never pruned, copied or exported as whole. The log is read once, by ``read``."""
    head = await store.load_head(thread)
    return head, await store.read(thread)


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
