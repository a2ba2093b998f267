"""The edge against hostile callers, over real sockets (no Ray: ``memory_server``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx2

from edge.options import ServeOptions
from edge.timely import TimelyH11
from tests.support.servers import wait_until

from .memory_server import served


async def test_a_burst_of_streams_opens_no_more_than_the_server_takes() -> None:
    """The slot was checked before the store was asked whether the thread exists and
    counted only once the response was read: 40 requests at once all passed the check
    of a server that takes 2, and all 40 streams stayed open."""
    options = ServeOptions(no_auth=True, max_streams=2)
    with served(options, load_delay_s=0.05) as server:
        limits = httpx2.Limits(max_connections=50)
        async with httpx2.AsyncClient(base_url=server.url, timeout=30, limits=limits) as http:

            async def follow() -> httpx2.Response:
                request = http.build_request("GET", "/threads/t1/stream")
                return await http.send(request, stream=True)

            answers = await asyncio.gather(*(follow() for _ in range(40)))
            try:
                codes = sorted(a.status_code for a in answers)
                assert codes == [200] * 2 + [503] * 38, codes
                assert server.app.state.streams.open == 2
            finally:
                for answer in answers:
                    await answer.aclose()
            # closed by their clients, their slots are free again
            wait_until(lambda: server.app.state.streams.open == 0, "the streams' slots back")
            refused = await http.get("/threads/nothing/stream")  # refused before it started
            assert refused.status_code == 404
            assert server.app.state.streams.open == 0
            ended = await http.get("/threads/t1/stream", params={"until_rest": "true"})
            assert ended.status_code == 200 and "run_finished" in ended.text
            wait_until(lambda: server.app.state.streams.open == 0, "the ended stream's slot")


class _Quick(TimelyH11):
    head_s = 1.0


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (what it sends is read and
    dropped); a byte is sent every 0.2 s meanwhile, as a slow caller would."""
    deadline = time.monotonic() + within_s
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            with contextlib.suppress(OSError):
                sock.sendall(b"a")
        except OSError:  # reset: closed too
            return True
    return False


def test_a_caller_that_sends_no_request_in_time_is_disconnected() -> None:
    """A new connection had no deadline, and uvicorn's keep-alive one ended at the next
    byte: with no token, a caller held a socket for good by sending nothing, a head a
    byte at a time, or a body after its 401, until the server ran out of descriptors."""
    with served(ServeOptions(tokens=("secret",)), http=_Quick) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        head = socket.create_connection(("127.0.0.1", server.port))
        head.sendall(b"GET /runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        refused = socket.create_connection(("127.0.0.1", server.port))
        refused.sendall(
            b"POST /threads/t1/stop HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n{"
        )
        body = b'{"reason": "late"}'
        answered = socket.create_connection(("127.0.0.1", server.port))  # passed the guard
        answered.sendall(
            b"POST /threads/t1/stop HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer secret\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5])
        )
        started = time.monotonic()
        for sock in (idle, head, refused):
            assert _closed_by_server(sock, within_s=10)
            sock.close()
        assert time.monotonic() - started > _Quick.head_s
        answered.sendall(body[5:])  # the rest, after its head's deadline: still answered
        answered.settimeout(10)
        assert answered.recv(65536).startswith(b"HTTP/1.1 200 "), "the request was cut"
        answered.close()


class _QuickBody(TimelyH11):
    body_s = 1.0


def test_a_body_that_does_not_arrive_in_time_is_cut() -> None:
    """Once a request's head was in, nothing bounded its body: a caller with a token
    sent one a byte at a time (or not at all) and held the socket, and the request's
    task waiting for it, for good. A body sent whole in time is still answered."""
    with served(ServeOptions(tokens=("secret",)), http=_QuickBody) as server:
        head = (
            b"POST /threads/t1/stop HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer secret\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"  # within the cap: the app waits for it
        )
        trickle = socket.create_connection(("127.0.0.1", server.port))
        trickle.sendall(head)
        started = time.monotonic()
        assert _closed_by_server(trickle, within_s=10)
        trickle.close()
        assert time.monotonic() - started > _QuickBody.body_s * 0.9
        body = b'{"reason": "in time"}'
        whole = socket.create_connection(("127.0.0.1", server.port))
        whole.sendall(
            b"POST /threads/t1/stop HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer secret\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        whole.settimeout(10)
        assert _answer(whole).startswith(b"HTTP/1.1 200 ")
        # kept alive past the first body's deadline: the next request is answered too
        time.sleep(_QuickBody.body_s * 1.5)  # past the first body's deadline, on purpose
        whole.sendall(
            b"POST /threads/t1/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer secret\r\nContent-Length: 0\r\n\r\n"
        )
        assert _answer(whole).startswith(b"HTTP/1.1 200 ")
        whole.close()


def _answer(sock: socket.socket) -> bytes:
    """One whole response read from ``sock`` (its head, and its body by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head
