"""OpenTelemetry spans of Runs on the in-process runner (``runtime.tracing``).

Each test traces into an in-memory exporter through ``tracing.enable(provider)`` (the
global tracer provider is left alone: it can be set only once per process); the
configuration from ``OTEL_*`` runs in a subprocess of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from runtime import (
    Agent,
    Hook,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    ToolContext,
    answer,
    call,
    tool,
    tracing,
)
from runtime.errors import ModelUnavailable
from runtime.faults import Crash, FaultPlan
from runtime.models import InferenceRequest, Usage
from runtime.state import RESERVED_KEYS
from runtime.tools import OutcomeUnknown, UnavailableBeforeDispatch
from storage.memory import MemoryCommitStore

ROOT = str(Path(__file__).resolve().parents[2])


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def get_tracer(self, name: str) -> Tracer:
        return self.provider.get_tracer(name)


@pytest.fixture
def provider() -> Iterator[Traced]:
    traced = Traced()
    tracing.enable(traced.provider)
    yield traced
    tracing.disable()


def finished(traced: Traced) -> list[ReadableSpan]:
    return list(traced.exporter.get_finished_spans())


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[str]:
    return [s.name for s in spans if s.parent is not None and s.parent.span_id == span_id(parent)]


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def traceparent(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"


@tool(recovery=("replay_safe",))
def lookup(customer: str) -> str:
    return f"{customer} is a gold customer"


@tool(recovery=("never_replay",))
def charge(amount: int, ctx: ToolContext) -> str:
    return f"charged {amount}"


def billing(model: ScriptedModel | None = None) -> Agent:
    model = model or ScriptedModel(
        [
            ModelResponse(
                text="Checking.",
                tool_calls=(call("lookup", "c1", customer="ada"), call("charge", "c2", amount=4)),
            ),
            ModelResponse(text="Done."),
        ]
    )
    return Agent(name="billing", model=model, tools=[lookup, charge])


async def test_a_run_with_a_tool_batch_is_a_tree_of_run_step_inference_tools_commits(provider):
    store = MemoryCommitStore()
    frontier = await InProcessRunner(billing(), store).start("go", thread_id="t1")
    spans = finished(provider)
    [run] = named(spans, "ratchet.run")
    assert run.parent is None
    assert run.attributes["ratchet.thread.id"] == "t1"
    assert run.attributes["ratchet.run.id"] == frontier.run_id
    assert run.attributes["ratchet.agent"] == "billing"
    assert run.attributes["ratchet.run.way"] == "start"
    assert run.attributes["ratchet.run.state"] == "ended"
    assert run.attributes["ratchet.run.cause"] == "natural"
    assert children(spans, run) == ["ratchet.commit activation", "ratchet.step", "ratchet.step"]
    first, second = named(spans, "ratchet.step")
    assert (first.attributes["ratchet.step"], second.attributes["ratchet.step"]) == (0, 1)
    assert children(spans, first) == [
        "chat",
        "ratchet.commit inference",
        "execute_tool lookup",
        "execute_tool charge",
        "ratchet.commit results",
    ]
    assert children(spans, second) == ["chat", "ratchet.commit ended"]
    records = await store.read("t1")
    commits = [s for s in spans if s.name.startswith("ratchet.commit ")]
    assert [
        (s.attributes["ratchet.commit.label"], s.attributes["ratchet.commit.version"])
        for s in commits
    ] == [(r.commit.label, r.seq) for r in records]
    assert {s.kind for s in commits} == {SpanKind.CLIENT}
    [looked_up] = named(spans, "execute_tool lookup")
    assert dict(looked_up.attributes) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": "c1",
        "ratchet.operation.id": f"tool-batch:{frontier.run_id}:0:c1",
        "ratchet.tool.attempt": 1,
        "ratchet.tool.outcome": "completed",
    }
    assert looked_up.kind == SpanKind.INTERNAL
    assert {s.context.trace_id for s in spans} == {run.context.trace_id}
    # the drive's traceparent rides in its first commit: the activation
    assert records[0].commit.commands[-1].key == tracing.TRACE_KEY
    [kept] = frontier.state["run"][tracing.TRACE_KEY]
    assert kept.startswith(traceparent(run))
    assert all(tracing.TRACE_KEY not in [c.key for c in r.commit.commands] for r in records[1:])


class Provider(ScriptedModel):
    """A scripted model that names itself as an adapter does, and fails its first try."""

    model = "gpt-test"
    provider_name = "openai"
    max_tokens = 64

    def __init__(self) -> None:
        answer_ = ModelResponse(
            text="Hello.", usage=Usage(input_tokens=12, output_tokens=3, model="gpt-test-0613")
        )
        super().__init__([self.first_fails(answer_)])
        self.tries = 0

    def first_fails(self, response: ModelResponse):
        def entry(request: InferenceRequest) -> ModelResponse:
            self.tries += 1
            if self.tries == 1:
                raise ModelUnavailable("status_500", "the provider had a bad moment")
            return response

        return entry


async def test_inference_spans_follow_the_genai_semantic_conventions(provider):
    await InProcessRunner(Agent(name="a", model=Provider()), MemoryCommitStore()).start(
        "hi", thread_id="conv-1"
    )
    failed, answered = named(finished(provider), "chat gpt-test")
    for span in (failed, answered):
        assert span.kind == SpanKind.CLIENT
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.provider.name"] == "openai"
        assert span.attributes["gen_ai.request.model"] == "gpt-test"
        assert span.attributes["gen_ai.request.max_tokens"] == 64
        assert span.attributes["gen_ai.conversation.id"] == "conv-1"
        assert span.attributes["ratchet.step"] == 0
    assert failed.attributes["ratchet.inference.attempt"] == 1
    assert failed.attributes["error.type"] == "status_500"
    assert failed.status.status_code == StatusCode.ERROR
    assert answered.attributes["ratchet.inference.attempt"] == 2
    assert answered.attributes["gen_ai.response.model"] == "gpt-test-0613"
    assert answered.attributes["gen_ai.usage.input_tokens"] == 12
    assert answered.attributes["gen_ai.usage.output_tokens"] == 3
    assert "error.type" not in answered.attributes


async def test_a_recovered_drive_links_to_the_crashed_one(provider):
    store = MemoryCommitStore()
    runner = InProcessRunner(billing(), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t1", faults=FaultPlan(crash_at=("before:results", 1)))
    frontier = await runner.recover("t1")
    assert frontier.run_state.cause.kind == "natural"
    crashed, recovered = named(finished(provider), "ratchet.run")
    assert recovered.attributes["ratchet.run.way"] == "recover"
    assert crashed.context.trace_id != recovered.context.trace_id  # each drive its own trace
    assert [(link.context.trace_id, link.context.span_id) for link in recovered.links] == [
        (crashed.context.trace_id, crashed.context.span_id)
    ]
    kept = frontier.state["run"][tracing.TRACE_KEY]
    assert len(kept) == 2
    assert kept[0].startswith(traceparent(crashed)) and kept[1].startswith(traceparent(recovered))
    # the recovered drive: lookup (replay_safe) ran again, charge (never_replay) did not
    spans = finished(provider)
    again = [
        s for s in named(spans, "execute_tool lookup") if s.attributes["ratchet.tool.attempt"] == 2
    ]
    assert len(again) == 1 and again[0].context.trace_id == recovered.context.trace_id
    assert len(named(spans, "execute_tool charge")) == 1


async def test_a_resumed_drive_links_to_the_drive_that_awaited(provider):
    @tool(needs_permission=True)
    def wire(amount: int) -> str:
        return f"wired {amount}"

    model = ScriptedModel(
        [ModelResponse(tool_calls=(call("wire", "w1", amount=5),)), ModelResponse(text="Sent.")]
    )
    runner = InProcessRunner(Agent(name="payer", model=model, tools=[wire]), MemoryCommitStore())
    waiting = await runner.start("pay", thread_id="t1")
    done = await runner.resume(answer(waiting.run_state.ticket, PermissionDecision(approve=True)))
    assert done.run_state.cause.kind == "natural"
    first, resumed = named(finished(provider), "ratchet.run")
    assert first.attributes["ratchet.run.state"] == "awaiting"
    assert resumed.attributes["ratchet.run.way"] == "resume"
    assert [link.context.span_id for link in resumed.links] == [first.context.span_id]
    assert len(done.state["run"][tracing.TRACE_KEY]) == 2
    [wired] = named(finished(provider), "execute_tool wire")
    assert wired.context.trace_id == resumed.context.trace_id


async def test_each_tool_outcome_is_on_its_span(provider):
    tries: dict[str, int] = {}

    @tool(recovery=("replay_safe",))
    def flaky(ctx: ToolContext) -> str:
        tries["flaky"] = tries.get("flaky", 0) + 1
        if tries["flaky"] == 1:
            raise OutcomeUnknown("the connection dropped")
        return "ok"

    @tool(recovery=("never_replay",))
    def once(ctx: ToolContext) -> str:
        raise OutcomeUnknown("the connection dropped")

    @tool(recovery=("never_replay",))
    def closed(ctx: ToolContext) -> str:
        tries["closed"] = tries.get("closed", 0) + 1
        if tries["closed"] == 1:
            raise UnavailableBeforeDispatch("not open yet")
        return "open now"

    @tool
    def broken() -> str:
        raise ValueError("no")

    calls = (call("flaky", "a"), call("once", "b"), call("closed", "c"), call("broken", "d"))
    model = ScriptedModel([ModelResponse(tool_calls=calls), ModelResponse(text="Done.")])
    agent = Agent(name="a", model=model, tools=[flaky, once, closed, broken])
    await InProcessRunner(agent, MemoryCommitStore()).start("go")
    outcomes = {
        (s.attributes["gen_ai.tool.name"], s.attributes["ratchet.tool.attempt"]): (
            s.attributes["ratchet.tool.outcome"],
            s.attributes.get("error.type"),
            s.status.status_code,
        )
        for s in finished(provider)
        if s.name.startswith("execute_tool ")
    }
    assert outcomes == {
        ("flaky", 1): ("lost", "lost", StatusCode.ERROR),
        ("flaky", 2): ("completed", None, StatusCode.UNSET),
        ("once", 1): ("indeterminate", "indeterminate", StatusCode.ERROR),
        ("closed", 1): ("unavailable", "unavailable", StatusCode.ERROR),
        ("closed", 2): ("completed", None, StatusCode.UNSET),
        ("broken", 1): ("completed", "tool_error", StatusCode.ERROR),
    }


async def test_the_callers_span_is_the_parent_and_the_tool_runs_inside_its_own(provider):
    tracer = provider.get_tracer("tests")

    @tool
    async def measured() -> str:
        with tracer.start_as_current_span("inside the tool"):
            return "done"

    @tool
    def threaded() -> str:  # a synchronous tool: its thread gets the context too
        with tracer.start_as_current_span("inside the thread"):
            return "done"

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("measured", "m"), call("threaded", "t"))),
            ModelResponse(text="Done."),
        ]
    )
    agent = Agent(name="a", model=model, tools=[measured, threaded])
    with tracer.start_as_current_span("caller") as caller:
        await InProcessRunner(agent, MemoryCommitStore()).start("go")
    spans = finished(provider)
    [run] = named(spans, "ratchet.run")
    assert run.parent is not None and run.parent.span_id == caller.get_span_context().span_id
    for tool_name, inner in (("measured", "inside the tool"), ("threaded", "inside the thread")):
        [execute] = named(spans, f"execute_tool {tool_name}")
        [inside] = named(spans, inner)
        assert inside.parent is not None and inside.parent.span_id == span_id(execute)


async def test_tracing_off_makes_no_span_and_adds_nothing_to_a_commit(provider):
    tracing.disable()
    store = MemoryCommitStore()
    with provider.get_tracer("tests").start_as_current_span("caller"):
        frontier = await InProcessRunner(billing(), store).start("go", thread_id="t1")
    assert [s.name for s in finished(provider)] == ["caller"]
    assert tracing.TRACE_KEY not in frontier.state["run"]
    assert all(
        c.key != tracing.TRACE_KEY for r in await store.read("t1") for c in r.commit.commands
    )
    assert not tracing.active()


def test_no_hook_or_tool_writes_the_trace_key():
    assert f"run:{tracing.TRACE_KEY}" in RESERVED_KEYS


def test_importing_runtime_imports_no_opentelemetry():
    code = (
        "import sys, runtime, runtime.engine, runtime.runner\n"
        "import runtime.tracing, runtime.tracing_env, runtime.tools, runtime.tool_calls\n"
        "import runtime.toolbatch\n"
        "print([m for m in sys.modules if m.startswith('opentelemetry')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


SCRIPT = """
import asyncio
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call, tool
from storage.memory import MemoryCommitStore

@tool
def lookup(customer: str) -> str:
    return customer

model = ScriptedModel([ModelResponse(tool_calls=(call("lookup", "c1", customer="ada"),)),
                       ModelResponse(text="Done.")])
runner = InProcessRunner(Agent(name="env", model=model, tools=[lookup]), MemoryCommitStore())
print("OUTCOME", asyncio.run(runner.start("go")).run_state.cause.kind)
"""


def run_script(tmp_path: Path, path: Path | None = None, **env: str) -> tuple[str, list[dict]]:
    path = path or tmp_path / "spans.jsonl"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    clean.update(env, RATCHET_TRACE_FILE=str(path), PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=clean,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = path.read_text().splitlines() if path.is_file() else []
    return out.stdout, [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_PROPAGATORS": "b3"},  # not installed: its import failed every tool call
        {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "-1"},  # raised as the SDK was imported
    ],
)
def test_a_tracing_setting_that_cannot_be_used_costs_spans_never_the_run(tmp_path, env):
    stdout, _ = run_script(tmp_path, **env)
    assert "OUTCOME natural" in stdout


def test_a_trace_file_that_is_no_regular_file_is_refused_not_waited_on(tmp_path):
    """A pipe nobody reads blocked the process at its open (every RunHost on Ray); one
    whose reader stopped, at a span's write, on the loop that drives the Runs."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    stdout, _ = run_script(tmp_path, fifo)
    assert "OUTCOME natural" in stdout


def test_the_otel_environment_configures_the_sdk(tmp_path):
    stdout, spans = run_script(tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="svc")
    assert '"name": "ratchet.run"' in stdout  # the SDK's console exporter, chosen by name
    names = [s["name"] for s in spans]  # RATCHET_TRACE_FILE: the same spans, a line each
    assert {"ratchet.run", "ratchet.step", "chat", "execute_tool lookup"} <= set(names)
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"svc"}
    [run] = [s for s in spans if s["name"] == "ratchet.run"]
    [step, _] = [s for s in spans if s["name"] == "ratchet.step"]
    assert step["parent_id"] == run["context"]["span_id"]


def test_otel_sdk_disabled_turns_tracing_off(tmp_path):
    stdout, spans = run_script(tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert spans == [] and "ratchet" not in stdout


@pytest.mark.parametrize("when", ["start", "end"])
@pytest.mark.parametrize(
    "name", ["ratchet.run", "ratchet.step", "chat", "execute_tool", "ratchet.commit"]
)
async def test_a_span_processor_that_raises_costs_spans_never_the_run(when, name):
    """The SDK lets what an application's span processor raises through to whoever
    starts or ends the span: a Run failed, or stayed running with no end committed, or
    a bare RuntimeError reached the caller."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Raising(SpanProcessor):
        def on_start(self, span, parent_context=None):  # type: ignore[no-untyped-def]
            if when == "start" and span.name.startswith(name):
                raise RuntimeError("on_start")

        def on_end(self, span):  # type: ignore[no-untyped-def]
            if when == "end" and span.name.startswith(name):
                raise RuntimeError("on_end")

    traced = Traced()
    traced.provider.add_span_processor(Raising())
    tracing.enable(traced.provider)
    try:
        store = MemoryCommitStore()
        frontier = await InProcessRunner(billing(), store).start("go", thread_id="t1")
    finally:
        tracing.disable()
    assert frontier.run_state.kind == "ended" and frontier.run_state.cause.kind == "natural"
    assert [r.commit.label for r in await store.read("t1")][-1] == "ended"
    if name not in ("ratchet.run", "ratchet.commit"):  # the other spans are made
        assert "ratchet.commit ended" in {s.name for s in finished(traced)}


async def test_a_commit_span_says_how_many_commits_shared_its_transaction(provider, tmp_path):
    import asyncio

    from storage.sql import SqlCommitStore

    store = await SqlCommitStore.connect(f"sqlite:///{tmp_path}/group.db")
    try:
        runner = InProcessRunner(billing(), store)
        await asyncio.gather(*(runner.start("go", thread_id=f"g{i}") for i in range(8)))
        sizes = [
            s.attributes["ratchet.commit.group_size"]
            for s in finished(provider)
            if s.name.startswith("ratchet.commit ")
        ]
        assert len(sizes) == 8 * 4 and all(n >= 1 for n in sizes)
        assert max(sizes) > 1  # eight Runs at once: the group writer shared transactions
    finally:
        await store.close()


@pytest.mark.parametrize("fails", ["inject", "extract"])
async def test_a_propagator_that_raises_costs_trace_context_never_the_run(provider, fails):
    """The global text-map propagator is the application's to set; one that raises as
    a call's context is carried to its tool (after the executing commit), or as a
    drive or a tool continues a caller's, failed the Run ``internal`` and left its
    never_replay call's outcome unknown."""
    from opentelemetry import propagate
    from opentelemetry.context import get_current
    from opentelemetry.propagators.textmap import TextMapPropagator

    class Raising(TextMapPropagator):
        def inject(self, carrier, context=None, setter=None):  # type: ignore[no-untyped-def]
            if fails == "inject":
                raise RuntimeError("inject")
            carrier["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"

        def extract(self, carrier, context=None, getter=None):  # type: ignore[no-untyped-def]
            if fails == "extract":
                raise RuntimeError("extract")
            return context or get_current()

        @property
        def fields(self) -> set[str]:
            return {"traceparent"}

    was = propagate.get_global_textmap()
    propagate.set_global_textmap(Raising())
    try:
        tracer = provider.get_tracer("tests")
        store = MemoryCommitStore()
        with tracer.start_as_current_span("caller"):
            frontier = await InProcessRunner(billing(), store).start("go", thread_id="t1")
    finally:
        propagate.set_global_textmap(was)
    assert frontier.run_state.kind == "ended" and frontier.run_state.cause.kind == "natural"
    assert "execute_tool charge" in {s.name for s in finished(provider)}


@pytest.mark.parametrize("given", ["thread", "run"])
@pytest.mark.parametrize("value", ["t\ud800", "t" * 5_000_000])
async def test_a_refused_id_is_shown_on_the_span_exportable_and_cut(provider, given, value):
    """A start's ids are put on its span before the engine checks them: a lone surrogate
    made the span unencodable by OTLP (its batch, other Runs' spans with it, dropped),
    megabytes went out whole."""
    from runtime.errors import InputRefused

    ids = {"thread_id": value} if given == "thread" else {"thread_id": "t1", "run_id": value}
    with pytest.raises(InputRefused):
        await InProcessRunner(billing(), MemoryCommitStore()).start("go", **ids)
    [run] = named(finished(provider), "ratchet.run")
    shown = run.attributes[f"ratchet.{given}.id"]
    assert isinstance(shown, str) and len(shown) <= tracing.ATTRIBUTE_ID_CHARS
    shown.encode("utf-8")  # strict: what an exporter encodes


@pytest.mark.parametrize("switched", ["on", "off"])
async def test_tracing_switched_during_a_drive_keeps_to_the_drives_decision(switched):
    """Whether a drive is traced is decided as it starts: switched on in the middle of
    an untraced drive, its later inferences and tool calls made root spans, each in a
    trace of its own; switched off in a traced one, its tree lost them."""
    traced = Traced()
    if switched == "off":
        tracing.enable(traced.provider)

    def flip(hook_input: Any) -> None:
        if hook_input.step == 0:
            tracing.enable(traced.provider) if switched == "on" else tracing.disable()

    hooks = [Hook("AfterInference", flip)]
    agent = Agent(name="a", model=billing().model, tools=billing().tools, hooks=hooks)
    try:
        frontier = await InProcessRunner(agent, MemoryCommitStore()).start("go", thread_id="t1")
    finally:
        tracing.disable()
    assert frontier.run_state.kind == "ended" and frontier.run_state.cause.kind == "natural"
    spans = finished(traced)
    if switched == "on":
        assert spans == []
    else:
        [run] = named(spans, "ratchet.run")
        assert {s.context.trace_id for s in spans} == {run.context.trace_id}
        assert len(named(spans, "execute_tool charge")) == 1 and len(named(spans, "chat")) == 2
