"""State Commands and their merge policies (DESIGN §2).

Tools and hooks never mutate state; they return Commands. A commit applies its
commands once, here; the materialised store is the fold of every committed command.
The state it produces is deeply immutable (``runtime.frozen``): whoever reads it —
a hook, a tool, a client of an in-process store — cannot change it behind a commit.

Merge policies decide how the commands of one commit that touch the same key combine
(commands of one commit on one key must share the policy and the operation):

- ``exclusive``: one writer per commit: a second command on the key (set or remove)
  is a StateConflict. The value replaces what is stored.
- ``disjoint``: the value is a JSON object; the commands of one commit must set
  different fields of it (a field set by two of them is a StateConflict). The fields
  set replace those stored; the other stored fields stay. ``remove`` drops the key
  and must be the key's only command in the commit.
- ``commutative``: order-independent accumulation only, so the result never depends
  on which producer came first: an integer adds to a counter, a list is a set whose
  union is taken (kept sorted by canonical JSON, each member once), an object merges
  field-wise by the same two rules. Floats (whose sum depends on order), text,
  booleans and null are refused when the Command is made, and so is ``remove``
  (remove such a key with an ``exclusive`` command). A stored value of another shape
  is a StateConflict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import JsonValue, model_validator

from runtime.base import Given, canonical_json
from runtime.errors import InputRefused, StateConflict
from runtime.frozen import FrozenDict, freeze

Scope = Literal["run", "thread"]
MergePolicy = Literal["disjoint", "commutative", "exclusive"]
StateView = dict[str, dict[str, Any]]


class Command(Given):
    key: str
    scope: Scope = "thread"
    merge: MergePolicy = "exclusive"
    op: Literal["set", "remove"] = "set"
    value: JsonValue = None

    @model_validator(mode="after")
    def _shape(self) -> Command:
        if self.merge == "disjoint" and self.op == "set" and not isinstance(self.value, dict):
            raise ValueError("a disjoint command sets an object of fields")
        if self.merge == "commutative":
            if self.op == "remove":
                raise ValueError("a commutative key is only added to: remove it as exclusive")
            problem = _commutative_problem(self.value)
            if problem is not None:
                raise ValueError(f"commutative value: {problem}")
        return self


def _commutative_problem(value: Any) -> str | None:
    """Why ``value`` has no order-independent accumulation, or None."""
    if isinstance(value, bool) or not isinstance(value, int | list | dict):
        return (
            f"{type(value).__name__} does not accumulate (integers add, lists unite, "
            "objects merge field-wise)"
        )
    if isinstance(value, dict):
        for field, child in value.items():
            problem = _commutative_problem(child)
            if problem is not None:
                return f"field {field!r}: {problem}"
    return None


SESSION_KEY = "session"
"""Thread-state key of a dual-side session (``runtime.session``)."""

RESERVED_KEYS = frozenset(
    {
        *(
            f"run:{key}"
            for key in (
                "plugins",  # runtime.plugin_env: the pinned plugins
                "usage",  # runtime.usage: what the Run used, and its model
                "model",
                "budget_from",
                "step_ended",  # runtime.context: StepEnd hooks ran once per Step
                "children",  # runtime.delegation: the Run's children and its parent
                "parent",
                "injected",  # runtime.injection: messages injected, not yet in history
                "session",  # runtime.session: whose turn, how many turns
                "forced_turn",  # runtime.session: the side force_turn named
                "wait_request",  # runtime.context: a hook's wait, not yet taken
                "trace",  # runtime.tracing: the traceparents of the Run's drives
            )
        ),
        "thread:usage",
        "thread:session",
    }
)
"""``scope:key`` of the state Ratchet itself keeps: no hook or tool writes these."""


def check_writable(cmd: Command, declared: Mapping[str, MergePolicy] | None = None) -> None:
    """Refuse a hook's or tool's command on a reserved key; with ``declared`` (a plugin's
    state keys, ``scope:key`` → policy), also on a key it did not declare, or with
    another merge policy than it declared (InputRefused)."""
    name = f"{cmd.scope}:{cmd.key}"
    if name in RESERVED_KEYS:
        raise InputRefused(f"state command {name!r}", "reserved_key", "Ratchet keeps this key")
    if declared is None:
        return
    policy = declared.get(name)
    if policy is None:
        raise InputRefused(
            f"state command {name!r}", "undeclared_key", "the plugin did not declare this key"
        )
    if policy != cmd.merge:
        raise InputRefused(
            f"state command {name!r}", "merge_policy", f"declared {policy}, written {cmd.merge}"
        )


def empty_state() -> StateView:
    return FrozenDict(thread=FrozenDict(), run=FrozenDict())


def apply_commands(state: StateView, commands: Iterable[Command]) -> StateView:
    """Apply one commit's commands; raises StateConflict and leaves ``state`` untouched."""
    groups: dict[tuple[str, str], list[Command]] = {}
    for cmd in commands:
        group = groups.setdefault((cmd.scope, cmd.key), [])
        if group and (group[0].merge != cmd.merge or group[0].op != cmd.op):
            raise StateConflict(f"state key {cmd.scope}:{cmd.key} written with mixed policies")
        group.append(cmd)
    new: dict[str, dict[str, Any]] = {"thread": dict(state["thread"]), "run": dict(state["run"])}
    for (scope, key), group in groups.items():
        bucket = new[scope]
        name = f"{scope}:{key}"
        first = group[0]
        if first.op == "remove" or first.merge == "exclusive":
            if len(group) > 1:
                raise StateConflict(f"{first.merge} state key {name} written twice in one commit")
            if first.op == "remove":
                bucket.pop(key, None)
            else:
                bucket[key] = freeze(first.value)
        elif first.merge == "disjoint":
            bucket[key] = _disjoint(bucket.get(key), group, name)
        else:
            current = bucket.get(key)
            for cmd in group:
                current = _accumulate(current, cmd.value, name)
            bucket[key] = freeze(current)
    return FrozenDict(thread=FrozenDict(new["thread"]), run=FrozenDict(new["run"]))


def _disjoint(current: Any, group: list[Command], name: str) -> Any:
    if current is not None and not isinstance(current, dict):
        raise StateConflict(f"disjoint state key {name}: the stored value is not an object")
    fields: dict[str, Any] = {}
    for cmd in group:
        assert isinstance(cmd.value, dict)
        for field, value in cmd.value.items():
            if field in fields:
                raise StateConflict(
                    f"disjoint state key {name}: field {field!r} set twice in one commit"
                )
            fields[field] = value
    return freeze({**(current or {}), **fields})


_BIG_BITS = 14_000
"""Below this many bits an integer has fewer than 4,300 decimal digits (Python's
``int_max_str_digits``, which the stores' JSON readers share)."""


def _sum(total: int, name: str) -> int:
    """``total``, if it can be written and read back as JSON: each added value is held to
    that (``check_json_value``), but two of 4,300 digits add up to 4,301, which a store
    wrote and then could never read (the thread unreadable)."""
    if total.bit_length() < _BIG_BITS:
        return total
    try:
        str(total)
    except ValueError:
        raise StateConflict(
            f"commutative state key {name}: the sum has more digits than JSON may hold"
        ) from None
    return total


def _accumulate(current: Any, delta: Any, name: str) -> Any:
    """``current`` (stored, possibly absent) combined with ``delta``: commutative and
    associative, so the order of a commit's commands cannot change the result."""
    if current is None:
        current = [] if isinstance(delta, list) else {} if isinstance(delta, dict) else 0
    if isinstance(delta, int) and isinstance(current, int) and not isinstance(current, bool):
        return _sum(current + delta, name)
    if isinstance(delta, list) and isinstance(current, list):
        members = {canonical_json(v): v for v in (*current, *delta)}
        return [members[k] for k in sorted(members)]
    if isinstance(delta, dict) and isinstance(current, dict):
        merged = dict(current)
        for field, value in delta.items():
            merged[field] = _accumulate(current.get(field), value, f"{name}.{field}")
        return merged
    raise StateConflict(
        f"commutative state key {name}: cannot add a {type(delta).__name__} "
        f"to the stored {type(current).__name__}"
    )
