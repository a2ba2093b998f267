"""Dual-side sessions on Ray: a side's tools run on the executors, and a human side's
turn parks the Run (idle, awaiting_human) until any host resumes it."""

from __future__ import annotations

import pytest

from runtime.lifecycle import AwaitingState, UserInput, answer

pytestmark = pytest.mark.ray


async def test_the_other_sides_tool_runs_on_an_executor_with_its_side(make_system):
    client = await make_system()
    handle = await client.start("tests.ray.session_agents:debate_agent", "write")
    done = await handle.result(timeout_s=60)
    assert done.run_state.cause.kind == "natural"
    results = [m.content for m in done.messages if m.kind == "tool_result"]
    assert results == ["b:critic"]
    answers = [(m.side, m.text) for m in done.messages if m.kind == "assistant" and m.text]
    assert answers == [("a", "a draft"), ("b", "critic heard b:critic")]


async def test_a_human_turn_parks_the_run_and_any_host_resumes_it(make_system):
    client = await make_system()
    handle = await client.start("tests.ray.session_agents:chat_agent", "write")
    parked = await handle.result(timeout_s=60)
    assert isinstance(parked.run_state, AwaitingState)
    status = await handle.status()
    assert (status.state, status.reason) == ("idle", "awaiting_human")
    for host in client.hosts:
        assert handle.thread_id not in await host.driving.remote()
    await handle.resume(answer(parked.run_state.ticket, UserInput(text="shorter")), host=1)
    done = await handle.result(timeout_s=60)
    assert done.run_state.cause.kind == "natural"
    said = [(m.side, m.text) for m in done.messages if m.kind in ("user", "assistant")]
    assert said == [(None, "write"), ("a", "a draft"), ("b", "shorter"), ("a", "a draft")]
