"""``claim_then_load``: claim_frontier for backends that cannot make it one step."""

from __future__ import annotations

import pytest

from runtime.errors import Fenced, InvalidTransition
from runtime.ids import RunId, ThreadId
from runtime.ports import claim_then_load
from storage.memory import MemoryCommitStore
from tests.storage.builders import activation

T = ThreadId("t")


async def test_a_claim_landing_in_between_is_fenced_not_taken_for_ours() -> None:
    store = MemoryCommitStore()
    claim = store.claim

    async def raced(thread: ThreadId, owner: str) -> int:
        epoch = await claim(thread, owner)
        await claim(thread, "someone-else")  # lands before the claim is read back
        return epoch

    store.claim = raced  # type: ignore[method-assign]
    with pytest.raises(Fenced):
        await claim_then_load(store, T, "me")
    assert (await store.load(T)).owner == "someone-else"


async def test_the_start_rule_is_checked_before_claiming() -> None:
    store = MemoryCommitStore()
    epoch = await store.claim(T, "owner-1")
    await store.append(activation(T, "run-1"), 0, epoch)
    with pytest.raises(InvalidTransition):
        await claim_then_load(store, T, "me", RunId("run-2"))
    assert (await store.load(T)).epoch == epoch
    claimed = await claim_then_load(store, T, "me", RunId("run-1"))
    assert (claimed.epoch, claimed.owner) == (epoch + 1, "me")
