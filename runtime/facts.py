"""Facts are derived from committed data only: this is the one place that derives them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.base import trusted
from runtime.events import Fact, FactType
from runtime.ids import RunId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    Failed,
    IndeterminateEnd,
    RunDisposition,
    ThreadStatus,
)
from runtime.messages import AssistantMessage, Message, ToolResultMessage, UserMessage


def _fact(type_: FactType, run: RunId, data: dict[str, Any]) -> Fact:
    # every part is one the engine made from validated records: not validated again
    return trusted(Fact, type=type_, run_id=run, data=data)


def facts_of(
    run: RunId,
    label: str,
    messages: Sequence[Message],
    status: ThreadStatus | None,
    disposition: RunDisposition,
) -> tuple[Fact, ...]:
    """The facts of the commit made of these parts; ``status`` only if it changed.

    Their data are dumps of typed fields of our records, none of them a float (a test
    holds the records' schemas to that): plain JSON, as the commit encoder needs to know.
    """
    facts: list[Fact] = []
    if label == "activation":
        text = next((m.text for m in messages if isinstance(m, UserMessage)), "")
        facts.append(_fact("run_started", run, {"input": text}))
    for msg in messages:
        if isinstance(msg, AssistantMessage):
            facts.append(_fact("assistant_message", run, {"text": msg.text}))
            facts.extend(
                _fact(
                    "tool_call",
                    run,
                    {"call_id": c.call_id, "tool": c.tool, "arguments": c.arguments},
                )
                for c in msg.tool_calls
            )
        elif isinstance(msg, ToolResultMessage):
            # its fields are all str and bool: its __dict__ is its JSON-mode dump, at a
            # tenth of the cost (a test compares the two)
            facts.append(_fact("tool_result", run, dict(msg.__dict__)))
    if status is not None:
        facts.append(_fact("status", run, status.frame()))
    # the rest fact comes last in its commit, so a follower can stop right after it
    if isinstance(disposition, AwaitingState):
        data = {"ticket": disposition.ticket.model_dump(mode="json")}
        facts.append(_fact("awaiting", run, data))
    elif isinstance(disposition, EndedState):
        failed = isinstance(disposition.cause, Failed | IndeterminateEnd)
        data = {"cause": disposition.cause.model_dump(mode="json")}
        facts.append(_fact("run_failed" if failed else "run_finished", run, data))
    return tuple(facts)
