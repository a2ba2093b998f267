"""The REST routes: start, read, resume, cancel and stop Runs, page the log.

Each route is a thin call of the cluster client (``cluster.client.Ratchet`` and its
``RunHandle``), which validates and decides; what it raises becomes a problem
(``edge.problems``). ``wait=S`` on a control route waits up to S seconds for the Run to
rest (ended or awaiting) and answers with the thread as it is then.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from cluster.cli_args import awaiting_ticket
from cluster.cli_runs import RunQuery, run_page
from cluster.client import Ratchet, RunHandle, command_for
from edge.models import (
    AGENT_REF_CHARS,
    CommitRecord,
    CommitsPage,
    ControlResult,
    Resume,
    RunItem,
    RunsPage,
    StartRun,
    Stop,
    ThreadSummary,
)
from edge.paths import THREAD_KEY
from edge.problems import HttpProblem, problems
from edge.strict_json import StrictJsonRoute
from runtime import tracing_env
from runtime.commit import Frontier, ThreadCommit
from runtime.errors import AgentImportError, ResumeEnded, StoreUnavailable
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, StatusState, check_payload
from runtime.limits import STORED_ID_CHARS, STORED_IDS, check_id, check_reason
from runtime.patience import patiently

router = APIRouter(route_class=StrictJsonRoute)
log = logging.getLogger("ratchet.edge")
READ_BACK_S = 60.0
"""How long a route waits out a store outage to read back what it just did."""
MAX_WAIT_S = 300.0
MAX_SEQ = 2**63 - 1
"""A store's sequence numbers are 64-bit: a larger cursor is refused (422), not a 503."""
RunStateName = Literal["running", "awaiting", "ended"]
OnlyRun = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=STORED_ID_CHARS,
        description="Only this Run: a thread holding a later one answers not_running (a "
        "request retried after its answer was lost never ends the thread's next Run)",
    ),
]


def client_of(request: Request) -> Ratchet:
    client: Ratchet = request.app.state.ratchet
    return client


Client = Annotated[Ratchet, Depends(client_of)]


def thread_of(
    request: Request,
    client: Client,
    thread: Annotated[str, Path(min_length=1, description="The thread id, percent-encoded")],
) -> ThreadId:
    """The path's thread id as sent (``edge.paths``: a ``/`` in it is the id's, not the
    path's), held to the id rule of what is stored (InputRefused: 422): a thread made
    before the system lowered ``id_chars`` is still read and ended (a start holds a new
    thread to ``id_chars``)."""
    sent = request.scope.get(THREAD_KEY, thread)
    return ThreadId(check_id("thread id", sent, STORED_IDS))


Thread = Annotated[ThreadId, Depends(thread_of)]
Wait = Annotated[
    float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for the Run to rest")
]


async def known(client: Ratchet, thread: ThreadId) -> Frontier:
    """The thread's frontier; a thread with no commits is 404 ThreadNotFound."""
    frontier = await client.store.load(thread)
    if frontier.version == 0:
        raise HttpProblem(404, "ThreadNotFound", f"thread {thread!r} has no commits")
    return frontier


async def at_rest(handle: RunHandle, wait_s: float) -> ThreadSummary:
    """The thread once the Run rests, or as it is after ``wait_s`` (0: at once).

    Called once the action landed: a store outage on the way is waited out (as a
    follower waits it out) rather than answered 503 for an action that was done, and if
    it outlasts that, the 503 names the Run (a start without a ``run_id`` retried would
    otherwise be 409 and never learn the id of its own Run)."""
    try:
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await patiently(lambda: handle.result(timeout_s=wait_s), READ_BACK_S)
        frontier = await patiently(handle.view, READ_BACK_S)
    except StoreUnavailable as exc:
        raise HttpProblem(
            503,
            "StoreUnavailable",
            f"done, but the thread could not be read back: {exc}",
            thread_id=handle.thread_id,
            run_id=handle.run_id,
        ) from exc
    return ThreadSummary.of(frontier, handle.client.spec.limits)


@router.post(
    "/threads/{thread}/runs",
    status_code=201,
    responses=problems(409, 413, 422, 503),
    summary="Start a Run (idempotent by run_id)",
)
async def start_run(
    request: Request, client: Client, thread: Thread, body: StartRun, wait: Wait = 0
) -> ThreadSummary:
    """Start a Run of ``agent`` on the thread; answered once its first commit landed.
    The same ``run_id`` again returns that Run; a start while another Run of the thread
    is active is 409 InvalidTransition."""
    allowed = request.app.state.agents
    if allowed and body.agent not in allowed:
        raise AgentImportError(f"agent {body.agent!r} is not one this server may start")
    with tracing_env.continued(request.headers):  # a traceparent header: the Run's parent
        handle = await client.start(
            body.agent, body.input, thread_id=thread, run_id=body.run_id, placement=body.placement
        )
    return await at_rest(handle, wait)


@router.get("/threads/{thread}", responses=problems(404, 422), summary="A thread's frontier")
async def get_thread(client: Client, thread: Thread) -> ThreadSummary:
    return ThreadSummary.of(await known(client, thread), client.spec.limits)


@router.get("/runs", responses=problems(422), summary="Every thread's latest Run, paged")
async def list_runs(
    client: Client,
    state: RunStateName | None = None,
    status: StatusState | None = None,
    agent: Annotated[str | None, Query(max_length=AGENT_REF_CHARS)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=STORED_ID_CHARS)] = None,
) -> RunsPage:
    """Pages in thread id order; ``cursor`` is the previous page's ``next_cursor``. Each
    item is the thread's verified head with the agent its Run was started with (read
    from the Run's own records, not the whole log), as ``ratchet runs`` lists it; a
    thread whose records do not verify is left out (and logged)."""
    if cursor is not None:  # a thread id: one that cannot be is refused, not an empty page
        check_id("cursor", cursor, STORED_IDS)  # a stored one's, whatever id_chars is now
    after = None if cursor is None else ThreadId(cursor)
    query = RunQuery(state=state, status=status, agent=agent, limit=limit, after=after)
    rows, last = await run_page(client.store, query)
    return RunsPage(runs=[RunItem.of(row) for row in rows], next_cursor=last)


@router.post(
    "/threads/{thread}/resume",
    responses=problems(404, 409, 413, 422, 503),
    summary="Answer the awaiting Run's ticket",
)
async def resume(
    request: Request, client: Client, thread: Thread, body: Resume, wait: Wait = 0
) -> ThreadSummary:
    """The ids come from the thread's committed ticket, the payload from the body. A
    payload that does not fit the ticket is 409 ResumeRejected naming the ``axis``
    (``payload``, ``ticket``, ``deadline``, …); the ticket stays as it was."""
    limits = client.spec.limits  # bad input is 413/422 whatever the thread holds
    check_payload(body.payload, limits)
    if body.request_id is not None:
        check_id("request id", body.request_id, limits)
    frontier = await known(client, thread)
    handle = client.handle(thread, frontier.run_id)
    # asked again after a lost answer: a resume that landed under this id is a success,
    # whatever the thread holds now (the Run's next ticket is never answered with it)
    if body.request_id is not None and await handle.answered(body.payload, body.request_id):
        return await at_rest(handle, wait)
    command = command_for(awaiting_ticket(frontier), body.payload)
    if body.request_id is not None:
        command = command.model_copy(update={"request_id": body.request_id})
    # a traceparent header: the drive's parent. A resume taken that ended the Run
    # failed(history_limit) (ResumeEnded) is served as the summary that says so
    with tracing_env.continued(request.headers), contextlib.suppress(ResumeEnded):
        await handle.resume(command)
    return await at_rest(handle, wait)


@router.post(
    "/threads/{thread}/cancel",
    responses=problems(404, 422, 503),
    summary="Cancel the Run: a live one at its next check, an awaiting one at once",
)
async def cancel(
    client: Client, thread: Thread, wait: Wait = 0, run_id: OnlyRun = None
) -> ControlResult:
    return await _end(client, thread, None, wait, run_id)


@router.post(
    "/threads/{thread}/stop",
    responses=problems(404, 413, 422, 503),
    summary="End the Run stopped(reason)",
)
async def stop(
    client: Client, thread: Thread, body: Stop, wait: Wait = 0, run_id: OnlyRun = None
) -> ControlResult:
    return await _end(client, thread, body.reason, wait, run_id)


async def _end(
    client: Ratchet, thread: ThreadId, reason: str | None, wait: float, run: str | None
) -> ControlResult:
    if reason is not None:  # bad input is 413/422 whatever the thread holds
        check_reason(reason, client.spec.limits)
    if run is not None:  # an id no Run can have is refused, not "not_running"
        check_id("run id", run, STORED_IDS)
    frontier = await known(client, thread)
    if isinstance(frontier.run_state, EndedState) or run not in (None, frontier.run_id):
        # ended, or the thread holds a later Run than the one named (it ended): as
        # `ratchet cancel` does, no host is asked (it could create a dedicated one to say so)
        summary = ThreadSummary.of(frontier, client.spec.limits)
        return ControlResult(outcome="not_running", thread=summary)
    # the Run named, or the one the request read: a later Run started meanwhile is left
    handle = client.handle(thread, frontier.run_id)
    outcome = await (handle.cancel() if reason is None else handle.stop(reason))
    summary = await at_rest(handle, wait if outcome == "signalled" else 0)
    return ControlResult.model_validate({"outcome": outcome, "thread": summary})


def _served(commit: ThreadCommit) -> dict[str, Any]:
    """A commit as the API serves it: ``events`` holds every fact of the commit (a
    schema-3 record stores only those it cannot derive: ``ThreadCommit.facts``)."""
    served = commit.model_dump(mode="json")
    served["events"] = [fact.model_dump(mode="json") for fact in commit.facts]
    return served


@router.get(
    "/threads/{thread}/commits",
    responses=problems(404, 422),
    summary="The committed log, paged",
)
async def commits(
    client: Client,
    thread: Thread,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="Only commits with seq > after")] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> CommitsPage:
    """A page is read and verified alone (``CommitStore.read`` with a limit: the chain
    from the record before it), never the whole log: its cost is bounded by ``limit``
    whatever the thread's length. One record past it says whether there are more."""
    if (await client.store.load_head(thread)).version == 0:  # its head: no history read
        raise HttpProblem(404, "ThreadNotFound", f"thread {thread!r} has no commits")
    records = await client.store.read(thread, after, limit + 1)
    page = [CommitRecord(seq=r.seq, commit=_served(r.commit)) for r in records[:limit]]
    more = len(records) > limit
    return CommitsPage(thread_id=thread, commits=page, next_after=page[-1].seq if more else None)
