"""Two Ray clusters alive on one store: the second is refused, and a cluster that does
not hold its system's lease takes over none of the other's Runs (``actors.system_lease``).

Before, both clusters took the name the store's URL gives, and each one's hosts took the
other's Runs for a dead incarnation's, in turn: tools ran on both sides, replay-safe ones
up to their attempts, and Runs were dead-lettered though no process had died. Another
cluster is played here by its lease (held and renewed under another token) and by a
claim under one of its hosts' owner names: two Ray clusters in one test session would
cost a second Ray's start-up and memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.system_lease import LEASE_TTL_S, cluster_token, lease_name
from actors.wire import NAMESPACE
from cluster.client import Ratchet
from cluster.config import store_url_from, system_name
from runtime.errors import StoreError, StoreUnavailable, SystemInUse
from runtime.ids import ThreadId
from runtime.lifecycle import EndedState
from runtime.ports import CommitStore
from storage.url import open_store

from .conftest import wait_for

pytestmark = pytest.mark.ray

OTHER = "another-cluster"


@contextlib.asynccontextmanager
async def another_cluster(store: CommitStore, system: str, ttl_s: float) -> AsyncIterator[None]:
    """Hold the system's lease as another live cluster would: renewed until the end."""
    stop = asyncio.Event()

    async def renew() -> None:
        while not stop.is_set():
            await store.hold_lease(lease_name(system), OTHER, ttl_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ttl_s / 4)

    assert (await store.hold_lease(lease_name(system), OTHER, ttl_s)).holder == OTHER
    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        stop.set()
        await task
        await store.drop_lease(lease_name(system), OTHER)


def _actors_of(system: str) -> list[str]:
    return [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(f"{system}:")
    ]


@pytest.mark.parametrize("writer", ["direct", "actor"])
async def test_a_cluster_is_refused_a_store_another_live_cluster_serves(
    tmp_path: Path, writer: str
) -> None:
    """Refused before any host or Supervisor starts; a store actor (SQLite behind one)
    started to ask for the lease goes too: it held the store open for nobody."""
    url = store_url_from(f"sqlite:///{tmp_path}/served.db")
    system = system_name(url)
    store = await open_store(url)
    try:
        async with another_cluster(store, system, LEASE_TTL_S):
            with pytest.raises(SystemInUse) as refused:
                await Ratchet.connect(store_url=url, sqlite_writer=writer)
            assert refused.value.holder == OTHER

            async def no_actor_left() -> bool:  # none started; a store actor, killed
                return _actors_of(system) == []

            await wait_for(no_actor_left, what="no actor of the refused system left")
    finally:
        await store.close()


async def test_another_spelling_of_the_stores_url_is_refused_too(tmp_path: Path) -> None:
    """The name hashed the URL as written: ``?synchronous=normal`` or a ``..`` in the path
    named another system, whose lease another cluster did not hold."""
    url = store_url_from(f"sqlite:///{tmp_path}/served.db")
    store = await open_store(url)
    try:
        async with another_cluster(store, system_name(url), LEASE_TTL_S):
            for spelling in (
                f"{url}?synchronous=normal",
                f"sqlite:///{tmp_path}/../{tmp_path.name}/served.db",
            ):
                with pytest.raises(SystemInUse):
                    await Ratchet.connect(store_url=spelling)
    finally:
        await store.close()


async def test_a_store_path_that_cannot_be_made_is_a_store_error(tmp_path: Path) -> None:
    """A file where the store's folder should be: it was StoreUnavailable, which a caller
    retries for ever, though nothing will change until someone moves the file."""
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(StoreError, match="FileExistsError") as refused:
        await Ratchet.connect(store_url=f"sqlite:///{tmp_path}/afile/r.db")
    assert not isinstance(refused.value, StoreUnavailable)


async def test_a_dead_clusters_lease_is_waited_out(tmp_path: Path) -> None:
    """Its holder died without giving it up: the lease runs out, and a new cluster
    serves the store (a whole cluster restarted after it was lost)."""
    url = store_url_from(f"sqlite:///{tmp_path}/left.db")
    system = system_name(url)
    store = await open_store(url)
    try:
        await store.hold_lease(lease_name(system), OTHER, 2.0)  # never renewed
        began = time.monotonic()
        client = await Ratchet.connect(store_url=url)
        try:
            assert time.monotonic() - began > 1.0  # waited for it, not taken from it
            lease = await store.hold_lease(lease_name(system), OTHER, 2.0)
            assert lease.holder == cluster_token()
            run = await client.run("tests.ray.agents:quick_agent", "hi", timeout_s=60)
            assert isinstance(run.run_state, EndedState)
        finally:
            await client.shutdown()
        # given up at shutdown: another cluster need not wait for it to run out
        assert (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder == OTHER
    finally:
        await store.close()


@pytest.mark.timeout(180)
async def test_a_cluster_without_the_lease_takes_no_run_of_another(make_system) -> None:
    """Claimed by one of the other cluster's hosts named as our host 0 (our host's to
    take back), and by one named as a host ours does not run (the Supervisor's)."""
    client = await make_system()
    system, store = client.spec.name, client.store
    handles = [
        await client.start("tests.ray.agents:long_napping_agent", "nap", host=host)
        for host in (0, 1)
    ]
    threads = [ThreadId(handle.thread_id) for handle in handles]

    async def napping() -> bool:  # both inferences committed
        return all([(await store.load_head(t)).version >= 2 for t in threads])

    await wait_for(napping, timeout_s=60, what="the naps to start")
    await store.drop_lease(lease_name(system), cluster_token())
    async with another_cluster(store, system, 3.0):
        foreign = [f"{client.spec.host_name(i)}#424242" for i in (0, 9)]
        claimed = [
            await store.claim(t, owner, (await store.load_head(t)).epoch)
            for t, owner in zip(threads, foreign, strict=True)
        ]
        passes = (await client.hosts[0].info.remote())["reconciled"]

        async def reconciled_thrice() -> bool:  # the Supervisor swept as often meanwhile
            return bool((await client.hosts[0].info.remote())["reconciled"] >= passes + 3)

        await wait_for(reconciled_thrice, timeout_s=60, what="three reconcile passes")
        for t, owner, was in zip(threads, foreign, claimed, strict=True):
            after = await store.load_head(t)
            assert (after.owner, after.version) == (owner, was.version)  # not taken
        supervisor = ray.get_actor(client.spec.supervisor_name, namespace=NAMESPACE)
        report = await supervisor.report.remote()
        assert report["serves"] is False
    # the other cluster is gone (its lease given up): ours takes the Runs and ends them
    for handle, t, owner in zip(handles, threads, foreign, strict=True):
        result = await handle.result(timeout_s=120)
        assert isinstance(result.run_state, EndedState)
        assert (await store.load_head(t)).owner != owner


class _LeaseRefused:
    """A store whose lease read fails: ``error`` raised by every hold."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> None:
        raise self.error


async def test_a_lease_that_does_not_read_is_not_held_an_outage_changes_nothing() -> None:
    """A lease row edited by hand (a SQLite ``expires_at`` of text, a Redis key of another
    type) left the Supervisor serving, taking Runs over, on a lease nobody could read."""
    from actors.system_lease import LeaseKeeper
    from runtime.errors import StoreError, StoreLost, StoreUnavailable

    out = LeaseKeeper(_LeaseRefused(StoreUnavailable("out")), "s")  # type: ignore[arg-type]
    assert await out.serves() is True  # as it was: the store will answer again
    unreadable = LeaseKeeper(_LeaseRefused(StoreError("not a float")), "s")  # type: ignore[arg-type]
    assert await unreadable.serves() is False
    lost = LeaseKeeper(_LeaseRefused(StoreLost("flushed")), "s")  # type: ignore[arg-type]
    with pytest.raises(StoreLost):  # the Supervisor's tick reports it (store_lost)
        await lost.serves()
    assert lost.held is False


async def test_a_client_of_a_system_shut_down_starts_nothing(tmp_path: Path) -> None:
    """A dedicated host is made on demand: one a client connected before made after
    another process shut the system down had no Supervisor to end it, and stayed, with
    the executors it started, for good."""
    from cluster.config import ClusterUnavailable

    url = store_url_from(f"sqlite:///{tmp_path}/down.db")
    stale = await Ratchet.connect(store_url=url)
    try:
        other = await Ratchet.connect(store_url=url)  # another process's client, same system
        await other.shutdown()
        with pytest.raises(ClusterUnavailable, match="was shut down"):
            await stale.start("tests.ray.agents:quick_agent", "hi", thread_id="t-down",
                              placement="dedicated")  # fmt: skip
        with pytest.raises(ValueError):
            ray.get_actor(stale.spec.dedicated_name("t-down"), namespace=NAMESPACE)
        # a pool host of a system shut down is dead for good: said at once, not after
        # a minute of asking it again
        with pytest.raises(ClusterUnavailable, match="was shut down") as refused:
            await stale.start("tests.ray.agents:quick_agent", "hi", thread_id="t-pool")
        assert "may have started" not in str(refused.value)  # nothing was, nor will be
    finally:
        await stale.close()


async def test_the_last_close_in_a_process_gives_the_lease_up_and_no_renewal_takes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In a process that started its Ray (this test session), ``close()`` gives the lease
    up while the system's actors live on until the process ends. The Supervisor's next
    renewal took the free lease again, and the next cluster on the store waited
    ``LEASE_TTL_S`` for a lease held by nobody alive. And the first of two clients to
    close gave it up for the whole system: the Supervisor took over nothing more while
    the other still started Runs."""
    url = store_url_from(f"sqlite:///{tmp_path}/closed.db")
    system = system_name(url)
    first = await Ratchet.connect(store_url=url, heartbeat_s=0.05)
    second = await Ratchet.connect(store_url=url, heartbeat_s=0.05)
    store = await open_store(url)
    supervisor = ray.get_actor(first.spec.supervisor_name, namespace=NAMESPACE)

    async def after_a_renewal() -> dict[str, Any]:
        checked = (await supervisor.report.remote())["lease_checks"]

        async def came_due() -> bool:
            return bool((await supervisor.report.remote())["lease_checks"] > checked)

        await wait_for(came_due, timeout_s=30, what="a renewal of the lease")
        return dict(await supervisor.report.remote())

    async def holder() -> str:
        return (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder

    try:
        await supervisor.report.remote()  # after the second connect's word to keep it
        await first.close()  # not the last: nothing given up
        assert (await after_a_renewal())["serves"] is True and await holder() == cluster_token()
        run = await second.run("tests.ray.agents:quick_agent", "hi", timeout_s=60)
        assert isinstance(run.run_state, EndedState)

        await second.close()  # the last: given up
        await second.close()  # again: nothing (it released the lease on a closed store)
        assert "could not release" not in caplog.text
        assert (await after_a_renewal())["serves"] is False
        assert await holder() == OTHER  # free: another cluster takes it at once
        await store.drop_lease(lease_name(system), OTHER)

        # connected again in this process, with the Supervisor of before: it renews the
        # lease again (it stayed given up, ran out, and nothing refused a second cluster)
        again = await Ratchet.connect(store_url=url, heartbeat_s=0.05)

        async def renewed_again() -> bool:  # its word to keep it is not waited for by connect
            return bool((await supervisor.report.remote())["serves"])

        await wait_for(renewed_again, timeout_s=30, what="the lease renewed again")
        assert await holder() == cluster_token()
        await again.close()
    finally:
        _kill_all(system)
        await store.close()


async def test_a_last_close_while_a_host_drives_a_run_keeps_the_lease(tmp_path: Path) -> None:
    """A process that started its Ray and lives on after its last close (a notebook)
    keeps its hosts, and they drive on: the close gave the lease up all the same, and a
    cluster started next took the store and recovered the Runs driven here."""
    url = store_url_from(f"sqlite:///{tmp_path}/driven.db")
    system = system_name(url)
    client = await Ratchet.connect(store_url=url, heartbeat_s=0.05)
    store = await open_store(url)
    supervisor = ray.get_actor(client.spec.supervisor_name, namespace=NAMESPACE)
    hosts = [ray.get_actor(client.spec.host_name(i), namespace=NAMESPACE) for i in range(2)]
    try:
        await client.start("tests.ray.agents:long_napping_agent", "nap", thread_id="t-driven")

        async def driven() -> bool:
            return any([await host.driving.remote() for host in hosts])

        await wait_for(driven, timeout_s=30, what="the Run driven")
        await client.close()  # the last in this process, which started its Ray
        checked = (await supervisor.report.remote())["lease_checks"]

        async def renewed() -> bool:
            return bool((await supervisor.report.remote())["lease_checks"] > checked)

        await wait_for(renewed, timeout_s=30, what="a renewal of the lease")
        assert (await supervisor.report.remote())["serves"] is True
        lease = await store.hold_lease(lease_name(system), OTHER, 2.0)
        assert lease.holder == cluster_token()  # held still: no other cluster takes it
    finally:
        _kill_all(system)
        await store.close()


async def test_a_connect_that_fails_after_its_claim_gives_the_lease_up_as_a_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its word to keep the lease set the Supervisor renewing again, and with no client
    open nothing gave it up: it was renewed for as long as the process lived."""
    url = store_url_from(f"sqlite:///{tmp_path}/failed.db")
    system = system_name(url)
    first = await Ratchet.connect(store_url=url, heartbeat_s=0.05)
    store = await open_store(url)
    supervisor = ray.get_actor(first.spec.supervisor_name, namespace=NAMESPACE)
    try:
        await first.close()  # the last, idle: given up

        def no_host(spec: Any, index: int) -> Any:
            raise RuntimeError("no host (test)")

        monkeypatch.setattr("cluster.client.hosted_host", no_host)
        with pytest.raises(RuntimeError, match="no host"):
            await Ratchet.connect(store_url=url, heartbeat_s=0.05)
        checked = (await supervisor.report.remote())["lease_checks"]

        async def renewed() -> bool:
            return bool((await supervisor.report.remote())["lease_checks"] > checked)

        await wait_for(renewed, timeout_s=30, what="a tick of the lease")
        assert (await supervisor.report.remote())["serves"] is False
        assert (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder == OTHER
    finally:
        _kill_all(system)
        await store.close()


async def test_a_report_asked_of_a_system_shut_down_starts_no_supervisor(tmp_path: Path) -> None:
    """It started a Supervisor again, which took the lease and the system's Runs back."""
    from cluster.config import SystemShutDown

    url = store_url_from(f"sqlite:///{tmp_path}/reported.db")
    stale = await Ratchet.connect(store_url=url)
    try:
        other = await Ratchet.connect(store_url=url)
        await other.shutdown()
        with pytest.raises(SystemShutDown, match="shut down"):
            await stale.supervisor_report()
        with pytest.raises(ValueError):
            ray.get_actor(stale.spec.supervisor_name, namespace=NAMESPACE)
    finally:
        await stale.close()
        _kill_all(system_name(url))


def _kill_all(system: str) -> None:
    for name in _actors_of(system):
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


class _SlowLease:
    """A store whose lease holds wait for ``go``: a renewal on its way."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.holds = 0
        self.drops = 0

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Any:
        self.holds += 1
        await self.go.wait()
        return type("Lease", (), {"holder": holder, "expires_in_s": ttl_s})()

    async def drop_lease(self, name: str, holder: str) -> None:
        self.drops += 1


async def test_a_renewal_that_lands_after_the_give_up_drops_what_it_took() -> None:
    """A renewal sent before the give-up, landing after it (a slow store: the client
    dropped the lease meanwhile), took the free lease again: it now drops it, the
    give-up waits for it, and no renewal is sent after."""
    from actors.system_lease import LeaseKeeper

    store = _SlowLease()
    keeper = LeaseKeeper(store, "s")  # type: ignore[arg-type]
    renewal = asyncio.create_task(keeper.serves())
    await wait_for(lambda: _true(store.holds == 1), what="the renewal to be sent")
    giving_up = asyncio.create_task(keeper.give_up())
    await wait_for(lambda: _true(keeper.given_up), what="the give-up to be told")
    assert not giving_up.done() and keeper.held is False  # it waits for the renewal
    store.go.set()
    assert await renewal is False and (await giving_up) is None
    assert store.drops == 1  # what the late renewal took
    assert await keeper.serves() is False and store.holds == 1 and keeper.held is False


async def _true(value: bool) -> bool:
    return value


def test_a_ratchet_run_refused_after_it_connected_gives_the_lease_up(tmp_path: Path) -> None:
    """An input over its limit is refused by the start, after the connect took the lease:
    ``ratchet run`` left it held, and the next command on the store waited it out."""
    from typer.testing import CliRunner

    from cluster.cli import app
    from runtime.limits import DEFAULT_LIMITS

    url = store_url_from(f"sqlite:///{tmp_path}/refused.db")
    system = system_name(url)
    text = "x" * (DEFAULT_LIMITS.input_bytes + 1)
    try:
        done = CliRunner().invoke(
            app, ["run", "tests.ray.agents:quick_agent", text, "--store", url]
        )
        assert done.exit_code == 1 and "input_bytes" in done.output, done.output

        async def lease_holder() -> str:
            store = await open_store(url)
            try:
                return (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder
            finally:
                await store.close()

        assert asyncio.run(lease_holder()) == OTHER  # free: the next cluster waits not
    finally:
        _kill_all(system)


async def test_a_shutdown_after_a_close_still_gives_the_lease_up(tmp_path: Path) -> None:
    """Its store closed, ``shutdown`` left the lease held for ``LEASE_TTL_S``: it now
    gives it up through the store opened again."""
    url = store_url_from(f"sqlite:///{tmp_path}/late.db")
    system = system_name(url)
    client = await Ratchet.connect(store_url=url)
    other = await Ratchet.connect(store_url=url)  # so the close gives nothing up
    store = await open_store(url)
    try:
        await client.close()
        assert (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder == cluster_token()
        await client.shutdown()
        assert (await store.hold_lease(lease_name(system), OTHER, 2.0)).holder == OTHER
        assert _actors_of(system) == [] or await _gone(system)
    finally:
        await other.close()
        _kill_all(system)
        await store.close()


async def _gone(system: str) -> bool:
    async def none_left() -> bool:
        return _actors_of(system) == []

    await wait_for(none_left, what="the system's actors to be gone")
    return True


class _CountedLease:
    """A store whose lease is always this cluster's: counts the renewals."""

    def __init__(self) -> None:
        self.holds = 0

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Any:
        self.holds += 1
        return type("Lease", (), {"holder": holder, "expires_in_s": ttl_s})()


async def test_a_tick_held_up_by_slow_work_does_not_let_the_lease_lapse(monkeypatch) -> None:
    """The lease was renewed by the Supervisor's tick, which waits for its sweep and for
    hosts that do not answer: a tick longer than ``LEASE_TTL_S`` (a listing of many Runs
    on a slow store) let another cluster take the system while this one still served it.
    Here the tick never ends, and the lease is renewed all the same."""
    import actors.system_lease as system_lease
    from actors.supervisor import Supervisor
    from actors.system_lease import LeaseKeeper

    monkeypatch.setattr(system_lease, "RENEW_S", 0.05)
    store = _CountedLease()
    bare = object.__new__(Supervisor)  # the watch only: no actor, no hosts
    bare.spec = type("Spec", (), {"heartbeat_s": 0.01})()  # type: ignore[assignment]
    bare.lease = LeaseKeeper(store, "s")  # type: ignore[arg-type]
    bare.store_lost = False
    ticking = asyncio.Event()

    async def stuck_tick() -> None:
        ticking.set()
        await asyncio.Event().wait()  # a sweep that does not end

    bare._tick = stuck_tick  # type: ignore[method-assign]
    watch = asyncio.create_task(bare._watch())
    renewing = asyncio.create_task(bare._keep_lease())
    try:
        await wait_for(lambda: _true(ticking.is_set()), what="the tick to start")
        await wait_for(lambda: _true(store.holds >= 3), what="renewals while the tick hangs")
        assert bare.lease.held
    finally:
        for task in (watch, renewing):
            task.cancel()
        await asyncio.gather(watch, renewing, return_exceptions=True)
