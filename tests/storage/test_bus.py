"""The live bus, embedded and on Redis Streams: order, reconnect by offset, cap, fan-out."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit, urlunsplit

import pytest

from runtime import Agent, InProcessRunner, ModelDelta, ModelResponse, ScriptedModel
from runtime.errors import StoreUnavailable
from runtime.events import Delta, Fact
from runtime.ids import RunId, ThreadId
from runtime.rules import stamp_facts
from storage.bus import BusEvent, EmbeddedBus, RedisStreamBus
from storage.memory import MemoryCommitStore

DEADLINE_S = 5.0
TEST_DB = 11
"""The bus tests' own Redis database; keys carry a per-test prefix as well."""

Bus = EmbeddedBus | RedisStreamBus
MakeBus = Callable[..., Bus]


def db_url(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


@pytest.fixture(params=["embedded", "redis"])
async def make_bus(request: pytest.FixtureRequest) -> AsyncIterator[MakeBus]:
    """A factory of buses of one kind (capacity as a keyword)."""
    made: list[Bus] = []
    prefix = f"bus-test-{uuid.uuid4().hex[:8]}"
    url = db_url(request.getfixturevalue("redis_url"), TEST_DB) if request.param == "redis" else ""

    def make(**options: int) -> Bus:
        bus: Bus = (
            EmbeddedBus(**options)
            if request.param == "embedded"
            else RedisStreamBus.connect(url, prefix=prefix, block_ms=200, **options)
        )
        made.append(bus)
        return bus

    yield make
    for bus in made:
        if isinstance(bus, RedisStreamBus):
            keys = [k async for k in bus.client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await bus.client.delete(*keys)
        await bus.close()


def events(n: int, start: int = 0) -> list[Fact | Delta]:
    """Alternating facts and deltas, each distinguishable by its number."""
    run = RunId("run-1")
    return [
        Fact(type="status", run_id=run, data={"n": i}, seq=i, index=0)
        if i % 2 == 0
        else Delta(type="text_delta", run_id=run, step=0, attempt=1, text=f"word {i}")
        for i in range(start, start + n)
    ]


def order(offset: str) -> tuple[int, ...]:
    """Offsets of both buses compare as tuples of integers ("17", "1700-3")."""
    return tuple(int(part) for part in offset.split("-"))


async def take(stream: AsyncIterator[BusEvent], n: int) -> list[BusEvent]:
    got: list[BusEvent] = []
    async with asyncio.timeout(DEADLINE_S):
        async for item in stream:
            got.append(item)
            if len(got) == n:
                break
    return got


async def take_until(stream: AsyncIterator[BusEvent], last: Fact | Delta) -> list[BusEvent]:
    """Everything up to and including ``last``: a sentinel instead of waiting for silence."""
    got: list[BusEvent] = []
    async with asyncio.timeout(DEADLINE_S):
        async for item in stream:
            got.append(item)
            if item.event == last:
                break
    return got


async def test_subscriber_sees_published_batches_in_order(make_bus: MakeBus) -> None:
    bus, thread = make_bus(), ThreadId("t-order")
    stream = bus.subscribe(thread, after=await bus.head(thread))
    reader = asyncio.create_task(take(stream, 30))
    sent = events(30)
    for i in range(0, 30, 10):
        await bus.publish(thread, sent[i : i + 10])
    got = await reader
    assert [g.event for g in got] == sent
    offsets = [order(g.offset) for g in got]
    assert offsets == sorted(offsets) and len(set(offsets)) == 30


async def test_reconnect_from_an_offset_loses_nothing_and_duplicates_nothing(
    make_bus: MakeBus,
) -> None:
    bus, thread = make_bus(), ThreadId("t-reconnect")
    start = await bus.head(thread)
    sent = events(16)
    await bus.publish(thread, sent[:10])
    first = bus.subscribe(thread, after=start)
    seen = await take(first, 4)
    await first.aclose()  # the client disconnects after four events
    await bus.publish(thread, sent[10:])
    rest = await take_until(bus.subscribe(thread, after=seen[-1].offset), sent[-1])
    assert [g.event for g in seen + rest] == sent


async def test_a_subscriber_from_none_gets_only_later_events(make_bus: MakeBus) -> None:
    bus, thread = make_bus(), ThreadId("t-new")
    await bus.publish(thread, events(3))
    stream = bus.subscribe(thread, after=await bus.head(thread))
    later = events(2, start=100)
    await bus.publish(thread, later)
    assert [g.event for g in await take(stream, 2)] == later


async def test_the_cap_bounds_what_a_thread_retains(make_bus: MakeBus) -> None:
    bus, thread = make_bus(capacity=10), ThreadId("t-cap")
    start = await bus.head(thread)
    sent = events(500)
    for i in range(0, 500, 50):
        await bus.publish(thread, sent[i : i + 50])
    retained = [g.event for g in await take_until(bus.subscribe(thread, after=start), sent[-1])]
    # Redis trims whole stream nodes (MAXLEN ~, 100 entries a node); the ring is exact.
    slack = 0 if isinstance(bus, EmbeddedBus) else 100
    assert 10 <= len(retained) <= 10 + slack
    assert retained == sent[-len(retained) :]


async def test_two_subscribers_each_get_every_event(make_bus: MakeBus) -> None:
    bus, thread = make_bus(), ThreadId("t-fanout")
    start = await bus.head(thread)
    readers = [asyncio.create_task(take(bus.subscribe(thread, after=start), 12)) for _ in "ab"]
    sent = events(12)
    await bus.publish(thread, sent[:5])
    await bus.publish(thread, sent[5:])
    first, second = await asyncio.gather(*readers)
    assert [g.event for g in first] == [g.event for g in second] == sent
    assert [g.offset for g in first] == [g.offset for g in second]


async def test_threads_do_not_see_each_other(make_bus: MakeBus) -> None:
    bus = make_bus()
    a, b = ThreadId("t-a"), ThreadId("t-b")
    start = await bus.head(a)
    await bus.publish(b, events(3))
    await bus.publish(a, events(2, start=50))
    assert [g.event for g in await take(bus.subscribe(a, after=start), 2)] == events(2, 50)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_redis_publish_failure_is_store_unavailable_without_the_password() -> None:
    bus = RedisStreamBus.connect(f"redis://user:s3cret@127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailable) as caught:
        await bus.publish(ThreadId("t"), events(1))
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)
    await bus.close()


async def test_embedded_offsets_must_be_numbers() -> None:
    with pytest.raises(ValueError, match="decimal"):
        EmbeddedBus().subscribe(ThreadId("t"), after="1700-0")


async def test_a_run_publishes_its_stamped_facts_and_live_deltas(make_bus: MakeBus) -> None:
    bus, thread, store = make_bus(), ThreadId("t-run"), MemoryCommitStore()
    stream = bus.subscribe(thread, after=await bus.head(thread))
    model = ScriptedModel([ModelResponse(text="hello live world")])
    await InProcessRunner(Agent(name="a", model=model), store, bus=bus).start(
        "hi", thread_id=thread
    )
    committed = [f for r in await store.read(thread) for f in stamp_facts(r.commit, r.seq)]
    got = [g.event for g in await take_until(stream, committed[-1])]
    assert [e for e in got if isinstance(e, Fact)] == committed
    assert "".join(e.text for e in got if isinstance(e, Delta)) == "hello live world"


class CutEmoji:
    """A model whose gateway cuts an emoji between two chunks, each JSON-escaped alone."""

    async def stream(self, request: object) -> AsyncIterator[ModelDelta | ModelResponse]:
        yield ModelDelta(text="smile \ud83d")
        yield ModelDelta(text="\ude00!")
        yield ModelResponse(text="smile \U0001f600!")


async def test_an_emoji_cut_between_two_chunks_goes_live_whole(make_bus: MakeBus) -> None:
    """The Redis bus cannot encode half a character, and dropped the first delta: the
    live text lost its "smile ". The engine now holds the half for the next chunk."""
    bus, thread, store = make_bus(), ThreadId("t-cut"), MemoryCommitStore()
    stream = bus.subscribe(thread, after=await bus.head(thread))
    await InProcessRunner(Agent(name="a", model=CutEmoji()), store, bus=bus).start(
        "hi", thread_id=thread
    )
    committed = [f for r in await store.read(thread) for f in stamp_facts(r.commit, r.seq)]
    got = [g.event for g in await take_until(stream, committed[-1])]
    assert [e.text for e in got if isinstance(e, Delta)] == ["smile ", "\U0001f600!"]


async def test_the_embedded_bus_forgets_idle_threads_beyond_its_limit() -> None:
    bus, followed = EmbeddedBus(max_threads=2), ThreadId("t-followed")
    follower = bus.subscribe(followed, after="0")
    await bus.publish(followed, events(1))
    assert [g.event for g in await take(follower, 1)] == events(1)  # now it is followed
    for name in ("t-1", "t-2", "t-3"):
        await bus.publish(ThreadId(name), events(1, start=10))
    await bus.publish(followed, events(1, start=20))
    assert [g.event for g in await take(follower, 1)] == events(1, start=20)
    sentinel = events(1, start=30)
    await bus.publish(ThreadId("t-1"), sentinel)
    # t-1's first event went with its evicted ring; offsets kept growing regardless.
    assert [g.event for g in await take(bus.subscribe(ThreadId("t-1"), after="0"), 1)] == sentinel


async def test_closing_the_embedded_bus_ends_its_subscriptions() -> None:
    bus, thread = EmbeddedBus(), ThreadId("t-close")
    stream = bus.subscribe(thread, after=await bus.head(thread))
    await bus.publish(thread, events(1))
    assert len(await take(stream, 1)) == 1
    reader = asyncio.create_task(take(stream, 5))
    await bus.close()
    assert await reader == []


async def test_an_event_no_json_holds_is_left_out_alone_not_its_batch(make_bus: MakeBus) -> None:
    """A delta holding half a surrogate pair (a gateway that splits an emoji across
    chunks): the Redis bus cannot encode it; the facts published with it still go out."""
    bus, thread = make_bus(), ThreadId("t-half-pair")
    stream = bus.subscribe(thread, after=await bus.head(thread))
    run = RunId("run-1")
    half = Delta(type="text_delta", run_id=run, step=0, attempt=1, text="smile \ud83d")
    fact = Fact(type="status", run_id=run, data={"n": 1}, seq=1, index=0)
    reader = asyncio.create_task(take_until(stream, fact))
    await bus.publish(thread, [half, fact])
    got = [g.event for g in await reader]
    assert got[-1] == fact and got in ([half, fact], [fact])  # the embedded bus keeps both


async def test_an_entry_written_by_hand_past_the_bound_is_skipped(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who can write to Redis can add a 20 MB "delta": every follower of the
    thread was sent it whole, as one frame."""
    from storage.bus import MAX_ENTRY_CHARS

    prefix = f"bus-test-{uuid.uuid4().hex[:8]}"
    bus = RedisStreamBus.connect(db_url(redis_url, TEST_DB), prefix=prefix, block_ms=200)
    stream = bus.subscribe(ThreadId("t"), "0-0")
    huge = Delta(
        type="text_delta", run_id=RunId("r"), step=0, attempt=1, text="x" * MAX_ENTRY_CHARS
    )
    await bus.client.xadd(bus.key("t"), {"e": huge.model_dump_json()})
    (after,) = events(1, start=1)
    await bus.publish(ThreadId("t"), [after])
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.bus"):
        assert [e.event for e in await take(stream, 1)] == [after]
    assert "skipping bus entry" in caplog.text
    await bus.client.delete(bus.key("t"))
    await bus.close()
