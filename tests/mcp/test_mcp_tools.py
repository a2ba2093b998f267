"""The MCP adapter against a real MCP server (``server.py``, run as a subprocess)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel, call
from runtime.adapters import mcp_session
from runtime.adapters.mcp import McpServer, McpUnavailable, mcp_tools
from runtime.commit import Frontier
from runtime.errors import ToolDefinitionError
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.messages import ToolResultMessage
from runtime.ports import Finished, Lost, ToolInvocation, Unavailable
from runtime.tool_calls import LocalToolRunner
from runtime.tools import Tool, ToolContext, tool
from storage.memory import MemoryCommitStore
from tests.mcp.conftest import DEADLINE_S, SERVER, alive, started_pids
from tests.support.servers import answers, free_port, wait_until
from tests.support.waiting import until

ROOT = Path(__file__).parents[2]
RAW_SERVER = str(Path(__file__).with_name("raw_server.py"))
ADD_SCHEMA = {
    "properties": {
        "a": {"title": "A", "type": "integer"},
        "b": {"title": "B", "type": "integer"},
    },
    "required": ["a", "b"],
    "type": "object",
    "title": "addArguments",
}


def runner_for(
    tools: list[Tool], *steps: ModelResponse
) -> tuple[InProcessRunner, MemoryCommitStore]:
    store = MemoryCommitStore()
    script = ScriptedModel([*steps, ModelResponse(text="done")])
    return InProcessRunner(Agent(name="mcp", model=script, tools=tools), store), store


def results(frontier: Frontier) -> dict[str, ToolResultMessage]:
    return {m.call_id: m for m in frontier.messages if isinstance(m, ToolResultMessage)}


async def operation_id(store: MemoryCommitStore, thread: str, call_id: str) -> str:
    for record in await store.read(ThreadId(thread)):
        batch = record.commit.batch
        for c in batch.calls if batch else ():
            if c.call_id == call_id:
                return c.operation_id
    raise AssertionError(f"no call {call_id} in thread {thread}")


def invocation(tool: str, call_id: str, **arguments: object) -> ToolInvocation:
    return ToolInvocation(
        tool=tool,
        arguments=arguments,
        call_id=CallId(call_id),
        operation_id=OperationId(f"op-{call_id}"),
        attempt=1,
        run_id=RunId("r"),
        thread_id=ThreadId("t"),
    )


def test_listing_gives_each_tool_the_servers_schema_and_description(stdio_server, records):
    listed = mcp_tools(
        stdio_server(), recovery={"add": ("idempotent", "never_replay")}, timeouts={"hang": 5.0}
    )
    tools = {t.id: t for t in listed}
    assert list(tools) == ["record", "add", "fail", "hang"]
    add = tools["add"]
    assert add.schema() == {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": ADD_SCHEMA,
    }
    # a call waits at most DEFAULT_CALL_TIMEOUT_S unless told: the SDK drops a reply it
    # cannot parse, and the call would wait for ever
    assert add.recovery == ("idempotent", "never_replay") and add.timeout_s == 300.0
    assert tools["record"].recovery == ("never_replay",) and tools["hang"].timeout_s == 5.0
    assert len(started_pids(records)) == 1  # the listing's own server, gone again (fixture)


def test_names_ratchet_cannot_use_and_unknown_overrides_are_refused(stdio_server):
    dotted = stdio_server(MCP_TEST_DOTTED="1")
    with pytest.raises(ToolDefinitionError, match=r"'files\.read'.*include="):
        mcp_tools(dotted)
    assert [t.id for t in mcp_tools(dotted, include=["add", "record"])] == ["record", "add"]
    with pytest.raises(ToolDefinitionError, match=r"no tool named \['nope'\]"):
        mcp_tools(dotted, recovery={"nope": ("replay_safe",)})
    with pytest.raises(ToolDefinitionError, match="unknown or empty recovery modes"):
        mcp_tools(dotted, include=["add"], recovery={"add": ("sometimes",)})  # type: ignore[dict-item]


def test_a_server_that_cannot_be_listed_is_a_definition_error():
    with pytest.raises(ToolDefinitionError, match="cannot list the tools of MCP server"):
        mcp_tools(McpServer.stdio("/nonexistent/mcp-server"))


async def test_a_run_commits_the_result_and_the_server_sees_the_operation_id(server):
    tools = mcp_tools(server)  # inside a running loop: listed on a private one
    runner, store = runner_for(tools, ModelResponse(tool_calls=(call("record", "c1", note="hi"),)))
    frontier = await runner.start("go", thread_id="t1")
    result = results(frontier)["c1"]
    assert not result.is_error and frontier.run_state.cause.kind == "natural"
    answer = json.loads(result.content)
    assert answer["note"] == "hi"
    op = await operation_id(store, "t1", "c1")
    assert answer["meta"] == {"idempotency_key": op, "attempt": 1, "epoch": frontier.epoch}


async def test_a_tool_error_is_an_error_result(server):
    runner, _ = runner_for(
        mcp_tools(server), ModelResponse(tool_calls=(call("fail", "c1", reason="why"),))
    )
    result = results(await runner.start("go", thread_id="t1"))["c1"]
    assert result.is_error and "failed on purpose: why" in result.content


async def test_arguments_that_break_the_schema_never_reach_the_server(server, records):
    runner, _ = runner_for(
        mcp_tools(server),
        ModelResponse(tool_calls=(call("add", "bad", a="one", b=2), call("add", "short", a=1))),
        ModelResponse(tool_calls=(call("add", "good", a=1, b=2),)),
    )
    by_call = results(await runner.start("go", thread_id="t1"))
    assert (
        by_call["bad"].is_error and "$.a: 'one' is not of type 'integer'" in by_call["bad"].content
    )
    assert by_call["short"].is_error and "'b' is a required property" in by_call["short"].content
    assert not by_call["good"].is_error and by_call["good"].content == "3"
    assert (records / "add.log").read_text() == "1+2\n"  # only the good call was served


async def test_concurrent_calls_share_one_session(server, records):
    wave = [invocation("record", f"c{i}", note=str(i)) for i in range(4)]
    outcomes = await LocalToolRunner(mcp_tools(server)).run(wave)
    pids = {json.loads(o.output.content)["pid"] for o in outcomes if isinstance(o, Finished)}
    assert len(pids) == 1 and server.connected
    assert not pickle.loads(pickle.dumps(server)).connected  # a copy opens its own
    assert len(started_pids(records)) == 2  # the listing's server, then the session's


async def test_a_server_killed_between_calls_is_restarted_for_the_next(server):
    runner, _ = runner_for(
        mcp_tools(server), ModelResponse(tool_calls=(call("record", "c1", note="a"),))
    )
    first = json.loads(results(await runner.start("go", thread_id="t1"))["c1"].content)["pid"]
    os.kill(first, signal.SIGKILL)
    await until(lambda: not server.connected, DEADLINE_S)
    second = results(await runner.start("go", thread_id="t2"))["c1"]
    assert not second.is_error and json.loads(second.content)["pid"] != first


async def test_a_server_killed_during_a_call_leaves_that_call_indeterminate(server, records):
    tools = mcp_tools(server)
    runner, _ = runner_for(tools, ModelResponse(tool_calls=(call("hang", "c1"),)))
    run = asyncio.create_task(runner.start("go", thread_id="t1"))
    hanging = records / "hang.pid"
    await until(hanging.exists, DEADLINE_S)
    os.kill(int(hanging.read_text()), signal.SIGKILL)
    lost = results(await run)["c1"]  # never_replay: Lost, so indeterminate; the Run goes on
    assert lost.is_error and lost.content.startswith("tool outcome unknown")
    assert "hang" in lost.content and "timed out" not in lost.content  # says what happened
    runner, _ = runner_for(tools, ModelResponse(tool_calls=(call("record", "c1", note="again"),)))
    after = results(await runner.start("go", thread_id="t2"))["c1"]
    assert not after.is_error and json.loads(after.content)["note"] == "again"


async def test_a_call_past_its_timeout_is_lost_and_its_session_lives_on(server):
    runner = LocalToolRunner(mcp_tools(server, timeouts={"hang": 0.5}))

    async def pid(call_id: str) -> int:
        (outcome,) = await runner.run([invocation("record", call_id, note="x")])
        assert isinstance(outcome, Finished)
        return int(json.loads(outcome.output.content)["pid"])

    before = await pid("c1")  # the session is open: the timeout bounds the call alone
    (lost,) = await runner.run([invocation("hang", "c2")])
    assert isinstance(lost, Lost) and "timed out after 0.5s" in lost.message
    assert await pid("c3") == before  # the same session, the same server process


async def _hung_and_replaced(server: McpServer, monkeypatch: pytest.MonkeyPatch) -> int:
    """Stop the server of a live session, lose a call on it, and make the next call on a
    fresh server; the stopped server's pid (killed by the SDK as its session ends)."""
    monkeypatch.setattr(mcp_session, "PING_TIMEOUT_S", 1.0)
    hasty = LocalToolRunner(mcp_tools(server, timeouts={"record": 0.5}))
    patient = LocalToolRunner(mcp_tools(server, timeouts={"record": 20.0}))
    (first,) = await patient.run([invocation("record", "c1", note="x")])
    hung = int(json.loads(first.output.content)["pid"])
    os.kill(hung, signal.SIGSTOP)
    try:
        (lost,) = await hasty.run([invocation("record", "c2", note="x")])
        assert isinstance(lost, Lost) and "timed out after 0.5s" in lost.message
        (after,) = await patient.run([invocation("record", "c3", note="x")])
        assert isinstance(after, Finished), after
        assert int(json.loads(after.output.content)["pid"]) != hung
    except BaseException:
        os.kill(hung, signal.SIGKILL)
        raise
    return hung


async def test_a_hung_server_is_replaced_once_a_call_passes_its_deadline(server, monkeypatch):
    """A stopped (or deadlocked) server keeps its pipe open, so its session never ends by
    itself: the ping after the lost call goes unanswered, and the next call is sent to a
    fresh server instead of waiting out its own timeout on the hung one."""
    hung = await _hung_and_replaced(server, monkeypatch)
    try:
        await until(lambda: not alive(hung), DEADLINE_S)  # the SDK killed the hung server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)


async def test_a_close_waits_for_a_hung_server_s_session_to_end(server, monkeypatch):
    """The hung server's session is replaced, and ends (its server killed) seconds later.
    A close right after the replacement returned without it: a process that then ended
    its loop waited for ever on the SDK's ending of it, and left the stopped server."""
    hung = await _hung_and_replaced(server, monkeypatch)
    try:
        await asyncio.wait_for(server.aclose(), DEADLINE_S)
        assert not alive(hung)  # the close waited for the old session's end
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)


async def test_a_reply_the_sdk_cannot_parse_is_read_again_not_waited_out(records):
    """The SDK drops a line it cannot parse, and the call would wait out its timeout: an
    unpaired surrogate escape (a JS string cut mid-emoji) is read as U+FFFD instead (a
    pair as its character), and a reply still unreadable (too deep) is lost at once."""
    env = {"MCP_TEST_DIR": str(records)}
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env=env)
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={"snippet": 20.0, "deep": 20.0}))
        kept, deep = await runner.run([invocation("snippet", "c1"), invocation("deep", "c2")])
    finally:
        await server.aclose()
    assert isinstance(kept, Finished), kept
    assert kept.output.content == "charged; note: caf\ufffd \U0001f600"
    assert isinstance(deep, Lost) and "reply could not be read" in deep.message, deep


async def test_a_reply_that_is_not_utf8_costs_neither_its_session_nor_the_calls_on_it(records):
    """Bytes that are no UTF-8 in a reply ended the SDK's reader of the server's stdout
    (it decoded strictly): the session stayed open with nothing reading it, so every
    call on it waited out its timeout and was lost, the server's answers with them. The
    bytes are read as U+FFFD, as an unpaired surrogate escape is."""
    env = {"MCP_TEST_DIR": str(records)}
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env=env)
    try:
        timeouts = {"not_utf8": 20.0, "snippet": 20.0}
        runner = LocalToolRunner(mcp_tools(server, timeouts=timeouts))
        odd, after = await runner.run([invocation("not_utf8", "c1"), invocation("snippet", "c2")])
    finally:
        await server.aclose()
    assert isinstance(odd, Finished) and odd.output.content == "caf\ufffd\ufffd", odd
    assert isinstance(after, Finished), after


@pytest.mark.parametrize("tool", ["not_an_object", "code_of_text"])
async def test_a_reply_that_is_no_json_rpc_answer_is_lost_at_once(records, tool):
    """JSON, but none of JSON-RPC's messages (a ``result`` of 42, an error code of text):
    the SDK drops it by its shape, and the call waited out its timeout (for ever with
    none). It is lost at once, as a reply nothing can read."""
    env = {"MCP_TEST_DIR": str(records)}
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env=env)
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={tool: None}))
        (outcome,) = await asyncio.wait_for(runner.run([invocation(tool, "c1")]), DEADLINE_S)
    finally:
        await server.aclose()
    assert isinstance(outcome, Lost) and "reply could not be read" in outcome.message, outcome


async def _raw_call(records, tool):
    """The outcome of one call of ``tool`` on the hand-written server (``raw_server``)."""
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env={"MCP_TEST_DIR": str(records)})
    try:
        runner = LocalToolRunner(mcp_tools(server))
        (outcome,) = await asyncio.wait_for(runner.run([invocation(tool, "c1")]), DEADLINE_S)
    finally:
        await server.aclose()
    return outcome


async def test_a_reply_of_a_shape_the_sdk_refuses_is_lost_not_an_error_result(records):
    """A content block of a type MCP has not (``"isError": null``, ``"content": null``):
    the SDK refuses the result by its shape, and the call was committed as finished with
    an error result, which under never_replay tells the model it failed, when the server
    may well have run it."""
    outcome = await _raw_call(records, "wrong_shape")
    assert isinstance(outcome, Lost) and "the wrong shape" in outcome.message, outcome


async def test_a_server_s_patterns_never_run_on_the_host_s_loop(records):
    """``^(a+)+$`` against forty a's and a "!" backtracks for hours: the SDK checked each
    result against the outputSchema's pattern on the event loop, past the call's own
    deadline, and so did the arguments' check against the inputSchema's. The server's
    expressions are the server's to run; every other keyword is checked."""
    from runtime.adapters.mcp import _args_model

    outcome = await _raw_call(records, "backtracks")
    assert isinstance(outcome, Finished) and not outcome.output.is_error, outcome
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
    schema["patternProperties"] = {"^(a+)+$": {"type": "integer"}}
    args = _args_model("t", schema)
    args.model_validate({"s": "a" * 40 + "!", "a" * 40 + "!": 1})
    with pytest.raises(ValueError, match="is not of type 'string'"):
        args.model_validate({"s": 5})


def test_an_input_schema_nested_past_python_s_limit_is_a_definition_error():
    from runtime.adapters.mcp import _args_model

    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ToolDefinitionError, match="nests too deep"):
        _args_model("t", {"type": "object", "properties": {"x": deep}})


async def test_a_server_error_with_the_sdk_s_closing_code_is_the_server_s_answer(records):
    """JSON-RPC leaves -32000..-32099 to servers, and the SDK uses -32000 for its own
    "connection closed": a live server's "card declined" of that code was taken for a
    session that ended mid-call (lost: indeterminate, or run again by a replay-safe
    policy after the server had refused). It is the error the model sees."""
    env = {"MCP_TEST_DIR": str(records)}
    server = McpServer.stdio(sys.executable, [RAW_SERVER], env=env)
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={"declined": 20.0}))
        (outcome,) = await runner.run([invocation("declined", "c1")])
        (again,) = await runner.run([invocation("declined", "c2")])
        (forged,) = await runner.run([invocation("forged", "c3")])
    finally:
        await server.aclose()
    for one in (outcome, again):
        assert isinstance(one, Finished), one
        assert one.output.is_error and one.output.content == "MCP error -32000: card declined"
    # the words the adapter marks an unreadable reply with, said by the server: an answer
    assert isinstance(forged, Finished) and forged.output.content == "MCP error -32700: no"
    started = (records / "started.log").read_text().split()
    assert len(started) == 2  # one process listed the tools, one session took both calls


async def test_a_server_that_cannot_start_is_unavailable_before_dispatch(server, records):
    runner = LocalToolRunner(mcp_tools(server))
    (records / "refuse").touch()  # from now on the server exits as it starts
    (outcome,) = await runner.run([invocation("record", "c1", note="x")])
    assert isinstance(outcome, Unavailable) and "cannot be started" in outcome.message
    (records / "refuse").unlink()
    (outcome,) = await runner.run([invocation("record", "c2", note="y")])
    assert isinstance(outcome, Finished) and not outcome.output.is_error


async def test_a_missing_command_is_unavailable_with_its_reason():
    missing = McpServer.stdio("/nonexistent/mcp-server")
    ctx = ToolContext(OperationId("op"), 1, CallId("c"), RunId("r"), ThreadId("t"))
    with pytest.raises(McpUnavailable, match=r"cannot be started.*mcp-server"):
        await missing.call("record", {"note": "x"}, ctx)
    assert not missing.connected


async def test_over_streamable_http(records: Path):
    port = free_port()
    env = {**os.environ, "MCP_TEST_DIR": str(records)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, SERVER, "http", str(port), env=env
    )
    server = McpServer.http(f"http://127.0.0.1:{port}/mcp", headers={"x-test": "1"})
    try:
        await until(lambda: answers(port), DEADLINE_S)
        tools = {t.id: t for t in mcp_tools(server)}
        assert tools["add"].schema()["parameters"] == ADD_SCHEMA
        (outcome,) = await LocalToolRunner(list(tools.values())).run(
            [invocation("record", "c1", note="http")]
        )
        assert isinstance(outcome, Finished)
        assert json.loads(outcome.output.content)["meta"]["idempotency_key"] == "op-c1"
    finally:
        await server.aclose()
        process.terminate()
        await asyncio.wait_for(process.wait(), DEADLINE_S)


async def _http_server(records: Path, port: int) -> asyncio.subprocess.Process:
    env = {**os.environ, "MCP_TEST_DIR": str(records)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, SERVER, "http", str(port), env=env
    )
    await until(lambda: answers(port), DEADLINE_S)
    return process


async def test_an_http_server_that_dies_mid_call_loses_the_call_and_a_restart_is_a_new_session(
    records: Path,
):
    """Over HTTP the SDK puts its own "connection closed" into the stream as if the server
    had answered it (-32000, a server's code too): the call the server had when it died
    is lost, not a finished error; and after a restart the server answers 404 to the old
    session (the SDK's "Session terminated"), which ended nothing: every later call
    failed on the dead session. That call is unavailable (nothing ran), and the next
    opens a fresh session."""
    port = free_port()
    process = await _http_server(records, port)
    server = McpServer.http(f"http://127.0.0.1:{port}/mcp")
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={"hang": 60.0}))
        hung = asyncio.ensure_future(runner.run([invocation("hang", "c1")]))
        await until(lambda: (records / "hang.pid").exists(), DEADLINE_S)
        process.kill()
        await process.wait()
        (lost,) = await asyncio.wait_for(hung, DEADLINE_S)
        assert isinstance(lost, Lost) and "ended during the call" in lost.message, lost
        process = await _http_server(records, port)  # the same address, a new server
        (fresh,) = await runner.run([invocation("record", "c2", note="x")])
        assert isinstance(fresh, Finished) and not fresh.output.is_error, fresh
        process.kill()  # restarted between calls: the session's id is unknown to it
        await process.wait()
        process = await _http_server(records, port)
        (refused,) = await runner.run([invocation("record", "c3", note="y")])
        assert isinstance(refused, Unavailable) and "restarted" in refused.message, refused
        (kept,) = await runner.run([invocation("record", "c4", note="z")])
        assert isinstance(kept, Finished) and not kept.output.is_error, kept
    finally:
        await server.aclose()
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), DEADLINE_S)


def test_importing_the_adapter_does_not_import_the_sdk():
    sdk = ("mcp", "mcp_types", "httpx2", "jsonschema")
    code = f"import sys, runtime.adapters.mcp; print([m for m in {sdk!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.strip() == "[]"


async def test_a_listing_that_hands_out_cursors_without_end_is_cut() -> None:
    """A server whose ``tools/list`` answers every page with a next cursor (the same one
    again, or new ones for ever) is listed ``MAX_LIST_PAGES`` pages at most, then refused,
    rather than listed for ever with its tools piling up. (The session is the SDK's
    interface alone: ``list_tools`` answering pages as such a server would.)"""
    from mcp.types import ListToolsResult
    from mcp.types import Tool as Listed

    from runtime.adapters.mcp_session import MAX_LIST_PAGES

    class Endless:
        def __init__(self, same: bool) -> None:
            self.same, self.pages = same, 0

        async def list_tools(self, params: object = None) -> ListToolsResult:
            self.pages += 1
            cursor = "again" if self.same else f"page-{self.pages}"
            tool = Listed(name=f"t{self.pages}", inputSchema={"type": "object"})
            return ListToolsResult(tools=[tool], nextCursor=cursor)

    server = McpServer.stdio(sys.executable, ["-c", "pass"])
    for same in (True, False):
        session = Endless(same)
        with pytest.raises(ValueError, match="cursors"):
            await server._listing(session)  # type: ignore[arg-type]
        assert session.pages == (2 if same else MAX_LIST_PAGES)


async def test_a_listing_s_pages_share_one_timeout() -> None:
    """Each page of tools/list had ``open_timeout_s`` of its own: a server answering
    every page just in time held its opening up to a hundred times as long. (The
    session is the SDK's interface alone, its pages slow as a server's would be.)"""
    from mcp.types import ListToolsResult

    class Slow:
        pages = 0

        async def list_tools(self, params: object = None) -> ListToolsResult:
            self.pages += 1
            await asyncio.sleep(0.3)  # the server's pace, well inside a page's timeout
            return ListToolsResult(tools=[], nextCursor=f"page-{self.pages}")

    server = McpServer.stdio(sys.executable, ["-c", "pass"], open_timeout_s=1.0)
    session = Slow()
    with pytest.raises(TimeoutError, match=r"within 1\.0s"):
        await server._listing(session)  # type: ignore[arg-type]
    assert session.pages < 10


@pytest.mark.parametrize("properties", [5, None, True, "abc"])
def test_an_input_schema_whose_properties_are_not_an_object_is_refused_typed(properties):
    """A server's schema of the wrong shape is ToolDefinitionError naming the tool when the
    agent is built, not a TypeError out of the listing."""
    from runtime.adapters.mcp import _args_model

    with pytest.raises(ToolDefinitionError, match="MCP tool t"):
        _args_model("t", {"type": "object", "properties": properties})


def test_a_tool_whose_definition_is_too_large_is_refused_unless_left_out():
    """A listed tool's description and inputSchema go to the model with every inference:
    one past ``MAX_DEFINITION_BYTES`` is refused by name when the agent is built (and
    ``include=`` leaves it out), not sent along with every Step of every Run."""
    from mcp.types import Tool as Listed

    from runtime.adapters.mcp import MAX_DEFINITION_BYTES, _tool

    server = McpServer.stdio(sys.executable, ["-c", "pass"])
    schema = {"type": "object", "properties": {}}
    big = Listed(name="big", description="x" * MAX_DEFINITION_BYTES, inputSchema=schema)
    with pytest.raises(ToolDefinitionError, match=r"MCP tool big .*past 262144"):
        _tool(server, big, ("never_replay",), None)
    fits = Listed(name="fits", description="x" * (MAX_DEFINITION_BYTES - 100), inputSchema=schema)
    assert _tool(server, fits, ("never_replay",), None).id == "fits"


async def test_a_call_whose_deadline_comes_while_its_session_opens_is_unavailable(server, records):
    """Nothing was sent: the call is unavailable (tried again under any policy), not lost
    (its never_replay policy would have made it indeterminate for a call never made)."""
    runner = LocalToolRunner(mcp_tools(server, timeouts={"record": 0.5}))
    (records / "hold").touch()  # the server takes its time to start
    try:
        (outcome,) = await runner.run([invocation("record", "c1", note="x")])
    finally:
        (records / "hold").unlink()
    assert isinstance(outcome, Unavailable), outcome
    assert "opening" in outcome.message
    patient = LocalToolRunner(mcp_tools(server))  # the same session, once it has opened
    (outcome,) = await patient.run([invocation("record", "c2", note="y")])
    assert isinstance(outcome, Finished) and not outcome.output.is_error


def test_a_listing_that_names_a_tool_twice_is_a_definition_error(records):
    """It was the Agent's untyped ValueError, as a local tool of an MCP tool's name is."""
    env = {"MCP_TEST_DIR": str(records), "MCP_TEST_TWICE": "1"}
    with pytest.raises(ToolDefinitionError, match=r"lists \['snippet'\] more than once"):
        mcp_tools(McpServer.stdio(sys.executable, [RAW_SERVER], env=env))
    once = {**env, "MCP_TEST_TWICE": ""}
    listed = mcp_tools(McpServer.stdio(sys.executable, [RAW_SERVER], env=once))

    @tool(name="snippet")
    def clash() -> str:
        return "local"

    with pytest.raises(ToolDefinitionError, match="duplicate tool ids"):
        Agent(name="a", model=ScriptedModel((ModelResponse(text="x"),)), tools=[*listed, clash])


_HOLDS_A_SESSION = """
import asyncio, sys
from runtime.adapters.mcp import McpServer
from runtime.ids import CallId, OperationId, RunId, ThreadId
from runtime.tools import ToolContext

server = McpServer.stdio(sys.executable, [sys.argv[1]], env={"MCP_TEST_DIR": sys.argv[2]})
ctx = ToolContext(OperationId("op"), 1, CallId("c"), RunId("r"), ThreadId("t"))
asyncio.run(server.call("stall", {}, ctx))
"""


def _dead(pid: int) -> bool:
    """Gone, or a zombie (its parent died: whoever adopted it reaps it when it will)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stdio_server_dies_with_the_process_that_started_it(records):
    """The SDK starts a server in a session of its own: an executor killed with ``kill
    -9`` mid-call (Ray restarts it) left its server running for good, one busy in a
    call (deaf to its stdin closing) for as long as the call took."""
    root = str(Path(__file__).parents[2])
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_SESSION, RAW_SERVER, str(records)],
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        (server,) = wait_until_started(records)
        stalling = records / "stalling"
        wait_until(stalling.exists, "the server to be in the call", DEADLINE_S)
        assert not _dead(server)
        holder.kill()
        holder.wait()
        wait_until(lambda: _dead(server), f"MCP server {server} to die with its holder", DEADLINE_S)
    finally:
        holder.kill()
        holder.wait()
        for pid in started_pids(records):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_until_started(records: Path) -> list[int]:
    wait_until(lambda: started_pids(records), "the MCP server to start", DEADLINE_S)
    return started_pids(records)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_death_wrapper_finds_a_command_where_the_sdk_runs_it(tmp_path, monkeypatch):
    """It looked on ``env``'s PATH alone (``os.defpath`` without one), where the SDK
    starts the server with the inherited PATH under ``env``: a ``uvx`` given with
    ``env={"API_KEY": ...}`` was not wrapped. A relative command is the server's
    ``cwd``'s."""
    from runtime.adapters.mcp_transport import _dying_with_this_process

    (tmp_path / "bin").mkdir()
    server = tmp_path / "bin" / "my-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ.get('PATH', '')}")
    command, args = _dying_with_this_process("my-server", ("--x",), {"API_KEY": "k"}, None)
    assert command == sys.executable and args[-2:] == ("my-server", "--x")
    command, _ = _dying_with_this_process("./bin/my-server", (), None, str(tmp_path))
    assert command == sys.executable
    assert _dying_with_this_process("no-such-server", (), None, None) == ("no-such-server", ())


async def test_a_close_waits_a_bounded_time_for_a_stopped_http_server(records, monkeypatch):
    """A server stopped (SIGSTOP) while a read of its session was open held ``aclose``
    for the HTTP client's read timeout, 300 s; the session is now cancelled after
    ``CLOSE_WAIT_S``."""
    monkeypatch.setattr(mcp_session, "CLOSE_WAIT_S", 0.5, raising=False)
    port = free_port()
    process = await _http_server(records, port)
    server = McpServer.http(f"http://127.0.0.1:{port}/mcp")
    try:
        runner = LocalToolRunner(mcp_tools(server, timeouts={"record": 2.0}))
        (first,) = await runner.run([invocation("record", "c1", note="before")])
        assert isinstance(first, Finished)
        process.send_signal(signal.SIGSTOP)
        (lost,) = await runner.run([invocation("record", "c2", note="stopped")])
        assert isinstance(lost, Lost)
        await asyncio.wait_for(server.aclose(), 30)
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        await asyncio.wait_for(process.wait(), DEADLINE_S)
