"""Named fault points at every commit boundary (crash tests are first-class).

The engine calls ``hit("before:<label>")`` and ``hit("after:<label>")`` around every
commit and ``hit("during:tools")`` while a wave runs. A plan can crash at the n-th
occurrence of a point: in-process by raising ``Crash`` (a BaseException, so no
``except Exception`` swallows it); on Ray by ending the process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class Unwind(BaseException):
    """Ends a driver where it stands, settling nothing (a BaseException, which no ``except
    Exception`` catches): the engine's boundaries around user code, which take any other
    BaseException for that code's failure, let it through."""


class Crash(Unwind):
    """The simulated death of the driver at a fault point."""


class FaultPlan:
    def __init__(
        self,
        crash_at: tuple[str, int] | None = None,
        action: Callable[[str], None] | None = None,
    ) -> None:
        self.crash_at = crash_at
        self.action = action or _raise_crash
        self.counts: Counter[str] = Counter()
        self.seen: list[tuple[str, int]] = []

    def hit(self, name: str) -> None:
        self.counts[name] += 1
        point = (name, self.counts[name])
        self.seen.append(point)
        if point == self.crash_at:
            self.action(f"{name}#{point[1]}")


def _raise_crash(where: str) -> None:
    raise Crash(where)


class _NoFaults(FaultPlan):
    """The shared default: crashes nowhere and records nothing (shared by every engine
    of a process, a record of its points would only grow)."""

    def hit(self, name: str) -> None:
        return None


NO_FAULTS: FaultPlan = _NoFaults()
