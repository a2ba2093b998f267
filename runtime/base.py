"""The one base class of every persisted and wire type, and the canonical encoding."""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable, strict about unknown fields: a record either decodes whole or not at all."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Given(Frozen):
    """A record user code builds and hands to Ratchet (a hook's or a tool's commands and
    reactions, a tool's output, a resume): validated again wherever it is taken, as a
    field or an item. One built with ``model_construct`` (which checks nothing) is
    refused there as bad input is; taken as it was, a field of the wrong type was
    committed into a record that never decodes again, its thread unreadable."""

    model_config = ConfigDict(frozen=True, extra="forbid", revalidate_instances="always")


F = TypeVar("F", bound=Frozen)

# ---- records of our own making, built without validating them again --------------------
#
# A validated constructor costs several microseconds per record, mostly re-checking
# values that are records or ids we built and validated already. ``trusted`` and
# ``evolve`` skip that, for such values only: never for anything decoded, or given by a
# user or a model. They fill the four slots pydantic gives every model the way
# ``model_construct`` does (a Frozen record has no extra fields, no private attributes).

_SLOTS = vars(BaseModel)
_set_dict = _SLOTS["__dict__"].__set__
_set_fields_set = _SLOTS["__pydantic_fields_set__"].__set__
_set_extra = _SLOTS["__pydantic_extra__"].__set__
_set_private = _SLOTS["__pydantic_private__"].__set__


def _record(cls: type[F], values: dict[str, Any], fields_set: set[str]) -> F:
    new = object.__new__(cls)  # what cls.__new__ is, without the look-up through the metaclass
    _set_dict(new, values)
    _set_fields_set(new, fields_set)
    _set_extra(new, None)
    _set_private(new, None)
    return new


_TEMPLATES: dict[type, tuple[dict[str, Any], frozenset[str]]] = {}
"""Per record type: every field (in order) with its default, and the fields without one
``trusted`` can share (a mutable default, or one made per record, must be given)."""
_SHARED = (str, int, float, type(None), tuple, frozenset, Frozen)


def trusted(cls: type[F], /, **values: Any) -> F:
    """A ``cls`` record of ``values`` that are valid already (see above); defaults filled."""
    template = _TEMPLATES.get(cls)
    if template is None:
        template = _TEMPLATES[cls] = _template(cls)
    defaults, required = template
    merged = {**defaults, **values}  # the fields' order, the values given
    if len(merged) != len(defaults) or not required <= values.keys():
        unknown, missing = values.keys() - defaults.keys(), required - values.keys()
        raise TypeError(f"{cls.__name__}: unknown {sorted(unknown)}, missing {sorted(missing)}")
    return _record(cls, merged, set(values))


def _template(cls: type[Frozen]) -> tuple[dict[str, Any], frozenset[str]]:
    defaults: dict[str, Any] = {}
    required = set()
    for name, info in cls.__pydantic_fields__.items():
        shared = info.default_factory is None and isinstance(info.default, _SHARED)
        defaults[name] = info.default if shared else None
        if not shared:
            required.add(name)
    return defaults, frozenset(required)


def evolve(model: F, **changes: Any) -> F:
    """``model`` with ``changes`` (valid already, see above): ``model_copy(update=...)``
    without its generic copying. Values cached in ``__dict__`` (cached properties) are
    dropped: they were computed from the old fields."""
    cls = type(model)
    names = _FIELD_NAMES.get(cls) or _field_names(cls)
    values = {**model.__dict__, **changes}
    if len(values) != len(names):  # a cached property, or a name that is not a field
        unknown = changes.keys() - set(names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
        values = {name: values[name] for name in names}
    return _record(cls, values, model.__pydantic_fields_set__ | changes.keys())


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Field names per record type, filled on first use (looked up for every record built)."""


def _field_names(cls: type) -> tuple[str, ...]:
    if not issubclass(cls, Frozen):
        raise TypeError(f"{cls.__name__} is not a record")
    names = _FIELD_NAMES[cls] = tuple(cls.__pydantic_fields__)
    return names


# ---- the canonical encoding -----------------------------------------------------------


def canonical_json(data: Any, *, plain: bool | None = None) -> str:
    """Sorted keys, no spaces, non-ASCII kept: the same value always encodes to the same bytes.

    The definition is ``json.dumps(sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)``: every stored hash was taken over that text. orjson writes the
    same text an order of magnitude faster for plain data, but not for floats (``1e-05``
    comes out as ``0.00001``, NaN as ``null``) nor for types json refuses and orjson
    takes (datetimes, dataclasses): anything not plain takes the reference path, and so
    does whatever orjson refuses (ints beyond 64 bits, lone surrogates, non-str keys).
    ``plain`` is the caller's knowledge of ``data`` (see ``is_plain``); None: look here.
    """
    if plain if plain is not None else is_plain(data):
        try:
            return orjson.dumps(data, option=orjson.OPT_SORT_KEYS).decode()
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            pass
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_model_json(model: Frozen, *, plain: bool) -> str:
    """``canonical_json(model.model_dump(mode="json"))``, without building the dump.

    orjson walks the records itself and asks ``_fields`` for each one's field values,
    which for our records (no aliases, no custom serializers, no excluded fields) are
    exactly what the JSON-mode dump holds, once the free-form values in them are plain.
    ``plain`` says they are (the caller knows where its model keeps free-form values);
    if not, or if orjson refuses something, the reference path decides.
    """
    if plain:
        try:
            return orjson.dumps(model, default=_fields, option=orjson.OPT_SORT_KEYS).decode()
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            pass
    return canonical_json(model.model_dump(mode="json"), plain=False)


def _fields(value: Any) -> dict[str, Any]:
    """orjson's ``default``: asked once for each record it meets."""
    names = _FIELD_NAMES.get(type(value)) or _field_names(type(value))
    values = value.__dict__
    # cached properties share __dict__ with the fields: leave them out
    return values if len(values) == len(names) else {name: values[name] for name in names}


_LEAVES = (str, int, type(None))  # bool is an int


def is_plain(data: Any) -> bool:
    """Only dicts, lists, tuples, str, int, bool and None: json and orjson agree on it."""
    if isinstance(data, _LEAVES):
        return True
    if isinstance(data, dict):
        data = data.values()
    elif not isinstance(data, list | tuple):
        return False
    # a plain loop with leaves tested inline (no generator, no call per leaf): this runs
    # over every commit's free-form data
    for item in data:  # noqa: SIM110
        if not (isinstance(item, _LEAVES) or is_plain(item)):
            return False
    return True


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
