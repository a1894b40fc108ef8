"""Anthropic Messages API streams as they appear on the wire, for driving the real SDK offline.

Each helper returns one server-sent event (``event: ...\\ndata: {...}\\n\\n``) with the JSON the
API sends; ``StreamBody`` serves them as a streaming ``httpx2`` response body that records how
far it was read and whether it was closed, so an abort is observable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx2

MODEL = "claude-sonnet-4-6"


def event(name: str, data: dict[str, Any], *, compact: bool = True) -> bytes:
    """One SSE event. The API sends compact JSON, except for ``ping`` and ``error``."""
    separators = (",", ":") if compact else (", ", ": ")
    return f"event: {name}\ndata: {json.dumps(data, separators=separators)}\n\n".encode()


def message_start(
    *,
    input_tokens: int = 25,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
    model: str = MODEL,
    message_id: str = "msg_01XFDUDYJgAACzvnptvVoYEL",
) -> bytes:
    return event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "model": model,
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": input_tokens,
                    "cache_creation_input_tokens": cache_creation_input_tokens,
                    "cache_read_input_tokens": cache_read_input_tokens,
                    "cache_creation": {
                        "ephemeral_5m_input_tokens": cache_creation_input_tokens,
                        "ephemeral_1h_input_tokens": 0,
                    },
                    "output_tokens": 1,
                    "service_tier": "standard",
                },
            },
        },
    )


def ping() -> bytes:
    return event("ping", {"type": "ping"}, compact=False)


def text_start(index: int) -> bytes:
    return _block_start(index, {"type": "text", "text": ""})


def thinking_start(index: int) -> bytes:
    return _block_start(index, {"type": "thinking", "thinking": "", "signature": ""})


def tool_use_start(index: int, tool_id: str, name: str) -> bytes:
    return _block_start(index, {"type": "tool_use", "id": tool_id, "name": name, "input": {}})


def text_delta(index: int, text: str) -> bytes:
    return _delta(index, {"type": "text_delta", "text": text})


def thinking_delta(index: int, thinking: str) -> bytes:
    return _delta(index, {"type": "thinking_delta", "thinking": thinking})


def signature_delta(index: int, signature: str) -> bytes:
    return _delta(index, {"type": "signature_delta", "signature": signature})


def input_json_delta(index: int, partial_json: str) -> bytes:
    return _delta(index, {"type": "input_json_delta", "partial_json": partial_json})


def block_stop(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(
    *,
    stop_reason: str | None = "end_turn",
    output_tokens: int,
    input_tokens: int | None = None,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
) -> bytes:
    """``usage`` here is cumulative; newer API versions repeat the input and cache tokens."""
    usage: dict[str, Any] = {"output_tokens": output_tokens}
    if input_tokens is not None:
        usage = {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": cache_creation_input_tokens,
            "cache_read_input_tokens": cache_read_input_tokens,
            "output_tokens": output_tokens,
        }
    return event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage,
        },
    )


def message_stop() -> bytes:
    return event("message_stop", {"type": "message_stop"})


def error(error_type: str = "overloaded_error", message: str = "Overloaded") -> bytes:
    """A mid-stream failure, sent on the already-200 response."""
    return event(
        "error",
        {"type": "error", "error": {"type": error_type, "message": message}},
        compact=False,
    )


def error_body(
    error_type: str = "overloaded_error",
    message: str = "Overloaded",
    request_id: str = "req_011CSHoEeqs5C35K2UUqR7Fy",
) -> dict[str, Any]:
    """The JSON body of an HTTP error response."""
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": request_id,
    }


def text_stream(
    chunks: Sequence[str], *, input_tokens: int = 25, output_tokens: int = 12
) -> list[bytes]:
    """A whole one-text-block reply, as the API streams it (a ping after the block start)."""
    return [
        message_start(input_tokens=input_tokens),
        text_start(0),
        ping(),
        *(text_delta(0, chunk) for chunk in chunks),
        block_stop(0),
        message_delta(output_tokens=output_tokens),
        message_stop(),
    ]


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


class StreamBody(httpx2.AsyncByteStream):
    """A streaming response body: yields ``chunks`` one by one as the reader asks for them.

    With ``hold_after``, it stops after that many chunks and waits for ``release`` (never set
    by default), so a reader is provably mid-stream. ``sent`` counts chunks handed out;
    ``closed`` is set by ``aclose()``, which the SDK calls when its stream is closed.
    """

    def __init__(self, chunks: Sequence[bytes], *, hold_after: int | None = None) -> None:
        self.chunks = list(chunks)
        self.hold_after = hold_after
        self.release = asyncio.Event()
        self.reached_hold = asyncio.Event()
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.sent == self.hold_after:
                self.reached_hold.set()
                await self.release.wait()
            self.sent += 1
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


def sse_response(
    chunks: Sequence[bytes] | StreamBody, *, request_id: str = "req_test_0001"
) -> httpx2.Response:
    """A 200 ``text/event-stream`` response streaming ``chunks``."""
    body = chunks if isinstance(chunks, StreamBody) else StreamBody(chunks)
    return httpx2.Response(
        200,
        headers={"content-type": "text/event-stream; charset=utf-8", "request-id": request_id},
        stream=body,
    )


def error_response(
    status: int,
    error_type: str,
    message: str,
    *,
    request_id: str = "req_011CSHoEeqs5C35K2UUqR7Fy",
    headers: dict[str, str] | None = None,
) -> httpx2.Response:
    """An HTTP error response as the API sends it (JSON body, ``request-id`` header)."""
    return httpx2.Response(
        status,
        headers={"request-id": request_id, **(headers or {})},
        json=error_body(error_type, message, request_id),
    )
