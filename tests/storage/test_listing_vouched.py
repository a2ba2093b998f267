"""A listing serves only what the store vouches for (SQL stores: the index columns of a
thread row are checked against the row's frontier, which its checksum and the hash of
the record at its version vouch for). An index edited by hand leaves that Run out of
every listing, logged, and never stops the listing of the others: the Supervisor's
sweeps and the hosts' reconciliation list Runs, and take them over from what they list.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from sqlalchemy import insert

from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import audit
from runtime.ports import refused_in
from storage.schema import commits

from .test_integrity import SqlTamper, make_victim

GOOD, BAD = ThreadId("listed-good"), ThreadId("listed-bad")
FORGED_STATUS = json.dumps({"state": "failed", "since": 1, "reason": "forged"})


@pytest.mark.parametrize(
    "edit",
    [
        {"run_state": "ended", "cause": "natural"},
        {"owner": "evil-host#1", "host": "evil-host"},
        {"status": FORGED_STATUS},
        {"run_id": "run-forged"},
        {"status": "x"},  # not even a status
        {"run_state": "bogus"},  # not a run state
    ],
    ids=["state", "owner", "status", "run-id", "status-not-json", "state-not-a-state"],
)
async def test_an_index_edited_by_hand_is_left_out_and_the_others_are_listed(
    sql_store: Any, edit: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = await make_victim(sql_store, GOOD), await make_victim(sql_store, BAD)
    await SqlTamper(sql_store, BAD).set_meta(**edit)
    with caplog.at_level(logging.ERROR, logger="ratchet.store"):
        every = await sql_store.list_runs()
        awaiting = await sql_store.list_runs("awaiting")
        ended = await sql_store.list_runs("ended")
    assert [s.thread_id for s in every] == [GOOD] == [s.thread_id for s in awaiting]
    assert ended == []  # a Run the index calls ended, which its frontier does not
    assert every[0].state == "awaiting" and every[0].owner == good.frontier.owner
    assert f"{BAD}" in caplog.text and "does not verify" in caplog.text
    assert refused_in(every) == (BAD,)  # a sweep quarantines it
    # the thread itself still loads as its records have it
    assert (await sql_store.load(BAD)).run_state == bad.frontier.run_state


async def test_a_host_listing_trusts_no_host_column(sql_store: Any) -> None:
    """The owner index (``list_runs(host=...)``) picks rows by their host column; the
    Runs it answers are those whose vouched owner is that host."""
    victim = await make_victim(sql_store, GOOD)
    await SqlTamper(sql_store, GOOD).set_meta(host="other-host")
    assert await sql_store.list_runs(host="other-host") == []
    assert victim.frontier.run_state is not None


async def test_a_record_past_the_head_fails_closed_instead_of_a_conflict_for_ever(
    sql_store: Any,
) -> None:
    """A record put by hand past the thread row's version: the next append meets it. It
    is CorruptRecord (no engine acts on the thread), not a VersionConflict that a drive
    would retry for ever; the approved call never runs."""
    victim = await make_victim(sql_store, BAD)
    async with sql_store.engine.begin() as conn:
        await conn.execute(
            insert(commits).values(
                thread_id=BAD,
                seq=victim.frontier.version + 1,
                operation_id="planted",
                payload_hash="0" * 64,
                label="results",
                body="{}",
            )
        )
    with pytest.raises(CorruptRecord, match="past the frontier's head"):
        await victim.runner(sql_store).resume(victim.approval())
    assert victim.ran == []


async def test_a_log_whose_thread_row_was_deleted_is_listed_for_an_audit(sql_store: Any) -> None:
    await make_victim(sql_store, GOOD)
    await make_victim(sql_store, BAD)
    await SqlTamper(sql_store, BAD).drop_thread()
    assert await sql_store.thread_ids() == [BAD, GOOD]
    assert await sql_store.thread_ids(BAD) == [GOOD]
    assert await sql_store.thread_ids("", 1) == [BAD]
    with pytest.raises(CorruptRecord, match="no frontier vouches for"):
        await sql_store.load(BAD)


async def test_an_audit_names_a_run_index_that_is_not_its_frontier_s(sql_store: Any) -> None:
    """A running Run whose index says ended would never be swept up again: ``ratchet
    verify`` must say so."""
    await make_victim(sql_store, GOOD)
    await make_victim(sql_store, BAD)
    await SqlTamper(sql_store, BAD).set_meta(run_state="ended", cause="natural")
    assert await audit(sql_store, GOOD) == []
    (problem,) = await audit(sql_store, BAD)
    assert "run index is not the frontier's" in problem.detail


async def test_an_index_that_hides_a_run_is_named_by_an_audit_and_refused_by_a_sweep(
    sql_store: Any,
) -> None:
    """The owner index picks rows by their host column, and a row that names no Run is
    in no listing: either edit hid a Run from every host's reconciliation. An audit
    names both; the Supervisor's listing of running Runs (no host filter) refuses the
    host edit, so the Run is quarantined and reported, not forgotten."""
    await make_victim(sql_store, GOOD)
    await make_victim(sql_store, BAD)
    await SqlTamper(sql_store, BAD).set_meta(run_state=None, run_id=None, cause=None)
    assert [s.thread_id for s in await sql_store.list_runs()] == [GOOD]
    (problem,) = await audit(sql_store, BAD)
    assert "names no Run" in problem.detail
    other = ThreadId("listed-moved")
    await make_victim(sql_store, other)
    await SqlTamper(sql_store, other).set_meta(host="elsewhere")
    listing = await sql_store.list_runs("awaiting")
    assert [s.thread_id for s in listing] == [GOOD] and other in refused_in(listing)
    (problem,) = await audit(sql_store, other)
    assert "host is not its owner's" in problem.detail


REDIS_DB = 12
"""This file's own Redis database (the shared fixture's db 9 is flushed by other suites)."""


@pytest.fixture
def redis_test_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize(
    "edit", [{"state": "ended"}, {"owner": "evil-host#1"}, {"run_id": "run-forged"}]
)
async def test_a_redis_run_index_entry_edited_by_hand_is_left_out(
    store: Any, edit: dict[str, Any]
) -> None:
    await make_victim(store, GOOD)
    await make_victim(store, BAD)
    index = store._index("awaiting")
    entry = json.loads(await store.client.hget(index, BAD))
    await store.client.hset(index, BAD, json.dumps(entry | edit))
    assert [s.thread_id for s in await store.list_runs()] == [GOOD]
    assert refused_in(await store.list_runs()) == (BAD,)
    assert [s.thread_id for s in await store.list_runs("awaiting")] == [GOOD]
    await store.client.hset(index, BAD, "not json")
    assert [s.thread_id for s in await store.list_runs()] == [GOOD]


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_redis_log_whose_meta_was_deleted_is_listed_for_an_audit(store: Any) -> None:
    await make_victim(store, GOOD)
    await make_victim(store, BAD)
    odd = ThreadId("with:colons:meta")  # a thread id may hold what looks like a key part
    await make_victim(store, odd)
    await store.client.delete(f"{store.prefix}:thread:{BAD}:meta")
    assert await store.thread_ids() == sorted([BAD, GOOD, odd])
    assert await store.thread_ids(BAD, 1) == [GOOD]
    with pytest.raises(CorruptRecord):
        await store.load(BAD)
    assert await audit(store, BAD)  # the thread is reported, not skipped


class _DoneHost:
    """A host that says at once that it drives the Run no more (no Ray asked)."""

    class _Done:
        async def remote(self, *args: Any, **kwargs: Any) -> None:
            return None

    until_rest = _Done()


async def _hide_in_the_index(store: Any, backend: str, thread: ThreadId) -> None:
    """The thread's run index entry removed by hand: its Run is in no listing."""
    if backend == "redis":
        for state in ("running", "awaiting", "ended"):
            await store.client.hdel(store._index(state), thread)
    else:
        await SqlTamper(store, thread).set_meta(run_state=None, run_id=None, cause=None)


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"], indirect=True)
async def test_wait_all_sees_a_run_at_rest_that_an_edited_index_hides(
    store: Any, backend: str
) -> None:
    """``wait_all`` confirms Runs at rest from one listing: a Run the index no longer
    lists (edited by hand) was waited for as if it still ran, for ever without a
    timeout, while its own handle's ``result`` (the verified head) said it had ended.
    A thread the listing leaves out is asked of its verified head."""
    from actors.wire import SystemSpec
    from cluster.client import Ratchet
    from cluster.handle import RunHandle
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
    from runtime.ids import RunId

    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    await InProcessRunner(agent, store).start("go", thread_id=BAD, run_id="r1")
    await _hide_in_the_index(store, backend, BAD)
    assert await store.list_runs() == []
    client = Ratchet(SystemSpec(name="t", store_url="memory://", hosts=1), store, [_DoneHost()])
    handle = RunHandle(client, BAD, RunId("r1"), "hosted")
    assert (await handle.result(timeout_s=30)).ended  # the verified head: it ended
    (summary,) = await asyncio.wait_for(client.wait_all([handle], timeout_s=10), 30)
    assert (summary.thread_id, summary.run_id, summary.state) == (BAD, "r1", "ended")


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_redis_owner_index_of_the_wrong_type_still_lists_the_hosts_runs(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A host's owner index edited by hand into a string made every listing of that
    host's running Runs a StoreError: its reconciliation and the Supervisor's tick
    failed at every pass. The running index names each Run's owner too."""
    from runtime import Crash, FaultPlan, InProcessRunner
    from runtime.ports import host_of

    from .test_integrity import permission_agent

    crash = FaultPlan(crash_at=("after:results", 1))
    with pytest.raises(Crash):
        await InProcessRunner(permission_agent([]), store).start("go", thread_id=BAD, faults=crash)
    host = host_of((await store.load_head(BAD)).owner)
    assert host is not None
    [listed] = await store.list_runs("running", host=host)
    owners = f"{store.prefix}:owner:{host}"
    await store.client.delete(owners)
    await store.client.set(owners, "edited")
    with caplog.at_level(logging.ERROR, logger="ratchet.storage.redis"):
        assert await store.list_runs("running", host=host) == [listed]
    assert owners in caplog.text
    assert await store.list_runs("running", host="another-host") == []


@pytest.mark.parametrize("delta", [1, -1])
async def test_audit_names_a_thread_rows_epoch_that_is_not_its_frontiers(
    sql_store: Any, delta: int
) -> None:
    """The ``epoch`` column copies the checksummed frontier's (planned writes compare
    it): edited by hand, ``ratchet verify`` said nothing. The frontier stays the truth:
    the Run is resumed, and its next write puts the column right."""
    victim = await make_victim(sql_store, BAD)
    assert await audit(sql_store, BAD) == []
    await SqlTamper(sql_store, BAD).set_meta(epoch=victim.frontier.epoch + delta)
    (problem,) = await audit(sql_store, BAD)
    assert "epoch" in problem.detail, problem
    assert (await sql_store.load(BAD)).epoch == victim.frontier.epoch
    done = await victim.runner(sql_store).resume(victim.approval())
    assert done.ended and await audit(sql_store, BAD) == []


async def test_audit_names_the_owner_column_of_a_thread_with_no_run(sql_store: Any) -> None:
    """A claimed thread with no Run yet has no run index entry to vouch its owner by."""
    claimed = await sql_store.claim(GOOD, "host-0#1", 0)
    assert await audit(sql_store, GOOD) == []
    await SqlTamper(sql_store, GOOD).set_meta(owner="host-9#9")
    (problem,) = await audit(sql_store, GOOD)
    assert "host-9#9" in problem.detail, problem
    assert (await sql_store.load_head(GOOD)).owner == claimed.owner
