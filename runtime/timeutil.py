"""The one clock of the runtime: microseconds since the epoch, as stored everywhere."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def now_us() -> int:
    return time.time_ns() // 1000


def utc_time(us: int) -> datetime | None:
    """The UTC moment of ``us`` microseconds since the epoch; None if no datetime can
    hold it (a stored time is data: an imported or hand-edited one may be far off)."""
    try:
        return datetime.fromtimestamp(us / 1e6, UTC)
    except (ValueError, OverflowError, OSError):
        return None
