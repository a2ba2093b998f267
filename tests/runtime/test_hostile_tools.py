"""Tools that misbehave at the tool boundary: each failure is its own call's error, seen
by the model, and never escapes into the wave, the other calls, or the event loop (an
executor runs the waves of many Runs in one call: one call raising through would have
lost them all)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from runtime import tool
from runtime.ports import Finished
from runtime.tools import LocalToolRunner

from .test_sync_tools import invocation


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for you")


class Custom(BaseException):
    pass


@tool
async def exits_on_the_loop() -> str:
    sys.exit(3)


@tool
def exits_in_a_thread() -> str:
    raise KeyboardInterrupt


@tool(timeout_s=5)
async def exits_under_a_timeout() -> str:
    raise SystemExit(1)


@tool
async def generator_exit() -> str:
    raise GeneratorExit


@tool
async def custom_base() -> str:
    raise Custom("mine")


@tool
async def unprintable() -> str:
    raise Unprintable


@tool
async def fine() -> str:
    await asyncio.sleep(0)
    return "fine"


TOOLS = [
    exits_on_the_loop,
    exits_in_a_thread,
    exits_under_a_timeout,
    generator_exit,
    custom_base,
    unprintable,
    fine,
]
HOSTILE = [
    ("exits_on_the_loop", "SystemExit"),
    ("exits_in_a_thread", "KeyboardInterrupt"),
    ("exits_under_a_timeout", "SystemExit"),
    ("generator_exit", "GeneratorExit"),
    ("custom_base", "Custom"),
    ("unprintable", "cannot be printed"),
]


@pytest.mark.parametrize(("name", "said"), HOSTILE, ids=[n for n, _ in HOSTILE])
async def test_a_hostile_failure_is_its_own_call_s_error(name: str, said: str) -> None:
    runner = LocalToolRunner(TOOLS)
    outcomes = await runner.run([invocation(name, "a"), invocation("fine", "b")])
    hostile, neighbour = outcomes
    assert isinstance(hostile, Finished) and hostile.output.is_error, hostile
    assert said in hostile.output.content
    assert isinstance(neighbour, Finished) and neighbour.output.content == "fine"
    # and the loop goes on: a later call runs
    (again,) = await runner.run([invocation("fine", "c")])
    assert again.output.content == "fine"
