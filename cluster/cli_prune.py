"""``ratchet prune``: retention, the commit logs of ended Runs removed in bounded rounds.

    ratchet prune --ended-before DATE [--keep-last N] [--batch N] [--dry-run] [--store URL]

The store's threads are walked in id order, ``--batch`` threads a round; each thread's
log is read (verified) and pruned through the end of its latest Run that, with every
Run before it, ended before DATE and is not among its last ``--keep-last`` Runs
(``storage.retention``: the rule, and why it is safe beside running Runs). A line of
progress follows each round and a summary the last; ``--dry-run`` reads and counts
what would go, and removes nothing. A thread whose log does not verify is named on
stderr and left as it is (``ratchet verify`` says more); the others are pruned, and
the exit code is then 1. Bad input is one line on stderr, exit code 1, before the
store is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import typer

from cluster.cli_args import BadInput
from cluster.cli_base import as_command, errors, open_db
from cluster.cli_view import console
from runtime.errors import CorruptRecord, InvalidTransition, StoreError, StoreUnavailable
from runtime.ids import ThreadId
from storage.retention import prune_point, read_for_dry_run, run_logs

DEFAULT_BATCH = 100
"""Threads a round: each is read whole and pruned in a transaction of its own."""


def register(app: typer.Typer) -> None:
    """Add ``prune`` to the ``ratchet`` application."""
    app.command("prune")(prune)


def prune(
    ended_before: str = typer.Option(
        ..., "--ended-before", help="Prune Runs that ended before this ISO 8601 date (UTC)"
    ),
    keep_last: int = typer.Option(
        0, "--keep-last", help="Keep the logs of each thread's last N Runs"
    ),
    batch: int = typer.Option(DEFAULT_BATCH, "--batch", help="Threads per round"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would go; remove nothing"),
    store: str | None = typer.Option(
        None, "--store", help="Store URL (default: RATCHET_STORE_URL or ./ratchet-data)"
    ),
) -> None:
    """Remove the commit logs of ended Runs; their threads' frontiers (messages, state,
    status) stay readable, and what is kept still verifies."""
    as_command(_prune)(ended_before, keep_last, batch, dry_run, store)


@dataclass
class Tally:
    rounds: int = 0
    scanned: int = 0
    pruned: int = 0
    """Threads that lost records (or would, in a dry run)."""
    records: int = 0
    skipped: int = 0

    def progress(self, dry_run: bool) -> str:
        went = "would go" if dry_run else "removed"
        return (
            f"round {self.rounds}: {self.scanned} threads scanned, {self.pruned} pruned, "
            f"{self.records} records {went}"
        )

    def summary(self, dry_run: bool) -> str:
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        if dry_run:
            return (
                f"dry run: {self.pruned} of {self.scanned} threads would be pruned, "
                f"{self.records} records would be removed{skipped}"
            )
        return (
            f"pruned {self.pruned} of {self.scanned} threads, {self.records} records "
            f"removed{skipped}"
        )


def cutoff_of(text: str) -> int:
    """An ISO 8601 date or time (UTC unless it names an offset), in µs since the epoch."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"--ended-before must be a date (ISO 8601), not {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    # exact: a float timestamp times 10**6 fell a microsecond short for about one date
    # in a hundred, and a Run that ended just before the date was kept
    return (moment - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


MAX_BATCH = 10_000
"""Threads a round at most: a page of thread ids is held in memory."""


async def _prune(
    ended_before: str, keep_last: int, batch: int, dry_run: bool, store: str | None
) -> None:
    cutoff = cutoff_of(ended_before)
    if keep_last < 0:
        raise BadInput(f"--keep-last must be 0 or more, not {keep_last}")
    if not 1 <= batch <= MAX_BATCH:  # a page no store can ask for failed in the store
        raise BadInput(f"--batch must be 1 to {MAX_BATCH}, not {batch}")
    db = await open_db(store)
    tally = Tally()
    try:
        after = ""
        while page := await db.thread_ids(after, batch):
            for thread in page:
                await _prune_thread(db, thread, cutoff, keep_last, dry_run, tally)
            after = page[-1]
            tally.rounds += 1
            console.print(tally.progress(dry_run), highlight=False)
    finally:
        await db.close()
    console.print(tally.summary(dry_run), highlight=False)
    if tally.skipped:
        raise typer.Exit(1)


async def _prune_thread(
    db: Any, thread: ThreadId, cutoff: int, keep_last: int, dry_run: bool, tally: Tally
) -> None:
    tally.scanned += 1
    try:
        records = await db.read(thread)
        point = prune_point(run_logs(records), cutoff, keep_last)
        if not point:
            return
        if dry_run:  # what the prune would refuse before it cut (``storage.retention``)
            await read_for_dry_run(db, thread)
        removed = point - (records[0].seq - 1) if dry_run else await db.prune(thread, point)
    except StoreUnavailable:
        raise  # the store, not this thread: the whole command stops (and says so)
    except (CorruptRecord, InvalidTransition, StoreError) as exc:
        # this thread's problem (its records, a history a prune cannot extend, an id
        # the driver cannot send): named, and the other threads are pruned
        line = f"skipped: thread {thread!r}: {exc}"
        errors.print(line, markup=False, highlight=False, soft_wrap=True)
        tally.skipped += 1
        return
    if removed:
        tally.pruned += 1
        tally.records += removed
