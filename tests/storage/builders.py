"""Real ThreadCommits for store tests (no fakes: the runtime's own types).

A commit names the hash of the one before it (the chain), the owner epoch of its
writer and, when it carries a claim, its claimant, so builders take ``prev``, ``epoch``
and ``claim``; ``head(store, thread)`` gives the hash for the thread's next commit.
"""

from __future__ import annotations

from typing import Any

from runtime.commit import ThreadCommit
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState, Natural, RunningState
from runtime.messages import AssistantMessage, UserMessage
from runtime.state import Command


async def head(store: Any, thread: str) -> str:
    """The hash the thread's next commit must name."""
    return str((await store.load_head(ThreadId(thread))).head)


def activation(
    thread: str,
    run: str,
    text: str = "hello",
    prev: str = "",
    epoch: int = 0,
    claim: str | None = None,
) -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=0,
        label="activation",
        disposition=RunningState(run_id=RunId(run)),
        messages=(UserMessage(id=f"{run}:input", text=text),),
        prev=prev,
        epoch=epoch,
        claim=claim,
    )


def step(
    thread: str,
    run: str,
    ordinal: int,
    text: str = "thinking",
    commands: tuple[Command, ...] = (),
    prev: str = "",
    epoch: int = 0,
    claim: str | None = None,
) -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=ordinal,
        label="inference",
        disposition=RunningState(run_id=RunId(run)),
        messages=(AssistantMessage(text=text),),
        commands=commands,
        prev=prev,
        epoch=epoch,
        claim=claim,
    )


def ended(
    thread: str,
    run: str,
    ordinal: int,
    text: str = "done",
    prev: str = "",
    epoch: int = 0,
    claim: str | None = None,
) -> ThreadCommit:
    return ThreadCommit(
        thread_id=ThreadId(thread),
        run_id=RunId(run),
        ordinal=ordinal,
        label="ended",
        disposition=EndedState(run_id=RunId(run), cause=Natural()),
        messages=(AssistantMessage(text=text),),
        prev=prev,
        epoch=epoch,
        claim=claim,
    )
