"""RunHandle: one Run followed through the store, and the way to answer its ticket.

Everything a handle knows comes from the store (committed facts and the frontier),
never from a host: a handle works the same after its host crashed, from another
process, or after ``Ratchet.handle(thread_id)``. It reaches hosts through the client
that made it (``cluster.client.Ratchet``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError, RayError

from actors.wire import NAMESPACE, Placement, SystemSpec, host_index, run_meta, unwrap
from cluster.config import ClusterUnavailable
from cluster.stream import follow_thread
from cluster.waiting import (
    HOST_ANSWER_S,
    POLL_FIRST_S,
    POLL_MAX_S,
    checked_timeout,
    end_of,
    moved_on,
    notice_or_rest,
    on_a_live_host,
    polled,
    rests,
)
from runtime import tracing_env
from runtime.commit import Frontier, ThreadCommit
from runtime.errors import InvalidTransition, ResumeEnded, ResumeRejected, StoreUnavailable
from runtime.events import Fact
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndedState,
    Failed,
    ResumeCommand,
    ResumePayload,
    ResumeTicket,
    Stopped,
    ThreadStatus,
    answer,
    validate_resume,
)
from runtime.limits import check_reason
from runtime.patience import patiently
from runtime.ports import CommitStore
from runtime.resume import check_command
from runtime.rules import stamp_facts
from runtime.stream import Frame, parse_offset

RESUME_GIVE_UP_S = 60.0
"""How long a resume whose hosts die or restart is asked again, from the first failure
(as a start, cancel or stop is: ``cluster.waiting.on_a_live_host``)."""

Taken = tuple[Fact, ThreadCommit]
"""A resume's ``TAKEN`` fact, and the commit that holds it."""


class Client(Protocol):
    """What a handle uses of the client that made it (``cluster.client.Ratchet``)."""

    spec: SystemSpec
    store: CommitStore
    hosts: list[Any]

    def host_for(self, thread: str, placement: Placement, host: int | None = None) -> Any: ...

    async def host_failed(self, target: Any) -> None: ...


TAKEN = ("resumed", "resume_ended")
"""The facts of a resume that was taken: it landed, or (``resume_ended``) what the
runtime had to write to resume could not fit the thread's history limits, and it ended
the Run ``failed(history_limit)`` instead (``runtime.resume``). Either way the caller's
resume was applied, and a rival's or a repeat's was not."""


class RunHandle:
    """Follow one Run through the store."""

    def __init__(
        self, client: Client, thread_id: ThreadId, run_id: RunId | None, placement: Placement
    ) -> None:
        self.client = client
        self.thread_id = thread_id
        self.run_id = run_id
        self.placement = placement

    async def frontier(self) -> Frontier:
        return await self.client.store.load(self.thread_id)

    async def view(self) -> Frontier:
        """The thread as this Run left it: the thread's frontier while the Run is its
        latest, as the Run's end left it once a later Run followed (a start repeated
        for an earlier Run is answered with that Run, not the thread's latest)."""
        frontier = await self.frontier()
        if self.run_id is not None and moved_on(frontier.run_id, self.run_id):
            return await end_of(self.client.store, self.thread_id, self.run_id, frontier.run_id)
        return frontier

    async def result(self, timeout_s: float | None = None) -> Frontier:
        """The frontier once the Run is Ended or Awaiting.

        The host driving the Run says when its drive is over (no polling while it
        runs); the store then confirms. A Run recovered elsewhere, or whose host died,
        is followed by polling the store with backoff.
        """
        timeout_s = checked_timeout(timeout_s)
        try:
            return await asyncio.wait_for(self.settled(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"run on {self.thread_id} still running after {timeout_s}s"
            ) from None

    async def settled(self, host_done: bool = False) -> Frontier:
        """``result`` without a deadline; ``host_done``: the host already said so."""
        if not host_done:
            await self.until_host_done()
        return await polled(self.at_rest)

    async def at_rest(self) -> Frontier | None:
        """The Run's frontier if the store holds it at rest (a Run the thread moved on
        from: as its end left it), else None."""
        frontier = await patiently(self.frontier)  # an outage is not an answer
        if frontier.version == 0:  # no Run to wait for: a mistyped id waited for ever
            raise InvalidTransition(f"thread {self.thread_id!r} has no commits: no Run to wait for")
        if rests(frontier, self.run_id):
            return frontier
        if self.run_id is not None and moved_on(frontier.run_id, self.run_id):
            return await end_of(self.client.store, self.thread_id, self.run_id, frontier.run_id)
        return None

    async def until_host_done(self) -> None:
        """Wait for the host this Run was placed on to finish driving it, if it does,
        or for the store to hold the Run at rest (a hung host never says so)."""
        await notice_or_rest(self._host_notice(), self.at_rest)

    async def _host_notice(self) -> None:
        if self.placement == "dedicated":
            try:  # a dedicated host retires with its Run: never start one just to ask
                name = self.client.spec.dedicated_name(self.thread_id)
                host = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return
        else:
            host = self.client.host_for(self.thread_id, "hosted")
        # a dead or restarting host, or one driving nothing here: the store decides
        with contextlib.suppress(RayError):
            await host.until_rest.remote(self.thread_id)

    async def status(self) -> ThreadStatus:
        return (await self.frontier()).status

    async def events(self, after_seq: int = 0) -> list[Fact]:
        """Committed facts after ``after_seq``, in commit order (a resumable cursor).
        A cursor that is no seq (not a whole number from 0 below 2**63) is ValueError."""
        if type(after_seq) is not int or not 0 <= after_seq < 2**63:
            raise ValueError(
                f"after_seq must be a whole number of 0 or more, not {after_seq!r:.60}"
            )
        records = await self.client.store.read(self.thread_id, after_seq)
        return [fact for r in records for fact in stamp_facts(r.commit, r.seq)]

    async def ticket(self) -> ResumeTicket | None:
        """The committed ResumeTicket, while the Run awaits; otherwise None."""
        state = (await self.frontier()).run_state
        return state.ticket if isinstance(state, AwaitingState) else None

    def stream(self, after: str | None = None, *, until_rest: bool = True) -> AsyncIterator[Frame]:
        """Frames of the thread after the cursor ``after`` (``"seq:index"``, None: all).

        First a ``thread_status`` snapshot, then every committed fact after the cursor
        (from the store), then live deltas and facts (Redis bus when the system has
        one, else the store is polled), with a status frame on every change. Ends when
        the Run is at rest (awaiting or ended) unless ``until_rest`` is False. Reconnect
        with the ``offset`` of the last frame seen: no fact is lost or repeated. A thread
        with no commits yet is followed from its first (start following, then start the
        Run). A malformed cursor is ValueError, at the first frame.
        """
        return self._stream(after, until_rest)

    async def _stream(self, after: str | None, until_rest: bool) -> AsyncIterator[Frame]:
        parse_offset(after)  # before the store is asked
        frames = follow_thread(
            self.client.store,
            self.thread_id,
            after,
            redis_url=self.client.spec.redis_url,
            until_rest=until_rest,
        )
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame

    async def cancel(self) -> str:
        """Cancel the Run wherever it is (a Run at rest is ended here and now).

        ``"cancelled"``: its end is committed (at rest, or by its driver within
        ``SIGNAL_WAIT_S``); ``"signalled"``: its driver was told and has not ended it yet
        (it ends ``cancelled`` at its next check); ``"not_running"``: nothing to do.
        """
        return await self._end_on_host("cancel_run", (), Cancelled, "cancelled")

    async def stop(self, reason: str) -> str:
        """End the Run ``stopped(reason)``; returns like ``cancel``. A reason that is not
        storable text within ``input_bytes`` is InputRefused, before any host is asked."""
        check_reason(reason, self.client.spec.limits)
        return await self._end_on_host("stop_run", (reason,), Stopped, "stopped")

    async def _end_on_host(
        self, method: str, args: tuple[Any, ...], cause: type[Any], ended_word: str
    ) -> str:
        """Have the Run's host cancel or stop it.

        A dedicated host retires once it is idle, and may die before its answer is
        sent: asked again, a new host finds nothing running. The frontier then says
        whether the Run ended as asked (by the first call, or meanwhile)."""
        placement = await self._placement()
        calls = 0
        # the Run to end is pinned before the first call: a call asked again (its host
        # died before it answered) must not end a later Run the thread started meanwhile
        run = self.run_id or (await self.frontier()).run_id

        async def end_run() -> Any:
            nonlocal calls
            calls += 1
            host = self.client.host_for(self.thread_id, placement)
            # the handle's Run only: a thread that moved on to a later Run keeps it
            call = getattr(host, method).remote(self.thread_id, *args, run=run)
            try:
                return unwrap(await call)
            except RayActorError:  # asked again: of a pool host made again if it is gone
                await self.client.host_failed(host)
                raise

        result: str = await on_a_live_host(end_run, answer_s=HOST_ANSWER_S)
        if result == "not_running" and calls > 1:
            frontier = await self.frontier()
            state, mine = frontier.run_state, run in (None, frontier.run_id)
            if mine and isinstance(state, EndedState) and isinstance(state.cause, cause):
                return ended_word
        return result

    async def resume(self, command: ResumeCommand, *, host: int | None = None) -> None:
        """Deliver a ResumeCommand; raises ResumeRejected (the ticket stays) on a mismatch,
        and ResumeEnded if it was taken but could not land: what resuming writes (a
        grant, a handoff, the commit itself) is past the thread's history limits, and the
        Run ended ``failed(history_limit, <limit>)`` instead — the answer was never
        applied. Asked again under the same ``request_id``, the same ResumeEnded.

        The command is checked here first against this thread's committed ticket, in the
        order of DESIGN §2 (a command for another thread fails on ``thread``), then again
        by the host, which is authoritative. ``host`` picks a host of the pool; if the
        chosen host dies before it answered, the committed ``resumed`` fact says whether
        this resume landed (each call carries its own ``request_id``): if another one
        did, this one is ResumeRejected; if none did, it goes to the next host. Every
        ResumeRejected is checked against that fact too: a resume with this request id
        that landed (through a host that died before it answered, or another call with
        the same ``request_id``) is this call's success, not a rejection.
        """
        command = check_command(command, self.client.spec.limits)  # InputRefused: nothing is sent
        if command.request_id is None:
            command = command.model_copy(update={"request_id": uuid.uuid4().hex})
        try:
            await self._resume(command, host)
        except ResumeRejected:
            taken = await self._taken(command)
            if taken is None or not _holds(taken[0], command):
                raise
            # this request's resume was taken: the rejection was of a repeat
        except StoreUnavailable:
            # it may have landed before the store went away (a retry would carry a new
            # request id, and hear that another resume was applied): its fact says so
            taken = await patiently(lambda: self._taken(command))
            if taken is None or not _holds(taken[0], command):
                raise
        else:
            try:
                taken = await patiently(lambda: self._ended_by(command))
            except StoreUnavailable:  # it landed; whether it ended the Run, the log says
                return
        if taken is not None:
            _raise_if_ended(self.thread_id, command, *taken)

    async def _ended_by(self, command: ResumeCommand) -> Taken | None:
        """After a resume that landed: its taken fact, if the Run has ended since (it may
        have ended as the resume was taken, ``resume_ended``); None while it goes on. The
        thread's head (no history read), and the last commit, while the Run is its latest."""
        frontier = await self.client.store.load_head(self.thread_id)
        if frontier.run_id != command.run_id:  # the thread moved on: that Run has ended
            return await self._taken(command)
        if not isinstance(frontier.run_state, EndedState):
            return None
        return await self._taken(command, after_seq=frontier.version - 1)  # the end's commit

    async def _resume(self, command: ResumeCommand, index: int | None) -> None:
        # the host decides the deadline by its clock: a client's may run ahead
        validate_resume(_ticket_of(await self.frontier()), command, None)
        placement = await self._placement()
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # as a start's (on_a_live_host): from the first failure
        delay = POLL_FIRST_S
        while True:
            target = self.client.host_for(self.thread_id, placement, index)
            try:
                unwrap(await target.resume_run.remote(command, trace=tracing_env.carrier()))
                return
            except RayActorError as exc:
                await self.client.host_failed(target)
                ticket = await self.ticket()
                if ticket is None or ticket.correlation != command.correlation:
                    await self._landed(command)  # returns if it was ours, else raises
                    return  # ``resume`` then asks the log whether it ended the Run
                if deadline is None:
                    deadline = loop.time() + RESUME_GIVE_UP_S
                elif loop.time() > deadline:
                    raise ClusterUnavailable(
                        f"no host accepted the resume of {self.thread_id} within "
                        f"{RESUME_GIVE_UP_S:g}s; its ticket is as it was: ask again"
                    ) from exc
                if placement == "hosted":  # the next host (a dedicated one is re-created)
                    current = (
                        index
                        if index is not None
                        else host_index(self.thread_id, self.client.spec.hosts)
                    )
                    index = (current + 1) % self.client.spec.hosts
                await asyncio.sleep(delay)  # hosts restarting (a kill of several at once)
                delay = min(delay * 2, POLL_MAX_S)

    async def _landed(self, command: ResumeCommand) -> None:
        """The ticket is gone: whose resume was applied? Ours: return; else ResumeRejected."""
        applied = await self._applied(command)
        if applied:
            return
        if applied is False:
            raise ResumeRejected("ticket", "another resume of this ticket was applied")
        raise ResumeRejected("ticket", "the run stopped awaiting without this resume")

    async def _applied(self, command: ResumeCommand) -> bool | None:
        """Whose resume of the command's ticket the log holds: True ours (its request id
        and its payload), False another's, None none. A request id reused with another
        payload is another's: its caller is not told that what it asked for was done."""
        taken = await self._taken(command)
        return None if taken is None else _holds(taken[0], command)

    async def _taken(self, command: ResumeCommand, after_seq: int = 0) -> Taken | None:
        """The fact of the resume of the command's ticket the log holds (``TAKEN``: it
        landed, or ended the Run), whoever's, and its commit; None if none."""
        for record in reversed(await self.client.store.read(self.thread_id, after_seq)):
            for fact in reversed(stamp_facts(record.commit, record.seq)):
                if fact.type in TAKEN and fact.data.get("correlation") == command.correlation:
                    return fact, record.commit
        return None

    async def respond(
        self, payload: ResumePayload, *, host: int | None = None, request_id: str | None = None
    ) -> ResumeCommand:
        """Answer the committed ticket with ``payload`` (ids and call id taken from it).

        ``request_id``: the caller's own id for this answer. Asked again with the same id
        after an answer that was lost (an outage that outlasted the client's wait, a
        process that died), a resume that landed under it is this call's success, whatever
        the thread holds now (no ticket, or the Run's next one: never answered with it);
        the same id with another payload is ResumeRejected, and one whose resume ended the
        Run (``resume``) ResumeEnded again. Without one, each call is a new answer."""
        if request_id is not None:
            landed = await self.answered(payload, request_id)
            if landed is not None:
                ended = await self._taken(landed)
                if ended is not None:
                    _raise_if_ended(self.thread_id, landed, *ended)
                return landed
        ticket = await self.ticket()
        if ticket is None:
            state = (await self.frontier()).run_state
            raise ResumeRejected("ticket", f"thread {self.thread_id!r} is {_where(state)}")
        command = command_for(ticket, payload)
        if request_id is not None:
            command = command.model_copy(update={"request_id": request_id})
        await self.resume(command, host=host)
        return command

    async def answered(self, payload: ResumePayload, request_id: str) -> ResumeCommand | None:
        """The command of the resume of this thread that landed under ``request_id``,
        rebuilt from the ticket it answered, if it answered with ``payload``; None if no
        resume landed under that id; ResumeRejected if one did with another payload."""
        ticket: ResumeTicket | None = None
        for record in await self.client.store.read(self.thread_id):
            state = record.commit.disposition
            if isinstance(state, AwaitingState):
                ticket = state.ticket
            for fact in record.commit.facts:
                if fact.type not in TAKEN or fact.data.get("request_id") != request_id:
                    continue
                if ticket is None or fact.data.get("correlation") != ticket.correlation:
                    continue
                command = command_for(ticket, payload).model_copy(update={"request_id": request_id})
                if not _holds(fact, command):
                    raise ResumeRejected(
                        "ticket", f"request id {request_id!r} answered with another payload"
                    )
                return command
        return None

    async def _placement(self) -> Placement:
        meta = run_meta(await self.frontier())
        return meta.placement if meta is not None else self.placement


def _holds(fact: Fact, command: ResumeCommand) -> bool:
    """Whether a ``resumed`` fact is ``command``'s: its request id and its payload. What
    the fact holds must be ours (a field added since it was written is not)."""
    mine = {
        "correlation": command.correlation,
        **command.payload.model_dump(mode="json"),
        "request_id": command.request_id,
    }
    return fact.data.get("request_id") == command.request_id and all(
        mine.get(key) == value for key, value in fact.data.items()
    )


def _raise_if_ended(
    thread: ThreadId, command: ResumeCommand, fact: Fact, commit: ThreadCommit
) -> None:
    """ResumeEnded if ``fact`` says the command's resume was taken as the Run's end."""
    if fact.type != "resume_ended" or not _holds(fact, command):
        return
    cause = getattr(commit.disposition, "cause", None)
    limit = cause.code if isinstance(cause, Failed) else "history_limit"
    raise ResumeEnded(thread, command.run_id, limit)


def command_for(ticket: ResumeTicket, payload: ResumePayload) -> ResumeCommand:
    """The ResumeCommand answering ``ticket`` with ``payload``."""
    return answer(ticket, payload)


def _ticket_of(frontier: Frontier) -> ResumeTicket | None:
    state = frontier.run_state
    return state.ticket if isinstance(state, AwaitingState) else None


def _where(state: Any) -> str:
    if state is None:
        return "unknown (no run was ever started on it)"
    if isinstance(state, EndedState):
        return f"not awaiting: run {state.run_id} ended {state.cause.kind}"
    return f"not awaiting: run {state.run_id} is {state.kind}"
