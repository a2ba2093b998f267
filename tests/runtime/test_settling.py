"""One settling path (engine docstring): whatever escapes a Step — a hook, a store refusal,
a broken executor — ends the Run with a committed ``failed(kind, code, message)``,
retried until it lands. After ``start`` returns the Run is never left running, and when
it raises a typed error for bad input at the edge nothing at all was written."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from runtime import (
    DEFAULT_LIMITS,
    Agent,
    Command,
    CorruptRecord,
    Crash,
    Engine,
    FaultPlan,
    Hook,
    HookOutput,
    InjectMessage,
    InProcessRunner,
    InputRefused,
    LocalToolRunner,
    ModelResponse,
    ResumeCommand,
    ScriptedModel,
    StoreRetry,
    StoreUnavailable,
    ToolResult,
    ToolResultMessage,
    call,
    tool,
)
from runtime.commit import Frontier, assemble_commit
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import RunningState, Unpause
from runtime.limits import Limits
from runtime.messages import ContextMessage
from runtime.rules import replay
from storage.memory import MemoryCommitStore
from tests.storage.conftest import make_store, pg_conformance_url  # noqa: F401 (a fixture)
from tests.support.waiting import until

POINTS = ("StepStart", "BeforeInference", "AfterInference", "AfterTool", "StepEnd")
FAST = StoreRetry(first_delay_s=0.001, max_delay_s=0.01, give_up_after_s=0.02)


class Boom(Exception):
    """What a hostile hook raises."""


def script() -> ScriptedModel:
    """Step 0 calls a tool (so all five hook points are reached), step 1 answers."""
    return ScriptedModel(
        [ModelResponse(text="calling", tool_calls=(call("keep", "c1"),)), ModelResponse(text="ok")]
    )


@tool
def keep() -> ToolResult:
    """Commits nested state, for hooks that try to change it in place."""
    return ToolResult(content="kept", commands=[Command(key="k", value={"a": [1]})])


def agent(*hooks: Hook, model: Any = None, tools: Sequence[Any] = (keep,)) -> Agent:
    return Agent(name="a", model=model or script(), tools=list(tools), hooks=list(hooks))


async def at_rest(store: Any, thread: str = "t") -> Frontier:
    frontier = await store.load(thread)
    assert frontier.run_state is not None and frontier.run_state.kind in ("ended", "awaiting")
    replayed = replay(frontier.thread_id, [r.commit for r in await store.read(thread)])
    skip = {"epoch", "owner"}
    assert replayed.model_dump(exclude=skip) == frontier.model_dump(exclude=skip)
    return frontier


async def run(a: Agent, store: Any = None, **options: Any) -> tuple[Any, Frontier]:
    store = store if store is not None else MemoryCommitStore()
    await InProcessRunner(a, store, **options).start("go", thread_id="t", run_id="r")
    return store, await at_rest(store)


def failure(frontier: Frontier) -> tuple[str, str]:
    c = frontier.run_state.cause  # type: ignore[union-attr]
    assert c.kind == "failed", c
    assert frontier.status.state == "failed" and frontier.status.reason == c.code
    return c.failure, c.code


# ---- hooks ------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
async def test_a_hook_that_raises_at_any_point_ends_the_run_failed_hook(point):
    def hook(_input: Any) -> None:
        raise Boom(f"hook broke at {point}")

    store, frontier = await run(agent(Hook(point, hook, name="bad")))
    assert failure(frontier) == ("hook", "Boom")
    assert f"bad at {point}" in frontier.run_state.cause.message
    labels = [r.commit.label for r in await store.read("t")]
    assert labels[-1] == "ended" and labels.count("ended") == 1


def nest(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


BAD_OUTPUTS: list[tuple[object, str]] = [
    ({"commands": []}, "TypeError"),
    ("context", "TypeError"),
    (HookOutput(commands=["not a command"]), "InputRefused"),  # type: ignore[list-item]
    (HookOutput(commands=[Command(key="k\n", value=1)]), "InputRefused"),
    (HookOutput(commands=[Command(key="k" * 300, value=1)]), "InputRefused"),
    (HookOutput(commands=[Command(key="k", value="v" * 70_000)]), "InputRefused"),
    (HookOutput(commands=[Command(key="k", value=nest(70))]), "InputRefused"),
    (HookOutput(context=[ContextMessage(text="half \udcff")]), "InputRefused"),
    (HookOutput(context=[ContextMessage(text="x" * 300_000)]), "InputRefused"),
]


@pytest.mark.parametrize(("output", "code"), BAD_OUTPUTS)
@pytest.mark.parametrize("point", ["StepStart", "AfterTool"])
async def test_a_hook_returning_what_cannot_be_committed_ends_the_run_failed_hook(
    point, output, code
):
    _, frontier = await run(agent(Hook(point, lambda _i: output)))
    assert failure(frontier) == ("hook", code)
    assert frontier.state["thread"] in ({}, {"k": {"a": [1]}})  # the hook's commands dropped


MUTATIONS: list[Callable[[Any], object]] = [
    lambda i: i.state["thread"].__setitem__("x", 1),
    lambda i: i.state["thread"].update(x=1),
    lambda i: i.state["thread"].pop("k"),
    lambda i: i.state["thread"].__delitem__("k"),
    lambda i: i.state.clear(),
    lambda i: i.state["run"].setdefault("x", 1),
    lambda i: i.state["thread"]["k"]["a"].append(2),
    lambda i: i.state["thread"]["k"]["a"].__iadd__([2]),
    lambda i: i.state["thread"]["k"]["a"].__setitem__(0, 2),
    lambda i: i.state["thread"]["k"].__ior__({"b": 2}),
]


@pytest.mark.parametrize("mutate", MUTATIONS)
async def test_a_hook_mutating_state_ends_the_run_failed_hook_and_state_is_unchanged(mutate):
    def hook(hook_input: Any) -> None:
        if "k" in hook_input.state["thread"]:  # from step 1 on: the tool's state is there
            mutate(hook_input)

    store, frontier = await run(agent(Hook("StepStart", hook)))
    assert failure(frontier) == ("hook", "TypeError")
    assert frontier.state["thread"] == {"k": {"a": [1]}}
    assert replay(ThreadId("t"), [r.commit for r in await store.read("t")]).state == {
        "thread": {"k": {"a": [1]}},
        "run": {},
    }


@pytest.mark.parametrize(
    ("point", "mutate"),
    [
        ("AfterInference", lambda i: setattr(i.response, "text", "changed")),
        ("AfterTool", lambda i: setattr(i.call, "tool", "other")),
        ("AfterTool", lambda i: setattr(i, "step", 9)),
    ],
)
async def test_a_hook_mutating_what_it_is_shown_ends_the_run_failed_hook(point, mutate):
    _, frontier = await run(agent(Hook(point, mutate)))
    kind, _code = failure(frontier)
    assert kind == "hook" and "changed" not in str(frontier.messages)
    assert [c.tool for m in frontier.messages for c in getattr(m, "tool_calls", ())] in (
        [],
        ["keep"],
    )


async def test_two_hooks_setting_one_exclusive_key_fail_the_second_hook():
    def setter(value: int) -> Hook:
        return Hook("StepStart", lambda _i: HookOutput(commands=[Command(key="x", value=value)]))

    _, frontier = await run(agent(setter(1), setter(2)))
    assert failure(frontier) == ("hook", "StateConflict")
    assert "x" not in frontier.state["thread"]


# ---- a broken executor: our own (or the host's) bug ---------------------------------------


class BrokenTools:
    def __init__(self, answer: Callable[[Sequence[Any]], Any]) -> None:
        self.answer = answer
        self.calls = 0

    async def run(self, invocations: Sequence[Any]) -> list[Any]:
        self.calls += 1
        return self.answer(invocations)  # type: ignore[no-any-return]


def _raise(_invocations: Sequence[Any]) -> list[Any]:
    raise RuntimeError("the executor pool is gone")


@pytest.mark.parametrize(
    ("answer", "code"),
    [(_raise, "RuntimeError"), (lambda inv: [], "ValueError")],
    ids=["raises", "too-few-outcomes"],
)
async def test_a_broken_tool_runner_ends_the_run_failed_internal(answer, code):
    tools = BrokenTools(answer)
    _, frontier = await run(agent(), tools=tools)
    assert failure(frontier) == ("internal", code) and tools.calls == 1
    assert frontier.batch is None  # sealed and finalized with the end


async def test_an_outcome_of_no_known_kind_is_not_taken_for_nothing_dispatched():
    """A never_replay call must not be sent again because the executor answered junk."""
    tools = BrokenTools(lambda inv: [object()])
    _, frontier = await run(agent(), tools=tools)
    assert failure(frontier)[0] == "internal" and tools.calls == 1


# ---- what the store refuses ---------------------------------------------------------------


RESULT = DEFAULT_LIMITS.tool_result_bytes - 768
"""Just under tool_result_bytes: three fit in batch_result_bytes, the fourth does not."""


def big_results(concurrency: str, answer: str = "done") -> Agent:
    @tool(concurrency=concurrency)
    def fill(n: int) -> str:
        return str(n) * RESULT

    calls = tuple(call("fill", f"c{n}", n=n) for n in range(4))
    model = ScriptedModel([ModelResponse(tool_calls=calls), ModelResponse(text=answer)])
    return Agent(name="a", model=model, tools=[fill])


def test_a_store_too_small_for_the_limits_is_refused_before_anything_runs():
    """Every commit a Run can make under its limits must fit the store, or an end could
    be refused for its size: such a pairing is refused when the engine is made."""
    small = MemoryCommitStore(payload_limit=DEFAULT_LIMITS.commit_bytes() - 1)
    with pytest.raises(ValueError, match="payload limit") as info:
        InProcessRunner(big_results("parallel"), small).engine()
    assert str(DEFAULT_LIMITS.commit_bytes()) in str(info.value)


@pytest.mark.parametrize("concurrency", ["parallel", "serial"])
async def test_results_over_the_batch_limit_are_errors_and_every_commit_fits(concurrency):
    """On the smallest store the limits allow, with results as large as they may be and
    the longest answer: the fourth result is over batch_result_bytes (a model-visible
    error naming it), every commit fits, and the Run ends naturally, its results
    published in call order."""
    assert 3 * RESULT <= DEFAULT_LIMITS.batch_result_bytes < 4 * RESULT
    store = MemoryCommitStore(payload_limit=DEFAULT_LIMITS.commit_bytes())
    answer = "a" * DEFAULT_LIMITS.model_text_bytes
    store, frontier = await run(big_results(concurrency, answer), store)
    assert frontier.ended and frontier.run_state.cause.kind == "natural"
    records = await store.read("t")
    assert all(len(r.commit.encoded.encode()) <= store.payload_limit for r in records)
    published = [m for m in frontier.messages if isinstance(m, ToolResultMessage)]
    assert [m.call_id for m in published] == ["c0", "c1", "c2", "c3"]
    assert [m.is_error for m in published] == [False, False, False, True]
    assert "batch_result_bytes" in published[3].content


async def test_a_store_the_limits_allow_takes_an_inference_commit_with_the_hooks_output():
    """On the smallest store these limits allow, a Step's inference commit holding the
    messages its hooks inject (all of ``input_bytes``) and a call whose arguments take
    the rest of the response fits: the Run ends naturally, not failed(store,
    payload_too_large) as when the hooks' output was left out of ``commit_bytes``."""
    limits = Limits(
        tool_calls=1,
        id_chars=64,
        batch_result_bytes=1024,
        tool_result_bytes=1024,
        input_bytes=32 * 1024,
        response_bytes=32 * 1024,
    )
    store = MemoryCommitStore(payload_limit=limits.commit_bytes())

    @tool
    def take(text: str) -> str:
        return "taken"

    def inject(h: Any) -> HookOutput | None:
        if h.step != 0:
            return None
        return HookOutput(reactions=[InjectMessage(text="y" * (limits.input_bytes - 64))])

    big = call("take", "c1", text="x" * (limits.response_bytes - 128))
    model = ScriptedModel([ModelResponse(tool_calls=(big,)), ModelResponse(text="ok")])
    hooks = [Hook("StepStart", inject)]
    a = Agent(name="a", model=model, tools=[take], hooks=hooks)
    store, frontier = await run(a, store, limits=limits)
    assert frontier.run_state.cause.kind == "natural", frontier.run_state.cause
    records = await store.read("t")
    assert max(len(r.commit.encoded.encode()) for r in records) > 2 * limits.response_bytes


class FlakyStore:
    """A real MemoryCommitStore whose availability the test switches: while ``down`` every
    call raises StoreUnavailable; ``lose_reply`` makes the next append land and then fail
    as if its reply was lost on the way."""

    def __init__(self) -> None:
        self.inner = MemoryCommitStore()
        self.down = False
        self.lose_reply = False
        self.refused = 0

    def _gate(self) -> None:
        if self.down:
            self.refused += 1
            raise StoreUnavailable("flaky store is down")

    async def append(self, commit: Any, expected_version: int, epoch: int, **kw: Any) -> Any:
        self._gate()
        receipt = await self.inner.append(commit, expected_version, epoch, **kw)
        if self.lose_reply:
            self.lose_reply = False
            raise StoreUnavailable("the reply was lost")
        return receipt

    async def load(self, thread: ThreadId) -> Frontier:
        self._gate()
        return await self.inner.load(thread)

    async def load_head(self, thread: ThreadId) -> Frontier:
        self._gate()
        return await self.inner.load_head(thread)

    async def read(self, thread: ThreadId, after_seq: int = 0) -> Any:
        self._gate()
        return await self.inner.read(thread, after_seq)

    async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
        self._gate()
        return await self.inner.claim(thread, owner, supersedes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine(a: Agent, store: Any) -> Engine:
    return Engine(a, store, LocalToolRunner(a.tools), store_retry=FAST)


async def test_an_end_committed_while_the_store_is_down_is_retried_until_it_lands(caplog):
    caplog.set_level(logging.WARNING, "ratchet.engine")
    store = FlakyStore()

    def fail_with_the_store(_input: Any) -> None:
        store.down = True
        raise Boom("and the store went down with it")

    e = engine(agent(Hook("AfterInference", fail_with_the_store)), store)
    task = asyncio.create_task(e.start(ThreadId("t"), "go", run_id=RunId("r")))

    def settle_retries() -> int:
        return sum("settling r: store unavailable" in r.getMessage() for r in caplog.records)

    # settling outlasts the drive's own give-up (FAST.give_up_after_s) more than once
    await until(lambda: settle_retries() >= 3)
    assert not task.done() and (await store.inner.load("t")).run_state.kind == "running"
    refused = store.refused
    await until(lambda: store.refused > refused)  # still trying
    store.down = False
    done = await asyncio.wait_for(task, 5)
    assert failure(done) == ("hook", "Boom") and failure(await at_rest(store.inner)) == (
        "hook",
        "Boom",
    )


async def test_an_end_whose_reply_was_lost_lands_once():
    store = FlakyStore()

    def fail_and_lose_the_reply(_input: Any) -> None:
        store.lose_reply = True
        raise Boom("the end's reply will be lost")

    e = engine(agent(Hook("AfterTool", fail_and_lose_the_reply)), store)
    await e.start(ThreadId("t"), "go", run_id=RunId("r"))
    frontier = await at_rest(store.inner)
    assert failure(frontier) == ("hook", "Boom") and not store.lose_reply
    labels = [r.commit.label for r in await store.inner.read("t")]
    assert labels.count("ended") == 1 and labels[-1] == "ended"


# ---- refused at the edge: nothing written, on every SQL backend too ------------------------


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def edge_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    backend = request.param
    url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/edge.db"}.get(backend)
    store = await make_store(backend, url or request.getfixturevalue("pg_conformance_url"))
    yield store
    await store.close()


def greeter() -> Agent:
    return Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))


LONG = "t" * (DEFAULT_LIMITS.id_chars + 1)
EDGE_CASES = [
    ({"text": "bad \udcff text"}, "utf8"),
    ({"text": b"go\xff".decode("utf-8", "surrogateescape")}, "utf8"),
    ({"text": "x" * (DEFAULT_LIMITS.input_bytes + 1)}, "input_bytes"),
    ({"text": "é" * (DEFAULT_LIMITS.input_bytes // 2) + "x"}, "input_bytes"),
    ({"text": None}, "type"),
    ({"thread_id": b"thread-\xff".decode("utf-8", "surrogateescape")}, "utf8"),
    ({"thread_id": "thread\n1"}, "control_chars"),
    ({"thread_id": "thread\x00"}, "control_chars"),
    ({"thread_id": LONG}, "id_chars"),
    ({"run_id": LONG}, "id_chars"),
    ({"run_id": "run-\udcff"}, "utf8"),
    ({"run_id": "run\x7f"}, "control_chars"),
    ({"thread_id": "thread\x9b1m"}, "control_chars"),  # C1: a terminal's CSI
    ({"run_id": "run\x85"}, "control_chars"),
    ({"thread_id": "."}, "dot_segment"),
    ({"thread_id": ".."}, "dot_segment"),
    ({"run_id": ".."}, "dot_segment"),
]


@pytest.mark.parametrize(
    ("bad", "limit"), EDGE_CASES, ids=[c[1] + str(i) for i, c in enumerate(EDGE_CASES)]
)
async def test_bad_input_is_refused_at_the_edge_and_nothing_is_written(edge_store, bad, limit):
    start = {"text": "go", "thread_id": "t", **bad}
    with pytest.raises(InputRefused) as refused:
        await InProcessRunner(greeter(), edge_store).start(start.pop("text"), **start)
    assert refused.value.limit == limit and limit in str(refused.value)
    assert await edge_store.thread_ids() == [] and await edge_store.list_runs() == []
    assert (await edge_store.load("t")).version == 0
    # the store is fine: the largest input that fits is taken
    ok = "é" * (DEFAULT_LIMITS.input_bytes // 2)
    done = await InProcessRunner(greeter(), edge_store).start(
        ok, thread_id="t", run_id="r" * DEFAULT_LIMITS.id_chars
    )
    assert done.run_state.cause.kind == "natural" and done.messages[0].text == ok


async def test_a_resume_naming_an_unstorable_thread_is_refused_before_the_store_is_asked(
    edge_store,
):
    command = ResumeCommand(
        correlation="c", run_id="r", thread_id="t\udcff", payload=Unpause(), call_id=None
    )
    with pytest.raises(InputRefused) as refused:
        await InProcessRunner(greeter(), edge_store).resume(command)
    assert refused.value.limit == "utf8"
    assert await edge_store.thread_ids() == []


# ---- cancellation that nobody asked for ---------------------------------------------------


def cancelled(_input: Any = None) -> Any:
    raise asyncio.CancelledError  # e.g. a library's own timeout, leaking out of user code


class CancelledModel:
    async def stream(self, request: Any) -> Any:
        cancelled()
        yield ModelResponse(text="never")


@tool
def cancelling() -> str:
    return cancelled()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "a",
    [
        agent(model=CancelledModel()),
        agent(
            model=ScriptedModel([ModelResponse(tool_calls=(call("cancelling", "c"),))]),
            tools=[cancelling],
        ),
        agent(Hook("StepStart", cancelled)),
    ],
    ids=["model", "tool", "hook"],
)
async def test_a_cancelled_error_raised_by_user_code_does_not_leave_the_run_running(a):
    store = MemoryCommitStore()
    with contextlib.suppress(asyncio.CancelledError):  # nobody cancelled this task
        await InProcessRunner(a, store).start("go", thread_id="t")
    await at_rest(store)


async def test_an_end_that_landed_while_its_answer_was_lost_is_not_committed_twice(caplog):
    """The end lands, its reply is lost and the store stays out past the drive's give-up:
    the next attempt, stamped later, is another commit, which the store refuses as the
    Run has ended; settling takes that as the end it was after."""
    caplog.set_level(logging.WARNING, "ratchet.engine")

    class LosesTheEnd(FlakyStore):
        async def append(self, commit: Any, expected_version: int, epoch: int, **kw: Any) -> Any:
            self._gate()
            receipt = await self.inner.append(commit, expected_version, epoch, **kw)
            if commit.label == "ended" and not self.refused:
                self.down = True
                raise StoreUnavailable("the reply was lost, and the store with it")
            return receipt

    store = LosesTheEnd()

    def fail(_input: Any) -> None:
        raise Boom("the hook broke")

    e = engine(agent(Hook("AfterInference", fail)), store)
    task = asyncio.create_task(e.start(ThreadId("t"), "go", run_id=RunId("r")))
    await until(
        lambda: any("settling r: store unavailable" in r.getMessage() for r in caplog.records)
    )
    store.down = False
    done = await asyncio.wait_for(task, 5)
    assert failure(done) == ("hook", "Boom")
    ends = [r for r in await store.inner.read(ThreadId("t")) if r.commit.label == "ended"]
    assert len(ends) == 1 and failure(await at_rest(store.inner)) == ("hook", "Boom")


async def test_a_claim_whose_answer_was_lost_is_the_recoverers_own():
    """The claim lands, its answer is lost, the retry is refused as superseded: by this
    very owner's claim, so the recovery goes on instead of giving the Run up."""

    class LosesTheClaim(FlakyStore):
        async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
            claimed = await self.inner.claim(thread, owner, supersedes)
            if not self.refused:
                self.refused += 1
                raise StoreUnavailable("the claim's answer was lost")
            return claimed

    store = LosesTheClaim()
    a = agent()
    crashing = Engine(a, store, LocalToolRunner(a.tools), faults=FaultPlan(("after:inference", 1)))
    with pytest.raises(Crash):
        await crashing.start(ThreadId("t"), "go", run_id=RunId("r"))
    done = await engine(agent(), store).recover(ThreadId("t"))
    assert done.run_state.kind == "ended" and done.run_state.cause.kind == "natural"
    assert store.refused == 1 and (await at_rest(store.inner)).epoch == 2


async def test_records_landed_between_the_verify_and_the_claim_are_verified_too():
    """A recovery verifies the log, then claims at the epoch it read. The owner may have
    committed in between (its epoch did not change): those records are verified before
    the recovery acts on them, so a corrupt one stops it (CorruptRecord)."""

    class CommitsBeforeTheClaim(FlakyStore):
        async def claim(self, thread: ThreadId, owner: str, supersedes: int) -> Frontier:
            f = await self.inner.load(thread)
            assert isinstance(f.run_state, RunningState)
            late = assemble_commit(
                thread_id=thread,
                run_id=f.run_state.run_id,
                ordinal=f.next_ordinal,
                label="status",
                disposition=f.run_state,
                status=f.status,
                prev=f.head,
                epoch=f.epoch,
            )
            await self.inner.append(late, f.version, f.epoch)  # the owner, still at work
            self.inner.corrupt(thread, f.version + 1, "{}")  # and the disk mangles it
            return await self.inner.claim(thread, owner, supersedes)

    store = CommitsBeforeTheClaim()
    a = agent()
    crashing = Engine(a, store, LocalToolRunner(a.tools), faults=FaultPlan(("after:inference", 1)))
    with pytest.raises(Crash):
        await crashing.start(ThreadId("t"), "go", run_id=RunId("r"))
    with pytest.raises(CorruptRecord):
        await engine(agent(), store).recover(ThreadId("t"))
