"""The local runtime end to end, on both stores: sessions, turns, tools, events, audit."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import pytest

from pleach_client.facets import Projection
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import WriteBatch
from pleach_client.store.memory import MemoryAdapter
from pleach_client.stream import StreamEventBase
from pleach_client.tools import Tool
from shared.errors import NotFound, SessionLocked
from shared.hashchain import verify_proof
from shared.records import Event


async def run(rt: SessionRuntime, session_id: str, text: str, **kw: Any) -> list[StreamEventBase]:
    return [ev async for ev in rt.execute_message(session_id, text, **kw)]


def types(events: list[StreamEventBase]) -> list[str]:
    return [e.type for e in events]


async def test_create_persists_row_vector_and_empty_state(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session(title="first")
    assert uuid.UUID(handle.id).version == 7
    row = await runtime.store.get_session(handle.id)
    assert row is not None
    assert row.vv == {runtime.client_id: 1}
    assert row.state.message_ids == [] and row.provider == "scripted"
    assert runtime.get_active_session() is handle


async def test_provider_and_model_are_locked(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    with pytest.raises(SessionLocked):
        await runtime.sessions.update_provider_model(handle.id, "anthropic", "claude-x")
    with pytest.raises(SessionLocked):
        await runtime.sessions.save(msgspec.structs.replace(handle.record, model="other"))
    saved = await runtime.sessions.rename(handle.id, "renamed")
    assert saved.title == "renamed" and saved.vv[runtime.client_id] == 2


async def test_client_id_is_kept_by_the_store(tmp_path: Any) -> None:
    from pleach_client.store.sqlite import SQLiteAdapter

    path = tmp_path / "keep.db"
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        first = rt.client_id
        assert rt.user_id == "anonymous"
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        assert rt.client_id == first


async def test_default_runtime_is_in_memory() -> None:
    async with SessionRuntime(provider=ScriptedProvider()) as rt:
        assert isinstance(rt.store, MemoryAdapter) and not rt.store.durable
        handle = await rt.create_session()
        assert (await run(rt, handle.id, "hi"))[-1].type == "turn.complete"


async def test_turns_on_one_session_take_turns(runtime: SessionRuntime) -> None:
    """Two turns started at once on one session run one after the other (the session's turn
    lock, held by the turn itself from its first step to its end), and each event reaches
    the bus as it is yielded; a turn on another session does not wait for them."""
    first, other = await runtime.create_session(), await runtime.create_session()
    seen: list[tuple[str, str]] = []
    runtime.events.on("*", lambda ev: seen.append(("bus", ev.type)))
    yielded: dict[str, list[tuple[float, str]]] = {"a": [], "b": [], "c": []}

    async def consume(label: str, session_id: str) -> None:
        async for ev in runtime.execute_message(session_id, f"turn {label}"):
            assert seen[-1] == ("bus", ev.type)  # emitted before it was yielded
            yielded[label].append((asyncio.get_running_loop().time(), ev.type))
            await asyncio.sleep(0)  # let the other consumers try to interleave

    await asyncio.gather(consume("a", first.id), consume("b", first.id), consume("c", other.id))
    a, b = yielded["a"], yielded["b"]
    assert a[-1][1] == b[-1][1] == "turn.complete"
    one, two = (a, b) if a[0][0] <= b[0][0] else (b, a)
    assert one[-1][0] <= two[0][0]  # the second began after the first completed
    transcript = await runtime.sessions.messages(first.id)
    assert [m.role for m in transcript] == ["user", "assistant", "user", "assistant"]
    assert yielded["c"][-1][1] == "turn.complete"
    c_start = yielded["c"][0][0]
    assert c_start < one[-1][0]  # the other session's turn ran meanwhile


async def test_turn_streams_and_commits(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend([ScriptedReply(text="Hello there friend")])
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "hi")
    kinds = types(events)
    assert kinds[0] == "message.added" and kinds[-1] == "turn.complete"
    assert "".join(e.delta for e in events if e.type == "message.delta") == "Hello there friend"  # type: ignore[attr-defined]
    assert kinds.index("message.complete") < kinds.index("checkpoint.created")
    messages = await runtime.sessions.messages(handle.id)
    assert [m.role for m in messages] == ["user", "assistant"]
    checkpoints = await runtime.checkpoints.list(handle.id)
    assert len(checkpoints) == 1 and checkpoints[0].appended == [m.id for m in messages]
    assert (await runtime.events.verify_chain(handle.id)).ok
    rows = await runtime.audit.rows(handle.id)
    assert len(rows) == 1 and rows[0].outcome.status == "ok" and rows[0].usage.input_tokens > 0
    assert rows[0].request_id is not None and rows[0].seq_within_turn == 0


async def test_tool_loop_with_calculator(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend(
        [
            ScriptedReply(text="Computing.", tool_calls=[("calculator", {"expression": "6 * 7"})]),
            ScriptedReply(text="It is 42."),
        ]
    )
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "6*7?")
    completed = [e for e in events if e.type == "tool.completed"]
    assert completed and completed[0].output == "42"  # type: ignore[attr-defined]
    second = scripted.requests[-1].messages
    assert second[-1]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": second[-2]["content"][1]["id"],
        "content": "42",
    }
    rows = await runtime.audit.rows(handle.id)
    assert [r.seq_within_turn for r in rows] == [0, 1]
    assert len({r.turn_id for r in rows}) == 1


async def test_failing_tool_becomes_error_result(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    def boom(_: dict[str, Any]) -> str:
        raise RuntimeError("disk on fire")

    runtime.tools.register(Tool("boom", "fails", {"type": "object"}, boom))
    scripted.extend(
        [
            ScriptedReply(tool_calls=[("boom", {}), ("nope", {})]),
            ScriptedReply(text="Sorry."),
        ]
    )
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "go")
    failed = [e for e in events if e.type == "tool.failed"]
    assert len(failed) == 2 and "disk on fire" in failed[0].error  # type: ignore[attr-defined]
    results = scripted.requests[-1].messages[-1]["content"]
    assert all(r["is_error"] for r in results)
    rows = await runtime.audit.rows(handle.id)
    assert rows[0].outcome.status == "tool-error"
    assert events[-1].outcome == "tool-error"  # type: ignore[attr-defined]
    assert (await run(runtime, handle.id, "still there?"))[-1].type == "turn.complete"


async def test_provider_error_keeps_session_usable(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend(
        [ScriptedReply(error="overloaded", error_retryable=True), ScriptedReply(text="Back.")]
    )
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "hi")
    error = next(e for e in events if e.type == "error")
    assert error.code == "overloaded" and error.retryable  # type: ignore[attr-defined]
    rows = await runtime.audit.rows(handle.id)
    assert rows[-1].outcome.status == "provider-error" and rows[-1].outcome.code == "overloaded"
    events = await run(runtime, handle.id, "again")
    assert events[-1].outcome == "ok"  # type: ignore[attr-defined]
    roles = [m["role"] for m in scripted.requests[-1].messages]
    assert roles == ["user"]  # two user turns merged into one valid request


async def test_tool_iteration_cap(adapter: Any) -> None:
    provider = ScriptedProvider(
        default_reply=ScriptedReply(tool_calls=[("calculator", {"expression": "1+1"})])
    )
    async with SessionRuntime(adapter, provider, max_tool_iterations=2) as rt:
        handle = await rt.create_session()
        events = await run(rt, handle.id, "loop forever")
        assert any(
            e.type == "error" and e.code == "tool_iteration_limit"  # type: ignore[attr-defined]
            for e in events
        )
        assert len(provider.requests) == 3
        request = provider.requests[-1]
        assert request.messages[-1]["role"] == "user"


async def test_abort_by_event_accounts_and_keeps_partial(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend(
        [ScriptedReply(text="one two three four five six seven eight", input_tokens=120)]
    )
    handle = await runtime.create_session()
    abort = asyncio.Event()
    events: list[StreamEventBase] = []
    async for ev in runtime.execute_message(handle.id, "long answer", abort=abort):
        events.append(ev)
        if sum(e.type == "message.delta" for e in events) == 2:
            abort.set()
    assert events[-1].outcome == "user-aborted"  # type: ignore[attr-defined]
    assert scripted.closed == 1
    row = (await runtime.audit.rows(handle.id))[-1]
    assert row.outcome.status == "user-aborted"
    assert row.usage.input_tokens == 120 and row.usage.output_estimated
    assert row.usage.output_tokens == 2  # the 8 characters streamed, a token per four
    messages = await runtime.sessions.messages(handle.id)
    assert messages[-1].aborted and messages[-1].content == [{"type": "text", "text": "one two "}]
    assert (await run(runtime, handle.id, "continue"))[-1].outcome == "ok"  # type: ignore[attr-defined]
    sent = scripted.requests[-1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == [{"type": "text", "text": "one two "}]


async def test_abort_during_tools_closes_dangling_tool_use(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow(_: dict[str, Any]) -> str:
        started.set()
        await release.wait()
        return "never"

    runtime.tools.register(Tool("slow", "waits", {"type": "object"}, slow))
    scripted.extend(
        [
            ScriptedReply(
                text="Working.", tool_calls=[("slow", {}), ("calculator", {"expression": "1"})]
            )
        ]
    )
    handle = await runtime.create_session()
    abort = asyncio.Event()

    async def consume() -> list[StreamEventBase]:
        return await run(runtime, handle.id, "do it", abort=abort)

    task = asyncio.create_task(consume())
    await started.wait()
    abort.set()
    events = await task
    assert events[-1].outcome == "user-aborted"  # type: ignore[attr-defined]
    messages = await runtime.sessions.messages(handle.id)
    tool_ids = [b["id"] for b in messages[1].content if b["type"] == "tool_use"]
    results = {b["tool_use_id"]: b for b in messages[2].content}
    assert set(results) == set(tool_ids)
    assert all(r["is_error"] for r in results.values())
    await run(runtime, handle.id, "next")
    sent = scripted.requests[-1].messages
    assert sent[2]["content"][0]["type"] == "tool_result"
    assert sent[2]["content"][-1] == {"type": "text", "text": "next"}


async def test_abort_by_cancelling_the_consumer(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend([ScriptedReply(text="a b c d e f g h i j", delay=0.001, input_tokens=50)])
    handle = await runtime.create_session()
    got_delta = asyncio.Event()

    async def consume() -> None:
        async for ev in runtime.execute_message(handle.id, "story"):
            if ev.type == "message.delta":
                got_delta.set()

    task = asyncio.create_task(consume())
    await got_delta.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rows = await runtime.audit.rows(handle.id)
    assert rows[-1].outcome.status == "user-aborted" and rows[-1].usage.input_tokens == 50
    assert len(await runtime.checkpoints.list(handle.id)) == 1
    assert (await runtime.events.verify_chain(handle.id)).ok
    assert (await run(runtime, handle.id, "go on"))[-1].outcome == "ok"  # type: ignore[attr-defined]


async def test_breaking_out_early_with_aclosing_aborts(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend([ScriptedReply(text="x y z w", input_tokens=9)])
    handle = await runtime.create_session()
    async with contextlib.aclosing(runtime.execute_message(handle.id, "hi")) as stream:
        async for ev in stream:
            if ev.type == "message.delta":
                break
    rows = await runtime.audit.rows(handle.id)
    assert rows[-1].outcome.status == "user-aborted"


async def test_resume_is_idempotent_and_hydrates(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    await run(runtime, handle.id, "one")
    await run(runtime, handle.id, "two")
    a = await runtime.resume_session(handle.id)
    b = await runtime.resume_session(handle.id)
    assert a.id == b.id == handle.id and a.message_ids == b.message_ids
    assert a.hydrated["turns"] == 2 and a.layers == ["row", "events"]
    assert runtime.get_active_session() is b
    with pytest.raises(NotFound):
        await runtime.resume_session(str(uuid.uuid4()))


async def test_resume_overlays_a_newer_checkpoint_only(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    await run(runtime, handle.id, "one")
    row = await runtime.store.get_session(handle.id)
    assert row is not None
    # A crash that landed a checkpoint but lost the row write: the checkpoint is newer and
    # descends from the row's head.
    extra = runtime.core.draft_checkpoint(
        handle.id, parent_id=row.head_checkpoint_id, turn_id=None, kind="turn", appended=["m-x"]
    )
    await runtime.store.commit(WriteBatch(records=[extra], outbox=False))
    resumed = await runtime.resume_session(handle.id)
    assert "checkpoint" in resumed.layers and resumed.message_ids[-1] == "m-x"
    assert resumed.message_ids[:-1] == row.state.message_ids
    # The overlay is a new local version: the next turn builds on it.
    stored = await runtime.store.get_session(handle.id)
    assert stored is not None and stored.head_checkpoint_id == extra.id
    # A newer checkpoint of another branch (a sibling of the head) is never overlaid.
    sibling = runtime.core.draft_checkpoint(
        handle.id, parent_id=row.head_checkpoint_id, turn_id=None, kind="turn", appended=["m-y"]
    )
    await runtime.store.commit(WriteBatch(records=[sibling], outbox=False))
    resumed = await runtime.resume_session(handle.id)
    assert "checkpoint" not in resumed.layers and resumed.message_ids[-1] == "m-x"


async def test_delete_cascades_checkpoints_keeps_audit(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    await run(runtime, handle.id, "one")
    receipt = await runtime.delete_session(handle.id)
    assert receipt.deleted and receipt.session_id == handle.id and receipt.removed_from_cache
    assert receipt.checkpoints_removed == 1
    assert await runtime.checkpoints.list(handle.id) == []
    assert len(await runtime.audit.rows(handle.id)) == 1
    assert runtime.get_active_session() is None
    assert await runtime.sessions.find(handle.id) is None
    again = await runtime.delete_session(handle.id)
    assert not again.deleted


async def test_event_log_iterate_fold_verify_and_prove(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    for text in ("a", "b", "c"):
        await run(runtime, handle.id, text)
    rows = [e async for e in runtime.events.iterate(handle.id, page_size=4)]
    assert [r.sequence_number for r in rows] == list(range(1, len(rows) + 1))
    tail = [e async for e in runtime.events.iterate(handle.id, from_sequence=5)]
    assert tail[0].sequence_number == 5
    count_turns: Projection[int] = Projection(
        "turns", lambda: 0, lambda n, e: n + (e.type == "turn.complete")
    )
    result = await runtime.events.fold(count_turns, handle.id)
    assert result.state == 3 and result.rows_processed == len(rows)
    proof = await runtime.events.generate_proof(rows[3].id)
    assert verify_proof(proof, rows[3])
    assert not verify_proof(proof, msgspec.structs.replace(rows[3], payload={"x": 1}))
    # Tamper with one stored row: verification names its index.
    bad = msgspec.structs.replace(rows[4], payload={"forged": True})
    await runtime.store.commit(WriteBatch(records=[bad], outbox=False))
    report = await runtime.events.verify_chain(handle.id)
    assert not report.ok and report.first_bad_index == 4


async def test_live_bus_and_stream_modes(runtime: SessionRuntime) -> None:
    seen: dict[str, list[str]] = {m: [] for m in ("values", "updates", "messages", "all")}
    unsubscribe = {
        m: runtime.subscribe_to_stream(m, lambda e, m=m: seen[m].append(e.type))  # type: ignore[misc]
        for m in seen
    }
    once: list[str] = []
    every: list[str] = []
    runtime.events.once("turn.complete", lambda e: once.append(e.type))
    runtime.events.on("*", lambda e: every.append(e.type))
    handle = await runtime.create_session()
    await run(runtime, handle.id, "hi")
    await run(runtime, handle.id, "again")
    assert seen["values"][0] == "session.created" and "checkpoint.created" in seen["values"]
    assert "message.delta" not in seen["updates"] and "message.added" in seen["updates"]
    assert set(seen["messages"]) <= {
        "message.delta",
        "message.complete",
        "thinking.delta",
        "thinking.complete",
    }
    assert once == ["turn.complete"] and every.count("turn.complete") == 2
    assert len(seen["all"]) == len(every)
    assert unsubscribe["all"]() and not unsubscribe["all"]()
    manager = runtime.get_stream_manager()
    manager.set_event_filter(["turn.complete"])
    before = len(seen["messages"])
    await run(runtime, handle.id, "filtered")
    assert len(seen["messages"]) == before
    manager.set_event_filter(None)
    manager.set_throttle_interval(60_000)
    await run(runtime, handle.id, "one two three four five")
    deltas = seen["messages"][before:].count("message.delta")
    assert deltas == 2  # the first, then the rest coalesced into one (tests/test_turn_surface.py)


async def test_checkpoints_rollback_fork_and_time_travel(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    for text in ("one", "two", "three"):
        await run(runtime, handle.id, text)
    cps = await runtime.checkpoints.list(handle.id)
    assert [c.parent_id for c in cps] == [None, cps[0].id, cps[1].id]
    at_first = await runtime.checkpoints.state_at(handle.id, cps[0].id)
    assert at_first[0].content[0]["text"] == "one" and len(at_first) == 2
    audit_before = len(await runtime.audit.rows(handle.id))
    receipt = await runtime.checkpoints.rollback(handle.id, cps[0].id)
    assert receipt.messages_before == 6 and receipt.messages_after == 2
    row = await runtime.store.get_session(handle.id)
    assert row is not None and row.head_checkpoint_id == receipt.new_checkpoint_id
    assert len(await runtime.audit.rows(handle.id)) == audit_before
    assert (await runtime.checkpoints.list(handle.id))[-1].parent_id == cps[-1].id
    await run(runtime, handle.id, "after rollback")
    sent = [
        m["content"][0]["text"]
        for m in runtime._provider.requests[-1].messages  # type: ignore[union-attr]
        if m["role"] == "user"
    ]
    assert sent == ["one", "after rollback"]
    fork = await runtime.checkpoints.fork(handle.id, cps[1].id)
    assert fork.session_id != handle.id and fork.messages == 4
    forked = await runtime.sessions.messages(fork.session_id)
    assert [m.content[0]["text"] for m in forked if m.role == "user"] == ["one", "two"]
    assert len(await runtime.sessions.messages(handle.id)) == 4
    await run(runtime, fork.session_id, "on the fork")
    assert (await runtime.events.verify_chain(fork.session_id)).ok


async def test_audit_rollup_cost_and_gdpr(adapter: Any) -> None:
    from tests.test_runtime_anthropic import anthropic_provider, text_reply

    provider, _ = anthropic_provider(
        [
            text_reply("hi", input_tokens=1000, output_tokens=500),
            text_reply("again", input_tokens=2000, output_tokens=100),
        ]
    )
    async with SessionRuntime(adapter, provider, user_id="bob") as rt:
        handle = await rt.create_session(model="claude-sonnet-4-20250514")
        await run(rt, handle.id, "one")
        await run(rt, handle.id, "two")
        rollup = await rt.audit.rollup(handle.id)
        assert rollup.calls == 2 and rollup.input_tokens == 3000 and rollup.output_tokens == 600
        assert rollup.cost_usd is not None and rollup.cost_usd > 0
        assert len(rollup.turns) == 2 and rollup.outcomes == {"ok": 2}
        receipt = await rt.audit.gdpr_soft_delete("bob")
        assert receipt.rows_redacted == 2 and receipt.chain_verified
        rows = await rt.audit.rows(handle.id)
        assert all(r.redacted and r.subject_key is None and r.request_id is None for r in rows)
        assert all(r.usage.input_tokens > 0 for r in rows)


async def test_unknown_model_has_no_cost(runtime: SessionRuntime) -> None:
    handle = await runtime.create_session()
    await run(runtime, handle.id, "hi")
    rollup = await runtime.audit.rollup()
    assert rollup.calls == 1 and rollup.cost_usd is None


async def test_turns_on_one_session_do_not_interleave(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend(
        [ScriptedReply(text="first reply", delay=0.001), ScriptedReply(text="second reply")]
    )
    handle = await runtime.create_session()
    await asyncio.gather(run(runtime, handle.id, "a"), run(runtime, handle.id, "b"))
    messages = await runtime.sessions.messages(handle.id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert (await runtime.events.verify_chain(handle.id)).ok


def test_event_records_are_events() -> None:
    assert Event.__struct_config__.tag == "Event"


async def test_thinking_streams_and_is_kept(
    runtime: SessionRuntime, scripted: ScriptedProvider
) -> None:
    scripted.extend([ScriptedReply(thinking="weigh the options", text="Answer.")])
    handle = await runtime.create_session()
    events = await run(runtime, handle.id, "think")
    assert "".join(e.delta for e in events if e.type == "thinking.delta") == "weigh the options"  # type: ignore[attr-defined]
    assert any(e.type == "thinking.complete" for e in events)
    reply = (await runtime.sessions.messages(handle.id))[-1]
    assert reply.content[0]["type"] == "thinking" and reply.content[0]["signature"]
    await run(runtime, handle.id, "next")
    assert scripted.requests[-1].messages[1]["content"][0]["type"] == "thinking"


async def test_memory_default_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    import pleach_client.runtime as runtime_module

    runtime_module._memory_warned = False
    with caplog.at_level("WARNING", logger="pleach.runtime"):
        SessionRuntime(provider=ScriptedProvider())
        SessionRuntime(provider=ScriptedProvider())
    warnings = [r for r in caplog.records if "in-memory store" in r.getMessage()]
    assert len(warnings) == 1


async def test_anthropic_sessions_default_to_a_current_model(adapter: Any) -> None:
    from pleach_client.providers.anthropic import AnthropicProvider
    from tests.test_runtime_anthropic import anthropic_provider

    provider, _ = anthropic_provider([])
    assert isinstance(provider, AnthropicProvider)
    async with SessionRuntime(adapter, provider) as rt:
        handle = await rt.create_session()
        assert (handle.provider, handle.model) == ("anthropic", "claude-sonnet-4-6")
    await provider.client.close()


def test_the_common_names_import_from_the_package_without_the_anthropic_sdk() -> None:
    """``from pleach_client import SessionRuntime`` works, and does not pay for the anthropic
    SDK's import (seconds) unless ``AnthropicProvider`` is asked for. A fresh interpreter, so
    what this test process imported before does not count."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pleach_client import SessionRuntime, SQLiteAdapter, ScriptedProvider, Tool\n"
        "assert 'anthropic' not in sys.modules, 'anthropic imported eagerly'\n"
        "from pleach_client import AnthropicProvider\n"
        "assert 'anthropic' in sys.modules\n"
        "print(SessionRuntime.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SessionRuntime"


async def test_a_tool_registered_after_create_is_named_and_can_be_enabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A session lists its tools when created; a tool registered later is not offered. That
    is said (once) instead of silent, and ``sessions.set_tools`` enables it."""
    provider = ScriptedProvider()
    async with SessionRuntime(MemoryAdapter(), provider) as rt:
        session_id = (await rt.create_session()).id
        rt.tools.add("late", "added after", {"type": "object", "properties": {}}, lambda _: "ok")
        with caplog.at_level("WARNING", logger="pleach.runtime"):
            for text in ("one", "two"):
                async for _ in rt.execute_message(session_id, text):
                    pass
        warnings = [
            r for r in caplog.records if "'late' is registered but not offered" in r.message
        ]
        assert len(warnings) == 1
        assert "late" not in [t.name for t in provider.requests[-1].tools]
        current = await rt.sessions.find(session_id)
        assert current is not None
        await rt.sessions.set_tools(session_id, [*current.tools, "late"])
        async for _ in rt.execute_message(session_id, "three"):
            pass
        assert "late" in [t.name for t in provider.requests[-1].tools]
        with pytest.raises(NotFound):
            await rt.sessions.set_tools(session_id, ["never-registered"])


_OFFLINE_APP = """
import asyncio, sys
from pleach_client.runtime import SessionRuntime
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.store.sqlite import SQLiteAdapter

async def main():
    async with SessionRuntime(SQLiteAdapter(sys.argv[1]), ScriptedProvider()) as rt:
        handle = await rt.create_session(title="offline")
        async for _ in rt.execute_message(handle.id, "hello"):
            pass
        await rt.sessions.resume(handle.id)
        print("pleach_client.sync" in sys.modules, "websockets" in sys.modules)
        await rt.sync.status()  # asked for: made then
        print("pleach_client.sync" in sys.modules, (await rt.sync.status()).pending)

asyncio.run(main())
"""


def test_a_runtime_that_never_syncs_never_imports_the_sync_client(tmp_path: Any) -> None:
    """An app that works offline does not pay for the sync client and its WebSocket stack at
    start; ``rt.sync`` is made when first asked for, and sees what was queued before."""
    out = subprocess.run(
        [sys.executable, "-c", _OFFLINE_APP, str(tmp_path / "d.db")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    before, after = out.stdout.splitlines()
    assert before == "False False"
    first, pending = after.split()
    assert first == "True" and int(pending) > 0
