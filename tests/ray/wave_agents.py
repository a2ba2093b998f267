"""Tools for the wave-dispatch tests (``tests.ray.wave_agents:agent``)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from runtime.agent import Agent
from runtime.models import ModelResponse, ScriptedModel
from runtime.tools import tool


@tool
def echo_wave(text: str) -> str:
    return text


@tool
async def linger(seconds: float, marker: str) -> str:
    """Marks ``<marker>.started``, sleeps; marks ``<marker>.cancelled`` if cancelled."""
    _mark(f"{marker}.started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _mark(f"{marker}.cancelled")
        raise
    return "lingered"


@tool
async def cancels_itself() -> str:
    asyncio.current_task().cancel()  # type: ignore[union-attr]
    await asyncio.sleep(0)
    return "never"


def _mark(path: str) -> None:
    Path(path).touch()


@tool
def freeze(seconds: float) -> str:
    """Blocks its executor's event loop: the executor cannot answer, nor time it out."""
    time.sleep(seconds)
    return "thawed"


agent = Agent(
    name="waves",
    model=ScriptedModel((ModelResponse(text="unused"),)),
    tools=(echo_wave, linger, freeze, cancels_itself),
)


SLOW_RELEASE = Path(tempfile.gettempdir()) / "ratchet-slow-loading-agent.release"
"""The test that asks for ``slow_loading_agent`` creates this to let its loading end."""


def slow_loading_agent() -> Agent:
    """An agent whose loading waits (as a module listing a slow MCP server's tools at
    import does) until the test creates ``SLOW_RELEASE``, for 30 s at most."""
    deadline = time.monotonic() + 30
    while not SLOW_RELEASE.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return agent
