"""The engine's fast paths give exactly what the plain, validated paths give.

Canonical JSON via orjson, commits assembled from trusted records, records built or
changed without validation, the remembered fold, and racing work against the
cancellation signal in the calling task.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
from typing import Any

import pytest
from pydantic import ValidationError

from runtime import (
    Agent,
    Command,
    HookOutput,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    ThreadCommit,
    ToolOutput,
    call,
    tool,
)
from runtime.base import canonical_json, evolve, is_plain, trusted
from runtime.batch import ActiveToolBatch, CallSpec, complete, mark_executing, open_batch
from runtime.commit import Frontier, assemble_commit
from runtime.events import Fact
from runtime.facts import facts_of
from runtime.hooks import Hook
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    ExternalResult,
    Failed,
    Natural,
    PermissionDecision,
    ResumeCommand,
    ResumeTicket,
    RunningState,
    ThreadStatus,
    ToolWaitTarget,
    UserInput,
    answer,
)
from runtime.messages import AssistantMessage, ToolResultMessage, ToolUse, UserMessage
from runtime.ports import ToolInvocation
from runtime.rules import _KEPT, KEPT_FOLDS, _fold, advance, replay
from runtime.signals import CancelledSignal, CancelSignal, guarded
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

from .agents import Ledger, crash_matrix_agent

R, T = RunId("r"), ThreadId("t")


def reference_json(data: Any) -> str:
    """The definition every stored hash was taken over."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def reference(commit: ThreadCommit) -> str:
    return reference_json(commit.model_dump(mode="json"))


UNICODE = 'héllo wörld ✓ 😀 "quoted" back\\slash \n\t\u2028\u2029\x00\x1f\x7f'


def a_batch() -> ActiveToolBatch:
    specs = [
        CallSpec(call_id=CallId("c1"), tool="t", arguments='{"q": "é"}'),
        CallSpec(call_id=CallId("c2"), tool="t", arguments="{}"),
    ]
    batch = mark_executing(open_batch(R, 0, specs), CallId("c1"))
    return complete(batch, CallId("c2"), ToolOutput(content=UNICODE))


def commits() -> list[ThreadCommit]:
    """Commits of every shape: unicode text, nested state, floats and ints, every
    disposition, a batch with calls in several phases, every kind of fact."""
    ticket = ResumeTicket(
        correlation=CorrelationId("x:permission"),
        run_id=R,
        thread_id=T,
        deadline_us=2**62,
        target=ToolWaitTarget(wait="permission", call_id=CallId("c1"), tool="t", arguments="{}"),
    )
    plain_state = {"nested": {"list": [1, 2, {"é": None}], "flag": True}, "big": 2**63 - 1}
    floats = {"f": 1.5, "small": 1e-05, "tiny": 8.4e-06, "huge": 1e16, "ints": [0, -1]}
    assistant = AssistantMessage(
        text=UNICODE, tool_calls=(ToolUse(call_id=CallId("c1"), tool="t", arguments="{}"),)
    )
    result = ToolResultMessage(call_id=CallId("c1"), tool="t", content=UNICODE, is_error=True)
    status = ThreadStatus(state="running", since=123, reason=None)
    parts: list[dict[str, Any]] = [
        {
            "label": "activation",
            "disposition": RunningState(run_id=R),
            "messages": (UserMessage(id="m", text=UNICODE),),
            "commands": (Command(key="ü", value=plain_state),),
            "status": status,
        },
        {
            "label": "inference",
            "disposition": RunningState(run_id=R),
            "messages": (result, assistant),
            "commands": (Command(key="k", merge="disjoint", value=floats),),
            "batch": a_batch(),
        },
        {
            "label": "awaiting",
            "disposition": AwaitingState(run_id=R, ticket=ticket),
            "status": ThreadStatus(state="idle", since=5, reason="awaiting_permission"),
        },
        {
            "label": "ended",
            "disposition": EndedState(run_id=R, cause=Natural()),
            "messages": (assistant,),
            "commands": (Command(key="n", merge="commutative", value=2**70),),
        },
        {
            "label": "ended",
            "disposition": EndedState(
                run_id=R, cause=Failed(failure="inference", code="E", message=UNICODE)
            ),
            "commands": (Command(key="nan", value=float("nan")),),
        },
    ]
    built = []
    for ordinal, p in enumerate(parts):
        # schema 3 stores only the facts not derived from the commit (``facts`` has all)
        resumed = Fact(type="resumed", run_id=R, data={"x": 0.1, "y": [1e-07]})
        built.append(ThreadCommit(thread_id=T, run_id=R, ordinal=ordinal, events=(resumed,), **p))
    return built


# ---- canonical JSON -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        {"b": 1, "a": [True, False, None], "é": UNICODE, "z": {"y": "x", "😀": 2**63 - 1}},
        {"\uffff": 1, "😀": 2, "a": 3, "é": 4, "Z": 5, "": 6},  # code point order
        {"floats": [1e-05, 8.4e-06, 0.1, 1e16, 1e22, -0.0, 5e-324, 1.0]},
        {"big": 2**64, "neg": -(2**70)},  # beyond orjson's integers
        {"nan": float("nan"), "inf": float("inf")},
        {"lone": "\ud800"},
        {1: "int key", "s": "str"},
        [UNICODE, (1, 2), [{"k": None}]],
        "plain text",
        3,
    ],
)
def test_canonical_json_is_the_reference_text(data: Any):
    try:
        expected = reference_json(data)
    except Exception as exc:  # whatever the reference refuses, canonical_json refuses too
        with pytest.raises(type(exc)):
            canonical_json(data)
        return
    assert canonical_json(data) == expected
    if is_plain(data):  # what orjson refuses (big ints, int keys) takes the reference path
        assert canonical_json(data, plain=True) == expected


def test_is_plain_accepts_only_what_both_encoders_agree_on():
    assert is_plain({"a": [1, "x", None, True, {"b": (2,)}]})
    assert not is_plain({"a": [1, {"b": 1.0}]})
    assert not is_plain({"when": object()})


@pytest.mark.parametrize("index", range(5))
def test_commit_encoding_is_the_reference_text_and_its_hash(index: int):
    commit = commits()[index]
    assert commit.encoded == reference(commit)
    assert commit.payload_hash == hashlib.sha256(reference(commit).encode()).hexdigest()
    decoded = ThreadCommit.model_validate_json(commit.encoded)
    assert decoded.encoded == commit.encoded


def _has_number(schema: Any) -> bool:
    if isinstance(schema, dict):
        if schema.get("type") == "number":
            return True
        return any(_has_number(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_number(v) for v in schema)
    return False


def test_typed_fields_hold_no_floats():
    """The encoder looks for floats only in the free-form parts (command values, fact
    data), and engine-made facts only hold dumps of these records: none has a float."""
    for record in (ThreadCommit, ResumeTicket, ResumeCommand, ThreadStatus, EndedState):
        assert not _has_number(record.model_json_schema()), record.__name__


def test_a_tool_results_fields_are_its_json_dump():
    message = ToolResultMessage(call_id=CallId("c"), tool="t", content=UNICODE, is_error=True)
    (fact,) = facts_of(R, "results", (message,), None, RunningState(run_id=R))
    assert fact.data == message.model_dump(mode="json")


# ---- assembled commits ----------------------------------------------------------------


def _parts(commit: ThreadCommit) -> dict[str, Any]:
    """assemble_commit's arguments for ``commit`` (its stored facts are the extra ones)."""
    parts = {name: getattr(commit, name) for name in commit.model_fields_set - {"events"}}
    derived = facts_of(R, commit.label, commit.messages, commit.status, commit.disposition)
    assert commit.facts == (*derived, *commit.events)
    return {**parts, "extra_facts": commit.events}


@pytest.mark.parametrize("index", range(5))
def test_an_assembled_commit_is_the_validated_commit(index: int):
    commit = commits()[index]
    assembled = assemble_commit(**_parts(commit))
    assert assembled == commit
    assert assembled.encoded == commit.encoded == reference(commit)


def test_assembling_checks_what_the_constructor_checks():
    good = _parts(commits()[3])
    with pytest.raises(ValueError, match="label"):
        assemble_commit(**{**good, "label": "nonsense"})
    with pytest.raises(ValueError, match="negative"):
        assemble_commit(**{**good, "ordinal": -1})
    with pytest.raises(ValueError, match="assistant output"):
        assemble_commit(**{**good, "messages": ()})
    with pytest.raises(ValueError, match="another run"):
        assemble_commit(**{**good, "disposition": RunningState(run_id=RunId("other"))})
    open_b = a_batch()
    with pytest.raises(ValueError, match="sealed and finalized"):
        assemble_commit(**{**good, "batch": open_b})
    broken = ActiveToolBatch.model_construct(**{**open_b.__dict__, "calls": ()})
    with pytest.raises(ValueError, match="at least one call"):
        assemble_commit(**{**good, "disposition": RunningState(run_id=R), "batch": broken})


def test_commands_that_are_not_commands_yet_are_validated_as_the_constructor_would():
    parts = {**_parts(commits()[0]), "commands": ({"key": "k", "value": 1},)}
    assembled = assemble_commit(**parts)
    extra = parts.pop("extra_facts")
    assert assembled == ThreadCommit(**parts, events=extra)
    assert isinstance(assembled.commands[0], Command)
    with pytest.raises(ValueError):
        assemble_commit(**{**parts, "commands": ({"key": "k", "merge": "disjoint", "value": 1},)})


async def test_every_commit_a_run_makes_is_the_validated_commit_encoded_canonically():
    """Runs with hooks, state commands, tool results, waits and resumes: each commit the
    engine assembles equals the commit validated from its dump, encoded to the reference."""
    seen: list[ThreadCommit] = []

    class Recording(MemoryCommitStore):
        async def append(
            self, commit: ThreadCommit, expected_version: int, epoch: int, **claim: Any
        ) -> Any:
            seen.append(commit)
            return await super().append(commit, expected_version, epoch, **claim)

    @tool(needs_permission=True)
    def wire(amount: float) -> str:
        return f"sent {amount}"

    hook = Hook(
        point="StepStart",
        fn=lambda i: HookOutput(commands=(Command(key="n", value=0.5),)),
    )
    model = ScriptedModel(
        [ModelResponse(text="ü", tool_calls=(call("wire", "w", amount=1e-05),)), ModelResponse()]
    )
    store = Recording()
    agent = Agent(name="a", model=model, tools=[wire], hooks=[hook])
    runner = InProcessRunner(agent, store)
    waiting = await runner.start("héllo", thread_id="t")
    assert isinstance(waiting.run_state, AwaitingState)
    await runner.resume(answer(waiting.run_state.ticket, PermissionDecision(approve=True)))
    await InProcessRunner(crash_matrix_agent(Ledger()), store).start("go", thread_id="u")
    assert len(seen) > 10
    for commit in seen:
        validated = ThreadCommit.model_validate(commit.model_dump())
        assert commit == validated
        assert commit.encoded == validated.encoded == reference(commit)
    stored = [r.commit for t in ("t", "u") for r in await store.read(ThreadId(t))]
    assert [c.encoded for c in stored] == [c.encoded for c in seen]


def test_resume_payload_facts_are_plain():
    for payload in (
        PermissionDecision(approve=False, note=UNICODE),
        ExternalResult(output=ToolOutput(content="x", is_error=True)),
        UserInput(text=UNICODE),
    ):
        assert is_plain(payload.model_dump(mode="json"))


# ---- records built or changed without validation --------------------------------------


def test_trusted_is_the_validated_constructor():
    made = trusted(Fact, type="status", run_id=R, data={"a": 1})
    assert made == Fact(type="status", run_id=R, data={"a": 1})
    assert made.model_fields_set == {"type", "run_id", "data"}
    assert repr(made) == repr(Fact(type="status", run_id=R, data={"a": 1}))
    with pytest.raises(TypeError, match="missing"):
        trusted(Fact, type="status", run_id=R)  # data has a mutable default: give it
    with pytest.raises(TypeError, match="unknown"):
        trusted(Fact, type="status", run_id=R, data={}, extra=1)
    with pytest.raises(ValidationError, match="frozen"):
        made.seq = 3  # type: ignore[misc]


def test_evolve_is_model_copy_and_drops_cached_values():
    commit = commits()[0]
    assert commit.encoded  # cached in __dict__
    changed = evolve(commit, ordinal=9)
    assert changed == commit.model_copy(update={"ordinal": 9})
    assert "encoded" not in changed.__dict__ and changed.encoded == reference(changed)
    assert changed.model_fields_set == commit.model_fields_set | {"ordinal"}
    with pytest.raises(TypeError, match="no field"):
        evolve(commit, nope=1)


def test_the_remembered_fold_is_the_fold():
    history = commits()[:3]
    frontier = replay(T, history[:1])
    again = Frontier.model_validate(frontier.model_dump())  # equal, not the same object
    first = advance(frontier, history[1], keep=True)  # the engine's fold
    assert advance(frontier, history[1]) is first  # the store's second fold is free
    assert advance(again, history[1]) == first == _fold(frontier, history[1])
    # kept until its store's fold, whatever other folds came between
    _KEPT.clear()
    first = advance(again, history[1], keep=True)
    for _ in range(KEPT_FOLDS - 1):  # other Runs' commits on their way
        advance(frontier, evolve(history[1]), keep=True)
    assert advance(again, history[1]) is first
    _KEPT.clear()


def test_folds_kept_are_few_and_each_taken_once():
    history = commits()[:2]
    frontier = replay(T, history[:1])
    for _ in range(KEPT_FOLDS + 5):  # refused before the store's fold, say
        advance(frontier, evolve(history[1]), keep=True)
    assert len(_KEPT) == KEPT_FOLDS
    _KEPT.clear()
    first = advance(frontier, history[1], keep=True)
    assert advance(frontier, history[1]) is first
    assert not _KEPT  # the store's fold took it: a retried append folds again
    assert advance(frontier, history[1]) is not first


def test_the_remembered_fold_of_a_head_only_frontier_is_not_the_whole_one_s():
    """A store folds onto the head it keeps (no messages), the engine onto the whole
    frontier: one identity to the chain, two frontiers. The engine given the head's
    fold went on without the thread's history."""
    from runtime.commit import head_only

    history = commits()[:3]
    whole = replay(T, history[:2])
    head = head_only(whole)
    assert whole.messages and not head.messages
    kept = advance(head, history[2])  # the store's fold first
    assert advance(whole, history[2]) == _fold(whole, history[2]) != kept
    # the engine's first, then the store's: a head stays a head (its cache held whole
    # histories), at the cost of no second fold
    assert advance(head, history[2]) == _fold(head, history[2]) == kept


# ---- the cancellation race ------------------------------------------------------------


async def test_guarded_work_returns_its_result():
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await guarded(CancelSignal(), work()) == 7


async def test_the_signal_unwinds_the_work_and_leaves_the_task_usable():
    signal, unwound = CancelSignal(), asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            unwound.set()

    asyncio.get_running_loop().call_later(0.01, signal.set)
    with pytest.raises(CancelledSignal):
        await guarded(signal, work())
    assert unwound.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation left pending on this task


async def test_a_set_signal_still_lets_work_that_does_not_wait_finish():
    signal = CancelSignal()
    signal.set()

    async def instant() -> str:
        return "done"

    assert await guarded(signal, instant()) == "done"
    await asyncio.sleep(0.01)  # the pending interrupt was withdrawn
    with pytest.raises(CancelledSignal):
        await guarded(signal, asyncio.sleep(1))


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    waiting = asyncio.Event()

    async def wait_forever() -> None:
        waiting.set()
        await asyncio.Event().wait()

    async def outer() -> None:
        await guarded(CancelSignal(), wait_forever())

    task = asyncio.create_task(outer())
    await asyncio.wait_for(waiting.wait(), 5)  # the cancel lands inside guarded
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_races_each_answer_their_own_signal():
    """A child Run driven inside its parent's wave shares the parent's task."""

    async def child(inner: CancelSignal) -> str:
        try:
            return await guarded(inner, asyncio.Event().wait())  # type: ignore[arg-type]
        except CancelledSignal:
            return "child cancelled"

    inner, outer = CancelSignal(), CancelSignal()
    asyncio.get_running_loop().call_later(0.01, inner.set)
    assert await guarded(outer, child(inner)) == "child cancelled"
    inner, outer = CancelSignal(), CancelSignal()
    asyncio.get_running_loop().call_later(0.01, outer.set)
    with pytest.raises(CancelledSignal):
        await guarded(outer, child(inner))
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_local_tools_of_a_wave_run_concurrently_and_are_cancelled_together():
    ping, pong, cancelled = asyncio.Event(), asyncio.Event(), []

    @tool
    async def first() -> str:
        ping.set()
        await pong.wait()
        return "first"

    @tool
    async def second() -> str:
        await ping.wait()
        pong.set()
        return "second"

    started: list[int] = []

    @tool
    async def forever(n: int) -> str:
        started.append(n)
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append(n)
        return "never"

    def inv(name: str, **args: Any) -> ToolInvocation:
        return ToolInvocation(
            tool=name,
            arguments=args,
            call_id=CallId(name),
            operation_id=f"op:{name}:{args}",
            attempt=1,
            run_id=R,
            thread_id=T,
        )

    runner = LocalToolRunner([first, second, forever])
    outcomes = await runner.run([inv("first"), inv("second")])
    assert [o.output.content for o in outcomes] == ["first", "second"]  # type: ignore[union-attr]
    task = asyncio.create_task(runner.run([inv("forever", n=1), inv("forever", n=2)]))
    await until(lambda: len(started) == 2, interval_s=0)  # both tools are running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: sorted(cancelled) == [1, 2], interval_s=0)


# ---- memory -----------------------------------------------------------------------------


async def test_a_finished_run_is_freed_by_reference_counting_alone():
    """An engine, its inference and its records form no cycle: at thousands of Runs
    a cycle per Run left tens of thousands of objects each to the cycle collector."""

    @tool
    def echo(x: str) -> str:
        return x

    store = MemoryCommitStore()

    async def one(thread: str) -> None:
        model = ScriptedModel(
            [ModelResponse(text="a", tool_calls=(call("echo", "c", x="y"),)), ModelResponse()]
        )
        agent = Agent(name="a", model=model, tools=[echo])
        await InProcessRunner(agent, store).start("hi", thread_id=thread)

    await one("warm")  # first use fills module caches
    gc.collect()
    gc.disable()
    try:
        for index in range(20):
            await one(f"t{index}")
        assert gc.collect() == 0
    finally:
        gc.enable()
