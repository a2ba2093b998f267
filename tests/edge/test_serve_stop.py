"""``ratchet serve`` stopped with Ctrl-C or SIGTERM gives the system's lease up.

uvicorn catches the SIGINT, shuts down, then raises it again once ``serve()`` returned;
asyncio's own handler then cancelled the client's close at its first await, so the
lease stayed held and the next cluster on the store waited it out (up to 15 s). A
SIGTERM (a service manager's stop) came back as Ray's ``SystemExit(15)``: the client
closed, but the command exited 15, which a service manager reads as a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster.cli_base import uncancelled
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]


async def test_a_close_runs_to_its_end_though_its_task_is_cancelled() -> None:
    started, go, ended = asyncio.Event(), asyncio.Event(), []

    async def close() -> str:
        started.set()
        await go.wait()
        ended.append(True)
        return "closed"

    task = asyncio.create_task(uncancelled(close()))
    await started.wait()
    task.cancel()  # the Ctrl-C uvicorn raises again
    task.cancel()  # and a second one
    go.set()  # the cancellation reaches the task first: a plain await ended the close there
    with pytest.raises(asyncio.CancelledError):  # said once the close ended
        await task
    assert ended == [True]


async def test_a_close_that_fails_raises_its_error() -> None:
    async def close() -> None:
        raise OSError("the store went away")

    async def seven() -> int:
        return 7

    with pytest.raises(OSError, match="went away"):
        await uncancelled(close())
    assert await uncancelled(seven()) == 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leases(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return list(conn.execute("SELECT name, holder FROM ratchet_leases"))


@pytest.mark.ray
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stop", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_serve_stopped_gives_the_lease_up(tmp_path: Path, stop: int, exit_code: int) -> None:
    db, port = tmp_path / "served.db", _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RATCHET_STORE_URL")}
    # a background process started by a shell ignores SIGINT: Python's own handler put
    # back, as a terminal's Ctrl-C finds it
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from cluster.cli import app; app()"
    )
    args = ["serve", "--store", f"sqlite:///{db}", "--port", str(port), "--no-auth"]
    server = subprocess.Popen(
        [sys.executable, "-c", code, *args, "--agent", "cluster.demo_agent:agent"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def answering() -> bool:
            assert server.poll() is None, server.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=2):
                    return True
            except OSError:  # refused, not yet listening
                return False

        asyncio.run(until(answering, 90, what="ratchet serve to answer", interval_s=0.2))
        # a Run to its rest first: the system's actors are up (on a loaded machine, a
        # Supervisor still starting may give no word within the close's bound)
        started = urllib.request.Request(
            f"http://127.0.0.1:{port}/threads/t/runs?wait=60",
            data=json.dumps({"agent": "cluster.demo_agent:agent", "input": "hi"}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(started, timeout=90) as answer:
            assert answer.status == 201
        assert [holder for _, holder in _leases(db)] != []  # held while it serves
        server.send_signal(stop)
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == exit_code, output[-3000:]
    if "gave no word within" not in output:  # a Supervisor too slow for the close's bound
        assert _leases(db) == [], output[-3000:]  # given up: the next cluster waits not
