"""Thread history: fork a thread where it was at rest; export a thread as JSON lines and
import it again (a recorded production thread becomes a test fixture).

Both write a new thread the way every thread is written: each record of the source
re-made for the new thread (``assemble_commit``: its thread id, the hash chain, its
writer) and appended through the store's ``append`` with compare-and-set expectations.
The new thread verifies like any other (``ratchet verify``); the source is only read.
Everything is checked before the first append: a refusal writes nothing. A fork and
an export need the thread's whole log: one pruned (``storage.retention``) is refused.

**At rest.** A fork starts at a commit where the thread's Run had *ended*: no batch
open, no ticket, nothing of that Run left to happen. Refused there are a commit with
an open batch (``batch_open``: calls in flight or awaiting, or results staged but not
yet published — a Run awaiting with its batch fully terminal is not at rest), a Run
awaiting with no batch (``run_awaiting``: a pause, user input) and a Run running
between its commits (``run_running``). An awaiting Run is refused although it waits
for someone else: its ticket and its run id would exist twice, and both threads,
resumed, would send the same tool operation ids (``tool-batch:{run}:{step}:{call}``)
for calls with diverging histories — a downstream system deduplicating by them would
take the fork's call for the original's. A new Run on the fork has a new run id.

**The writer** (``runtime.history_write``). The new thread is written by one owner,
the fork or the import, whose name says where the thread came from (``fork_owner``:
``ratchet-fork#{thread}@{seq}``; ``import_owner``: ``ratchet-import#{head}@{records}``); its
host part has no ``:``, so no system's Supervisor takes over what it owns (a system's
owners are ``{system}:...``, ``actors.supervisor``). It claims the new thread where
its source was claimed; a Run started or resumed on the new thread claims it from
there, as on any thread.

**Interrupted.** The records are a pure function of the source (and so is the owner's
name): a fork or an import cut short (the store went out, the process died) is
completed by running it again, which finds its own prefix and appends the rest; a
repeat of one that finished writes nothing and returns the same frontier. A thread
written by anyone else, or by another fork or import, is ``thread_exists``. Until the
copy is whole, no Run starts or resumes on it (``copy_under_way``: InvalidTransition),
so none takes a Run of it at rest half way through the copy for the thread's latest.

**Export format** (``runtime.history_format``), one JSON object per line, UTF-8, no
timestamps (an export of the same log is the same bytes)::

    {"format":"ratchet-thread","version":1,"thread_id":T,"records":N,"head":H}
    {"seq":1,"hash":H1,"body":"{...the commit's stored canonical JSON, as a string...}"}
    ...

The body is the stored text exactly as hashed, carried as a JSON string so that no
encoder touches it. Import checks every line — JSON (orjson: malformed text, lone
surrogates, nesting past its limit), the header's format and version, seq continuity,
each body against its hash, the decoded record, its thread, the chain, the header's
count and head, a replay of the whole log, the values of Ratchet's reserved state
keys (``runtime.reserved``) — and refuses naming the line (1 is the header). It is held
to the limits of the system it imports into (``limits``: a header naming more records
than ``history_commits`` allows, and the end a Run commits past it, is ``too_large``;
an explicit target is a new id, held to ``id_chars``) and to its store's payload limit
(a line longer than a record it takes can make, ``history_format.line_bytes``); a fork's
new thread is held to its system's ``id_chars`` as well. Both are held to its history
limits as the runtime holds a Run's commits to them (``history_write.folded``): a
record other than a Run's end past ``history_bytes`` or ``history_commits`` (an
awaiting one keeping a commit for its resume), or a state past ``state_bytes`` where
the last such record left it, is refused naming the limit (its ``reason``). Copied
past them, an awaiting Run, answered, ended ``failed(history_limit)`` with the answer
never applied, and every start on the thread was refused.

    RatchetError
    └── HistoryRefused      a fork, export or import refused (``reason``; an export:
        │                   unknown_thread, pruned)
        ├── ForkRefused     unknown_thread, pruned, beyond_head, batch_open,
        │                   run_awaiting, run_running, thread_exists, record, replay,
        │                   reserved_state, too_large, history_bytes, history_commits,
        │                   state_bytes
        └── ImportRefused   names the ``line``: malformed, header, format, version, seq,
                            hash, record, thread, chain, truncated, replay,
                            reserved_state, too_large, history_bytes, history_commits,
                            state_bytes; thread_exists (no line)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.commit import DEFAULT_PAYLOAD_LIMIT, Frontier, ThreadCommit
from runtime.errors import RunSuperseded
from runtime.history_format import (
    ForkRefused,
    HistoryRefused,
    ImportRefused,
    export_lines,
    parse_export,
)
from runtime.history_write import check_sizes, folded, payload_limit_of, remade, write_copy
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, RunningState
from runtime.limits import DEFAULT_LIMITS, STORED_IDS, Limits, check_id
from runtime.ports import CommitStore, CommittedRecord, RunSummary, vouched_log
from runtime.rules import replay

__all__ = [
    "ForkRefused",
    "HistoryRefused",
    "ImportRefused",
    "export",
    "fork",
    "fork_owner",
    "import_owner",
    "import_thread",
    "parse_export",
]

FORK_HOST = "ratchet-fork"
"""The host part (``runtime.ports.host_of``) of every fork writer's owner name."""


def fork_owner(thread: ThreadId, at_seq: int) -> str:
    """The owner that writes the fork of ``thread`` at ``at_seq``."""
    return f"{FORK_HOST}#{thread}@{at_seq}"


def import_owner(head: str, records: int) -> str:
    """The owner that writes an import of the ``records`` of the export whose last record
    is ``head``."""
    return f"ratchet-import#{head}@{records}"


def end_of_run(
    thread: ThreadId, records: Sequence[CommittedRecord], run_id: str, current: str | None
) -> Frontier:
    """The thread's whole frontier as ``run_id``'s last commit left it: ``records`` (the
    thread's verified log) folded up to that commit. RunSuperseded if the log does not
    start at its first commit (pruned) or holds no commit of the Run (``current``: the
    thread's latest Run, for the message)."""
    ends = [i for i, r in enumerate(records) if r.commit.run_id == run_id]
    if not ends or records[0].seq != 1:
        raise RunSuperseded(thread, run_id, current)
    return replay(thread, [r.commit for r in records[: ends[-1] + 1]])


def copy_under_way(frontier: Frontier | RunSummary) -> str | None:
    """Why no Run may start, resume or be recovered on ``frontier``'s thread yet: a fork
    or an import is writing it (its owner's name ends in how many records it writes).
    One of its Runs at rest in the middle of the copy is no thread to take over: the
    copy's next record would be refused, and the thread left holding part of it. A Run
    it copied half way is the source's: driven on, it would run the source's tool calls
    again, under their operation ids. Ending it (cancel, stop) abandons the copy."""
    owner = frontier.owner or ""
    if not owner.startswith(("ratchet-fork#", "ratchet-import#")):
        return None
    count = owner.rpartition("@")[2]
    if not (count.isascii() and count.isdigit() and len(count) < 19):
        return None  # written by an earlier release, which named no count
    if frontier.version >= int(count):
        return None  # written whole
    return (
        f"thread {frontier.thread_id} is being written by {owner.partition('#')[0]} "
        f"({frontier.version} of {count} records): run it again to complete it"
    )


async def forks_under_way(store: CommitStore, source: ThreadId) -> list[str]:
    """Why ``source`` must keep its records: the forks of it cut short in the middle of a
    Run (run again, one reads them; pruned, they are gone, and the copy can never be
    completed). The owner index finds them (``host_of`` the fork writer's owner:
    ``ratchet-fork``), on every backend without reading other threads, whatever the
    state of the Run copied last: a copy cut between Runs, or where a Run awaited, must
    be completed from the source's records too."""
    mine = f"{FORK_HOST}#{source}"  # the owner less its "@seq" (an id may hold an "@")
    listed = await store.list_runs(None, host=FORK_HOST)
    return [
        f"{why} (a fork of {source})"
        for row in listed
        if (row.owner or "").rpartition("@")[0] == mine and (why := copy_under_way(row)) is not None
    ]


# ---- fork ---------------------------------------------------------------------------------


async def fork(
    store: CommitStore,
    thread: ThreadId,
    at_seq: int,
    new_thread: ThreadId,
    limits: Limits = DEFAULT_LIMITS,
) -> Frontier:
    """Start ``new_thread`` as ``thread``'s log up to commit ``at_seq``, where its Run had
    ended; returns the new thread's frontier. ForkRefused names why it cannot be.
    ``limits``: those of the system the fork is for (``new_thread`` is a new id, held to
    its ``id_chars``; ``thread`` names what is stored, ``STORED_IDS``)."""
    check_id("thread id", new_thread, limits)
    if not isinstance(at_seq, int) or isinstance(at_seq, bool):  # "4", 4.0, True: no seq
        raise ForkRefused("beyond_head", f"a seq is a whole number, not {at_seq!r:.80}")
    records = await _whole_log(store, thread, ForkRefused)
    if not 1 <= at_seq <= len(records):
        raise ForkRefused(
            "beyond_head", f"thread {thread!r} has commits 1 to {len(records)}, not {at_seq}"
        )

    def refuse(seq: int, reason: str, detail: str) -> HistoryRefused:
        return ForkRefused(reason, f"thread {thread!r} seq {seq}: {detail}" if seq else detail)

    owner = fork_owner(thread, at_seq)
    planned = remade([r.commit for r in records[:at_seq]], new_thread, owner, refuse)
    _check_at_rest(folded(planned, new_thread, owner, refuse, limits), thread, at_seq)
    check_sizes(store, planned, refuse)
    return await write_copy(store, new_thread, planned, owner, refuse)


def _check_at_rest(at: Frontier, thread: ThreadId, seq: int) -> None:
    unrested = _unrested(at)
    if unrested is not None:
        reason, what = unrested
        raise ForkRefused(reason, f"thread {thread!r} at seq {seq}: {what}; fork where a Run ended")


def _unrested(at: Frontier) -> tuple[str, str] | None:
    """Why a copy of the thread at ``at`` would go on with calls its source may make
    too, under the same operation ids (its Run is not over): (reason, what), or None."""
    where = f"run {at.run_id}"
    if at.batch is not None:
        return "batch_open", f"{where} has its tool batch {at.batch.batch_id} open"
    state = at.run_state
    if isinstance(state, AwaitingState):
        return "run_awaiting", f"{where} awaits {state.ticket.payload_kind}"
    if isinstance(state, RunningState):
        return "run_running", f"{where} is running"
    return None


# ---- export and import --------------------------------------------------------------------


async def export(store: CommitStore, thread: ThreadId) -> Iterator[str]:
    """The thread as JSON lines (no newlines): the header, then one line per record.
    The log is read (and verified) once, here; the lines are made as they are taken."""
    return export_lines(thread, await _whole_log(store, thread, HistoryRefused))


async def _whole_log(
    store: CommitStore, thread: ThreadId, error: type[HistoryRefused]
) -> list[CommittedRecord]:
    """The thread's log from its first record, its frontier verified too; refused while
    a fork or an import is still writing it (its records are not a thread yet)."""
    check_id("thread id", thread, STORED_IDS)  # a stored thread's, whatever id_chars was
    head, records = await vouched_log(store, thread)
    if (copying := copy_under_way(head)) is not None:
        raise error("copy_under_way", copying)
    if not records:
        if head.version:  # every record was pruned; the frontier stays
            raise error(
                "pruned", f"thread {thread!r} keeps no records (pruned through seq {head.version})"
            )
        raise error("unknown_thread", f"thread {thread!r} has no commits")
    if records[0].seq != 1:  # pruned (``storage.retention``): the history is not whole
        raise error("pruned", f"thread {thread!r} keeps its records from seq {records[0].seq} only")
    return records


async def import_thread(
    store: CommitStore,
    lines: Iterable[str | bytes],
    thread: ThreadId | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Frontier:
    """Write the exported thread ``lines`` as ``thread`` (default: the exported id);
    returns its frontier. ImportRefused names the first line that does not hold.
    ``limits``: those of the system that holds ``store`` (``plan_import``)."""
    plan = plan_import(lines, thread, limits, payload_limit_of(store))
    return await write_import(store, plan)


@dataclass(frozen=True)
class PlannedImport:
    """An export read and checked as far as no store is needed: its commits re-made for
    the target thread (``plan_import``), to write with ``write_import``."""

    thread: ThreadId
    owner: str
    commits: list[ThreadCommit]
    source: ThreadId
    """The exported thread's id."""
    unrested: tuple[str, str] | None
    """Why its last Run is not over (``_unrested``), or None."""


def plan_import(
    lines: Iterable[str | bytes],
    thread: ThreadId | None = None,
    limits: Limits = DEFAULT_LIMITS,
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
) -> PlannedImport:
    """Every line read and checked, before any store is opened (``ratchet import`` into
    a store not made yet makes none for an input it refuses), against the limits of the
    system it goes into: ``limits`` (its ``history_commits``; ``thread``, a new id, held
    to its ``id_chars``) and its store's ``payload_limit`` (``parse_export``)."""
    exported = parse_export(lines, limits, payload_limit)
    if thread is None:  # the exported id: a stored thread's, whatever its id_chars
        target = exported.thread_id
    else:
        target = ThreadId(check_id("thread id", thread, limits))
    commits = [r.commit for r in exported.records]
    owner = import_owner(commits[-1].payload_hash, len(commits))
    planned = remade(commits, target, owner, _import_refused)
    at = folded(planned, target, owner, _import_refused, limits)
    return PlannedImport(target, owner, planned, exported.thread_id, _unrested(at))


async def write_import(store: CommitStore, plan: PlannedImport) -> Frontier:
    """``plan`` written into ``store``, held to the store's own limits first. A thread
    whose Run is not over is refused beside any thread of the store where that Run is
    not over either — its source, or an earlier import of the same export under another
    id (as a fork of it is): the copy and that thread would each go on with the Run's
    calls, under the same operation ids (an approval given to both ran a tool twice as
    one operation)."""
    check_sizes(store, plan.commits, _import_refused)
    if plan.unrested is not None:
        twin = await _run_going_on(store, plan)
        if twin is not None:
            reason, what = plan.unrested
            kind = "its source thread" if twin == plan.source else "thread"
            raise ImportRefused(
                None,
                reason,
                f"{what}, as it does in {kind} {twin!r} in this store; import it once that "
                "Run has ended there (or into another store)",
            )
    return await write_copy(store, plan.thread, plan.commits, plan.owner, _import_refused)


async def _run_going_on(store: CommitStore, plan: PlannedImport) -> ThreadId | None:
    """A thread of ``store`` other than the target whose latest Run is the one ``plan``
    leaves not over, itself not over there (listed by state: the stores index it; an
    import of a Run not over is a test fixture's, rare enough to list for)."""
    run = plan.commits[-1].run_id
    source = await store.load_head(plan.source)
    if plan.thread != plan.source and source.run_id == run and not source.ended:
        return plan.source
    going: tuple[Literal["running", "awaiting"], ...] = ("running", "awaiting")
    for state in going:
        for row in await store.list_runs(state):
            if row.run_id == run and row.thread_id != plan.thread:
                return row.thread_id
    return None


def _import_refused(seq: int, reason: str, detail: str) -> HistoryRefused:
    if not seq:
        return ImportRefused(None, reason, detail)
    return ImportRefused(seq + 1, reason, f"record {seq}: {detail}")
