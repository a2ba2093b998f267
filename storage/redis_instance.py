"""Which Redis store a process connected to: one whose contents are gone must not pass
for an empty truth.

A ``FLUSHDB``, or a server restarted without persistence, leaves an empty database,
which the next connect would take for a new store. The processes connected before it
know better: at connect each reads ``P:instance`` (set once, at random, by the first
process to connect to the store), and every read, listing and append checks it in the
same round trip (the append and claim scripts, atomically). Should it be gone or
another, the store's contents were lost: ``StoreLost``, and the process fails closed
(no Run is driven, nor served, from an empty store), as it does for an in-memory store
whose actor restarted. A process connected afterwards starts on the new, empty store,
unless it joins a cluster that knew the old one (``actors.store_instance``).
"""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from runtime.errors import StoreLost


def instance_key(prefix: str) -> str:
    return f"{prefix}:instance"


async def instance_of(client: aioredis.Redis, prefix: str) -> str:
    """The store's instance token: this process's, if it is the first to connect."""
    key = instance_key(prefix)
    await client.set(key, secrets.token_hex(16), nx=True)
    return str(await client.get(key))


def check_instance(seen: object, expected: str | None, where: str) -> None:
    """StoreLost unless ``seen`` (read beside the data) is the token read at connect
    (``expected`` None: a store not opened by ``connect``, which checks nothing). A read
    the key refused (it holds another type: edited by hand) is no token either."""
    if expected is not None and seen != expected:
        raise StoreLost(
            f"redis at {where} lost the store's contents (its instance key is "
            f"{'gone' if seen is None else 'another'}: flushed, or restarted without "
            "persistence); nothing is read from or written into it"
        )
