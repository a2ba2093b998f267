"""Errors of storage's own, in the vocabulary of ``runtime.errors``::

StoreError (runtime.errors)
└── StoreTooNew     the store was written by a newer Ratchet (schema or key layout)
"""

from __future__ import annotations

from runtime.errors import StoreError


class StoreTooNew(StoreError):
    """The store's SQL schema or Redis key layout is newer than this code knows.

    Writing it by the older rules would corrupt its threads, and retrying will not
    help: this Ratchet must be upgraded (or the newer one stopped) before it connects.
    """

    def __init__(self, found: int, known: int) -> None:
        super().__init__(
            f"store schema {found} is newer than this Ratchet ({known}): upgrade Ratchet"
        )
        self.found = found
        """The schema version (SQL) or layout (Redis) the store holds."""
        self.known = known
        """The newest one this code knows."""
