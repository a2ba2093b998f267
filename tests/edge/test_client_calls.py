"""What the edge asks of the cluster client and its hosts (no Ray: a host stand-in that
records each call, over the in-memory store, with Runs driven by the in-process runner).

- A cancel or stop names the Run the caller saw: a host told ``run=None`` ends
  whichever Run the thread holds by then, a later one started meanwhile included.
- A start checks its agent reference off the server's event loop, once: an agent
  factory (called to check it) must not hold every other request of the server.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from actors.wire import SystemSpec
from cluster.client import Ratchet
from edge import routes
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.control import control_engine
from runtime.lifecycle import Cancelled
from runtime.models import call
from runtime.tools import tool
from storage.memory import MemoryCommitStore

SPEC = SystemSpec(name="edge-calls", store_url="memory://", hosts=1)


@tool(needs_permission=True)
def drop_table(name: str) -> str:
    """Drop a table (asks first)."""
    return f"dropped {name}"


@dataclass
class _Method:
    calls: list[tuple[Any, ...]]
    answer: Any

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((*args, kwargs))
        return self.answer(*args, **kwargs)


@dataclass
class _Host:
    """A RunHost's interface, recording what it is asked; a cancel ends the named Run."""

    store: MemoryCommitStore
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cancel_run = _Method(self.calls, self._cancel)
        self.start_run = _Method(self.calls, self._start)
        self.until_rest = _Method(self.calls, self._until_rest)

    async def _cancel(self, thread: str, *, run: str | None = None) -> str:
        engine = control_engine(self.store, owner="stand-in")
        await engine.terminate(thread, Cancelled(), run=run)  # type: ignore[arg-type]
        return "cancelled" if engine.committed.is_set() else "not_running"

    async def _start(self, *args: Any, **kwargs: Any) -> bool:
        return True

    async def _until_rest(self, thread: str) -> bool:
        return False


async def test_a_cancel_through_the_edge_names_the_run_the_caller_saw() -> None:
    store = MemoryCommitStore()
    asks = [ModelResponse(text="may I?", tool_calls=(call("drop_table", "c1", name="users"),))]
    ask = Agent(name="asks", model=ScriptedModel(asks), tools=(drop_table,))
    parked = await InProcessRunner(ask, store).start("go", thread_id="t-c", run_id="run-a")
    assert parked.run_state is not None and parked.run_state.kind == "awaiting"
    host = _Host(store)
    client = Ratchet(SPEC, store, [host])
    result = await routes._end(client, parked.thread_id, None, 0, None)
    assert result.outcome == "cancelled"
    assert host.calls == [("t-c", {"run": "run-a"})]  # the host is told which Run


FACTORY_MAY_RETURN = threading.Event()
FACTORY_CALLS: list[str] = []


def slow_factory() -> Agent:
    """An agent factory that returns only once the caller's event loop has run on
    (it would never return if it were called on that loop: a deadlock, cut at 10 s)."""
    FACTORY_CALLS.append(threading.current_thread().name)
    if not FACTORY_MAY_RETURN.wait(timeout=10):
        raise RuntimeError("the factory was called on the event loop it waited for")
    return Agent(name="slow", model=ScriptedModel([ModelResponse(text="hi")]))


async def test_a_start_checks_its_agent_off_the_event_loop_once() -> None:
    FACTORY_MAY_RETURN.clear()
    FACTORY_CALLS.clear()
    store = MemoryCommitStore()
    client = Ratchet(SPEC, store, [_Host(store)])
    ref = f"{__name__}:slow_factory"
    started = asyncio.ensure_future(client.start(ref, "hello", thread_id="t-slow"))

    async def release() -> None:  # runs only if the loop is free while the factory waits
        FACTORY_MAY_RETURN.set()

    await asyncio.wait_for(asyncio.gather(started, release()), timeout=20)
    await client.start(ref, "again", thread_id="t-slow-2")
    assert len(FACTORY_CALLS) == 1  # checked once per client
    assert FACTORY_CALLS[0] != threading.current_thread().name


async def test_a_cancel_naming_an_earlier_run_leaves_the_thread_s_next_one() -> None:
    """A cancel retried after its answer was lost names the Run it meant (``run_id``):
    by then the thread holds the next Run, which is left alone (not_running)."""
    store = MemoryCommitStore()
    asks = [ModelResponse(text="may I?", tool_calls=(call("drop_table", "c1", name="users"),))]
    runner = InProcessRunner(
        Agent(name="asks", model=ScriptedModel(asks * 2), tools=(drop_table,)), store
    )
    first = await runner.start("go", thread_id="t-n", run_id="run-a")
    host = _Host(store)
    client = Ratchet(SPEC, store, [host])
    assert (await routes._end(client, first.thread_id, None, 0, "run-a")).outcome == "cancelled"
    await runner.start("again", thread_id="t-n", run_id="run-b")  # the next Run, awaiting
    retried = await routes._end(client, first.thread_id, None, 0, "run-a")
    assert retried.outcome == "not_running"
    assert (await store.load("t-n")).run_state.kind == "awaiting"  # run-b goes on
    assert host.calls == [("t-n", {"run": "run-a"})]  # asked once, for run-a only
