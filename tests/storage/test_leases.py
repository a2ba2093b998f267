"""Store leases (``CommitStore.hold_lease``) on every backend: one holder at a time,
renewed by its holder, free again once expired or dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage.redis_store import RedisCommitStore
from storage.sql import SqlCommitStore
from tests.support.waiting import until


async def test_a_lease_is_held_by_one_holder_until_dropped(store: Any) -> None:
    first = await store.hold_lease("system-a", "cluster-1", 30.0)
    assert first.holder == "cluster-1" and 0 < first.expires_in_s <= 30.0
    other = await store.hold_lease("system-a", "cluster-2", 30.0)
    assert other.holder == "cluster-1" and other.expires_in_s > 20.0
    assert (await store.hold_lease("system-b", "cluster-2", 30.0)).holder == "cluster-2"
    renewed = await store.hold_lease("system-a", "cluster-1", 60.0)
    assert renewed.holder == "cluster-1" and renewed.expires_in_s > 30.0
    await store.drop_lease("system-a", "cluster-2")  # not its lease: nothing changes
    assert (await store.hold_lease("system-a", "cluster-2", 30.0)).holder == "cluster-1"
    await store.drop_lease("system-a", "cluster-1")
    assert (await store.hold_lease("system-a", "cluster-2", 30.0)).holder == "cluster-2"


async def test_an_expired_lease_goes_to_the_next_holder(store: Any) -> None:
    assert (await store.hold_lease("system-a", "cluster-1", 0.3)).holder == "cluster-1"

    async def taken() -> bool:
        lease = await store.hold_lease("system-a", "cluster-2", 30.0)
        return bool(lease.holder == "cluster-2")

    await until(taken, 10.0, what="the expired lease to pass to cluster-2")
    assert (await store.hold_lease("system-a", "cluster-1", 30.0)).holder == "cluster-2"


async def test_of_racing_holders_of_a_free_lease_one_holds_it(
    store: Any, backend: str, backend_url: str
) -> None:
    """Each racer through its own connection (the memory store: the one object)."""
    others = [await _another(backend, backend_url) for _ in range(3)]
    stores = [store if each is None else each for each in [store, *others]]
    try:
        for round_ in range(5):
            name = f"race-{round_}"
            answers = await asyncio.gather(
                *(
                    each.hold_lease(name, f"cluster-{i}-{j}", 30.0)
                    for i, each in enumerate(stores)
                    for j in range(3)
                )
            )
            assert len({answer.holder for answer in answers}) == 1, answers
    finally:
        for each in others:
            if each is not None:
                await each.close()


@pytest.mark.parametrize("backend", ["redis"])
async def test_a_redis_lease_key_edited_by_hand_is_no_lease(store: Any) -> None:
    """A lease key set without a TTL is taken (it would be held for ever); one of
    another type is a StoreError, not the driver's WRONGTYPE."""
    from runtime.errors import StoreError

    key = f"{store.prefix}:lease:system-a"
    await store.client.set(key, "cluster-gone")
    assert (await store.hold_lease("system-a", "cluster-1", 30.0)).holder == "cluster-1"
    await store.client.delete(key)
    await store.client.hset(key, "holder", "x")
    with pytest.raises(StoreError):
        await store.hold_lease("system-a", "cluster-1", 30.0)
    await store.drop_lease("system-a", "cluster-1")  # leaves what it does not know
    assert await store.client.type(key) == "hash"


async def _another(backend: str, url: str) -> Any:
    """Another connection to the fixture's store (not emptied as the fixture's was)."""
    if backend == "memory":
        return None
    if backend == "redis":
        return await RedisCommitStore.connect(url)
    return await SqlCommitStore.connect(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
async def test_a_lease_set_by_hand_to_run_out_far_ahead_is_no_lease(
    store: Any, backend: str
) -> None:
    """A year 3000, NaN, infinity or text (SQLite): no holder sets it, so it is taken as
    an expired lease. It was waited on for ever, every claim refused with SystemInUse
    naming a holder that never renewed; text on SQLite failed every hold with a
    ValueError."""
    from sqlalchemy import text

    far = ["1e11", "'NaN'", "'Infinity'"] if backend == "postgres" else ["1e11", "'garbage'"]
    if backend == "redis":
        far = ["year 3000"]
    for expiry in far:
        assert (await store.hold_lease("system-a", "cluster-gone", 30.0)).holder == "cluster-gone"
        if backend == "redis":
            key = f"{store.prefix}:lease:system-a"
            await store.client.set(key, "cluster-gone", ex=10**9)  # some thirty years
        else:
            async with store.engine.begin() as conn:
                await conn.execute(
                    text(f"UPDATE ratchet_leases SET expires_at = {expiry} WHERE name = 'system-a'")
                )
        lease = await store.hold_lease("system-a", "cluster-1", 30.0)
        assert (lease.holder, round(lease.expires_in_s)) == ("cluster-1", 30), expiry
        await store.drop_lease("system-a", "cluster-1")


async def test_a_lease_held_longer_than_any_holder_sets_is_no_lease_in_memory() -> None:
    from storage.leases import MAX_LEASE_AHEAD_S, LeaseTable

    table = LeaseTable()
    table.hold("a", "cluster-gone", MAX_LEASE_AHEAD_S * 2)
    assert table.hold("a", "cluster-1", 30.0).holder == "cluster-1"
    table.hold("b", "cluster-alive", MAX_LEASE_AHEAD_S)
    assert table.hold("b", "cluster-1", 30.0).holder == "cluster-alive"
