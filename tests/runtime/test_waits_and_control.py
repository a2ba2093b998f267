"""Every wait kind on the in-process runner, control (cancel, stop, pause), terminate."""

from __future__ import annotations

import pytest

from runtime import (
    Agent,
    EndedState,
    ExternalResult,
    InProcessRunner,
    ModelResponse,
    ResumeCommand,
    ResumeRejected,
    ScriptedModel,
    ToolOutput,
    ToolResultMessage,
    UserInput,
    UserMessage,
    call,
    tool,
)
from runtime.hooks import Hook
from runtime.lifecycle import AwaitingState, ScheduledFire, Unpause, answer
from storage.memory import MemoryCommitStore


def command_for(frontier, payload) -> ResumeCommand:
    return answer(frontier.run_state.ticket, payload)


def results(frontier) -> list[ToolResultMessage]:
    return [m for m in frontier.messages if isinstance(m, ToolResultMessage)]


def one_tool_agent(t, *extra_steps: ModelResponse, **kwargs) -> Agent:
    script = [
        ModelResponse(tool_calls=(call(t.id, "c1", x=1),)),
        *extra_steps,
        ModelResponse(text="finished"),
    ]
    return Agent(name="w", model=ScriptedModel(script), tools=[t], **kwargs)


async def test_client_executed_tool_takes_the_callers_result():
    @tool(wait="external_result")
    def measure(x: int) -> str:
        raise AssertionError("a client-executed tool never runs on our side")

    runner = InProcessRunner(one_tool_agent(measure), MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    assert isinstance(f.run_state, AwaitingState)
    assert f.run_state.ticket.target.wait == "external_result"
    done = await runner.resume(command_for(f, ExternalResult(output=ToolOutput(content="42"))))
    assert done.run_state.cause.kind == "natural"
    assert results(done)[0].content == "42"


async def test_scheduled_action_runs_when_it_fires():
    ran = []

    @tool(wait="scheduled_action")
    def remind(x: int) -> str:
        ran.append(x)
        return "reminded"

    runner = InProcessRunner(one_tool_agent(remind), MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    assert f.run_state.ticket.payload_kind == "scheduled_action" and ran == []
    done = await runner.resume(command_for(f, ScheduledFire()))
    assert ran == [1] and results(done)[0].content == "reminded"


async def test_wait_deadline_rejects_a_late_resume_and_keeps_the_ticket():
    # a microsecond: past before any resume can arrive (zero or less is refused when built)
    @tool(needs_permission=True, wait_deadline_s=1e-6)
    def risky(x: int) -> str:
        return "ran"

    from runtime import PermissionDecision

    store = MemoryCommitStore()
    runner = InProcessRunner(one_tool_agent(risky), store)
    f = await runner.start("go", thread_id="t")
    with pytest.raises(ResumeRejected) as err:
        await runner.resume(command_for(f, PermissionDecision(approve=True)))
    assert err.value.axis == "deadline"
    assert (await store.load("t")).run_state == f.run_state


@pytest.mark.parametrize(
    ("wait", "said"),
    [
        ({"needs_permission": True}, "blocked: no permission decision"),
        ({"wait": "external_result"}, "no result came"),
        ({"wait": "scheduled_action"}, "not run: its schedule did not fire"),
    ],
)
async def test_a_wait_past_its_deadline_expires_and_the_run_goes_on(wait, said):
    """Before, a wait past its deadline refused every resume and nothing ended it: the
    Run stayed awaiting for good. ``WaitExpired`` completes the call with an error the
    model sees, never runs the tool, and the Run goes on to its next Step."""
    from runtime import WaitExpired

    @tool(wait_deadline_s=1e-6, **wait)
    def act(x: int) -> str:
        raise AssertionError("an expired wait never runs its tool")

    store = MemoryCommitStore()
    runner = InProcessRunner(one_tool_agent(act), store)
    f = await runner.start("go", thread_id="t")
    done = await runner.resume(command_for(f, WaitExpired()))
    assert done.run_state.cause.kind == "natural"
    (result,) = results(done)
    assert result.is_error and result.content.startswith(said)
    with pytest.raises(ResumeRejected) as err:  # the ticket is gone: one expiry lands
        await runner.resume(command_for(f, WaitExpired()))
    assert err.value.axis == "ticket"


async def test_a_wait_expires_only_past_a_deadline_it_has():
    """An expiry before the deadline, or of a wait with none, is refused on the deadline
    axis and leaves the ticket for the real answer."""
    from runtime import PermissionDecision, WaitExpired

    from .agents import answer_any_time, answer_within_an_hour

    for act in (answer_within_an_hour, answer_any_time):
        store = MemoryCommitStore()
        runner = InProcessRunner(one_tool_agent(act), store)
        f = await runner.start("go", thread_id="t")
        with pytest.raises(ResumeRejected) as err:
            await runner.resume(command_for(f, WaitExpired()))
        assert err.value.axis == "deadline"
        assert (await store.load("t")).run_state == f.run_state
        done = await runner.resume(command_for(f, PermissionDecision(approve=True)))
        assert results(done)[0].content == "ran"


async def test_user_input_requested_by_a_hook_then_resumed_with_text():
    asked = []

    def ask_once(hook_input):
        if not asked:
            asked.append(1)
            hook_input.execution.request_input("Which account?")

    @tool
    def noop(x: int) -> str:
        return "ok"

    agent = one_tool_agent(noop, hooks=[Hook(point="StepEnd", fn=ask_once)])
    runner = InProcessRunner(agent, MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    assert f.run_state.ticket.target.kind == "user_input"
    assert f.run_state.ticket.target.prompt == "Which account?"
    assert (f.status.state, f.status.reason) == ("idle", "awaiting_user_input")
    done = await runner.resume(command_for(f, UserInput(text="savings")))
    kinds = [m.kind for m in done.messages]
    # the batch's results are published before the new user text
    assert kinds == ["user", "assistant", "tool_result", "user", "assistant"]
    assert isinstance(done.messages[3], UserMessage) and done.messages[3].text == "savings"


@pytest.mark.parametrize(
    ("wait", "payload"),
    [
        (lambda execution: execution.request_input("Which account?"), UserInput(text="savings")),
        (lambda execution: execution.pause(), Unpause()),
    ],
    ids=["user_input", "pause"],
)
async def test_step_end_hooks_that_wait_run_once_per_step_across_the_resume(wait, payload):
    """The wait a StepEnd hook asks for is committed as that Step's end: resuming it goes
    on to the next Step, it does not end the Step (and run its hooks) a second time."""
    ended_steps = []

    def ask_at_first(hook_input):
        ended_steps.append(hook_input.step)
        if hook_input.step == 0:
            wait(hook_input.execution)

    @tool
    def noop(x: int) -> str:
        return "ok"

    agent = one_tool_agent(noop, hooks=[Hook(point="StepEnd", fn=ask_at_first)])
    runner = InProcessRunner(agent, MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    assert f.run_state.ticket.target.kind == payload.kind
    done = await runner.resume(command_for(f, payload))
    assert done.run_state.cause.kind == "natural"
    assert ended_steps == [0, 1]


async def test_a_wait_asked_for_during_the_tools_comes_after_the_steps_end_hooks():
    """A wait an AfterTool hook asks for is taken at the Step boundary: the Step ends
    first (its StepEnd hooks run, once), then the Run waits."""
    seen = []

    def ask_after_the_tool(hook_input):
        seen.append((hook_input.point, hook_input.step))
        if hook_input.point == "AfterTool":
            hook_input.execution.request_input("Which account?")

    @tool
    def noop(x: int) -> str:
        return "ok"

    hooks = [Hook(point=p, fn=ask_after_the_tool) for p in ("AfterTool", "StepEnd")]
    runner = InProcessRunner(one_tool_agent(noop, hooks=hooks), MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    assert f.run_state.ticket.target.kind == "user_input"
    assert seen == [("AfterTool", 0), ("StepEnd", 0)]
    done = await runner.resume(command_for(f, UserInput(text="savings")))
    assert done.run_state.cause.kind == "natural"
    assert seen == [("AfterTool", 0), ("StepEnd", 0), ("StepEnd", 1)]


async def test_manual_pause_waits_at_the_step_boundary_and_unpauses():
    @tool
    def noop(x: int) -> str:
        return "ok"

    runner = InProcessRunner(one_tool_agent(noop), MemoryCommitStore())
    engine = runner.engine()
    engine.pause()
    f = await engine.start("t", "go")
    assert f.run_state.ticket.target.kind == "pause"
    done = await runner.resume(command_for(f, Unpause()))
    assert done.run_state.cause.kind == "natural"


def _asking_permission() -> tuple[MemoryCommitStore, InProcessRunner]:
    """A store and a runner whose Runs await permission for their one call."""

    @tool(needs_permission=True)
    def risky(x: int) -> str:
        return "ran"

    store = MemoryCommitStore()
    return store, InProcessRunner(one_tool_agent(risky), store)


async def test_cancel_of_an_awaiting_run_clears_the_ticket_and_a_late_resume_fails_closed():
    from runtime import PermissionDecision

    store, runner = _asking_permission()
    f = await runner.start("go", thread_id="t")
    ended = await runner.engine().terminate("t")
    assert isinstance(ended.run_state, EndedState) and ended.run_state.cause.kind == "cancelled"
    assert results(ended)[0].is_error and "owning run ended" in results(ended)[0].content
    with pytest.raises(ResumeRejected) as err:
        await runner.resume(command_for(f, PermissionDecision(approve=True)))
    assert err.value.axis == "ticket"
    assert await runner.engine().terminate("t") == await store.load("t")  # idempotent


async def test_a_terminate_of_a_named_run_leaves_the_threads_later_run_alone():
    store, runner = _asking_permission()
    first = await runner.start("go", thread_id="t", run_id="r1")
    await runner.engine().terminate("t", run=first.run_id)  # r1 ends
    later = await runner.start("again", thread_id="t", run_id="r2")
    assert isinstance(later.run_state, AwaitingState)
    assert await runner.engine().terminate("t", run=first.run_id) == later  # r2 untouched
    assert await store.load("t") == later
    ended = await runner.engine().terminate("t", run=later.run_id)
    assert isinstance(ended.run_state, EndedState) and ended.run_id == "r2"


async def test_a_control_engine_ends_a_run_on_a_thread_id_its_system_accepted():
    """A system with a raised ``id_chars`` started a Run on a long thread id: its control
    engine (a host's cancel at rest, a dead letter) is held to the same limits."""
    from runtime.control import control_engine
    from runtime.limits import Limits

    @tool(needs_permission=True)
    def risky(x: int) -> str:
        return "ran"

    # fewer calls a Step: a commit of 64 calls with such ids would outgrow the store
    store, limits, thread = MemoryCommitStore(), Limits(id_chars=1024, tool_calls=16), "t" * 300
    runner = InProcessRunner(one_tool_agent(risky), store, limits=limits)
    assert isinstance((await runner.start("go", thread_id=thread)).run_state, AwaitingState)
    ended = await control_engine(store, limits=limits).terminate(thread)
    assert isinstance(ended.run_state, EndedState) and ended.run_state.cause.kind == "cancelled"


async def test_a_run_awaiting_since_before_id_chars_was_lowered_is_resumed_and_ended():
    """A system restarted with a lower ``id_chars``: a Run that waited on a thread (and
    with a run id) its old limit took was refused every resume and every cancel as
    InputRefused(id_chars), and waited for ever. Ids that name what is stored are held
    to what a store holds (``STORED_IDS``); a new Run is still held to the new limit."""
    from runtime.control import control_engine
    from runtime.errors import InputRefused
    from runtime.lifecycle import PermissionDecision
    from runtime.limits import Limits

    @tool(needs_permission=True)
    def risky(x: int) -> str:
        return "ran"

    store, wide, narrow = MemoryCommitStore(), Limits(id_chars=256), Limits(id_chars=64)
    waiting = {}
    for name in ("resumed", "cancelled"):
        thread, run = name[0] * 200, f"{name}-" + "r" * 190
        before = InProcessRunner(one_tool_agent(risky), store, limits=wide)
        waiting[name] = await before.start("go", thread_id=thread, run_id=run)
        assert isinstance(waiting[name].run_state, AwaitingState)
    after = InProcessRunner(one_tool_agent(risky), store, limits=narrow)
    ticket = waiting["resumed"].run_state.ticket
    done = await after.resume(answer(ticket, PermissionDecision(approve=True)))
    assert done.run_state.cause.kind == "natural"
    ended = await control_engine(store, limits=narrow).terminate(waiting["cancelled"].thread_id)
    assert isinstance(ended.run_state, EndedState) and ended.run_state.cause.kind == "cancelled"
    with pytest.raises(InputRefused) as refused:  # what is new: the new limit
        await after.start("again", thread_id="n" * 65)
    assert refused.value.limit == "id_chars"


async def test_a_run_resumed_on_a_thread_over_a_lowered_id_chars_is_recovered():
    """Resumed under a lower ``id_chars`` (its thread id is held to ``STORED_IDS``), a
    Run whose process then died was refused every recovery, InputRefused(id_chars):
    dead-lettered where it would have gone on. A recovery names a stored thread too."""
    from runtime.faults import Crash, FaultPlan
    from runtime.lifecycle import PermissionDecision
    from runtime.limits import Limits

    @tool(needs_permission=True)
    def risky(x: int) -> str:
        return "ran"

    store, narrow = MemoryCommitStore(), Limits(id_chars=64)
    wide = InProcessRunner(one_tool_agent(risky), store, limits=Limits(id_chars=256))
    waiting = await wide.start("go", thread_id="t" * 200, run_id="r" * 190)
    after = InProcessRunner(one_tool_agent(risky), store, limits=narrow)
    command = answer(waiting.run_state.ticket, PermissionDecision(approve=True))
    with pytest.raises(Crash):  # its process dies once the resume has landed
        await after.resume(command, faults=FaultPlan(crash_at=("after:resume", 1)))
    done = await after.recover("t" * 200)
    assert done.run_state.cause.kind == "natural"


async def test_a_stop_after_inference_runs_none_of_the_steps_calls():
    ran: list[int] = []

    def stopper(hook_input):
        hook_input.execution.stop("enough")

    @tool
    def effect(x: int) -> str:
        ran.append(x)
        return "ok"

    agent = one_tool_agent(effect, hooks=[Hook(point="AfterInference", fn=stopper)])
    store = MemoryCommitStore()
    f = await InProcessRunner(agent, store).start("go", thread_id="t")
    assert f.run_state.cause.kind == "stopped" and f.run_state.cause.reason == "enough"
    assert ran == [] and results(f)[0].is_error
    labels = [r.commit.label for r in await store.read("t")]
    assert labels == ["activation", "inference", "ended"]


async def test_stop_from_inside_the_run_ends_stopped():
    def stopper(hook_input):
        hook_input.execution.stop("budget reached")

    @tool
    def noop(x: int) -> str:
        return "ok"

    agent = one_tool_agent(noop, hooks=[Hook(point="AfterTool", fn=stopper)])
    f = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t")
    assert f.run_state.cause.kind == "stopped" and f.run_state.cause.reason == "budget reached"


async def test_a_recovered_wait_keeps_its_deadline():
    """A driver lost once its wait landed: the recovery finds the Run at rest and
    commits nothing, so the ticket's deadline is the one committed with the wait (a wait
    committed again would arm a deadline from the recovery's clock)."""
    from runtime import Crash, FaultPlan, PermissionDecision

    from .agents import answer_within_an_hour

    store = MemoryCommitStore()
    runner = InProcessRunner(one_tool_agent(answer_within_an_hour), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", faults=FaultPlan(("after:awaiting", 1)))
    waiting = await store.load("t")
    assert waiting.run_state.ticket.deadline_us is not None
    recovered = await InProcessRunner(one_tool_agent(answer_within_an_hour), store).recover("t")
    assert (recovered.version, recovered.run_state) == (waiting.version, waiting.run_state)
    done = await runner.resume(command_for(recovered, PermissionDecision(approve=True)))
    assert done.run_state.cause.kind == "natural"
