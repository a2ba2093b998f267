"""Delegation under kills and cancels on real Ray (DESIGN §7): every parent and child
comes to rest, each child starts once, and a child whose parent ended runs nothing more."""

from __future__ import annotations

import json
import os
import signal

from actors.wire import host_index
from runtime.delegation import child_ids
from runtime.ids import CallId, RunId, ThreadId
from tests.ray.conftest import wait_for

HERE = "tests.ray.delegation_chaos_agents"


async def activations(store, thread) -> int:
    return sum(r.commit.label == "activation" for r in await store.read(thread))


async def kill_host(client, index) -> None:
    info = await client.hosts[index].info.remote()
    os.kill(info["pid"], signal.SIGKILL)


def committed(store, thread, version):
    async def at() -> bool:
        return (await store.load_head(thread)).version >= version

    return at


def ended(store, thread):
    async def at_end() -> bool:
        return (await store.load_head(thread)).ended

    return at_end


def apart(prefix: str, hosts: int) -> tuple[ThreadId, RunId, ThreadId]:
    """A parent and its child d0 placed on different hosts."""
    for i in range(256):
        thread, run = ThreadId(f"{prefix}-{i}"), RunId(f"{prefix}-run-{i}")
        kid, _ = child_ids(thread, run, CallId("d0"))
        if host_index(kid, hosts) != host_index(thread, hosts):
            return thread, run, kid
    raise AssertionError("no parent and child apart")


async def test_cancelling_a_parent_cancels_its_running_children_once(make_system):
    client = await make_system()
    handle = await client.start(f"{HERE}:sleepers", "go", thread_id="sp", run_id="sp-run")
    kids = [child_ids(ThreadId("sp"), RunId("sp-run"), CallId(f"d{i}"))[0] for i in range(3)]
    for kid in kids:
        await wait_for(committed(client.store, kid, 2), timeout_s=30, what=f"{kid} in its tool")
    assert await handle.cancel() == "cancelled"
    for kid in kids:
        await wait_for(ended(client.store, kid), timeout_s=30, what=f"{kid} cancelled")
        f = await client.store.load(kid)
        assert f.run_state.cause.kind == "cancelled"
        assert await activations(client.store, kid) == 1


async def test_a_child_whose_host_died_as_its_parent_was_cancelled_replays_nothing(make_system):
    """The child's host is killed mid-tool, then its parent cancelled: the cancel met the
    restarting host and was given up, and the recovered child replayed its replay-safe
    tool (ten minutes) for a parent that had ended. The cancel is asked again, and a
    recovery looks at the parent first: the child ends cancelled, its call not replayed."""
    client = await make_system()
    thread, run, kid = apart("rp", client.spec.hosts)
    handle = await client.start(f"{HERE}:one_replayer", "go", thread_id=thread, run_id=run)
    await wait_for(committed(client.store, kid, 2), timeout_s=30, what="the child in its tool")
    await kill_host(client, host_index(kid, client.spec.hosts))
    assert await handle.cancel() == "cancelled"
    await wait_for(ended(client.store, kid), timeout_s=40, what="the child cancelled")
    f = await client.store.load(kid)
    assert f.run_state.cause.kind == "cancelled"
    labels = [r.commit.label for r in await client.store.read(kid)]
    assert "executing" not in labels, labels  # its first attempt came with its inference


async def test_three_deep_with_the_middle_host_killed_comes_to_rest_once(make_system):
    client = await make_system()
    hosts = client.spec.hosts
    for i in range(256):
        thread, run = ThreadId(f"n-{i}"), RunId(f"n-run-{i}")
        mid, mid_run = child_ids(thread, run, CallId("d0"))
        leaf, _ = child_ids(mid, mid_run, CallId("d0"))
        if host_index(mid, hosts) != host_index(thread, hosts) == host_index(leaf, hosts):
            break
    handle = await client.start(f"{HERE}:top", "go", thread_id=thread, run_id=run)
    await wait_for(committed(client.store, leaf, 1), timeout_s=30, what="the leaf started")
    await kill_host(client, host_index(mid, hosts))
    f = await handle.result(timeout_s=50)
    assert f.run_state.cause.kind == "natural", f.run_state
    assert len(json.loads(f.messages[-1].text)) == 1
    for t in (mid, leaf):
        assert await activations(client.store, t) == 1
        assert (await client.store.load(t)).run_state.cause.kind == "natural"
