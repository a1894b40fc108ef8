"""``AnthropicProvider``: the ``Provider`` protocol over the real ``anthropic`` SDK.

One ``stream()`` call is one ``client.messages.stream(...)``: the SDK's stream events are mapped
to ``ProviderEvent``s, and every SDK or transport failure is raised as ``ProviderError`` with a
stable ``code``. Closing the iterator (``aclose()``, or cancelling the task that iterates it)
exits the SDK stream manager, which closes the HTTP response.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Mapping
from types import TracebackType
from typing import Any, NoReturn, cast

import anthropic
import httpx2
from anthropic.lib.streaming import AsyncMessageStream, ParsedMessageStreamEvent
from anthropic.types import MessageParam, ThinkingConfigParam, ToolParam
from anthropic.types.parsed_message import ParsedContentBlock

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

__all__ = ["AnthropicProvider", "translate_error"]

# API ``error.type`` -> (our code, retryable). The body's type wins over the HTTP status: a
# mid-stream ``event: error`` arrives on a 200 response.
_ERROR_TYPES: dict[str, tuple[str, bool]] = {
    "overloaded_error": ("overloaded", True),
    "rate_limit_error": ("rate_limited", True),
    "api_error": ("api_error", True),
    "timeout_error": ("timeout", True),
    "invalid_request_error": ("invalid_request", False),
    "authentication_error": ("authentication_error", False),
    "permission_error": ("permission_error", False),
    "billing_error": ("billing_error", False),
    "not_found_error": ("not_found", False),
    "request_too_large": ("request_too_large", False),
}

_STATUSES: dict[int, tuple[str, bool]] = {
    400: ("invalid_request", False),
    401: ("authentication_error", False),
    402: ("billing_error", False),
    403: ("permission_error", False),
    404: ("not_found", False),
    408: ("timeout", True),
    413: ("request_too_large", False),
    422: ("invalid_request", False),
    429: ("rate_limited", True),
    504: ("timeout", True),
    529: ("overloaded", True),
}


DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0


class AnthropicProvider:
    """Streams Claude calls through ``anthropic.AsyncAnthropic``.

    Pass a ready ``client`` (tests pass one over ``httpx2.MockTransport``), or let the provider
    build one from ``api_key``/``base_url``/``max_retries`` and the timeouts: ``connect_timeout``
    (10 s) to reach the API, ``read_timeout`` (60 s) between two chunks of an answer (the API
    pings a live stream well within that; the SDK's own default waits 600 s). The SDK retries a
    failed request
    (429, 5xx, 529, connection errors) ``max_retries`` times before the stream starts, never
    mid-stream. A provider that built its client owns it: ``aclose()`` it, or use it as an
    ``async with`` block, when done.
    """

    name = "anthropic"

    def __init__(
        self,
        client: anthropic.AsyncAnthropic | None = None,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 2,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self._owns_client = client is None
        if client is None:
            try:
                client = anthropic.AsyncAnthropic(
                    api_key=api_key,
                    base_url=base_url,
                    max_retries=max_retries,
                    timeout=anthropic.Timeout(read_timeout, connect=connect_timeout),
                )
            except anthropic.AnthropicError as exc:
                # A profile or federation config the SDK found on its own is broken.
                raise ProviderError(
                    f"Anthropic credentials could not be loaded: {exc}", code="credentials_error"
                ) from exc
            if client.api_key is None and client.auth_token is None and client.credentials is None:
                raise ProviderError(
                    "no Anthropic credentials: pass api_key=, set ANTHROPIC_API_KEY, "
                    "or run offline with the scripted provider",
                    code="missing_api_key",
                )
        self.client = client

    @classmethod
    def from_env(
        cls,
        *,
        environ: Mapping[str, str] | None = None,
        base_url: str | None = None,
        max_retries: int = 2,
    ) -> AnthropicProvider:
        """Build a provider from ``ANTHROPIC_API_KEY`` (and ``ANTHROPIC_BASE_URL`` if set);
        ``PLEACH_CONNECT_TIMEOUT`` and ``PLEACH_READ_TIMEOUT`` (seconds) set the timeouts.

        Raises ``ProviderError(code="missing_api_key")`` when the key is unset or empty: tell the
        user to export it, or to run offline.
        """
        env = os.environ if environ is None else environ
        api_key = env.get("ANTHROPIC_API_KEY", "").strip()
        if not api_key:
            raise ProviderError(
                "ANTHROPIC_API_KEY is not set: export it to call Claude, "
                "or run offline (pleach chat --offline)",
                code="missing_api_key",
            )
        try:
            connect = float(env.get("PLEACH_CONNECT_TIMEOUT") or DEFAULT_CONNECT_TIMEOUT)
            read = float(env.get("PLEACH_READ_TIMEOUT") or DEFAULT_READ_TIMEOUT)
        except ValueError as exc:
            raise ProviderError(
                f"PLEACH_CONNECT_TIMEOUT / PLEACH_READ_TIMEOUT must be seconds: {exc}",
                code="invalid_config",
            ) from exc
        return cls(
            api_key=api_key,
            base_url=base_url or env.get("ANTHROPIC_BASE_URL") or None,
            max_retries=max_retries,
            connect_timeout=connect,
            read_timeout=read,
        )

    async def aclose(self) -> None:
        """Close the HTTP client if this provider built it; a client passed in is left open."""
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> AnthropicProvider:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Make one call and yield its events, ending with ``MessageStop``.

        Raises ``ProviderError`` on any failure, possibly after some events (the caller keeps
        the partial reply and decides whether to retry from ``retryable``). To abort, call
        ``aclose()`` on this iterator (or cancel the task iterating it): the HTTP stream closes.
        """
        request_id: str | None = None
        try:
            async with self.client.messages.stream(**_call_arguments(request)) as sdk_stream:
                request_id = sdk_stream.request_id
                async for sdk_event in sdk_stream:
                    event = _translate_event(sdk_event, sdk_stream)
                    if event is not None:
                        yield event
                    if isinstance(event, MessageStop):
                        return
        except anthropic.APIError as exc:
            if request_id is not None and isinstance(exc, anthropic.APIConnectionError):
                # The body broke after the response began (newer SDKs wrap a mid-body
                # transport error so): the stream's own failure, with its response's id.
                timeout = isinstance(exc, anthropic.APITimeoutError)
                raise _stream_broke(exc, request_id, timeout=timeout) from exc
            raise translate_error(exc) from exc
        except httpx2.TimeoutException as exc:
            # A read timeout mid-body, as older SDKs raise it: httpx2's own (newer ones wrap it).
            raise _stream_broke(exc, request_id, timeout=True) from exc
        except httpx2.TransportError as exc:
            raise _stream_broke(exc, request_id, timeout=False) from exc
        except ValueError as exc:
            # The SDK could not parse the tool input JSON the model streamed.
            raise ProviderError(
                f"Anthropic sent an unparseable stream: {exc}",
                code="invalid_response",
                retryable=True,
                request_id=request_id,
            ) from exc
        except anthropic.AnthropicError as exc:
            # Not an API error: credentials that failed to load or exchange, or a middleware's.
            credentials = isinstance(exc, anthropic.CredentialsError)
            raise ProviderError(
                f"Anthropic client failed: {exc}",
                code="credentials_error" if credentials else "provider_error",
                request_id=request_id,
            ) from exc
        _raise_truncated(request_id)


def _stream_broke(exc: BaseException, request_id: str | None, *, timeout: bool) -> ProviderError:
    """A stream whose connection broke (or whose reads timed out) once its response began."""
    return ProviderError(
        f"Anthropic stream {'timed out' if timeout else 'broke'}: {exc}",
        code="timeout" if timeout else "connection_error",
        retryable=True,
        request_id=request_id,
    )


def _raise_truncated(request_id: str | None) -> NoReturn:
    raise ProviderError(
        "Anthropic stream ended before message_stop",
        code="connection_error",
        retryable=True,
        request_id=request_id,
    )


def translate_error(exc: anthropic.APIError) -> ProviderError:
    """The ``ProviderError`` for an SDK error, with a stable ``code`` and ``retryable``.

    ``status`` is the HTTP status of a failed request; it is ``None`` for a connection error
    and for an ``event: error`` received mid-stream (whose response was a 200).
    """
    if isinstance(exc, anthropic.APITimeoutError):
        return ProviderError(f"Anthropic request timed out: {exc}", code="timeout", retryable=True)
    if isinstance(exc, anthropic.APIConnectionError):
        return ProviderError(
            f"could not reach Anthropic: {exc}", code="connection_error", retryable=True
        )
    if isinstance(exc, anthropic.APIStatusError):
        http_status = exc.status_code
        status = http_status if http_status >= 400 else None
        error_type = exc.type or ""
        if error_type in _ERROR_TYPES:
            code, retryable = _ERROR_TYPES[error_type]
        elif http_status in _STATUSES:
            code, retryable = _STATUSES[http_status]
        else:
            # Unknown 5xx, or an unknown error event mid-stream: a server-side failure.
            code, retryable = "api_error", status is None or http_status >= 500
        should_retry = exc.response.headers.get("x-should-retry")
        if should_retry in ("true", "false"):
            retryable = should_retry == "true"
        request_id = exc.request_id or _body_request_id(exc.body)
        detail = exc.api_message or exc.message
        where = f"HTTP {status}" if status is not None else "mid-stream"
        return ProviderError(
            f"Anthropic {code} ({where}): {detail}",
            code=code,
            retryable=retryable,
            status=status,
            request_id=request_id,
        )
    status = getattr(exc, "status_code", None)
    return ProviderError(
        f"Anthropic API error: {exc.message}",
        code="api_error",
        retryable=False,
        status=status if isinstance(status, int) else None,
    )


def _body_request_id(body: object) -> str | None:
    if isinstance(body, dict):
        value = body.get("request_id")
        if isinstance(value, str):
            return value
    return None


def _call_arguments(request: ProviderRequest) -> dict[str, Any]:
    """The ``messages.stream`` keyword arguments for ``request`` (unset options are omitted)."""
    arguments: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "messages": cast(list[MessageParam], request.messages),
    }
    if request.system is not None:
        arguments["system"] = request.system
    if request.tools:
        arguments["tools"] = [
            ToolParam(
                name=tool.name,
                description=tool.description,
                input_schema=tool.input_schema,
            )
            for tool in request.tools
        ]
    if request.thinking_budget:
        thinking: ThinkingConfigParam = {
            "type": "enabled",
            "budget_tokens": request.thinking_budget,
        }
        arguments["thinking"] = thinking
    return arguments


def _translate_event(
    event: ParsedMessageStreamEvent[Any], stream: AsyncMessageStream[Any]
) -> ProviderEvent | None:
    """Our event for one SDK event, or ``None`` for the SDK's derived convenience events."""
    match event.type:
        case "message_start":
            usage = event.message.usage
            return MessageStart(
                request_id=stream.request_id,
                model=event.message.model,
                input_tokens=usage.input_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
                cache_read_input_tokens=usage.cache_read_input_tokens or 0,
            )
        case "content_block_start":
            block = event.content_block
            if block.type == "tool_use":
                return ToolUseStart(index=event.index, id=block.id, name=block.name)
            return None
        case "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta":
                return TextDelta(index=event.index, text=delta.text)
            if delta.type == "thinking_delta":
                return ThinkingDelta(index=event.index, thinking=delta.thinking)
            if delta.type == "input_json_delta":
                return ToolInputDelta(index=event.index, partial_json=delta.partial_json)
            return None  # signature and citation deltas land in the final block
        case "content_block_stop":
            return BlockStop(index=event.index, block=_block_dict(event.content_block))
        case "message_delta":
            return MessageDelta(
                stop_reason=event.delta.stop_reason, output_tokens=event.usage.output_tokens
            )
        case "message_stop":
            message = event.message
            usage = message.usage
            return MessageStop(
                content=[_block_dict(block) for block in message.content],
                stop_reason=message.stop_reason,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
                cache_read_input_tokens=usage.cache_read_input_tokens or 0,
                request_id=stream.request_id,
            )
        case _:
            # "text", "thinking", "input_json", "signature", "citation": the SDK's derived
            # events duplicate the raw deltas above.
            return None


def _block_dict(block: ParsedContentBlock[Any]) -> dict[str, JSON]:
    """A final content block as the plain dict the next request sends back."""
    match block.type:
        case "text":
            text: dict[str, JSON] = {"type": "text", "text": block.text}
            if block.citations:
                text["citations"] = [citation.to_dict(mode="json") for citation in block.citations]
            return text
        case "tool_use":
            tool_input = block.input if isinstance(block.input, dict) else {}
            return {"type": "tool_use", "id": block.id, "name": block.name, "input": tool_input}
        case "thinking":
            return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
        case "redacted_thinking":
            return {"type": "redacted_thinking", "data": block.data}
        case _:
            return cast(dict[str, JSON], block.to_dict(mode="json", exclude_none=True))
