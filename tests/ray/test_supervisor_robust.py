"""The Supervisor and the dead letter under hostile Runs: a recovery that kills its host
counts; one corrupt thread does not stop the take-over of the others; a dead letter
lands only at the frontier it was decided from; a busy host is never retired."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import ray

from actors.ownership import DEAD_LETTER_AFTER, mark_lost
from actors.supervisor import supervisor
from runtime import (
    Agent,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    ScriptedModel,
    call,
    tool,
)
from runtime.lifecycle import EndedState, RunningState
from storage.memory import MemoryCommitStore

from .conftest import actor_gone, wait_for
from .crashing_agents import recovery_kills

pytestmark = pytest.mark.ray


def _killer() -> tuple[str, str]:
    token = uuid.uuid4().hex[:10]
    return token, f"tests.ray.crashing_agents:recovery_killer_{token}"


async def _left_running(store: Any, thread: str) -> Any:
    """A thread whose Run's host died before its end: running, driven by nobody."""
    agent = Agent(name="once", model=ScriptedModel([ModelResponse(text="done")]))
    with pytest.raises(Crash):
        await InProcessRunner(agent, store).start(
            "go", thread_id=thread, faults=FaultPlan(crash_at=("before:ended", 1))
        )
    return thread


def _assert_dead_lettered(frontier: Any) -> None:
    state = frontier.run_state
    assert isinstance(state, EndedState), state
    cause = state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "recovery", "execution_lost")
    assert f"{DEAD_LETTER_AFTER} times in a row" in cause.message, cause.message


@pytest.mark.timeout(150)
async def test_a_run_whose_recovery_kills_its_host_is_dead_lettered(make_system):
    """Ray restarts the host each time; each new process marks the Run lost (the last
    one had marked it already, then died recovering it) and dies recovering it."""
    client = await make_system(hosts=1, reconcile_s=0.5, heartbeat_s=0.25)
    token, ref = _killer()
    handle = await client.start(ref, "go", thread_id=f"rk-{token}", host=0)
    ray.kill(client.hosts[0], no_restart=False)  # the first loss: Ray restarts it
    _assert_dead_lettered(await handle.result(timeout_s=120))
    kills = recovery_kills(token)
    # the first loss was the kill; each recovery after it died once, counted once
    assert len(kills) == DEAD_LETTER_AFTER - 1 and len(set(kills)) == len(kills), kills
    assert await client.runs("running") == []


@pytest.mark.timeout(150)
async def test_a_run_whose_recovery_kills_every_host_it_is_sent_to_is_dead_lettered(
    make_system,
):
    """No restarts: the Supervisor re-places the Run, and each host it sends it to dies
    recovering it (the call fails with a RayActorError): each of those counts."""
    client = await make_system(hosts=2, host_max_restarts=0, reconcile_s=0.5, heartbeat_s=0.25)
    token, ref = _killer()
    handle = await client.start(ref, "go", thread_id=f"rk-{token}", host=0)
    ray.kill(client.hosts[0], no_restart=True)  # the first loss
    _assert_dead_lettered(await handle.result(timeout_s=120))
    kills = recovery_kills(token)
    assert len(kills) == DEAD_LETTER_AFTER - 1 and len(set(kills)) == len(kills), kills
    assert await client.runs("running") == []


async def _napping(client, ledger, thread: str) -> Any:
    handle = await client.start(
        "tests.ray.agents:long_napping_agent", "nap", thread_id=thread, host=0
    )
    prefix = f"tool-batch:{handle.run_id}:"

    async def napping() -> bool:
        return any(note == "started" for *_, note in ledger.rows(prefix))

    await wait_for(napping, what=f"the first nap of {thread}")
    return handle


@pytest.mark.timeout(120)
async def test_a_corrupt_thread_does_not_stop_the_take_over_of_the_others(make_system, ledger):
    """Host 0 dies for good owning three Runs; the first in every listing's order has a
    record that no longer verifies. It is quarantined; the others are taken over."""
    client = await make_system(hosts=2, host_max_restarts=0, reconcile_s=0.5, heartbeat_s=0.25)
    tag = uuid.uuid4().hex[:8]
    corrupt = f"a-corrupt-{tag}"
    await _napping(client, ledger, corrupt)
    healthy = [await _napping(client, ledger, f"{c}-healthy-{tag}") for c in "bc"]
    path = client.spec.store_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as db, db:
        db.execute("UPDATE ratchet_threads SET checksum = 'x' WHERE thread_id = ?", (corrupt,))
    ray.kill(client.hosts[0], no_restart=True)

    for handle in healthy:
        frontier = await handle.result(timeout_s=90)
        assert frontier.run_state.cause.kind == "natural", frontier.run_state
        assert frontier.owner.startswith(client.spec.host_name(1))
    report = await supervisor(client.spec).report.remote()
    assert report["quarantined"] == [corrupt], report


class _HeldModel:
    """Asks for ``wait`` once; answers at once unless ``hold`` (then once ``release``)."""

    def __init__(self) -> None:
        self.hold = False
        self.release = asyncio.Event()

    async def stream(self, request: Any) -> AsyncIterator[ModelResponse]:
        if self.hold:
            await self.release.wait()
        yield ModelResponse(text="waiting", tool_calls=(call("wait", "c1"),))


class _ProgressFirst:
    """The store, except that the first log read (the dead letter checks the log between
    deciding and appending) lets the live owner make progress, and waits for it."""

    def __init__(self, inner: MemoryCommitStore, model: _HeldModel, busy: asyncio.Event):
        self.inner, self.model, self.busy = inner, model, busy
        self.raced = False

    async def read(self, thread: Any, after_seq: int = 0) -> Any:
        if not self.raced:
            self.raced = True
            self.model.release.set()
            await asyncio.wait_for(self.busy.wait(), 10)  # its inference has committed
        return await self.inner.read(thread, after_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_dead_letter_never_ends_a_run_that_made_progress_meanwhile():
    """The Run has been lost twice; its owner, taken for lost but alive, commits an
    inference (progress: the count starts again) between the dead letter's decision and
    its append. The end does not land; the Run is marked lost once, as it is now."""
    busy = asyncio.Event()
    forever = asyncio.Event()

    @tool(recovery=("replay_safe",))
    async def wait() -> str:
        busy.set()
        await forever.wait()
        return "never"

    store = MemoryCommitStore()
    model = _HeldModel()
    runner = InProcessRunner(Agent(name="held", model=model, tools=(wait,)), store)
    with pytest.raises(Crash):
        await runner.start("go", thread_id="t", faults=FaultPlan(crash_at=("before:inference", 1)))
    assert await mark_lost(store, "t", "supervisor", lost_owner=(await store.load("t")).owner)
    with pytest.raises(Crash):
        await runner.recover("t", faults=FaultPlan(crash_at=("before:inference", 1)))
    assert await mark_lost(store, "t", "supervisor", lost_owner=(await store.load("t")).owner)
    assert (await store.load("t")).failed_recoveries == DEAD_LETTER_AFTER - 1

    model.hold = True
    live = asyncio.create_task(runner.recover("t"))
    try:

        async def recovered() -> bool:
            f = await store.load("t")
            return f.owner != "supervisor" and f.status.state == "running"

        await wait_for(recovered, timeout_s=10, what="the live owner's recovery")
        owner = (await store.load("t")).owner
        raced = _ProgressFirst(store, model, busy)
        marked = await mark_lost(raced, "t", "supervisor", lost_owner=owner)  # type: ignore[arg-type]
        assert marked == "lost"
        assert raced.raced
        frontier = await store.load("t")
        assert isinstance(frontier.run_state, RunningState), frontier.run_state
        assert frontier.steps == 1 and frontier.failed_recoveries == 1
        assert (frontier.status.state, frontier.owner) == ("failed", "supervisor")
    finally:
        live.cancel()
        with contextlib.suppress(BaseException):
            await live


async def test_a_busy_host_is_not_retired(make_system, ledger):
    """A host asks to retire, but work arrived meanwhile: the Supervisor refuses; an idle
    one it ends."""
    client = await make_system()
    handle = await _napping(client, ledger, f"busy-{uuid.uuid4().hex[:8]}")
    boss = supervisor(client.spec)
    assert await boss.retire.remote(client.spec.host_name(0)) is False
    assert handle.thread_id in await client.hosts[0].driving.remote()
    assert await boss.retire.remote(client.spec.host_name(1)) is True
    await wait_for(actor_gone(client.spec.host_name(1)), what="the idle host to end")


async def test_a_take_over_decided_from_a_stale_listing_leaves_the_run_to_its_new_owner():
    """The sweep lists a Run as the Supervisor marked it (failed, its own), but a host
    claimed it since (a recovery of ours whose call timed out went on, say). Re-placing
    it now, at that claim's epoch, would fence a drive nobody judged lost: the take-over
    does nothing, and the next sweep judges the new owner afresh."""
    from actors.supervisor import Supervisor

    store = MemoryCommitStore()
    thread = await _left_running(store, "t-stale")
    lost = (await store.load_head(thread)).owner
    assert await mark_lost(store, thread, "supervisor", lost_owner=lost) == "lost"
    (listed,) = await store.list_runs("running")
    assert (listed.owner, listed.status.state) == ("supervisor", "failed")
    marked = await store.load_head(thread)
    claimed = await store.claim(thread, "host-2#7", supersedes=marked.epoch)

    bare = object.__new__(Supervisor)  # the decision only: no actor, no hosts
    bare.store, bare.owner, bare.publisher, bare.children = store, "supervisor", None, None
    sent: list[Any] = []

    async def replace(*args: Any) -> None:
        sent.append(args)

    bare._replace = replace  # type: ignore[method-assign]
    assert await bare._take_over(listed) is False
    assert sent == []
    head = await store.load_head(thread)
    assert (head.owner, head.epoch) == ("host-2#7", claimed.epoch)


class _HungHost:
    """A host whose calls never answer (its process stopped, its loop blocked)."""

    def __init__(self) -> None:
        self.calls = 0
        hung = self

        class _Never:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                hung.calls += 1
                return asyncio.get_running_loop().create_future()

        self.resume_run = _Never()


async def test_a_hung_host_does_not_hold_the_watch_with_due_pauses(monkeypatch):
    """Paused Runs whose time has come, placed on a host that hangs: the sweep resumed
    them inline, one after the other, each call up to DELIVERY_S, and the watch (leases,
    take-overs) waited. Now they are asked in the background, several at once (as many
    as one host may have under way), and a sweep while that pass is under way starts no
    second one."""
    from collections import Counter

    import actors.deliveries
    from actors.deliveries import PER_HOST
    from actors.orphans import Orphans
    from actors.schedule import Alarms, alarm
    from actors.supervisor import Supervisor
    from actors.system_lease import LeaseKeeper
    from actors.wire import SystemSpec
    from runtime.engine import Engine
    from runtime.errors import ModelRateLimited
    from runtime.ids import ThreadId
    from runtime.timeutil import now_us
    from runtime.tool_calls import LocalToolRunner

    class Limited:
        async def stream(self, request: Any) -> Any:
            raise ModelRateLimited("rate_limit", "slow down", status=429, retry_after_s=0.0)
            yield  # an async generator that never yields

    monkeypatch.setattr(actors.deliveries, "DELIVERY_S", 3600.0)
    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    agent = Agent(name="limited", model=Limited(), rate_limit_wait_s=0.0)
    engine = Engine(agent, store, LocalToolRunner([]), owner=f"{spec.host_name(0)}#1")
    for i in range(6):
        f = await engine.start(ThreadId(f"p{i}"), "go")  # paused until a moment from now
        assert f.run_state.kind == "awaiting" and f.status.reason == "awaiting_pause"
    threads = [ThreadId(f"p{i}") for i in range(6)]

    async def all_due() -> bool:
        return all([alarm(await store.load(t))[0] <= now_us() for t in threads])

    await wait_for(all_due, what="the pauses' time to come")
    hung = _HungHost()
    bare = object.__new__(Supervisor)  # the sweep only: no actor, no hosts
    bare.spec, bare.owner, bare.store = spec, spec.supervisor_name, store
    bare.counts, bare.quarantined, bare._taking, bare.leases = Counter(), set(), set(), {}
    bare._quarantined_at = {}
    bare._waking = None
    bare.orphans, bare.alarms = Orphans(store, bare._end_orphan), Alarms()
    bare.lease = LeaseKeeper(store, spec.name)  # held, as Ratchet.connect leaves it
    bare._host_of = lambda frontier: hung  # type: ignore[method-assign]
    await asyncio.wait_for(bare._sweep(), 30)  # not held by the hung host
    await wait_for(lambda: hung.calls == PER_HOST, what="due Runs to be asked at once")
    await asyncio.wait_for(bare._sweep(), 30)
    assert hung.calls == PER_HOST and not bare._waking.done()  # the pass under way goes on
    bare._waking.cancel()


async def test_timed_runs_at_rest_are_read_once_per_version_and_woken_when_due(monkeypatch):
    """The sweep reads when a Run at rest is due (a wait's deadline) from its frontier:
    once per committed version, not once per sweep for every parked Run, and again
    when due, to wake it. Runs with no deadline are not read again at all."""
    import runtime.resume
    from actors.schedule import Alarms
    from runtime.engine import Engine
    from runtime.ids import ThreadId
    from runtime.timeutil import now_us
    from runtime.tool_calls import LocalToolRunner
    from tests.runtime.agents import answer_any_time as never
    from tests.runtime.agents import answer_within_an_hour as later

    class Counting(MemoryCommitStore):
        loads = 0

        async def load(self, thread: str) -> Any:
            Counting.loads += 1
            return await super().load(thread)

    class Host:
        calls: list[Any] = []

        class resume_run:
            @staticmethod
            async def remote(command: Any) -> Any:
                Host.calls.append((command, Counting.loads))
                return await engines[command.thread_id].resume(command)

    store, engines = Counting(), {}
    for name, t in (("soon", later), ("none", never)):
        script = [ModelResponse(tool_calls=(call(t.id, "c1", x=1),)), ModelResponse(text="ok")]
        agent = Agent(name=name, model=ScriptedModel(script), tools=[t])
        engines[name] = Engine(agent, store, LocalToolRunner([t]), owner="sys:host-0#1")
        await engines[name].start(ThreadId(name), "go")
    alarms = Alarms()
    awaiting = list(await store.list_runs("awaiting"))
    assert {s.status.reason for s in awaiting} == {"awaiting_permission"}
    Counting.loads = 0
    now = now_us()
    assert await alarms.fire(store, awaiting, lambda f: Host, now) == (0, 0)
    assert Counting.loads == 2
    for _ in range(5):  # nothing changed, nothing due: nothing read
        assert await alarms.fire(store, awaiting, lambda f: Host, now) == (0, 0)
    assert Counting.loads == 2 and Host.calls == []
    # past the deadline (by the host's clock too): the Run is read again and its wait
    # expired through its host
    later_us = now + 3601 * 10**6
    monkeypatch.setattr(runtime.resume, "now_us", lambda: later_us)
    assert await alarms.fire(store, awaiting, lambda f: Host, later_us) == (0, 1)
    assert [(c.payload.kind, loads) for c, loads in Host.calls] == [("expired", 3)]


async def test_a_failed_recovery_is_tried_again_only_after_a_while():
    """A restarted host cannot import the Run's agent for a moment (a deploy, a server
    its module asks for restarting): each pass, 2 s apart, counted a failure and the
    Run was dead-lettered on the second. Now the next try waits RECOVERY_RETRY_S; once
    the import works the Run is driven again, and its failures are forgotten."""
    from actors.drives import Drives
    from actors.reconcile import RECOVERY_RETRY_S, Reconciler
    from actors.wire import RemoteError, SystemSpec
    from runtime.errors import AgentImportError
    from runtime.ids import ThreadId

    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    agent = Agent(name="once", model=ScriptedModel([ModelResponse(text="done")]))
    thread = ThreadId("t-import")
    with pytest.raises(Crash):  # the host's last incarnation dies mid-run
        await InProcessRunner(agent, store).start(
            "go", thread_id=thread, faults=FaultPlan(crash_at=("before:ended", 1))
        )
    head = await store.load_head(thread)
    host, owner = spec.host_name(0), f"{spec.host_name(0)}#2"
    await store.claim(thread, f"{host}#1", supersedes=head.epoch)  # it was that host's
    importing = [AgentImportError("cannot import module 'pkg.mod': restarting")]

    async def recover(t: ThreadId) -> Any:
        if importing:
            return RemoteError.of(importing[0])
        return True  # a drive started

    drives = Drives(spec, store, owner, *[None] * 4, lambda: None)
    reconciler = Reconciler(host, owner, store, drives, recover)
    await reconciler.once()  # the loss, then the failed recovery: both count
    marked = await store.load_head(thread)
    assert marked.failed_recoveries == 2 and marked.status.state == "failed"
    for _ in range(3):  # passes before the retry's time: nothing is tried or counted
        await reconciler.once()
    assert (await store.load_head(thread)).version == marked.version
    assert reconciler.retry[thread][1] == 2 * RECOVERY_RETRY_S  # the wait after the next
    importing.clear()  # the import works again, and the retry's time has come
    reconciler.retry[thread] = (0.0, reconciler.retry[thread][1])
    await reconciler.once()
    assert thread not in reconciler.retry
    still = await store.load_head(thread)
    assert isinstance(still.run_state, RunningState) and still.version == marked.version


async def test_a_quarantined_run_listed_again_is_driven_again_after_a_while():
    """A thread quarantined for records that did not verify (an index key set to another
    type by hand), then repaired: host and Supervisor kept it quarantined for their
    lives, and its Run stayed running, driven by nobody. Listed again (its head
    verifies), it is looked at again once RECOVERY_RETRY_S has passed."""
    from actors.drives import Drives
    from actors.reconcile import RECOVERY_RETRY_S, Reconciler
    from actors.supervisor import Supervisor
    from actors.wire import RemoteError, SystemSpec
    from runtime.errors import CorruptRecord
    from runtime.ids import ThreadId

    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    thread = await _left_running(store, "t-repaired")
    host, owner = spec.host_name(0), f"{spec.host_name(0)}#1"
    await store.claim(thread, owner, supersedes=(await store.load_head(thread)).epoch)
    recovered: list[ThreadId] = []
    corrupt = [True]

    async def recover(t: ThreadId) -> Any:
        recovered.append(t)
        if corrupt[0]:  # its drive meets records that do not verify, and quarantines it
            drives.quarantined.add(t)
            return RemoteError.of(CorruptRecord(t, 3, "checksum"))
        return True  # repaired: a drive started

    drives = Drives(spec, store, owner, *[None] * 4, lambda: None)
    drives.quarantined.add(thread)  # its drive met records that did not verify
    reconciler = Reconciler(host, owner, store, drives, recover)
    await reconciler.once()  # listed: looked at again, still corrupt
    assert recovered == [thread] and thread in drives.quarantined
    for _ in range(3):  # the next look waits
        await reconciler.once()
    assert recovered == [thread]
    corrupt[0] = False  # repaired by hand, and the wait is over
    reconciler.retry[thread] = (0.0, reconciler.retry[thread][1])
    await reconciler.once()
    assert recovered == [thread, thread] and thread not in drives.quarantined

    bare = object.__new__(Supervisor)
    bare.store, bare.quarantined, bare._quarantined_at = store, set(), {}
    bare._quarantine(thread, time.monotonic())
    await bare._running()  # listed, but quarantined only now: kept
    assert bare.quarantined == {thread}
    bare._quarantined_at[thread] -= RECOVERY_RETRY_S + 1
    await bare._running()
    assert bare.quarantined == set() and bare._quarantined_at == {}


async def test_a_hung_dedicated_host_this_supervisor_never_heard_from_is_ended(monkeypatch):
    """A Run's dedicated host hangs (SIGSTOP) while the Supervisor does not know it (it
    restarted, or the host never sent it a heartbeat): the Run was re-placed on that
    hung host at every sweep for ever, as only a host whose lease ran out was ended,
    and this Supervisor never granted it one. Now the first host that does not answer
    gets a lease then, and is ended when it runs out."""
    import importlib
    from collections import Counter

    from actors.wire import RunMeta, SystemSpec
    from runtime.engine import Engine
    from runtime.ids import RunId, ThreadId
    from runtime.tool_calls import LocalToolRunner

    class _Hung:
        class ping:
            @staticmethod
            def remote() -> Any:
                return asyncio.get_running_loop().create_future()

    import actors.take_overs as take_overs

    sup = importlib.import_module("actors.supervisor")  # the package names its function so
    killed: list[Any] = []
    hung = _Hung()
    monkeypatch.setattr(take_overs, "PING_TIMEOUT_S", 0.01)
    monkeypatch.setattr(take_overs, "dedicated_host", lambda spec, thread, extra=None: hung)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    store = MemoryCommitStore()
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))
    run, thread = RunId("r1"), ThreadId("hung-unknown")
    engine = Engine(
        agent,
        store,
        LocalToolRunner([]),
        owner="sys:dedicated:abc#1",
        faults=FaultPlan(crash_at=("after:activation", 1)),
    )
    with pytest.raises(Crash):  # started, then its host hung: running, driven by nobody
        await engine.start(
            thread, "go", run_id=run, message_id=RunMeta("m:a", "dedicated").message_id(run)
        )
    bare = object.__new__(sup.Supervisor)  # a Supervisor just restarted: no leases, no kinds
    bare.spec = SystemSpec(name="sys", store_url="memory://", lease_ttl_s=0.05)
    bare.store, bare.owner = store, bare.spec.supervisor_name
    bare.leases, bare.kinds, bare._silent = {}, {}, {}
    bare._recovering, bare.counts = Counter(), Counter()

    async def ended_once_its_lease_ran_out() -> bool:
        await bare._replace(await store.load(thread))
        return bool(killed)

    await wait_for(ended_once_its_lease_ran_out, 10, "the hung dedicated host to be ended")
    assert killed == [hung]


async def test_a_recovery_that_fails_before_its_first_commit_counts_to_its_dead_letter():
    """A recovery drive that dies before its first commit (here: before its claim, as
    one whose thread id a lowered id_chars refused used to) was never counted: the
    recovery had been "started", so each reconciliation pass started another that died
    the same way, and the Run stayed running for ever."""
    from actors.drives import Drives
    from actors.reconcile import Reconciler
    from actors.retiring import Admission
    from actors.run_host import RunHost
    from actors.wire import RunMeta, SystemSpec
    from runtime.engine import Engine
    from runtime.ids import RunId, ThreadId
    from runtime.tool_calls import LocalToolRunner

    store = MemoryCommitStore()
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))
    run, thread, owner = RunId("r1"), ThreadId("t" * 200), "h#2"
    with pytest.raises(Crash):  # the host process died after the activation landed
        await Engine(
            agent, store, LocalToolRunner([]), owner="h#1",
            faults=FaultPlan(crash_at=("after:activation", 1)),
        ).start(thread, "go", run_id=run, message_id=RunMeta("x:a").message_id(run))  # fmt: skip
    host = object.__new__(RunHost)  # its new incarnation
    host.spec = SystemSpec(name="s", store_url="memory://")
    host.store, host.owner, host.kind, host.recovered = store, owner, "hosted", 0
    host.publisher = host.children = None
    host._background, host.admission = set(), Admission()
    host.drives = Drives(host.spec, store, owner, *[None] * 4, lambda: None)

    class DiesBeforeItsClaim(Engine):
        async def recover(self, thread: ThreadId, loaded: Any = None) -> Any:
            raise Crash("the recovery's process died before its claim")

    host.drives.engine = lambda ref, faults, link, holding: DiesBeforeItsClaim(  # type: ignore[method-assign]
        agent, holding, LocalToolRunner([]), owner=owner, limits=host.spec.limits
    )

    async def loaded(ref: str) -> None:
        host.drives.agents.setdefault(ref, (agent, None))  # type: ignore[arg-type]

    host.drives.loaded = loaded  # type: ignore[method-assign]
    recover = functools.partial(host._recover, owner=owner)
    reconciler = Reconciler("h", owner, store, host.drives, recover)

    async def dead_lettered() -> bool:
        await reconciler.once()
        return (await store.load(thread)).ended

    await wait_for(dead_lettered, 30, "the Run to be dead-lettered")
    cause = (await store.load(thread)).run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "recovery", "recovery_failed")
    assert "Crash" in cause.message, cause.message


def _crashed_run(store: MemoryCommitStore, owner: str) -> Any:
    """A Run started by ``owner``, whose process died after its activation landed."""
    from actors.wire import RunMeta
    from runtime.engine import Engine
    from runtime.ids import RunId, ThreadId
    from runtime.tool_calls import LocalToolRunner

    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")]))
    run = RunId("r1")
    engine = Engine(
        agent, store, LocalToolRunner([]), owner=owner,
        faults=FaultPlan(crash_at=("after:activation", 1)),
    )  # fmt: skip
    message = RunMeta("x:a").message_id(run)
    return engine.start(ThreadId("outage"), "go", run_id=run, message_id=message)


@pytest.mark.parametrize("by", ["reconciler", "supervisor"])
async def test_a_recovery_that_met_a_store_outage_does_not_count_to_its_dead_letter(by):
    """The store flaps, or one host cannot reach it (a partition, "too many clients"
    after a restart): a recovery whose own read met the outage failed for no fault of
    its Run's, yet was counted, and three such passes (six seconds of Supervisor sweeps)
    ended the Run ``failed(recovery)`` for good. Now it is tried again, not counted;
    a recovery that fails for its Run's own reason still counts."""
    from collections import Counter

    from actors.drives import Drives
    from actors.reconcile import Reconciler
    from actors.supervisor import Supervisor
    from actors.wire import RemoteError, SystemSpec
    from runtime.errors import AgentImportError, StoreUnavailable
    from runtime.ids import ThreadId

    spec = SystemSpec(name="sys", store_url="memory://")
    store = MemoryCommitStore()
    thread, host_owner = ThreadId("outage"), f"{spec.host_name(0)}#1"
    with pytest.raises(Crash):
        await _crashed_run(store, host_owner)
    answers = [RemoteError.of(StoreUnavailable("store out for this host"))] * 4

    async def recover(*args: Any) -> Any:
        return answers.pop(0)

    if by == "reconciler":
        drives = Drives(spec, store, host_owner, *[None] * 4, lambda: None)  # type: ignore[arg-type]
        drives.paused.add(thread)  # its drive paused on the outage: ours to drive again
        reconciler = Reconciler(spec.host_name(0), host_owner, store, drives, recover)

        async def one_pass() -> None:
            reconciler.retry.clear()  # as if the back-off had run out
            await reconciler.once()
    else:

        class _Host:
            class ping:
                @staticmethod
                async def remote() -> None:
                    return None

            class recover_run:
                remote = staticmethod(recover)

        bare = object.__new__(Supervisor)
        bare.spec, bare.owner, bare.store = spec, spec.supervisor_name, store
        bare.counts, bare._recovering, bare.leases, bare.kinds = Counter(), Counter(), {}, {}
        bare.publisher = bare.children = None
        bare._target = lambda thread, meta: ("host", _Host())  # type: ignore[method-assign]
        await mark_lost(store, thread, bare.owner, lost_owner=host_owner)

        async def one_pass() -> None:
            await bare._replace(await store.load(thread))

    before = (await store.load(thread)).failed_recoveries
    for _ in range(4):
        await one_pass()
    after = await store.load(thread)
    assert not after.ended and after.failed_recoveries == before
    answers.append(RemoteError.of(AgentImportError("the deploy is under way")))
    await one_pass()  # the Run's own failure still counts
    assert (await store.load(thread)).failed_recoveries == before + 1
