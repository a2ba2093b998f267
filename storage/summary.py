"""Shared helpers of every backend."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Literal

from runtime.commit import Frontier
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState
from runtime.ports import Listing, RunSummary, host_of

RunStateKind = Literal["running", "awaiting", "ended"]
RUN_STATES: tuple[RunStateKind, ...] = ("running", "awaiting", "ended")
log = logging.getLogger("ratchet.store")


def summarize(frontier: Frontier) -> RunSummary | None:
    """The listing row of a thread's latest Run, or None for a thread with no Run."""
    state, cause = listing(frontier)
    if state is None or frontier.run_id is None:
        return None
    return RunSummary(
        thread_id=frontier.thread_id,
        run_id=frontier.run_id,
        state=state,
        status=frontier.status,
        version=frontier.version,
        cause=cause,
        owner=frontier.owner,
    )


def vouched(listed: RunSummary, head: Frontier) -> RunSummary:
    """The summary of ``head``, a thread's verified head, if the index entry that listed
    it says the same; else CorruptRecord (an index changed by hand would have a Run
    served, or taken over, as it is not)."""
    summary = summarize(head)
    if summary != listed:
        raise CorruptRecord(head.thread_id, head.version, "the run index is not the frontier's")
    return listed


def kept(
    summaries: Iterable[Callable[[], RunSummary | None]],
    state: RunStateKind | None,
    host: str | None,
) -> Listing:
    """The listing: each entry built and checked on its own (None: no longer listed). One
    that does not verify is left out (logged, and named in ``refused``): a single bad row
    must not stop every listing, and with it every sweep of the Supervisor and every
    host's reconciliation."""
    found, refused = [], []
    for make in summaries:
        try:
            summary = make()
        except CorruptRecord as exc:
            log.error("a run index entry does not verify, left out of the listing: %s", exc)
            refused.append(ThreadId(exc.thread))
            continue
        if summary is None:
            continue
        if (state is None or summary.state == state) and (
            host is None or host_of(summary.owner) == host
        ):
            found.append(summary)
    return Listing.of(found, refused)


def listing(frontier: Frontier) -> tuple[RunStateKind | None, str | None]:
    """The latest Run's state kind and end cause kind; (None, None) for a thread with no Run.

    What ``summarize`` lists, without building the summary (stores keep these columns).
    """
    state = frontier.run_state
    if state is None or frontier.run_id is None:
        return None, None
    return state.kind, state.cause.kind if isinstance(state, EndedState) else None


def summaries_of(
    frontiers: Iterable[Frontier], state: RunStateKind | None, host: str | None
) -> list[RunSummary]:
    """``CommitStore.list_runs`` over frontiers held in process (the in-memory stores)."""
    found = (summarize(f) for f in frontiers)
    return [
        s
        for s in found
        if s is not None
        and (state is None or s.state == state)
        and (host is None or host_of(s.owner) == host)
    ]
