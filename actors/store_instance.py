"""The store a cluster first saw: a process that joins after the store's contents were
lost must not take the empty database for a new store.

A Redis store's processes each read its instance token at connect and check it beside
every read and append (``storage.redis_instance``), so the processes connected before a
loss (a ``FLUSHDB``, a server restarted without persistence) fail closed. One that
connects afterwards — a dedicated host started for a new Run, a host Ray restarted, a
new client — would read the new token of the empty database and drive Runs there
while the rest of the cluster answers ``StoreLost``: the cluster split.

So the first token any process of the cluster reads is kept in Ray's KV (held by the
GCS: it lives as long as the cluster, and a restarted cluster starts afresh), and a
process that reads another adopts the cluster's instead: each of its reads and appends
is ``StoreLost``, as for the processes connected before. Restart the whole cluster
after a store loss (README).
"""

from __future__ import annotations

import hashlib
import logging

from ray.experimental import internal_kv

from actors.wire import NAMESPACE
from runtime.ports import CommitStore
from storage.url import redact

log = logging.getLogger("ratchet.store_instance")


def instance_kv_key(url: str, prefix: str) -> str:
    """The KV key of the store at ``url`` under ``prefix`` (hashed: URLs hold secrets)."""
    digest = hashlib.sha256(f"{url}\0{prefix}".encode("utf-8", "surrogatepass"))
    return f"store-instance:{digest.hexdigest()}"


def held_to_first_instance(store: CommitStore, url: str) -> CommitStore:
    """``store``, made to expect the token the cluster first read from its URL.

    A store without an instance token (SQL, memory) or a process outside Ray is
    returned as it is: the SQL stores keep their contents across a restart, and the
    in-memory one's loss is its store actor's to tell (``actors.store_actor``)."""
    token = getattr(store, "instance", None)
    prefix = getattr(store, "prefix", None)
    if not isinstance(token, str) or not isinstance(prefix, str):
        return store
    if not internal_kv._internal_kv_initialized():  # type: ignore[no-untyped-call]
        return store
    key = instance_kv_key(url, prefix)
    internal_kv._internal_kv_put(key, token, overwrite=False, namespace=NAMESPACE)
    first = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    if first is not None and first.decode() != token:
        log.error(
            "the store at %s is not the one this cluster first connected to (its "
            "contents were lost: flushed, or restarted without persistence); every "
            "read and write of this process is StoreLost until the cluster restarts",
            redact(url),
        )
        store.instance = first.decode()  # type: ignore[attr-defined]
    return store


def forget_first_instance(url: str, prefix: str = "ratchet") -> None:
    """Let the cluster take the store at ``url`` as new: for one emptied on purpose (a
    benchmark's fresh store, a test), never after a loss."""
    if internal_kv._internal_kv_initialized():  # type: ignore[no-untyped-call]
        internal_kv._internal_kv_del(instance_kv_key(url, prefix), namespace=NAMESPACE)
