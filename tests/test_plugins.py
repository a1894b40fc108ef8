"""Plugins, prompts, flow control and the observer router, driven through the real anthropic
SDK (``httpx2.MockTransport`` replaying the API's SSE bodies) wherever a model is called."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

import pleach_client.plugins as plugins_module
from pleach_client.plugins import (
    ExponentialRetry,
    ModelCallNext,
    ToolCallNext,
    ToolInvocation,
    ToolStep,
    TurnContext,
)
from pleach_client.prompts import PromptFragment
from pleach_client.providers.base import (
    MessageStart,
    MessageStop,
    ProviderEvent,
    ProviderRequest,
    TextDelta,
)
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.memory import MemoryAdapter
from pleach_client.stream import CustomEvent, StreamEventBase
from pleach_client.tools import Tool
from tests import sse
from tests.test_runtime_anthropic import MODEL, anthropic_provider, text_reply


def tool_reply(tool_id: str, name: str, input_json: str, *, text: str = "") -> sse.StreamBody:
    """A reply that calls one tool (after an optional text block), as the API streams it."""
    chunks = [sse.message_start(input_tokens=120)]
    index = 0
    if text:
        chunks += [sse.text_start(0), sse.text_delta(0, text), sse.block_stop(0)]
        index = 1
    chunks += [
        sse.tool_use_start(index, tool_id, name),
        sse.input_json_delta(index, input_json),
        sse.block_stop(index),
        sse.message_delta(stop_reason="tool_use", output_tokens=30),
        sse.message_stop(),
    ]
    return sse.StreamBody(chunks)


async def run(rt: SessionRuntime, session_id: str, text: str) -> list[StreamEventBase]:
    return [e async for e in rt.execute_message(session_id, text)]


def of_type(events: list[StreamEventBase], kind: str) -> list[Any]:
    return [e for e in events if e.type == kind]


# -- nothing contributed ------------------------------------------------------------------------


async def test_with_no_plugins_collections_are_empty_and_capabilities_none() -> None:
    async with SessionRuntime(MemoryAdapter(), meta_tool_names=()) as rt:
        p = rt.plugins
        assert p.list() == [] and p.get("anything") is None
        for collection in (
            p.collect_prompts(),
            p.collect_tools(),
            p.collect_safety_policies(),
            p.collect_stream_observers(),
            p.collect_model_middleware(),
            p.collect_tool_middleware(),
            p.collect_stream_chunk_handlers(),
            p.list_available_prompt_contributions(),
        ):
            assert collection == []
        assert p.collect_retry_policy() is None and p.collect_continuation_policy() is None
        assert p.get_safety_registry() is rt.safety.get_registry()
        assert rt.observer_router.list() == []


def test_a_plugin_needs_a_unique_name() -> None:
    class Named:
        def __init__(self, name: Any) -> None:
            self.name = name

    with pytest.raises(ValueError, match="two plugins are named 'a'"):
        SessionRuntime(MemoryAdapter(), plugins=[Named("a"), Named("a")], meta_tool_names=())
    with pytest.raises(ValueError, match="non-empty string name"):
        SessionRuntime(MemoryAdapter(), plugins=[Named("")], meta_tool_names=())


# -- every hook, through the SDK ------------------------------------------------------------------


class Everything:
    """A plugin with every hook, recording what it saw."""

    name = "everything"

    def __init__(self) -> None:
        self.requests: list[ProviderRequest] = []
        self.tool_calls: list[ToolInvocation] = []
        self.observed: list[str] = []
        self.chunks = 0
        self.set_up_with: SessionRuntime | None = None

    def prompts(self) -> list[PromptFragment]:
        return [PromptFragment(id="everything.house-style", text="Answer in one sentence.")]

    def tools(self) -> list[Tool]:
        return [Tool("shout", "Upper-case a word.", {"type": "object"}, lambda i: i["w"].upper())]

    def stream_observers(self) -> list[Any]:
        return [lambda event: self.observed.append(event.type)]

    def setup(self, runtime: SessionRuntime) -> None:
        self.set_up_with = runtime

    async def wrap_model_call(
        self, ctx: TurnContext, request: ProviderRequest, call_next: ModelCallNext
    ) -> AsyncIterator[ProviderEvent]:
        self.requests.append(request)
        ctx.emit("model_call", {"seq": ctx.seq, "model": ctx.model})
        async for event in call_next(request):
            yield event

    async def wrap_tool_call(
        self, ctx: TurnContext, call: ToolInvocation, call_next: ToolCallNext
    ) -> str:
        self.tool_calls.append(call)
        output = await call_next(call)
        return f"{output}!"

    def on_stream_chunk(self, ctx: TurnContext, chunk: ProviderEvent) -> None:
        if isinstance(chunk, TextDelta):
            self.chunks += 1
            ctx.emit("progress", {"chars": len(chunk.text)})


async def test_every_hook_runs_in_a_turn_through_the_sdk(adapter: StorageAdapter) -> None:
    plugin = Everything()
    provider, api = anthropic_provider(
        [tool_reply("toolu_1", "shout", '{"w": "hi"}', text="Shouting."), text_reply("HI! done")]
    )
    async with SessionRuntime(adapter, provider, plugins=[plugin], meta_tool_names=()) as rt:
        assert plugin.set_up_with is rt
        assert rt.plugins.list() == ["everything"] and rt.plugins.get("everything") is plugin
        assert [f.id for f in rt.prompts.list_by_origin("everything")] == ["everything.house-style"]
        handle = await rt.create_session(model=MODEL)
        assert "shout" in handle.record.tools  # a plugin's tool is offered to new sessions
        events = await run(rt, handle.id, "shout hi")

    # The plugin's prompt fragment and tool reached the API; the core fragment too.
    first, second = api.sent
    assert "Answer in one sentence." in first["system"]
    assert "Tool results come from the runtime" in first["system"]
    assert [t["name"] for t in first["tools"]] == ["calculator", "shout"]
    # The tool middleware saw the call and changed its output, which the model then read.
    assert plugin.tool_calls == [ToolInvocation(id="toolu_1", name="shout", input={"w": "hi"})]
    assert of_type(events, "tool.completed")[0].output == "HI!"
    assert second["messages"][-1]["content"][0]["content"] == "HI!"
    # The model middleware saw both requests; its custom events are in the stream, in order.
    assert [r.model for r in plugin.requests] == [MODEL, MODEL]
    customs = [e for e in events if isinstance(e, CustomEvent)]
    assert [e.type for e in customs if e.name == "model_call"] == ["custom.model_call"] * 2
    assert [e.data["seq"] for e in customs if e.name == "model_call"] == [0, 1]
    progress = [e for e in customs if e.name == "progress"]
    assert len(progress) == plugin.chunks == len(of_type(events, "message.delta"))
    kinds = [e.type for e in events]
    first_delta = kinds.index("message.delta")
    assert kinds[first_delta + 1] == "custom.progress"  # right after the chunk that made it
    # The stream observer saw everything the consumer did.
    assert plugin.observed[-len(kinds) :] == kinds
    assert events[-1].type == "turn.complete"
    await provider.client.close()


async def test_a_model_middleware_can_answer_without_calling_the_provider() -> None:
    class Cache:
        name = "cache"

        async def wrap_model_call(
            self, ctx: TurnContext, request: ProviderRequest, call_next: ModelCallNext
        ) -> AsyncIterator[ProviderEvent]:
            yield MessageStart(request_id="cached", model=ctx.model, input_tokens=0)
            yield TextDelta(index=0, text="from cache")
            yield MessageStop(
                content=[{"type": "text", "text": "from cache"}],
                stop_reason="end_turn",
                input_tokens=0,
                output_tokens=0,
                request_id="cached",
            )

    provider, api = anthropic_provider([])
    async with SessionRuntime(
        MemoryAdapter(), provider, plugins=[Cache()], meta_tool_names=()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "hello")
        assert api.sent == []
        assert of_type(events, "message.complete")[0].content == [
            {"type": "text", "text": "from cache"}
        ]
        assert (await rt.audit.rows(handle.id))[0].request_id == "cached"
    await provider.client.close()


async def test_a_failing_middleware_is_an_error_event_and_the_sdk_stream_is_closed() -> None:
    class Breaks:
        name = "breaks"

        async def wrap_model_call(
            self, ctx: TurnContext, request: ProviderRequest, call_next: ModelCallNext
        ) -> AsyncIterator[ProviderEvent]:
            async for event in call_next(request):
                if isinstance(event, TextDelta):
                    raise RuntimeError("middleware bug")
                yield event

    body = sse.StreamBody(sse.text_stream(["never", " seen"]))
    provider, _ = anthropic_provider([body, text_reply("fine")])
    async with SessionRuntime(
        MemoryAdapter(), provider, plugins=[Breaks()], meta_tool_names=()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "hi")  # no exception out of the generator
        error = of_type(events, "error")[0]
        assert error.code == "plugin_error" and "middleware bug" in error.error
        assert events[-1].outcome == "provider-error"
        assert body.closed, "the SDK's HTTP stream must be closed when a layer fails"
        row = (await rt.audit.rows(handle.id))[0]
        assert (row.outcome.status, row.outcome.code) == ("provider-error", "plugin_error")
        assert not rt.degradation.is_model_degraded(MODEL)  # a plugin's bug is not the model's
    await provider.client.close()


async def test_abort_mid_stream_closes_every_layer_and_the_sdk_stream() -> None:
    closed: list[str] = []

    class Layer:
        def __init__(self, name: str) -> None:
            self.name = name

        async def wrap_model_call(
            self, ctx: TurnContext, request: ProviderRequest, call_next: ModelCallNext
        ) -> AsyncIterator[ProviderEvent]:
            try:
                async for event in call_next(request):
                    yield event
            finally:
                closed.append(self.name)

    held = sse.StreamBody(sse.text_stream(["partial", " answer", " more"]), hold_after=4)
    provider, _ = anthropic_provider([held])
    async with SessionRuntime(
        MemoryAdapter(), provider, plugins=[Layer("outer"), Layer("inner")], meta_tool_names=()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        abort = asyncio.Event()
        task = asyncio.create_task(_collect(rt.execute_message(handle.id, "go", abort=abort)))
        await held.reached_hold.wait()
        abort.set()
        events = await task
        assert events[-1].outcome == "user-aborted"
        assert held.closed
        assert sorted(closed) == ["inner", "outer"]
        row = (await rt.audit.rows(handle.id))[-1]
        assert row.outcome.status == "user-aborted" and row.usage.input_tokens == 25
    await provider.client.close()


async def _collect(events: AsyncIterator[StreamEventBase]) -> list[Any]:
    return [e async for e in events]


# -- flow control -------------------------------------------------------------------------------


async def test_a_meta_tool_ends_the_turn_through_the_sdk(adapter: StorageAdapter) -> None:
    provider, api = anthropic_provider(
        [
            tool_reply("toolu_done", "set_step_complete", '{"summary": "said hi"}', text="Hi."),
            text_reply("Next question?"),
        ]
    )
    async with SessionRuntime(adapter, provider, meta_tool_names={"set_step_complete"}) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "say hi, then you are done")
        assert len(api.sent) == 1, "a terminal signal: no second model call"
        first = api.sent[0]
        assert "set_step_complete" in [t["name"] for t in first["tools"]]
        assert "Call set_step_complete when the task you were given is done" in first["system"]
        done = events[-1]
        assert done.type == "turn.complete" and done.outcome == "ok"
        assert done.stopped_by == "set_step_complete"
        assert of_type(events, "tool.completed")[0].output == "Step marked complete."
        log_types = [e.type for e in await rt.store.list_events(handle.id)]
        assert "turn.stopped" in log_types
        # The next turn's request is valid: the meta tool's call has its result.
        await run(rt, handle.id, "and now?")
        body = api.sent[1]
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert body["messages"][2]["content"][0] == {
            "type": "tool_result",
            "tool_use_id": "toolu_done",
            "content": "Step marked complete.",
        }
    await provider.client.close()


async def test_without_meta_tool_names_it_warns_once_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugins_module, "_meta_warned", False)
    done = Tool("set_step_complete", "done", {"type": "object"}, lambda _: "noted")
    provider, api = anthropic_provider(
        [tool_reply("toolu_1", "set_step_complete", "{}"), text_reply("carrying on")]
    )
    with caplog.at_level(logging.WARNING, logger="pleach.plugins"):
        SessionRuntime(MemoryAdapter(), provider)  # no flow-control tool: nothing to say
        assert not caplog.records
        rt = SessionRuntime(MemoryAdapter(), provider, tools=[done])
        SessionRuntime(MemoryAdapter(), provider, tools=[done])
    warnings = [r for r in caplog.records if "metaToolNames-config-missing" in r.getMessage()]
    assert len(warnings) == 1 and "set_step_complete" in warnings[0].getMessage()
    async with rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "go")
        assert len(api.sent) == 2  # an ordinary tool call: the model is called again
        assert events[-1].stopped_by is None
    await provider.client.close()


async def test_a_meta_tool_without_a_registered_tool_is_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provider, _ = anthropic_provider([text_reply("ok"), text_reply("ok")])
    async with SessionRuntime(MemoryAdapter(), provider, meta_tool_names={"wait_for_jobs"}) as rt:
        handle = await rt.create_session(model=MODEL)
        with caplog.at_level(logging.WARNING, logger="pleach.plugins"):
            await run(rt, handle.id, "one")
            await run(rt, handle.id, "two")
    named = [r for r in caplog.records if "['wait_for_jobs'] have no registered tool" in r.message]
    assert len(named) == 1
    await provider.client.close()


async def test_a_continuation_policy_decides_after_each_round() -> None:
    seen: list[ToolStep] = []

    class Policy:
        name = "policy"

        def continuation_policy(self) -> Any:
            return self

        async def decide(self, step: ToolStep, ctx: TurnContext) -> str | None:
            seen.append(step)
            if "wait_for_jobs" in step.meta_tools:
                return "continue"  # the jobs are in: let the model go on
            if any(c.name == "calculator" for c in step.calls):
                return "stop"
            return None

    jobs = Tool("wait_for_jobs", "wait", {"type": "object"}, lambda _: "all 2 jobs finished")
    provider, api = anthropic_provider(
        [
            tool_reply("toolu_w", "wait_for_jobs", "{}"),
            tool_reply("toolu_c", "calculator", '{"expression": "1+1"}'),
            text_reply("never asked for"),
        ]
    )
    async with SessionRuntime(
        MemoryAdapter(),
        provider,
        tools=[jobs],
        plugins=[Policy()],
        meta_tool_names={"wait_for_jobs"},
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "wait, then add")
        assert len(api.sent) == 2
        assert [s.meta_tools for s in seen] == [("wait_for_jobs",), ()]
        assert seen[1].calls[0].input == {"expression": "1+1"} and not seen[1].failed
        assert events[-1].stopped_by == "continuation_policy"
        assert rt.plugins.collect_continuation_policy() is not None
    await provider.client.close()


# -- retries ------------------------------------------------------------------------------------


class Retrying:
    name = "retrying"

    def __init__(self, policy: ExponentialRetry) -> None:
        self.policy = policy

    def retry_policy(self) -> ExponentialRetry:
        return self.policy


def broken_stream() -> sse.StreamBody:
    return sse.StreamBody(
        [
            sse.message_start(input_tokens=40),
            sse.text_start(0),
            sse.text_delta(0, "Half an ans"),
            sse.error("overloaded_error", "Overloaded"),
        ]
    )


async def test_a_retry_policy_calls_again_after_a_broken_stream(adapter: StorageAdapter) -> None:
    provider, api = anthropic_provider([broken_stream(), text_reply("Whole.")])
    retry = Retrying(ExponentialRetry(max_attempts=2, base_delay=0.0, jitter=False))
    async with SessionRuntime(adapter, provider, plugins=[retry], meta_tool_names=()) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "answer")
        kinds = [e.type for e in events]
        assert kinds.index("error") < kinds.index("message.complete")
        assert of_type(events, "error")[0].code == "overloaded"
        assert events[-1].outcome == "ok" and events[-1].provider_calls == 2
        rows = await rt.audit.rows(handle.id)
        assert [(r.seq_within_turn, r.outcome.status) for r in rows] == [
            (0, "provider-error"),
            (1, "ok"),
        ]
        # The broken reply is not kept: the transcript is the question and the whole answer.
        messages = await rt.sessions.messages(handle.id)
        assert [m.content for m in messages][1] == [{"type": "text", "text": "Whole."}]
        assert len(messages) == 2 and api.sent[0] == api.sent[1]
    await provider.client.close()


async def test_a_retry_policy_gives_up_after_its_attempts() -> None:
    provider, api = anthropic_provider([broken_stream(), broken_stream(), text_reply("late")])
    retry = Retrying(ExponentialRetry(max_attempts=1, base_delay=0.0, jitter=False))
    async with SessionRuntime(MemoryAdapter(), provider, plugins=[retry], meta_tool_names=()) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "answer")
        assert len(api.sent) == 2
        assert [e.code for e in of_type(events, "error")] == ["overloaded", "overloaded"]
        assert events[-1].outcome == "provider-error"
    await provider.client.close()


def test_exponential_retry_only_retries_retryable_errors() -> None:
    from shared.errors import ProviderError

    policy = ExponentialRetry(max_attempts=3, base_delay=1.0, max_delay=3.0, jitter=False)
    ctx: Any = None
    busy = ProviderError("busy", code="overloaded", retryable=True)
    assert [policy.retry_delay(busy, n, ctx) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, None]
    assert policy.retry_delay(ProviderError("bad", code="invalid_request"), 1, ctx) is None


# -- prompts ------------------------------------------------------------------------------------


async def test_prompts_facet_lists_and_composes_fragments() -> None:
    provider, api = anthropic_provider([text_reply("ok"), text_reply("ok")])
    async with SessionRuntime(
        MemoryAdapter(), provider, system="You are terse.", meta_tool_names=()
    ) as rt:
        prompts = rt.prompts
        assert prompts.list() == ["core.tool_results", "core.approval", "core.flow_control"]
        assert [f.id for f in prompts.list_by_origin("core")] == prompts.list()
        assert prompts.get("core.approval") is not None and prompts.get("nope") is None
        assert prompts.list_by_origin("host") == []
        fragment = prompts.register(PromptFragment(id="host.units", text="Use SI units.", order=5))
        assert prompts.get_all()[0] is fragment
        with pytest.raises(ValueError, match="already registered"):
            prompts.register(PromptFragment(id="host.units", text="again"))
        prompts.register(PromptFragment(id="host.units", text="Use metric.", order=5), replace=True)
        handle = await rt.create_session(model=MODEL)
        await run(rt, handle.id, "how far?")
        system = api.sent[0]["system"]
        # The host's system first, then the fragments in order; approval is not configured.
        assert system.startswith("You are terse.\n\nUse metric.\n\nTool results come from")
        assert "approve" not in system and "flow-control" not in system
        # A session offering no tools gets no tool fragment.
        bare = await rt.create_session(model=MODEL, tools=[])
        await run(rt, bare.id, "hi")
        assert api.sent[1]["system"] == "You are terse.\n\nUse metric."
    await provider.client.close()


async def test_without_core_defaults_no_system_prompt_is_sent() -> None:
    provider, api = anthropic_provider([text_reply("ok")])
    async with SessionRuntime(
        MemoryAdapter(), provider, seed_core_defaults=False, meta_tool_names=()
    ) as rt:
        assert rt.prompts.list() == []
        handle = await rt.create_session(model=MODEL)
        await run(rt, handle.id, "hi")
        assert "system" not in api.sent[0]
    await provider.client.close()


# -- observers and custom events ----------------------------------------------------------------


async def test_observer_router_registers_late_and_unregisters_with_a_receipt() -> None:
    async with SessionRuntime(MemoryAdapter(), meta_tool_names=()) as rt:
        handle = await rt.create_session(provider="scripted")
        seen: list[str] = []
        custom: list[str] = []
        everything = rt.observer_router.register(lambda e: seen.append(e.type))
        only_custom = rt.observer_router.register(lambda e: custom.append(e.type), mode="custom")
        assert {r.id for r in rt.observer_router.list()} == {everything.id, only_custom.id}
        rt.emit_custom(handle.id, "progress", {"done": 1})
        await run(rt, handle.id, "hi")
        assert seen[0] == "custom.progress" and seen[-1] == "turn.complete"
        assert custom == ["custom.progress"]

        receipt = rt.observer_router.unregister(everything)
        assert (receipt.removed, receipt.was_registered) == (True, True)
        again = rt.observer_router.unregister(everything)
        assert (again.removed, again.was_registered) == (False, True)
        unknown = rt.observer_router.unregister("never-given")
        assert (unknown.removed, unknown.was_registered) == (False, False)
        count = len(seen)
        await run(rt, handle.id, "again")
        assert len(seen) == count  # no longer called
        assert rt.observer_router.clear() == 1 and rt.observer_router.list() == []


async def test_custom_events_reach_the_bus_the_filter_and_the_wire() -> None:
    async with SessionRuntime(MemoryAdapter(), meta_tool_names=()) as rt:
        handle = await rt.create_session(provider="scripted")
        on_bus: list[Any] = []
        rt.events.on("custom.progress", on_bus.append)
        delivered: list[str] = []
        rt.subscribe_to_stream("all", lambda e: delivered.append(e.type))
        rt.get_stream_manager().set_event_filter(["custom.*"])
        event = rt.emit_custom(handle.id, "custom.progress", {"pct": 50})
        await run(rt, handle.id, "filtered out")
        assert on_bus == [event] and delivered == ["custom.progress"]
        assert event.type == "custom.progress"
        wire = msgspec.json.decode(msgspec.json.encode(event))
        assert wire == {
            "type": "custom",
            "session_id": handle.id,
            "name": "progress",
            "data": {"pct": 50},
        }
        with pytest.raises(ValueError, match="needs a name"):
            rt.emit_custom(handle.id, "custom.")
