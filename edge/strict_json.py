"""Request bodies whose JSON objects repeat a key are refused.

Such a body (``runtime.strict_json``) is 422 ``InputRefused`` (``duplicate_key``):
FastAPI answers a parse failure that is not a JSONDecodeError with a bare 400 caused
by it, and ``edge.problems`` names the rule.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from runtime.strict_json import DuplicateKey, unique_pairs

__all__ = ["DuplicateKey", "StrictJsonRoute"]


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            with _no_collections():
                self._json = json.loads(body, object_pairs_hook=unique_pairs)
        return self._json


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """The collector off while a body is parsed. A body within the size cap may hold
    some 200,000 lists: their allocation set off collection after collection over the
    server's whole heap, which held its event loop (every other request) for a second
    and more; a parse makes no reference cycle for a collection to find. Nothing else
    runs meanwhile: the parse does not await."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class StrictJsonRoute(APIRoute):
    """A route that parses its JSON body with repeated keys refused (FastAPI's documented
    way to change how a route reads its request: a custom ``Request`` in its handler)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive))

        return strict
