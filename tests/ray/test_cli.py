"""The ``ratchet`` CLI: expected failures are one clear line; run, runs and show work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cluster.cli import app

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def _ratchet(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    code = "from cluster.cli import app; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("run", "no_such_module:agent", "hi"), "cannot import module 'no_such_module'"),
        (("run", "cluster.demo_agent:nobody", "hi"), "has no attribute 'nobody'"),
        (("run", "not-a-reference", "hi"), "must look like 'package.module:name'"),
        (
            ("run", "cluster.demo_agent:agent", "hi", "--address", "127.0.0.1:1"),
            "cannot reach the Ray cluster at 127.0.0.1:1",
        ),
        (("runs", "--store", "postgresql://u:hunter2@127.0.0.1:1/db"), "u:***@127.0.0.1:1"),
        (("runs", "--store", "ftp://somewhere"), "unsupported store URL"),
    ],
)
def test_expected_failures_are_one_line(args, expected):
    done = _ratchet(*args)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert expected in lines[0]
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


def test_run_then_runs_then_show(tmp_path):
    store = f"sqlite:///{tmp_path}/cli.db"
    runner = CliRunner()
    ran = runner.invoke(
        app, ["run", "tests.ray.agents:quick_agent", "hi", "--thread", "cli-1", "--store", store]
    )
    assert ran.exit_code == 0, ran.output
    assert "said hi" in ran.output and "status: idle reason=natural" in ran.output
    listed = runner.invoke(app, ["runs", "--store", store])
    assert listed.exit_code == 0 and "cli-1" in listed.output and "natural" in listed.output
    shown = runner.invoke(app, ["show", "cli-1", "--store", store])
    assert shown.exit_code == 0
    assert "echo: completed" in shown.output and "running → idle(natural)" in shown.output


def test_show_prints_usage_per_step_and_in_total(tmp_path):
    import asyncio

    from runtime import Agent, InProcessRunner, ModelResponse, ScriptedModel
    from runtime.models import Usage
    from storage.url import open_store

    store_url = f"sqlite:///{tmp_path}/usage.db"
    used = Usage(input_tokens=120, output_tokens=7, cached_tokens=100, model="gpt-test")

    async def run() -> None:
        store = await open_store(store_url)
        agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi", usage=used)]))
        await InProcessRunner(agent, store).start("go", thread_id="u-1")
        await store.close()

    asyncio.run(run())
    shown = CliRunner().invoke(app, ["show", "u-1", "--store", store_url])
    assert shown.exit_code == 0, shown.output
    assert "usage: 120 in (100 cached), 7 out, 1 inference(s) (gpt-test)" in shown.output
    assert "usage (run): 120 in (100 cached), 7 out, 1 inference(s)" in shown.output
    assert "usage (thread): 120 in" in shown.output
