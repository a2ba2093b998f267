"""A past call's arguments as they go back to a provider: one decision for every adapter.

The history keeps what the model sent, and a call whose arguments Ratchet could not
take was answered with a tool error that says why. The next request carries the call
again, and a provider parses it (Anthropic's ``tool_use.input`` is an object; vLLM
parses OpenAI's ``arguments`` text): arguments it cannot read would have it refuse
every later request of the thread, failing the Run over its own model's earlier output.
So they go as ``{}`` when they are no JSON object, not strict JSON (NaN, Infinity,
1e400, an escaped lone surrogate), or nested deeper than the Run's ``json_depth`` (the
call was refused for it: ``runtime.tools.Tool.parse``; parsers stop at depths of their
own, serde_json's at 128, and an object nests the arguments a few levels deeper
still). The model keeps seeing its call, and the error it was answered with.
"""

from __future__ import annotations

import orjson

from runtime.limits import MAX_JSON_DEPTH, json_depth

EMPTY = "{}"


def sent_arguments(arguments: str, depth_limit: int) -> str:
    """``arguments`` when a provider surely reads them as the object the model meant,
    else ``{}``. ``depth_limit`` is the Run's ``json_depth``, at most ``MAX_JSON_DEPTH``
    (what the engine allows; deeper is what a provider may stop at)."""
    depth_limit = min(depth_limit, MAX_JSON_DEPTH)
    # it cannot nest deeper than it opens: count first (at C speed), scan only a deep one
    opened = arguments.count("[") + arguments.count("{")
    if opened > depth_limit and json_depth(arguments) > depth_limit:
        return EMPTY
    try:  # strict JSON: Python's json takes NaN, Infinity and lone surrogates
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return EMPTY
    return arguments if isinstance(value, dict) else EMPTY


__all__ = ["EMPTY", "sent_arguments"]
