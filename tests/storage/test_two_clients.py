"""Two clients against one thread, every store: starts, resumes, cancels, recoveries and
crashes of the driver at any fault point, raced — checked after every step.

A hypothesis state machine drives two in-process runners (each its own engines, as two
client processes have) against the same store. Each step races one operation of each
client; a store wrapper lets the event loop run a few turns before every store call, so
the racers interleave differently from example to example. After every step:

- at most one Run is active, and each Run's activation follows the previous Run's end;
- every Run is driven or at rest: once both operations returned, the thread rests
  unless a driver was crashed (then only until a recovery);
- no ``never_replay`` effect happened twice;
- the log replays to the stored frontier;
- every outcome is a typed answer: success, or InvalidTransition, ResumeRejected,
  Fenced (a caller whose thread another took over), or the Crash the step armed.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from runtime import (
    Agent,
    Crash,
    FaultPlan,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ScriptedModel,
    ToolContext,
    call,
    tool,
)
from runtime.commit import Frontier
from runtime.control import control_engine
from runtime.errors import Fenced, InvalidTransition, ResumeRejected
from runtime.ids import ThreadId
from runtime.lifecycle import AwaitingState, EndedState, ResumeTicket, RunningState, answer
from runtime.rules import replay
from tests.storage.conftest import make_store

T = ThreadId("t")
RUN_IDS = ("r1", "r2", "r3")
POINTS = (
    "before:activation",
    "after:activation",
    "before:inference",
    "after:inference",
    "during:tools",
    "before:results",
    "after:results",
    "before:awaiting",
    "after:awaiting",
    "before:resume",
    "after:resume",
    "before:ended",
)
TYPED = (InvalidTransition, ResumeRejected, Fenced)


class Effects:
    """How often each operation id of each tool really ran."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[str, str]] = Counter()

    def record(self, tool_id: str, ctx: ToolContext) -> None:
        self.runs[(tool_id, ctx.operation_id)] += 1


def race_agent(effects: Effects) -> Agent:
    """Step 0 asks for a permission-gated charge and a plain one; step 1 answers."""

    @tool(needs_permission=True)
    def refund(amount: int, ctx: ToolContext) -> str:
        effects.record("refund", ctx)
        return f"refunded {amount}"

    @tool
    def charge(amount: int, ctx: ToolContext) -> str:
        effects.record("charge", ctx)
        return f"charged {amount}"

    model = ScriptedModel(
        [
            ModelResponse(
                text="both",
                tool_calls=(call("charge", "c1", amount=1), call("refund", "c2", amount=2)),
            ),
            ModelResponse(text="done"),
        ]
    )
    return Agent(name="racer", model=model, tools=[charge, refund])


class Interleaving:
    """The real store, with a few event-loop turns before each call (a real race)."""

    def __init__(self, inner: Any, rng: random.Random) -> None:
        self.inner = inner
        self.rng = rng

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if name not in ("append", "load", "read", "claim", "list_runs", "thread_ids"):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            for _ in range(self.rng.randint(0, 4)):
                await asyncio.sleep(0)
            return await target(*args, **kwargs)

        return call


OPS = st.sampled_from(
    ["start", "start_same", "approve", "deny", "stale", "cancel", "recover", "crash"]
)


class TwoClients(RuleBasedStateMachine):
    backend = "memory"

    @staticmethod
    def url() -> str:
        return "memory://"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.effects = Effects()
        # a fresh store per example (PostgreSQL truncated, Redis flushed, a new SQLite file)
        self.store = self.loop.run_until_complete(make_store(self.backend, self.url()))
        self.rng = random.Random(0)
        shared = Interleaving(self.store, self.rng)
        self.clients = [InProcessRunner(race_agent(self.effects), shared) for _ in range(2)]
        self.orphaned = False  # a crashed driver left the Run running: recovery is due
        self.tickets: list[ResumeTicket] = []

    def teardown(self) -> None:
        self.loop.run_until_complete(self.store.close())
        self.loop.close()

    def _frontier(self) -> Frontier:
        return self.loop.run_until_complete(self.store.load(T))

    # ---- what each client may do ------------------------------------------------------

    async def _op(self, client: InProcessRunner, op: str, arg: int) -> Any:
        rid = RUN_IDS[arg % len(RUN_IDS)]
        if op == "start":
            return await client.start("go", thread_id=T, run_id=f"{rid}-{uuid.uuid4().hex[:4]}")
        if op == "start_same":
            return await client.start("go", thread_id=T, run_id=rid)
        if op in ("approve", "deny", "stale"):
            ticket = self._ticket() if op != "stale" else (self.tickets or [None])[0]
            if ticket is None:
                raise ResumeRejected("ticket", "nothing to resume in this step")
            return await client.resume(answer(ticket, PermissionDecision(approve=op != "deny")))
        if op == "cancel":
            return await control_engine(client.store).terminate(T)
        if op == "recover":
            return await client.recover(T)
        point = (POINTS[arg % len(POINTS)], 1)
        frontier = self._current
        if isinstance(frontier.run_state, AwaitingState):
            command = answer(frontier.run_state.ticket, PermissionDecision(approve=True))
            return await client.resume(command, faults=FaultPlan(crash_at=point))
        if isinstance(frontier.run_state, RunningState):
            return await client.recover(T, faults=FaultPlan(crash_at=point))
        return await client.start("go", thread_id=T, faults=FaultPlan(crash_at=point))

    def _ticket(self) -> ResumeTicket | None:
        state = self._current.run_state
        return state.ticket if isinstance(state, AwaitingState) else None

    @rule(
        a=OPS,
        b=OPS,
        arg_a=st.integers(0, 50),
        arg_b=st.integers(0, 50),
        seed=st.integers(0, 2**16),
    )
    def race(self, a: str, b: str, arg_a: int, arg_b: int, seed: int) -> None:
        self.rng.seed(seed)
        self._current = self._frontier()
        ticket = self._ticket()
        if ticket is not None:
            self.tickets.append(ticket)
        pairs = zip(self.clients, (a, b), (arg_a, arg_b), strict=True)
        ops = [self._op(client, op, arg) for client, op, arg in pairs]
        outcomes = self.loop.run_until_complete(_together(ops))
        for op, outcome in zip((a, b), outcomes, strict=True):
            event(f"{op}: {type(outcome).__name__}")  # --hypothesis-show-statistics
            if isinstance(outcome, Crash):
                assert op == "crash", f"{op} crashed: {outcome}"
                self.orphaned = True
            elif isinstance(outcome, BaseException):
                assert isinstance(outcome, TYPED), f"{op} raised {outcome!r}"
        if self._at_rest():
            self.orphaned = False

    def _at_rest(self) -> bool:
        state = self._frontier().run_state
        return state is None or isinstance(state, AwaitingState | EndedState)

    # ---- after every step ---------------------------------------------------------------

    @invariant()
    def every_run_is_driven_or_at_rest(self) -> None:
        # both operations have returned: nobody drives the thread now
        assert self._at_rest() or self.orphaned, "a Run is left running with no driver"

    @invariant()
    def no_never_replay_effect_twice(self) -> None:
        twice = {key: n for key, n in self.effects.runs.items() if n > 1}
        assert not twice, f"never_replay effects ran more than once: {twice}"

    @invariant()
    def the_log_replays_to_the_frontier_with_one_run_active_at_a_time(self) -> None:
        records = self.loop.run_until_complete(self.store.read(T))
        stored = self._frontier()
        ownership = {"epoch", "owner"}
        rebuilt = replay(T, [r.commit for r in records])
        assert rebuilt.model_dump(exclude=ownership) == stored.model_dump(exclude=ownership)
        ended: set[str] = set()
        current: str | None = None
        for record in records:
            commit = record.commit
            if commit.run_id != current:
                assert current is None or current in ended, "a second Run while one is active"
                assert commit.label == "activation" and commit.ordinal == 0
                current = commit.run_id
            assert commit.run_id not in ended, "a commit after the Run ended"
            if isinstance(commit.disposition, EndedState):
                ended.add(commit.run_id)


async def _together(ops: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*ops, return_exceptions=True))


def _machine(backend: str, url: Any) -> type[TwoClients]:
    return type(
        f"TwoClients_{backend}", (TwoClients,), {"backend": backend, "url": staticmethod(url)}
    )


SETTINGS = settings(
    max_examples=int(os.environ.get("RATCHET_RACE_EXAMPLES", "12")),
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgres", "redis"])
def test_two_clients_race_on_one_thread(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if backend in ("postgres", "redis"):
        fixture = "pg_conformance_url" if backend == "postgres" else "redis_test_url"
        fixed = str(request.getfixturevalue(fixture))
        machine = _machine(backend, lambda: fixed)
    elif backend == "sqlite":
        machine = _machine(backend, lambda: f"sqlite:///{tmp_path}/{uuid.uuid4().hex[:8]}.db")
    else:
        machine = _machine(backend, lambda: "memory://")
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=SETTINGS)
