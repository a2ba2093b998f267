"""A trace across processes: the caller, the RunHost that drives the Run, the
ToolExecutor that runs its tool, and an HTTP caller of ``ratchet serve``.

The actors' spans cannot be read from an exporter in this process: the system's actors
get ``RATCHET_TRACE_FILE`` in their runtime_env and append every span to one file, a
JSON object a line, which the test reads. The agent is defined here: the actors import
it by reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from edge.app import create_app
from edge.options import ServeOptions
from runtime import Agent, ModelResponse, PermissionDecision, ScriptedModel, call, tool

from .conftest import wait_for

pytestmark = pytest.mark.ray
HERE = "tests.ray.test_tracing"


@tool(recovery=("replay_safe",))
def lookup(customer: str) -> str:
    # the tool's own instrumentation, in the executor's process: a child of its call's span
    with trace.get_tracer("tests.backend").start_as_current_span("backend lookup"):
        return f"{customer} is a gold customer"


@tool(needs_permission=True)
def wire(amount: int) -> str:
    return f"wired {amount}"


agent = Agent(
    name="traced",
    model=ScriptedModel(
        [
            ModelResponse(tool_calls=(call("lookup", "c1", customer="ada"),)),
            ModelResponse(tool_calls=(call("wire", "w1", amount=5),)),
            ModelResponse(text="Done."),
        ]
    ),
    tools=[lookup, wire],
)
quick = Agent(name="quick", model=ScriptedModel([ModelResponse(text="Hi.")]))


def read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hex_id(value: int, digits: int) -> str:
    return f"0x{value:0{digits}x}"


async def test_a_trace_goes_from_the_caller_through_the_host_to_the_executor(make_system, tmp_path):
    path = tmp_path / "spans.jsonl"
    env = {"runtime_env": {"env_vars": {"RATCHET_TRACE_FILE": str(path)}}}
    client = await make_system(host_options=(env, env), core_options=env)
    tracer = TracerProvider().get_tracer("tests.caller")  # this process's own spans

    with tracer.start_as_current_span("caller") as caller:
        awaiting = await client.run(f"{HERE}:agent", "pay ada", thread_id="t-traced")
    assert awaiting.run_state.kind == "awaiting"
    with tracer.start_as_current_span("approver") as approver:
        handle = client.handle("t-traced")
        await handle.respond(PermissionDecision(approve=True))
    done = await handle.result(timeout_s=60)
    assert done.run_state.cause.kind == "natural"

    # an HTTP caller's traceparent header makes its span the Run's parent
    http_trace, http_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    app = create_app(client, ServeOptions(no_auth=True), agents=[f"{HERE}:quick"])
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        answer = await http.post(
            "/threads/t-http/runs?wait=30",
            json={"agent": f"{HERE}:quick", "input": "hi"},
            headers={"traceparent": f"00-{http_trace}-{http_span}-01"},
        )
    assert answer.status_code == 201, answer.text

    def runs() -> list[dict[str, Any]]:
        return [s for s in read_spans(path) if s["name"] == "ratchet.run"]

    async def all_written() -> bool:
        names = {s["name"] for s in read_spans(path)}
        return len(runs()) == 3 and {"backend lookup", "execute_tool wire"} <= names

    await wait_for(all_written, timeout_s=30, what="the actors' spans in the trace file")
    spans = read_spans(path)
    by_id = {s["context"]["span_id"]: s for s in spans}
    first, resumed, http_run = sorted(runs(), key=lambda s: s["start_time"])

    # client -> RunHost: the drive's span is a child of the caller's, in its trace
    context = caller.get_span_context()
    assert first["context"]["trace_id"] == hex_id(context.trace_id, 32)
    assert first["parent_id"] == hex_id(context.span_id, 16)
    assert first["attributes"]["ratchet.run.state"] == "awaiting"
    host_pid = first["resource"]["attributes"]["process.pid"]

    # RunHost -> ToolExecutor: the tool's own span is a child of its call's, elsewhere
    [backend] = [s for s in spans if s["name"] == "backend lookup"]
    execute = by_id[backend["parent_id"]]
    assert execute["name"] == "execute_tool lookup"
    assert execute["attributes"]["ratchet.tool.outcome"] == "completed"
    step = by_id[execute["parent_id"]]
    assert step["name"] == "ratchet.step" and step["parent_id"] == first["context"]["span_id"]
    assert execute["resource"]["attributes"]["process.pid"] == host_pid
    assert backend["resource"]["attributes"]["process.pid"] != host_pid
    assert backend["context"]["trace_id"] == first["context"]["trace_id"]

    # the resume: a child of the approver's span, linked to the drive that awaited
    assert resumed["attributes"]["ratchet.run.way"] == "resume"
    assert resumed["parent_id"] == hex_id(approver.get_span_context().span_id, 16)
    assert [link["context"]["span_id"] for link in resumed["links"]] == [
        first["context"]["span_id"]
    ]
    [wired] = [s for s in spans if s["name"] == "execute_tool wire"]
    assert wired["context"]["trace_id"] == resumed["context"]["trace_id"]

    # ratchet serve: the request's traceparent is the parent of the Run it started
    assert http_run["context"]["trace_id"] == f"0x{http_trace}"
    assert http_run["parent_id"] == f"0x{http_span}"
    assert http_run["attributes"]["ratchet.agent"] == "quick"
