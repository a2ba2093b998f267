"""Keep an actor process's heap out of the garbage collector's way.

An actor process holds ~100k long-lived objects once it has started (Ray's worker,
SQLAlchemy, pydantic's schemas, the agent's module), and every full collection walks
them all. They live as long as the process, so nothing is lost by never collecting
them: ``gc.freeze`` moves them to a generation the collector does not visit. The
objects made afterwards (Runs, frontiers, caches) are collected as usual, but less
often than Python's default (``GC_THRESHOLDS``).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 20)
"""A young collection once 50,000 more objects are alive than at the last one (Python's
default: 700), a middle one every 20 young ones and a full one every 20 middle ones
(default 10 and 10; measured together, not apart; a full one also waits, as always,
until a quarter of the long-lived objects are new). A host's Steps make and drop
records by the thousand, nearly all freed by reference counting; at 700 the live ones
of the Runs in flight crossed the threshold about 40 times a second, and the collector
took 10-14 % of a RunHost's CPU at W1, C=50 on PostgreSQL (1.0-1.4 s per 1,500 Runs by
``gc.callbacks``, 14 % of the GIL's samples by py-spy; 0.03-0.05 s at 50,000). The
cost: garbage in reference cycles waits longer to be freed. A cycle that dies young
goes at the next young collection; one that lived through a collection first waits
for a middle one (about a million more objects made and kept) or a full one."""


def freeze_startup_heap() -> None:
    """Call once, at the end of an actor's ``__init__``, when its imports are done.

    No collection first: it would hold up a restarted host's recovery for tens of
    milliseconds, and the little garbage of a fresh process it would free is bounded.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
