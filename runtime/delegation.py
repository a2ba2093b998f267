"""Terminal-only child delegation (DESIGN §7).

A delegation tool call starts a child Run whose ids are derived from (parent run,
call id), so a repeated start after any crash addresses the same child. The parent
commits the relationship and the call's ``executing`` (policy ``durable_request``)
before the child starts; the call stays executing while the child runs, so all
children of a batch run at once. The parent sees only the child's terminal outcome,
installed in the same commit that completes the call; the child's own thread is the
durable record of that outcome (the parent's inbox), so recording it twice is
impossible and re-reading it is harmless.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, Protocol

from pydantic import Field, TypeAdapter

from runtime.base import Frozen
from runtime.batch import ToolOutput
from runtime.commit import Frontier
from runtime.errors import InputRefused, RatchetError, ResumeRejected
from runtime.ids import CallId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    DelegationOutcome,
    EndedState,
    ResumeCommand,
    ResumeTicket,
    ToolWaitTarget,
    answer,
    check_payload,
)
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.messages import AssistantMessage
from runtime.ports import CommitStore, Finished, Lost
from runtime.state import Command
from runtime.tools import Tool, tool

CHILDREN_KEY = "children"
"""Run-scoped state key: {call_id: child thread}, written with the executing commit."""
PARENT_KEY = "parent"
"""Run-scoped state key of a child: its ParentLink."""
NO_ANSWER = "(the child run ended without an answer of its own)"
"""What a parent's call gets from a child that ended naturally having said nothing."""


log = logging.getLogger("ratchet.delegation")

Limit = Annotated[int, Field(strict=True, ge=0)]
"""A limit given as a plain integer: ``True``, ``"7"`` or -1 are refused, not read as one."""


class DelegationLimits(Frozen):
    max_depth: Annotated[int, Field(strict=True, ge=1)] = 8
    """Longest prompt path (root agent included) a child may have."""
    max_parallel: Limit = 8
    """Delegation calls of one batch; later ones are refused."""
    max_total: Limit = 64
    """Children one Run may start in all."""
    allow_cycles: Annotated[bool, Field(strict=True)] = False
    """Whether an agent may (indirectly) delegate to itself."""
    agents: tuple[str, ...] | None = None
    """The agent references (``module:attr``) a model may delegate to. None: those of
    the delegating agent's own module (an Agent there, or a function there annotated to
    return one). The model names the agent, and loading it imports its module and may
    call a function there: a model must not pick any module at all."""


class ChildRequest(Frozen):
    parent_thread: ThreadId
    parent_run: RunId
    call_id: CallId
    agent: str
    """Import reference ``module:attr`` of the child's agent."""
    input: str
    child_thread: ThreadId
    child_run: RunId
    prompt_path: tuple[str, ...]
    """The child's prompt path: the parent's, then the child agent."""
    lineage: tuple[str, ...]
    """Agent references from the root to the child (cycle detection)."""


class ParentLink(Frozen):
    """Committed into a child's run state at activation: who waits for it."""

    thread: ThreadId
    run: RunId
    call_id: CallId
    agent: str
    """The child's own agent reference, so any process can rebuild it."""
    prompt_path: tuple[str, ...]
    lineage: tuple[str, ...]

    @classmethod
    def of(cls, request: ChildRequest) -> ParentLink:
        return cls(
            thread=request.parent_thread,
            run=request.parent_run,
            call_id=request.call_id,
            agent=request.agent,
            prompt_path=request.prompt_path,
            lineage=request.lineage,
        )

    def command(self) -> Command:
        return Command(key=PARENT_KEY, scope="run", value=self.model_dump(mode="json"))


class ChildWaiting(Frozen):
    """The child needs a human: it committed Awaiting(ticket)."""

    kind: Literal["child_waiting"] = "child_waiting"
    ticket: ResumeTicket


ChildOutcome = Finished | Lost | ChildWaiting


class ChildRunner(Protocol):
    async def run(self, request: ChildRequest) -> ChildOutcome:
        """Start the child or re-attach to it (same ids), and wait until it is at rest."""

    async def cancel(self, child_thread: ThreadId, child_run: RunId | None = None) -> None:
        """Cancel the child if it is not ended; idempotent. ``child_run``: only that Run
        (a thread holding another Run is left alone)."""


def child_ids(
    parent_thread: ThreadId, parent_run: RunId, call: CallId, max_chars: int = 256
) -> tuple[ThreadId, RunId]:
    """The child's ids, derived from the parent's: the same call always names the same
    child. An id that would grow past ``max_chars`` (``Limits.id_chars``: each level of
    delegation adds the parent's ids) keeps its start and ends in a digest of the whole,
    so every depth stays addressable.

    The call id (the model's) is escaped (``%``, ``/``, ``@``, ``~``): the pair of ids
    then names one (thread, run, call) only — the run id ends in the call after its last
    ``/``, and the thread id is the rest. A thread id a caller chose may still equal a
    derived one: ``Engine.start`` refuses a child's start on a thread that holds another
    Run, and a parent cancels only its own child's Run."""
    escaped = call.translate(_ESCAPES)
    thread = _within(f"{parent_thread}/{escaped}@{parent_run}", max_chars)
    return ThreadId(thread), RunId(_within(f"{parent_run}/{escaped}", max_chars))


_ESCAPES = str.maketrans({"%": "%25", "/": "%2F", "@": "%40", "~": "%7E"})
"""Call ids as real models make them (``call_…``, ``toolu_…``) hold none of these: their
children's ids are those of before the escaping."""


def _within(derived: str, max_chars: int) -> str:
    if len(derived) <= max_chars:
        return derived  # the ids of every child started so far, unchanged
    digest = hashlib.sha256(derived.encode("utf-8", "surrogatepass")).hexdigest()
    keep = max(0, max_chars - 33)
    return f"{derived[:keep]}~{digest}"[:max_chars]


def delegate_tool(name: str = "delegate") -> Tool:
    """The delegation tool: ``delegate(agent="module:attr", input="...")``."""

    def delegate(agent: str, input: str) -> str:
        """Hand a task to another agent and wait for its final answer."""
        raise RuntimeError("delegation calls are run by the engine, never directly")

    built: Tool = tool(delegate, name=name, recovery=("durable_request",))
    return built.with_delegation()


def may_delegate_to(limits: DelegationLimits, lineage: tuple[str, ...], agent: str) -> bool:
    """Whether ``agent`` is one the last agent of ``lineage`` may start a child of."""
    if limits.agents is not None:
        return agent in limits.agents
    module, sep, attr = agent.partition(":")
    own, own_sep, _ = (lineage[-1] if lineage else "").partition(":")
    return bool(sep and attr and own_sep and module == own) and _names_an_agent(module, attr)


def _names_an_agent(module_name: str, attr: str) -> bool:
    """Whether ``attr`` of the (imported) module is an Agent, or a function there that says
    it returns one: loading the reference calls a function it names, and a model must
    not have the module's ``main()`` or ``reset()`` called. Looked up, never called."""
    from runtime.agent import Agent

    module = sys.modules.get(module_name)
    if module is None:  # not imported in this process: nothing of it is an agent here
        return False
    found = inspect.getattr_static(module, attr, None)  # no module __getattr__ runs
    if isinstance(found, Agent):
        return True
    if not (inspect.isfunction(found) and found.__module__ == module_name):
        return False
    returns = found.__annotations__.get("return")
    # "Agent" under ``from __future__ import annotations``, or a dotted name of it
    if returns is Agent or (isinstance(returns, str) and returns.rsplit(".", 1)[-1] == "Agent"):
        return True
    if (module_name, attr) not in _WARNED:  # said once: a model may ask again every Step
        _WARNED.add((module_name, attr))  # bounded: each is a function of the module
        log.warning(
            "a model asked to delegate to %s:%s, a function not annotated to return an "
            "Agent: refused (annotate it -> Agent, or name it in DelegationLimits.agents)",
            module_name,
            attr,
        )
    return False


_WARNED: set[tuple[str, str]] = set()
"""The functions a refusal of ``_names_an_agent`` has warned of, in this process."""


def refusal(
    limits: DelegationLimits,
    depth: int,
    lineage: tuple[str, ...],
    agent: str,
    started: int,
    in_batch: int,
) -> str | None:
    """Why a child may not start, as the model should read it; None if it may."""
    if depth >= limits.max_depth:
        return f"delegation refused: depth limit {limits.max_depth} reached"
    if in_batch > limits.max_parallel:
        return f"delegation refused: at most {limits.max_parallel} delegations per step"
    if started >= limits.max_total:
        return f"delegation refused: this run already started {limits.max_total} children"
    if not may_delegate_to(limits, lineage, agent):
        return (
            f"delegation refused: {agent!r} is not an agent this one may delegate to "
            "(an Agent of its own module, a function there annotated -> Agent, or one "
            "DelegationLimits.agents names)"
        )
    if agent in lineage and not limits.allow_cycles:
        return f"delegation refused: {agent} is already in the chain {list(lineage)} (cycle)"
    return None


def outcome_of(frontier: Frontier) -> ChildOutcome:
    """A child at rest, as its parent's tool call sees it."""
    state = frontier.run_state
    if isinstance(state, AwaitingState):
        return ChildWaiting(ticket=state.ticket)
    if not isinstance(state, EndedState):
        return Lost(message=f"child {frontier.thread_id} is not at rest")
    if state.cause.kind == "natural":
        answer = next(
            (m.text for m in reversed(frontier.messages) if isinstance(m, AssistantMessage)),
            NO_ANSWER,  # a session child whose turns all went to its handler or a person
        )
        return Finished(output=ToolOutput(content=answer))
    detail = json.dumps(state.cause.model_dump(mode="json"))
    return Finished(
        output=ToolOutput(content=f"child run ended without an answer: {detail}", is_error=True)
    )


def parent_link(frontier: Frontier) -> ParentLink | None:
    """A child Run's link to its parent (prompt path, lineage), from its run state."""
    raw = frontier.state["run"].get(PARENT_KEY)
    return ParentLink.model_validate(raw) if raw is not None else None


def awaited_child(parent: Frontier) -> ThreadId | None:
    """The child thread a parent at rest awaits (its ticket names the delegating call)."""
    state = parent.run_state
    if not isinstance(state, AwaitingState):
        return None
    target = state.ticket.target
    if not isinstance(target, ToolWaitTarget) or target.wait != "delegation":
        return None
    child = parent.state["run"].get(CHILDREN_KEY, {}).get(target.call_id)
    return ThreadId(child) if isinstance(child, str) else None


def delivery(
    child: Frontier, parent: Frontier, limits: Limits = DEFAULT_LIMITS
) -> ResumeCommand | None:
    """The resume that hands an ended child's outcome to a parent awaiting exactly it.
    An answer its parent's call cannot hold (over ``tool_result_bytes``, as a child's
    model may write, or a resume payload over ``resume_payload_bytes``) is handed as
    the error the running path's admission makes of it: a resume the host refuses
    would leave the parent awaiting for ever."""
    link = child.state["run"].get(PARENT_KEY)
    state = parent.run_state
    if link is None or not child.ended or not isinstance(state, AwaitingState):
        return None
    target = state.ticket.target
    if not (
        isinstance(target, ToolWaitTarget)
        and target.wait == "delegation"
        and target.call_id == link["call_id"]
        and state.run_id == link["run"]
        # the parent's own record of the call's child: a copy of the child (imported
        # under another id) names the same parent, and must not answer it
        and parent.state["run"].get(CHILDREN_KEY, {}).get(link["call_id"]) == child.thread_id
    ):
        return None
    outcome = outcome_of(child)
    assert isinstance(outcome, Finished)
    payload = DelegationOutcome(output=outcome.output)
    try:  # by the rule the host's resume applies (its own limit on a payload too)
        check_payload(payload, limits)
    except InputRefused as exc:
        payload = DelegationOutcome(output=Finished.refused(exc).output)
    return answer(state.ticket, payload)


async def check_delegation_answer(
    parent: Frontier,
    command: ResumeCommand,
    load: Callable[[ThreadId], Awaitable[Frontier]],
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """A delegation's ticket takes its child's own outcome only, as the child's stored
    end makes it (``delivery``): a caller's made-up outcome, or one sent while the child
    still runs, is ResumeRejected on its payload and the ticket stays. ``load`` reads
    (and verifies) the child's thread."""
    if not isinstance(command.payload, DelegationOutcome):
        return
    child = awaited_child(parent)
    if child is None:
        raise ResumeRejected("payload", "the parent's record names no child for this call")
    vouched = delivery(await load(child), parent, limits)
    if vouched is None:
        raise ResumeRejected(
            "payload", f"a delegation is answered by its child's end; {child} has not ended"
        )
    if vouched.payload != command.payload:
        raise ResumeRejected("payload", f"not the outcome its child {child} ended with")


CHILD_OUTCOME: TypeAdapter[Finished | Lost | ChildWaiting] = TypeAdapter(
    Annotated[Finished | Lost | ChildWaiting, Field(discriminator="kind")]
)
"""Encodes a ChildOutcome for the wire as JSON."""


async def parent_gone(store: CommitStore, link: ParentLink) -> bool:
    """Whether the Run a child was started for has ended (or the parent's thread moved on
    to another Run). Its end cancels its open children, but a host killed between that
    end and the cancels leaves them running: each looks before its next Step. A store
    that cannot answer says nothing (the child goes on; it looks again next Step)."""
    try:
        parent = await store.load_head(link.thread)
    except RatchetError:
        return False
    return parent.run_id != link.run or parent.ended
