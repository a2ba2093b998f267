"""Session-wide fixtures: the shared PostgreSQL and Redis servers.

Outside CI a missing server skips the tests that need it; in CI (CI=true) it is a
failure, so a green CI run always means every backend was exercised.
"""

from __future__ import annotations

import os
import socket

import pytest

POSTGRES_URL = os.environ.get(
    "RATCHET_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("RATCHET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _require(name: str, host: str, port: int) -> None:
    if _answers(host, port):
        return
    message = f"{name} does not answer on {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    _require("PostgreSQL", "127.0.0.1", 5432)
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    _require("Redis", "127.0.0.1", 6379)
    return REDIS_URL
