"""Agents whose recovery kills the RunHost attempting it (``tests.ray.crashing_agents``).

``recovery_killer_<token>``: the first RunHost process to load it (the start) gets an
agent whose model never answers, so the start is answered and the Run stays running
until the test ends that host. Every RunHost process that loads it later — a
recovery, in a new process — ends itself (``os._exit``) while loading it, before the
Run is claimed or anything is committed: the Run stays marked lost, under an owner
that is gone. Each such load is first written to a file beside the EffectLedger
(``recovery_kills``), which survives the process's death. Outside a RunHost (the test
process, a client) loading it does nothing: a test must not end itself.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import ray

from runtime.agent import Agent
from runtime.models import InferenceRequest, ModelDelta, ModelResponse

PREFIX = "recovery_killer_"


def _path(token: str, what: str) -> Path:
    ledger = os.environ.get("RATCHET_LEDGER")
    assert ledger, "RATCHET_LEDGER is not set"
    return Path(ledger).with_name(f"recovery-killer-{token}.{what}")


def recovery_kills(token: str) -> list[int]:
    """The pid of every RunHost process that ended itself loading the agent, in order."""
    path = _path(token, "kills")
    if not path.exists():
        return []
    return [int(line) for line in path.read_text().split()]


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _in_run_host() -> bool:
    if not ray.is_initialized():
        return False
    name = ray.get_runtime_context().get_actor_name() or ""
    return ":host:" in name or ":dedicated:" in name


class _SilentModel:
    """The first drive's inference never answers (the test ends its host)."""

    async def stream(self, request: InferenceRequest) -> AsyncIterator[ModelDelta | ModelResponse]:
        await asyncio.Event().wait()
        yield ModelResponse(text="never reached")  # makes this an async generator


def __getattr__(name: str) -> Agent:
    if not name.startswith(PREFIX):
        raise AttributeError(name)
    token = name.removeprefix(PREFIX)
    if _in_run_host():
        started = _path(token, "started")
        try:  # O_EXCL: exactly one process ever loads it to start the Run
            os.close(os.open(started, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            _append(_path(token, "kills"), str(os.getpid()))
            os._exit(1)
    return Agent(name="recovery-killer", model=_SilentModel())
