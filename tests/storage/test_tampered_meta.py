"""Values kept beside the verified ones, edited by hand: a receipt handed back to a
retry, and (Redis) the ``run_id``/``ended`` meta fields the append script once trusted.
Each is either checked against what the chain vouches for or never acted on."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import func, select, update

from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from storage.schema import commits

from .test_integrity import SqlTamper, make_victim

T = ThreadId("tampered-meta")


async def _retry_of_the_last(store: Any) -> Any:
    """Append the thread's last commit again, as a writer that lost its receipt would."""
    last = (await store.read(T))[-1].commit
    frontier = await store.load(T)
    return await store.append(last, frontier.version - 1, frontier.epoch)


async def test_a_retry_gets_its_receipt_back(store: Any) -> None:
    await make_victim(store, T)
    receipt = await _retry_of_the_last(store)
    assert receipt.seq == 5 and receipt.thread_id == T


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize(
    "edit", [{"seq": 1005}, {"seq": 0}, {"thread_id": "another"}, {"operation_id": "x"}]
)
async def test_a_redis_receipt_edited_by_hand_is_never_handed_to_a_retry(
    store: Any, edit: dict[str, Any]
) -> None:
    await make_victim(store, T)
    ops = f"{store.prefix}:thread:{T}:ops"
    last = (await store.read(T))[-1].commit
    receipt = json.loads(await store.client.hget(ops, last.operation_id))
    await store.client.hset(ops, last.operation_id, json.dumps(receipt | edit))
    with pytest.raises(CorruptRecord, match="receipt"):
        await _retry_of_the_last(store)


async def test_a_sql_head_record_renumbered_past_the_head_fails_a_retry(sql_store: Any) -> None:
    """The SQL receipt is the commit row's own seq: the row renumbered past the frontier
    fails the retry closed (the load that precedes the receipt's check already does)."""
    await make_victim(sql_store, T)
    async with sql_store.engine.begin() as conn:
        row = (commits.c.thread_id == T) & (commits.c.seq == 5)
        await conn.execute(update(commits).where(row).values(seq=1005))
    with pytest.raises(CorruptRecord):
        await _retry_of_the_last(sql_store)


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize("fields", [{"ended": "1"}, {"run_id": "run-other", "ended": "1"}])
async def test_redis_run_fields_edited_by_hand_do_not_wedge_the_run(
    store: Any, fields: dict[str, str]
) -> None:
    """The append script used to refuse every append of a Run the meta called ended,
    which no load ever saw: the Run could neither go on nor be settled."""
    victim = await make_victim(store, T)
    await store.client.hset(f"{store.prefix}:thread:{T}:meta", mapping=fields)
    done = await victim.runner(store).resume(victim.approval())
    assert done.run_state is not None and done.run_state.kind == "ended"
    assert victim.ran  # the approved tool ran once the approval was committed


async def test_one_corrupt_thread_does_not_stop_the_listing_of_the_others(
    sql_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``ratchet runs`` and ``GET /runs`` (one listing, ``run_page``) read each listed
    Run's verified head and own records (the store's listing columns are not what a
    checksum covers): a record of one of them edited by hand leaves that thread out,
    logged, and lists the rest."""
    from cluster.cli_runs import RunQuery, run_page
    from edge.routes import list_runs
    from runtime.limits import DEFAULT_LIMITS

    good, bad = ThreadId("a-good"), ThreadId("b-bad")
    await make_victim(sql_store, good)
    victim = await make_victim(sql_store, bad)
    await SqlTamper(sql_store, bad).set_record(3, body=victim.bodies[2].replace("a", "b", 1))
    client = SimpleNamespace(store=sql_store, spec=SimpleNamespace(limits=DEFAULT_LIMITS))
    with caplog.at_level(logging.ERROR):
        rows, after = await run_page(sql_store, RunQuery())
        page = await list_runs(client)  # type: ignore[arg-type]
    assert [r.summary.thread_id for r in rows] == [good] and after is None
    assert [(r.thread_id, r.agent) for r in page.runs] == [(good, None)]  # no agent reference
    assert page.next_cursor is None
    assert "b-bad" in caplog.text and "left out" in caplog.text


@pytest.mark.parametrize("edit", ["head record", "thread row"])
async def test_a_head_record_deleted_under_a_running_run_stops_its_next_append(
    sql_store: Any, edit: str
) -> None:
    """An append writes the next record without reading the log. The record at the
    frontier's head deleted by hand while a Run ran (its tool still busy) was written
    past: the Run went on over the gap to its end, ``ended natural``, and only later
    reads refused the thread. The append now checks the head record is still there (in
    the planned group's update, and in the read-first group): CorruptRecord, nothing
    more written."""
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call, tool

    busy, release = asyncio.Event(), asyncio.Event()

    @tool(recovery=("replay_safe",))
    async def slow() -> str:
        busy.set()
        await release.wait()
        return "done"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("slow", "c1"),)), ModelResponse(text="ok")]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), sql_store)
    drive = asyncio.create_task(runner.start("go", thread_id="t-gap"))
    await asyncio.wait_for(busy.wait(), 10)
    head = await sql_store.load_head(ThreadId("t-gap"))
    tamper = SqlTamper(sql_store, ThreadId("t-gap"))
    if edit == "head record":
        await tamper.delete(head.version)
    else:  # the row made again by the append found records no frontier vouched for
        await tamper.drop_thread()
    release.set()
    why = "head is gone" if edit == "head record" else "no frontier vouches for"
    with pytest.raises(CorruptRecord, match=why):
        await asyncio.wait_for(drive, 30)
    stored = await SqlTamper(sql_store, ThreadId("t-gap"))._run(
        select(func.max(commits.c.seq)).where(commits.c.thread_id == "t-gap")
    )
    kept = head.version - 1 if edit == "head record" else head.version
    assert stored == [(kept,)]  # nothing written past the gap
    with pytest.raises(CorruptRecord):
        await sql_store.load(ThreadId("t-gap"))


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epoch", "123456789012345678"),  # past 2**53: Lua wrote epoch + 1 rounded
        ("epoch", "0_1"),  # Python's int() took it, Lua's tonumber did not
        ("version", "\u0665"),  # an Arabic-Indic five, the same
        ("epoch", "1e3"),  # Lua's tonumber took it, Python's int() did not
        ("epoch", "-1"),
    ],
)
async def test_redis_counters_edited_by_hand_are_corrupt_to_reads_and_scripts_alike(
    store: Any, field: str, value: str
) -> None:
    """A meta counter Python and the Lua scripts read differently: reads and ``ratchet
    verify`` called the thread clean while every append failed, or a claim answered an
    epoch the script had stored rounded (``1.2345678901235e+17``), the thread unreadable
    from then on. Now neither side takes it."""
    victim = await make_victim(store, T)
    meta = f"{store.prefix}:thread:{T}:meta"
    await store.client.hset(meta, field, value)
    with pytest.raises(CorruptRecord):
        await store.load(T)
    with pytest.raises(CorruptRecord):
        await store.claim(T, "someone", victim.frontier.epoch)
    assert await store.client.hget(meta, field) == value  # the scripts wrote nothing
