"""Dual-side sessions (seed ``execution-state-and-run-status`` §2.3, §4.1).

An ``Agent(session=Session(b=...))`` makes each Run a conversation between two sides:
``a`` is the agent itself (its model, tools and hooks); ``b`` is backed by another
agent's model, a handler (a Python callable) or a human. A turn ends with a message:

- a model side's turn is its Steps, up to an answer without tool calls; that answer
  is committed with the handoff, in the Step's inference commit;
- a handler's turn is one call of the handler, committed as a ``turn`` commit (it adds
  no Step); a handler that returns None ends the session;
- a human's turn is a ``user_input`` ticket (the Run awaits, status ``idle`` /
  ``awaiting_human``); the resume commits the answer with the handoff.

Turns alternate; ``force_turn(side)`` names the next side instead (staged in the run
state with the commit that carries the request, so a crash keeps it). After
``max_session_turns`` turns, of any backing, the Run ends naturally. The session's
state is the thread's (``thread:session``: whose turn, how many turns, each side's
Steps, whether it ended), so a later Run of the thread continues an open session;
``stop_session()`` — a session ending naturally too — closes it, while ``stop()`` only
ends the Run. Each side's model sees the session from its side (``view``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from runtime.agent import Agent, HandlerInput, SessionSide
from runtime.commit import Frontier
from runtime.context import RunContext, StepServices
from runtime.execution import ExecutionState, ExecutionView, Side
from runtime.faults import Unwind
from runtime.hooks import Hook, HookFailed, check_handed
from runtime.injection import inject_commands
from runtime.lifecycle import Natural, UserInputTarget
from runtime.limits import check_text
from runtime.messages import AssistantMessage, ContextMessage, RequestMessage, UserMessage
from runtime.signals import (
    CancelledSignal,
    EndRun,
    OwnCancels,
    cancelling,
)
from runtime.state import SESSION_KEY, Command

# SESSION_KEY, the thread-state key (disjoint): side, turns, a_steps, b_steps, ended
FORCED_KEY = "forced_turn"
"""Run-state key: the side a ``force_turn`` named for the next turn."""


def state_of(frontier: Frontier) -> dict[str, Any]:
    return dict(frontier.state["thread"].get(SESSION_KEY) or {})


def _set(**fields: Any) -> Command:
    return Command(key=SESSION_KEY, scope="thread", merge="disjoint", value=fields)


def other(side: Side) -> Side:
    return "b" if side == "a" else "a"


def opening(agent: Agent, frontier: Frontier) -> tuple[Command, ...]:
    """With a Run's activation: a new session, unless the thread's is still open."""
    if agent.session is None:
        return ()
    held = state_of(frontier)
    if held and not held.get("ended"):
        return ()
    first = agent.session.first
    return (_set(side=first, turns=0, a_steps=0, b_steps=0, ended=False),)


def current_side(agent: Agent, frontier: Frontier) -> Side:
    if agent.session is None:
        return "a"
    side = state_of(frontier).get("side")
    return "b" if side == "b" else "a"


def side_agent(agent: Agent, side: Side) -> Agent | None:
    """The agent whose model takes ``side``'s turns (None: a handler or a human)."""
    if side == "a" or agent.session is None:
        return agent
    return agent.session.b.agent


def counted(execution: ExecutionState, agent: Agent, frontier: Frontier, step: int) -> None:
    """The ExecutionState's step counts: the Run's Steps, and each side's (the session's
    model Steps; a handler or human turn adds none)."""
    execution.step_count = step
    if agent.session is None:
        execution.side_a_step_count, execution.side_b_step_count = step, 0
        return
    held = state_of(frontier)
    execution.current_side = current_side(agent, frontier)
    execution.side_a_step_count = int(held.get("a_steps", 0))
    execution.side_b_step_count = int(held.get("b_steps", 0))


def stepped(agent: Agent, frontier: Frontier, side: Side) -> tuple[Command, ...]:
    """With each inference commit of a session: one more Step for ``side``."""
    if agent.session is None:
        return ()
    field = f"{side}_steps"
    return (_set(**{field: int(state_of(frontier).get(field, 0)) + 1}),)


def turns_over(agent: Agent, frontier: Frontier) -> bool:
    return agent.session is not None and (
        int(state_of(frontier).get("turns", 0)) >= agent.session.max_session_turns
    )


def closing() -> Command:
    """With the Run's end, when the session ends too (no later Run continues it)."""
    return _set(ended=True)


def forces(command: Command) -> bool:
    """The command stages a ``force_turn``."""
    return command.key == FORCED_KEY and command.scope == "run"


def stage_forced(execution: ExecutionState, commands: list[Command]) -> None:
    """A ``force_turn`` made now is staged with ``commands`` (the last one counts)."""
    side, execution.forced_side = execution.forced_side, None
    if side is None:
        return
    commands[:] = [c for c in commands if not forces(c)]
    commands.append(Command(key=FORCED_KEY, scope="run", value=side))


def last_forced(commands: tuple[Command, ...]) -> tuple[Command, ...]:
    """``commands`` with only their last write of the forced side. The parts of a Run
    that stage for one commit may each force a turn — the AfterTool hooks of calls a
    recovery sealed (staged before the wave that rejoins the others), that wave's tools,
    then its hooks — and the last made counts: two writes of the key in one commit
    would fail it (``StateConflict``), and the Run with it."""
    writes = [i for i, c in enumerate(commands) if forces(c)]
    if len(writes) < 2:
        return commands
    last = writes[-1]
    return tuple(c for i, c in enumerate(commands) if i == last or not forces(c))


def handoff(
    frontier: Frontier, side: Side, staged: Sequence[Command] = ()
) -> tuple[tuple[Command, ...], tuple[Command, ...]]:
    """``side`` ends its turn: ``staged`` without the forced side it may hold, and the
    commands passing the turn (to the forced side, else the other)."""
    forced = next(
        (c.value for c in staged if forces(c)),
        frontier.state["run"].get(FORCED_KEY),
    )
    rest = tuple(c for c in staged if not forces(c))
    turns = int(state_of(frontier).get("turns", 0)) + 1
    passing: tuple[Command, ...] = (_set(side=forced or other(side), turns=turns),)
    if FORCED_KEY in frontier.state["run"]:
        passing += (Command(key=FORCED_KEY, scope="run", op="remove"),)
    return rest, passing


def view(messages: Sequence[RequestMessage], side: Side) -> tuple[RequestMessage, ...]:
    """The session as ``side``'s model sees it: its own answers, calls and results; the
    other side's answers and turns as user messages (its calls and results not at all);
    the thread's input and injected messages as they are."""
    own_calls: set[str] = set()
    seen: list[RequestMessage] = []
    for m in messages:
        if isinstance(m, AssistantMessage):
            if (m.side or "a") == side:
                seen.append(m)
                own_calls.update(u.call_id for u in m.tool_calls)
            elif not m.tool_calls and m.text:
                seen.append(UserMessage(id="", text=m.text))
        elif m.kind == "tool_result":
            if m.call_id in own_calls:
                seen.append(m)
        elif isinstance(m, UserMessage) and m.side == side:
            seen.append(AssistantMessage(text=m.text, side=side))
        else:
            seen.append(m)
    return tuple(seen)


def human_wait(spec: SessionSide, side: Side) -> UserInputTarget:
    return UserInputTarget(prompt=spec.human or "", side=side)


def human_answer(
    ticket_target: UserInputTarget, frontier: Frontier, text: str, message_id: str
) -> tuple[UserMessage, tuple[Command, ...]]:
    """A human side's answer: its message and the handoff (for the resume commit)."""
    assert ticket_target.side is not None
    side = ticket_target.side
    _, passing = handoff(frontier, side)
    return UserMessage(id=message_id, text=text, side=side), passing


async def handler_turn(
    services: StepServices, ctx: RunContext, spec: SessionSide, side: Side
) -> None:
    """Call the handler and commit its turn (or end the session if it returns None)."""
    assert spec.handler is not None
    f = ctx.frontier
    history = view((*f.messages,), side)
    seen = HandlerInput(
        run_id=ctx.run_id,
        thread_id=f.thread_id,
        turn=int(state_of(f).get("turns", 0)),
        messages=tuple(m for m in history if not isinstance(m, ContextMessage)),
        execution=ExecutionView(ctx.execution),
    )
    as_hook = Hook(point="StepStart", fn=lambda _: None, name=f"handler {spec.name}")
    try:
        own = OwnCancels()
        async with own:
            out = spec.handler(seen)
        if own.dropped:  # a synchronous one cancelled the Run's task
            raise HookFailed(as_hook, "StepStart", asyncio.CancelledError())
        if inspect.isawaitable(out):
            out = await services.guard_apart(out)
        if out is not None:
            check_text("a handler's turn", out, services.limits.input_bytes, "input_bytes")
        # what it injected goes with its turn's commit, held as a hook's output is
        check_handed(0, (), ctx.execution.injected, (), services.limits)
    except CancelledSignal as exc:
        if services.ending:  # the Run's cancel or stop, through the guard
            raise
        raise HookFailed(as_hook, "StepStart", exc) from exc  # the handler's own
    except asyncio.CancelledError as exc:
        if cancelling():
            raise  # the Run's task is being cancelled: it goes on unwinding
        raise HookFailed(as_hook, "StepStart", exc) from exc
    except (Unwind, HookFailed):
        raise  # a crash test's Crash, a replay's Halt: nothing settles; ours, made above
    except BaseException as exc:  # the handler's failure fails the Run, as a hook's does
        raise HookFailed(as_hook, "StepStart", exc) from exc
    turn = int(state_of(f).get("turns", 0))
    execution = ctx.execution  # what the handler injected goes with its turn, as a hook's
    staged = list(inject_commands(f.version, f"{turn:06d}:handler:{side}", execution.injected))
    execution.injected.clear()
    stage_forced(execution, staged)
    if out is None:  # the handler ends the session
        ctx.pending.extend((*staged, closing()))
        raise EndRun(Natural())
    rest, passing = handoff(f, side, staged)
    message = UserMessage(id=f"{ctx.run_id}:turn:{turn}:{side}", text=out, side=side)
    await services.commit(
        ctx, "turn", ctx.running(), messages=(message,), commands=(*rest, *passing)
    )
