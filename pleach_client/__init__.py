"""pleach client: an offline-first session runtime for LLM agents over a local SQLite file.

The common names are importable from here (``from pleach_client import SessionRuntime``); each
is loaded on first use, so ``import pleach_client`` stays cheap (the anthropic SDK, slow to
import, is loaded only for ``AnthropicProvider``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import RecordCache
    from .degradation import DegradedModelRecord
    from .diagnostics import DiagnosticsReport
    from .files import FileReference
    from .interrupts import ApprovalDecision, Approve, Edit, Interrupt, InterruptConfig, Reject
    from .plugins import ExponentialRetry, ToolInvocation, TurnContext
    from .prompts import PromptFragment
    from .providers.anthropic import AnthropicProvider
    from .providers.scripted import ScriptedProvider, ScriptedReply
    from .receipts import InterruptResolveReceipt
    from .runtime import SessionRuntime
    from .safety import Redact, Refuse, ToolAllowlist
    from .store.memory import MemoryAdapter
    from .store.postgres import PostgresAdapter
    from .store.sqlite import SQLiteAdapter
    from .tasks import JobHandler
    from .tools import Tool

_WHERE = {
    "SessionRuntime": ".runtime",
    "SQLiteAdapter": ".store.sqlite",
    "MemoryAdapter": ".store.memory",
    "PostgresAdapter": ".store.postgres",
    "RecordCache": ".cache",
    "DegradedModelRecord": ".degradation",
    "DiagnosticsReport": ".diagnostics",
    "JobHandler": ".tasks",
    "ScriptedProvider": ".providers.scripted",
    "ScriptedReply": ".providers.scripted",
    "AnthropicProvider": ".providers.anthropic",
    "Tool": ".tools",
    "InterruptConfig": ".interrupts",
    "Interrupt": ".interrupts",
    "ApprovalDecision": ".interrupts",
    "Approve": ".interrupts",
    "Reject": ".interrupts",
    "Edit": ".interrupts",
    "InterruptResolveReceipt": ".receipts",
    "FileReference": ".files",
    "PromptFragment": ".prompts",
    "ExponentialRetry": ".plugins",
    "ToolInvocation": ".plugins",
    "TurnContext": ".plugins",
    "Redact": ".safety",
    "Refuse": ".safety",
    "ToolAllowlist": ".safety",
}

__all__ = [
    "AnthropicProvider",
    "ApprovalDecision",
    "Approve",
    "DegradedModelRecord",
    "DiagnosticsReport",
    "Edit",
    "ExponentialRetry",
    "FileReference",
    "Interrupt",
    "InterruptConfig",
    "InterruptResolveReceipt",
    "JobHandler",
    "MemoryAdapter",
    "PostgresAdapter",
    "PromptFragment",
    "RecordCache",
    "Redact",
    "Refuse",
    "Reject",
    "SQLiteAdapter",
    "ScriptedProvider",
    "ScriptedReply",
    "SessionRuntime",
    "Tool",
    "ToolAllowlist",
    "ToolInvocation",
    "TurnContext",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
