"""The edge against hostile callers, over real sockets (no Ray: ``memory_server``)."""

from __future__ import annotations

import asyncio

import httpx2

from edge.options import ServeOptions
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
