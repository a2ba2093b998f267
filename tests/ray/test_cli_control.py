"""``ratchet resume``, ``cancel``, ``stop`` and ``watch`` against a live system."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cluster.cli import app
from cluster.client import Ratchet, RunHandle
from runtime.events import Fact
from runtime.lifecycle import AwaitingState, EndedState
from runtime.messages import ToolResultMessage, UserMessage
from runtime.stream import Frame, parse_offset
from tests.support.waiting import until

from .wait_agents import ANSWER, gate_path

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
WAITS = "tests.ray.wait_agents"
PERMISSION = "tests.ray.agents:permission_agent"


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ratchet]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('cli-control'))}/store.db"
    client = asyncio.run(Ratchet.connect(store_url=url))
    yield client
    asyncio.run(client.shutdown())


def ratchet(system: Ratchet, *args: str):
    result = CliRunner().invoke(app, [*args, "--store", system.spec.store_url])
    assert "Traceback" not in result.output, result.output
    return result


def start(system: Ratchet, agent: str, *, rest: bool = True) -> RunHandle:
    async def go() -> RunHandle:
        handle = await system.start(agent, "go")
        if rest:
            await handle.result(timeout_s=30)
        return handle

    return asyncio.run(go())


def frontier(handle: RunHandle):
    return asyncio.run(handle.frontier())


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


RESUMES = {
    "approve": (PERMISSION, ["--approve"]),
    "deny": (PERMISSION, ["--deny", "--note", "not today"]),
    "result": (f"{WAITS}:external_agent", ["--result", '{"cm": 7}']),
    "fire": (f"{WAITS}:scheduled_agent", ["--fire"]),
    "input": (f"{WAITS}:input_agent", ["--input", "savings"]),
    "unpause": (f"{WAITS}:pause_agent", ["--unpause"]),
}


@pytest.mark.parametrize("flag", list(RESUMES))
def test_resume_builds_the_command_from_the_ticket(system, flag):
    agent, args = RESUMES[flag]
    handle = start(system, agent)
    ticket = frontier(handle).run_state.ticket
    result = ratchet(system, "resume", handle.thread_id, *args)
    assert result.exit_code == 0, result.output
    assert f"resumed run {ticket.run_id} on thread {handle.thread_id}" in result.output
    assert "ended natural" in result.output
    done = frontier(handle)
    results = [m for m in done.messages if isinstance(m, ToolResultMessage)]
    if flag == "deny":
        assert results[0].content == "blocked: permission denied: not today"
    elif flag == "result":
        assert results[0].content == '{"cm": 7}'
    elif flag == "input":
        assert [m.text for m in done.messages if isinstance(m, UserMessage)][-1] == "savings"


def test_a_wrong_flag_prints_the_rejection_and_keeps_the_ticket(system):
    handle = start(system, PERMISSION)
    before = frontier(handle).run_state
    line = one_error_line(ratchet(system, "resume", handle.thread_id, "--input", "sure, go"))
    assert (
        line == "error: resume rejected on payload: expected a permission payload, got user_input"
    )
    assert frontier(handle).run_state == before
    line = one_error_line(ratchet(system, "resume", handle.thread_id, "--unpause"))
    assert "expected a permission payload, got pause" in line
    line = one_error_line(ratchet(system, "resume", handle.thread_id, "--expire"))
    assert line == "error: resume rejected on deadline: the ticket has no deadline to expire"
    assert frontier(handle).run_state == before
    assert ratchet(system, "resume", handle.thread_id, "--approve").exit_code == 0
    line = one_error_line(ratchet(system, "resume", handle.thread_id, "--approve"))
    assert line.startswith("error: resume rejected on ticket: thread ")
    assert "is not awaiting: run " in line and "ended natural" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["resume", "no-such-thread", "--approve"], "thread 'no-such-thread' has no commits"),
        (["cancel", "no-such-thread"], "thread 'no-such-thread' has no commits"),
        (["stop", "no-such-thread", "--reason", "x"], "thread 'no-such-thread' has no commits"),
        (["watch", "no-such-thread"], "thread 'no-such-thread' has no commits"),
        (["resume", "t"], "give exactly one of --approve, --deny, --input"),
        (["resume", "t", "--approve", "--deny"], "(got --approve, --deny)"),
        (["resume", "t", "--fire", "--expire"], "(got --fire, --expire)"),
        (["resume", "t", "--result", "{not json"], "--result must be JSON: "),
        (["watch", "t", "--after", "yesterday"], "must look like 'SEQ:INDEX'"),
        (["stop", "t", "--reason", " "], "--reason must not be empty"),
    ],
)
def test_bad_input_is_one_clear_line(system, args, expected):
    assert expected in one_error_line(ratchet(system, *args))


def test_cancel_an_awaiting_and_a_running_run(system, ledger):
    parked = start(system, PERMISSION)
    result = ratchet(system, "cancel", parked.thread_id)
    assert result.exit_code == 0 and "ended cancelled" in result.output, result.output
    again = ratchet(system, "cancel", parked.thread_id)
    assert again.exit_code == 0 and "nothing to do: " in again.output

    napping = start(system, f"{WAITS}:long_nap_agent", rest=False)
    asyncio.run(until(lambda: bool(ledger.rows(f"tool-batch:{napping.run_id}:")), 30.0))
    result = ratchet(system, "cancel", napping.thread_id)
    assert result.exit_code == 0 and "ended cancelled" in result.output, result.output
    assert isinstance(frontier(napping).run_state, EndedState)


def test_stop_with_a_reason(system, ledger):
    napping = start(system, f"{WAITS}:long_nap_agent", rest=False)
    asyncio.run(until(lambda: bool(ledger.rows(f"tool-batch:{napping.run_id}:")), 30.0))
    result = ratchet(system, "stop", napping.thread_id, "--reason", "over budget")
    assert result.exit_code == 0, result.output
    assert "ended stopped: over budget" in result.output
    assert frontier(napping).run_state.cause.reason == "over budget"


def test_watch_to_rest_then_from_an_offset(system):
    handle = start(system, PERMISSION, rest=False)
    first = ratchet(system, "watch", handle.thread_id)
    assert first.exit_code == 0, first.output
    out = first.output
    assert "● status running" in out and "● status idle (awaiting_permission)" in out
    assert 'tool_call [c1] drop_table({"name": "users"})' in out
    assert "answer with: ratchet resume " in out and "--approve or --deny" in out
    assert isinstance(frontier(handle).run_state, AwaitingState)
    last = re.findall(r"^\s*(\d+:\d+) awaiting permission", out, flags=re.M)[-1]
    resumed = ratchet(system, "resume", handle.thread_id, "--approve", "--no-wait")
    assert resumed.exit_code == 0, resumed.output
    rest = ratchet(system, "watch", handle.thread_id, "--after", last)
    assert rest.exit_code == 0, rest.output
    assert "awaiting permission" not in rest.output  # nothing before the offset again
    assert "resumed (permission)" in rest.output
    assert "tool_result [c1] drop_table: dropped users" in rest.output
    assert "● status idle (natural)" in rest.output
    assert "at rest: run " in rest.output and "ended natural" in rest.output


def test_watch_json_is_one_frame_per_line_until_rest(system):
    handle = start(system, PERMISSION, rest=False)
    result = ratchet(system, "watch", handle.thread_id, "--json")
    assert result.exit_code == 0, result.output
    frames = [Frame.model_validate_json(line) for line in result.stdout.splitlines()]
    assert frames[0].type == "thread_status" and frames[0].offset is None
    offsets = [parse_offset(frame.offset) for frame in frames[1:]]
    assert offsets == sorted(set(offsets))  # every fact once, in order
    statuses = [frame.status.state for frame in frames if frame.type == "thread_status"]
    assert "running" in statuses and statuses[-1] == "idle"
    last = frames[-1].event
    assert isinstance(last, Fact) and last.type == "awaiting"
    assert last.data["ticket"]["target"]["tool"] == "drop_table"


@pytest.mark.redis
def test_watch_shows_streamed_text_once_with_redis(make_system, redis_url):
    client = asyncio.run(_connect(make_system, redis_url))
    handle = asyncio.run(client.start(f"{WAITS}:gated_flaky_agent", "what is it?"))
    code = "from cluster.cli import app; app()"
    args = ["watch", handle.thread_id, "--store", client.spec.store_url, "--redis", redis_url]
    watcher = subprocess.Popen(
        [sys.executable, "-u", "-c", code, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    lines: list[str] = []
    try:
        assert watcher.stdout is not None
        for line in watcher.stdout:  # the Run waits at the gate until the watcher is in
            lines.append(line)
            if "tool_call [c1] gate" in line:
                Path(gate_path(handle.thread_id)).touch()
        watcher.wait(timeout=30)
    finally:
        watcher.kill()
    out = "".join(lines)
    assert watcher.returncode == 0, out + (watcher.stderr.read() if watcher.stderr else "")
    assert "… the answer might " in out  # the failed attempt's partial text…
    assert f"↻ {ANSWER}\n" in out  # …is replaced by the retry's, shown once
    assert ANSWER + ANSWER not in out
    assert f"assistant: {ANSWER}" in out and "run_finished: natural" in out


async def _connect(make_system, redis_url: str) -> Ratchet:
    return await make_system(redis_url=redis_url)
