"""ExecutionState for hooks and tools, hook reactions, injected messages, and the state
keys hooks and tools may write (DESIGN §8-9, seed execution-state-and-run-status §2-3)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime import (
    Agent,
    Crash,
    DenyCall,
    EndedState,
    FaultPlan,
    Hook,
    HookOutput,
    InjectMessage,
    InProcessRunner,
    ModelResponse,
    RequestInput,
    ScriptedModel,
    StopRun,
    ToolContext,
    ToolResult,
    UserInput,
    answer,
    call,
    tool,
)
from runtime.injection import INJECTED_KEY
from runtime.plugins import CapabilityBound, Contributions, Plugin, PluginManifest
from runtime.state import RESERVED_KEYS, Command
from storage.memory import MemoryCommitStore


def texts(messages) -> list[tuple[str, str]]:
    return [(m.kind, getattr(m, "text", "") or getattr(m, "content", "")) for m in messages]


def scripted(*responses: ModelResponse, seen: list | None = None) -> ScriptedModel:
    def answer(i: int, response: ModelResponse):
        def respond(request):
            if seen is not None:
                seen.append(texts(request.messages))
            return response

        return respond

    return ScriptedModel([answer(i, r) for i, r in enumerate(responses)])


async def start(agent: Agent, store=None, **kw):
    return await InProcessRunner(agent, store or MemoryCommitStore()).start(
        "go", thread_id="t", run_id="r", **kw
    )


# ---- what tools and hooks see ---------------------------------------------------------


async def test_a_tool_and_a_hook_see_the_same_execution_state_in_one_step():
    seen: dict[str, dict] = {}

    def fields(execution) -> dict:
        return {
            "flow_id": execution.flow_id,
            "current_side": execution.current_side,
            "step_count": execution.step_count,
            "side_a_step_count": execution.side_a_step_count,
            "side_b_step_count": execution.side_b_step_count,
            "stopped": execution.stopped,
            "stopped_by": execution.stopped_by,
            "prompt_path": tuple(execution.prompt_path),
            "aborted": execution.abort_signal.is_set(),
        }

    @tool
    def probe(ctx: ToolContext) -> str:
        seen["tool"] = fields(ctx.execution)
        return "ok"

    def after_tool(h):
        seen["hook"] = fields(h.execution)

    model = scripted(
        ModelResponse(text="a", tool_calls=(call("probe", "c1"),)),
        ModelResponse(text="b", tool_calls=(call("probe", "c2"),)),
        ModelResponse(text="done"),
    )
    agent = Agent(name="prober", model=model, tools=[probe], hooks=[Hook("AfterTool", after_tool)])
    f = await start(agent)
    assert f.run_state.cause.kind == "natural"
    expected = {
        "flow_id": "r",
        "current_side": "a",
        "step_count": 1,
        "side_a_step_count": 1,
        "side_b_step_count": 0,
        "stopped": False,
        "stopped_by": None,
        "prompt_path": ("prober",),
        "aborted": False,
    }
    assert seen == {"tool": expected, "hook": expected}


async def test_a_tool_without_sees_history_is_not_sent_the_history():
    @tool
    def plain(ctx: ToolContext) -> str:
        try:
            _ = ctx.execution.message_history
        except AttributeError as exc:
            return str(exc)
        return "sent"

    model = scripted(ModelResponse(tool_calls=(call("plain", "c1"),)), ModelResponse(text="done"))
    f = await start(Agent(name="a", model=model, tools=[plain]))
    assert "sees_history=True" in f.messages[-2].content


async def test_a_timed_out_synchronous_tool_sees_its_abort_signal():
    release = threading.Event()
    observed: list[bool] = []

    @tool(timeout_s=0.05, recovery=("never_replay",))
    def slow(ctx: ToolContext) -> str:
        # polls its abort signal as a blocking client would (deadline, never forever)
        observed.append(ctx.execution.abort_signal.is_set())
        for _ in range(2000):
            if ctx.execution.abort_signal.is_set():
                observed.append(True)
                release.set()
                return "gave up"
            release.wait(0.005)
        return "never aborted"

    model = scripted(ModelResponse(tool_calls=(call("slow", "c1"),)), ModelResponse(text="done"))
    f = await start(Agent(name="a", model=model, tools=[slow]))
    assert release.wait(10), "the tool never saw its abort signal"
    assert observed == [False, True]
    result = next(m for m in f.messages if m.kind == "tool_result")
    assert result.is_error and "timed out" in result.content  # lost, never_replay


# ---- reactions ------------------------------------------------------------------------


async def test_a_hook_denies_a_call_by_reaction_and_the_tool_never_runs():
    ran: list[str] = []

    @tool
    def wire(amount: int) -> str:
        ran.append(str(amount))
        return "sent"

    def review(h):
        big = [c.call_id for c in h.response.tool_calls if '"amount": 5000' in c.arguments]
        return HookOutput(reactions=[DenyCall(call_id=c, reason="over the limit") for c in big])

    model = scripted(
        ModelResponse(tool_calls=(call("wire", "c1", amount=5000), call("wire", "c2", amount=5))),
        ModelResponse(text="done"),
    )
    agent = Agent(name="a", model=model, tools=[wire], hooks=[Hook("AfterInference", review)])
    f = await start(agent)
    assert ran == ["5"]
    results = {m.call_id: m.content for m in f.messages if m.kind == "tool_result"}
    assert results == {"c1": "denied: over the limit", "c2": "sent"}


async def test_deny_call_outside_after_inference_fails_the_run_as_the_hooks_fault():
    def early(h):
        return HookOutput(reactions=[DenyCall(call_id="c1", reason="no")])

    model = scripted(ModelResponse(text="done"))
    f = await start(Agent(name="a", model=model, hooks=[Hook("StepStart", early)]))
    assert f.run_state.cause.kind == "failed" and f.run_state.cause.failure == "hook"
    assert "deny_call is an AfterInference reaction" in f.run_state.cause.message


async def test_stop_and_request_input_are_reactions():
    def stop(h):
        return HookOutput(reactions=[StopRun(reason="enough")])

    model = scripted(ModelResponse(tool_calls=(call("noop", "c1"),)), ModelResponse(text="x"))

    @tool
    def noop() -> str:
        return "ok"

    f = await start(Agent(name="a", model=model, tools=[noop], hooks=[Hook("AfterTool", stop)]))
    assert f.run_state.cause.kind == "stopped" and f.run_state.cause.reason == "enough"

    def ask(h):
        return HookOutput(reactions=[RequestInput(prompt="Which account?")])

    model = scripted(ModelResponse(tool_calls=(call("noop", "c1"),)), ModelResponse(text="x"))
    f = await start(Agent(name="a", model=model, tools=[noop], hooks=[Hook("StepEnd", ask)]))
    assert f.run_state.kind == "awaiting"
    assert f.run_state.ticket.target.prompt == "Which account?"


async def test_a_tool_stops_its_run_through_its_execution():
    @tool
    def finish(ctx: ToolContext) -> str:
        ctx.execution.stop("the tool had enough")
        return "ok"

    model = scripted(ModelResponse(tool_calls=(call("finish", "c1"),)), ModelResponse(text="x"))
    f = await start(Agent(name="a", model=model, tools=[finish]))
    assert f.run_state.cause.kind == "stopped"
    assert f.run_state.cause.reason == "the tool had enough"
    assert f.messages[-1].content == "ok"  # its result was committed first


# ---- injected messages ----------------------------------------------------------------


@tool(concurrency="serial", recovery=("replay_safe",))
def note(ctx: ToolContext, text: str) -> str:
    ctx.execution.inject_message(text)
    return "noted"


@tool(concurrency="serial", sees_history=True)
def recall(ctx: ToolContext) -> str:
    return " | ".join(m.text for m in ctx.execution.message_history if m.kind == "user")


def injecting_agent(seen_requests: list, seen_by_hook: list) -> Agent:
    def after_tool(h):
        if h.call.tool == "recall":
            seen_by_hook.append([m.text for m in h.execution.message_history if m.kind == "user"])

    model = scripted(
        ModelResponse(tool_calls=(call("note", "c1", text="remember me"), call("recall", "c2"))),
        ModelResponse(text="done"),
        seen=seen_requests,
    )
    return Agent(name="a", model=model, tools=[note, recall], hooks=[Hook("AfterTool", after_tool)])


async def test_an_injected_message_is_visible_to_later_tools_and_hooks_and_then_committed():
    requests: list = []
    by_hook: list = []
    f = await start(injecting_agent(requests, by_hook))
    assert f.run_state.cause.kind == "natural"
    recalled = next(m.content for m in f.messages if m.kind == "tool_result" and m.call_id == "c2")
    assert recalled == "go | remember me"  # the later tool of the same Step saw it
    assert by_hook == [["go", "remember me"]]
    # the next inference was sent it after the Step's results, and it is committed there
    assert requests[1][-3:] == [
        ("tool_result", "noted"),
        ("tool_result", "go | remember me"),
        ("user", "remember me"),
    ]
    assert texts(f.messages)[-2:] == [("user", "remember me"), ("assistant", "done")]
    assert INJECTED_KEY not in f.state["run"]


async def test_a_hook_injects_before_inference_and_the_model_is_sent_it_once():
    requests: list = []
    later: list = []

    def step_start(h):
        if h.step == 0:
            return HookOutput(reactions=[InjectMessage(text="policy: be brief")])
        return None

    def before(h):
        later.append([m.text for m in h.execution.message_history if m.kind == "user"])

    model = scripted(
        ModelResponse(tool_calls=(call("note", "c1", text="x"),)),
        ModelResponse(text="done"),
        seen=requests,
    )
    hooks = [Hook("StepStart", step_start), Hook("BeforeInference", before)]
    f = await start(Agent(name="a", model=model, tools=[note], hooks=hooks))
    assert later[0] == ["go", "policy: be brief"]  # the next hook saw it at once
    assert requests[0] == [("user", "go"), ("user", "policy: be brief")]
    users = [m.text for m in f.messages if m.kind == "user"]
    assert users == ["go", "policy: be brief", "x"]  # each once


def _fault_points() -> list[tuple[str, int]]:
    plan = FaultPlan()
    asyncio.run(start(injecting_agent([], []), faults=plan))
    return plan.seen


@pytest.mark.parametrize("point", _fault_points(), ids=lambda p: f"{p[0]}#{p[1]}")
async def test_an_injected_message_survives_a_crash_and_lands_once(point):
    store = MemoryCommitStore()
    with pytest.raises(Crash):
        await start(injecting_agent([], []), store, faults=FaultPlan(crash_at=point))
    fresh = InProcessRunner(injecting_agent([], []), store)
    if await store.read("t"):
        f = await fresh.recover("t")
    else:  # nothing committed: the caller redelivers the start, idempotent by run id
        f = await fresh.start("go", thread_id="t", run_id="r")
    assert isinstance(f.run_state, EndedState) and f.run_state.cause.kind == "natural"
    # the replay-safe call re-runs if its result was not committed: its injection is
    # committed with the result it is part of, so it lands exactly once either way
    assert [m.text for m in f.messages if m.kind == "user"] == ["go", "remember me"]
    assert INJECTED_KEY not in f.state["run"]


# ---- which state keys hooks and tools may write ---------------------------------------


@pytest.mark.parametrize("key", sorted(RESERVED_KEYS))
async def test_no_hook_writes_a_key_ratchet_keeps(key):
    scope, _, name = key.partition(":")

    def forge(h):
        return HookOutput(commands=[Command(key=name, scope=scope, value=1)])

    model = scripted(ModelResponse(text="done"))
    f = await start(Agent(name="a", model=model, hooks=[Hook("StepStart", forge)]))
    assert f.run_state.cause.failure == "hook"
    assert "reserved_key" in f.run_state.cause.message


def test_every_key_the_runtime_keeps_is_reserved():
    from runtime.context import STEP_ENDED, WAIT_KEY
    from runtime.delegation import CHILDREN_KEY, PARENT_KEY
    from runtime.plugin_env import PLUGINS_KEY
    from runtime.session import FORCED_KEY
    from runtime.usage import BUDGET_FROM, MODEL_KEY, USAGE_KEY

    kept = {STEP_ENDED, CHILDREN_KEY, PARENT_KEY, PLUGINS_KEY, BUDGET_FROM, MODEL_KEY, USAGE_KEY}
    assert {f"run:{k}" for k in (*kept, INJECTED_KEY, FORCED_KEY, WAIT_KEY)} <= RESERVED_KEYS


def test_every_reserved_key_has_the_shape_an_import_holds_it_to():
    from runtime.reserved import SHAPES

    assert SHAPES.keys() == RESERVED_KEYS


def keeper(**made) -> Plugin:
    bound = CapabilityBound(
        tools=frozenset({"stash"}),
        hook_points=frozenset({"StepEnd"}),
        state_keys=frozenset({"thread:notes"}),
    )
    manifest = PluginManifest(id="keeper", version="1", bound=bound)
    return Plugin(manifest, lambda: Contributions(state_keys={"thread:notes": "disjoint"}, **made))


async def test_a_plugins_hook_writes_only_the_keys_its_plugin_declared():
    def undeclared(h):
        return HookOutput(commands=[Command(key="other", value=1)])

    def wrong_policy(h):
        return HookOutput(commands=[Command(key="notes", value={"a": 1})])

    for fn, rule in ((undeclared, "undeclared_key"), (wrong_policy, "merge_policy")):
        plugin = keeper(hooks=[Hook("StepEnd", fn)])
        model = scripted(
            ModelResponse(tool_calls=(call("note", "c1", text="x"),)), ModelResponse(text="done")
        )
        f = await start(Agent(name="a", model=model, tools=[note], plugins=[plugin]))
        assert f.run_state.cause.failure == "hook", rule
        assert rule in f.run_state.cause.message


async def test_a_plugins_tool_writing_an_undeclared_key_gets_a_model_visible_error():
    @tool
    def stash() -> ToolResult:
        return ToolResult(content="stashed", commands=[Command(key="elsewhere", value=1)])

    model = scripted(ModelResponse(tool_calls=(call("stash", "c1"),)), ModelResponse(text="done"))
    f = await start(Agent(name="a", model=model, plugins=[keeper(tools=[stash])]))
    result = next(m for m in f.messages if m.kind == "tool_result")
    assert result.is_error and "undeclared_key" in result.content
    assert "elsewhere" not in f.state["thread"]


async def test_a_stop_or_a_wait_asked_at_step_start_comes_before_the_inference():
    asked: list[int] = []

    def count(request):
        asked.append(request.step)
        return ModelResponse(tool_calls=(call("note", f"c{request.step}", text="x"),))

    def stop_at_one(h):
        return HookOutput(reactions=[StopRun(reason="enough")]) if h.step == 1 else None

    model = ScriptedModel([count] * 4)
    agent = Agent(name="a", model=model, tools=[note], hooks=[Hook("StepStart", stop_at_one)])
    f = await start(agent)
    assert asked == [0]  # Step 1's inference never ran
    assert (f.run_state.cause.kind, f.run_state.cause.reason) == ("stopped", "enough")
    assert [m.content for m in f.messages if m.kind == "tool_result"] == ["noted"]

    asked.clear()

    def ask_at_one(h):  # the Step starts over on the resume: ask once
        answered = any(m.kind == "user" and m.text == "yes" for m in h.execution.message_history)
        if h.step == 1 and not answered:
            return HookOutput(reactions=[RequestInput(prompt="more?")])
        return None

    model = ScriptedModel([count, ModelResponse(text="done")])
    agent = Agent(name="a", model=model, tools=[note], hooks=[Hook("StepStart", ask_at_one)])
    runner = InProcessRunner(agent, MemoryCommitStore())
    f = await runner.start("go", thread_id="t", run_id="r")
    assert asked == [0] and f.run_state.ticket.target.prompt == "more?"
    f = await runner.resume(answer(f.run_state.ticket, UserInput(text="yes")))
    assert f.run_state.cause.kind == "natural"
    # the tool's injection, staged before the wait, is written before the answer
    assert [m.text for m in f.messages if m.kind == "user"] == ["go", "x", "yes"]
