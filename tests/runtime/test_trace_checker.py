"""The trace checker (tests/support/trace.py): each rule passes a legal commit and
reports a hand-made illegal one.

Legal traces are built from real records and folded with ``advance``; the illegal
commit of each test differs from a legal one in the one thing its rule is about.
Records the model validators would refuse are built with ``model_construct``
(``forged``, ``with_call``): the checker must not rely on the validators it backs up.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.batch import (
    ActiveToolBatch,
    Awaiting,
    CallSpec,
    Completed,
    Executing,
    Requested,
    ToolOutput,
    ToolRecoveryPolicy,
    complete,
    finalize,
    mark_awaiting,
    mark_executing,
    mark_indeterminate,
    open_batch,
    seal,
)
from runtime.commit import Frontier, ThreadCommit
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    Cancelled,
    EndedState,
    Failed,
    MaxSteps,
    Natural,
    PauseTarget,
    ResumeTicket,
    RunningState,
    ThreadStatus,
    ToolWaitTarget,
)
from runtime.messages import AssistantMessage, ToolResultMessage, ToolUse, UserMessage
from runtime.rules import advance
from tests.support.trace import TraceViolation, check, legal_next

T, R, R2 = ThreadId("t"), RunId("r"), RunId("r2")
A, B, C = CallId("a"), CallId("b"), CallId("c")
OK, KEY = ToolOutput(content="ok"), CorrelationId("key-1")
RUNNING = RunningState(run_id=R)
NATURAL = EndedState(run_id=R, cause=Natural())
CANCEL = EndedState(run_id=R, cause=Cancelled())
PAUSED = AwaitingState(
    run_id=R, ticket=ResumeTicket(correlation=KEY, run_id=R, thread_id=T, target=PauseTarget())
)
LOST = ThreadStatus(state="failed", since=5, reason="execution_lost")
HI, AGAIN = UserMessage(id="m1", text="hi"), UserMessage(id="m2", text="again")
DONE = AssistantMessage(text="done")
REPLAY_SAFE = ToolRecoveryPolicy(mode="replay_safe", max_attempts=2)


def asked(*calls: tuple[CallId, str]) -> AssistantMessage:
    return AssistantMessage(
        tool_calls=tuple(ToolUse(call_id=c, tool=t, arguments="{}") for c, t in calls)
    )


ASK_AB, ASK_C = asked((A, "charge"), (B, "lookup")), asked((C, "delete"))
STEP1 = open_batch(R, 1, [CallSpec(call_id=C, tool="delete", arguments="{}")])


# ---- building traces ------------------------------------------------------------------


def make(f: Frontier, label: str, disposition: Any = None, **fields: Any) -> ThreadCommit:
    """The next commit after ``f``: its run's next ordinal, extending the chain head."""
    run = fields.pop("run", f.run_id or R)
    fields.setdefault("ordinal", f.next_ordinal if run == f.run_id else 0)
    fields.setdefault("prev", f.head)
    disposition = disposition or RunningState(run_id=run)
    return ThreadCommit(thread_id=T, run_id=run, label=label, disposition=disposition, **fields)


def forged(f: Frontier, label: str, disposition: Any = RUNNING, **fields: Any) -> ThreadCommit:
    """Like ``make``, but built past the validators (for records they would refuse)."""
    fields.setdefault("ordinal", f.next_ordinal)
    fields.setdefault("prev", f.head)
    return ThreadCommit.model_construct(
        thread_id=T, run_id=R, label=label, disposition=disposition, **fields
    )


def go(f: Frontier, label: str, disposition: Any = None, **fields: Any) -> Frontier:
    """``f`` after the legal commit ``make`` builds from these parts."""
    commit = make(f, label, disposition, **fields)
    assert legal_next(f, commit) == []
    return advance(f, commit)


def refused(f: Frontier, commit: ThreadCommit, rule: str) -> list[str]:
    reasons = legal_next(f, commit)
    assert any(r.startswith(rule) for r in reasons), reasons
    return reasons


def results(batch: ActiveToolBatch) -> tuple[ToolResultMessage, ...]:
    outputs = [(c, c.to_model_output()) for c in batch.calls]
    return tuple(
        ToolResultMessage(call_id=c.call_id, tool=c.tool, content=o.content, is_error=o.is_error)
        for c, o in outputs
    )


def with_call(batch: ActiveToolBatch, call_id: CallId, **changes: Any) -> ActiveToolBatch:
    calls = tuple(c.model_copy(update=changes) if c.call_id == call_id else c for c in batch.calls)
    return ActiveToolBatch.model_construct(**{**dict(batch), "calls": calls})


def step0() -> ActiveToolBatch:
    specs = [
        CallSpec(call_id=A, tool="charge", arguments="{}"),  # never_replay
        CallSpec(call_id=B, tool="lookup", arguments="{}", policy=REPLAY_SAFE),
    ]
    return mark_executing(open_batch(R, 0, specs), A)


def started() -> Frontier:
    return go(Frontier(thread_id=T), "activation", messages=(HI,))


def opened() -> Frontier:
    """Step 0 open: a (never_replay) executing(1), b (replay_safe) requested."""
    return go(started(), "inference", messages=(ASK_AB,), batch=step0())


def finished() -> Frontier:
    """Step 0 with both calls completed, its results not yet published."""
    f = opened()
    f = go(f, "results", batch=complete(f.batch, A, OK))
    f = go(f, "executing", batch=mark_executing(f.batch, B))
    return go(f, "results", batch=complete(f.batch, B, OK))


def ticket(call: CallId = C, wait: str = "permission", tool: str = "delete") -> ResumeTicket:
    target = ToolWaitTarget(wait=wait, call_id=call, tool=tool, arguments="{}")
    return ResumeTicket(correlation=KEY, run_id=R, thread_id=T, target=target)


def waiting(wait: str = "permission") -> Frontier:
    """Step 1: call c awaits ``wait`` under the run's ticket."""
    f = finished()
    f = go(f, "inference", messages=(*results(f.batch), ASK_C), batch=STEP1)
    awaited = mark_awaiting(f.batch, C, wait, KEY)  # type: ignore[arg-type]
    return go(f, "awaiting", AwaitingState(run_id=R, ticket=ticket(wait=wait)), batch=awaited)


def ended() -> Frontier:
    f = finished()
    return go(f, "ended", NATURAL, messages=(*results(f.batch), DONE))


# ---- the log: chain, runs, ordinals -------------------------------------------------------


def test_a_whole_run_with_a_wait_and_a_second_run_is_legal():
    f = waiting()
    f = go(f, "resume", batch=mark_executing(f.batch, C))
    f = go(f, "results", batch=complete(f.batch, C, OK))
    f = go(f, "ended", NATURAL, messages=(*results(f.batch), DONE), batch=finalize(f.batch))
    assert go(f, "activation", run=R2, messages=(AGAIN,)).run_id == R2


def test_the_chain_link_must_name_the_head():
    f = started()
    refused(f, make(f, "status", status=LOST, prev="0" * 64), "chain: prev")
    elsewhere = make(f, "status", status=LOST).model_copy(update={"thread_id": ThreadId("u")})
    refused(f, elsewhere, "chain: commit of thread u")


def test_ended_is_absorbing_for_its_run():
    f = ended()
    refused(f, forged(f, "status", f.run_state, status=LOST), "ended:")


def test_a_new_run_only_after_the_last_ended_and_starting_with_its_activation():
    refused(opened(), make(opened(), "activation", run=R2, messages=(AGAIN,)), "runs:")
    f = ended()
    go(f, "activation", run=R2, messages=(AGAIN,))
    refused(f, make(f, "inference", run=R2, messages=(DONE,)), "runs:")
    refused(f, make(f, "activation", run=R2, messages=(AGAIN,), ordinal=3), "ordinal:")
    refused(f, make(f, "activation", run=R2), "messages:")
    refused(started(), make(started(), "activation", messages=(AGAIN,)), "runs:")
    failed = EndedState(run_id=R, cause=Failed(failure="capability_bound", code="x", message="y"))
    go(Frontier(thread_id=T), "activation", failed, messages=(HI,))  # fails before inference


def test_ordinals_are_consecutive_and_input_is_delivered_once():
    f = started()
    refused(f, make(f, "inference", messages=(DONE,), ordinal=2), "ordinal:")
    f = ended()
    refused(f, make(f, "activation", run=R2, messages=(HI,)), "input: message 'm1'")


# ---- the disposition and what a label carries ---------------------------------------------


def test_an_awaiting_run_leaves_its_wait_only_by_resume_or_end():
    f = waiting()
    refused(f, make(f, "results", batch=complete(f.batch, C, OK)), "disposition:")
    go(f, "resume", batch=complete(f.batch, C, OK))
    go(f, "ended", CANCEL, messages=results(seal(f.batch)), batch=seal(f.batch))
    f = opened()
    refused(f, make(f, "resume", batch=complete(f.batch, A, OK)), "disposition: only")


def test_the_label_names_the_disposition_it_leaves():
    f = opened()
    go(f, "awaiting", PAUSED)
    refused(f, make(f, "executing", PAUSED), "label:")


def test_an_awaiting_ticket_names_this_run_and_thread():
    f = opened()
    target = PauseTarget()
    elsewhere = ResumeTicket(correlation=KEY, run_id=R, thread_id=ThreadId("u"), target=target)
    wrong = AwaitingState.model_construct(run_id=R, ticket=elsewhere)
    refused(f, forged(f, "awaiting", wrong), "disposition: the ticket")


def test_a_status_commit_changes_only_the_status():
    f = opened()
    lost = go(f, "status", status=LOST)
    go(lost, "status", status=ThreadStatus(state="running", since=6))
    refused(f, make(f, "status", status=LOST, batch=complete(f.batch, A, OK)), "status:")
    refused(f, make(f, "status", status=LOST, messages=(DONE,)), "status:")
    refused(f, make(f, "status"), "status: a status commit carries")
    refused(f, make(f, "status", PAUSED, status=LOST), "status: a status commit leaves")
    later = f.status.model_copy(update={"since": f.status.since + 1})
    refused(f, make(f, "status", status=later), "status: since")


def test_an_end_settles_a_running_status():
    f = go(started(), "status", status=ThreadStatus(state="running", since=1))
    go(f, "ended", CANCEL, status=ThreadStatus(state="idle", since=2, reason="cancelled"))
    refused(f, make(f, "ended", CANCEL), "status: the end")


def test_a_natural_end_carries_an_answer_without_tool_calls():
    f = finished()
    refused(f, forged(f, "ended", NATURAL, messages=results(f.batch)), "end:")
    answer = (*results(f.batch), ASK_C, *results(seal(STEP1)))
    refused(f, make(f, "ended", NATURAL, messages=answer, batch=seal(STEP1)), "end:")


def test_tool_calls_without_a_batch_only_in_an_end_at_max_steps():
    f = finished()
    answer = (*results(f.batch), ASK_C)
    go(f, "ended", EndedState(run_id=R, cause=MaxSteps()), messages=answer)
    refused(f, make(f, "ended", CANCEL, messages=answer), "batch: the model's")
    refused(f, make(f, "inference", messages=answer), "batch: the model's")


def test_a_cancel_as_the_model_answers_opens_and_seals_the_batch():
    f = finished()
    messages = (*results(f.batch), ASK_C, *results(seal(STEP1)))
    go(f, "ended", CANCEL, messages=messages, batch=seal(STEP1))
    unpublished = make(f, "ended", CANCEL, messages=messages[:-1], batch=seal(STEP1))
    refused(f, unpublished, "publication: tool-batch:r:1 is finalized without")


def test_an_executing_commit_starts_an_attempt_and_a_results_commit_finishes_a_call():
    f = opened()
    refused(f, make(f, "executing", batch=complete(f.batch, A, OK)), "label:")
    refused(f, make(f, "results", batch=mark_executing(f.batch, B)), "label:")
    attempt = mark_executing(f.batch, B)
    refused(f, make(f, "executing", messages=(DONE,), batch=attempt), "messages:")


# ---- the batch of a step --------------------------------------------------------------------


def test_a_batch_id_is_tool_batch_run_step():
    f = started()
    wrong = ActiveToolBatch.model_construct(**{**dict(step0()), "batch_id": "tool-batch:r:7"})
    refused(f, forged(f, "inference", messages=(ASK_AB,), batch=wrong), "batch: id")
    specs = [CallSpec(call_id=A, tool="charge", arguments="{}")]
    late = open_batch(R, 2, [*specs, CallSpec(call_id=B, tool="lookup", arguments="{}")])
    refused(f, make(f, "inference", messages=(ASK_AB,), batch=late), "batch: step")
    other = make(f, "inference", messages=(asked((A, "charge")),), batch=step0())
    refused(f, other, "batch: tool-batch:r:0 holds other calls")
    twice = ActiveToolBatch.model_construct(**{**dict(step0()), "calls": step0().calls[:1] * 2})
    ask_twice = asked((A, "charge"), (A, "charge"))
    refused(
        f,
        forged(f, "inference", messages=(ask_twice,), batch=twice),
        "batch: tool-batch:r:0 is empty",
    )


def test_a_batch_opens_with_requested_first_attempts_and_gate_verdicts():
    f = started()
    gate_refused = complete(step0(), B, ToolOutput(content="blocked", is_error=True))
    go(f, "inference", messages=(ASK_AB,), batch=gate_refused)
    at_once = mark_awaiting(step0(), B, "permission", KEY)
    refused(f, make(f, "inference", messages=(ASK_AB,), batch=at_once), "call b: opened awaiting")
    flagged = with_call(step0(), A, phase=Executing(attempt=1, after_undispatched=True))
    refused(f, forged(f, "inference", messages=(ASK_AB,), batch=flagged), "call a:")
    ran = with_call(step0(), B, phase=Completed(output=OK), attempts=1)
    refused(f, forged(f, "inference", messages=(ASK_AB,), batch=ran), "call b: opened with 1")
    f = finished()  # only an inference (or an end) opens a step's batch
    refused(f, make(f, "executing", batch=mark_executing(STEP1, C)), "batch: a executing")


def test_the_call_set_never_changes_within_a_step():
    f = opened()
    done = complete(f.batch, A, OK)
    changed = with_call(done, B, arguments='{"x": 1}')
    refused(f, make(f, "results", batch=changed), "batch: the calls")
    repinned = with_call(done, B, policy=ToolRecoveryPolicy(mode="idempotent"))
    refused(f, make(f, "results", batch=repinned), "batch: the calls")
    fewer = ActiveToolBatch.model_construct(**{**dict(done), "calls": done.calls[:1]})
    refused(f, forged(f, "results", batch=fewer), "batch: the calls")


def test_executing_is_never_turned_back_into_requested():
    f = opened()
    back = with_call(complete(f.batch, B, OK), A, phase=Requested(), attempts=0)
    refused(f, forged(f, "results", batch=back), "call a: executing was turned back")


def test_terminal_calls_never_change():
    f = finished()
    other = with_call(f.batch, A, phase=Completed(output=ToolOutput(content="other")))
    refused(f, forged(f, "results", batch=other), "call a: completed is terminal")
    f = opened()
    f = go(f, "results", batch=mark_indeterminate(f.batch, A, "lost"))
    revived = with_call(complete(f.batch, B, OK), A, phase=Completed(output=OK))
    refused(f, forged(f, "results", batch=revived), "call a: indeterminate is terminal")


def test_never_replay_runs_again_only_after_an_undispatched_attempt():
    f = opened()
    again = with_call(f.batch, A, phase=Executing(attempt=2), attempts=2)
    refused(f, forged(f, "executing", batch=again), "call a: never_replay")
    go(f, "executing", batch=mark_executing(f.batch, A, undispatched=True))


def test_a_retry_is_the_next_attempt_within_the_pinned_budget():
    f = go(opened(), "executing", batch=mark_executing(opened().batch, B))
    f = go(f, "executing", batch=mark_executing(f.batch, B))  # replay_safe: attempt 2 of 2
    third = with_call(f.batch, B, phase=Executing(attempt=3), attempts=3)
    refused(f, forged(f, "executing", batch=third), "call b: 3 attempts exceed")
    f = opened()
    skipped = with_call(f.batch, B, phase=Executing(attempt=2), attempts=2)
    refused(f, forged(f, "executing", batch=skipped), "call b: attempt 2 does not follow 0")


def test_attempts_change_only_with_a_new_attempt_and_never_decrease():
    f = go(opened(), "results", batch=complete(opened().batch, A, OK))
    more = with_call(mark_executing(f.batch, B), A, attempts=2)
    refused(f, forged(f, "executing", batch=more), "call a: attempts changed without")
    flagged = with_call(f.batch, B, phase=Executing(attempt=1, after_undispatched=True), attempts=1)
    refused(f, forged(f, "executing", batch=flagged), "call b: after_undispatched")
    f = opened()
    fewer = with_call(f.batch, A, phase=Completed(output=OK), attempts=0)
    refused(f, forged(f, "results", batch=fewer), "call a: attempts went down")


def test_a_wait_turns_into_an_attempt_only_by_a_resume():
    f = waiting()
    attempt = mark_executing(f.batch, C)
    go(f, "resume", batch=attempt)
    refused(f, forged(f, "executing", batch=attempt), "call c: only a resume")


def test_an_awaiting_call_cannot_start_another_wait():
    f = waiting()
    k2 = CorrelationId("k2")
    other = with_call(f.batch, C, phase=Awaiting(wait="external_result", correlation=k2))
    moved = ticket(wait="external_result").model_copy(update={"correlation": k2})
    again = AwaitingState(run_id=R, ticket=moved)
    refused(f, forged(f, "awaiting", again, batch=other), "call c: an awaiting call cannot")


def test_an_inference_only_finalizes_the_batch_it_carries_on():
    f = go(opened(), "results", batch=complete(opened().batch, A, OK))
    done = complete(f.batch, B, OK)
    answer = (*results(done), DONE)
    refused(f, make(f, "inference", messages=answer, batch=finalize(done)), "label: an inference")


def test_at_most_one_call_awaits():
    f = opened()
    phase = Awaiting(wait="permission", correlation=KEY)
    two = with_call(with_call(f.batch, A, phase=phase), B, phase=phase)
    target = AwaitingState(run_id=R, ticket=ticket(A, tool="charge"))
    refused(f, forged(f, "awaiting", target, batch=two), "batch: 2 calls")


def test_finalize_only_when_every_call_is_terminal():
    f = opened()
    early = ActiveToolBatch.model_construct(
        **{**dict(complete(f.batch, A, OK)), "status": "finalized"}
    )
    refused(f, forged(f, "results", batch=early), "batch: tool-batch:r:0 is finalized with")


def test_an_end_seals_every_unfinished_call():
    f = opened()
    sealed = seal(f.batch)
    go(f, "ended", CANCEL, messages=results(sealed), batch=sealed)
    refused(f, make(f, "ended", CANCEL), "end:")
    refused(f, forged(f, "ended", CANCEL, batch=mark_indeterminate(f.batch, A, "x")), "end:")


# ---- publication ---------------------------------------------------------------------------


def test_the_next_inference_never_sees_half_a_batch():
    f = go(opened(), "results", batch=complete(opened().batch, A, OK))  # b still requested
    half = (ToolResultMessage(call_id=A, tool="charge", content="ok"), DONE)
    reasons = refused(f, make(f, "inference", messages=half), "publication:")
    assert any("unfinished" in r for r in reasons)
    refused(f, make(f, "inference", messages=(ASK_C,), batch=STEP1), "batch:")


def test_results_are_published_whole_in_call_order_once():
    f = finished()
    ordered = results(f.batch)
    go(f, "inference", messages=(*ordered, ASK_C), batch=STEP1)
    rule = "publication: not exactly"
    refused(f, make(f, "inference", messages=(*ordered[::-1], ASK_C), batch=STEP1), rule)
    refused(f, make(f, "inference", messages=(ordered[0], ASK_C), batch=STEP1), rule)
    altered = (ordered[0].model_copy(update={"content": "forged"}), ordered[1], ASK_C)
    refused(f, make(f, "inference", messages=altered, batch=STEP1), rule)
    refused(f, make(f, "inference", messages=(ASK_C,), batch=STEP1), "publication:")
    text_only = go(f, "inference", messages=(*ordered, AssistantMessage(text="hm")))
    again = (*ordered, DONE)
    refused(text_only, make(text_only, "inference", messages=again), "publication:")
    go(text_only, "inference", messages=(DONE,))
    stray = ToolResultMessage(call_id=A, tool="charge", content="ok")
    refused(started(), make(started(), "inference", messages=(stray, DONE)), "publication: tool")


def test_a_batch_is_not_closed_without_publishing_its_results():
    f = finished()
    go(f, "ended", CANCEL, messages=results(f.batch))
    refused(f, make(f, "ended", CANCEL), "publication:")
    finalized = make(f, "inference", messages=(DONE,), batch=finalize(f.batch))
    refused(f, finalized, "publication:")


def test_a_resume_may_publish_the_finished_batch_with_the_users_input():
    f = go(finished(), "awaiting", PAUSED)
    go(f, "resume", messages=(*results(f.batch), AGAIN), batch=finalize(f.batch))
    refused(f, make(f, "resume", messages=(AGAIN,)), "publication:")


# ---- waits ---------------------------------------------------------------------------------


def test_a_call_awaits_only_under_a_ticket_that_targets_it():
    f = opened()
    delegated = mark_awaiting(f.batch, A, "delegation", KEY)
    # the shape of the engine's lone-child delegation (a results commit, then the ticket)
    refused(f, make(f, "results", batch=delegated), "wait:")
    for_a = AwaitingState(run_id=R, ticket=ticket(A, "delegation", "charge"))
    go(f, "awaiting", for_a, batch=delegated)
    for_b = AwaitingState(run_id=R, ticket=ticket(B, "delegation", "lookup"))
    refused(f, make(f, "awaiting", for_b, batch=delegated), "wait:")
    other_kind = AwaitingState(run_id=R, ticket=ticket(A, "permission", "charge"))
    refused(f, make(f, "awaiting", other_kind, batch=delegated), "wait:")


def test_a_tool_ticket_names_a_call_that_awaits_it():
    f = finished()
    f = go(f, "inference", messages=(*results(f.batch), ASK_C), batch=STEP1)
    nowhere = AwaitingState(run_id=R, ticket=ticket(CallId("z")))
    refused(f, make(f, "awaiting", nowhere), "wait: the ticket waits on call z")
    renamed = AwaitingState(run_id=R, ticket=ticket(tool="drop"))
    awaited = mark_awaiting(f.batch, C, "permission", KEY)
    refused(f, make(f, "awaiting", renamed, batch=awaited), "wait: the ticket names another")


def test_a_resume_releases_its_call_as_the_wait_kind_allows():
    f = waiting("external_result")
    go(f, "resume", batch=complete(f.batch, C, OK))
    refused(f, make(f, "resume", batch=mark_executing(f.batch, C)), "resume:")
    refused(f, make(f, "resume"), "resume:")
    f = waiting("scheduled_action")
    go(f, "resume", batch=mark_executing(f.batch, C))
    refused(f, make(f, "resume", batch=mark_indeterminate(f.batch, C, "x")), "resume:")


def test_a_delegation_call_may_stay_executing_while_others_finish():
    policy = ToolRecoveryPolicy(mode="durable_request")
    specs = [
        CallSpec(call_id=A, tool="delegate", arguments="{}", policy=policy),
        CallSpec(call_id=B, tool="lookup", arguments="{}", policy=REPLAY_SAFE),
    ]
    batch = mark_executing(mark_executing(open_batch(R, 0, specs), A), B)
    f = go(started(), "inference", messages=(asked((A, "delegate"), (B, "lookup")),), batch=batch)
    f = go(f, "results", batch=complete(f.batch, B, OK))
    go(f, "results", batch=complete(f.batch, A, OK))


# ---- the suite's hook -----------------------------------------------------------------------


def test_check_logs_each_reason_as_a_json_line_and_raises(tmp_path, monkeypatch):
    log = tmp_path / "violations.jsonl"
    monkeypatch.setenv("RATCHET_TRACE_LOG", str(log))
    f = waiting()
    with pytest.raises(TraceViolation) as info:
        check(f, make(f, "results", batch=complete(f.batch, C, OK)))
    violation = info.value
    assert (violation.thread_id, violation.run_id, violation.label) == (T, R, "results")
    assert violation.reasons and violation.reasons[0] in str(violation)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["reason"] for line in lines] == list(violation.reasons)
    assert {(line["label"], line["run_id"], line["thread_id"]) for line in lines} == {
        ("results", R, T)
    }


def test_check_passes_legal_commits_and_logs_illegal_ones(tmp_path, monkeypatch):
    log = tmp_path / "violations.jsonl"
    monkeypatch.setenv("RATCHET_TRACE_LOG", str(log))
    f = opened()
    check(f, make(f, "results", batch=complete(f.batch, A, OK)))
    assert not log.exists()
    with pytest.raises(TraceViolation, match="ordinal"):
        check(f, make(f, "results", batch=complete(f.batch, A, OK), ordinal=7))
    assert "ordinal" in log.read_text()
    log.unlink()
    monkeypatch.delenv("RATCHET_TRACE_LOG")
    with pytest.raises(TraceViolation):
        check(f, make(f, "executing", batch=complete(f.batch, A, OK)))
