"""Two client processes racing on one system; and an in-memory store that Ray restarted.

Every ownership change is compare-and-set (DESIGN §5): of two callers racing a start
or a resume on one thread exactly one wins and the other gets a typed error. The two
clients are separate OS processes (``race_client.py``) joined to this session's Ray
cluster and store; a barrier on the filesystem (each writes a ready file, then waits
for the go file this test writes) makes their calls overlap. Half of each round's
threads are raced through one host (both clients pin the same host), half through
different hosts. Races covered: two starts of different Runs, two starts of the same
Run, two resumes of one ticket, a resume against a cancel.

Two races are made certain in this process instead: a host dying under one client's
resume while another client's resume lands (the loser must hear ResumeRejected), and
two hosts whose activations of one Run are stamped in the same microsecond (the
claimant is part of the commit, so the second is not taken for a retry of the first).

Last, an in-memory store (it lives in the store actor) that Ray restarted comes back
empty: every store call and every host answers StoreLost, never the empty store.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.store_actor import store_actor
from actors.wire import unwrap
from cluster.client import Ratchet, command_for
from runtime.errors import ResumeRejected, StoreLost, StoreUnavailable
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import AwaitingState, EndedState, PermissionDecision
from runtime.messages import ToolResultMessage
from runtime.ports import CommitStore

from .checks import check_log, never_twice
from .conftest import wait_for

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
AGENTS = "tests.ray.agents"
PERMISSION = f"{AGENTS}:permission_agent"
NAPPING = "tests.ray.agents:napping_agent"
ROLES = ("a", "b")
THREADS = 8
"""Threads per mode (one host / different hosts): 2 * THREADS threads per round."""
DEADLINE_S = 120.0
"""For a client process to come up, for one call, and for a Run to come to rest."""


# ---- the two client processes ---------------------------------------------------------


async def race(
    client: Ratchet,
    workdir: Path,
    rounds: dict[str, list[dict[str, Any]]],
    **options: Any,
) -> dict[str, dict[str, Any]]:
    """Run ``race_client`` once per role with its rounds; release each round once both
    clients are ready for it. Returns each role's findings, by round and thread.
    ``options``: more of each client's config (``connect_race``: the go of the round
    ``connect`` first; its ``hosts`` and ``name`` by role, ``{role: value}``)."""
    barrier = workdir / "barrier"
    barrier.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    procs: dict[str, asyncio.subprocess.Process] = {}
    for role, role_rounds in rounds.items():
        config = {
            "address": ray.get_runtime_context().gcs_address,
            "store_url": client.spec.store_url,
            "name": client.spec.name,
            "hosts": client.spec.hosts,
            "role": role,
            "barrier": str(barrier),
            "deadline_s": DEADLINE_S,
            "rounds": role_rounds,
            **{k: v[role] if isinstance(v, dict) else v for k, v in options.items()},
        }
        path = workdir / f"client-{role}.json"
        path.write_text(json.dumps(config))
        procs[role] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.ray.race_client",
            str(path),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    outputs = {role: asyncio.create_task(p.communicate()) for role, p in procs.items()}
    names = ["connect"] if options.get("connect_race") else []
    try:
        for n in [*names, *range(len(rounds[ROLES[0]]))]:

            async def ready(n: int | str = n) -> bool:
                exited = any(p.returncode is not None for p in procs.values())
                return exited or all((barrier / f"ready-{n}-{r}").exists() for r in procs)

            await wait_for(ready, timeout_s=DEADLINE_S, what=f"both clients ready for round {n}")
            if any(p.returncode is not None for p in procs.values()):
                break
            (barrier / f"go-{n}").write_text("go")
        done = await asyncio.wait_for(asyncio.gather(*outputs.values()), 2 * DEADLINE_S)
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                await p.wait()
    found = {}
    for (role, proc), (out, err) in zip(procs.items(), done, strict=True):
        text = out.decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        tail = text[-2000:] + err.decode(errors="replace")[-4000:]
        assert proc.returncode == 0 and lines, f"client {role} failed:\n{tail}"
        found[role] = json.loads(lines[-1].removeprefix("RESULT "))
    return found


def pairs(tag: str, same_run: bool = False) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """Threads, and each client's calls on them: the first THREADS threads through one
    host (both clients pin it), the others through different hosts. On every other pair
    of threads both clients take the thread for new (``new_thread``: no read before the
    activation, only the store's compare-and-set between them)."""
    threads = [f"race-{i}" for i in range(2 * THREADS)]
    calls: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
    for i, thread in enumerate(threads):
        for k, role in enumerate(ROLES):
            host = i % 2 if i < THREADS else (i + k) % 2
            run = f"run-{tag}-{i}" if same_run else f"run-{tag}-{role}-{i}"
            new = i % 4 >= 2
            calls[role].append({"thread": thread, "run_id": run, "host": host, "new_thread": new})
    return threads, calls


def outcomes(found: dict[str, Any], thread: str, round_no: int = 0) -> dict[str, str]:
    return {role: found[role][str(round_no)][thread]["outcome"] for role in ROLES}


def rests(found: dict[str, Any], thread: str, round_no: int = 0) -> set[str]:
    return {found[role][str(round_no)][thread]["rest"] for role in ROLES}


async def runs_of(store: CommitStore, thread: str) -> dict[str, int]:
    """Every Run in a thread's committed log, with the number of activations it had."""
    runs: dict[str, int] = {}
    for record in await store.read(ThreadId(thread)):
        runs.setdefault(record.commit.run_id, 0)
        runs[record.commit.run_id] += record.commit.label == "activation"
    return runs


# ---- racing starts ----------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("agent", "rest"), [(PERMISSION, "awaiting"), (f"{AGENTS}:slow_model_agent", "ended:natural")]
)
async def test_racing_starts_of_different_runs_leave_exactly_one(
    make_system, tmp_path, agent, rest
):
    """(A winner that ended within 5 s, its model slow: the loser, through the same host, took
    the winner's drive for one winding down, waited for it to end, and started a second
    Run on the thread, its caller told "ok".)"""
    client = await make_system()
    tag = uuid.uuid4().hex[:8]
    threads, calls = pairs(tag)
    rounds = {r: [{"action": "start", "agent": agent, "calls": calls[r]}] for r in ROLES}
    found = await race(client, tmp_path, rounds)
    for i, thread in enumerate(threads):
        told = outcomes(found, thread)
        assert sorted(told.values()) == ["InvalidTransition", "ok"], (thread, told)
        winner = f"run-{tag}-{next(r for r, o in told.items() if o == 'ok')}-{i}"
        assert await runs_of(client.store, thread) == {winner: 1}, thread
        # nobody hangs: both clients saw the thread's Run come to rest
        assert rests(found, thread) == {rest}, (thread, found["a"]["0"][thread])
        frontier = await client.store.load(ThreadId(thread))
        assert frontier.run_id == winner and frontier.run_state.kind == rest.split(":")[0]
        await check_log(client.store, thread)


@pytest.mark.timeout(300)
async def test_the_same_run_started_by_both_is_one_run(make_system, tmp_path):
    client = await make_system()
    tag = uuid.uuid4().hex[:8]
    threads, calls = pairs(tag, same_run=True)
    rounds = {r: [{"action": "start", "agent": PERMISSION, "calls": calls[r]}] for r in ROLES}
    found = await race(client, tmp_path, rounds)
    for i, thread in enumerate(threads):
        assert outcomes(found, thread) == {"a": "ok", "b": "ok"}, thread
        assert await runs_of(client.store, thread) == {f"run-{tag}-{i}": 1}, thread
        assert rests(found, thread) == {"awaiting"}, (thread, found["a"]["0"][thread])
        report = await check_log(client.store, thread)
        assert report.steps == 1 and report.lost == 0  # one drive asked the model once


# ---- racing resumes ---------------------------------------------------------------------


@pytest.mark.timeout(300)
async def test_racing_resumes_of_one_ticket_apply_it_once(make_system, tmp_path, ledger):
    client = await make_system()
    threads, calls = pairs(uuid.uuid4().hex[:8])
    handles = await asyncio.gather(
        *(client.start(PERMISSION, "clean up", thread_id=t) for t in threads)
    )
    await client.wait_all(handles, timeout_s=DEADLINE_S)
    tickets = {h.thread_id: await h.ticket() for h in handles}
    assert all(tickets.values()), tickets
    rounds = {r: [{"action": "resume", "calls": calls[r]}] for r in ROLES}
    found = await race(client, tmp_path, rounds)
    for handle in handles:
        thread = handle.thread_id
        told = outcomes(found, thread)
        assert sorted(told.values()) == ["ResumeRejected", "ok"], (thread, told)
        assert rests(found, thread) == {"ended:natural"}, (thread, found["a"]["0"][thread])
        done = await handle.result(timeout_s=DEADLINE_S)
        assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
        effects = ledger.rows(f"tool-batch:{handle.run_id}:")
        results = [m for m in done.messages if isinstance(m, ToolResultMessage)]
        assert len(effects) == 1, (thread, effects, results)  # the tool ran exactly once
        facts = [f.type for f in await handle.events()]
        assert facts.count("resumed") == 1, (thread, facts)
        assert await runs_of(client.store, thread) == {handle.run_id: 1}
        await check_log(client.store, thread)
    never_twice(ledger, [h.run_id for h in handles], ("drop_table",))


@pytest.mark.timeout(300)
async def test_a_resume_racing_a_cancel(make_system, tmp_path, ledger):
    """Client a approves, client b cancels the same ticket: whichever lands first wins; a
    rejected resume leaves no effect, an applied one runs the tool at most once."""
    client = await make_system()
    threads, calls = pairs(uuid.uuid4().hex[:8])
    handles = await asyncio.gather(*(client.start(PERMISSION, "go", thread_id=t) for t in threads))
    await client.wait_all(handles, timeout_s=DEADLINE_S)
    rounds = {
        "a": [{"action": "resume", "calls": calls["a"]}],
        "b": [{"action": "cancel", "calls": calls["b"]}],
    }
    found = await race(client, tmp_path, rounds)
    for handle in handles:
        thread = handle.thread_id
        resumed, cancelled = (found[r]["0"][thread] for r in ROLES)
        assert cancelled["outcome"] == "ok", (thread, cancelled)
        done = await handle.result(timeout_s=DEADLINE_S)
        cause = done.run_state.cause.kind
        assert rests(found, thread) == {f"ended:{cause}"}, (thread, resumed, cancelled)
        effects = ledger.rows(f"tool-batch:{handle.run_id}:")
        facts = [f.type for f in await handle.events()]
        if resumed["outcome"] == "ResumeRejected":  # the cancel landed first
            assert (cause, cancelled["detail"]) == ("cancelled", "cancelled"), thread
            assert effects == [] and "resumed" not in facts, (thread, effects, facts)
        else:
            assert resumed["outcome"] == "ok", (thread, resumed)
            assert facts.count("resumed") == 1 and len(effects) <= 1, (thread, facts)
            if cause == "natural":  # the approved Run was done before the cancel came
                assert cancelled["detail"] in ("not_running", "signalled"), (thread, cancelled)
                assert len(effects) == 1
            else:
                assert cause == "cancelled", (thread, done.run_state)
                assert cancelled["detail"] in ("signalled", "cancelled"), (thread, cancelled)
        await check_log(client.store, thread)
    never_twice(ledger, [h.run_id for h in handles], ("drop_table",))


class _Remote:
    def __init__(self, call: Any) -> None:
        self.remote = call


class _HostDyingMidResume:
    """Stands in for host 0 of client A: while A's resume is in flight there, client B's
    resume of the same ticket lands through host 1, then host 0 dies before answering."""

    def __init__(self, other_host: Any, other_command: Any) -> None:
        self.other_host, self.other_command = other_host, other_command
        self.resume_run = _Remote(self._resume)

    async def _resume(self, command: Any, trace: Any = None) -> Any:
        unwrap(await self.other_host.resume_run.remote(self.other_command))
        raise ray.exceptions.RayActorError()


async def test_a_resume_whose_host_died_is_not_ok_when_another_resume_landed(make_system, ledger):
    client = await make_system()
    handle = await client.start(PERMISSION, "clean up", thread_id="died-1")
    ticket = (await handle.result(timeout_s=60)).run_state.ticket
    approve = command_for(ticket, PermissionDecision(approve=True))
    deny = command_for(ticket, PermissionDecision(approve=False, note="B said no"))
    dying = _HostDyingMidResume(client.hosts[1], deny)
    a = Ratchet(client.spec, client.store, [dying, client.hosts[1]])
    outcome = "ok"
    try:
        await a.handle(handle.thread_id).resume(approve, host=0)
    except ResumeRejected:
        outcome = "ResumeRejected"
    done = await handle.result(timeout_s=60)
    (result,) = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    assert result.is_error and "B said no" in result.content  # B's denial is what landed
    assert ledger.rows(f"tool-batch:{handle.run_id}:") == []  # A's approval never applied
    assert outcome == "ResumeRejected", "A was told its approval landed"


class _LoadThenYield:
    """A store whose ``load`` lets the loop run before answering: two engines started
    together both read the thread before either writes (the race, made certain)."""

    def __init__(self, inner: CommitStore) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        frontier = await self.inner.load(thread)
        await asyncio.sleep(0)
        return frontier


async def test_two_hosts_starting_one_run_in_the_same_microsecond_run_it_once(monkeypatch):
    """What the same-run-id race above meets once in a while: both hosts' activation
    commits are stamped in the same microsecond, so they are byte-identical."""
    from runtime.engine import Engine
    from runtime.tool_calls import LocalToolRunner
    from storage.memory import MemoryCommitStore

    from .race_agents import CHARGES, charging_agent

    monkeypatch.setattr("runtime.engine.now_us", lambda: 1_700_000_000_000_000)
    store = _LoadThenYield(MemoryCommitStore())
    thread, run = ThreadId("same-us"), RunId(f"run-us-{uuid.uuid4().hex[:8]}")
    engines = [
        Engine(charging_agent, store, LocalToolRunner(charging_agent.tools), owner=f"host-{i}#1")
        for i in range(2)
    ]
    ends = await asyncio.gather(
        *(e.start(thread, "go", run_id=run, message_id=f"{run}:input") for e in engines),
        return_exceptions=True,
    )
    assert all(not isinstance(e, BaseException) for e in ends), ends
    charged = [op for op in CHARGES if op.startswith(f"tool-batch:{run}:")]
    assert len(charged) == 1, f"the never_replay charge ran {len(charged)} times: {charged}"


# ---- an in-memory store that Ray restarted ----------------------------------------------


@pytest.mark.timeout(120)
async def test_a_restarted_memory_store_fails_closed(ledger):
    name = f"ratchet-memrace-{uuid.uuid4().hex[:8]}"
    client = await Ratchet.connect(store_url="memory://", name=name)
    try:
        handle = await client.start(PERMISSION, "clean up", thread_id="mem-1", host=0)
        parked = await handle.result(timeout_s=60)
        assert isinstance(parked.run_state, AwaitingState)
        command = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
        napping = await client.start(NAPPING, "nap", thread_id="mem-nap", host=1)

        async def in_its_nap() -> bool:
            return bool(ledger.rows(f"tool-batch:{napping.run_id}:"))

        await wait_for(in_its_nap, what="the nap")  # a Run being driven, mid-tool
        ray.kill(store_actor(client.spec), no_restart=False)  # Ray restarts it, empty

        async def lost() -> bool:
            try:
                frontier = await client.store.load(handle.thread_id)
            except StoreUnavailable:  # restarting
                return False
            except StoreLost:
                return True
            # the old actor, not killed yet; an empty answer would be a guess taken for truth
            assert frontier.run_state == parked.run_state, frontier
            return False

        await wait_for(lost, timeout_s=60, what="the restarted store to answer StoreLost")
        with pytest.raises(StoreLost):
            await client.store.list_runs()
        with pytest.raises(StoreLost):
            await handle.result(timeout_s=30)
        with pytest.raises(StoreLost):  # would be InvalidTransition if the store were truth
            await client.start(PERMISSION, "again", thread_id=handle.thread_id)
        with pytest.raises(StoreLost):
            await client.start(PERMISSION, "fresh", thread_id="mem-fresh")
        with pytest.raises(StoreLost):
            await handle.resume(command)

        # the drive in flight stops at its next commit, and is never driven again there
        async def dropped() -> bool:
            info = await client.hosts[1].info.remote()
            return info["driving"] == 0 and "mem-nap" in info["quarantined"]

        await wait_for(dropped, timeout_s=60, what="host 1 to drop the napping Run")
        with pytest.raises(StoreLost):
            await napping.result(timeout_s=30)
        # each host answers StoreLost itself, typed, whichever the client would have asked
        for host in client.hosts:
            with pytest.raises(StoreLost):
                unwrap(await host.resume_run.remote(command))
            fresh = ThreadId(f"mem-fresh-{uuid.uuid4().hex[:6]}")
            with pytest.raises(StoreLost):
                unwrap(await host.start_run.remote(PERMISSION, fresh, RunId("run-x"), "hi"))
            assert await host.driving.remote() == []
        assert ledger.rows(f"tool-batch:{handle.run_id}:") == []  # the call never ran

    finally:
        await client.shutdown()
