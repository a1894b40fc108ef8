"""Turn spans and model degradation through the real anthropic SDK (offline, MockTransport)."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import anthropic
import httpx2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pleach_client.providers.anthropic import AnthropicProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.memory import MemoryAdapter
from tests import sse
from tests.test_runtime_anthropic import text_reply

MODEL = sse.MODEL
FALLBACK = "claude-fallback-1"


class API:
    """Answers each request with the next queued response (an SSE body or an HTTP error)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers: deque[Any] = deque(answers)
        self.models: list[str] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        self.models.append(json.loads(request.content)["model"])
        answer = self.answers.popleft()
        if isinstance(answer, httpx2.Response):
            return answer
        return sse.sse_response(answer, request_id=f"req_{len(self.models)}")


def provider(api: API) -> AnthropicProvider:
    client = anthropic.AsyncAnthropic(
        api_key="test",
        base_url="http://test",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api.handler)),
    )
    return AnthropicProvider(client)


def overloaded() -> httpx2.Response:
    return sse.error_response(529, "overloaded_error", "Overloaded")


async def drain(stream: Any) -> list[Any]:
    return [e async for e in stream]


async def test_a_model_that_keeps_failing_is_routed_to_its_fallback() -> None:
    api = API([overloaded(), overloaded(), text_reply("from the fallback"), text_reply("back")])
    p = provider(api)
    async with SessionRuntime(MemoryAdapter(), p, fallbacks={MODEL: FALLBACK}) as rt:
        rt.degradation.threshold = 2
        handle = await rt.create_session(model=MODEL)
        for _ in range(2):
            events = await drain(rt.execute_message(handle.id, "hi"))
            assert events[-1].outcome == "provider-error"
        assert rt.degradation.is_model_degraded(MODEL)
        assert rt.degradation.get_degraded_models() == [MODEL]
        record = rt.degradation.get_degraded_model_record(MODEL)
        assert record is not None and record.reason == "overloaded" and record.failures == 2
        assert record.fallback == FALLBACK
        events = await drain(rt.execute_message(handle.id, "again"))
        assert events[-1].outcome == "ok"
        assert api.models == [MODEL, MODEL, FALLBACK]
        rows = await rt.audit.rows(handle.id)
        assert [r.model for r in rows] == [MODEL, MODEL, FALLBACK]  # the model actually called
        assert [r.outcome.status for r in rows] == ["provider-error", "provider-error", "ok"]
        # The session stays locked to its model; the fallback served while it was degraded.
        assert (await rt.sessions.find(handle.id)).model == MODEL  # type: ignore[union-attr]
    await p.client.close()


async def test_a_bad_request_does_not_degrade_the_model() -> None:
    bad = sse.error_response(400, "invalid_request_error", "bad")
    api = API([bad, bad, bad, text_reply("ok")])
    p = provider(api)
    async with SessionRuntime(MemoryAdapter(), p, fallbacks={MODEL: FALLBACK}) as rt:
        handle = await rt.create_session(model=MODEL)
        for _ in range(3):
            await drain(rt.execute_message(handle.id, "hi"))
        assert not rt.degradation.is_model_degraded(MODEL)
        assert rt.degradation.get_degraded_model_record(MODEL) is None
        await drain(rt.execute_message(handle.id, "hi"))
        assert api.models[-1] == MODEL
    await p.client.close()


async def test_a_turn_is_one_span_with_its_model_and_tool_calls() -> None:
    tool_turn = sse.StreamBody(
        [
            sse.message_start(input_tokens=400),
            sse.tool_use_start(0, "toolu_01", "calculator"),
            sse.input_json_delta(0, '{"expression": "6*7"}'),
            sse.block_stop(0),
            sse.message_delta(stop_reason="tool_use", output_tokens=40),
            sse.message_stop(),
        ]
    )
    api = API([tool_turn, text_reply("It is 42.", input_tokens=450, output_tokens=12)])
    p = provider(api)
    exporter = InMemorySpanExporter()
    async with SessionRuntime(
        MemoryAdapter(), p, user_id="alice", org_id="acme", span_exporter=exporter
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await drain(rt.execute_message(handle.id, "6*7?"))
        assert rt.spans.in_flight_count() == 0
    await p.client.close()
    spans = exporter.get_finished_spans()
    (turn,) = [s for s in spans if s.name == "pleach.turn"]
    models = [s for s in spans if s.name == "pleach.model_call"]
    (tool,) = [s for s in spans if s.name == "pleach.tool_call"]
    assert len(models) == 2
    for child in (*models, tool):
        assert child.parent is not None and child.parent.span_id == turn.context.span_id
        assert child.context.trace_id == turn.context.trace_id
    a = dict(turn.attributes or {})
    assert a["pleach.session_id"] == handle.id and a["pleach.user_id"] == "alice"
    assert a["pleach.outcome"] == "ok" and a["pleach.turn_id"] == events[-1].turn_id
    assert a["gen_ai.usage.input_tokens"] == 850 and a["gen_ai.usage.output_tokens"] == 52
    first = dict(models[0].attributes or {})
    assert first["gen_ai.request.model"] == MODEL and first["gen_ai.system"] == "anthropic"
    assert first["gen_ai.usage.input_tokens"] == 400
    assert first["gen_ai.response.finish_reasons"] == "tool_use"
    assert dict(tool.attributes or {})["pleach.tool"] == "calculator"


async def test_an_aborted_turn_ends_its_spans() -> None:
    slow = sse.StreamBody(
        [sse.message_start(input_tokens=10), sse.text_start(0)]
        + [sse.text_delta(0, f"w{i} ") for i in range(50)]
        + [
            sse.block_stop(0),
            sse.message_delta(stop_reason="end_turn", output_tokens=60),
            sse.message_stop(),
        ]
    )
    api = API([slow])
    p = provider(api)
    exporter = InMemorySpanExporter()
    async with SessionRuntime(MemoryAdapter(), p, span_exporter=exporter) as rt:
        handle = await rt.create_session(model=MODEL)
        stream = rt.execute_message(handle.id, "talk")
        async for event in stream:
            if event.type == "message.delta":
                break
        await stream.aclose()  # the consumer walks away mid-reply
        assert rt.spans.in_flight_count() == 0
        rows = await rt.audit.rows(handle.id)
        assert rows[-1].outcome.status == "user-aborted"
    await p.client.close()
    (turn,) = [s for s in exporter.get_finished_spans() if s.name == "pleach.turn"]
    assert dict(turn.attributes or {})["pleach.outcome"] == "user-aborted"
    (model,) = [s for s in exporter.get_finished_spans() if s.name == "pleach.model_call"]
    assert dict(model.attributes or {})["pleach.aborted"] is True
