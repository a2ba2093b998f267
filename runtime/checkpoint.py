"""Stream checkpoints: partial output of an interrupted inference (DESIGN §4).

Best effort from end to end: writing one never fails a Run, nor holds one up for more
than a timeout while its store hangs (``SafeCheckpoints``), and it is used only on the
first Step a recovered engine runs, then deleted once that Step commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.ids import CallId, RunId, ThreadId
from runtime.limits import joined
from runtime.messages import ContextMessage, ToolUse
from runtime.models import ModelDelta, ModelResponse
from runtime.ports import StreamCheckpoint, StreamCheckpointStore

log = logging.getLogger("ratchet.checkpoint")
T = TypeVar("T")


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


COOL_DOWN_S = 30.0
"""How long checkpoint I/O is skipped once the store failed or did not answer in time."""
MAX_OWED = 10_000
"""Threads whose owed delete is remembered (the oldest is forgotten past it)."""


@dataclass
class _Health:
    """What every SafeCheckpoints over one store knows of it (there is one per engine,
    so one per Run: an outage learnt by one Run spares the others)."""

    failing: bool = False
    """Whether its last call timed out: calls are skipped until one answers in time."""
    resume_at: float = 0.0
    """``time.monotonic()`` before which a failing store is not called (its cool-down)."""
    probing: bool = False
    """Whether a call is trying a failing store again (the others still skip it)."""
    owed: dict[ThreadId, None] = field(default_factory=dict)
    """Threads whose checkpoint should have been deleted and may not have been, oldest first."""


_HEALTH: weakref.WeakKeyDictionary[Any, _Health] = weakref.WeakKeyDictionary()


def _health_of(store: StreamCheckpointStore | None) -> _Health:
    try:
        return _HEALTH.setdefault(store, _Health())
    except TypeError:  # None, or a store that cannot be weakly referenced: its own
        return _Health()


class _Failed(Exception):
    """A call skipped, or one that raised, timed out, or answered as slowly as a store
    that gave up."""


class SafeCheckpoints:
    """Wraps a StreamCheckpointStore so that no failure of it ever reaches a Run, nor
    holds one up for long.

    A call that raises is logged, and the checkpoint treated as absent. One that does
    not answer within ``timeout_s``, or answers after half of it (a store that gave up
    on its own timeout answers as if it had succeeded), is logged too, and the store is
    left alone for ``cool_down_s``: puts are skipped, ``get`` answers None (the Step
    infers again), deletes are owed. Then one call tries it again (the others still
    skip it), and the store is used as before once that call answers in time. The
    state is shared by every SafeCheckpoints over the same store object.

    A delete not made is owed: until a later put or delete of that thread lands, this
    process serves no checkpoint of it (``get`` makes the delete first, and answers
    None). What it leaves in the store is harmless once its Step has committed (a
    checkpoint names its Run and Step, and a recovery's first Step is a later one).
    One a failed attempt left is replaced by the next attempt's first put, or deleted
    when its Step commits; a process that dies before either, its store back when the
    recovery reads, lets that attempt's complete calls be taken up — as a delete that
    failed outright always could (nothing committed tells a failed attempt)."""

    def __init__(
        self,
        store: StreamCheckpointStore | SafeCheckpoints | None,
        timeout_s: float = 5.0,
        cool_down_s: float = COOL_DOWN_S,
    ) -> None:
        if isinstance(store, SafeCheckpoints):  # wrapped already: taken as it is
            timeout_s, cool_down_s = store.timeout_s, store.cool_down_s
            store = store.store
        self.store: StreamCheckpointStore | None = store
        self.timeout_s: float = timeout_s
        self.cool_down_s: float = cool_down_s
        self.health = _health_of(store)

    def cooling(self) -> bool:
        """Whether calls skip the store now (a failing one, in its cool-down)."""
        return self.health.failing and time.monotonic() < self.health.resume_at

    async def get(self, thread: ThreadId) -> StreamCheckpoint | None:
        store = self.store
        if store is None:
            return None
        if thread in self.health.owed:  # what it holds may be stale
            await self.delete(thread)
            return None
        try:
            return await self._call("read", thread, lambda: store.get(thread))
        except _Failed:
            return None

    async def put(self, thread: ThreadId, cp: StreamCheckpoint) -> None:
        store = self.store
        if store is None:
            return
        with contextlib.suppress(_Failed):
            await self._call("write", thread, lambda: store.put(thread, cp))
            self.health.owed.pop(thread, None)  # replaced: nothing stale is left

    async def delete(self, thread: ThreadId) -> None:
        store = self.store
        if store is None:
            return
        try:
            await self._call("delete", thread, lambda: store.delete(thread))
        except _Failed:
            self._owe(thread)
        else:
            self.health.owed.pop(thread, None)

    async def _call(self, what: str, thread: ThreadId, work: Callable[[], Awaitable[T]]) -> T:
        health = self.health
        probe = health.failing
        if probe:
            if health.probing or time.monotonic() < health.resume_at:
                raise _Failed  # left alone
            health.probing = True
        try:
            return await self._timed(what, thread, work)
        finally:
            if probe:
                health.probing = False

    async def _timed(self, what: str, thread: ThreadId, work: Callable[[], Awaitable[T]]) -> T:
        began = time.monotonic()
        try:
            answer = await asyncio.wait_for(work(), self.timeout_s)
        except TimeoutError as exc:
            self._cool_down(what, thread, f"no answer within {self.timeout_s:g}s")
            raise _Failed from exc
        except Exception as exc:  # quick to fail, so nothing to wait out
            log.warning("stream checkpoint %s failed for %s: %r", what, thread, exc)
            raise _Failed from exc
        took = time.monotonic() - began
        if took >= self.timeout_s / 2:
            self._cool_down(what, thread, f"it took {took:.1f}s")
            raise _Failed
        if self.health.failing:
            self.health.failing = False
            log.warning("the stream checkpoint store answers again: checkpoints are kept")
        return answer

    def _cool_down(self, what: str, thread: ThreadId, why: str) -> None:
        self.health.failing = True
        self.health.resume_at = time.monotonic() + self.cool_down_s
        log.warning(
            "stream checkpoint %s failed for %s (%s): checkpoints are skipped for %gs",
            what,
            thread,
            why,
            self.cool_down_s,
        )

    def _owe(self, thread: ThreadId) -> None:
        owed = self.health.owed
        owed.pop(thread, None)
        owed[thread] = None
        if len(owed) > MAX_OWED:
            del owed[next(iter(owed))]
