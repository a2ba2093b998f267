"""Peak RSS and CPU time of the driver and the Ray processes it started, sampled in a thread."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

RSS_SAMPLE_S = 0.25
CHILDREN_EVERY = 8
"""Re-list the process tree every 8 samples (2 s); RSS is read every sample."""
SERVERS = ("postgres", "redis-server")
"""Local server processes whose CPU time counts too (not their RSS): a durable Run's
commits cost the database server CPU on the same cores (every such process on the
machine: nothing else uses these servers while a benchmark runs)."""


class RssSampler:
    """Peak RSS of this process plus the Ray processes it started, sampled in a thread;
    and the CPU time each kind of process spent meanwhile.

    ``workers``: the driver and every ``ray::`` process (actors, idle workers);
    ``total``: also Ray's own daemons (raylet, GCS, agents). Only descendants of this
    process count: other Ray instances on the machine are not ours. CPU time of a
    process that dies (a killed host) counts up to its last sample. The local
    PostgreSQL and Redis servers' CPU counts under their names (``SERVERS``).
    """

    def __init__(self) -> None:
        import psutil  # vendored by Ray (ray/thirdparty_files), importable once ray is

        self.psutil = psutil
        self.me = psutil.Process()
        self.peak_workers = 0
        self.peak_total = 0
        self._children: list[Any] = []
        self._servers: list[Any] = []
        self._ticks = 0
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")

    def sample(self) -> tuple[int, int]:
        if self._ticks % CHILDREN_EVERY == 0:  # listing /proc is the costly part
            self._children = self.me.children(recursive=True)
            self._servers = [
                p for p in self.psutil.process_iter(["name"]) if p.info["name"] in SERVERS
            ]
        self._ticks += 1
        workers = total = self.me.memory_info().rss
        self._cpu(self.me.pid, "driver", self.me.cpu_times())
        for proc in self._servers:
            try:
                self._cpu(proc.pid, proc.info["name"], proc.cpu_times())
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
        for proc in self._children:
            try:
                rss = proc.memory_info().rss
                first = (proc.cmdline() or [""])[0]
                self._cpu(proc.pid, _kind(first), proc.cpu_times())
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
            total += rss
            if first.startswith("ray::"):
                workers += rss
        return workers, total

    def _cpu(self, pid: int, kind: str, times: Any) -> None:
        used = times.user + times.system
        if self._thread.is_alive() or pid in self._cpu_first:
            self._cpu_first.setdefault(pid, 0.0)  # a process born during the load
        else:
            self._cpu_first[pid] = used
        self._cpu_last[pid] = (kind, used)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds per kind of process between ``__enter__`` and ``__exit__``."""
        spent: dict[str, float] = defaultdict(float)
        for pid, (kind, used) in self._cpu_last.items():
            spent[kind] += used - self._cpu_first.get(pid, 0.0)
        return dict(spent)

    def _loop(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self._take()

    def _take(self) -> None:
        workers, total = self.sample()
        self.peak_workers = max(self.peak_workers, workers)
        self.peak_total = max(self.peak_total, total)

    def __enter__(self) -> RssSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._children = self.me.children(recursive=True)
        self._ticks = 1
        self._take()


def _kind(title: str) -> str:
    """``ray::ratchet-…:host:0:RunHost.run`` → ``RunHost``; Ray's daemons are ``ray``."""
    if not title.startswith("ray::"):
        return "ray"
    name = title.removeprefix("ray::").split()[0].split(".")[0].rsplit(":", 1)[-1]
    return name or "ray"


def mb(n: float) -> float:
    return round(n / 2**20, 1)


__all__ = ["RssSampler", "mb"]
