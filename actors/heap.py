"""Keep an actor process's startup heap out of the garbage collector's way.

An actor process holds ~100k long-lived objects once it has started (Ray's worker,
SQLAlchemy, pydantic's schemas, the agent's module), and every full collection walks
them all. They live as long as the process, so nothing is lost by never collecting
them: ``gc.freeze`` moves them to a generation the collector does not visit. The
objects made afterwards (Runs, frontiers, caches) are collected as usual.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Call once, at the end of an actor's ``__init__``, when its imports are done.

    No collection first: it would hold up a restarted host's recovery for tens of
    milliseconds, and the little garbage of a fresh process it would free is bounded.
    """
    gc.freeze()
