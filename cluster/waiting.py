"""How a client waits: on the store, with backoff, and on hosts while they restart.

The store is the truth a client waits on; a host's notice only saves the polling
while it drives. A store outage pauses a follower, as it pauses Runs: it is not an
answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.exceptions import RayActorError

from cluster.config import ClusterUnavailable
from runtime.commit import Frontier
from runtime.errors import CorruptRecord
from runtime.history import end_of_run
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, EndedState
from runtime.patience import patiently
from runtime.ports import CommitStore, RunSummary, refused_in
from storage.summary import summarize

log = logging.getLogger("ratchet.client")
T = TypeVar("T")
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5
HOST_CHECK_S = 5.0
"""While a host's notice is awaited, how often the store is asked whether the Run rests."""
HOST_ANSWER_S = 300.0
"""How long a start, cancel or stop that waits for no Run may go unanswered by a host
(``on_a_live_host``): past the Supervisor's restart of a hung host and a store's
outage, which its host waits out for a minute before it answers."""


def checked_timeout(timeout_s: object) -> float | None:
    """``timeout_s`` as a wait takes it: None (no deadline) or seconds, a finite number
    not below 0; else TypeError or ValueError saying so, before anything is started or
    waited for (NaN made every wait a TimeoutError "after nans", a string an asyncio
    TypeError from inside the wait)."""
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool):
        raise TypeError(f"timeout_s is seconds (a number) or None, not {type(timeout_s).__name__}")
    if not _finite(timeout_s) or timeout_s < 0:
        raise ValueError(f"timeout_s is a finite number of seconds not below 0, not {timeout_s}")
    return float(timeout_s)


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int past a float's range (10**400)
        return False


async def polled(check: Callable[[], Awaitable[T | None]]) -> T:
    """``check``'s first answer that is not None, asking again with backoff (the store
    is the truth; the host's notice only saves the polling while it drives)."""
    delay = POLL_FIRST_S
    while (answer := await check()) is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)
    return answer


async def notice_or_rest(
    notice: Awaitable[T], at_rest: Callable[[], Awaitable[object | None]]
) -> T | None:
    """``notice``'s answer (a host saying its drive is over); or None as soon as
    ``at_rest`` finds the Run at rest in the store while the notice has not come. Asked
    every ``HOST_CHECK_S``: a host that hangs (stopped, its loop blocked) never answers,
    and the Run it held may have been re-placed and ended elsewhere."""
    waiting = asyncio.ensure_future(notice)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=HOST_CHECK_S)
            if done:
                return waiting.result()
            if await at_rest() is not None:
                return None
    finally:
        waiting.cancel()


def rests(frontier: Frontier, run_id: RunId | None) -> bool:
    """The frontier holds ``run_id`` (any Run if None) ended or awaiting."""
    run = run_id or frontier.run_id
    return frontier.run_id == run and isinstance(frontier.run_state, EndedState | AwaitingState)


def moved_on(current: RunId | None, run_id: RunId | None) -> bool:
    """The thread holds another Run than ``run_id``: that one has ended (a thread's next
    Run starts only once the one before it ended), and waiting for it to rest as the
    thread's Run would never end."""
    return run_id is not None and current is not None and current != run_id


async def end_of(
    store: CommitStore, thread: ThreadId, run_id: RunId, current: RunId | None
) -> Frontier:
    """The thread's whole frontier as ``run_id``'s last commit left it (``end_of_run``),
    from the store's verified log."""
    return end_of_run(thread, await patiently(lambda: store.read(thread)), run_id, current)


async def on_a_live_host(
    call: Callable[[], Awaitable[T]], give_up_s: float = 60.0, answer_s: float | None = None
) -> T:
    """Call a host again while it is dead or restarting (the calls given are idempotent),
    for up to ``give_up_s`` from the first failure: a call that lasts (a start that waits
    for its Run to rest) has not used up the time its host has to come back.

    ``answer_s``: how long one call may go unanswered (a call that does not wait for a
    Run). Ray takes a stopped host for a live one, and only the Supervisor kills it;
    with the Supervisor stopped too, the call was waited on for good."""
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    delay = POLL_FIRST_S
    while True:
        bound = asyncio.timeout(answer_s)
        try:
            async with bound:
                return await call()
        except TimeoutError as exc:
            if not bound.expired():
                raise  # the host's own error, not this wait's
            raise ClusterUnavailable(
                f"no RunHost answered within {answer_s:g}s (hung, and not restarted)"
            ) from exc
        except RayActorError as exc:
            if deadline is None:
                deadline = loop.time() + give_up_s
            elif loop.time() > deadline:
                what = type(exc).__name__
                raise ClusterUnavailable(
                    f"no RunHost answered within {give_up_s:g}s ({what})"
                ) from exc
            log.info("host unavailable (%s); asking again", type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)


async def rested_summaries(
    store: CommitStore, wanted: dict[ThreadId, RunId | None]
) -> list[RunSummary]:
    """The summaries of the ``wanted`` Runs (by thread) the store holds at rest, from one
    listing (waiting out an outage of a moment); a thread it does not list, from its
    verified head (the listing is the index, which a hand can empty)."""
    listing = await patiently(store.list_runs)
    for thread in refused_in(listing):  # it would never be listed at rest
        if thread in wanted:
            raise CorruptRecord(thread, 0, "its run index entry does not verify")
    rows = {r.thread_id: r for r in listing}
    done: list[RunSummary] = []
    for t, run in wanted.items():
        row = rows.get(t)
        if row is None:
            # not listed: no commit yet, or its index entry was removed by hand, and then
            # it was waited for as running for ever (its own ``result`` said it ended):
            # its verified head says whether it rests
            row = summarize(await patiently(functools.partial(store.load_head, t)))
        if _at_rest(row, run):
            done.append(row)  # type: ignore[arg-type]  # _at_rest: not None
        elif row is not None and run is not None and moved_on(row.run_id, run):
            done.append(await _summary_at_end(store, t, run, row.run_id))
    return done


async def _summary_at_end(
    store: CommitStore, thread: ThreadId, run: RunId, current: RunId
) -> RunSummary:
    """The listing row ``run`` had when it ended, though its thread has moved on."""
    summary = summarize(await end_of(store, thread, run, current))
    assert summary is not None, "a frontier folded up to a Run's commit holds that Run"
    return summary


def _at_rest(row: RunSummary | None, run: RunId | None) -> bool:
    if row is None or (run is not None and row.run_id != run):
        return False
    return row.state in ("ended", "awaiting")


def may_have_started(run: RunId, thread: ThreadId) -> str:
    """What a start that gave up says: the ids that find its Run, should it have landed."""
    return (
        f"run {run!r} on thread {thread!r} may have started: ask again with these ids "
        "(a start is idempotent by run id) or look at the thread"
    )
