"""The rest of the turn surface: file references (through the SDK, and synced to another
device), thinking budgets, provider errors as events, stream fidelity (custom events, a
throttle that coalesces, artifact.created, the nested shape) and the deprecated flat surface."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from pleach_client.files import FileReference
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionConfigError, SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import (
    CustomEvent,
    MessageComplete,
    MessageDelta,
    StreamEventBase,
    StreamManager,
    ThinkingDelta,
)
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.errors import InvalidInput, NotFound, RecordTooLarge
from tests import sse
from tests.test_plugins import of_type, run, tool_reply
from tests.test_runtime_anthropic import MODEL, anthropic_provider, text_reply

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
PDF = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"


# -- file references ----------------------------------------------------------------------------


async def test_files_reach_the_model_as_image_and_document_blocks(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Plan\nShip on Friday.\n", encoding="utf-8")
    provider, api = anthropic_provider([text_reply("Seen."), text_reply("Still seen.")])
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "device.db"), provider, meta_tool_names=()
    ) as rt:
        updates: list[StreamEventBase] = []
        rt.subscribe_to_stream("updates", updates.append)
        handle = await rt.create_session(model=MODEL)
        events = await _collect(
            rt.execute_message(
                handle.id,
                "What do these say?",
                file_references=[
                    FileReference(data=PNG, name="chart.png"),
                    notes,
                    {"data": PDF, "name": "terms.pdf"},
                ],
            )
        )
        sent = api.sent[0]["messages"][0]["content"]
        assert sent[0] == {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(PNG).decode(),
            },
        }
        assert sent[1] == {
            "type": "document",
            "source": {
                "type": "text",
                "media_type": "text/plain",
                "data": "# Plan\nShip on Friday.\n",
            },
            "title": "notes.md",
        }
        assert sent[2]["source"]["media_type"] == "application/pdf"
        assert base64.b64decode(sent[2]["source"]["data"]) == PDF
        assert sent[3] == {"type": "text", "text": "What do these say?"}
        # Stored as artifacts of the session; the message keeps small references.
        files = await rt.files.list(handle.id)
        assert [(f.name, f.media_type, f.size) for f in files] == [
            ("chart.png", "image/png", len(PNG)),
            ("notes.md", "text/markdown", len(notes.read_bytes())),
            ("terms.pdf", "application/pdf", len(PDF)),
        ]
        stored = (await rt.sessions.messages(handle.id))[0].content
        assert [b["type"] for b in stored] == ["file_reference"] * 3 + ["text"]
        assert len(json.dumps(stored)) < 1000
        created = of_type(events, "artifact.created")
        assert [e.name for e in created] == ["chart.png", "notes.md", "terms.pdf"]
        assert [e.type for e in updates if e.type == "artifact.created"] == ["artifact.created"] * 3
        logged = [e for e in await rt.store.list_events(handle.id) if e.type == "artifact.created"]
        assert [e.payload["kind"] for e in logged] == ["file"] * 3
        # A file attached before is referred to by its artifact id, not stored again.
        await _collect(
            rt.execute_message(
                handle.id, "And the chart?", file_references=[{"artifact_id": files[0].artifact_id}]
            )
        )
        assert len(await rt.files.list(handle.id)) == 3

    await provider.client.close()


async def test_a_reopened_device_rebuilds_file_blocks_from_its_store(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    provider, _ = anthropic_provider([text_reply("Seen.")])
    async with SessionRuntime(SQLiteAdapter(db), provider, meta_tool_names=()) as rt:
        handle = await rt.create_session(model=MODEL)
        await _collect(
            rt.execute_message(handle.id, "look", file_references=[{"data": PNG, "name": "a.png"}])
        )
    provider2, api2 = anthropic_provider([text_reply("Still.")])
    async with SessionRuntime(SQLiteAdapter(db), provider2, meta_tool_names=()) as rt:
        await run(rt, handle.id, "again")
        image = api2.sent[0]["messages"][0]["content"][0]
        assert base64.b64decode(image["source"]["data"]) == PNG
    await provider.client.close()
    await provider2.client.close()


async def test_an_unusable_file_is_refused_before_anything_is_written(
    adapter: StorageAdapter, tmp_path: Path
) -> None:
    async with SessionRuntime(adapter, ScriptedProvider(), meta_tool_names=()) as rt:
        rt.files.max_file_bytes = 1024
        handle = await rt.create_session()
        cases: list[tuple[Any, type[Exception], str]] = [
            ({"data": b"PK\x03\x04", "name": "a.zip"}, InvalidInput, "cannot be shown"),
            ({"data": b"\xff\xfe", "name": "a.txt"}, InvalidInput, "not UTF-8"),
            ({"data": b"x" * 1025, "name": "big.txt"}, RecordTooLarge, "1,024-byte limit"),
            (tmp_path / "missing.png", InvalidInput, "cannot read"),
            ({"artifact_id": "0190-none"}, NotFound, "no attached file"),
            ({"nonsense": 1}, InvalidInput, "not valid"),
        ]
        for ref, error, words in cases:
            with pytest.raises(error, match=words):
                # A good file beside the bad one is not written either.
                await run_with(rt, handle.id, [{"data": b"ok", "name": "ok.txt"}, ref])
        assert await rt.sessions.messages(handle.id) == []
        assert await rt.files.list(handle.id) == []
        assert await rt.artifacts.list(handle.id) == []


async def run_with(rt: SessionRuntime, session_id: str, refs: list[Any]) -> list[Any]:
    return await _collect(rt.execute_message(session_id, "see", file_references=refs))


async def test_attached_files_sync_to_another_device(tmp_path: Path) -> None:
    secret = b"surface-secret"
    tenant = Tenant(org_id="acme", user_id="alice")
    store = SQLiteServerStore(tmp_path / "server.db")
    await store.open()
    server = SyncServer(store, port=0, secret=secret)
    await server.start()
    url, token = f"ws://127.0.0.1:{server.port}/sync", issue_token(secret, tenant, 3600)
    laptop_model, _ = anthropic_provider([text_reply("A photo.")])
    phone_model, phone_api = anthropic_provider([text_reply("A chart.")])
    try:
        async with (
            SessionRuntime(
                SQLiteAdapter(tmp_path / "laptop.db"),
                laptop_model,
                org_id="acme",
                user_id="alice",
                meta_tool_names=(),
            ) as laptop,
            SessionRuntime(
                SQLiteAdapter(tmp_path / "phone.db"),
                phone_model,
                org_id="acme",
                user_id="alice",
                meta_tool_names=(),
            ) as phone,
        ):
            handle = await laptop.create_session(model=MODEL)
            await run_with(laptop, handle.id, [FileReference(data=PNG, name="photo.png")])
            await laptop.sync.connect(url, token)
            assert await laptop.sync.wait_until_synced(timeout=30)
            await phone.sync.connect(url, token)
            assert await phone.sync.wait_until_synced(timeout=30)
            (synced,) = await phone.files.list(handle.id)
            assert (synced.name, synced.size) == ("photo.png", len(PNG))
            await run(phone, handle.id, "what was in the photo?")
            image = phone_api.sent[0]["messages"][0]["content"][0]
            assert image["type"] == "image"
            assert base64.b64decode(image["source"]["data"]) == PNG
    finally:
        await server.shutdown()
        await store.close()
        await laptop_model.client.close()
        await phone_model.client.close()


# -- thinking -------------------------------------------------------------------------------------


def thinking_reply() -> sse.StreamBody:
    return sse.StreamBody(
        [
            sse.message_start(input_tokens=60),
            sse.thinking_start(0),
            sse.thinking_delta(0, "Two plus two "),
            sse.thinking_delta(0, "is four."),
            sse.signature_delta(0, "EqQBCkYIBxgCKkA"),
            sse.block_stop(0),
            sse.text_start(1),
            sse.text_delta(1, "4"),
            sse.block_stop(1),
            sse.message_delta(output_tokens=40),
            sse.message_stop(),
        ]
    )


async def test_a_thinking_budget_streams_thinking_through_the_sdk(
    adapter: StorageAdapter,
) -> None:
    provider, api = anthropic_provider([thinking_reply(), text_reply("Sure.")])
    async with SessionRuntime(adapter, provider, max_tokens=1000, meta_tool_names=()) as rt:
        handle = await rt.create_session(model=MODEL, thinking={"budget_tokens": 2048})
        assert handle.record.thinking_budget == 2048
        events = await run(rt, handle.id, "2+2?")
        body = api.sent[0]
        assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
        assert body["max_tokens"] == 1000 + 2048
        assert "".join(e.delta for e in of_type(events, "thinking.delta")) == (
            "Two plus two is four."
        )
        assert of_type(events, "thinking.complete")[0].thinking == "Two plus two is four."
        await run(rt, handle.id, "thanks")
        kept = api.sent[1]["messages"][1]["content"][0]
        assert kept == {
            "type": "thinking",
            "thinking": "Two plus two is four.",
            "signature": "EqQBCkYIBxgCKkA",
        }
        row = await rt.store.get_session(handle.id)
        assert row is not None and row.thinking_budget == 2048
    await provider.client.close()


async def test_thinking_budgets_are_checked_before_anything_is_written() -> None:
    async with SessionRuntime(MemoryAdapter(), ScriptedProvider(), meta_tool_names=()) as rt:
        for config in (
            {"thinking_budget": 500},
            {"thinking_budget": True},
            {"thinking_budget": "lots"},
            {"thinking": {"budget_tokens": 2048, "extra": 1}},
            {"thinking": 2048},
            {"thinking_budget": 2048, "thinking": {"budget_tokens": 2048}},
        ):
            with pytest.raises(SessionConfigError):
                await rt.create_session(**config)
        assert await rt.sessions.list() == []
        plain = await rt.create_session(thinking_budget=1024)
        assert plain.record.thinking_budget == 1024


# -- errors are events ---------------------------------------------------------------------------


async def test_a_provider_mismatch_is_an_error_event_without_an_audit_row(
    adapter: StorageAdapter,
) -> None:
    async with SessionRuntime(adapter, ScriptedProvider(), meta_tool_names=()) as rt:
        handle = await rt.create_session(provider="anthropic", model=MODEL)
        events = await run(rt, handle.id, "hi")  # no exception
        assert [e.type for e in events] == [
            "message.added",
            "error",
            "checkpoint.created",
            "turn.complete",
        ]
        assert events[1].code == "provider_unavailable" and "locked to provider" in events[1].error
        assert events[-1].outcome == "provider-error" and events[-1].provider_calls == 0
        assert await rt.audit.rows(handle.id) == []  # no call was attempted
        assert [m.role for m in await rt.sessions.messages(handle.id)] == ["user"]


async def test_a_missing_api_key_is_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    async with SessionRuntime(MemoryAdapter(), meta_tool_names=()) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "hi")
        error = of_type(events, "error")[0]
        assert error.code == "missing_api_key" and "ANTHROPIC_API_KEY" in error.error
        assert events[-1].outcome == "provider-error"
        assert await rt.audit.rows(handle.id) == []


# -- stream fidelity -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def delta(text: str, message_id: str = "m1", session_id: str = "s1") -> MessageDelta:
    return MessageDelta(session_id=session_id, message_id=message_id, delta=text)


def test_the_throttle_coalesces_deltas_and_drops_nothing() -> None:
    clock = Clock()
    manager = StreamManager(clock=clock)
    got: list[StreamEventBase] = []
    manager.subscribe("all", got.append)
    manager.set_throttle_interval(100)
    for word in ("one ", "two ", "three "):
        manager.emit(delta(word))
    clock.now += 0.2
    manager.emit(delta("four "))  # the interval is up: the held text and this one together
    manager.emit(delta("five"))
    manager.emit(ThinkingDelta(session_id="s1", message_id="m1", delta="hmm"))
    manager.emit(MessageComplete(session_id="s1", message_id="m1", content=[]))
    kinds = [e.type for e in got]
    assert kinds == ["message.delta", "message.delta", "thinking.delta", "message.complete"]
    deltas = [e.delta for e in got if isinstance(e, MessageDelta | ThinkingDelta)]
    assert deltas == ["one ", "two three four five", "hmm"]
    # Sessions are throttled apart; turning the throttle off delivers what it holds.
    manager.emit(delta("a", session_id="s2"))
    manager.emit(delta("b", session_id="s2"))
    manager.set_throttle_interval(0)
    assert [e.delta for e in got[-2:]] == ["a", "b"]  # type: ignore[attr-defined]


async def test_the_throttle_delivers_held_text_when_the_interval_is_up() -> None:
    manager = StreamManager()
    arrived = asyncio.Event()
    got: list[str] = []

    def on(event: StreamEventBase) -> None:
        got.append(event.delta)  # type: ignore[attr-defined]
        if len(got) == 2:
            arrived.set()

    manager.subscribe("messages", on)
    manager.set_throttle_interval(20)
    manager.emit(delta("first"))
    manager.emit(delta(" second"))
    manager.emit(delta(" third"))
    assert got == ["first"]
    await asyncio.wait_for(arrived.wait(), timeout=5)  # the timer, no other event
    assert got == ["first", " second third"]


async def test_a_throttled_turn_delivers_every_character(runtime: SessionRuntime) -> None:
    text: list[str] = []
    runtime.subscribe_to_stream("messages", lambda e: text.append(getattr(e, "delta", "")))
    runtime.get_stream_manager().set_throttle_interval(60_000)
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "one two three four five six")
    streamed = "".join(e.delta for e in of_type(events, "message.delta"))
    assert "".join(text) == streamed == "You said: one two three four five six"
    assert len([t for t in text if t]) == 2


async def test_artifact_created_is_an_update_and_events_have_the_nested_shape() -> None:
    provider, _ = anthropic_provider(
        [tool_reply("toolu_m", "calculator", '{"expression": "2*3"}'), text_reply("Six.")]
    )
    async with SessionRuntime(MemoryAdapter(), provider, meta_tool_names=()) as rt:
        updates: list[StreamEventBase] = []
        rt.subscribe_to_stream("updates", updates.append)
        handle = await rt.create_session(model=MODEL)
        receipt = await rt.artifacts.create(handle.id, "draft")
        (created,) = [e for e in updates if e.type == "artifact.created"]
        assert created.artifact_id == receipt.artifact_id  # type: ignore[attr-defined]
        assert created.kind == "document"  # type: ignore[attr-defined]

        events = await run(rt, handle.id, "2*3")
        started = of_type(events, "tool.started")[0]
        completed = of_type(events, "tool.completed")[0]
        assert started.tool_call.name == "calculator"
        assert started.tool_call.input == {"expression": "2*3"}
        assert completed.tool_call.id == started.tool_call.id == "toolu_m"
        assert completed.tool_call.name == "calculator" and completed.output == "6"
        checkpoint = of_type(events, "checkpoint.created")[0]
        assert checkpoint.checkpoint.session_id == handle.id
        assert checkpoint.checkpoint.id == checkpoint.checkpoint_id
        added = of_type(events, "message.added")[0]
        assert (added.message.id, added.message.role) == (added.message_id, "user")
        complete = of_type(events, "message.complete")[-1]
        assert complete.message.content == complete.content == [{"type": "text", "text": "Six."}]
    await provider.client.close()


async def test_plugin_custom_events_reach_custom_mode_subscribers() -> None:
    class Progress:
        name = "progress"

        def on_stream_chunk(self, ctx: Any, chunk: Any) -> None:
            if getattr(chunk, "text", ""):
                ctx.emit("tick")

    got: list[str] = []
    provider, _ = anthropic_provider([text_reply("a b c")])
    async with SessionRuntime(
        MemoryAdapter(), provider, plugins=[Progress()], meta_tool_names=()
    ) as rt:
        rt.subscribe_to_stream("custom", lambda e: got.append(e.type))
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "say a b c")
        ticks = [e for e in events if isinstance(e, CustomEvent)]
        assert len(ticks) == 3 and got == ["custom.tick"] * 3
        assert len(ticks) == len(of_type(events, "message.delta"))
    await provider.client.close()


# -- the flat legacy surface ---------------------------------------------------------------------


async def test_the_flat_legacy_surface_warns_and_forwards(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    await run(runtime, handle.id, "one")
    first = (await runtime.checkpoints.list(handle.id))[0]
    await run(runtime, handle.id, "two")
    with pytest.deprecated_call(match="rt.checkpoints.rollback"):
        receipt = await runtime.rollback_to_checkpoint(handle.id, first.id)
    assert receipt.messages_after == 2 and receipt.messages_before == 4
    row = await runtime.store.get_session(handle.id)
    assert row is not None
    with pytest.deprecated_call(match=r"rt.sessions.save"):
        saved = await runtime.save_session(row)
    assert saved.vv[runtime.client_id] > row.vv[runtime.client_id]
    with pytest.deprecated_call(match="rt.checkpoints"):
        assert runtime.get_time_travel_api() is runtime.checkpoints
    with pytest.deprecated_call(match=r"rt.tenant.get_tenant_id\(\)"):
        assert runtime.get_tenant_id() == "acme/alice" == runtime.tenant.get_tenant_id()
    with pytest.deprecated_call(match="rt.plugins"):
        assert runtime.get_plugin_manager() is runtime.plugins
    with pytest.deprecated_call(match=r"rt.safety.get_registry\(\)"):
        assert runtime.get_safety_registry() is runtime.safety.get_registry()
    with pytest.deprecated_call(match=r"rt.safety.get_active\(\)"):
        assert runtime.list_active_safety_policies() == []
    with pytest.deprecated_call(match="rt.interrupts"):
        assert runtime.get_interrupt_manager() is None
    with pytest.deprecated_call(match="rt.sync.resolve_conflict"), pytest.raises(NotFound):
        await runtime.resolve_conflict(handle.id, "no-such-conflict", "local")
    seen: list[str] = []

    def handler(event: StreamEventBase) -> None:
        seen.append(event.type)

    with pytest.deprecated_call(match=r"rt.events.on"):
        runtime.on("turn.complete", handler)
    with pytest.deprecated_call(match=r"rt.events.once"):
        runtime.once("checkpoint.created", handler)
    await run(runtime, handle.id, "three")
    with pytest.deprecated_call(match=r"rt.events.off"):
        assert runtime.off("turn.complete", handler)
    await run(runtime, handle.id, "four")
    assert seen == ["checkpoint.created", "turn.complete"]


async def test_destroy_detaches_every_listener() -> None:
    rt = SessionRuntime(MemoryAdapter(), ScriptedProvider(), meta_tool_names=())
    await rt.open()
    handle = await rt.create_session()
    heard: list[str] = []
    rt.events.on("*", lambda e: heard.append("bus"))
    rt.subscribe_to_stream("all", lambda e: heard.append("stream"))
    rt.observer_router.register(lambda e: heard.append("observer"))
    rt.emit_custom(handle.id, "before")
    assert sorted(heard) == ["bus", "observer", "stream"]
    await rt.destroy()
    heard.clear()
    rt.emit_custom(handle.id, "after")
    assert heard == [] and rt.observer_router.list() == []


async def _collect(events: Any) -> list[Any]:
    return [e async for e in events]
