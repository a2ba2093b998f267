"""Injected messages (``ExecutionState.inject_message``): staged in the run state until
the next inference commit moves them into the history.

A message cannot be appended to the committed history in the middle of a Step: the
model's tool calls must be followed by their results (every provider refuses anything
between them). So an injection is a run-state entry, committed with whatever commit
comes next (a hook's with the Step's next commit, a tool's with its result); the live
history (``ExecutionState.message_history``) shows the entries at once, and the next
inference commit writes them as user messages after the Step's results and removes the
entries, in that one commit. The entries sort by their id, which begins with the
version of the thread they were injected at: chronological between commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from runtime.base import trusted
from runtime.batch import ActiveToolBatch, Completed, result_messages
from runtime.commit import Frontier
from runtime.messages import Message, ToolResultMessage, UserMessage
from runtime.state import Command, StateView

INJECTED_KEY = "injected"
"""Run-state key: injected messages not yet in the history, ``[{"id", "text"}, ...]``."""


def inject_commands(version: int, source: str, texts: Sequence[str]) -> tuple[Command, ...]:
    """The command staging ``texts`` (a commutative list: concurrent tools may inject)."""
    if not texts:
        return ()
    entries = [{"id": f"{version:012d}:{source}:{i:04d}", "text": t} for i, t in enumerate(texts)]
    return (Command(key=INJECTED_KEY, scope="run", merge="commutative", value=entries),)


def _listed(value: Any) -> list[dict[str, str]]:
    """The entries of a stored or staged value (made by ``inject_commands`` only)."""
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list | tuple) else []


def _entries(state: StateView, staged: Iterable[Command]) -> list[dict[str, str]]:
    by_id = {e["id"]: e for e in _listed(state["run"].get(INJECTED_KEY))}
    for cmd in staged:
        if cmd.key == INJECTED_KEY and cmd.scope == "run":
            by_id.update((e["id"], e) for e in _listed(cmd.value))
    return [by_id[k] for k in sorted(by_id)]


def injected_messages(
    run_id: str, state: StateView, staged: Iterable[Command]
) -> tuple[UserMessage, ...]:
    return tuple(
        trusted(UserMessage, id=f"{injected_prefix(run_id)}{e['id']}", text=e["text"])
        for e in _entries(state, staged)
    )


def take_injected(
    run_id: str, state: StateView, commands: Sequence[Command]
) -> tuple[tuple[UserMessage, ...], tuple[Command, ...]]:
    """For a commit that writes history: the injected messages it writes, and its
    commands without the staging ones (with the removal of what was committed)."""
    messages = injected_messages(run_id, state, commands)
    if not messages:
        return (), tuple(commands)
    rest = tuple(c for c in commands if not (c.key == INJECTED_KEY and c.scope == "run"))
    if INJECTED_KEY in state["run"]:
        rest += (Command(key=INJECTED_KEY, scope="run", op="remove"),)
    return messages, rest


def injected_prefix(run_id: str) -> str:
    """What the id of each message ``run_id`` injected begins with."""
    return f"{run_id}:injected:"


def carried_by_answer(waiting: Frontier) -> tuple[Message, ...]:
    """What the answer to a wait for input on ``waiting`` writes ahead of its own text, in
    its resume commit (``runtime.resume.resume_commit``): the last Step's results (the new
    text follows them), then the messages injected before the wait."""
    injected = injected_messages(waiting.run_id or "", waiting.state, ())
    return (*result_messages(waiting.batch), *injected)


def live_history(
    frontier: Frontier, staged: Iterable[Command], pending: Sequence[str] = ()
) -> tuple[Message, ...]:
    """The persisted history as it stands: committed messages, the Step's finished
    results, the injected messages (committed, staged, and ``pending`` texts)."""
    results = _finished_results(frontier.batch)
    injected = injected_messages(frontier.run_id or "", frontier.state, staged)
    extra = tuple(UserMessage(id="", text=t) for t in pending)
    return (*frontier.messages, *results, *injected, *extra)


def _finished_results(batch: ActiveToolBatch | None) -> tuple[ToolResultMessage, ...]:
    if batch is None or batch.all_terminal:
        return result_messages(batch)
    return tuple(
        trusted(
            ToolResultMessage,
            call_id=c.call_id,
            tool=c.tool,
            content=c.phase.output.content,
            is_error=c.phase.output.is_error,
        )
        for c in batch.calls
        if isinstance(c.phase, Completed)
    )


def restaged(commands: Sequence[Command]) -> list[Command]:
    """A commit that writes the injected messages into history (removing their entries)
    may also carry new ones (an AfterInference hook's, for the next inference): one key
    takes one policy per commit, so the new entries become the key's one exclusive set."""
    mine = [c for c in commands if c.key == INJECTED_KEY and c.scope == "run"]
    if not any(c.op == "remove" for c in mine) or all(c.op == "remove" for c in mine):
        return list(commands)
    entries = {e["id"]: e for c in mine if c.op == "set" for e in _listed(c.value)}
    rest = [c for c in commands if c not in mine]
    return [
        *rest,
        Command(key=INJECTED_KEY, scope="run", value=[entries[k] for k in sorted(entries)]),
    ]
