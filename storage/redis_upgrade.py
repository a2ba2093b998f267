"""Bringing a Redis store of an earlier layout up to date, at connect.

Layout "1" kept no ``sums`` list and no frontier checksum or head; layout "2" has
them, and the owner index; layout "3" may also have pruned threads (an anchor in the
meta, lists that begin after it); layout "4" (``storage.redis_store``) keeps each
message once, in the log, the frontier holding its head alone, and a pruned thread's
messages of the records removed in its ``history`` list. A "2" store reads as a "4"
one with nothing pruned, so it is upgraded by setting ``P:schema`` alone (a
compare-and-set: no lock, nothing else written); frontiers that hold their messages
still read, and lose them at their next append. A "3" store's pruned threads held the
messages of their records removed only in their frontier: under the lock below each
gets its ``history`` from there (``upgrade_pruned``: one script per thread, a
compare-and-set on its frontier text and anchor), checked against the records kept;
a "1" store is upgraded as below, straight to "4". ``upgrade_layout`` runs on every
connect and returns at once once ``P:schema`` says "4".

- **One upgrader at a time, none for ever.** The lock ``P:upgrading`` holds a random
  token under a short lease (``LEASE_MS``) that its holder renews while it lives and
  releases by compare-and-delete, so no one else's lock is ever deleted. A process that
  finds the lock held waits; when the holder dies (kill -9) its lease runs out, the key
  is gone with the layout key still unset, and the next waiter takes over.
- **Each thread atomically, at most once.** A thread is read in one MULTI (meta, log,
  receipts), its hashes computed here, and one script (``_THREAD_LUA``) writes them only
  if the thread is still un-upgraded (no checksum) and its frontier text and log length
  are what was read. Two upgraders at once (a lease that ran out under a slow one)
  therefore never both write a thread, and a stale one never rolls back a thread that a
  writer of the new layout has appended to since (its append wrote a checksum).
- **Damage is not blessed.** Each body's hash must be the ``payload_hash`` of its
  receipt in ``ops``, the log must be as long as the frontier's version, every key of
  its type. A thread that fails is logged and left un-upgraded (no checksum), so a load
  of that thread alone fails closed, as SQL migration 4 leaves a row whose frontier
  does not decode; the others are upgraded and the store opens.
- **A newer layout is refused** (``StoreTooNew``), and nothing is written: this code
  would corrupt its threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
import redis.exceptions as rex
from pydantic import ValidationError

from runtime.commit import Frontier, Receipt
from runtime.errors import StoreError, StoreUnavailable
from runtime.integrity import body_hash, frontier_checksum, history_digest, message_text
from runtime.ports import host_of
from storage.errors import StoreTooNew
from storage.redis_scripts import TYPED, Skipped
from storage.summary import RUN_STATES, summarize

log = logging.getLogger("ratchet.storage.redis")

LAYOUT = "4"
CHAINED = "2"
"""The layout before retention: the same keys, nothing pruned."""
RETAINED = "3"
"""The layout before incremental history: pruned threads kept their messages in the
frontier alone."""
LEASE_MS = 2000
"""The upgrade lock's lease: how long a dead upgrader keeps the others waiting."""
WAIT_S = 300.0
"""How long a connect waits for a live upgrader before it gives up (StoreUnavailable)."""
_POLL_S = 0.05
_ATTEMPTS = 3
"""Reads of a thread whose log moves under the upgrader (an old writer still running)."""
Outcome = Literal["upgraded", "skipped", "damaged"]
"""``upgraded`` here; ``skipped``: nothing to do (upgraded elsewhere, no frontier yet);
``damaged``: left un-upgraded, so that its load fails closed."""

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_BUMP_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: meta log sums runs:running runs:awaiting runs:ended owner:HOST
# ARGV: frontier as read, log length as read, new frontier, its checksum, head, thread,
#       run state (0 none, 1..3 as RUN_STATES), run-index entry, then the hashes
# A shared index of another type (edited by hand) is left unwritten, as appends do
# (``redis_scripts.Skipped``): failing there left every thread un-upgraded, each failing
# closed for good, for one key that is no thread's.
_THREAD_LUA = """#!lua
local want = {'hash', 'list', 'list', 'hash', 'hash', 'hash', 'hash'}
%(typed)s
local ok, broken = typed(7, 4)
if not ok then return 'corrupt ' .. broken end
local f = redis.call('HMGET', KEYS[1], 'frontier', 'checksum')
if f[2] then return 'done' end
if f[1] ~= ARGV[1] or redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return 'moved' end
redis.call('DEL', KEYS[3])
for i = 9, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', KEYS[1], 'frontier', ARGV[3], 'checksum', ARGV[4], 'head', ARGV[5])
local state = tonumber(ARGV[7])
if state > 0 then
  for i = 4, 6 do
    if not broken[i] then redis.call('HDEL', KEYS[i], ARGV[6]) end
  end
  if not broken[3 + state] then redis.call('HSET', KEYS[3 + state], ARGV[6], ARGV[8]) end
  if state == 1 and not broken[7] then redis.call('HSET', KEYS[7], ARGV[6], '1') end
end
if #broken.keys > 0 then return {'ok', unpack(broken.keys)} end
return 'ok'
""".replace("%(typed)s", TYPED)


_SKIPPED = Skipped()
"""The shared indexes the upgrade left unwritten, logged once a while, not per thread."""


class Damaged(Exception):
    """A thread the upgrade leaves as it is (the reason is logged)."""


@dataclass(frozen=True)
class OldThread:
    """One thread as read, in one MULTI, before its upgrade."""

    thread: str
    text: str | None
    owner: str | None
    checksum: str | None
    version: str | None
    bodies: list[str]
    receipts: dict[str, str]


@dataclass(frozen=True)
class Upgrade:
    """What the script writes for one thread, if the thread is still as read."""

    old: OldThread
    text: str
    sums: list[str]
    state: int
    """0: no Run; else 1 + the index of its state in RUN_STATES."""
    entry: str


def check_layout(value: str | bytes | None, where: str) -> bool:
    """Whether ``P:schema`` says the layout is current; StoreTooNew if it is newer,
    StoreError if it is no layout at all."""
    if value is None:
        return False
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if not (text.isascii() and text.isdigit()):
        raise StoreError(f"redis at {where}: unknown store layout {text!r}")
    if int(text) > int(LAYOUT):
        raise StoreTooNew(int(text), int(LAYOUT))
    return int(text) == int(LAYOUT)


async def upgrade_layout(
    client: aioredis.Redis, prefix: str, where: str, *, wait_s: float = WAIT_S
) -> None:
    """Upgrade the store, or wait while a live process does (see the module docstring).
    Driver errors reach the caller as they are (``translated`` is the caller's)."""
    schema, lock = f"{prefix}:schema", f"{prefix}:upgrading"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not check_layout(layout := await client.get(schema), where):
        if layout in (CHAINED, CHAINED.encode()):
            await client.eval(_BUMP_LUA, 1, schema, CHAINED, LAYOUT)
            continue
        token = secrets.token_hex(16)
        if await client.set(lock, token, nx=True, px=LEASE_MS):
            try:
                if not check_layout(await client.get(schema), where):  # done meanwhile?
                    await _as_holder(client, prefix, lock, token)
            finally:
                with contextlib.suppress(rex.RedisError, OSError):  # the lease runs out
                    await client.eval(_RELEASE_LUA, 1, lock, token)
            return
        if loop.time() > deadline:
            raise StoreUnavailable(f"redis at {where}: the layout upgrade did not finish")
        await asyncio.sleep(_POLL_S)


async def _as_holder(client: aioredis.Redis, prefix: str, lock: str, token: str) -> None:
    done = asyncio.Event()  # not a cancel: cancelling a command in flight can hang it
    renewer = asyncio.create_task(_keep_lease(client, lock, token, done))
    try:
        layout = await client.get(f"{prefix}:schema")
        if layout in (RETAINED, RETAINED.encode()):
            outcomes = await upgrade_pruned(client, prefix)
        else:
            outcomes = await upgrade_threads(client, prefix)
        await client.set(f"{prefix}:schema", LAYOUT)
    finally:
        done.set()
        await renewer
    counts = {o: sum(1 for v in outcomes.values() if v == o) for o in ("upgraded", "damaged")}
    log.info("redis key layout %s: %s", LAYOUT, counts)


async def _keep_lease(client: aioredis.Redis, lock: str, token: str, done: asyncio.Event) -> None:
    """Renew the lease until ``done``; once it is lost, another process may upgrade too,
    which the per-thread script makes harmless."""
    try:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), LEASE_MS / 4000)
            if not done.is_set() and not await client.eval(_RENEW_LUA, 1, lock, token, LEASE_MS):
                log.warning("the upgrade lock was lost: another process may upgrade as well")
                return
    except (rex.RedisError, OSError) as exc:
        log.warning("renewing the upgrade lock failed: %s", exc)


async def upgrade_threads(client: aioredis.Redis, prefix: str) -> dict[str, Outcome]:
    """Upgrade every thread that still needs it; what became of each (by thread id)."""
    first, last = f"{prefix}:thread:", ":meta"
    outcomes: dict[str, Outcome] = {}
    async for meta in client.scan_iter(match=f"{first}*{last}"):
        thread = str(meta)[len(first) : -len(last)]
        if thread not in outcomes:  # SCAN may return a key twice
            outcomes[thread] = await upgrade_thread(client, prefix, thread)
    return outcomes


async def upgrade_thread(client: aioredis.Redis, prefix: str, thread: str) -> Outcome:
    for _ in range(_ATTEMPTS):
        try:
            old = await read_thread(client, prefix, thread)
            if old.text is None or old.checksum is not None:
                return "skipped"
            reply = await write_upgrade(client, prefix, plan_upgrade(old))
        except Damaged as exc:
            log.warning("redis thread %r left as it was (its load fails closed): %s", thread, exc)
            return "damaged"
        if reply != "moved":
            log.debug("redis thread %r: %s", thread, reply)
            return "upgraded" if reply == "ok" else "skipped"
    log.warning("redis thread %r kept moving under the upgrade: left as it was", thread)
    return "damaged"


async def read_thread(client: aioredis.Redis, prefix: str, thread: str) -> OldThread:
    key = f"{prefix}:thread:{thread}"
    async with client.pipeline(transaction=True) as pipe:
        pipe.hmget(f"{key}:meta", ["frontier", "owner", "checksum", "version"])
        pipe.lrange(f"{key}:log", 0, -1)
        pipe.hgetall(f"{key}:ops")
        found = await pipe.execute(raise_on_error=False)
    for part, value in zip(("meta", "log", "ops"), found, strict=True):
        if isinstance(value, rex.ResponseError):  # WRONGTYPE: a key edited by hand
            raise Damaged(f"{key}:{part}: {value}")
    (text, owner, checksum, version), bodies, receipts = found
    return OldThread(thread, text, owner, checksum, version, list(bodies), dict(receipts))


def plan_upgrade(old: OldThread) -> Upgrade:
    """The upgraded thread, checked first: Damaged unless every stored part agrees."""
    assert old.text is not None
    try:
        frontier = Frontier.model_validate_json(old.text)
        version = int(old.version or 0)
    except (ValidationError, ValueError) as exc:
        raise Damaged(f"the frontier does not decode: {exc}") from None
    if frontier.thread_id != old.thread or frontier.version != version:
        raise Damaged("the frontier names another thread or version")
    if len(old.bodies) != version:
        raise Damaged(f"the log holds {len(old.bodies)} records, the frontier {version}")
    sums = [body_hash(b) for b in old.bodies]
    vouched = _vouched(old)
    for seq, digest in enumerate(sums, 1):
        if vouched.get(seq) != digest:
            raise Damaged(f"record {seq} does not match the payload hash of its receipt")
    head = sums[-1] if sums else ""
    text = frontier.model_copy(update={"schema_version": 2, "head": head}).model_dump_json()
    summary = summarize(frontier.model_copy(update={"owner": old.owner}))
    state = 0 if summary is None else 1 + RUN_STATES.index(summary.state)
    entry = "" if summary is None else summary.model_dump_json()
    return Upgrade(old, text, sums, state, entry)


def _vouched(old: OldThread) -> dict[int, str]:
    """The payload hash each receipt stored beside the log names, by seq."""
    hashes: dict[int, str] = {}
    for text in old.receipts.values():
        try:
            receipt = Receipt.model_validate_json(text)
        except ValidationError:
            raise Damaged("a stored receipt does not decode") from None
        if receipt.thread_id != old.thread or receipt.seq in hashes:
            raise Damaged(f"the receipts disagree at seq {receipt.seq}")
        hashes[receipt.seq] = receipt.payload_hash
    return hashes


async def write_upgrade(client: aioredis.Redis, prefix: str, upgrade: Upgrade) -> str:
    """Run the script: ``ok``, ``done`` (upgraded meanwhile: nothing written) or
    ``moved`` (the log or frontier changed since the read: nothing written)."""
    old, key = upgrade.old, f"{prefix}:thread:{upgrade.old.thread}"
    keys = [f"{key}:meta", f"{key}:log", f"{key}:sums"]
    keys += [f"{prefix}:runs:{s}" for s in RUN_STATES]
    keys.append(f"{prefix}:owner:{host_of(old.owner) or ''}")
    args: list[Any] = [old.text, len(old.bodies), upgrade.text, frontier_checksum(upgrade.text)]
    args += [upgrade.sums[-1] if upgrade.sums else "", old.thread, upgrade.state, upgrade.entry]
    script = client.register_script(_THREAD_LUA)  # EVALSHA, loading it on first use
    answer = await script(keys=keys, args=[*args, *upgrade.sums])
    if _SKIPPED.of_append(old.thread, answer):
        return "ok"
    reply = str(answer)
    if reply.startswith("corrupt"):
        raise Damaged(f"{reply.partition(' ')[2]} is of the wrong type")
    return reply


# ---- layout 3 to 4: the pruned threads' history ------------------------------------------

# KEYS: meta history
# ARGV: frontier as read, anchor as read, the digest, then the messages' texts
_PRUNED_LUA = """#!lua
local want = {'hash', 'list'}
for i = 1, 2 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= 'none' and t ~= want[i] then return 'corrupt ' .. KEYS[i] end
end
local f = redis.call('HMGET', KEYS[1], 'frontier', 'pruned', 'pruned_digest')
if f[3] then return 'done' end
if f[1] ~= ARGV[1] or f[2] ~= ARGV[2] then return 'moved' end
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', KEYS[1], 'pruned_digest', ARGV[3])
return 'ok'
"""


async def upgrade_pruned(client: aioredis.Redis, prefix: str) -> dict[str, Outcome]:
    """Give every pruned thread of a layout 3 store its pruned history (by thread id)."""
    first, last = f"{prefix}:thread:", ":meta"
    outcomes: dict[str, Outcome] = {}
    async for meta in client.scan_iter(match=f"{first}*{last}"):
        thread = str(meta)[len(first) : -len(last)]
        if thread not in outcomes:  # SCAN may return a key twice
            outcomes[thread] = await _pruned_thread(client, f"{first}{thread}", thread)
    return outcomes


async def _pruned_thread(client: aioredis.Redis, key: str, thread: str) -> Outcome:
    for _ in range(_ATTEMPTS):
        async with client.pipeline(transaction=True) as pipe:
            pipe.hmget(f"{key}:meta", ["frontier", "pruned", "pruned_digest"])
            pipe.lrange(f"{key}:log", 0, -1)
            found = await pipe.execute(raise_on_error=False)
        if any(isinstance(v, rex.ResponseError) for v in found):
            log.warning("redis thread %r left as it was: a key of the wrong type", thread)
            return "damaged"
        (text, pruned, digest), bodies = found
        if text is None or not pruned or digest is not None:
            return "skipped"
        try:
            texts = _pruned_texts(thread, text, bodies)
        except Damaged as exc:
            log.warning("redis thread %r left as it was (its load fails closed): %s", thread, exc)
            return "damaged"
        script = client.register_script(_PRUNED_LUA)
        args = [text, pruned, history_digest("", texts), *texts]
        reply = str(await script(keys=[f"{key}:meta", f"{key}:history"], args=args))
        if reply.startswith("corrupt"):
            return "damaged"
        if reply != "moved":
            return "upgraded" if reply == "ok" else "skipped"
    return "damaged"


def _pruned_texts(thread: str, text: str, bodies: list[str]) -> list[str]:
    """The messages a layout 3 frontier holds from before the records kept."""
    try:
        frontier = Frontier.model_validate_json(text)
        kept = sum(len(json.loads(b).get("messages", ())) for b in bodies)
    except (ValidationError, ValueError, AttributeError) as exc:
        raise Damaged(f"the frontier or a record does not decode: {exc}") from None
    before = len(frontier.messages) - kept
    if frontier.thread_id != thread or before < 0:
        raise Damaged("the frontier holds fewer messages than the records kept")
    return [message_text(m) for m in frontier.messages[:before]]
