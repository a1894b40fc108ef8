"""Human in the loop: tool calls that wait for a person's decision, on any device.

Layers: the pure decision rules (``pleach_client.interrupts``) with a Hypothesis model of
devices deciding in any interleaving; turns through the real anthropic SDK (SSE replayed by an
httpx MockTransport); a restart and a SIGKILL while a turn waits, on a real SQLite file; and
devices with a real server on a loopback port. Waits are on events and conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.interrupts import (
    DECIDED,
    REQUESTED,
    RESOLVED,
    ApprovalDecision,
    Approve,
    Edit,
    Interrupt,
    InterruptConfig,
    Reject,
    ToolCall,
    interrupt_states,
    plan_resolve,
    plan_settle,
)
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.receipts import InterruptResolveReceipt
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import InterruptRequested, StreamEventBase
from pleach_client.tools import Tool
from pleach_client.turn import ABORTED_TOOL_RESULT
from shared.errors import InvalidInput, InvalidState, NotFound
from shared.ids import uuid7
from shared.records import Event
from tests import sse
from tests.factories import log_event
from tests.test_runtime_anthropic import anthropic_provider, text_reply
from tests.test_sync_e2e import ALICE, Cluster

ROOT = Path(__file__).resolve().parent.parent
MODEL = sse.MODEL


# -- the pure rules ------------------------------------------------------------------------------


def _request(config: InterruptConfig | None = None, *, by: str = "asker") -> Event:
    config = config or InterruptConfig(tools=["deploy"])
    call = ToolCall(id="toolu_1", name="deploy", input={"target": "prod"})
    return log_event(by, REQUESTED, config.request_payload("turn-1", call, now_ms=1_000))


def _decided(client: str, interrupt_id: str, decision: ApprovalDecision) -> Event:
    payload = {"interrupt_id": interrupt_id, "decision": msgspec.to_builtins(decision)}
    return log_event(client, DECIDED, payload)


def test_first_decision_wins_and_the_resolution_is_final() -> None:
    request = _request()
    b = _decided("phone", request.id, Approve())
    c = _decided("tablet", request.id, Reject(reason="not now"))
    state = interrupt_states([request, b, c])[request.id]
    assert state.status == "decided" and state.decided_by == "phone"
    assert isinstance(state.decision, Approve) and state.overruled == [c.id]
    # The asking device adopts the proposal in force; that is final.
    adopt = plan_settle(state, now_ms=0, abort=False, by="asker")
    assert adopt is not None and adopt["decided_by"] == "phone"
    resolved = log_event("asker", RESOLVED, adopt)
    late = _decided("laptop2", request.id, Edit(input={"target": "staging"}))
    # A second resolution (two processes on one file, a buggy peer) does not count either.
    twice = log_event("asker", RESOLVED, plan_settle(state, now_ms=0, abort=True, by="asker") or {})
    final = interrupt_states([request, b, c, resolved, late, twice])[request.id]
    assert final.final and final.decision_event_id == b.id
    assert final.resolution_event_id == resolved.id and final.source == "user"
    assert final.overruled == [c.id, late.id, twice.id]


def test_malformed_or_disallowed_decisions_are_refused_alone() -> None:
    request = _request(InterruptConfig(tools=["deploy"], decisions=("approve", "reject")))
    junk = log_event("phone", DECIDED, {"interrupt_id": request.id, "decision": {"kind": "maybe"}})
    edit = _decided("phone", request.id, Edit(input={"target": "x"}))  # not allowed here
    long = log_event(
        "phone",
        DECIDED,
        {"interrupt_id": request.id, "decision": {"kind": "reject", "reason": "x" * 5_000}},
    )
    unknown = _decided("phone", "no-such-interrupt", Approve())
    reject = _decided("tablet", request.id, Reject(reason="no"))
    bad_request = log_event("asker", REQUESTED, {"turn_id": 3})
    states = interrupt_states([bad_request, request, junk, edit, long, unknown, reject])
    assert list(states) == [request.id]
    state = states[request.id]
    assert state.decided_by == "tablet" and state.decision == Reject(reason="no")


def test_plan_resolve_by_role() -> None:
    request = _request(InterruptConfig(tools=["deploy"], decisions=("approve", "reject")))
    pending = interrupt_states([request])[request.id]
    with pytest.raises(InvalidInput, match="not 'edit'"):
        plan_resolve(pending, Edit(input={}), by="asker", asker=True)
    here = plan_resolve(pending, Approve(), by="asker", asker=True)
    assert (here.write, here.accepted, here.final) == (RESOLVED, True, True)
    there = plan_resolve(pending, Approve(), by="phone", asker=False)
    assert (there.write, there.accepted, there.final) == (DECIDED, True, False)
    decided = interrupt_states([request, _decided("phone", request.id, Approve())])[request.id]
    late = plan_resolve(decided, Reject(), by="tablet", asker=False)
    assert (late.write, late.accepted, late.final, late.decided_by) == (None, False, False, "phone")
    adopted = plan_resolve(decided, Reject(), by="asker", asker=True)
    assert (adopted.write, adopted.accepted, adopted.final) == (RESOLVED, False, True)
    assert adopted.decided_by == "phone" and isinstance(adopted.decision, Approve)


def test_deadline_default_and_abort() -> None:
    config = InterruptConfig(tools=["deploy"], timeout=5, default=Approve())
    request = _request(config)
    state = interrupt_states([request])[request.id]
    assert state.deadline_ms == 6_000 and state.default == Approve()
    assert plan_settle(state, now_ms=5_999, abort=False, by="asker") is None
    fired = plan_settle(state, now_ms=6_000, abort=False, by="asker")
    assert (
        fired is not None
        and fired["source"] == "timeout"
        and fired["decision"] == {"kind": "approve"}
    )
    aborted = plan_settle(state, now_ms=0, abort=True, by="asker")
    assert aborted is not None and aborted["source"] == "abort"
    done = interrupt_states([request, log_event("asker", RESOLVED, fired)])[request.id]
    assert plan_settle(done, now_ms=10**9, abort=True, by="asker") is None


def test_config_is_validated_and_a_failing_predicate_asks() -> None:
    with pytest.raises(InvalidInput):
        InterruptConfig(decisions=())
    with pytest.raises(InvalidInput):
        InterruptConfig(decisions=("approve", "shrug"))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        InterruptConfig(timeout=0)
    with pytest.raises(InvalidInput):
        InterruptConfig(tools="deploy")

    def broken(name: str, tool_input: Any) -> bool:
        raise RuntimeError("bug")

    assert InterruptConfig(when=broken).needs_approval("x", {})
    assert not InterruptConfig(tools=["x"], enabled=False).needs_approval("x", {})


# -- a model of devices and a server, for any interleaving ---------------------------------------

ASKER = "dev0"
DEVICES = ("dev0", "dev1", "dev2")
KINDS: dict[str, ApprovalDecision] = {
    "approve": Approve(),
    "reject": Reject(reason="no"),
    "edit": Edit(input={"target": "staging"}),
}


class Model:
    """Devices that hold a canonical prefix of the server's log plus their own unsent events,
    deciding with ``plan_resolve``; the asking device's turn applies with ``plan_settle``."""

    def __init__(self, timeout: bool, synced: bool = False) -> None:
        config = InterruptConfig(tools=["deploy"], timeout=60 if timeout else None)
        request = _request(config, by=ASKER)
        self.interrupt_id = request.id
        self.server: list[Event] = [request]
        self.seen = {d: (1 if d == ASKER or synced else 0) for d in DEVICES}
        self.own: dict[str, list[Event]] = {d: [] for d in DEVICES}
        self.sent = dict.fromkeys(DEVICES, 0)
        self.now = 0
        self.ran: tuple[Any, ...] | None = None
        self.receipts: list[tuple[str, Any, str | None]] = []

    def view(self, device: str) -> list[Event]:
        prefix = self.server[: self.seen[device]]
        placed = {e.id for e in prefix}
        return prefix + [e for e in self.own[device] if e.id not in placed]

    def state(self, device: str) -> Interrupt | None:
        return interrupt_states(self.view(device)).get(self.interrupt_id)

    def decide(self, device: str, kind: str) -> None:
        state = self.state(device)
        if state is None:
            assert device != ASKER
            return  # NotFound: this device has not seen the request
        plan = plan_resolve(state, KINDS[kind], by=device, asker=device == ASKER)
        written = None
        if plan.write is not None:
            assert plan.payload is not None
            if plan.write == RESOLVED:
                self.first_wins(state, plan.payload)
            event = log_event(device, plan.write, plan.payload)
            self.own[device].append(event)
            written = event.id
        self.receipts.append((device, plan, written))

    @staticmethod
    def first_wins(before: Interrupt, payload: dict[str, Any]) -> None:
        """The asking device applies the first decision it holds (an abort overrides it)."""
        if before.status == "decided" and payload["source"] != "abort":
            assert payload["decision_event_id"] == before.decision_event_id
            assert payload["decided_by"] == before.decided_by

    def push(self, device: str) -> None:
        self.server.extend(self.own[device][self.sent[device] :])
        self.sent[device] = len(self.own[device])

    def pull(self, device: str) -> None:
        self.seen[device] = len(self.server)

    def wake(self, *, abort: bool = False) -> None:
        """The asking device's turn looks at its log (and runs the tool once it is final)."""
        if self.ran is not None:
            return
        state = self.state(ASKER)
        assert state is not None
        payload = plan_settle(state, now_ms=self.now, abort=abort, by=ASKER)
        if payload is not None:
            self.first_wins(state, payload)
            self.own[ASKER].append(log_event(ASKER, RESOLVED, payload))
        state = self.state(ASKER)
        assert state is not None
        if state.final:
            self.ran = (state.decision, state.decided_by, state.source, state.decision_event_id)


_DECIDE = st.tuples(st.just("decide"), st.sampled_from(DEVICES), st.sampled_from(sorted(KINDS)))
_PUSH = st.tuples(st.just("push"), st.sampled_from(DEVICES))
_PULL = st.tuples(st.just("pull"), st.sampled_from(DEVICES))
OPS = st.one_of(_DECIDE, _PUSH, _PULL, st.tuples(st.just("wake")))
# At most one timeout or abort (either ends the wait), at any point of the schedule.
ENDING = st.one_of(st.none(), st.tuples(st.sampled_from(["timeout", "abort"]), st.integers(0, 40)))


@settings(max_examples=500, deadline=None)
@given(
    timeout=st.booleans(),
    synced=st.booleans(),
    ops=st.lists(OPS, max_size=40),
    ending=ENDING,
)
def test_devices_deciding_in_any_order_converge_on_what_ran(
    timeout: bool, synced: bool, ops: list[tuple[str, ...]], ending: tuple[str, int] | None
) -> None:
    """Three devices (``dev0`` asks) decide, push, pull and wake in any order; a timeout or
    an abort may come anywhere. After everything syncs, all agree, what they agree on is
    what ran, the first proposal wins, and no receipt that said final was wrong."""
    if ending is not None:
        ops = [*ops[: ending[1]], (ending[0],), *ops[ending[1] :]]
    model = Model(timeout, synced)
    for op in ops:
        match op:
            case ("decide", device, kind):
                model.decide(device, kind)
            case ("push", device):
                model.push(device)
            case ("pull", device):
                model.pull(device)
            case ("wake",):
                model.wake()
            case ("timeout",):
                model.now = 10**12
                model.wake()
            case ("abort",):
                model.wake(abort=True)
    for device in DEVICES:
        model.push(device)
    for device in DEVICES:
        model.pull(device)
    model.wake()  # the turn sees what synced
    model.push(ASKER)
    for device in DEVICES:
        model.pull(device)

    states = [model.state(d) for d in DEVICES]
    assert states[0] == states[1] == states[2], "every device derives the same answer"
    final = states[0]
    assert final is not None
    resolutions = [e for e in model.server if e.type == RESOLVED]
    assert len(resolutions) <= 1, "the asking device applies a decision once"
    accepted = any(plan.accepted for _, plan, _ in model.receipts)
    if accepted or (timeout and model.now):
        assert model.ran is not None, "a decision that came is applied"
    if model.ran is not None:
        assert final.final
        ran = (final.decision, final.decided_by, final.source, final.decision_event_id)
        assert ran == model.ran, "what every device sees is what ran"
        proposals = [e for e in model.server if e.type == DECIDED]
        if final.source == "user" and final.decided_by != ASKER:
            assert final.decision_event_id == proposals[0].id, "the first proposal wins"
        losers = {e.id for e in proposals} - {final.decision_event_id}
        assert losers <= set(final.overruled)
    for device, plan, written in model.receipts:
        if plan.final:
            assert (plan.decision, plan.decided_by, plan.source) == (
                final.decision,
                final.decided_by,
                final.source,
            ), f"a final receipt never changes ({device})"
        if plan.accepted and plan.final:
            assert final.decision_event_id == written
        if not plan.accepted:
            assert written is None or final.decision_event_id != written


# -- turns through the real SDK ------------------------------------------------------------------


class Deploy:
    """A tool with a side effect worth approving; it records every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, tool_input: dict[str, Any]) -> str:
        self.calls.append(dict(tool_input))
        return f"deployed to {tool_input.get('target')}"

    def tool(self) -> Tool:
        schema = {"type": "object", "properties": {"target": {"type": "string"}}}
        return Tool("deploy", "Deploy the build to a target", schema, self)


def tool_reply(*calls: tuple[str, str, str], input_tokens: int = 400) -> sse.StreamBody:
    """A reply that says a word, then calls tools: ``(tool_use_id, name, input JSON)``."""
    chunks = [
        sse.message_start(input_tokens=input_tokens),
        sse.text_start(0),
        sse.text_delta(0, "On it."),
        sse.block_stop(0),
    ]
    for i, (tool_id, name, input_json) in enumerate(calls, start=1):
        chunks += [
            sse.tool_use_start(i, tool_id, name),
            sse.input_json_delta(i, input_json),
            sse.block_stop(i),
        ]
    chunks += [sse.message_delta(stop_reason="tool_use", output_tokens=40), sse.message_stop()]
    return sse.StreamBody(chunks)


def needs_deploy(**kw: Any) -> InterruptConfig:
    return InterruptConfig(tools=["deploy"], **kw)


async def test_approval_waits_then_runs_the_call_through_the_sdk(
    adapter: StorageAdapter,
) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [
            tool_reply(
                ("toolu_c", "calculator", '{"expression": "2+2"}'),
                ("toolu_d", "deploy", '{"target": "prod"}'),
            ),
            text_reply("Deployed."),
        ]
    )
    async with SessionRuntime(
        adapter, provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as rt:
        with pytest.deprecated_call():  # the flat getter points at rt.interrupts
            assert rt.get_interrupt_manager() is rt.interrupts
        handle = await rt.create_session(model=MODEL)
        events: list[StreamEventBase] = []
        receipt: InterruptResolveReceipt | None = None
        async for event in rt.execute_message(handle.id, "ship it"):
            events.append(event)
            if isinstance(event, InterruptRequested):
                assert event.name == "deploy" and event.input == {"target": "prod"}
                # Nothing of the reply ran yet, and what the turn did so far is committed.
                assert deploy.calls == [] and "tool.started" not in [e.type for e in events]
                row = await rt.store.get_session(handle.id)
                assert row is not None and len(row.state.message_ids) == 2
                assert row.state.pending_tool_calls == [
                    {"id": "toolu_d", "name": "deploy", "interrupt_id": event.interrupt_id}
                ]
                [accounted] = await rt.audit.rows(handle.id)
                assert accounted.usage.input_tokens == 400 and accounted.outcome.status == "ok"
                assert [i.id for i in await rt.interrupts.list()] == [event.interrupt_id]
                receipt = await rt.interrupts.resolve(event.interrupt_id, Approve())
        kinds = [e.type for e in events]
        assert kinds.count("interrupt.requested") == 1
        assert kinds.index("message.complete") < kinds.index("interrupt.requested")
        assert kinds.index("interrupt.requested") < kinds.index("interrupt.resolved")
        assert kinds.index("interrupt.resolved") < kinds.index("tool.started")
        assert kinds[-1] == "turn.complete" and events[-1].outcome == "ok"  # type: ignore[attr-defined]
        assert events[-1].input_tokens == 430 and events[-1].provider_calls == 2  # type: ignore[attr-defined]
        assert receipt is not None and receipt.accepted and receipt.final
        assert receipt.decided_by == rt.client_id and receipt.source == "user"
        assert deploy.calls == [{"target": "prod"}]
        second = api.sent[1]["messages"][2]["content"]
        assert [(b["tool_use_id"], b["content"]) for b in second] == [
            ("toolu_c", "4"),
            ("toolu_d", "deployed to prod"),
        ]
        assert await rt.interrupts.list() == []
        row = await rt.store.get_session(handle.id)
        assert row is not None and row.state.pending_tool_calls == []
        assert len(await rt.checkpoints.list(handle.id)) == 1
        assert (await rt.events.verify_chain(handle.id)).ok
        [settled] = (await rt.resume_session(handle.id)).hydrated["interrupts"]
        assert settled["status"] == "resolved" and settled["decision"] == {"kind": "approve"}
        again = await rt.resolve_interrupt(settled["id"], Reject(reason="too late"))
        assert not again.accepted and again.final and again.event_id is None
        assert again.decision == Approve()
    await provider.client.close()


async def test_rejection_tells_the_model_why_and_runs_nothing(adapter: StorageAdapter) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Understood.")]
    )
    async with SessionRuntime(
        adapter, provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = []
        async for event in rt.execute_message(handle.id, "ship it"):
            events.append(event)
            if isinstance(event, InterruptRequested):
                await rt.interrupts.resolve(event.interrupt_id, Reject(reason="freeze week"))
        assert deploy.calls == []
        assert events[-1].outcome == "ok"
        resolved = next(e for e in events if e.type == "interrupt.resolved")
        assert resolved.decision == Reject(reason="freeze week")  # type: ignore[attr-defined]
        assert "tool.started" not in [e.type for e in events]
        [result] = api.sent[1]["messages"][2]["content"]
        assert result["tool_use_id"] == "toolu_d" and result["is_error"] is True
        assert "rejected" in result["content"] and "freeze week" in result["content"]
    await provider.client.close()


async def test_edit_runs_the_call_with_the_edited_input(adapter: StorageAdapter) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Staged.")]
    )
    config = needs_deploy(decisions=("approve", "edit"))
    async with SessionRuntime(adapter, provider, tools=[deploy.tool()], interrupt=config) as rt:
        handle = await rt.create_session(model=MODEL)
        events = []
        async for event in rt.execute_message(handle.id, "ship it"):
            events.append(event)
            if isinstance(event, InterruptRequested):
                with pytest.raises(InvalidInput, match="not 'reject'"):
                    await rt.interrupts.resolve(event.interrupt_id, Reject())
                receipt = await rt.interrupts.resolve(
                    event.interrupt_id, {"kind": "edit", "input": {"target": "staging"}}
                )
                assert receipt.accepted and receipt.decision == Edit(input={"target": "staging"})
        assert deploy.calls == [{"target": "staging"}]
        started = next(e for e in events if e.type == "tool.started")
        assert started.input == {"target": "staging"}  # type: ignore[attr-defined]
        result = api.sent[1]["messages"][2]["content"][0]
        assert result["content"] == "deployed to staging"
        # The model's own call stays as it made it; the log says what was run instead.
        reply = (await rt.sessions.messages(handle.id))[1]
        assert reply.content[1]["input"] == {"target": "prod"}
    await provider.client.close()


@pytest.mark.parametrize("how", ["abort-event", "cancel", "aclose"])
async def test_abort_while_waiting_is_an_abort(adapter: StorageAdapter, how: str) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Fine.")]
    )
    async with SessionRuntime(
        adapter, provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        abort = asyncio.Event()
        asked = asyncio.Event()
        seen: list[StreamEventBase] = []

        async def consume() -> None:
            events = rt.execute_message(handle.id, "ship it", abort=abort)
            async with contextlib.aclosing(events) as stream:
                async for event in stream:
                    seen.append(event)
                    if isinstance(event, InterruptRequested):
                        asked.set()
                        if how == "aclose":
                            break  # stop listening: closing the turn aborts it

        task = asyncio.create_task(consume())
        await asked.wait()
        interrupt_id = next(e.interrupt_id for e in seen if isinstance(e, InterruptRequested))
        if how == "aclose":
            await task
        else:
            assert [i.id for i in await rt.interrupts.list(handle.id)] == [interrupt_id]
        if how == "abort-event":
            abort.set()
            await task
            assert seen[-1].outcome == "user-aborted"  # type: ignore[attr-defined]
        elif how == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert deploy.calls == []
        # The call was accounted once, exactly, when the turn started waiting.
        [row] = await rt.audit.rows(handle.id)
        assert row.usage.input_tokens == 400 and row.usage.output_tokens == 40
        assert not row.usage.output_estimated
        settled = await rt.interrupts.get(interrupt_id)
        assert settled.final and settled.source == "abort"
        late = await rt.interrupts.resolve(interrupt_id, Approve())
        assert not late.accepted and late.final and late.source == "abort"
        assert await rt.interrupts.list() == []
        outcome = [
            e.payload["outcome"]
            for e in await rt.store.list_events(handle.id)
            if e.type == "turn.complete"
        ]
        assert outcome == ["user-aborted"]
        # The next request is one the API accepts: the call has its (synthetic) result.
        async for _ in rt.execute_message(handle.id, "never mind"):
            pass
        body = api.sent[-1]["messages"]
        assert [m["role"] for m in body] == ["user", "assistant", "user"]
        result = body[2]["content"][0]
        assert result == {
            "type": "tool_result",
            "tool_use_id": "toolu_d",
            "content": ABORTED_TOOL_RESULT,
            "is_error": True,
        }
    await provider.client.close()


async def test_a_rollback_while_waiting_keeps_the_turn_whole(adapter: StorageAdapter) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [
            text_reply("Hello."),
            tool_reply(("toolu_d", "deploy", '{"target": "prod"}')),
            text_reply("Deployed."),
            text_reply("Next."),
        ]
    )
    async with SessionRuntime(
        adapter, provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        async for _ in rt.execute_message(handle.id, "hi"):
            pass
        [first] = await rt.checkpoints.list(handle.id)
        async for event in rt.execute_message(handle.id, "ship it"):
            if isinstance(event, InterruptRequested):
                await rt.checkpoints.rollback(handle.id, first.id)  # takes the turn's first half
                assert await rt.interrupts.list() == []
                await rt.interrupts.resolve(event.interrupt_id, Approve())
        assert deploy.calls == [{"target": "prod"}]
        async for _ in rt.execute_message(handle.id, "and then?"):
            pass
        for body in api.sent[1:]:
            messages = body["messages"]
            for i, message in enumerate(messages):
                assert message["role"] == ("user" if i % 2 == 0 else "assistant")
                for block in message["content"]:
                    if block["type"] == "tool_result":
                        called = messages[i - 1]["content"]
                        assert any(b.get("id") == block["tool_use_id"] for b in called)
        texts = [m.role for m in await rt.sessions.messages(handle.id)]
        assert texts == ["user", "assistant"] * 4
        head = (await rt.store.get_session(handle.id)).head_checkpoint_id  # type: ignore[union-attr]
        assert head is not None
        rebuilt = [m.id for m in await rt.checkpoints.state_at(handle.id, head)]
        assert rebuilt == [m.id for m in await rt.sessions.messages(handle.id)]
    await provider.client.close()


async def test_a_delete_while_waiting_ends_the_turn(adapter: StorageAdapter) -> None:
    deploy = Deploy()
    provider, _ = anthropic_provider([tool_reply(("toolu_d", "deploy", '{"target": "prod"}'))])
    async with SessionRuntime(
        adapter, provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        turn = Turn(rt, handle.id, "ship it")
        await turn.asked.wait()
        assert (await rt.delete_session(handle.id)).deleted
        events = await turn.task
        assert events[-1].outcome == "user-aborted" and deploy.calls == []  # type: ignore[attr-defined]
        kinds = [e.type for e in await rt.store.list_events(handle.id)]
        assert kinds.count("interrupt.resolved") == 1 and kinds[-1] == "turn.complete"
    await provider.client.close()


@pytest.mark.parametrize("default", [Reject(reason="nobody answered"), Approve()])
async def test_timeout_applies_the_default_once(
    adapter: StorageAdapter, default: ApprovalDecision
) -> None:
    deploy = Deploy()
    provider, api = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Done.")]
    )
    config = needs_deploy(timeout=0.05, default=default)
    async with SessionRuntime(adapter, provider, tools=[deploy.tool()], interrupt=config) as rt:
        handle = await rt.create_session(model=MODEL)
        events = [e async for e in rt.execute_message(handle.id, "ship it")]
        resolved = next(e for e in events if e.type == "interrupt.resolved")
        assert resolved.source == "timeout" and resolved.decision == default  # type: ignore[attr-defined]
        assert deploy.calls == ([] if isinstance(default, Reject) else [{"target": "prod"}])
        result = api.sent[1]["messages"][2]["content"][0]
        if isinstance(default, Reject):
            assert (
                "no decision came" in result["content"] and "nobody answered" in result["content"]
            )
        late = await rt.interrupts.resolve(resolved.interrupt_id, Edit(input={}))  # type: ignore[attr-defined]
        assert not late.accepted and late.final and late.source == "timeout"
        log = await rt.store.list_events(handle.id)
        assert [e.type for e in log].count("interrupt.resolved") == 1
    await provider.client.close()


async def test_only_what_the_predicate_picks_waits(adapter: StorageAdapter) -> None:
    deploy = Deploy()
    provider, _ = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "staging"}')), text_reply("Staged.")]
    )
    config = InterruptConfig(when=lambda name, args: args.get("target") == "prod")
    async with SessionRuntime(adapter, provider, tools=[deploy.tool()], interrupt=config) as rt:
        handle = await rt.create_session(model=MODEL)
        events = [e async for e in rt.execute_message(handle.id, "stage it")]
        assert "interrupt.requested" not in [e.type for e in events]
        assert deploy.calls == [{"target": "staging"}]
    await provider.client.close()


async def test_unknown_ids_and_wrong_states_are_clear_errors(adapter: StorageAdapter) -> None:
    async with SessionRuntime(adapter, ScriptedProvider()) as rt:
        handle = await rt.create_session()
        with pytest.deprecated_call():
            assert rt.get_interrupt_manager() is None
        with pytest.raises(NotFound, match="has not synced here yet"):
            await rt.interrupts.resolve(uuid7(), Approve())
        with pytest.raises(InvalidInput):
            await rt.interrupts.resolve(uuid7(), "maybe")
        with pytest.raises(InvalidState, match="no turn waiting"):
            async for _ in rt.interrupts.resume(handle.id):
                pass


# -- restarts ------------------------------------------------------------------------------------


async def test_restart_while_waiting_then_resume(tmp_path: Path) -> None:
    path = tmp_path / "device.db"
    deploy = Deploy()
    provider, _ = anthropic_provider([tool_reply(("toolu_d", "deploy", '{"target": "prod"}'))])
    rt = SessionRuntime(
        SQLiteAdapter(path), provider, tools=[deploy.tool()], interrupt=needs_deploy()
    )
    await rt.open()
    handle = await rt.create_session(model=MODEL)
    asked = asyncio.Event()
    seen: list[StreamEventBase] = []

    async def consume() -> None:
        async for event in rt.execute_message(handle.id, "ship it"):
            seen.append(event)
            if isinstance(event, InterruptRequested):
                asked.set()

    task = asyncio.create_task(consume())
    await asked.wait()
    await rt.close()  # the waiting turn is suspended, not aborted
    await task
    assert seen[-1].type == "turn.suspended" and "turn.complete" not in [e.type for e in seen]
    interrupt_id = seen[-2].interrupt_id  # type: ignore[attr-defined]
    await provider.client.close()

    provider, api = anthropic_provider([text_reply("Deployed.", input_tokens=50)])
    async with SessionRuntime(
        SQLiteAdapter(path), provider, tools=[deploy.tool()], interrupt=needs_deploy()
    ) as again:
        [pending] = await again.interrupts.list()
        assert pending.id == interrupt_id and pending.status == "pending"
        resumed = await again.resume_session(handle.id)
        assert [i["status"] for i in resumed.hydrated["interrupts"]] == ["pending"]
        with pytest.raises(InvalidState, match="waiting for approval of deploy"):
            async for _ in again.execute_message(handle.id, "something else"):
                pass
        receipt = await again.interrupts.resolve(interrupt_id, Approve())
        assert receipt.accepted and receipt.final  # the same device: its word is final
        events = [e async for e in again.interrupts.resume(handle.id)]
        kinds = [e.type for e in events]
        assert kinds[0] == "interrupt.resolved" and kinds[-1] == "turn.complete"
        assert "tool.completed" in kinds and deploy.calls == [{"target": "prod"}]
        done = events[-1]
        assert done.outcome == "ok" and done.provider_calls == 2  # type: ignore[attr-defined]
        assert done.input_tokens == 450  # type: ignore[attr-defined]
        request = api.sent[0]["messages"]
        assert [m["role"] for m in request] == ["user", "assistant", "user"]
        assert request[2]["content"][0]["tool_use_id"] == "toolu_d"
        rows = await again.audit.rows(handle.id)
        assert [r.seq_within_turn for r in rows] == [0, 1]
        assert len({r.turn_id for r in rows}) == 1
        [checkpoint] = await again.checkpoints.list(handle.id)
        assert len(checkpoint.appended) == 4
        assert (await again.events.verify_chain(handle.id)).ok
        hydrated = (await again.resume_session(handle.id)).hydrated
        assert [i["status"] for i in hydrated["interrupts"]] == ["resolved"]
        assert hydrated["turns"] == 1
    await provider.client.close()


async def test_a_deadline_that_passed_during_a_restart_applies_at_resume(tmp_path: Path) -> None:
    path = tmp_path / "device.db"
    deploy = Deploy()
    config = needs_deploy(timeout=3600)
    script = [ScriptedReply(text="Deploying.", tool_calls=[("deploy", {"target": "prod"})])]
    rt = SessionRuntime(
        SQLiteAdapter(path), ScriptedProvider(script), tools=[deploy.tool()], interrupt=config
    )
    await rt.open()
    handle = await rt.create_session()
    async for event in rt.execute_message(handle.id, "ship it"):
        if isinstance(event, InterruptRequested):
            await rt.close()
    # Two hours later (the clock under the HLC moves on; nothing was decided meanwhile).
    later = SessionRuntime(
        SQLiteAdapter(path),
        ScriptedProvider([ScriptedReply(text="Not deployed.")]),
        tools=[deploy.tool()],
        interrupt=config,
        wall_clock=lambda: rt.wall_ms() + 2 * 3600 * 1000,
    )
    async with later:
        events = [e async for e in later.interrupts.resume(handle.id)]
        resolved = next(e for e in events if e.type == "interrupt.resolved")
        assert resolved.source == "timeout"  # type: ignore[attr-defined]
        assert deploy.calls == [] and events[-1].outcome == "ok"  # type: ignore[attr-defined]


async def _waiting_child(db: str) -> None:
    """The child of the SIGKILL test: a turn that waits, then is killed while it waits."""
    deploy = Deploy()
    script = [ScriptedReply(text="Deploying.", tool_calls=[("deploy", {"target": "prod"})])]
    async with SessionRuntime(
        SQLiteAdapter(db),
        ScriptedProvider(script),
        user_id="u",
        org_id="o",
        tools=[deploy.tool()],
        interrupt=needs_deploy(),
    ) as rt:
        handle = await rt.create_session()
        async for event in rt.execute_message(handle.id, "ship it"):
            if isinstance(event, InterruptRequested):
                print(f"waiting {handle.id} {event.interrupt_id}", flush=True)
    print("finished", flush=True)  # never reached: the test kills this process while it waits


async def test_process_killed_while_waiting_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.test_interrupts",
        str(db),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    assert line[0] == "waiting", line
    session_id, interrupt_id = line[1], line[2]

    deploy = Deploy()
    async with SessionRuntime(
        SQLiteAdapter(db),
        ScriptedProvider([ScriptedReply(text="Deployed.")]),
        user_id="u",
        org_id="o",
        tools=[deploy.tool()],
        interrupt=needs_deploy(),
    ) as rt:
        [pending] = await rt.interrupts.list()
        assert pending.id == interrupt_id and pending.tool_call.input == {"target": "prod"}
        messages = await rt.sessions.messages(session_id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert len(await rt.audit.rows(session_id)) == 1
        assert (await rt.sync.status()).pending > 0  # queued to sync, with the request
        await rt.interrupts.resolve(interrupt_id, Approve())
        events = [e async for e in rt.interrupts.resume(session_id)]
        assert events[-1].outcome == "ok" and deploy.calls == [{"target": "prod"}]  # type: ignore[attr-defined]
        assert len(await rt.sessions.messages(session_id)) == 4
        assert (await rt.events.verify_chain(session_id)).ok


# -- devices and a real server -------------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        c = Cluster(tmp_path, stack)
        await c.start_server()
        try:
            yield c
        finally:
            await stack.aclose()
            if c.server is not None:
                await c.stop_server()


async def asker(
    cluster: Cluster, bodies: list[sse.StreamBody], deploy: Deploy, config: InterruptConfig
) -> SessionRuntime:
    """The laptop: its turns call deploy through the real SDK and wait for approval."""
    provider, _ = anthropic_provider(bodies)
    rt = SessionRuntime(
        SQLiteAdapter(cluster.tmp / "laptop.db"),
        provider,
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
        client_id="laptop",
        tools=[deploy.tool()],
        interrupt=config,
    )
    await cluster.stack.enter_async_context(rt)
    cluster.stack.push_async_callback(provider.client.close)
    rt.sync.backoff_initial = 0.01
    rt.sync.backoff_max = 0.2
    return rt


class Turn:
    """A turn consumed in a task; ``asked`` is set at its first ``interrupt.requested``."""

    def __init__(self, rt: SessionRuntime, session_id: str, text: str) -> None:
        self.events: list[StreamEventBase] = []
        self.asked = asyncio.Event()
        self.task = asyncio.create_task(self._run(rt, session_id, text))

    async def _run(self, rt: SessionRuntime, session_id: str, text: str) -> list[StreamEventBase]:
        async for event in rt.execute_message(session_id, text):
            self.events.append(event)
            if isinstance(event, InterruptRequested):
                self.asked.set()
        return self.events


def watch(rt: SessionRuntime, kind: str) -> asyncio.Event:
    seen = asyncio.Event()
    rt.events.on(kind, lambda _: seen.set())
    return seen


async def test_another_device_approves_and_the_turn_goes_on(cluster: Cluster) -> None:
    deploy = Deploy()
    laptop = await asker(
        cluster,
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Deployed.")],
        deploy,
        needs_deploy(),
    )
    phone = await cluster.device("phone")
    await cluster.online(laptop, phone)
    session = await laptop.create_session(model=MODEL)
    on_phone = watch(phone, "interrupt.requested")
    resolved_on_phone = watch(phone, "interrupt.resolved")
    turn = Turn(laptop, session.id, "ship it")
    await asyncio.wait_for(on_phone.wait(), 20)
    [pending] = await phone.interrupts.list()
    assert pending.requested_by == "laptop" and pending.tool_call.name == "deploy"
    with pytest.deprecated_call():
        assert phone.get_interrupt_manager() is None  # no config, but it can decide
    with pytest.raises(InvalidState, match="runs on device laptop"):
        async for _ in phone.interrupts.resume(session.id):
            pass  # only the laptop runs its tools

    receipt = await phone.interrupts.resolve(pending.id, Approve(), wait=20)
    assert receipt.accepted and receipt.final and receipt.decided_by == "phone"
    events = await asyncio.wait_for(turn.task, 20)
    assert events[-1].outcome == "ok" and deploy.calls == [{"target": "prod"}]  # type: ignore[attr-defined]
    resolved = next(e for e in events if e.type == "interrupt.resolved")
    assert resolved.decided_by == "phone" and resolved.source == "user"  # type: ignore[attr-defined]
    await asyncio.wait_for(resolved_on_phone.wait(), 20)
    await cluster.settle(laptop, phone)
    assert await phone.interrupts.list() == [] and await laptop.interrupts.list() == []
    on_laptop = (await laptop.resume_session(session.id)).hydrated["interrupts"]
    there = (await phone.resume_session(session.id)).hydrated["interrupts"]
    assert on_laptop == there and there[0]["decided_by"] == "phone"
    assert (await phone.events.verify_chain(session.id)).ok


async def test_a_timeout_beats_a_later_decision_from_another_device(cluster: Cluster) -> None:
    deploy = Deploy()
    laptop = await asker(
        cluster,
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Held back.")],
        deploy,
        needs_deploy(timeout=1.5),
    )
    phone = await cluster.device("phone")
    await cluster.online(laptop, phone)
    session = await laptop.create_session(model=MODEL)
    on_phone = watch(phone, "interrupt.requested")
    turn = Turn(laptop, session.id, "ship it")
    await asyncio.wait_for(on_phone.wait(), 20)
    await phone.sync.disconnect()
    events = await asyncio.wait_for(turn.task, 20)  # the default applies on the laptop
    assert deploy.calls == []
    [pending] = await phone.interrupts.list()  # the phone has not heard yet
    late = asyncio.create_task(phone.interrupts.resolve(pending.id, Approve(), wait=20))
    await phone.sync.connect(cluster.url, cluster.token())
    receipt = await late
    assert not receipt.accepted and receipt.final
    assert receipt.decided_by == "laptop" and receipt.source == "timeout"
    assert isinstance(receipt.decision, Reject)
    resolved = next(e for e in events if e.type == "interrupt.resolved")
    assert resolved.source == "timeout"  # type: ignore[attr-defined]
    await cluster.settle(laptop, phone)
    for rt in (laptop, phone):
        state = await rt.interrupts.get(pending.id)
        assert state.source == "timeout" and receipt.event_id in state.overruled


async def test_two_devices_deciding_at_once_converge_on_one(cluster: Cluster) -> None:
    deploy = Deploy()
    laptop = await asker(
        cluster,
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Done.")],
        deploy,
        needs_deploy(),
    )
    phone = await cluster.device("phone")
    tablet = await cluster.device("tablet")
    await cluster.online(laptop, phone, tablet)
    session = await laptop.create_session(model=MODEL)
    seen = [watch(phone, "interrupt.requested"), watch(tablet, "interrupt.requested")]
    turn = Turn(laptop, session.id, "ship it")
    for flag in seen:
        await asyncio.wait_for(flag.wait(), 20)
    await phone.sync.disconnect()
    await tablet.sync.disconnect()
    [pending] = await phone.interrupts.list()
    decisions: dict[str, ApprovalDecision] = {
        "phone": Approve(),
        "tablet": Reject(reason="not today"),
    }
    tasks = {
        name: asyncio.create_task(rt.interrupts.resolve(pending.id, decisions[name], wait=20))
        for name, rt in (("phone", phone), ("tablet", tablet))
    }
    await asyncio.gather(
        phone.sync.connect(cluster.url, cluster.token()),
        tablet.sync.connect(cluster.url, cluster.token()),
    )
    receipts = {name: await task for name, task in tasks.items()}
    events = await asyncio.wait_for(turn.task, 20)
    winner = next(e for e in events if e.type == "interrupt.resolved")
    won_by = winner.decided_by  # type: ignore[attr-defined]
    lost_by = "tablet" if won_by == "phone" else "phone"
    assert receipts[won_by].accepted and receipts[won_by].final
    assert not receipts[lost_by].accepted and receipts[lost_by].final
    assert receipts[lost_by].decided_by == won_by
    assert receipts[lost_by].decision == decisions[won_by]
    assert deploy.calls == ([{"target": "prod"}] if won_by == "phone" else [])
    await cluster.settle(laptop, phone, tablet)
    states = [await rt.interrupts.get(pending.id) for rt in (laptop, phone, tablet)]
    assert states[0] == states[1] == states[2]
    assert states[0].decided_by == won_by
    assert receipts[lost_by].event_id in states[0].overruled


if __name__ == "__main__":
    asyncio.run(_waiting_child(sys.argv[1]))


async def test_approval_on_the_phone_through_a_pleach_server_process(tmp_path: Path) -> None:
    """As a user runs it: a ``pleach-server`` process, the laptop's agent asks, the phone
    (another runtime, its own file) approves; the laptop's turn goes on and both agree."""
    from tests.test_cli import server_process

    deploy = Deploy()
    provider, _ = anthropic_provider(
        [tool_reply(("toolu_d", "deploy", '{"target": "prod"}')), text_reply("Deployed.")]
    )
    with server_process(tmp_path) as (url, make_token):
        token = await asyncio.to_thread(make_token, ALICE.user_id, ALICE.org_id)
        async with (
            SessionRuntime(
                SQLiteAdapter(tmp_path / "laptop.db"),
                provider,
                user_id=ALICE.user_id,
                org_id=ALICE.org_id,
                client_id="laptop",
                tools=[deploy.tool()],
                interrupt=needs_deploy(),
            ) as laptop,
            SessionRuntime(
                SQLiteAdapter(tmp_path / "phone.db"),
                user_id=ALICE.user_id,
                org_id=ALICE.org_id,
                client_id="phone",
            ) as phone,
        ):
            await laptop.sync.connect(url, token)
            await phone.sync.connect(url, token)
            session = await laptop.create_session(model=MODEL)
            asked_on_phone = watch(phone, "interrupt.requested")
            turn = Turn(laptop, session.id, "ship it")
            await asyncio.wait_for(asked_on_phone.wait(), 30)
            assert deploy.calls == []  # nothing ran before the approval
            [pending] = await phone.interrupts.list()
            assert pending.tool_call.name == "deploy" and pending.requested_by == "laptop"
            receipt = await phone.interrupts.resolve(pending.id, Approve(), wait=30)
            assert receipt.accepted and receipt.final and receipt.decided_by == "phone"
            events = await asyncio.wait_for(turn.task, 30)
            assert events[-1].outcome == "ok" and deploy.calls == [{"target": "prod"}]  # type: ignore[attr-defined]
            assert await laptop.sync.wait_until_synced(30)
            assert await phone.sync.wait_until_synced(30)
            assert await laptop.interrupts.list() == [] == await phone.interrupts.list()
            texts = [m.content for m in await phone.sessions.messages(session.id)]
            assert texts == [m.content for m in await laptop.sessions.messages(session.id)]
    await provider.client.close()
