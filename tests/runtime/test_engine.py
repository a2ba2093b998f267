"""The Step engine on the in-process runner with a ScriptedModel."""

from __future__ import annotations

import asyncio

import pytest

from runtime import (
    Agent,
    AssistantMessage,
    AwaitingState,
    Command,
    EndedState,
    HookOutput,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    ToolResult,
    ToolResultMessage,
    call,
    tool,
)
from runtime.hooks import Hook
from storage.memory import MemoryCommitStore

from .agents import Ledger, crash_matrix_agent


async def run(agent: Agent):
    return await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")


def results(frontier) -> list[ToolResultMessage]:
    return [m for m in frontier.messages if isinstance(m, ToolResultMessage)]


def cause(frontier) -> str:
    assert isinstance(frontier.run_state, EndedState)
    return frontier.run_state.cause.kind


async def test_natural_end_commits_the_answer_and_settles_idle():
    model = ScriptedModel([ModelResponse(text="hello there")])
    runner = InProcessRunner(Agent(name="a", model=model), MemoryCommitStore())
    f = await runner.start("hi", thread_id="t")
    assert cause(f) == "natural"
    assert isinstance(f.messages[-1], AssistantMessage) and f.messages[-1].text == "hello there"
    assert (f.status.state, f.status.reason) == ("idle", "natural")
    assert f.version == 2  # activation + the answer
    model.assert_consumed()


async def test_tool_batch_results_are_published_in_model_order():
    ledger = Ledger()
    agent = crash_matrix_agent(ledger, steps=1)
    store = MemoryCommitStore()
    f = await InProcessRunner(agent, store).start("go", thread_id="t")
    assert cause(f) == "natural"
    assert [(m.call_id, m.content) for m in results(f)] == [
        ("c0a", "charged 0"),
        ("c0b", "value of k0"),
    ]
    labels = [r.commit.label for r in await store.read("t")]
    # finalize is folded into the next Step's first commit: no separate finalize commit;
    # the first wave's executing rides in the inference commit, the serial call's has its own
    assert labels == ["activation", "inference", "results", "executing", "results", "ended"]


async def test_parallel_wave_runs_calls_concurrently_and_serial_calls_alone():
    both_started = asyncio.Event()
    started: list[str] = []

    @tool(concurrency="parallel")
    async def p(name: str) -> str:
        started.append(name)
        if len(started) == 2:
            both_started.set()
        # each parallel call waits for its sibling: this only finishes if they overlap
        await asyncio.wait_for(both_started.wait(), timeout=5)
        return name

    @tool(concurrency="serial")
    def s(name: str) -> str:
        started.append(name)
        return name

    model = ScriptedModel(
        [
            ModelResponse(
                tool_calls=(
                    call("p", "1", name="a"),
                    call("p", "2", name="b"),
                    call("s", "3", name="c"),
                )
            ),
            ModelResponse(text="ok"),
        ]
    )
    store = MemoryCommitStore()
    f = await InProcessRunner(Agent(name="a", model=model, tools=[p, s]), store).start(
        "go", thread_id="t"
    )
    assert cause(f) == "natural"
    assert [m.content for m in results(f)] == ["a", "b", "c"]
    records = await store.read("t")
    labels = [r.commit.label for r in records]
    assert labels == ["activation", "inference", "results", "executing", "results", "ended"]
    # one wave of two, marked executing in the inference commit; then the serial call alone
    opened = records[1].commit.batch
    assert opened is not None
    assert [c.phase.kind for c in opened.calls] == ["executing", "executing", "requested"]


async def test_max_steps_withholds_tools_on_the_last_step():
    seen_tools: list[object] = []

    def answer(request):
        seen_tools.append(request.tools)
        return ModelResponse(tool_calls=(call("noop", f"c{request.step}"),))

    @tool
    def noop() -> str:
        return "ok"

    model = ScriptedModel([answer, answer, answer])
    agent = Agent(name="a", model=model, tools=[noop], max_steps=3)
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert cause(f) == "max_steps"
    assert seen_tools[0] is not None and seen_tools[1] is not None
    assert seen_tools[2] is None
    assert f.steps == 3
    # the calls the model made anyway are dropped: none is committed without a result,
    # so the thread's history stays valid for the next Run on any provider
    last = f.messages[-1]
    assert last.kind == "assistant" and last.tool_calls == ()
    called = [c.call_id for m in f.messages if m.kind == "assistant" for c in m.tool_calls]
    answered = [m.call_id for m in f.messages if m.kind == "tool_result"]
    assert called == answered == ["c0", "c1"]


async def test_an_answer_on_the_last_step_ends_naturally():
    @tool
    def noop() -> str:
        return "ok"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("noop", "c0"),)), ModelResponse(text="ok")]
    )
    agent = Agent(name="a", model=model, tools=[noop], max_steps=2)
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert cause(f) == "natural" and f.messages[-1].text == "ok"


async def test_the_system_prompt_goes_with_every_inference():
    seen: list[str] = []

    def answer(request):
        seen.append(request.system)
        return ModelResponse(text="hi")

    agent = Agent(name="a", model=ScriptedModel([answer]), system="You are terse.")
    await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert seen == ["You are terse."]


async def test_exclusive_state_conflict_ends_failed_and_keeps_earlier_steps():
    @tool
    def setter(value: int) -> ToolResult:
        return ToolResult(content="set", commands=[Command(key="k", value=value)])

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("setter", "1", value=1),)),
            ModelResponse(tool_calls=(call("setter", "2", value=2), call("setter", "3", value=3))),
            ModelResponse(text="unreachable"),
        ]
    )
    store = MemoryCommitStore()
    f = await InProcessRunner(Agent(name="a", model=model, tools=[setter]), store).start(
        "go", thread_id="t"
    )
    assert isinstance(f.run_state, EndedState)
    assert f.run_state.cause.kind == "failed"
    assert f.run_state.cause.failure == "state_conflict"
    assert f.state["thread"]["k"] == 1  # the first step's command stays committed
    assert (f.status.state, f.status.reason) == ("failed", "state_conflict")
    assert await store.load("t") == f


async def test_bad_arguments_and_unknown_tools_reach_the_model_as_errors():
    @tool
    def add(a: int, b: int) -> int:
        return a + b

    seen: list[list[ToolResultMessage]] = []

    def second(request):
        seen.append([m for m in request.messages if isinstance(m, ToolResultMessage)])
        return ModelResponse(text="understood")

    bad = (
        call("missing", "1"),
        call("add", "2", a="x", b=1),
        call("add", "3").model_copy(update={"arguments": "{not json"}),
        call("add", "4").model_copy(update={"arguments": "[1, 2]"}),
        call("add", "5", a=1, b=2, c=3),
    )
    model = ScriptedModel([ModelResponse(tool_calls=bad), second])
    f = await run(Agent(name="a", model=model, tools=[add]))
    assert cause(f) == "natural"
    errors = seen[0]
    assert [m.is_error for m in errors] == [True] * 5
    assert "unknown tool 'missing'" in errors[0].content
    assert "a: Input should be a valid integer" in errors[1].content
    assert "not valid JSON" in errors[2].content
    assert "must be a JSON object" in errors[3].content
    assert "c: Extra inputs are not permitted" in errors[4].content


async def test_a_tool_that_raises_is_a_model_visible_error_not_a_crash():
    @tool
    def boom() -> str:
        raise RuntimeError("disk on fire")

    model = ScriptedModel([ModelResponse(tool_calls=(call("boom", "1"),)), ModelResponse(text="k")])
    f = await InProcessRunner(
        Agent(name="a", model=model, tools=[boom]), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert cause(f) == "natural"
    assert results(f)[0].is_error and "disk on fire" in results(f)[0].content


async def test_unsupported_recovery_mode_never_enters_the_executor():
    ran = []

    @tool(recovery=("never_replay",))
    def pay() -> str:
        ran.append(1)
        return "paid"

    from runtime import ToolRecoveryPolicy

    model = ScriptedModel([ModelResponse(tool_calls=(call("pay", "1"),)), ModelResponse(text="k")])
    agent = Agent(
        name="a", model=model, tools=[pay], policies={"pay": ToolRecoveryPolicy(mode="replay_safe")}
    )
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert ran == []
    assert "does not support recovery mode replay_safe" in results(f)[0].content


async def test_unavailable_before_dispatch_retries_even_never_replay():
    from runtime import UnavailableBeforeDispatch

    attempts: list[int] = []

    @tool
    def flaky(ctx: object = None) -> str:  # type: ignore[assignment]
        attempts.append(1)
        if len(attempts) < 3:
            raise UnavailableBeforeDispatch("pool busy")
        return "finally"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("flaky", "1"),)), ModelResponse(text="k")]
    )
    f = await InProcessRunner(
        Agent(name="a", model=model, tools=[flaky]), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert len(attempts) == 3
    assert results(f)[0].content == "finally"


async def test_cancel_during_a_tool_seals_the_batch_and_ends_cancelled():
    entered = asyncio.Event()

    @tool
    async def slow() -> str:
        entered.set()
        await asyncio.Event().wait()  # never returns on its own
        return "never"

    model = ScriptedModel([ModelResponse(tool_calls=(call("slow", "1"),)), ModelResponse(text="k")])
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[slow]), store)
    engine = runner.engine()
    task = asyncio.create_task(engine.start("t", "go"))
    await asyncio.wait_for(entered.wait(), timeout=5)
    engine.cancel()
    f = await asyncio.wait_for(task, timeout=5)
    assert cause(f) == "cancelled"
    assert results(f)[0].is_error and "owning run ended" in results(f)[0].content
    assert f.batch is None and (f.status.state, f.status.reason) == ("idle", "cancelled")


async def test_cancel_before_inference_ends_cancelled_without_asking_the_model():
    model = ScriptedModel([ModelResponse(text="never")])
    runner = InProcessRunner(Agent(name="a", model=model), MemoryCommitStore())
    engine = runner.engine()
    engine.cancel()
    f = await engine.start("t", "go")
    assert cause(f) == "cancelled" and not model.served


async def test_cancel_as_the_model_answers_seals_its_calls_without_running_them():
    ran: list[str] = []

    @tool
    def effect() -> str:
        ran.append("effect")
        return "done"

    class CancellingModel(ScriptedModel):
        def respond(self, request):
            engine.cancel()  # lands after the answer: the inference result stands
            return super().respond(request)

    model = CancellingModel([ModelResponse(tool_calls=(call("effect", "1"),))])
    store = MemoryCommitStore()
    engine = InProcessRunner(Agent(name="a", model=model, tools=[effect]), store).engine()
    f = await engine.start("t", "go")
    assert cause(f) == "cancelled" and ran == []
    records = await store.read("t")
    assert [r.commit.label for r in records] == ["activation", "inference", "ended"]
    opened = records[1].commit.batch
    assert opened is not None and opened.calls[0].phase.kind == "requested"
    assert results(f)[0].is_error


class _HeldWait:
    """A store whose commit of a wait (the Run going to rest awaiting) is held until the
    test lets it go."""

    def __init__(self) -> None:
        self.inner = MemoryCommitStore()
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append(self, commit, expected_version, epoch, *, claim=None):
        if isinstance(commit.disposition, AwaitingState):
            self.entered.set()
            await self.release.wait()
        return await self.inner.append(commit, expected_version, epoch, claim=claim)


async def test_a_cancel_while_the_run_s_wait_is_being_committed_ends_it():
    """Its caller was told the driver heard it: the Run ends cancelled, it does not rest
    awaiting with the cancel dropped."""

    class PausingModel(ScriptedModel):
        def respond(self, request):
            engine.pause()  # awaits at the next Step boundary
            return super().respond(request)

    @tool
    def echo(text: str) -> str:
        return text

    model = PausingModel([ModelResponse(tool_calls=(call("echo", "1", text="x"),))])
    store = _HeldWait()
    agent = Agent(name="a", model=model, tools=[echo])
    engine = InProcessRunner(agent, store).engine()
    drive = asyncio.ensure_future(engine.start("t", "go"))
    await store.entered.wait()
    engine.cancel()
    store.release.set()
    f = await drive
    assert cause(f) == "cancelled"
    labels = [r.commit.label for r in await store.inner.read("t")]
    assert labels[-2:] == ["awaiting", "ended"]


async def test_stop_ends_stopped_with_the_reason():
    model = ScriptedModel([ModelResponse(text="never")])
    engine = InProcessRunner(Agent(name="a", model=model), MemoryCommitStore()).engine()
    engine.stop("operator said so")
    f = await engine.start("t", "go")
    assert f.run_state.cause.kind == "stopped"
    assert f.run_state.cause.reason == "operator said so"


async def test_a_model_that_fails_ends_the_run_failed_inference():
    model = ScriptedModel([ModelResponse(tool_calls=(call("noop", "1"),))])  # step 1 missing

    @tool
    def noop() -> str:
        return "ok"

    f = await InProcessRunner(
        Agent(name="a", model=model, tools=[noop]), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert f.run_state.cause.kind == "failed"
    assert f.run_state.cause.failure == "inference"
    assert f.run_state.cause.code == "ScriptExhausted"
    assert (f.status.state, f.status.reason) == ("failed", "ScriptExhausted")


async def test_hooks_run_at_their_points_and_context_is_never_committed():
    points: list[str] = []

    def record(hook_input):
        points.append(f"{hook_input.point}:{hook_input.step}")
        if hook_input.point == "BeforeInference":
            from runtime.messages import ContextMessage

            return HookOutput(
                context=[ContextMessage(text="be brief")],
                commands=[Command(key="n", merge="commutative", value=1)],
            )
        return None

    hooks = [
        Hook(point=p, fn=record)
        for p in ("StepStart", "BeforeInference", "AfterInference", "AfterTool", "StepEnd")
    ]

    @tool
    def noop() -> str:
        return "ok"

    contexts: list[int] = []

    def respond(request):
        contexts.append(sum(m.kind == "context" for m in request.messages))
        if request.step == 0:
            return ModelResponse(tool_calls=(call("noop", "1"),))
        return ModelResponse(text="done")

    model = ScriptedModel([respond, respond])
    f = await InProcessRunner(
        Agent(name="a", model=model, tools=[noop], hooks=hooks), MemoryCommitStore()
    ).start("go", thread_id="t")
    assert points == [
        "StepStart:0",
        "BeforeInference:0",
        "AfterInference:0",
        "AfterTool:0",
        "StepEnd:0",
        "StepStart:1",
        "BeforeInference:1",
        "AfterInference:1",
        "StepEnd:1",
    ]
    assert contexts == [1, 1]
    assert all(m.kind != "context" for m in f.messages)
    assert f.state["thread"]["n"] == 2


async def test_start_is_idempotent_by_run_id_and_refuses_a_second_active_run():
    from runtime import InvalidTransition

    entered, gate = asyncio.Event(), asyncio.Event()

    @tool
    async def wait() -> str:
        entered.set()
        await gate.wait()
        return "ok"

    model = ScriptedModel([ModelResponse(tool_calls=(call("wait", "1"),)), ModelResponse(text="k")])
    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=model, tools=[wait]), store)
    first = asyncio.create_task(runner.start("go", thread_id="t", run_id="r1"))
    await asyncio.wait_for(entered.wait(), timeout=5)
    with pytest.raises(InvalidTransition, match="already has an active run r1"):
        await runner.start("again", thread_id="t", run_id="r2")
    gate.set()
    done = await asyncio.wait_for(first, timeout=5)
    assert cause(done) == "natural"
    again = await runner.start("go", thread_id="t", run_id="r1")
    assert again.version == done.version  # nothing new committed


@pytest.mark.parametrize("steps", [1, 3])
async def test_store_log_replays_to_the_stored_frontier(steps):
    from runtime import replay

    store = MemoryCommitStore()
    await InProcessRunner(crash_matrix_agent(Ledger(), steps), store).start("go", thread_id="t")
    records = await store.read("t")
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    stored = await store.load("t")
    rebuilt = replay(stored.thread_id, [r.commit for r in records])
    assert rebuilt.model_copy(update={"epoch": stored.epoch, "owner": stored.owner}) == stored


async def test_calls_of_an_unknown_tool_among_many_keep_their_errors_short():
    """The error lists the tools there are, cut: an agent of a thousand tools, asked for
    a tool it lacks in many calls at once, would put over a megabyte in one commit and
    fail the Run on the store's payload limit instead of telling the model."""
    from runtime.gates import UNKNOWN_CHARS

    def make(i: int):
        @tool(name=f"tool_number_{i:04d}_with_a_long_name")
        def t() -> str:
            return "ok"

        return t

    many = [make(i) for i in range(1000)]
    calls = tuple(call("no_such_tool", f"c{i}") for i in range(64))
    model = ScriptedModel([ModelResponse(tool_calls=calls), ModelResponse(text="understood")])
    f = await run(Agent(name="a", model=model, tools=many))
    assert cause(f) == "natural"
    errors = results(f)
    assert len(errors) == 64 and all(m.is_error for m in errors)
    assert all(len(m.content) <= UNKNOWN_CHARS for m in errors)
    assert errors[0].content.startswith("unknown tool 'no_such_tool'; available tools: tool_")


async def test_a_start_asked_again_after_the_thread_moved_on_is_its_repeat():
    """The answer to a start was lost; meanwhile the Run ended and another client started
    the thread's next Run. Asked again (as the README says a start may be), it is that
    start's repeat — nothing written, no error — not "a new Run needs a new id", and it
    is answered with its own Run as it ended, not the later one; the same run id with
    another input is refused."""
    from runtime import InvalidTransition

    store = MemoryCommitStore()
    agent = Agent(
        name="a", model=ScriptedModel([ModelResponse(text="one"), ModelResponse(text="two")])
    )
    runner = InProcessRunner(agent, store)
    first = await runner.start("first", thread_id="t", run_id="r1")
    later = await runner.start("second", thread_id="t", run_id="r2")
    again = await runner.start("first", thread_id="t", run_id="r1")
    claim = {"epoch", "owner"}  # a fold of the log: the claims are not in it
    assert again.model_dump(exclude=claim) == first.model_dump(exclude=claim)
    assert (again.run_id, cause(again)) == ("r1", "natural")
    with pytest.raises(InvalidTransition, match="another input"):
        await runner.start("something else", thread_id="t", run_id="r1")
    assert (await store.load("t")).version == later.version


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_ids_the_system_s_limits_allow_are_stored(backend, tmp_path):
    """A system whose Limits allow longer ids (``id_chars``) stores them: the stores check
    only what they cannot store (a 300-character thread id was refused at 256)."""
    from runtime.engine import Engine
    from runtime.limits import Limits
    from runtime.tool_calls import LocalToolRunner
    from storage.url import open_store

    store = (
        MemoryCommitStore()
        if backend == "memory"
        else await open_store(f"sqlite:///{tmp_path}/s.db")
    )
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))
    engine = Engine(agent, store, LocalToolRunner([]), limits=Limits(id_chars=400))
    done = await engine.start("t" * 300, "hello")
    assert done.ended and done.run_state.cause.kind == "natural"
    await store.close()
