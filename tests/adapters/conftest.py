"""Each test gets its own fake provider server, on a free port, stopped after it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pytest

from .fake_provider import FakeProvider

M = TypeVar("M")

API_KEY = "sk-test-SECRET0123456789abcdef"
"""Looks like a real key so that scrubbing by shape is exercised too."""


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    server = FakeProvider()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def closing() -> AsyncIterator[Callable[[M], M]]:
    """Registers adapters to close after the test, on its own loop (an SDK client left to
    the garbage collector closes itself on whatever loop runs then)."""
    kept: list[Any] = []

    def keep(model: M) -> M:
        kept.append(model)
        return model

    yield keep
    for model in kept:
        await model.aclose()
