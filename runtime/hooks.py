"""The five hook points and the one input object each hook takes.

A hook returns data — state commands, request-only context, reactions
(``runtime.execution``: stop the Run, request input, deny a call, inject a message,
...) — and mutates nothing: the state it is shown is immutable (``runtime.frozen``).
What it returns is checked (``runtime.limits``; no hook writes a key Ratchet keeps, and
a plugin's hooks write only the keys the plugin declared, with the declared policy); a
hook that raises or returns something unusable fails the Run ``failed(hook)``
(``HookFailed``, settled by the engine). Hooks run in order: those of the agent's
plugins first, in their dependency order (``runtime.plugins``), then the agent's own.
Plugins also contribute tool gates and run-end guards (defined here).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from runtime.batch import ToolCall
from runtime.errors import InputRefused, StateConflict
from runtime.execution import (
    DenyCall,
    ExecutionState,
    ExecutionView,
    InjectMessage,
    Reaction,
    check_reaction_text,
)
from runtime.faults import Unwind
from runtime.ids import RunId, ThreadId
from runtime.limits import (
    Limits,
    check_id,
    check_json_value,
    check_text,
    handed_bytes,
    printable,
    raised,
    short_code,
    stored_size,
)
from runtime.messages import ContextMessage, Message
from runtime.state import Command, MergePolicy, StateView, apply_commands, check_writable

HookPoint = Literal["StepStart", "BeforeInference", "AfterInference", "AfterTool", "StepEnd"]
HOOK_POINTS: tuple[HookPoint, ...] = (
    "StepStart",
    "BeforeInference",
    "AfterInference",
    "AfterTool",
    "StepEnd",
)


@dataclass(frozen=True)
class HookInput:
    """One object per hook call, so adding a field never breaks a hook."""

    point: HookPoint
    run_id: RunId
    thread_id: ThreadId
    step: int
    state: StateView
    execution: ExecutionView
    """The Run as it is now, read only: the live controls are the way to change it."""
    response: Any = None
    """AfterInference: the ModelResponse."""
    call: ToolCall | None = None
    """AfterTool: the call, in its terminal phase."""


@dataclass(frozen=True)
class HookOutput:
    commands: Sequence[Command] = ()
    context: Sequence[ContextMessage] = ()
    """Request-only context for the next inference; never committed."""
    reactions: Sequence[Reaction] = ()
    """Requests of the Run (``runtime.execution``); ``DenyCall`` at AfterInference only."""


HookFn = Callable[[HookInput], "HookOutput | Awaitable[HookOutput | None] | None"]


@dataclass(frozen=True)
class GateInput:
    """What a tool gate sees of a requested call (the arguments as validated)."""

    run_id: RunId
    call_id: str
    tool: str
    arguments: dict[str, Any]
    """Read-only (a ``FrozenDict``: writing it raises, and the gate denies): the tool
    runs with the arguments the log holds."""
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
    """The Run's final answer: the text of the assistant message its end commits (a
    session whose turns are over: its last model answer), else empty."""
    state: StateView
    messages: Sequence[Message]


RunEndGuard = Callable[[RunEndInput], "str | None"]
"""A run-end guard (contributed by a plugin): None lets the Run end naturally; a reason
refuses the end, and the Run ends ``failed(hook, run_end_guard)`` with it instead."""


def verdict(answer: object, default: str) -> str | None:
    """A gate's or run-end guard's answer: None lets the call run (the Run end); else
    its reason (``default`` if it says nothing). An awaitable (an async gate) is no
    answer: it is closed unawaited, and refuses."""
    if inspect.isawaitable(answer):
        close = getattr(answer, "close", None)
        if callable(close):
            close()
        return "it answered with an awaitable: gates and guards are plain functions"
    return None if answer is None else printable(str(answer)) or default


@dataclass(frozen=True)
class Hook:
    point: HookPoint
    fn: HookFn
    name: str = ""
    keys: Mapping[str, MergePolicy] | None = None
    """A plugin's hook: the state keys (``scope:key``) its plugin declared, the only ones
    it may write (set by ``runtime.plugins.resolve``); None for the agent's own hooks."""

    def __post_init__(self) -> None:
        # a misspelt point would be a hook that silently never runs (a policy skipped)
        if self.point not in HOOK_POINTS:
            raise ValueError(
                f"a hook's point is one of {', '.join(HOOK_POINTS)}, not {self.point!r}"
            )
        if not callable(self.fn):
            raise TypeError(f"a hook's fn is a function, not a {type(self.fn).__name__}")


@dataclass
class HookResults:
    commands: list[Command] = field(default_factory=list)
    context: list[ContextMessage] = field(default_factory=list)
    denied: dict[str, str] = field(default_factory=dict)
    """Call id → reason, from ``DenyCall`` reactions (the gates complete them)."""
    alongside: Sequence[Command] = ()
    """Commands the hooks' are committed with (an AfterTool wave's tools'): a hook whose
    commands cannot merge with them and those before is the one that fails, by name, not
    the commit that would have carried what the tools did."""
    handed: int = 0
    """Bytes the hooks handed the commit these results ride with (messages injected,
    state commands): held to ``input_bytes`` together (``run_hooks``)."""


class HookFailed(Exception):
    """A hook raised, or returned what cannot be committed: the Run ends failed(hook)."""

    def __init__(self, hook: Hook, point: HookPoint, error: BaseException) -> None:
        name = hook.name or getattr(hook.fn, "__qualname__", "hook")
        super().__init__(printable(f"hook {name} at {point}: {raised(error)}"))
        self.code = short_code(type(error).__name__)


_COMMANDS: TypeAdapter[list[Command]] = TypeAdapter(list[Command])
_CONTEXT: TypeAdapter[list[ContextMessage]] = TypeAdapter(list[ContextMessage])
_REACTIONS: TypeAdapter[list[Reaction]] = TypeAdapter(list[Reaction])


async def run_hooks(
    hooks: Sequence[Hook],
    hook_input: HookInput,
    execution: ExecutionState,
    into: HookResults,
    limits: Limits,
    staged: Sequence[Command] = (),
) -> None:
    """Run the hooks of one point in list order, collecting what they return and applying
    their reactions (the one place hook reactions take effect). ``staged``: commands the
    Run holds for its next commit, which the hooks' must merge with too; ``execution``:
    the live state ``hook_input`` shows (read only), where reactions take effect.

    Awaited in a task of its own (``guarded_apart``), never the Run's: the Run's cancel
    or stop lets that task go and drops whatever it ends with, so a cancellation heard
    here matters only when a hook cancelled its own task, and is that hook's failure (as
    a tool's is). Passed on, it reached the Run's task, not itself cancelled, as a
    ``failed(internal, CancelledError)``."""
    task = asyncio.current_task()
    assert task is not None, "hooks run inside a task"
    for hook in hooks:
        if hook.point != hook_input.point:
            continue
        live = len(execution.injected)  # where what it injects live begins
        try:
            asked = task.cancelling()
            out = hook.fn(hook_input)
            if inspect.isawaitable(out):
                out = await out
            if task.cancelling() > asked:
                # it cancelled its task and returned: the cancellation it left pending
                # lands here, on it, not on the next hook's first wait (one it caught and
                # swallowed is gone, and the hook's output stands, as a tool's result does)
                await asyncio.sleep(0)
            commands, context, reactions = (
                _admitted(out, hook, hook_input, limits) if out is not None else ([], [], [])
            )
            injected = execution.injected[live:]
            handed = check_handed(into.handed, commands, injected, reactions, limits)
            if commands:  # a clash found now is this hook's (StateConflict)
                _merge_check(hook_input.state, (*staged, *into.alongside, *into.commands), commands)
        except Unwind:
            raise  # a crash test's Crash, a replay's Halt: nothing settles
        except BaseException as exc:  # SystemExit and the like are the hook's failure too
            # (asyncio would re-raise them out of the loop, stopping every Run of the host),
            # and so is a CancelledError (see above)
            del execution.injected[live:]  # a hook that fails hands nothing, as it returns
            raise HookFailed(hook, hook_input.point, exc) from exc
        into.handed += handed
        into.commands.extend(commands)
        into.context.extend(context)
        for reaction in reactions:
            if isinstance(reaction, DenyCall):
                into.denied.setdefault(reaction.call_id, reaction.reason)
            else:
                execution.react(reaction)


def check_handed(
    so_far: int,
    commands: Sequence[Command],
    live: Sequence[str],
    reactions: Sequence[Reaction],
    limits: Limits,
) -> int:
    """The bytes a hook (or a session's handler) hands the commit its output rides with:
    its state commands and the messages it injected, live or as reactions. Each is
    within its own limit; past ``input_bytes`` together with what the hooks before it
    handed (``so_far``) they are refused (InputRefused), and the hook that went over
    fails by name — not the store refusing the commit, nor the thread's state_bytes,
    with no one to blame."""
    texts = [*live, *(r.text for r in reactions if isinstance(r, InjectMessage))]
    adds = sum(map(handed_bytes, commands)) + sum(map(stored_size, texts))
    if so_far + adds > limits.input_bytes:
        raise InputRefused(
            "hooks' output",
            "input_bytes",
            f"the messages injected and state commands the hooks hand one commit would be "
            f"{so_far + adds} bytes together; the limit is {limits.input_bytes}",
        )
    return adds


def _merge_check(state: StateView, before: Sequence[Command], commands: list[Command]) -> None:
    """StateConflict if ``commands`` cannot merge with those their commit already holds;
    nothing if those clash among themselves (a wave's tools writing one exclusive key):
    that is not the hook's doing, and the commit itself says so. Only the keys the hook
    writes are merged: a large commutative key it does not touch would be merged again
    for every hook call of a Step."""
    touched = {(c.scope, c.key) for c in commands}
    before = [c for c in before if (c.scope, c.key) in touched]
    try:
        apply_commands(state, before)
    except StateConflict:
        return
    apply_commands(state, (*before, *commands))


def _admitted(
    out: object, hook: Hook, seen: HookInput, limits: Limits
) -> tuple[list[Command], list[ContextMessage], list[Reaction]]:
    """A hook's output, validated: Commands within the state limits and on keys it may
    write, context text that can be sent, reactions this point can apply. Raises (the
    caller blames the hook)."""
    if not isinstance(out, HookOutput):
        raise TypeError(f"a hook returns a HookOutput or None, not {type(out).__name__}")
    try:
        commands = _COMMANDS.validate_python(list(out.commands))
        context = _CONTEXT.validate_python(list(out.context))
        reactions = _REACTIONS.validate_python(list(out.reactions))
    except ValidationError as exc:
        raise InputRefused("hook output", "type", printable(str(exc), 500)) from None
    for reaction in reactions:
        _check_reaction(reaction, seen, limits)
    for cmd in commands:
        check_writable(cmd, hook.keys)
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
    return commands, context, reactions


def _check_reaction(reaction: Reaction, seen: HookInput, limits: Limits) -> None:
    if isinstance(reaction, DenyCall):
        calls = getattr(seen.response, "tool_calls", ()) if seen.point == "AfterInference" else ()
        if all(c.call_id != reaction.call_id for c in calls):
            raise InputRefused(
                "a deny_call reaction",
                "reaction",
                f"call {reaction.call_id!r} is not one the model just asked for "
                "(deny_call is an AfterInference reaction)",
            )
    check_reaction_text(reaction, limits)
