"""Errors of storage's own, in the vocabulary of ``runtime.errors``::

StoreError (runtime.errors)
├── StoreTooNew     the store was written by a newer Ratchet (schema or key layout)
└── NoStore         nothing of Ratchet's is at the URL, and the opener makes no store
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


class NoStore(StoreError):
    """The URL names no store (a database with no Ratchet schema, a SQLite file that is
    missing or empty), and whoever opened it only reads it, or writes into a thread that
    would have to be there: nothing was created."""

    def __init__(self, where: str, why: str = "it holds no Ratchet schema") -> None:
        super().__init__(f"no store at {where}: {why}")
        self.where = where
        """The store's URL, its password hidden."""
