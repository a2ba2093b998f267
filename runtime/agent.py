"""An Agent: model, tools, limits, hooks. Defined in user code, addressed by reference."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.batch import ToolRecoveryPolicy
from runtime.delegation import DelegationLimits
from runtime.errors import AgentImportError
from runtime.hooks import Hook
from runtime.models import Model
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

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        ids = [t.id for t in self.tools]
        if len(set(ids)) != len(ids):
            raise ValueError(f"agent {self.name}: duplicate tool ids {ids}")
        object.__setattr__(self, "_by_id", {t.id: t for t in self.tools})
        object.__setattr__(self, "delegating", any(t.delegates for t in self.tools))

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
