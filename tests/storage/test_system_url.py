"""What a store URL means to a system on Ray, read without Ray: whether its writes go
through the one store actor, and (``system_name``) which system it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.wire import SystemSpec
from runtime.limits import Limits


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


SAME_POSTGRES = [
    "postgresql://app:old@db/r",
    "postgresql://app:new@db/r",  # a password rotated
    "postgres://app:new@db/r",
    "postgresql+asyncpg://app:new@db/r",
    "postgresql://app:new@DB:5432/r",  # the default port, the host's case
    "postgresql://other@db/r?pool_size=20&key_joins=off",  # another role, options
]


@pytest.mark.parametrize(
    "spellings",
    [
        SAME_POSTGRES,
        [
            "redis://:old@cache/3",
            "rediss://user:new@CACHE:6379/3?socket_timeout=9",
            "redis://cache?db=3",
        ],
        ["redis://cache", "redis://cache:6379/", "redis://cache/0"],
        ["sqlite:////srv/r/ratchet.db", "sqlite:////srv/r/../r/ratchet.db?synchronous=normal"],
        ["SQLITE:////srv/r/ratchet.db", "sqlite:////srv/r/ratchet.db"],
    ],
)
def test_every_spelling_of_one_stores_url_names_one_system(spellings: list[str]) -> None:
    """A restarted cluster took up no Run the old one left, and another cluster got past
    the one-cluster lease, when the URL was spelt otherwise: the name hashed it whole."""
    from cluster.config import system_name

    assert len({system_name(url) for url in spellings}) == 1, spellings


@pytest.mark.parametrize(
    "other",
    [
        "postgresql://app@db/r2",
        "postgresql://app@db2/r",
        "postgresql://app@db:5433/r",
        # the driver takes these options over the URL's parts: another store each
        "postgresql://app@db/r?port=5433",
        "postgresql://app@db/r?database=r2",
        "postgresql://app@db/r?host=db2",
        "redis://db/3",
        "sqlite:////srv/r/other.db",
        "memory://",
    ],
)
def test_another_store_names_another_system(other: str) -> None:
    from cluster.config import system_name

    assert system_name(other) != system_name(SAME_POSTGRES[0])


def test_a_sqlite_store_is_named_by_the_file_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cluster.config import store_url_from, system_name

    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    spellings = [
        f"sqlite:///{tmp_path}/data/r.db",
        f"sqlite:///{tmp_path}/link/r.db",
        store_url_from("sqlite:///data/r.db"),
    ]
    assert len({system_name(url) for url in spellings}) == 1


@pytest.mark.parametrize(
    "url",
    [
        "mysql://app:pw@db/r",
        "postgresql://app:pw@db:abc/r",
        "postgresql://app@db/r?pool_size=0",
        "postgresql://app@db/r?sslmode=bogus",
        "sqlite://host/r.db",
        "sqlite:///r.db?synchronous=bogus",
        "redis://cache:6379/13x",
        "rediss://cache/0?ssl_cert_reqs=bogus",
    ],
)
async def test_a_client_refuses_a_url_it_cannot_read_before_ray_starts(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bad URL was StoreUnavailable (which callers retry), after Ray had started."""
    import cluster.client
    from cluster.client import Ratchet
    from storage.url import UnsupportedStoreUrl

    def no_ray(*_: object, **__: object) -> None:
        raise AssertionError("Ray was started for a URL no store can be opened with")

    monkeypatch.setattr(cluster.client, "connect_ray", no_ray)
    with pytest.raises(UnsupportedStoreUrl) as refused:
        await Ratchet.connect(store_url=url)
    assert "pw" not in str(refused.value)


def test_a_sqlite_store_is_refused_only_with_a_node_on_another_machine() -> None:
    """Each node would open its own file at the store's path (``check_store_reach``);
    raylets of one machine (``ray.cluster_utils``, ``--nodes N``) share it."""
    from cluster.config import nodes_elsewhere

    def node(address: str, alive: bool = True) -> dict[str, object]:
        return {"NodeManagerAddress": address, "Alive": alive}

    here = "10.0.0.5"
    assert nodes_elsewhere([node(here), node(here), node("127.0.0.1")], here) == []
    assert nodes_elsewhere([node(here), node("10.0.0.9", alive=False)], here) == []
    assert nodes_elsewhere([node(here), node("10.0.0.9"), node("10.0.0.7")], here) == [
        "10.0.0.7",
        "10.0.0.9",
    ]
    assert nodes_elsewhere([node("10.0.0.9")], here) == ["10.0.0.9"]  # ray:// from afar


@pytest.mark.parametrize(
    "option",
    [
        {"hosts": 0},  # a ZeroDivisionError at the first start
        {"executors": -3},
        {"host_max_restarts": -2},
        {"reconcile_s": float("nan")},
        {"lease_ttl_s": -1},
        {"heartbeat_s": True},
        {"limits": {"input_bytes": 1}},  # an AttributeError in the hosts
        {"sqlite_writer": "bogus"},
        {"limits": Limits(input_bytes=400 * 1024)},  # every start refused in the hosts
    ],
    ids=str,
)
def test_a_system_s_options_are_checked_when_it_is_made(option):
    with pytest.raises((ValueError, TypeError)):
        SystemSpec(name="s", store_url="memory://", **option)


def test_two_servers_on_one_machine_by_socket_are_two_systems() -> None:
    from cluster.config import system_name

    one = "postgresql://app@/r?host=/var/run/postgresql"
    assert system_name(one) != system_name(one + "&port=5433")
