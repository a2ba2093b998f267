"""Helpers for the tests of code built on Ratchet.

``assert_replays`` is the replay check for upgrades (``runtime.replay_check``) as a test
assertion: record a thread once (a test run, or a production thread exported with
``ratchet export``), keep it as a fixture, and every change to the agent's code is
checked against its decisions::

    from runtime.testing import assert_replays

    async def test_the_billing_agent_still_decides_as_recorded():
        await assert_replays("tests/fixtures/billing-t1.jsonl", "t1", billing.agent)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from runtime.agent import Agent
from runtime.commit import ThreadCommit
from runtime.ports import CommitStore, CommittedRecord
from runtime.replay_check import ReplayReport, Source, replay

Recorded = Source | str | os.PathLike[str] | Iterable[str] | Iterable[bytes]
"""A store holding the thread, its records or commits in order, the path of an export
(``ratchet export``, ``runtime.history.export``) or the export's lines."""


async def assert_replays(
    recorded: Recorded, thread: str, agent: Agent, **options: Any
) -> ReplayReport:
    """Replay ``thread`` against ``agent`` (``runtime.replay_check.replay``, which takes
    ``options``); an AssertionError names the first divergence. Returns the report."""
    report = await replay(_source(recorded), thread, agent, **options)
    if report.divergence is not None:
        notes = "".join(f"\n  note: run {n.run_id} step {n.step}: {n.text}" for n in report.notes)
        raise AssertionError(report.line() + notes)
    return report


def _source(recorded: Recorded) -> Source:
    if isinstance(recorded, str | os.PathLike):
        with Path(recorded).open("rb") as file:
            return _exported(file)
    if hasattr(recorded, "read") and hasattr(recorded, "append"):
        store: CommitStore = recorded  # type: ignore[assignment]
        return store
    items: list[Any] = list(recorded)
    if items and isinstance(items[0], str | bytes):
        return _exported(items)
    records: Sequence[CommittedRecord] | Sequence[ThreadCommit] = items
    return records


def _exported(lines: Iterable[str] | Iterable[bytes]) -> list[CommittedRecord]:
    """An export's records as they were stored (the bodies are the stored commits, their
    writers' epochs and claims kept: an import would make them one writer's)."""
    from runtime.history_format import parse_export

    return list(parse_export(lines).records)


__all__ = ["Recorded", "assert_replays"]
