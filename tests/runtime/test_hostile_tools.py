"""Tools that misbehave at the tool boundary: each failure is its own call's error, seen
by the model, and never escapes into the wave, the other calls, or the event loop (an
executor runs the waves of many Runs in one call: one call raising through would have
lost them all)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from runtime import (
    Agent,
    Command,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    OutcomeUnknown,
    ScriptedModel,
    ToolResult,
    call,
    tool,
)
from runtime.messages import ToolResultMessage
from runtime.ports import Finished
from runtime.tool_calls import LocalToolRunner
from runtime.tools import Tool
from storage.memory import MemoryCommitStore

from .test_sync_tools import invocation


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for you")


class Custom(BaseException):
    pass


@tool
async def exits_on_the_loop() -> str:
    sys.exit(3)


@tool
def exits_in_a_thread() -> str:
    raise KeyboardInterrupt


@tool(timeout_s=5)
async def exits_under_a_timeout() -> str:
    raise SystemExit(1)


@tool
async def generator_exit() -> str:
    raise GeneratorExit


@tool
async def custom_base() -> str:
    raise Custom("mine")


@tool
async def unprintable() -> str:
    raise Unprintable


@tool
async def cancels_itself() -> str:
    asyncio.current_task().cancel()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    return "never"


@tool
async def fine() -> str:
    return "fine"


TOOLS = [
    exits_on_the_loop,
    exits_in_a_thread,
    exits_under_a_timeout,
    generator_exit,
    custom_base,
    unprintable,
    cancels_itself,
    fine,
]
HOSTILE = [
    ("exits_on_the_loop", "SystemExit"),
    ("exits_in_a_thread", "KeyboardInterrupt"),
    ("exits_under_a_timeout", "SystemExit"),
    ("generator_exit", "GeneratorExit"),
    ("custom_base", "Custom"),
    ("unprintable", "cannot be printed"),
    ("cancels_itself", "cancelled its own task"),  # failed the whole Run, its results lost
]


@pytest.mark.parametrize(("name", "said"), HOSTILE, ids=[n for n, _ in HOSTILE])
async def test_a_hostile_failure_is_its_own_call_s_error(name: str, said: str) -> None:
    runner = LocalToolRunner(TOOLS)
    outcomes = await runner.run([invocation(name, "a"), invocation("fine", "b")])
    hostile, neighbour = outcomes
    assert isinstance(hostile, Finished) and hostile.output.is_error, hostile
    assert said in hostile.output.content
    assert isinstance(neighbour, Finished) and neighbour.output.content == "fine"
    # and the loop goes on: a later call runs
    (again,) = await runner.run([invocation("fine", "c")])
    assert again.output.content == "fine"


def _lost_once() -> Tool:
    """A replay_safe tool whose first call is lost on the way back; the next answers."""
    tries: list[int] = []

    @tool(recovery=("replay_safe",))
    def flaky() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise OutcomeUnknown("lost on the way back")
        return "ok"

    return flaky


async def test_a_finished_call_s_commands_survive_a_crash_while_its_neighbour_is_retried():
    """A finishes with state commands; B is lost and tried again. The retry's executing
    commit holds A completed: a crash right after it, and recovery never runs A again,
    so A's commands must have gone in with that commit."""

    @tool
    def setter() -> ToolResult:
        return ToolResult(content="set", commands=[Command(key="k", value="from A")])

    flaky = _lost_once()

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("setter", "a"), call("flaky", "b"))),
            ModelResponse(text="done"),
        ]
    )
    runner = InProcessRunner(
        Agent(name="a", model=model, tools=[setter, flaky]), MemoryCommitStore()
    )
    # the first executing is committed with the inference: the retry's is the first alone
    with pytest.raises(Crash):  # right after the retry's executing commit
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("after:executing", 1)))
    done = await runner.recover("t")
    assert done.run_state.cause.kind == "natural"
    assert done.state["thread"]["k"] == "from A"


async def test_a_call_that_never_got_a_tool_thread_is_unavailable_and_never_runs():
    """Synchronous calls past their timeout keep their threads (a thread cannot be
    interrupted). Once every tool thread is held so, a later call waits in the queue
    and times out without having run: it is unavailable (tried again), not lost (its
    never_replay policy would have ended it indeterminate), and it never runs later."""
    import threading

    from runtime import tool_threads
    from runtime.ports import Lost, Unavailable
    from runtime.tool_threads import SYNC_TOOL_THREADS

    from .test_sync_tools import DEADLINE_S

    released, ran = threading.Event(), threading.Event()

    @tool(timeout_s=0.2)
    def stuck() -> str:
        released.wait(DEADLINE_S)
        return "late"

    @tool(timeout_s=0.5)
    def victim() -> str:
        ran.set()
        return "ran"

    @tool
    def sentinel() -> str:
        return "drained"

    runner = LocalToolRunner([stuck, victim, sentinel])
    jam = [invocation("stuck", f"s{i}") for i in range(SYNC_TOOL_THREADS)]
    pool = tool_threads.tool_threads()  # the one the jam and the victim queue in
    try:
        outcomes = await runner.run([*jam, invocation("victim", "v")])
    finally:
        released.set()
    assert all(isinstance(o, Lost) for o in outcomes[:-1])
    assert isinstance(outcomes[-1], Unavailable), outcomes[-1]
    (drained,) = await runner.run([invocation("sentinel", "z")])  # queued after the victim
    if pool is not tool_threads.tool_threads():  # the sentinel went to a fresh pool
        await asyncio.to_thread(pool.shutdown, wait=True)  # the victim's turn came there
    assert drained.output.content == "drained" and not ran.is_set()


async def test_a_fresh_pool_of_tool_threads_once_every_thread_is_held_past_its_deadline(
    monkeypatch,
):
    """Every tool thread held by a call past its timeout: every later synchronous call
    of the process was unavailable for good (it waited for a thread and timed out),
    while the process answered its pings and was never restarted. A fresh pool serves
    them; the old one's threads end with their calls."""
    import threading

    from runtime import tool_threads
    from runtime.ports import Lost

    from .test_sync_tools import DEADLINE_S

    monkeypatch.setattr(tool_threads, "SYNC_TOOL_THREADS", 2)
    monkeypatch.setattr(tool_threads, "_threads", [])
    released = threading.Event()

    @tool(timeout_s=0.2)
    def stuck() -> str:
        released.wait(DEADLINE_S)
        return "late"

    @tool(timeout_s=DEADLINE_S / 2)  # the stuck calls hold their threads longer
    def later() -> str:
        return "served"

    runner = LocalToolRunner([stuck, later])
    try:
        jammed = await runner.run([invocation("stuck", "s1"), invocation("stuck", "s2")])
        (served,) = await runner.run([invocation("later", "l")])
    finally:
        released.set()
    assert all(isinstance(o, Lost) for o in jammed), jammed
    assert isinstance(served, Finished) and served.output.content == "served", served


async def test_pools_of_tool_threads_held_past_their_deadline_are_bounded(monkeypatch):
    """A tool that hangs for good, called again and again: each pool it fills is replaced,
    but only ``MAX_POOLS`` at once; past that a call waits, and is unavailable at its
    timeout, rather than the process growing threads without end."""
    import threading

    from runtime import tool_threads
    from runtime.ports import Lost, Unavailable

    from .test_sync_tools import DEADLINE_S

    monkeypatch.setattr(tool_threads, "SYNC_TOOL_THREADS", 1)
    monkeypatch.setattr(tool_threads, "MAX_POOLS", 2)
    monkeypatch.setattr(tool_threads, "_threads", [])
    monkeypatch.setattr(tool_threads, "_overdue", {})
    released = threading.Event()

    @tool(timeout_s=0.2)
    def hangs() -> str:
        released.wait(DEADLINE_S)
        return "late"

    runner = LocalToolRunner([hangs])
    try:
        outcomes = [(await runner.run([invocation("hangs", f"h{i}")]))[0] for i in range(3)]
    finally:
        released.set()
    assert [type(o) for o in outcomes] == [Lost, Lost, Unavailable], outcomes


# ---- deadlines, and the tool's own errors that look like ours ---------------------------


async def test_a_call_that_ignores_its_cancellation_is_lost_at_its_deadline():
    """``timeout_s`` bounds the call whatever it does with its cancellation: one that
    catches it and goes on is left behind, lost, at its deadline (its Run does not wait
    for it), and what it returns later is dropped."""
    import asyncio

    from runtime.ports import Lost

    finished = asyncio.Event()

    @tool(timeout_s=0.1)
    async def stubborn() -> str:
        for _ in range(100):
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue  # not taken
        finished.set()
        return "finished after its deadline"

    runner = LocalToolRunner([stubborn, fine])
    lost, neighbour = await runner.run([invocation("stubborn", "a"), invocation("fine", "b")])
    assert isinstance(lost, Lost) and "timed out after 0.1s" in lost.message, lost
    assert isinstance(neighbour, Finished) and neighbour.output.content == "fine"
    assert not finished.is_set()  # answered without it: it is still going on its own


async def test_a_timeout_the_tool_raises_itself_is_its_error_not_its_deadline():
    """A TimeoutError from inside the tool (a socket's, an asyncio.timeout of its own) is
    the tool's failure, seen by the model; only the call's own deadline makes it lost
    (a replay_safe call would have been run again, and the model never told why)."""
    import asyncio

    runs: list[int] = []

    @tool(recovery=("replay_safe",))
    async def upstream() -> str:
        runs.append(1)
        async with asyncio.timeout(0):
            await asyncio.sleep(1)
        return "never"

    @tool(timeout_s=30)
    def socket_timeout() -> str:
        raise TimeoutError("upstream read timed out")

    runner = LocalToolRunner([upstream, socket_timeout])
    outcomes = await runner.run([invocation("upstream", "a"), invocation("socket_timeout", "b")])
    for outcome in outcomes:
        assert isinstance(outcome, Finished) and outcome.output.is_error, outcome
        assert outcome.output.content.startswith("TimeoutError")
    assert "upstream read timed out" in outcomes[1].output.content and runs == [1]


async def test_the_tool_s_own_unavailable_and_unknown_need_no_text():
    """UnavailableBeforeDispatch and OutcomeUnknown whose text cannot be had are still
    what they say (unavailable, lost), for that call alone."""
    from runtime import UnavailableBeforeDispatch
    from runtime.ports import Lost, Unavailable

    class Unsaid(UnavailableBeforeDispatch):
        def __str__(self) -> str:
            raise ValueError("no text")

    class Unknown(OutcomeUnknown):
        def __str__(self) -> str:
            raise ValueError("no text")

    @tool
    async def not_sent() -> str:
        raise Unsaid

    @tool
    async def unknown() -> str:
        raise Unknown

    runner = LocalToolRunner([not_sent, unknown, fine])
    calls = [invocation("not_sent", "a"), invocation("unknown", "b"), invocation("fine", "c")]
    unavailable, lost, neighbour = await runner.run(calls)
    assert isinstance(unavailable, Unavailable) and "cannot be printed" in unavailable.message
    assert isinstance(lost, Lost) and "cannot be printed" in lost.message
    assert isinstance(neighbour, Finished) and neighbour.output.content == "fine"


async def test_a_result_whose_text_exits_is_the_tool_s_error():
    class Exiting:
        def __repr__(self) -> str:
            raise SystemExit(2)

        __str__ = __repr__

    @tool
    async def returns_exiting() -> object:
        return {"value": Exiting()}

    @tool
    def returns_exiting_in_a_thread() -> object:
        return ToolResult(content={"value": Exiting()})

    runner = LocalToolRunner([returns_exiting_in_a_thread])
    (failed,) = await runner.run([invocation("returns_exiting_in_a_thread", "a")])
    assert isinstance(failed, Finished) and failed.output.is_error
    assert "cannot be a result" in failed.output.content and "SystemExit" in failed.output.content

    runner = LocalToolRunner([returns_exiting, fine])
    failed, neighbour = await runner.run(
        [invocation("returns_exiting", "a"), invocation("fine", "b")]
    )
    assert isinstance(failed, Finished) and failed.output.is_error
    assert "cannot be a result" in failed.output.content and "SystemExit" in failed.output.content
    assert neighbour.output.content == "fine"


# ---- what a call hands its Run, besides its result --------------------------------------


async def _one_call(tool_fn: object) -> object:
    from runtime.messages import ToolResultMessage

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("hands", "c1"),)), ModelResponse(text="ok")]
    )
    runner = InProcessRunner(Agent(name="a", model=model, tools=[tool_fn]), MemoryCommitStore())
    done = await runner.start("go", thread_id="t")
    assert done.run_state.cause.kind == "natural", done.run_state  # the Run goes on
    (result,) = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    return result


@pytest.mark.parametrize(
    ("count", "value"),
    [
        # each state command within its own limit, but forty of them: refused (a
        # model-visible error), not a commit past the store's payload limit that lost the
        # call's result with the Run (failed store)
        (40, "x" * 30_000),
        # eleven values of 8,190 emoji: 32 KiB apiece as stored, 360 KB in all; counted
        # as 8,193 characters each, they passed at four times the limit
        (11, "\U0001f600" * 8190),
    ],
)
async def test_what_one_call_hands_its_run_is_bounded_in_all_in_bytes(
    count: int, value: str
) -> None:
    @tool
    def hands() -> ToolResult:
        return ToolResult(
            content="done", commands=[Command(key=f"k{i}", value=value) for i in range(count)]
        )

    result = await _one_call(hands)
    assert result.is_error and "batch_result_bytes" in result.content


async def test_a_state_value_json_cannot_write_is_refused_not_a_failed_run():
    @tool
    def hands() -> ToolResult:
        return ToolResult(content="done", commands=[Command(key="big", value=10**5000)])

    result = await _one_call(hands)
    assert result.is_error and "cannot be written as JSON" in result.content


async def test_a_recovered_call_its_tool_no_longer_takes_is_sealed_not_a_failed_run():
    """A replay_safe call was executing when its host died; the tool deployed since takes
    a new required parameter. Its arguments no longer parse: the call is sealed unknown
    (it may have run) and the Run goes on, where the parse error failed it ``internal``."""

    @tool(name="fetch", recovery=("replay_safe",))
    def fetch_v1(url: str) -> str:
        return "v1"

    @tool(name="fetch", recovery=("replay_safe",))
    def fetch_v2(url: str, region: str) -> str:
        return "v2"

    store = MemoryCommitStore()
    first = ScriptedModel([ModelResponse(tool_calls=(call("fetch", "c1", url="x"),))])
    before = InProcessRunner(Agent(name="a", model=first, tools=[fetch_v1]), store)
    with pytest.raises(Crash):
        await before.start("go", thread_id="t", faults=FaultPlan(crash_at=("before:results", 1)))
    answer = ScriptedModel([ModelResponse(text="step 0 was answered"), ModelResponse(text="done")])
    done = await InProcessRunner(Agent(name="a", model=answer, tools=[fetch_v2]), store).recover(
        "t"
    )
    assert done.run_state.cause.kind == "natural", done.run_state
    (result,) = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    assert result.is_error and "no longer takes the call's arguments" in result.content
    assert "region" in result.content


@pytest.mark.parametrize("retried", [False, True], ids=["alone", "beside a retried call"])
@pytest.mark.parametrize("refusal", ["state_conflict", "state_bytes"])
async def test_finished_calls_whose_commands_are_refused_keep_their_results(refusal, retried):
    """Two calls write the same exclusive key (or, together, more than ``state_bytes``):
    the commit carrying their commands is refused and the Run ends, with their results,
    known, committed. Refused at the executing commit of a call retried beside them, or
    by state_bytes at the results commit, the results were sealed "outcome unknown"."""
    from runtime.limits import Limits

    def writes(text: str, key: str) -> Any:
        value = 1 if refusal == "state_conflict" else text * 1500
        return lambda: ToolResult(content=text, commands=[Command(key=key, value=value)])

    key_b = "k" if refusal == "state_conflict" else "kb"
    a, b = tool(name="a")(writes("A", "k")), tool(name="b")(writes("B", key_b))

    flaky = _lost_once()

    calls = (call("a", "1"), call("b", "2"), *((call("flaky", "3"),) if retried else ()))
    model = ScriptedModel([ModelResponse(tool_calls=calls), ModelResponse(text="done")])
    agent = Agent(name="x", model=model, tools=[a, b, flaky])
    runner = InProcessRunner(agent, MemoryCommitStore(), limits=Limits(state_bytes=2500))
    done = await runner.start("go", thread_id="t")
    assert done.run_state.cause.kind == "failed", done.run_state
    assert done.run_state.cause.code == refusal
    results = {m.call_id: m.content for m in done.messages if isinstance(m, ToolResultMessage)}
    assert (results["1"], results["2"]) == ("A", "B")


async def test_a_synchronous_tool_s_result_is_made_text_in_its_thread():
    """A synchronous tool runs in a tool thread so that it stalls no other call; its
    result was made text on the event loop, where a large one (or a ``__str__`` that
    blocks) stalled every Run of the process, past the call's own timeout."""
    import threading

    made_in: list[threading.Thread] = []

    class Noted:
        def __str__(self) -> str:
            made_in.append(threading.current_thread())
            return "noted"

    @tool(timeout_s=5)
    def returns_noted() -> object:
        return {"value": Noted()}

    (outcome,) = await LocalToolRunner([returns_noted]).run([invocation("returns_noted", "a")])
    assert isinstance(outcome, Finished) and outcome.output.content == '{"value": "noted"}'
    assert made_in and made_in[0] is not threading.main_thread()
