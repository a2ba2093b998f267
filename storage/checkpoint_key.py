"""The key that seals a system's stream checkpoints in Redis, held by its commit store.

A checkpoint's complete tool calls are run on recovery without asking the model again
(``storage.checkpoints``), and Redis may be shared with clients that read the live bus
but may not write the system's commits. A seal anyone can recompute (a digest) let such
a client write a checkpoint whose calls a recovery ran as the model's. So the seal is an
HMAC under a key only the commit store's writers can read: the holder of a store lease
(``CommitStore.hold_lease``) named for the system. Whoever asks first makes it (a random
token; of racers, one holds it), every host reads it from there, and each renews it as it
uses it. Left unrenewed past its lease (no host streamed for five minutes), the next to
ask makes a new one: a checkpoint sealed under the old key is not acted on, and its Step
infers again, as when there is no checkpoint (best effort by contract).
"""

from __future__ import annotations

import logging
import secrets
import time

from runtime.ports import CommitStore
from storage.leases import MAX_LEASE_AHEAD_S

log = logging.getLogger("ratchet.storage.checkpoints")

KEY_TTL_S = MAX_LEASE_AHEAD_S / 2
"""How long the key's lease lasts from each renewal (within what a store takes for a
lease at all)."""
RENEW_S = 60.0
"""How long a host uses the key it read before it renews the lease (and so reads it
again: another may have made a new one after the lease ran out)."""


def key_lease(system: str) -> str:
    return f"checkpoint-key:{system}"


class CheckpointKey:
    """A system's checkpoint key as its commit store holds it, read again every
    ``RENEW_S``. ``current`` answers None when the store cannot be asked (no checkpoint
    is written or acted on then)."""

    def __init__(self, store: CommitStore, system: str) -> None:
        self.store, self.name = store, key_lease(system)
        self._key: str | None = None
        self._read_at = 0.0

    async def current(self) -> bytes | None:
        now = time.monotonic()
        if self._key is not None and now - self._read_at < RENEW_S:
            return self._key.encode()
        mine = self._key or secrets.token_hex(32)
        try:
            lease = await self.store.hold_lease(self.name, mine, KEY_TTL_S)
        except Exception as exc:  # best effort by contract: no key, no checkpoint
            log.warning("the checkpoint key cannot be read from the store: %s", exc)
            self._key = None
            return None
        self._key, self._read_at = lease.holder, now
        return lease.holder.encode()
