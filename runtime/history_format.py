"""The history errors and the export format of a thread (``runtime.history`` forks,
exports and imports with them): one JSON object per line, the header first, then each
record's stored body as a JSON string with its hash, checked line by line on the way in
(``parse_export``: pure, no store). ``runtime.history``'s docstring describes the format
and names every refusal's reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from runtime.commit import DEFAULT_PAYLOAD_LIMIT, ThreadCommit, decode_commit
from runtime.errors import CorruptRecord, InputRefused, RatchetError
from runtime.ids import ThreadId
from runtime.integrity import body_hash
from runtime.limits import DEFAULT_LIMITS, STORED_IDS, Limits, check_id, printable
from runtime.ports import CommittedRecord
from runtime.strict_json import DuplicateKey, refuse_duplicate_keys, unique_pairs


class HistoryRefused(RatchetError):
    """A fork, an export or an import refused; ``reason`` names the rule."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class ForkRefused(HistoryRefused):
    """A fork refused (before anything was written, but for ``thread_exists`` found
    once its writing had begun: then the part it wrote stays)."""


class ImportRefused(HistoryRefused):
    """An import refused (before anything was written, but as for ForkRefused). ``line``
    is the 1-based line of the input at fault (1: the header), None when the fault is
    not the input's (``thread_exists``)."""

    def __init__(self, line: int | None, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.line = line
        if line is not None:
            self.args = (f"line {line}: {reason}: {detail}",)


EXPORT_FORMAT = "ratchet-thread"
EXPORT_VERSION = 1


def line_bytes(payload_limit: int) -> int:
    """The longest line an import into a store of ``payload_limit`` reads: a record line
    holds one commit as a JSON string, at most the payload limit, each byte of it taking
    at most two (a quote or a backslash: the body is JSON already, so it holds no control
    character), with room to spare (a line past it is ``too_large``)."""
    return 16 * payload_limit


MAX_LINE_BYTES = line_bytes(DEFAULT_PAYLOAD_LIMIT)
"""The longest line read into a store of the default payload limit (16 MiB)."""


def export_lines(thread: ThreadId, records: Sequence[CommittedRecord]) -> Iterator[str]:
    last = records[-1].commit
    yield _dumps(
        {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "thread_id": thread,
            "records": len(records),
            "head": last.payload_hash,
        }
    )
    for r in records:
        try:
            yield _dumps({"seq": r.seq, "hash": r.commit.payload_hash, "body": r.commit.encoded})
        except orjson.JSONEncodeError as exc:  # no store can hold it: only a test aid could
            raise CorruptRecord(thread, r.seq, f"the body is not valid Unicode: {exc}") from exc


def _dumps(value: dict[str, Any]) -> str:
    return orjson.dumps(value).decode()


@dataclass(frozen=True)
class Exported:
    """An export, every line checked: the exported thread's id and its records."""

    thread_id: ThreadId
    records: tuple[CommittedRecord, ...]


def parse_export(
    lines: Iterable[str | bytes],
    limits: Limits = DEFAULT_LIMITS,
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
) -> Exported:
    """The export in ``lines`` (with or without their newlines), checked line by line:
    ImportRefused names the first line that does not hold (pure: no store). It is held
    to the limits of the system it goes into: at most ``history_commits`` records (and
    the end a Run commits past them), no line longer than a record a store of
    ``payload_limit`` holds can make (``line_bytes``)."""
    numbered = enumerate(lines, start=1)
    first = next(numbered, None)
    if first is None:
        raise ImportRefused(1, "header", "the input is empty")
    longest = line_bytes(payload_limit)
    thread, count, head = _header(_json_line(first[1], 1, longest), limits)
    records: list[CommittedRecord] = []
    prev, last = "", 1
    for last, raw in numbered:
        seq = len(records) + 1
        if seq > count:
            raise ImportRefused(last, "seq", f"record {seq} of an export of {count} records")
        commit, stored = _record(_json_line(raw, last, longest), last, thread, seq, prev)
        records.append(CommittedRecord(seq=seq, commit=commit))
        prev = stored
    if len(records) != count or prev != head:
        raise ImportRefused(
            last + 1,
            "truncated",
            f"the input ends after line {last} with {len(records)} records; its header "
            f"names {count} records ending in {head[:12]}",
        )
    return Exported(thread, tuple(records))


def _json_line(raw: str | bytes, line: int, longest: int) -> dict[str, Any]:
    if not isinstance(raw, str | bytes):  # a caller's iterable of anything
        raise ImportRefused(line, "malformed", f"a line is text, not {type(raw).__name__}")
    text = raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n")
    if len(text) > longest:
        raise ImportRefused(line, "too_large", f"the line is over {longest} bytes")
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ImportRefused(line, "malformed", f"not JSON: {exc}") from None
    _unique_keys(text, line, "malformed", "")
    if not isinstance(value, dict):
        raise ImportRefused(line, "malformed", "not a JSON object")
    return value


_HEADER_FIELDS = frozenset({"format", "version", "thread_id", "records", "head"})


def _header(value: dict[str, Any], limits: Limits) -> tuple[ThreadId, int, str]:
    if value.get("format") != EXPORT_FORMAT:
        raise ImportRefused(1, "format", f"not a Ratchet thread export ({EXPORT_FORMAT!r})")
    extra = sorted(value.keys() - _HEADER_FIELDS)
    if extra:
        fields = printable(repr(extra), 200)
        raise ImportRefused(1, "malformed", f"the header holds fields no export writes: {fields}")
    version = value.get("version")
    if not _is_int(version) or version != EXPORT_VERSION:  # true and 1.0 are == 1
        raise ImportRefused(
            1,
            "version",
            f"format version {printable(repr(version), 80)}; this Ratchet reads {EXPORT_VERSION}",
        )
    thread, count, head = value.get("thread_id"), value.get("records"), value.get("head")
    try:
        check_id("thread id", thread, STORED_IDS)  # a stored thread's, whatever its id_chars
    except InputRefused as exc:
        raise ImportRefused(1, "header", str(exc)) from None
    if not (isinstance(count, int) and _is_int(count) and count >= 1 and isinstance(head, str)):
        raise ImportRefused(1, "header", "it needs records (a count of at least 1) and head")
    # a Run that reaches the limit still commits its end past it: one more
    most = limits.history_commits + 1
    if count > most:
        raise ImportRefused(
            1, "too_large", f"{count} records: more than a thread may hold here ({most})"
        )
    return ThreadId(str(thread)), count, head


def _record(
    value: dict[str, Any], line: int, thread: ThreadId, seq: int, prev: str
) -> tuple[ThreadCommit, str]:
    """The record on ``line``, which must be record ``seq`` and extend ``prev``."""
    if value.keys() != {"seq", "hash", "body"}:
        raise ImportRefused(line, "malformed", "a record line holds seq, hash and body")
    found, stored, body = value["seq"], value["hash"], value["body"]
    if not _is_int(found) or not isinstance(stored, str) or not isinstance(body, str):
        raise ImportRefused(line, "malformed", "seq is a number, hash and body are text")
    if found != seq:
        raise ImportRefused(
            line, "seq", f"record {found} where record {seq} belongs: the log has a gap"
        )
    if body_hash(body) != stored:
        raise ImportRefused(line, "hash", f"record {seq}: the body does not match its hash")
    _body_json(body, line, seq)
    try:
        commit = decode_commit(body, thread, seq)
    except CorruptRecord as exc:
        raise ImportRefused(line, "record", str(exc)) from None
    if commit.thread_id != thread:
        raise ImportRefused(
            line, "thread", f"record {seq} belongs to thread {commit.thread_id!r}, not {thread!r}"
        )
    if commit.schema_version >= 2 and commit.prev != prev:
        raise ImportRefused(line, "chain", f"record {seq} does not name its predecessor's hash")
    return commit, stored


def _body_json(body: str, line: int, seq: int) -> None:
    """ImportRefused for a body a store's reader takes but no encoder writes: a key an
    object repeats, NaN, Infinity, a number past a float's range (``1e400``, which the
    reader takes as infinity). An integer of any length is JSON, and an encoder writes
    it: orjson reads one past 64 bits as a float, and refused one past 1e308 as
    "infinity", so a thread whose state held such an integer was exported and never
    imported again."""
    try:
        json.loads(
            body, object_pairs_hook=unique_pairs, parse_constant=_no_constant, parse_float=_finite
        )
    except DuplicateKey as exc:
        raise ImportRefused(line, "record", f"record {seq}: its body: {exc}") from None
    except RecursionError:  # orjson reads 1,024 levels, Python's parser fewer
        raise ImportRefused(line, "record", f"record {seq}: its body: nested too deep") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of over 4,300 digits
        detail = f"record {seq}: its body is no JSON: {printable(str(exc), 200)}"
        raise ImportRefused(line, "record", detail) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is past the range of a float")
    return value


def _unique_keys(text: str | bytes, line: int, kind: str, what: str) -> None:
    """No encoder writes a key twice; a reader keeps one of the two, and which one
    depends on the reader (``runtime.strict_json``)."""
    try:
        refuse_duplicate_keys(text)
    except DuplicateKey as exc:
        raise ImportRefused(line, kind, f"{what}{exc}") from None
    except RecursionError:  # orjson reads 1,024 levels, Python's parser fewer
        raise ImportRefused(line, kind, f"{what}nested too deep") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
