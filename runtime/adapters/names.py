"""Call ids and tool names as a provider's API accepts them in a request's history.

A model's own ids and names may be anything (a renamed repeat is ``id#2``; a model may
call ``functions.add``), and the history keeps what the model sent. The APIs refuse
history entries that break their patterns — with a 400 for every later request of the
thread — so each goes on the wire as it is when it fits, else as a digest of it (the
same each time, so a call and its result still pair).
"""

from __future__ import annotations

import hashlib
import re

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wire_name(value: str, max_chars: int = 64) -> str:
    """``value`` if it is ``^[a-zA-Z0-9_-]{1,max_chars}$`` (tool names, Anthropic's ids),
    else ``r`` and a digest of it."""
    if len(value) <= max_chars and _NAME.fullmatch(value):
        return value
    return "r" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[: max_chars - 1]


def wire_id(value: str, max_chars: int = 40) -> str:
    """An OpenAI tool call id: any text of at most ``max_chars``, else a digest of it."""
    if 0 < len(value) <= max_chars and value.isprintable() and value.isascii():
        return value
    return "r" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[: max_chars - 1]


__all__ = ["wire_id", "wire_name"]
