"""An Agent: model, tools, limits, hooks. Defined in user code, addressed by reference."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeGuard

from pydantic import ValidationError

from runtime.batch import ToolRecoveryPolicy
from runtime.delegation import DelegationLimits
from runtime.errors import AgentImportError, ToolDefinitionError
from runtime.execution import ExecutionView, Side
from runtime.hooks import Gate, Hook, RunEndGuard
from runtime.ids import RunId, ThreadId
from runtime.limits import printable, raised
from runtime.messages import Message
from runtime.models import Model
from runtime.plugins import DuplicateId, Plugin, PluginRefused, ResolvedExecutionEnv, resolve
from runtime.tools import Tool, check_deployable
from runtime.usage import Budget


@dataclass(frozen=True)
class HandlerInput:
    """What a handler-backed side sees when its turn comes."""

    run_id: RunId
    thread_id: ThreadId
    turn: int
    """Turns taken so far in the session (this one is the next)."""
    messages: Sequence[Message]
    """The session as this side sees it: its own turns as assistant messages, the other
    side's answers as user messages (``runtime.session.view``)."""
    execution: ExecutionView
    """The Run as it is now, read only: the live controls are the way to change it."""


Handler = Callable[[HandlerInput], "str | Awaitable[str | None] | None"]
"""A handler's turn: its message, or None to end the session (the Run ends naturally)."""


@dataclass(frozen=True)
class SessionSide:
    """Side ``b`` of a session: backed by a model (an Agent), a handler, or a human."""

    agent: Agent | None = None
    handler: Handler | None = None
    human: str | None = None
    """A human: the prompt of the ``user_input`` ticket the Run awaits on its turn."""
    name: str = ""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.agent, self.handler, self.human)) != 1:
            raise ValueError("a session side is backed by exactly one of agent, handler, human")
        for part, kind in (("agent", Agent), ("human", str)):
            value = getattr(self, part)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"a session side's {part} is a {kind.__name__}, not {value!r:.80}")
        if self.handler is not None and not callable(self.handler):
            raise TypeError(f"a session side's handler is a function, not {self.handler!r:.80}")
        if self.agent is not None and self.agent.plugins:
            raise ValueError(
                "a session side's agent may not have plugins (they are pinned per Run, by "
                "the session's own agent): give them to that agent"
            )
        if self.agent is not None and self.agent.session is not None:
            raise ValueError("a session side's agent cannot hold a session of its own")
        if not self.name:
            default = self.agent.name if self.agent is not None else self.backing
            object.__setattr__(self, "name", default)

    @property
    def backing(self) -> Literal["model", "handler", "human"]:
        return "model" if self.agent else "handler" if self.handler else "human"


@dataclass(frozen=True)
class Session:
    """A dual-side session (``runtime.session``): the agent is side ``a``; turns
    alternate with ``b`` until ``max_session_turns`` turns (of any backing) were taken."""

    b: SessionSide
    max_session_turns: int = 8
    first: Side = "a"

    def __post_init__(self) -> None:
        if not _counts(self.max_session_turns):  # 1.5 would give 2 turns, "3" a TypeError
            raise ValueError(
                f"max_session_turns must be an integer of at least 1, not "
                f"{self.max_session_turns!r}"
            )
        if self.first not in ("a", "b"):
            raise ValueError("first is 'a' or 'b'")


def _counts(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_seconds(value: object) -> TypeGuard[float]:
    """A finite, non-negative number of seconds."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int no float holds (10**400): not a number of seconds
        return False


@dataclass(frozen=True)
class Agent:
    name: str
    model: Model
    tools: Sequence[Tool] = ()
    max_steps: int = 16
    """The Run ends ``max_steps`` after this many inferences; tools are withheld on the last."""
    policies: Mapping[str, ToolRecoveryPolicy] = field(default_factory=dict)
    """Per tool id, overrides the tool's default recovery policy."""
    hooks: Sequence[Hook] = ()
    plugins: Sequence[Plugin] = ()
    """Resolved when the agent is made (``resolved``, ``plugins_refused``)."""
    gates: Sequence[Gate] = ()
    """Tool gates, run for every requested call where the permission gate runs."""
    run_end_guards: Sequence[RunEndGuard] = ()
    """Checked before a natural end; a guard's reason refuses it (``runtime.hooks``)."""
    system: str = ""
    """The system prompt, sent with every inference (``InferenceRequest.system``)."""
    inference_attempts: int = 2
    """Attempts per inference before the Run ends failed(inference)."""
    inference_timeout_s: float = 600.0
    """The longest one attempt at an inference may take, its whole stream included: a
    provider that keeps a stream open with pings or empty chunks (which reset an SDK's
    read timeout) fails its attempt ``ModelUnavailable("timeout")`` past it."""
    budget: Budget | None = None
    """Bounds on each Run's tokens and cost; past them the Run pauses (``runtime.usage``)."""
    rate_limit_wait_s: float = 60.0
    """Seconds a Run may spend waiting out rate limits (``ModelRateLimited``) in all;
    a wait beyond it pauses the Run ``awaiting(pause(rate_limit))`` instead."""
    delegation: DelegationLimits = field(default_factory=DelegationLimits)
    """Limits on the child Runs this agent's Runs may start."""
    session: Session | None = None
    """Make each Run a dual-side session with this agent as side ``a``."""
    _by_id: Mapping[str, Tool] = field(init=False, repr=False, compare=False)
    """The tools by id: looked up several times for every call of every Step."""
    delegating: bool = field(init=False, repr=False, compare=False)
    """Whether any tool starts child Runs (if none, no call needs looking at for that)."""
    deployed_tools: tuple[Tool, ...] = field(init=False, repr=False, compare=False)
    """Its tools and those of its session's other side: what its executors run."""

    resolved: ResolvedExecutionEnv | None = field(init=False, repr=False, compare=False)
    """The plugins, resolved (``runtime.plugins``): their tools, hooks, gates and guards
    are the agent's too (plugins' hooks before its own); None without plugins."""
    plugins_refused: PluginRefused | None = field(init=False, repr=False, compare=False)
    """Why the plugins cannot be resolved: a Run of this agent is committed as ended
    ``failed(capability_bound)`` at its start instead of executing."""

    def __post_init__(self) -> None:
        if not _counts(self.max_steps):
            raise ValueError(f"max_steps must be an integer of at least 1, not {self.max_steps!r}")
        if not _counts(self.inference_attempts):
            raise ValueError(
                f"inference_attempts must be an integer of at least 1, not "
                f"{self.inference_attempts!r}"
            )
        for name in ("inference_timeout_s", "rate_limit_wait_s"):
            value = getattr(self, name)
            if not is_seconds(value) or (name == "inference_timeout_s" and value == 0):
                raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
        for name, kind in (("budget", Budget), ("session", Session)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):  # a dict from a config file
                raise TypeError(f"{name} must be a {kind.__name__} or None, not {value!r:.80}")
        if not isinstance(self.delegation, DelegationLimits):
            raise TypeError(f"delegation must be a DelegationLimits, not {self.delegation!r:.80}")
        self._check_parts()
        self._resolve_plugins()
        ids = [t.id for t in self.tools]
        if len(set(ids)) != len(ids):
            raise ToolDefinitionError(f"agent {self.name}: duplicate tool ids {ids}")
        object.__setattr__(self, "_by_id", {t.id: t for t in self.tools})
        object.__setattr__(self, "delegating", any(t.delegates for t in self.tools))
        deployed = dict(self._by_id)
        other = self.session.b.agent if self.session is not None else None
        for t in other.tools if other is not None else ():
            if deployed.setdefault(t.id, t) is not t:
                raise ToolDefinitionError(
                    f"agent {self.name}: the sides have different tools {t.id!r}"
                )
        object.__setattr__(self, "deployed_tools", tuple(deployed.values()))

    def _check_parts(self) -> None:
        """What the Run would meet only later, refused now: a part of the wrong kind
        ended Runs ``failed(internal)`` (a bug of Ratchet's, it said) at their first use,
        and a recovery policy built with ``model_construct`` was pinned into the batch
        as it was, and committed into a record no read decodes."""
        if not isinstance(self.name, str) or not isinstance(self.system, str):
            raise TypeError(f"an agent's name and system prompt are text: {self.name!r:.80}")
        if not callable(getattr(self.model, "stream", None)):  # the Model protocol's one method
            raise TypeError(
                f"agent {self.name}: a model has a stream(request) method "
                f"(runtime.models.Model), not {self.model!r:.80}"
            )
        for part in ("tools", "hooks", "gates", "run_end_guards"):
            given = getattr(self, part)
            if isinstance(given, str | bytes) or not isinstance(given, Iterable):
                raise TypeError(f"agent {self.name}: {part} is a sequence, not {given!r:.80}")
        for t in self.tools:
            if not isinstance(t, Tool):
                raise ToolDefinitionError(
                    f"agent {self.name}: a tool is made with @tool, not {t!r:.80}"
                )
            check_deployable(t)
        for hook in self.hooks:
            if not isinstance(hook, Hook):
                raise TypeError(f"agent {self.name}: a hook is a Hook, not {hook!r:.80}")
        for fn in (*self.gates, *self.run_end_guards):
            if not callable(fn):
                raise TypeError(f"agent {self.name}: gates and guards are functions: {fn!r:.80}")
        if not isinstance(self.policies, Mapping):
            raise ToolDefinitionError(
                f"agent {self.name}: policies map tool ids to ToolRecoveryPolicy, "
                f"not {self.policies!r:.80}"
            )
        policies = {}
        for tool_id, policy in self.policies.items():
            try:  # validated again, from its fields: one built with model_construct too
                fields = dict(policy) if isinstance(policy, ToolRecoveryPolicy) else policy
                policies[tool_id] = ToolRecoveryPolicy.model_validate(fields)
            except ValidationError as exc:
                raise ToolDefinitionError(
                    f"agent {self.name}: the policy for {tool_id!r:.80} is no "
                    f"ToolRecoveryPolicy: {printable(str(exc), 500)}"
                ) from None
        object.__setattr__(self, "policies", policies)

    def _resolve_plugins(self) -> None:
        env, refused = None, None
        if self.plugins:
            try:
                env = resolve(self.plugins)
            except PluginRefused as exc:
                refused = exc
        own = {t.id for t in self.tools}
        clash = next((t.id for t in env.tools if t.id in own), None) if env else None
        if clash is not None:
            env, refused = None, DuplicateId("(agent)", f"tool {clash!r}", "the agent has one")
        object.__setattr__(self, "resolved", env)
        object.__setattr__(self, "plugins_refused", refused)
        if env is not None:  # every part of the Run sees one set of tools, hooks, gates
            object.__setattr__(self, "tools", (*self.tools, *env.tools))
            object.__setattr__(self, "hooks", (*env.hooks, *self.hooks))
            object.__setattr__(self, "gates", (*self.gates, *env.gates))
            guards = (*self.run_end_guards, *env.run_end_guards)
            object.__setattr__(self, "run_end_guards", guards)

    def tool(self, tool_id: str) -> Tool | None:
        """The tool this agent's model may call."""
        return self._by_id.get(tool_id)

    def deployed_tool(self, tool_id: str) -> Tool | None:
        """A tool any side of its Runs may call (what executors run for this agent)."""
        found = self._by_id.get(tool_id)
        if found is None and len(self.deployed_tools) > len(self._by_id):
            found = next((t for t in self.deployed_tools if t.id == tool_id), None)
        return found

    def policy_for(self, tool: Tool) -> ToolRecoveryPolicy:
        return self.policies.get(tool.id, tool.default_policy)


def load_agent(ref: str) -> Agent:
    """Resolve ``module:attr`` to an Agent (an Agent, or a zero-argument factory of one)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AgentImportError(f"agent reference {ref!r} must look like 'package.module:name'")
    # whatever the module's code raises is the agent's failure, never the caller's: a
    # SystemExit or a BaseException of its own included (in a RunHost it would end the
    # process, and every Run it drives with it)
    try:  # a relative name, the module's own error
        module = importlib.import_module(module_name)
    except BaseException as exc:
        why = f"cannot import module {module_name!r} for {ref!r}: {raised(exc)}"
        raise AgentImportError(why[:2000]) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise AgentImportError(f"module {module_name!r} has no attribute {attr!r}") from exc
    except BaseException as exc:  # a module __getattr__ of its own
        raise AgentImportError(f"looking up {ref!r} raised {raised(exc)}"[:2000]) from exc
    # only a function of that module is a factory: a reference must never call whatever
    # else is callable there (a class, os:abort, builtins:input)
    if inspect.isfunction(obj) and obj.__module__ == module.__name__:
        try:
            obj = obj()
        except BaseException as exc:
            why = f"the agent factory {ref!r} raised {raised(exc)}"
            raise AgentImportError(why[:2000]) from exc
    if not isinstance(obj, Agent):
        raise AgentImportError(f"{ref!r} is a {type(obj).__name__}, not an Agent")
    return obj


IMPORT_WAIT_S = 60.0
"""How long a request waits for an agent's import before hearing AgentImportError."""


class AgentImports:
    """Agents imported in a thread, once for all who ask meanwhile: a module may list an
    MCP server's tools as it is imported (``mcp_tools``), which on an event loop would
    hold everything else on it for as long as that server takes. An import that fails
    raises to everyone waiting for it, and is tried again by the next one to ask.

    An import that hangs (a server its module connects to without a timeout) is waited
    for ``wait_s`` at most: past it, whoever asked hears AgentImportError, as for an
    import that failed (a host's recovery counts it and tries again later), rather than
    waiting for ever with every request queued behind it. The thread cannot be stopped;
    the next to ask joins it, and none is started beside it."""

    def __init__(self, wait_s: float = IMPORT_WAIT_S) -> None:
        self.wait_s = wait_s
        self._loading: dict[str, asyncio.Future[Agent]] = {}

    async def load(self, ref: str) -> Agent:
        loading = self._loading.get(ref)
        if loading is None:
            loading = asyncio.ensure_future(asyncio.to_thread(load_agent, ref))
            self._loading[ref] = loading
            loading.add_done_callback(lambda _: self._loading.pop(ref, None))
        try:
            return await asyncio.wait_for(asyncio.shield(loading), self.wait_s)
        except TimeoutError:
            raise AgentImportError(
                f"importing {ref!r} has taken over {self.wait_s:g}s (still under way)"
            ) from None
