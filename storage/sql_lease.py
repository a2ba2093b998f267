"""Store leases on SQL (``CommitStore.hold_lease``), timed by the database's clock: the
processes holding and testing a lease may sit on machines whose clocks disagree.

A hold is one transaction: insert the lease if there is none, take it over where it is
the holder's own, has expired or runs out further ahead than any holder sets, then
read who holds it. On PostgreSQL the update
re-checks its condition on the row a concurrent taker just wrote (so of two takers of
an expired lease one holds it); SQLite runs one writer at a time.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from runtime.ports import Lease
from storage.leases import MAX_LEASE_AHEAD_S

_NOW = {
    "postgresql": text("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"),
    "sqlite": text("SELECT (julianday('now') - 2440587.5) * 86400.0"),
}
_INSERT = text(
    "INSERT INTO ratchet_leases (name, holder, expires_at) VALUES (:name, :holder, :until) "
    "ON CONFLICT (name) DO NOTHING"
)
_TAKE = text(
    "UPDATE ratchet_leases SET holder = :holder, expires_at = :until "
    "WHERE name = :name AND (holder = :holder OR expires_at <= :now OR expires_at > :far)"
)
_HELD = text("SELECT holder, expires_at FROM ratchet_leases WHERE name = :name")
_DROP = text("DELETE FROM ratchet_leases WHERE name = :name AND holder = :holder")


def hold_body(conn: Connection, name: str, holder: str, ttl_s: float) -> Lease:
    with conn.begin():
        now = float(conn.execute(_NOW[conn.dialect.name]).scalar_one())
        # an expiry further ahead than any holder sets (NaN, infinity and text on SQLite
        # sort above every number) is no lease: it would be waited on for ever
        far = now + MAX_LEASE_AHEAD_S
        values = {"name": name, "holder": holder, "until": now + ttl_s, "now": now, "far": far}
        conn.execute(_INSERT, values)
        conn.execute(_TAKE, values)
        held, until = conn.execute(_HELD, values).one()
    return Lease(str(held), float(until) - now)


def drop_body(conn: Connection, name: str, holder: str) -> None:
    with conn.begin():
        conn.execute(_DROP, {"name": name, "holder": holder})
