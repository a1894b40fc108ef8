"""LLM providers behind one small protocol: ``AnthropicProvider`` and ``ScriptedProvider``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .anthropic import AnthropicProvider, translate_error


def __getattr__(name: str) -> Any:
    # The anthropic SDK takes seconds to import: only a host that uses it pays for it.
    if name in ("AnthropicProvider", "translate_error"):
        from . import anthropic

        return getattr(anthropic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
