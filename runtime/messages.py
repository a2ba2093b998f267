"""Committed conversation messages."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from runtime.base import Frozen, Given
from runtime.ids import CallId


class UserMessage(Frozen):
    kind: Literal["user"] = "user"
    id: str
    """Message id; delivering the same input twice is idempotent by this id."""
    text: str
    side: Literal["a", "b"] | None = None
    """In a session: the handler- or human-backed side whose turn this was."""


class ToolUse(Frozen):
    """One tool call exactly as the model asked for it (arguments kept raw)."""

    call_id: CallId
    tool: str
    arguments: str
    """The model's raw JSON text: validated later so bad JSON becomes a tool error."""


class AssistantMessage(Frozen):
    kind: Literal["assistant"] = "assistant"
    text: str = ""
    tool_calls: tuple[ToolUse, ...] = ()
    side: Literal["a", "b"] | None = None
    """In a session: the model-backed side that answered (None: side ``a``)."""


class ToolResultMessage(Frozen):
    kind: Literal["tool_result"] = "tool_result"
    call_id: CallId
    tool: str
    content: str
    is_error: bool = False


class ContextMessage(Given):
    """Request-only context from a hook: goes into one inference, never committed."""

    kind: Literal["context"] = "context"
    text: str


Message = Annotated[UserMessage | AssistantMessage | ToolResultMessage, Field(discriminator="kind")]
RequestMessage = Annotated[
    UserMessage | AssistantMessage | ToolResultMessage | ContextMessage,
    Field(discriminator="kind"),
]
