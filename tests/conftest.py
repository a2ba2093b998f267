"""Session-wide fixtures: the trace checker and the shared PostgreSQL and Redis servers.

Every commit any store admits, in any process the session starts, is checked by
``tests.support.trace.check`` (DESIGN §11): the environment names it before anything
else runs, so Ray workers and subprocesses inherit it, and they log violations to one
file that the session fails on at its end (a violation raised inside a worker may be
swallowed by whatever called the store; the log is not).

Outside CI a missing server skips the tests that need it; in CI (CI=true) it is a
failure, so a green CI run always means every backend was exercised.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ.setdefault("RATCHET_TRACE_CHECK", "tests.support.trace:check")
if "RATCHET_TRACE_LOG" not in os.environ:
    _log_dir = tempfile.mkdtemp(prefix="ratchet-trace-")
    os.environ["RATCHET_TRACE_LOG"] = os.path.join(_log_dir, "violations.jsonl")
# a subprocess (the CLI, a second SQLite writer, a Ray worker) must import the checker
# from this tree, which is not installed
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if _ROOT not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, _paths)])

POSTGRES_URL = os.environ.get(
    "RATCHET_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("RATCHET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _require(name: str, host: str, port: int) -> None:
    if _answers(host, port):
        return
    message = f"{name} does not answer on {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    _require("PostgreSQL", "127.0.0.1", 5432)
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    _require("Redis", "127.0.0.1", 6379)
    return REDIS_URL


@pytest.fixture(scope="session", autouse=True)
def trace_violations() -> Iterator[None]:
    """Fail the session if any process logged an illegal commit while it ran."""
    log = Path(os.environ["RATCHET_TRACE_LOG"])
    start = log.stat().st_size if log.exists() else 0
    yield
    if not log.exists():
        return
    with log.open("rb") as file:
        file.seek(start)
        lines = file.read().decode().splitlines()
    if lines:
        shown = "\n".join(_violation(line) for line in lines[:20])
        more = f"\n... and {len(lines) - 20} more" if len(lines) > 20 else ""
        pytest.fail(
            f"{len(lines)} trace violations (each with its frontier and commit in {log}):\n"
            f"{shown}{more}",
            pytrace=False,
        )


def _violation(line: str) -> str:
    try:
        v = json.loads(line)
        return (
            f"- {v['test']}: thread {v['thread_id']} run {v['run_id']} "
            f"{v['label']} #{v['ordinal']}: {v['reason']}"
        )
    except (ValueError, KeyError):
        return f"- {line}"
