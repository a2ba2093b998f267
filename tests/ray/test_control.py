"""Cancel, resume and the status stream through the cluster client."""

from __future__ import annotations

import pytest

from runtime.errors import ResumeRejected
from runtime.lifecycle import AwaitingState, PermissionDecision, ResumeCommand
from runtime.messages import ToolResultMessage

from .checks import check_log
from .conftest import wait_for

pytestmark = pytest.mark.ray


def _approval(frontier, approve: bool, correlation: str | None = None) -> ResumeCommand:
    ticket = frontier.run_state.ticket
    return ResumeCommand(
        correlation=correlation or ticket.correlation,
        run_id=ticket.run_id,
        thread_id=ticket.thread_id,
        payload=PermissionDecision(approve=approve),
        call_id=ticket.target.call_id,
    )


async def test_an_awaiting_run_holds_nothing_and_resumes_on_any_host(make_system, ledger):
    client = await make_system()
    handle = await client.start("tests.ray.agents:permission_agent", "clean up")
    awaiting = await handle.result(timeout_s=30)
    assert isinstance(awaiting.run_state, AwaitingState)
    assert (await handle.status()).reason == "awaiting_permission"
    for host in client.hosts:
        assert handle.thread_id not in await host.driving.remote()
    with pytest.raises(ResumeRejected) as rejected:
        await handle.resume(_approval(awaiting, True, correlation="wrong"))
    assert rejected.value.axis == "correlation"
    await handle.resume(_approval(awaiting, True))
    done = await handle.result(timeout_s=30)
    assert done.run_state.cause.kind == "natural"
    assert len(ledger.rows(f"tool-batch:{handle.run_id}:")) == 1


async def test_a_denied_call_never_runs(make_system, ledger):
    client = await make_system()
    handle = await client.start("tests.ray.agents:permission_agent", "clean up")
    await handle.resume(_approval(await handle.result(timeout_s=30), False))
    done = await handle.result(timeout_s=30)
    (result,) = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    assert result.is_error and "blocked" in result.content
    assert ledger.rows(f"tool-batch:{handle.run_id}:") == []


async def test_cancel_a_running_run_and_an_awaiting_one(make_system, ledger):
    client = await make_system()
    napping = await client.start("tests.ray.agents:napping_agent", "nap")

    async def napping_now() -> bool:
        return bool(ledger.rows(f"tool-batch:{napping.run_id}:"))

    await wait_for(napping_now, what="the nap")
    assert await napping.cancel() == "cancelled"  # told, and its end committed
    ended = await napping.result(timeout_s=30)
    assert ended.run_state.cause.kind == "cancelled"
    assert (await napping.status()).state == "idle"

    waiting = await client.start("tests.ray.agents:permission_agent", "clean up")
    await waiting.result(timeout_s=30)
    assert await waiting.cancel() == "cancelled"
    ended = await waiting.result(timeout_s=30)
    assert ended.run_state.cause.kind == "cancelled"


async def test_stream_starts_with_a_status_snapshot(make_system):
    client = await make_system()
    handle = await client.start("tests.ray.agents:quick_agent", "hi")
    frames = [f async for f in handle.stream()]
    assert frames[0].type == "thread_status" and frames[0].offset is None
    facts = [f.event for f in frames if f.type == "fact"]
    assert facts[0].type == "run_started" and facts[-1].type == "run_finished"
    states = [f.status.state for f in frames if f.type == "thread_status"]
    assert states[-1] == "idle" and "running" in states


async def test_a_run_on_a_long_thread_id_a_system_accepts_is_cancelled_at_rest(make_system):
    """A system with a raised ``id_chars``: its hosts end a Run at rest on a thread id
    past the default limit (their control engine is held to the system's limits)."""
    from runtime.limits import Limits

    client = await make_system(limits=Limits(id_chars=1024, tool_calls=16))  # room for ids
    handle = await client.start(
        "tests.ray.agents:permission_agent", "clean up", thread_id="t" * 300
    )
    assert isinstance((await handle.result(timeout_s=30)).run_state, AwaitingState)
    assert await handle.cancel() == "cancelled"
    assert (await handle.frontier()).run_state.cause.kind == "cancelled"


async def test_a_cancel_whose_host_dies_before_the_end_lands_still_ends_the_run(
    make_system, ledger
):
    """The host is told the cancel and dies just before the Run's end would be committed
    (kill -9 at that commit point): the Run, recovered, would otherwise nap on and end
    naturally. The cancel is answered only once the end is committed, so its caller asks
    the restarted host again, which ends the recovered Run."""
    client = await make_system()
    napping = await client.start(
        "tests.ray.agents:napping_agent", "nap", faults=("before:ended", 1, "exit")
    )

    async def napping_now() -> bool:
        return bool(ledger.rows(f"tool-batch:{napping.run_id}:"))

    await wait_for(napping_now, what="the nap")
    assert await napping.cancel() in ("cancelled", "signalled")
    ended = await napping.result(timeout_s=60)
    assert ended.run_state.cause.kind == "cancelled"
    assert (await check_log(client.store, napping.thread_id)).lost == 1  # it did die


async def test_a_run_that_times_out_names_the_ids_that_follow_it(make_system):
    """``Ratchet.run`` makes a Run's ids when its caller gives none; one that timed out
    (the Run going on) said only that it was still running: its caller could neither
    follow it nor cancel it. Now the TimeoutError names them."""
    import re

    client = await make_system()
    with pytest.raises(TimeoutError, match="still running") as caught:
        await client.run("tests.ray.agents:long_napping_agent", "nap", timeout_s=0.5)
    ids = re.search(r"run '([^']+)' on thread '([^']+)'", str(caught.value))
    assert ids is not None, caught.value
    run, thread = ids.groups()
    handle = client.handle(thread, run)

    async def started() -> bool:  # its start was on its way when the caller gave up
        return (await handle.frontier()).run_id == run

    await wait_for(started, what="the Run started")
    assert await handle.cancel() in ("cancelled", "signalled")
    frontier = await handle.result(timeout_s=60)
    assert frontier.run_id == run and frontier.run_state.cause.kind == "cancelled"
