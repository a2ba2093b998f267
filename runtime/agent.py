"""An Agent: model, tools, limits, hooks. Defined in user code, addressed by reference."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.batch import ToolRecoveryPolicy
from runtime.delegation import DelegationLimits
from runtime.errors import AgentImportError
from runtime.hooks import Gate, Hook, RunEndGuard
from runtime.models import Model
from runtime.plugins import DuplicateId, Plugin, PluginRefused, ResolvedExecutionEnv, resolve
from runtime.tools import Tool
from runtime.usage import Budget


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
    budget: Budget | None = None
    """Bounds on each Run's tokens and cost; past them the Run pauses (``runtime.usage``)."""
    rate_limit_wait_s: float = 60.0
    """Seconds a Run may spend waiting out rate limits (``ModelRateLimited``) in all;
    a wait beyond it pauses the Run ``awaiting(pause(rate_limit))`` instead."""
    delegation: DelegationLimits = field(default_factory=DelegationLimits)
    """Limits on the child Runs this agent's Runs may start."""
    _by_id: Mapping[str, Tool] = field(init=False, repr=False, compare=False)
    """The tools by id: looked up several times for every call of every Step."""
    delegating: bool = field(init=False, repr=False, compare=False)
    """Whether any tool starts child Runs (if none, no call needs looking at for that)."""

    resolved: ResolvedExecutionEnv | None = field(init=False, repr=False, compare=False)
    """The plugins, resolved (``runtime.plugins``): their tools, hooks, gates and guards
    are the agent's too (plugins' hooks before its own); None without plugins."""
    plugins_refused: PluginRefused | None = field(init=False, repr=False, compare=False)
    """Why the plugins cannot be resolved: a Run of this agent is committed as ended
    ``failed(capability_bound)`` at its start instead of executing."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        self._resolve_plugins()
        ids = [t.id for t in self.tools]
        if len(set(ids)) != len(ids):
            raise ValueError(f"agent {self.name}: duplicate tool ids {ids}")
        object.__setattr__(self, "_by_id", {t.id: t for t in self.tools})
        object.__setattr__(self, "delegating", any(t.delegates for t in self.tools))

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
        return self._by_id.get(tool_id)

    def policy_for(self, tool: Tool) -> ToolRecoveryPolicy:
        return self.policies.get(tool.id, tool.default_policy)


def load_agent(ref: str) -> Agent:
    """Resolve ``module:attr`` to an Agent (an Agent, or a zero-argument factory of one)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AgentImportError(f"agent reference {ref!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentImportError(f"cannot import module {module_name!r} for {ref!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise AgentImportError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if callable(obj) and not isinstance(obj, Agent):
        obj = obj()
    if not isinstance(obj, Agent):
        raise AgentImportError(f"{ref!r} is a {type(obj).__name__}, not an Agent")
    return obj
