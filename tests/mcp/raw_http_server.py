"""``raw_server``'s replies over streamable HTTP, written by hand: each answer is the
JSON body of the POST's response (``application/json``), as a server may choose. Besides
``raw_server``'s tools: ``too_deep`` answers with JSON nested deeper than Python's
``json`` reads, ``gzip_bomb`` with a body of 20 MiB (far past the bound) that gzip
makes 20 KiB on the wire, ``sse_deep`` with an SSE event nested deeper than the SDK
reads, ``other_id`` with an answer whose id is not the request's, ``no_answer`` with a
notification in place of an answer, and ``endless`` with a body of 64 MiB (as good as
endless) written a MiB at a time. Run as ``raw_http_server.py PORT``; it appends its pid
to ``MCP_TEST_DIR/started.log``."""

from __future__ import annotations

import gzip
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # run as a script, from anywhere
from tests.mcp.raw_server import TOOLS, answer

HTTP_TOOLS = [
    {"name": name, "description": name, "inputSchema": {"type": "object", "properties": {}}}
    for name in ("too_deep", "gzip_bomb", "sse_deep", "endless", "other_id", "no_answer")
]
TOO_DEEP = '{"content":[],"structuredContent":{"x":' + "[" * 100_000 + "]" * 100_000 + "}}"
BOMB = '{"content":[{"type":"text","text":"' + "x" * 20 * 2**20 + '"}]}'


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests read outcomes, not the server's log."""

    def do_GET(self) -> None:  # no stream of the server's own
        self._send(405, b"", "text/plain")

    def do_DELETE(self) -> None:
        self._send(200, b"", "text/plain")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if "id" not in request:  # a notification
            self._send(202, b"", "text/plain")
            return
        name = (request.get("params") or {}).get("name")
        reply = '{"jsonrpc":"2.0","id":' + json.dumps(request["id"]) + ',"result":'
        if request["method"] == "tools/list":
            self._send(200, (reply + json.dumps({"tools": TOOLS + HTTP_TOOLS}) + "}").encode())
        elif name == "too_deep":
            self._send(200, (reply + TOO_DEEP + "}").encode())
        elif name == "gzip_bomb":
            self._send(200, gzip.compress((reply + BOMB + "}").encode()), gzipped=True)
        elif name == "sse_deep":
            deep = raw_answer_of("deep", request)
            self._send(200, f"event: message\ndata: {deep}\n\n".encode(), "text/event-stream")
        elif name == "other_id":
            self._send(200, b'{"jsonrpc":"2.0","id":"999","result":{"content":[]}}')
        elif name == "no_answer":
            self._send(200, b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}')
        elif name == "endless":
            self._endless(reply)
        else:
            self._send(200, answer(request).encode("utf-8", "surrogateescape"))

    def _endless(self, reply: str) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("mcp-session-id", "raw")
        self.end_headers()
        self.wfile.write((reply + '{"content":[{"type":"text","text":"').encode())
        chunk = b"x" * 2**20
        try:
            for _ in range(64):  # unless the client stops reading first
                self.wfile.write(chunk)
        except OSError:
            pass
        self.close_connection = True

    def _send(
        self, status: int, body: bytes, kind: str = "application/json", gzipped: bool = False
    ) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.send_header("mcp-session-id", "raw")
        if gzipped:
            self.send_header("content-encoding", "gzip")
        self.end_headers()
        self.wfile.write(body)


def raw_answer_of(tool: str, request: dict[str, object]) -> str:
    params = dict(request["params"])  # type: ignore[call-overload]
    return answer({**request, "params": {**params, "name": tool}})


if __name__ == "__main__":
    with (Path(os.environ["MCP_TEST_DIR"]) / "started.log").open("a") as started:
        started.write(f"{os.getpid()}\n")
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
