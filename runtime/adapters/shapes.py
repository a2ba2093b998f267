"""What an adapter says of a chunk or event that is not of the documented shape.

The SDKs build a provider's chunks unvalidated: ``tool_calls`` may come as a string, a
call's ``arguments`` as a number. Read as they came, they failed somewhere further on,
and the failure said what Python said there: a bound method's repr with a memory
address ("indexed <built-in method index of str object at 0x7f…>"), pydantic's errors
with their "For further information visit https://errors.pydantic.dev/…" line. After
the last attempt that text is the Run's committed failure, stored for good: it must
say what the provider sent, by its JSON shape, and the same for the same bytes in any
process. So the folds ask for each part's type as they read it (``Misshapen`` names
the part), and whatever else they fail on is said by ``unreadable``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from runtime.limits import printable, said


class Misshapen(ValueError):
    """A part of a chunk or event of a type the format does not give it."""


def shape(value: object) -> str:
    """``value``'s kind as JSON names it: "a string", "a list", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    return "an object"  # a dict, or the SDK's model of one


def wire_object(value: object, what: str) -> None:
    """Misshapen unless ``value`` is an object (the SDK builds its model of one only
    where the format has one: anything else stays as it came)."""
    if not isinstance(value, BaseModel):
        raise Misshapen(f"{what} is {shape(value)}, not an object")


def wire_text(value: object, what: str) -> str:
    """A text part: "" when absent or null, else it must be a string."""
    if value is None or isinstance(value, str):
        return value or ""
    raise Misshapen(f"{what} is {shape(value)}, not a string")


def wire_str(value: object, what: str) -> str:
    """A text part the format always gives: it must be a string (null too is refused)."""
    if not isinstance(value, str):
        raise Misshapen(f"{what} is {shape(value)}, not a string")
    return value


def wire_list(value: object, what: str) -> list[Any]:
    """A list part: [] when absent or null, else it must be a list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise Misshapen(f"{what} is {shape(value)}, not a list")
    return value


def wire_index(value: object, what: str) -> int:
    if type(value) is not int:
        raise Misshapen(f"{what} is {shape(value)}, not an integer")
    return value


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def unreadable(exc: BaseException) -> str:
    """What reading a chunk failed on, said the same in every process: pydantic's errors
    as ``where: what`` (no input quoted, no URL), any other without a memory address."""
    if isinstance(exc, ValidationError):
        return printable(
            "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()
            )
        )
    return _ADDRESS.sub("", said(exc))


__all__ = [
    "Misshapen",
    "shape",
    "unreadable",
    "wire_index",
    "wire_list",
    "wire_object",
    "wire_str",
    "wire_text",
]
