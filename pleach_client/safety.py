"""Safety policies: checks that can refuse or rewrite a model request or a tool call.

A policy is registered by a plugin (its ``safety_policies()`` hook) or by the host
(``SessionRuntime(safety_policies=[...])`` or ``rt.safety.register``), and runs only once the
operator opts in by id: ``SessionRuntime(enabled_safety_policies=["tool-allowlist"])``. An
enabled id that nobody registered fails closed: every turn ends with an ``error`` event
(``policy_unavailable``) before any model call.

A policy has an ``id``, a ``description`` and any of three optional hooks (sync or async):

- ``check_model_request(request, ctx)``: return a new ``ProviderRequest`` to send instead, a
  ``Refuse(reason)``, or None to let it through. Active policies run in the order enabled,
  each on the previous one's request, after plugins' model middleware and right before the
  provider, so what a policy removes never reaches it.
- ``check_tool_call(call, ctx)``: a new ``ToolInvocation`` (other input), a ``Refuse``, or None.
- ``redact_text(text)``: the text with what must not be kept replaced; it runs on what the
  turn writes to the audit ledger and the event log (error messages, refusal reasons).

A refusal is never an exception out of ``execute_message``: a refused model request becomes
an ``error`` event (code ``policy_refused``) and an audit row of a call that sent nothing; a
refused tool call becomes an error tool result for the model, ``tool.failed`` and an ``error``
event, and the audit row of the call that asked for it says ``policy_refused``. A policy that
raises refuses (it fails closed), naming the exception.

Two policies ship: ``ToolAllowlist`` and ``Redact``.
"""

from __future__ import annotations

import builtins
import inspect
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from shared.errors import RequestRefused, ToolRefused

from .providers.base import ProviderRequest

if TYPE_CHECKING:
    from .plugins import ToolInvocation, TurnContext

log = logging.getLogger("pleach.safety")

__all__ = [
    "Redact",
    "Refuse",
    "SafetyFacet",
    "SafetyPolicy",
    "SafetyPolicySummary",
    "SafetyRegistry",
    "ToolAllowlist",
]


@dataclass(frozen=True)
class Refuse:
    """A policy's refusal, with the reason the caller (and, for a tool call, the model) reads."""

    reason: str


@runtime_checkable
class SafetyPolicy(Protocol):
    """A safety policy: an ``id``, a ``description``, and any of the optional hooks
    ``check_model_request``, ``check_tool_call`` and ``redact_text`` (see the module)."""

    id: str
    description: str


class SafetyPolicySummary(msgspec.Struct, frozen=True, kw_only=True):
    """A registered policy as ``rt.safety`` lists it; ``active`` once enabled."""

    id: str
    description: str
    origin: str
    active: bool
    hooks: list[str] = []


_HOOKS = ("check_model_request", "check_tool_call", "redact_text")


class SafetyRegistry:
    """Registered policies by id (``rt.safety.get_registry()``)."""

    def __init__(self) -> None:
        self._policies: dict[str, tuple[SafetyPolicy, str]] = {}

    def register(self, policy: SafetyPolicy, *, origin: str = "host") -> SafetyPolicy:
        """Add a policy; ``ValueError`` if its id is taken or it is not a policy."""
        policy_id = getattr(policy, "id", None)
        if not isinstance(policy_id, str) or not policy_id:
            raise ValueError(f"a safety policy needs a non-empty string id, not {policy_id!r}")
        if not any(callable(getattr(policy, hook, None)) for hook in _HOOKS):
            raise ValueError(f"safety policy {policy_id!r} has none of the hooks {_HOOKS}")
        if policy_id in self._policies:
            raise ValueError(
                f"safety policy {policy_id!r} is already registered (by "
                f"{self._policies[policy_id][1]!r})"
            )
        self._policies[policy_id] = (policy, origin)
        return policy

    def get(self, policy_id: str) -> SafetyPolicy | None:
        found = self._policies.get(policy_id)
        return found[0] if found is not None else None

    def origin(self, policy_id: str) -> str | None:
        found = self._policies.get(policy_id)
        return found[1] if found is not None else None

    def ids(self) -> list[str]:
        return list(self._policies)

    def __contains__(self, policy_id: object) -> bool:
        return policy_id in self._policies

    def __len__(self) -> int:
        return len(self._policies)


class SafetyFacet:
    """``runtime.safety``: the policies available, the ones active, and the registry."""

    def __init__(
        self,
        *,
        enabled: Iterable[str] = (),
        policies: Iterable[SafetyPolicy] = (),
    ) -> None:
        self._registry = SafetyRegistry()
        self._enabled = list(dict.fromkeys(enabled))
        for policy in policies:
            self._registry.register(policy)

    # -- reads -----------------------------------------------------------------------------
    def get_registry(self) -> SafetyRegistry:
        return self._registry

    def list_available(self) -> builtins.list[SafetyPolicySummary]:
        """Every registered policy (enabled or not), in registration order."""
        return [self._summary(i) for i in self._registry.ids()]

    def get_active(self) -> builtins.list[SafetyPolicySummary]:
        """The enabled policies that are registered, in the order they run."""
        return [self._summary(i) for i in self._enabled if i in self._registry]

    @property
    def enabled(self) -> builtins.list[str]:
        """The ids the operator enabled (``enabled_safety_policies``), registered or not."""
        return list(self._enabled)

    def missing(self) -> builtins.list[str]:
        """Enabled ids that no one registered: turns fail closed until they are."""
        return [i for i in self._enabled if i not in self._registry]

    def register(self, policy: SafetyPolicy, *, origin: str = "host") -> SafetyPolicySummary:
        """Register a policy (it runs once its id is in ``enabled_safety_policies``)."""
        self._registry.register(policy, origin=origin)
        return self._summary(policy.id)

    # -- the turn's side ---------------------------------------------------------------------
    @property
    def in_force(self) -> bool:
        """Whether a turn has anything to check (an enabled policy, registered or not)."""
        return bool(self._enabled)

    def _active(self) -> builtins.list[SafetyPolicy]:
        return [p for i in self._enabled if (p := self._registry.get(i)) is not None]

    async def check_request(self, request: ProviderRequest, ctx: TurnContext) -> ProviderRequest:
        """The request to send after every active policy saw it; ``RequestRefused`` when one
        refuses (or fails, or an enabled policy is missing)."""
        missing = self.missing()
        if missing:
            raise RequestRefused(
                f"safety policies {missing} are enabled but not registered: nothing is sent "
                "until they are (register them, or leave them out of enabled_safety_policies)",
                policy=missing[0],
                code="policy_unavailable",
            )
        for policy in self._active():
            hook = getattr(policy, "check_model_request", None)
            if not callable(hook):
                continue
            try:
                verdict = await _maybe_await(hook(request, ctx))
            except Exception as exc:
                log.exception("safety policy %r failed on a model request", policy.id)
                raise RequestRefused(
                    f"safety policy {policy.id!r} failed ({type(exc).__name__}: {exc}), so the "
                    "request was refused",
                    policy=policy.id,
                ) from exc
            if isinstance(verdict, Refuse):
                raise RequestRefused(
                    f"safety policy {policy.id!r} refused the model request: {verdict.reason}",
                    policy=policy.id,
                )
            if isinstance(verdict, ProviderRequest) and verdict is not request:
                if verdict != request:
                    ctx.note("safety.rewrote", {"policy": policy.id, "target": "model_request"})
                request = verdict
        return request

    async def check_tool(self, call: ToolInvocation, ctx: TurnContext) -> ToolInvocation:
        """The tool call to run after every active policy saw it; ``ToolRefused`` when one
        refuses (or fails)."""
        from .plugins import ToolInvocation

        for policy in self._active():
            hook = getattr(policy, "check_tool_call", None)
            if not callable(hook):
                continue
            try:
                verdict = await _maybe_await(hook(call, ctx))
            except Exception as exc:
                log.exception("safety policy %r failed on tool call %s", policy.id, call.name)
                raise ToolRefused(
                    f"safety policy {policy.id!r} failed ({type(exc).__name__}: {exc}), so the "
                    f"call of {call.name!r} was refused",
                    policy=policy.id,
                ) from exc
            if isinstance(verdict, Refuse):
                raise ToolRefused(
                    f"safety policy {policy.id!r} refused the call of {call.name!r}: "
                    f"{verdict.reason}",
                    policy=policy.id,
                )
            if isinstance(verdict, ToolInvocation) and verdict != call:
                ctx.note(
                    "safety.rewrote",
                    {"policy": policy.id, "target": "tool_call", "tool_call_id": call.id},
                )
                call = verdict
        return call

    def scrub(self, text: str | None) -> str | None:
        """``text`` after every active policy's ``redact_text`` (what the ledger and the event
        log keep)."""
        if not text:
            return text
        for policy in self._active():
            hook = getattr(policy, "redact_text", None)
            if callable(hook):
                text = str(hook(text))
        return text

    def scrub_payload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An event payload with its text fields (``message``, ``error``, ``reason``) scrubbed."""
        if not self._enabled:
            return payload
        out = dict(payload)
        for key in ("message", "error", "reason"):
            value = out.get(key)
            if isinstance(value, str):
                out[key] = self.scrub(value)
        return out

    def _summary(self, policy_id: str) -> SafetyPolicySummary:
        policy = self._registry.get(policy_id)
        assert policy is not None
        return SafetyPolicySummary(
            id=policy_id,
            description=str(getattr(policy, "description", "")),
            origin=self._registry.origin(policy_id) or "host",
            active=policy_id in self._enabled,
            hooks=[h for h in _HOOKS if callable(getattr(policy, h, None))],
        )


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


# -- the policies that ship -------------------------------------------------------------------


class ToolAllowlist:
    """Only the named tools: the others are not offered to the model (its request is
    rewritten without them) and a call of one is refused.

    Flow-control tools (``set_step_complete``...) are tools too: list them to keep them."""

    def __init__(
        self,
        tools: Iterable[str],
        *,
        id: str = "tool-allowlist",
        description: str | None = None,
    ) -> None:
        self.id = id
        self.allowed = frozenset(tools)
        self.description = description or (
            f"only these tools may run: {', '.join(sorted(self.allowed)) or '(none)'}"
        )

    def check_model_request(
        self, request: ProviderRequest, ctx: TurnContext
    ) -> ProviderRequest | None:
        kept = [t for t in request.tools if t.name in self.allowed]
        if len(kept) == len(request.tools):
            return None
        return msgspec.structs.replace(request, tools=kept)

    def check_tool_call(self, call: ToolInvocation, ctx: TurnContext) -> Refuse | None:
        if call.name in self.allowed:
            return None
        return Refuse(f"tool {call.name!r} is not on the allowlist")


class Redact:
    """Replace what matches ``patterns`` (regular expressions) before it reaches the provider
    or the audit ledger.

    In a model request: the system prompt, text blocks, tool inputs and tool results, and
    text documents (signed thinking blocks are left as they are: the API checks their
    signature, and they are the model's own words). In what the turn writes to the ledger
    and the event log: error messages and refusal reasons. The session's stored messages are
    not changed. ``EMAIL`` and ``API_KEY`` are ready-made patterns.
    """

    EMAIL = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"
    API_KEY = r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}\b"

    def __init__(
        self,
        patterns: Iterable[str | re.Pattern[str]],
        *,
        replacement: str = "[redacted]",
        id: str = "redact",
        description: str | None = None,
    ) -> None:
        compiled = [p if isinstance(p, re.Pattern) else re.compile(p) for p in patterns]
        if not compiled:
            raise ValueError("Redact needs at least one pattern")
        self.id = id
        self.replacement = replacement
        self._pattern = re.compile("|".join(f"(?:{p.pattern})" for p in compiled))
        self.description = description or (
            f"redacts {len(compiled)} pattern(s) before the provider and the ledger"
        )

    def redact_text(self, text: str) -> str:
        return self._pattern.sub(self.replacement, text)

    def check_model_request(
        self, request: ProviderRequest, ctx: TurnContext
    ) -> ProviderRequest | None:
        system = self.redact_text(request.system) if request.system else request.system
        messages = [
            {**m, "content": _redact_content(m.get("content"), self.redact_text)}
            for m in request.messages
        ]
        if system == request.system and messages == request.messages:
            return None
        return msgspec.structs.replace(request, system=system, messages=messages)


def _redact_content(content: Any, redact: Any) -> Any:
    if isinstance(content, str):
        return redact(content)
    if isinstance(content, list):
        return [_redact_block(b, redact) if isinstance(b, Mapping) else b for b in content]
    return content


def _redact_block(block: Mapping[str, Any], redact: Any) -> dict[str, Any]:
    """A new block with its text redacted (the request's dicts are shared: never mutated)."""
    out = dict(block)
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        out["text"] = redact(block["text"])
    elif kind == "tool_use":
        out["input"] = _redact_value(block.get("input"), redact)
    elif kind == "tool_result":
        out["content"] = _redact_content(block.get("content"), redact)
    elif kind == "document":
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "text":
            out["source"] = {**source, "data": redact(str(source.get("data", "")))}
    return out


def _redact_value(value: Any, redact: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _redact_value(v, redact) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, redact) for v in value]
    return value
