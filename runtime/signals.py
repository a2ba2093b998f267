"""Exceptions the engine's parts use to tell the Step loop what happened (never escape it)."""

from __future__ import annotations

from runtime.lifecycle import EndCause


class CancelledSignal(Exception):
    """The cancellation signal won a race against inference or tools."""


class RunOver(Exception):
    """The Run reached a terminal commit inside a helper: the loop just returns."""


class EndRun(Exception):
    """Carrying out a Step decided that the Run must end with ``cause``."""

    def __init__(self, cause: EndCause) -> None:
        super().__init__(cause.kind)
        self.cause = cause
