"""What a store URL means to a system on Ray, read without Ray: whether its writes go
through the one store actor, and (``system_name``) which system it is."""

from __future__ import annotations

import pytest

from actors.wire import SystemSpec


@pytest.mark.parametrize(
    ("url", "writer", "funnels"),
    [
        ("memory://", "direct", True),
        ("MEMORY://", "direct", True),  # was every process's own, private store
        ("sqlite:////tmp/r.db", "actor", True),
        ("SQLITE:////tmp/r.db", "actor", True),  # bypassed the store actor
        ("Sqlite:////tmp/r.db", "direct", False),
        ("postgresql://db/r", "actor", False),
    ],
)
def test_which_writes_funnel_through_the_store_actor_is_read_from_the_scheme(
    url: str, writer: str, funnels: bool
) -> None:
    spec = SystemSpec(name="s", store_url=url, sqlite_writer=writer)  # type: ignore[arg-type]
    assert spec.funnels_writes is funnels
