"""The Redis CommitStore: one Lua script makes the checks and the append one atomic step.

**Durability.** Redis is durable only with AOF and ``appendfsync always``
(``--appendonly yes --appendfsync always``). With ``everysec`` (the default) or
RDB snapshots alone, a commit whose receipt was returned can be lost on a crash:
run it that way only where losing the last second of commits is acceptable.
Redis 7 or newer, a single primary (not Redis Cluster: the run index spans threads).

**How an append works.** Python loads the frontier, applies the pure admission
rule (``check_append``) and fold (``advance``) of ``runtime.commit``, and sends
the new frontier to a Lua script that re-checks, atomically, what may have
changed since the load — operation id unknown, owner epoch, run not ended,
version — and then writes the commit, its receipt, the frontier and the run
index. The script answers ``ok``, ``refused`` or ``corrupt KEY``. On ``refused``
the append loads again and lets ``check_append`` name the error (or return the
original receipt of a retried write), so the order of the rules lives in one
place only. Every refusal condition is monotonic — an operation id stays known,
epochs and versions only grow, an ended run stays ended until the version moves —
so the second look refuses too. The script reads and type-checks every key before
its first write, so a refused or failed append writes nothing. The epoch lives
outside the frontier JSON (its own hash field), so a ``claim`` never races an
append's frontier.

**Key layout** (``P`` is the prefix, default ``ratchet``; ``T`` the thread id)::

    P:thread:T:meta       hash    frontier  Frontier JSON (epoch 0, owner null inside)
                                  epoch     owner epoch (decimal)
                                  owner     owner name
                                  version   thread version (= log length)
                                  run_id    current run id
                                  ended     "1" when the current run has ended
    P:thread:T:log        list    encoded ThreadCommits; index i holds seq i + 1
    P:thread:T:ops        hash    operation id -> Receipt JSON
    P:runs:STATE          hash    thread id -> RunSummary JSON, STATE one of
                                  running | awaiting | ended (a thread is in one)

A test corrupts a record with ``LSET P:thread:T:log (seq - 1) TEXT`` (or
``corrupt()``) and a frontier with ``HSET P:thread:T:meta frontier TEXT``.

**Errors.** Driver exceptions are translated in ``translated`` and nowhere else::

    redis.AuthenticationError, AuthorizationError, NOPERM       -> StoreError
    redis.ConnectionError, redis.TimeoutError, OSError,
    LOADING / READONLY / OOM / TRYAGAIN / MASTERDOWN / MISCONF  -> StoreUnavailable
    any other redis.RedisError                                  -> StoreError
    script "refused" -> whatever check_append raises on a fresh load: Fenced,
        DuplicateOperation, RunEnded, VersionConflict; "corrupt KEY" -> CorruptRecord

Messages name the server by its redacted URL: a password never reaches a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import redis.asyncio as aioredis
import redis.exceptions as rex
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from runtime.commit import (
    DEFAULT_PAYLOAD_LIMIT,
    Frontier,
    Receipt,
    ThreadCommit,
    advance,
    check_append,
    check_size,
    decode_commit,
)
from runtime.errors import CorruptRecord, StoreError, StoreUnavailable
from runtime.ids import RunId, ThreadId
from runtime.ports import CommittedRecord, RunSummary, claim_then_load
from storage.summary import summarize
from storage.url import redact

log = logging.getLogger("ratchet.storage.redis")

RunStateKind = Literal["running", "awaiting", "ended"]
RUN_STATES: tuple[RunStateKind, ...] = ("running", "awaiting", "ended")

# ---- the Redis edge: clients and error translation --------------------------------------

_REFUSED: tuple[type[BaseException], ...] = (
    rex.AuthenticationError,
    rex.AuthorizationError,
    rex.NoPermissionError,
)
_TRANSIENT: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.MasterDownError,
    OSError,
)


@contextmanager
def translated(where: str) -> Iterator[None]:
    """The one place where redis-py exceptions become Ratchet's."""
    try:
        yield
    except _REFUSED as exc:  # wrong credentials do not heal by retrying
        raise StoreError(f"redis at {where} refused access: {_describe(exc)}") from exc
    except _TRANSIENT as exc:
        raise StoreUnavailable(f"redis at {where} unavailable: {_describe(exc)}") from exc
    except rex.ResponseError as exc:
        # MISCONF: the server cannot persist, so it refuses writes until it can again.
        if str(exc).startswith("MISCONF"):
            raise StoreUnavailable(f"redis at {where} cannot persist: {_describe(exc)}") from exc
        raise StoreError(f"redis at {where} refused a command: {_describe(exc)}") from exc
    except rex.RedisError as exc:
        raise StoreError(f"redis at {where} failed: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def open_client(
    url: str, *, socket_timeout: float = 5.0, connect_timeout: float = 2.0
) -> aioredis.Redis:
    """A pooled client that fails fast: the caller's own backoff decides when to retry.

    Two quick retries let a pooled connection that died with a restarted server be
    replaced transparently; anything longer belongs to the engine's StoreRetry.
    """
    with translated(redact(url)):
        return aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 2),
        )


# ---- the append script ------------------------------------------------------------------

# The shebang opts into Redis 7 script flags: without allow-oom the server refuses the
# whole script up front when out of memory, instead of failing between two writes.
_APPEND_LUA = """#!lua
local meta, log, ops = KEYS[1], KEYS[2], KEYS[3]
local want = {'hash', 'list', 'hash', 'hash', 'hash', 'hash'}
for i = 1, 6 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= 'none' and t ~= want[i] then return 'corrupt ' .. KEYS[i] end
end
local f = redis.call('HMGET', meta, 'epoch', 'version', 'run_id', 'ended')
local epoch, version = tonumber(f[1] or '0'), tonumber(f[2] or '0')
if not epoch or not version then return 'corrupt ' .. meta end
if redis.call('HEXISTS', ops, ARGV[4]) == 1 or epoch ~= tonumber(ARGV[2])
   or (f[4] == '1' and f[3] == ARGV[3]) or version ~= tonumber(ARGV[1]) then
  return 'refused'
end
if redis.call('LLEN', log) ~= version then return 'corrupt ' .. log end
redis.call('RPUSH', log, ARGV[5])
redis.call('HSET', ops, ARGV[4], ARGV[6])
redis.call('HSET', meta, 'frontier', ARGV[7], 'version', tostring(version + 1),
           'run_id', ARGV[8], 'ended', ARGV[9])
for i = 4, 6 do redis.call('HDEL', KEYS[i], ARGV[10]) end
redis.call('HSET', KEYS[tonumber(ARGV[11])], ARGV[10], ARGV[12])
return 'ok'
"""
_APPEND_ATTEMPTS = 3
"""A refusal is re-examined by loading again, and that look decides (the refusal
conditions are monotonic); the bound only guards against keys edited by hand."""


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
        self._append_script = client.register_script(_APPEND_LUA)

    @classmethod
    async def connect(
        cls, url: str, *, payload_limit: int = DEFAULT_PAYLOAD_LIMIT, prefix: str = "ratchet"
    ) -> RedisCommitStore:
        """Open a client and check the server answers (StoreUnavailable if it does not)."""
        store = cls(open_client(url), where=redact(url), payload_limit=payload_limit, prefix=prefix)
        with translated(store.where):
            await store.client.ping()
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

    # ---- the port -----------------------------------------------------------------------

    async def append(self, commit: ThreadCommit, expected_version: int, epoch: int) -> Receipt:
        check_size(commit, self.payload_limit)
        with translated(self.where):
            for _ in range(_APPEND_ATTEMPTS):
                frontier, known = await self._snapshot(commit.thread_id, commit.operation_id)
                receipt = check_append(frontier, commit, expected_version, epoch, known)
                if receipt is not None:
                    return receipt
                new = advance(frontier, commit)
                receipt = await self._apply(commit, new, expected_version, epoch)
                if receipt is not None:
                    return receipt
        raise StoreError(f"thread {commit.thread_id}: the append script kept refusing")

    async def load(self, thread: ThreadId) -> Frontier:
        with translated(self.where):
            frontier, _ = await self._snapshot(thread, None)
            return frontier

    async def read(self, thread: ThreadId, after_seq: int = 0) -> list[CommittedRecord]:
        with translated(self.where):
            texts = await self.client.lrange(self._key(thread, "log"), max(after_seq, 0), -1)
        first = max(after_seq, 0) + 1
        return [
            CommittedRecord(seq=seq, commit=decode_commit(text, thread, seq))
            for seq, text in enumerate(texts, start=first)
        ]

    async def claim(self, thread: ThreadId, owner: str) -> int:
        """Epoch + 1 (as ``runtime.commit.with_claim``), atomically, outside the frontier."""
        meta = self._key(thread, "meta")
        with translated(self.where):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hincrby(meta, "epoch", 1)
                pipe.hset(meta, "owner", owner)
                epoch, _ = await pipe.execute()
        return int(epoch)

    async def claim_frontier(
        self, thread: ThreadId, owner: str, starting: RunId | None = None
    ) -> Frontier:
        """Not one atomic step here (``claim_then_load``): a Run started on the thread
        between the check and the claim is fenced by it, as a plain claim would."""
        return await claim_then_load(self, thread, owner, starting)

    async def list_runs(self, state: RunStateKind | None = None) -> list[RunSummary]:
        states = RUN_STATES if state is None else (state,)
        with translated(self.where):
            async with self.client.pipeline(transaction=True) as pipe:
                for s in states:
                    pipe.hgetall(self._index(s))
                indexes = await pipe.execute()
        rows = (item for index in indexes for item in sorted(index.items()))
        return [_decode_summary(thread, text) for thread, text in rows]

    async def close(self) -> None:
        with translated(self.where):
            await self.client.aclose()

    async def corrupt(self, thread: ThreadId, seq: int, text: str) -> None:
        """Test aid: overwrite a stored record, as a disk or a hand edit might."""
        with translated(self.where):
            if not 1 <= seq <= await self.client.llen(self._key(thread, "log")):
                raise CorruptRecord(thread, seq, "no such record")
            await self.client.lset(self._key(thread, "log"), seq - 1, text)

    # ---- inside an append ---------------------------------------------------------------

    async def _snapshot(self, thread: ThreadId, op: str | None) -> tuple[Frontier, Receipt | None]:
        """The frontier (with its epoch) and the receipt under ``op``, read at one instant."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hmget(self._key(thread, "meta"), ["frontier", "version", "epoch", "owner"])
            pipe.hget(self._key(thread, "ops"), op or "")
            (text, version, epoch, owner), known = await pipe.execute()
        frontier = _decode_frontier(thread, text, version, epoch)
        frontier = frontier.model_copy(update={"owner": owner})
        return frontier, (_decode_receipt(thread, known) if op and known else None)

    async def _apply(
        self, commit: ThreadCommit, new: Frontier, expected_version: int, epoch: int
    ) -> Receipt | None:
        """Run the script: re-check and write everything atomically, or refuse (None).

        ``new`` is ``advance(loaded, commit)``; it is written only if the thread is
        still exactly as loaded (same version, epoch), so it is never stale.
        """
        receipt = Receipt(
            thread_id=commit.thread_id,
            seq=new.version,
            operation_id=commit.operation_id,
            payload_hash=commit.payload_hash,
        )
        summary = summarize(new)
        assert summary is not None  # a thread with a commit always has a run
        thread = commit.thread_id
        keys = [self._key(thread, p) for p in ("meta", "log", "ops")]
        keys += [self._index(s) for s in RUN_STATES]
        args: list[str | int] = [
            expected_version,
            epoch,
            commit.run_id,
            commit.operation_id,
            commit.encoded,
            receipt.model_dump_json(),
            new.model_copy(update={"epoch": 0, "owner": None}).model_dump_json(),
            new.run_id or "",
            "1" if new.ended else "0",
            thread,
            4 + RUN_STATES.index(summary.state),
            summary.model_dump_json(),
        ]
        reply = await self._append_script(keys=keys, args=args)
        if reply == "ok":
            return receipt
        if reply == "refused":
            return None
        raise CorruptRecord(thread, receipt.seq, f"unexpected shape of {reply.partition(' ')[2]}")


# ---- decoding: every stored shape is re-validated and fails closed ----------------------


def _decode_frontier(
    thread: str, text: str | None, version: str | None, epoch: str | None
) -> Frontier:
    """The stored frontier with the epoch kept beside it; fails closed on any mismatch."""
    stored_version = _number(thread, "version", version)
    current = _number(thread, "owner epoch", epoch)
    if text is None:
        if stored_version:
            raise CorruptRecord(thread, stored_version, "the stored frontier is missing")
        return Frontier(thread_id=ThreadId(thread), epoch=current)
    try:
        frontier = Frontier.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(
            thread, stored_version, f"stored frontier: {_first_error(exc)}"
        ) from exc
    if frontier.thread_id != thread or frontier.version != stored_version:
        raise CorruptRecord(thread, stored_version, "stored frontier names another thread/version")
    return frontier.model_copy(update={"epoch": current})


def _number(thread: str, name: str, text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError as exc:
        raise CorruptRecord(thread, 0, f"stored {name} {text!r} is not a number") from exc


def _decode_receipt(thread: str, text: str) -> Receipt:
    try:
        return Receipt.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, 0, f"stored receipt: {_first_error(exc)}") from exc


def _decode_summary(thread: str, text: str) -> RunSummary:
    try:
        return RunSummary.model_validate_json(text)
    except ValidationError as exc:
        raise CorruptRecord(thread, 0, f"run index entry: {_first_error(exc)}") from exc


def _first_error(exc: ValidationError) -> str:
    return str(exc.errors()[0].get("msg", exc))
