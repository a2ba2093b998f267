"""Reading every Run of a measurement back from the store, through a new connection,
and checking it against the workload and the side-effect ledger (see ``benchmarks.load``)."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from benchmarks.w1_agent import NEVER_REPLAY, W1, read_ledger
from cluster.report import EXECUTION_LOST
from runtime.commit import Frontier
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, Natural
from runtime.messages import AssistantMessage
from runtime.patience import patiently
from runtime.ports import CommitStore, CommittedRecord
from runtime.rules import replay

VERIFY_CONCURRENCY = 32
NATURAL = Natural().kind


@dataclass
class Verdict:
    natural_runs: int = 0
    wrong_text: int = 0
    commits: int = 0
    lost_commits: int = 0
    duplicate_never_replay: int = 0
    exactly_once_calls: int = 0
    replayed_calls: int = 0
    indeterminate_calls: int = 0
    ledger_violations: int = 0
    recovered_runs: int = 0
    recoveries_ms: list[float] = field(default_factory=list)
    settled_ms: list[float] = field(default_factory=list)
    """Host kill → the lost Run's ``failed/execution_lost`` commit (part of recovery)."""
    step_ms: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 10:
            self.problems.append(text)

    def ok(self, runs: int) -> bool:
        return (
            self.natural_runs == runs
            and self.wrong_text == 0
            and self.lost_commits == 0
            and self.duplicate_never_replay == 0
            and self.ledger_violations == 0
        )


class Answer(NamedTuple):
    """What the checks need of a Run's end, kept by the driver in place of the frontier
    its host answered with. A trial holds one per Run until it is checked: as frontiers
    (records of messages and state) they kept the driver's collector busy mid-load, with
    full collections of 0.14 to 0.27 s inside the durable arm's timed window and none in the
    plain arm's, which keeps only each Run's text. An answer is one object for the
    collector to walk, a frontier dozens."""

    run_id: str | None
    version: int
    state: str
    """The Run's state's type name (``EndedState``, ``AwaitingState``, ...)."""
    cause: str | None
    """Its end cause's kind, once ended."""
    text: str | None
    """Its last assistant message's text."""

    @classmethod
    def of(cls, frontier: Frontier) -> Answer:
        state = frontier.run_state
        cause = state.cause.kind if isinstance(state, EndedState) else None
        said = (m.text for m in reversed(frontier.messages) if isinstance(m, AssistantMessage))
        text = next(said, None)
        return cls(frontier.run_id, frontier.version, type(state).__name__, cause, text)


_FRONTIER_TRUTH = {"epoch", "owner"}
"""Claims change these without a commit: a replayed log cannot reproduce them."""


async def verify(
    store: CommitStore,
    params: W1,
    runs: Sequence[tuple[str, str]],
    host_kills: Sequence[float],
    strict: bool,
    timed_runs: set[str] | None = None,
) -> Verdict:
    """Read every Run back from ``store`` and check it against the ledger."""
    verdict = Verdict()
    gate = asyncio.Semaphore(VERIFY_CONCURRENCY)

    async def fetch(thread: str) -> tuple[list[CommittedRecord], Frontier]:
        async with gate:
            records = await patiently(lambda: store.read(ThreadId(thread)))
            return records, await patiently(lambda: store.load(ThreadId(thread)))

    fetched = await asyncio.gather(*(fetch(t) for t, _ in runs))
    effects, tool_of, inferences = _ledger(params)
    expected_ops: set[str] = set()
    for (thread, run), (records, frontier) in zip(runs, fetched, strict=True):
        verdict.commits += len(records)
        _check_log(verdict, thread, records, frontier)
        _check_end(verdict, params, thread, run, Answer.of(frontier))
        calls = {}
        for record in records:
            if record.commit.batch is not None:
                calls.update({c.operation_id: c for c in record.commit.batch.calls})
        for op in params.operation_ids(run):
            expected_ops.add(op)
            call = calls.get(op)
            if call is None:
                verdict.ledger_violations += 1
                verdict.problem(f"{thread}: call {op} was never committed")
                continue
            _check_call(verdict, op, call, effects[op], strict)
        _recoveries(verdict, records, host_kills)
        if timed_runs is None or run in timed_runs:
            verdict.step_ms += intervals_ms(inferences.get(run, {}))
    _phantoms_and_duplicates(verdict, effects, tool_of, expected_ops)
    return verdict


def verify_answers(
    params: W1,
    runs: Sequence[tuple[str, str]],
    answers: Mapping[str, Answer | None],
    appends: int,
    timed_runs: set[str],
) -> Verdict:
    """Check a Run of the same-dispatch arm (``noop://``: nothing to read back) by what
    its host answered with (its ``Answer``) — ended naturally with its text, holding exactly
    ``commits_per_run`` commits, and the hosts' stores together acknowledged no append
    that is not in one of them — and by the ledger: every call's effect exactly once,
    none of a call that was not made."""
    verdict = Verdict()
    effects, tool_of, inferences = _ledger(params)
    per_run = params.commits_per_run()
    expected_ops: set[str] = set()
    for thread, run in runs:
        answer = answers.get(run)
        if answer is None:
            verdict.problem(f"{thread}: its host gave no answer at rest")
            continue
        verdict.commits += answer.version
        if answer.version != per_run:
            verdict.lost_commits += abs(per_run - answer.version)
            verdict.problem(f"{thread}: {answer.version} commits, not {per_run}")
        _check_end(verdict, params, thread, run, answer)
        for op in params.operation_ids(run):
            expected_ops.add(op)
            if effects[op] == 1:
                verdict.exactly_once_calls += 1
            else:
                verdict.ledger_violations += 1
                verdict.problem(f"{op}: {effects[op]} effect(s) in the ledger")
        if run in timed_runs:
            verdict.step_ms += intervals_ms(inferences.get(run, {}))
    if appends != verdict.commits:
        verdict.lost_commits += abs(appends - verdict.commits)
        verdict.problem(
            f"the hosts acknowledged {appends} appends; the Runs hold {verdict.commits}"
        )
    _phantoms_and_duplicates(verdict, effects, tool_of, expected_ops)
    return verdict


def _ledger(params: W1) -> tuple[Counter[str], dict[str, str], dict[str, dict[int, float]]]:
    """The ledger's effects by operation id, each operation's tool, and each Run's
    inference starts by Step (the earliest, where a Step was asked again)."""
    assert params.ledger is not None
    effects: Counter[str] = Counter()
    tool_of: dict[str, str] = {}
    inferences: dict[str, dict[int, float]] = defaultdict(dict)
    for line in read_ledger(params.ledger):
        if line[0] == "t":
            effects[line[1]] += 1
            tool_of[line[1]] = line[2]
        elif line[0] == "m":
            steps = inferences[line[1]]
            step = int(line[2])
            steps[step] = min(steps.get(step, math.inf), float(line[3]))
    return effects, tool_of, inferences


def _phantoms_and_duplicates(
    v: Verdict, effects: Counter[str], tool_of: dict[str, str], expected: set[str]
) -> None:
    """Effects of no call the Runs made; ``never_replay`` operations seen twice."""
    phantom = set(effects) - expected
    if phantom:
        v.ledger_violations += len(phantom)
        v.problem(f"{len(phantom)} ledger effects of no committed call, e.g. {min(phantom)}")
    v.duplicate_never_replay = sum(
        1 for op, n in effects.items() if n > 1 and tool_of[op] in NEVER_REPLAY
    )


def intervals_ms(starts: dict[int, float]) -> list[float]:
    """A Step's time: from its inference's start to the next Step's inference's start."""
    times = [t for _, t in sorted(starts.items())]
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def _check_log(v: Verdict, thread: str, records: list[CommittedRecord], frontier: Frontier) -> None:
    seqs = [r.seq for r in records]
    if seqs != list(range(1, len(seqs) + 1)) or frontier.version != len(seqs):
        missing = max([*seqs, frontier.version]) - len(seqs)
        v.lost_commits += max(missing, 1)
        v.problem(f"{thread}: log seqs {seqs[:3]}… of {len(seqs)}, frontier v{frontier.version}")
        return
    rebuilt = replay(ThreadId(thread), [r.commit for r in records])
    if rebuilt.model_dump(exclude=_FRONTIER_TRUTH) != frontier.model_dump(exclude=_FRONTIER_TRUTH):
        v.lost_commits += 1
        v.problem(f"{thread}: replay(log) differs from the stored frontier")


def _check_end(v: Verdict, params: W1, thread: str, run: str, answer: Answer) -> None:
    if answer.run_id != run or answer.cause is None:
        v.problem(f"{thread}: not ended ({answer.state})")
        return
    if answer.cause != NATURAL:
        v.problem(f"{thread}: ended {answer.cause}")
        return
    v.natural_runs += 1
    if answer.text != params.final_text(run):
        v.wrong_text += 1
        v.problem(f"{thread}: final text {answer.text!r}")


def _check_call(v: Verdict, op: str, call: Any, seen: int, strict: bool) -> None:
    phase, attempts = call.phase.kind, call.attempts
    if phase == "completed" and attempts == 1 and seen == 1:
        v.exactly_once_calls += 1
        return
    if strict:
        v.ledger_violations += 1
        v.problem(f"{op}: {phase} after {attempts} attempt(s), {seen} effect(s) in the ledger")
        return
    if phase == "indeterminate":
        v.indeterminate_calls += 1
        good = seen <= attempts
    elif phase == "completed":
        v.replayed_calls += attempts > 1
        good = 1 <= seen <= attempts
    else:
        good = False
    if not good:
        v.ledger_violations += 1
        v.problem(f"{op}: {phase} after {attempts} attempt(s), {seen} effect(s) in the ledger")


def _recoveries(v: Verdict, records: list[CommittedRecord], host_kills: Sequence[float]) -> None:
    """Host kill → the first commit of the resumed Run (its status back to running)."""
    lost_at: int | None = None
    recovered = False
    for record in records:
        status = record.commit.status
        if status is None:
            continue
        if status.state == "failed" and status.reason == EXECUTION_LOST:
            lost_at = status.since
        elif status.state == "running" and lost_at is not None:
            before = [k for k in host_kills if k * 1e6 <= lost_at]
            if before:
                v.recoveries_ms.append((status.since - max(before) * 1e6) / 1000)
                v.settled_ms.append((lost_at - max(before) * 1e6) / 1000)
            recovered, lost_at = True, None
    v.recovered_runs += recovered


def quantile(values: Sequence[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return round(values[0], 2)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)


__all__ = ["Answer", "Verdict", "intervals_ms", "quantile", "verify", "verify_answers"]
