"""What a long-lived host or Supervisor keeps must not grow with the work it has seen
(no Ray: bare RunHost and Supervisor objects over the in-memory store, Ray's lookups
stubbed). Each was found growing without bound: a dedicated host left idle after a
refused resume, a retire task kept per idle notice, a host name kept per lost host."""

from __future__ import annotations

import asyncio
import importlib
import time
from typing import Any

import pytest

import actors.host_recovery
import actors.hung_hosts
import actors.run_host
from actors.drives import Drives
from actors.reconcile import Reconciler
from actors.retiring import Admission
from actors.run_host import RunHost
from actors.supervisor import Supervisor
from actors.wire import RemoteError, SystemSpec, owner_id
from runtime import (
    Agent,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    call,
    tool,
)
from runtime.ids import ThreadId
from runtime.lifecycle import answer
from storage.memory import MemoryCommitStore
from tests.support.waiting import until

SUPERVISOR = importlib.import_module("actors.supervisor")  # actors.supervisor: the function


class _Call:
    """A remote method that answers ``result`` and records what it was asked."""

    def __init__(self, result: Any, asked: list[Any] | None = None) -> None:
        self.result, self.asked = result, asked if asked is not None else []

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(args)

        async def answered() -> Any:
            return self.result

        return answered()


@tool(needs_permission=True, wait_deadline_s=1e-6)
def too_late(x: int) -> str:
    return "ran"


def _dedicated_host(store: MemoryCommitStore, thread: str) -> RunHost:
    spec = SystemSpec(name="life", store_url="memory://")
    host = object.__new__(RunHost)
    host.spec, host.host_id, host.kind = spec, spec.dedicated_name(thread), "dedicated"
    host.owner, host.store = owner_id(host.host_id), store
    host.publisher = host.children = None
    host.admission, host._background, host._retire_asked = Admission(), set(), None
    host.drives = Drives(spec, store, host.owner, None, None, None, None, host._retire_if_idle)  # type: ignore[arg-type]
    host.reconciler = Reconciler(host.host_id, host.owner, store, host.drives, host._recover)
    reconciled = asyncio.get_running_loop().create_future()
    reconciled.set_result(None)
    host._reconciled = reconciled
    return host


async def test_a_dedicated_host_started_for_a_refused_resume_asks_to_retire(monkeypatch):
    """The Run's last dedicated host retired while it awaited; a resume past the wait's
    deadline starts a new one, which refuses it. That host, left with nothing to drive,
    lived on idle (a Ray process per such resume): now it asks to retire."""
    asked: list[Any] = []
    supervisor = type("Sup", (), {"retire": _Call(False, asked)})()
    monkeypatch.setattr(actors.run_host.ray, "get_actor", lambda *a, **k: supervisor)
    store = MemoryCommitStore()
    agent = Agent(
        name="late",
        model=ScriptedModel(
            [ModelResponse(tool_calls=(call("too_late", "c1", x=1),)), ModelResponse(text="ok")]
        ),
        tools=[too_late],
    )
    parked = await InProcessRunner(agent, store).start("go", thread_id="t-late")
    command = answer(parked.run_state.ticket, PermissionDecision(approve=True))
    host = _dedicated_host(store, "t-late")
    refused = await host.resume_run(command)
    assert isinstance(refused, RemoteError) and refused.name == "ResumeRejected"

    async def asked_to_retire() -> bool:
        return len(asked) == 1

    await until(asked_to_retire, 5, what="the host asking to retire")
    await until(lambda: not host._background, 5, what="its retire task forgotten")


async def test_a_host_that_stays_idle_keeps_no_retire_task_per_notice(monkeypatch):
    """An idle dedicated host is told so again and again (its door reopens every 30 s
    when no end comes; each drive or cancel that ends tells it too): each notice's
    retire task is forgotten once it is done."""
    supervisor = type("Sup", (), {"retire": _Call(False)})()
    monkeypatch.setattr(actors.run_host.ray, "get_actor", lambda *a, **k: supervisor)
    host = _dedicated_host(MemoryCommitStore(), "t-idle")
    for _ in range(200):
        host._retire_if_idle()
    await until(lambda: not host._background, 5, what="every retire task forgotten")


class _Dying:
    """A Supervisor whose ``retire`` fails as a call to one that died does, ``dies``
    times, then ends the host (True); ``heartbeat`` answers."""

    def __init__(self, dies: int) -> None:
        self.dies, self.asked = dies, 0
        self.heartbeat, self.retire = _Call(None), self

    def remote(self, *args: Any) -> Any:  # ``retire.remote``
        self.asked += 1
        died = self.asked <= self.dies

        async def answered() -> bool:
            if died:
                raise RuntimeError("the actor died unexpectedly before finishing")
            return True

        return answered()


async def test_a_dedicated_host_asks_to_retire_again_when_the_ask_was_lost(monkeypatch):
    """The host asked once, when its Run came to rest: a Supervisor killed around then
    lost the ask (the error was swallowed), and the host lived on idle for good (a
    helper found 29 such hosts 25 minutes on). Its heartbeat asks again until it is
    ended."""
    supervisor = _Dying(dies=2)
    monkeypatch.setattr(actors.run_host.ray, "get_actor", lambda *a, **k: supervisor)
    monkeypatch.setattr(actors.run_host, "RETIRE_AGAIN_S", 0.05)
    host = _dedicated_host(MemoryCommitStore(), "t-lost")
    host.spec = SystemSpec(name="life", store_url="memory://", heartbeat_s=0.01)
    host._retire_if_idle()  # its Run came to rest
    beating = asyncio.create_task(host._heartbeat())
    try:
        await until(lambda: supervisor.asked >= 3, 10, what="the host asking until ended")
    finally:
        beating.cancel()
    assert supervisor.asked == 3  # answered True the third time: asked no more after


@pytest.mark.parametrize("seen", ["dead", "lost"])
async def test_a_supervisor_forgets_dedicated_hosts_ray_reports_gone(monkeypatch, seen):
    """Dedicated hosts that came up (a heartbeat) and died with no Run to re-place, or
    whose last heartbeat came in after they retired: each kept its name in ``kinds``
    and an event for the Supervisor's life. Names of hosts gone for good are dropped,
    whether the watch finds them dead while their lease holds or lost once it has run
    out (then gone when it looks for them hung); the events kept are the latest
    ``EVENTS_KEPT``."""

    def gone(name: str, namespace: str | None = None) -> Any:
        raise ValueError(f"no actor {name}")

    async def a_store(spec: SystemSpec, who: str) -> MemoryCommitStore:
        return MemoryCommitStore()  # the system's store actor, in this process

    monkeypatch.setattr(SUPERVISOR, "open_system_store", a_store)
    monkeypatch.setattr(SUPERVISOR, "EVENTS_KEPT", 10)
    lease_ttl_s = 60.0 if seen == "dead" else 0.05
    spec = SystemSpec(
        name="life",
        store_url="memory://",
        lease_ttl_s=lease_ttl_s,
        reconcile_s=1e9,
        warm_spares=False,
    )
    s = object.__new__(Supervisor)
    await Supervisor.__init__(s, spec)  # as Ray would, in this process
    s._task.cancel()  # its watch's ticks are this test's own
    s._renewing.cancel()
    monkeypatch.setattr(SUPERVISOR.ray, "get_actor", gone)
    monkeypatch.setattr(actors.hung_hosts.ray, "get_actor", gone)
    for n in range(50):
        await s.heartbeat(spec.dedicated_name(f"t{n}"), "dedicated")
    if seen == "lost":
        expiry = max(s.leases.values())
        await until(lambda: time.monotonic() > expiry, 5, what="every lease run out")

    async def all_forgotten() -> bool:
        await s._tick()
        return not s.kinds and not s.leases and not s._silent

    await until(all_forgotten, 10, what="every gone host forgotten", interval_s=0.02)
    assert s.counts["hosts_lost"] == 50 and len(s.events) == 10


async def test_a_recovery_ended_by_its_own_code_s_unwind_counts_against_the_run(monkeypatch):
    """A hook or model raising ``Crash`` (public, for tests that simulate a death in one
    process) ended each recovery of its Run on a host without counting it: the next pass
    recovered it again, failing the same way, for ever, and its dead letter never came."""
    from types import SimpleNamespace

    from runtime.faults import Crash

    counted: list[str] = []

    async def mark_lost(*args: Any, reason: str, **kwargs: Any) -> None:
        counted.append(reason)

    async def hostile() -> None:
        raise Crash("a hook's")

    monkeypatch.setattr(actors.host_recovery, "mark_lost", mark_lost)
    host = object.__new__(RunHost)  # the ending only: no actor, no store
    host.owner, host.store, host.publisher, host.children = "host-a:1", None, None, None
    host.drives, host._background = {}, set()
    task = asyncio.ensure_future(hostile())
    await asyncio.wait({task})
    drive = SimpleNamespace(
        task=task, engine=SimpleNamespace(committed=asyncio.Event()), epoch=None
    )
    host._recovery_ended(ThreadId("t"), drive, "host-b:1")  # type: ignore[arg-type]
    await asyncio.gather(*host._background)
    assert counted == ["recovery_failed:Crash"]
