"""AnthropicProvider drives the real anthropic SDK over httpx2.MockTransport replaying SSE."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import pytest

from pleach_client.providers import (
    AnthropicProvider,
    BlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    ProviderEvent,
    ProviderRequest,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolSpec,
    ToolUseStart,
    cost_usd,
    price_for,
)
from shared.errors import ProviderError
from tests import sse

WEATHER = ToolSpec(
    name="get_weather",
    description="Current weather for a city.",
    input_schema={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
)


class FakeAPI:
    """The server side: answers each request with the next queued response (or exception)."""

    def __init__(self) -> None:
        self.replies: deque[httpx2.Response | Exception] = deque()
        self.requests: list[httpx2.Request] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        reply = self.replies.popleft()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def serve(self, *chunks: bytes, request_id: str = "req_test_0001") -> sse.StreamBody:
        body = sse.StreamBody(chunks)
        self.replies.append(sse.sse_response(body, request_id=request_id))
        return body

    def sent_json(self) -> dict[str, object]:
        body: dict[str, object] = json.loads(self.requests[-1].content)
        return body


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


@pytest.fixture
async def provider(api: FakeAPI) -> AsyncIterator[AnthropicProvider]:
    http_client = httpx2.AsyncClient(transport=httpx2.MockTransport(api.handler))
    client = anthropic.AsyncAnthropic(
        api_key="test", base_url="http://test", http_client=http_client, max_retries=0
    )
    async with client:
        yield AnthropicProvider(client)


def ask(text: str = "Hello", **kwargs: object) -> ProviderRequest:
    return ProviderRequest(
        model=sse.MODEL,
        messages=[{"role": "user", "content": text}],
        **kwargs,  # type: ignore[arg-type]
    )


async def collect(provider: AnthropicProvider, request: ProviderRequest) -> list[ProviderEvent]:
    return [event async for event in provider.stream(request)]


async def test_text_stream_maps_deltas_usage_and_request_id(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(
        sse.message_start(input_tokens=472, cache_read_input_tokens=100),
        sse.text_start(0),
        sse.ping(),
        sse.text_delta(0, "Hello"),
        sse.ping(),
        sse.text_delta(0, ", world"),
        sse.block_stop(0),
        sse.message_delta(output_tokens=89, input_tokens=472, cache_read_input_tokens=100),
        sse.message_stop(),
        request_id="req_011CRzNkGp",
    )

    events = await collect(provider, ask())

    assert events == [
        MessageStart(
            request_id="req_011CRzNkGp",
            model=sse.MODEL,
            input_tokens=472,
            cache_read_input_tokens=100,
        ),
        TextDelta(index=0, text="Hello"),
        TextDelta(index=0, text=", world"),
        BlockStop(index=0, block={"type": "text", "text": "Hello, world"}),
        MessageDelta(stop_reason="end_turn", output_tokens=89),
        MessageStop(
            content=[{"type": "text", "text": "Hello, world"}],
            stop_reason="end_turn",
            input_tokens=472,
            output_tokens=89,
            cache_read_input_tokens=100,
            request_id="req_011CRzNkGp",
        ),
    ]


async def test_message_delta_output_tokens_are_cumulative(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(
        sse.message_start(input_tokens=10),
        sse.text_start(0),
        sse.text_delta(0, "a"),
        sse.message_delta(stop_reason=None, output_tokens=5),
        sse.text_delta(0, "b"),
        sse.block_stop(0),
        sse.message_delta(output_tokens=9),
        sse.message_stop(),
    )

    events = await collect(provider, ask())

    deltas = [event for event in events if isinstance(event, MessageDelta)]
    assert deltas == [
        MessageDelta(stop_reason=None, output_tokens=5),
        MessageDelta(stop_reason="end_turn", output_tokens=9),
    ]
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert (stop.input_tokens, stop.output_tokens) == (10, 9)


async def test_thinking_block_keeps_its_signature(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(
        sse.message_start(),
        sse.thinking_start(0),
        sse.thinking_delta(0, "Let me think"),
        sse.thinking_delta(0, " about it."),
        sse.signature_delta(0, "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pk"),
        sse.block_stop(0),
        sse.text_start(1),
        sse.text_delta(1, "42"),
        sse.block_stop(1),
        sse.message_delta(output_tokens=30),
        sse.message_stop(),
    )

    events = await collect(provider, ask(thinking_budget=2048, max_tokens=8000))

    thinking = {
        "type": "thinking",
        "thinking": "Let me think about it.",
        "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pk",
    }
    assert events[1:4] == [
        ThinkingDelta(index=0, thinking="Let me think"),
        ThinkingDelta(index=0, thinking=" about it."),
        BlockStop(index=0, block=thinking),
    ]
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert stop.content == [thinking, {"type": "text", "text": "42"}]
    assert api.sent_json()["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert api.sent_json()["max_tokens"] == 8000


async def test_tool_use_input_is_parsed_from_json_chunks(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(
        sse.message_start(),
        sse.text_start(0),
        sse.text_delta(0, "Checking."),
        sse.block_stop(0),
        sse.tool_use_start(1, "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "get_weather"),
        sse.input_json_delta(1, ""),
        sse.input_json_delta(1, '{"city": "San'),
        sse.input_json_delta(1, ' Francisco", "un'),
        sse.input_json_delta(1, 'it": "celsius"}'),
        sse.block_stop(1),
        sse.message_delta(stop_reason="tool_use", output_tokens=54),
        sse.message_stop(),
    )

    events = await collect(provider, ask("Weather in SF?", tools=[WEATHER]))

    tool_use = {
        "type": "tool_use",
        "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
        "name": "get_weather",
        "input": {"city": "San Francisco", "unit": "celsius"},
    }
    assert events[3:9] == [
        ToolUseStart(index=1, id="toolu_01T1x1fJ34qAmk2tNTrN7Up6", name="get_weather"),
        ToolInputDelta(index=1, partial_json=""),
        ToolInputDelta(index=1, partial_json='{"city": "San'),
        ToolInputDelta(index=1, partial_json=' Francisco", "un'),
        ToolInputDelta(index=1, partial_json='it": "celsius"}'),
        BlockStop(index=1, block=tool_use),
    ]
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert stop.stop_reason == "tool_use"
    assert stop.content == [{"type": "text", "text": "Checking."}, tool_use]


async def test_request_body_carries_model_messages_system_and_tools(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(*sse.text_stream(["ok"]))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in SF?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}],
        },
    ]
    request = ProviderRequest(
        model=sse.MODEL,
        messages=messages,
        system="Be brief.",
        tools=[WEATHER],
        max_tokens=1024,
    )

    await collect(provider, request)

    sent = api.requests[-1]
    assert (sent.method, sent.url.path) == ("POST", "/v1/messages")
    assert api.sent_json() == {
        "model": sse.MODEL,
        "max_tokens": 1024,
        "messages": messages,
        "system": "Be brief.",
        "tools": [
            {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "input_schema": WEATHER.input_schema,
            }
        ],
        "stream": True,
    }


async def test_unset_options_are_not_sent(api: FakeAPI, provider: AnthropicProvider) -> None:
    api.serve(*sse.text_stream(["ok"]))

    await collect(provider, ask())

    assert set(api.sent_json()) == {"model", "max_tokens", "messages", "stream"}


async def test_mid_stream_error_event_raises_after_the_deltas(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    body = api.serve(
        sse.message_start(input_tokens=30),
        sse.text_start(0),
        sse.text_delta(0, "Once upon"),
        sse.text_delta(0, " a time"),
        sse.error("overloaded_error", "Overloaded"),
        request_id="req_midstream",
    )
    seen: list[ProviderEvent] = []

    with pytest.raises(ProviderError) as caught:
        async for event in provider.stream(ask()):
            seen.append(event)

    assert seen == [
        MessageStart(request_id="req_midstream", model=sse.MODEL, input_tokens=30),
        TextDelta(index=0, text="Once upon"),
        TextDelta(index=0, text=" a time"),
    ]
    error = caught.value
    assert (error.code, error.retryable, error.status) == ("overloaded", True, None)
    assert error.request_id == "req_midstream"
    assert "Overloaded" in str(error)
    assert isinstance(error.__cause__, anthropic.APIStatusError)
    assert body.closed


async def test_http_529_is_a_retryable_overloaded_error(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.replies.append(
        sse.error_response(529, "overloaded_error", "Overloaded", request_id="req_529")
    )

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    error = caught.value
    assert (error.code, error.retryable, error.status) == ("overloaded", True, 529)
    assert error.request_id == "req_529"


@pytest.mark.parametrize(
    ("status", "error_type", "code", "retryable"),
    [
        (429, "rate_limit_error", "rate_limited", True),
        (500, "api_error", "api_error", True),
        (400, "invalid_request_error", "invalid_request", False),
        (401, "authentication_error", "authentication_error", False),
        (403, "permission_error", "permission_error", False),
        (413, "request_too_large", "request_too_large", False),
        (503, "mystery_error", "api_error", True),
    ],
)
async def test_http_errors_get_stable_codes(
    api: FakeAPI,
    provider: AnthropicProvider,
    status: int,
    error_type: str,
    code: str,
    retryable: bool,
) -> None:
    api.replies.append(sse.error_response(status, error_type, "nope"))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable, caught.value.status) == (
        code,
        retryable,
        status,
    )


async def test_x_should_retry_header_overrides_retryable(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.replies.append(
        sse.error_response(500, "api_error", "boom", headers={"x-should-retry": "false"})
    )

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable) == ("api_error", False)


async def test_connection_failure_is_a_connection_error(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.replies.append(httpx2.ConnectError("connection refused"))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable, caught.value.status) == (
        "connection_error",
        True,
        None,
    )


async def test_timeout_before_the_response_is_a_timeout(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.replies.append(httpx2.ReadTimeout("timed out"))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable) == ("timeout", True)


class BreakingBody(sse.StreamBody):
    """A body whose connection drops after its chunks (``error``: how it breaks)."""

    error: Exception = httpx2.ReadError("connection reset by peer")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise self.error


class StallingBody(BreakingBody):
    """A body whose reads time out after its chunks."""

    error = httpx2.ReadTimeout("timed out")


async def test_connection_dropped_mid_body_is_a_connection_error(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    body = BreakingBody([sse.message_start(), sse.text_start(0), sse.text_delta(0, "Hi")])
    api.replies.append(sse.sse_response(body))
    seen: list[ProviderEvent] = []

    with pytest.raises(ProviderError) as caught:
        async for event in provider.stream(ask()):
            seen.append(event)

    assert [type(event) for event in seen] == [MessageStart, TextDelta]
    assert (caught.value.code, caught.value.retryable) == ("connection_error", True)
    assert caught.value.request_id == "req_test_0001"
    assert str(caught.value).startswith("Anthropic stream broke")


async def test_a_read_timing_out_mid_body_is_a_timeout_of_that_response(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    """Whether the SDK raises the transport's timeout as it is or wraps it (newer versions
    wrap what breaks mid-body), the error names the response the stream had begun."""
    body = StallingBody([sse.message_start(), sse.text_start(0), sse.text_delta(0, "Hi")])
    api.replies.append(sse.sse_response(body))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable) == ("timeout", True)
    assert caught.value.request_id == "req_test_0001"


async def test_stream_ending_without_message_stop_is_an_error(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    api.serve(sse.message_start(), sse.text_start(0), sse.text_delta(0, "Hi"))

    with pytest.raises(ProviderError) as caught:
        await collect(provider, ask())

    assert (caught.value.code, caught.value.retryable) == ("connection_error", True)


async def test_aclose_after_two_events_closes_the_response_stream(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    body = api.serve(*sse.text_stream(["one", " two", " three", " four"]))
    stream = provider.stream(ask())

    first = await anext(stream)
    second = await anext(stream)
    await stream.aclose()

    assert isinstance(first, MessageStart)
    assert second == TextDelta(index=0, text="one")
    assert body.closed
    assert body.sent < len(body.chunks)


async def test_cancelling_the_consumer_closes_the_response_stream(
    api: FakeAPI, provider: AnthropicProvider
) -> None:
    chunks = sse.text_stream(["one", " two", " three"])
    body = sse.StreamBody(chunks, hold_after=4)  # message_start, block start, ping, "one"
    api.replies.append(sse.sse_response(body))
    seen: list[ProviderEvent] = []

    async def consume() -> None:
        async for event in provider.stream(ask()):
            seen.append(event)

    task = asyncio.create_task(consume())
    await body.reached_hold.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert body.closed
    assert seen == [
        MessageStart(request_id="req_test_0001", model=sse.MODEL, input_tokens=25),
        TextDelta(index=0, text="one"),
    ]


def test_from_env_needs_an_api_key() -> None:
    with pytest.raises(ProviderError) as caught:
        AnthropicProvider.from_env(environ={})

    assert caught.value.code == "missing_api_key"
    assert "ANTHROPIC_API_KEY" in str(caught.value)


async def test_from_env_builds_and_owns_a_client() -> None:
    provider = AnthropicProvider.from_env(
        environ={"ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": "http://localhost:9"}
    )
    async with provider:
        assert provider.name == "anthropic"
        assert provider.client.api_key == "sk-ant-test"
        assert str(provider.client.base_url) == "http://localhost:9"
    assert provider.client.is_closed()


def test_no_credentials_anywhere_is_missing_api_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    for name in list(os.environ):
        if name.startswith("ANTHROPIC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))

    with pytest.raises(ProviderError) as caught:
        AnthropicProvider()

    assert caught.value.code == "missing_api_key"


def test_cost_usd_prices_each_kind_of_token() -> None:
    cost = cost_usd(
        "claude-sonnet-4-5-20250929",
        input_tokens=1_000_000,
        output_tokens=100_000,
        cache_creation_input_tokens=200_000,
        cache_read_input_tokens=1_000_000,
    )

    assert cost == pytest.approx(3.0 + 1.5 + 0.75 + 0.30)


@pytest.mark.parametrize(
    ("model", "input_price"),
    [
        ("claude-opus-4-20250514", 15.0),
        ("claude-opus-4-1", 15.0),
        ("claude-opus-4-5-20251101", 5.0),
        ("claude-sonnet-4-6", 3.0),
        ("claude-3-7-sonnet-latest", 3.0),
        ("claude-haiku-4-5", 1.0),
        ("claude-3-5-haiku-20241022", 0.80),
    ],
)
def test_models_match_by_longest_prefix(model: str, input_price: float) -> None:
    assert cost_usd(model, input_tokens=1_000_000) == pytest.approx(input_price)


def test_unknown_model_has_no_cost() -> None:
    assert cost_usd("gpt-4o", input_tokens=10) is None
    assert price_for("claude-instant-1") is None


async def test_from_env_takes_the_timeouts() -> None:
    provider = AnthropicProvider.from_env(
        environ={
            "ANTHROPIC_API_KEY": "sk-ant-test",
            "PLEACH_CONNECT_TIMEOUT": "3",
            "PLEACH_READ_TIMEOUT": "7.5",
        }
    )
    async with provider:
        timeout = provider.client.timeout
        assert (timeout.connect, timeout.read) == (3.0, 7.5)  # type: ignore[union-attr]
    with pytest.raises(ProviderError, match="seconds"):
        AnthropicProvider.from_env(
            environ={"ANTHROPIC_API_KEY": "k", "PLEACH_READ_TIMEOUT": "soon"}
        )


async def test_a_model_that_never_answers_times_out_as_a_turn_error(tmp_path: pathlib.Path) -> None:
    """A server that accepts the connection and never answers: the turn ends with a timeout
    error event after ``read_timeout`` (not the SDK's 600 s x 3), and the turn is kept."""
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.sqlite import SQLiteAdapter

    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    provider = AnthropicProvider(
        api_key="sk-ant-test",
        base_url=f"http://127.0.0.1:{port}",
        max_retries=0,
        connect_timeout=2.0,
        read_timeout=0.5,
    )
    try:
        async with provider, SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), provider) as rt:
            session_id = (await rt.create_session()).id
            events = [e async for e in rt.execute_message(session_id, "hello?")]
            errors = [e for e in events if e.type == "error"]
            assert errors and errors[0].code == "timeout"  # type: ignore[attr-defined]
            assert events[-1].type == "turn.complete"
            messages = await rt.sessions.messages(session_id)
            assert messages[0].content[0]["text"] == "hello?"
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
