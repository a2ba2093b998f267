"""One inference of a Step: the stream checkpoint, the model call, live deltas, retries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runtime.base import trusted
from runtime.checkpoint import PartialOutput, plan_from_checkpoint
from runtime.events import Delta
from runtime.ids import CallId
from runtime.lifecycle import Failed
from runtime.messages import (
    AssistantMessage,
    ContextMessage,
    ToolResultMessage,
    ToolUse,
    UserMessage,
)
from runtime.models import InferenceRequest, ModelResponse
from runtime.signals import CancelledSignal

if TYPE_CHECKING:
    from runtime.engine import Engine, RunContext

log = logging.getLogger("ratchet.engine")


async def salvage(
    engine: Engine, ctx: RunContext, step: int
) -> ModelResponse | ContextMessage | None:
    """On the first Step after recovery only: what the stream checkpoint offers."""
    if not engine.use_checkpoint:
        return None
    engine.use_checkpoint = False
    cp = await engine.checkpoints.get(ctx.frontier.thread_id)
    engine.checkpointed = cp is not None
    return plan_from_checkpoint(cp, ctx.run_id, step)


async def infer(
    engine: Engine, ctx: RunContext, step: int, history: tuple[Any, ...], last: bool
) -> ModelResponse | None:
    """Ask the model, streaming deltas live; None when the Run ended failed(inference)."""
    error: Exception | None = None
    for attempt in range(1, engine.agent.inference_attempts + 1):
        if engine.cancel_event.is_set():
            raise CancelledSignal
        request = _request(engine, ctx, step, attempt, history, last)
        try:
            return await engine.guard(_stream(engine, ctx, request))
        except CancelledSignal:
            raise
        except Exception as exc:  # a model failure of any kind is the model's, not ours
            error = exc
            log.warning("inference attempt %d of run %s failed: %s", attempt, ctx.run_id, exc)
    assert error is not None
    failure = Failed(failure="inference", code=type(error).__name__, message=str(error)[:2000])
    await engine.end(ctx, failure)
    return None


_MESSAGE_TYPES = frozenset({UserMessage, AssistantMessage, ToolResultMessage, ContextMessage})


def _request(
    engine: Engine, ctx: RunContext, step: int, attempt: int, history: tuple[Any, ...], last: bool
) -> InferenceRequest:
    """The request; validated only if the history holds something other than our records.

    Validating committed messages again would cost more than the rest of building the
    request (it grows with the conversation); hook context that is not a ContextMessage
    record yet is validated (and coerced) as before. Each request gets its own copy of
    the tool schemas, as validation would give it, so a model cannot alter them.
    """
    tools = None if last else tuple(dict(t.schema()) for t in engine.agent.tools)
    parts = {"run_id": ctx.run_id, "step": step, "attempt": attempt, "tools": tools}
    if all(type(m) in _MESSAGE_TYPES for m in history):
        return trusted(InferenceRequest, messages=history, **parts)
    return InferenceRequest(messages=history, **parts)


async def _stream(engine: Engine, ctx: RunContext, request: InferenceRequest) -> ModelResponse:
    response: ModelResponse | None = None
    partial = PartialOutput(run_id=request.run_id, step=request.step)
    checkpointing = engine.checkpoints.store is not None  # else the partial is never read
    clock = asyncio.get_running_loop().time
    last_put = clock()
    async for item in engine.agent.model.stream(request):
        if isinstance(item, ModelResponse):
            response = item
            continue
        if checkpointing:
            partial.add(item)
            if clock() - last_put >= engine.checkpoint_interval_s:
                await engine.checkpoints.put(ctx.frontier.thread_id, partial.checkpoint())
                engine.checkpointed, last_put = True, clock()
        if engine.bus is not None:
            delta = Delta(
                type=item.type,
                run_id=request.run_id,
                step=request.step,
                attempt=request.attempt,
                text=item.text,
            )
            await engine.publish(ctx, (delta,))
    if response is None:
        raise RuntimeError("the model stream ended without a complete response")
    return response


def unique_calls(calls: Sequence[ToolUse]) -> tuple[ToolUse, ...]:
    """Models sometimes repeat a call id; rename repeats so every call stays addressable."""
    seen: set[str] = set()
    out = []
    for use in calls:
        cid = use.call_id or "call"
        n = 1
        while cid in seen:
            n += 1
            cid = f"{use.call_id}#{n}"
        seen.add(cid)
        out.append(use if cid == use.call_id else use.model_copy(update={"call_id": CallId(cid)}))
    return tuple(out)
