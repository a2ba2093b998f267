"""What the ``ratchet`` commands make of their arguments: a resume payload from its flags,
the ticket a resume answers, and the one error for arguments that cannot be used."""

from __future__ import annotations

import json
from typing import Any

import typer

from cluster.report import cause_text
from runtime.batch import ToolOutput
from runtime.commit import Frontier
from runtime.errors import InputRefused, ResumeRejected
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    ExternalResult,
    PermissionDecision,
    ResumePayload,
    ResumeTicket,
    ScheduledFire,
    Unpause,
    UserInput,
    WaitExpired,
)
from runtime.limits import STORED_IDS, check_id, utf8_problem
from runtime.strict_json import unique_pairs


class BadInput(Exception):
    """A command-line argument that cannot be used as given."""


def payload_from(flags: tuple[Any, ...]) -> ResumePayload:
    approve, deny, note, text, result, is_error, fire, unpause, expire = flags
    given = [
        name
        for name, on in (
            ("--approve", approve),
            ("--deny", deny),
            ("--input", text is not None),
            ("--result", result is not None),
            ("--fire", fire),
            ("--unpause", unpause),
            ("--expire", expire),
        )
        if on
    ]
    if len(given) != 1:
        got = f" (got {', '.join(given)})" if given else ""
        raise BadInput(
            "give exactly one of --approve, --deny, --input, --result, --fire, --unpause, "
            f"--expire{got}"
        )
    if approve or deny:
        return PermissionDecision(approve=approve, note=note)
    if text is not None:
        return UserInput(text=text)
    if result is not None:
        try:  # JSON as the HTTP service reads it: no NaN or Infinity, no key twice
            value = json.loads(result, parse_constant=_no_constant, object_pairs_hook=unique_pairs)
        except (ValueError, RecursionError) as exc:  # bad JSON, too deep, a huge integer
            raise BadInput(f"--result must be JSON: {exc!s:.200}") from None
        content = value if isinstance(value, str) else json.dumps(value)
        return ExternalResult(output=ToolOutput(content=content, is_error=is_error))
    if expire:
        return WaitExpired()
    return ScheduledFire() if fire else Unpause()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def thread_arg(value: str | None) -> str | None:
    """A thread id given on the command line, checked before anything is opened (text
    that is not UTF-8, decoded by Python with surrogates, would reach the store). It
    names a stored thread, or one a start makes (held to its system's ``id_chars`` there):
    the rule of stored ids, whatever limits the system that wrote it had (``STORED_IDS``)."""
    if value is None:
        return None
    try:
        return check_id("thread id", value, STORED_IDS)
    except InputRefused as exc:
        raise typer.BadParameter(str(exc)) from None


def text_arg(value: str | None, param: typer.CallbackParam) -> str | None:
    """Text given on the command line, checked before anything is opened: bytes that are
    not UTF-8 (decoded by Python with surrogates) can be neither sent nor stored, and Ray
    fails to start a driver whose command line holds them (which read as "cannot
    connect")."""
    problem = None if value is None else utf8_problem(value)
    if problem is not None:
        raise typer.BadParameter(str(InputRefused(param.name or "text", "utf8", problem)))
    return value


def awaiting_ticket(frontier: Frontier) -> ResumeTicket:
    state = frontier.run_state
    if isinstance(state, AwaitingState):
        return state.ticket
    where = (
        f"run {state.run_id} ended {cause_text(state.cause.model_dump())}"
        if isinstance(state, EndedState)
        else f"run {frontier.run_id} is running"
    )
    raise ResumeRejected("ticket", f"thread {frontier.thread_id!r} is not awaiting: {where}")
