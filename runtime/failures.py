"""What an exception that escaped a Step means for the Run: the one classification.

The engine ends a Run whose Step raised with ``failed(kind, code, message)``
(``Engine.settle``); this decides the kind. Our own control flow (CancelledSignal,
EndRun, RunOver) never gets here, nor do the errors that mean "not ours to settle"
(``NOT_OURS``): those stop the drive and go to its caller.
"""

from __future__ import annotations

from runtime.errors import (
    CommitRefused,
    CorruptRecord,
    Fenced,
    HistoryLimitReached,
    InputRefused,
    PayloadTooLarge,
    RunEnded,
    StateConflict,
    StoreError,
    StoreLost,
    StoreUnavailable,
)
from runtime.hooks import HookFailed
from runtime.lifecycle import Failed, FailureKind
from runtime.limits import printable, said, short_code

NOT_OURS: tuple[type[BaseException], ...] = (
    Fenced,  # another owner has the thread: it settles the Run, not us
    RunEnded,  # it has ended already
    CorruptRecord,  # no engine acts on a thread whose records do not verify
    StoreLost,  # the store's contents are gone: nothing may be written into it
    StoreUnavailable,  # an outage outlasted the backoff: the Run pauses, a host resumes it
)


def failure_of(exc: BaseException) -> Failed:
    """The cause a Run ends with when ``exc`` escaped one of its Steps."""
    kind, code = _classified(exc)
    message = said(exc) or printable(type(exc).__name__)
    return Failed(failure=kind, code=short_code(code), message=message)


def _classified(exc: BaseException) -> tuple[FailureKind, str]:
    if isinstance(exc, HookFailed):
        return "hook", exc.code
    if isinstance(exc, StateConflict):
        return "state_conflict", "state_conflict"
    if isinstance(exc, HistoryLimitReached):
        return "history_limit", exc.limit
    if isinstance(exc, PayloadTooLarge):
        return "store", "payload_too_large"
    if isinstance(exc, CommitRefused):
        return "store", exc.limit
    if isinstance(exc, StoreError):
        return "store", type(exc).__name__
    if isinstance(exc, InputRefused):
        return "internal", exc.limit
    return "internal", type(exc).__name__
