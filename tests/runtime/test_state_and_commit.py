"""State commands and their merge policies; ThreadCommit legality and hashing."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime import Command, CorruptRecord, StateConflict, ThreadCommit
from runtime.batch import CallSpec, open_batch
from runtime.commit import decode_commit
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    Natural,
    PauseTarget,
    ResumeTicket,
    RunningState,
)
from runtime.messages import AssistantMessage
from runtime.state import apply_commands, empty_state

R, T = RunId("r"), ThreadId("t")


def test_exclusive_set_twice_in_one_commit_conflicts():
    with pytest.raises(StateConflict, match="set twice"):
        apply_commands(empty_state(), [Command(key="k", value=1), Command(key="k", value=2)])


def test_disjoint_fields_merge_and_overlaps_conflict():
    s = apply_commands(
        empty_state(),
        [
            Command(key="k", merge="disjoint", value={"a": 1}),
            Command(key="k", merge="disjoint", value={"b": 2}),
        ],
    )
    assert s["thread"]["k"] == {"a": 1, "b": 2}
    with pytest.raises(StateConflict):
        apply_commands(
            s,
            [
                Command(key="k", merge="disjoint", value={"a": 1}),
                Command(key="k", merge="disjoint", value={"a": 3}),
            ],
        )
    with pytest.raises(ValidationError):
        Command(key="k", merge="disjoint", value=5)


def test_commutative_accumulates_in_producer_order():
    s = apply_commands(
        empty_state(),
        [
            Command(key="n", merge="commutative", value=2),
            Command(key="n", merge="commutative", value=3),
            Command(key="l", merge="commutative", value=["a"]),
            Command(key="l", merge="commutative", value=["b"]),
        ],
    )
    assert s["thread"] == {"n": 5, "l": ["a", "b"]}
    s = apply_commands(s, [Command(key="n", merge="commutative", value=1, scope="thread")])
    assert s["thread"]["n"] == 6


def test_a_failed_apply_leaves_the_state_untouched():
    before = apply_commands(empty_state(), [Command(key="k", value=1)])
    with pytest.raises(StateConflict):
        apply_commands(before, [Command(key="k", value=2), Command(key="k", value=3)])
    assert before["thread"] == {"k": 1}


def test_remove_and_scopes():
    s = apply_commands(
        empty_state(), [Command(key="a", value=1, scope="run"), Command(key="b", value=2)]
    )
    s = apply_commands(s, [Command(key="a", scope="run", op="remove")])
    assert s == {"thread": {"b": 2}, "run": {}}


def test_illegal_dispositions_cannot_be_built():
    ticket = ResumeTicket(
        correlation=CorrelationId("c"), run_id=RunId("other"), thread_id=T, target=PauseTarget()
    )
    with pytest.raises(ValidationError):
        AwaitingState(run_id=R)  # awaiting without a ticket
    with pytest.raises(ValidationError):
        RunningState(run_id=R, ticket=ticket)  # a ticket on running
    with pytest.raises(ValidationError, match="another run or thread"):
        ThreadCommit(
            thread_id=T,
            run_id=RunId("other"),
            ordinal=0,
            label="executing",
            disposition=AwaitingState(
                run_id=RunId("other"), ticket=ticket.model_copy(update={"thread_id": "x"})
            ),
        )
    with pytest.raises(ValidationError, match="assistant output"):
        ThreadCommit(
            thread_id=T,
            run_id=R,
            ordinal=0,
            label="ended",
            disposition=EndedState(run_id=R, cause=Natural()),
        )
    open_b = open_batch(R, 0, [CallSpec(call_id=CallId("c"), tool="t", arguments="{}")])
    with pytest.raises(ValidationError, match="sealed"):
        ThreadCommit(
            thread_id=T,
            run_id=R,
            ordinal=0,
            label="ended",
            batch=open_b,
            messages=(AssistantMessage(text="x"),),
            disposition=EndedState(run_id=R, cause=Natural()),
        )


def test_payload_hash_is_canonical_and_operation_id_stable():
    a = ThreadCommit(
        thread_id=T,
        run_id=R,
        ordinal=4,
        label="inference",
        disposition=RunningState(run_id=R),
        messages=(AssistantMessage(text="hi"),),
    )
    b = ThreadCommit.model_validate_json(a.encoded)
    assert a.payload_hash == b.payload_hash and len(a.payload_hash) == 64
    assert a.operation_id == "r:commit:4"
    c = a.model_copy(update={"messages": (AssistantMessage(text="ho"),)})
    assert ThreadCommit.model_validate(c.model_dump()).payload_hash != a.payload_hash


def test_corrupt_commit_names_thread_and_seq():
    with pytest.raises(CorruptRecord, match="thread 't' at seq 7"):
        decode_commit('{"thread_id": "t"}', "t", 7)
