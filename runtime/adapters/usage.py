"""Token usage as a provider reports it at the end of a stream.

Each adapter extracts a ``runtime.models.Usage`` from its stream with a pure function
(``openai_compat.usage_of``, ``anthropic.usage_of``) and returns it on the Step's
``ModelResponse``, which the engine commits (``runtime.usage``). Counts:
``input_tokens`` are the prompt tokens billed, cached ones included (OpenAI
``prompt_tokens``; Anthropic ``input_tokens`` plus cache reads and writes);
``output_tokens`` the completion tokens, reasoning included; ``cached_tokens`` the
prompt tokens read from the provider's cache (a part of ``input_tokens``).
"""

from __future__ import annotations

import logging

from runtime.models import Usage

log = logging.getLogger("ratchet.adapters")


def token_count(value: object) -> int:
    """A provider's count as Usage holds it: an int (not a bool) it is, else 0. The SDKs
    build stream chunks without validating them, so a count may be null, "n/a" or 1.5:
    usage is bookkeeping, and what does not parse must not fail the inference."""
    return value if type(value) is int else 0


class Reported:
    """The counts of a stream's usage reports, each the newest one given: a later report
    of the wrong shape (a null, a string, a negative count) erases no earlier count. A
    negative count with none before it is kept, so that it is not believed
    (``runtime.usage.admitted_usage``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.any = False
        """Whether any report came (none: the usage is unknown, not zero)."""

    def add(self, report: object, names: tuple[str, ...]) -> None:
        if report is None:
            return
        self.any = True
        for name in names:
            value = getattr(report, name, None)
            if type(value) is int and (value >= 0 or name not in self.counts):
                self.counts[name] = value

    def count(self, name: str) -> int:
        return self.counts.get(name, 0)


def model_name(value: object) -> str:
    return value if isinstance(value, str) else ""


__all__ = ["Reported", "Usage", "log", "model_name", "token_count"]
