"""The shapes Ratchet writes under its reserved state keys (``state.RESERVED_KEYS``).

A tool or hook cannot write these keys (``state.check_writable``), so the runtime and
the CLI read what they hold as Ratchet wrote it. Only an import brings state that no
Run of this system wrote — an export from elsewhere, or one edited by hand — so
``runtime.history`` holds each record's reserved keys to these shapes (in
``history_write.folded``), and refuses the record that breaks one before anything is
written: one such thread made ``ratchet runs`` fail for every thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from runtime.base import Frozen, canonical_json
from runtime.delegation import ParentLink
from runtime.lifecycle import RunWait
from runtime.state import RESERVED_KEYS, Command, StateView

Count = Annotated[StrictInt, Field(ge=0)]
Totals = dict[Literal["input_tokens", "output_tokens", "cached_tokens", "inferences"], Count]
"""Token totals (``runtime.usage``): a Run's, a thread's, and where a budget restarts."""
Side = Literal["a", "b"]


class Injected(Frozen):
    """An injected message not yet in the history (``runtime.injection``)."""

    id: StrictStr
    text: StrictStr


class Session(Frozen):
    """A dual-side session (``runtime.session``), set field by field (disjoint)."""

    side: Side | None = None
    turns: Count | None = None
    a_steps: Count | None = None
    b_steps: Count | None = None
    ended: StrictBool | None = None


SHAPES: Mapping[str, TypeAdapter[Any] | None] = {
    "run:plugins": TypeAdapter(list[tuple[StrictStr, StrictStr]]),  # [[id, version], ...]
    "run:usage": TypeAdapter(Totals),
    "run:model": TypeAdapter(StrictStr),
    "run:budget_from": TypeAdapter(Totals),
    "run:step_ended": TypeAdapter(StrictStr),  # a batch id
    "run:children": TypeAdapter(dict[StrictStr, StrictStr]),  # call id → child thread
    "run:parent": TypeAdapter(ParentLink),
    "run:injected": TypeAdapter(list[Injected]),
    "run:session": None,  # reserved, never written: any value is not Ratchet's
    "run:forced_turn": TypeAdapter(Side),
    "run:wait_request": TypeAdapter(RunWait),
    "run:trace": TypeAdapter(list[StrictStr]),  # traceparents
    "thread:usage": TypeAdapter(Totals),
    "thread:session": TypeAdapter(Session),
}


def reserved_problem(state: StateView, commands: Iterable[Command]) -> str | None:
    """Why a reserved key ``commands`` wrote holds, in ``state`` (the state after them),
    a value of another shape than Ratchet writes there; None if none does."""
    for name in sorted({f"{c.scope}:{c.key}" for c in commands} & RESERVED_KEYS):
        problem = reserved_value(state, name)[1]
        if problem is not None:
            return problem
    return None


def reserved_value(state: StateView, name: str) -> tuple[Any, str | None]:
    """What reserved key ``name`` (``scope:key``) holds in ``state``, None if nothing,
    and why it is not what Ratchet writes there (then the value is None): for readers
    of a thread that may have been imported before imports were checked."""
    scope, key = name.split(":", 1)
    value = state[scope].get(key)
    if value is None:
        return None, None
    shape = SHAPES[name]
    if shape is None:
        return None, f"state key {name} holds a value, and Ratchet writes none there"
    try:  # as JSON, strictly: a list where a tuple belongs is what JSON holds
        shape.validate_json(canonical_json(value), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the value"
        return None, f"state key {name} is not as Ratchet writes it ({where}: {first['msg']})"
    return value, None
