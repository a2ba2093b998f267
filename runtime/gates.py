"""May a requested call run? The gates, and the admission of what a tool returned.

``plan`` answers, for every call of an open batch, what happens next (from the pure
recovery decision ``plan_calls``, so a live Step and a recovered one take the same
path): it runs the gates of requested calls — arguments, recovery mode, delegation
limits, arguments the model sent that could not be kept — and sorts the calls into
the ready ones, the one that waits, and those it settled at once (model-visible
errors). ``waves`` groups the ready calls. ``admit_outcome`` checks a tool's result
against the limits before it can be committed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.agent import Agent
from runtime.batch import ActiveToolBatch, Completed, ToolOutput, complete, mark_indeterminate
from runtime.context import RunContext, StepServices
from runtime.delegation import CHILDREN_KEY, child_ids, refusal
from runtime.errors import InputRefused
from runtime.execution import check_reaction_text
from runtime.faults import Unwind
from runtime.frozen import freeze
from runtime.hooks import Gate, GateInput, verdict
from runtime.ids import CallId
from runtime.lifecycle import IndeterminateEnd
from runtime.limits import (
    Limits,
    check_id,
    check_json_value,
    check_text,
    handed_bytes,
    printable,
    raised,
    stored_size,
)
from runtime.ports import Finished
from runtime.recovery import (
    MarkIndeterminate,
    Reconnect,
    Replay,
    RunGates,
    WaitOnCall,
    plan_calls,
)
from runtime.signals import EndRun, cancels_asked
from runtime.state import Command, MergePolicy, StateView, check_writable

UNKNOWN_CHARS = 1000
"""The longest error a call of an unknown tool gets (it lists the tools there are)."""


@dataclass
class CallPlan:
    """What happens next to each call of a batch (the batch with the gates' verdicts)."""

    batch: ActiveToolBatch
    ready: list[CallId] = field(default_factory=list)
    waiter: CallId | None = None
    parsed: dict[CallId, dict[str, Any]] = field(default_factory=dict)
    """Arguments the gates validated, for the calls' first invocation."""
    joined: set[CallId] = field(default_factory=set)
    """Ready calls whose attempt goes on (``Reconnect``): not marked executing again."""
    sealed: list[CallId] = field(default_factory=list)
    """Executing calls a recovery sealed indeterminate (their tool may have run)."""


def plan(
    services: StepServices,
    state: StateView,
    batch: ActiveToolBatch,
    refused: Mapping[CallId, str] | None = None,
) -> CallPlan:
    """Run the gates of the requested calls and sort every call by what comes next."""
    agent = services.agent
    out = CallPlan(batch)
    for action in plan_calls(batch, lambda tool, mode: _supports(agent, tool, mode)):
        if isinstance(action, (Replay, Reconnect)):
            why = _reparsed(services, out, action.call_id)
            if why is not None:
                action = MarkIndeterminate(call_id=action.call_id, reason=why)
        if isinstance(action, MarkIndeterminate):
            if delegates(agent, out.batch, action.call_id):
                raise EndRun(
                    IndeterminateEnd(reason=f"delegation {action.call_id}: {action.reason}")
                )
            out.batch = mark_indeterminate(out.batch, action.call_id, action.reason)
            out.sealed.append(action.call_id)
        elif isinstance(action, Replay):
            out.ready.append(action.call_id)
        elif isinstance(action, Reconnect):
            out.ready.append(action.call_id)
            out.joined.add(action.call_id)
        elif isinstance(action, WaitOnCall):
            out.waiter = out.waiter or action.call_id
        elif isinstance(action, RunGates):
            why = None if refused is None else refused.get(action.call_id)
            verdict = _gate(services, state, out, action.call_id, why)
            if verdict == "ready":
                out.ready.append(action.call_id)
            elif verdict == "wait" and out.waiter is None:
                out.waiter = action.call_id  # one wait at a time; later ones stay requested
    return out


def _reparsed(services: StepServices, out: CallPlan, call_id: CallId) -> str | None:
    """Parse a recovered executing call's arguments again for the tool as deployed now
    (kept for its next invocation); why not, if it no longer takes them (its signature
    changed since): the call is sealed unknown, not the Run failed ``internal``."""
    call = out.batch.call(call_id)
    tool = services.agent.tool(call.tool)
    assert tool is not None  # plan_calls sealed a call whose tool is gone
    try:
        out.parsed[call_id] = tool.parse(call.arguments, services.limits)
    except ValueError as exc:
        return printable(f"the tool as deployed no longer takes the call's arguments: {exc}")
    return None


def _supports(agent: Agent, tool_id: str, mode: str) -> bool:
    tool = agent.tool(tool_id)
    return tool is not None and tool.supports(mode)  # type: ignore[arg-type]


def _gate(
    services: StepServices, state: StateView, out: CallPlan, call_id: CallId, refused: str | None
) -> str:
    """Validate a requested call; bad input becomes a model-visible error, never a crash."""
    agent = services.agent
    call = out.batch.call(call_id)
    if refused is not None:
        return _fail(out, call_id, refused)
    tool = agent.tool(call.tool)
    if tool is None:
        known = ", ".join(t.id for t in agent.tools) or "none"
        # cut: an agent of a thousand MCP tools would put 20 KB in each such error, and a
        # Step of many such calls past the store's payload limit
        unknown = f"unknown tool {call.tool!r}; available tools: {known}"
        return _fail(out, call_id, printable(unknown, UNKNOWN_CHARS))
    try:
        out.parsed[call_id] = tool.parse(call.arguments, services.limits)
    except ValueError as exc:
        return _fail(out, call_id, str(exc))
    if tool.delegates:
        why = _delegation_refusal(services, state, out.batch, call_id)
        if why is not None:
            return _fail(out, call_id, why)
    # read-only: a gate judges the call, and the tool runs with what was committed (a
    # gate that wrote into the arguments changed what ran, not what the log says ran)
    arguments: dict[str, Any] = freeze(out.parsed[call_id]) if agent.gates else {}
    for gate in agent.gates:
        seen = GateInput(out.batch.run_id, call_id, call.tool, arguments, state)
        why = _gated(gate, seen)
        if why is not None:
            return _fail(out, call_id, f"blocked: {why}")
    if not tool.supports(call.policy.mode):
        return _fail(
            out,
            call_id,
            f"tool {tool.id} does not support recovery mode "
            f"{call.policy.mode} (it declares {list(tool.recovery)})",
        )
    return "wait" if tool.wait is not None else "ready"


def _gated(gate: Gate, seen: GateInput) -> str | None:
    """A tool gate's verdict: a reason denies the call (a gate that raises denies it, and
    so does one that cancels the Run's task: its caller drops that cancellation)."""
    asked = cancels_asked()
    try:
        why = verdict(gate(seen), "denied")
    except Unwind:
        raise  # a crash test's Crash, a replay's Halt: nothing settles
    except BaseException as exc:  # a gate that cannot tell denies (SystemExit included)
        why = f"the gate raised {raised(exc)}"
    if cancels_asked() > asked:
        return "the gate cancelled its own task"
    return why


def _fail(out: CallPlan, call_id: CallId, text: str) -> str:
    out.batch = complete(out.batch, call_id, ToolOutput(content=text, is_error=True))
    return "done"


def delegates(agent: Agent, batch: ActiveToolBatch, call_id: CallId) -> bool:
    if not agent.delegating:
        return False
    tool = agent.tool(batch.call(call_id).tool)
    return tool is not None and tool.delegates


def relationships(
    services: StepServices, ctx: RunContext, batch: ActiveToolBatch, wave: Sequence[CallId]
) -> tuple[Command, ...]:
    """The delegation relationship of each call of ``wave`` that starts a child: committed
    with the call's executing, before the child starts (a recovery finds its child by it,
    and a child's end is handed over only to the call it names)."""
    started = {
        c: child_ids(ctx.frontier.thread_id, ctx.run_id, c, services.limits.id_chars)[0]
        for c in wave
        if delegates(services.agent, batch, c)
    }
    if not started:
        return ()
    return (Command(key=CHILDREN_KEY, scope="run", merge="disjoint", value=dict(started)),)


def _delegation_refusal(
    services: StepServices, state: StateView, batch: ActiveToolBatch, call_id: CallId
) -> str | None:
    if services.children is None:
        return "delegation is not available: this runner has no child runner"
    agent = services.agent
    delegations = [c.call_id for c in batch.calls if delegates(agent, batch, c.call_id)]
    earlier = delegations[: delegations.index(call_id)]
    # children already committed, plus earlier calls of this batch that were not refused
    started = set(state["run"].get(CHILDREN_KEY, {})) | {
        c for c in earlier if batch.call(c).phase.kind != "completed"
    }
    args = json.loads(batch.call(call_id).arguments)
    try:  # the child's input is a Run's input: refused here, not by the child's start
        check_text("the child's input", args["input"], services.limits.input_bytes, "input_bytes")
    except InputRefused as exc:
        return f"delegation refused: {exc}"
    target = args["agent"]
    return refusal(
        agent.delegation,
        depth=len(services.prompt_path),
        lineage=services.lineage,
        agent=target,
        started=len(started),
        in_batch=len(earlier) + 1,
    )


def waves(agent: Agent, batch: ActiveToolBatch, ready: Sequence[CallId]) -> list[list[CallId]]:
    """Consecutive parallel-safe calls share a wave; a serial call runs alone."""
    current: list[CallId] = []
    out: list[list[CallId]] = []
    for call_id in ready:
        tool = agent.tool(batch.call(call_id).tool)
        if tool is not None and tool.concurrency == "parallel":
            current.append(call_id)
            continue
        if current:
            out.append(current)
            current = []
        out.append([call_id])
    if current:
        out.append(current)
    return out


def admit_outcome(
    outcome: Finished,
    limits: Limits,
    batch: ActiveToolBatch,
    declared: Mapping[str, MergePolicy] | None = None,
    staged: Sequence[Command] = (),
) -> Finished:
    """A tool's finished outcome as it may be committed: a result over
    ``tool_result_bytes`` or that cannot be stored, state commands beyond the state
    limits or on keys the tool may not write (``declared``: its plugin's keys), requests
    of its Run beyond the limits, or an outcome that would take what the Step's calls
    hand their Run — results, state commands and injected messages together, ``staged``
    being the commands earlier calls of its wave handed — over ``batch_result_bytes``
    (so a Step's commit stays within the store's payload limit), become a model-visible
    error naming the limit (the commands and requests are dropped)."""
    try:
        content = outcome.output.content
        check_text("tool result", content, limits.tool_result_bytes, "tool_result_bytes")
        for request in outcome.requests:  # held to what the Run's state will take of them
            check_reaction_text(request, limits)
        for cmd in outcome.commands:
            check_writable(cmd, declared)
            check_id("state key", cmd.key, limits)
            check_json_value(
                f"state command {cmd.key!r}",
                cmd.value,
                limits.state_value_bytes,
                "state_value_bytes",
                limits,
            )
        so_far = sum(
            stored_size(c.phase.output.content)
            for c in batch.calls
            if isinstance(c.phase, Completed)
        ) + sum(handed_bytes(c) for c in staged)
        adds = stored_size(content) + sum(handed_bytes(c) for c in outcome.commands)
        adds += sum(stored_size(getattr(r, "text", None) or "") for r in outcome.requests)
        if so_far + adds > limits.batch_result_bytes:
            raise InputRefused(
                "tool result",
                "batch_result_bytes",
                f"the Step's results, state commands and injected messages would be "
                f"{so_far + adds} bytes; the limit is {limits.batch_result_bytes}",
            )
    except InputRefused as exc:
        return Finished.refused(exc)
    return outcome
