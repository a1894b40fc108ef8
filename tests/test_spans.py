"""Spans on OpenTelemetry: ``rt.spans`` and the server's, through the SDK's in-memory exporter.

A device's flush span is the parent of the server's push span: the trace crosses the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store.base import Tenant
from pleach_server.store.sqlite import SQLiteServerStore
from shared.tracing import Spans

SECRET = b"spans-secret"
ALICE = Tenant(org_id="acme", user_id="alice")


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_the_default_counts_spans_and_exports_nothing() -> None:
    spans = Spans()
    assert spans.snapshot().exporting is False
    outer = spans.start("host.custom", kind="host.custom")
    with spans.span("inner") as inner:
        assert spans.in_flight_count() == 2
        assert inner.traceparent == ""
    assert spans.in_flight_count() == 1
    outer.end()
    outer.end()  # ending twice counts once
    assert spans.in_flight_count() == 0
    assert await spans.flush()
    await spans.shutdown()
    await spans.shutdown()
    assert spans.snapshot().is_shutdown


async def test_spans_nest_and_record_errors() -> None:
    exporter = InMemorySpanExporter()
    spans = Spans(exporter=exporter, service_name="test")
    with spans.span("pleach.turn", attributes={"pleach.session_id": "s1"}) as turn:
        with pytest.raises(ValueError):
            with spans.span("pleach.tool_call", parent=turn) as tool:
                tool.set(**{"pleach.tool": "calc", "ignored": None})
                raise ValueError("bad input")
    assert spans.in_flight_count() == 0
    await spans.shutdown()
    (tool_span,) = by_name(exporter.get_finished_spans(), "pleach.tool_call")
    (turn_span,) = by_name(exporter.get_finished_spans(), "pleach.turn")
    assert tool_span.parent is not None
    assert tool_span.parent.span_id == turn_span.context.span_id
    assert tool_span.attributes is not None and tool_span.attributes["pleach.tool"] == "calc"
    assert "ignored" not in tool_span.attributes
    assert not tool_span.status.is_ok and "bad input" in (tool_span.status.description or "")
    assert turn_span.resource.attributes["service.name"] == "test"


async def test_a_hosts_provider_is_not_shut_down() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = Spans(tracer_provider=provider)
    await spans.shutdown()
    provider.get_tracer("host").start_span("still exporting").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["still exporting"]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[SyncServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    async with SQLiteServerStore(tmp_path / "server.db") as store:
        srv = SyncServer(store, port=0, secret=SECRET, span_exporter=exporter)
        await srv.start()
        try:
            yield srv, exporter
        finally:
            await srv.shutdown()


async def test_a_devices_flush_is_the_parent_of_the_servers_push(
    server: tuple[SyncServer, InMemorySpanExporter], tmp_path: Path
) -> None:
    srv, server_spans = server
    device_spans = InMemorySpanExporter()
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "laptop.db"),
        ScriptedProvider(),
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
        client_id="laptop",
        span_exporter=device_spans,
    ) as rt:
        session = await rt.create_session()
        async for _ in rt.execute_message(session.id, "hello"):
            pass
        url = f"ws://127.0.0.1:{srv.port}/sync"
        receipt = await rt.sync.sync_once(url, issue_token(SECRET, ALICE, 3600))
        assert receipt.flushed > 0
        assert rt.spans.in_flight_count() == 0
    (flush,) = by_name(device_spans.get_finished_spans(), "pleach.sync.flush")
    assert flush.attributes is not None
    assert flush.attributes["pleach.user_id"] == "alice"
    assert flush.attributes["pleach.flushed"] == receipt.flushed
    pulls = by_name(device_spans.get_finished_spans(), "pleach.sync.pull")
    assert pulls and pulls[-1].attributes is not None
    await srv.spans.flush()
    pushes = by_name(server_spans.get_finished_spans(), "pleach.server.push")
    assert pushes
    for push in pushes:
        # One trace across the wire: the server's push span hangs under the device's flush.
        assert push.context.trace_id == flush.context.trace_id
        assert push.parent is not None and push.parent.span_id == flush.context.span_id
        attributes: dict[str, Any] = dict(push.attributes or {})
        assert attributes["pleach.org_id"] == "acme" and attributes["pleach.client_id"] == "laptop"
    assert sum(dict(p.attributes or {})["pleach.changes"] for p in pushes) == receipt.flushed
    assert all(dict(p.attributes or {})["pleach.applied"] > 0 for p in pushes)
    server_pulls = by_name(server_spans.get_finished_spans(), "pleach.server.pull")
    assert server_pulls and server_pulls[0].resource.attributes["service.name"] == "pleach-server"


async def test_a_forged_traceparent_is_only_ignored(
    server: tuple[SyncServer, InMemorySpanExporter],
) -> None:
    """A peer controls ``Push.trace``: junk starts a fresh trace, nothing breaks."""
    _, exporter = server
    spans = Spans(exporter=exporter)
    with spans.span("pleach.server.push", traceparent="00-zz-not-a-trace" + "x" * 500):
        pass
    (span,) = by_name(exporter.get_finished_spans(), "pleach.server.push")
    assert span.parent is None


async def test_each_job_run_is_a_span(tmp_path: Path) -> None:
    from pleach_client.tasks import JobContext

    async def render(ctx: JobContext) -> Any:
        return {"frames": ctx.input}

    async def broken(ctx: JobContext) -> Any:
        raise RuntimeError("disk full")

    exporter = InMemorySpanExporter()
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider(), span_exporter=exporter
    ) as rt:
        rt.tasks.register_job("render", render)
        rt.tasks.register_job("broken", broken)
        session = await rt.create_session()
        ok = await rt.tasks.start_job(session.id, "render", {"n": 3})
        bad = await rt.tasks.start_job(session.id, "broken", {})
        done = await rt.tasks.wait_for_jobs(session.id, timeout=20)
        assert done.done
    # Closing waited for the runs: their spans are over.
    jobs = {
        dict(s.attributes or {})["pleach.job_id"]: s
        for s in by_name(exporter.get_finished_spans(), "pleach.job")
    }
    assert dict(jobs[ok.job_id].attributes or {})["pleach.status"] == "completed"
    assert jobs[ok.job_id].status.is_ok
    failed = jobs[bad.job_id]
    assert dict(failed.attributes or {})["pleach.status"] == "failed"
    assert not failed.status.is_ok and "disk full" in (failed.status.description or "")
