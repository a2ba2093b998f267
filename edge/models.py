"""The HTTP service's request and response bodies.

Neither an id's length nor a text's size is bound by the schemas: both are the running
system's rule (its ``SystemSpec.limits``, which need not be the defaults), applied when
the request reaches the client (``InputRefused``: 413 for a size, 422 naming the limit
otherwise: a ``run_id`` or a ``request_id`` past the system's ``id_chars`` is 422
``InputRefused(id_chars)``), so a size is 413 whatever its characters; the body's own cap
(``app.max_body_bytes``) bounds what is read. The sizes the descriptions quote are the
defaults. A resume payload is the runtime's own ``ResumePayload`` record, one
shape per wait kind.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.wire import run_meta
from cluster.cli_runs import RunRow
from runtime.commit import Frontier
from runtime.ids import ThreadId
from runtime.lifecycle import (
    ExternalResult,
    PermissionDecision,
    RunState,
    ScheduledFire,
    ThreadStatus,
    Unpause,
    UserInput,
    WaitExpired,
)
from runtime.limits import DEFAULT_LIMITS, Limits, history_headroom
from runtime.ports import RunSummary

LIMITS = DEFAULT_LIMITS
"""The limits the schemas' descriptions quote: the defaults, those ``ratchet serve``
connects with. The routes check every body against the running system's own."""

Id = Annotated[
    str,
    Field(
        min_length=1,
        description=f"At most the system's id_chars ({LIMITS.id_chars} by default) characters, "
        "no control characters: more is 422 InputRefused(id_chars)",
    ),
]
AGENT_REF_CHARS = 1024


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StartRun(Body):
    agent: str = Field(
        min_length=1,
        max_length=AGENT_REF_CHARS,
        description="The agent as MODULE:ATTR, as `ratchet run` takes it",
        examples=["myapp.agents:support"],
    )
    input: str = Field(
        description="The user's input: at most the system's input_bytes "
        f"({LIMITS.input_bytes} by default) as stored (UTF-8); more is 413 "
        "InputRefused(input_bytes)"
    )
    run_id: Id | None = Field(
        None,
        description="The Run's id: a start repeated with the same id returns the same Run "
        "(never a second one). None: a new id, so a repeated request starts another Run.",
    )
    placement: Literal["hosted", "dedicated"] = "hosted"


CallerPayload = Annotated[
    PermissionDecision | ExternalResult | ScheduledFire | UserInput | Unpause | WaitExpired,
    Field(discriminator="kind"),
]
"""What a caller may answer a ticket with: ``permission`` (approve or deny, a note),
``external_result`` (a client-executed tool's output), ``scheduled_action`` (fire),
``user_input`` (text), ``pause`` (unpause) or ``expired`` (end a tool wait whose
deadline has passed). A delegation's outcome is its child's."""


class Resume(Body):
    payload: CallerPayload
    request_id: Id | None = Field(
        None,
        description="Your id for this resume: retried after a lost answer, a resume that "
        "landed under it is a success, not a 409",
    )


class Stop(Body):
    reason: str = Field(
        description="At most the system's input_bytes "
        f"({LIMITS.input_bytes} by default) as stored (UTF-8): more is 413; "
        "a blank one is 422 InputRefused(empty)",
        examples=["over budget"],
    )


class HistoryRoom(BaseModel):
    """A thread's history against its limits (``runtime.limits``)."""

    bytes: int
    bytes_limit: int
    commits: int
    commits_limit: int


class ThreadSummary(BaseModel):
    """A thread's committed frontier in brief; ``status`` is the stream's status object."""

    thread_id: str
    version: int
    """Commits on the thread; 0: none."""
    run_id: str | None
    agent: str | None
    """The current Run's agent (``MODULE:ATTR``)."""
    run_state: RunState | None
    """``running``, ``awaiting`` (with the ticket a resume answers) or ``ended`` (with
    its cause)."""
    status: ThreadStatus
    steps: int
    history: HistoryRoom
    """How close the thread is to its history limits (``failed(history_limit)``)."""

    @classmethod
    def of(cls, frontier: Frontier, limits: Limits = DEFAULT_LIMITS) -> ThreadSummary:
        meta = run_meta(frontier)
        room = history_headroom(frontier.messages, frontier.version, limits)
        return cls(
            history=HistoryRoom(**room),
            thread_id=frontier.thread_id,
            version=frontier.version,
            run_id=frontier.run_id,
            agent=meta.agent_ref if meta is not None else None,
            run_state=frontier.run_state,
            status=frontier.status,
            steps=frontier.steps,
        )


class RunItem(RunSummary):
    """A thread's latest Run in a listing (as ``ratchet runs`` lists it)."""

    agent: str | None = None
    """The agent the Run was started with (``MODULE:ATTR``); None: not started by
    reference (a library Run)."""

    @classmethod
    def of(cls, row: RunRow) -> RunItem:
        return cls(**row.summary.model_dump(), agent=row.agent)


class RunsPage(BaseModel):
    runs: list[RunItem]
    next_cursor: ThreadId | None
    """Pass as ``cursor`` for the next page; None: this was the last."""


class CommitRecord(BaseModel):
    seq: int
    """The commit's sequence number; its facts' stream offsets are ``seq:index``."""
    commit: dict[str, Any]
    """The ThreadCommit (label, disposition, messages, batch, hashes), its ``events``
    every fact of the commit, derived ones included (``ThreadCommit.facts``)."""


class CommitsPage(BaseModel):
    thread_id: str
    commits: list[CommitRecord]
    next_after: int | None
    """Pass as ``after`` for the next page; None: this was the last."""


class ControlResult(BaseModel):
    outcome: Literal["signalled", "cancelled", "stopped", "not_running"]
    """``signalled``: its driver was told and ends it at its next check; ``cancelled`` /
    ``stopped``: it was at rest and is ended now; ``not_running``: nothing to do."""
    thread: ThreadSummary


__all__ = [
    "AGENT_REF_CHARS",
    "LIMITS",
    "CallerPayload",
    "CommitRecord",
    "CommitsPage",
    "ControlResult",
    "Resume",
    "RunsPage",
    "StartRun",
    "Stop",
    "ThreadSummary",
]
