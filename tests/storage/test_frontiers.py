"""The frontier cache of the SQL store: it may only ever save work, never change an answer."""

from __future__ import annotations

import json

import pytest

from runtime.commit import Frontier, advance, replay, with_claim
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import frontier_checksum
from storage.frontiers import FrontierCache, decode_frontier
from tests.storage.builders import activation, ended, step

T = ThreadId("t-cache")


def _folds(n: int) -> list[Frontier]:
    """The frontiers of one Run, commit after commit (a claim first)."""
    frontiers = [with_claim(Frontier(thread_id=T), "owner")]
    frontiers.append(advance(frontiers[-1], activation(T, "run-1")))
    for i in range(1, n):
        prev = frontiers[-1].head
        frontiers.append(advance(frontiers[-1], step(T, "run-1", i, f"step {i}", prev=prev)))
    return frontiers


def test_encoding_folds_decodes_to_each_frontier() -> None:
    cache = FrontierCache()
    for frontier in _folds(8):
        text, checksum = cache.encode(T, frontier)  # all but the first reuse the messages
        assert checksum == frontier_checksum(text)
        assert json.loads(text) == json.loads(frontier.model_dump_json())
        assert decode_frontier(T, text, frontier.version) == frontier
        assert cache.decode(T, text, frontier.version, checksum) is frontier


def _sum(text: str) -> str:
    return frontier_checksum(text)


def test_text_written_elsewhere_is_decoded_not_trusted() -> None:
    cache = FrontierCache()
    ours, theirs = _folds(3)[1:3]
    cache.encode(T, ours)
    other = theirs.model_dump_json()  # the same thread, advanced by another process
    decoded = cache.decode(T, other, theirs.version, _sum(other))
    assert decoded == theirs and decoded is not theirs
    stale = ours.model_dump_json()  # equal meaning, other text: decoded all the same
    assert cache.decode(T, stale, ours.version, _sum(stale)) == ours
    bad = other.replace('"version":2', '"version":"two"')
    with pytest.raises(CorruptRecord):
        cache.decode(T, bad, theirs.version, _sum(bad))
    with pytest.raises(CorruptRecord):  # the text matches, the row's version does not
        cache.decode(T, other, theirs.version + 1, _sum(other))


def test_text_that_does_not_match_its_checksum_is_corrupt_cached_or_not() -> None:
    cache = FrontierCache()
    frontier = _folds(3)[-1]
    text, checksum = cache.encode(T, frontier)
    flipped = text.replace("step 1", "step 9")
    for edited, summed in ((flipped, checksum), (text, "0" * 64), (text, None)):
        with pytest.raises(CorruptRecord, match="checksum"):
            cache.decode(T, edited, frontier.version, summed)
    assert cache.decode(T, text, frontier.version, checksum) is frontier


def test_messages_that_are_not_a_prefix_are_encoded_whole() -> None:
    cache = FrontierCache()
    first = _folds(4)[-1]
    cache.encode(T, first)
    rewritten = first.model_copy(update={"messages": first.messages[1:]})
    text, _ = cache.encode(T, rewritten)
    assert decode_frontier(T, text, rewritten.version) == rewritten


def test_ended_runs_are_dropped_and_the_cache_stays_bounded() -> None:
    first = activation(T, "run-1")
    done = replay(T, [first, ended(T, "run-1", 1, prev=first.payload_hash)])
    cache = FrontierCache(entries=3)
    cache.encode(T, done)
    assert len(cache) == 0
    for i in range(5):
        cache.encode(ThreadId(f"t-{i}"), Frontier(thread_id=ThreadId(f"t-{i}")))
    assert len(cache) == 3
    by_size = FrontierCache(chars=400)
    for i in range(5):
        by_size.encode(ThreadId(f"t-{i}"), Frontier(thread_id=ThreadId(f"t-{i}")))
    assert 0 < len(by_size) < 5
