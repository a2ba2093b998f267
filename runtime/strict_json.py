"""JSON whose objects repeat a key is refused, wherever Ratchet reads JSON from outside.

Python's parser (and pydantic's, and orjson) keeps a repeated key's last value, other
parsers its first: ``{"approve": false, "approve": true}`` reads as a denial to a proxy
or an audit log and as an approval here, and an export line read one way by an audit
tool and another by ``ratchet import`` is two histories. Such input is refused instead
of meaning two things: by the HTTP service (``edge.strict_json``), ``ratchet resume
--result`` (``cluster.cli_args``), ``ratchet import`` (``runtime.history_format``) and a
model's tool-call arguments (``runtime.tools.Tool.parse``: a model-visible error).
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKey(ValueError):
    """An object repeats ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r:.80} appears twice in one object")
        self.key = key


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or DuplicateKey naming the first
    key repeated."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


def refuse_duplicate_keys(text: str | bytes) -> None:
    """DuplicateKey if an object of ``text`` repeats a key. For text a strict parser
    (orjson) already read: this parse only looks for what that one let through. Text
    nested deeper than Python's recursion limit raises RecursionError."""
    json.loads(text, object_pairs_hook=unique_pairs)
