"""Store backends: in-memory, SQLAlchemy (SQLite, PostgreSQL) and Redis."""

from storage.memory import MemoryCommitStore

__all__ = ["MemoryCommitStore"]
