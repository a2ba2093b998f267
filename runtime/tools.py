"""Tools: the ``@tool`` decorator and argument validation (calls run in ``runtime.tool_calls``).

A tool is a plain function. ``@tool`` builds a pydantic model of its arguments from
the signature; the parameter annotated ``ToolContext`` (if any) receives the call's
operation id and attempt. A tool signals "nothing was dispatched, safe to retry"
only by raising ``UnavailableBeforeDispatch``; any other exception is a finished
call whose error the model sees (its effect may have happened: it is never re-run).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, RootModel, ValidationError, create_model

from runtime.batch import RECOVERY_MODES, RecoveryMode, ToolRecoveryPolicy, WaitKind
from runtime.errors import InputRefused, ToolDefinitionError
from runtime.execution import ToolExecution
from runtime.frozen import FrozenDict, freeze
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.limits import (
    DEFAULT_LIMITS,
    Limits,
    check_json_value,
    json_depth,
    printable,
    raised,
)
from runtime.state import Command
from runtime.strict_json import DuplicateKey, unique_pairs
from runtime.tool_threads import CallStart, tool_threads

Concurrency = Literal["parallel", "serial"]
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""The tool names every model provider Ratchet talks to accepts (OpenAI's and
Anthropic's rule; MCP also allows dots): a tool named otherwise is refused when it is
made, not by the provider at the Run's first inference."""


class UnavailableBeforeDispatch(Exception):
    """Raised by a tool before any external effect: the call may safely be retried."""


class OutcomeUnknown(Exception):
    """Raised by a tool that lost touch with what it called after the request left (a
    connection dropped mid-call): it may have run, so the call is lost and its pinned
    recovery policy decides (``never_replay``: indeterminate)."""


@dataclass(frozen=True)
class ToolContext:
    """What a running tool may know about its call."""

    operation_id: OperationId
    """Stable across retries: hand it to downstream systems for deduplication."""
    attempt: int
    call_id: CallId
    run_id: RunId
    thread_id: ThreadId
    prompt_path: tuple[str, ...] = ()
    epoch: int = 0
    """The owner epoch of the engine that sent this call. It only grows: a downstream
    system that records the highest epoch seen per operation id can refuse a call from a
    zombie engine (a lower epoch) after another took the Run over."""
    execution: ToolExecution | None = None
    """The Run's ExecutionState as the call was sent, the call's abort signal, and the
    requests the tool may make of its Run (``runtime.execution``)."""


@dataclass(frozen=True)
class ToolResult:
    """A tool's return value when it also stages state commands."""

    content: Any
    commands: Sequence[Command] = ()
    is_error: bool = False


@dataclass(frozen=True)
class Tool:
    id: str
    fn: Callable[..., Any]
    args_model: type[BaseModel]
    context_param: str | None
    recovery: tuple[RecoveryMode, ...]
    concurrency: Concurrency
    wait: WaitKind | None = None
    """A call of this tool first waits: for ``permission`` (then runs), an
    ``external_result`` (a client-executed tool: the caller supplies the output) or a
    ``scheduled_action`` (runs when the schedule fires)."""
    wait_deadline_s: float | None = None
    """Reject a resume that arrives later than this after the wait began."""
    resources: Mapping[str, float] = field(default_factory=dict)
    timeout_s: float | None = None
    description: str = ""
    delegates: bool = False
    """A delegation tool: its calls start child Runs (runtime.delegation)."""
    sees_history: bool = False
    """Its calls are sent the Run's live message history (``ctx.execution``); off by
    default, since the history would travel with every call."""

    def with_delegation(self) -> Tool:
        return replace(self, delegates=True)

    @property
    def default_policy(self) -> ToolRecoveryPolicy:
        """Built once (it is asked for every call the model makes); records are immutable."""
        cached: ToolRecoveryPolicy | None = self.__dict__.get("_policy")
        if cached is None:
            cached = ToolRecoveryPolicy(mode=self.recovery[0])
            object.__setattr__(self, "_policy", cached)
        return cached

    def supports(self, mode: RecoveryMode) -> bool:
        """never_replay is always honoured: it only ever does less."""
        return mode == "never_replay" or mode in self.recovery

    def parse(self, arguments: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
        """Validate the model's raw JSON; raises ValueError with a model-readable message
        (JSON nested deeper than ``limits.json_depth`` is refused before it is parsed)."""
        # it cannot nest deeper than it opens: count first, scan only what may be deep
        opened = arguments.count("[") + arguments.count("{")
        depth = json_depth(arguments) if opened > limits.json_depth else opened
        if depth > limits.json_depth:
            raise ValueError(
                f"arguments nest {depth} deep; the limit json_depth is {limits.json_depth}"
            )
        try:
            # a key twice means two things to two parsers: the tool would run with the
            # last value while the committed text (that hooks, tickets and audits read)
            # holds both
            raw = _strict_loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments are not valid JSON: {exc.msg}") from exc
        except DuplicateKey as exc:
            raise ValueError(f"arguments are not valid: {exc}") from None
        except RecursionError:  # json_depth counts what json nests; belt and braces
            raise ValueError("arguments nest too deeply to parse") from None
        if not isinstance(raw, dict):
            raise ValueError("arguments must be a JSON object")
        # an escaped lone surrogate, 1e400, NaN: no tool (nor MCP server) can take it. The
        # raw text's size was held to tool_arguments_bytes already; its canonical form
        # may be a little longer ("1e5" is 100000.0), so the bound here is only a backstop
        most = 2 * limits.tool_arguments_bytes
        try:
            check_json_value("arguments", raw, most, "tool_arguments_bytes", limits)
        except InputRefused as exc:
            raise ValueError(printable(str(exc))) from None
        try:
            checked = self.args_model.model_validate(raw).model_dump(mode="json")
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(printable(f"invalid arguments for {self.id}: {problems}")) from exc
        except BaseException as exc:  # a validator of the tool's own that raised KeyError,
            # SystemExit...: the model's arguments, refused; not a failed Run
            raise ValueError(printable(f"invalid arguments for {self.id}: {raised(exc)}")) from None
        # a typed parameter travels as the model sent it, to be validated once into its
        # type where the tool runs (``_typed``): its dump is not always what validates back
        # to it (a model with aliases, a validator that is not idempotent)
        checked.update((name, raw[name]) for name in self._typed_fields() if name in raw)
        return checked

    def _typed_fields(self) -> tuple[str, ...]:
        """The parameters whose JSON form is not their type (built once)."""
        typed: tuple[str, ...] | None = self.__dict__.get("_typed_names")  # asked every call
        if typed is None:
            root = issubclass(self.args_model, RootModel)  # the arguments whole (MCP's)
            fields = self.args_model.model_fields.items()
            typed = () if root else tuple(n for n, f in fields if not _json_native(f.annotation))
            object.__setattr__(self, "_typed_names", typed)
        return typed

    def _typed(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments as its parameters are typed: they travel as JSON, so a
        ``datetime``, ``Decimal``, ``Enum``, model or tuple parameter is validated into its
        type here (once: ``parse`` sent it as the model did); plain JSON types go as
        they are."""
        if not self._typed_fields():
            return dict(arguments)
        model = self.args_model.model_validate(arguments)
        return {name: getattr(model, name) for name in type(model).model_fields}

    def schema(self) -> dict[str, Any]:
        """The tool's schema for the model (built once: it is asked for every inference),
        deeply immutable: every request shares it, and a model or an adapter that changed
        a part of it in place would change it for every later request (TypeError)."""
        cached: dict[str, Any] | None = self.__dict__.get("_schema")
        if type(cached) is not FrozenDict:
            cached = freeze(cached if cached is not None else self._build_schema())
            object.__setattr__(self, "_schema", cached)
        assert cached is not None
        return cached

    def _build_schema(self) -> dict[str, Any]:
        return {
            "name": self.id,
            "description": self.description,
            "parameters": self.args_model.model_json_schema(),
        }

    async def invoke(
        self, arguments: dict[str, Any], ctx: ToolContext, start: CallStart | None = None
    ) -> Any:
        """Call the tool: a coroutine function on the event loop, any other function in
        the process's tool threads (``tool_threads``), so a blocking call never
        stalls the other calls of this process. A synchronous call that times out or
        is cancelled cannot be interrupted: its thread runs it to its end, and what it
        returns is dropped. ``start`` notes whether the call began (a synchronous one
        may wait for a thread, and one given up before that never runs)."""
        on_loop: bool | None = self.__dict__.get("_on_loop")  # asked for every call
        if on_loop is None:
            on_loop = inspect.iscoroutinefunction(self.fn)
            object.__setattr__(self, "_on_loop", on_loop)
        # SystemExit and KeyboardInterrupt are turned into an ordinary error here, in the
        # call's own frame: asyncio re-raises them out of the event loop, which would stop
        # every Run of the process, not fail this call (a parameter's validator included)
        start = start or CallStart()
        try:
            kwargs = self._typed(arguments)
            if self.context_param is not None:
                kwargs[self.context_param] = ctx
            if on_loop:
                start.begin()
                return await self.fn(**kwargs)
            texted = functools.partial(_texted, self.fn)
            call = functools.partial(start.run, contextvars.copy_context().run, texted, **kwargs)
            start.pool = tool_threads()
            result = await asyncio.get_running_loop().run_in_executor(start.pool, call)
            if inspect.isawaitable(result):
                result = await result
            return result
        except (SystemExit, KeyboardInterrupt) as exc:
            raise ToolExited(f"the tool raised {type(exc).__name__}") from None


def as_text(value: Any) -> str:
    """A tool's result as the model reads it: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


class Untextable(Exception):
    """What a synchronous tool returned cannot be made text (``_texted``)."""


def _texted(fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """A synchronous tool's result, made text in its own thread: on the event loop, a
    large result (or one whose ``__str__`` blocks) stalled every Run of the process,
    past the call's own ``timeout_s``."""
    result = fn(**kwargs)
    try:
        if isinstance(result, ToolResult):
            return replace(result, content=as_text(result.content))
        return result if inspect.isawaitable(result) else as_text(result)
    except BaseException as exc:  # its __str__ may raise anything, SystemExit included
        raise Untextable(raised(exc)) from None


_JSON_TYPES: frozenset[Any] = frozenset({str, int, float, bool, Any, dict, list, type(None)})


def _json_native(annotation: Any) -> bool:
    """Whether an argument of this type is already what its JSON form is (``Tool._typed``
    validates it no further): JSON's own types, and lists, dicts and unions of them."""
    if annotation in _JSON_TYPES:
        return True
    origin = get_origin(annotation)
    if origin in (list, dict, Union, UnionType):
        return all(_json_native(a) for a in get_args(annotation))
    return False


@overload
def tool(
    fn: Callable[..., Any],
    /,
    *,
    name: str | None = None,
    recovery: Sequence[RecoveryMode] = ("never_replay",),
    concurrency: Concurrency = "parallel",
    needs_permission: bool = False,
    wait: WaitKind | None = None,
    wait_deadline_s: float | None = None,
    resources: Mapping[str, float] | None = None,
    timeout_s: float | None = None,
    sees_history: bool = False,
) -> Tool: ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    recovery: Sequence[RecoveryMode] = ("never_replay",),
    concurrency: Concurrency = "parallel",
    needs_permission: bool = False,
    wait: WaitKind | None = None,
    wait_deadline_s: float | None = None,
    resources: Mapping[str, float] | None = None,
    timeout_s: float | None = None,
    sees_history: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    recovery: Sequence[RecoveryMode] = ("never_replay",),
    concurrency: Concurrency = "parallel",
    needs_permission: bool = False,
    wait: WaitKind | None = None,
    wait_deadline_s: float | None = None,
    resources: Mapping[str, float] | None = None,
    timeout_s: float | None = None,
    sees_history: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Declare a tool; usable bare (``@tool``) or with options (``@tool(recovery=...)``).

    ``recovery`` lists the modes the tool supports; the first is its default policy.
    ``needs_permission=True`` is short for ``wait="permission"``.
    """
    if needs_permission and wait not in (None, "permission"):
        raise ToolDefinitionError("needs_permission=True conflicts with another wait kind")
    check_wait(name or getattr(fn, "__name__", None), wait)
    declared: WaitKind | None = "permission" if needs_permission else wait
    if wait_deadline_s is not None and declared is None:
        # a deadline on a wait that never happens would be silently ignored
        raise ToolDefinitionError(
            "wait_deadline_s bounds a wait: give the tool one (wait=... or needs_permission=True)"
        )

    def build(f: Callable[..., Any]) -> Tool:
        tool_id = f.__name__ if name is None else name
        check_seconds(tool_id, "wait_deadline_s", wait_deadline_s)
        built = _build_tool(
            f, tool_id, tuple(recovery), concurrency, dict(resources or {}), timeout_s
        )
        return replace(
            built, wait=declared, wait_deadline_s=wait_deadline_s, sees_history=sees_history
        )

    return build(fn) if fn is not None else build


def _build_tool(
    fn: Callable[..., Any],
    tool_id: str,
    recovery: tuple[RecoveryMode, ...],
    concurrency: Concurrency,
    resources: dict[str, float],
    timeout_s: float | None,
) -> Tool:
    if not (isinstance(tool_id, str) and TOOL_NAME.fullmatch(tool_id)):
        raise ToolDefinitionError(
            f"tool {tool_id!r:.80}: a tool name must be 1 to 64 letters, digits, '_' or '-' "
            "(what model providers accept); name it with @tool(name=...)"
        )
    unknown = [m for m in recovery if m not in RECOVERY_MODES]
    if not recovery or unknown:
        raise ToolDefinitionError(f"tool {tool_id}: unknown or empty recovery modes {unknown}")
    if concurrency not in ("parallel", "serial"):
        raise ToolDefinitionError(f"tool {tool_id}: concurrency must be parallel or serial")
    check_seconds(tool_id, "timeout_s", timeout_s)
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        # its call returns a generator, the body never run: taken for its result text
        raise ToolDefinitionError(f"tool {tool_id}: a generator function cannot be a tool")
    fields, context_param = _signature_fields(fn, tool_id)
    # no NaN or infinity: no JSON holds one (a "nan" text would pass a float parameter)
    config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model = create_model(f"{tool_id}_args", __config__=config, **fields)
    return Tool(
        id=tool_id,
        fn=fn,
        args_model=model,
        context_param=context_param,
        recovery=recovery,
        concurrency=concurrency,
        resources=resources,
        timeout_s=timeout_s,
        description=inspect.getdoc(fn) or "",
    )


TOOL_WAITS: tuple[WaitKind, ...] = ("permission", "external_result", "scheduled_action")
"""The waits a tool may declare. ``delegation`` is the runtime's own: a delegating call
waits so while its lone child waits, and only that child's end answers it."""


def check_wait(tool_id: str | None, wait: object) -> None:
    """Refused when the tool is built: a tool that declared ``delegation`` waited for a
    child it never had, every answer and its expiry refused, and only a cancel ended its
    Run."""
    named = f"tool {tool_id}: " if tool_id else ""  # @tool(...) given no name yet
    if wait == "delegation":
        raise ToolDefinitionError(
            f"{named}wait='delegation' is the runtime's own wait of a delegating "
            "call for its child (runtime.delegation.delegate_tool); a tool declares "
            f"{', '.join(TOOL_WAITS)}"
        )
    if wait is not None and wait not in TOOL_WAITS:
        raise ToolDefinitionError(
            f"{named}wait is one of {', '.join(TOOL_WAITS)} or None, not {wait!r:.80}"
        )


MAX_SECONDS = 10**9
"""About 31 years: a longer bound is no bound (give None), and one of 1e308 seconds
overflowed when a call's deadline was made of it."""


def check_deployable(tool: Tool) -> None:
    """The options of ``tool`` as ``@tool`` checked them, checked again where a Tool is
    taken in (an agent's, a plugin's): one changed since (``dataclasses.replace``) is
    not, and a plugin's went unchecked (ToolDefinitionError)."""
    for option in ("wait_deadline_s", "timeout_s"):
        check_seconds(tool.id, option, getattr(tool, option))
    check_wait(tool.id, tool.wait)


def check_seconds(tool_id: str, option: str, value: float | None) -> None:
    """Refused when the tool is built, not when a call first meets it: NaN never
    compares, infinity cannot be stored as a deadline (None is "no bound"), and zero or
    less has passed before anything could run."""
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_SECONDS
    ):
        bits = value.bit_length() if isinstance(value, int) else 0  # repr() may refuse it
        shown = f"an integer of {bits} bits" if bits > 64 else f"{value!r:.80}"
        raise ToolDefinitionError(
            f"tool {tool_id}: {option} must be a positive number of seconds up to "
            f"{MAX_SECONDS} or None, not {shown}"
        )


def _signature_fields(fn: Callable[..., Any], tool_id: str) -> tuple[dict[str, Any], str | None]:
    try:
        hints = get_type_hints(fn)
    except Exception as exc:
        raise ToolDefinitionError(f"tool {tool_id}: cannot resolve annotations: {exc}") from exc
    fields: dict[str, Any] = {}
    context_param = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {tool_id}: *args and **kwargs are not supported")
        if param.kind is param.POSITIONAL_ONLY:  # arguments are passed by name
            raise ToolDefinitionError(f"tool {tool_id}: positional-only {param.name} (before /)")
        hint = hints.get(param.name, Any)
        if hint is ToolContext or ToolContext in get_args(hint):
            context_param = param.name
            continue
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hint, default)
    return fields, context_param


_STRICT = json.JSONDecoder(object_pairs_hook=unique_pairs)
"""``json.loads(text, object_pairs_hook=unique_pairs)`` builds this decoder for every
call; it keeps no state between calls, so one serves them all."""


def _strict_loads(text: str) -> Any:
    """``json.loads(text, object_pairs_hook=unique_pairs)`` for ``text`` a str, decoded by
    the one decoder (the same refusal of a leading byte order mark first)."""
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _STRICT.decode(text)


class ToolExited(Exception):
    """A tool raised SystemExit or KeyboardInterrupt: its call failed, nothing more."""
