"""Stream checkpoints: partial output of an interrupted inference (DESIGN §4).

Best effort from end to end: writing one never fails a Run, and it is used only on
the first Step a recovered engine runs, then deleted once that Step commits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from runtime.ids import CallId, RunId, ThreadId
from runtime.limits import joined
from runtime.messages import ContextMessage, ToolUse
from runtime.models import ModelDelta, ModelResponse
from runtime.ports import StreamCheckpoint, StreamCheckpointStore

log = logging.getLogger("ratchet.checkpoint")


def plan_from_checkpoint(
    cp: StreamCheckpoint | None, run_id: RunId, step: int
) -> ModelResponse | ContextMessage | None:
    """What a recovered Step makes of a checkpoint.

    - one or more complete tool calls: use them without asking the model again;
    - text only, or text plus a broken call: drop the broken call and continue from
      the text as request-only context;
    - nothing usable (or a checkpoint of another Step): infer again.
    """
    if cp is None or cp.run_id != run_id or cp.step != step:
        return None
    complete = [use for use in map(_complete_call, cp.tool_calls) if use is not None]
    if complete:
        return ModelResponse(text=cp.text, tool_calls=tuple(complete))
    if cp.text:
        return ContextMessage(
            text=f"Your previous answer was interrupted after: {cp.text!r}. Continue from there."
        )
    return None


def _complete_call(raw: dict[str, Any]) -> ToolUse | None:
    tool, call_id, arguments = raw.get("tool"), raw.get("call_id"), raw.get("arguments", "")
    if not tool or not call_id:
        return None
    try:
        parsed = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    return ToolUse(call_id=CallId(str(call_id)), tool=str(tool), arguments=arguments)


@dataclass
class PartialOutput:
    """Accumulates one inference's deltas into a checkpoint."""

    run_id: RunId
    step: int
    texts: list[str] = field(default_factory=list)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    """call id → its tool and its argument fragments."""

    # fragments are kept apart and joined for a checkpoint: ``+=`` on an attribute copies
    # the whole text for every delta (quadratic in a long stream)
    def add(self, delta: ModelDelta) -> None:
        if delta.type == "text_delta":
            self.texts.append(delta.text)
        elif delta.type == "tool_call_delta" and delta.call_id:
            call = self.calls.setdefault(delta.call_id, {"tool": "", "arguments": []})
            call["tool"] = delta.tool or call["tool"]
            call["arguments"].append(delta.text)

    @property
    def text(self) -> str:
        return joined(self.texts)

    def checkpoint(self) -> StreamCheckpoint:
        calls = tuple(
            {"call_id": call_id, "tool": call["tool"], "arguments": joined(call["arguments"])}
            for call_id, call in self.calls.items()
        )
        return StreamCheckpoint(
            run_id=self.run_id, step=self.step, text=self.text, tool_calls=calls
        )


class SafeCheckpoints:
    """Wraps a StreamCheckpointStore so that no failure of it ever reaches a Run: an
    error, or an answer slower than ``timeout_s`` (a hung server), is logged and the
    checkpoint treated as absent (one left behind is ignored: it names its run and step)."""

    def __init__(self, store: StreamCheckpointStore | None, timeout_s: float = 5.0) -> None:
        self.store = store
        self.timeout_s = timeout_s

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        if self.store is None:
            return None
        try:
            return await asyncio.wait_for(self.store.get(thread), self.timeout_s)
        except Exception as exc:
            log.warning("stream checkpoint read failed for %s: %r", thread, exc)
            return None

    async def put(self, thread: ThreadId, cp: StreamCheckpoint) -> None:
        if self.store is not None:
            try:
                await asyncio.wait_for(self.store.put(thread, cp), self.timeout_s)
            except Exception as exc:
                log.warning("stream checkpoint write failed for %s: %r", thread, exc)

    async def delete(self, thread: ThreadId) -> None:
        if self.store is not None:
            try:
                await asyncio.wait_for(self.store.delete(thread), self.timeout_s)
            except Exception as exc:
                log.warning("stream checkpoint delete failed for %s: %r", thread, exc)
