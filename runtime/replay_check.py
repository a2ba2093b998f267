"""The replay check for upgrades: re-run a recorded thread's decisions against the current
agent code, without any effect, and report the first divergence (STYLE 7; like DBOS's
unexpected-step check and Temporal's replayer).

The real Engine decides: there is no second Step loop here. Each way into the recorded
log (``runtime.replay_log``: a start, a resume, a recovery, an end at rest, a host's
mark of a lost Run) is made again, in order, by a fresh Engine of the current agent on
a scratch in-memory store, with the recorded run and message ids, and

- a model that answers inference *n* of Run *r* with the response committed for it
  (text, tool calls and usage), and fails where the recorded model failed;
- a tool runner and a child runner that answer each attempt of each call with the
  outcome committed for it — never running a tool or starting a child;
- the recorded ResumeCommands (their payloads are in the resume commits' facts).

Every commit the engine makes is compared, before it is stored, with the recorded commit
at the same seq (``runtime.replay_compare``): the first that differs ends the replay. A
way in whose driver died (a crash, a lost host) ends where it ended: at the first
commit, inference or tool call that the recording does not have.

What the log cannot tell is fed back, never judged:

- **A tool's state commands** ride in its results commit with the AfterTool hooks'
  commands, unattributed. The replay first gives the tools none; where the results
  commit then lacks commands and only that, those are the tools', and the thread is
  replayed again with them (each attempt placed in the order the engine records).
  So an AfterTool hook that now writes *less* is not caught at that commit.
- **An end from outside.** ``cancelled`` (not at rest) only ever comes from outside:
  the replay cancels its engine where the code reaches for an inference or a tool result
  the recording does not have. ``stopped`` comes from outside, a hook or a tool: it is
  fed back so where a wave was in flight or had just committed its results (a tool's
  ``stop()``, or a stop during the next inference); elsewhere it is the code's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from runtime.agent import Agent
from runtime.base import Frozen
from runtime.commit import Frontier, Receipt, ThreadCommit, assemble_commit
from runtime.engine import Engine
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, RunningState
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.messages import UserMessage
from runtime.models import Model
from runtime.ports import CommitStore, CommittedRecord, Lease, RunSummary, vouched_log
from runtime.replay_compare import (
    Divergence,
    DivergenceKind,
    commit_text,
    compare,
    decisions,
    divergence,
)
from runtime.replay_feed import (
    Feed,
    Halt,
    Hints,
    ReplayChildren,
    ReplayModel,
    ReplayNote,
    ReplayTools,
)
from runtime.replay_log import Recording, ReplayInputError, Way, resume_command, tools_commands

Source = CommitStore | Sequence[CommittedRecord] | Sequence[ThreadCommit]
"""A recording: a store holding the thread, or its records (or commits) in order."""


class ReplayReport(Frozen):
    """The outcome of a replay check."""

    thread_id: str
    commits: int
    """Commits in the recorded log."""
    matched: int
    """Commits the replay made that agree with the recording."""
    runs: int
    inferences: int
    """Inferences answered from the recording."""
    tool_calls: int
    """Executor attempts answered from the recording (no tool ran)."""
    divergence: Divergence | None = None
    notes: tuple[ReplayNote, ...] = ()

    @property
    def clean(self) -> bool:
        return self.divergence is None

    def line(self) -> str:
        if self.divergence is not None:
            return f"thread {self.thread_id} diverges at {self.divergence.line()}"
        return (
            f"thread {self.thread_id}: {_n(self.commits, 'commit')} of {_n(self.runs, 'Run')}"
            f" replay cleanly ({_n(self.inferences, 'inference')} and "
            f"{_n(self.tool_calls, 'tool result')} fed back)"
        )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


async def replay(
    source: Source,
    thread: str,
    agent: Agent,
    *,
    lineage: Sequence[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    scratch: Callable[[], CommitStore] | None = None,
) -> ReplayReport:
    """Replay ``thread``'s recorded decisions against ``agent`` and report the first
    divergence (ReplayInputError if there is nothing to replay).

    ``lineage``: the agent references of the Run's ancestry, as its runner had them
    (default: the agent's name; a cluster's is ``module:attr``), for delegation limits.
    ``scratch`` makes the empty store the replay writes to (default: in memory).
    """
    recording = Recording.of(await _records(source, ThreadId(thread)))
    hints: Hints = {}
    while True:
        attempt = _Replay(recording, agent, hints, lineage, limits, scratch)
        report = await attempt.run(ThreadId(thread))
        learned = attempt.learned
        if not learned or learned.keys() <= hints.keys():
            return report
        hints = {**hints, **learned}  # the tools' commands: replay again with them


async def _records(source: Source, thread: ThreadId) -> list[CommittedRecord]:
    if isinstance(source, Sequence):
        items = list(source)
        records = [
            item if isinstance(item, CommittedRecord) else CommittedRecord(seq=i, commit=item)
            for i, item in enumerate(items, start=1)
        ]
    else:
        head, records = await vouched_log(source, thread)
        if not records and head.version:
            raise ReplayInputError(f"thread {thread!r} keeps no records: it was pruned")
    records = [r for r in records if r.commit.thread_id == thread]
    if not records:
        raise ReplayInputError(f"thread {thread!r} has no recorded commits")
    return records


class _CheckingStore:
    """The scratch store, behind a check of every append against the recording."""

    def __init__(self, inner: CommitStore, feed: Feed, agent: Agent) -> None:
        self.inner = inner
        self.feed = feed
        self.agent = agent

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        feed = self.feed
        seq = expected_version + 1
        expected = feed.next_expected()
        if expected is None:
            if feed.way.cut_short:
                raise Halt(None)  # the recording's driver died before this commit
            at_rest = "nothing: the Run was at rest"
            raise Halt(divergence(seq, "extra_commit", at_rest, commit_text(commit)))
        if expected.seq != seq:
            raise Halt(
                divergence(seq, "extra_commit", commit_text(expected.commit), commit_text(commit))
            )
        found = compare(seq, expected.commit, commit, self._known)
        if found is not None:
            raise Halt(found, self._learned(found, expected, commit))
        receipt = await self.inner.append(commit, expected_version, epoch, claim=claim)
        feed.made += 1
        feed.matched += 1
        return receipt

    def _known(self, tool: str) -> bool:
        return self.agent.deployed_tool(tool) is not None

    def _learned(
        self, found: Divergence, expected: CommittedRecord, got: ThreadCommit
    ) -> Hints | None:
        if found.what != "state_differs" or expected.commit.label != "results":
            return None
        slots = self.feed.recording.finished_in.get(expected.seq, ())
        return tools_commands(decisions(expected.commit.commands), decisions(got.commands), slots)

    async def load(self, thread: ThreadId) -> Frontier:
        return await self.inner.load(thread)

    async def load_head(self, thread: ThreadId) -> Frontier:
        return await self.inner.load_head(thread)

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        return await self.inner.read(thread, after_seq, limit)

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        return await self.inner.claim(thread, owner, supersedes)

    async def list_runs(
        self,
        state: Literal["running", "awaiting", "ended"] | None = None,
        *,
        host: str | None = None,
    ) -> list[RunSummary]:
        return await self.inner.list_runs(state, host=host)

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        return await self.inner.thread_ids(after, limit)

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        return await self.inner.prune(thread, through_seq)

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        return await self.inner.hold_lease(name, holder, ttl_s)

    async def drop_lease(self, name: str, holder: str) -> None:
        await self.inner.drop_lease(name, holder)

    async def close(self) -> None:
        await self.inner.close()


class _Replay:
    """One replay of a recording (``replay`` may make several: see the module doc)."""

    def __init__(
        self,
        recording: Recording,
        agent: Agent,
        hints: Hints,
        lineage: Sequence[str] | None,
        limits: Limits,
        scratch: Callable[[], CommitStore] | None,
    ) -> None:
        self.recording = recording
        self.feed = Feed(recording, hints)
        self.agent = _replaying(agent, ReplayModel(self.feed))
        self.lineage = lineage
        self.limits = limits
        self.inner = scratch() if scratch is not None else _memory_store()
        self.store = _CheckingStore(self.inner, self.feed, self.agent)
        self.tools = ReplayTools(self.feed)
        self.children = ReplayChildren(self.feed, self.inner)
        self.learned: Hints | None = None

    async def run(self, thread: ThreadId) -> ReplayReport:
        try:
            return self._report(thread, await self._ways(thread))
        finally:
            await self.inner.close()

    async def _ways(self, thread: ThreadId) -> Divergence | None:
        for way in self.recording.ways:
            engine = self._engine(way)
            self.feed.begin(way, engine)
            try:
                await self._way_in(thread, way, engine)
            except Halt as halt:
                if halt.found is None:
                    continue  # the recording's driver died here too
                self.learned = halt.learned
                return halt.found
            except RatchetError as exc:
                first = way.records[0]
                return divergence(
                    first.seq, "way_in_refused", commit_text(first.commit), str(exc), first.commit
                )
            missing = self.feed.next_expected()
            if missing is not None:
                got = "nothing: the code came to rest"
                return divergence(
                    missing.seq, "missing_commit", commit_text(missing.commit), got, missing.commit
                )
        return None

    def _engine(self, way: Way) -> Engine:
        link = self.recording.links.get(way.first.run_id)
        engine = Engine(
            self.agent,
            self.store,
            self.tools,
            owner=f"replay-{way.kind}",
            children=self.children,
            prompt_path=link.prompt_path if link is not None else None,
            lineage=link.lineage if link is not None else self.lineage,
            parent=link,
            limits=self.limits,
        )
        # the feed follows the log in order: each commit lands before the code goes on
        engine.lands_later = engine.chains = False
        # the recorded resumes are vouched for by the recording: a delegation's outcome
        # (the scratch store holds no child to check it against) and its deadline verdict
        engine.recorded_resumes = True
        return engine

    async def _way_in(self, thread: ThreadId, way: Way, engine: Engine) -> None:
        first = way.first
        if way.kind == "start":
            user = next((m for m in first.messages if isinstance(m, UserMessage)), None)
            if user is None:
                raise ReplayInputError(f"the start of run {first.run_id} has no user message")
            await engine.start(thread, user.text, run_id=first.run_id, message_id=user.id)
        elif way.kind == "resume":
            await engine.resume(resume_command(way))
        elif way.kind == "recover":
            await engine.recover(thread)
        elif way.kind == "terminate":
            if not isinstance(first.disposition, EndedState):
                raise ReplayInputError(f"the end of run {first.run_id} does not end it")
            await engine.terminate(thread, first.disposition.cause)
        else:
            await self._mark(thread, first)

    async def _mark(self, thread: ThreadId, recorded: ThreadCommit) -> None:
        """A host's mark of a lost Run (``actors.ownership``): input, made as it was."""
        f = await self.inner.load(thread)
        if not isinstance(f.run_state, RunningState):
            raise ReplayInputError(f"the mark of run {recorded.run_id} finds it not running")
        owner = "replay-mark"
        commit = assemble_commit(
            thread_id=thread,
            run_id=recorded.run_id,
            ordinal=f.next_ordinal,
            label="status",
            disposition=f.run_state,
            status=recorded.status or f.status,
            prev=f.head,
            epoch=f.epoch + 1,
            claim=owner,
        )
        await self.store.append(commit, f.version, f.epoch, claim=owner)

    def _report(self, thread: ThreadId, found: Divergence | None) -> ReplayReport:
        feed, records = self.feed, self.recording.records
        return ReplayReport(
            thread_id=thread,
            commits=len(records),
            matched=feed.matched,
            runs=len({r.commit.run_id for r in records}),
            inferences=feed.inferences,
            tool_calls=feed.calls,
            divergence=found,
            notes=tuple(feed.notes.values()),
        )


def _replaying(agent: Agent, model: Model) -> Agent:
    """``agent`` as it is, with ``model`` in place of each side's model. A copy, not
    ``dataclasses.replace``: that would resolve the plugins again onto tools and hooks
    that already hold theirs."""
    twin = _with_model(agent, model)
    session = agent.session
    if session is not None and session.b.agent is not None:
        side = dataclasses.replace(session.b, agent=_with_model(session.b.agent, model))
        object.__setattr__(twin, "session", dataclasses.replace(session, b=side))
    return twin


def _with_model(agent: Agent, model: Model) -> Agent:
    twin = copy.copy(agent)
    object.__setattr__(twin, "model", model)
    return twin


def _memory_store() -> CommitStore:
    from storage.memory import MemoryCommitStore  # the layer above: imported only here

    return MemoryCommitStore()


__all__ = [
    "Divergence",
    "DivergenceKind",
    "ReplayInputError",
    "ReplayNote",
    "ReplayReport",
    "replay",
]
