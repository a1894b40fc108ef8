"""LLM providers behind one small protocol: ``AnthropicProvider`` and ``ScriptedProvider``."""

from __future__ import annotations

from .anthropic import AnthropicProvider, translate_error
from .base import (
    BlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    Provider,
    ProviderEvent,
    ProviderRequest,
    StopReason,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolSpec,
    ToolUseStart,
)
from .pricing import PRICES, ModelPrice, cost_usd, price_for
from .scripted import ScriptedProvider, ScriptedReply, echo_reply

__all__ = [
    "PRICES",
    "AnthropicProvider",
    "BlockStop",
    "MessageDelta",
    "MessageStart",
    "MessageStop",
    "ModelPrice",
    "Provider",
    "ProviderEvent",
    "ProviderRequest",
    "ScriptedProvider",
    "ScriptedReply",
    "StopReason",
    "TextDelta",
    "ThinkingDelta",
    "ToolInputDelta",
    "ToolSpec",
    "ToolUseStart",
    "cost_usd",
    "echo_reply",
    "price_for",
    "translate_error",
]
