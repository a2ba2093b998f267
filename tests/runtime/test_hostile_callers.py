"""Hostile callers of the entry points around a Run: a stop's reason, an agent
reference, a stream cursor and the command line's arguments are refused with a clear,
typed error before anything is done; and what the command line prints of hostile
stored data (control sequences, state of another shape) harms nothing around it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cluster.cli import app
from cluster.handle import RunHandle
from cluster.stream import StreamText
from runtime import (
    Agent,
    InProcessRunner,
    InputRefused,
    ModelResponse,
    ScriptedModel,
    call,
    tool,
)
from runtime.agent import load_agent
from runtime.errors import AgentImportError
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState
from runtime.stream import parse_offset
from storage.memory import MemoryCommitStore
from storage.url import open_store
from tests.support.waiting import until

NOT_TEXT = "half a pair: \udcff"


def _engine():
    model = ScriptedModel([ModelResponse(text="done")])
    return InProcessRunner(Agent(name="a", model=model), MemoryCommitStore()).engine()


@pytest.mark.parametrize("reason", [NOT_TEXT, "x" * (200 * 1024), 7, "", "  \n"])
def test_a_stop_reason_that_cannot_be_stored_is_refused_and_nothing_is_signalled(reason):
    engine = _engine()
    with pytest.raises(InputRefused, match="stop reason"):
        engine.stop(reason)
    assert not engine.ending and engine.stop_reason is None


async def test_a_client_refuses_such_a_reason_before_asking_any_host():
    class Spec:
        from runtime.limits import DEFAULT_LIMITS as limits

    class Client:  # asked for nothing but its limits: no host may be reached
        spec = Spec()

        def host_for(self, *args: object) -> object:
            raise AssertionError("a host was asked")

    handle = RunHandle(Client(), "t", "r", "hosted")  # type: ignore[arg-type]
    with pytest.raises(InputRefused, match="utf8"):
        await handle.stop(NOT_TEXT)


def _factory() -> Agent:
    return Agent(name="made", model=ScriptedModel([ModelResponse(text="hi")]))


def _raising_factory() -> Agent:
    raise RuntimeError("no agent today")


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("os:getcwd", "not an Agent"),  # a callable of another module is never called
        ("runtime.agent:Agent", "not an Agent"),  # nor a class
        (".relative:agent", "cannot import"),
        (f"{__name__}:_raising_factory", "no agent today"),
    ],
)
def test_an_agent_reference_runs_nothing_but_its_own_module_s_factory(ref, says):
    with pytest.raises(AgentImportError, match=says):
        load_agent(ref)
    assert load_agent(f"{__name__}:_factory").name == "made"


class _Own(BaseException):
    """A BaseException of the agent module's own."""


class _Unprintable(Exception):
    def __repr__(self) -> str:
        raise ValueError("no text")

    __str__ = __repr__


@pytest.mark.parametrize(
    "raising", [SystemExit(4), KeyboardInterrupt(), GeneratorExit(), _Own("own"), _Unprintable()]
)
@pytest.mark.parametrize("where", ["import", "factory", "lookup"])
def test_an_agent_module_raising_anything_is_an_agent_import_error(
    tmp_path, monkeypatch, raising, where
):
    """Whatever an agent's module raises — as it is imported, from its factory, from a
    module ``__getattr__`` — is AgentImportError: a SystemExit escaped as itself (in a
    RunHost it ended the process, and every Run driven there with it)."""
    name = f"hostile_agent_{where}_{type(raising).__name__.lower()}"
    body = {
        "import": "raise RAISING\n",
        "factory": "def agent():\n    raise RAISING\n",
        "lookup": "def __getattr__(name):\n    raise RAISING\n",
    }[where]
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.RAISING", raising, raising=False)
    with pytest.raises(AgentImportError, match=type(raising).__name__):
        load_agent(f"{name}:agent")


@pytest.mark.parametrize("offset", [f"{10**20}:0", f"1:{10**19}"])
def test_a_stream_cursor_past_64_bit_integers_is_bad_input(offset):
    with pytest.raises(ValueError, match="below 10"):
        parse_offset(offset)


def test_the_command_line_refuses_a_thread_id_that_is_not_text(tmp_path):
    store = f"sqlite:///{tmp_path}/s.db"
    for args in (["show", NOT_TEXT], ["verify", NOT_TEXT], ["export", NOT_TEXT]):
        result = CliRunner().invoke(app, [*args, "--store", store])
        assert result.exit_code == 2, result.output
        assert "thread id refused (utf8)" in result.output
    assert not (tmp_path / "s.db").exists()  # nothing was opened


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["run", "m:agent", NOT_TEXT], "text"),
        (["run", NOT_TEXT, "go"], "agent"),
        (["stop", "t", "--reason", NOT_TEXT], "reason"),
        (["resume", "t", "--deny", "--note", NOT_TEXT], "note"),
        (["resume", "t", "--input", NOT_TEXT], "text"),
        (["resume", "t", "--result", NOT_TEXT], "result"),
        (["runs", "--agent", NOT_TEXT], "agent"),
    ],
)
def test_the_command_line_refuses_text_that_is_not_utf8_before_connecting(args, named, tmp_path):
    """Bytes that are not UTF-8 in a reason, a note, an input: Ray could not start the
    driver whose command line held them, and the command said "cannot connect to auto"
    (exit 1), pointing at the cluster, not at the argument."""
    reads = args[0] == "runs"  # the store's listing; the others go to the cluster
    where = ["--store", f"sqlite:///{tmp_path}/s.db"] if reads else ["--address", "127.0.0.1:9"]
    result = CliRunner().invoke(app, [*args, *where])
    assert result.exit_code == 2, result.output
    assert f"{named} refused (utf8)" in result.output and "connect" not in result.output
    assert not (tmp_path / "s.db").exists()  # nothing was opened


@tool(wait="external_result")
def remote(q: str) -> str:
    return "never run here"


async def test_input_no_store_takes_is_refused_before_a_cluster_is_reached(tmp_path, monkeypatch):
    """Text over ``input_bytes`` as stored (each quote escaped: 140 KB), a JSON-escaped
    lone surrogate in a result: checked only by the client once connected, so the
    command first started a cluster over input it refuses. With no address named (no
    ``--address``, no RAY_ADDRESS) the limits are the defaults and no Ray is asked
    (``cli_base.system_limits``): nothing is started. (Named, the running system's limits
    decide, and a cluster that does not answer is said as such.)"""
    import asyncio

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    store = f"sqlite:///{tmp_path}/s.db"
    model = ScriptedModel([ModelResponse(tool_calls=(call("remote", "c1", q="x"),))])
    waiting = InProcessRunner(Agent(name="a", model=model, tools=[remote]), await open_store(store))
    await waiting.start("go", thread_id="t")
    await waiting.store.close()
    w1 = "benchmarks.w1_agent:w1_s1_k0_m0_t0"
    cases = [
        (["run", w1, '"' * 70_000, "--store", store], "input refused (input_bytes)"),
        (["resume", "t", "--result", '"\\ud800"', "--store", store], "(utf8)"),
    ]
    had_ray = ray.is_initialized()  # the session's Ray, if an earlier test started it
    for args, says in cases:
        result = await asyncio.to_thread(CliRunner().invoke, app, args)
        assert result.exit_code == 1, result.output
        assert says in result.output, result.output
        assert ray.is_initialized() == had_ray  # no Ray started over input refused
    db = await open_store(store)  # the Run waits as it did: nothing was resumed
    try:
        assert isinstance((await db.load_head(ThreadId("t"))).run_state, AwaitingState)
    finally:
        await db.close()


@pytest.mark.parametrize(
    "payload", ["[" * 100_000, "9" * 5000, "NaN", "[Infinity]", '{"a": 1, "a": 2}']
)
def test_a_resume_result_that_is_not_json_is_one_clear_error(payload, tmp_path):
    """NaN, Infinity and a key twice too, as the HTTP service refuses them: they were
    taken (NaN stored as the result "NaN", the last "a" kept)."""
    args = ["resume", "t", "--result", payload, "--store", f"sqlite:///{tmp_path}/s.db"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "--result must be JSON" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("since", [10**18, -(10**18), 2**63 - 1])
def test_a_stored_time_no_datetime_holds_is_shown_raw(since):
    """A status time is data (imported, edited by hand): ``ratchet runs`` and ``show``
    raised ValueError on one past year 9999, and the console on such a deadline."""
    from cluster.cli_runs import iso_time
    from cluster.cli_view import when
    from edge.agui import _interrupt as interrupt_of
    from runtime.lifecycle import PauseTarget, ResumeTicket

    assert iso_time(since) is None
    assert when(since) == f"{since} µs since the epoch"
    assert iso_time(1_000_000).startswith("1970-01-01T00:00:01")
    ticket = ResumeTicket(
        correlation="c", run_id="r", thread_id="t", deadline_us=since, target=PauseTarget()
    )
    assert interrupt_of(ticket).expires_at is None


async def test_an_agent_import_that_hangs_is_an_agent_import_error_after_a_while(monkeypatch):
    """A module that connects to a server without a timeout as it is imported hung every
    request of a host that asked for it (a restarted host's first reconciliation, and
    every start and resume behind it). The wait is bounded; the import still under way
    is joined by the next to ask, never started again beside it."""
    import threading

    import runtime.agent
    from runtime.agent import AgentImports

    release, started = threading.Event(), []

    def hanging(ref: str) -> object:
        started.append(ref)
        release.wait(30)
        return _factory()

    monkeypatch.setattr(runtime.agent, "load_agent", hanging)
    imports = AgentImports(wait_s=0.2)
    try:
        with pytest.raises(AgentImportError, match="still under way"):
            await imports.load("x:hangs")
        with pytest.raises(AgentImportError, match="still under way"):
            await imports.load("x:hangs")
        assert started == ["x:hangs"]  # one import, joined
    finally:
        release.set()
    await until(lambda: not imports._loading)
    assert started == ["x:hangs"]


HOSTILE = "ok\x1b[1A\x1b[2K\r\x1b]0;pwned\x07\x9b2J"
"""Erases the line above (the call a model asks approval for), retitles the window."""


def test_stored_and_streamed_text_reaches_a_terminal_as_text(tmp_path, monkeypatch):
    """A model's text, a tool's arguments, a failure's message or a streamed delta held
    terminal control sequences, and ``show``, ``runs`` and ``watch`` sent them to the
    terminal; each control character is shown as its escape (``--json`` is as it was)."""
    import asyncio
    import io

    from cluster import cli_view
    from runtime import call, tool
    from runtime.errors import ModelRefused
    from runtime.events import Delta
    from runtime.stream import Frame
    from storage.url import open_store

    @tool(recovery=("replay_safe",), needs_permission=True)
    def wire(to: str) -> str:
        return "sent"

    def refuse(request):
        raise ModelRefused("invalid_request", HOSTILE)

    store_url = f"sqlite:///{tmp_path}/esc.db"

    async def fill() -> None:
        store = await open_store(store_url)
        asks = ModelResponse(text=HOSTILE, tool_calls=(call("wire", "c1", to=HOSTILE),))
        for thread, script in (("asks", [asks]), ("refused", [refuse])):
            agent = Agent(name="a", model=ScriptedModel(script), tools=[wire])
            await InProcessRunner(agent, store).start(HOSTILE, thread_id=thread)
        await store.close()

    asyncio.run(fill())
    shown = "\\x1b[1A\\x1b[2K\\x0d\\x1b]0;pwned\\x07\\x9b2J"
    for args in (["show", "asks"], ["show", "refused"], ["runs"], ["watch", "refused"]):
        result = CliRunner().invoke(app, [*args, "--store", store_url])
        assert result.exit_code == 0, result.output
        assert not set("\x1b\x07\r\x9b") & set(result.output), (args, result.output)
    assert shown in result.output  # the failure's message, as watch prints its end
    as_json = CliRunner().invoke(app, ["show", "asks", "--json", "--store", store_url])
    assert "\\u001b[1A" in as_json.output  # JSON's own escape, left to the reader

    out = io.StringIO()  # a terminal: rich's own styling is written, and must be
    monkeypatch.setattr(cli_view, "console", cli_view.Terminal(file=out, force_terminal=True))
    delta = Delta(type="text_delta", run_id="r", step=0, attempt=1, text=HOSTILE)
    cli_view.WatchView(StreamText()).show(Frame(type="delta", event=delta))
    assert shown in out.getvalue() and "\x1b]0;" not in out.getvalue()


def _forged(lines: list[str], thread: str, *commands) -> list[str]:
    """The export ``lines`` with ``commands`` added to its last record, re-chained."""
    import json

    from runtime.commit import assemble_commit, decode_commit

    head, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    commit = decode_commit(records[-1]["body"], thread, len(records))
    fields = {name: getattr(commit, name) for name in ("run_id", "ordinal", "label", "batch")}
    made = assemble_commit(
        thread_id=commit.thread_id,
        disposition=commit.disposition,
        messages=commit.messages,
        commands=(*commit.commands, *commands),
        status=commit.status,
        extra_facts=commit.events,
        prev=commit.prev,
        epoch=commit.epoch,
        claim=commit.claim,
        **fields,
    )
    records[-1] = {"seq": len(records), "hash": made.payload_hash, "body": made.encoded}
    return [json.dumps({**head, "head": made.payload_hash}), *map(json.dumps, records)]


async def test_a_thread_holding_reserved_state_of_another_shape_is_a_problem_row(
    tmp_path, monkeypatch
):
    """Imported before imports held Ratchet's reserved keys to their shapes
    (``runtime.reserved``): usage as text made ``ratchet runs`` fail for every thread,
    and children naming their own thread made ``show`` recurse without end."""
    import asyncio
    import json

    from runtime import history, history_write
    from runtime.ids import ThreadId
    from runtime.state import Command
    from storage.url import open_store

    url = f"sqlite:///{tmp_path}/forged.db"
    store = await open_store(url)
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="fine")]))
    await InProcessRunner(agent, store).start("go", thread_id="good")
    lines = _forged(
        list(await history.export(store, ThreadId("good"))),
        "good",
        Command(key="usage", scope="run", value="lots"),
        Command(key="children", scope="run", value={"c1": "evil", "c2": "good"}),
    )
    with pytest.raises(history.ImportRefused, match="reserved_state"):
        await history.import_thread(store, lines, ThreadId("evil"))
    monkeypatch.setattr(history_write, "reserved_problem", lambda state, commands: None)  # as was
    await history.import_thread(store, lines, ThreadId("evil"))
    await store.close()

    def cli(*args: str):
        return asyncio.to_thread(CliRunner().invoke, app, [*args, "--store", url])

    listed = await cli("runs", "--json")
    rows = {row.get("thread_id"): row for row in map(json.loads, listed.stdout.splitlines())}
    assert rows["evil"]["problem"].startswith("state key run:usage is not as Ratchet writes")
    assert rows["evil"]["usage"] is None and rows["good"]["problem"] is None
    table = await cli("runs")
    assert table.exit_code == 0 and "│ good " in table.output and "(bad" in table.output
    shown = await cli("show", "evil")
    assert shown.exit_code == 0, shown.output
    assert "└ evil  (shown above: the children loop)" in shown.output
    assert "└ good  [natural]" in shown.output
    assert "usage (run): state key run:usage is not as Ratchet writes it" in shown.output
    as_json = await cli("show", "evil", "--json")
    assert json.loads(as_json.stdout.splitlines()[0])["children"]["c1"] == "evil"


async def test_ids_and_options_of_the_wrong_type_are_refused_with_nothing_written(tmp_path):
    """What a caller can pass wrong, each refused by name before the store is asked:
    a run id of 7 and ``new_thread="yes"`` raised TypeError from deep inside, an empty
    thread id started a Run on a new thread (an empty run id, under a new id), a thread
    of None was a pydantic ValidationError of Frontier."""
    from runtime.history import export, fork

    store = MemoryCommitStore()
    runner = InProcessRunner(Agent(name="a", model=ScriptedModel([ModelResponse(text="x")])), store)
    for kwargs in (
        {"run_id": 7},
        {"thread_id": ""},
        {"run_id": ""},
        {"thread_id": None, "run_id": 7},
    ):
        with pytest.raises(InputRefused):
            await runner.start("go", **kwargs)
    with pytest.raises(TypeError, match="new_thread is True or False"):
        await runner.start("go", thread_id="t", new_thread="yes")  # type: ignore[arg-type]
    for attempt in (runner.recover(None), fork(store, None, 1, "f"), export(store, None)):  # type: ignore[arg-type]
        with pytest.raises(InputRefused, match="thread id"):
            await attempt
    assert await store.thread_ids() == []
    agent = runner.agent
    for wrong, kwargs in (("limits", {"limits": None}), ("agent", {})):
        with pytest.raises(TypeError, match=f"{wrong} must be a"):
            InProcessRunner(None if wrong == "agent" else agent, store, **kwargs)  # type: ignore[arg-type]
    for run in (
        runner.start("go", faults=None),  # type: ignore[arg-type]
        runner.recover("t", faults={}),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="faults must be a FaultPlan, not"):
            await run
    assert await store.thread_ids() == []


async def test_a_store_url_or_option_no_store_can_use_is_refused_typed(tmp_path):
    """``open_store(None)`` raised AttributeError, a SQLite URL with a host SQLAlchemy's
    ArgumentError (driver errors never leave storage/), and ``timeout_s=0`` made every
    statement give up at once, each start retrying for a minute."""
    from storage.url import UnsupportedStoreUrl, open_store

    with pytest.raises(UnsupportedStoreUrl, match="a store URL is text"):
        await open_store(None)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedStoreUrl, match="Invalid SQLite URL"):
        await open_store(f"sqlite://host{tmp_path}/s.db")
    for seconds in (0, -1, "x", float("nan"), True):
        with pytest.raises(ValueError, match="timeout_s is a positive number"):
            await open_store(f"sqlite:///{tmp_path}/s.db", timeout_s=seconds)
    assert list(tmp_path.iterdir()) == []


def test_a_capability_bound_holds_names_not_one_string():
    """``tools="reporting_admin"`` was matched as a substring: a tool named "reporting"
    got through a bound that must only ever hold back."""
    from runtime.plugins import CapabilityBound

    for value in ("reporting_admin", b"x", [1]):
        with pytest.raises(TypeError, match="a bound's tools is a set of names"):
            CapabilityBound(tools=value)  # type: ignore[arg-type]
    assert CapabilityBound(tools=["a"]).tools == frozenset({"a"})


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param("external_result", id="content-123"),
        pytest.param("is_error", id="is-error-yes"),
        pytest.param("permission", id="approve-yes"),
    ],
)
def test_an_answer_built_with_model_construct_is_refused_as_bad_input(payload):
    """``handle.respond`` with such a payload raised pydantic's ValidationError (no
    RatchetError); a command carrying it was InputRefused already."""
    from runtime.batch import ToolOutput
    from runtime.lifecycle import (
        ExternalResult,
        PermissionDecision,
        ResumeTicket,
        ToolWaitTarget,
        answer,
    )

    built = {
        "external_result": lambda: ExternalResult.model_construct(
            output=ToolOutput.model_construct(content=123)
        ),
        "is_error": lambda: ExternalResult.model_construct(
            output=ToolOutput.model_construct(content="x", is_error="yes")
        ),
        "permission": lambda: PermissionDecision.model_construct(approve="yes"),
    }[payload]()
    target = ToolWaitTarget(wait="external_result", call_id="c1", tool="t", arguments="{}")
    ticket = ResumeTicket(correlation="c", run_id="r", thread_id="t", target=target)
    with pytest.raises(InputRefused) as refused:
        answer(ticket, built)
    assert refused.value.limit == "type"
