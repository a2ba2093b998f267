"""State Commands and their merge policies (DESIGN §2).

Tools and hooks never mutate state; they return Commands. A commit applies its
commands once, here; the materialised store is the fold of every committed command.

Merge policies, for commands of one commit that touch the same key:
- ``exclusive``: one writer per commit; a second ``set`` is a StateConflict.
- ``disjoint``: the value is a JSON object and writers own disjoint fields of it;
  fields are merged, and a field set to two different values is a StateConflict.
- ``commutative``: order-free accumulation onto the stored value: numbers add,
  lists extend, objects merge field-wise (commands apply in producer order, which
  is model call order, so the result never depends on timing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import JsonValue, model_validator

from runtime.base import Frozen
from runtime.errors import StateConflict

Scope = Literal["run", "thread"]
MergePolicy = Literal["disjoint", "commutative", "exclusive"]
StateView = dict[str, dict[str, Any]]


class Command(Frozen):
    key: str
    scope: Scope = "thread"
    merge: MergePolicy = "exclusive"
    op: Literal["set", "remove"] = "set"
    value: JsonValue = None

    @model_validator(mode="after")
    def _shape(self) -> Command:
        if self.merge == "disjoint" and self.op == "set" and not isinstance(self.value, dict):
            raise ValueError("a disjoint command sets an object of fields")
        return self


def empty_state() -> StateView:
    return {"thread": {}, "run": {}}


def apply_commands(state: StateView, commands: Iterable[Command]) -> StateView:
    """Apply one commit's commands; raises StateConflict and leaves ``state`` untouched."""
    new: StateView = {"thread": dict(state["thread"]), "run": dict(state["run"])}
    seen: dict[tuple[str, str], Command] = {}
    for cmd in commands:
        slot = (cmd.scope, cmd.key)
        prior = seen.get(slot)
        if prior is not None and (prior.merge != cmd.merge or prior.op != cmd.op):
            raise StateConflict(f"state key {cmd.scope}:{cmd.key} written with mixed policies")
        if prior is not None and cmd.merge == "exclusive":
            raise StateConflict(
                f"exclusive state key {cmd.scope}:{cmd.key} set twice in one commit"
            )
        seen[slot] = cmd
        _apply_one(new[cmd.scope], cmd, first=prior is None)
    return new


def _apply_one(bucket: dict[str, Any], cmd: Command, first: bool) -> None:
    if cmd.op == "remove":
        bucket.pop(cmd.key, None)
    elif cmd.merge == "exclusive":
        bucket[cmd.key] = cmd.value
    elif cmd.merge == "disjoint":
        bucket[cmd.key] = _merge_disjoint(bucket.get(cmd.key), cmd, first)
    else:
        bucket[cmd.key] = _accumulate(bucket.get(cmd.key), cmd.value, cmd.key)


def _merge_disjoint(current: Any, cmd: Command, first: bool) -> dict[str, Any]:
    assert isinstance(cmd.value, dict)
    base = dict(current) if isinstance(current, dict) else {}
    for field, value in cmd.value.items():
        if not first and field in base and base[field] != value:
            raise StateConflict(f"disjoint state key {cmd.key}: field {field!r} set twice")
        base[field] = value
    return base


def _accumulate(current: Any, delta: Any, key: str) -> Any:
    if current is None:
        return delta
    if isinstance(current, bool) or isinstance(delta, bool):
        raise StateConflict(f"commutative state key {key}: booleans do not accumulate")
    if isinstance(current, int | float) and isinstance(delta, int | float):
        return current + delta
    if isinstance(current, list) and isinstance(delta, list):
        return [*current, *delta]
    if isinstance(current, dict) and isinstance(delta, dict):
        return {**current, **delta}
    raise StateConflict(f"commutative state key {key}: cannot combine {type(current).__name__}")
