"""Ratchet's pure runtime: types, state machines, recovery decisions, the Step engine.

Nothing here imports ray, redis or sqlalchemy (a test asserts it).
"""

from runtime.agent import Agent, load_agent
from runtime.batch import (
    ActiveToolBatch,
    CallSpec,
    ToolCall,
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
from runtime.commit import Frontier, Receipt, ThreadCommit, advance, check_append, replay
from runtime.engine import Engine, RunContext, StoreRetry, now_us
from runtime.errors import (
    AgentImportError,
    CorruptBatch,
    CorruptRecord,
    DuplicateOperation,
    Fenced,
    InvalidTransition,
    PayloadTooLarge,
    RatchetError,
    ResumeRejected,
    RunEnded,
    ScriptExhausted,
    StateConflict,
    StoreError,
    StoreUnavailable,
    ToolDefinitionError,
    VersionConflict,
)
from runtime.events import AgentEvent, Delta, Fact
from runtime.faults import Crash, FaultPlan
from runtime.hooks import ExecutionState, Hook, HookInput, HookOutput
from runtime.ids import CallId, CorrelationId, OperationId, RunId, ThreadId
from runtime.lifecycle import (
    AwaitingState,
    EndedState,
    ExternalResult,
    PermissionDecision,
    ResumeCommand,
    ResumeTicket,
    RunningState,
    ThreadStatus,
    UserInput,
    validate_resume,
)
from runtime.messages import AssistantMessage, ToolResultMessage, ToolUse, UserMessage
from runtime.models import InferenceRequest, Model, ModelDelta, ModelResponse, ScriptedModel, call
from runtime.ports import (
    CommitStore,
    CommittedRecord,
    LiveBus,
    RunSummary,
    StreamCheckpoint,
    StreamCheckpointStore,
    ToolInvocation,
    ToolRunner,
)
from runtime.recovery import Decision, decide
from runtime.runner import InProcessRunner
from runtime.state import Command
from runtime.tools import (
    LocalToolRunner,
    Tool,
    ToolContext,
    ToolResult,
    UnavailableBeforeDispatch,
    invoke_safely,
    tool,
)

__all__ = [
    "ActiveToolBatch", "Agent", "AgentEvent", "AgentImportError", "AssistantMessage",
    "AwaitingState", "CallId", "CallSpec", "Command", "CommitStore", "CommittedRecord",
    "CorrelationId", "CorruptBatch", "CorruptRecord", "Crash", "Decision", "Delta",
    "DuplicateOperation", "EndedState", "Engine", "ExecutionState", "ExternalResult", "Fact",
    "FaultPlan", "Fenced", "Frontier", "Hook", "HookInput", "HookOutput", "InProcessRunner",
    "InferenceRequest", "InvalidTransition", "LiveBus", "LocalToolRunner", "Model",
    "ModelDelta", "ModelResponse", "OperationId", "PayloadTooLarge", "PermissionDecision",
    "RatchetError", "Receipt", "ResumeCommand", "ResumeRejected", "ResumeTicket", "RunContext",
    "RunEnded", "RunId", "RunSummary", "RunningState", "ScriptExhausted", "ScriptedModel",
    "StateConflict", "StoreError", "StoreRetry", "StoreUnavailable", "StreamCheckpoint",
    "StreamCheckpointStore", "ThreadCommit", "ThreadId", "ThreadStatus", "Tool", "ToolCall",
    "ToolContext", "ToolDefinitionError", "ToolInvocation", "ToolOutput",
    "ToolRecoveryPolicy", "ToolResult", "ToolResultMessage", "ToolRunner", "ToolUse",
    "UnavailableBeforeDispatch", "UserInput", "UserMessage", "VersionConflict", "advance",
    "call", "check_append", "complete", "decide", "decode_batch", "finalize", "invoke_safely",
    "load_agent", "mark_awaiting", "mark_executing", "mark_indeterminate", "now_us",
    "open_batch", "replay", "seal", "tool", "validate_resume",
]
