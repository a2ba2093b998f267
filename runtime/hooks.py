"""The five hook points, the one input object each hook takes, and ExecutionState.

A hook returns data (state commands, request-only context); it mutates nothing: the
state it is shown is immutable (``runtime.frozen``). What it returns is checked
(``runtime.limits``); a hook that raises or returns something unusable fails the Run
``failed(hook)`` (``HookFailed``, settled by the engine). Hooks run in order: those
of the agent's plugins first, in their dependency order (``runtime.plugins``), then the
agent's own. Plugins also contribute tool gates and run-end guards (defined here).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from runtime.batch import ToolCall
from runtime.errors import InputRefused
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import PauseReason, PauseTarget, UserInputTarget
from runtime.limits import Limits, check_id, check_json_value, check_text, printable
from runtime.messages import ContextMessage, Message
from runtime.signals import cancelling
from runtime.state import Command, StateView

HookPoint = Literal["StepStart", "BeforeInference", "AfterInference", "AfterTool", "StepEnd"]
HOOK_POINTS: tuple[HookPoint, ...] = (
    "StepStart",
    "BeforeInference",
    "AfterInference",
    "AfterTool",
    "StepEnd",
)


class ExecutionState:
    """What tools and hooks see of a Run while it executes (DESIGN §9)."""

    def __init__(
        self,
        run_id: RunId,
        thread_id: ThreadId,
        prompt_path: Sequence[str],
        cancel: asyncio.Event,
    ) -> None:
        self.run_id = run_id
        self.thread_id = thread_id
        self.prompt_path = tuple(prompt_path)
        self.step_count = 0
        self.message_history: tuple[Message, ...] = ()
        self.cancel_signal = cancel
        self.stop_reason: str | None = None
        self.wait_request: UserInputTarget | PauseTarget | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def stop(self, reason: str = "stopped from inside the run") -> None:
        """End the loop after the current operation (the Run ends ``stopped(reason)``)."""
        self.stop_reason = reason

    def request_input(self, prompt: str = "") -> None:
        """At the next Step boundary the Run awaits remote user input."""
        self.wait_request = UserInputTarget(prompt=prompt)

    def pause(self, reason: PauseReason = "manual") -> None:
        """At the next Step boundary the Run awaits an explicit unpause."""
        self.wait_request = PauseTarget(reason=reason)


@dataclass(frozen=True)
class HookInput:
    """One object per hook call, so adding a field never breaks a hook."""

    point: HookPoint
    run_id: RunId
    thread_id: ThreadId
    step: int
    state: StateView
    execution: ExecutionState
    response: Any = None
    """AfterInference: the ModelResponse."""
    call: ToolCall | None = None
    """AfterTool: the call, in its terminal phase."""


@dataclass(frozen=True)
class HookOutput:
    commands: Sequence[Command] = ()
    context: Sequence[ContextMessage] = ()
    """Request-only context for the next inference; never committed."""


HookFn = Callable[[HookInput], "HookOutput | Awaitable[HookOutput | None] | None"]


@dataclass(frozen=True)
class GateInput:
    """What a tool gate sees of a requested call (the arguments as validated)."""

    run_id: RunId
    call_id: str
    tool: str
    arguments: dict[str, Any]
    state: StateView


Gate = Callable[[GateInput], "str | None"]
"""A tool gate (contributed by a plugin): None lets the call run; a reason denies it,
and the model sees ``blocked: <reason>`` as the call's result."""


@dataclass(frozen=True)
class RunEndInput:
    """What a run-end guard sees of a Run about to end naturally."""

    run_id: RunId
    thread_id: ThreadId
    answer: str
    state: StateView
    messages: Sequence[Message]


RunEndGuard = Callable[[RunEndInput], "str | None"]
"""A run-end guard (contributed by a plugin): None lets the Run end naturally; a reason
refuses the end, and the Run ends ``failed(hook, run_end_guard)`` with it instead."""


@dataclass(frozen=True)
class Hook:
    point: HookPoint
    fn: HookFn
    name: str = ""


@dataclass
class HookResults:
    commands: list[Command] = field(default_factory=list)
    context: list[ContextMessage] = field(default_factory=list)


class HookFailed(Exception):
    """A hook raised, or returned what cannot be committed: the Run ends failed(hook)."""

    def __init__(self, hook: Hook, point: HookPoint, error: BaseException) -> None:
        name = hook.name or getattr(hook.fn, "__qualname__", "hook")
        super().__init__(f"hook {name} at {point}: {type(error).__name__}: {error}")
        self.code = type(error).__name__


_COMMANDS: TypeAdapter[list[Command]] = TypeAdapter(list[Command])
_CONTEXT: TypeAdapter[list[ContextMessage]] = TypeAdapter(list[ContextMessage])


async def run_hooks(
    hooks: Sequence[Hook], hook_input: HookInput, into: HookResults, limits: Limits
) -> None:
    """Run the hooks of one point in list order, collecting what they return."""
    for hook in hooks:
        if hook.point != hook_input.point:
            continue
        try:
            out = hook.fn(hook_input)
            if inspect.isawaitable(out):
                out = await out
            if out is None:
                continue
            commands, context = _admitted(out, limits)
        except asyncio.CancelledError as exc:
            if cancelling():
                raise  # the Run's task is being cancelled: it goes on unwinding
            raise HookFailed(hook, hook_input.point, exc) from exc
        except Exception as exc:
            raise HookFailed(hook, hook_input.point, exc) from exc
        into.commands.extend(commands)
        into.context.extend(context)


def _admitted(out: object, limits: Limits) -> tuple[list[Command], list[ContextMessage]]:
    """A hook's output, validated: Commands within the state limits, context text that
    can be sent. Raises (the caller blames the hook)."""
    if not isinstance(out, HookOutput):
        raise TypeError(f"a hook returns a HookOutput or None, not {type(out).__name__}")
    try:
        commands = _COMMANDS.validate_python(list(out.commands))
        context = _CONTEXT.validate_python(list(out.context))
    except ValidationError as exc:
        raise InputRefused("hook output", "type", printable(str(exc), 500)) from None
    for cmd in commands:
        check_id("state key", cmd.key, limits)
        check_json_value(
            f"state command {cmd.key!r}",
            cmd.value,
            limits.state_value_bytes,
            "state_value_bytes",
            limits,
        )
    for message in context:
        check_text("context message", message.text, limits.model_text_bytes, "model_text_bytes")
    return commands, context
