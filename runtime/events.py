"""AgentEvent: committed Facts and live-only Deltas (DESIGN §2).

Facts are derived only from committed data and published after their commit; a
client that reconnects re-reads them from the store by cursor. Deltas are live
only and tagged with the inference attempt, so a retried inference replaces its
partial text instead of duplicating it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from runtime.base import Frozen
from runtime.ids import RunId

FactType = Literal[
    "run_started",
    "assistant_message",
    "tool_call",
    "tool_result",
    "awaiting",
    "run_finished",
    "run_failed",
    "status",
    "resumed",
    "resume_ended",
]
DeltaType = Literal["text_delta", "reasoning_delta", "tool_call_delta"]


class Fact(Frozen):
    kind: Literal["fact"] = "fact"
    type: FactType
    run_id: RunId
    data: dict[str, Any] = {}
    seq: int = 0
    """Commit sequence the fact belongs to (0 until committed)."""
    index: int = 0
    """Position of the fact inside its commit; (seq, index) is the stream offset."""


class Delta(Frozen):
    kind: Literal["delta"] = "delta"
    type: DeltaType
    run_id: RunId
    step: int
    attempt: int
    """Inference attempt; a newer attempt of the same step replaces older partial text."""
    text: str


AgentEvent = Annotated[Fact | Delta, Field(discriminator="kind")]
