"""``GET /threads/{t}/commits`` reads its page, not the log (no Ray: the service over an
in-memory store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx2

from actors.wire import SystemSpec
from edge.app import create_app
from edge.options import ServeOptions
from runtime.ids import ThreadId
from storage.memory import MemoryCommitStore
from tests.storage.test_conformance import T, _next, _started


@dataclass
class _Counting:
    """The in-memory store, counting the records each call read and verified."""

    inner: MemoryCommitStore
    records_read: list[int] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, thread: ThreadId) -> Any:
        self.records_read.append(len(await self.inner.read(thread)))  # what a load reads
        return await self.inner.load(thread)

    async def read(self, thread: ThreadId, after_seq: int = 0, limit: int | None = None) -> Any:
        records = await self.inner.read(thread, after_seq, limit)
        self.records_read.append(len(records))
        return records


@dataclass
class _Client:
    store: Any
    spec: SystemSpec = field(default_factory=lambda: SystemSpec(name="p", store_url="memory://"))
    hosts: tuple[Any, ...] = ()


async def test_a_page_of_commits_reads_the_page_not_the_whole_log():
    """A page of one commit read the frontier with its whole history, then the whole log
    after the cursor, verified each, and cut it: every request cost the thread's whole
    length (up to the history limit), whatever ``limit`` it asked for."""
    inner = MemoryCommitStore()
    await _started(inner)
    for i in range(39):
        await _next(inner, T, "run-1", f"step {i}")
    store = _Counting(inner)
    app = create_app(_Client(store), ServeOptions(no_auth=True))  # type: ignore[arg-type]
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        answer = await http.get(f"/threads/{T}/commits", params={"after": 3, "limit": 2})
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert [c["seq"] for c in page["commits"]] == [4, 5] and page["next_after"] == 5
        assert max(store.records_read) <= 3, store.records_read  # the page, one past it
        seqs, after = [], 0
        while after is not None:
            answer = await http.get(f"/threads/{T}/commits", params={"after": after, "limit": 7})
            seqs += [c["seq"] for c in answer.json()["commits"]]
            after = answer.json()["next_after"]
        assert seqs == list(range(1, 41))
        last = await http.get(f"/threads/{T}/commits", params={"after": 40})
        assert last.json() == {"thread_id": T, "commits": [], "next_after": None}
        missing = await http.get("/threads/nobody/commits")
        assert missing.status_code == 404 and missing.json()["kind"] == "ThreadNotFound"
