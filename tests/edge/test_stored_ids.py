"""Ids that name what a store holds are held to what a store holds (``STORED_IDS``),
not to the system's ``id_chars`` (no Ray: the service over an in-memory store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx2

from actors.wire import SystemSpec
from edge.app import create_app
from edge.options import ServeOptions
from runtime import Agent, InProcessRunner, Limits, ModelResponse, ScriptedModel
from runtime.limits import STORED_ID_CHARS
from storage.memory import MemoryCommitStore


@dataclass
class _Client:
    store: Any
    spec: SystemSpec
    hosts: tuple[Any, ...] = field(default=())


async def test_threads_a_system_wrote_are_read_and_listed_whatever_its_id_chars_is_now():
    """A system with a raised ``id_chars`` made threads of 300-character ids: the page
    after one (its cursor, the thread's id) was refused by the schema's bound (the
    default ``id_chars``), so ``GET /runs`` could not page past it. Restarted with a
    lowered ``id_chars``, the service refused to read its threads at all (422)."""
    store = MemoryCommitStore()
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="hi")] * 3))
    wide = InProcessRunner(agent, store, limits=Limits(id_chars=1024, tool_calls=16))
    threads = [c * 300 for c in "abc"]
    for thread in threads:
        await wide.start("go", thread_id=thread, run_id=f"run-{thread}")
    for id_chars in (1024, 64):
        limits = Limits(id_chars=id_chars, tool_calls=16)
        spec = SystemSpec(name="ids", store_url="memory://", limits=limits)
        app = create_app(_Client(store, spec), ServeOptions(no_auth=True))  # type: ignore[arg-type]
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            seen, cursor = [], None
            while True:
                params = {"limit": 1} | ({"cursor": cursor} if cursor else {})
                page = await http.get("/runs", params=params)
                assert page.status_code == 200, page.text
                seen += [r["thread_id"] for r in page.json()["runs"]]
                cursor = page.json()["next_cursor"]
                if cursor is None:
                    break
            assert seen == threads
            read = await http.get(f"/threads/{quote(threads[0], safe='')}")
            assert read.status_code == 200 and read.json()["thread_id"] == threads[0]
            too_long = await http.get(f"/threads/{'x' * (STORED_ID_CHARS + 1)}")
            assert too_long.status_code == 422 and too_long.json()["limit"] == "id_chars"


def _service(limits: Limits) -> httpx2.AsyncClient:
    """The service of a system of ``limits`` over an empty in-memory store (no cluster:
    a request that reached a host would fail)."""
    from cluster.client import Ratchet

    spec = SystemSpec(name="ids", store_url="memory://", limits=limits)
    app = create_app(Ratchet(spec, MemoryCommitStore(), []), ServeOptions(no_auth=True))
    transport = httpx2.ASGITransport(app=app)
    return httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1")


def _refused_id_chars(answer: Any) -> bool:
    body = answer.json()
    return answer.status_code == 422 and (body["kind"], body["limit"]) == (
        "InputRefused",
        "id_chars",
    )


async def test_body_ids_are_held_to_the_running_systems_id_chars_not_the_defaults():
    """The schemas bound ``run_id`` and ``request_id`` by the default ``id_chars`` (256):
    a system connected with a raised one refused a 300-character id its client takes
    (422 ValidationError), and the routes' own check by the system's limits was never
    reached. Now the system's limits decide: taken where they allow it, a typed 422
    ``InputRefused(id_chars)`` where they do not."""
    long_id = "q" * 300
    resume = {"payload": {"kind": "pause"}, "request_id": long_id}
    start = {"agent": "cluster.demo_agent:agent", "input": "hi", "run_id": long_id}
    async with _service(Limits(id_chars=1024, tool_calls=16)) as http:
        answer = await http.post("/threads/nobody/resume", json=resume)
        # the body is taken: what is missing is the thread
        assert answer.status_code == 404 and answer.json()["kind"] == "ThreadNotFound", answer.text
    async with _service(Limits()) as http:
        answer = await http.post("/threads/nobody/resume", json=resume)
        assert _refused_id_chars(answer), answer.text
        answer = await http.post("/threads/t/runs", json=start)  # refused before any host
        assert _refused_id_chars(answer), answer.text
