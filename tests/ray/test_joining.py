"""A client joining a running system takes its settings (``cluster.joining``): a second
Python client, and the ``ratchet`` commands, hold input to the limits the system runs
with, not to the defaults; settings asked for that it does not run with are ConfigError."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from cluster.cli import app
from cluster.client import Ratchet
from runtime.errors import ConfigError
from runtime.history import export
from runtime.ids import ThreadId
from runtime.limits import DEFAULT_LIMITS, Limits

pytestmark = pytest.mark.ray
QUICK = "tests.ray.agents:quick_agent"
ROOT = Path(__file__).resolve().parents[2]
WIDE = Limits(id_chars=1024, tool_calls=16)
"""Raised ``id_chars`` (fewer tool calls, so that its largest commit fits the stores)."""


async def test_a_second_client_takes_the_running_systems_limits(make_system):
    """It built its spec from the defaults: a 300-character thread id, which the system
    takes, was refused by its start and by its import (InputRefused(id_chars))."""
    system = await make_system(limits=WIDE, hosts=1)
    second = await Ratchet.connect(store_url=system.spec.store_url)
    try:
        assert second.spec.limits == WIDE and second.spec.hosts == 1
        thread = "t" * 300
        frontier = await second.run(QUICK, "hi", thread_id=thread, timeout_s=30)
        assert frontier.thread_id == thread and frontier.status.reason == "natural"
        lines = await export(second.store, ThreadId(thread))
        copied = await second.import_thread(lines, "c" * 300)
        assert copied.version == frontier.version
    finally:
        await second.close()


async def test_settings_asked_that_the_running_system_has_not_are_refused_typed(make_system):
    """A joining client that asked for other limits (or hosts) kept them, and held input
    to rules the system does not keep; asked as the system runs, it joins."""
    system = await make_system(limits=WIDE)
    url = system.spec.store_url
    with pytest.raises(ConfigError) as refused:
        await Ratchet.connect(store_url=url, limits=DEFAULT_LIMITS)
    assert "limits.id_chars: running 1024, asked 256" in str(refused.value)
    assert refused.value.system == system.spec.name
    with pytest.raises(ConfigError, match="hosts: running 2, asked 3"):
        await Ratchet.connect(store_url=url, hosts=3)
    same = await Ratchet.connect(store_url=url, limits=WIDE, hosts=2)
    await same.close()
    frontier = await system.run(QUICK, "still here", thread_id="s" * 300, timeout_s=30)
    assert frontier.status.reason == "natural"  # the refusals left the system as it was


def test_the_command_line_takes_the_running_systems_limits(make_system, tmp_path: Path):
    """``ratchet run`` held a thread id to the default ``id_chars``, and ``fork`` and
    ``import`` to ``SYSTEM_LIMITS`` (the defaults): with ``--address`` they hold them to
    the system's as it runs there. Without it, ``run`` asked the Ray of RAY_ADDRESS and
    ``fork``/``import`` held to the defaults still, and ``show`` measured the room
    against the defaults always: now all of them ask RAY_ADDRESS's system; with
    neither, no Ray is asked, and they are the defaults."""
    limits = replace(WIDE, history_commits=60_000)
    system = asyncio.run(make_system(limits=limits))
    store = ["--store", system.spec.store_url]
    here = ["--address", "auto"]  # the Ray of this process: joined already
    thread, saved = "r" * 300, str(tmp_path / "r.jsonl")

    def ratchet(*args: str) -> str:
        result = CliRunner().invoke(app, [*args, *store])
        assert result.exit_code == 0, result.output
        return result.output

    assert "said hi" in ratchet("run", QUICK, "hi", "--thread", thread)
    ratchet("export", thread, "--out", saved)
    assert "imported thread" in ratchet("import", saved, "--as", "i" * 300, *here)
    at = asyncio.run(system.handle(thread).frontier()).version
    assert "forked thread" in ratchet("fork", thread, "--at", str(at), "--to", "f" * 300, *here)
    shown = ratchet("show", thread)  # this process has joined Ray, as RAY_ADDRESS would
    assert "of 60,000 commits (the limits system ratchet-" in shown, shown

    def process(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", "from cluster.cli import app; app()", *args, *store],
            cwd=ROOT,
            env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    address = ray.get_runtime_context().gcs_address
    joined = process("import", saved, "--as", "e" * 300, RAY_ADDRESS=address)
    assert joined.returncode == 0 and "imported thread" in joined.stdout, joined.stderr
    shown = process("show", thread, RAY_ADDRESS=address).stdout
    assert "of 60,000 commits (the limits system" in shown, shown
    alone = process("import", saved, "--as", "d" * 300)  # no Ray named: the defaults
    assert alone.returncode == 1 and "id_chars" in alone.stderr, alone.stderr
    assert "of 50,000 commits (default limits)" in process("show", thread).stdout


def test_a_conflict_names_each_setting_and_the_urls_are_the_client_s_own():
    """A store's and a bus's URLs say where this client reaches them (another host
    name, other credentials): its own are kept, never a conflict, never shown."""
    from actors.wire import SystemSpec
    from cluster.joining import adopt

    running = SystemSpec("s", "memory://", redis_url="redis://:hunter2@127.0.0.1:6379/0", hosts=3)
    mine = SystemSpec("s", "MEMORY://", redis_url="redis://:swordfish@10.0.0.9:6379/0")
    asked = {"redis_url": mine.redis_url, "store_url": mine.store_url, "hosts": 2}
    with pytest.raises(ConfigError) as refused:
        adopt(mine, running, asked)
    assert refused.value.conflicts == ("hosts: running 3, asked 2",)
    assert "hunter2" not in str(refused.value) and "swordfish" not in str(refused.value)
    joined = adopt(mine, running, {"redis_url": mine.redis_url})
    assert joined == SystemSpec("s", "MEMORY://", redis_url=mine.redis_url, hosts=3)
    bare = SystemSpec("s", "MEMORY://")  # no bus of its own: the system's
    expected = SystemSpec("s", "MEMORY://", redis_url=running.redis_url, hosts=3)
    assert adopt(bare, running, {}) == expected
