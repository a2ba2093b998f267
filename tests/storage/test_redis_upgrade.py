"""A Redis store of the layout before the hash chain upgrades at connect, and safely.

The old data is test_migration.py's (real Runs, kept as the old layout kept them: no
hash list, no checksum, no head, no owner index, no schema key). Connecting must
upgrade it, every read and load verify, ``ratchet verify --all`` pass, the Runs go on,
and a second connect change nothing. The upgrade must hold with two upgraders at once,
with a real upgrading process killed (kill -9) half-way while another connect waits,
with one stalled while writers of the new layout append, and with damage already in the
old store (a body its receipt does not vouch for, keys of the wrong type): what is
damaged is left un-upgraded, so it fails closed, and the store opens. A store of a
newer layout is refused, untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.commit import Receipt
from runtime.errors import CorruptRecord, StoreError
from runtime.ids import ThreadId
from runtime.integrity import frontier_checksum
from runtime.ports import host_of
from storage.errors import StoreTooNew
from storage.memory import MemoryCommitStore
from storage.redis_client import open_client
from storage.redis_store import RedisCommitStore
from storage.redis_upgrade import (
    LAYOUT,
    LEASE_MS,
    plan_upgrade,
    read_thread,
    upgrade_threads,
    write_upgrade,
)
from storage.summary import summarize
from tests.storage.test_migration import (
    CRASHED,
    DONE,
    WAITING,
    Old,
    as_old,
    check_verified,
    go_on,
    old_threads,
    sha,
    verifies_and_runs_go_on,
    verify_all,
)
from tests.storage.test_verify_cli import ratchet
from tests.support.waiting import until

REDIS_DB = 13
"""This file's own Redis database (flushed before and after each test)."""
ROOT = Path(__file__).resolve().parents[2]
JUNK = ThreadId("t-junk")


# ---- the layout before the chain ----------------------------------------------------------


@pytest.fixture
async def redis_old(redis_url: str) -> AsyncIterator[str]:
    url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    client = (await RedisCommitStore.connect(url)).client
    await client.flushdb()  # (that connect saw an empty store: nothing was upgraded)
    try:
        yield url
    finally:
        await client.flushdb()
        await client.aclose()


async def write_old_redis(store: RedisCommitStore, olds: list[Old]) -> None:
    """The keys of the layout before the chain: no sums, no checksum, no head, no owner
    index, no schema key; the frontier text at schema 1, its epoch and owner beside it."""
    client, prefix = store.client, store.prefix
    await client.delete(f"{prefix}:schema")
    for old in olds:
        f, key = old.frontier, f"{prefix}:thread:{old.thread}"
        meta = {"frontier": json.dumps(old.frontier_json(ownerless=True))}
        meta |= {"epoch": str(f.epoch), "owner": f.owner or "", "version": str(f.version)}
        meta |= {"run_id": f.run_id or "", "ended": "1" if f.ended else "0"}
        receipts = {
            op: Receipt(thread_id=f.thread_id, seq=seq, operation_id=op, payload_hash=sha(b))
            for seq, (b, op) in enumerate(zip(old.bodies, old.operations, strict=True), 1)
        }
        summary = summarize(f)
        assert summary is not None
        async with client.pipeline(transaction=False) as pipe:
            pipe.hset(f"{key}:meta", mapping=meta)
            pipe.rpush(f"{key}:log", *old.bodies)
            pipe.hset(f"{key}:ops", mapping={k: r.model_dump_json() for k, r in receipts.items()})
            pipe.hset(f"{prefix}:runs:{summary.state}", old.thread, summary.model_dump_json())
            await pipe.execute()


async def _redis_dump(store: RedisCommitStore) -> dict[str, Any]:
    from tests.storage.test_integrity import RedisTamper

    return dict(await RedisTamper(store, ThreadId("-")).snapshot())


async def upgraded_redis(url: str, ran: list[str]) -> tuple[RedisCommitStore, list[Old]]:
    olds = await old_threads(ran, claimed=False)
    writer = await RedisCommitStore.connect(url)
    await write_old_redis(writer, olds)
    await writer.close()
    return await RedisCommitStore.connect(url), olds


async def test_an_old_redis_layout_upgrades_and_verifies(redis_old: str) -> None:
    store, olds = await upgraded_redis(redis_old, [])
    try:
        client, prefix = store.client, store.prefix
        assert await client.get(f"{prefix}:schema") == LAYOUT
        for old in olds:
            key = f"{prefix}:thread:{old.thread}"
            assert await client.lrange(f"{key}:sums", 0, -1) == [sha(b) for b in old.bodies]
            meta = await client.hgetall(f"{key}:meta")
            assert meta["head"] == old.head
            assert meta["checksum"] == frontier_checksum(meta["frontier"])
        crashed = next(o.frontier for o in olds if o.thread == CRASHED)
        owners = await client.hkeys(f"{prefix}:owner:{host_of(crashed.owner)}")
        assert owners == [CRASHED]  # the running Run is in its host's owner index
        await check_verified(store, olds)
        upgraded = await _redis_dump(store)
        await (await RedisCommitStore.connect(redis_old)).close()
        assert await _redis_dump(store) == upgraded  # a second connect changes nothing
    finally:
        await store.close()


async def test_an_upgraded_store_verifies_and_its_runs_go_on(redis_old: str) -> None:
    await verifies_and_runs_go_on(redis_old, upgraded_redis)


# ---- Redis: upgraders that race, die or stall, and damage found on the way ----------------


async def old_redis(url: str) -> tuple[RedisCommitStore, list[Old]]:
    """A store of the old layout, and a connected store to edit it with (its connect saw
    an empty store: nothing was upgraded)."""
    olds = await old_threads([], claimed=False)
    writer = await RedisCommitStore.connect(url)
    await write_old_redis(writer, olds)
    return writer, olds


async def test_two_connects_at_once_upgrade_each_thread_once(
    redis_old: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer, olds = await old_redis(redis_old)
    caplog.set_level(logging.DEBUG, logger="ratchet.storage.redis")
    stores = await asyncio.gather(*(RedisCommitStore.connect(redis_old) for _ in range(2)))
    try:
        written = [r.args for r in caplog.records if r.msg == "redis thread %r: %s"]
        assert sorted(written) == sorted((o.thread, "ok") for o in olds)
        for store in stores:
            await check_verified(store, olds)
    finally:
        for store in (*stores, writer):
            await store.close()
    await verify_all(redis_old, len(olds))


async def test_two_upgraders_at_once_write_each_thread_once(redis_old: str) -> None:
    """As when the lock's lease ran out under a slow upgrader: both work through the same
    threads at once, and each thread is written by one of them."""
    writer, olds = await old_redis(redis_old)
    clients = [open_client(redis_old) for _ in range(2)]
    try:
        outcomes = await asyncio.gather(*(upgrade_threads(c, writer.prefix) for c in clients))
    finally:
        for client in clients:
            await client.aclose()
    assert all(set(o) == {old.thread for old in olds} for o in outcomes)
    for old in olds:
        assert sorted(o[old.thread] for o in outcomes) == ["skipped", "upgraded"]
    await writer.close()
    store = await RedisCommitStore.connect(redis_old)
    try:
        await check_verified(store, olds)
    finally:
        await store.close()
    await verify_all(redis_old, len(olds))


KILLED = 300
"""Threads of the store whose upgrader is killed."""
STOPS_AFTER = 5
UPGRADER = f"""
import asyncio, os, signal, sys
import storage.redis_upgrade as upgrading
from storage.redis_store import RedisCommitStore

# the upgrader stops itself a few threads in, to be killed there: a kill timed from
# outside came after the last thread once (the machine busy, the test's poll late)
done, upgrade_thread = [], upgrading.upgrade_thread

async def upgrade_one(*args):
    outcome = await upgrade_thread(*args)
    done.append(outcome)
    if len(done) == {STOPS_AFTER}:
        os.kill(os.getpid(), signal.SIGSTOP)
    return outcome

upgrading.upgrade_thread = upgrade_one

async def main() -> None:
    await (await RedisCommitStore.connect(sys.argv[1])).close()

asyncio.run(main())
"""


async def many_old(n: int) -> list[Old]:
    """``n`` threads of one ended Run each, as the old layout held them."""
    store = MemoryCommitStore()
    names = [ThreadId(f"t-{i:04d}") for i in range(n)]
    for name in names:
        agent = Agent(name="done", model=ScriptedModel([ModelResponse(text="hello")]))
        await InProcessRunner(agent, store).start("hi", thread_id=name)
    return [await as_old(store, name) for name in names]


async def _upgraded(client: Any, prefix: str, olds: list[Old]) -> int:
    """How many of the threads are upgraded (they have a checksum)."""
    async with client.pipeline(transaction=False) as pipe:
        for old in olds:
            pipe.hexists(f"{prefix}:thread:{old.thread}:meta", "checksum")
        return sum(await pipe.execute())


async def _upgraded_as_many(client: Any, prefix: str, olds: list[Old], n: int) -> bool:
    return await _upgraded(client, prefix, olds) >= n


async def test_an_upgrader_killed_half_way_is_taken_over(
    redis_old: str, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of a real process a few threads into the upgrade: its lock outlives it, so
    the next connect takes over once the lease has run out (seconds, not the five
    minutes a connect once waited), upgrades exactly the threads left, and every thread
    verifies."""
    olds = await many_old(KILLED)
    writer = await RedisCommitStore.connect(redis_old)
    client, prefix = writer.client, writer.prefix
    await write_old_redis(writer, olds)
    caplog.set_level(logging.INFO, logger="ratchet.storage.redis")
    upgrader = await asyncio.create_subprocess_exec(
        sys.executable, "-c", UPGRADER, redis_old, cwd=ROOT, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        await until(
            lambda: _upgraded_as_many(client, prefix, olds, STOPS_AFTER),
            30.0,
            what=f"{STOPS_AFTER} threads upgraded (and the upgrader stopped)",
        )
        upgrader.send_signal(signal.SIGKILL)
    finally:
        if upgrader.returncode is None:
            upgrader.kill()
        assert await upgrader.wait() == -signal.SIGKILL
    by_the_dead = await _upgraded(client, prefix, olds)
    assert by_the_dead == STOPS_AFTER < len(olds)
    assert await client.get(f"{prefix}:schema") is None
    assert await client.pttl(f"{prefix}:upgrading") > 0  # its lock, held by no one alive
    store = await asyncio.wait_for(RedisCommitStore.connect(redis_old), LEASE_MS / 1000 + 20)
    try:
        assert await client.get(f"{prefix}:schema") == LAYOUT
        assert not await client.exists(f"{prefix}:upgrading")  # released by the new holder
        done = [r.args for r in caplog.records if r.msg == "redis key layout %s: %s"]
        assert done == [(LAYOUT, {"upgraded": len(olds) - by_the_dead, "damaged": 0})]
    finally:
        await store.close()
        await writer.close()
    await verify_all(redis_old, len(olds))


async def test_a_stalled_upgrader_never_rolls_back_a_later_append(redis_old: str) -> None:
    """An upgrader reads every thread, then stalls; another upgrades the store and Runs
    go on under the new layout. When the stalled one writes at last, nothing changes."""
    writer, olds = await old_redis(redis_old)
    client, prefix = writer.client, writer.prefix
    stalled = [plan_upgrade(await read_thread(client, prefix, o.thread)) for o in olds]
    store = await RedisCommitStore.connect(redis_old)
    try:
        await go_on(store, [], olds)
        after = await _redis_dump(store)
        for upgrade in stalled:
            assert await write_upgrade(client, prefix, upgrade) == "done"
        assert await _redis_dump(store) == after
    finally:
        await store.close()
        await writer.close()
    await verify_all(redis_old, len(olds))


async def test_damage_in_an_old_store_is_not_blessed(redis_old: str) -> None:
    """A body edited before the upgrade (its receipt names another hash), a log key and a
    meta key of the wrong type: those threads are left un-upgraded, so they fail closed;
    the store opens, the other thread verifies, and every later connect opens too."""
    writer, olds = await old_redis(redis_old)
    client, prefix = writer.client, writer.prefix
    done = next(o for o in olds if o.thread == DONE)
    edited = done.bodies[-1].replace("hello", "HELLO")
    assert edited != done.bodies[-1]
    await client.lset(f"{prefix}:thread:{DONE}:log", len(done.bodies) - 1, edited)
    await client.delete(f"{prefix}:thread:{CRASHED}:log")
    await client.set(f"{prefix}:thread:{CRASHED}:log", "not a list")
    await client.rpush(f"{prefix}:thread:{JUNK}:meta", "a list where a hash belongs")
    for _ in range(2):
        store = await RedisCommitStore.connect(redis_old)
        try:
            assert await client.get(f"{prefix}:schema") == LAYOUT
            assert await client.hget(f"{prefix}:thread:{DONE}:meta", "checksum") is None
            assert await client.hget(f"{prefix}:thread:{CRASHED}:meta", "checksum") is None
            with pytest.raises(CorruptRecord) as info:
                await store.load(DONE)
            assert info.value.thread == DONE
            await check_verified(store, [o for o in olds if o.thread == WAITING])
        finally:
            await store.close()
    await writer.close()
    result = await ratchet("verify", "--all", "--store", redis_old)
    assert result.exit_code == 1
    for thread in (DONE, CRASHED, JUNK):
        assert f"thread '{thread}'" in result.stderr
    assert f"thread '{WAITING}'" not in result.stderr


async def test_a_shared_index_of_the_wrong_type_leaves_no_thread_un_upgraded(
    redis_old: str,
) -> None:
    """``SET P:runs:ended x`` in an old store: every thread was left un-upgraded (each
    failing closed for good) for one key that is no thread's. Each is upgraded now, the
    key left as it is, and ``ratchet verify`` names it."""
    writer, olds = await old_redis(redis_old)
    ended = f"{writer.prefix}:runs:ended"
    await writer.client.delete(ended)
    await writer.client.set(ended, "edited by hand")
    store = await RedisCommitStore.connect(redis_old)
    try:
        await check_verified(store, olds)
        assert await writer.client.get(ended) == "edited by hand"
    finally:
        await store.close()
        await writer.close()
    result = await ratchet("verify", "--all", "--store", redis_old)
    assert result.exit_code == 1 and ended in result.stderr


@pytest.mark.parametrize("layout", ["5", "banana"])
async def test_a_store_of_a_newer_redis_layout_is_refused(redis_old: str, layout: str) -> None:
    """Refused before anything is written: an old-layout thread beside it stays as it was."""
    writer, _ = await old_redis(redis_old)
    await writer.client.set(f"{writer.prefix}:schema", layout)
    before = await _redis_dump(writer)
    try:
        with pytest.raises(StoreError) as info:
            await RedisCommitStore.connect(redis_old)
        assert await _redis_dump(writer) == before
    finally:
        await writer.close()
    if layout == "banana":  # no layout at all: not taken for a newer one
        assert type(info.value) is StoreError and "unknown store layout" in str(info.value)
        return
    assert isinstance(info.value, StoreTooNew)
    assert (info.value.found, info.value.known) == (5, 4)
    assert str(info.value) == "store schema 5 is newer than this Ratchet (4): upgrade Ratchet"
