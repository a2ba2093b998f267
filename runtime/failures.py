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
from runtime.lifecycle import Failed
from runtime.limits import said

NOT_OURS: tuple[type[BaseException], ...] = (
    Fenced,  # another owner has the thread: it settles the Run, not us
    RunEnded,  # it has ended already
    CorruptRecord,  # no engine acts on a thread whose records do not verify
    StoreLost,  # the store's contents are gone: nothing may be written into it
    StoreUnavailable,  # an outage outlasted the backoff: the Run pauses, a host resumes it
)


def failure_of(exc: BaseException) -> Failed:
    """The cause a Run ends with when ``exc`` escaped one of its Steps."""
    message = said(exc) or type(exc).__name__
    if isinstance(exc, HookFailed):
        return Failed(failure="hook", code=exc.code, message=message)
    if isinstance(exc, StateConflict):
        return Failed(failure="state_conflict", code="state_conflict", message=message)
    if isinstance(exc, HistoryLimitReached):
        return Failed(failure="history_limit", code=exc.limit, message=message)
    if isinstance(exc, PayloadTooLarge):
        return Failed(failure="store", code="payload_too_large", message=message)
    if isinstance(exc, CommitRefused):
        return Failed(failure="store", code=exc.limit, message=message)
    if isinstance(exc, StoreError):
        return Failed(failure="store", code=type(exc).__name__, message=message)
    if isinstance(exc, InputRefused):
        return Failed(failure="internal", code=exc.limit, message=message)
    return Failed(failure="internal", code=type(exc).__name__, message=message)
