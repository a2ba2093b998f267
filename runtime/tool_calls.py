"""Running tool calls: how one invocation ends (``invoke_safely``: finished, lost or
unavailable, never an exception) and the in-process ToolRunner (``LocalToolRunner``).

A call runs under its own ``timeout_s`` in a task of its own; past it, it is cancelled
and left behind, never waited for, and counts as Lost (its effect may have happened),
unless it never got a tool thread or says it sent nothing (Unavailable: tried again).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any

from runtime.batch import ToolOutput
from runtime.execution import AbortSignal, ToolExecution, ToolRequest
from runtime.limits import printable, raised, said
from runtime.ports import Finished, Lost, ToolInvocation, ToolOutcome, Unavailable
from runtime.signals import cancelling, let_go
from runtime.tool_threads import CallStart
from runtime.tools import (
    OutcomeUnknown,
    Tool,
    ToolContext,
    ToolResult,
    UnavailableBeforeDispatch,
    Untextable,
    as_text,
)
from runtime.tracing_env import within


def _failed(text: str, requests: Sequence[Any]) -> Finished:
    """The tool's error as the model sees it, with what it asked of its Run if that is a
    list of requests (a tool can put anything there)."""
    output = ToolOutput(content=text, is_error=True)
    try:
        return Finished(output=output, requests=tuple(requests))
    except Exception:  # requests that are not requests: dropped, the call still failed
        return Finished(output=output)


def outcome_of(result: Any, requests: Sequence[ToolRequest] = ()) -> Finished:
    """Turn a tool's return value (and what it asked of its Run) into a finished outcome."""
    # the output given as its fields: validated once, by Finished (a ToolOutput record
    # given to it would be validated again: a Given record always is)
    if isinstance(result, ToolResult):
        return Finished(
            output={"content": as_text(result.content), "is_error": bool(result.is_error)},
            commands=tuple(result.commands),
            requests=tuple(requests),
        )
    return Finished(output={"content": as_text(result)}, requests=tuple(requests))


async def invoke_safely(t: Tool, inv: ToolInvocation) -> ToolOutcome:
    """Run one invocation and classify how it ended; never raises an ordinary exception.

    A call that times out or is cancelled has its abort signal set first; what it asked
    of its Run is kept only if it finished (a retried call asks again)."""
    abort = AbortSignal()
    execution = None if inv.execution is None else ToolExecution(inv.execution, abort)
    ctx = ToolContext(
        operation_id=inv.operation_id,
        attempt=inv.attempt,
        call_id=inv.call_id,
        run_id=inv.run_id,
        thread_id=inv.thread_id,
        prompt_path=inv.prompt_path,
        epoch=inv.epoch,
        execution=execution,
    )
    timeout = inv.timeout_s if inv.timeout_s is not None else t.timeout_s
    requests = () if execution is None else execution.requests
    start = CallStart()
    try:
        work = t.invoke(inv.arguments, ctx, start)
        result = await (work if timeout is None else _within(work, timeout))
    except _DeadlinePassed:
        if start.abandon():
            return Unavailable(
                message=f"tool {t.id} got no tool thread within {timeout}s (all are busy)"
            )
        abort.set()  # a tool still running (in its thread, or ignoring its cancellation)
        start.given_up()
        return Lost(message=f"tool {t.id} timed out after {timeout}s")
    except UnavailableBeforeDispatch as exc:
        return Unavailable(message=said(exc) or "unavailable before dispatch")
    except OutcomeUnknown as exc:
        return Lost(message=printable(f"tool {t.id}: {said(exc)}") or f"tool {t.id}: lost")
    except Untextable as exc:
        return _failed(f"tool {t.id} returned what cannot be a result: {exc}", ())
    except asyncio.CancelledError as exc:
        abort.set()
        if cancelling():
            start.given_up()  # a synchronous call's thread runs on
            raise  # the wave is being cancelled: it goes on unwinding
        return _failed(raised(exc), requests)
    except BaseException as exc:  # the tool's failure is the model's to see, never a crash
        # (GeneratorExit or a BaseException of its own included: one call's failure
        # must not fail the wave, nor the other Runs' waves sent in the same call)
        return _failed(raised(exc), requests)
    try:
        return outcome_of(result, requests)
    except BaseException as exc:  # a result that cannot be text is the tool's error
        # (its __str__ or __repr__ may raise anything, SystemExit included)
        return _failed(f"tool {t.id} returned what cannot be a result: {raised(exc)}", ())


class _DeadlinePassed(Exception):
    """The call's own deadline (``timeout_s``) passed: not a TimeoutError the tool raised."""


async def _within(work: Awaitable[Any], limit_s: float) -> Any:
    """``work``'s result, or _DeadlinePassed once ``limit_s`` has passed: the call is then
    cancelled and left behind, not waited for (one that ignores its cancellation would
    hold its Run for as long as it likes). Its own TimeoutError is its own failure."""
    bounded = contextvars.copy_context()
    bounded.run(_BOUNDED.set, True)
    task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(
        _awaited(work), context=bounded
    )
    try:
        await asyncio.wait({task}, timeout=limit_s)
    except asyncio.CancelledError:
        task.cancel()  # the wave is being cancelled: so is the call
        raise
    if not task.done():
        await let_go(task)  # a call that takes its cancellation ends within a moment
        if task.done() and not task.cancelled():
            unsent = task.exception()  # retrieved: what it ends with past its deadline
            if isinstance(unsent, UnavailableBeforeDispatch):
                raise unsent  # it says it had sent nothing yet: unavailable, not lost
        raise _DeadlinePassed
    return task.result()


_BOUNDED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ratchet_call_bounded", default=False
)


async def _awaited(work: Awaitable[Any]) -> Any:
    return await work


def cancelled_at_deadline() -> bool:
    """Whether the running call runs under its own ``timeout_s`` (in a task of its own, which
    only its deadline or its wave's end cancels): a call cancelled there may answer
    ``UnavailableBeforeDispatch`` if it had sent nothing yet (it is then tried again,
    not lost). Anywhere else a CancelledError must go on unwinding."""
    return _BOUNDED.get()


class LocalToolRunner:
    """Runs tools in this process, a wave at a time, concurrently (the in-process runner)."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = {t.id: t for t in tools}

    async def run(self, invocations: Sequence[ToolInvocation]) -> list[ToolOutcome]:
        return await run_calls(
            [within(i.trace_context, invoke_safely(self.tools[i.tool], i)) for i in invocations]
        )


async def run_calls(calls: Sequence[Coroutine[Any, Any, ToolOutcome]]) -> list[ToolOutcome]:
    """A wave's calls, each in a task of its own (concurrently, each in its own context),
    their outcomes in order: awaited one by one without gather's bookkeeping, which costs
    more than the tasks. If this is cancelled, so are they, as with a cancelled gather.

    A call's task cancelled while this one is not is the tool's own doing
    (``asyncio.current_task().cancel()``): its error, as any the tool raises. Passed on,
    it failed the Run (or, on an executor, lost every call of the wave, finished ones
    included: a replay_safe one ran twice)."""
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(call) for call in calls]
    outcomes: list[ToolOutcome] = []
    try:
        for task in tasks:
            try:
                outcomes.append(await task)
            except asyncio.CancelledError:
                if cancelling():
                    raise
                outcomes.append(_failed("the tool cancelled its own task (CancelledError)", ()))
    except BaseException:  # cancelled (or a bug of ours): no call outlives its wave
        for task in tasks:
            task.cancel()
        raise
    return outcomes
