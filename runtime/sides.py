"""The Engine's part in a dual-side session (``runtime.session``): whose turn it is, a
handler's or a human's turn, and a model side's handover."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.agent import Agent
from runtime.batch import ActiveToolBatch, finalize
from runtime.context import RunContext
from runtime.execution import Side
from runtime.hooking import Hooking
from runtime.inference import Inference
from runtime.lifecycle import Natural
from runtime.messages import Message
from runtime.session import (
    closing,
    current_side,
    handler_turn,
    handoff,
    human_wait,
    side_agent,
    stage_forced,
    turns_over,
)
from runtime.state import Command


class Sides(Hooking):
    """The Engine's base: it switches the agent, the inference and the prompt path to
    the side whose turn it is."""

    root: Agent
    agent: Agent
    inference: Inference
    prompt_path: tuple[str, ...]
    _inference_parts: tuple[Any, ...]
    _sides: dict[str, tuple[Agent, Inference, tuple[str, ...]]]

    def _use_side(self, ctx: RunContext) -> Side:
        """Make the side whose turn the committed frontier gives the current one."""
        assert self.root.session is not None
        if not self._sides:
            self._sides["a"] = (self.root, self.inference, self.prompt_path)
        side = current_side(self.root, ctx.frontier)
        ctx.execution.current_side = side
        if side not in self._sides:
            agent = side_agent(self.root, side) or self.root  # a handler or human: no model
            inference = Inference(agent, *self._inference_parts)
            inference.use_checkpoint = self.inference.use_checkpoint
            # side b is as deep in a delegation as side a: its path keeps a's ancestry
            # (a child's side b started at depth 1, and could delegate without end)
            ancestry = self._sides["a"][2][:-1]
            self._sides[side] = (agent, inference, (*ancestry, self.root.session.b.name))
        self.agent, self.inference, self.prompt_path = self._sides[side]
        ctx.execution.prompt_path = self.prompt_path
        return side

    async def _other_turn(self, ctx: RunContext, side: Side, staged: list[Command]) -> bool:
        """Before a model Step of a session: end the session if its turns are over, or
        let a handler or a human take the turn. True if the Step is not the model's."""
        session = self.root.session
        assert session is not None
        if turns_over(self.root, ctx.frontier):
            # closed whatever a guard says of its end: its turns are over, and a session
            # left open ended every later Run of the thread at once, without an inference
            staged.append(closing())
            await self.end(ctx, Natural(), commands=tuple(staged))
            return True
        spec = session.b if side == "b" else None
        if spec is None or spec.backing == "model":
            return False
        ctx.pending.extend(staged)
        if spec.backing == "handler":
            await handler_turn(self, ctx, spec, side)  # type: ignore[arg-type]
        else:  # a human: the Run awaits their answer, holding nothing
            ctx.execution.wait_request = human_wait(spec, side)
        return True

    async def _hand_over(
        self,
        ctx: RunContext,
        side: Side,
        messages: Sequence[Message],
        prior: ActiveToolBatch | None,
        commands: Sequence[Command],
    ) -> None:
        """A model side answered without calls: its answer ends its turn, committed with
        the handover in the Step's inference commit."""
        staged = list(commands)
        stage_forced(ctx.execution, staged)
        rest, passing = handoff(ctx.frontier, side, staged)
        batch = finalize(prior) if prior is not None else None
        await self._commit(
            ctx,
            "inference",
            ctx.running(),
            messages=tuple(messages),
            batch=batch,
            commands=(*rest, *passing),
        )
