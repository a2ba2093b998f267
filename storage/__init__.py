"""Store backends: in-memory, SQLAlchemy (SQLite, PostgreSQL) and Redis; the live buses.

Backends load lazily by URL (``open_store``) so that importing ``storage`` pulls in
no driver the configuration does not use.
"""

from storage.checkpoints import MemoryCheckpointStore
from storage.errors import StoreTooNew
from storage.memory import MemoryCommitStore
from storage.url import UnsupportedStoreUrl, default_store_url, open_store, redact

__all__ = [
    "MemoryCheckpointStore",
    "MemoryCommitStore",
    "StoreTooNew",
    "UnsupportedStoreUrl",
    "default_store_url",
    "open_store",
    "redact",
]
