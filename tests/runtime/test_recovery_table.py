"""One test row per row of the recovery table (DESIGN §4), on hand-built frontiers."""

from __future__ import annotations

import pytest

from runtime import (
    CallSpec,
    ToolOutput,
    ToolRecoveryPolicy,
    complete,
    decide,
    mark_awaiting,
    mark_executing,
    open_batch,
)
from runtime.commit import Frontier
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    Natural,
    ResumeTicket,
    RunningState,
    ToolWaitTarget,
)
from runtime.recovery import (
    INTERRUPTED,
    ContinueStep,
    KeepTerminal,
    MarkIndeterminate,
    NoRun,
    Reconnect,
    Replay,
    ReturnTerminus,
    RunGates,
    WaitForResume,
    WaitOnCall,
)

RUN, THREAD = RunId("r"), ThreadId("t")
SAFE = ToolRecoveryPolicy(mode="replay_safe", max_attempts=2)
DURABLE = ToolRecoveryPolicy(mode="durable_request", max_attempts=2)


def batch(*policies: ToolRecoveryPolicy):
    specs = [
        CallSpec(call_id=CallId(f"c{i}"), tool="t", arguments="{}", policy=p)
        for i, p in enumerate(policies)
    ]
    return open_batch(RUN, 0, specs)


def running(b=None) -> Frontier:
    return Frontier(thread_id=THREAD, run_id=RUN, run_state=RunningState(run_id=RUN), batch=b)


def supports_all(tool: str, mode: str) -> bool:
    return True


def c(i: int) -> CallId:
    return CallId(f"c{i}")


TICKET = ResumeTicket(
    correlation=CorrelationId("x"),
    run_id=RUN,
    thread_id=THREAD,
    target=ToolWaitTarget(wait="permission", call_id=c(0), tool="t", arguments="{}"),
)

ROWS = [
    ("no run yet", Frontier(thread_id=THREAD), supports_all, NoRun(), ()),
    ("running, no open batch", running(), supports_all, ContinueStep(), ()),
    (
        "a call requested",
        running(batch(SAFE)),
        supports_all,
        ContinueStep(),
        (RunGates(call_id=c(0)),),
    ),
    (
        "executing, never_replay",
        running(mark_executing(batch(ToolRecoveryPolicy()), c(0))),
        supports_all,
        ContinueStep(),
        (MarkIndeterminate(call_id=c(0), reason=INTERRUPTED),),
    ),
    (
        "executing, replay_safe with budget",
        running(mark_executing(batch(SAFE), c(0))),
        supports_all,
        ContinueStep(),
        (Replay(call_id=c(0), attempt=2),),
    ),
    (
        "executing, tool dropped the mode",
        running(mark_executing(batch(SAFE), c(0))),
        lambda tool, mode: mode == "never_replay",
        ContinueStep(),
        (
            MarkIndeterminate(
                call_id=c(0), reason="tool no longer supports the pinned mode replay_safe"
            ),
        ),
    ),
    (
        "executing, budget exhausted",
        running(mark_executing(mark_executing(batch(SAFE), c(0)), c(0))),
        supports_all,
        ContinueStep(),
        (MarkIndeterminate(call_id=c(0), reason="all 2 attempts used"),),
    ),
    (
        "executing, durable_request (a delegation): its attempt goes on, whatever its count",
        running(mark_executing(mark_executing(batch(DURABLE), c(0)), c(0))),
        supports_all,
        ContinueStep(),
        (Reconnect(call_id=c(0)),),
    ),
    (
        "a call awaiting",
        Frontier(
            thread_id=THREAD,
            run_id=RUN,
            run_state=AwaitingState(run_id=RUN, ticket=TICKET),
            batch=mark_awaiting(batch(SAFE), c(0), "permission", CorrelationId("x")),
        ),
        supports_all,
        WaitForResume(ticket=TICKET),
        (WaitOnCall(call_id=c(0)),),
    ),
    (
        "some calls terminal, batch open",
        running(complete(batch(SAFE, SAFE), c(0), ToolOutput(content="ok"))),
        supports_all,
        ContinueStep(),
        (KeepTerminal(call_id=c(0)), RunGates(call_id=c(1))),
    ),
    (
        "ended",
        Frontier(thread_id=THREAD, run_id=RUN, run_state=EndedState(run_id=RUN, cause=Natural())),
        supports_all,
        ReturnTerminus(cause=Natural()),
        (),
    ),
]


@pytest.mark.parametrize(
    ("frontier", "supports", "run_action", "call_actions"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_recovery_row(frontier, supports, run_action, call_actions):
    decision = decide(frontier, supports)
    assert decision.run == run_action
    assert decision.calls == call_actions


def test_executing_is_never_turned_back_into_requested():
    for row in ROWS:
        for action in decide(row[1], row[2]).calls:
            if isinstance(action, RunGates):
                call = row[1].batch.call(action.call_id)
                assert call.phase.kind == "requested"
