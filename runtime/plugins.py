"""Plugins with capability bounds, resolved into the environment a Run executes in
(DESIGN §8).

A ``Plugin`` is a manifest ``{id, version, requires, bound}`` and a function returning
its ``Contributions``: tools, hooks, state keys with their merge policy, tool gates,
action kinds and run-end guards. ``resolve(plugins)`` makes a ``ResolvedExecutionEnv``
or refuses, with a ``PluginRefused`` naming the plugin and the item:

- ``MissingDependency``  a plugin requires one that is not selected;
- ``DependencyCycle``    the requirements form a cycle;
- ``DuplicateId``        two plugins, tools or action kinds share an id (a state key
                         declared twice with different policies, too);
- ``OutsideBound``       a contribution the plugin's ``CapabilityBound`` does not
                         allow: a bound limits what a plugin may contribute, it grants
                         nothing;
- ``ContributionFailed`` the plugin's function raised or returned no Contributions.

Hooks run in dependency order (a plugin's after those it requires), ties by the order
the plugins were given, and an agent's own hooks after every plugin's.

An agent's plugins are resolved when its engine is built (``prepare``); a refusal is
committed when a Run starts — its activation, with the input, then
``ended(failed(capability_bound, <rule>))`` — so the request is on record. The
resolved plugins (ids and versions) are pinned in the activation's run state
(``run:plugins``); a Run resumed or recovered by code that resolves differently ends
``failed(capability_bound, plugins_changed)`` instead of running with other hooks.

While a Run executes, a plugin's hooks and tools write only the state keys the plugin
declared, each with its declared merge policy (``runtime.state.check_writable``: a
hook's other command fails the Run ``failed(hook)``, a tool's makes its result a
model-visible error). Action kinds are declared and checked for duplicates; Ratchet
runs no actions yet, so nothing executes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from runtime.errors import RatchetError, ToolDefinitionError
from runtime.hooks import Gate, Hook, HookPoint, RunEndGuard
from runtime.limits import printable, raised
from runtime.state import RESERVED_KEYS, MergePolicy
from runtime.tools import Tool, check_deployable


class PluginRefused(RatchetError):
    """The plugins cannot be resolved; ``rule`` names which rule, ``plugin`` and ``item``
    what broke it."""

    rule = "plugin_refused"

    def __init__(self, plugin: str, item: str, detail: str) -> None:
        super().__init__(printable(f"plugin {plugin!r}, {item}: {detail}"))
        self.plugin, self.item = plugin, item


class MissingDependency(PluginRefused):
    rule = "missing_dependency"


class DependencyCycle(PluginRefused):
    rule = "dependency_cycle"


class DuplicateId(PluginRefused):
    rule = "duplicate_id"


class OutsideBound(PluginRefused):
    rule = "outside_bound"


class ContributionFailed(PluginRefused):
    """The plugin's function raised, or returned something other than Contributions."""

    rule = "contribution_failed"


@dataclass(frozen=True)
class CapabilityBound:
    """What a plugin may contribute (nothing, by default)."""

    tools: frozenset[str] = frozenset()
    hook_points: frozenset[HookPoint] = frozenset()
    state_keys: frozenset[str] = frozenset()
    """``"scope:key"``, e.g. ``"thread:notes"``."""
    gates: bool = False
    actions: frozenset[str] = frozenset()
    run_end_guards: bool = False

    def __post_init__(self) -> None:
        for name in ("tools", "hook_points", "state_keys", "actions"):
            # tools="reporting_admin" let a tool named "reporting" in (a substring),
            # where a bound must only ever hold back
            value = frozenset(_names(getattr(self, name), f"a bound's {name} is a set of names"))
            object.__setattr__(self, name, value)


def _names(value: Any, what: str) -> tuple[str, ...]:
    """``value``'s names; TypeError (``what``) if it is no collection of text: one string
    is a collection too, of its letters."""
    if isinstance(value, str | bytes) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what}, not {value!r:.80}")
    return tuple(value)


@dataclass(frozen=True)
class PluginManifest:
    id: str
    version: str = "0"
    requires: tuple[str, ...] = ()
    bound: CapabilityBound = field(default_factory=CapabilityBound)

    def __post_init__(self) -> None:
        # pinned in each Run's state as text: an id of 5 was written, and the thread's
        # own export and fork then refused the state Ratchet itself had written
        if not (isinstance(self.id, str) and self.id and isinstance(self.version, str)):
            raise TypeError(
                f"a plugin's id (non-empty) and version are text, not {self.id!r:.80} "
                f"and {self.version!r:.80}"
            )
        # requires="audit" would require "a", "u", ...
        what = f"plugin {self.id!r:.80}: requires is a sequence of plugin ids"
        object.__setattr__(self, "requires", _names(self.requires, what))


@dataclass(frozen=True)
class Contributions:
    tools: Sequence[Tool] = ()
    hooks: Sequence[Hook] = ()
    state_keys: Mapping[str, MergePolicy] = field(default_factory=dict)
    gates: Sequence[Gate] = ()
    actions: Sequence[str] = ()
    run_end_guards: Sequence[RunEndGuard] = ()


@dataclass(frozen=True)
class Plugin:
    manifest: PluginManifest
    contribute: Callable[[], Contributions]


@dataclass(frozen=True)
class ResolvedExecutionEnv:
    pins: tuple[tuple[str, str], ...]
    """(id, version) of each plugin, in dependency order."""
    tools: tuple[Tool, ...] = ()
    hooks: tuple[Hook, ...] = ()
    state_keys: Mapping[str, MergePolicy] = field(default_factory=dict)
    gates: tuple[Gate, ...] = ()
    actions: tuple[str, ...] = ()
    run_end_guards: tuple[RunEndGuard, ...] = ()
    tool_keys: Mapping[str, Mapping[str, MergePolicy]] = field(default_factory=dict)
    """Tool id → the state keys its plugin declared (the only ones its results write)."""


def resolve(plugins: Sequence[Plugin]) -> ResolvedExecutionEnv:
    """The environment the selected plugins make, or PluginRefused (see the module)."""
    by_id: dict[str, Plugin] = {}
    for plugin in plugins:
        pid = plugin.manifest.id
        if pid in by_id:
            raise DuplicateId(pid, "its id", "two plugins have this id")
        by_id[pid] = plugin
    order = _dependency_order(plugins, by_id)
    env: dict[str, Any] = {"tools": [], "hooks": [], "gates": [], "actions": [], "guards": []}
    keys: dict[str, MergePolicy] = {}
    tool_keys: dict[str, Mapping[str, MergePolicy]] = {}
    owners: dict[str, str] = {}
    for plugin in order:
        made = _contributions(plugin)
        _within_bound(plugin.manifest, made)
        for tool in made.tools:
            _claim(owners, f"tool {tool.id!r}", plugin.manifest.id)
        for action in made.actions:
            _claim(owners, f"action {action!r}", plugin.manifest.id)
        for key, policy in made.state_keys.items():
            if keys.setdefault(key, policy) != policy:
                raise DuplicateId(
                    plugin.manifest.id, f"state key {key!r}", f"declared {keys[key]} elsewhere"
                )
        declared = dict(made.state_keys)
        tool_keys.update((tool.id, declared) for tool in made.tools)
        env["tools"] += made.tools
        env["hooks"] += [replace(hook, keys=declared) for hook in made.hooks]
        env["gates"] += made.gates
        env["actions"] += made.actions
        env["guards"] += made.run_end_guards
    return ResolvedExecutionEnv(
        pins=tuple((p.manifest.id, p.manifest.version) for p in order),
        tools=tuple(env["tools"]),
        hooks=tuple(env["hooks"]),
        state_keys=keys,
        gates=tuple(env["gates"]),
        actions=tuple(env["actions"]),
        run_end_guards=tuple(env["guards"]),
        tool_keys=tool_keys,
    )


def _dependency_order(plugins: Sequence[Plugin], by_id: Mapping[str, Plugin]) -> list[Plugin]:
    """A topological order of the requirements; among plugins free to go, the one given
    first goes first (so hooks keep declaration order where nothing constrains them)."""
    for plugin in plugins:
        for need in plugin.manifest.requires:
            if need not in by_id:
                raise MissingDependency(plugin.manifest.id, f"requirement {need!r}", "not selected")
    placed: list[Plugin] = []
    done: set[str] = set()
    while len(placed) < len(plugins):
        ready = next(
            (p for p in plugins if p.manifest.id not in done and set(p.manifest.requires) <= done),
            None,
        )
        if ready is None:
            stuck = [p.manifest.id for p in plugins if p.manifest.id not in done]
            raise DependencyCycle(stuck[0], "its requirements", f"a cycle among {stuck}")
        placed.append(ready)
        done.add(ready.manifest.id)
    return placed


def _contributions(plugin: Plugin) -> Contributions:
    pid = plugin.manifest.id
    try:
        made = plugin.contribute()
    except BaseException as exc:  # the plugin's bug is a refusal naming it, never a crash
        # (a SystemExit or a BaseException of its own included; its text may not print)
        raise ContributionFailed(pid, "its contributions", raised(exc)) from exc
    if not isinstance(made, Contributions):
        kind = type(made).__name__
        raise ContributionFailed(pid, "its contributions", f"a {kind}, not Contributions")
    _check_kinds(pid, made)
    return made


def _check_kinds(pid: str, made: Contributions) -> None:
    """Each contribution of the kind its field holds (a function where a Hook belongs, a
    tool's name where the Tool does): ContributionFailed naming the plugin, never an
    AttributeError out of the agent's construction."""
    wanted: list[tuple[str, Any, Callable[[Any], bool]]] = [
        ("tools", made.tools, lambda t: isinstance(t, Tool)),
        ("hooks", made.hooks, lambda h: isinstance(h, Hook)),
        ("gates", made.gates, _answers_at_once),
        ("actions", made.actions, lambda a: isinstance(a, str)),
        ("run_end_guards", made.run_end_guards, _answers_at_once),
    ]
    for field_name, items, fits in wanted:
        if isinstance(items, str | bytes) or not isinstance(items, Sequence | set | frozenset):
            raise ContributionFailed(pid, field_name, f"a {type(items).__name__}, not a list")
        for item in items:
            if not fits(item):
                what = type(item).__name__
                raise ContributionFailed(pid, field_name, f"holds a {what}")
    for tool in made.tools:
        try:
            check_deployable(tool)
        except ToolDefinitionError as exc:  # a wait no answer ends, a deadline no clock holds
            raise ContributionFailed(pid, "tools", str(exc)) from exc
    keys = made.state_keys
    if not isinstance(keys, Mapping) or not all(isinstance(k, str) for k in keys):
        raise ContributionFailed(pid, "state_keys", "not a mapping of keys to merge policies")
    for key, policy in keys.items():
        scope, _, name = key.partition(":")
        if scope not in ("run", "thread") or not name:
            raise ContributionFailed(
                pid, "state_keys", f"{key!r} is not 'run:<key>' or 'thread:<key>'"
            )
        if policy not in get_args(MergePolicy):
            raise ContributionFailed(pid, "state_keys", f"{key!r}: no merge policy {policy!r}")
        if key in RESERVED_KEYS:  # no command may write it: refused now, not at a Step
            raise ContributionFailed(pid, "state_keys", f"{key!r}: Ratchet keeps this key")


def _answers_at_once(fn: object) -> bool:
    """A gate or guard answers when called: a coroutine function's answer would be a
    coroutine, which is neither None nor a reason."""
    return callable(fn) and not inspect.iscoroutinefunction(fn)


def _within_bound(manifest: PluginManifest, made: Contributions) -> None:
    bound, pid = manifest.bound, manifest.id
    for tool in made.tools:
        if tool.id not in bound.tools:
            raise OutsideBound(pid, f"tool {tool.id!r}", "not in its capability bound")
    for hook in made.hooks:
        if hook.point not in bound.hook_points:
            raise OutsideBound(pid, f"a {hook.point} hook", "not in its capability bound")
    for key in made.state_keys:
        if key not in bound.state_keys:
            raise OutsideBound(pid, f"state key {key!r}", "not in its capability bound")
    if made.gates and not bound.gates:
        raise OutsideBound(pid, "a tool gate", "its capability bound allows none")
    for action in made.actions:
        if action not in bound.actions:
            raise OutsideBound(pid, f"action {action!r}", "not in its capability bound")
    if made.run_end_guards and not bound.run_end_guards:
        raise OutsideBound(pid, "a run-end guard", "its capability bound allows none")


def _claim(owners: dict[str, str], item: str, plugin: str) -> None:
    if item in owners:
        raise DuplicateId(plugin, item, f"contributed by {owners[item]!r} too")
    owners[item] = plugin
