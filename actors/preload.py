"""Imported by every worker process of a Ray instance that Ratchet starts, before it
takes work (Ray's ``preload_python_modules`` system config): the modules a RunHost,
a ToolExecutor and the store need, so an actor, above all a restarted one, finds
them imported. A spare worker (``actors.spare``) is warm, not only started.

Whatever goes wrong here — a module that is not installed, one that raises as it is
imported — is logged once and skipped: the worker starts cold instead of broken (a
preload that raised would cost every worker of the instance).
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger("ratchet.preload")

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


def preload(modules: tuple[str, ...] = WARM_MODULES) -> list[str]:
    """Import ``modules``; returns those that failed (each logged once, never raised)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            failed.append(name)  # not installed (an optional driver): nothing to warm
        except Exception:  # a module that breaks on import must not break the worker
            log.warning("preloading %s failed; this worker starts cold", name, exc_info=True)
            failed.append(name)
    return failed


preload()
