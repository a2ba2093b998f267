"""Placement: many hosted Runs per host, a dedicated Run, resource-routed tools."""

from __future__ import annotations

import json
import time

import pytest

from runtime.errors import AgentImportError, InvalidTransition
from runtime.messages import ToolResultMessage

from .conftest import actor_gone, wait_for

pytestmark = pytest.mark.ray
CONCURRENT = 500


async def test_500_concurrent_hosted_runs_finish(make_system):
    client = await make_system()
    began = time.monotonic()
    handles = [
        await client.start("tests.ray.agents:quick_agent", f"hi {i}") for i in range(CONCURRENT)
    ]
    summaries = await client.wait_all(handles, timeout_s=240)
    elapsed = time.monotonic() - began
    assert len(summaries) == CONCURRENT
    assert {s.cause for s in summaries} == {"natural"}
    assert {s.status.state for s in summaries} == {"idle"}
    infos = [await h.info.remote() for h in client.hosts]
    assert sum(i["finished"] for i in infos) >= CONCURRENT
    assert all(i["finished"] > CONCURRENT // 4 for i in infos), infos  # spread over the pool
    assert all(i["driving"] == 0 for i in infos)  # ended Runs hold nothing
    print(f"{CONCURRENT} runs in {elapsed:.1f}s")


async def test_a_dedicated_run_gets_a_host_of_its_own(make_system):
    client = await make_system()
    handle = await client.start(
        "tests.ray.agents:quick_agent", "alone", thread_id="dedicated-1", placement="dedicated"
    )
    frontier = await handle.result(timeout_s=60)
    assert frontier.run_state.cause.kind == "natural"
    name = client.spec.dedicated_name("dedicated-1")
    assert frontier.owner.startswith(name)
    await wait_for(actor_gone(name), what="the dedicated host to retire after its Run")


@pytest.mark.parametrize("first", ["hosted", "dedicated"])
async def test_a_start_asked_again_with_the_other_placement_joins_its_run(make_system, first):
    """A retry through another door (the HTTP edge's default placement, say) asks the same
    Run: it joins it, wherever it runs. It was refused as "another input or agent"."""
    client = await make_system()
    thread, run = f"again-{first}", f"again-{first}-run"
    other = "dedicated" if first == "hosted" else "hosted"
    agent = "tests.ray.agents:quick_agent"
    original = await client.start(agent, "hi", thread_id=thread, run_id=run, placement=first)
    again = await client.start(agent, "hi", thread_id=thread, run_id=run, placement=other)
    assert again.run_id == original.run_id
    frontier = await again.result(timeout_s=60)
    assert frontier.run_id == run and frontier.run_state.cause.kind == "natural"
    assert [m.text for m in frontier.messages if getattr(m, "id", "").startswith(run)] == ["hi"]
    with pytest.raises(InvalidTransition, match="another input or agent"):
        await client.start(agent, "bye", thread_id=thread, run_id=run, placement=other)


@pytest.mark.parametrize("placement", ["hosted", "dedicated"])
async def test_run_starts_and_returns_the_run_at_rest(make_system, placement, monkeypatch):
    # the store is asked every HOST_CHECK_S while the host's notice is awaited (a hung
    # host never answers): a machine under load can take that long, and that look is
    # not the read back counted here
    monkeypatch.setattr("cluster.waiting.HOST_CHECK_S", 3600.0)
    client = await make_system()
    thread = f"run-{placement}"
    loads = []
    load = client.store.load

    async def counted(thread_id):
        loads.append(thread_id)
        return await load(thread_id)

    client.store.load = counted
    frontier = await client.run(
        "tests.ray.agents:quick_agent", "hi", thread_id=thread, placement=placement, timeout_s=60
    )
    assert frontier.thread_id == thread and frontier.run_state.cause.kind == "natural"
    # a hosted Run's host answers with the frontier its last commit wrote: no read back
    assert len(loads) == (0 if placement == "hosted" else 1)
    assert frontier == await client.handle(thread).frontier()  # what the store holds
    infos = [await h.info.remote() for h in client.hosts]
    assert sum(i["driving"] for i in infos) == 0
    with pytest.raises(AgentImportError):
        await client.run("tests.ray.no_such_module:agent", "hi")


async def test_a_tool_needing_a_custom_resource_runs_where_it_exists(make_system):
    client = await make_system()
    handle = await client.start("tests.ray.agents:resource_agent", "where?")
    frontier = await handle.result(timeout_s=60)
    results = {m.call_id: m for m in frontier.messages if isinstance(m, ToolResultMessage)}
    special, plain = json.loads(results["c1"].content), json.loads(results["c2"].content)
    assert special["resources"].get("special") == 1.0
    assert ":exec:special=1:" in special["actor"]
    assert "special" not in plain["resources"]
    assert ":exec:default:" in plain["actor"]
