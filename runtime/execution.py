"""ExecutionState: what tools and hooks see of a Run while it executes (DESIGN §9, seed
``execution-state-and-run-status`` §2-3), and the reactions that control it.

A hook returns data: its ``HookOutput.reactions`` (``StopRun``, ``RequestInput``,
``Pause``, ``DenyCall``, ``InjectMessage``, ``ForceTurn``, ``StopSession``) are applied
by the engine in one place, ``ExecutionState.react``. The seed's controls
(``stop()``, ``force_turn()``, ``stop_session()``, ``inject_message()``) are the same
requests made by a call; a tool makes them on its ``ToolContext.execution``, a
``ToolExecution``, whose requests travel back with the call's result (a tool may run in
another process) and are applied when that result is committed. A request of a call
that did not finish (lost, unavailable) is dropped with it: a retry asks again.

``message_history`` is the live persisted history: the committed messages, the results
of the Step's finished calls, then the messages injected so far (committed with the
next commit; ``runtime.injection``). Request-only context never appears in it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import Field

from runtime.base import Frozen, Given
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import PauseReason, PauseTarget, UserInputTarget
from runtime.limits import DEFAULT_LIMITS, Limits, check_text
from runtime.messages import Message, UserMessage

Side = Literal["a", "b"]
SIDES: tuple[Side, ...] = ("a", "b")


class StopRun(Given):
    """End the loop after the current operation: the Run ends ``stopped(reason)``."""

    kind: Literal["stop"] = "stop"
    reason: str = "stopped from inside the run"


class StopSession(Given):
    """End the agent session terminally (the Run ends ``stopped(reason)`` and no side
    takes another turn); in a single-side Run the same as ``StopRun``."""

    kind: Literal["stop_session"] = "stop_session"
    reason: str = "session stopped"


class ForceTurn(Given):
    """The next turn of a session goes to ``side``, whoever's turn it would be."""

    kind: Literal["force_turn"] = "force_turn"
    side: Side


class InjectMessage(Given):
    """Add a user message to the persisted history (visible to later tools and hooks at
    once, committed with the next commit, sent with the next inference)."""

    kind: Literal["inject_message"] = "inject_message"
    text: str


class RequestInput(Given):
    """At the next Step boundary the Run awaits remote user input (held in the run
    state from the Step's next commit until then: ``runtime.context.wait_commands``)."""

    kind: Literal["request_input"] = "request_input"
    prompt: str = ""


class Pause(Given):
    """At the next Step boundary the Run awaits an explicit unpause (held as
    ``RequestInput`` is)."""

    kind: Literal["pause"] = "pause"
    reason: PauseReason = "manual"


class DenyCall(Given):
    """AfterInference only: the call does not run; the model sees ``denied: reason``."""

    kind: Literal["deny_call"] = "deny_call"
    call_id: str
    reason: str


Reaction = Annotated[
    StopRun | StopSession | ForceTurn | InjectMessage | RequestInput | Pause | DenyCall,
    Field(discriminator="kind"),
]
ToolRequest = Annotated[
    StopRun | StopSession | ForceTurn | InjectMessage, Field(discriminator="kind")
]
"""What a tool may ask of its Run (through ``ToolExecution``)."""


class ExecutionState:
    """A Run seen from inside, while it executes (``None`` at rest: there is none). The
    engine's own record, which only the engine writes: hooks and handlers are shown an
    ``ExecutionView`` of it, tools a ``ToolExecution``."""

    def __init__(
        self,
        run_id: RunId,
        thread_id: ThreadId,
        prompt_path: Sequence[str],
        cancel: asyncio.Event,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.run_id = run_id
        self.limits = limits
        self.thread_id = thread_id
        self.prompt_path = tuple(prompt_path)
        self.current_side: Side = "a"
        self.step_count = 0
        self.side_a_step_count = 0
        self.side_b_step_count = 0
        self.abort_signal = cancel
        """Set when the Run is cancelled or stopped from outside: await or poll it."""
        self.stop_reason: str | None = None
        self.stopped_by: Side | None = None
        self.session_stopped = False
        self.forced_side: Side | None = None
        self.wait_request: UserInputTarget | PauseTarget | None = None
        """The wait the Run takes at the next Step boundary; each commit records it in
        the run state, whence a resume or recovery restores it (``runtime.context``)."""
        self.injected: list[str] = []
        """Injected texts not yet staged for a commit (the engine takes them)."""
        self._history: Callable[[], tuple[Message, ...]] = tuple

    @property
    def flow_id(self) -> str:
        """The execution flow: the Run's id (a resumed or recovered Run keeps it)."""
        return self.run_id

    @property
    def cancel_signal(self) -> asyncio.Event:
        return self.abort_signal

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def message_history(self) -> tuple[Message, ...]:
        return self._history()

    def show_history(self, history: Callable[[], tuple[Message, ...]]) -> None:
        """Where ``message_history`` comes from (the engine's live view of the Run)."""
        self._history = history

    def stop(self, reason: str = "stopped from inside the run") -> None:
        self.react(StopRun(reason=reason))

    def stop_session(self, reason: str = "session stopped") -> None:
        self.react(StopSession(reason=reason))

    def force_turn(self, side: Side) -> None:
        self.react(ForceTurn(side=side))

    def inject_message(self, text: str) -> None:
        self.react(InjectMessage(text=text))

    def request_input(self, prompt: str = "") -> None:
        self.react(RequestInput(prompt=prompt))

    def pause(self, reason: PauseReason = "manual") -> None:
        self.react(Pause(reason=reason))

    def react(self, reaction: Reaction) -> None:
        """Apply one reaction (the one place they take effect; ``DenyCall`` is applied
        where the calls are gated, and is refused here). Its text is checked first: a
        hook calling ``stop()`` on the live state is held to what it may return."""
        if not isinstance(reaction, DenyCall):
            check_reaction_text(reaction, self.limits)
        if isinstance(reaction, StopRun | StopSession):
            if self.stop_reason is None:
                self.stop_reason, self.stopped_by = reaction.reason, self.current_side
            self.session_stopped = self.session_stopped or isinstance(reaction, StopSession)
        elif isinstance(reaction, ForceTurn):
            self.forced_side = reaction.side
        elif isinstance(reaction, InjectMessage):
            self.injected.append(reaction.text)
        elif isinstance(reaction, RequestInput):
            self.wait_request = UserInputTarget(prompt=reaction.prompt)
        elif isinstance(reaction, Pause):
            self.wait_request = PauseTarget(reason=reaction.reason)
        else:
            raise TypeError(f"{type(reaction).__name__} is not a reaction this point can apply")


class ReadOnlySignal:
    """The Run's abort signal as a hook sees it: awaited or polled, never set or cleared
    (set, it would cancel the Run as if from outside; cleared, it would hide a cancel
    from the checks that come after)."""

    __slots__ = ("_event",)

    def __init__(self, event: asyncio.Event) -> None:
        self._event = event

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> bool:
        return await self._event.wait()


class ExecutionView:
    """What a hook or a session's handler is shown of its Run: the live ExecutionState,
    read only. Its one way to change the Run is a live control (``stop()``, ...,
    ``react()``), checked as a returned reaction is (DESIGN §8: reactions are applied in
    one place). A field written directly (``stop_reason``, ``wait_request``, ...) would
    undo another hook's or a plugin's reaction unchecked, or hand a commit what no
    store holds: it raises AttributeError, and the hook that wrote it fails."""

    __slots__ = ("_signal", "_state")
    _state: ExecutionState
    _signal: ReadOnlySignal

    def __init__(self, state: ExecutionState) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_signal", ReadOnlySignal(state.abort_signal))

    def __setattr__(self, name: str, value: object) -> None:
        # said plainly: "has no setter" would leave the hook's author guessing how
        raise AttributeError(
            f"the Run's ExecutionView is read-only (writing {name!r}): change the Run by "
            "a reaction in the HookOutput, or a live control (stop(), pause(), ...)"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    run_id = property(lambda self: self._state.run_id)
    thread_id = property(lambda self: self._state.thread_id)
    flow_id = property(lambda self: self._state.flow_id)
    prompt_path = property(lambda self: self._state.prompt_path)
    limits = property(lambda self: self._state.limits)
    current_side = property(lambda self: self._state.current_side)
    step_count = property(lambda self: self._state.step_count)
    side_a_step_count = property(lambda self: self._state.side_a_step_count)
    side_b_step_count = property(lambda self: self._state.side_b_step_count)
    stopped = property(lambda self: self._state.stopped)
    stopped_by = property(lambda self: self._state.stopped_by)
    message_history = property(lambda self: self._state.message_history)
    abort_signal = property(lambda self: self._signal)
    """Set when the Run is cancelled or stopped from outside: await or poll it."""
    cancel_signal = abort_signal

    def stop(self, reason: str = "stopped from inside the run") -> None:
        self._state.stop(reason)

    def stop_session(self, reason: str = "session stopped") -> None:
        self._state.stop_session(reason)

    def force_turn(self, side: Side) -> None:
        self._state.force_turn(side)

    def inject_message(self, text: str) -> None:
        self._state.inject_message(text)

    def request_input(self, prompt: str = "") -> None:
        self._state.request_input(prompt)

    def pause(self, reason: PauseReason = "manual") -> None:
        self._state.pause(reason)

    def react(self, reaction: Reaction) -> None:
        self._state.react(reaction)


def check_reaction_text(reaction: Reaction, limits: Limits) -> None:
    """A reaction's text is storable and within its limit (InputRefused): an injected
    message is input, anything else is text the model or the Run's end holds."""
    if isinstance(reaction, InjectMessage):
        check_text("injected message", reaction.text, limits.input_bytes, "input_bytes")
        return
    text = getattr(reaction, "reason", None) or getattr(reaction, "prompt", "")
    what = "deny reason" if isinstance(reaction, DenyCall) else f"a {reaction.kind} reaction"
    check_text(what, str(text), limits.model_text_bytes, "model_text_bytes")


class ExecutionSnapshot(Frozen):
    """The ExecutionState a call is sent with (it may run in another process)."""

    flow_id: str
    current_side: Side = "a"
    step_count: int = 0
    side_a_step_count: int = 0
    side_b_step_count: int = 0
    stopped: bool = False
    stopped_by: Side | None = None
    prompt_path: tuple[str, ...] = ()
    message_history: tuple[Message, ...] | None = None
    """Only for tools declared ``@tool(sees_history=True)``: None for the others."""


def snapshot(
    execution: ExecutionState, history: tuple[Message, ...] | None = None
) -> ExecutionSnapshot:
    return ExecutionSnapshot(
        flow_id=execution.flow_id,
        current_side=execution.current_side,
        step_count=execution.step_count,
        side_a_step_count=execution.side_a_step_count,
        side_b_step_count=execution.side_b_step_count,
        stopped=execution.stopped,
        stopped_by=execution.stopped_by,
        prompt_path=execution.prompt_path,
        message_history=history,
    )


class AbortSignal:
    """Set when a call is cancelled or times out: ``await wait()`` on the loop, or poll
    ``is_set()`` from a synchronous tool's thread (thread-safe)."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        # a flag (a bool attribute is read and written whole under the GIL, as a
        # threading.Event's own flag is), and the loop's event made only for a waiter:
        # most calls end without anyone waiting on their signal
        self._set = False
        self._event: asyncio.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> bool:
        if self._event is None:
            self._event = asyncio.Event()
            if self._set:
                self._event.set()
        return await self._event.wait()


class ToolExecution:
    """A tool's view of its Run: the snapshot it was sent with, its abort signal, and
    the requests it makes (returned with its result: ``requests``)."""

    def __init__(self, seen: ExecutionSnapshot, abort: AbortSignal) -> None:
        self._seen = seen
        self.abort_signal = abort
        self.requests: list[StopRun | StopSession | ForceTurn | InjectMessage] = []
        self._lock = threading.Lock()  # a synchronous tool asks from its own thread

    flow_id = property(lambda self: self._seen.flow_id)
    current_side = property(lambda self: self._seen.current_side)
    step_count = property(lambda self: self._seen.step_count)
    side_a_step_count = property(lambda self: self._seen.side_a_step_count)
    side_b_step_count = property(lambda self: self._seen.side_b_step_count)
    stopped_by = property(lambda self: self._seen.stopped_by)
    prompt_path = property(lambda self: self._seen.prompt_path)

    @property
    def stopped(self) -> bool:
        """Stopped when the call was sent, or by this call since."""
        asked = any(isinstance(r, StopRun | StopSession) for r in self.requests)
        return self._seen.stopped or asked

    @property
    def message_history(self) -> tuple[Message, ...]:
        history = self._seen.message_history
        if history is None:
            raise AttributeError(
                "message_history is sent only to tools declared @tool(sees_history=True)"
            )
        injected = tuple(r for r in self.requests if isinstance(r, InjectMessage))
        if not injected:
            return history
        return (*history, *(UserMessage(id="", text=r.text) for r in injected))

    def _ask(self, request: StopRun | StopSession | ForceTurn | InjectMessage) -> None:
        with self._lock:
            self.requests.append(request)

    def stop(self, reason: str = "stopped by a tool") -> None:
        self._ask(StopRun(reason=reason))

    def stop_session(self, reason: str = "session stopped by a tool") -> None:
        self._ask(StopSession(reason=reason))

    def force_turn(self, side: Side) -> None:
        self._ask(ForceTurn(side=side))

    def inject_message(self, text: str) -> None:
        self._ask(InjectMessage(text=text))
