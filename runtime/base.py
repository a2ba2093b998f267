"""The one base class of every persisted and wire type."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable, strict about unknown fields: a record either decodes whole or not at all."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def canonical_json(data: Any) -> str:
    """Sorted keys, no spaces: the same value always encodes to the same bytes."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
