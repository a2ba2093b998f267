"""One Ray instance for the whole Ray test session; one Ratchet system per test.

The effect ledger's path is put in the environment before ``ray.init`` so every
worker process inherits it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.client import Ratchet
from cluster.config import LOCAL_SYSTEM_CONFIG
from cluster.demo_agent import EffectLedger
from tests.support.waiting import until

LEDGER_DIR = tempfile.mkdtemp(prefix="ratchet-ray-tests-")
os.environ["RATCHET_LEDGER"] = os.path.join(LEDGER_DIR, "effects.db")


@pytest.fixture(scope="session", autouse=True)
def ray_session() -> Any:
    if not ray.is_initialized():
        ray.init(
            address="local",  # a Ray of its own: never another session's on this machine
            num_cpus=4,
            resources={"special": 2},
            include_dashboard=False,
            namespace="ratchet",
            log_to_driver=False,
            _system_config=LOCAL_SYSTEM_CONFIG,
        )
    yield
    ray.shutdown()


@pytest.fixture
def ledger() -> EffectLedger:
    return EffectLedger(os.environ["RATCHET_LEDGER"])


@pytest.fixture
async def make_system(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Ratchet]]]:
    made: list[Ratchet] = []

    async def make(**options: Any) -> Ratchet:
        url = f"sqlite:///{tmp_path}/store-{len(made)}.db"
        client = await Ratchet.connect(store_url=url, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.shutdown()


async def wait_for(
    condition: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s`` (never sleep to sync)."""
    await until(condition, timeout_s, what=what, interval_s=0.05)


def actor_gone(name: str) -> Callable[[], Awaitable[bool]]:
    """A ``wait_for`` condition: Ray knows no actor by ``name`` any more."""

    async def gone() -> bool:
        try:
            ray.get_actor(name, namespace="ratchet")
        except ValueError:
            return True
        return False

    return gone


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process SIGSTOPped (hung: Ray takes it for alive) for the block's length."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed meanwhile
            os.kill(pid, signal.SIGCONT)
