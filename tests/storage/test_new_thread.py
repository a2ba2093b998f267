"""A start that takes its thread for new (``new_thread``: its id was made for the Run)
activates it without reading it first, on every backend; the guess is checked by the
store's compare-and-set, never trusted. A thread that has records after all is read
and verified, and the start goes on exactly as without the hint: a later Run of the
thread starts after the earlier one, a repeated start joins its Run, a start beside an
active Run is refused, and two starts racing one new thread drive it once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from runtime import (
    Agent,
    EndedState,
    InProcessRunner,
    InvalidTransition,
    ModelResponse,
    ScriptedModel,
    call,
    tool,
)
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState

T = ThreadId("t-new")


def _counting(store: Any, name: str) -> list[int]:
    """Count calls of one of the store's methods (the store itself does the work)."""
    calls = [0]
    method = getattr(store, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await method(*args, **kwargs)

    setattr(store, name, counted)
    return calls


def _agent(effects: list[str], permission: bool = False) -> Callable[[], Agent]:
    @tool(needs_permission=permission)
    def note(text: str) -> str:
        effects.append(text)
        return "noted"

    def build() -> Agent:  # a fresh script for each runner: a script is consumed
        script = [
            ModelResponse(tool_calls=(call("note", "c1", text="once"),)),
            ModelResponse(text="done"),
        ]
        return Agent(name="newthread", model=ScriptedModel(script), tools=[note])

    return build


def _natural(frontier: Any, run_id: str) -> bool:
    state = frontier.run_state
    return (
        isinstance(state, EndedState)
        and state.cause.kind == "natural"
        and frontier.run_id == run_id
    )


async def test_a_new_thread_is_started_without_a_read(store: Any) -> None:
    effects: list[str] = []
    loads, heads = _counting(store, "load"), _counting(store, "load_head")
    runner = InProcessRunner(_agent(effects)(), store)
    done = await runner.start("go", thread_id=T, run_id="r1", new_thread=True)
    assert _natural(done, "r1") and effects == ["once"]
    assert (loads[0], heads[0]) == (0, 0)
    stored = await store.load(T)
    assert stored.version == done.version and stored.run_id == "r1"


async def test_a_later_run_of_a_thread_taken_for_new_is_read_and_started(store: Any) -> None:
    effects: list[str] = []
    build = _agent(effects)
    await InProcessRunner(build(), store).start("one", thread_id=T, run_id="r1")
    first = await store.load(T)
    loads = _counting(store, "load")
    done = await InProcessRunner(build(), store).start(
        "two", thread_id=T, run_id="r2", new_thread=True
    )
    assert _natural(done, "r2") and effects == ["once", "once"]
    assert loads[0] >= 1  # the guess was refused: the thread was read
    records = await store.read(T)
    assert [r.seq for r in records] == list(range(1, done.version + 1))
    assert records[first.version].commit.run_id == "r2"  # right after the first Run


async def test_a_repeated_start_taken_for_new_joins_its_run(store: Any) -> None:
    effects: list[str] = []
    build = _agent(effects)
    done = await InProcessRunner(build(), store).start("go", thread_id=T, run_id="r1")
    again = await InProcessRunner(build(), store).start(
        "go", thread_id=T, run_id="r1", new_thread=True
    )
    assert again.version == done.version and _natural(again, "r1")
    assert effects == ["once"] and len(await store.read(T)) == done.version


async def test_a_start_taken_for_new_beside_an_active_run_is_refused(store: Any) -> None:
    effects: list[str] = []
    build = _agent(effects, permission=True)
    parked = await InProcessRunner(build(), store).start("go", thread_id=T, run_id="r1")
    assert isinstance(parked.run_state, AwaitingState)
    with pytest.raises(InvalidTransition, match="active run r1"):
        await InProcessRunner(build(), store).start(
            "other", thread_id=T, run_id="r2", new_thread=True
        )
    assert (await store.load(T)).version == parked.version  # nothing written


async def test_two_starts_racing_one_new_thread_drive_it_once(store: Any) -> None:
    """Two engines (two owners) guess the same new thread at once: one activation lands;
    the other is refused by the compare-and-set, reads the thread, finds its Run there
    and returns it. The tool ran once; the log is one Run's."""
    effects: list[str] = []
    build = _agent(effects)
    a, b = (InProcessRunner(build(), store) for _ in range(2))
    results = await asyncio.gather(
        a.start("go", thread_id=T, run_id="r1", new_thread=True),
        b.start("go", thread_id=T, run_id="r1", new_thread=True),
    )
    assert all(f.run_id == "r1" for f in results)
    final = await store.load(T)
    assert _natural(final, "r1") and effects == ["once"]
    assert {r.commit.run_id for r in await store.read(T)} == {"r1"}
