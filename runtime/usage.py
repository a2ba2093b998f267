"""Token usage, committed with each inference, and the Run's budget (``Agent.budget``).

Each inference commit carries the usage its provider reported as commutative state
commands: the Run's totals (``run:usage``) and the thread's (``thread:usage``), both
``{input_tokens, output_tokens, cached_tokens, inferences}``, and the model id
(``run:model``). The committed commands are the per-Step record (``ratchet show``
prints them); the frontier keeps the totals.

A ``Budget`` bounds a Run's tokens and cost. Before each inference the Run's spend
so far, plus its average inference's (a guess at the next), is held to the budget:
past it, the Run pauses ``awaiting(pause(budget))``. Unpausing it grants the budget
anew: the spend is counted from that resume (``run:budget_from``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from runtime.base import Frozen
from runtime.limits import printable
from runtime.models import Usage
from runtime.state import Command

if TYPE_CHECKING:
    from runtime.commit import Frontier

USAGE_KEY = "usage"
MODEL_KEY = "model"
BUDGET_FROM = "budget_from"
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cached_tokens")
MAX_TOKENS = 2**40
"""A provider's count past this is not believed (a fuzzed or broken answer)."""


class Budget(Frozen):
    """Bounds on one Run's model use; costs are per million tokens, in any currency."""

    max_tokens: int | None = Field(default=None, ge=0, strict=True)
    """Input plus output tokens (a whole number: ``True`` is not 1 token)."""
    max_cost: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    input_cost: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    output_cost: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    cached_cost: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Per million cached input tokens (they are not counted at ``input_cost`` too)."""

    def cost(self, spent: Mapping[str, int]) -> float:
        fresh = max(spent.get("input_tokens", 0) - spent.get("cached_tokens", 0), 0)
        return (
            fresh * self.input_cost
            + spent.get("cached_tokens", 0) * self.cached_cost
            + spent.get("output_tokens", 0) * self.output_cost
        ) / 1_000_000

    def exceeded(self, spent: Mapping[str, int], next_guess: Mapping[str, int]) -> bool:
        """Would the next inference, if it uses ``next_guess``, go past the budget?"""
        after = {f: spent.get(f, 0) + next_guess.get(f, 0) for f in TOKEN_FIELDS}
        tokens = after["input_tokens"] + after["output_tokens"]
        if self.max_tokens is not None and tokens > self.max_tokens:
            return True
        return self.max_cost is not None and self.cost(after) > self.max_cost


def admitted_usage(usage: Any) -> Usage | None:
    """The provider's usage as it may be committed: counts within bounds, the model id
    printable and short; anything else is not believed (None)."""
    if not isinstance(usage, Usage):
        return None
    counts = [getattr(usage, f) for f in TOKEN_FIELDS]
    if not all(type(n) is int and 0 <= n <= MAX_TOKENS for n in counts):
        return None
    admitted = dict(zip(TOKEN_FIELDS, counts, strict=True))
    # cached input is a part of the input: a surplus would make later inferences' input
    # free of cost in the Run's totals; held to the input, the report still counts
    admitted["cached_tokens"] = min(admitted["cached_tokens"], admitted["input_tokens"])
    return Usage(**admitted, model=printable(usage.model, 200))


def usage_commands(usage: Usage | None) -> tuple[Command, ...]:
    """The commands an inference commit carries for ``usage`` (none without it)."""
    if usage is None:
        return ()
    counted = {f: getattr(usage, f) for f in TOKEN_FIELDS} | {"inferences": 1}
    return (
        Command(key=USAGE_KEY, scope="run", merge="commutative", value=counted),
        Command(key=USAGE_KEY, scope="thread", merge="commutative", value=counted),
        Command(key=MODEL_KEY, scope="run", value=usage.model),
    )


def run_usage(frontier: Frontier) -> Mapping[str, int]:
    return frontier.state["run"].get(USAGE_KEY) or {}


def over_budget(budget: Budget | None, frontier: Frontier) -> bool:
    """Whether the Run must pause before its next inference."""
    if budget is None:
        return False
    total = run_usage(frontier)
    inferences = total.get("inferences", 0)
    if not inferences:
        return False
    base = frontier.state["run"].get(BUDGET_FROM) or {}
    spent = {f: total.get(f, 0) - base.get(f, 0) for f in (*TOKEN_FIELDS, "inferences")}
    if not spent["inferences"]:  # a grant allows one inference at least, as a Run's start
        return False  # does: else an average above the budget re-paused at every Unpause
    guess = {f: total.get(f, 0) // inferences for f in TOKEN_FIELDS}
    return budget.exceeded(spent, guess)


def budget_granted(frontier: Frontier) -> Command:
    """Unpausing a budget pause: the spend is counted from here."""
    return Command(key=BUDGET_FROM, scope="run", value=dict(run_usage(frontier)))


def step_usage(commands: Any) -> tuple[Mapping[str, int], str] | None:
    """The usage an inference commit recorded (its run-scope commands), for display."""
    counted = model = None
    for c in commands:
        if c.scope == "run" and c.key == USAGE_KEY:
            counted = c.value
        elif c.scope == "run" and c.key == MODEL_KEY:
            model = c.value
    return (counted, str(model or "")) if isinstance(counted, Mapping) else None
