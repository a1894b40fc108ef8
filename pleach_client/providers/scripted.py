"""``ScriptedProvider``: a deterministic offline ``Provider`` for demos and tests.

Each call consumes the next ``ScriptedReply`` of the script and streams it as the Anthropic
provider would: ``MessageStart``, thinking/text/tool_use blocks in small deltas, each closed by
``BlockStop``, then ``MessageDelta`` and ``MessageStop``. When the script runs out, the default
reply echoes the last user text, so an offline chat never ends.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import msgspec

from shared.errors import ProviderError

from .base import (
    JSON,
    BlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    ProviderEvent,
    ProviderRequest,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolUseStart,
)

__all__ = ["ScriptedProvider", "ScriptedReply", "echo_reply"]

_WORDS = re.compile(r"\S+\s*|\s+")
_JSON_CHUNK = 16
_SIGNATURE = "scripted-signature"


@dataclass(frozen=True, kw_only=True)
class ScriptedReply:
    """One scripted model reply.

    ``text`` and ``thinking`` stream one word per delta; each of ``tool_calls`` (``(name,
    input)`` pairs) streams as ``ToolUseStart`` and its input JSON in chunks. ``error`` is a
    ``ProviderError`` code to raise: before any event when ``error_after_chunks`` is ``None``,
    else after that many text deltas. ``delay`` seconds pass before each delta. Token counts
    default to about a token per four characters (request JSON in, reply out).
    """

    text: str = ""
    thinking: str | None = None
    tool_calls: Sequence[tuple[str, dict[str, JSON]]] = ()
    error: str | None = None
    error_after_chunks: int | None = None
    error_retryable: bool = False
    delay: float = 0.0
    input_tokens: int | None = None
    output_tokens: int | None = None
    stop_reason: str | None = None


def echo_reply(request: ProviderRequest) -> ScriptedReply:
    """The default reply: ``You said: <last user text>``."""
    said = _last_user_text(request.messages)
    return ScriptedReply(text=f"You said: {said}" if said else "(nothing to echo)")


class ScriptedProvider:
    """Replays ``script`` one reply per call, then ``default_reply`` (an echo) forever.

    ``requests`` holds a copy of every request received, so a test can assert on what would be
    sent. ``closed`` counts streams closed (``aclose()`` or cancellation) before they finished.
    Queue more replies with ``extend``.
    """

    def __init__(
        self,
        script: Iterable[ScriptedReply] | None = None,
        *,
        name: str = "scripted",
        default_reply: ScriptedReply | Callable[[ProviderRequest], ScriptedReply] = echo_reply,
    ) -> None:
        self.name = name
        self.default_reply = default_reply
        self.requests: list[ProviderRequest] = []
        self.closed = 0
        self._pending: deque[ScriptedReply] = deque(script or ())
        self._tool_ids = 0
        self._sized: list[dict[str, JSON]] = []
        self._sized_chars: list[int] = []

    def _json_chars(self, messages: list[dict[str, JSON]]) -> int:
        """``len(json.dumps(messages))``, measuring only the messages after the part this
        conversation's previous request shared (a list compare, identity first, in C): the
        estimate costs what the new messages cost, not the whole conversation again."""
        known = len(self._sized)
        if not (len(messages) >= known and messages[:known] == self._sized):
            known = 0
            self._sized_chars = []
        sizes = self._sized_chars[:known] + [len(json.dumps(m)) for m in messages[known:]]
        self._sized, self._sized_chars = list(messages), sizes
        return 2 + sum(sizes) + 2 * max(0, len(sizes) - 1)

    @property
    def remaining(self) -> int:
        """How many scripted replies are left before the default reply takes over."""
        return len(self._pending)

    def extend(self, replies: Iterable[ScriptedReply]) -> None:
        """Queue more replies after the ones still pending."""
        self._pending.extend(replies)

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Stream the next reply. Raises ``ProviderError`` where the reply scripts an error.

        ``aclose()`` the iterator (or cancel its task) to abort; ``closed`` then counts it.
        """
        # A copy of the list: the caller may go on to append to the list it passed. The message
        # dicts are shared, as the runtime never mutates a message it has sent.
        self.requests.append(msgspec.structs.replace(request, messages=list(request.messages)))
        reply = self._next_reply(request)
        request_id = f"req_scripted_{len(self.requests):04d}"
        if reply.error is not None and reply.error_after_chunks is None:
            raise _scripted_error(reply, request_id)
        try:
            async with aclosing(self._events(reply, request, request_id)) as events:
                async for event in events:
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            self.closed += 1
            raise

    def _next_reply(self, request: ProviderRequest) -> ScriptedReply:
        if self._pending:
            return self._pending.popleft()
        if isinstance(self.default_reply, ScriptedReply):
            return self.default_reply
        return self.default_reply(request)

    async def _events(
        self, reply: ScriptedReply, request: ProviderRequest, request_id: str
    ) -> AsyncGenerator[ProviderEvent, None]:
        input_tokens = reply.input_tokens
        if input_tokens is None:
            input_tokens = _tokens(len(request.system or "") + self._json_chars(request.messages))
        yield MessageStart(request_id=request_id, model=request.model, input_tokens=input_tokens)

        content: list[dict[str, JSON]] = []
        if reply.thinking:
            index = len(content)
            for piece in _WORDS.findall(reply.thinking):
                await asyncio.sleep(reply.delay)
                yield ThinkingDelta(index=index, thinking=piece)
            block: dict[str, JSON] = {
                "type": "thinking",
                "thinking": reply.thinking,
                "signature": _SIGNATURE,
            }
            content.append(block)
            yield BlockStop(index=index, block=block)

        if reply.text or not reply.tool_calls:
            index = len(content)
            sent = 0
            for piece in _WORDS.findall(reply.text):
                if reply.error is not None and sent == reply.error_after_chunks:
                    raise _scripted_error(reply, request_id)
                await asyncio.sleep(reply.delay)
                yield TextDelta(index=index, text=piece)
                sent += 1
            block = {"type": "text", "text": reply.text}
            content.append(block)
            yield BlockStop(index=index, block=block)
        if reply.error is not None:
            # Fewer text deltas than error_after_chunks: fail once the text is out.
            raise _scripted_error(reply, request_id)

        for tool_name, tool_input in reply.tool_calls:
            index = len(content)
            self._tool_ids += 1
            tool_id = f"toolu_scripted_{self._tool_ids:04d}"
            yield ToolUseStart(index=index, id=tool_id, name=tool_name)
            encoded = json.dumps(tool_input)
            for start in range(0, len(encoded), _JSON_CHUNK):
                await asyncio.sleep(reply.delay)
                yield ToolInputDelta(index=index, partial_json=encoded[start : start + _JSON_CHUNK])
            block = {
                "type": "tool_use",
                "id": tool_id,
                "name": tool_name,
                "input": json.loads(encoded),
            }
            content.append(block)
            yield BlockStop(index=index, block=block)

        output_tokens = reply.output_tokens
        if output_tokens is None:
            output_tokens = _tokens(sum(len(json.dumps(block)) for block in content))
        stop_reason = reply.stop_reason or ("tool_use" if reply.tool_calls else "end_turn")
        yield MessageDelta(stop_reason=stop_reason, output_tokens=output_tokens)
        yield MessageStop(
            content=content,
            stop_reason=stop_reason,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            request_id=request_id,
        )


def _scripted_error(reply: ScriptedReply, request_id: str) -> ProviderError:
    code = reply.error or "provider_error"
    return ProviderError(
        f"scripted {code} error",
        code=code,
        retryable=reply.error_retryable,
        request_id=request_id,
    )


def _tokens(chars: int) -> int:
    return max(1, (chars + 3) // 4)


def _last_user_text(messages: list[dict[str, JSON]]) -> str:
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = [
                block["text"]
                for block in content
                if isinstance(block, dict) and block.get("type") == "text"
            ]
            if texts:
                return "\n".join(texts)
    return ""
