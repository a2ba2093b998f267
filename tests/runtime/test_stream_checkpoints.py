"""Stream checkpoints: each recovery case, and a checkpoint store that raises or hangs."""

from __future__ import annotations

import asyncio

import pytest

from runtime import (
    Agent,
    Crash,
    Engine,
    InProcessRunner,
    LocalToolRunner,
    ModelDelta,
    ModelResponse,
    ToolResultMessage,
    tool,
)
from runtime.checkpoint import SafeCheckpoints
from runtime.errors import ModelRateLimited, ModelUnavailable
from runtime.ids import RunId, ThreadId
from runtime.messages import ContextMessage
from runtime.ports import StreamCheckpoint
from storage.checkpoints import MemoryCheckpointStore
from storage.memory import MemoryCommitStore
from tests.support.waiting import until


@tool
def lookup(key: str) -> str:
    return f"value of {key}"


class InterruptedModel:
    """Streams ``deltas`` for Step 0, then dies the first time; answers normally after."""

    def __init__(self, deltas: list[ModelDelta]) -> None:
        self.deltas = deltas
        self.calls: list[int] = []
        self.contexts: list[list[str]] = []

    async def stream(self, request):
        self.calls.append(request.step)
        self.contexts.append([m.text for m in request.messages if isinstance(m, ContextMessage)])
        if request.step == 0 and len(self.calls) == 1:
            for d in self.deltas:
                yield d
            raise Crash("process died mid-inference")
        if request.step == 0:
            yield ModelResponse(text="fresh answer")
        else:
            yield ModelResponse(text="done")


class BrokenCheckpoints:
    async def get(self, thread):
        raise OSError("checkpoint disk gone")

    put = delete = get


def engine(model, store, checkpoints) -> Engine:
    agent = Agent(name="cp", model=model, tools=[lookup])
    return Engine(
        agent, store, LocalToolRunner([lookup]), checkpoints=checkpoints, checkpoint_interval_s=0
    )


async def run_interrupted(deltas, checkpoints=None):
    checkpoints = checkpoints if checkpoints is not None else MemoryCheckpointStore()
    store = MemoryCommitStore()
    model = InterruptedModel(deltas)
    with pytest.raises(Crash):
        await engine(model, store, checkpoints).start("t", "go")
    f = await engine(model, store, checkpoints).recover("t")
    return f, model, checkpoints


def text(t: str) -> ModelDelta:
    return ModelDelta(text=t)


def args(call_id: str, fragment: str, tool: str | None = "lookup") -> ModelDelta:
    return ModelDelta(type="tool_call_delta", call_id=call_id, tool=tool, text=fragment)


async def test_complete_tool_calls_are_used_without_asking_the_model_again():
    f, model, cps = await run_interrupted(
        [text("Looking "), text("up"), args("c1", '{"key": '), args("c1", '"a"}')]
    )
    assert model.calls == [0, 1]  # step 0 was never asked again
    assert [m.content for m in f.messages if isinstance(m, ToolResultMessage)] == ["value of a"]
    assert f.messages[1].text == "Looking up"
    assert await cps.get("t") is None  # deleted once the Step committed


async def test_a_character_cut_between_deltas_is_one_character_in_the_checkpoint():
    """The halves of a pair a provider cut between chunks (runtime.limits.joined): the
    recovered Step commits the one character, not two halves no store can hold."""
    f, model, _ = await run_interrupted(
        [
            text("smile \ud83d"),
            text("\ude00"),
            args("c1", '{"key": "\ud83d'),
            args("c1", '\ude00"}'),
        ]
    )
    assert model.calls == [0, 1]
    assert f.messages[1].text == "smile \U0001f600"
    assert [m.content for m in f.messages if isinstance(m, ToolResultMessage)] == [
        "value of \U0001f600"
    ]


async def test_text_only_continues_from_it_as_request_only_context():
    f, model, _ = await run_interrupted([text("The answer "), text("is")])
    assert model.calls == [0, 0]
    assert model.contexts[1] and "The answer is" in model.contexts[1][0]
    assert all(m.kind != "context" for m in f.messages)  # never committed
    assert f.messages[-1].text == "fresh answer"


async def test_text_plus_a_broken_call_drops_the_call():
    f, model, _ = await run_interrupted([text("Let me "), args("c1", '{"key": "a')])
    assert model.calls == [0, 0]
    assert "Let me" in model.contexts[1][0]
    assert not any(isinstance(m, ToolResultMessage) for m in f.messages)


async def test_nothing_usable_infers_again():
    f, model, _ = await run_interrupted([args("c1", "{")])
    assert model.calls == [0, 0] and model.contexts[1] == []
    assert f.run_state.cause.kind == "natural"


async def test_a_checkpoint_store_that_raises_never_fails_the_run():
    f, model, _ = await run_interrupted([text("partial")], checkpoints=BrokenCheckpoints())
    assert f.run_state.cause.kind == "natural"
    assert model.calls == [0, 0] and model.contexts[1] == []


async def test_a_run_without_crash_leaves_no_checkpoint():
    cps = MemoryCheckpointStore()
    model = InterruptedModel([])
    model.calls.append(-1)  # skip the simulated death
    f = await engine(model, MemoryCommitStore(), cps).start("t", "go")
    assert f.run_state.cause.kind == "natural"
    assert await cps.get("t") is None
    assert isinstance(InProcessRunner, type)


@pytest.mark.parametrize(
    "deltas",
    [
        [args("c1", "[" * 50_000 + "]" * 50_000)],  # json.loads would recurse too deep
        [args("c1", '{"key": "a"}', tool="\udcff")],  # a tool name no record accepts
    ],
    ids=["deep-arguments", "surrogate-tool"],
)
async def test_a_hostile_checkpoint_is_not_used_and_the_model_is_asked_again(deltas):
    f, model, _ = await run_interrupted(deltas)
    assert model.calls == [0, 0] and f.run_state.cause.kind == "natural"
    assert f.messages[-1].text == "fresh answer"


class HungCheckpoints:
    """A checkpoint server that accepts the connection and never answers."""

    async def get(self, thread):
        await asyncio.Event().wait()

    put = delete = get


async def test_a_hung_checkpoint_store_delays_but_never_stops_a_run():
    hung = SafeCheckpoints(HungCheckpoints(), timeout_s=0.05)
    f, model, _ = await asyncio.wait_for(run_interrupted([text("partial")], checkpoints=hung), 10)
    assert f.run_state.cause.kind == "natural"
    assert model.calls == [0, 0] and model.contexts[1] == []  # nothing was salvaged


class FailingThenDying:
    """Step 0's first attempt streams a complete call, then fails (``failure``); the
    second dies before its first token; asked again after recovery, it answers."""

    def __init__(self, failure: BaseException) -> None:
        self.failure = failure
        self.asked = 0

    async def stream(self, request):
        self.asked += 1
        if self.asked == 1:
            yield args("c1", '{"key": "prod"}')
            raise self.failure
        if self.asked == 2:
            raise Crash("kill -9 before attempt 2's first token")
        yield ModelResponse(text="not looking anything up")


@pytest.mark.parametrize(
    "failure",
    [
        ModelUnavailable("stream_cut", "connection reset"),
        ModelRateLimited("rate", "slow down", retry_after_s=0),
    ],
    ids=["cut", "rate_limited"],
)
async def test_a_failed_attempts_checkpoint_is_never_taken_up_by_a_recovery(failure):
    """The attempt the runtime threw away must not come back through its checkpoint: a
    recovery would commit and run its complete call without the model asked again."""
    ran: list[str] = []

    @tool
    def lookup(key: str) -> str:  # the call the failed attempt streamed
        ran.append(key)
        return key

    model, store = FailingThenDying(failure), MemoryCommitStore()
    checkpoints = MemoryCheckpointStore()
    agent = Agent(name="cp", model=model, tools=[lookup], rate_limit_wait_s=60)
    tools = LocalToolRunner([lookup])

    def fresh() -> Engine:
        return Engine(agent, store, tools, checkpoints=checkpoints, checkpoint_interval_s=0)

    with pytest.raises(Crash):
        await fresh().start("t", "go")
    assert await checkpoints.get("t") is None  # spent with its attempt
    done = await fresh().recover("t")
    assert done.run_state.kind == "ended" and ran == [] and model.asked == 3


class Stoppable:
    """A checkpoint store in memory that can be made to hang (a stopped server), and that
    counts the calls that reach it."""

    def __init__(self) -> None:
        self.inner = MemoryCheckpointStore()
        self.hung = False
        self.reached = 0

    async def _reach(self) -> None:
        self.reached += 1
        if self.hung:
            await asyncio.Event().wait()

    async def get(self, thread):
        await self._reach()
        return await self.inner.get(thread)

    async def put(self, thread, cp):
        await self._reach()
        await self.inner.put(thread, cp)

    async def delete(self, thread):
        await self._reach()
        await self.inner.delete(thread)


def checkpoint(text: str) -> StreamCheckpoint:
    return StreamCheckpoint(run_id=RunId("r"), step=0, text=text)


async def test_a_store_that_stops_answering_is_left_alone_for_a_cool_down():
    """One call waits out its timeout; then, for the cool-down, puts are skipped, gets
    answer None and deletes are owed, none reaching the store; then one call at a time
    tries it again, and once it answers the owed delete is made before anything of that
    thread is served."""
    store = Stoppable()
    safe = SafeCheckpoints(store, timeout_s=0.05, cool_down_s=0.3)
    await safe.put(ThreadId("t"), checkpoint("before"))
    store.hung = True
    await safe.put(ThreadId("t"), checkpoint("timed out"))
    reached = store.reached
    assert safe.cooling()
    await safe.put(ThreadId("t"), checkpoint("skipped"))
    assert await safe.get(ThreadId("t")) is None
    await safe.delete(ThreadId("t"))  # owed
    assert store.reached == reached  # none of the three reached it
    await until(lambda: not safe.cooling(), what="the cool-down to end")
    puts = [safe.put(ThreadId(f"t{i}"), checkpoint("probe")) for i in range(4)]
    await asyncio.gather(*puts)
    assert store.reached == reached + 1  # one tried it (and timed out); the others skipped
    store.hung = False
    await until(lambda: not safe.cooling(), what="the next cool-down to end")
    assert await safe.get(ThreadId("t")) is None  # owed: the delete is made, nothing served
    assert await store.inner.get(ThreadId("t")) is None
    await safe.put(ThreadId("t"), checkpoint("kept"))
    assert await safe.get(ThreadId("t")) == checkpoint("kept")


async def test_a_failed_attempts_delete_that_could_not_be_made_is_not_taken_up():
    """The store hangs as the first attempt fails, so its checkpoint (a complete call)
    cannot be deleted; the next attempt dies. A recovery in the same process, the store
    answering again, must not run the call the runtime threw away."""
    ran: list[str] = []

    @tool
    def lookup(key: str) -> str:
        ran.append(key)
        return key

    store = Stoppable()

    class HangingAsItFails(FailingThenDying):
        async def stream(self, request):
            async for item in super().stream(request):
                yield item
                if self.asked == 1:  # the call is checkpointed: now the store hangs
                    store.hung = True

    model = HangingAsItFails(ModelUnavailable("stream_cut", "connection reset"))
    agent = Agent(name="cp", model=model, tools=[lookup])
    commits = MemoryCommitStore()
    safe = SafeCheckpoints(store, timeout_s=0.05, cool_down_s=0.2)

    def fresh() -> Engine:
        tools = LocalToolRunner([lookup])
        return Engine(agent, commits, tools, checkpoints=safe, checkpoint_interval_s=0)

    with pytest.raises(Crash):
        await fresh().start("t", "go")
    assert await store.inner.get(ThreadId("t")) is not None  # left behind
    store.hung = False
    await until(lambda: not safe.cooling(), what="the cool-down to end")
    done = await fresh().recover("t")
    assert done.run_state.kind == "ended" and ran == [] and model.asked == 3


async def test_an_answer_said_to_be_refused_leaves_no_checkpoint_to_take_up():
    """An adapter that learns the answer is refused (OpenAI ``length`` inside its calls)
    says so before its stream ends, the usage still to come: a process killed then left
    the checkpoint of its complete-looking call, which the recovery ran."""
    from runtime.models import Refusing

    f, model, cps = await run_interrupted(
        [args("c1", '{"key": "a"}'), Refusing(reason="max_tokens"), text("never seen")]
    )
    assert model.calls == [0, 0]  # asked again: the refused call was not taken up
    assert not [m for m in f.messages if isinstance(m, ToolResultMessage)]
    assert await cps.get("t") is None
