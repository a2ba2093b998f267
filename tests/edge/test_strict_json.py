"""Parsing a request body: repeated keys refused, and no collection while it is parsed."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

from edge import strict_json
from edge.strict_json import DuplicateKey, _StrictJsonRequest


def _request(body: bytes) -> _StrictJsonRequest:
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop(0)

    return _StrictJsonRequest({"type": "http", "method": "POST", "headers": []}, receive)


@pytest.mark.parametrize("body", [b'{"a": [[[1]]], "b": {"c": null}}', b'{"a": 1, "a": 2}', b"[1"])
async def test_a_body_is_parsed_with_the_collector_off_and_left_on(body, monkeypatch):
    """A body of some 200,000 small lists, within the size cap, set off collection after
    collection over the server's heap while the event loop waited (a second and more
    for every other request): nothing of a parse is a cycle to collect."""
    seen: list[bool] = []
    loads = json.loads

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return loads(*args, **kwargs)

    monkeypatch.setattr(strict_json.json, "loads", watched)
    assert gc.isenabled()
    try:
        parsed = await _request(body).json()
    except (DuplicateKey, json.JSONDecodeError):
        parsed = None
    assert seen == [False] and gc.isenabled()
    assert parsed == (json.loads(body) if body.startswith(b'{"a": [') else None)


async def test_a_collector_turned_off_by_the_host_stays_off():
    gc.disable()
    try:
        assert await _request(b"[1, 2]").json() == [1, 2]
        assert not gc.isenabled()
    finally:
        gc.enable()
