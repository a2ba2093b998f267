"""Request bodies whose JSON objects repeat a key are refused.

Python's parser (and pydantic's) keeps a repeated key's last value, other parsers its
first: ``{"approve": false, "approve": true}`` would read as a denial to a proxy or an
audit log in front of the service and as an approval here. Such a body is 422
``InputRefused`` (``duplicate_key``) instead of meaning two things.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class DuplicateKey(ValueError):
    """An object of the body repeats ``key``. FastAPI answers a parse failure that is not
    a JSONDecodeError with a bare 400 caused by it; ``edge.problems`` names the rule."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r:.80} appears twice in one object")
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:  # the first repeated, to name it
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            with _no_collections():
                self._json = json.loads(body, object_pairs_hook=_unique)
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
