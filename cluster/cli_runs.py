"""What ``ratchet runs`` lists: its filters, one page of rows, and the cursor to the next.

The store filters by run state itself (every store keeps that index, ``list_runs``);
``--status``, ``--agent`` and ``--failed`` are applied here, over its listing, to each
thread's frontier as loaded (so a Run that moved on since the listing is judged as it
is now). Pages follow thread-id order, whatever order a store lists in: a cursor is
the last thread id of a page, so every thread appears on exactly one page, and a
thread that appears between two pages is on a later page if its id sorts after the
cursor. The cursor is that id in base64url (``c1.`` and the id's UTF-8 bytes): any
id pastes into a shell as it is, and anything else is refused as bad input.
"""

from __future__ import annotations

import base64
import binascii
import logging
from dataclasses import dataclass
from typing import Any, get_args

from actors.wire import RunMeta, run_meta, stored_run_meta
from cluster.cli_args import BadInput
from runtime.commit import Frontier
from runtime.errors import CorruptRecord, InputRefused
from runtime.ids import ThreadId
from runtime.lifecycle import StatusState
from runtime.limits import STORED_IDS, check_id
from runtime.ports import RunSummary
from runtime.reserved import reserved_value
from runtime.timeutil import utc_time
from runtime.usage import USAGE_KEY
from storage.summary import RUN_STATES, RunStateKind, summarize

log = logging.getLogger("ratchet.cli")

STATUSES: tuple[StatusState, ...] = get_args(StatusState)
DEFAULT_LIMIT = 50
CURSOR_PREFIX = "c1."


@dataclass(frozen=True)
class RunQuery:
    """One ``ratchet runs`` invocation's filters and page, checked."""

    state: RunStateKind | None = None
    status: StatusState | None = None
    agent: str | None = None
    """The agent reference (``module:attr``) the Run was started with."""
    failed: bool = False
    """Only Runs that ended ``failed``."""
    limit: int = DEFAULT_LIMIT
    after: ThreadId | None = None
    """Only threads whose id sorts after this one (the decoded cursor)."""

    def admits(self, row: RunRow) -> bool:
        s = row.summary
        return (
            (self.state is None or s.state == self.state)
            and (self.status is None or s.status.state == self.status)
            and (not self.failed or s.cause == "failed")
            and (self.agent is None or row.agent == self.agent)
        )


def run_query(
    state: str | None,
    status: str | None,
    agent: str | None,
    failed: bool,
    limit: int,
    after: str | None,
) -> RunQuery:
    """The query the flags ask for; BadInput names the first flag that cannot be used."""
    if state is not None and state not in RUN_STATES:
        hint = f" ({state} is a status: --status {state})" if state in STATUSES else ""
        raise BadInput(f"--state must be one of {', '.join(RUN_STATES)}, not {state!r}{hint}")
    if status is not None and status not in STATUSES:
        raise BadInput(f"--status must be one of {', '.join(STATUSES)}, not {status!r}")
    if failed and state not in (None, "ended"):
        raise BadInput(f"--failed lists ended Runs: it does not go with --state {state}")
    if limit < 1:
        raise BadInput(f"--limit must be at least 1, not {limit}")
    return RunQuery(
        state="ended" if failed else state,
        status=status,
        agent=agent,
        failed=failed,
        limit=limit,
        after=None if after is None else thread_after(after),
    )


@dataclass(frozen=True)
class RunRow:
    """A thread's latest Run as ``ratchet runs`` lists it."""

    summary: RunSummary
    agent: str | None
    steps: int
    usage: dict[str, Any] | None
    problem: str | None = None
    """Why part of the thread's state cannot be shown (a reserved key holding what
    Ratchet never writes: imported before imports were checked); the row shows the
    rest, and the listing goes on past it."""

    @property
    def thread_id(self) -> ThreadId:
        return self.summary.thread_id

    def json(self) -> dict[str, Any]:
        """``ratchet runs --json``'s object for the thread:

        ``thread_id``, ``run_id``; ``state`` (``running``, ``awaiting`` or ``ended``)
        and ``cause`` (the end cause kind, null unless ended); ``status`` (the thread's
        run status: ``{"state": idle|running|failed, "since": µs, "reason"}``);
        ``since`` (``status.since`` as ISO 8601 UTC, null if never set); ``steps``
        (inferences committed by the Run); ``agent`` (the agent reference it was
        started with, null if the Run records none, as in-process Runs do); ``usage``
        (the Run's token totals, null if its model reported none); ``version`` (the
        thread's commit count), ``owner`` (its current owner, or null) and ``problem``
        (null, or why part of the thread's state cannot be read).
        """
        s = self.summary
        return {
            "thread_id": s.thread_id,
            "run_id": s.run_id,
            "state": s.state,
            "cause": s.cause,
            "status": s.status.model_dump(mode="json"),
            "since": iso_time(s.status.since),
            "steps": self.steps,
            "agent": self.agent,
            "usage": self.usage,
            "version": s.version,
            "owner": s.owner,
            "problem": self.problem,
        }


def run_row(frontier: Frontier, meta: RunMeta | None = None) -> RunRow | None:
    """The thread's row, or None for a thread with no Run; ``meta`` if the frontier is
    a head (no messages to find it in)."""
    summary = summarize(frontier)
    if summary is None:
        return None
    meta = meta or run_meta(frontier)
    usage, problem = reserved_value(frontier.state, f"run:{USAGE_KEY}")
    return RunRow(
        summary=summary,
        agent=meta.agent_ref if meta is not None else None,
        steps=frontier.steps,
        usage=dict(usage) if usage else None,
        problem=problem,
    )


async def run_page(db: Any, query: RunQuery) -> tuple[list[RunRow], ThreadId | None]:
    """Up to ``query.limit`` rows in thread-id order, and the thread the next page starts
    after (None: this is the last page). One row more is looked for, so a next page is
    never empty. Each row is the thread's verified head, its agent read from the Run's
    own verified records: the store's listing only names the candidates (its columns
    are not what a checksum covers), and a thread that does not verify is left out,
    logged (``ratchet runs``, ``GET /runs``)."""
    listed = await db.list_runs(query.state)
    after = query.after
    threads = sorted(s.thread_id for s in listed if after is None or s.thread_id > after)
    rows: list[RunRow] = []
    for thread in threads:
        # the head and the Run's own records, not the thread's whole log
        try:
            head = await db.load_head(thread)
            row = run_row(head, await stored_run_meta(db, head))
        except CorruptRecord as exc:  # one bad thread must not hide every other
            log.error("thread %s left out of the listing: %s", thread, exc)
            continue
        if row is not None and query.admits(row):
            rows.append(row)
            if len(rows) > query.limit:
                return rows[: query.limit], rows[query.limit - 1].summary.thread_id
    return rows, None


def cursor(thread: str) -> str:
    """The cursor to the page after ``thread``."""
    raw = thread.encode("utf-8", "surrogatepass")
    return CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def thread_after(text: str) -> ThreadId:
    """The thread id a cursor stands for; BadInput if ``text`` is not one ``cursor`` made."""
    bad = BadInput(f"--after {text!r} is not a cursor that ratchet runs printed")
    if not text.startswith(CURSOR_PREFIX):
        raise bad
    body = text[len(CURSOR_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        thread = raw.decode("utf-8", "surrogatepass")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise bad from None
    if not thread or cursor(thread) != text:  # one spelling per cursor
        raise bad
    try:  # an id no thread can have (a lone surrogate, a control character, too long)
        return ThreadId(check_id("thread id", thread, STORED_IDS))
    except InputRefused:
        raise bad from None


def iso_time(since_us: int) -> str | None:
    """ISO 8601 UTC; None for no time, and for one no datetime holds (the raw
    microseconds stay in the row's ``status``)."""
    moment = utc_time(since_us) if since_us else None
    return moment.isoformat(timespec="microseconds") if moment else None
