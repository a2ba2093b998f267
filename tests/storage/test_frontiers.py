"""The frontier cache of the SQL store: it may only ever save work, never change an answer."""

from __future__ import annotations

import json

import pytest

from runtime.commit import Frontier, frontier_text, head_only
from runtime.errors import CorruptRecord
from runtime.ids import ThreadId
from runtime.integrity import frontier_checksum
from runtime.rules import advance, replay, with_claim
from storage.frontiers import FrontierCache, decode_frontier, decode_head
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


def test_encoding_folds_decodes_to_each_frontier_head() -> None:
    cache = FrontierCache()
    for frontier in _folds(8):
        text, checksum = cache.encode(T, frontier)
        head = head_only(frontier)
        assert checksum == frontier_checksum(text)
        assert json.loads(text) == json.loads(head.model_dump_json(exclude={"messages"}))
        assert decode_frontier(T, text, frontier.version) == head
        assert head.message_count == len(frontier.messages)
        assert cache.decode(T, text, frontier.version, checksum) == head


def test_the_stored_text_does_not_grow_with_the_history() -> None:
    """A head's text is the same size whatever the messages before it (issue 20)."""
    short, long = _folds(3)[-1], _folds(300)[-1]
    assert len(frontier_text(long)) - len(frontier_text(short)) < 10  # the counts' digits


def test_a_frontier_stored_with_its_messages_still_decodes() -> None:
    """Schema 2 frontiers hold the history; they decode whole, and their head is kept."""
    frontier = _folds(4)[-1]
    old = frontier.model_dump_json(exclude={"message_count"})
    decoded = decode_frontier(T, old, frontier.version)
    assert decoded.messages == frontier.messages
    assert decoded.message_count == len(frontier.messages)
    assert decode_head(T, old, frontier.version) == head_only(frontier)


def _sum(text: str) -> str:
    return frontier_checksum(text)


def test_text_written_elsewhere_is_decoded_not_trusted() -> None:
    cache = FrontierCache()
    ours, theirs = (head_only(f) for f in _folds(3)[1:3])
    cache.encode(T, ours)
    other = frontier_text(theirs)  # the same thread, advanced by another process
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
    frontier = head_only(_folds(3)[-1])
    text, checksum = cache.encode(T, frontier)
    flipped = text.replace('"message_count":3', '"message_count":4')
    assert flipped != text
    for edited, summed in ((flipped, checksum), (text, "0" * 64), (text, None)):
        with pytest.raises(CorruptRecord, match="checksum"):
            cache.decode(T, edited, frontier.version, summed)
    assert cache.decode(T, text, frontier.version, checksum) is frontier


def _ended(thread: ThreadId) -> Frontier:
    first = activation(thread, "run-1")
    return replay(thread, [first, ended(thread, "run-1", 1, prev=first.payload_hash)])


def test_ended_runs_are_dropped_and_the_cache_stays_bounded() -> None:
    cache = FrontierCache(entries=3)
    cache.encode(T, _ended(T))
    assert len(cache) == 0 and cache.known(T) is None
    for i in range(5):
        cache.encode(ThreadId(f"t-{i}"), Frontier(thread_id=ThreadId(f"t-{i}")))
    assert len(cache) == 3
    by_size = FrontierCache(chars=400)
    for i in range(5):
        by_size.encode(ThreadId(f"t-{i}"), Frontier(thread_id=ThreadId(f"t-{i}")))
    assert 0 < len(by_size) < 5


def test_a_thread_at_rest_is_kept_as_read_apart_and_bounded() -> None:
    """A resting thread read is about to be acted on (its next Run): known, so its next
    commit can be planned; at most ``resting`` of them, never evicting active threads."""
    cache = FrontierCache(entries=2, resting=2)
    active = [ThreadId(f"t-active-{i}") for i in range(2)]
    for thread in active:
        cache.encode(thread, Frontier(thread_id=thread))
    rested = [ThreadId(f"t-rest-{i}") for i in range(3)]
    for thread in rested:
        text, checksum = FrontierCache().encode(thread, _ended(thread))  # written elsewhere
        head = cache.decode(thread, text, 2, checksum)
        assert head.ended and cache.known(thread) == head
    assert [cache.known(t) is not None for t in rested] == [False, True, True]
    assert all(cache.known(t) is not None for t in active)
    assert len(cache) == 4
    # its next commit, written here, moves it among the active (evicting the oldest)
    moved = head_only(Frontier(thread_id=rested[2], version=3))
    cache.encode(rested[2], moved)
    assert cache.known(rested[2]) == moved and len(cache) == 3
    assert cache.known(active[0]) is None


def test_text_bounds_evict_resting_threads_first() -> None:
    thread = ThreadId("t-rest")
    text, checksum = FrontierCache().encode(thread, _ended(thread))
    cache = FrontierCache(chars=len(text) + 2 * len(frontier_text(Frontier(thread_id=T))))
    cache.decode(thread, text, 2, checksum)
    for i in range(2):
        cache.encode(ThreadId(f"t-{i}"), Frontier(thread_id=ThreadId(f"t-{i}")))
    assert cache.known(thread) is not None
    cache.encode(ThreadId("t-2"), Frontier(thread_id=ThreadId("t-2")))
    assert cache.known(thread) is None
    assert all(cache.known(ThreadId(f"t-{i}")) is not None for i in range(3))
