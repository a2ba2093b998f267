"""Waves of many Runs share executor round trips, and each still ends on its own."""

from __future__ import annotations

import asyncio
import os

import pytest

from actors.tool_executor import ExecutorPools
from actors.waves import START_WAIT_S, WaveDispatcher, ray_state, up_by_ray
from runtime.ports import Finished, Lost, ToolInvocation, Unavailable

from .conftest import wait_for

pytestmark = pytest.mark.ray
AGENT = "tests.ray.wave_agents:agent"


def _wave(tool: str, n: int, timeout_s: float | None = None, **arguments: object):
    return [
        ToolInvocation(
            tool=tool,
            arguments=arguments,
            call_id=f"c{n}",
            operation_id=f"op-{n}",
            attempt=1,
            run_id=f"run-{n}",
            thread_id=f"thread-{n}",
            timeout_s=timeout_s,
        )
    ]


async def _dispatcher(make_system, grace_s: float = 5.0) -> WaveDispatcher:
    client = await make_system(executors=1)
    return WaveDispatcher(ExecutorPools(client.spec), grace_s=grace_s)


async def test_waves_ready_together_share_one_call(make_system):
    waves = await _dispatcher(make_system)
    outcomes = await asyncio.gather(
        *(waves.run({}, AGENT, _wave("echo_wave", n, text=f"t{n}")) for n in range(10))
    )
    assert [o[0].output.content for o in outcomes] == [f"t{n}" for n in range(10)]
    assert waves.sent == {"waves": 10, "calls": 1}
    again = await waves.run({}, AGENT, _wave("echo_wave", 10, text="alone"))
    assert isinstance(again[0], Finished) and again[0].output.content == "alone"
    assert waves.sent == {"waves": 11, "calls": 2}


async def test_a_slow_wave_holds_back_only_itself_and_is_cancelled_where_it_runs(
    make_system, tmp_path
):
    waves = await _dispatcher(make_system)
    marker = str(tmp_path / "slow")
    slow = asyncio.ensure_future(
        waves.run({}, AGENT, _wave("linger", 0, seconds=120.0, marker=marker))
    )
    fast = asyncio.ensure_future(waves.run({}, AGENT, _wave("echo_wave", 1, text="quick")))
    (done,) = await asyncio.wait_for(fast, 30)
    assert done.output.content == "quick" and not slow.done()
    assert waves.sent == {"waves": 2, "calls": 1}

    await wait_for(lambda: _exists(f"{marker}.started"), what="the slow tool to start")
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    await wait_for(lambda: _exists(f"{marker}.cancelled"), what="the tool to be cancelled")


async def test_a_lone_wave_goes_in_a_plain_call_and_is_cancelled_where_it_runs(
    make_system, tmp_path
):
    waves = await _dispatcher(make_system)
    marker = str(tmp_path / "alone")
    slow = asyncio.ensure_future(
        waves.run({}, AGENT, _wave("linger", 0, seconds=120.0, marker=marker))
    )
    await wait_for(lambda: _exists(f"{marker}.started"), what="the lone tool to start")
    assert waves.sent == {"waves": 1, "calls": 1}
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    await wait_for(lambda: _exists(f"{marker}.cancelled"), what="the lone tool to be cancelled")


async def test_an_executor_that_cannot_answer_loses_the_wave_at_its_deadline(make_system):
    waves = await _dispatcher(make_system, grace_s=0.5)
    (outcome,) = await asyncio.wait_for(
        waves.run({}, AGENT, _wave("freeze", 0, timeout_s=0.2, seconds=8.0)), 30
    )
    assert isinstance(outcome, Lost) and "did not answer" in outcome.message


async def _exists(path: str) -> bool:
    return await asyncio.to_thread(os.path.exists, path)


async def test_a_pool_ray_refuses_fails_the_wave_instead_of_hanging_it(make_system):
    waves = await _dispatcher(make_system)
    with pytest.raises(ValueError):
        await asyncio.wait_for(waves.run({"num_gpus": -1.0}, AGENT, _wave("echo_wave", 0)), 30)


async def test_an_agent_slow_to_load_holds_back_only_its_own_waves(make_system):
    """An executor imports an agent off its event loop (its module may list an MCP
    server's tools as it is imported): a wave of another agent is answered meanwhile."""
    from .wave_agents import SLOW_RELEASE

    SLOW_RELEASE.unlink(missing_ok=True)
    try:
        waves = await _dispatcher(make_system)
        slow = asyncio.ensure_future(
            waves.run(
                {},
                f"{AGENT.partition(':')[0]}:slow_loading_agent",
                _wave("echo_wave", 0, text="late"),
            )
        )
        (quick,) = await asyncio.wait_for(
            waves.run({}, AGENT, _wave("echo_wave", 1, text="quick")), 20
        )
        assert quick.output.content == "quick" and not slow.done()
        SLOW_RELEASE.touch()
        (late,) = await asyncio.wait_for(slow, 30)
        assert isinstance(late, Finished) and late.output.content == "late"
    finally:
        SLOW_RELEASE.unlink(missing_ok=True)


async def test_a_wave_that_fails_around_its_tools_loses_only_itself(monkeypatch):
    """The executor's streaming call carries the waves of many Runs: one wave whose run
    fails around its tools (a bug of ours) is lost on its own, the others are answered
    (no Ray: the executor's method, called in this process)."""
    from actors.tool_executor import ToolExecutor

    executor = ToolExecutor(warm_spares=False)
    real = ToolExecutor.run

    async def run(self: ToolExecutor, agent_ref: str, invocations: list[ToolInvocation]) -> list:
        if invocations[0].call_id == "c0":
            raise RuntimeError("a bug around the tools")
        return await real(self, agent_ref, invocations)

    monkeypatch.setattr(ToolExecutor, "run", run)
    stream = ToolExecutor.run_waves
    stream = getattr(stream, "__wrapped__", stream)  # the method under @ray.method
    calls = [(f"w{n}", AGENT, _wave("echo_wave", n, text=f"t{n}")) for n in range(2)]
    answered = {w: outcomes async for batch in stream(executor, calls) for w, outcomes in batch}
    (lost,), (fine,) = answered["w0"], answered["w1"]
    assert isinstance(lost, Lost) and "a bug around the tools" in lost.message
    assert isinstance(fine, Finished) and fine.output.content == "t1"


async def test_a_tool_that_cancels_its_own_task_fails_alone():
    """A tool calling ``asyncio.current_task().cancel()`` cancelled the wave's gather: the
    whole wave went unanswered, its finished calls lost with it (a replay_safe one ran
    again). It is that call's error (no Ray: the method, in this process)."""
    from actors.tool_executor import ToolExecutor

    executor = ToolExecutor(warm_spares=False)
    wave = [*_wave("cancels_itself", 0), *_wave("echo_wave", 1, text="kept")]
    rogue, kept = await executor.run(AGENT, wave)
    assert isinstance(rogue, Finished) and "cancelled its own task" in rogue.output.content
    assert isinstance(kept, Finished) and kept.output.content == "kept"


async def test_a_wave_whose_timeout_passes_before_it_was_sent_is_unavailable():
    """A wave for an executor seen dying waits (up to a minute) for it to come back; its
    calls' timeout passing meanwhile made them Lost, a never_replay one indeterminate,
    though nothing had left the host. Unavailable: tried again (no Ray: an executor
    that never comes back, never sent anything)."""
    from types import SimpleNamespace

    sent: list[str] = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: object) -> asyncio.Future[object]:
            sent.append(self.name)
            return asyncio.get_running_loop().create_future()  # never answered

    class Restarting:
        def __getattr__(self, name: str) -> Method:
            return Method(name)

    executor = Restarting()
    pools = SimpleNamespace(spec=SimpleNamespace(lease_ttl_s=60.0), pick=lambda *_, **__: executor)
    waves = WaveDispatcher(pools, grace_s=0.05)  # type: ignore[arg-type]
    back = waves._back[executor] = asyncio.ensure_future(asyncio.Event().wait())
    try:
        (outcome,) = await waves.run({}, AGENT, _wave("echo_wave", 0, timeout_s=0.05, text="x"))
    finally:
        back.cancel()
        if waves._watch is not None:
            waves._watch.cancel()
    assert isinstance(outcome, Unavailable), outcome
    assert "run_wave" not in sent and "run_waves" not in sent


async def test_a_streamed_call_forgets_its_waves_once_answered():
    """An executor keeps a wave by id only while it runs (so its host can cancel it): a
    streamed call that kept every answered wave grew the executor by one task, outcomes
    and all, per wave for as long as it lived (no Ray: the method, in this process)."""
    from actors.tool_executor import ToolExecutor

    executor = ToolExecutor(warm_spares=False)
    stream = ToolExecutor.run_waves
    stream = getattr(stream, "__wrapped__", stream)  # the method under @ray.method
    calls = [(f"w{n}", AGENT, _wave("echo_wave", 1, text=f"t{n}")) for n in range(3)]
    answered = {w async for batch in stream(executor, calls) for w, _ in batch}
    assert answered == {"w0", "w1", "w2"}
    assert executor._waves == {}


async def test_an_executor_that_never_came_up_is_waited_for_not_restarted(make_system):
    """A pool whose resources no node has: its executor is never created, the wave waits
    queued in Ray. That is no hang: the watch pings it and, never having heard it, kills
    nothing (a restart would only lose calls that never ran)."""
    client = await make_system(executors=1, lease_ttl_s=0.2)
    waves = WaveDispatcher(ExecutorPools(client.spec))
    wave = asyncio.ensure_future(waves.run({"no-such-node": 1.0}, AGENT, _wave("echo_wave", 0)))

    async def watched_a_while() -> bool:
        return waves.watched >= 4

    await wait_for(watched_a_while, what="the watch to ping a few times")
    assert waves.restarted == 0 and not wave.done()
    assert not waves._up  # Ray says it is pending creation, not alive
    (executor,) = ExecutorPools(client.spec).pool({"no-such-node": 1.0})
    assert ray_state(executor) == "PENDING_CREATION"
    wave.cancel()


def test_an_executor_is_up_by_rays_word_or_after_a_long_wait():
    """An executor whose first ping has waited a lease: up if Ray says it is alive (a
    process stopped before it ever answered), never while Ray creates or restarts it;
    if Ray cannot say, after ``START_WAIT_S``."""
    assert up_by_ray("ALIVE", 1.0)
    for state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING", "DEAD"):
        assert not up_by_ray(state, START_WAIT_S * 10)
    assert not up_by_ray(None, START_WAIT_S - 1)
    assert up_by_ray(None, START_WAIT_S)
