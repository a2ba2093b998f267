"""A route's read-back after its action landed: a store outage is waited out, and one
that outlasts the wait is a 503 naming the Run that was started (no Ray: a handle over
the in-memory store whose loads fail for a while)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from actors.wire import SystemSpec
from cluster.handle import RunHandle
from edge import routes
from edge.problems import HttpProblem
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.errors import StoreUnavailable
from runtime.ids import RunId, ThreadId
from storage.memory import MemoryCommitStore


class _Blinking:
    """The in-memory store, whose next ``fails`` loads meet an outage."""

    def __init__(self, inner: MemoryCommitStore, fails: int) -> None:
        self.inner, self.fails = inner, fails

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        if self.fails:
            self.fails -= 1
            raise StoreUnavailable("store memory:// did not answer")
        return await self.inner.load(thread)


SPEC = SystemSpec(name="read-back", store_url="memory://")


@dataclass
class _Client:
    store: Any
    spec: SystemSpec = SPEC
    hosts: tuple[Any, ...] = ()


async def _started(fails: int) -> RunHandle:
    store = MemoryCommitStore()
    agent = Agent(name="once", model=ScriptedModel([ModelResponse(text="done")]))
    f = await InProcessRunner(agent, store).start("go", thread_id="t-read", run_id="r-read")
    return RunHandle(_Client(_Blinking(store, fails)), f.thread_id, RunId("r-read"), "hosted")  # type: ignore[arg-type]


async def test_a_read_back_waits_out_a_store_outage() -> None:
    handle = await _started(fails=3)
    summary = await routes.at_rest(handle, 0)
    assert (summary.run_id, summary.run_state.kind) == ("r-read", "ended")  # type: ignore[union-attr]
    assert handle.client.store.fails == 0


async def test_an_outage_past_the_wait_is_a_503_naming_the_run(monkeypatch) -> None:
    monkeypatch.setattr(routes, "READ_BACK_S", 0.05)
    handle = await _started(fails=10**6)
    with pytest.raises(HttpProblem) as problem:
        await routes.at_rest(handle, 0)
    assert (problem.value.status, problem.value.kind) == (503, "StoreUnavailable")
    assert problem.value.extra == {"thread_id": "t-read", "run_id": "r-read"}
    assert "done, but" in problem.value.detail


def test_a_run_whose_thread_moved_past_it_is_a_conflict() -> None:
    """Waiting on a Run (``?wait=``) whose end its pruned thread no longer holds."""
    from edge.problems import status_of
    from runtime.errors import RunSuperseded

    assert status_of(RunSuperseded("t", "r1", "r2")) == 409


async def test_a_resume_whose_answer_met_an_outage_is_its_success_once_it_landed() -> None:
    """The host applied the resume, then its answer was StoreUnavailable (the store went
    away just after the commit). Asked again, the caller's resume would carry a new
    request id and hear that another resume was applied: the client asks the log
    whether its own landed instead. (The host here applies the resume with an engine
    on the real in-memory store and answers as a host whose store then failed.)"""
    from actors.wire import RemoteError, RunMeta
    from cluster.handle import command_for
    from runtime.engine import Engine
    from runtime.lifecycle import PermissionDecision
    from runtime.tool_calls import LocalToolRunner
    from tests.ray.agents import permission_agent

    store = MemoryCommitStore()
    engine = Engine(permission_agent, store, LocalToolRunner(permission_agent.tools))
    run = RunId("r-resume")
    parked = await engine.start(
        ThreadId("t-resume"), "go", run_id=run, message_id=RunMeta("ref").message_id(run)
    )

    class _Host:
        class resume_run:  # named as the actor method is
            @staticmethod
            async def remote(command: Any, trace: Any = None) -> Any:
                drive = Engine(permission_agent, store, LocalToolRunner(permission_agent.tools))
                await drive.resume(command)
                return RemoteError.of(StoreUnavailable("store memory:// did not answer"))

    client = _Client(store)
    client.host_for = lambda *args: _Host  # type: ignore[attr-defined]
    handle = RunHandle(client, parked.thread_id, run, "hosted")  # type: ignore[arg-type]
    await handle.resume(command_for(parked.run_state.ticket, PermissionDecision(approve=True)))
    assert (await store.load(parked.thread_id)).run_state.kind == "ended"
