"""Real ThreadCommits for store tests (no fakes: the runtime's own types)."""

from __future__ import annotations

from runtime.commit import ThreadCommit
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState, Natural, RunningState
from runtime.messages import AssistantMessage, UserMessage
from runtime.state import Command


def activation(thread: str, run: str, text: str = "hello") -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=0,
        label="activation",
        disposition=RunningState(run_id=RunId(run)),
        messages=(UserMessage(id=f"{run}:input", text=text),),
    )


def step(
    thread: str, run: str, ordinal: int, text: str = "thinking", commands: tuple[Command, ...] = ()
) -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=ordinal,
        label="inference",
        disposition=RunningState(run_id=RunId(run)),
        messages=(AssistantMessage(text=text),),
        commands=commands,
    )


def ended(thread: str, run: str, ordinal: int, text: str = "done") -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=ordinal,
        label="ended",
        disposition=EndedState(run_id=RunId(run), cause=Natural()),
        messages=(AssistantMessage(text=text),),
    )
