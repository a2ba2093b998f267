"""A Run's metadata (its agent reference) read from that Run's own records, verified,
on every backend: a listing asks it of every thread, so it must not read whole logs."""

from __future__ import annotations

from typing import Any

from actors.wire import RunMeta, run_meta, stored_run_meta
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.ids import RunId, ThreadId

T = ThreadId("t-meta")


def _agent() -> Agent:
    script = [ModelResponse(text="one"), ModelResponse(text="two"), ModelResponse(text="three")]
    return Agent(name="meta", model=ScriptedModel(script))


async def _three_runs(store: Any) -> None:
    """Three Runs on one thread, each started as a hosted Run is (its metadata in the id
    of its input message)."""
    for i, ref in enumerate(("pkg.a:agent", "pkg.b:agent", "pkg.c:agent")):
        engine = InProcessRunner(_agent(), store).engine()
        run = RunId(f"run-{i}")
        await engine.start(T, "go", run_id=run, message_id=RunMeta(agent_ref=ref).message_id(run))


def _counting_reads(store: Any) -> list[int]:
    """Records each read returned (the store itself does the reading)."""
    seen: list[int] = []
    read = store.read

    async def counted(thread: Any, after_seq: int = 0) -> Any:
        records = await read(thread, after_seq)
        seen.append(len(records))
        return records

    store.read = counted
    return seen


async def test_the_latest_runs_metadata_is_read_from_its_own_records(store: Any) -> None:
    await _three_runs(store)
    whole = await store.load(T)
    head = await store.load_head(T)
    seen, loads = _counting_reads(store), [0]
    load = store.load

    async def counted_load(thread: Any) -> Any:
        loads[0] += 1
        return await load(thread)

    store.load = counted_load
    meta = await stored_run_meta(store, head)
    assert meta == run_meta(whole) == RunMeta(agent_ref="pkg.c:agent")
    assert seen == [head.next_ordinal] and head.next_ordinal < head.version
    assert loads[0] == 0  # not the whole log


async def test_a_head_the_thread_moved_past_still_names_its_own_run(store: Any) -> None:
    engine = InProcessRunner(_agent(), store).engine()
    run = RunId("run-0")
    await engine.start(T, "go", run_id=run, message_id=RunMeta(agent_ref="x:y").message_id(run))
    old = await store.load_head(T)
    engine = InProcessRunner(_agent(), store).engine()
    later = RunId("run-1")
    await engine.start(T, "go", run_id=later, message_id=RunMeta(agent_ref="z:w").message_id(later))
    assert await stored_run_meta(store, old) == RunMeta(agent_ref="x:y")
    assert await stored_run_meta(store, await store.load_head(T)) == RunMeta(agent_ref="z:w")


async def test_a_run_whose_input_was_pruned_is_read_whole(store: Any) -> None:
    await _three_runs(store)
    head = await store.load_head(T)
    assert await store.prune(T, head.version) > 0  # the last Run ended: all of it goes
    assert await stored_run_meta(store, await store.load_head(T)) == RunMeta(
        agent_ref="pkg.c:agent"
    )


async def test_a_run_started_without_metadata_has_none(store: Any) -> None:
    await InProcessRunner(_agent(), store).start("go", thread_id=T, run_id="r1")
    assert await stored_run_meta(store, await store.load_head(T)) is None
    assert await stored_run_meta(store, await store.load_head(ThreadId("t-none"))) is None


async def test_a_run_id_holding_the_separator_keeps_its_metadata(store: Any) -> None:
    """Ids may hold "|", which also separates the metadata in the input message's id:
    read from the right, a run id such as "a|dedicated|b" names neither the placement
    nor the agent (else every resume and recovery of the Run imported "dedicated|b")."""
    for run, placement in (("a|b", "hosted"), ("x|dedicated|y", "hosted"), ("p|q", "dedicated")):
        meta = RunMeta(agent_ref="pkg.a:agent", placement=placement)  # type: ignore[arg-type]
        engine = InProcessRunner(_agent(), store).engine()
        await engine.start(T, "go", run_id=RunId(run), message_id=meta.message_id(run))
        head = await store.load_head(T)
        assert await stored_run_meta(store, head) == meta
        assert run_meta(await store.load(T)) == meta
