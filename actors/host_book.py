"""What the Supervisor keeps of its hosts: the state its mixins (``actors.hung_hosts``,
``actors.idle_hosts``) share with it, declared once."""

from __future__ import annotations

from actors.wire import SystemSpec
from runtime.ports import CommitStore


class HostBook:
    spec: SystemSpec
    store: CommitStore
    leases: dict[str, float]
    """host id → monotonic time its lease expires."""
    kinds: dict[str, str]
    _silent: dict[str, float]
    """Hosts lost by their lease, not dead → when: one silent a lease longer is hung."""
