"""Ratchet's one error vocabulary.

    RatchetError
    ├── InvalidTransition        a state-machine rule was broken (batch, run state)
    ├── CorruptBatch             a persisted batch failed re-validation on decode
    ├── ResumeRejected           a ResumeCommand did not match the ticket (names the axis)
    ├── ResumeEnded              a resume was taken, but could not land: what resuming
    │                            writes is past the thread's limits, and the Run ended
    │                            failed(history_limit) instead (names the limit)
    ├── StateConflict            state commands of one commit cannot be merged
    ├── ToolDefinitionError      a @tool cannot be built from its signature, or two tools
    │                            of an agent (an MCP listing) share a name
    ├── ScriptExhausted          a ScriptedModel was asked for more than its script
    ├── AgentImportError         an agent reference ``module:attr`` cannot be resolved
    ├── SystemInUse              another live Ray cluster serves the store's system
    ├── ConfigError              a client joining a running system asked for other
    │                            settings than it runs with (names them)
    ├── InputRefused             input refused at the edge: a limit, bad text, deep JSON
    │   │                        (names the limit; nothing was committed)
    │   └── HistoryLimitReached  the thread's history is at its size or commit limit
    ├── ModelError               a model provider's failure, classified by its adapter
    │   ├── ModelRefused         permanent: a bad request, context too long, auth (ends
    │   │                        the Run failed(inference) at once)
    │   └── ModelUnavailable     transient: timeout, dropped stream, 5xx (a new attempt)
    │       └── ModelRateLimited 429 / overloaded (backs off, then pauses the Run)
    └── StoreError               raised by every store backend, never a driver error
        ├── VersionConflict      the thread is not at the expected version
        ├── Fenced               the writer's owner epoch is stale
        ├── DuplicateOperation   a known operation id arrived with a different payload
        ├── RunEnded             the Run is ended; nothing more may be committed
        ├── StoreUnavailable     the server cannot be reached (retry with backoff)
        ├── CorruptRecord        a stored record failed validation (names thread, seq)
        ├── StoreLost            the store lost its contents (an in-memory store restarted)
        └── PayloadTooLarge      a commit exceeds the backend's limit (names it)

Backends translate driver exceptions into these at their edge; nothing above
``storage/`` catches a driver exception.
"""

from __future__ import annotations

from typing import Any


class RatchetError(Exception):
    """Base of every error Ratchet raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take other constructor arguments than their message; rebuild by
        # state so the error crosses process boundaries (Ray) as its own type.
        return (_rebuild, (type(self), self.args, dict(vars(self))))


def _rebuild(kind: type[RatchetError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    vars(error).update(state)
    return error


class InvalidTransition(RatchetError):
    """A transition that the state machines of DESIGN §2 forbid."""


class CorruptBatch(RatchetError):
    """A persisted ActiveToolBatch broke an invariant when it was decoded."""


class ResumeRejected(RatchetError):
    """A ResumeCommand failed validation; the ticket is left intact."""

    def __init__(self, axis: str, detail: str) -> None:
        super().__init__(f"resume rejected on {axis}: {detail}")
        self.axis = axis
        self.detail = detail


class ResumeEnded(RatchetError):
    """A resume was taken (its ticket is gone; no rival's can land), but what the runtime
    itself writes to resume (a grant, a handoff, the commit) is past the thread's history
    limits: the Run ended ``failed(history_limit, <limit>)`` instead, and the answer was
    never applied. Asked again under the same request id, the same error (the resume is
    still the caller's, not a rival's). ``limit`` names the limit (``history_commits``,
    ``history_bytes``, ``state_bytes``)."""

    def __init__(self, thread_id: str, run_id: str, limit: str) -> None:
        super().__init__(
            f"the resume of run {run_id} on thread {thread_id} could not land: the run "
            f"ended failed (history_limit/{limit}) instead"
        )
        self.thread_id, self.run_id, self.limit = thread_id, run_id, limit


class StateConflict(RatchetError):
    """Two state commands of one commit cannot be merged under their policy."""


class ToolDefinitionError(RatchetError, ValueError):
    """A tool's declaration is unusable (bad signature, unknown recovery mode, a name two
    tools of one agent share). A ValueError too: what an agent's tools were refused with
    before it was typed."""


class ScriptExhausted(RatchetError):
    """A ScriptedModel was asked for a response beyond the end of its script."""


class AgentImportError(RatchetError):
    """An agent reference could not be imported or is not an Agent."""


class InputRefused(RatchetError):
    """Input that breaks a documented limit or cannot be stored; refused before anything
    is committed. ``limit`` names the limit (``runtime.limits``) or the rule broken."""

    def __init__(self, what: str, limit: str, detail: str) -> None:
        super().__init__(f"{what} refused ({limit}): {detail}")
        self.what, self.limit, self.detail = what, limit, detail


class CommitRefused(InputRefused):
    """A commit no store can hold (text with an unpaired surrogate, nesting past
    ``STORED_DEPTH``), refused before it is written: a Run that makes one ends
    ``failed(store, <limit>)``."""


class HistoryLimitReached(InputRefused):
    """A commit would take the thread past ``history_bytes``, ``history_commits`` or
    ``state_bytes`` (``runtime.limits``): a start is refused with nothing written, a Run
    that reaches it ends ``failed(history_limit, <limit>)`` — never retried."""


class ModelError(RatchetError):
    """A model provider failed; ``code`` names how (``rate_limit``, ``status_500``,
    ``invalid_request``, ...). The message is the provider's, never a credential.

    ``usage``: what the provider reported using for an answer it refused to stand by (a
    refusal, a cut at ``max_tokens``): a ``runtime.models.Usage``, recorded with the
    Run's end, since the provider bills it; None when it said nothing."""

    usage: Any = None

    def __init__(
        self, code: str, message: str, *, status: int | None = None, usage: Any = None
    ) -> None:
        super().__init__(message)
        self.code, self.status = code, status
        if usage is not None:
            self.usage = usage


class ModelRefused(ModelError):
    """The provider refuses the request for good (400, context too long, 401/403): asking
    again cannot help, so the Run ends ``failed(inference, code)`` at once."""


class ModelUnavailable(ModelError):
    """A transient failure (timeout, dropped or malformed stream, 5xx): the inference is
    tried again as a new attempt (its partial deltas replaced)."""


class ModelRateLimited(ModelUnavailable):
    """Rate limited or overloaded (429, 529); ``retry_after_s`` is the provider's hint
    (``Retry-After``), if it gave one."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(code, message, status=status)
        self.retry_after_s = retry_after_s


class StoreError(RatchetError):
    """Base of every error a store backend raises."""


class VersionConflict(StoreError):
    def __init__(self, thread: str, expected: int, actual: int) -> None:
        super().__init__(f"thread {thread!r} is at version {actual}, expected {expected}")
        self.thread, self.expected, self.actual = thread, expected, actual


class Fenced(StoreError):
    """A writer or a claim named an owner epoch the thread has moved past."""

    def __init__(self, thread: str, epoch: int, current: int) -> None:
        super().__init__(
            f"writer epoch {epoch} on thread {thread!r} is stale (current owner epoch {current})"
        )
        self.thread, self.epoch, self.current = thread, epoch, current


class DuplicateOperation(StoreError):
    def __init__(self, operation_id: str) -> None:
        super().__init__(f"operation {operation_id!r} was already committed with another payload")
        self.operation_id = operation_id


class RunEnded(StoreError):
    def __init__(self, thread: str, run: str) -> None:
        super().__init__(f"run {run!r} on thread {thread!r} has ended; nothing may be committed")
        self.thread, self.run = thread, run


class RunSuperseded(RatchetError):
    """A Run waited on has ended and its thread holds a later Run, and the log no longer
    holds the waited Run's end to answer with (pruned), or never held the Run."""

    def __init__(self, thread: str, run: str, current: str | None) -> None:
        super().__init__(
            f"run {run!r} is no longer thread {thread!r}'s (it holds run {current!r}), and "
            "its log keeps no end of it to answer with (pruned?)"
        )
        self.thread, self.run, self.current = thread, run, current


class SystemInUse(RatchetError):
    """Another Ray cluster, alive, serves this system (its store): a second cluster on the
    same store would take the first one's Runs for a dead incarnation's, and the two would
    drive them in turn. Join that cluster (``--address``), or stop it first."""

    def __init__(self, system: str, holder: str) -> None:
        super().__init__(
            f"system {system} is served by another Ray cluster on the same store (cluster "
            f"{holder}, which renews its lease): join it with --address (`auto` for a Ray "
            "on this machine; or RAY_ADDRESS), or stop it first"
        )
        self.system, self.holder = system, holder


class ConfigError(RatchetError, ValueError):
    """A client joining a running system asked for settings other than those it runs
    with: a client adopts the running system's settings (its ``SystemSpec``), and one
    that asked for others would check input by rules the system does not keep. Connect
    without them to join it, or shut it down first. A ValueError too, as the options
    ``SystemSpec`` refuses are."""

    def __init__(self, system: str, conflicts: tuple[str, ...]) -> None:
        super().__init__(
            f"system {system} is running with other settings than asked: "
            f"{'; '.join(conflicts)}. Connect without them to join it (a client takes the "
            "running system's settings), or shut it down first"
        )
        self.system, self.conflicts = system, conflicts


class StoreUnavailable(StoreError):
    """The store cannot be reached; the caller retries with backoff and records no guess."""


class CorruptRecord(StoreError):
    def __init__(self, thread: str, seq: int, detail: str) -> None:
        super().__init__(f"corrupt record on thread {thread!r} at seq {seq}: {detail}")
        self.thread, self.seq = thread, seq


class StoreLost(StoreError):
    """The store's contents are gone (an in-memory store whose process restarted): nothing
    it answers can be trusted, so every caller fails closed instead of starting over."""


class PayloadTooLarge(StoreError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"commit payload is {size} bytes; the limit is {limit} bytes")
        self.size, self.limit = size, limit
