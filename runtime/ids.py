"""Typed identifiers.

Every id is a plain string on the wire; ``NewType`` keeps them apart for the type
checker so a ``CallId`` is never passed where a ``RunId`` is expected.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal, NewType

RunId = NewType("RunId", str)
ThreadId = NewType("ThreadId", str)
CallId = NewType("CallId", str)
OperationId = NewType("OperationId", str)
BatchId = NewType("BatchId", str)
ToolId = NewType("ToolId", str)
CorrelationId = NewType("CorrelationId", str)

SCHEMA_VERSION: Literal[1] = 1
"""Version of every persisted shape; decoding a record of another version fails closed."""


def batch_id(run: RunId, step: int) -> BatchId:
    return BatchId(f"tool-batch:{run}:{step}")


def call_operation_id(batch: BatchId, call: CallId) -> OperationId:
    """The stable id a tool receives so downstream systems can deduplicate."""
    return OperationId(f"{batch}:{call}")


def commit_operation_id(run: RunId, ordinal: int) -> OperationId:
    return OperationId(f"{run}:commit:{ordinal}")


def distinct_id(raw: str, taken: Collection[str], max_chars: int | None = None) -> str:
    """``raw``, or, when another call of the same answer has it, ``raw#2``, ``raw#3``...
    (``raw`` cut so that the whole stays within ``max_chars``): models sometimes repeat a
    call id, and every call must stay addressable."""
    n, cid = 1, raw
    while cid in taken:
        n += 1
        suffix = f"#{n}"
        cid = (raw if max_chars is None else raw[: max(max_chars - len(suffix), 0)]) + suffix
    return cid
