"""Every wait kind, every rejection axis, cancel and stop, and the stream, on Ray.

One system (SQLite, no bus) serves the module; the Redis test makes its own. Every
test leaves its Runs at rest, so the hosts it shares are idle between tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
import ray

from cluster.client import Ratchet, RunHandle, command_for
from cluster.config import ClusterUnavailable
from cluster.report import EXECUTION_LOST, analyse
from cluster.stream import StreamText
from runtime.batch import ToolOutput
from runtime.errors import ResumeRejected
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    ExternalResult,
    PermissionDecision,
    ScheduledFire,
    Unpause,
    UserInput,
)
from runtime.messages import AssistantMessage, ToolResultMessage, UserMessage
from runtime.stream import Frame, parse_offset

from .checks import check_log
from .conftest import actor_gone, wait_for
from .wait_agents import ANSWER, LONG_S

pytestmark = pytest.mark.ray
WAITS = "tests.ray.wait_agents"
PERMISSION = "tests.ray.agents:permission_agent"


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ratchet]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('waits'))}/store.db"
    client = asyncio.run(Ratchet.connect(store_url=url))
    yield client
    asyncio.run(client.shutdown())


def tool_results(frontier) -> list[ToolResultMessage]:
    return [m for m in frontier.messages if isinstance(m, ToolResultMessage)]


def statuses(frames: list[Frame]) -> list[tuple[str, str | None]]:
    return [(f.status.state, f.status.reason) for f in frames if f.type == "thread_status"]


def fact_keys(frames: list[Frame]) -> list[tuple[int, int, str]]:
    return [(f.event.seq, f.event.index, f.event.type) for f in frames if f.offset is not None]


async def awaiting(handle: RunHandle):
    frontier = await handle.result(timeout_s=30)
    assert isinstance(frontier.run_state, AwaitingState), frontier.run_state
    return frontier


async def ended(handle: RunHandle, cause: str):
    frontier = await handle.result(timeout_s=30)
    assert isinstance(frontier.run_state, EndedState), frontier.run_state
    assert frontier.run_state.cause.kind == cause, frontier.run_state.cause
    return frontier


async def not_driven(client: Ratchet, thread: str) -> bool:
    for host in client.hosts:
        if thread in await host.driving.remote():
            return False
    return True


# ---- each wait kind, round trip ------------------------------------------------------------

ROUND_TRIPS = {
    "approve": (PERMISSION, PermissionDecision(approve=True), "permission"),
    "deny": (PERMISSION, PermissionDecision(approve=False, note="not today"), "permission"),
    "external": (f"{WAITS}:external_agent", None, "external_result"),
    "scheduled": (f"{WAITS}:scheduled_agent", ScheduledFire(), "scheduled_action"),
    "input": (f"{WAITS}:input_agent", UserInput(text="savings"), "user_input"),
    "pause": (f"{WAITS}:pause_agent", Unpause(), "pause"),
}


@pytest.mark.parametrize("kind", list(ROUND_TRIPS))
async def test_each_wait_kind_round_trip(system, ledger, kind):
    ref, payload, wait = ROUND_TRIPS[kind]
    payload = payload or ExternalResult(output=ToolOutput(content="7 cm"))
    handle = await system.start(ref, "go")
    parked = await awaiting(handle)
    ticket = parked.run_state.ticket
    assert ticket.payload_kind == wait
    assert (await handle.status()).reason == f"awaiting_{wait}"
    assert await not_driven(system, handle.thread_id)  # held by the store alone
    command = await handle.respond(payload)
    assert command.correlation == ticket.correlation
    done = await ended(handle, "natural")
    effects = ledger.rows(f"tool-batch:{handle.run_id}:")
    results = tool_results(done)
    if kind == "approve":
        assert results[0].content == "dropped users" and len(effects) == 1
    elif kind == "deny":
        assert results[0].is_error and "blocked" in results[0].content and effects == []
    elif kind == "external":
        assert results[0].content == "7 cm"
    elif kind == "scheduled":
        assert results[0].content == "reminded: tea" and len(effects) == 1
    elif kind == "input":
        assert [m.text for m in done.messages if isinstance(m, UserMessage)] == ["go", "savings"]
    facts = [f.type for f in await handle.events()]
    assert facts.count("awaiting") == 1 and facts.count("resumed") == 1
    await check_log(system.store, handle.thread_id)


async def test_respond_asked_again_under_its_request_id_is_its_success(system, ledger):
    """A caller whose answer was lost asks again with the same request id: the resume that
    landed under it is its success (its command back), even with the ticket gone; another
    id, or that id with another payload, is rejected, and the tool ran once."""
    handle = await system.start(PERMISSION, "go")
    ticket = (await awaiting(handle)).run_state.ticket
    approve = PermissionDecision(approve=True)
    first = await handle.respond(approve, request_id="answer-1")
    assert first.request_id == "answer-1" and first.correlation == ticket.correlation
    await ended(handle, "natural")
    assert await handle.respond(approve, request_id="answer-1") == first
    with pytest.raises(ResumeRejected):
        await handle.respond(approve, request_id="answer-2")
    with pytest.raises(ResumeRejected):
        await handle.respond(PermissionDecision(approve=False), request_id="answer-1")
    with pytest.raises(ResumeRejected):
        await handle.respond(approve)  # no id: a new answer, and there is no ticket
    assert len(ledger.rows(f"tool-batch:{handle.run_id}:")) == 1


async def test_respond_asked_again_never_answers_the_run_s_next_ticket(system, ledger):
    """The Run awaits a second permission by the time the caller asks again under the
    first answer's request id: that is the first answer's success, and the second
    ticket stays unanswered (no human approved it)."""
    handle = await system.start("tests.ray.edge_agents:asks_twice_agent", "go")
    first = (await awaiting(handle)).run_state.ticket
    approve = PermissionDecision(approve=True)
    answered = await handle.respond(approve, request_id="answer-1")
    assert answered.correlation == first.correlation

    async def asks_again():
        ticket = await handle.ticket()
        return ticket is not None and ticket.correlation != first.correlation

    await wait_for(asks_again, what="the second permission asked")
    assert await handle.respond(approve, request_id="answer-1") == answered
    second = await handle.ticket()
    assert second is not None and second.correlation != first.correlation  # still waiting
    effects = [row for row in ledger.rows(f"tool-batch:{handle.run_id}:")]
    assert len(effects) == 1  # scratch only


# ---- an awaiting Run outlives its host ------------------------------------------------------


async def _pid(host) -> int | None:
    try:
        return int((await host.info.remote())["pid"])
    except ray.exceptions.RayActorError:
        return None


@pytest.mark.parametrize("how", ["ray_kill", "os_exit_after_awaiting"])
async def test_an_awaiting_run_survives_its_host_and_resumes_on_another(system, ledger, how):
    host0 = system.hosts[0]
    before = await _pid(host0)
    faults = ("after:awaiting", 1, "exit") if how == "os_exit_after_awaiting" else None
    handle = await system.start(PERMISSION, "clean up", host=0, faults=faults)
    parked = await awaiting(handle)
    if how == "ray_kill":
        ray.kill(host0, no_restart=False)

    async def restarted() -> bool:
        pid = await _pid(host0)
        return pid is not None and pid != before

    await wait_for(restarted, what="host 0 restarted")
    after = await handle.frontier()
    assert after.run_state == parked.run_state  # still awaiting, the same ticket
    assert (after.status.state, after.status.reason) == ("idle", "awaiting_permission")
    await handle.respond(PermissionDecision(approve=True), host=1)
    done = await ended(handle, "natural")
    assert done.owner is not None and done.owner.startswith(system.spec.host_name(1))
    assert len(ledger.rows(f"tool-batch:{handle.run_id}:")) == 1
    report = await check_log(system.store, handle.thread_id)
    assert report.lost == 0  # nothing was running, so nothing was lost


async def test_a_wait_on_a_run_its_thread_moved_past_answers_with_that_runs_end(system):
    """A waiter that looks only once its Run ended and a later Run started on the thread
    (a conversation's next turn) is answered with its own Run's end, folded from the
    store's verified log, not left polling for a Run the thread will never hold again."""
    first = await system.start(PERMISSION, "clean up")
    await awaiting(first)
    assert await first.cancel() == "cancelled"
    end = await ended(first, "cancelled")
    later = await system.start(PERMISSION, "and again", thread_id=first.thread_id)
    await awaiting(later)
    stale = RunHandle(system, first.thread_id, first.run_id, "hosted")  # another process's
    answer = await stale.result(timeout_s=30)
    assert (answer.run_id, answer.version, answer.head) == (end.run_id, end.version, end.head)
    assert answer.run_state == end.run_state and answer.messages == end.messages
    (row,) = await system.wait_all([stale], timeout_s=30)
    assert (row.run_id, row.state, row.version) == (first.run_id, "ended", end.version)
    # a handle acts on its own Run only: the later one is not ended in its place
    assert await stale.cancel() == "not_running"
    assert await stale.stop("stale") == "not_running"
    assert isinstance((await later.frontier()).run_state, AwaitingState)
    assert await later.cancel() == "cancelled"


async def test_a_moved_past_run_whose_end_was_pruned_is_a_clear_error():
    """Folded from the log only while the log is whole: a pruned thread (or a Run it
    never held) is RunSuperseded, naming the Run the thread holds now."""
    from cluster.waiting import end_of
    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
    from runtime.errors import RunSuperseded
    from storage.memory import MemoryCommitStore

    store = MemoryCommitStore()
    thread = ThreadId("t-pruned")
    for run in ("r1", "r2"):
        agent = Agent(name="once", model=ScriptedModel([ModelResponse(text=run)]))
        await InProcessRunner(agent, store).start("go", thread_id=thread, run_id=run)
    assert (await end_of(store, thread, RunId("r1"), RunId("r2"))).run_id == "r1"
    with pytest.raises(RunSuperseded, match="'r9' is no longer"):
        await end_of(store, thread, RunId("r9"), RunId("r2"))
    await store.prune(thread, (await store.load_head(thread)).version)
    with pytest.raises(RunSuperseded) as superseded:
        await end_of(store, thread, RunId("r1"), RunId("r2"))
    assert (superseded.value.run, superseded.value.current) == ("r1", "r2")


# ---- rejections --------------------------------------------------------------------------


async def test_every_rejection_axis_through_the_client(system, ledger):
    handle = await system.start(PERMISSION, "clean up")
    parked = await awaiting(handle)
    good = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
    bad = {
        "correlation": good.model_copy(update={"correlation": "guess"}),
        "run": good.model_copy(update={"run_id": "run-other"}),
        "thread": good.model_copy(update={"thread_id": "thread-other"}),
        "payload": good.model_copy(update={"payload": UserInput(text="yes, go ahead")}),
        "call_id": good.model_copy(update={"call_id": "c9"}),
    }
    for axis, command in bad.items():
        with pytest.raises(ResumeRejected) as rejected:
            await handle.resume(command)
        assert rejected.value.axis == axis
    # the host checks again on its own (a caller may skip the client)
    from actors.wire import unwrap

    with pytest.raises(ResumeRejected) as rejected:
        unwrap(await system.hosts[1].resume_run.remote(bad["correlation"]))
    assert rejected.value.axis == "correlation"
    assert (await handle.frontier()).run_state == parked.run_state  # the ticket stayed
    await handle.resume(good)
    await ended(handle, "natural")
    with pytest.raises(ResumeRejected) as rejected:
        await handle.resume(good)  # a second resume finds no ticket
    assert rejected.value.axis == "ticket"
    assert len(ledger.rows(f"tool-batch:{handle.run_id}:")) == 1


async def test_a_wait_past_its_deadline_is_refused_then_expired_by_the_supervisor(system, ledger):
    """A late answer is refused on the deadline (before its kind: DESIGN §2). Before, that
    was all: nothing ended the wait and the Run stayed awaiting for good. The
    Supervisor's sweep now expires it: the call completes with an error the model sees,
    the tool never runs, and the Run goes on to its end."""
    late = await system.start(f"{WAITS}:deadline_agent", "go")
    await awaiting(late)
    for payload in (PermissionDecision(approve=True), UserInput(text="late")):
        with pytest.raises(ResumeRejected) as rejected:
            await late.respond(payload)
        # the Supervisor, sweeping every heartbeat, may have expired the wait first
        assert rejected.value.axis in ("deadline", "ticket")

    async def expired() -> bool:
        return (await late.frontier()).ended

    await wait_for(expired, what="the Supervisor to expire the wait")
    done = await ended(late, "natural")
    (result,) = tool_results(done)
    assert result.is_error and "no permission decision" in result.content
    assert ledger.rows(f"tool-batch:{late.run_id}:") == []
    resumed = [f for f in await late.events() if f.type == "resumed"]
    assert [f.data["kind"] for f in resumed] == ["expired"]
    report = await system.supervisor_report()
    assert report["counts"]["waits_expired"] >= 1
    await check_log(system.store, late.thread_id)


async def test_cancelling_an_awaiting_dedicated_run_leaves_no_host_behind(system):
    handle = await system.start(PERMISSION, "alone", placement="dedicated")
    await awaiting(handle)
    retired = actor_gone(system.spec.dedicated_name(handle.thread_id))
    await wait_for(retired, what="the dedicated host to retire once its Run awaits")
    assert await handle.cancel() == "cancelled"  # a host is started to end it at rest
    await ended(handle, "cancelled")
    await wait_for(retired, what="the host started for the cancel to retire")


class _AnswerLost:
    """A host that does what it is asked, then dies before its answer reaches us (a
    dedicated host retiring as soon as it is idle can)."""

    def __init__(self, host, method: str) -> None:
        self.host, self.method = host, method

    def __getattr__(self, name: str):
        real = getattr(self.host, name)
        if name != self.method:
            return real

        class _Lost:
            @staticmethod
            async def remote(*args, **kwargs):
                await real.remote(*args, **kwargs)
                raise ray.exceptions.RayActorError()

        return _Lost


class _Down:
    """A host that is dead or restarting: every call fails, nothing is done."""

    class resume_run:
        @staticmethod
        async def remote(*args, **kwargs):
            raise ray.exceptions.RayActorError()


async def test_a_resume_whose_hosts_are_all_down_for_a_while_is_asked_again(system, monkeypatch):
    """Every host of the pool dead or restarting at once (a kill of several): a resume is
    asked again until one answers, as a start is, for up to 60 s. It gave up after one
    round of the pool, the ticket intact but the caller told ``ClusterUnavailable``."""
    handle = await system.start(PERMISSION, "all down", host=0)
    await awaiting(handle)
    down = [_Down()] * (len(system.hosts) * 2 + 2)  # several rounds of the pool
    monkeypatch.setattr(system, "host_for", lambda *a, **k: down.pop() if down else system.hosts[0])
    await handle.resume(command_for((await handle.ticket()), PermissionDecision(approve=True)))
    assert not down
    await ended(handle, "natural")


@pytest.mark.parametrize(
    ("method", "cause"), [("cancel_run", "cancelled"), ("stop_run", "stopped")]
)
async def test_an_end_whose_answer_is_lost_reports_what_it_did(system, monkeypatch, method, cause):
    handle = await system.start(PERMISSION, "answer lost", host=0)
    await awaiting(handle)
    lost = [_AnswerLost(system.hosts[0], method)]  # the first call only; then the real host
    monkeypatch.setattr(system, "host_for", lambda *a, **k: lost.pop() if lost else system.hosts[0])
    if method == "cancel_run":
        assert await handle.cancel() == "cancelled"
    else:
        assert await handle.stop("over budget") == "stopped"
    await ended(handle, cause)
    assert await handle.cancel() == "not_running"  # asked again, there is nothing to do


# ---- cancel and stop ------------------------------------------------------------------------


async def test_cancel_during_inference(system):
    handle = await system.start(f"{WAITS}:slow_model_agent", "think")
    began = asyncio.get_running_loop().time()
    assert (await handle.frontier()).batch is None  # the model is still thinking
    assert await handle.cancel() == "cancelled"  # told, and ended: the end is committed
    done = await ended(handle, "cancelled")
    assert asyncio.get_running_loop().time() - began < LONG_S / 2
    assert not any(isinstance(m, AssistantMessage) for m in done.messages)
    assert (done.status.state, done.status.reason) == ("idle", "cancelled")


async def _napping(system, ledger) -> RunHandle:
    handle = await system.start(f"{WAITS}:long_nap_agent", "nap")

    async def napping() -> bool:
        return bool(ledger.rows(f"tool-batch:{handle.run_id}:"))

    await wait_for(napping, what="the nap to begin")
    return handle


async def test_cancel_during_a_tool(system, ledger):
    handle = await _napping(system, ledger)
    began = asyncio.get_running_loop().time()
    assert await handle.cancel() == "cancelled"
    done = await ended(handle, "cancelled")
    assert asyncio.get_running_loop().time() - began < LONG_S / 2
    (result,) = tool_results(done)
    assert result.is_error and "owning run ended" in result.content
    report = await check_log(system.store, handle.thread_id)
    assert [c.tool for c in report.indeterminate] == ["long_nap"]


async def test_cancel_while_awaiting_then_a_late_resume_fails_closed(system, ledger):
    handle = await system.start(PERMISSION, "clean up")
    parked = await awaiting(handle)
    assert await handle.cancel() == "cancelled"
    done = await ended(handle, "cancelled")
    assert "owning run ended" in tool_results(done)[0].content
    late = command_for(parked.run_state.ticket, PermissionDecision(approve=True))
    with pytest.raises(ResumeRejected) as rejected:
        await handle.resume(late)
    assert rejected.value.axis == "ticket"
    assert ledger.rows(f"tool-batch:{handle.run_id}:") == []
    assert await handle.cancel() == "not_running"


async def test_stop_a_running_and_an_awaiting_run(system, ledger):
    handle = await _napping(system, ledger)
    assert await handle.stop("over budget") in ("stopped", "signalled")  # fenced, or told
    done = await ended(handle, "stopped")
    assert done.run_state.cause.reason == "over budget"
    assert (done.status.state, done.status.reason) == ("idle", "stopped")
    assert "owning run ended" in tool_results(done)[0].content
    await wait_for(lambda: not_driven(system, handle.thread_id), what="the host letting go")
    await check_log(system.store, handle.thread_id)
    assert await handle.stop("again") == "not_running"

    parked = await system.start(PERMISSION, "clean up")
    await awaiting(parked)
    assert await parked.stop("changed my mind") != "not_running"
    done = await ended(parked, "stopped")
    assert done.run_state.cause.reason == "changed my mind"
    with pytest.raises(ResumeRejected):
        await parked.respond(PermissionDecision(approve=True))


# ---- the stream -----------------------------------------------------------------------------


async def test_status_frames_for_a_run_that_awaits_resumes_and_ends(system):
    handle = await system.start(PERMISSION, "clean up")
    first = [f async for f in handle.stream()]
    assert first[0].type == "thread_status" and first[0].offset is None  # the snapshot
    assert first[-1].event.type == "awaiting"
    assert statuses(first)[1:] == [("running", None), ("idle", "awaiting_permission")]
    await handle.respond(PermissionDecision(approve=True))
    rest = [f async for f in handle.stream(after=first[-1].offset)]
    assert statuses(rest)[1:] == [("running", None), ("idle", "natural")]
    assert rest[-1].event.type == "run_finished"
    committed = [(f.seq, f.index, f.type) for f in await handle.events()]
    assert fact_keys(first) + fact_keys(rest) == committed


async def test_status_frames_for_a_run_that_fails(system):
    handle = await system.start(f"{WAITS}:failing_agent", "go")
    frames = [f async for f in handle.stream()]
    assert statuses(frames)[1:] == [("running", None), ("failed", "ScriptExhausted")]
    assert frames[-1].event.type == "run_failed"
    assert fact_keys(frames) == [(f.seq, f.index, f.type) for f in await handle.events()]


async def test_stream_reconnects_after_a_host_crash_with_every_fact(system):
    handle = await system.start(
        "cluster.demo_agent:agent", "order 7", host=0, faults=("after:inference", 2, "exit")
    )
    seen: list[Frame] = []
    async with aclosing(handle.stream()) as frames:
        async for frame in frames:
            seen.append(frame)
            if frame.offset is not None:
                break  # the client goes away after the first fact
    await ended(handle, "natural")  # meanwhile the host died and the Run recovered
    rest = [f async for f in handle.stream(after=seen[-1].offset)]
    committed = [(f.seq, f.index, f.type) for f in await handle.events()]
    assert fact_keys(seen) + fact_keys(rest) == committed
    states = statuses(seen + rest)[1:]
    assert ("failed", EXECUTION_LOST) in states and states[-1] == ("idle", "natural")
    offsets = [parse_offset(f.offset) for f in seen + rest if f.offset]
    assert offsets == sorted(set(offsets))


@pytest.mark.redis
async def test_redis_stream_across_a_host_crash_keeps_facts_and_text_whole(make_system, redis_url):
    client = await make_system(redis_url=redis_url)
    thread = "flaky-1"
    frames: list[Frame] = []
    follower = client.handle(thread).stream()
    frames.append(await anext(follower))  # following before the Run exists

    async def rest() -> None:
        async for frame in follower:
            frames.append(frame)

    reading = asyncio.create_task(rest())
    handle = await client.start(
        f"{WAITS}:flaky_text_agent",
        "what is it?",
        thread_id=thread,
        host=0,
        faults=("before:inference", 2, "exit"),  # step 1, long after start answered
    )
    await ended(handle, "natural")
    await asyncio.wait_for(reading, 30)
    committed = [(f.seq, f.index, f.type) for f in await handle.events()]
    assert fact_keys(frames) == committed  # every fact once, in order, none lost
    states = statuses(frames)[1:]
    assert states == [
        ("running", None),
        ("failed", EXECUTION_LOST),
        ("running", None),
        ("idle", "natural"),
    ]
    text = StreamText()
    for frame in frames:
        text.add(frame)
    # step 1 was streamed in full after the crash; before it, perhaps also (deltas go to
    # the bus off the commit path, and the host died right after that inference)
    deltas = [f.event for f in frames if f.type == "delta"]
    assert 1 <= sum(d.text == "42" for d in deltas if d.step == 1) <= 2
    assert [text.text(handle.run_id, step) for step in range(3)] == [
        "let me check",
        ANSWER,
        "all done",
    ]
    report = analyse(thread, await client.store.read(thread))
    assert report.lost == 1
    lost_at = next(f.offset for f in frames if f.status and f.status.state == "failed")
    again = [f async for f in handle.stream(after=lost_at)]
    assert fact_keys(again) == [k for k in committed if k[:2] > parse_offset(lost_at)]


async def test_a_host_that_never_answers_is_given_up_on():
    """A stopped host with the Supervisor stopped too: nothing kills the host, and a
    start, cancel or stop waited on it for good. Now ClusterUnavailable past ``answer_s``;
    a TimeoutError of the call's own is not taken for it."""
    from cluster.waiting import on_a_live_host

    never = asyncio.Event()
    with pytest.raises(ClusterUnavailable, match=r"no RunHost answered within 0\.1s"):
        await on_a_live_host(never.wait, answer_s=0.1)

    async def own_timeout() -> None:
        raise TimeoutError("the host's")

    with pytest.raises(TimeoutError, match="the host's"):
        await on_a_live_host(own_timeout, answer_s=10)


async def test_a_host_lost_late_in_a_lasting_call_still_gets_its_time_to_come_back():
    """The time a host has to come back runs from the first failure: a start that waits
    for its Run for longer than that, and then loses its host, is asked again."""
    from cluster.waiting import on_a_live_host

    calls = 0

    async def lasting_then_lost() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.2)  # the call itself lasts (a drive waited on), then:
            raise ray.exceptions.RayActorError()
        return "answered"

    assert await on_a_live_host(lasting_then_lost, give_up_s=0.1) == "answered"
    assert calls == 2
