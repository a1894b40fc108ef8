"""Safety policies through the real anthropic SDK: refusals are error events and audit rows,
never exceptions; rewrites reach the provider; redaction keeps patterns out of the provider's
requests and out of the ledger."""

from __future__ import annotations

from typing import Any

import pytest

from pleach_client.plugins import ToolInvocation, TurnContext
from pleach_client.providers.base import ProviderRequest
from pleach_client.runtime import SessionRuntime
from pleach_client.safety import Redact, Refuse, ToolAllowlist
from pleach_client.store.base import StorageAdapter
from pleach_client.store.memory import MemoryAdapter
from pleach_client.tools import Tool
from tests import sse
from tests.test_plugins import of_type, run, tool_reply
from tests.test_runtime_anthropic import MODEL, anthropic_provider, text_reply


class NoSecrets:
    """A host policy: refuses a request whose last user text says 'secret'."""

    id = "no-secrets"
    description = "refuses requests about secrets"

    def check_model_request(self, request: ProviderRequest, ctx: TurnContext) -> Refuse | None:
        last = request.messages[-1]["content"][-1]  # what the user said last
        if "secret" in str(last.get("text", "")):
            return Refuse("the user asked about secrets")
        return None


async def test_no_policies_means_nothing_available_or_active() -> None:
    async with SessionRuntime(MemoryAdapter(), meta_tool_names=()) as rt:
        assert rt.safety.list_available() == [] and rt.safety.get_active() == []
        assert len(rt.safety.get_registry()) == 0 and rt.safety.missing() == []


async def test_a_policy_runs_only_once_enabled(adapter: StorageAdapter) -> None:
    class Contributes:
        name = "contributes"

        def safety_policies(self) -> list[Any]:
            return [NoSecrets()]

    provider, api = anthropic_provider([text_reply("sure")])
    async with SessionRuntime(adapter, provider, plugins=[Contributes()], meta_tool_names=()) as rt:
        (summary,) = rt.safety.list_available()
        assert (summary.id, summary.origin, summary.active) == ("no-secrets", "contributes", False)
        assert summary.hooks == ["check_model_request"]
        assert rt.safety.get_active() == []
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "tell me a secret")
        assert of_type(events, "error") == [] and len(api.sent) == 1
    await provider.client.close()


async def test_a_refused_request_is_an_error_event_and_an_audit_row(
    adapter: StorageAdapter,
) -> None:
    provider, api = anthropic_provider([text_reply("fine")])
    async with SessionRuntime(
        adapter,
        provider,
        safety_policies=[NoSecrets()],
        enabled_safety_policies=["no-secrets"],
        meta_tool_names=(),
    ) as rt:
        assert [s.id for s in rt.safety.get_active()] == ["no-secrets"]
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "what is the secret?")  # no exception
        assert [e.type for e in events] == [
            "message.added",
            "error",
            "checkpoint.created",
            "turn.complete",
        ]
        error = events[1]
        assert error.code == "policy_refused" and "the user asked about secrets" in error.error
        assert events[-1].outcome == "provider-error"
        assert api.sent == [], "nothing reached the provider"
        (row,) = await rt.audit.rows(handle.id)
        assert (row.outcome.status, row.outcome.code) == ("provider-error", "policy_refused")
        assert row.usage.input_tokens == 0 and row.cost_usd == 0.0
        assert not rt.degradation.is_model_degraded(MODEL)
        # The session goes on: the next request is sent.
        await run(rt, handle.id, "never mind, hello")
        assert len(api.sent) == 1
    await provider.client.close()


async def test_an_enabled_policy_nobody_registered_fails_closed() -> None:
    provider, api = anthropic_provider([])
    async with SessionRuntime(
        MemoryAdapter(), provider, enabled_safety_policies=["pii-filter"], meta_tool_names=()
    ) as rt:
        assert rt.safety.missing() == ["pii-filter"] and rt.safety.get_active() == []
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "hi")
        assert of_type(events, "error")[0].code == "policy_unavailable"
        assert api.sent == []
    await provider.client.close()


async def test_the_tool_allowlist_hides_and_refuses(adapter: StorageAdapter) -> None:
    ran: list[dict[str, Any]] = []
    shell = Tool("shell", "Run a command.", {"type": "object"}, lambda i: ran.append(i) or "ok")
    provider, api = anthropic_provider(
        [tool_reply("toolu_sh", "shell", '{"cmd": "rm -rf /"}'), text_reply("Understood.")]
    )
    async with SessionRuntime(
        adapter,
        provider,
        tools=[shell],
        safety_policies=[ToolAllowlist(["calculator"])],
        enabled_safety_policies=["tool-allowlist"],
        meta_tool_names=(),
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        assert "shell" in handle.record.tools
        events = await run(rt, handle.id, "clean up")
        # The model is not offered the tool...
        assert [t["name"] for t in api.sent[0]["tools"]] == ["calculator"]
        # ...and a call of it anyway is refused: an error event, never run.
        assert ran == []
        error = of_type(events, "error")[0]
        assert error.code == "policy_refused" and "not on the allowlist" in error.error
        assert of_type(events, "tool.failed")[0].tool_call.name == "shell"
        result = api.sent[1]["messages"][-1]["content"][0]
        assert result["is_error"] and "not on the allowlist" in result["content"]
        rows = await rt.audit.rows(handle.id)
        assert (rows[0].outcome.status, rows[0].outcome.code) == ("tool-error", "policy_refused")
        assert events[-1].outcome == "tool-error"
        logged = [e for e in await rt.store.list_events(handle.id) if e.type == "error"]
        assert logged[0].payload["code"] == "policy_refused"
    await provider.client.close()


async def test_redact_keeps_patterns_from_the_provider_and_the_ledger(
    adapter: StorageAdapter,
) -> None:
    def lookup(tool_input: dict[str, Any]) -> str:
        raise LookupError(f"no account for {tool_input['email']}")

    provider, api = anthropic_provider(
        [
            tool_reply("toolu_l", "lookup", '{"email": "carol@example.org"}'),
            sse.StreamBody(
                [
                    sse.message_start(input_tokens=50),
                    sse.error("invalid_request_error", "cannot mail dave@example.net"),
                ]
            ),
        ]
    )
    async with SessionRuntime(
        adapter,
        provider,
        tools=[Tool("lookup", "Find an account.", {"type": "object"}, lookup)],
        system="Escalate to ops@example.com.",
        safety_policies=[Redact([Redact.EMAIL, r"sk-[a-z]+"])],
        enabled_safety_policies=["redact"],
        meta_tool_names=(),
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "My mail is bob@example.com and key sk-abcdef")
        first, second = api.sent
        assert "ops@example.com" not in first["system"] and "[redacted]" in first["system"]
        assert first["messages"][0]["content"] == [
            {"type": "text", "text": "My mail is [redacted] and key [redacted]"}
        ]
        # The model's own tool input and the tool's error were redacted in the next request.
        call, result = second["messages"][1]["content"][0], second["messages"][2]["content"][0]
        assert call["input"] == {"email": "[redacted]"}
        assert "carol@example.org" not in result["content"] and "[redacted]" in result["content"]
        # The ledger and the event log keep no address.
        rows = await rt.audit.rows(handle.id)
        messages = [r.outcome.message or "" for r in rows]
        assert len(rows) == 2 and all("@" not in m for m in messages)
        assert "cannot mail [redacted]" in messages[1]
        logged = [e.payload for e in await rt.store.list_events(handle.id)]
        assert all("@example" not in str(p) for p in logged)
        # The stream tells the local caller what happened, and the stored message is the
        # user's own words.
        assert "dave@example.net" in of_type(events, "error")[0].error
        stored = await rt.sessions.messages(handle.id)
        assert "bob@example.com" in stored[0].content[0]["text"]
    await provider.client.close()


async def test_a_policy_can_rewrite_a_tool_call_and_one_that_raises_refuses() -> None:
    class Clamp:
        id = "clamp"
        description = "keeps expressions short"

        async def check_tool_call(
            self, call: ToolInvocation, ctx: TurnContext
        ) -> ToolInvocation | None:
            expression = str(call.input.get("expression", ""))
            if len(expression) > 5:
                return ToolInvocation(id=call.id, name=call.name, input={"expression": "0"})
            return None

    class Broken:
        id = "broken"
        description = "raises on tool calls named boom"

        def check_tool_call(self, call: ToolInvocation, ctx: TurnContext) -> None:
            if call.name == "boom":
                raise RuntimeError("policy bug")

    boom = Tool("boom", "b", {"type": "object"}, lambda _: "should not run")
    provider, api = anthropic_provider(
        [
            tool_reply("toolu_c", "calculator", '{"expression": "123456*789"}'),
            tool_reply("toolu_b", "boom", "{}"),
            text_reply("done"),
        ]
    )
    async with SessionRuntime(
        MemoryAdapter(),
        provider,
        tools=[boom],
        safety_policies=[Clamp(), Broken()],
        enabled_safety_policies=["clamp", "broken"],
        meta_tool_names=(),
    ) as rt:
        handle = await rt.create_session(model=MODEL)
        events = await run(rt, handle.id, "compute, then boom")
        assert of_type(events, "tool.completed")[0].output == "0"
        assert len(api.sent) == 3  # a refusal is data for the model, and the loop goes on
        failed = of_type(events, "tool.failed")[0]
        assert failed.name == "boom" and "failed (RuntimeError: policy bug)" in failed.error
        rewrote = [
            e.payload for e in await rt.store.list_events(handle.id) if e.type == "safety.rewrote"
        ]
        assert rewrote == [
            {
                "policy": "clamp",
                "target": "tool_call",
                "tool_call_id": "toolu_c",
                "turn_id": events[-1].turn_id,
            }
        ]
    await provider.client.close()


def test_the_registry_refuses_what_is_not_a_policy() -> None:
    rt = SessionRuntime(MemoryAdapter(), meta_tool_names=())

    class NoHooks:
        id = "inert"
        description = ""

    with pytest.raises(ValueError, match="has none of the hooks"):
        rt.safety.register(NoHooks())
    rt.safety.register(NoSecrets())
    with pytest.raises(ValueError, match="already registered"):
        rt.safety.register(NoSecrets())
