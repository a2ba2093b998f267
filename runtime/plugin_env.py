"""An agent's plugins in its Runs: pinned at activation, checked again by every resume
and recovery (``runtime.plugins``), and the run-end guards they contribute."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.agent import Agent
from runtime.commit import Frontier
from runtime.context import RunContext
from runtime.faults import Unwind
from runtime.hooks import RunEndInput, verdict
from runtime.injection import injected_prefix
from runtime.lifecycle import EndCause, Failed, Natural
from runtime.limits import printable, raised
from runtime.messages import AssistantMessage, Message, UserMessage
from runtime.plugins import PluginRefused, ResolvedExecutionEnv
from runtime.signals import cancels_asked
from runtime.state import Command

PLUGINS_KEY = "plugins"
"""Run-state key: the resolved plugins, ``[[id, version], ...]``, pinned at activation."""


def pin(env: ResolvedExecutionEnv | None) -> tuple[Command, ...]:
    """The activation's record of the resolved plugins."""
    if env is None:
        return ()
    return (Command(key=PLUGINS_KEY, scope="run", value=[list(p) for p in env.pins]),)


def refusal(
    env: ResolvedExecutionEnv | None, refused: PluginRefused | None, frontier: Frontier
) -> Failed | None:
    """Why this Run may not execute with this code's plugins, or None."""
    if refused is not None:
        return Failed(failure="capability_bound", code=refused.rule, message=str(refused))
    stored = frontier.state["run"].get(PLUGINS_KEY)
    pinned = [list(p) for p in stored] if stored is not None else None
    now = [list(p) for p in env.pins] if env is not None else None
    if pinned != now:
        detail = f"the Run was started with plugins {pinned}; this code resolves {now}"
        return Failed(failure="capability_bound", code="plugins_changed", message=printable(detail))
    return None


def guarded_end(agent: Agent, ctx: RunContext, messages: Sequence[Message]) -> EndCause:
    """A natural end, unless a run-end guard refuses it: then ``failed(hook,
    run_end_guard)`` with the guard's reason (a guard that raises refuses too).

    ``messages``: what the end commits, its answer last. An end that commits none (a
    session whose turns are over, ended before a Step) answered with the history's last
    answer: its guards were shown none."""
    if not agent.run_end_guards:
        return Natural()
    final = messages[-1] if messages else _last_answer(ctx.frontier.messages, ctx.run_id)
    seen = RunEndInput(
        run_id=ctx.run_id,
        thread_id=ctx.frontier.thread_id,
        answer=final.text if isinstance(final, AssistantMessage) else "",
        state=ctx.frontier.state,
        messages=(*ctx.frontier.messages, *messages),
    )
    for guard in agent.run_end_guards:
        asked = cancels_asked()
        try:
            text = verdict(guard(seen), "refused")
        except Unwind:
            raise  # a crash test's Crash, a replay's Halt: nothing settles
        except BaseException as exc:  # a guard that cannot tell refuses (SystemExit too)
            text = f"the guard raised {raised(exc)}"
        if cancels_asked() > asked:  # refuses: its caller drops the cancellation
            text = "the guard cancelled its own task"
        if text is not None:
            return Failed(failure="hook", code="run_end_guard", message=text)
    return Natural()


def _last_answer(history: Sequence[Message], run_id: str) -> AssistantMessage | None:
    """The Run's last model answer (an assistant message without calls: a handler's or a
    human's turn is no answer), found from the end: it is the last turn's, or the one
    before it. Not past a user message of no side but the Run's injected ones (its input,
    or an answer to its wait for input): what came before may be an earlier Run's, and a
    guard shown it would let an end that answered nothing pass for it."""
    injected = injected_prefix(run_id)
    for m in reversed(history):
        if isinstance(m, AssistantMessage) and not m.tool_calls:
            return m
        if isinstance(m, UserMessage) and m.side is None and not m.id.startswith(injected):
            return None
    return None
