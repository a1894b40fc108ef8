"""ScriptedProvider: deterministic offline replies with the same event shapes as Anthropic."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pleach_client.providers import (
    BlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    Provider,
    ProviderEvent,
    ProviderRequest,
    ScriptedProvider,
    ScriptedReply,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolSpec,
    ToolUseStart,
)
from shared.errors import ProviderError

MODEL = "claude-sonnet-4-6"


def ask(text: str = "Hello there", **kwargs: object) -> ProviderRequest:
    return ProviderRequest(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        **kwargs,  # type: ignore[arg-type]
    )


async def collect(provider: ScriptedProvider, request: ProviderRequest) -> list[ProviderEvent]:
    return [event async for event in provider.stream(request)]


def test_is_a_provider() -> None:
    assert isinstance(ScriptedProvider(), Provider)
    assert ScriptedProvider().name == "scripted"
    assert ScriptedProvider(name="offline").name == "offline"


async def test_text_streams_in_word_chunks() -> None:
    provider = ScriptedProvider([ScriptedReply(text="Hi there, friend.")])

    events = await collect(provider, ask())

    start, stop = events[0], events[-1]
    assert isinstance(start, MessageStart) and isinstance(stop, MessageStop)
    assert (start.model, start.request_id) == (MODEL, "req_scripted_0001")
    assert events[1:] == [
        TextDelta(index=0, text="Hi "),
        TextDelta(index=0, text="there, "),
        TextDelta(index=0, text="friend."),
        BlockStop(index=0, block={"type": "text", "text": "Hi there, friend."}),
        MessageDelta(stop_reason="end_turn", output_tokens=stop.output_tokens),
        MessageStop(
            content=[{"type": "text", "text": "Hi there, friend."}],
            stop_reason="end_turn",
            input_tokens=start.input_tokens,
            output_tokens=stop.output_tokens,
            request_id="req_scripted_0001",
        ),
    ]


async def test_token_counts_are_deterministic_and_overridable() -> None:
    request = ask("x" * 400)
    provider = ScriptedProvider(
        [ScriptedReply(text="y" * 200), ScriptedReply(text="z", input_tokens=7, output_tokens=3)]
    )

    first = (await collect(provider, request))[-1]
    second = (await collect(provider, request))[-1]

    assert isinstance(first, MessageStop) and isinstance(second, MessageStop)
    expected_input = (len(json.dumps(request.messages)) + 3) // 4
    assert first.input_tokens == expected_input
    assert 50 <= first.output_tokens <= 60  # ~200 chars / 4, plus the block's JSON keys
    assert (second.input_tokens, second.output_tokens) == (7, 3)


async def test_thinking_comes_first_with_a_signature() -> None:
    provider = ScriptedProvider([ScriptedReply(thinking="Two plus two.", text="4")])

    events = await collect(provider, ask("2+2?", thinking_budget=1024))

    assert events[1:4] == [
        ThinkingDelta(index=0, thinking="Two "),
        ThinkingDelta(index=0, thinking="plus "),
        ThinkingDelta(index=0, thinking="two."),
    ]
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert stop.content == [
        {"type": "thinking", "thinking": "Two plus two.", "signature": "scripted-signature"},
        {"type": "text", "text": "4"},
    ]


async def test_tool_calls_stream_their_input_json() -> None:
    tool_input = {"path": "notes/todo.md", "contents": "- buy milk\n- write tests"}
    provider = ScriptedProvider(
        [ScriptedReply(text="Writing it.", tool_calls=[("write_file", tool_input), ("ls", {})])]
    )

    events = await collect(provider, ask())

    starts = [event for event in events if isinstance(event, ToolUseStart)]
    assert [(start.index, start.name) for start in starts] == [(1, "write_file"), (2, "ls")]
    assert starts[0].id != starts[1].id
    chunks = [e.partial_json for e in events if isinstance(e, ToolInputDelta) and e.index == 1]
    assert len(chunks) > 1
    assert json.loads("".join(chunks)) == tool_input
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert stop.stop_reason == "tool_use"
    assert stop.content[1:] == [
        {"type": "tool_use", "id": starts[0].id, "name": "write_file", "input": tool_input},
        {"type": "tool_use", "id": starts[1].id, "name": "ls", "input": {}},
    ]


async def test_tool_call_without_text_has_no_text_block() -> None:
    provider = ScriptedProvider([ScriptedReply(tool_calls=[("ls", {"path": "."})])])

    events = await collect(provider, ask())

    assert not any(isinstance(event, TextDelta) for event in events)
    stop = events[-1]
    assert isinstance(stop, MessageStop)
    assert [block["type"] for block in stop.content] == ["tool_use"]
    assert isinstance(events[1], ToolUseStart) and events[1].index == 0


async def test_error_before_any_event() -> None:
    provider = ScriptedProvider(
        [ScriptedReply(error="overloaded", error_retryable=True), ScriptedReply(text="ok")]
    )
    seen: list[ProviderEvent] = []

    with pytest.raises(ProviderError) as caught:
        async for event in provider.stream(ask()):
            seen.append(event)

    assert seen == []
    assert (caught.value.code, caught.value.retryable) == ("overloaded", True)
    assert caught.value.request_id == "req_scripted_0001"
    assert provider.closed == 0
    # The failed call consumed its reply; the next one gets the next reply.
    stop = (await collect(provider, ask()))[-1]
    assert isinstance(stop, MessageStop) and stop.content == [{"type": "text", "text": "ok"}]


async def test_error_mid_stream_after_n_text_chunks() -> None:
    provider = ScriptedProvider(
        [ScriptedReply(text="one two three four", error="api_error", error_after_chunks=2)]
    )
    seen: list[ProviderEvent] = []

    with pytest.raises(ProviderError) as caught:
        async for event in provider.stream(ask()):
            seen.append(event)

    assert isinstance(seen[0], MessageStart)
    assert seen[1:] == [TextDelta(index=0, text="one "), TextDelta(index=0, text="two ")]
    assert (caught.value.code, caught.value.retryable) == ("api_error", False)
    assert provider.closed == 0


async def test_exhausted_script_echoes_the_last_user_text_forever() -> None:
    provider = ScriptedProvider([ScriptedReply(text="scripted")])
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "scripted"}]},
        {"role": "user", "content": [{"type": "text", "text": "and again"}]},
    ]

    await collect(provider, ask())
    assert provider.remaining == 0
    replies = []
    for _ in range(3):
        stop = (await collect(provider, ProviderRequest(model=MODEL, messages=conversation)))[-1]
        assert isinstance(stop, MessageStop)
        replies.append(stop.content)

    assert replies == [[{"type": "text", "text": "You said: and again"}]] * 3


async def test_default_reply_can_be_replaced() -> None:
    provider = ScriptedProvider(default_reply=ScriptedReply(text="fixed"))

    stop = (await collect(provider, ask()))[-1]

    assert isinstance(stop, MessageStop)
    assert stop.content == [{"type": "text", "text": "fixed"}]


async def test_requests_are_recorded_as_sent() -> None:
    provider = ScriptedProvider()
    tool = ToolSpec(name="ls", description="List files.", input_schema={"type": "object"})
    request = ProviderRequest(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        system="Be brief.",
        tools=[tool],
        max_tokens=100,
    )

    await collect(provider, request)
    request.messages.append({"role": "assistant", "content": "changed afterwards"})
    await collect(provider, ask("second"))

    assert [r.messages for r in provider.requests] == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "second"}],
    ]
    assert provider.requests[0].system == "Be brief."
    assert provider.requests[0].tools == [tool]
    assert provider.requests[0].max_tokens == 100


async def test_aclose_mid_stream_is_counted() -> None:
    provider = ScriptedProvider([ScriptedReply(text="a b c d e f")])
    stream = provider.stream(ask())

    assert isinstance(await anext(stream), MessageStart)
    assert await anext(stream) == TextDelta(index=0, text="a ")
    await stream.aclose()

    assert provider.closed == 1


async def test_cancelling_a_delayed_stream_is_counted() -> None:
    provider = ScriptedProvider([ScriptedReply(text="slow words here", delay=3600)])
    started = asyncio.Event()

    async def consume() -> None:
        async for event in provider.stream(ask()):
            if isinstance(event, MessageStart):
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert provider.closed == 1


async def test_a_finished_stream_is_not_counted_as_closed() -> None:
    provider = ScriptedProvider()

    await collect(provider, ask())

    assert provider.closed == 0
