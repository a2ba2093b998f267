"""Private PostgreSQL and redis-server instances for tests that stop a server mid-test.

Each server gets its own temporary directory and a free port; ``stop()`` and
``start()`` keep both, so a restarted server has the same address and the same
data. Waits are on conditions (the port answers, pg_ctl -w) with deadlines.

We run as root in CI containers and PostgreSQL refuses to: its programs run as
the ``postgres`` user (``runuser``) and its directory is owned by that user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(condition: object, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition()`` until true or the deadline passes (then fail loudly)."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"PostgreSQL program {name} not found")
    return path


class PrivatePostgres:
    """initdb into a temp dir, trust auth, on a free port; stop()/start() keep the data."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ratchet-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8")  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c max_connections=200"
        )
        log = str(self.dir / "server.log")
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", log, "-o", options, "-w",
                  "-t", "30", "start")  # fmt: skip
        wait_until(lambda: answers(self.port), f"PostgreSQL on port {self.port}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``immediate`` is a crash: no shutdown checkpoint)."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")
        wait_until(lambda: not answers(self.port), f"PostgreSQL on {self.port} to go away")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, TimeoutError):
            if answers(self.port):
                self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, *argv: str) -> None:
        cmd = ["runuser", "-u", "postgres", "--", *argv] if self._as_root else list(argv)
        subprocess.run(cmd, check=True, capture_output=True, timeout=60, cwd=self.dir)


class PrivateRedis:
    """redis-server on a free port with AOF (appendfsync always), so a restart keeps data."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ratchet-redis-"))
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
        ]  # fmt: skip
        log = (self.dir / "server.log").open("ab")
        self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: answers(self.port), f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait(timeout=30)
        self._proc = None
        wait_until(lambda: not answers(self.port), f"redis-server on {self.port} to go away")

    def remove(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=30)
            self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.remove()


@contextlib.contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    try:
        server.start()
        yield server
    finally:
        server.remove()
