"""The one clock of the runtime: microseconds since the epoch, as stored everywhere."""

from __future__ import annotations

import time


def now_us() -> int:
    return time.time_ns() // 1000
