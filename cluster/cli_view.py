"""How the ``ratchet`` commands print: transcripts, Run trees, watched frames, times."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape as rich_escape
from rich.segment import Segments
from rich.table import Table
from rich.text import Text

from cluster.report import (
    RunReport,
    cause_text,
    fact_text,
    phase_text,
    status_text,
    ticket_text,
)
from runtime.commit import Frontier
from runtime.delegation import CHILDREN_KEY
from runtime.errors import CorruptRecord, InputRefused
from runtime.events import Fact
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, EndedState
from runtime.limits import DEFAULT_LIMITS, Limits, history_headroom, visible
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage
from runtime.ports import CommittedRecord
from runtime.reserved import reserved_value
from runtime.stream import Frame
from runtime.timeutil import utc_time
from runtime.usage import USAGE_KEY, step_usage


class Terminal(Console):
    """The CLI's console for people (``--json`` writes past it): every string it prints
    is made ``visible`` first, whoever built it, so stored or streamed text — a model's
    answer, a tool's error, a stop reason, an id — shows its control characters instead
    of moving the cursor, erasing lines or retitling the window (a model's text could
    hide the call it asks approval for). Rich's own styling is written after this, and
    its emoji codes are off: ``:smile:`` in a stored id or answer prints as written."""

    def __init__(self, **options: Any) -> None:
        columns = os.environ.get("COLUMNS", "").strip()
        if columns.isascii() and columns.isdigit() and int(columns) == 0:
            # Rich takes COLUMNS=0 for a width of 0 and prints nothing at all, errors
            # included: such a width is no width, so the usual one is used
            options.setdefault("width", DEFAULT_WIDTH)
        super().__init__(**{"emoji": False, **options})

    def render_str(self, text: str, **options: Any) -> Text:
        return super().render_str(visible(text), **options)


DEFAULT_WIDTH = 80
"""The width of a terminal that says its width is 0."""
console = Terminal()

RESUME_FLAGS = {
    "permission": "--approve or --deny",
    "external_result": "--result JSON",
    "scheduled_action": "--fire",
    "user_input": "--input TEXT",
    "pause": "--unpause",
}
"""The flag that answers each ticket kind (a delegation wait is answered by its child)."""


RUN_COLUMNS: tuple[tuple[str, int], ...] = (
    ("thread", 0),
    ("run", 0),
    ("state", 8),
    ("status", 8),
    ("steps", 5),
    ("since", 10),
    ("agent", 12),
)
"""The columns of ``ratchet runs``, each but the ids with the width it may fold down to;
those after the first four go, last first, when the terminal is too narrow for them."""
KEPT_COLUMNS = 4


def runs_table(rows: Sequence[Any], width: int, title: str) -> tuple[Table, int]:
    """The ``ratchet runs`` table and the width to print it at.

    Ids are never folded or cut (a cut id cannot be pasted into ``ratchet show``): the
    other columns fold, then give way, and should the ids alone be wider than the
    terminal the table is printed wider than it (the terminal wraps its lines).
    """
    ids = (
        _widest("thread", [row.summary.thread_id for row in rows]),
        _widest("run", [row.summary.run_id for row in rows]),
    )
    columns = list(RUN_COLUMNS)
    while len(columns) > KEPT_COLUMNS and _needed(columns, ids) > width:
        columns.pop()
    table = Table(title=title)
    for name, _ in columns:
        if name in ("thread", "run"):
            table.add_column(name, no_wrap=True)
        else:
            table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(visible(cell)) for cell in _cells(row)[: len(columns)]))
    return table, max(width, _needed(columns, ids))


def _widest(header: str, cells: Sequence[str]) -> int:
    return max(cell_len(text) for text in (header, *cells))


def _needed(columns: Sequence[tuple[str, int]], ids: Sequence[int]) -> int:
    """The narrowest the table can be with its ids whole: rich's box takes one cell
    between columns and at each edge, and each column has a cell of padding each side."""
    return sum(ids) + sum(fold for _, fold in columns) + 3 * len(columns) + 1


def _cells(row: Any) -> tuple[str, ...]:
    s = row.summary
    return (
        s.thread_id,
        s.run_id,
        # the reason in full is long for a column: show and --json print it
        s.state
        + (f" {s.cause}" if s.cause else "")
        + (" (bad state: see show)" if row.problem else ""),
        status_text(s.status),
        str(row.steps),
        when(s.status.since),
        row.agent or "-",
    )


def print_runs(rows: Sequence[Any], next_cursor: str | None) -> None:
    """``ratchet runs``: the table, then the cursor to the next page if there is one."""
    title = f"{len(rows)} runs" + (" (more: see below)" if next_cursor else "")
    table, width = runs_table(rows, console.width, title)
    print_wide(table, width)
    if next_cursor:
        line = f"next page: --after {next_cursor}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_wide(renderable: Any, width: int) -> None:
    """Print at ``width`` even beyond the terminal's (``console.print`` would crop it)."""
    if width <= console.width:
        console.print(renderable)
        return
    lines = console.render(renderable, console.options.update(width=width))
    console.print(Segments(lines), crop=False)


def print_thread(
    frontier: Frontier,
    records: Sequence[CommittedRecord],
    report: RunReport,
    tree: list[str],
    limits: tuple[Limits, str] = (DEFAULT_LIMITS, "default limits"),
) -> None:
    """``ratchet show``: transcript, each commit with its calls' phases, status, usage;
    the history room against ``limits`` (the system's, and what they are)."""
    console.rule(f"thread {escape(frontier.thread_id)}")
    for message in frontier.messages:
        console.print(message_line(message), highlight=False)
    console.rule("commits")
    for record in records:
        c = record.commit
        console.print(
            f"[dim]{record.seq:>3}[/dim] {c.label:<10} {c.disposition.kind}", highlight=False
        )
        for call in c.batch.calls if c.batch else ():
            line = f"      {call.call_id} {call.tool}: {phase_text(call)}"
            console.print(line, markup=False, highlight=False)
        used = step_usage(c.commands)
        if used is not None:
            usage = f"      usage: {usage_text(used[0])} ({used[1] or '?'})"
            console.print(usage, markup=False, highlight=False)  # the model names itself
    console.rule("status")
    s = frontier.status
    state = frontier.run_state
    where: str = state.cause.kind if isinstance(state, EndedState) else state.kind if state else "-"
    if isinstance(state, AwaitingState):
        where += f" ({state.ticket.payload_kind}, correlation {state.ticket.correlation})"
    console.print(f"run {frontier.run_id}: {where}", markup=False)
    console.print(f"status: {s.state} reason={s.reason} since={when(s.since)}", markup=False)
    history = " → ".join(f"{a}({b})" if b else a for a, b in report.statuses)
    console.print(f"status history: {history}", markup=False, highlight=False)
    for scope in ("run", "thread"):
        total, problem = reserved_value(frontier.state, f"{scope}:{USAGE_KEY}")
        if total or problem:
            shown = problem or usage_text(total)
            console.print(f"usage ({scope}): {shown}", markup=False, highlight=False)
    room = history_headroom(frontier.messages, frontier.version, limits[0])
    console.print(
        f"history: {room['bytes']:,} of {room['bytes_limit']:,} bytes, "
        f"{room['commits']:,} of {room['commits_limit']:,} commits ({limits[1]})",
        markup=False,
        highlight=False,
        soft_wrap=True,  # a line to grep, whatever the width
    )
    if len(tree) > 1:
        console.rule("run tree (delegation)")
        for line in tree:
            console.print(line, markup=False, highlight=False)


MAX_TREE_DEPTH = 32
"""Deeper than any delegation goes (``DelegationLimits.max_depth``: 8 unless a system
sets more): a deeper tree is not one Ratchet made, and is cut there."""


async def run_tree(
    db: Any, frontier: Any, depth: int = 0, seen: set[str] | None = None
) -> list[str]:
    """The Run and its child Runs, one indented line each (children in call order). A
    thread's children are read as Ratchet writes them (``runtime.reserved``); children
    that name a thread already shown (a loop), one past ``MAX_TREE_DEPTH`` or one that
    cannot be read is one line saying so: only an import made before imports were
    checked could hold them, and they made ``show`` recurse without end or fail."""
    seen = set() if seen is None else seen
    seen.add(frontier.thread_id)
    state = frontier.run_state
    where = state.cause.kind if isinstance(state, EndedState) else state.kind if state else "-"
    indent = f"{'  ' * depth}{'└ ' if depth else ''}"
    lines = [f"{indent}{frontier.thread_id}  [{where}]"]
    children, problem = reserved_value(frontier.state, f"run:{CHILDREN_KEY}")
    if problem is not None:
        lines.append(f"{'  ' * (depth + 1)}({problem})")
    for child in (children or {}).values():
        lines += await _child_tree(db, ThreadId(child), depth + 1, seen)
    return lines


async def _child_tree(db: Any, child: ThreadId, depth: int, seen: set[str]) -> list[str]:
    line = f"{'  ' * depth}└ {child}"
    if child in seen:
        return [f"{line}  (shown above: the children loop)"]
    if depth > MAX_TREE_DEPTH:
        return [f"{line}  (deeper than {MAX_TREE_DEPTH} levels: not followed)"]
    try:
        frontier = await db.load(child)
    except (CorruptRecord, InputRefused) as exc:  # that child's, not the whole tree's
        return [f"{line}  (cannot be read: {exc})"]
    return await run_tree(db, frontier, depth, seen)


class WatchView:
    """Prints frames: one line per status frame and fact; streamed text inline."""

    def __init__(self, text: Any) -> None:
        self.text = text
        self.shown: dict[tuple[str, int], str] = {}
        self.open: tuple[str, int] | None = None

    def show(self, frame: Frame) -> None:
        key = self.text.add(frame)
        if frame.type == "delta":
            if key is not None:
                self._stream(key, self.text.text(*key))
            return
        self.close_line()
        where = f"[dim]{frame.offset:>6}[/dim] " if frame.offset else " " * 7
        if frame.type == "thread_status" and frame.status is not None:
            line = f"[bold]● status {escape(status_text(frame.status))}[/bold]"
        elif isinstance(frame.event, Fact):
            line = escape(fact_text(frame.event))
        elif frame.type == "pruned":  # the facts up to it are gone: said, not skipped
            line = f"[yellow]✂ the facts through seq {frame.pruned_through} were pruned[/yellow]"
        else:
            return
        console.print(where + line, highlight=False, soft_wrap=True)

    def _stream(self, key: tuple[str, int], text: str) -> None:
        before = self.shown.get(key, "")
        if self.open != key:
            self.close_line()
            self.open = key
            print_raw(f"{'':7}… {text}")
        elif text.startswith(before):
            print_raw(text[len(before) :])
        else:  # a retried inference: its text starts over
            print_raw(f"\n{'':7}↻ {text}")
        self.shown[key] = text

    def close_line(self) -> None:
        if self.open is not None:
            print_raw("\n")
            self.open = None


def print_raw(text: str) -> None:
    console.print(text, end="", markup=False, highlight=False, soft_wrap=True)


def escape(text: str) -> str:
    """Stored text for a line of rich markup: shown as itself, markup and all, on any
    console (``visible`` again on a ``Terminal`` changes nothing)."""
    return rich_escape(visible(text))


def print_rest(thread: str, frontier: Frontier, prefix: str = "") -> None:
    state = frontier.run_state
    run = frontier.run_id
    if isinstance(state, AwaitingState):
        flag = RESUME_FLAGS.get(state.ticket.payload_kind)
        hint = f"; answer with: ratchet resume {thread} {flag}" if flag else ""
        deadline = state.ticket.deadline_us
        if flag and deadline is not None:  # a tool's wait with a deadline: then it expires
            hint += f" by {when(deadline)} UTC, or after it: --expire"
        line = f"run {run} on thread {thread} awaits {ticket_text(state.ticket)}{hint}"
    elif isinstance(state, EndedState):
        line = f"run {run} on thread {thread} ended {cause_text(state.cause.model_dump())}"
    else:
        line = f"run {run} on thread {thread} is running"
    console.print(prefix + escape(line), highlight=False, soft_wrap=True)


def message_line(message: Any) -> str:
    """A transcript line in rich markup; everything stored (the model's, a tool's or a
    user's text, ids) is escaped, so text like ``[/x]`` prints as itself."""
    if isinstance(message, UserMessage):
        return f"[bold cyan]user[/]: {escape(message.text)}"
    if isinstance(message, AssistantMessage):
        calls = ", ".join(f"{c.tool}({c.arguments})" for c in message.tool_calls)
        return f"[bold green]assistant[/]: {escape(message.text)}" + (
            f"  [dim]→ {escape(calls)}[/]" if calls else ""
        )
    if isinstance(message, ToolResultMessage):
        tag = "[red]tool error[/]" if message.is_error else "[yellow]tool[/]"
        return f"{tag} {escape(f'{message.tool} ({message.call_id}): {message.content}')}"
    return escape(str(message))


def when(since_us: int) -> str:
    if not since_us:
        return "-"
    moment = utc_time(since_us)
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else f"{since_us} µs since the epoch"


def usage_text(counted: Any) -> str:
    """Token counts as ``ratchet show`` prints them."""
    return (
        f"{counted.get('input_tokens', 0)} in ({counted.get('cached_tokens', 0)} cached), "
        f"{counted.get('output_tokens', 0)} out, {counted.get('inferences', 0)} inference(s)"
    )
