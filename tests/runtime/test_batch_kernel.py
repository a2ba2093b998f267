"""The ActiveToolBatch kernel: hypothesis stateful tests and the codec."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime import (
    CallSpec,
    CorruptBatch,
    InvalidTransition,
    ToolOutput,
    ToolRecoveryPolicy,
    complete,
    decode_batch,
    finalize,
    mark_awaiting,
    mark_executing,
    mark_indeterminate,
    open_batch,
    seal,
)
from runtime.batch import check_invariants
from runtime.ids import CallId, CorrelationId, RunId

MODES = ["never_replay", "replay_safe", "idempotent", "durable_request"]
calls = st.integers(min_value=0, max_value=3).map(lambda i: CallId(f"c{i}"))
outputs = st.sampled_from([ToolOutput(content="a"), ToolOutput(content="b", is_error=True)])


def new_batch(n: int = 4, modes=None):
    modes = modes or ["never_replay", "replay_safe", "idempotent", "replay_safe"]
    specs = [
        CallSpec(
            call_id=CallId(f"c{i}"),
            tool="t",
            arguments="{}",
            policy=ToolRecoveryPolicy(mode=modes[i % len(modes)], max_attempts=2),
        )
        for i in range(n)
    ]
    return open_batch(RunId("run"), 3, specs)


class BatchMachine(RuleBasedStateMachine):
    """Random transition sequences never break an invariant; refused ones change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = new_batch()
        self.history: dict[CallId, list[str]] = {c.call_id: ["requested"] for c in self.batch.calls}

    def attempt(self, fn, *args, **kwargs) -> None:
        before = self.batch
        try:
            self.batch = fn(self.batch, *args, **kwargs)
        except InvalidTransition:
            assert self.batch == before
            return
        for call in self.batch.calls:
            if self.history[call.call_id][-1] != call.phase.kind:
                self.history[call.call_id].append(call.phase.kind)
            prior = before.call(call.call_id)
            if prior.terminal:
                assert call == prior, "a terminal call changed"
            if prior.phase.kind == "executing":
                assert call.phase.kind != "requested", "executing went back to requested"
            assert call.attempts >= prior.attempts

    @rule(call=calls, undispatched=st.booleans())
    def execute(self, call, undispatched):
        self.attempt(mark_executing, call, undispatched=undispatched)

    @rule(call=calls)
    def wait(self, call):
        self.attempt(mark_awaiting, call, "permission", CorrelationId(f"{call}:w"))

    @rule(call=calls, output=outputs)
    def complete_call(self, call, output):
        self.attempt(complete, call, output)

    @rule(call=calls)
    def indeterminate(self, call):
        self.attempt(mark_indeterminate, call, "lost")

    @rule()
    def finalize_batch(self):
        self.attempt(finalize)

    @precondition(lambda self: self.batch.status == "open")
    @rule()
    def seal_batch(self):
        self.attempt(seal)
        assert self.batch.status == "finalized" and self.batch.all_terminal
        assert seal(self.batch) == self.batch  # idempotent

    @invariant()
    def invariants_hold(self):
        check_invariants(self.batch)
        assert sum(c.phase.kind == "awaiting" for c in self.batch.calls) <= 1
        for call in self.batch.calls:
            assert call.attempts <= call.policy.max_attempts

    @invariant()
    def codec_round_trips(self):
        assert decode_batch(self.batch.model_dump_json()) == self.batch


TestBatchMachine = BatchMachine.TestCase
TestBatchMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_identical_recompletion_is_a_noop_and_a_different_one_an_error():
    b = complete(new_batch(), CallId("c0"), ToolOutput(content="x"))
    assert complete(b, CallId("c0"), ToolOutput(content="x")) == b
    with pytest.raises(InvalidTransition, match="different output"):
        complete(b, CallId("c0"), ToolOutput(content="y"))


def test_finalize_requires_every_call_terminal():
    b = complete(new_batch(2), CallId("c0"), ToolOutput(content="x"))
    with pytest.raises(InvalidTransition, match="not terminal"):
        finalize(b)


def test_batches_must_be_non_empty_with_unique_ids():
    with pytest.raises(InvalidTransition, match="at least one call"):
        open_batch(RunId("r"), 0, [])
    spec = CallSpec(call_id=CallId("x"), tool="t", arguments="{}")
    with pytest.raises(InvalidTransition, match="unique"):
        open_batch(RunId("r"), 0, [spec, spec])


def test_only_one_call_may_await():
    b = mark_awaiting(new_batch(), CallId("c0"), "permission", CorrelationId("a"))
    with pytest.raises(InvalidTransition, match="at most one"):
        mark_awaiting(b, CallId("c1"), "permission", CorrelationId("b"))


def test_attempt_budget_and_never_replay():
    b = mark_executing(new_batch(), CallId("c0"))  # never_replay
    with pytest.raises(InvalidTransition, match="never_replay"):
        mark_executing(b, CallId("c0"))
    b = mark_executing(mark_executing(b, CallId("c1")), CallId("c1"))  # replay_safe, budget 2
    with pytest.raises(InvalidTransition, match="used all 2 attempts"):
        mark_executing(b, CallId("c1"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["exec", "wait", "done", "lost"]), calls), max_size=12))
def test_any_reachable_batch_round_trips(steps):
    b = new_batch()
    for op, call in steps:
        fn = {
            "exec": mark_executing,
            "done": complete,
            "lost": mark_indeterminate,
            "wait": mark_awaiting,
        }[op]
        args = {
            "exec": (),
            "done": (ToolOutput(content="o"),),
            "lost": ("r",),
            "wait": ("external_result", CorrelationId("w")),
        }[op]
        with contextlib.suppress(InvalidTransition):
            b = fn(b, call, *args)
    assert decode_batch(b.model_dump_json()) == b


def _mutate(data: dict, how: str) -> dict:
    calls = data["calls"]
    if how == "duplicate_ids":
        calls[1]["call_id"] = calls[0]["call_id"]
    elif how == "two_awaiting":
        for c in calls[:2]:
            c["phase"] = {"kind": "awaiting", "wait": "permission", "correlation": "x"}
    elif how == "over_budget":
        calls[0]["attempts"] = 9
        calls[0]["phase"] = {"kind": "executing", "attempt": 9}
    elif how == "attempt_mismatch":
        calls[0]["phase"] = {"kind": "executing", "attempt": 2}
        calls[0]["attempts"] = 1
    elif how == "finalized_open_calls":
        data["status"] = "finalized"
    elif how == "empty":
        data["calls"] = []
    elif how == "unknown_phase":
        calls[0]["phase"] = {"kind": "teleported"}
    elif how == "wrong_schema":
        data["schema_version"] = 99
    elif how == "foreign_operation_id":
        calls[0]["operation_id"] = "tool-batch:other:1:c0"
    elif how == "extra_field":
        data["sneaky"] = True
    return data


@pytest.mark.parametrize(
    "how",
    [
        "duplicate_ids",
        "two_awaiting",
        "over_budget",
        "attempt_mismatch",
        "finalized_open_calls",
        "empty",
        "unknown_phase",
        "wrong_schema",
        "foreign_operation_id",
        "extra_field",
    ],
)
def test_corrupted_encodings_are_rejected(how):
    data = json.loads(new_batch().model_dump_json())
    with pytest.raises(CorruptBatch):
        decode_batch(json.dumps(_mutate(data, how)))


def test_truncated_json_is_rejected():
    with pytest.raises(CorruptBatch):
        decode_batch(new_batch().model_dump_json()[:-5])
