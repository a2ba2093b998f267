"""Listing Runs on Redis (``CommitStore.list_runs``): the run indexes, each entry
vouched for by its thread's verified head.

The indexes (``P:runs:STATE``) and the owner index (``P:owner:HOST``) say which
threads to look at; each thread's entry is then read again beside its head, in one
round trip (each thread's entries in every state's index, meta and hash tail at one
instant): a Run that committed since the indexes were read has a newer entry, maybe in
another state's index (a Run ended, a new one started), not a corrupt one. An entry
that does not verify, or says otherwise, is left out (``storage.summary.kept``), as is
one of another state than asked.

An index key that holds a value of another type (edited by hand) is left out and
logged, its threads with it: it is no thread's fault, and failing the whole listing
(or refusing every thread, as each thread's entry is read from it too) stopped every
sweep and quarantined every Run. Its Runs are listed again once it is repaired (appends
pass it over meanwhile, ``redis_scripts.Skipped``: deleted, each Run is listed again
from its next commit, and ``ratchet verify`` names those it does not list). An owner
index of another type is passed over for the running index (``_running_of``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

from runtime.errors import CorruptRecord
from runtime.ports import RunSummary
from storage.redis_client import translated
from storage.redis_instance import check_instance
from storage.redis_rows import META, anchor_of, decode_summary, verified_frontier
from storage.summary import RUN_STATES, RunStateKind, kept, vouched

log = logging.getLogger("ratchet.storage.redis")


class _Store(Protocol):
    """What a listing uses of ``storage.redis_store.RedisCommitStore``."""

    where: str
    client: Any
    prefix: str
    instance: str | None
    _instance: str

    def _key(self, thread: str, part: str) -> str: ...

    def _index(self, state: Any) -> str: ...


async def list_runs(
    store: _Store, state: RunStateKind | None, host: str | None
) -> list[RunSummary]:
    if host is not None and state == "running":
        return await _running_of(store, host)
    return await _indexed(store, state, host)


async def _indexed(store: _Store, state: RunStateKind | None, host: str | None) -> list[RunSummary]:
    """The Runs the run indexes list (of ``state``, all without), those of ``host`` only."""
    states = RUN_STATES if state is None else (state,)
    with translated(store.where):
        async with store.client.pipeline(transaction=True) as pipe:
            for s in states:
                pipe.hgetall(store._index(s))
            pipe.get(store._instance)
            *indexes, instance = await pipe.execute(raise_on_error=False)
    check_instance(instance, store.instance, store.where)
    threads = []
    for s, index in zip(states, indexes, strict=True):
        if isinstance(index, Exception):
            log.error("the run index %s refuses a read, left out: %s", store._index(s), index)
            continue
        threads += [str(t) for t in sorted(index)]
    return await _vouched(store, threads, state, host)


async def _running_of(store: _Store, host: str) -> list[RunSummary]:
    """The owner index: running threads whose owner belongs to ``host``. An owner index
    that refuses a read (edited by hand) is passed over for the running index, whose
    entries name their owner too: the listing is slower, not wrong, and a StoreError
    here stopped that host's reconciliation and the Supervisor's tick at every pass."""
    key = f"{store.prefix}:owner:{host}"
    with translated(store.where):
        async with store.client.pipeline(transaction=True) as pipe:
            pipe.hkeys(key)
            pipe.get(store._instance)
            owned, instance = await pipe.execute(raise_on_error=False)
    check_instance(instance, store.instance, store.where)
    if isinstance(owned, Exception):
        log.error("the owner index %s refuses a read, the running index is used: %s", key, owned)
        return await _indexed(store, "running", host)
    return await _vouched(store, [str(t) for t in sorted(owned)], "running", host)


async def _vouched(
    store: _Store, threads: list[str], state: RunStateKind | None, host: str | None
) -> list[RunSummary]:
    """The ``threads`` found in the run indexes, each as its verified head has it."""
    per = 3 + len(RUN_STATES)
    with translated(store.where):
        async with store.client.pipeline(transaction=True) as pipe:
            for thread in threads:
                pipe.hmget(store._key(thread, "meta"), META[:8])
                pipe.llen(store._key(thread, "sums"))
                pipe.lindex(store._key(thread, "sums"), -1)
                for s in RUN_STATES:
                    pipe.hget(store._index(s), thread)
            pipe.get(store._instance)
            # one thread's key of the wrong type (edited by hand) is that thread's
            # answer, not the whole listing's error
            *answers, instance = await pipe.execute(raise_on_error=False)
    check_instance(instance, store.instance, store.where)

    def summary(i: int, thread: str) -> RunSummary | None:
        mine = answers[per * i : per * i + per]
        refused = next((a for a in mine[:3] if isinstance(a, Exception)), None)
        if refused is not None:
            raise CorruptRecord(thread, 0, f"its keys refuse a read: {refused}")
        (frontier, version, epoch, owner, checksum, head, *anchored), n, last = mine[:3]
        # an index that refuses a read is left out (logged by the listing), not the thread
        entries = [e for e in mine[3:] if e is not None and not isinstance(e, Exception)]
        if not entries:
            return None  # its entry is gone (edited by hand): nothing to list
        if len(entries) > 1:  # a Run is in one state: an index edited by hand
            raise CorruptRecord(thread, 0, "its run index entry is in two states")
        (text,) = entries
        anchor = anchor_of(thread, *anchored)
        verified = verified_frontier(
            thread, frontier, version, epoch, owner, checksum, head, n, last, anchor
        )
        return vouched(decode_summary(thread, str(text)), verified)

    makes = (functools.partial(summary, i, t) for i, t in enumerate(threads))
    return kept(makes, state, host)
