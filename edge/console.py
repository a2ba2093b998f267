"""The web console of ``ratchet serve``: ``/`` lists the Runs, ``/console/threads/{t}``
shows one (transcript, commits, the tool batch's call phases, the ticket and controls).

The server sends a shell only: one HTML page, one script and one stylesheet, the
same bytes for every visitor and every thread, holding no data. The script reads
everything through the service's own routes (``GET /runs``, ``GET /threads/{t}``,
``/commits``, the SSE ``/stream`` read with ``fetch``) and acts through them
(``/resume``, ``/cancel``, ``/stop``), so the page shows what the store vouches for
and nothing else (live text deltas, which no store holds, are not shown). Those
routes need the bearer token: the page asks for it once and keeps it in the tab's
``sessionStorage``, and sends it in the ``Authorization`` header of every request;
no cookie is ever set, so no other site can make the browser act with it.

Because the shell holds no data, it and its assets are the only paths the guard lets
through without a token (``is_public``): a browser cannot send the header when it
navigates. Every console response carries a strict Content-Security-Policy (scripts,
styles and fetches from this origin only, no inline script, no framing), and the
script writes text into the page as text (``textContent``), never as HTML.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Path
from starlette.responses import Response

from edge.problems import HttpProblem

router = APIRouter(include_in_schema=False)

THREAD_PAGE = "/console/threads/"
STATIC = "/console/static/"
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_MEDIA_TYPES = {
    "console.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
_FILES = {
    name: (resources.files("edge") / "console_static" / name).read_bytes() for name in _MEDIA_TYPES
}
"""Read once at import: a console whose files are missing fails the server's start."""


def is_public(method: str, path: str) -> bool:
    """Whether the guard serves this request without a token: GETs of the shell and
    its assets, which are the same for everyone and hold no data."""
    if method not in ("GET", "HEAD"):
        return False
    return path == "/" or path.startswith((THREAD_PAGE, STATIC))


def _file(name: str) -> Response:
    return Response(_FILES[name], media_type=_MEDIA_TYPES[name], headers=HEADERS)


@router.get("/")
async def runs_page() -> Response:
    return _file("console.html")


@router.get(THREAD_PAGE + "{thread:path}")
async def thread_page(thread: str) -> Response:
    """The same shell: the script reads the thread id from the address."""
    return _file("console.html")


@router.get(STATIC + "{name}")
async def static_file(name: str = Path(max_length=64)) -> Response:
    if name == "console.html" or name not in _FILES:
        raise HttpProblem(404, "NotFound", f"no console file {name!r}")
    return _file(name)


__all__ = ["CSP", "is_public", "router"]
