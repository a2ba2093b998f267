"""State commands and their merge policies; ThreadCommit legality and hashing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
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


def test_exclusive_is_one_writer_per_commit():
    with pytest.raises(StateConflict, match="written twice"):
        apply_commands(empty_state(), [Command(key="k", value=1), Command(key="k", value=2)])
    removed_twice = [Command(key="k", op="remove"), Command(key="k", op="remove")]
    with pytest.raises(StateConflict, match="written twice"):
        apply_commands(empty_state(), removed_twice)
    # one writer replaces what is stored, whatever it was
    s = apply_commands(empty_state(), [Command(key="k", value={"a": 1})])
    assert apply_commands(s, [Command(key="k", value=2)])["thread"]["k"] == 2


def test_disjoint_commands_of_one_commit_set_different_fields():
    s = apply_commands(
        empty_state(),
        [
            Command(key="k", merge="disjoint", value={"a": 1}),
            Command(key="k", merge="disjoint", value={"b": 2}),
        ],
    )
    assert s["thread"]["k"] == {"a": 1, "b": 2}
    # a field already stored is simply set again: only commands of one commit conflict
    again = [
        Command(key="k", merge="disjoint", value={"c": 3}),
        Command(key="k", merge="disjoint", value={"a": 9}),
    ]
    assert apply_commands(s, again)["thread"]["k"] == {"a": 9, "b": 2, "c": 3}
    for value in (1, 3):  # the same field twice in one commit, equal or not
        with pytest.raises(StateConflict, match="field 'a' set twice"):
            apply_commands(
                s,
                [
                    Command(key="k", merge="disjoint", value={"a": 1}),
                    Command(key="k", merge="disjoint", value={"a": value}),
                ],
            )
    with pytest.raises(ValidationError):
        Command(key="k", merge="disjoint", value=5)
    stored_number = apply_commands(empty_state(), [Command(key="n", value=5)])
    with pytest.raises(StateConflict, match="not an object"):
        apply_commands(stored_number, [Command(key="n", merge="disjoint", value={"a": 1})])


def test_commutative_counters_add_and_lists_are_sets():
    s = apply_commands(
        empty_state(),
        [
            Command(key="n", merge="commutative", value=2),
            Command(key="n", merge="commutative", value=3),
            Command(key="l", merge="commutative", value=["b", "a"]),
            Command(key="l", merge="commutative", value=["a", {"x": 1}]),
            Command(key="o", merge="commutative", value={"hits": 1, "tags": ["x"]}),
            Command(key="o", merge="commutative", value={"hits": 2, "tags": ["y"]}),
        ],
    )
    assert s["thread"]["n"] == 5
    assert s["thread"]["l"] == ["a", "b", {"x": 1}]  # each member once, canonical order
    assert s["thread"]["o"] == {"hits": 3, "tags": ["x", "y"]}
    s = apply_commands(s, [Command(key="n", merge="commutative", value=-1)])
    assert s["thread"]["n"] == 4
    with pytest.raises(StateConflict, match="cannot add"):
        apply_commands(s, [Command(key="l", merge="commutative", value=1)])


@pytest.mark.parametrize("value", [0.5, "text", True, None, {"a": 0.5}, {"a": "x"}], ids=repr)
def test_commutative_refuses_what_has_no_order_free_sum(value):
    with pytest.raises(ValidationError, match="commutative"):
        Command(key="k", merge="commutative", value=value)
    with pytest.raises(ValidationError, match="commutative"):
        Command(key="k", merge="commutative", op="remove")


_COMMUTATIVE = st.recursive(
    st.integers(-1000, 1000) | st.lists(st.integers(0, 5) | st.text(max_size=2), max_size=3),
    lambda inner: st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
    max_leaves=6,
)


@given(st.lists(_COMMUTATIVE, min_size=1, max_size=5), st.randoms())
def test_commutative_results_do_not_depend_on_the_order_of_commands(values, rng):
    commands = [Command(key="k", merge="commutative", value=v) for v in values]
    shuffled = list(commands)
    rng.shuffle(shuffled)
    try:
        first = apply_commands(empty_state(), commands)
    except StateConflict:
        with pytest.raises(StateConflict):
            apply_commands(empty_state(), shuffled)
        return
    assert apply_commands(empty_state(), shuffled) == first


async def test_a_commutative_sum_no_store_could_read_back_is_a_conflict(tmp_path):
    """Each value of 4,300 digits is storable (``check_json_value``); their sum of 4,301
    was folded and written into a SQL store's frontier, which no read could decode
    again: the thread unreadable after a Run that ended ``natural``."""
    from runtime import Agent, Hook, HookOutput, InProcessRunner, ModelResponse, ScriptedModel
    from runtime.lifecycle import Failed
    from storage.url import open_store

    big = 9 * 10**4299
    counter = {"n": Command(key="n", merge="commutative", value=big)}
    with pytest.raises(StateConflict, match="more digits than JSON may hold"):
        apply_commands(empty_state(), [counter["n"]] * 2)
    within = apply_commands(
        empty_state(), [counter["n"], Command(key="n", merge="commutative", value=-big)]
    )
    assert within["thread"]["n"] == 0
    nested = Command(key="o", merge="commutative", value={"hits": big})
    with pytest.raises(StateConflict, match=r"thread:o\.hits"):
        apply_commands(apply_commands(empty_state(), [nested]), [nested])  # across commits

    store = await open_store(f"sqlite:///{tmp_path}/s.db")
    hook = Hook("StepStart", lambda _: HookOutput(commands=[counter["n"]] * 2))
    agent = Agent(name="a", model=ScriptedModel([ModelResponse(text="x")]), hooks=[hook])
    f = await InProcessRunner(agent, store).start("go", thread_id="t")
    assert isinstance(f.run_state, EndedState) and isinstance(f.run_state.cause, Failed)
    assert f.run_state.cause.code == "StateConflict"
    assert (await store.load(ThreadId("t"))).run_state == f.run_state  # still readable
    await store.close()


def test_mixed_policies_on_one_key_conflict():
    with pytest.raises(StateConflict, match="mixed policies"):
        apply_commands(
            empty_state(),
            [Command(key="k", value=1), Command(key="k", merge="commutative", value=1)],
        )


def test_state_seen_by_anyone_is_read_only():
    s = apply_commands(empty_state(), [Command(key="k", value={"a": [1, 2]})])
    for mutate in (
        lambda: s["thread"].__setitem__("x", 1),
        lambda: s["thread"]["k"].update(b=2),
        lambda: s["thread"]["k"]["a"].append(3),
        lambda: s.pop("run"),
    ):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    assert s["thread"]["k"] == {"a": [1, 2]}  # still equal to plain JSON
    value = {"a": [1]}
    s = apply_commands(empty_state(), [Command(key="k", value=value)])
    value["a"].append(2)  # the producer's own object is not the state
    assert s["thread"]["k"] == {"a": [1]}


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
