"""A Step's results commit lands while the next inference runs (``Committing.commit``,
``landing``): the model is asked before the results' receipt is back, nothing after it
is committed or acted on before that receipt, and a results commit that does not land
leaves the Run as if the model had never been asked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime import (
    Agent,
    Engine,
    Hook,
    LocalToolRunner,
    ModelDelta,
    ModelResponse,
    ScriptedModel,
    StoreRetry,
    StoreUnavailable,
    VersionConflict,
    call,
    tool,
)
from runtime.ids import RunId, ThreadId
from runtime.models import InferenceRequest
from storage.checkpoints import MemoryCheckpointStore
from storage.memory import MemoryCommitStore
from storage.sql import SqlCommitStore
from tests.support.waiting import until

FAST = StoreRetry(first_delay_s=0.001, max_delay_s=0.01, give_up_after_s=0.05)


@tool
async def keep() -> str:
    return "kept"


class GatedStore:
    """A real MemoryCommitStore whose ``results`` appends wait for the test to let them
    through (``gate``), or fail while ``refuse`` is set; it counts appends submitted."""

    ordered_appends = False
    """It lets later appends pass a held one: no commit may be queued behind another."""

    def __init__(self) -> None:
        self.inner = MemoryCommitStore()
        self.gate = asyncio.Event()
        self.gate.set()
        self.refuse = False
        self.submitted: list[str] = []
        self.landed = 0
        """Appends the inner store accepted."""
        self.held = 0

    async def append(self, commit: Any, expected_version: int, epoch: int, **kw: Any) -> Any:
        self.submitted.append(commit.label)
        if commit.label == "results":
            if self.refuse:
                raise StoreUnavailable("the store refuses results")
            self.held += 1
            try:
                await self.gate.wait()
            finally:
                self.held -= 1
        receipt = await self.inner.append(commit, expected_version, epoch, **kw)
        self.landed += 1
        return receipt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def watching(store: GatedStore, seen: list[tuple[int, int]]) -> ScriptedModel:
    """Step 0 calls a tool, step 1 answers; each inference notes the stored version and
    how many results appends were held when it was asked."""

    def answer(response: ModelResponse) -> Any:
        def entry(request: InferenceRequest) -> ModelResponse:
            seen.append((store.landed, store.held))
            return response

        return entry

    return ScriptedModel(
        [
            answer(ModelResponse(text="calling", tool_calls=(call("keep", "c1"),))),
            answer(ModelResponse(text="done")),
        ]
    )


def engine(agent: Agent, store: GatedStore) -> Engine:
    return Engine(agent, store, LocalToolRunner(agent.tools), store_retry=FAST)


async def labels(store: GatedStore) -> list[str]:
    return [r.commit.label for r in await store.inner.read(ThreadId("t"))]


async def test_the_next_inference_is_asked_while_the_results_commit_is_on_its_way():
    store, seen = GatedStore(), []
    store.gate.clear()
    agent = Agent(name="a", model=watching(store, seen), tools=[keep])
    e = engine(agent, store)
    assert e.lands_later
    task = asyncio.create_task(e.start(ThreadId("t"), "go", run_id=RunId("r")))
    await until(lambda: len(seen) == 2 and store.held == 1)
    # asked for step 1 before its results landed: the store held the activation and the
    # inference commit of step 0 then, and nothing is submitted past the held results
    assert [landed for landed, _ in seen] == [1, 2]
    for _ in range(20):  # the drive has every chance to commit past the held receipt
        await asyncio.sleep(0)
    assert store.submitted == ["activation", "inference", "results"] and not task.done()
    store.gate.set()
    frontier = await asyncio.wait_for(task, 5)
    assert frontier.run_state.cause.kind == "natural"
    assert await labels(store) == ["activation", "inference", "results", "ended"]


async def test_with_hooks_every_commit_lands_before_the_next_inference():
    store, seen = GatedStore(), []
    agent = Agent(
        name="a", model=watching(store, seen), tools=[keep], hooks=[Hook("StepEnd", lambda _: None)]
    )
    e = engine(agent, store)
    assert not e.lands_later
    frontier = await e.start(ThreadId("t"), "go", run_id=RunId("r"))
    assert frontier.run_state.cause.kind == "natural"
    assert [held for _, held in seen] == [0, 0]
    assert seen[1][0] == seen[0][0] + 2  # the inference and results commits of step 0


async def refused_then_recovered(lands_later: bool) -> tuple[list[str], list[Any]]:
    store, seen = GatedStore(), []
    store.refuse = True
    agent = Agent(name="a", model=watching(store, seen), tools=[keep])
    e = engine(agent, store)
    e.lands_later = lands_later
    with pytest.raises(StoreUnavailable):  # out too long: the drive stops, as ever
        await asyncio.wait_for(e.start(ThreadId("t"), "go", run_id=RunId("r")), 5)
    assert await labels(store) == ["activation", "inference"]
    asked = len(seen)
    store.refuse = False
    frontier = await asyncio.wait_for(engine(agent, store).recover(ThreadId("t")), 5)
    assert frontier.run_state.cause.kind == "natural"
    return await labels(store), [asked, frontier.messages[-1].text]


async def test_a_results_commit_that_does_not_land_leaves_the_answer_uncommitted():
    """The model answered step 1 while its input was being committed; that commit never
    landed, so neither did the answer: what the store holds is what it holds without
    landing, and a recovery goes on from there."""
    later, (asked_later, text_later) = await refused_then_recovered(True)
    now, (asked_now, text_now) = await refused_then_recovered(False)
    assert later == now
    assert (asked_later, asked_now) == (2, 1)  # step 1 was asked only with landing
    assert text_later == text_now == "done"


async def test_a_drive_cancelled_with_a_commit_on_its_way_leaves_no_task_behind():
    store, seen = GatedStore(), []
    store.gate.clear()
    agent = Agent(name="a", model=watching(store, seen), tools=[keep])
    e = engine(agent, store)
    task = asyncio.create_task(e.start(ThreadId("t"), "go", run_id=RunId("r")))
    await until(lambda: len(seen) == 2 and store.held == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: store.held == 0)  # the append on its way was cancelled with it
    assert await labels(store) == ["activation", "inference"]
    store.gate.set()
    frontier = await asyncio.wait_for(engine(agent, store).recover(ThreadId("t")), 5)
    assert frontier.run_state.cause.kind == "natural"
    assert (await labels(store))[:2] == ["activation", "inference"]


class RecordingCheckpoints(MemoryCheckpointStore):
    """A real in-memory checkpoint store that notes each put (step, text, results held)."""

    def __init__(self, store: GatedStore) -> None:
        super().__init__()
        self.store = store
        self.puts: list[tuple[int, str, int]] = []

    async def put(self, thread: ThreadId, checkpoint: Any) -> None:
        self.puts.append((checkpoint.step, checkpoint.text, self.store.held))
        await super().put(thread, checkpoint)


class SlowStreamingModel:
    """Step 0 calls a tool; step 1 streams "a", waits for ``go``, streams "b", answers."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.streamed = 0

    async def stream(self, request: InferenceRequest) -> Any:
        if request.step == 0:
            yield ModelResponse(text="calling", tool_calls=(call("keep", "c1"),))
            return
        yield ModelDelta(text="a")
        self.streamed += 1
        await self.go.wait()
        yield ModelDelta(text="b")
        yield ModelResponse(text="ab")


async def test_no_stream_checkpoint_is_written_before_the_results_it_follows_land():
    """A recovery takes a checkpoint up as the model's answer to what the store holds: one
    written while that Step's input was still on its way could outlive it."""
    store, model = GatedStore(), SlowStreamingModel()
    checkpoints = RecordingCheckpoints(store)
    store.gate.clear()
    agent = Agent(name="a", model=model, tools=[keep])
    e = Engine(
        agent,
        store,
        LocalToolRunner(agent.tools),
        store_retry=FAST,
        checkpoints=checkpoints,
        checkpoint_interval_s=0.0,
    )
    assert e.lands_later
    task = asyncio.create_task(e.start(ThreadId("t"), "go", run_id=RunId("r")))
    await until(lambda: model.streamed == 1 and store.held == 1)
    assert checkpoints.puts == []  # "a" arrived while its input was held
    store.gate.set()
    await until(lambda: store.landed == 3)
    model.go.set()
    frontier = await asyncio.wait_for(task, 5)
    assert frontier.run_state.cause.kind == "natural"
    assert checkpoints.puts == [(1, "ab", 0)]


# ---- a commit queued behind one on its way (``Committing.chains``) ----------------------


def three_steps() -> ScriptedModel:
    return ScriptedModel(
        [
            ModelResponse(text="one", tool_calls=(call("keep", "c1"),)),
            ModelResponse(text="two", tool_calls=(call("keep", "c2"),)),
            ModelResponse(text="done"),
        ]
    )


async def test_a_commit_queued_behind_one_on_its_way_shares_its_group(tmp_path):
    """A Step's results and the next inference commit (or the end) go to one SQLite
    transaction: the group writer finds both queued, in order."""
    store = await SqlCommitStore.connect(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")
    try:
        agent = Agent(name="a", model=three_steps(), tools=[keep])
        e = Engine(agent, store, LocalToolRunner(agent.tools), store_retry=FAST)
        assert store.ordered_appends and e.chains
        frontier = await e.start(ThreadId("t"), "go", run_id=RunId("r"))
        assert frontier.run_state.cause.kind == "natural"
        records = await store.read(ThreadId("t"))
        labels_ = [r.commit.label for r in records]
        assert labels_ == ["activation", "inference", "results", "inference", "results", "ended"]
        # results + inference, results + ended: two groups of two
        assert (store.appends, store.groups) == (6, 4)
        assert frontier == await store.load(ThreadId("t"))
    finally:
        await store.close()


class BlinkingStore(GatedStore):
    """The first results append fails before it is written (a group that failed as a
    whole); appends refused as out of order are counted. Requests keep their order, as
    in a group writer's queue: a retry is a new request."""

    ordered_appends = True

    def __init__(self) -> None:
        super().__init__()
        self.blinked = False
        self.out_of_order = 0

    async def append(self, commit: Any, expected_version: int, epoch: int, **kw: Any) -> Any:
        if commit.label == "results" and not self.blinked:
            self.blinked = True
            raise StoreUnavailable("a blink")
        try:
            return await super().append(commit, expected_version, epoch, **kw)
        except VersionConflict:
            self.out_of_order += 1
            raise


async def test_a_commit_refused_while_the_one_before_it_was_retried_is_asked_again():
    store = BlinkingStore()
    agent = Agent(name="a", model=three_steps(), tools=[keep])
    e = engine(agent, store)
    assert e.chains
    frontier = await asyncio.wait_for(e.start(ThreadId("t"), "go", run_id=RunId("r")), 5)
    assert frontier.run_state.cause.kind == "natural"
    assert store.out_of_order == 1  # the inference commit arrived before the retried results
    assert await labels(store) == [
        "activation", "inference", "results", "inference", "results", "ended"
    ]  # fmt: skip
