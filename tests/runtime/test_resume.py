"""ResumeCommand validation (fixed order) and the permission wait on the in-process runner."""

from __future__ import annotations

import pytest

from runtime import (
    Agent,
    InProcessRunner,
    ModelResponse,
    PermissionDecision,
    ResumeCommand,
    ResumeRejected,
    ResumeTicket,
    ScriptedModel,
    ToolResultMessage,
    UserInput,
    call,
    tool,
    validate_resume,
)
from runtime.batch import ToolOutput
from runtime.ids import CallId, CorrelationId, RunId, ThreadId
from runtime.lifecycle import AwaitingState, ExternalResult, ToolWaitTarget, UserInputTarget, answer
from storage.memory import MemoryCommitStore

TICKET = ResumeTicket(
    correlation=CorrelationId("k"),
    run_id=RunId("r"),
    thread_id=ThreadId("t"),
    deadline_us=1000,
    target=ToolWaitTarget(wait="permission", call_id=CallId("c"), tool="x", arguments="{}"),
)
GOOD = ResumeCommand(
    correlation=CorrelationId("k"),
    run_id=RunId("r"),
    thread_id=ThreadId("t"),
    payload=PermissionDecision(approve=True),
    call_id=CallId("c"),
)


@pytest.mark.parametrize(
    ("change", "axis"),
    [
        ({"correlation": "other"}, "correlation"),
        ({"run_id": "other"}, "run"),
        ({"thread_id": "other"}, "thread"),
        ({"payload": UserInput(text="yes please")}, "payload"),  # free text for a permission
        ({"call_id": "other"}, "call_id"),
        # several axes wrong at once: the first in the fixed order is named
        ({"correlation": "x", "run_id": "y", "call_id": "z"}, "correlation"),
        ({"thread_id": "x", "payload": UserInput(text="t")}, "thread"),
    ],
)
def test_each_rejection_axis_in_order(change, axis):
    with pytest.raises(ResumeRejected) as err:
        validate_resume(TICKET, GOOD.model_copy(update=change), now_us=0)
    assert err.value.axis == axis


def test_expired_deadline_is_rejected_before_the_payload():
    bad = GOOD.model_copy(update={"payload": UserInput(text="t")})
    with pytest.raises(ResumeRejected) as err:
        validate_resume(TICKET, bad, now_us=2000)
    assert err.value.axis == "deadline"


def test_a_check_without_a_clock_leaves_the_deadline_and_what_follows_to_the_host():
    """A client's clock may run ahead of the host's, which decides the deadline (a valid
    resume is never refused by a client's clock); the axes after it are the host's too,
    or a late resume of the wrong kind would be refused on its payload by the client and
    on its deadline by the host."""
    validate_resume(TICKET, GOOD, now_us=None)
    bad = GOOD.model_copy(update={"payload": UserInput(text="t")})
    validate_resume(TICKET, bad, now_us=None)  # left to the host
    with pytest.raises(ResumeRejected) as err:
        validate_resume(TICKET, bad.model_copy(update={"run_id": "other"}), now_us=None)
    assert err.value.axis == "run"  # the axes before the deadline are checked
    no_deadline = TICKET.model_copy(update={"deadline_us": None})
    with pytest.raises(ResumeRejected) as err:
        validate_resume(no_deadline, bad, now_us=None)
    assert err.value.axis == "payload"


def test_an_expiry_turns_the_deadline_axis_round():
    """``WaitExpired`` lands only past a ticket's deadline (by the host's clock: a client
    leaves it to the host), never on a ticket without one, nor on a delegation's wait
    (its child ends it); the axes before the deadline and the call id still apply."""
    from runtime.lifecycle import DelegationOutcome, WaitExpired

    expiry = GOOD.model_copy(update={"payload": WaitExpired()})
    validate_resume(TICKET, expiry, now_us=2000)
    validate_resume(TICKET, expiry, now_us=None)  # left to the host
    for ticket, now in ((TICKET, 1000), (TICKET.model_copy(update={"deadline_us": None}), 2000)):
        with pytest.raises(ResumeRejected) as err:
            validate_resume(ticket, expiry, now_us=now)
        assert err.value.axis == "deadline"
    with pytest.raises(ResumeRejected) as err:
        validate_resume(TICKET, expiry.model_copy(update={"call_id": "other"}), now_us=2000)
    assert err.value.axis == "call_id"
    with pytest.raises(ResumeRejected) as err:
        validate_resume(TICKET, expiry.model_copy(update={"run_id": "other"}), now_us=None)
    assert err.value.axis == "run"
    target = TICKET.target.model_copy(update={"wait": "delegation"})
    delegation = TICKET.model_copy(update={"target": target})
    with pytest.raises(ResumeRejected) as err:
        validate_resume(delegation, expiry, now_us=2000)
    assert err.value.axis == "payload"
    assert DelegationOutcome(output=ToolOutput(content="x")).kind == delegation.payload_kind


def test_no_ticket_is_rejected():
    with pytest.raises(ResumeRejected) as err:
        validate_resume(None, GOOD, now_us=0)
    assert err.value.axis == "ticket"


def permission_agent(ran: list[str]) -> Agent:
    @tool(needs_permission=True)
    def delete(path: str) -> str:
        ran.append(path)
        return f"deleted {path}"

    model = ScriptedModel(
        [
            ModelResponse(tool_calls=(call("delete", "c1", path="/tmp/x"),)),
            ModelResponse(text="done"),
        ]
    )
    return Agent(name="p", model=model, tools=[delete])


def command_for(frontier, payload) -> ResumeCommand:
    return answer(frontier.run_state.ticket, payload)


@pytest.mark.parametrize("approve", [True, False])
async def test_permission_round_trip(approve):
    ran: list[str] = []
    store = MemoryCommitStore()
    runner = InProcessRunner(permission_agent(ran), store)
    f = await runner.start("go", thread_id="t")
    assert isinstance(f.run_state, AwaitingState)
    assert (f.status.state, f.status.reason) == ("idle", "awaiting_permission")
    assert ran == []

    # a rejected command leaves the ticket intact
    wrong = command_for(f, UserInput(text="sure"))
    with pytest.raises(ResumeRejected):
        await runner.resume(wrong)
    assert (await store.load("t")).run_state == f.run_state

    done = await runner.resume(command_for(f, PermissionDecision(approve=approve)))
    assert done.run_state.cause.kind == "natural"
    result = next(m for m in done.messages if isinstance(m, ToolResultMessage))
    if approve:
        assert ran == ["/tmp/x"] and result.content == "deleted /tmp/x"
    else:
        assert ran == [] and result.is_error and result.content.startswith("blocked")
    facts = [e.type for r in await store.read("t") for e in r.commit.facts]
    assert "resumed" in facts

    with pytest.raises(ResumeRejected) as err:  # a second resume after success
        await runner.resume(command_for(f, PermissionDecision(approve=True)))
    assert err.value.axis == "ticket"


async def test_external_result_supplied_by_the_caller_completes_the_call():
    ran: list[str] = []
    runner = InProcessRunner(permission_agent(ran), MemoryCommitStore())
    f = await runner.start("go", thread_id="t")
    ticket = f.run_state.ticket
    # an external result where a permission decision is expected is the wrong payload type
    with pytest.raises(ResumeRejected, match="payload"):
        await runner.resume(command_for(f, ExternalResult(output=ToolOutput(content="x"))))
    assert ticket.target.wait == "permission"


async def test_user_input_ticket_accepts_text():
    from runtime.lifecycle import ResumeTicket as Ticket

    ticket = Ticket(
        correlation=CorrelationId("u"),
        run_id=RunId("r"),
        thread_id=ThreadId("t"),
        target=UserInputTarget(prompt="name?"),
    )
    ok = ResumeCommand(
        correlation=CorrelationId("u"),
        run_id=RunId("r"),
        thread_id=ThreadId("t"),
        payload=UserInput(text="Ada"),
    )
    validate_resume(ticket, ok, now_us=0)
    with pytest.raises(ResumeRejected, match="payload"):
        validate_resume(
            ticket, ok.model_copy(update={"payload": PermissionDecision(approve=True)}), now_us=0
        )


def test_a_user_input_is_held_to_input_bytes_as_a_run_s_input_is():
    """The limits say ``input_bytes`` (128 KiB) bounds a user_input resume's text; the
    whole payload's bound (``resume_payload_bytes``, 64 KiB) refused it first."""
    from runtime.errors import InputRefused
    from runtime.limits import DEFAULT_LIMITS, KIB
    from runtime.resume import check_command

    def asking(text: str) -> ResumeCommand:
        return ResumeCommand(
            correlation=CorrelationId("u"),
            run_id=RunId("r"),
            thread_id=ThreadId("t"),
            payload=UserInput(text=text),
        )

    check_command(asking("x" * 100 * KIB), DEFAULT_LIMITS)
    with pytest.raises(InputRefused) as refused:
        check_command(asking("x" * 129 * KIB), DEFAULT_LIMITS)
    assert refused.value.limit == "input_bytes"
