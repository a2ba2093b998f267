"""Shared helpers of every backend."""

from __future__ import annotations

from runtime.commit import Frontier
from runtime.lifecycle import EndedState
from runtime.ports import RunSummary


def summarize(frontier: Frontier) -> RunSummary | None:
    """The listing row of a thread's latest Run, or None for a thread with no Run."""
    state = frontier.run_state
    if state is None or frontier.run_id is None:
        return None
    return RunSummary(
        thread_id=frontier.thread_id,
        run_id=frontier.run_id,
        state=state.kind,
        status=frontier.status,
        version=frontier.version,
        cause=state.cause.kind if isinstance(state, EndedState) else None,
    )
