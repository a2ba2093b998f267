"""Tamper-evidence: each field of a stored commit and frontier, edited behind the store.

A real Run (``InProcessRunner``) leaves a thread of five commits awaiting permission
for ``delete(path="SAFE")``. Each case then edits what the backend holds — SQL rows,
Redis keys, the memory store's test aids — and two things must follow:

- the store's ``read`` and/or ``load`` fails closed with CorruptRecord naming the
  thread and the seq (and ``audit``, what ``ratchet verify`` runs, names the same:
  the CLI itself is driven over these cases in test_verify_cli.py);
- an engine asked to act on the thread (approving the permission) refuses with
  CorruptRecord, runs no tool and writes nothing.

The "SAFE -> EVIL" attack is the last case: the argument rewritten in the stored
frontier and log alike (hashes and checksum left as they were) must not run EVIL.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import delete, select, update

from runtime import (
    Agent,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    call,
    tool,
)
from runtime.commit import Frontier, ThreadCommit
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import audit, frontier_checksum
from runtime.lifecycle import AwaitingState, answer
from storage.schema import commits, threads

T = ThreadId("victim")
REDIS_DB = 14
"""This file's own Redis database (the shared fixture's db 9 is flushed by other suites)."""


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


# ---- the victim: a real Run awaiting permission ------------------------------------------


def permission_agent(ran: list[str]) -> Agent:
    """lookup (runs at once), then delete (needs permission), then done: five commits up
    to the wait (activation, inference, results, inference, awaiting)."""

    @tool()
    def lookup(key: str) -> str:
        return f"value of {key}"

    @tool(needs_permission=True)
    def delete(path: str) -> str:
        ran.append(path)
        return f"deleted {path}"

    script = [
        ModelResponse(text="looking", tool_calls=(call("lookup", "c0", key="k"),)),
        ModelResponse(tool_calls=(call("delete", "c1", path="SAFE"),)),
        ModelResponse(text="done"),
    ]
    return Agent(name="permission", model=ScriptedModel(script), tools=[lookup, delete])


@dataclass
class Victim:
    thread: ThreadId
    frontier: Frontier
    """As the Run left it: awaiting permission, version 5."""
    bodies: list[str]
    hashes: list[str]
    ran: list[str] = field(default_factory=list)
    """Paths the delete tool was really called with."""

    def runner(self, store: Any) -> InProcessRunner:
        return InProcessRunner(permission_agent(self.ran), store)

    def approval(self) -> Any:
        assert isinstance(self.frontier.run_state, AwaitingState)
        return answer(self.frontier.run_state.ticket, PermissionDecision(approve=True))


async def make_victim(store: Any, thread: ThreadId = T) -> Victim:
    ran: list[str] = []
    frontier = await InProcessRunner(permission_agent(ran), store).start("go", thread_id=thread)
    assert isinstance(frontier.run_state, AwaitingState) and frontier.version == 5
    records = await store.read(thread)
    assert [r.commit.label for r in records] == [
        "activation",
        "inference",
        "results",
        "inference",
        "awaiting",
    ]
    bodies = [r.commit.encoded for r in records]
    return Victim(thread, frontier, bodies, [r.commit.payload_hash for r in records], ran)


# ---- raw edits, per backend ---------------------------------------------------------------


class SqlTamper:
    """Edits the rows of ``storage.schema`` through the store's own engine."""

    def __init__(self, store: Any, thread: ThreadId) -> None:
        self.engine, self.thread = store.engine, thread

    async def _run(self, stmt: Any) -> Any:
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt)
            return result.all() if stmt.is_select else None

    def _row(self, seq: int) -> Any:
        return (commits.c.thread_id == self.thread) & (commits.c.seq == seq)

    async def set_record(self, seq: int, body: str | None = None, hash_: str | None = None) -> None:
        values = {"body": body, "payload_hash": hash_}
        stmt = update(commits).where(self._row(seq))
        await self._run(stmt.values({k: v for k, v in values.items() if v is not None}))

    async def delete(self, seq: int) -> None:
        await self._run(delete(commits).where(self._row(seq)))

    async def renumber(self, seq: int, to: int) -> None:
        await self._run(update(commits).where(self._row(seq)).values(seq=to))

    async def move_to_thread(self, seq: int, other: str) -> None:
        await self._run(update(commits).where(self._row(seq)).values(thread_id=other))

    async def frontier(self) -> str:
        [(text,)] = await self._run(
            select(threads.c.frontier).where(threads.c.thread_id == self.thread)
        )
        return str(text)

    async def set_meta(self, **values: Any) -> None:
        """Columns of the thread row: frontier, checksum, version, head."""
        await self._run(update(threads).where(threads.c.thread_id == self.thread).values(values))

    async def drop_thread(self) -> None:
        """Delete the thread row, leaving its log."""
        await self._run(delete(threads).where(threads.c.thread_id == self.thread))

    async def reset_frontier(self, empty: Frontier) -> None:
        """The thread row put back at version 0 with a frontier that checks out."""
        text = empty.model_dump_json()
        await self.set_meta(frontier=text, checksum=frontier_checksum(text), version=0, head="")

    async def snapshot(self) -> Any:
        rows = await self._run(select(commits).order_by(commits.c.thread_id, commits.c.seq))
        return [tuple(r) for r in rows], [tuple(r) for r in await self._run(select(threads))]


class RedisTamper:
    """Edits the keys documented at the top of ``storage.redis_store``."""

    def __init__(self, store: Any, thread: ThreadId) -> None:
        self.client, self.prefix = store.client, store.prefix
        self.meta, self.log, self.sums = (
            f"{store.prefix}:thread:{thread}:{part}" for part in ("meta", "log", "sums")
        )

    async def set_record(self, seq: int, body: str | None = None, hash_: str | None = None) -> None:
        if body is not None:
            await self.client.lset(self.log, seq - 1, body)
        if hash_ is not None:
            await self.client.lset(self.sums, seq - 1, hash_)

    async def delete(self, seq: int, keys: tuple[str, ...] | None = None) -> None:
        for key in keys or (self.log, self.sums):
            await self.client.lset(key, seq - 1, "<deleted>")
            await self.client.lrem(key, 1, "<deleted>")

    async def frontier(self) -> str:
        return str(await self.client.hget(self.meta, "frontier"))

    async def set_meta(self, **values: Any) -> None:
        await self.client.hset(self.meta, mapping={k: str(v) for k, v in values.items()})

    async def drop_thread(self) -> None:
        """Delete the meta hash (frontier, head, version), leaving the log and its hashes."""
        await self.client.delete(self.meta)

    async def reset_frontier(self, empty: Frontier) -> None:
        text = empty.model_copy(update={"epoch": 0, "owner": None}).model_dump_json()
        await self.set_meta(frontier=text, checksum=frontier_checksum(text), version=0, head="")

    async def snapshot(self) -> Any:
        dump = {}
        async for key in self.client.scan_iter(match=f"{self.prefix}:*"):
            kind = await self.client.type(key)
            if kind == "hash":
                dump[key] = await self.client.hgetall(key)
            elif kind == "list":
                dump[key] = await self.client.lrange(key, 0, -1)
            else:
                dump[key] = await self.client.get(key)
        return dump


class MemoryTamper:
    """The memory store's own test aids; its frontier is an object (nothing to edit)."""

    def __init__(self, store: Any, thread: ThreadId) -> None:
        self.store, self.thread = store, thread

    async def set_record(self, seq: int, body: str | None = None, hash_: str | None = None) -> None:
        self.store.corrupt(self.thread, seq, body, hash_)

    async def delete(self, seq: int) -> None:
        self.store.delete(self.thread, seq)

    async def drop_thread(self) -> None:
        self.store.drop_frontier(self.thread)

    async def reset_frontier(self, empty: Frontier) -> None:
        self.store._threads[self.thread].frontier = empty  # no test aid: a frontier object

    async def snapshot(self) -> Any:
        t = self.store._threads[self.thread]  # no public view of the raw log
        return t.frontier, list(t.log), dict(t.receipts)


def tamper_for(store: Any, backend: str, thread: ThreadId = T) -> Any:
    kind = {"memory": MemoryTamper, "redis": RedisTamper}.get(backend, SqlTamper)
    return kind(store, thread)


# ---- the cases ----------------------------------------------------------------------------

Edit = Callable[[Any, Victim], Awaitable[None]]
ALL = frozenset({"memory", "sqlite", "postgres", "redis"})
ENCODED = ALL - {"memory"}
"""Backends that store the frontier as text with its checksum."""
SQL = frozenset({"sqlite", "postgres"})


@dataclass(frozen=True)
class Case:
    name: str
    edit: Edit
    seqs: tuple[int, ...]
    """The seq a CorruptRecord may name (more than one where two readings are fair)."""
    raises: frozenset[str]
    """Which of ``read`` and ``load`` must raise."""
    backends: frozenset[str] = ALL


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def flip_byte(text: str) -> str:
    """One byte flipped in the middle of a JSON string value (still ASCII)."""
    at = text.index('"value of k"') + 3
    return text[:at] + chr(ord(text[at]) ^ 1) + text[at + 1 :]


def reencoded(body: str, change: Callable[[dict[str, Any]], None]) -> ThreadCommit:
    """A validly encoded commit: ``body`` decoded, changed, validated and encoded again."""
    data = json.loads(body)
    change(data)
    return ThreadCommit.model_validate(data)


def _later_status(data: dict[str, Any]) -> None:
    data["status"]["since"] += 1


def _evil_result(data: dict[str, Any]) -> None:
    data["batch"]["calls"][0]["phase"]["output"]["content"] = "value of EVIL"


async def _replace_validly(t: Any, v: Victim, seq: int, change: Callable[..., None]) -> None:
    forged = reencoded(v.bodies[seq - 1], change)
    assert forged.prev == v.hashes[seq - 2]  # it links to its predecessor
    await t.set_record(seq, forged.encoded, forged.payload_hash)


async def _swap(t: Any, v: Victim) -> None:
    await t.set_record(3, v.bodies[3], v.hashes[3])
    await t.set_record(4, v.bodies[2], v.hashes[2])


async def _frontier_byte(t: Any, v: Victim) -> None:
    text = await t.frontier()
    await t.set_meta(frontier=text.replace('"steps":2', '"steps":3'))


R, L, RL = frozenset({"read"}), frozenset({"load"}), frozenset({"read", "load"})
CASES = [
    Case("body-byte-flipped", lambda t, v: t.set_record(3, flip_byte(v.bodies[2])), (3,), R),
    Case(
        "tool-result-rewritten",
        lambda t, v: t.set_record(3, v.bodies[2].replace("value of k", "value of EVIL")),
        (3,),
        R,
    ),
    Case(
        "message-text-rewritten",
        lambda t, v: t.set_record(2, v.bodies[1].replace('"looking"', '"LOOKING"')),
        (2,),
        R,
    ),
    Case("payload-hash-replaced", lambda t, v: t.set_record(4, hash_=sha("other")), (4,), R),
    Case("record-deleted", lambda t, v: t.delete(3), (3,), R),
    Case(
        "record-deleted-from-the-log-only",
        lambda t, v: t.delete(3, keys=(t.log,)),
        (3,),
        R,
        frozenset({"redis"}),
    ),
    Case("records-swapped", _swap, (3,), R),
    Case("seq-renumbered", lambda t, v: t.renumber(3, 9), (3,), R, SQL),
    Case("record-moved-to-another-thread", lambda t, v: t.move_to_thread(3, "x"), (3,), R, SQL),
    # its own hash holds, the next record's link does not
    Case("middle-record-forged", lambda t, v: _replace_validly(t, v, 3, _evil_result), (4,), R),
    # the chain holds, the head does not
    Case("last-record-forged", lambda t, v: _replace_validly(t, v, 5, _later_status), (5,), R),
    Case("frontier-byte-flipped", _frontier_byte, (5,), L, ENCODED),
    Case(
        "frontier-checksum-replaced", lambda t, v: t.set_meta(checksum=sha("x")), (5,), L, ENCODED
    ),
    Case("version-raised", lambda t, v: t.set_meta(version=6), (6,), RL, ENCODED),
    # the frontier at 4 has the record at 5 folded in: either seq is a fair name
    Case("version-lowered", lambda t, v: t.set_meta(version=4), (4, 5), RL, ENCODED),
    Case("head-changed", lambda t, v: t.set_meta(head=v.hashes[3]), (5,), R, ENCODED),
]
CASE_IDS = [c.name for c in CASES]


def applies(case: Case, backend: str) -> None:
    if backend not in case.backends:
        pytest.skip(f"{backend} has no such field to edit")


def encoded_frontier(backend: str) -> None:
    if backend not in ENCODED:
        pytest.skip("the memory store keeps its frontier as an object: nothing to edit")


def check_names(exc: CorruptRecord, case: Case, thread: str = T) -> None:
    assert exc.thread == thread and exc.seq in case.seqs, (exc.thread, exc.seq, str(exc))
    assert f"thread '{thread}' at seq {exc.seq}" in str(exc)


# ---- the tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_a_tampered_thread_fails_closed_naming_thread_and_seq(
    store: Any, backend: str, case: Case
) -> None:
    applies(case, backend)
    victim = await make_victim(store)
    bystander = await make_victim(store, ThreadId("bystander"))
    await case.edit(tamper_for(store, backend), victim)
    for op in ("read", "load"):
        if op in case.raises:
            with pytest.raises(CorruptRecord) as info:
                await getattr(store, op)(T)
            check_names(info.value, case)
    problems = await audit(store, T)
    assert problems and {p.thread for p in problems} == {T}
    assert {p.seq for p in problems} <= set(case.seqs), problems
    assert await audit(store, bystander.thread) == []  # the other thread still verifies


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_no_engine_acts_on_a_tampered_thread(store: Any, backend: str, case: Case) -> None:
    applies(case, backend)
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)
    await case.edit(tamper, victim)
    before = await tamper.snapshot()
    with pytest.raises(CorruptRecord) as info:
        await victim.runner(store).resume(victim.approval())
    assert info.value.thread == T
    assert victim.ran == []  # the approved tool never ran
    assert await tamper.snapshot() == before  # and nothing was written


async def test_the_untouched_victim_verifies_and_resumes(store: Any, backend: str) -> None:
    """The control for the cases above: without an edit, each check passes."""
    victim = await make_victim(store)
    assert await audit(store, T) == []
    done = await victim.runner(store).resume(victim.approval())
    assert done.ended and victim.ran == ["SAFE"]
    assert await audit(store, T) == []


@pytest.mark.parametrize("where", ["frontier", "log"])
async def test_recovery_refuses_a_running_thread_that_was_edited(
    store: Any, backend: str, where: str
) -> None:
    """The other way in: a driver died mid-Run (three commits, the lookup's result the
    last); its recovery meets that result rewritten and takes nothing over (no claim,
    no commit)."""
    if where == "frontier":
        encoded_frontier(backend)
    runner = InProcessRunner(permission_agent([]), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id=T, faults=FaultPlan(crash_at=("after:results", 1)))
    running = await store.load(T)
    assert (running.version, running.run_state.kind) == (3, "running")
    tamper = tamper_for(store, backend)
    if where == "frontier":
        text = await tamper.frontier()
        await tamper.set_meta(frontier=text.replace('"value of k"', '"value of j"'))
    else:
        body = (await store.read(T))[2].commit.encoded
        await tamper.set_record(3, body.replace('"value of k"', '"value of j"'))
    before = await tamper.snapshot()
    with pytest.raises(CorruptRecord) as info:
        await InProcessRunner(permission_agent([]), store).recover(T)
    assert (info.value.thread, info.value.seq) == (T, 3)
    assert await tamper.snapshot() == before


@pytest.mark.parametrize("also_the_log", [True, False], ids=["frontier-and-log", "frontier"])
async def test_safe_to_evil_rewrite_never_runs_evil(
    store: Any, backend: str, also_the_log: bool
) -> None:
    """An attacker rewrites the awaiting call's argument SAFE -> EVIL in the stored
    frontier (and in every log record that names it) without recomputing a hash or the
    checksum; the approval fails closed and the tool runs neither with EVIL nor at all."""
    encoded_frontier(backend)
    victim = await make_victim(store)
    tamper = tamper_for(store, backend)
    text = await tamper.frontier()
    assert text.count("SAFE") >= 2  # the batch and the ticket (the assistant's call: the log)
    await tamper.set_meta(frontier=text.replace("SAFE", "EVIL"))
    if also_the_log:
        for seq, body in enumerate(victim.bodies, start=1):
            if "SAFE" in body:
                await tamper.set_record(seq, body.replace("SAFE", "EVIL"))
    before = await tamper.snapshot()
    approval = victim.approval()  # the ticket's correlation does not name the argument
    with pytest.raises(CorruptRecord) as info:
        await victim.runner(store).resume(approval)
    assert (info.value.thread, info.value.seq) == (T, 5)
    assert victim.ran == []
    assert await tamper.snapshot() == before
    with pytest.raises(CorruptRecord):  # a second try, after the first, fails the same way
        await victim.runner(store).resume(approval)
    assert victim.ran == []


class _AppendedMeanwhile:
    """The store, with the thread's next commit landing between the audit's read of the
    log and its load of the frontier (a live thread, written to as it is audited)."""

    def __init__(self, inner: Any, commit: ThreadCommit, version: int, epoch: int) -> None:
        self.inner, self.commit, self.at = inner, commit, (version, epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Frontier:
        if self.commit is not None:
            commit, self.commit = self.commit, None
            await self.inner.append(commit, *self.at)
        return await self.inner.load(thread)


async def test_a_thread_appended_to_as_it_is_audited_verifies(store: Any) -> None:
    """The audit compares one moment of the thread: the records the frontier it loaded
    folds. An append between its two reads made a healthy live thread "not the fold of
    its log", and `ratchet verify` failed on every busy store."""
    from tests.storage.builders import activation, step

    thread = ThreadId("t-live")
    first = activation(thread, "run-1", epoch=1, claim="w#1")
    await store.append(first, 0, 0, claim="w#1")
    later = step(thread, "run-1", 1, prev=first.payload_hash, epoch=1)
    assert await audit(_AppendedMeanwhile(store, later, 1, 1), thread) == []
    assert (await store.load(thread)).version == 2
    assert await audit(store, thread) == []
