"""The ``Provider`` protocol: one streamed model call, as provider-neutral events.

A provider turns a ``ProviderRequest`` into an async iterator of ``ProviderEvent``s. The turn
closes the iterator (``aclose()``) to abort: the provider must then close its network stream.
Failures are raised as ``shared.errors.ProviderError`` (never a foreign exception), possibly
after some events were already yielded (a mid-stream error).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

JSON = Any


class ToolSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str
    input_schema: dict[str, JSON]


class ProviderRequest(msgspec.Struct, kw_only=True):
    """What one call sends: Anthropic-shaped messages (role + content blocks)."""

    model: str
    messages: list[dict[str, JSON]]
    system: str | None = None
    tools: list[ToolSpec] = []
    max_tokens: int = 4096
    thinking_budget: int | None = None


class MessageStart(msgspec.Struct, kw_only=True, tag="message_start"):
    """Usage known at the start: input tokens are spent once this arrives (prefill)."""

    request_id: str | None
    model: str
    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextDelta(msgspec.Struct, kw_only=True, tag="text_delta"):
    index: int
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag="thinking_delta"):
    index: int
    thinking: str


class ToolUseStart(msgspec.Struct, kw_only=True, tag="tool_use_start"):
    index: int
    id: str
    name: str


class ToolInputDelta(msgspec.Struct, kw_only=True, tag="tool_input_delta"):
    index: int
    partial_json: str


class BlockStop(msgspec.Struct, kw_only=True, tag="block_stop"):
    """A content block is complete; ``block`` is its final Anthropic-shaped dict."""

    index: int
    block: dict[str, JSON]


class MessageDelta(msgspec.Struct, kw_only=True, tag="message_delta"):
    """Cumulative output usage so far, and the stop reason once known."""

    stop_reason: str | None
    output_tokens: int


class MessageStop(msgspec.Struct, kw_only=True, tag="message_stop"):
    """The call finished: the whole assistant content and the final usage."""

    content: list[dict[str, JSON]]
    stop_reason: str | None
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    request_id: str | None = None


ProviderEvent = (
    MessageStart
    | TextDelta
    | ThinkingDelta
    | ToolUseStart
    | ToolInputDelta
    | BlockStop
    | MessageDelta
    | MessageStop
)

StopReason = Literal["end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal"]


@runtime_checkable
class Provider(Protocol):
    """A streaming LLM provider. ``name`` is what sessions lock (e.g. ``"anthropic"``)."""

    name: str

    def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Start one call; iterate for events; ``aclose()`` the iterator to abort it."""
        ...


class UnavailableProvider:
    """Stands in for a provider that cannot be used (a session locked to another provider, a
    missing API key): every call fails with ``error`` before anything is sent."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.error = error

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        raise self.error
        yield  # pragma: no cover (makes this an async generator)
