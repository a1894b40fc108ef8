"""Subagents (``rt.tasks``): child sessions with their own model call, tools and budget.

Through the real anthropic SDK (SSE replayed by an httpx MockTransport, routed by the
prompt each conversation starts with): the model's ``subagent`` tool, its result as the
tool result, audit lineage, the parent's rollup and the spans; parallel subagent calls held
mid-stream against the concurrency bound; the abort of a parent with running subagents; the
runtime closing under them. A seeded set of spawn trees checks the bound as a generated
property. Waits are on events and conditions.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import deque
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pleach_client.providers.anthropic import AnthropicProvider
from pleach_client.providers.base import ProviderEvent, ProviderRequest
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_client.tasks import SUBAGENT_TOOL
from pleach_client.turn import ABORTED_TOOL_RESULT
from shared.errors import InvalidInput, InvalidState, ToolError
from tests import sse
from tests.loop import next_tick
from tests.test_interrupts import tool_reply
from tests.test_runtime_anthropic import text_reply

MODEL = sse.MODEL


class RoutedAPI:
    """Answers each request with the next body queued for the conversation's first user
    text (the parent's message or a subagent's prompt); records every request body."""

    def __init__(self, routes: dict[str, list[sse.StreamBody]]) -> None:
        self.routes = {prompt: deque(bodies) for prompt, bodies in routes.items()}
        self.sent: list[dict[str, Any]] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        self.sent.append(body)
        return sse.sse_response(self.routes[first_text(body)].popleft(), request_id="req_x")

    def to(self, prompt: str) -> list[dict[str, Any]]:
        return [b for b in self.sent if first_text(b) == prompt]


def first_text(body: dict[str, Any]) -> str:
    content = body["messages"][0]["content"]
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


def routed(routes: dict[str, list[sse.StreamBody]]) -> tuple[AnthropicProvider, RoutedAPI]:
    api = RoutedAPI(routes)
    client = anthropic.AsyncAnthropic(
        api_key="test",
        base_url="http://test",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api.handler)),
    )
    return AnthropicProvider(client), api


def said(text: str, *, input_tokens: int = 30, output_tokens: int = 10) -> sse.StreamBody:
    """A text reply streamed a word at a time (spaces kept)."""
    words = re.findall(r"\S+\s*", text)
    return sse.StreamBody(
        sse.text_stream(words, input_tokens=input_tokens, output_tokens=output_tokens)
    )


def subagent_call(tool_id: str, prompt: str, title: str = "") -> tuple[str, str, str]:
    return (tool_id, "subagent", json.dumps({"prompt": prompt, "title": title}))


def held(text: str, *, input_tokens: int = 50) -> sse.StreamBody:
    """A reply that stops after its first text delta until released."""
    return sse.StreamBody(
        sse.text_stream(re.findall(r"\S+\s*", text), input_tokens=input_tokens, output_tokens=20),
        hold_after=4,
    )


def collect(rt: SessionRuntime, mode: str = "updates") -> list[StreamEventBase]:
    seen: list[StreamEventBase] = []
    rt.subscribe_to_stream(mode, seen.append)  # type: ignore[arg-type]
    return seen


async def drain(stream: Any) -> list[Any]:
    return [e async for e in stream]


async def test_the_model_hands_a_task_to_a_subagent_through_the_sdk(
    adapter: StorageAdapter,
) -> None:
    provider, api = routed(
        {
            "plan a trip to Lisbon": [
                tool_reply(subagent_call("toolu_s", "find flights to Lisbon", "flights")),
                text_reply("Flights are found."),
            ],
            "find flights to Lisbon": [
                said("TAP at 10:05 for 120 EUR", input_tokens=50, output_tokens=20)
            ],
        }
    )
    spans = InMemorySpanExporter()
    async with SessionRuntime(
        adapter, provider, tools=[SUBAGENT_TOOL], span_exporter=spans, meta_tool_names=()
    ) as rt:
        assert rt.get_subagent_manager() is None  # concurrency is off
        seen = collect(rt)
        parent = await rt.create_session(model=MODEL)
        events = await drain(rt.execute_message(parent.id, "plan a trip to Lisbon"))
        done = events[-1]
        assert done.outcome == "ok" and done.provider_calls == 2
        # The subagent's answer is the tool result the parent's model reads.
        [result] = api.to("plan a trip to Lisbon")[1]["messages"][2]["content"]
        assert (result["tool_use_id"], result["content"]) == ("toolu_s", "TAP at 10:05 for 120 EUR")
        [child_request] = api.to("find flights to Lisbon")
        assert child_request["model"] == MODEL
        assert [t["name"] for t in child_request["tools"]] == ["calculator"]  # no deeper
        [run] = await rt.tasks.subagents.list(parent.id)
        assert (run.status, run.outcome, run.depth, run.title) == ("ended", "ok", 1, "flights")
        assert run.parent_turn_id == done.turn_id and run.input_tokens == 50
        child = await rt.sessions.find(run.subagent_id)
        assert child is not None and child.title == "subagent: flights"
        assert child.tools == ["calculator"] and child.model == MODEL
        created = (await rt.store.list_events(child.id))[0]
        assert created.payload["parent_session_id"] == parent.id
        assert created.payload["parent_turn_id"] == done.turn_id
        assert created.payload["subagent_depth"] == 1
        # Audit lineage, and the parent's rollup includes what its subagent spent.
        [child_row] = await rt.audit.rows(child.id)
        assert (child_row.parent_turn_id, child_row.subagent_depth) == (done.turn_id, 1)
        assert child_row.usage.input_tokens == 50 and child_row.cost_usd
        own = await rt.audit.rows(parent.id)
        assert [r.subagent_depth for r in own] == [0, 0]
        rollup = await rt.audit.rollup(parent.id)
        assert rollup.calls == 3 and rollup.subagent_calls == 1
        assert rollup.input_tokens == sum(r.usage.input_tokens for r in [*own, child_row])
        assert rollup.cost_usd == pytest.approx(sum(r.cost_usd or 0 for r in [*own, child_row]))
        assert rollup.subagent_cost_usd == pytest.approx(child_row.cost_usd)
        [turn] = rollup.turns
        assert turn.turn_id == done.turn_id and turn.calls == 3 and turn.subagent_calls == 1
        kinds = [e.type for e in seen if e.type.startswith("subagent.")]
        assert kinds == ["subagent.started", "subagent.completed"]
        assert all(e.session_id == parent.id for e in seen if e.type.startswith("subagent."))
        assert (await rt.events.verify_chain(parent.id)).ok
        assert (await rt.events.verify_chain(child.id)).ok
    # One pleach.subagent span, a child of the parent's turn, with the child's turn under it.
    finished = spans.get_finished_spans()
    [sub] = [s for s in finished if s.name == "pleach.subagent"]
    turns = {s.attributes["pleach.session_id"]: s for s in finished if s.name == "pleach.turn"}
    assert sub.parent is not None and sub.parent.span_id == turns[parent.id].context.span_id
    child_turn = turns[run.subagent_id]
    assert child_turn.parent is not None and child_turn.parent.span_id == sub.context.span_id
    assert sub.attributes["pleach.subagent_depth"] == 1
    assert sub.attributes["pleach.outcome"] == "ok"
    assert child_turn.attributes["pleach.subagent_depth"] == 1
    assert rt.spans.in_flight_count() == 0
    await provider.client.close()


async def test_parallel_subagent_calls_run_at_once_up_to_the_bound(tmp_path: Path) -> None:
    bodies = {p: held(f"answer {p}") for p in ("alpha", "beta", "gamma")}
    provider, api = routed(
        {
            "research three things": [
                tool_reply(*(subagent_call(f"toolu_{p}", p) for p in bodies)),
                text_reply("All three are in."),
            ],
            **{p: [body] for p, body in bodies.items()},
        }
    )
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "device.db"),
        provider,
        tools=[SUBAGENT_TOOL],
        enable_subagent_concurrency=True,
        max_concurrent_subagents=2,
        meta_tool_names=(),
    ) as rt:
        manager = rt.get_subagent_manager()
        assert manager is rt.tasks.subagents and manager is not None
        parent = await rt.create_session(model=MODEL)
        started = asyncio.Event()
        runs_seen: list[Any] = []

        def on_started(event: StreamEventBase) -> None:
            runs_seen.append(event)
            if len(runs_seen) == 3:
                started.set()

        rt.events.on("subagent.started", on_started)
        turn = asyncio.create_task(drain(rt.execute_message(parent.id, "research three things")))
        holds = {p: asyncio.ensure_future(b.reached_hold.wait()) for p, b in bodies.items()}
        await asyncio.wait_for(started.wait(), 20)  # all three subagents exist
        while sum(h.done() for h in holds.values()) < 2:
            await asyncio.wait(
                [h for h in holds.values() if not h.done()], return_when=asyncio.FIRST_COMPLETED
            )
        # Two subagents are mid-reply; the third waits for a slot and has called nothing.
        assert manager.running() == 2 and manager.waiting() == 1
        assert len(api.sent) == 3  # the parent's call and two subagents'
        running = [p for p, h in holds.items() if h.done()]
        [queued] = [p for p in bodies if p not in running]
        bodies[running[0]].release.set()
        await asyncio.wait_for(holds[queued], 20)  # a slot freed: the third starts
        assert manager.running() == 2 and manager.peak == 2
        for body in bodies.values():
            body.release.set()
        events = await asyncio.wait_for(turn, 20)
        assert events[-1].outcome == "ok"
        results = api.to("research three things")[1]["messages"][2]["content"]
        assert [(r["tool_use_id"], r["content"]) for r in results] == [
            (f"toolu_{p}", f"answer {p}") for p in bodies
        ]
        assert manager.running() == 0 and manager.waiting() == 0
        runs = await manager.list(parent.id)
        assert len(runs) == 3 and all(r.outcome == "ok" for r in runs)
    for task in holds.values():
        task.cancel()
    await provider.client.close()


@pytest.mark.parametrize("how", ["abort-event", "cancel-task"])
async def test_aborting_the_parent_aborts_its_subagents(adapter: StorageAdapter, how: str) -> None:
    bodies = {p: held(f"slow answer {p}", input_tokens=70) for p in ("north", "south")}
    provider, api = routed(
        {
            "survey both coasts": [
                tool_reply(*(subagent_call(f"toolu_{p}", p) for p in bodies)),
                text_reply("Starting over."),
            ],
            **{p: [body] for p, body in bodies.items()},
        }
    )
    async with SessionRuntime(
        adapter,
        provider,
        tools=[SUBAGENT_TOOL],
        enable_subagent_concurrency=True,
        meta_tool_names=(),
    ) as rt:
        parent = await rt.create_session(model=MODEL)
        abort = asyncio.Event()
        seen: list[Any] = []

        async def consume() -> None:
            async for event in rt.execute_message(
                parent.id, "survey both coasts", abort=abort if how == "abort-event" else None
            ):
                seen.append(event)

        turn = asyncio.create_task(consume())
        for body in bodies.values():
            await asyncio.wait_for(body.reached_hold.wait(), 20)
        if how == "abort-event":
            abort.set()
            await asyncio.wait_for(turn, 20)
            assert seen[-1].outcome == "user-aborted"
        else:
            turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn
        assert all(body.closed for body in bodies.values()), "the subagents' streams closed"
        assert rt.tasks.subagents.running() == 0
        turn_id = next(e.turn_id for e in seen if e.type == "message.added")
        runs = await rt.tasks.subagents.list(parent.id)
        assert len(runs) == 2 and {r.outcome for r in runs} == {"user-aborted"}
        for run in runs:
            [row] = await rt.audit.rows(run.subagent_id)
            assert row.outcome.status == "user-aborted" and row.usage.input_tokens == 70
            assert row.usage.output_estimated and row.usage.output_tokens >= 1
            assert (row.parent_turn_id, row.subagent_depth) == (turn_id, 1)
        rollup = await rt.audit.rollup(parent.id)
        assert rollup.subagent_calls == 2 and rollup.outcomes.get("user-aborted", 0) >= 2
        [turn_rollup] = rollup.turns
        assert turn_rollup.turn_id == turn_id and turn_rollup.subagent_calls == 2
        # The parent's next request is one the API accepts: every subagent call is answered.
        await drain(rt.execute_message(parent.id, "survey both coasts"))
        request = api.to("survey both coasts")[-1]
        results = [
            b for m in request["messages"] for b in m["content"] if b["type"] == "tool_result"
        ]
        assert {r["tool_use_id"] for r in results} == {f"toolu_{p}" for p in bodies}
        assert all(r["content"] == ABORTED_TOOL_RESULT and r["is_error"] for r in results)
    await provider.client.close()


class NoSecrets:
    """A plugin whose tool middleware refuses subagent calls that mention secrets."""

    name = "no-secrets"

    async def wrap_tool_call(self, ctx: Any, call: Any, call_next: Any) -> Any:
        if "secret" in str(call.input.get("prompt", "")):
            raise ToolError("no subagent may look for secrets")
        return await call_next(call)


async def test_a_call_that_middleware_checks_is_not_started_ahead(adapter: StorageAdapter) -> None:
    provider, api = routed(
        {
            "two tasks": [
                tool_reply(
                    subagent_call("toolu_a", "count the files"),
                    subagent_call("toolu_b", "find the secret keys"),
                ),
                text_reply("One done."),
            ],
            "count the files": [said("12 files")],
        }
    )
    async with SessionRuntime(
        adapter,
        provider,
        tools=[SUBAGENT_TOOL],
        plugins=[NoSecrets()],
        enable_subagent_concurrency=True,
        meta_tool_names=(),
    ) as rt:
        parent = await rt.create_session(model=MODEL)
        events = await drain(rt.execute_message(parent.id, "two tasks"))
        assert api.to("find the secret keys") == []  # refused before any model call
        results = api.to("two tasks")[1]["messages"][2]["content"]
        assert results[0]["content"] == "12 files"
        assert results[1]["is_error"] and "secrets" in results[1]["content"]
        assert len(await rt.tasks.subagents.list(parent.id)) == 1
        assert events[-1].outcome == "tool-error"
    await provider.client.close()


async def test_closing_the_runtime_aborts_running_subagents(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    body = held("never finished")
    provider, _ = routed({"dig": [body]})
    rt = SessionRuntime(SQLiteAdapter(db), provider, meta_tool_names=())
    await rt.open()
    parent = await rt.create_session(model=MODEL)
    spawn = asyncio.create_task(rt.tasks.spawn("dig", session_id=parent.id, title="digging"))
    await asyncio.wait_for(body.reached_hold.wait(), 20)
    await rt.close()
    result = await spawn
    assert result.outcome == "user-aborted" and result.parent_turn_id is None
    assert result.depth == 1 and result.input_tokens == 50 and body.closed
    async with SessionRuntime(SQLiteAdapter(db), provider, meta_tool_names=()) as again:
        [row] = await again.audit.rows(result.subagent_id)
        assert row.outcome.status == "user-aborted" and row.subagent_depth == 1
        [run] = await again.tasks.subagents.list(parent.id)
        assert run.status == "ended" and run.outcome == "user-aborted"
        assert (await again.audit.rollup(parent.id)).subagent_calls == 1
    await provider.client.close()


# -- the bound, as a generated property ----------------------------------------------------------


class CountingProvider(ScriptedProvider):
    """Scripted replies by prompt: ``nest N`` calls the subagent tool N times (in one reply),
    then answers; anything else answers at once. Counts the subagent streams open at once
    (the parent turn's, on prompt ``go``, is not one)."""

    def __init__(self) -> None:
        super().__init__(default_reply=self.reply)
        self.active = 0
        self.peak = 0

    def reply(self, request: ProviderRequest) -> ScriptedReply:
        prompt = first_text(msgspec_builtins(request))
        last = request.messages[-1]["content"]
        answered = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
        if prompt.startswith("nest ") and not answered:
            count = int(prompt.split()[1])
            return ScriptedReply(tool_calls=[("subagent", {"prompt": "leaf"})] * count)
        if prompt == "go" and not answered:
            return ScriptedReply(tool_calls=[("subagent", {"prompt": "leaf"})] * 3)
        return ScriptedReply(text=f"done: {prompt}")

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        mine = first_text(msgspec_builtins(request)) != "go"
        if mine:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            for _ in range(20):  # every other task that can start does so now
                await next_tick()
            async for event in super().stream(request):
                yield event
        finally:
            if mine:
                self.active -= 1


def msgspec_builtins(request: ProviderRequest) -> dict[str, Any]:
    return {"messages": request.messages}


@pytest.mark.parametrize("seed", range(24))
async def test_generated_spawns_never_exceed_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    concurrency = rng.random() < 0.75
    bound = rng.randint(1, 4)
    prompts = [rng.choice(["leaf", "nest 1", "nest 2", "nest 3"]) for _ in range(rng.randint(1, 7))]
    provider = CountingProvider()
    async with SessionRuntime(
        MemoryAdapter(),
        provider,
        tools=[SUBAGENT_TOOL],
        enable_subagent_concurrency=concurrency,
        max_concurrent_subagents=bound,
        max_subagent_depth=2,
        meta_tool_names=(),
    ) as rt:
        parent = await rt.create_session()
        turn = asyncio.create_task(drain(rt.execute_message(parent.id, "go")))
        results = await asyncio.gather(*(rt.tasks.spawn(p, session_id=parent.id) for p in prompts))
        events = await turn
        limit = bound if concurrency else 1
        assert provider.peak <= limit, (seed, concurrency, bound, prompts)
        assert rt.tasks.subagents.peak <= limit
        assert rt.tasks.subagents.running() == 0 and rt.tasks.subagents.waiting() == 0
        assert events[-1].outcome == "ok"
        assert all(r.outcome == "ok" and r.depth == 1 for r in results)
        assert [r.text for r in results] == [f"done: {p}" for p in prompts]
        # Every subagent ran, each accounted under its parent: the host's (no turn) or a turn.
        nested = sum(int(p.split()[1]) for p in prompts if p.startswith("nest"))
        runs = await rt.tasks.subagents.list(parent.id)
        assert len(runs) == len(prompts) + 3
        rows = [r for run in runs for r in await rt.audit.rows(run.subagent_id)]
        grand = [r for r in await rt.audit.rows() if r.subagent_depth == 2]
        assert len(grand) == nested and all(r.parent_turn_id for r in grand)
        child_turns = {r.turn_id for r in rows}
        assert {r.parent_turn_id for r in grand} <= child_turns
        rollup = await rt.audit.rollup(parent.id)
        assert rollup.subagent_calls == len(rows) + len(grand)
        if concurrency and bound > 1 and len(prompts) + 3 > 1:
            assert provider.peak > 1, "with concurrency, subagents did run at once"


# -- the surface ---------------------------------------------------------------------------------


async def test_spawn_from_the_host_and_what_it_refuses() -> None:
    provider = CountingProvider()
    async with SessionRuntime(
        MemoryAdapter(), provider, tools=[SUBAGENT_TOOL], meta_tool_names=()
    ) as rt:
        parent = await rt.create_session()
        assert rt.get_async_task_manager() is rt.tasks
        result = await rt.tasks.spawn(
            "leaf", session_id=parent.id, tools=[], max_tool_iterations=1, system="Be brief."
        )
        assert result.outcome == "ok" and result.text == "done: leaf"
        assert result.parent_turn_id is None and result.depth == 1
        assert provider.requests[-1].system is not None
        assert provider.requests[-1].system.endswith("Be brief.")
        assert provider.requests[-1].tools == []
        # At max_subagent_depth (1) a subagent is not offered the subagent tool; when its
        # model calls it anyway, the call fails like any tool it does not have.
        nested = await rt.tasks.spawn("nest 1", session_id=parent.id)
        assert nested.outcome == "tool-error" and nested.text == "done: nest 1"
        child = await rt.sessions.find(nested.subagent_id)
        assert child is not None and "subagent" not in child.tools
        failed = [
            e for e in await rt.store.list_events(nested.subagent_id) if e.type == "tool.failed"
        ]
        assert len(failed) == 1 and failed[0].payload["name"] == "subagent"
        with pytest.raises(InvalidInput, match="parent session_id"):
            await rt.tasks.spawn("leaf")
        with pytest.raises(InvalidInput, match="no registered tool"):
            await rt.tasks.spawn("leaf", session_id=parent.id, tools=["no-such-tool"])
        with pytest.raises(InvalidInput, match="max_tokens"):
            await rt.tasks.spawn("leaf", session_id=parent.id, max_tokens=0)
    with pytest.raises(InvalidInput, match="max_concurrent_subagents"):
        SessionRuntime(MemoryAdapter(), max_concurrent_subagents=0, meta_tool_names=())
    with pytest.raises(InvalidInput, match="max_subagent_depth"):
        SessionRuntime(MemoryAdapter(), max_subagent_depth=0, meta_tool_names=())
    with pytest.raises(InvalidState, match="closing"):
        await rt.tasks.spawn("leaf", session_id=parent.id)
