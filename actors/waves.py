"""Waves of many Runs share executor round trips (DESIGN §12).

A plain Ray actor call costs about a millisecond of CPU at each end on our 2-core
machines, whatever it carries; with tools that answer at once that is most of what a
Step costs. Group commit wakes many Runs of a host in the same event-loop turn, so
their next waves are ready together: the ``WaveDispatcher`` holds a wave for two loop
turns and sends every wave bound for the same executor pool in one streaming call (a
lone wave in a plain call, which costs less).

The executor runs the waves of a call concurrently and yields each as it finishes, so
a slow tool holds back only its own wave, never the others in its call. A wave its
Run stops waiting for (the deadline passed, or the Run was cancelled) is cancelled on
the executor by its id. An executor that dies mid-call makes every wave it had not
answered ``Lost``; the engine's pinned recovery policy decides what those become. One
that hangs (a stopped process, a tool that blocks its event loop) would hold its waves
for ever where their tools have no timeout, since Ray takes it for alive: while a call
has been out for a lease (``SystemSpec.lease_ttl_s``) the dispatcher pings its
executor, and one known up that misses ``HUNG_STRIKES`` pings in a row is killed for
Ray to restart, which loses its waves as a death does. Known up: it answered a ping, or
its first ping has waited a lease and Ray says the actor is alive (created; not pending
creation, waiting for resources, or restarting). Without that second way, a process
stopped before this host ever heard it answer (hung while idle) was never restarted:
every call sent to it was lost after about 20 s (Ray's ``ActorUnavailableError``), or
held until its tool's timeout, for as long as it stayed stopped.

An executor seen dying is passed over while its pool has another; a call bound for one
anyway (a pool of one: a resource pool, or ``executors=1``) waits until it answers a
ping again, up to ``RESTART_WAIT_S``. Ray refuses a call to a restarting actor at once,
so the next attempt of a replay-safe call, sent straight away, was lost too, and one
death spent every attempt without ever running the tool again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from actors.tool_executor import ExecutorPools, pool_key
from runtime.agent import Agent
from runtime.ports import Lost, ToolInvocation, ToolOutcome, Unavailable
from runtime.tools import Tool

log = logging.getLogger("ratchet.waves")
TIMEOUT_GRACE_S = 5.0
"""How long past a tool's own timeout the host waits before calling the executor lost."""
PING_TIMEOUT_S = 2.0
HUNG_STRIKES = 2
"""Pings in a row, a lease apart, an executor with a call out may miss before it is
taken for hung and restarted."""
RESTART_WAIT_S = 60.0
"""How long a call bound for an executor seen dying waits for it to answer again."""
START_WAIT_S = 120.0
"""How long an executor's first ping may wait before it is taken for up all the same,
should Ray not say what state the actor is in (its state is an internal API)."""
BACK_POLL_S = (0.05, 1.0)
"""The first and the longest pause between pings of an executor being restarted."""


@dataclass(eq=False)
class _Wave:
    id: str
    agent_ref: str
    invocations: list[ToolInvocation]
    done: asyncio.Future[list[ToolOutcome]]
    executor: Any = None
    """The executor the wave went to (None while it waits to be sent)."""
    sent: bool = False
    """Whether the wave was handed to Ray: until then nothing of it can have run."""

    def settle(self, outcomes: list[ToolOutcome]) -> None:
        if not self.done.done():  # a wave given up on is already settled
            self.done.set_result(outcomes)

    def lose(self, message: str) -> None:
        self.settle([Lost(message=message)] * len(self.invocations))


class WaveDispatcher:
    """One per host process: the waves of all its Runs, coalesced per executor pool."""

    def __init__(self, pools: ExecutorPools, grace_s: float = TIMEOUT_GRACE_S) -> None:
        self.pools = pools
        self.grace_s = grace_s
        self._pending: dict[str, list[_Wave]] = {}
        self._resources: dict[str, Mapping[str, float]] = {}
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._calls: dict[asyncio.Task[None], tuple[Any, float]] = {}
        """Calls out → their executor and when they were sent."""
        self._watch: asyncio.Task[None] | None = None
        self._up: set[Any] = set()
        """Executors known up (``_learn``): only those are taken for hung when they miss."""
        self._learning: dict[Any, tuple[asyncio.Future[Any], float]] = {}
        """Executors not known up → the ping that will say so when it is answered, and
        when it was sent."""
        self.sent = {"waves": 0, "calls": 0}
        """Counters for ``RunHost.info``: waves / calls is the coalescing achieved."""
        self.restarted = 0
        """Executors this dispatcher took for hung and killed."""
        self.watched = 0
        """Rounds of pings the watch of executors has made (diagnostics, tests)."""
        self._back: dict[Any, asyncio.Task[None]] = {}
        """Executors seen dying (a call to them lost) → the pings that end when it answers
        again (or ``RESTART_WAIT_S`` passed): passed over by ``pick`` until then."""

    async def run(
        self, resources: Mapping[str, float], agent_ref: str, invocations: Sequence[ToolInvocation]
    ) -> list[ToolOutcome]:
        """The outcomes of one wave, in the order of ``invocations``."""
        loop = asyncio.get_running_loop()
        wave = _Wave(
            f"{self._prefix}:{next(self._ids)}", agent_ref, list(invocations), loop.create_future()
        )
        key = pool_key(resources)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = []
            self._resources[key] = resources
            # two turns: Runs woken by the same group commit reach here in the next one
            loop.call_soon(loop.call_soon, self._flush, key)
        pending.append(wave)
        try:
            deadline = _deadline(invocations, self.grace_s)
            return await asyncio.wait_for(asyncio.shield(wave.done), deadline)
        except TimeoutError:
            if wave.sent:
                wave.lose("executor did not answer before the call's timeout")
            else:  # still waiting for its executor to come back: nothing ran, tried again
                why = "the call's timeout passed before its executor came back"
                wave.settle([Unavailable(message=why)] * len(wave.invocations))
            self._cancel(wave)
            return wave.done.result()
        except asyncio.CancelledError:  # the Run was cancelled: stop the tools where they run
            wave.lose("the run stopped waiting")
            self._cancel(wave)
            raise

    def _flush(self, key: str) -> None:
        waves = [w for w in self._pending.pop(key, []) if not w.done.done()]
        if not waves:
            return
        try:
            executor = self.pools.pick(self._resources[key], avoid=self._back)
        except Exception as exc:  # e.g. resources Ray refuses: the Runs hear it, not the loop
            for wave in waves:
                wave.done.set_exception(exc)
            return
        for wave in waves:
            wave.executor = executor
        self.sent["waves"] += len(waves)
        self.sent["calls"] += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._call(executor, waves))
        self._calls[task] = (executor, loop.time())
        task.add_done_callback(self._calls.pop)
        if self._watch is None or self._watch.done():
            self._watch = loop.create_task(self._watch_executors())

    async def _call(self, executor: Any, waves: list[_Wave]) -> None:
        coming_back = self._back.get(executor)
        if coming_back is not None:
            await asyncio.shield(coming_back)
            waves = [w for w in waves if not w.done.done()]  # given up on meanwhile
            if not waves:
                return
        open_waves = {w.id: w for w in waves}
        for wave in waves:
            wave.sent = True
        try:
            if len(waves) == 1:  # a lone wave: a plain call, cheaper than a stream
                (wave,) = waves
                outcomes = await executor.run_wave.remote(wave.id, wave.agent_ref, wave.invocations)
                open_waves.pop(wave.id).settle(outcomes)
            else:
                calls = [(w.id, w.agent_ref, w.invocations) for w in waves]
                async for ref in executor.run_waves.remote(calls):
                    for wave_id, outcomes in await ref:
                        open_waves.pop(wave_id).settle(outcomes)
        except RayActorError as exc:
            self._seen_down(executor)
            message = f"executor died mid-call ({type(exc).__name__})"
        except RayTaskError as exc:  # the executor itself failed around the tools
            message = f"executor failed: {exc.cause!r}"
        except RayError as exc:  # a node lost, a reply that did not come back: Ray's, not ours
            message = f"the call was lost in Ray ({type(exc).__name__})"
        except Exception as exc:  # a fault of ours, not of the tools: the Runs hear it
            log.exception("sending %d waves failed", len(waves))
            for wave in open_waves.values():
                if not wave.done.done():
                    wave.done.set_exception(exc)
            return
        else:
            message = "executor ended the call without answering"
        for wave in open_waves.values():
            wave.lose(message)

    async def _watch_executors(self) -> None:
        """While calls are out: ping each executor known up (``_learn``) that has had one
        out for a lease; one that misses ``HUNG_STRIKES`` pings in a row is killed, for Ray
        to restart."""
        period = self.pools.spec.lease_ttl_s
        loop = asyncio.get_running_loop()
        strikes: dict[Any, int] = {}
        while self._calls:
            await self._learn(period)
            now = loop.time()
            stale = {ex for ex, sent in self._calls.values() if now - sent >= period}
            due = [ex for ex in stale if ex in self._up]
            answers = await asyncio.gather(*(_answers(ex) for ex in due))
            self.watched += 1
            missed = [ex for ex, ok in zip(due, answers, strict=True) if not ok]
            strikes = {ex: strikes.get(ex, 0) + 1 for ex in missed}  # in a row: others reset
            for executor in [ex for ex, n in strikes.items() if n >= HUNG_STRIKES]:
                del strikes[executor]
                self._restart(executor)
            await asyncio.sleep(period)

    async def _learn(self, period: float) -> None:
        """Which executors with calls out are up. Each is pinged as soon as it is sent a
        call (one ping in flight, however long it waits): an answer says it is up. One
        whose ping waited a lease is up if Ray says the actor is alive, so that a process
        stopped before it ever answered is pinged, and restarted, like any other; one Ray
        still creates or restarts, or a pool waiting for resources no node has, holds its
        calls queued, which is no hang. Should Ray not say, ``START_WAIT_S`` decides."""
        for executor, (pinged, _) in list(self._learning.items()):
            if pinged.done():  # answered (it is up), or failed (asked again if still out)
                del self._learning[executor]
                if not pinged.cancelled() and pinged.exception() is None:
                    self._up.add(executor)
        now = asyncio.get_running_loop().time()
        out = {ex for ex, _ in self._calls.values()}
        for executor in out - self._up - self._learning.keys():
            self._learning[executor] = (asyncio.ensure_future(_pinged(executor)), now)
        waited = {ex: now - sent for ex, (_, sent) in self._learning.items() if ex in out}
        waited = {ex: s for ex, s in waited.items() if s >= period and ex not in self._up}
        states = await asyncio.gather(*(_ray_state_within(ex) for ex in waited))
        for (executor, waited_s), state in zip(waited.items(), states, strict=True):
            if up_by_ray(state, waited_s):
                self._up.add(executor)

    def _restart(self, executor: Any) -> None:
        self._up.discard(executor)  # its next incarnation is learnt afresh
        learning = self._learning.pop(executor, None)
        if learning is not None:
            learning[0].cancel()
        log.warning("an executor with a call out does not answer: restarting it")
        self.restarted += 1
        with contextlib.suppress(Exception):  # dead meanwhile: its calls hear it
            ray.kill(executor, no_restart=False)

    def _seen_down(self, executor: Any) -> None:
        if executor not in self._back:
            task = asyncio.get_running_loop().create_task(_until_back(executor))
            self._back[executor] = task
            task.add_done_callback(lambda _: self._back.pop(executor, None))

    def _cancel(self, wave: _Wave) -> None:
        if wave.executor is None:
            return  # not sent yet: the flush skips it
        with contextlib.suppress(Exception):  # a dead executor has nothing left to stop
            wave.executor.cancel_waves.remote([wave.id])


class RayToolRunner:
    """The ToolRunner port on Ray: a wave's calls go to each pool they need together,
    sharing the round trip with the waves of other Runs (``actors.waves``)."""

    def __init__(self, agent_ref: str, agent: Agent, dispatcher: WaveDispatcher) -> None:
        self.agent_ref = agent_ref
        self.agent = agent
        self.dispatcher = dispatcher

    async def run(self, invocations: Sequence[ToolInvocation]) -> list[ToolOutcome]:
        groups: dict[str, list[int]] = {}
        resources: dict[str, Mapping[str, float]] = {}
        for i, inv in enumerate(invocations):
            needs = self._resources(inv.tool)
            key = pool_key(needs)
            groups.setdefault(key, []).append(i)
            resources[key] = needs
        outcomes: list[ToolOutcome | None] = [None] * len(invocations)
        parts = [
            self.dispatcher.run(resources[key], self.agent_ref, [invocations[i] for i in idx])
            for key, idx in groups.items()
        ]
        for idx, results in zip(groups.values(), await asyncio.gather(*parts), strict=True):
            for i, outcome in zip(idx, results, strict=True):
                outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    def _resources(self, tool_id: str) -> Mapping[str, float]:
        tool: Tool | None = self.agent.deployed_tool(tool_id)
        return tool.resources if tool is not None else {}


async def _pinged(executor: Any) -> Any:
    return await executor.ping.remote()


async def _until_back(executor: Any) -> None:
    """Until ``executor`` answers a ping (it is up again), or ``RESTART_WAIT_S`` passed
    (a call bound for it is sent anyway, and hears what becomes of it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESTART_WAIT_S
    pause, longest = BACK_POLL_S
    while loop.time() < deadline and not await _answers(executor):
        await asyncio.sleep(pause)  # Ray is restarting it: a backoff, not a sync
        pause = min(pause * 2, longest)


def ray_state(actor: Any) -> str | None:
    """Ray's word on ``actor`` (``ALIVE``, ``PENDING_CREATION``, ``RESTARTING``, …), from
    its GCS; None if Ray does not say (an internal API: blocking, and best effort)."""
    try:
        state: Any = ray._private.state  # untyped internals
        return str(state.actors(actor_id=actor._actor_id.hex())["State"])
    except Exception:  # another Ray, the GCS out of reach: the caller's bound decides
        return None


async def _ray_state_within(actor: Any) -> str | None:
    """``ray_state`` off the loop, within ``PING_TIMEOUT_S``: a GCS slow to answer must
    not hold the watch of every executor (None: Ray did not say)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(ray_state, actor), PING_TIMEOUT_S)
    except TimeoutError:
        return None


def up_by_ray(state: str | None, waited_s: float) -> bool:
    """Whether an executor whose first ping has waited ``waited_s`` (a lease at least)
    is taken for up: created and alive by Ray's word, or long enough if Ray does not say."""
    if state is None:
        return waited_s >= START_WAIT_S
    return state == "ALIVE"


async def _answers(executor: Any) -> bool:
    try:
        await asyncio.wait_for(executor.ping.remote(), PING_TIMEOUT_S)
    except Exception:  # hung, dead or restarting: a death is heard by its calls
        return False
    return True


def _deadline(invocations: Sequence[ToolInvocation], grace_s: float) -> float | None:
    timeouts = [inv.timeout_s for inv in invocations]
    if any(t is None for t in timeouts):
        return None
    return max(t for t in timeouts if t is not None) + grace_s
