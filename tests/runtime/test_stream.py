"""The thread stream: status frames, committed facts after a cursor, live deltas, reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.ownership import mark_lost
from runtime import (
    Agent,
    Crash,
    Delta,
    Fact,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    call,
    tool,
)
from runtime.ids import RunId
from runtime.rules import stamp_facts
from runtime.stream import Frame, LiveText, follow, from_fact, parse_offset
from storage.bus import EmbeddedBus
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

from .agents import Ledger, crash_matrix_agent
from .test_waits_and_control import command_for


async def frames(store, thread, after=None, bus=None):
    return [f async for f in follow(store, thread, after, bus=bus)]


def statuses(fs) -> list[tuple[str, str | None]]:
    return [(f.status.state, f.status.reason) for f in fs if f.type == "thread_status"]


async def test_status_frames_for_a_run_that_awaits_resumes_and_ends():
    @tool(needs_permission=True)
    def risky(x: int) -> str:
        return "ran"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("risky", "c1", x=1),)), ModelResponse(text="done")]
    )
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[risky]), store)
    f = await runner.start("go", thread_id="t")
    first = await frames(store, "t")
    assert first[0].type == "thread_status"  # the snapshot comes first
    assert first[-1].event.type == "awaiting"  # stops at rest
    await runner.resume(command_for(f, PermissionDecision(approve=True)))
    # reconnect after the last offset seen: only what is new, then stop at the end
    rest = await frames(store, "t", after=first[-1].offset)
    assert statuses(first)[1:] == [("running", None), ("idle", "awaiting_permission")]
    assert statuses(rest)[1:] == [("running", None), ("idle", "natural")]
    assert rest[-1].event.type == "run_finished"
    offsets = [parse_offset(x.offset) for x in first + rest if x.offset]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


async def test_status_frames_for_a_run_that_fails():
    model = ScriptedModel([ModelResponse(tool_calls=(call("nope", "c"),))])  # then exhausted
    store = MemoryCommitStore()
    await InProcessRunner(Agent(name="a", model=model), store).start("go", thread_id="t")
    fs = await frames(store, "t")
    assert statuses(fs)[1:] == [("running", None), ("failed", "ScriptExhausted")]
    assert fs[-1].event.type == "run_failed"


async def test_status_frames_for_a_run_whose_host_is_lost():
    store = MemoryCommitStore()
    runner = InProcessRunner(crash_matrix_agent(Ledger()), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("after:results", 1)))
    lost = (await store.load("t")).owner
    assert await mark_lost(store, "t", "supervisor", lost_owner=lost)
    await runner.recover("t")
    fs = await frames(store, "t")
    assert statuses(fs)[1:] == [
        ("running", None),
        ("failed", "execution_lost"),
        ("running", None),
        ("idle", "natural"),
    ]


def gated(gate: asyncio.Event) -> Any:
    """A tool ``slow`` that answers once ``gate`` is set."""

    @tool
    async def slow(x: int) -> str:
        await gate.wait()
        return "ok"

    return slow


async def test_live_deltas_and_facts_arrive_through_the_bus():
    bus = EmbeddedBus()
    store = MemoryCommitStore()
    gate = asyncio.Event()

    slow = gated(gate)

    model = ScriptedModel(
        [
            ModelResponse(text="working on it", tool_calls=(call("slow", "c", x=1),)),
            ModelResponse(text="all done now"),
        ]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), store, bus=bus)
    task = asyncio.create_task(runner.start("go", thread_id="t", run_id="r"))
    seen = []

    async def watch():
        async for frame in follow(store, "t", bus=bus):
            seen.append(frame)
            if frame.type == "fact" and frame.event.type == "tool_call":
                gate.set()

    await asyncio.wait_for(asyncio.gather(watch(), task), timeout=10)
    text = LiveText()
    for frame in seen:
        if frame.type == "delta":
            text.add(frame.event)
    assert text.text("r", 1) == "all done now"
    facts = [f.event.type for f in seen if f.type == "fact"]
    assert facts[-1] == "run_finished" and "tool_result" in facts
    fact_offsets = [f.offset for f in seen if f.offset]
    assert len(fact_offsets) == len(set(fact_offsets))  # no fact twice (store, then bus)


async def test_reconnect_after_a_crash_loses_no_fact_and_duplicates_none():
    store, bus = MemoryCommitStore(), EmbeddedBus()
    clean_store = MemoryCommitStore()
    await InProcessRunner(crash_matrix_agent(Ledger()), clean_store).start(
        "go", thread_id="t", run_id="r"
    )
    runner = InProcessRunner(crash_matrix_agent(Ledger()), store, bus=bus)
    with pytest.raises(Crash):
        await runner.start(
            "go", thread_id="t", run_id="r", faults=FaultPlan(crash_at=("before:executing", 2))
        )
    # a client was following when the host died: it saw every fact committed so far
    last = max((r.seq, len(r.commit.facts) - 1) for r in await store.read("t") if r.commit.facts)
    before = []
    async for frame in follow(store, "t", bus=bus, until_rest=False):
        before.append(frame)
        if frame.offset and parse_offset(frame.offset) == last:
            break
    await runner.recover("t")
    after = await frames(store, "t", after=before[-1].offset, bus=bus)
    got = [(f.event.type, f.event.data.get("call_id")) for f in before + after if f.type == "fact"]
    want = [
        (f.event.type, f.event.data.get("call_id"))
        for f in await frames(clean_store, "t")
        if f.type == "fact"
    ]
    assert got == want


def test_retried_inference_replaces_partial_text():
    text = LiveText()
    run = RunId("r")
    text.add(Delta(type="text_delta", run_id=run, step=0, attempt=1, text="Hel"))
    text.add(Delta(type="text_delta", run_id=run, step=0, attempt=2, text="Hello"))
    text.add(Delta(type="text_delta", run_id=run, step=0, attempt=1, text="lo"))  # late
    text.add(Delta(type="text_delta", run_id=run, step=0, attempt=2, text=" world"))
    assert text.text("r", 0) == "Hello world"
    text.add(Delta(type="text_delta", run_id=run, step=1, attempt=1, text="smile \ud83d"))
    text.add(Delta(type="text_delta", run_id=run, step=1, attempt=1, text="\ude00"))
    assert text.text("r", 1) == "smile \U0001f600"  # an emoji cut between two deltas


def test_a_malformed_offset_is_a_clear_error():
    with pytest.raises(ValueError, match="SEQ:INDEX"):
        parse_offset("yesterday")


async def test_a_cursor_past_the_threads_last_commit_is_a_clear_error():
    """A thread's version only grows: a cursor past it (another thread's, a fork's with
    fewer commits) would have a stream of a running Run wait for facts it is never
    after, so it is refused before anything is streamed."""
    store = MemoryCommitStore()
    agent = Agent(name="once", model=ScriptedModel([ModelResponse(text="done")]))
    f = await InProcessRunner(agent, store).start("go", thread_id="t-past")
    assert [x.type for x in await frames(store, f.thread_id, f"{f.version}:0")]
    with pytest.raises(ValueError, match="past the thread's last commit"):
        await frames(store, f.thread_id, f"{f.version + 1}:0")


async def test_a_fact_only_the_bus_holds_is_never_served():
    """Anyone who can publish on the bus (a stray process, a hostile client of Redis)
    can announce facts: the stream serves the store's, so a forged one never reaches a
    follower, not even a forged end that would make it stop."""
    bus, store = EmbeddedBus(), MemoryCommitStore()
    gate = asyncio.Event()

    @tool
    async def slow() -> str:
        await gate.wait()
        return "ok"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("slow", "c"),)), ModelResponse(text="all done")]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), store, bus=bus)
    task = asyncio.create_task(runner.start("go", thread_id="t", run_id="r"))
    seen = []

    async def watch():
        async for frame in follow(store, "t", bus=bus):
            seen.append(frame)
            if frame.type == "fact" and frame.event.type == "tool_call":
                forged = [
                    Fact(type=kind, run_id=RunId("r"), seq=90 + i, index=0, data={"forged": 1})
                    for i, kind in enumerate(("tool_result", "run_finished"))
                ]
                await bus.publish("t", forged)
                gate.set()

    await asyncio.wait_for(asyncio.gather(watch(), task), timeout=10)
    served = [f.event for f in seen if f.type == "fact"]
    assert not any(fact.data.get("forged") for fact in served)
    stored = [f.event for f in await frames(store, "t") if f.type == "fact"]
    assert [(f.seq, f.index, f.type) for f in served] == [(f.seq, f.index, f.type) for f in stored]


async def test_deltas_keep_their_place_among_facts_the_store_already_holds():
    """The bus announces facts after their commits land, and an inference's deltas can be
    published after the next commit has landed too: the stream serves the store's facts
    up to the commit announced, not past it, so a delta stays before the facts the bus
    put after it (a reader that voids uncommitted text on a new execution relies on it)."""
    bus, store = EmbeddedBus(), MemoryCommitStore()
    entered, gate = asyncio.Event(), asyncio.Event()

    @tool
    async def slow() -> str:
        entered.set()
        await gate.wait()
        return "ok"

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("slow", "c"),)),
            ModelResponse(tool_calls=(call("slow", "c2"),)),  # a later commit, at least
            ModelResponse(text="all done"),
        ]
    )
    # the runner publishes nothing: the test plays the bus, in its own order
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), store)
    task = asyncio.create_task(runner.start("go", thread_id="t", run_id="r"))

    async def stored() -> list[Frame]:
        records = await store.read("t")
        return [from_fact(f) for r in records for f in stamp_facts(r.commit, r.seq)]

    await asyncio.wait_for(entered.wait(), 10)  # the Run waits in its tool
    mark = (await stored())[-1].offset
    counted = _ReadsCounted(store)
    following = asyncio.create_task(frames(counted, "t", after=mark, bus=bus))
    await until(lambda: "t" in bus._rings and bus._rings["t"].subscribers == 1)
    gate.set()
    await task  # every later commit has landed before the bus says a word
    later = [f.event for f in await stored() if parse_offset(f.offset) > parse_offset(mark)]
    # a commit's facts are offered to the bus together: the delta comes after the first
    # commit's, before the next commit's (as an inference's, published late, can)
    first = [f for f in later if f.seq == later[0].seq]
    assert len(first) < len(later)
    delta = Delta(type="text_delta", run_id=RunId("r"), step=1, attempt=0, text="x")
    reads_before = counted.reads
    await bus.publish("t", [*first, delta, *later[len(first) :]])
    served = await asyncio.wait_for(following, 10)
    # one store read per commit announced, not one per fact (each costs every follower)
    assert counted.reads - reads_before <= len({f.seq for f in later})
    shape = [False] * len(first) + [True] + [False] * (len(later) - len(first))
    assert [f.type == "delta" for f in served[1:]] == shape
    assert [f.event for f in served[1:] if f.type != "delta"] == later


class _LoadedBefore:
    """A store whose first ``load`` answers the frontier as it was before the commits
    that landed since (a follower's load, then another client's resume)."""

    def __init__(self, inner, earlier) -> None:
        self.inner, self.earlier = inner, earlier

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def load(self, thread):
        earlier, self.earlier = self.earlier, None
        return earlier if earlier is not None else await self.inner.load(thread)


async def test_a_resume_that_lands_between_the_load_and_the_read_does_not_end_the_stream():
    """The follower loads the thread awaiting; a resume lands before it reads the log.
    The facts it reads are past that frontier, so the frontier no longer says the Run
    rests: the stream goes on to the Run's real rest."""
    from tests.storage.test_integrity import make_victim

    store = MemoryCommitStore()
    victim = await make_victim(store)
    with pytest.raises(Crash):  # the resume lands, its driver dies before the next commit
        await victim.runner(store).resume(
            victim.approval(), faults=FaultPlan(crash_at=("after:resume", 1))
        )
    seen: list[Frame] = []

    async def follower() -> None:
        stream = follow(_LoadedBefore(store, victim.frontier), victim.thread, poll_s=0.01)
        async for frame in stream:
            seen.append(frame)

    task = asyncio.ensure_future(follower())
    await until(lambda: any(f.event is not None and f.event.seq == 6 for f in seen) or task.done())
    assert not task.done(), [f.event.type for f in seen if f.event is not None]
    await victim.runner(store).recover(victim.thread)
    await asyncio.wait_for(task, 10)
    assert seen[-1].event.type == "run_finished"


class _ReadsHeld:
    """The store as a follower sees it, its reads held while ``open`` is clear."""

    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner = inner
        self.open = asyncio.Event()
        self.open.set()

    async def read(self, thread, after_seq=0):
        await self.open.wait()
        return await self.inner.read(thread, after_seq)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("with_bus", [False, True], ids=["polling", "quiet-bus"])
async def test_a_run_pruned_as_it_ends_ends_the_stream_with_its_status(with_bus: bool):
    """The Run ends and its whole log is pruned before the follower reads its end: the
    store keeps only the frontier, so the stream ends with the status it keeps (it
    waited for facts that no longer exist), told first that they were pruned."""
    gate = asyncio.Event()

    slow = gated(gate)

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("slow", "c1", x=1),)), ModelResponse(text="done")]
    )
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), store)
    started = asyncio.ensure_future(runner.start("go", thread_id="t"))
    seen: list[Frame] = []
    held = _ReadsHeld(store)

    async def follower() -> None:
        bus = EmbeddedBus() if with_bus else None  # a bus nobody publishes to
        async for frame in follow(held, "t", bus=bus, poll_s=0.01, idle_check_s=0.2):
            seen.append(frame)

    task = asyncio.ensure_future(follower())
    await until(lambda: any(f.event is not None and f.event.type == "tool_call" for f in seen))
    held.open.clear()
    gate.set()
    ended = await started
    assert await store.prune("t", ended.version) == ended.version
    held.open.set()
    await asyncio.wait_for(task, 10)
    assert seen[-1].type == "thread_status" and seen[-1].status == ended.status
    assert not any(f.event is not None and f.event.type == "run_finished" for f in seen)
    # told that the facts it waited for were pruned: no silent end
    assert (seen[-2].type, seen[-2].pruned_through) == ("pruned", ended.version)


async def test_a_follower_ends_at_the_rest_of_the_run_it_loaded_not_a_later_one():
    """The follower loads the thread while its Run runs; before it reads the log, that
    Run ends and the thread's next Run starts. The stream ends at the first Run's rest,
    not at the next Run's (which may be hours away)."""
    store = MemoryCommitStore()
    runner = InProcessRunner(
        Agent(name="a", model=ScriptedModel([ModelResponse(text="ok")] * 2)), store
    )
    with pytest.raises(Crash):  # the first Run is running (its driver died)
        await runner.start("one", thread_id="t", faults=FaultPlan(crash_at=("after:activation", 1)))
    running = await store.load("t")
    first = await runner.recover("t")
    assert first.run_state.kind == "ended"
    with pytest.raises(Crash):  # the next Run started, and runs on
        await runner.start("two", thread_id="t", faults=FaultPlan(crash_at=("after:activation", 1)))
    stream = follow(_LoadedBefore(store, running), "t", poll_s=0.01)
    frames = await asyncio.wait_for(_all(stream), 10)
    assert frames[-1].event.type == "run_finished" and frames[-1].event.run_id == first.run_id


async def _all(stream) -> list[Frame]:
    return [frame async for frame in stream]


class _ReadsCounted:
    def __init__(self, inner: MemoryCommitStore) -> None:
        self.inner, self.reads = inner, 0

    async def read(self, thread, after_seq=0):
        self.reads += 1
        return await self.inner.read(thread, after_seq)

    def __getattr__(self, name):
        return getattr(self.inner, name)
