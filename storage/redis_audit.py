"""What ``ratchet verify`` asks of a Redis thread beyond its log and head: whether the
indexes beside it still say what its verified head does (``runtime.integrity.audit``).

A thread's keys verify on their own (the hash chain, the head's checksum), but three
things of the store's kept outside them are read by others:

- the run index (``P:runs:STATE``): listings and every Supervisor sweep read it; an
  entry missing, in another state's hash or saying otherwise hides the Run (or serves
  it as it is not);
- the owner index (``P:owner:HOST``): the Supervisor finds a lost host's running Runs
  there; a running thread missing from it would never be recovered;
- the receipts (``P:thread:T:ops``): a retried append finds its first receipt there; one
  missing or saying another seq or hash turns a harmless retry into a conflict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.ports import RunSummary
from storage.redis_client import translated
from storage.redis_rows import decode_receipt, decode_summary
from storage.summary import RUN_STATES, summarize


class _Store(Protocol):
    """What the audit uses of ``storage.redis_store.RedisCommitStore``."""

    where: str
    client: Any

    async def load_head(self, thread: ThreadId) -> Any: ...

    def _key(self, thread: str, part: str) -> str: ...

    def _index(self, state: Any) -> str: ...

    def _owners(self, owner: str | None) -> str: ...


MOVES = 3
"""How often the audit reads a live thread again when it moved between its reads."""


async def index_problem(store: _Store, thread: ThreadId) -> str | None:
    """What is wrong with the thread's entries in the indexes and its receipts (None:
    they say what its verified head does). A thread appended to between the head's read
    and the indexes' is read again: only one moment of it is compared; one that keeps
    moving is not judged (it is live, and its writers keep its indexes)."""
    for _ in range(MOVES):
        try:
            head = await store.load_head(thread)
            found = await _indexes_problem(store, thread, head)
            again = await store.load_head(thread)
        except CorruptRecord as exc:  # its head, which appends and claims read, fails
            return str(exc)
        if (again.version, again.epoch, again.owner) == (head.version, head.epoch, head.owner):
            return found
    return None


async def _indexes_problem(store: _Store, thread: ThreadId, head: Any) -> str | None:
    expected = summarize(head)
    keys = [store._index(state) for state in RUN_STATES]
    keys += [store._owners(head.owner), store._key(thread, "ops"), store._key(thread, "sums")]
    with translated(store.where, thread):
        async with store.client.pipeline(transaction=True) as pipe:
            for key in keys[: len(RUN_STATES)]:
                pipe.hget(key, thread)
            pipe.hexists(keys[-3], thread)
            pipe.hgetall(keys[-2])
            pipe.lrange(keys[-1], 0, -1)
            answers = await pipe.execute(raise_on_error=False)
    refused = [key for key, a in zip(keys, answers, strict=True) if isinstance(a, Exception)]
    if refused:  # a shared index so is named on every thread: appends pass it over
        return f"{', '.join(refused)} holds a value of another type (edited by hand)"
    *listed, owned, ops, sums = answers
    entries: dict[str, str] = {
        state: text for state, text in zip(RUN_STATES, listed, strict=True) if text
    }
    problem = _index_problem(thread, expected, entries, bool(owned))
    return problem or _receipts_problem(thread, head.version - len(sums), ops, sums)


def _index_problem(
    thread: str, expected: RunSummary | None, entries: Mapping[str, str], owned: bool
) -> str | None:
    if expected is None:
        return "the run index lists a Run its frontier does not have" if entries else None
    if set(entries) != {expected.state}:
        where = ", ".join(sorted(entries)) or "no state"
        return f"the run index lists it under {where}; its Run is {expected.state} (hidden)"
    try:
        if decode_summary(thread, entries[expected.state]) != expected:
            return "the run index is not the frontier's"
    except CorruptRecord as exc:
        return str(exc)
    if expected.state == "running" and not owned:
        return "the owner index does not list it: a lost host's Runs would not find it"
    return None


def _receipts_problem(thread: str, pruned: int, ops: dict[str, str], sums: list[str]) -> str | None:
    """Each kept record has its receipt, and each receipt is a kept record's."""
    if len(ops) != len(sums):
        return f"{len(ops)} receipts for {len(sums)} records: a retried append would conflict"
    for operation, text in ops.items():
        try:
            receipt = decode_receipt(thread, text)
        except CorruptRecord as exc:
            return str(exc)
        index = receipt.seq - pruned - 1
        if (
            receipt.operation_id != operation
            or not 0 <= index < len(sums)
            or sums[index] != receipt.payload_hash
        ):
            return f"the receipt of {operation} is not its record's"
    return None


__all__ = ["index_problem"]
