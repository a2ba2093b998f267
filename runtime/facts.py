"""Facts are derived from committed data only: this is the one place that derives them."""

from __future__ import annotations

from runtime.commit import Frontier, ThreadCommit
from runtime.events import Fact
from runtime.lifecycle import AwaitingState, EndedState, Failed, IndeterminateEnd
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage


def derive_facts(commit: ThreadCommit, before: Frontier) -> tuple[Fact, ...]:
    run = commit.run_id
    facts: list[Fact] = []
    if commit.label == "activation":
        text = next((m.text for m in commit.messages if isinstance(m, UserMessage)), "")
        facts.append(Fact(type="run_started", run_id=run, data={"input": text}))
    for msg in commit.messages:
        if isinstance(msg, AssistantMessage):
            facts.append(Fact(type="assistant_message", run_id=run, data={"text": msg.text}))
            facts.extend(
                Fact(
                    type="tool_call",
                    run_id=run,
                    data={"call_id": c.call_id, "tool": c.tool, "arguments": c.arguments},
                )
                for c in msg.tool_calls
            )
        elif isinstance(msg, ToolResultMessage):
            facts.append(Fact(type="tool_result", run_id=run, data=msg.model_dump(mode="json")))
    if commit.status is not None and commit.status != before.status:
        facts.append(Fact(type="status", run_id=run, data=commit.status.frame()))
    # the rest fact comes last in its commit, so a follower can stop right after it
    disposition = commit.disposition
    if isinstance(disposition, AwaitingState):
        facts.append(
            Fact(
                type="awaiting",
                run_id=run,
                data={"ticket": disposition.ticket.model_dump(mode="json")},
            )
        )
    elif isinstance(disposition, EndedState):
        failed = isinstance(disposition.cause, Failed | IndeterminateEnd)
        facts.append(
            Fact(
                type="run_failed" if failed else "run_finished",
                run_id=run,
                data={"cause": disposition.cause.model_dump(mode="json")},
            )
        )
    return tuple(facts)
