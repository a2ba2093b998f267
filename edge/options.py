"""What ``ratchet serve`` is started with, and the one rule about who may call it.

The rule: every request carries ``Authorization: Bearer <token>`` with one of the
server's tokens (``--token``, repeatable, and ``RATCHET_TOKENS``, comma-separated),
unless the server was started with ``--no-auth`` *and* is bound to a loopback address.
``--no-auth`` on any other address is refused before anything starts, and so is a
server with neither tokens nor ``--no-auth``. This module imports no web framework:
the CLI checks the rule before it loads one.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TOKENS_ENV = "RATCHET_TOKENS"


class ServeRefused(ValueError):
    """The options break the auth rule (or cannot be used); nothing was started."""


@dataclass(frozen=True, repr=False)
class ServeOptions:
    """How the HTTP service is exposed. ``repr`` leaves the tokens out: they never reach
    a log, a traceback or an error message."""

    host: str = "127.0.0.1"
    port: int = 8000
    tokens: tuple[str, ...] = ()
    no_auth: bool = False
    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS; none: no CORS headers at all (browsers on other origins
    are refused by their own same-origin rule)."""
    max_streams: int = 256
    """Streams (SSE, AG-UI) open at once; one more is 503 ``TooManyStreams``: each holds
    a socket to its caller and one to the live bus, and a caller with a token could
    otherwise open them until the server runs out of file descriptors."""

    def __repr__(self) -> str:
        return (
            f"ServeOptions(host={self.host!r}, port={self.port}, tokens=<{len(self.tokens)}>, "
            f"no_auth={self.no_auth}, cors_origins={self.cors_origins!r}, "
            f"max_streams={self.max_streams})"
        )

    def checked(self) -> ServeOptions:
        """These options if they keep the auth rule; ServeRefused saying why otherwise."""
        if self.max_streams < 1:
            raise ServeRefused(f"--max-streams is at least 1, not {self.max_streams}")
        if self.no_auth:
            if self.tokens:
                raise ServeRefused("--no-auth goes with no token (tokens were given)")
            if not is_loopback(self.host):
                raise ServeRefused(
                    f"--no-auth is only allowed on a loopback address, not {self.host!r}"
                )
            return self
        if not self.tokens:
            raise ServeRefused(
                f"no token: give --token (or {TOKENS_ENV}), or --no-auth on a loopback address"
            )
        if any(not t or t != t.strip() for t in self.tokens):
            raise ServeRefused("a token may not be empty or start or end with whitespace")
        return self


def tokens_from(given: Iterable[str], env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The ``--token`` values and those of ``RATCHET_TOKENS`` (comma-separated), once each."""
    listed = [*given, *env.get(TOKENS_ENV, "").split(",")]
    return tuple(dict.fromkeys(t.strip() for t in listed if t.strip()))


def is_loopback(host: str) -> bool:
    """Only an address that cannot be reached from another machine: a name other than
    ``localhost`` is not resolved here (what it resolves to may change)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["TOKENS_ENV", "ServeOptions", "ServeRefused", "is_loopback", "tokens_from"]
