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

__all__ = ["Usage", "log"]
