"""``--json`` output of the ``ratchet`` commands: one JSON object per line (JSON Lines).

Each object a command prints is documented where the command builds it
(``cluster.cli_runs.RunRow.json``, ``show_objects``); records inside them are their own
JSON form (``model_dump(mode="json")``: a commit as the store hashes it, a frame as the
stream serves it), never described a second time here.

Lines are written as UTF-8 bytes, whatever the locale. orjson encodes them; what it
refuses — a lone surrogate in stored text (say, bytes decoded with
``surrogateescape``), an integer beyond 64 bits — is encoded by ``json`` instead, with
each lone surrogate written as its escape ``\\udcXX``: the line stays valid UTF-8 and a
JSON parser reads back the same string.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from cluster.report import RunReport
from runtime.commit import Frontier
from runtime.delegation import CHILDREN_KEY
from runtime.limits import DEFAULT_LIMITS, Limits, history_headroom
from runtime.ports import CommittedRecord
from runtime.reserved import reserved_value
from runtime.usage import USAGE_KEY

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(obj: Any) -> bytes:
    """One compact JSON line for ``obj`` (plain data), valid UTF-8."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        # a surrogate can only stand inside a JSON string, where its escape means the same
        return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode()


def emit(obj: Any) -> None:
    """Write one line to stdout and flush it (a script reads each as it comes)."""
    out = sys.stdout
    out.flush()  # whatever was printed as text goes first
    line = dumps(obj) + b"\n"
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        out.write(line.decode())
        out.flush()
        return
    buffer.write(line)
    buffer.flush()


def show_objects(
    row: Mapping[str, Any],
    frontier: Frontier,
    records: Sequence[CommittedRecord],
    report: RunReport,
    limits: Limits = DEFAULT_LIMITS,
) -> Iterator[dict[str, Any]]:
    """What ``ratchet show --json`` prints, in order:

    - ``{"type": "thread", ...}``: the thread's ``ratchet runs --json`` row, plus
      ``run_state`` (the stored RunState: its ticket or cause in full),
      ``status_history`` (``[{"state", "reason"}]``, every committed status change of
      the latest Run), ``thread_usage`` (the thread's usage totals, or null) and
      ``children`` (``{call id: child thread id}`` of its delegations) and ``history``
      (``{"bytes", "bytes_limit", "commits", "commits_limit"}``, against ``limits``,
      the system's: how close the thread is to ``failed(history_limit)``);
    - ``{"type": "message", "index": i, "message": {...}}`` for each message of the
      transcript, oldest first;
    - ``{"type": "commit", "seq": n, "commit": {...}}`` for each committed record (the
      ThreadCommit as stored: label, disposition, messages, batch, status, facts…).
    """
    state = frontier.run_state
    yield {
        "type": "thread",
        **row,
        "run_state": state.model_dump(mode="json") if state is not None else None,
        "status_history": [{"state": s, "reason": r} for s, r in report.statuses],
        "thread_usage": frontier.state["thread"].get(USAGE_KEY) or None,
        "children": dict(reserved_value(frontier.state, f"run:{CHILDREN_KEY}")[0] or {}),
        "history": history_headroom(frontier.messages, frontier.version, limits),
    }
    for index, message in enumerate(frontier.messages):
        yield {"type": "message", "index": index, "message": message.model_dump(mode="json")}
    for record in records:
        yield {"type": "commit", "seq": record.seq, "commit": record.commit.model_dump(mode="json")}
