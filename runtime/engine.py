"""The Step engine (DESIGN §3): drives one Run from its committed frontier.

Every transition is committed before anything relies on it. The engine holds no
truth of its own: it starts from ``store.load`` and after each commit folds that
commit into its copy of the frontier with the same pure function the stores use. The
load is the one read of the thread's history per way in: it verifies the whole log
and takes the messages from it; from there on the engine keeps them itself (a store
keeps only each message's one copy in the log, and writes only what a commit adds).
The same engine runs under the in-process runner and inside a Ray RunHost.

**Ownership.** Every way in takes the thread by compare-and-set: a start, a resume
and an end at rest make their first commit carry the claim (it lands only if the
thread is still at the version and owner epoch they read), a recovery claims the
epoch it read. Whoever loses such a race gets a typed error (InvalidTransition,
ResumeRejected, Fenced) and has changed nothing.

**One settling path.** Whatever escapes a Step — a hook, the model's output, a
store refusal such as PayloadTooLarge, our own bug — ends the Run with a committed
``failed(kind, code, message)`` (``settle``; ``runtime.failures`` decides the kind),
retried with backoff until it lands. Only what means "not ours to settle"
(``runtime.failures.NOT_OURS``: fenced, ended, corrupt, the store lost or out too
long) stops a drive without an end, and goes to its caller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from runtime import tracing
from runtime.agent import Agent
from runtime.checkpoint import SafeCheckpoints
from runtime.commit import Frontier, whole_of, with_history
from runtime.context import DEFAULT_RETRY, RunContext, StoreRetry, held_wait
from runtime.delegation import (
    ChildRunner,
    ParentLink,
    check_delegation_answer,
    parent_gone,
    parent_link,
)
from runtime.errors import (
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    ResumeRejected,
    RunEnded,
    VersionConflict,
)
from runtime.execution import ExecutionState
from runtime.failures import NOT_OURS, failure_of
from runtime.faults import NO_FAULTS, FaultPlan
from runtime.history import copy_under_way, end_of_run
from runtime.ids import CallId, RunId, ThreadId
from runtime.inference import Inference
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndCause,
    ResumeCommand,
    RunningState,
)
from runtime.limits import (
    DEFAULT_LIMITS,
    STORED_IDS,
    Limits,
    check_id,
    check_reason,
    check_room,
    check_text,
    long_id_limits,
)
from runtime.messages import Message, UserMessage
from runtime.plugin_env import pin
from runtime.ports import CommitStore, LiveBus, StreamCheckpointStore, ToolRunner
from runtime.publish import Publisher
from runtime.resume import check_command, resume_commit, validate_ticket
from runtime.rules import check_repeated_start, input_message_id, ran_before, run_id_used
from runtime.session import opening
from runtime.signals import (
    CancelSignal,
    OwnTaskCancelled,
    cancelling,
    guarded,
    take_back_cancels,
)
from runtime.stepping import Stepping
from runtime.timeutil import now_us
from runtime.toolbatch import run_wave

log = logging.getLogger("ratchet.engine")
T = TypeVar("T")
RACES = 8
"""How often a way in looks again after losing a race, before it gives up."""
NEW_ID = "a new Run needs a new id"
_WHILE_ACTIVE = {
    "running": "wait for it to end (a Run whose host died is recovered), or cancel it",
    "awaiting": "resume it (its ticket says with what), or cancel it",
}
"""What a start refused for the Run its thread holds can do instead."""


class Engine(Stepping):
    """Drives one Run. Create one per Run attempt; crash it by abandoning it."""

    def __init__(
        self,
        agent: Agent,
        store: CommitStore,
        tools: ToolRunner,
        *,
        bus: LiveBus | None = None,
        publisher: Publisher | None = None,
        faults: FaultPlan = NO_FAULTS,
        owner: str | None = None,
        prompt_path: Sequence[str] | None = None,
        store_retry: StoreRetry = DEFAULT_RETRY,
        checkpoints: StreamCheckpointStore | None = None,
        checkpoint_interval_s: float = 0.25,
        children: ChildRunner | None = None,
        lineage: Sequence[str] | None = None,
        parent: ParentLink | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.root = agent
        """The Run's agent; ``agent`` is the one whose turn it is (a session's other side)."""
        self.agent = agent
        self.store = store
        check_room(store, limits)
        self.tools = tools
        self.publisher = publisher or (Publisher(bus) if bus is not None else None)
        self.faults = faults
        # 8 random hex digits, as uuid4().hex[:8] gave, without building a UUID per Run
        self.owner = owner or f"engine-{os.urandom(4).hex()}"
        self.prompt_path = tuple(prompt_path or (agent.name,))
        self.children = children
        self.lineage = tuple(lineage or (agent.name,))
        """Agent references from the root Run to this one (delegation cycle checks)."""
        self.parent = parent
        self.store_retry = store_retry
        self.limits = limits
        self.cancel_event = CancelSignal()
        self.stop_reason: str | None = None
        self.pause_requested = False
        self.stopped_only_when_told = False
        """True where only ``told_to_stop`` precedes a cancellation of the engine's task (a
        RunHost's drive): any other was asked by code the Run runs, and fails the Run. In
        process the caller of a start may cancel it, which stops the drive as asked."""
        self.told_to_stop = False
        self.listening = True
        """False once the loop decided to return: a control signalled after that is not
        heard (a host then ends the Run at rest instead: ``resting``)."""
        self.committed = asyncio.Event()
        """Set once this engine's first commit has landed (a host answers its caller then)."""
        self.end_landed = asyncio.Event()
        """Set once the Run's end, committed by this engine, has landed (a cancel told to
        it is answered then, before its children are cancelled)."""
        self._execution: ExecutionState | None = None
        publish = self.publisher.offer if self.publisher is not None else None
        # nothing here refers back to the engine: an engine must be freed by reference
        # counting when its drive is over, not wait for the cycle collector
        self._inference_parts = (
            limits,
            SafeCheckpoints(checkpoints),
            checkpoint_interval_s,
            functools.partial(guarded, self.cancel_event),
            self.cancel_event.is_set,
            publish,
        )
        self.inference = Inference(agent, *self._inference_parts)
        # a Step's results land while the next inference runs only where no code of the
        # agent's runs before the next commit: no hook, gate, end guard or session (a
        # stream checkpoint waits for them: runtime.inference)
        self.lands_later = not (agent.hooks or agent.gates or agent.run_end_guards or agent.session)
        # a planned crash "after:X" means nothing after X is written: a commit queued
        # behind X before X's receipt would be, so a fault plan keeps each commit apart
        ordered = getattr(store, "ordered_appends", False) is True
        self.chains = self.lands_later and ordered and faults.crash_at is None
        # a replay feeds the recorded resumes, which landed when they were made: their
        # deadlines are judged as then, and a delegation's outcome is not checked against
        # its child (the replay's store has none); live, it must be the child's stored end
        self.recorded_resumes = False
        self._sides: dict[str, tuple[Agent, Inference, tuple[str, ...]]] = {}

    # ---- control --------------------------------------------------------------------

    def cancel(self) -> None:
        """Checked before inference, while inference and tools are awaited, between steps."""
        self.cancel_event.set()

    def stop(self, reason: str) -> None:
        """Like cancel, but the Run ends ``stopped(reason)`` (InputRefused: a reason
        that is not storable text within ``input_bytes``; nothing is signalled)."""
        self.stop_reason = check_reason(reason, self.limits)
        self.cancel_event.set()

    def pause(self) -> None:
        """A manual pause: at the next Step boundary the Run commits Awaiting(pause)."""
        self.pause_requested = True

    # ---- ways in: each takes the thread by compare-and-set -----------------------------

    @tracing.drive
    async def start(
        self,
        thread: ThreadId,
        text: str,
        *,
        run_id: RunId | None = None,
        message_id: str | None = None,
        new_thread: bool = False,
    ) -> Frontier:
        """Activate a new Run with ``text`` as input and drive it.

        Idempotent by run id: if the Run exists already its frontier is returned as it
        is (whoever drives it; a Run whose driver is gone is recovered by its owner's
        host or the Supervisor, or in-process by ``recover``); an earlier Run of the
        thread, as its end left the thread (RunSuperseded if that was pruned). Refused with
        InvalidTransition while another Run of the thread is active, and with
        InputRefused (nothing written) for input or ids over the limits.

        ``new_thread``: the caller made the thread's id for this Run, so the thread is
        most likely empty: the activation is tried on an empty frontier first, without
        reading the thread (a read per Run, and its round trip). That is only a guess:
        the store's compare-and-set on version 0 and epoch 0 refuses it on any thread
        that has a record, and the start then reads and verifies the thread and goes
        on exactly as without the hint (nothing was written).
        """
        run_id = RunId(f"run-{uuid.uuid4().hex}") if run_id is None else run_id
        if not isinstance(new_thread, bool):  # a hint: "yes" would be taken as one
            raise TypeError(f"new_thread is True or False, not {new_thread!r:.80}")
        message_id = message_id or input_message_id(run_id)
        self._check_start(thread, run_id, message_id, text)
        user = UserMessage(id=message_id, text=text)
        link = () if self.parent is None else (self.parent.command(),)
        for attempt in range(RACES + new_thread):
            guessed = new_thread and attempt == 0
            frontier = Frontier(thread_id=thread) if guessed else await self._verified(thread)
            if self.parent is not None:
                _child_s_own(frontier, run_id, self.parent)
            # a repeated start: that Run exists (the thread's, or one before it, whose end
            # its log holds: not only by its receipts, which a prune drops); the same input
            # is answered with the thread as it is, another is refused
            if frontier.run_id == run_id or ran_before(frontier, message_id):
                check_repeated_start(frontier, message_id, text, run_id)
                self.listening = False  # this engine drives nothing: a signal is not heard
                if frontier.run_id == run_id:
                    return frontier
                records = await self._retrying(lambda: self.store.read(thread))
                return end_of_run(thread, records, run_id, frontier.run_id)  # as it ended
            if run_id_used(frontier, run_id):  # asked with another input or agent
                raise InvalidTransition(f"run {run_id} already ran on thread {thread}; {NEW_ID}")
            if (copying := copy_under_way(frontier)) is not None:
                raise InvalidTransition(copying)
            if frontier.run_state is not None and not frontier.ended:
                raise InvalidTransition(
                    f"thread {thread} already has an active run {frontier.run_id} "
                    f"({frontier.run_state.kind}): {_WHILE_ACTIVE[frontier.run_state.kind]}"
                )
            ctx = self._context(frontier)
            try:
                await self._commit(
                    ctx,
                    "activation",
                    RunningState(run_id=run_id),
                    claim=True,
                    messages=(user,),
                    commands=(*link, *pin(self.root.resolved), *opening(self.root, frontier)),
                    run_id=run_id,
                )
            except (VersionConflict, Fenced):
                continue  # the thread moved under us: look again
            except (DuplicateOperation, InvalidTransition, RunEnded) as exc:
                if guessed:  # the thread was not empty: what it holds decides
                    continue
                if isinstance(exc, DuplicateOperation):  # an earlier Run here had this id
                    raise InvalidTransition(
                        f"run {run_id} already ran on thread {thread}; {NEW_ID}"
                    ) from None
                raise
            return await self._drive(ctx)
        raise InvalidTransition(f"thread {thread} kept moving; run {run_id} was not started")

    def _check_start(self, thread: str, run_id: str, message_id: str, text: str) -> None:
        limits = self.limits
        check_id("thread id", thread, limits)
        check_id("run id", run_id, limits)
        check_id("message id", message_id, long_id_limits(limits.id_chars))
        check_text("input", text, limits.input_bytes, "input_bytes")

    @tracing.drive
    async def recover(self, thread: ThreadId, loaded: Frontier | None = None) -> Frontier:
        """Take over a running Run (its epoch as loaded: Fenced if the thread moved on
        meanwhile) and continue it from its frontier. A Run at rest is returned as is.

        ``loaded``: the thread's whole frontier as its caller just loaded it from this
        engine's store (``load``, verified), so that it is not read and verified twice;
        the claim is compare-and-set on its epoch, so a frontier gone stale meanwhile is
        Fenced, as one this engine loaded itself would be."""
        check_id("thread id", thread, STORED_IDS)  # a stored thread's, whatever id_chars is
        frontier = whole_of(loaded, thread) or await self._verified(thread)
        if not isinstance(frontier.run_state, RunningState):
            return frontier
        if (copying := copy_under_way(frontier)) is not None:
            raise InvalidTransition(copying)  # the source's Run, half copied: not driven
        claimed = await self._claimed(thread, frontier.epoch)
        added: tuple[Message, ...] = ()
        if claimed.version > frontier.version:  # its owner went on meanwhile: verify that too
            later = await self._retrying(
                lambda: self.store.read(thread, after_seq=frontier.version)
            )
            added = tuple(m for r in later if r.seq <= claimed.version for m in r.commit.messages)
        # a store answers a claim with the head alone: the messages are the ones loaded
        claimed = with_history(claimed, (*frontier.messages, *added))
        if not isinstance(claimed.run_state, RunningState):
            self.listening = False  # nothing to drive: a signal now would not be heard
            return claimed  # it came to rest between the load and the claim
        ctx = self._context(claimed)
        self.inference.use_checkpoint = True
        if self.parent is not None and await parent_gone(self.store, self.parent):
            # its parent ended while nothing drove this child (the cancel lost with the
            # child's host): the loop looks at the parent only before a Step, after a
            # recovery has replayed the child's calls or rejoined its own children
            async def orphaned() -> None:
                await self.end(ctx, Cancelled())

            return await self._drive(ctx, orphaned)
        if claimed.status.state != "running":

            async def status() -> None:
                await self._commit(ctx, "status", ctx.running())

            return await self._drive(ctx, status)
        return await self._drive(ctx)

    @tracing.drive
    async def resume(self, command: ResumeCommand, loaded: Frontier | None = None) -> Frontier:
        """Validate ``command`` against the committed ticket, commit it, and drive on.

        Raises ResumeRejected (naming the failed axis) and leaves the ticket intact; of
        two resumes of one ticket exactly one lands, the other is rejected. ``loaded`` as
        in ``recover``: the first try validates against it, and the resume commit is
        compare-and-set on its version, so a thread that moved since is loaded again.
        """
        command = check_command(command, self.limits)
        ctx, run_now = await self._resumed(command, whole_of(loaded, command.thread_id))
        if run_now is None:
            return await self._drive(ctx)
        return await self._drive(ctx, functools.partial(self._run_approved, ctx, run_now))

    async def _resumed(
        self, command: ResumeCommand, loaded: Frontier | None
    ) -> tuple[RunContext, CallId | None]:
        """The resume commit, made on the frontier its ticket was validated against."""
        for _ in range(RACES):
            frontier = loaded or await self._verified(command.thread_id)
            loaded = None  # a retry reads the thread again
            if (copying := copy_under_way(frontier)) is not None:
                raise InvalidTransition(copying)
            ticket = validate_ticket(frontier, command, self.recorded_resumes)
            if not self.recorded_resumes:
                await check_delegation_answer(frontier, command, self._verified, self.limits)
            ctx = self._context(frontier)
            self.inference.resumed_from(ticket, frontier.status.since)
            try:
                return ctx, await resume_commit(self, ctx, ticket, command)
            except (VersionConflict, Fenced, RunEnded):
                continue  # the thread moved: the ticket may be gone (validated again)
        raise ResumeRejected("ticket", "the thread kept moving; the resume was not applied")

    async def _run_approved(self, ctx: RunContext, call_id: CallId) -> None:
        """An approved call (or a fired schedule) runs now, marked executing by the resume."""
        assert ctx.frontier.batch is not None
        await run_wave(self, ctx, ctx.frontier.batch, [call_id], marked=True)

    async def terminate(
        self,
        thread: ThreadId,
        cause: EndCause | None = None,
        *,
        supersedes: int | None = None,
        run: RunId | None = None,
    ) -> Frontier:
        """End a Run that this engine is not driving (awaiting, or driven elsewhere).

        The end commit carries the claim, so a driver elsewhere is fenced by it; unfinished
        calls are sealed indeterminate and the ticket is cleared, so a late resume fails
        closed. A Run at rest is returned as is. With ``supersedes`` the end is made only
        if the thread's owner epoch is still that one (else Fenced). With ``run`` only that
        Run is ended: a thread that holds another (the one named ended, and a later one
        started) is returned as is, never the later Run ended in its place. The thread id
        names a stored thread: it is held to ``STORED_IDS``, not to ``id_chars`` (a Run's
        end always lands, also on a thread made before the limit was lowered).
        """
        check_id("thread id", thread, STORED_IDS)
        for _ in range(RACES):
            frontier = await self._verified(thread)
            if supersedes is not None and frontier.epoch != supersedes:
                raise Fenced(thread, supersedes, frontier.epoch)
            if run is not None and frontier.run_id != run:
                return frontier
            if not isinstance(frontier.run_state, RunningState | AwaitingState):
                return frontier
            ctx = self._context(frontier)
            try:
                await self.end(ctx, cause or Cancelled(), claim=True)
            except (VersionConflict, Fenced, RunEnded):
                continue  # it moved, or ended on its own: look again
            return ctx.frontier
        raise InvalidTransition(f"thread {thread} kept moving; it was not ended")

    async def _verified(self, thread: ThreadId) -> Frontier:
        """The thread's whole frontier; its load reads and verifies the whole log (hashes,
        chain, head) to take the messages from it: no engine acts on a thread whose
        records do not verify (CorruptRecord)."""
        return await self._retrying(lambda: self.store.load(thread))

    def _context(self, frontier: Frontier) -> RunContext:
        execution = ExecutionState(
            RunId(frontier.run_id or ""),
            frontier.thread_id,
            self.prompt_path,
            self.cancel_event,
            self.limits,
        )
        execution.wait_request = held_wait(frontier)  # a hook's, committed mid-Step
        self._execution = execution
        ctx = RunContext(frontier=frontier, epoch=frontier.epoch, execution=execution)
        if self.root.session is not None:
            self._use_side(ctx)
        return ctx

    # ---- the loop ---------------------------------------------------------------------

    async def _drive(
        self, ctx: RunContext, first: Callable[[], Awaitable[None]] | None = None
    ) -> Frontier:
        """Drive until the Run rests; whatever escapes a Step is settled here."""
        try:
            await self._loop(ctx, first)
        except NOT_OURS:
            raise
        except asyncio.CancelledError as exc:
            if cancelling():
                if not self.stopped_only_when_told or self.told_to_stop:
                    raise  # the drive itself is being cancelled (a host stopping it)
                # no one may cancel a host's drive but the host, which did not: the code
                # the Run runs did (left, the Run stayed running, and every recovery
                # ran that code again)
                await take_back_cancels()
                if self.told_to_stop:
                    raise  # told meanwhile: the host stops it after all
                own = OwnTaskCancelled()
                await self.settle(ctx, failure_of(own), own)
            else:
                await self.settle(ctx, failure_of(exc), exc)  # raised by a part of ours
        except Exception as exc:
            await self.settle(ctx, failure_of(exc), exc)
        finally:
            self.listening = False
            self.abandon_landing(ctx)  # a drive stopped early leaves no append behind
        return ctx.frontier


def _child_s_own(frontier: Frontier, run_id: RunId, parent: ParentLink) -> None:
    """A child's thread is made for it and holds its one Run: a thread that holds another
    Run (a caller chose its id, or another parent's child derived the same) is never
    adopted, nor its history shown to the child's model (InvalidTransition)."""
    if frontier.version == 0:
        return
    link = parent_link(frontier) if frontier.run_id == run_id else None
    mine = (parent.thread, parent.run, parent.call_id)
    if link is None or (link.thread, link.run, link.call_id) != mine:
        raise InvalidTransition(
            f"thread {frontier.thread_id} holds run {frontier.run_id}, not the child {run_id} "
            f"of run {parent.run} (call {parent.call_id}): their ids collide; the child is "
            "not started there"
        )


__all__ = ["Engine", "RunContext", "StoreRetry", "now_us"]
