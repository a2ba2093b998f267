"""What crosses actor boundaries: the system spec, actor names, run metadata, errors.

Actor calls carry ids, strings and frozen records, never functions. Ratchet's own
errors do not survive Ray's exception pickling (their constructors take several
arguments), so actors return them wrapped in ``RemoteError`` and the caller
re-raises the very same type (``unwrap``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.agent import is_seconds
from runtime.commit import DEFAULT_PAYLOAD_LIMIT, Frontier
from runtime.errors import InvalidTransition, RatchetError
from runtime.limits import DEFAULT_LIMITS, Limits, check_room
from runtime.messages import UserMessage
from runtime.ports import CommitStore, LiveBus, StreamCheckpointStore
from runtime.rules import check_repeated_start, input_message_id, input_meta, ran_before
from storage.url import scheme_of

NAMESPACE = "ratchet"
Placement = Literal["hosted", "dedicated"]
PLACEMENTS: tuple[Placement, ...] = ("hosted", "dedicated")


@dataclass(frozen=True)
class SystemSpec:
    """One Ratchet system on a Ray cluster: its store, its actors and their options."""

    name: str
    """Prefix of every named actor of the system (several systems may share a cluster)."""
    store_url: str
    redis_url: str | None = None
    hosts: int = 2
    """Size of the hosted RunHost pool."""
    executors: int = 2
    """ToolExecutors per pool."""
    host_max_restarts: int = -1
    """Ray's fast path: a crashed RunHost is restarted and re-claims its Runs. Past
    them (0: never), a dead pool host's Runs are taken over by the Supervisor, and a
    client's next call for it makes a new one under its name (``Ratchet.host_failed``)."""
    lease_ttl_s: float = 4.0
    heartbeat_s: float = 0.5
    reconcile_s: float = 2.0
    """How often each host compares the Runs it owns with those it drives, and the
    Supervisor looks for Runs whose owner is not a live host."""
    recover_timeout_s: float = 30.0
    """How long the Supervisor waits for a host to take a Run over (``recover_run``)
    before it tries again at a later sweep: a hung or slowly restarting host delays
    only the Runs sent to it."""
    limits: Limits = DEFAULT_LIMITS
    """The limits on input, model and tool output, ids and JSON (``runtime.limits``)."""
    host_options: tuple[Mapping[str, Any], ...] = ()
    """Ray options per hosted RunHost (index i), e.g. resources pinning it to a node."""
    core_options: Mapping[str, Any] = field(default_factory=dict)
    """Ray options for the store actor, the Supervisor and the default executor pool."""
    warm_spares: bool = True
    """A restarted actor asks its node for a warm spare worker process, so that the next
    restart starts in milliseconds (``actors.spare``); False saves one idle process."""
    sqlite_writer: Literal["direct", "actor"] = "direct"
    """SQLite only: ``direct`` — every process opens the file and group-commits its own
    Runs, writers queueing on an inter-process file lock (measured faster: no Ray call
    per commit); ``actor`` — every commit goes through the one store actor."""

    def __post_init__(self) -> None:
        """Options refused when the system is connected, not met later: ``hosts=0`` was a
        ZeroDivisionError at the first start, a ``limits`` dict an AttributeError, and
        limits whose largest commit outgrows the store refused every start in the hosts."""
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"a system's name is text, not {self.name!r:.80}")
        for option, least in (("hosts", 1), ("executors", 1), ("host_max_restarts", -1)):
            value = getattr(self, option)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{option} must be an integer of at least {least}, not {value!r}")
        for option in ("lease_ttl_s", "heartbeat_s", "reconcile_s", "recover_timeout_s"):
            value = getattr(self, option)
            if not is_seconds(value) or value == 0:
                raise ValueError(f"{option} must be a positive number of seconds, not {value!r}")
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a runtime.limits.Limits, not {self.limits!r:.80}")
        if self.sqlite_writer not in ("direct", "actor"):
            raise ValueError(f"sqlite_writer is 'direct' or 'actor', not {self.sqlite_writer!r}")
        # the system's stores open at the default payload limit: every commit must fit
        check_room(_DefaultStore, self.limits)

    def host_name(self, index: int) -> str:
        return f"{self.name}:host:{index}"

    def dedicated_name(self, thread: str) -> str:
        return f"{self.name}:dedicated:{stable_hash(thread):016x}"

    @property
    def store_name(self) -> str:
        return f"{self.name}:store"

    @property
    def supervisor_name(self) -> str:
        return f"{self.name}:supervisor"

    def executor_name(self, pool: str, index: int) -> str:
        return f"{self.name}:exec:{pool}:{index}"

    @property
    def funnels_writes(self) -> bool:
        """Whether the system's processes reach the store through the one store actor.

        Always for memory (it lives in one process); for SQLite when asked to.
        """
        scheme = scheme_of(self.store_url)  # MEMORY:// is memory:// too
        return scheme == "memory" or (scheme == "sqlite" and self.sqlite_writer == "actor")


class _DefaultStore:
    """What ``check_room`` asks of a store of the system: its payload limit."""

    payload_limit = DEFAULT_PAYLOAD_LIMIT


def stable_hash(text: str) -> int:
    """Same value in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def host_index(thread: str, hosts: int) -> int:
    return stable_hash(thread) % hosts


def pick_live(thread: str, candidates: list[str]) -> str:
    """Rendezvous hashing: the same thread prefers the same live host."""
    return max(candidates, key=lambda host: stable_hash(f"{host}|{thread}"))


# ---- run metadata ---------------------------------------------------------------------
# The agent reference and placement must survive every process, so they ride in the
# id of the Run's input message, which the activation commit stores.


@dataclass(frozen=True)
class RunMeta:
    agent_ref: str
    placement: Placement = "hosted"

    def message_id(self, run_id: str) -> str:
        return input_message_id(run_id, self.placement, self.agent_ref)


def asked_before(frontier: Frontier, run_id: str, agent_ref: str, text: str) -> bool:
    """Whether ``frontier`` holds the start of ``run_id`` asked with this agent and input,
    whichever placement it asked for: a start asked again through another door (the
    HTTP edge's default placement, say) asks the same Run, and joins it."""
    for placement in PLACEMENTS:
        message = RunMeta(agent_ref=agent_ref, placement=placement).message_id(run_id)
        if ran_before(frontier, message):
            try:
                check_repeated_start(frontier, message, text, run_id)
            except InvalidTransition:
                return False
            return True
    return False


def run_meta(frontier: Frontier) -> RunMeta | None:
    """The current Run's metadata, read from its committed input message."""
    if frontier.run_start >= len(frontier.messages):
        return None
    return _meta_of(frontier.messages[frontier.run_start])


async def stored_run_meta(store: CommitStore, head: Frontier) -> RunMeta | None:
    """``run_meta`` of the Run ``head`` (a frontier without its messages) names, reading
    only that Run's records, not the whole log (a listing asks it of every thread).

    A Run's commits are the last ``next_ordinal`` of its thread's log: each takes the
    next ordinal, and a new Run starts at 0. The read is verified against the stored
    head, and a thread that moved on since ``head`` still has that Run's first record
    at the same place. A Run whose first record was pruned (its input is in the pruned
    history) is read whole.
    """
    if head.run_id is None or head.next_ordinal < 1:
        return None
    start = head.version - head.next_ordinal + 1
    records = await store.read(head.thread_id, start - 1) if start >= 1 else []
    if not records or records[0].seq != start:
        return run_meta(await store.load(head.thread_id))
    first = records[0].commit
    if first.run_id != head.run_id or first.ordinal != 0 or not first.messages:
        return None
    return _meta_of(first.messages[0])


def _meta_of(message: object) -> RunMeta | None:
    if not isinstance(message, UserMessage) or (meta := input_meta(message.id)) is None:
        return None
    _, placement, ref = meta
    return RunMeta(agent_ref=ref, placement="dedicated" if placement == "dedicated" else "hosted")


def owner_id(host_id: str) -> str:
    """Owner names start with the host id, so a restarted host finds the Runs it owned."""
    return f"{host_id}#{os.getpid()}"


@dataclass(frozen=True)
class AtRest:
    """A Run's frontier as the host's last commit of it left it, at rest (ended or
    awaiting): ``start_run(wait=True)`` answers with it, so ``Ratchet.run`` need not
    read back what the store has just acknowledged. JSON: cheaper than pickling it."""

    frontier_json: str

    def frontier(self) -> Frontier:
        return Frontier.model_validate_json(self.frontier_json)


# ---- errors across actor calls ---------------------------------------------------------


@dataclass(frozen=True)
class RemoteError:
    """A RatchetError raised inside an actor, carried by value."""

    module: str
    name: str
    args: tuple[Any, ...]
    attrs: dict[str, Any]

    @classmethod
    def of(cls, exc: RatchetError) -> RemoteError:
        return cls(type(exc).__module__, type(exc).__qualname__, exc.args, dict(vars(exc)))

    def rebuild(self) -> Exception:
        kind = getattr(importlib.import_module(self.module), self.name)
        exc: Exception = kind.__new__(kind)
        Exception.__init__(exc, *self.args)
        vars(exc).update(self.attrs)
        return exc


def remote_error(exc: Exception) -> RemoteError:
    """A failure as an actor's caller receives it: our own error by type, anything else
    (a bug of ours) as a RatchetError that says what it was — never an untyped Ray error."""
    if isinstance(exc, RatchetError):
        return RemoteError.of(exc)
    return RemoteError.of(RatchetError(f"internal error in the host: {exc!r}"[:2000]))


def at_rest(frontier: Frontier) -> bool:
    """Whether the thread's latest Run rests (awaiting or ended)."""
    return frontier.run_state is not None and frontier.run_state.kind != "running"


def unwrap(value: Any) -> Any:
    """Return an actor's result, re-raising a carried RatchetError as itself."""
    if isinstance(value, RemoteError):
        raise value.rebuild()
    return value


def live_bus(spec: SystemSpec) -> LiveBus | None:
    """Redis Streams when Redis is configured; otherwise clients read facts from the store."""
    if not spec.redis_url:
        return None
    from storage.bus import RedisStreamBus

    return RedisStreamBus.connect(spec.redis_url)


def checkpoint_store(spec: SystemSpec, store: CommitStore) -> StreamCheckpointStore | None:
    """Stream checkpoints live in Redis when it is configured (best effort either way),
    sealed under the key ``store`` holds for the system (``storage.checkpoint_key``)."""
    if not spec.redis_url:
        return None
    from storage.checkpoint_key import CheckpointKey
    from storage.redis_checkpoints import RedisCheckpointStore

    return RedisCheckpointStore.connect(spec.redis_url, key=CheckpointKey(store, spec.name))
