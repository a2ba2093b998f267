"""A model's stream runs in its Run's own task: one that cancels that task (hostile or
buggy code calling ``asyncio.current_task().cancel()``) looked like its host stopping
the drive. The drive ended without settling, the Run stayed running, and each recovery
ran the same model again, for ever. On a host, where nothing but ``Drives.stop``
cancels a drive, it now fails the Run; a drive the host stops still just stops.

No Ray cluster: a ``Drives`` table over the in-memory store, as a RunHost holds one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.drives import Drives, starting
from actors.wire import SystemSpec
from runtime import Agent, ModelResponse
from runtime.ids import RunId, ThreadId
from runtime.lifecycle import EndedState, Failed, RunningState
from runtime.models import InferenceRequest
from storage.memory import MemoryCommitStore
from tests.support.waiting import until


class _SelfCancelling:
    """A model that cancels the task its stream runs in, then goes on as ``how`` says."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def stream(self, request: InferenceRequest) -> AsyncIterator[Any]:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        if self.how == "raises":
            raise ValueError("and then it failed")
        if self.how == "waits":
            await asyncio.sleep(0.01)  # the cancellation lands in the model's own wait
        yield ModelResponse(text="an answer")


def _agent(how: str) -> Agent:
    return Agent(name=f"self-cancelling-{how}", model=_SelfCancelling(how))


answers = _agent("answers")
raises = _agent("raises")
waits = _agent("waits")


class _Hanging:
    """A model that waits until its drive is stopped."""

    async def stream(self, request: InferenceRequest) -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield ModelResponse(text="never")


hanging = Agent(name="hanging", model=_Hanging())


class _Waiting(MemoryCommitStore):
    """The in-memory store, waiting on the loop in each append as a server's store does
    (the memory store's never waits, so a cancellation pending would land only after
    the drive)."""

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        return await super().append(*args, **kwargs)


def _drives(store: MemoryCommitStore) -> Drives:
    spec = SystemSpec(name="own-cancel", store_url="memory://")
    return Drives(spec, store, "host-a:1", None, None, None, None, lambda: None)  # type: ignore[arg-type]


def _start(drives: Drives, ref: str, thread: str) -> Any:
    run = RunId(f"run-{thread}")
    go = starting(ThreadId(thread), "go", run, f"{run}:input", True)
    return drives.spawn(ref, ThreadId(thread), run, go)


@pytest.mark.parametrize("how", ["answers", "raises", "waits"])
async def test_a_model_cancelling_its_runs_task_on_a_host_fails_the_run(how: str) -> None:
    store = _Waiting()
    drive = _start(_drives(store), f"{__name__}:{how}", f"t-{how}")
    done, _ = await asyncio.wait({drive.task}, timeout=30)
    assert done, "the drive did not end"
    assert not drive.task.cancelled()  # it settled the Run, not left it running
    frontier = await store.load(ThreadId(f"t-{how}"))
    assert isinstance(frontier.run_state, EndedState)
    cause = frontier.run_state.cause
    assert isinstance(cause, Failed) and cause.code == "OwnTaskCancelled"
    assert "cancelled the task the Run runs in" in cause.message


async def test_a_drive_the_host_stops_is_stopped_not_failed() -> None:
    store = _Waiting()
    drives = _drives(store)
    thread = ThreadId("t-hanging")
    drive = _start(drives, f"{__name__}:hanging", thread)

    async def running() -> bool:
        return (await store.load(thread)).version > 0

    await until(running, 10, what="the Run's activation")
    await drives.stop(thread, drive, idle=False)
    assert drive.task.cancelled()
    frontier = await store.load(thread)
    assert isinstance(frontier.run_state, RunningState)  # left for its next owner
