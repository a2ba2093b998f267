"""Two client processes racing what ``test_races`` does not: one Run started with two
inputs, one ticket answered two ways, a fork into a thread id another client starts a
Run on, and two clients starting one system at once (DESIGN §11).

The clients are ``race_client`` processes, released together by ``test_races.race``;
half of each round's threads are raced through one host, half through different ones.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from cluster.client import Ratchet
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState, PermissionDecision
from runtime.messages import ToolResultMessage, UserMessage

from .checks import check_log
from .test_races import PERMISSION, ROLES, outcomes, pairs, race, rests, runs_of

pytestmark = pytest.mark.ray
UNTIL_FILE = "tests.ray.race_agents:until_file_agent"


@pytest.mark.timeout(400)
async def test_one_run_started_two_ways_then_answered_two_ways_then_forked_into(
    make_system, tmp_path, ledger
):
    """Round 0: both clients start the same Run, a with input "alpha", b with "beta": one
    is the Run, the other refused typed (never a second Run, never the two merged).
    Round 1: a approves the ticket, b denies it: exactly one lands, the other is
    ResumeRejected, and the Run goes on once, as the one that landed asked. Round 2: a
    forks each thread at its end into a new id on which b starts a Run at once: one
    thread, whole and legal, whoever won."""
    client = await make_system()
    tag = uuid.uuid4().hex[:8]
    threads, calls = pairs(tag, same_run=True)
    inputs = {"a": "alpha", "b": "beta"}
    starts = {r: [{**c, "input": inputs[r]} for c in calls[r]] for r in ROLES}
    answers = {r: [{**c, "approve": r == "a"} for c in calls[r]] for r in ROLES}
    forks = {t: f"fork-{tag}-{i}" for i, t in enumerate(threads)}
    forking = [{"thread": forks[t], "source": t} for t in threads]
    starting = [
        {"thread": forks[t], "run_id": f"run-{tag}-on-fork-{i}", "host": i % 2, "new_thread": True}
        for i, t in enumerate(threads)
    ]
    rounds = {
        "a": [
            {"action": "start", "agent": PERMISSION, "calls": starts["a"]},
            {"action": "resume", "calls": answers["a"]},
            {"action": "fork", "calls": forking},
        ],
        "b": [
            {"action": "start", "agent": PERMISSION, "calls": starts["b"]},
            {"action": "resume", "calls": answers["b"]},
            {"action": "start", "agent": PERMISSION, "calls": starting},
        ],
    }
    found = await race(client, tmp_path, rounds)
    for i, thread in enumerate(threads):
        run = f"run-{tag}-{i}"
        told = outcomes(found, thread)
        assert sorted(told.values()) == ["InvalidTransition", "ok"], (thread, told)
        won = next(r for r, o in told.items() if o == "ok")
        assert await runs_of(client.store, thread) == {run: 1}, thread
        records = await client.store.read(ThreadId(thread))
        said = [m.text for r in records for m in r.commit.messages if isinstance(m, UserMessage)]
        assert said == [inputs[won]], (thread, said)
        # round 1: one answer landed, the Run ended once as it asked
        told = outcomes(found, thread, 1)
        assert sorted(told.values()) == ["ResumeRejected", "ok"], (thread, told)
        landed = next(r for r, o in told.items() if o == "ok")
        assert rests(found, thread, 1) == {"ended:natural"}, (thread, found["a"]["1"][thread])
        frontier = await client.store.load(ThreadId(thread))
        assert isinstance(frontier.run_state, EndedState)
        (result,) = [m for m in frontier.messages if isinstance(m, ToolResultMessage)]
        effects = ledger.rows(f"tool-batch:{run}:")
        assert len(effects) == (1 if landed == "a" else 0), (thread, landed, effects)
        assert result.is_error == (landed == "b"), (thread, landed, result)
        await check_log(client.store, thread)
        # round 2: the fork and the start on its thread
        new = forks[thread]
        forked, started = found["a"]["2"][new], found["b"]["2"][new]
        on_fork = f"run-{tag}-on-fork-{i}"
        copied = await runs_of(client.store, new)
        if forked["outcome"] == "ok":  # the copy is the thread's start, whole
            assert next(iter(copied)) == run, (new, copied, forked, started)
            if started["outcome"] == "ok":
                assert copied == {run: 1, on_fork: 1}, (new, copied)
            else:
                assert started["outcome"] == "InvalidTransition", (new, started)
                assert copied == {run: 1}, (new, copied, started)
        else:
            assert forked["outcome"] == "ForkRefused", (new, forked)
            assert "thread_exists" in forked["detail"], (new, forked)
            assert started["outcome"] == "ok", (new, started)
            assert copied == {on_fork: 1}, (new, copied)
        assert rests(found, new, 2) <= {"awaiting", "ended:natural"}, (new, forked, started)
        await check_log(client.store, new)


@pytest.mark.timeout(300)
async def test_two_clients_starting_one_system_at_once_run_it_with_one_spec(tmp_path):
    """Both find no Supervisor and start the system, asking for different pool sizes:
    one system runs, and no client is told it runs with settings it does not."""
    name = f"ratchet-conn-{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp_path}/connect.db"
    probe: Any = type("Probe", (), {"spec": type("S", (), {"store_url": url, "name": name})})
    probe.spec.hosts = 2
    try:
        found = await race(
            probe,
            tmp_path,
            {r: [] for r in ROLES},
            connect_race=True,
            hosts={"a": 2, "b": 3},
        )
    finally:
        system = await Ratchet.connect(store_url=url, name=name)
        await system.shutdown()
    connected = {r: found[r]["connect"] for r in ROLES}
    for role, seen in connected.items():
        if seen["outcome"] == "ok":
            assert seen["hosts"] == seen["system_hosts"], (role, connected)
        else:
            assert seen["outcome"] == "ConfigError", (role, connected)
    # they asked for different pools: one system, and the other client refused
    assert sorted(seen["outcome"] for seen in connected.values()) == ["ConfigError", "ok"]


@pytest.mark.timeout(300)
async def test_a_cancel_and_a_stop_racing_the_run_s_own_end(make_system, tmp_path):
    """Runs whose model answers once the round's go is given (each ends then), started
    pinned to a host; client a cancels each, client b stops it, each through the host the
    thread hashes to: the Run ends once, and only the call whose end it is says it ended
    it."""
    client = await make_system()
    threads, calls = pairs(uuid.uuid4().hex[:8])
    go = str(tmp_path / "barrier" / "go-0")  # the file ``race`` writes to start round 0
    handles = [
        await client.start(UNTIL_FILE, f"{go}|{60 * i}", thread_id=t, host=c["host"])
        for i, (t, c) in enumerate(zip(threads, calls["a"], strict=True))
    ]
    rounds = {
        "a": [{"action": "end", "calls": calls["a"]}],
        "b": [{"action": "end", "reason": "budget", "calls": calls["b"]}],
    }
    found = await race(client, tmp_path, rounds)
    for handle in handles:
        thread = handle.thread_id
        cancelled, stopped = (found[r]["0"][thread] for r in ROLES)
        assert {cancelled["outcome"], stopped["outcome"]} == {"ok"}, (thread, found)
        done = await handle.result(timeout_s=60)
        cause = done.run_state.cause.kind
        assert rests(found, thread) == {f"ended:{cause}"}, (thread, cancelled, stopped)
        said = {"cancelled": cancelled["detail"], "stopped": stopped["detail"]}
        for word, answer in said.items():
            if word != cause:  # it ended nothing
                assert answer in ("not_running", "signalled"), (thread, cause, said)
            else:
                assert answer in (word, "signalled"), (thread, cause, said)
        await check_log(client.store, thread)


async def test_one_answer_sent_twice_at_once_under_its_request_id_lands_once(make_system, ledger):
    """A caller (an HTTP edge retrying, two servers behind a balancer) sends the same
    answer under one request id twice at once, through different hosts: it landed once,
    and both are its success (the one that found it landed is not ResumeRejected)."""
    client = await make_system()
    tag = uuid.uuid4().hex[:8]
    handles = await asyncio.gather(
        *(client.start(PERMISSION, "go", thread_id=f"twice-{tag}-{i}") for i in range(6))
    )
    await client.wait_all(handles, timeout_s=60)
    approve = PermissionDecision(approve=True)
    for handle in handles:
        answers = await asyncio.gather(
            *(
                client.handle(handle.thread_id).respond(approve, host=h, request_id="r1")
                for h in (0, 1)
            ),
            return_exceptions=True,
        )
        assert not [a for a in answers if isinstance(a, BaseException)], answers
        done = await handle.result(timeout_s=60)
        assert done.run_state.cause.kind == "natural"
        assert len(ledger.rows(f"tool-batch:{handle.run_id}:")) == 1
        await check_log(client.store, handle.thread_id)
