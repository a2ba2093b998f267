"""Invariants of a committed log, checked after every crash test."""

from __future__ import annotations

from cluster.demo_agent import EffectLedger
from cluster.report import EXECUTION_LOST, RunReport, analyse
from runtime.ids import ThreadId
from runtime.ports import CommitStore
from runtime.rules import replay

ORDER = {"requested": 0, "executing": 1, "awaiting": 1, "completed": 2, "indeterminate": 2}


async def check_log(store: CommitStore, thread: str) -> RunReport:
    """The log folds to the stored frontier; no call phase ever moved backwards."""
    records = await store.read(ThreadId(thread))
    stored = await store.load(ThreadId(thread))
    rebuilt = replay(stored.thread_id, [r.commit for r in records])
    assert rebuilt.model_copy(update={"epoch": stored.epoch, "owner": stored.owner}) == stored
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    seen: dict[str, tuple[int, int, object]] = {}
    for record in records:
        for call in record.commit.batch.calls if record.commit.batch else ():
            rank = ORDER[call.phase.kind]
            before = seen.get(call.operation_id)
            if before is not None:
                assert rank >= before[0], f"{call.operation_id} went back to {call.phase.kind}"
                assert call.attempts >= before[1], f"{call.operation_id} lost attempts"
                if before[0] == 2:
                    assert call.phase == before[2], f"terminal {call.operation_id} changed"
            seen[call.operation_id] = (rank, call.attempts, call.phase)
    return analyse(thread, records)


def went_through_loss(report: RunReport) -> bool:
    """running → failed(execution_lost) → running → … → idle, in the committed status facts."""
    states = report.statuses
    for i, (state, reason) in enumerate(states):
        if state == "failed" and reason == EXECUTION_LOST:
            return (
                0 < i < len(states) - 1
                and states[i - 1][0] == "running"
                and states[i + 1][0] == "running"
                and states[-1][0] == "idle"
            )
    return False


def never_twice(ledger: EffectLedger, run_ids: list[str], tools: tuple[str, ...]) -> None:
    prefixes = tuple(f"tool-batch:{r}:" for r in run_ids)
    twice = [op for op in ledger.duplicates(tools) if op.startswith(prefixes)]
    assert not twice, f"never_replay effects ran twice: {twice}"
