"""Imported by every worker process of a Ray instance that Ratchet starts, before it
takes work (Ray's ``preload_python_modules`` system config): the modules a RunHost,
a ToolExecutor and the store need, so an actor, above all a restarted one, finds
them imported. A spare worker (``actors.spare``) is warm, not only started.

A module that is not installed is skipped: a preload that raised would cost every
worker.
"""

from __future__ import annotations

import contextlib
import importlib

WARM_MODULES = (
    "actors.run_host",
    "actors.tool_executor",
    "actors.store_actor",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.dialects.postgresql.asyncpg",
    "sqlalchemy.dialects.sqlite.aiosqlite",
    "asyncpg",
    "aiosqlite",
    "redis.asyncio",
)

for _name in WARM_MODULES:
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
