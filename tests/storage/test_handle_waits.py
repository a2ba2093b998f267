"""A Run's handle follows the store: a store outage of a moment pauses it (as it
pauses Runs and streams), it is not the Run's answer; and a host that hangs is not
waited for once the store holds the Run at rest. ``wait_all`` keeps its deadline,
outage or not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.wire import SystemSpec
from cluster.client import Ratchet
from cluster.handle import RunHandle
from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
from runtime.errors import StoreUnavailable
from runtime.ids import RunId, ThreadId
from storage.memory import MemoryCommitStore
from tests.storage.builders import activation


class _Blips:
    """The store, whose next ``blips`` loads fail StoreUnavailable; ``loads`` counts them
    all (each a check of the Run at rest)."""

    def __init__(self, inner: MemoryCommitStore, blips: int) -> None:
        self.inner, self.blips, self.loads = inner, blips, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: Any) -> Any:
        self.loads += 1
        if self.blips:
            self.blips -= 1
            raise StoreUnavailable("a blip (test)")
        return await self.inner.load(thread)


class _HungHost:
    """A host stopped or blocked: its notice never comes."""

    class _Never:
        def remote(self, *args: Any, **kwargs: Any) -> Any:
            return asyncio.get_running_loop().create_future()

    until_rest = _Never()


class _Out:
    """A store that is out: every listing fails StoreUnavailable."""

    async def list_runs(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("out (test)")


class _DoneHost:
    """A host that says at once that it drives the Run no more."""

    class _Done:
        async def remote(self, *args: Any, **kwargs: Any) -> None:
            return None

    until_rest = _Done()


class _Client:  # what a handle asks of its client
    def __init__(self, store: Any) -> None:
        self.spec = SystemSpec(name="t", store_url="memory://", hosts=1)
        self.store = store

    def host_for(self, thread: str, placement: str, host: int | None = None) -> Any:
        return _HungHost()


async def _ended(store: Any) -> None:
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    await InProcessRunner(agent, store).start("go", thread_id="th", run_id="r1")


async def test_a_run_ended_elsewhere_while_its_host_hangs_is_seen_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Supervisor re-placed the Run of a hung host and another host ended it: a
    handle waited for the hung host's notice for ever."""
    monkeypatch.setattr("cluster.waiting.HOST_CHECK_S", 0.05)
    store = MemoryCommitStore()
    await _ended(store)
    handle = RunHandle(_Client(store), ThreadId("th"), RunId("r1"), "hosted")  # type: ignore[arg-type]
    frontier = await handle.result(timeout_s=30)
    assert frontier.run_id == "r1" and frontier.run_state.kind == "ended"


async def test_a_handle_waits_out_a_store_outage_of_a_moment() -> None:
    """It raised StoreUnavailable at the first failed load (client.run did too)."""
    store = MemoryCommitStore()
    await _ended(store)
    blips = _Blips(store, 3)
    handle = RunHandle(_Client(blips), ThreadId("th"), RunId("r1"), "hosted")  # type: ignore[arg-type]
    frontier = await asyncio.wait_for(handle.settled(host_done=True), 30)
    assert frontier.run_id == "r1" and frontier.run_state.kind == "ended"
    assert blips.blips == 0


@pytest.mark.parametrize("out", [True, False], ids=["store-out", "store-up"])
async def test_wait_all_raises_at_its_deadline_with_what_the_store_told_by_then(
    out: bool,
) -> None:
    """Past its deadline, wait_all counted the Runs still running with a minute's
    patience for the store: during an outage it raised a minute late."""
    store: Any = _Out() if out else MemoryCommitStore()
    if not out:
        await store.append(activation("th", "r1"), 0, 0)  # running, and it stays so
    client = Ratchet(SystemSpec(name="t", store_url="memory://", hosts=1), store, [_DoneHost()])
    handle = RunHandle(client, ThreadId("th"), RunId("r1"), "hosted")
    told = "1 of 1 runs not known at rest" if out else "1 of 1 runs still running"
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError, match=told):
        await asyncio.wait_for(client.wait_all([handle], timeout_s=0.5), 30)
    assert loop.time() - began < 1.0  # the deadline, and a moment


@pytest.mark.parametrize("same_input", [True, False], ids=["its-own", "another-callers"])
async def test_run_takes_a_stored_run_at_rest_for_its_answer_only_if_it_asked_it(
    monkeypatch: pytest.MonkeyPatch, same_input: bool
) -> None:
    """``run`` stops waiting for a slow host once the store holds the Run at rest: it took
    a Run another caller started under the same ids with another input for its own, and
    dropped its host's refusal."""
    from actors.wire import RunMeta
    from runtime.errors import InvalidTransition
    from tests.support.waiting import until

    monkeypatch.setattr("cluster.waiting.HOST_CHECK_S", 0.05)
    memory = MemoryCommitStore()
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="done")]))
    ref = "tests.storage.test_handle_waits:agent"
    message = RunMeta(agent_ref=ref).message_id("r1")  # as a host starts it
    engine = InProcessRunner(agent, memory, agent_ref=ref).engine()
    await engine.start(ThreadId("th"), "A", run_id=RunId("r1"), message_id=message)
    store = _Blips(memory, 0)  # no blip: its loads counted
    client = Ratchet(SystemSpec(name="t", store_url="memory://", hosts=1), store, [_DoneHost()])  # type: ignore[arg-type]
    refused = asyncio.Event()

    async def slow_host(*args: Any, **kwargs: Any) -> Any:  # a host busy before it answers
        await refused.wait()
        raise InvalidTransition("run r1 exists with another input or agent (test)")

    monkeypatch.setattr(client, "_start", slow_host)
    asked = client.run(ref, "A" if same_input else "B", thread_id="th", run_id="r1")
    if same_input:  # the Run it asked, at rest: no need to wait for the host
        frontier = await asyncio.wait_for(asked, 30)
        assert frontier.run_id == "r1" and frontier.messages[-1].text == "done"
        return
    running = asyncio.ensure_future(asked)
    # the store checked again and again: the Run there is not this start's
    await until(lambda: store.loads >= 5, 30, what="five checks of the store")
    assert not running.done()
    refused.set()
    with pytest.raises(InvalidTransition, match="another input"):
        await asyncio.wait_for(running, 30)


async def test_a_handle_refuses_what_names_no_run_or_cursor_at_once() -> None:
    """A mistyped thread id waited for ever (``result`` has no deadline by default); a
    cursor of the wrong type was reported as store corruption or a TypeError from the
    store. (A stream follows a thread with no commits yet: follow, then start.)"""
    from runtime.errors import InvalidTransition

    store = MemoryCommitStore()
    await _ended(store)
    nowhere = RunHandle(_Client(store), ThreadId("no-such-thread"), None, "hosted")
    with pytest.raises(InvalidTransition, match="has no commits"):
        await asyncio.wait_for(nowhere.settled(host_done=True), 10)
    handle = RunHandle(_Client(store), ThreadId("th"), RunId("r1"), "hosted")
    for cursor in (1.5, "x", None, 2**70, -1, True):
        with pytest.raises(ValueError, match="after_seq"):
            await handle.events(cursor)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SEQ:INDEX"):
        await anext(handle.stream(5))  # type: ignore[arg-type]
    assert (await handle.events(0))[0].type == "run_started"


def test_a_handle_on_ids_no_store_takes_is_refused_as_a_start_is() -> None:
    from runtime.errors import InputRefused
    from runtime.limits import STORED_ID_CHARS

    client: Any = _Client(MemoryCommitStore())
    longest = "x" * STORED_ID_CHARS  # the longest id a store holds: a system's id_chars
    for thread, run in (("half \ud800", None), (longest + "x", None), ("t", ""), ("t", "\x00")):
        with pytest.raises(InputRefused):
            Ratchet.handle(client, thread, run)
    assert Ratchet.handle(client, "t", "r1").run_id == "r1"
    assert Ratchet.handle(client, longest, longest).run_id == longest  # may have been raised


async def test_a_resume_that_ended_the_run_is_its_requests_answer_when_asked_again():
    """A resume whose commit could not fit the thread's history limits ends the Run
    (``runtime.resume``). Its end recorded no request: asked again under the same
    request id (its answer lost), the caller heard ResumeRejected, "not awaiting" or
    "the run stopped awaiting without this resume", as if a rival had taken its ticket."""
    from runtime import answer
    from runtime.errors import ResumeRejected
    from runtime.lifecycle import PermissionDecision
    from runtime.limits import Limits
    from tests.runtime.test_history_limits import permitting

    store = MemoryCommitStore()
    f = await InProcessRunner(permitting(), store).start("go", thread_id="th")
    command = answer(f.run_state.ticket, PermissionDecision(approve=True))
    command = command.model_copy(update={"request_id": "req-1"})
    runner = InProcessRunner(permitting(), store, limits=Limits(history_commits=f.version))
    ended = await runner.resume(command)
    assert ended.run_state.cause.code == "history_commits"
    handle = RunHandle(_Client(store), ThreadId("th"), ended.run_id, "hosted")  # type: ignore[arg-type]
    assert await handle.answered(PermissionDecision(approve=True), "req-1") == command
    with pytest.raises(ResumeRejected, match="another payload"):
        await handle.answered(PermissionDecision(approve=False), "req-1")
    assert await handle._applied(command) is True
    rival = command.model_copy(update={"request_id": "req-2"})
    assert await handle._applied(rival) is False


@pytest.mark.parametrize("answer_lost", [False, True])
async def test_a_resume_that_ended_the_run_raises_resume_ended_and_so_does_its_repeat(
    answer_lost: bool,
) -> None:
    """``handle.resume`` returned as for a resume that landed when it had ended the Run
    ``failed(history_limit)`` instead: a caller could not tell its answer was never
    applied without reading the Run. It is ResumeEnded, also when the host's answer was
    lost (asked again, the host refuses the repeat) and when the caller asks again under
    the same request id; a rival is refused; a resume that lands returns (the host here
    is the engine in-process)."""
    from runtime.errors import ResumeEnded, ResumeRejected
    from runtime.lifecycle import PermissionDecision
    from runtime.limits import Limits
    from tests.runtime.test_history_limits import permitting

    store = MemoryCommitStore()
    parked = await InProcessRunner(permitting(), store).start("go", thread_id="th")
    lowered = Limits(history_commits=parked.version)  # lowered since the Run waited
    runner = InProcessRunner(permitting(), store, limits=lowered)

    class _InProcessHandle(RunHandle):
        async def _resume(self, command: Any, index: int | None) -> None:
            await runner.resume(command)  # the host's part, done here
            if answer_lost:  # asked again of a host, which refuses it as a repeat
                raise ResumeRejected("ticket", "not awaiting")

    handle = _InProcessHandle(_Client(store), ThreadId("th"), parked.run_id, "hosted")  # type: ignore[arg-type]
    approve = PermissionDecision(approve=True)
    with pytest.raises(ResumeEnded, match="history_limit/history_commits") as raised:
        await handle.respond(approve, request_id="req-1")
    assert (raised.value.run_id, raised.value.limit) == (parked.run_id, "history_commits")
    with pytest.raises(ResumeEnded):  # its answer lost, asked again: the same answer
        await handle.respond(approve, request_id="req-1")
    with pytest.raises(ResumeRejected, match="not awaiting"):  # another request: too late
        await handle.respond(approve, request_id="req-2")

    landing = await InProcessRunner(permitting(), store).start("go", thread_id="th2")
    runner = InProcessRunner(permitting(), store)  # the Run resumes, and ends natural
    answer_lost = False
    handle = _InProcessHandle(_Client(store), ThreadId("th2"), landing.run_id, "hosted")  # type: ignore[arg-type]
    await handle.respond(approve, request_id="req-3")
    assert (await handle.frontier()).run_state.cause.kind == "natural"


def test_ratchet_resume_says_when_its_resume_ended_the_run(tmp_path, monkeypatch):
    """``ratchet resume`` printed "resumed ... permission" and exited 0 for a resume that
    ended the Run failed(history_limit): the approval was never applied. The host here is
    the engine in-process (a real store, the CLI's and the handle's own code)."""
    from typer.testing import CliRunner

    import cluster.cli as cli
    from runtime.limits import Limits
    from storage.url import open_store
    from tests.runtime.test_history_limits import permitting

    url = f"sqlite:///{tmp_path / 'store.db'}"

    async def started() -> int:
        store = await open_store(url)
        try:
            return (await InProcessRunner(permitting(), store).start("go", thread_id="th")).version
        finally:
            await store.close()

    version = asyncio.run(started())

    class _InProcessHandle(RunHandle):
        async def _resume(self, command: Any, index: int | None) -> None:
            await self.client.runner.resume(command)  # the host's part, done here

    class _Connected(_Client):
        def __init__(self, store: Any) -> None:
            super().__init__(store)
            limits = Limits(history_commits=version)  # lowered since the Run waited
            self.runner = InProcessRunner(permitting(), store, limits=limits)

        def handle(self, thread: str, run_id: str | None = None) -> RunHandle:
            return _InProcessHandle(self, ThreadId(thread), None, "hosted")  # type: ignore[arg-type]

        async def close(self) -> None:
            await self.store.close()

    async def connect(*_: Any, **__: Any) -> _Connected:
        return _Connected(await open_store(url, create=False))

    monkeypatch.setattr(Ratchet, "connect", staticmethod(connect))
    result = CliRunner().invoke(cli.app, ["resume", "th", "--approve", "--store", url])
    assert result.exit_code == 1, result.output
    assert "the resume could not land" in result.output
    assert "failed (history_limit/history_commits)" in result.output
    assert "resumed run" not in result.output


@pytest.mark.parametrize(
    ("timeout_s", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-1, ValueError),
        (10**400, ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
    ids=["nan", "inf", "negative", "huge", "text", "bool"],
)
async def test_a_timeout_that_is_no_number_of_seconds_is_refused_before_anything(
    timeout_s: Any, error: type[Exception]
) -> None:
    """NaN made every wait a TimeoutError "after nans", a string an asyncio TypeError from
    inside the wait; ``run`` had started its Run by then. Each is refused first, saying
    what a timeout is, and nothing is started (the hosts here answer no start)."""
    store = MemoryCommitStore()
    await _ended(store)
    client = Ratchet(SystemSpec(name="t", store_url="memory://", hosts=1), store, [_HungHost()])
    handle = RunHandle(client, ThreadId("th"), RunId("r1"), "hosted")
    for waits in (
        handle.result(timeout_s=timeout_s),
        client.wait_all([handle], timeout_s=timeout_s),
        client.run("m:a", "go", thread_id="new", timeout_s=timeout_s),
    ):
        with pytest.raises(error, match="timeout_s is"):
            await asyncio.wait_for(waits, 30)
    assert (await store.load_head(ThreadId("new"))).run_id is None  # nothing started
