"""The foundation's crash matrix, re-run on the durable SQL stores.

Every named fault point of a 3-step Run: the engine is abandoned there, a fresh
engine recovers on the same SQLite file or PostgreSQL database, and the committed
log is checked exactly as on the memory store (tests/runtime/test_crash_matrix.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.runtime.test_crash_matrix import FAULT_POINTS, crash_and_recover


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    """Overrides the conformance backends: only the SQL ones here."""
    return str(request.param)


@pytest.mark.parametrize("point", FAULT_POINTS, ids=[f"{n}#{i}" for n, i in FAULT_POINTS])
async def test_crash_at_every_point_recovers(store: Any, point: tuple[str, int]) -> None:
    await crash_and_recover(lambda: store, point)
