"""Edges of a host's drives: stale drives, stopped and untrusted children, lost answers.

A host is made stale the way the Supervisor makes one: another host recovers (claims)
its Run while the first is inside a tool call; ``reconcile_s`` long keeps the stale
drive in place for the test to address it.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import select, update

from actors.drives import Drive, Drives, Holding
from actors.reconcile import Reconciler
from actors.retiring import Admission
from actors.run_host import RunHost
from actors.store_actor import RemoteCommitStore, store_actor
from actors.wire import SystemSpec, host_index, unwrap
from cluster.client import Ratchet, command_for
from runtime.agent import Agent
from runtime.context import StoreRetry
from runtime.delegation import ChildRequest, child_ids
from runtime.engine import Engine
from runtime.errors import ResumeRejected, StoreUnavailable
from runtime.faults import Crash, FaultPlan
from runtime.ids import CallId, RunId, ThreadId
from runtime.lifecycle import AwaitingState, PermissionDecision
from runtime.models import ModelResponse, ScriptedModel
from runtime.runner import InProcessRunner
from runtime.tool_calls import LocalToolRunner
from storage.memory import MemoryCommitStore
from storage.schema import commits
from tests.support.stores import AppendsOut

from .agents import permission_agent
from .checks import check_log
from .conftest import wait_for

pytestmark = pytest.mark.ray
HERE = "tests.ray.edge_agents"
STALE = {"reconcile_s": 600.0}
"""No reconciliation pass after the first: a stale drive stays until a request meets it."""


def _attempts(ledger, run_id: str) -> list[int]:
    return [attempt for _, _, attempt, _, note in ledger.rows(f":{run_id}:") if note == "started"]


async def _started(ledger, run_id: str, attempt: int) -> None:
    async def started() -> bool:
        return attempt in _attempts(ledger, run_id)

    await wait_for(started, what=f"attempt {attempt} of {run_id}'s tool to start")


async def _moved_to_host1(client: Ratchet, ledger, agent: str, thread: str) -> object:
    """A Run started on host 0, inside its first tool call, recovered by host 1."""
    handle = await client.start(f"{HERE}:{agent}", "go", thread_id=thread, host=0)
    await _started(ledger, handle.run_id, 1)
    assert unwrap(await client.hosts[1].recover_run.remote(handle.thread_id))
    assert handle.thread_id in await client.hosts[0].driving.remote()  # stale, still there
    return handle


async def test_a_cancel_sent_to_a_stale_host_ends_the_run_where_it_moved(make_system, ledger):
    client = await make_system(**STALE)
    handle = await _moved_to_host1(client, ledger, "dozing_agent", "edge-cancel")
    await _started(ledger, handle.run_id, 2)  # host 1 drives it now, inside its tool
    answer = unwrap(await client.hosts[0].cancel_run.remote(handle.thread_id))
    assert answer == "cancelled"  # ended through the claim-carrying path, not "signalled"
    assert handle.thread_id not in await client.hosts[0].driving.remote()
    frontier = await handle.result(timeout_s=30)
    assert frontier.run_state.cause.kind == "cancelled"
    assert frontier.owner.startswith(client.spec.host_name(0))
    await check_log(client.store, handle.thread_id)


async def test_a_resume_sent_to_a_stale_host_is_applied(make_system, ledger):
    client = await make_system(**STALE)
    handle = await _moved_to_host1(client, ledger, "nap_then_ask_agent", "edge-resume")

    async def awaiting() -> bool:
        return isinstance((await handle.frontier()).run_state, AwaitingState)

    await wait_for(awaiting, what="the Run to await its permission at host 1")
    ticket = await handle.ticket()
    await handle.resume(command_for(ticket, PermissionDecision(approve=True)), host=0)
    frontier = await handle.result(timeout_s=30)
    assert frontier.run_state.cause.kind == "natural"
    assert [m.text for m in frontier.messages if m.kind == "assistant"][-1] == "as you wished"
    drops = [row for row in ledger.rows(f":{handle.run_id}:") if row[1] == "drop_table"]
    assert len(drops) == 1


async def test_one_resume_through_two_hosts_at_once_lands_once_and_both_succeed(
    make_system, ledger
):
    client = await make_system()
    handle = await client.start("tests.ray.agents:permission_agent", "go")
    awaiting = await handle.result(timeout_s=30)
    command = command_for(awaiting.run_state.ticket, PermissionDecision(approve=True))
    command = command.model_copy(update={"request_id": "edge-request"})
    await asyncio.gather(handle.resume(command, host=0), handle.resume(command, host=1))
    frontier = await handle.result(timeout_s=30)
    assert frontier.run_state.cause.kind == "natural"
    resumed = [f for f in await handle.events() if f.type == "resumed"]
    assert [f.data["request_id"] for f in resumed] == ["edge-request"]
    drops = [row for row in ledger.rows(f":{handle.run_id}:") if row[1] == "drop_table"]
    assert len(drops) == 1
    await handle.resume(command)  # the same request once more: still its success
    denied = command.model_copy(update={"payload": PermissionDecision(approve=False, note="no")})
    with pytest.raises(ResumeRejected):  # the request id reused for another answer
        await handle.resume(denied)


async def test_a_child_drive_stopped_under_its_parent_is_followed_in_the_store(make_system, ledger):
    """The child's host stops its fenced drive (cancelled) while the parent waits on it:
    the parent's delegation follows the child to its new owner, and gets its answer."""
    client = await make_system(reconcile_s=0.3)
    parent, run = ThreadId("edge-parent-1"), RunId("edge-parent-run-1")
    child, child_run = child_ids(parent, run, CallId("d0"))
    handle = await client.start(f"{HERE}:parent_of_napper", "go", thread_id=parent, run_id=run)
    await _started(ledger, child_run, 1)
    home = host_index(child, client.spec.hosts)
    assert unwrap(await client.hosts[1 - home].recover_run.remote(child))
    frontier = await handle.result(timeout_s=40)
    assert frontier.run_state.cause.kind == "natural"
    assert json.loads(frontier.messages[-1].text) == ["rested"]
    kid = await client.store.load(child)
    assert kid.owner.startswith(client.spec.host_name(1 - home))
    assert child not in await client.hosts[home].driving.remote()


async def _plant_corrupt_thread(store, thread: ThreadId) -> None:
    """A thread whose first record no longer matches its hash (a disk gone bad)."""
    agent = Agent(name="planted", model=ScriptedModel((ModelResponse(text="planted"),)))
    await InProcessRunner(agent, store).start("planted input", thread_id=thread)
    first = (commits.c.thread_id == thread) & (commits.c.seq == 1)
    async with store.engine.begin() as conn:
        body = (await conn.execute(select(commits.c.body).where(first))).scalar_one()
        assert "planted input" in body
        await conn.execute(update(commits).where(first).values(body=body.replace("planted", "x")))


async def test_a_child_whose_records_do_not_verify_fails_its_delegation(make_system):
    client = await make_system()
    parent, run = ThreadId("edge-parent-2"), RunId("edge-parent-run-2")
    child, _ = child_ids(parent, run, CallId("d0"))
    await _plant_corrupt_thread(client.store, child)
    handle = await client.start(f"{HERE}:parent_of_worker", "go", thread_id=parent, run_id=run)
    frontier = await handle.result(timeout_s=40)
    assert frontier.run_state.cause.kind == "natural"  # the parent went on
    (result,) = json.loads(frontier.messages[-1].text)
    assert result.startswith("delegation failed") and "corrupt record" in result
    info = await client.hosts[host_index(child, client.spec.hosts)].info.remote()
    assert child in info["quarantined"]


async def test_a_claim_whose_answer_is_lost_is_store_unavailable(make_system):
    """The proxy's deadline passes before the store actor's answer arrives: the caller
    hears StoreUnavailable, though the claim landed (a retry must recognise it)."""
    client = await make_system(sqlite_writer="actor")
    hasty = RemoteCommitStore(store_actor(client.spec), timeout_s=1e-6)
    thread = ThreadId("edge-lost-claim")
    with pytest.raises(StoreUnavailable):
        await hasty.claim(thread, "edge-owner", 0)

    async def landed() -> bool:
        return (await client.store.load(thread)).owner == "edge-owner"

    await wait_for(landed, what="the claim whose answer was lost to land")


async def test_a_run_paused_by_a_rate_limit_is_resumed_when_its_time_comes(make_system):
    """The model is rate limited for longer than the Run may wait in memory: the Run
    pauses at rest with the time it may go on, and the Supervisor resumes it then."""
    client = await make_system()
    handle = await client.start(f"{HERE}:rate_limited_agent", "go")

    async def ended() -> bool:
        return (await handle.frontier()).ended

    await wait_for(ended, what="the Supervisor to resume the paused Run")
    done = await handle.frontier()
    assert done.run_state.cause.kind == "natural" and done.messages[-1].text == "served"
    # each host that drives it is limited once (the Supervisor may resume it elsewhere):
    # every pause is a rate limit's, each resumed no sooner than the time it named
    commits = [r.commit for r in await client.store.read(handle.thread_id)]
    pauses = [c.disposition.ticket.target for c in commits if c.label == "awaiting"]
    resumes = [c.status for c in commits if c.label == "resume"]
    assert pauses and len(resumes) == len(pauses)
    assert all((p.kind, p.reason) == ("pause", "rate_limit") for p in pauses)
    assert all(
        r is not None and r.since >= p.resume_at_us for p, r in zip(pauses, resumes, strict=True)
    )


async def test_a_frontier_read_before_a_drives_own_claim_does_not_fence_it():
    """A resume through a host loads the thread, then asks whether a drive of it here is
    stale. A load in flight while another resume's drive claimed the thread answers
    with the epoch before that claim: older, not another owner's claim. Taken for a
    fence, it stopped the drive after its resume landed and before its tool ran (CI
    found it in test_racing_resumes_of_one_ticket_apply_it_once)."""
    store, owner = MemoryCommitStore(), "edge-host#1"
    thread = ThreadId("edge-stale-read")
    tools = LocalToolRunner(permission_agent.tools)
    parked = await Engine(permission_agent, store, tools, owner=owner).start(thread, "go")
    before = await store.load(thread)  # read before the resume's claim
    holding = Holding(store)
    engine = Engine(permission_agent, holding, tools, owner=owner)
    command = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
    task = asyncio.ensure_future(engine.resume(command))
    await task
    drive = Drive(engine, task, parked.run_id, holding)
    drives = _drives(store, owner)
    assert drive.epoch == before.epoch + 1
    assert not drives.fenced(drive, before)  # older than the drive's claim
    assert not drives.fenced(drive, await store.load(thread))  # the drive's own
    await store.claim(thread, "another-host#1", drive.epoch)
    assert drives.fenced(drive, await store.load(thread))  # a later claim


def _drives(store: MemoryCommitStore, owner: str) -> Drives:
    """A host's drive table alone (no executors, children or bus: nothing here uses them)."""
    return Drives(
        SystemSpec(name="edge", store_url="memory://"), store, owner, *[None] * 4, lambda: None
    )


class _DriveSpawnedAtLoad:
    """A store whose first ``load`` of the thread lets a request in first: a drive of
    it is spawned here and claims the thread (a recovery's claim), as a resume or a
    recover arriving between the reconciler's look at the drive table and its mark."""

    def __init__(self, inner: MemoryCommitStore, drives: Drives, owner: str) -> None:
        self.inner, self.drives, self.owner = inner, drives, owner
        self.spawned = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> object:
        if not self.spawned:
            self.spawned = True
            holding = Holding(self.inner)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self.drives.table[thread] = Drive(None, done, None, holding)  # type: ignore[arg-type]
            await holding.claim(thread, self.owner, (await self.inner.load(thread)).epoch)
        return await self.inner.load(thread)


async def test_a_drive_spawned_while_the_host_reconciles_is_not_marked_lost_under_it():
    """The reconciler saw a Run of this host's running with no drive here (its drive
    ended just after the owner index was read), then a request spawned a drive that
    claimed it. Marking it lost now would claim it over that live drive."""
    store, owner = MemoryCommitStore(), "edge-host#2"
    thread = ThreadId("edge-spawned")
    tools = LocalToolRunner(permission_agent.tools)
    with pytest.raises(Crash):  # running, owned here, driven by nobody
        await Engine(
            permission_agent,
            store,
            tools,
            owner=owner,
            faults=FaultPlan(crash_at=("before:inference", 1)),
        ).start(thread, "go")
    (summary,) = await store.list_runs("running")
    drives = _drives(store, owner)
    raced = _DriveSpawnedAtLoad(store, drives, owner)
    recovered: list[ThreadId] = []

    async def recover(t: ThreadId) -> bool:
        recovered.append(t)
        return True

    reconciler = Reconciler("edge-host", owner, raced, drives, recover)  # type: ignore[arg-type]
    await reconciler._take_back(summary)
    assert raced.spawned  # the race happened
    frontier = await store.load(thread)
    assert frontier.status.state == "running"  # not marked lost over the new drive
    assert frontier.epoch == drives.get(thread).epoch and recovered == []


def _child_host(store: object, owner: str, agent: Agent) -> RunHost:
    """A RunHost's delegation side alone: its drives run ``agent`` on ``store``."""
    host = object.__new__(RunHost)
    host.spec = SystemSpec(name="edge", store_url="memory://")
    host.store, host.owner, host.kind = store, owner, "hosted"
    host.publisher = host.children = None
    host._background = set()
    host.admission = Admission()
    host.drives = _drives(store, owner)  # type: ignore[arg-type]
    retry = StoreRetry(give_up_after_s=0.2)

    def engine(ref: str, faults: object, link: object, holding: Holding) -> Engine:
        tools = LocalToolRunner(())
        return Engine(agent, holding, tools, owner=owner, parent=link, store_retry=retry)

    async def loaded(ref: str) -> None:
        return None

    host.drives.engine = engine  # type: ignore[method-assign]
    host.drives.loaded = loaded  # type: ignore[method-assign]
    return host


async def test_a_child_whose_start_never_landed_sends_its_parent_to_ask_again():
    """The child's start gave up before its activation landed (the store out longer than
    the engine's patience) and the store came back: the thread holds no Run, nobody owns
    it, so nobody would ever drive it. Following it waited for ever, and the parent's
    delegating call with it; the parent is told StoreUnavailable and asks again."""
    store = AppendsOut(MemoryCommitStore(), down=True)
    child = Agent(name="child", model=ScriptedModel((ModelResponse(text="done"),)))
    host = _child_host(store, "edge-host#3", child)
    request = ChildRequest(
        parent_thread=ThreadId("p"), parent_run=RunId("pr"), call_id=CallId("c1"),
        agent="x:child", input="hi", child_thread=ThreadId("p/c1@pr"), child_run=RunId("pr/c1"),
        prompt_path=("parent", "child"), lineage=("x:parent", "x:child"),
    )  # fmt: skip
    answer = asyncio.ensure_future(host.run_child(request.model_dump(mode="json")))
    gave_up = lambda: _true(request.child_thread in host.drives.paused)  # noqa: E731
    await wait_for(gave_up, 10, "the start gave up")
    store.down = False
    await Reconciler("edge-host", "edge-host#3", store, host.drives, _never).once()  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable, match="did not land"):
        unwrap(await asyncio.wait_for(answer, 10))
    assert (await store.load(request.child_thread)).version == 0  # nothing was written
    # asked again (the parent's recovery delegates the same child), it is started and
    # answered (cancelled here: the child sees that no parent Run awaits it)
    again = unwrap(await asyncio.wait_for(host.run_child(request.model_dump(mode="json")), 10))
    assert again["kind"] == "finished"
    ran = await store.load(request.child_thread)
    assert ran.run_id == request.child_run and ran.ended


async def _true(value: bool) -> bool:
    return value


async def _never(thread: ThreadId) -> bool:
    raise AssertionError(f"nothing is ours to recover here ({thread})")
