"""Deeply immutable JSON values: what hooks, tools and clients see of a thread's state.

A frontier's state is shared: by the engine's working copy, by an in-process store's
own frontier, by every hook that reads it. So it is built of ``FrozenDict`` and
``FrozenList`` — subclasses of dict and list (``json``, ``orjson``, pydantic and
equality treat them as plain ones) whose every mutating method raises ``TypeError``.
Writing state stays what it always was: return a Command.
"""

from __future__ import annotations

from typing import Any, NoReturn


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise TypeError("read-only: a value shared by every reader (state changes by a Command)")


class FrozenDict(dict[str, Any]):
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle would rebuild a dict subclass item by item, through __setitem__
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenDict:
        return self


class FrozenList(list[Any]):
    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = clear = extend = insert = pop = remove = reverse = sort = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self),))

    def __copy__(self) -> FrozenList:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenList:
        return self


def freeze(value: Any) -> Any:
    """``value`` with every dict and list replaced by a frozen copy (already frozen parts
    are shared, not copied)."""
    if type(value) is FrozenDict or type(value) is FrozenList:
        return value
    if isinstance(value, dict):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return FrozenList(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a (frozen) JSON value."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value
