"""Per-thread history limits: reached, the Run ends failed(history_limit) naming the
limit, once, never retried; a start on a thread at the limit is refused, nothing
written."""

from __future__ import annotations

import pytest

from runtime import Agent, InProcessRunner, Limits, ModelResponse, ScriptedModel, call, tool
from runtime.errors import HistoryLimitReached
from runtime.limits import history_headroom, history_size
from storage.memory import MemoryCommitStore


@tool
def echo(text: str) -> str:
    return text * 50


def chatty(steps: int = 6) -> Agent:
    script = [
        ModelResponse(tool_calls=(call("echo", f"c{i}", text="x" * 40),)) for i in range(steps)
    ]
    return Agent(name="chatty", model=ScriptedModel([*script, ModelResponse(text="done")]),
                 tools=[echo], max_steps=steps + 1)  # fmt: skip


async def test_the_commit_limit_ends_the_run_failed_naming_it():
    store = MemoryCommitStore()
    runner = InProcessRunner(chatty(), store, limits=Limits(history_commits=6))
    f = await runner.start("go", thread_id="t")
    cause = f.run_state.cause
    assert (cause.kind, cause.failure, cause.code) == ("failed", "history_limit", "history_commits")
    assert f.version == 7  # six commits, then the end, which always lands
    assert len(await store.read("t")) == 7


async def test_the_size_limit_ends_the_run_failed_naming_it():
    store = MemoryCommitStore()
    runner = InProcessRunner(chatty(), store, limits=Limits(history_bytes=5000))
    f = await runner.start("go", thread_id="t")
    cause = f.run_state.cause
    assert (cause.failure, cause.code) == ("history_limit", "history_bytes")
    assert "the limit is 5000" in cause.message
    # the end lands whatever the limits, with the results of the Step it ends
    assert 5000 < history_size(f.messages) <= 5000 + Limits().batch_result_bytes


async def test_a_start_on_a_thread_at_its_limit_is_refused_and_writes_nothing():
    store = MemoryCommitStore()
    limits = Limits(history_commits=6)
    await InProcessRunner(chatty(), store, limits=limits).start("go", thread_id="t")
    before = len(await store.read("t"))
    with pytest.raises(HistoryLimitReached) as refused:
        await InProcessRunner(chatty(), store, limits=limits).start("again", thread_id="t")
    assert refused.value.limit == "history_commits"
    assert len(await store.read("t")) == before


async def test_headroom_says_how_close_a_thread_is():
    store = MemoryCommitStore()
    f = await InProcessRunner(chatty(2), store).start("go", thread_id="t")
    room = history_headroom(f.messages, f.version, Limits())
    assert room["commits"] == f.version and room["commits_limit"] == 50_000
    assert room["bytes"] == history_size(f.messages) > 4000
