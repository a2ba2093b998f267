"""The FastAPI application of ``ratchet serve``: routes, problems, the guard, a console.

``create_app(client, options)`` serves one connected ``cluster.client.Ratchet``: the
caller connects it (on the event loop the server runs on) and closes it. Every
response goes through the guard (``edge.guard``: bearer token, body size), every error
is a problem (``edge.problems``). If the module ``edge.console`` exists, its
``router`` is included (the web console), and the guard serves the requests its
``is_public`` names (the console's shell and assets, which hold no data) without a
token; without it ``/`` is a 404 problem like any unknown path.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from cluster.client import Ratchet
from cluster.config import ClusterUnavailable
from edge import routes, streams
from edge.guard import BodyTooLarge, Guard, NoSniff
from edge.options import ServeOptions
from edge.paths import ThreadPaths
from edge.problems import (
    HttpProblem,
    Problem,
    http_problem,
    internal_problem,
    problem_response,
    ratchet_problem,
    starlette_problem,
    validation_problem,
)
from runtime.errors import RatchetError
from runtime.limits import KIB, Limits

TITLE = "Ratchet"
DESCRIPTION = (
    "Durable agent Runs over HTTP: start, follow (SSE, AG-UI), resume, cancel, stop. "
    "Every route needs `Authorization: Bearer <token>` unless the server runs with "
    "--no-auth on a loopback address; every error is an RFC 9457 problem."
)


def max_body_bytes(limits: Limits) -> int:
    """The largest body any route takes: its largest text three times over (a JSON
    client may escape every character beyond ASCII, up to 12 bytes for a 4-byte one),
    and room for the ids and keys around it."""
    largest = max(limits.input_bytes, limits.resume_payload_bytes, limits.tool_result_bytes)
    return 3 * largest + 16 * KIB


def create_app(client: Ratchet, options: ServeOptions, *, agents: Iterable[str] = ()) -> FastAPI:
    """The service for ``client``; ``agents``, if any, are the only ``MODULE:ATTR`` it
    starts (otherwise any agent the server can import)."""
    options = options.checked()
    # no /docs or /redoc: their page loads its script from a CDN and asks for the schema
    # without a token; /openapi.json serves the schema (to any OpenAPI viewer). No
    # redirect of a path with a slash too many: it named the request's own Host header
    # as where to go, and a path a route does not take is a 404 like any other.
    app = FastAPI(
        title=TITLE,
        description=DESCRIPTION,
        version=_version(),
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.state.ratchet = client
    app.state.agents = frozenset(agents)
    app.state.streams = streams.OpenStreams(options.max_streams)
    _handle_problems(app)
    app.include_router(routes.router)
    app.include_router(streams.router)
    public = _include_console(app)
    tokens = () if options.no_auth else options.tokens
    app.add_middleware(ThreadPaths)  # inside the guard: nothing is decoded before auth
    app.add_middleware(
        Guard,
        tokens=tokens,
        max_body_bytes=max_body_bytes(client.spec.limits),
        public=public,
        origins=options.cors_origins,
    )
    if options.cors_origins:  # outside the guard: a preflight carries no token
        app.add_middleware(
            ProblemCors,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Last-Event-ID", "Accept"],
        )
    app.add_middleware(NoSniff)
    _document(app, secured=bool(tokens))
    return app


class ProblemCors(CORSMiddleware):
    """CORS whose refused preflight is a problem like every other error, not plain text."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        preflight = (
            headers is not None
            and scope["method"] == "OPTIONS"
            and "origin" in headers
            and "access-control-request-method" in headers
        )
        if not preflight or headers is None:
            await super().__call__(scope, receive, send)
            return
        response = self.preflight_response(request_headers=headers)
        if response.status_code == 400:
            detail = bytes(response.body).decode()  # "Disallowed CORS origin, method"
            allowed = {k: v for k, v in response.headers.items() if k.startswith("access-")}
            response = problem_response(
                400, "CorsRefused", f"preflight refused: {detail}", scope["path"], allowed
            )
        await response(scope, receive, send)


def _handle_problems(app: FastAPI) -> None:
    app.add_exception_handler(RatchetError, ratchet_problem)
    app.add_exception_handler(ClusterUnavailable, ratchet_problem)
    app.add_exception_handler(TimeoutError, ratchet_problem)
    app.add_exception_handler(HttpProblem, http_problem)
    app.add_exception_handler(RequestValidationError, validation_problem)
    app.add_exception_handler(BodyTooLarge, _too_large)
    app.add_exception_handler(HTTPException, starlette_problem)
    app.add_exception_handler(Exception, internal_problem)


def _too_large(request: Request, exc: Exception) -> JSONResponse:
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    path = request.url.path
    return problem_response(413, "InputRefused", detail, path, limit="body_bytes")


def _include_console(app: FastAPI) -> Callable[[str, str], bool] | None:
    """The web console's routes, once ``edge/console.py`` exists (a console that fails
    to import is a bug to see at start, not to hide), and the rule naming the requests
    it serves without a token (its shell and assets, which hold no data)."""
    if importlib.util.find_spec("edge.console") is None:
        return None
    console = importlib.import_module("edge.console")
    app.include_router(console.router)
    public: Callable[[str, str], bool] = console.is_public
    return public


def _document(app: FastAPI, *, secured: bool) -> None:
    """The OpenAPI schema with the Problem schema every error response names, and the
    bearer scheme when tokens are required."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {})["Problem"] = Problem.model_json_schema()
            if secured:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _version() -> str:
    try:
        return importlib.metadata.version("ratchet")
    except importlib.metadata.PackageNotFoundError:
        return "0"


__all__ = ["create_app", "max_body_bytes"]
