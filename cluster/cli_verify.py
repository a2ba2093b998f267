"""``ratchet verify``: audit one thread, or every thread of the store a page at a time.

What was found before the store stopped answering is still printed, and the audit is
not passed (exit 1).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import typer

from cluster.cli_args import BadInput
from cluster.cli_base import errors, open_db
from cluster.cli_view import console, escape
from runtime.errors import RatchetError
from runtime.ids import ThreadId
from runtime.integrity import audit_thread


async def verify_store(thread: str | None, every: bool, store: str | None) -> None:
    if (thread is None) == (not every):
        raise BadInput("give a THREAD or --all (not both)")
    db = await open_db(store)
    problems = []
    audited = pruned = 0
    stopped: RatchetError | None = None
    try:
        async for name in _threads(db, thread):
            audited += 1
            found = await audit_thread(db, name)
            problems += found.problems
            if found.pruned_through:
                pruned += 1
                if thread is not None:
                    line = f"{name}: pruned through seq {found.pruned_through}"
                    console.print(line, markup=False)
    except RatchetError as exc:  # the store out, a listing that cannot go on: what was
        stopped = exc  # found so far is still said, and the audit is not passed
    finally:
        await db.close()
    for problem in problems:
        errors.print(f"[red]corrupt:[/red] {escape(str(problem))}", highlight=False, soft_wrap=True)
    if stopped is not None:
        errors.print(f"verify stopped after {audited} threads: {stopped}", markup=False)
        raise typer.Exit(1)
    bad = len({p.thread for p in problems})
    note = f" ({pruned} pruned: checked from their anchor)" if pruned else ""
    console.print(f"{audited} threads audited, {bad} with problems{note}", highlight=False)
    if problems:
        raise typer.Exit(1)


async def _threads(db: Any, thread: str | None) -> AsyncIterator[ThreadId]:
    if thread is not None:
        yield ThreadId(thread)
        return
    after = ""
    while page := await db.thread_ids(after, 500):
        for name in page:
            yield name
        after = page[-1]
