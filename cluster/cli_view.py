"""How the ``ratchet`` commands print: transcripts, Run trees, watched frames, times."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.markup import escape as rich_escape

from cluster.report import cause_text, fact_text, status_text, ticket_text
from runtime.commit import Frontier
from runtime.events import Fact
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, EndedState
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage
from runtime.stream import Frame

console = Console()

RESUME_FLAGS = {
    "permission": "--approve or --deny",
    "external_result": "--result JSON",
    "scheduled_action": "--fire",
    "user_input": "--input TEXT",
    "pause": "--unpause",
}
"""The flag that answers each ticket kind (a delegation wait is answered by its child)."""


async def run_tree(db: Any, frontier: Any, depth: int = 0) -> list[str]:
    """The Run and its child Runs, one indented line each (children in call order)."""
    state = frontier.run_state
    where = state.cause.kind if isinstance(state, EndedState) else state.kind if state else "-"
    lines = [f"{'  ' * depth}{'└ ' if depth else ''}{frontier.thread_id}  [{where}]"]
    for child in frontier.state["run"].get("children", {}).values():
        lines += await run_tree(db, await db.load(ThreadId(child)), depth + 1)
    return lines


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
            line = f"[bold]● status {status_text(frame.status)}[/bold]"
        elif isinstance(frame.event, Fact):
            line = escape(fact_text(frame.event))
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
    return rich_escape(text)


def print_rest(thread: str, frontier: Frontier, prefix: str = "") -> None:
    state = frontier.run_state
    run = frontier.run_id
    if isinstance(state, AwaitingState):
        flag = RESUME_FLAGS.get(state.ticket.payload_kind)
        hint = f"; answer with: ratchet resume {thread} {flag}" if flag else ""
        line = f"run {run} on thread {thread} awaits {ticket_text(state.ticket)}{hint}"
    elif isinstance(state, EndedState):
        line = f"run {run} on thread {thread} ended {cause_text(state.cause.model_dump())}"
    else:
        line = f"run {run} on thread {thread} is running"
    console.print(prefix + escape(line), highlight=False, soft_wrap=True)


def message_line(message: Any) -> str:
    if isinstance(message, UserMessage):
        return f"[bold cyan]user[/]: {message.text}"
    if isinstance(message, AssistantMessage):
        calls = ", ".join(f"{c.tool}({c.arguments})" for c in message.tool_calls)
        return f"[bold green]assistant[/]: {message.text}" + (
            f"  [dim]→ {calls}[/]" if calls else ""
        )
    if isinstance(message, ToolResultMessage):
        tag = "[red]tool error[/]" if message.is_error else "[yellow]tool[/]"
        return f"{tag} {message.tool} ({message.call_id}): {message.content}"
    return str(message)


def when(since_us: int) -> str:
    if not since_us:
        return "-"
    return dt.datetime.fromtimestamp(since_us / 1e6, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def usage_text(counted: Any) -> str:
    """Token counts as ``ratchet show`` prints them."""
    return (
        f"{counted.get('input_tokens', 0)} in ({counted.get('cached_tokens', 0)} cached), "
        f"{counted.get('output_tokens', 0)} out, {counted.get('inferences', 0)} inference(s)"
    )
