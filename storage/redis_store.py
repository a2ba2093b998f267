"""The Redis CommitStore: one Lua script makes the checks and the append one atomic step.

**Durability.** Redis is durable only with AOF and ``appendfsync always``
(``--appendonly yes --appendfsync always``). With ``everysec`` (the default) or
RDB snapshots alone, a commit whose receipt was returned can be lost on a crash:
run it that way only where losing the last second of commits is acceptable.
Redis 7 or newer, a single primary (not Redis Cluster: the run index spans threads).

**How an append works.** Python loads the frontier, applies the pure admission rule of
``runtime.commit`` (``admit``: the append's own claim, fencing, version, the hash chain,
the fold) and sends the new frontier to a Lua script that re-checks, atomically, what
may have changed since the load — operation id unknown, owner epoch, version (the run's
end comes with a version, and ``admit`` checked it on the frontier the checksum vouches
for: the ``run_id``/``ended`` meta fields are written for readers of the layout, never
trusted) — and then writes the commit, its hash, its receipt, the frontier with its
checksum, the run index and the owner index. The script answers ``ok``, ``refused`` or
``corrupt KEY``. On ``refused`` the append loads again and lets ``admit`` name the error
(or the original receipt of a retried write): the order of the rules lives in one place
only. Every refusal condition is monotonic — an operation id stays known, epochs and
versions only grow, an ended run stays ended until the version moves — so the second
look refuses too. The script reads and type-checks every key before its first write, so
a refused or failed append writes nothing; but a shared index of another type (edited by
hand) is left unwritten, logged and named by ``ratchet verify``
(``redis_scripts.Skipped``): it is no thread's fault, and failing closed stalled every
Run. The epoch and owner live beside the frontier JSON (hash fields a claim moves
alone); the JSON names those of the append that wrote it, so a pair beside it that is
older, or the same epoch with another owner, fails closed
(``redis_rows.decode_frontier``: the epoch is the fencing token).
**A claim** is one script too, a compare-and-set on the epoch alone: it checks
the epoch it supersedes, never the version the claimer loaded (as in SQL and memory,
appends of the superseded owner that land in between do not refuse it; the script
answers the frontier they left), bumps the epoch, patches the new owner into the
thread's run-index entry and moves the thread in the owner index, or answers ``fenced``.

**Key layout** (``P`` is the prefix, default ``ratchet``; ``T`` the thread id)::

    P:thread:T:meta       hash    frontier  the Frontier's head: JSON without messages
                                            (the epoch and owner of its append inside)
                                  checksum  SHA-256 of the frontier text
                                  head      hash of the latest commit
                                  epoch     owner epoch (decimal)
                                  owner     owner name
                                  version   thread version (= log length)
                                  run_id    current run id (for readers: never trusted)
                                  ended     "1" when the current run has ended (same)
                                  pruned    seq of the last record a prune removed
                                            (absent: none was; ``storage.retention``)
                                  pruned_hash  its stored hash (the chain's anchor)
                                  pruned_digest  the ``history_digest`` of ``history``
    P:thread:T:log        list    encoded ThreadCommits; index i holds seq
                                  pruned + i + 1 (their messages: the history)
    P:thread:T:history    list    the messages of the records a prune removed, one
                                  JSON text each, in order (the pruned history)
    P:thread:T:sums       list    their hashes, index for index (the chain)
    P:thread:T:ops        hash    operation id -> Receipt JSON
    P:runs:STATE          hash    thread id -> RunSummary JSON, STATE one of
                                  running | awaiting | ended (a thread is in one)
    P:owner:HOST          hash    thread id -> "1": running threads whose owner
                                  belongs to HOST (``runtime.ports.host_of``)
    P:schema              string  "4" once the layout above is in place
    P:instance            string  the store's token, set by the first process to
                                  connect: gone or another, the contents were lost
                                  (``storage.redis_instance``: StoreLost)
    P:upgrading           string  the layout upgrade's lock (``storage.redis_upgrade``)
    P:lease:NAME          string  the holder of the store lease NAME, with a TTL (the
                                  server's clock: ``CommitStore.hold_lease``)

A store of an earlier layout (no ``sums``, no checksums; "2", which had no prunes; or
"3", whose frontiers held the messages and whose pruned threads no ``history``) is
upgraded at connect (``storage.redis_upgrade``); a store of a newer layout is
refused. An append writes the commit, its hash and receipt and the head: nothing
that grows with the history. ``load_head`` reads the meta; ``load`` reads the log
and the pruned history too, in the same MULTI, and takes the messages from them. Tests
corrupt a record with ``LSET P:thread:T:log (seq - pruned - 1) TEXT``, a frontier with
``HSET P:thread:T:meta frontier TEXT``, a pruned message with ``LSET …:history I TEXT``.

**A prune** (``storage.retention``) is one script too: it trims the first records off
``log`` and ``sums`` (LTRIM), appends their messages to ``history``, deletes their
receipts from ``ops`` and moves the anchor (``pruned``, ``pruned_hash``,
``pruned_digest``), if the anchor and digest are still the ones the prune read and the
hash list still holds the hash it read at the new anchor; else it answers ``moved``
and the prune reads again. The append script counts the lists from the anchor.

**Errors.** Driver exceptions become Ratchet's in ``redis_client.translated``; "refused"
what admit raises on a fresh load; "corrupt KEY" CorruptRecord.
"""

from __future__ import annotations

import json
import logging
import math

import redis.asyncio as aioredis

from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    frontier_text,
    head_only,
)
from runtime.errors import CorruptRecord, Fenced, StoreError
from runtime.ids import ThreadId
from runtime.integrity import (
    PrunedHistory,
    check_page_limit,
    frontier_checksum,
    history_digest,
    whole_frontier,
)
from runtime.ports import CommittedRecord, Lease, RunSummary, host_of
from runtime.rules import admit, check_claim, check_size, receipt_of, with_claim
from storage.leases import MAX_LEASE_AHEAD_S
from storage.redis_audit import index_problem
from storage.redis_client import open_client, translated
from storage.redis_instance import check_instance, instance_key, instance_of
from storage.redis_listing import list_runs
from storage.redis_rows import (
    META,
    anchor_of,
    decode_receipt,
    number_of,
    read_rows,
    verified_frontier,
)
from storage.redis_scripts import APPEND_LUA, CLAIM_LUA, LEASE_LUA, PRUNE_LUA, UNLEASE_LUA, Skipped
from storage.redis_upgrade import upgrade_layout
from storage.retention import Cut, prune_thread, stray_history
from storage.summary import RUN_STATES, RunStateKind, summarize
from storage.url import redact

log = logging.getLogger("ratchet.storage.redis")

_THREAD_KEYS = ("meta", "log", "sums", "ops", "history")
"""The keys of a thread (``P:thread:T:<part>``)."""
_ATTEMPTS = 3
"""A refusal is re-examined by loading again, and that look decides (the refusal
conditions are monotonic); the bound only guards against keys edited by hand."""
_READS = 5
"""Reads of a log whose anchor a prune moved between two reads (it only moves on)."""


class _Snapshot:
    """What a load reads: the verified frontier (with its epoch and owner)."""

    def __init__(self, frontier: Frontier, known: Receipt | None) -> None:
        self.frontier = frontier
        self.known = known


class RedisCommitStore:
    """CommitStore on one Redis primary; durable only with ``appendfsync always``."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        where: str = "redis",
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        prefix: str = "ratchet",
    ) -> None:
        self.client = client
        self.where = where
        self.payload_limit = payload_limit
        self.prefix = prefix
        self._append_script = client.register_script(APPEND_LUA)
        self._claim_script = client.register_script(CLAIM_LUA)
        self._prune_script = client.register_script(PRUNE_LUA)
        self._lease_script = client.register_script(LEASE_LUA)
        self._unlease_script = client.register_script(UNLEASE_LUA)
        self._instance = instance_key(prefix)
        self._skipped = Skipped()
        self.instance: str | None = None
        """The store's instance token read at connect (``storage.redis_instance``)."""

    @classmethod
    async def connect(
        cls, url: str, *, payload_limit: int = DEFAULT_PAYLOAD_LIMIT, prefix: str = "ratchet"
    ) -> RedisCommitStore:
        """Open a client, check the server answers (StoreUnavailable if it does not) and
        bring an earlier key layout up to date (StoreError if the layout is newer)."""
        store = cls(open_client(url), where=redact(url), payload_limit=payload_limit, prefix=prefix)
        try:
            with translated(store.where):
                await store.client.ping()
                await upgrade_layout(store.client, store.prefix, store.where)
                store.instance = await instance_of(store.client, store.prefix)
        except StoreError:
            await store.client.aclose()
            raise
        await store._warn_unless_durable()
        return store

    async def _warn_unless_durable(self) -> None:
        """Say so in the log when a receipt would not mean "on disk" (DESIGN §5)."""
        try:
            with translated(self.where):
                config = await self.client.config_get("append*")
        except StoreError:  # CONFIG is often disabled on managed servers: cannot tell
            return
        if config.get("appendonly") != "yes" or config.get("appendfsync") != "always":
            log.warning(
                "redis at %s is not durable (appendonly=%s, appendfsync=%s): a committed "
                "Step can be lost on a crash; use --appendonly yes --appendfsync always",
                self.where,
                config.get("appendonly"),
                config.get("appendfsync"),
            )

    # ---- keys ---------------------------------------------------------------------------

    def _key(self, thread: str, part: str) -> str:
        return f"{self.prefix}:thread:{thread}:{part}"

    def _index(self, state: RunStateKind) -> str:
        return f"{self.prefix}:runs:{state}"

    def _owners(self, owner: str | None) -> str:
        return f"{self.prefix}:owner:{host_of(owner) or ''}"

    # ---- the port -----------------------------------------------------------------------

    async def append(
        self, commit: ThreadCommit, expected_version: int, epoch: int, *, claim: str | None = None
    ) -> Receipt:
        check_size(commit, self.payload_limit)
        with translated(self.where, commit.thread_id):
            for _ in range(_ATTEMPTS):
                snap = await self._snapshot(commit.thread_id, commit.operation_id)
                outcome = admit(snap.frontier, commit, expected_version, epoch, snap.known, claim)
                if isinstance(outcome, Receipt):
                    return outcome
                receipt = await self._apply(commit, snap.frontier, outcome, claim)
                if receipt is not None:
                    return receipt
        raise StoreError(f"thread {commit.thread_id}: the append script kept refusing")

    async def load(self, thread: ThreadId) -> Frontier:
        """The whole frontier: the head, the log and the pruned history in one MULTI,
        the log verified, the messages taken from it (``whole_frontier``)."""
        with translated(self.where, thread):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hmget(self._key(thread, "meta"), META)
                pipe.lrange(self._key(thread, "log"), 0, -1)
                pipe.lrange(self._key(thread, "sums"), 0, -1)
                pipe.lrange(self._key(thread, "history"), 0, -1)
                pipe.get(self._instance)
                (
                    (text, version, epoch, owner, checksum, stored_head, *anchored),
                    bodies,
                    sums,
                    texts,
                    instance,
                ) = await pipe.execute()
        check_instance(instance, self.instance, self.where)
        anchor = anchor_of(thread, *anchored[:2])
        last = sums[-1] if sums else None
        head = verified_frontier(
            thread, text, version, epoch, owner, checksum, stored_head, len(sums), last, anchor
        )
        if not head.version:
            return head
        pruned = anchor[0] if anchor else 0
        stored = (head.version, head.head)
        records = read_rows(thread, 0, pruned + 1, bodies, sums, stored, anchor)
        history = None if anchor is None else PrunedHistory(texts, anchored[2])
        return whole_frontier(thread, head, records, history)

    async def load_head(self, thread: ThreadId) -> Frontier:
        """The frontier without its messages: the meta, and the hash list's tail."""
        with translated(self.where, thread):
            return (await self._snapshot(thread, None)).frontier

    async def read(
        self, thread: ThreadId, after_seq: int = 0, limit: int | None = None
    ) -> list[CommittedRecord]:
        """The lists begin after the anchor, so where a read starts in them depends on
        it: read with the anchor last seen (none at first), again if it was another."""
        check_page_limit(limit)
        pruned = 0
        with translated(self.where, thread):
            for _ in range(_READS):
                start = max(after_seq - pruned - 1, 0)
                stop = -1 if limit is None else min(start + limit, 2**63 - 1)  # Redis's int
                async with self.client.pipeline(transaction=True) as pipe:
                    pipe.hmget(
                        self._key(thread, "meta"), ["version", "head", "pruned", "pruned_hash"]
                    )
                    pipe.lrange(self._key(thread, "log"), start, stop)
                    pipe.lrange(self._key(thread, "sums"), start, stop)
                    pipe.get(self._instance)
                    (version, head, *anchored), bodies, sums, instance = await pipe.execute()
                check_instance(instance, self.instance, self.where)
                anchor = anchor_of(thread, *anchored)
                pruned = anchor[0] if anchor else 0
                if max(after_seq - pruned - 1, 0) == start:
                    stored = (number_of(thread, "version", version), head or "")
                    first = pruned + start + 1
                    return read_rows(thread, after_seq, first, bodies, sums, stored, anchor, limit)
        raise StoreError(f"thread {thread}: prunes kept moving its log under a read")

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        """Epoch + 1 (as ``runtime.rules.with_claim``) if the thread's epoch is still
        ``supersedes``, else Fenced; StoreUnavailable if the server does not answer (the
        claim may have landed or not). The load before the script only refuses early:
        the script decides alone, one compare-and-set on the epoch, whatever version the
        load saw (appends of the superseded owner may land in between), moves the run and
        owner indexes in the same step, and answers the frontier it landed on."""
        with translated(self.where, thread):
            snap = await self._snapshot(thread, None)
            check_claim(snap.frontier, supersedes)
            return await self._claim(snap.frontier, owner)

    async def _claim(self, loaded: Frontier, owner: str) -> Frontier:
        """Run the claim script, superseding the epoch of ``loaded``: the frontier as
        claimed, ``loaded`` itself unless appends moved the thread since it was read."""
        thread = loaded.thread_id
        keys = [self._key(thread, "meta"), self._key(thread, "sums")]
        keys += [self._index(s) for s in RUN_STATES]
        keys += [self._owners(loaded.owner), self._owners(owner), self._instance]
        args: list[str | int] = [loaded.epoch, owner, thread, json.dumps(owner), loaded.version]
        args.append(self.instance or "")
        reply = await self._claim_script(keys=keys, args=args)
        if reply[0] == "lost":
            check_instance(None, self.instance, self.where)
        if reply[0] == "fenced":
            raise Fenced(thread, loaded.epoch, number_of(thread, "owner epoch", reply[1]))
        if reply[0] != "ok":
            raise CorruptRecord(thread, 0, f"unexpected shape of {reply[1]}")
        moved_by = self._skipped.of_claim(thread, reply)
        if not moved_by:
            return with_claim(head_only(loaded), owner)
        version, text, checksum, head, n, last, pruned, pruned_hash = moved_by
        anchor = anchor_of(thread, pruned, pruned_hash)
        epoch = str(loaded.epoch)
        moved = verified_frontier(
            thread, text, version, epoch, loaded.owner, checksum, head, n, last, anchor
        )
        return with_claim(moved, owner)

    async def list_runs(
        self, state: RunStateKind | None = None, *, host: str | None = None
    ) -> list[RunSummary]:
        return await list_runs(self, state, host)

    async def index_problem(self, thread: ThreadId) -> str | None:
        """What is wrong with the thread's index entries and receipts (``redis_audit``)."""
        return await index_problem(self, thread)

    async def held_history(self, thread: ThreadId) -> int:
        """The messages the thread's pruned history holds (``runtime.integrity.audit``)."""
        with translated(self.where):
            return int(await self.client.llen(self._key(thread, "history")))

    async def thread_ids(self, after: str = "", limit: int = 1000) -> list[ThreadId]:
        """Threads by their keys, any of them (a SCAN: for audits, not for hot paths): a
        log whose meta was deleted is listed too, so that an audit finds it; and so is a
        thread a run index names that has no keys at all (a ghost entry, which listings
        leave out and the Supervisor quarantines)."""
        first = f"{self.prefix}:thread:"
        with translated(self.where):
            keys = [str(k) async for k in self.client.scan_iter(match=f"{first}*", count=1000)]
            async with self.client.pipeline(transaction=False) as pipe:
                for state in RUN_STATES:
                    pipe.hkeys(self._index(state))
                indexed = await pipe.execute(raise_on_error=False)
        found = {
            key[len(first) : -len(part) - 1]
            for key in keys
            for part in _THREAD_KEYS
            if key.endswith(f":{part}")
        }
        found.update(str(t) for names in indexed if isinstance(names, list) for t in names)
        return [ThreadId(t) for t in sorted(found) if t > after][:limit]

    async def prune(self, thread: ThreadId, through_seq: int) -> int:
        with translated(self.where):
            return await prune_thread(self, thread, through_seq, self._cut)

    async def _cut(self, cut: Cut) -> bool:
        """The script checks the digest read here is still the thread's (else ``moved``)."""
        keys = [self._key(cut.thread, p) for p in ("meta", "log", "sums", "ops", "history")]
        stored = await self.client.hget(keys[0], "pruned_digest")
        before = "" if stored is None else str(stored)
        after = history_digest(before, cut.messages)
        args: list[str | int] = [cut.after, cut.through, cut.hash, before, after]
        args += [len(cut.messages), cut.history, *cut.messages, *cut.operations]
        reply = await self._prune_script(keys=keys, args=args)
        if reply.startswith("corrupt"):
            raise CorruptRecord(
                cut.thread, cut.through, f"{reply.partition(' ')[2]} is of the wrong type"
            )
        if reply.startswith("stray"):
            held = int(reply.partition(" ")[2])
            raise CorruptRecord(cut.thread, cut.after, stray_history(held, cut))
        return bool(reply == "ok")

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        key = f"{self.prefix}:lease:{name}"
        ttl_ms = str(max(1, math.ceil(ttl_s * 1000)))
        with translated(self.where):
            reply = await self._lease_script(
                keys=[key, self._instance],
                args=[holder, ttl_ms, self.instance or "", str(int(MAX_LEASE_AHEAD_S * 1000))],
            )
        if reply == "lost":
            check_instance(None, self.instance, self.where)
        if not isinstance(reply, list):
            raise StoreError(f"redis at {self.where}: the lease key {key} is not a string")
        return Lease(str(reply[0]), int(reply[1]) / 1000)

    async def drop_lease(self, name: str, holder: str) -> None:
        with translated(self.where):
            await self._unlease_script(keys=[f"{self.prefix}:lease:{name}"], args=[holder])

    async def close(self) -> None:
        with translated(self.where):
            await self.client.aclose()

    async def corrupt(self, thread: ThreadId, seq: int, text: str) -> None:
        """Test aid: overwrite a stored record, as a disk or a hand edit might."""
        with translated(self.where):
            stored = await self.client.hget(self._key(thread, "meta"), "pruned")
            pruned = number_of(thread, "pruned seq", None if stored is None else str(stored))
            if not 1 <= seq - pruned <= await self.client.llen(self._key(thread, "log")):
                raise CorruptRecord(thread, seq, "no such record")
            await self.client.lset(self._key(thread, "log"), seq - pruned - 1, text)

    # ---- inside an append ---------------------------------------------------------------

    async def _snapshot(self, thread: ThreadId, op: str | None) -> _Snapshot:
        """The frontier (verified, with its epoch and owner) and the receipt under ``op``,
        read at one instant."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hmget(self._key(thread, "meta"), META[:8])
            pipe.hget(self._key(thread, "ops"), op or "")
            pipe.llen(self._key(thread, "sums"))
            pipe.lindex(self._key(thread, "sums"), -1)
            pipe.get(self._instance)
            (
                (text, version, epoch, owner, checksum, head, *anchored),
                known,
                n,
                last,
                instance,
            ) = await pipe.execute()
        check_instance(instance, self.instance, self.where)
        anchor = anchor_of(thread, *anchored)
        frontier = verified_frontier(
            thread, text, version, epoch, owner, checksum, head, n, last, anchor
        )
        return _Snapshot(frontier, decode_receipt(thread, known) if op and known else None)

    async def _apply(
        self, commit: ThreadCommit, loaded: Frontier, new: Frontier, claim: str | None
    ) -> Receipt | None:
        """Run the script: re-check and write everything atomically, or refuse (None).

        ``new`` is what ``admit`` folded from ``loaded``; it is written only if the thread
        is still exactly as loaded (same version, epoch), so it is never stale.
        """
        receipt = receipt_of(commit, new.version)
        summary = summarize(new)
        assert summary is not None  # a thread with a commit always has a run
        thread = commit.thread_id
        keys = [self._key(thread, p) for p in ("meta", "log", "sums", "ops")]
        keys += [self._index(s) for s in RUN_STATES]
        keys += [self._owners(loaded.owner), self._owners(new.owner), self._instance]
        text = frontier_text(new)  # its epoch and owner too: decode_frontier checks them
        args: list[str | int] = [
            loaded.version,
            loaded.epoch,
            commit.run_id,
            commit.operation_id,
            commit.encoded,
            commit.payload_hash,
            receipt.model_dump_json(),
            text,
            frontier_checksum(text),
            new.run_id or "",
            "1" if new.ended else "0",
            thread,
            1 + RUN_STATES.index(summary.state),
            claim or "",
            summary.model_dump_json(),
            self.instance or "",
        ]
        reply = await self._append_script(keys=keys, args=args)
        if reply == "ok" or self._skipped.of_append(thread, reply):
            return receipt
        if reply == "refused":
            return None
        if reply == "lost":
            check_instance(None, self.instance, self.where)
        raise CorruptRecord(thread, receipt.seq, f"unexpected shape of {reply.partition(' ')[2]}")


# ---- decoding: every stored shape is re-validated and fails closed ----------------------
