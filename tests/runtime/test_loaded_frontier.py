"""A resume or a recovery handed the frontier its caller just loaded (a RunHost does)
does not read the thread again, and a stale one is no shortcut past the store's
compare-and-set: the thread is read again and the Run goes on from what is stored."""

from __future__ import annotations

from typing import Any

import pytest

from runtime import (
    Agent,
    EndedState,
    InProcessRunner,
    ModelResponse,
    ResumeRejected,
    ScriptedModel,
    call,
    tool,
)
from runtime.commit import Frontier
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, PermissionDecision, answer
from runtime.messages import UserMessage
from storage.memory import MemoryCommitStore


class CountingStore(MemoryCommitStore):
    """The in-memory store, counting whole-frontier loads."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    async def load(self, thread: ThreadId) -> Frontier:
        self.loads += 1
        return await super().load(thread)


def _agent(effects: list[str]) -> Agent:
    @tool(needs_permission=True)
    def pay(amount: int) -> str:
        effects.append(f"paid {amount}")
        return "paid"

    script = [ModelResponse(tool_calls=(call("pay", "c1", amount=3),)), ModelResponse(text="done")]
    return Agent(name="loaded", model=ScriptedModel(script), tools=[pay])


async def _parked(store: CountingStore, effects: list[str]) -> tuple[InProcessRunner, Frontier]:
    runner = InProcessRunner(_agent(effects), store)
    parked = await runner.start("go", thread_id="t")
    assert isinstance(parked.run_state, AwaitingState)
    return runner, parked


def _approval(frontier: Frontier) -> Any:
    state = frontier.run_state
    assert isinstance(state, AwaitingState)
    return answer(state.ticket, PermissionDecision(approve=True))


async def test_a_resume_handed_its_loaded_frontier_reads_no_more() -> None:
    store, effects = CountingStore(), list[str]()
    runner, _ = await _parked(store, effects)
    loaded = await store.load(ThreadId("t"))
    store.loads = 0
    done = await runner.engine().resume(_approval(loaded), loaded)
    assert isinstance(done.run_state, EndedState) and done.run_state.cause.kind == "natural"
    assert effects == ["paid 3"] and store.loads == 0


async def test_a_stale_loaded_frontier_is_no_shortcut_past_the_stores_compare_and_set() -> None:
    """Two resumes of one ticket, each handed the same frontier loaded before either:
    the first lands; the second's commit is refused against the version it names, the
    thread is read again, and its ticket is gone: ResumeRejected, the tool ran once."""
    store, effects = CountingStore(), list[str]()
    runner, _ = await _parked(store, effects)
    stale = await store.load(ThreadId("t"))
    first = _approval(stale).model_copy(update={"request_id": "first"})
    second = _approval(stale).model_copy(update={"request_id": "second"})
    done = await runner.engine().resume(first, stale)
    assert isinstance(done.run_state, EndedState)
    store.loads = 0
    with pytest.raises(ResumeRejected):
        await runner.engine().resume(second, stale)
    assert store.loads >= 1 and effects == ["paid 3"]


async def test_a_head_or_another_threads_frontier_is_not_taken_for_the_whole() -> None:
    store, effects = CountingStore(), list[str]()
    runner, _ = await _parked(store, effects)
    head = await store.load_head(ThreadId("t"))
    store.loads = 0
    done = await runner.engine().resume(_approval(head), head)
    assert isinstance(done.run_state, EndedState)
    assert store.loads >= 1  # the head has no messages: the engine read the whole thread
    assert isinstance(done.messages[0], UserMessage) and done.messages[0].text == "go"


async def test_a_recovery_handed_its_loaded_frontier_reads_no_more() -> None:
    store, effects = CountingStore(), list[str]()
    runner, _ = await _parked(store, effects)
    await runner.resume(_approval(await store.load(ThreadId("t"))))
    ended = await store.load(ThreadId("t"))
    store.loads = 0
    again = await runner.engine().recover(ThreadId("t"), ended)
    assert again.version == ended.version and store.loads == 0  # at rest: returned as is
