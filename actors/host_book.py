"""What the Supervisor keeps of its hosts: the state its mixins (``actors.hung_hosts``,
``actors.idle_hosts``, ``actors.take_overs``) share with it, declared once."""

from __future__ import annotations

from collections import Counter

from actors.system_lease import LeaseKeeper
from actors.wire import SystemSpec
from runtime.ids import ThreadId
from runtime.ports import CommitStore


class HostBook:
    spec: SystemSpec
    store: CommitStore
    owner: str
    """The Supervisor's own owner name (a Run it marked lost is its own until re-placed)."""
    counts: Counter[str]
    lease: LeaseKeeper
    """The system's lease: no take-over while another Ray cluster serves the system."""
    leases: dict[str, float]
    """host id → monotonic time its lease expires."""
    kinds: dict[str, str]
    _silent: dict[str, float]
    """Hosts lost by their lease, not dead → when: one silent a lease longer is hung."""
    _recovering: Counter[str]
    """host id → our ``recover_run`` calls in flight there (such a host never retires)."""
    _taking: set[ThreadId]
    """Threads with a take-over queued or under way (one at a time per thread)."""
