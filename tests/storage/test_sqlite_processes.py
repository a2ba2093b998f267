"""Several processes writing one SQLite file at once: every commit lands exactly once.

Each process has its own store (its own writer thread, frontier cache and file
lock), as each RunHost will. They append to threads of their own and race for one
shared thread, so each must see the rows the other wrote (its cached frontiers go
stale) and refuse, then retry, the appends the other won.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path
from typing import Any

from runtime.errors import DuplicateOperation, VersionConflict
from runtime.ids import ThreadId
from runtime.rules import replay
from storage.sql import SqlCommitStore
from tests.storage.builders import activation, step

OWN_THREADS = 8
STEPS = 15
SHARED = ThreadId("shared")
SHARED_RUN = "run-shared"
PROCESSES = ("a", "b")


def _process(url: str, name: str, start: Any) -> None:
    asyncio.run(_write(url, name, start))


async def _write(url: str, name: str, start: Any) -> None:
    store = await SqlCommitStore.connect(url)
    try:
        start.wait(30)  # both connected: from here on they overlap
        own = [_own(store, ThreadId(f"{name}-{i}")) for i in range(OWN_THREADS)]
        await asyncio.gather(*own, _race(store, name))
    finally:
        await store.close()


async def _own(store: SqlCommitStore, thread: ThreadId) -> None:
    first = activation(thread, f"run-{thread}", epoch=1, claim="owner")
    receipt = await store.append(first, 0, 0, claim="owner")
    for i in range(1, STEPS + 1):
        commit = step(thread, f"run-{thread}", i, prev=receipt.payload_hash, epoch=1)
        receipt = await store.append(commit, i, 1)


async def _race(store: SqlCommitStore, name: str) -> None:
    """Append STEPS commits to the shared thread, retrying each one the other process won."""
    for k in range(STEPS):
        while True:
            frontier = await store.load(SHARED)
            commit = step(
                SHARED,
                SHARED_RUN,
                frontier.next_ordinal,
                f"{name}-{k}",
                prev=frontier.head,
                epoch=frontier.epoch,
            )
            try:
                await store.append(commit, frontier.version, frontier.epoch)
                break
            except (VersionConflict, DuplicateOperation):
                continue


async def _prepare(url: str) -> None:
    store = await SqlCommitStore.connect(url)
    try:
        shared = activation(SHARED, SHARED_RUN, epoch=1, claim="everyone")
        await store.append(shared, 0, 0, claim="everyone")
    finally:
        await store.close()


async def _check(url: str) -> None:
    store = await SqlCommitStore.connect(url)
    try:
        for name in PROCESSES:
            for i in range(OWN_THREADS):
                thread = ThreadId(f"{name}-{i}")
                records = await store.read(thread)
                assert [r.seq for r in records] == list(range(1, STEPS + 2))
                assert (await store.load(thread)).version == STEPS + 1
        records = await store.read(SHARED)
        assert [r.seq for r in records] == list(range(1, 2 * STEPS + 2))
        texts = [m.text for r in records[1:] for m in r.commit.messages]
        assert sorted(texts) == sorted(f"{n}-{k}" for n in PROCESSES for k in range(STEPS))
        frontier = await store.load(SHARED)
        replayed = replay(SHARED, [r.commit for r in records])
        assert frontier.model_dump(exclude={"epoch", "owner"}) == replayed.model_dump(
            exclude={"epoch", "owner"}
        )
    finally:
        await store.close()


def test_processes_share_one_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/shared.db"
    asyncio.run(_prepare(url))
    spawn = multiprocessing.get_context("spawn")  # no fork of a process with threads
    start = spawn.Barrier(len(PROCESSES))
    workers = [spawn.Process(target=_process, args=(url, name, start)) for name in PROCESSES]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=45)
        assert [w.exitcode for w in workers] == [0, 0]
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    asyncio.run(_check(url))
