"""Turns through the real anthropic SDK, offline: httpx2.MockTransport replays SSE bodies."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any

import anthropic
import httpx2

from pleach_client.providers.anthropic import AnthropicProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from tests import sse

MODEL = sse.MODEL


class RecordingAPI:
    """Serves queued SSE bodies and records every request body the SDK sent."""

    def __init__(self, bodies: list[sse.StreamBody]) -> None:
        self.bodies: deque[sse.StreamBody] = deque(bodies)
        self.sent: list[dict[str, Any]] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        self.sent.append(json.loads(request.content))
        return sse.sse_response(self.bodies.popleft(), request_id=f"req_{len(self.sent)}")


def text_reply(text: str, *, input_tokens: int = 30, output_tokens: int = 10) -> sse.StreamBody:
    return sse.StreamBody(
        sse.text_stream(text.split(" "), input_tokens=input_tokens, output_tokens=output_tokens)
    )


def anthropic_provider(bodies: list[sse.StreamBody]) -> tuple[AnthropicProvider, RecordingAPI]:
    """A provider on a real AsyncAnthropic client whose transport replays ``bodies``."""
    api = RecordingAPI(bodies)
    client = anthropic.AsyncAnthropic(
        api_key="test",
        base_url="http://test",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api.handler)),
    )
    return AnthropicProvider(client), api


async def test_turn_with_tool_use_through_the_sdk(adapter: StorageAdapter) -> None:
    tool_turn = sse.StreamBody(
        [
            sse.message_start(input_tokens=400),
            sse.text_start(0),
            sse.text_delta(0, "Let me add."),
            sse.block_stop(0),
            sse.tool_use_start(1, "toolu_01", "calculator"),
            sse.input_json_delta(1, '{"expres'),
            sse.input_json_delta(1, 'sion": "2+2"}'),
            sse.block_stop(1),
            sse.message_delta(stop_reason="tool_use", output_tokens=40),
            sse.message_stop(),
        ]
    )
    provider, api = anthropic_provider([tool_turn, text_reply("It is 4.")])
    async with SessionRuntime(adapter, provider) as rt:
        handle = await rt.create_session(model=MODEL)
        events = [e async for e in rt.execute_message(handle.id, "2+2?")]
        assert [e.output for e in events if e.type == "tool.completed"] == ["4"]  # type: ignore[attr-defined]
        second = api.sent[1]
        assert second["model"] == MODEL
        assert second["tools"][0]["name"] == "calculator"
        assert second["messages"][1]["content"][1] == {
            "type": "tool_use",
            "id": "toolu_01",
            "name": "calculator",
            "input": {"expression": "2+2"},
        }
        assert second["messages"][2]["content"] == [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "4"}
        ]
        rows = await rt.audit.rows(handle.id)
        assert [r.usage.input_tokens for r in rows] == [400, 30]
        assert rows[0].request_id == "req_1" and rows[0].cost_usd is not None
    await provider.client.close()


async def test_abort_mid_tool_use_then_next_request_is_valid(adapter: StorageAdapter) -> None:
    held = sse.StreamBody(
        [
            sse.message_start(input_tokens=812),
            sse.text_start(0),
            sse.text_delta(0, "Checking the weather"),
            sse.block_stop(0),
            sse.tool_use_start(1, "toolu_02", "calculator"),
            sse.input_json_delta(1, '{"expression": "1'),
            sse.input_json_delta(1, '+1"}'),
            sse.block_stop(1),
            sse.message_delta(stop_reason="tool_use", output_tokens=55),
            sse.message_stop(),
        ],
        hold_after=6,
    )
    provider, api = anthropic_provider([held, text_reply("Fine.")])
    async with SessionRuntime(adapter, provider) as rt:
        handle = await rt.create_session(model=MODEL)
        abort = asyncio.Event()

        async def consume() -> list[Any]:
            return [e async for e in rt.execute_message(handle.id, "weather?", abort=abort)]

        task = asyncio.create_task(consume())
        await held.reached_hold.wait()
        abort.set()
        events = await task
        assert held.closed, "the SDK stream must be closed on abort"
        assert events[-1].outcome == "user-aborted"
        row = (await rt.audit.rows(handle.id))[-1]
        assert row.outcome.status == "user-aborted"
        assert row.usage.input_tokens == 812 and row.usage.output_estimated
        assert row.usage.output_tokens > 0
        # The tool_use never finished streaming, so the partial reply keeps only the text.
        messages = await rt.sessions.messages(handle.id)
        assert messages[-1].aborted
        assert messages[-1].content == [{"type": "text", "text": "Checking the weather"}]

        await _drain(rt.execute_message(handle.id, "try again"))
        body = api.sent[-1]
        roles = [m["role"] for m in body["messages"]]
        assert roles == ["user", "assistant", "user"]
        for i, message in enumerate(body["messages"]):
            for block in message["content"]:
                if block["type"] == "tool_use":
                    following = body["messages"][i + 1]["content"]
                    assert any(b.get("tool_use_id") == block["id"] for b in following)
    await provider.client.close()


async def test_abort_after_complete_tool_use_adds_synthetic_result(
    adapter: StorageAdapter,
) -> None:
    from pleach_client.tools import Tool

    started = asyncio.Event()

    async def slow(_: dict[str, Any]) -> str:
        started.set()
        await asyncio.Event().wait()
        return "unreachable"

    tool_turn = sse.StreamBody(
        [
            sse.message_start(input_tokens=90),
            sse.tool_use_start(0, "toolu_03", "slow"),
            sse.input_json_delta(0, "{}"),
            sse.block_stop(0),
            sse.message_delta(stop_reason="tool_use", output_tokens=20),
            sse.message_stop(),
        ]
    )
    provider, api = anthropic_provider([tool_turn, text_reply("ok then")])
    async with SessionRuntime(
        adapter, provider, tools=[Tool("slow", "s", {"type": "object"}, slow)]
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        abort = asyncio.Event()
        task = asyncio.create_task(_drain(rt.execute_message(handle.id, "run slow", abort=abort)))
        await started.wait()
        abort.set()
        await task
        row = (await rt.audit.rows(handle.id))[-1]
        assert row.outcome.status == "user-aborted" and not row.usage.output_estimated
        assert row.usage.output_tokens == 20
        await _drain(rt.execute_message(handle.id, "next"))
        body = api.sent[-1]
        assert body["messages"][1]["content"][0]["id"] == "toolu_03"
        result = body["messages"][2]["content"][0]
        assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_03"
        assert result["is_error"] is True
        assert body["messages"][2]["content"][-1] == {"type": "text", "text": "next"}
    await provider.client.close()


async def test_sdk_error_event_becomes_error_and_audit_row(adapter: StorageAdapter) -> None:
    broken = sse.StreamBody(
        [
            sse.message_start(input_tokens=70),
            sse.text_start(0),
            sse.text_delta(0, "Par"),
            sse.error(),
        ]
    )
    provider, _ = anthropic_provider([broken, text_reply("recovered")])
    async with SessionRuntime(adapter, provider) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await _drain(rt.execute_message(handle.id, "hi"))
        error = next(e for e in events if e.type == "error")
        assert error.code == "overloaded" and error.retryable
        row = (await rt.audit.rows(handle.id))[-1]
        assert row.outcome.status == "provider-error" and row.usage.input_tokens == 70
        events = await _drain(rt.execute_message(handle.id, "again"))
        assert events[-1].outcome == "ok"
    await provider.client.close()


async def _drain(stream: Any) -> list[Any]:
    return [e async for e in stream]
