"""``ratchet serve`` end to end: real uvicorn servers, a real HTTP client, Runs on Ray."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from ag_ui.core import Event, EventType
from pydantic import TypeAdapter

from cluster.client import Ratchet
from edge.app import max_body_bytes
from edge.options import ServeOptions
from runtime.limits import DEFAULT_LIMITS
from tests.ray.conftest import ray_session  # noqa: F401  (the session's Ray)
from tests.support.servers import free_port, wait_until

from .server import ServerThread

pytestmark = pytest.mark.ray
TOKEN, OTHER = f"tok-{uuid.uuid4().hex}", f"tok-{uuid.uuid4().hex}"
PERMISSION = "tests.ray.agents:permission_agent"
QUICK = "tests.ray.agents:quick_agent"
ORIGIN = "http://console.example"
APPROVE = {"payload": {"kind": "permission", "approve": True}}
AGUI_EVENTS = TypeAdapter(Event)


@dataclass(frozen=True)
class Service:
    url: str
    open_url: str
    """A server with --no-auth on loopback, without CORS, that starts QUICK only."""
    capped_url: str
    """A server with --no-auth on loopback that takes one stream at a time."""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    store_url = f"sqlite:///{tmp_path_factory.mktemp('edge')}/store.db"
    port, open_port, capped_port = free_port(), free_port(), free_port()
    secured = ServeOptions(tokens=(TOKEN, OTHER), cors_origins=(ORIGIN,))
    capped = ServeOptions(no_auth=True, max_streams=1)
    servers = ServerThread(
        store_url,
        [
            (port, secured, ()),
            (open_port, ServeOptions(no_auth=True), (QUICK,)),
            (capped_port, capped, (QUICK,)),
        ],
    )
    servers.start()
    urls = (f"http://127.0.0.1:{p}" for p in (port, open_port, capped_port))
    yield Service(*urls)
    servers.stop()
    asyncio.run(_shutdown(store_url))


async def _shutdown(store_url: str) -> None:
    client = await Ratchet.connect(store_url=store_url, quiet=True)
    await client.shutdown()


@pytest.fixture
def http(service: Service) -> Iterator[httpx2.Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx2.Client(base_url=service.url, headers=headers, timeout=60) as client:
        yield client


def new_thread() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def start(http: httpx2.Client, agent: str = PERMISSION) -> dict[str, Any]:
    """A Run started and at rest (a permission Run awaits its approval)."""
    body = {"agent": agent, "input": "go"}
    response = http.post(f"/threads/{new_thread()}/runs", params={"wait": 30}, json=body)
    assert response.status_code == 201, response.text
    return response.json()


def problem(response: httpx2.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["x-content-type-options"] == "nosniff"
    body = response.json()
    assert body["status"] == status and body["kind"] == kind
    assert body["type"] == f"urn:ratchet:problem:{kind}"
    assert body["title"] and body["detail"] and body["instance"]
    return body


def log_offsets(http: httpx2.Client, thread: str) -> list[str]:
    commits = http.get(f"/threads/{thread}/commits", params={"limit": 500}).json()["commits"]
    return [f"{c['seq']}:{i}" for c in commits for i in range(len(c["commit"]["events"]))]


async def test_start_is_idempotent_by_run_id(service, http):
    thread, body = new_thread(), {"agent": PERMISSION, "input": "go", "run_id": "run-once"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx2.AsyncClient(base_url=service.url, headers=headers, timeout=60) as client:
        both = await asyncio.gather(
            *(client.post(f"/threads/{thread}/runs", json=body) for _ in range(2))
        )
    assert [r.status_code for r in both] == [201, 201], [r.text for r in both]
    assert {r.json()["run_id"] for r in both} == {"run-once"}
    assert both[0].json()["agent"] == PERMISSION
    commits = http.get(f"/threads/{thread}/commits").json()["commits"]
    assert [c["commit"]["label"] for c in commits].count("activation") == 1
    another = http.post(f"/threads/{thread}/runs", json={**body, "run_id": "run-two"})
    problem(another, 409, "InvalidTransition")


def test_a_start_repeated_after_a_later_run_answers_with_its_own_run(http):
    """A client whose answer was lost asks again after another Run began: it is told of
    its own Run (as its end left the thread), not of the later one."""
    thread, first = new_thread(), {"agent": QUICK, "input": "go", "run_id": "run-first"}
    ended = http.post(f"/threads/{thread}/runs", params={"wait": 30}, json=first).json()
    assert ended["run_state"]["kind"] == "ended"
    later = {"agent": PERMISSION, "input": "again", "run_id": "run-later"}
    awaiting = http.post(f"/threads/{thread}/runs", params={"wait": 30}, json=later)
    assert awaiting.json()["run_state"]["kind"] == "awaiting", awaiting.text
    for wait in (0, 5):
        again = http.post(f"/threads/{thread}/runs", params={"wait": wait}, json=first)
        assert again.status_code == 201, again.text
        assert again.json()["run_id"] == "run-first"
        assert again.json()["run_state"] == ended["run_state"]
        assert again.json()["version"] == ended["version"]
    assert http.get(f"/threads/{thread}").json()["run_id"] == "run-later"


def test_a_resume_that_does_not_fit_is_409_and_the_ticket_stays(http):
    thread = start(http)["thread_id"]
    before = http.get(f"/threads/{thread}").json()
    assert before["run_state"]["kind"] == "awaiting"
    assert before["run_state"]["ticket"]["target"]["wait"] == "permission"
    room = before["history"]  # how close the thread is to failed(history_limit)
    assert room["commits"] == before["version"] and room["commits_limit"] == 50_000
    assert 0 < room["bytes"] < room["bytes_limit"] == 64 * 1024 * 1024
    wrong = {"payload": {"kind": "user_input", "text": "sure, go"}}
    body = problem(http.post(f"/threads/{thread}/resume", json=wrong), 409, "ResumeRejected")
    assert body["axis"] == "payload"
    assert body["detail"] == (
        "resume rejected on payload: expected a permission payload, got user_input"
    )
    assert http.get(f"/threads/{thread}").json() == before  # nothing was committed
    early = {"payload": {"kind": "expired"}}  # a wait with no deadline never expires
    body = problem(http.post(f"/threads/{thread}/resume", json=early), 409, "ResumeRejected")
    assert body["axis"] == "deadline" and "no deadline" in body["detail"]
    assert http.get(f"/threads/{thread}").json() == before
    right = http.post(f"/threads/{thread}/resume", params={"wait": 30}, json=APPROVE)
    assert right.status_code == 200, right.text
    done = right.json()
    assert done["run_state"]["kind"] == "ended"
    assert done["run_state"]["cause"] == {"kind": "natural"}
    assert done["status"]["state"] == "idle"
    again = http.post(f"/threads/{thread}/resume", json=APPROVE)
    assert problem(again, 409, "ResumeRejected")["axis"] == "ticket"


@pytest.mark.parametrize("approve", ["yes", 1, "true", None])
def test_a_permission_that_is_no_boolean_authorises_nothing(http, approve):
    """A decision authorises a tool to run (a payment, say): only true or false is one.
    Validated leniently, "yes" or 1 read as an approval and the tool ran."""
    thread = start(http)["thread_id"]
    before = http.get(f"/threads/{thread}").json()
    loose = {"payload": {"kind": "permission", "approve": approve}}
    problem(http.post(f"/threads/{thread}/resume", json=loose), 422, "ValidationError")
    result = {"payload": {"kind": "external_result", "output": {"content": "x", "is_error": "no"}}}
    problem(http.post(f"/threads/{thread}/resume", json=result), 422, "ValidationError")
    assert http.get(f"/threads/{thread}").json() == before  # the ticket is as it was


def test_a_body_that_repeats_a_key_means_nothing(http):
    """Python keeps a repeated key's last value, other parsers its first: a decision of
    ``"approve": false, "approve": true`` would be a denial to a proxy in front and an
    approval here. It is refused; the ticket stays."""
    headers = {"content-type": "application/json"}
    thread = start(http)["thread_id"]
    before = http.get(f"/threads/{thread}").json()
    twice = b'{"payload": {"kind": "permission", "approve": false, "approve": true}}'
    sent = http.post(f"/threads/{thread}/resume", content=twice, headers=headers)
    refused = problem(sent, 422, "InputRefused")
    assert refused["limit"] == "duplicate_key" and "'approve'" in refused["detail"]
    assert http.get(f"/threads/{thread}").json() == before
    fresh = new_thread()
    start_twice = b'{"agent": "%s", "input": "go", "input": "went"}' % PERMISSION.encode()
    sent = http.post(f"/threads/{fresh}/runs", content=start_twice, headers=headers)
    assert problem(sent, 422, "InputRefused")["limit"] == "duplicate_key"
    assert http.get(f"/threads/{fresh}").status_code == 404


def test_a_resume_asked_again_under_its_request_id_is_its_success(http):
    """The answer to a resume was lost (the client timed out, its connection broke): asked
    again with the same request id once the resume landed, it is 200, not a 409 for a
    ticket that is gone; another id, or the same id with another payload, is the 409."""
    thread = start(http)["thread_id"]
    mine = {**APPROVE, "request_id": "answer-1"}
    first = http.post(f"/threads/{thread}/resume", params={"wait": 30}, json=mine)
    assert first.status_code == 200, first.text
    again = http.post(f"/threads/{thread}/resume", json=mine)
    assert again.status_code == 200, again.text
    assert again.json()["run_state"]["kind"] == "ended"
    other = http.post(f"/threads/{thread}/resume", json={**APPROVE, "request_id": "answer-2"})
    assert problem(other, 409, "ResumeRejected")["axis"] == "ticket"
    denied = {"payload": {"kind": "permission", "approve": False}, "request_id": "answer-1"}
    assert problem(http.post(f"/threads/{thread}/resume", json=denied), 409, "ResumeRejected")
    facts = [c["commit"]["label"] for c in http.get(f"/threads/{thread}/commits").json()["commits"]]
    assert facts.count("resume") == 1


def test_a_resume_asked_again_never_answers_the_run_s_next_ticket(http):
    thread = start(http, "tests.ray.edge_agents:asks_twice_agent")["thread_id"]
    first = http.get(f"/threads/{thread}").json()["run_state"]["ticket"]
    mine = {**APPROVE, "request_id": "answer-1"}
    answered = http.post(f"/threads/{thread}/resume", params={"wait": 30}, json=mine)
    assert answered.status_code == 200, answered.text
    second = answered.json()["run_state"]["ticket"]
    assert second["correlation"] != first["correlation"]
    again = http.post(f"/threads/{thread}/resume", json=mine)
    assert again.status_code == 200, again.text
    assert again.json()["run_state"]["ticket"] == second  # still waiting for its answer


def test_a_server_keeps_as_many_streams_open_as_it_takes(service, http):
    """Each stream holds a socket to its caller and one to the live bus: a caller with a
    token could open them until the server ran out of file descriptors."""
    thread = start(http)["thread_id"]  # awaiting: its stream stays open
    path = f"/threads/{thread}/stream"
    with httpx2.Client(base_url=service.capped_url, timeout=60) as capped:
        with capped.stream("GET", path) as first:
            assert first.status_code == 200
            events = iter(httpx2.EventSource(first))  # kept: dropped, it closes the stream
            assert next(events).event == "thread_status"
            refused = capped.get(path, params={"until_rest": "true"})
            problem(refused, 503, "TooManyStreams")
            assert refused.headers["retry-after"] == "1"

        def taken_again() -> bool:  # once the server has seen the first one go
            return capped.get(path, params={"until_rest": "true"}).status_code == 200

        wait_until(taken_again, "the closed stream's place to be free again")


def test_the_stream_reconnects_with_last_event_id_exactly_once(http):
    thread = start(http)["thread_id"]
    seen: list[httpx2.ServerSentEvent] = []
    with http.stream("GET", f"/threads/{thread}/stream") as response:
        assert response.status_code == 200
        events = iter(httpx2.EventSource(response))
        snapshot = next(events)
        assert snapshot.event == "thread_status" and "offset" not in snapshot.json()
        assert snapshot.json()["status"] == http.get(f"/threads/{thread}").json()["status"]
        assert snapshot.json()["status"]["reason"] == "awaiting_permission"
        for event in events:
            seen.append(event)
            if len(seen) == 3:
                break  # disconnect midway through the log
    assert all(e.id == e.json()["offset"] for e in seen)
    http.post(f"/threads/{thread}/resume", params={"wait": 30}, json=APPROVE)
    last = {"Last-Event-ID": seen[-1].id}
    query = {"until_rest": "true", "after": "1:0"}  # the header wins over ?after=
    with http.stream("GET", f"/threads/{thread}/stream", params=query, headers=last) as response:
        again = list(httpx2.EventSource(response))
    assert again[0].event == "thread_status" and "offset" not in again[0].json()
    assert again[-1].json()["event"]["type"] == "run_finished"
    offsets = [e.json()["offset"] for e in [*seen, *again[1:]]]
    assert offsets == log_offsets(http, thread)  # every fact, in order, once


@pytest.mark.parametrize("asked", ["path", "accept"])
def test_the_agui_stream_of_a_real_run_validates(http, asked):
    thread = start(http)["thread_id"]
    http.post(f"/threads/{thread}/resume", params={"wait": 30}, json=APPROVE)
    path, headers = (
        (f"/threads/{thread}/agui", {})
        if asked == "path"
        else (f"/threads/{thread}/stream", {"Accept": "application/vnd.ag-ui+json"})
    )
    with http.stream("GET", path, params={"until_rest": "true"}, headers=headers) as response:
        sent = list(httpx2.EventSource(response))
    events = [AGUI_EVENTS.validate_json(e.data) for e in sent]
    for event, raw in zip(events, sent, strict=True):
        assert event.model_dump(mode="json", by_alias=True) == json.loads(raw.data)
    types = [e.type for e in events]
    assert types[0] == EventType.RUN_STARTED and types[-1] == EventType.RUN_FINISHED
    assert types.count(EventType.RUN_STARTED) == types.count(EventType.RUN_FINISHED) == 2
    waited = events[types.index(EventType.RUN_FINISHED)]
    call = events[types.index(EventType.TOOL_CALL_START)]
    result = events[types.index(EventType.TOOL_CALL_RESULT)]
    assert waited.outcome.type == "interrupt"
    assert waited.outcome.interrupts[0].tool_call_id == call.tool_call_id == result.tool_call_id
    assert (call.tool_call_name, result.content) == ("drop_table", "dropped users")
    assert events[-1].outcome.type == "success"
    texts = [e.delta for e in events if e.type == EventType.TEXT_MESSAGE_CONTENT]
    assert texts == ["go", "may I?", "as you wished"]
    assert sent[-1].id == log_offsets(http, thread)[-1]


def test_stop_and_cancel(http):
    thread = start(http)["thread_id"]
    blank = problem(
        http.post(f"/threads/{thread}/stop", json={"reason": "  "}), 422, "InputRefused"
    )
    assert blank["limit"] == "empty"
    stopped = http.post(f"/threads/{thread}/stop", json={"reason": "over budget"})
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["outcome"] == "stopped"
    cause = stopped.json()["thread"]["run_state"]["cause"]
    assert cause == {"kind": "stopped", "reason": "over budget"}
    assert http.post(f"/threads/{thread}/cancel").json()["outcome"] == "not_running"
    problem(http.post("/threads/no-such-thread/cancel"), 404, "ThreadNotFound")
    # bad input is refused as such whatever the thread holds (ended here), not 200 or 409
    huge = {"reason": "x" * (DEFAULT_LIMITS.input_bytes + 1)}
    problem(http.post(f"/threads/{thread}/stop", json=huge), 413, "InputRefused")
    text = {"payload": {"kind": "user_input", "text": "x" * (DEFAULT_LIMITS.input_bytes + 1)}}
    problem(http.post(f"/threads/{thread}/resume", json=text), 413, "InputRefused")


def test_every_route_needs_a_token_unless_no_auth_on_loopback(service):
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {TOKEN}x"},
             {"Authorization": f"Basic {TOKEN}"}]  # fmt: skip
    for headers in wrong:
        for method, path in [("GET", "/runs"), ("GET", "/openapi.json"), ("POST", "/"),
                             ("GET", "/no-such-path"), ("POST", "/threads/t/runs")]:  # fmt: skip
            response = httpx2.request(method, service.url + path, headers=headers)
            problem(response, 401, "Unauthorized")
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert TOKEN not in response.text
    other = httpx2.get(f"{service.url}/runs", headers={"Authorization": f"Bearer {OTHER}"})
    assert other.status_code == 200
    assert httpx2.get(f"{service.open_url}/runs").status_code == 200
    problem(httpx2.get(f"{service.open_url}/no-such-path"), 404, "NotFound")
    assert httpx2.get(f"{service.url}/").status_code == 200  # the console's shell: no data
    not_allowed = {"agent": PERMISSION, "input": "x"}
    refused = httpx2.post(f"{service.open_url}/threads/t/runs", json=not_allowed)
    assert "not one this server may start" in problem(refused, 422, "AgentImportError")["detail"]


def test_a_server_with_no_token_answers_no_other_page_and_no_other_name(service):
    """``--no-auth`` binds to loopback, which keeps other machines out but not other web
    pages in a browser here: a page elsewhere could POST a cancel (no body: no preflight),
    and one whose name resolves to 127.0.0.1 (DNS rebinding) reads and writes as if it
    were the server's own page. Only loopback names, and the server's own origin."""
    open_url = service.open_url
    port = open_url.rsplit(":", 1)[1]
    thread = new_thread()  # refused before any thread is looked at
    for origin in ("http://evil.example", "http://localhost:1", "null"):
        sent = httpx2.post(f"{open_url}/threads/{thread}/cancel", headers={"Origin": origin})
        assert "another origin" in problem(sent, 403, "NotLocal")["detail"]
    # the whole header is a name and at most a port: what came before a colon was taken
    # for the name ("localhost:1@evil.example" was "localhost")
    for host in (
        "evil.example",
        f"attacker.test:{port}",
        "127.0.0.1.nip.io",
        "localhost:evil.example",
        f"localhost:{port}@evil.example",
        "[::1]evil.example",
    ):
        sent = httpx2.get(f"{open_url}/runs", headers={"Host": host})
        assert "loopback name" in problem(sent, 403, "NotLocal")["detail"]
    for own in (open_url, f"http://localhost:{port}"):
        headers = {"Origin": own, "Host": own.removeprefix("http://")}
        assert httpx2.get(f"{open_url}/runs", headers=headers).status_code == 200
        sent = httpx2.post(f"{open_url}/threads/{thread}/cancel", headers=headers)
        problem(sent, 404, "ThreadNotFound")  # through the guard: there is no such thread
    ipv6 = httpx2.get(f"{open_url}/runs", headers={"Host": f"[::1]:{port}"})
    assert ipv6.status_code == 200


def test_cors_is_off_unless_an_origin_is_given(service):
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "GET",
             "Access-Control-Request-Headers": "authorization"}  # fmt: skip
    preflight = httpx2.options(f"{service.url}/runs", headers=asked)  # carries no token
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx2.get(f"{service.url}/runs", headers={"Origin": ORIGIN})
    assert denied.status_code == 401  # readable by the console: CORS wraps the guard
    assert denied.headers["access-control-allow-origin"] == ORIGIN
    stranger = httpx2.get(f"{service.url}/runs", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in stranger.headers
    closed = httpx2.get(f"{service.open_url}/runs", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in closed.headers
    problem(closed, 403, "NotLocal")  # a server with no token answers no other origin
    elsewhere = {**asked, "Origin": "http://elsewhere.example"}
    refused = httpx2.options(f"{service.url}/runs", headers=elsewhere)
    assert problem(refused, 400, "CorsRefused")["detail"] == (
        "preflight refused: Disallowed CORS origin"
    )


def test_bad_input_is_a_problem_and_nothing_is_started(http):
    problem(http.get("/threads/no-such-thread"), 404, "ThreadNotFound")
    no_input = http.post("/threads/t/runs", json={"agent": PERMISSION})
    missing = problem(no_input, 422, "ValidationError")
    assert missing["errors"][0]["loc"] == ["body", "input"]
    problem(http.get("/runs", params={"state": "asleep"}), 422, "ValidationError")
    problem(http.get("/threads/t/stream", params={"after": "yesterday"}), 422, "ValidationError")
    bad_agent = {"agent": "no_such_module:agent", "input": "x"}
    problem(http.post("/threads/t/runs", json=bad_agent), 422, "AgentImportError")
    control = http.post("/threads/a%01b/runs", json={"agent": PERMISSION, "input": "x"})
    assert problem(control, 422, "InputRefused")["limit"] == "control_chars"
    quoted = {"agent": PERMISSION, "input": '"' * 70_000}  # 70,000 characters, 140,000 bytes
    assert problem(http.post("/threads/t/runs", json=quoted), 413, "InputRefused")["limit"] == (
        "input_bytes"
    )
    cap = max_body_bytes(DEFAULT_LIMITS)
    declared = http.post("/threads/t/runs", content=b" " * (cap + 1))
    assert problem(declared, 413, "InputRefused")["limit"] == "body_bytes"
    chunks = (b" " * 65_536 for _ in range(cap // 65_536 + 2))  # no Content-Length
    streamed = http.post("/threads/t/runs", content=chunks)
    assert problem(streamed, 413, "InputRefused")["limit"] == "body_bytes"
    problem(http.get("/threads/t"), 404, "ThreadNotFound")  # none of it started a Run


def test_a_thread_id_holding_a_slash_is_one_path_segment(http):
    """A thread id may hold '/' (a delegated child's does): sent percent-encoded, as the
    console sends it, it names that thread, never a route of the thread before the '/'."""
    stem = new_thread()
    # (the permission agent: the paging test below counts the quick agent's Runs)
    stem_run = {"agent": PERMISSION, "input": "I am the stem"}
    assert http.post(f"/threads/{stem}/runs", params={"wait": 30}, json=stem_run).is_success
    slashed = f"{stem}/commits"
    body = {"agent": PERMISSION, "input": "I hold a slash", "run_id": "run-slashed"}
    started = http.post(f"/threads/{quote(slashed, safe='')}/runs", params={"wait": 30}, json=body)
    assert started.status_code == 201, started.text
    assert started.json()["thread_id"] == slashed
    read = http.get(f"/threads/{quote(slashed, safe='')}")
    assert read.status_code == 200 and read.json()["run_id"] == "run-slashed"
    log = http.get(f"/threads/{quote(slashed, safe='')}/commits").json()
    assert log["thread_id"] == slashed
    assert http.get(f"/threads/{stem}").json()["run_id"] != "run-slashed"
    not_utf8 = http.post("/threads/%FF/runs", json={"agent": PERMISSION, "input": "x"})
    assert problem(not_utf8, 422, "InputRefused")["limit"] == "utf8"


def test_every_response_is_served_as_its_type_and_no_path_redirects(http):
    """Nothing a browser may sniff into another type; a path with a slash too many is a
    404, never a redirect built from the request's ``Host``."""
    responses = [http.get("/runs"), http.get("/openapi.json"), http.get("/no-such-path")]
    with http.stream("GET", f"/threads/{start(http)['thread_id']}/stream") as streamed:
        responses.append(streamed)
    for response in responses:
        assert response.headers["x-content-type-options"] == "nosniff", response.url
    evil = {"Host": "evil.example"}
    for path in ("/runs/", "/openapi.json/"):
        slashed = http.get(path, headers=evil)
        assert "location" not in slashed.headers
        problem(slashed, 404, "NotFound")


@pytest.mark.parametrize("path", ["stream", "agui"])
def test_streamed_text_holds_no_character_a_reader_may_take_for_a_line_break(http, path):
    """SSE breaks lines at CR and LF only, but Python's ``splitlines`` (and older
    JavaScript) also at U+0085, U+2028 and U+2029: the stream sends them escaped, and
    the event's JSON reads back as the same text."""
    text = "one\u2028two\u2029three\x85four"
    body = {"agent": PERMISSION, "input": text}
    thread = new_thread()
    assert http.post(f"/threads/{thread}/runs", params={"wait": 30}, json=body).is_success
    query = {"until_rest": "true"}
    with http.stream("GET", f"/threads/{thread}/{path}", params=query) as response:
        raw = response.read().decode()
    assert not {"\x85", "\u2028", "\u2029"} & set(raw)
    events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data:")]
    assert any(text in json.dumps(json.loads(data), ensure_ascii=False) for data in events)


def test_an_unpaired_surrogate_is_input_refused_utf8_in_every_field(http):
    """Escaped in the JSON (``\\ud800``), in fields pydantic checks for length or pattern
    as in those it does not: one error kind, naming the field."""
    thread = start(http)["thread_id"]
    lone = "x\ud800"
    bodies = [
        (f"/threads/{new_thread()}/runs", {"agent": QUICK, "input": lone}),
        (f"/threads/{new_thread()}/runs", {"agent": QUICK, "input": "x", "run_id": lone}),
        (f"/threads/{new_thread()}/runs", {"agent": f"{QUICK}{lone}", "input": "x"}),
        (f"/threads/{thread}/stop", {"reason": lone}),
        (f"/threads/{thread}/resume", {"payload": APPROVE["payload"], "request_id": lone}),
        (f"/threads/{thread}/resume", {"payload": {"kind": "user_input", "text": lone}}),
    ]
    headers = {"content-type": "application/json"}
    for path, body in bodies:
        sent = http.post(path, content=json.dumps(body), headers=headers)  # escaped: ASCII
        refused = problem(sent, 422, "InputRefused")
        assert refused["limit"] == "utf8", (path, body, refused)
    assert http.get(f"/threads/{thread}").json()["run_state"]["kind"] == "awaiting"


def test_bodies_the_parser_cannot_read_are_422_naming_the_rule(http):
    raw = b'{"agent": "%s", "input": "\xff\xfe"}' % QUICK.encode()
    headers = {"content-type": "application/json"}
    not_utf8 = http.post(f"/threads/{new_thread()}/runs", content=raw, headers=headers)
    assert problem(not_utf8, 422, "InputRefused")["limit"] == "utf8"
    deep = b'{"agent": "x", "input": "y", "run_id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    nested = http.post(f"/threads/{new_thread()}/runs", content=deep, headers=headers)
    assert problem(nested, 422, "InputRefused")["limit"] == "json_depth"
    huge = b'{"agent": "x", "input": "y", "run_id": ' + b"1" * 5_000 + b"}"
    long_int = http.post(f"/threads/{new_thread()}/runs", content=huge, headers=headers)
    assert problem(long_int, 422, "InputRefused")["limit"] == "type"  # past 4,300 digits
    ascii_input = {"agent": QUICK, "input": "x" * (DEFAULT_LIMITS.input_bytes + 1)}
    too_long = http.post(f"/threads/{new_thread()}/runs", json=ascii_input)
    assert problem(too_long, 413, "InputRefused")["limit"] == "input_bytes"  # as for "é" * n
    thread = start(http)["thread_id"]
    bad_cursor = http.get(f"/threads/{thread}/stream", params={"after": "\u00b2:0"})
    assert "SEQ:INDEX" in problem(bad_cursor, 422, "ValidationError")["detail"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_another_unicode_encoding_is_refused_as_not_utf8(http, encoding):
    """JSON travels as UTF-8 (RFC 8259); Python's parser also takes UTF-16 and UTF-32 by
    their byte patterns, so such a body started a Run."""
    thread = new_thread()
    body = json.dumps({"agent": QUICK, "input": "café 中"}).encode(encoding)
    headers = {"content-type": "application/json"}
    refused = http.post(f"/threads/{thread}/runs", content=body, headers=headers)
    assert problem(refused, 422, "InputRefused")["limit"] == "utf8"
    problem(http.get(f"/threads/{thread}"), 404, "ThreadNotFound")


def test_a_character_cut_between_two_chunks_of_a_body_is_whole_utf8(http):
    """The UTF-8 check reads a streamed body chunk by chunk: a character cut between two
    chunks is whole once both are in (the permission agent: the paging test below counts
    the quick agent's Runs)."""
    text = json.dumps({"agent": PERMISSION, "input": "café 中"}, ensure_ascii=False).encode()
    cut = text.index("中".encode()) + 1
    chunks = iter([text[:cut], text[cut:]])
    headers = {"content-type": "application/json"}
    thread = new_thread()
    started = http.post(f"/threads/{thread}/runs", content=chunks, headers=headers)
    assert started.status_code == 201, started.text


def test_query_ids_no_run_or_thread_can_have_are_refused(http):
    """A page cursor and a control request's ``run_id`` are ids: one holding a control
    character is 422, not an empty page or a "not_running" that says nothing was wrong."""
    refused = http.get("/runs", params={"cursor": "a\x00b"})
    assert problem(refused, 422, "InputRefused")["limit"] == "control_chars"
    thread = start(http)["thread_id"]
    for path in ("cancel", "stop"):
        body = {"reason": "r"} if path == "stop" else None
        sent = http.post(f"/threads/{thread}/{path}", params={"run_id": "a\x1bb"}, json=body)
        assert problem(sent, 422, "InputRefused")["limit"] == "control_chars"
    assert http.get(f"/threads/{thread}").json()["run_state"]["kind"] == "awaiting"


def test_a_thread_id_no_url_can_name_is_refused(http):
    """``.`` and ``..`` sent percent-encoded reach the service as themselves, but every
    client resolves them as path steps before sending: a thread so named could never be
    read back (``/threads/./commits`` would ask for the thread ``commits``)."""
    for dots in ("%2E", "%2E%2E", ".%2E"):
        started = http.post(f"/threads/{dots}/runs", json={"text": "go"})
        assert problem(started, 422, "InputRefused")["limit"] == "dot_segment"
        assert problem(http.get(f"/threads/{dots}"), 422, "InputRefused")
    assert all(r["thread_id"] not in (".", "..") for r in http.get("/runs").json()["runs"])


def test_a_query_that_repeats_a_key_is_refused(http):
    """The framework keeps a repeated key's last value, a proxy or log in front may read the
    first: ``?run_id=a&run_id=b`` named one Run to one reader and another to the next."""
    thread = start(http)["thread_id"]
    for query in ("run_id=a&run_id=b", "limit=1&cursor=x&limit=2", "run_id=a&run%5Fid=b"):
        path = f"/threads/{thread}/cancel" if "run_id" in query else "/runs"
        sent = http.post(f"{path}?{query}") if "run_id" in query else http.get(f"{path}?{query}")
        assert problem(sent, 422, "InputRefused")["limit"] == "duplicate_key"
    assert http.get(f"/threads/{thread}").json()["run_state"]["kind"] == "awaiting"


def test_a_query_whose_bytes_are_not_utf8_is_refused(http):
    """Turned into U+FFFD by the framework, such a cursor passed for a thread id: an
    empty last page (``next_cursor`` null), or a page from somewhere never asked for."""
    for query in ("cursor=%ED%A0%80", "cursor=%FF", "cursor=s1%FF", "agent=%ED%A0%80", "%FF=1"):
        assert problem(http.get(f"/runs?{query}"), 422, "InputRefused")["limit"] == "utf8"
    assert http.get("/runs?cursor=%C3%A9").status_code == 200  # é, percent-encoded UTF-8


def test_a_body_sent_with_a_stream_request_is_dropped_not_refused_midway(http):
    thread = start(http)["thread_id"]
    chunks = (b"x" * 65_536 for _ in range(40))  # chunked: no Content-Length
    with http.stream(
        "GET", f"/threads/{thread}/stream", params={"until_rest": "true"}, content=chunks
    ) as response:
        assert response.status_code == 200
        events = list(httpx2.EventSource(response))
    assert events[-1].json()["event"]["type"] == "awaiting"


def test_runs_and_commits_are_paged(http):
    thread = start(http, QUICK)["thread_id"]
    pages, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = http.get("/runs", params=params).json()
        pages.append([r["thread_id"] for r in page["runs"]])
        if (cursor := page["next_cursor"]) is None:
            break
    listed = [t for page in pages for t in page]
    assert listed == sorted(set(listed)) and thread in listed
    assert all(len(page) == 2 for page in pages[:-1])
    everything = http.get("/runs", params={"limit": 1000}).json()["runs"]
    assert [r["thread_id"] for r in everything] == listed
    quick = http.get("/runs", params={"state": "ended", "agent": QUICK}).json()["runs"]
    assert [(r["thread_id"], r["agent"]) for r in quick] == [(thread, QUICK)]
    seqs, after = [], 0
    while after is not None:
        page = http.get(f"/threads/{thread}/commits", params={"after": after, "limit": 2}).json()
        seqs += [c["seq"] for c in page["commits"]]
        after = page["next_after"]
    assert seqs == list(range(1, http.get(f"/threads/{thread}").json()["version"] + 1))
    # a cursor past the store's 64-bit integers is bad input, not an outage (a 503)
    huge = {"after": 10**30}
    problem(http.get(f"/threads/{thread}/commits", params=huge), 422, "ValidationError")
    past = {"after": f"{10**20}:0"}
    problem(http.get(f"/threads/{thread}/stream", params=past), 422, "ValidationError")
    # a cursor past the thread's last commit would wait for facts it is never after
    ahead = {"after": f"{seqs[-1] + 5}:0", "until_rest": "true"}
    refused = problem(http.get(f"/threads/{thread}/stream", params=ahead), 422, "ValidationError")
    assert "past the thread's last commit" in refused["detail"]
    at_head = {"after": f"{seqs[-1]}:0", "until_rest": "true"}
    assert http.get(f"/threads/{thread}/stream", params=at_head).is_success


def test_the_openapi_schema_names_every_route_and_its_problems(http):
    spec = http.get("/openapi.json").json()
    routes = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    assert routes == {
        ("POST", "/threads/{thread}/runs"),
        ("GET", "/threads/{thread}"),
        ("GET", "/runs"),
        ("POST", "/threads/{thread}/resume"),
        ("POST", "/threads/{thread}/cancel"),
        ("POST", "/threads/{thread}/stop"),
        ("GET", "/threads/{thread}/commits"),
        ("GET", "/threads/{thread}/stream"),
        ("GET", "/threads/{thread}/agui"),
    }
    as_problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for ops in spec["paths"].values():
        for op in ops.values():
            for status in ("401", "422"):
                assert op["responses"][status]["content"] == as_problem
            assert "HTTPValidationError" not in json.dumps(op)
    schemas = spec["components"]["schemas"]
    assert {"type", "title", "status", "detail", "kind"} <= set(schemas["Problem"]["required"])
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    kinds = schemas["Resume"]["properties"]["payload"]["discriminator"]["mapping"]
    callers = {"permission", "external_result", "scheduled_action", "user_input", "pause"}
    callers.add("expired")  # a wait past its deadline
    assert set(kinds) == callers  # a delegation's outcome is not a caller's to give
