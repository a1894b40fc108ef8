"""Plugins: what a host or a library adds to the runtime, through optional hooks.

A plugin is any object with a ``name`` (``Plugin``) and any of these optional hooks, passed as
``SessionRuntime(plugins=[...])``. ``rt.plugins`` (a ``PluginManager``) says what each
contributed: ``collect_*`` return empty lists (collections) or None (capabilities) when
nothing was contributed, and never raise.

Contributions, read once when the runtime is built:

- ``prompts() -> Iterable[PromptFragment]``: system prompt fragments (``rt.prompts``).
- ``tools() -> Iterable[Tool]``: tools, registered in ``rt.tools`` (a new session offers them).
- ``safety_policies() -> Iterable[SafetyPolicy]``: policies, run once enabled
  (``enabled_safety_policies``; ``pleach_client.safety``).
- ``stream_observers() -> Iterable[Callback]``: called with every stream event
  (``rt.observer_router``).
- ``retry_policy() -> RetryPolicy | None`` and ``continuation_policy() ->
  ContinuationPolicy | None``: capabilities; the first plugin that gives one wins.
- ``setup(runtime)``: called last, with the runtime wired (to register observers with a mode,
  emit events, read facets).

Hooks of every turn (``ctx`` is the ``TurnContext``; ``ctx.emit(name, data)`` adds a
``custom.*`` event to the turn's stream, in order):

- ``wrap_model_call(ctx, request, call_next)``: an async generator around each model call.
  ``call_next(request)`` streams the call (the next plugin's, then the safety policies', then
  the provider's); yield its events (or others), change the request, or not call it at all.
  An exception other than ``ProviderError`` becomes a ``ProviderError`` (``plugin_error``).
- ``wrap_tool_call(ctx, call, call_next)``: a coroutine around each tool call;
  ``await call_next(call)`` (or a ``ToolInvocation`` with other input) runs it. Its result is
  the tool's output; an exception is the tool's failure (the model reads it).
- ``on_stream_chunk(ctx, chunk)``: sees each ``ProviderEvent`` of a model call as it arrives.

Flow control: ``meta_tool_names`` names the tools (``set_step_complete``, ``wait_for_jobs``) the
tool loop treats as terminal signals: when a reply calls one, its tool calls run (the tool
registered under that name is what it does; ``set_step_complete`` is built in) and the turn
ends there, with ``turn.complete``'s ``stopped_by`` naming it, unless a continuation policy
says to go on. When such a tool is registered but ``meta_tool_names`` was not given, a
warning is logged once (the reference's ``metaToolNames-config-missing``).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import inspect
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

from shared.errors import ProviderError, RequestRefused, ToolError
from shared.ids import uuid7
from shared.records import Session

from .prompts import PromptFragment
from .providers.base import Provider, ProviderEvent, ProviderRequest
from .receipts import ObserverUnregisterReceipt
from .safety import SafetyPolicy, SafetyRegistry
from .stream import Callback, CustomEvent, Mode, StreamManager
from .tools import Tool

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.plugins")

__all__ = [
    "SET_STEP_COMPLETE",
    "ContinuationPolicy",
    "ExponentialRetry",
    "ObserverRegistration",
    "ObserverRouter",
    "Plugin",
    "PluginManager",
    "RetryPolicy",
    "ToolInvocation",
    "ToolStep",
    "TurnContext",
]

_meta_warned = False


@runtime_checkable
class Plugin(Protocol):
    """A plugin: a ``name`` and any of the optional hooks the module docstring lists."""

    name: str


@dataclass(frozen=True)
class ToolInvocation:
    """One tool call as hooks see it: the model's ``tool_use`` id, the tool's name, the input."""

    id: str
    name: str
    input: dict[str, Any]


@dataclass(frozen=True)
class ToolStep:
    """One round of the tool loop, for a continuation policy: the calls that ran."""

    session_id: str
    turn_id: str
    seq: int
    calls: tuple[ToolInvocation, ...]
    meta_tools: tuple[str, ...]
    """The flow-control tools among the calls (``meta_tool_names``), in call order."""
    failed: bool
    """Whether some call failed or was refused."""


ContinuationVerdict = Literal["continue", "stop"]


class RetryPolicy(Protocol):
    """Whether to call the model again after a failed call: seconds to wait, or None."""

    def retry_delay(self, error: ProviderError, attempt: int, ctx: TurnContext) -> float | None: ...


class ContinuationPolicy(Protocol):
    """After a round of tool calls: ``"continue"`` (call the model again), ``"stop"`` (end
    the turn here) or None (the default: stop when a flow-control tool was called)."""

    def decide(
        self, step: ToolStep, ctx: TurnContext
    ) -> ContinuationVerdict | Awaitable[ContinuationVerdict | None] | None: ...


ModelCallNext = Callable[[ProviderRequest], AsyncIterator[ProviderEvent]]
ToolCallNext = Callable[[ToolInvocation], Awaitable[Any]]
ModelMiddleware = Callable[[Any, ProviderRequest, ModelCallNext], AsyncIterator[ProviderEvent]]
ToolMiddleware = Callable[[Any, ToolInvocation, ToolCallNext], Awaitable[Any]]
ChunkHandler = Callable[[Any, ProviderEvent], object]


class ExponentialRetry:
    """Retry a model call that failed with a retryable error (overloaded, rate limited, a
    5xx, a broken stream) up to ``max_attempts`` times in a turn, waiting ``base_delay``
    seconds doubled each time (at most ``max_delay``), with full jitter when ``jitter``.

    The SDK already retries a request that fails before its stream starts; this covers a
    stream that breaks midway (the partial reply is dropped and the call made again)."""

    def __init__(
        self,
        *,
        max_attempts: int = 2,
        base_delay: float = 0.5,
        max_delay: float = 8.0,
        jitter: bool = True,
    ) -> None:
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.jitter = jitter

    def retry_delay(self, error: ProviderError, attempt: int, ctx: TurnContext) -> float | None:
        if not error.retryable or attempt > self.max_attempts:
            return None
        delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return random.uniform(0.0, delay) if self.jitter else delay


class TurnContext:
    """What a hook knows of the turn it runs in.

    ``session`` is the row as the turn started; ``seq`` and ``model`` are those of the current
    model call (``model`` is the one actually called, a fallback while the session's is
    degraded). ``emit(name, data)`` adds a ``custom.*`` event to the turn's stream, delivered
    in order with the turn's own events (after the chunk or tool call during which it was
    emitted). ``pending`` is True while it holds events or notes that ``drain`` would give
    (the turn asks it for each streamed chunk, a plain attribute, before it drains)."""

    def __init__(self, runtime: SessionRuntime, session: Session, turn_id: str) -> None:
        self.runtime = runtime
        self.session = session
        self.turn_id = turn_id
        self.seq = 0
        self.model = session.model
        self._custom: list[CustomEvent] = []
        self._notes: list[tuple[str, dict[str, Any]]] = []
        self.pending = False

    @property
    def session_id(self) -> str:
        return self.session.id

    def emit(self, name: str, data: Mapping[str, Any] | None = None) -> CustomEvent:
        """Add ``custom.<name>`` to the turn's stream; returns the event."""
        event = custom_event(self.session.id, name, data)
        self._custom.append(event)
        self.pending = True
        return event

    def note(self, kind: str, payload: dict[str, Any]) -> None:
        """Have the turn write an event-log row (``kind``, ``payload``) with its commit."""
        self._notes.append((kind, {**payload, "turn_id": self.turn_id}))
        self.pending = True

    def drain(
        self, record: Callable[[str, dict[str, Any]], None] | None = None
    ) -> builtins.list[CustomEvent]:
        """The custom events emitted since the last drain (the turn yields them); notes go to
        ``record`` (the turn's event log)."""
        if not self._custom and not self._notes:
            return []
        if record is not None and self._notes:
            notes, self._notes = self._notes, []
            for kind, payload in notes:
                record(kind, payload)
        events, self._custom = self._custom, []
        self.pending = bool(self._notes)  # (notes stay when there is nothing to record them)
        return events


def custom_event(session_id: str, name: str, data: Mapping[str, Any] | None) -> CustomEvent:
    """A ``custom.<name>`` event (a leading ``custom.`` in ``name`` is not doubled)."""
    if name.startswith("custom."):
        name = name[len("custom.") :]
    if not name:
        raise ValueError("a custom event needs a name, such as 'progress'")
    return CustomEvent(session_id=session_id, name=name, data=dict(data or {}))


# -- flow control ---------------------------------------------------------------------------

SET_STEP_COMPLETE = Tool(
    name="set_step_complete",
    description=(
        "Signal that the task you were given is done. This ends your turn: make it your last "
        "tool call."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "summary": {"type": "string", "description": "one line on what was done"},
        },
    },
    fn=lambda _: "Step marked complete.",
)
"""The built-in ``set_step_complete`` (registered when ``meta_tool_names`` names it and no
tool of that name is registered)."""


# -- stream observers ---------------------------------------------------------------------------


class ObserverRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """A stream observer's registration (``rt.observer_router.register``)."""

    id: str
    mode: str
    origin: str = "host"


class ObserverRouter:
    """``runtime.observer_router``: stream observers registered at any time (plugins' are
    registered when the runtime is built). ``unregister`` returns a receipt saying whether it
    removed anything and whether the registration was ever known (the last 4,096 removed
    ones are remembered)."""

    FORGET_AFTER = 4096

    def __init__(self, stream: StreamManager) -> None:
        self._stream = stream
        self._live: dict[str, tuple[ObserverRegistration, Callable[[], bool]]] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()

    def register(
        self, observer: Callback, *, mode: Mode = "all", origin: str = "host"
    ) -> ObserverRegistration:
        """Call ``observer`` with every stream event of ``mode`` from now on."""
        unsubscribe = self._stream.subscribe(mode, observer)
        registration = ObserverRegistration(id=uuid7(), mode=mode, origin=origin)
        self._live[registration.id] = (registration, unsubscribe)
        return registration

    def unregister(self, registration: ObserverRegistration | str) -> ObserverUnregisterReceipt:
        reg_id = registration if isinstance(registration, str) else registration.id
        found = self._live.pop(reg_id, None)
        if found is None:
            return ObserverUnregisterReceipt(
                registration_id=reg_id, removed=False, was_registered=reg_id in self._gone
            )
        removed = found[1]()
        self._gone[reg_id] = None
        while len(self._gone) > self.FORGET_AFTER:
            self._gone.popitem(last=False)
        return ObserverUnregisterReceipt(
            registration_id=reg_id, removed=removed, was_registered=True
        )

    def list(self) -> builtins.list[ObserverRegistration]:
        return [registration for registration, _ in self._live.values()]

    def clear(self) -> int:
        """Unregister every observer; returns how many there were."""
        count = len(self._live)
        for reg_id in builtins.list(self._live):
            self.unregister(reg_id)
        return count


# -- the manager ------------------------------------------------------------------------------


class PluginManager:
    """``runtime.plugins``: the plugins and what they contributed; it also runs the turn's
    hooks (``model_stream``, ``call_tool``, ``retry_delay``, ``continuation``)."""

    def __init__(
        self,
        rt: SessionRuntime,
        plugins: Iterable[Plugin] = (),
        *,
        meta_tool_names: Iterable[str] | None = None,
    ) -> None:
        self._rt = rt
        self._plugins: dict[str, Plugin] = {}
        for plugin in plugins:
            name = getattr(plugin, "name", None)
            if not isinstance(name, str) or not name:
                raise ValueError(f"a plugin needs a non-empty string name, not {name!r}")
            if name in self._plugins:
                raise ValueError(f"two plugins are named {name!r}")
            self._plugins[name] = plugin
        self._meta_given = meta_tool_names is not None
        self.meta_tool_names: frozenset[str] = frozenset(meta_tool_names or ())
        self._unregistered_meta_warned = False
        self._prompts: list[PromptFragment] = []
        self._tools: list[Tool] = []
        self._policies: list[tuple[str, SafetyPolicy]] = []
        self._observers: list[tuple[str, Callback]] = []
        self._model_mw: list[tuple[str, ModelMiddleware]] = []
        self._tool_mw: list[tuple[str, ToolMiddleware]] = []
        self._chunk: list[tuple[str, ChunkHandler]] = []
        self._retry: RetryPolicy | None = None
        self._continuation: ContinuationPolicy | None = None
        for name, plugin in self._plugins.items():
            self._collect(name, plugin)

    def _collect(self, name: str, plugin: Plugin) -> None:
        for fragment in _items(plugin, "prompts"):
            if fragment.origin == "host":
                fragment = dataclasses.replace(fragment, origin=name)
            self._prompts.append(fragment)
        self._tools.extend(_items(plugin, "tools"))
        self._policies.extend((name, p) for p in _items(plugin, "safety_policies"))
        self._observers.extend((name, o) for o in _items(plugin, "stream_observers"))
        for attr, into in (
            ("wrap_model_call", self._model_mw),
            ("wrap_tool_call", self._tool_mw),
            ("on_stream_chunk", self._chunk),
        ):
            hook = getattr(plugin, attr, None)
            if callable(hook):
                into.append((name, hook))
        retry = _capability(plugin, "retry_policy")
        if retry is not None and self._retry is None:
            self._retry = retry
        elif retry is not None:
            log.warning("plugin %r's retry_policy is ignored: an earlier plugin gave one", name)
        continuation = _capability(plugin, "continuation_policy")
        if continuation is not None and self._continuation is None:
            self._continuation = continuation
        elif continuation is not None:
            log.warning(
                "plugin %r's continuation_policy is ignored: an earlier plugin gave one", name
            )

    def install(self) -> None:
        """Register the contributions with the runtime (tools, prompts, safety policies,
        observers), then call each plugin's ``setup``. Called once by the runtime."""
        rt = self._rt
        for tool in self._tools:
            rt.tools.register(tool)
        if (
            "set_step_complete" in self.meta_tool_names
            and rt.tools.get("set_step_complete") is None
        ):
            rt.tools.register(SET_STEP_COMPLETE)
        for fragment in self._prompts:
            rt.prompts.register(fragment)
        for origin, policy in self._policies:
            rt.safety.register(policy, origin=origin)
        for origin, observer in self._observers:
            rt.observer_router.register(observer, origin=origin)
        for plugin in self._plugins.values():
            setup = getattr(plugin, "setup", None)
            if callable(setup):
                setup(rt)
        self._probe_meta()
        missing = rt.safety.missing()
        if missing:
            log.warning(
                "safety policies %s are enabled but nobody registered them: every turn fails "
                "closed (an error event, no model call) until they are registered",
                missing,
            )

    def _probe_meta(self) -> None:
        """Warn once per process when flow-control tools are registered but
        ``meta_tool_names`` was not given: the tool loop then goes on after them (the
        reference's ``metaToolNames-config-missing`` warning)."""
        global _meta_warned
        if self._meta_given or _meta_warned:
            return
        found = sorted(FLOW_CONTROL_TOOLS & set(self._rt.tools.names()))
        if found:
            _meta_warned = True
            log.warning(
                "[metaToolNames-config-missing] tools %s are registered but SessionRuntime got "
                "no meta_tool_names: they are ordinary tool calls and the tool loop goes on "
                "after them instead of ending the turn. Pass meta_tool_names=%s (or () to "
                "keep them ordinary).",
                found,
                set(found),
            )

    # -- reads ------------------------------------------------------------------------------
    def list(self) -> builtins.list[str]:
        """The plugins' names, in the order given."""
        return builtins.list(self._plugins)

    def get(self, name: str) -> Plugin | None:
        return self._plugins.get(name)

    def collect_prompts(self) -> builtins.list[PromptFragment]:
        return builtins.list(self._prompts)

    def list_available_prompt_contributions(self) -> builtins.list[PromptFragment]:
        """Every prompt fragment plugins contributed (as the reference names it)."""
        return self.collect_prompts()

    def collect_tools(self) -> builtins.list[Tool]:
        return builtins.list(self._tools)

    def collect_safety_policies(self) -> builtins.list[SafetyPolicy]:
        return [p for _, p in self._policies]

    def collect_stream_observers(self) -> builtins.list[Callback]:
        return [o for _, o in self._observers]

    def collect_model_middleware(self) -> builtins.list[ModelMiddleware]:
        return [m for _, m in self._model_mw]

    def collect_tool_middleware(self) -> builtins.list[ToolMiddleware]:
        return [m for _, m in self._tool_mw]

    def collect_stream_chunk_handlers(self) -> builtins.list[ChunkHandler]:
        return [h for _, h in self._chunk]

    def collect_retry_policy(self) -> RetryPolicy | None:
        return self._retry

    def collect_continuation_policy(self) -> ContinuationPolicy | None:
        return self._continuation

    def get_safety_registry(self) -> SafetyRegistry:
        return self._rt.safety.get_registry()

    # -- the turn's hooks -------------------------------------------------------------------
    def turn_context(self, session: Session, turn_id: str) -> TurnContext:
        """The context the hooks of one turn share. The first turn says (once) which meta
        tools have no registered tool (no model can call those)."""
        self._probe_meta()
        unregistered = sorted(self.meta_tool_names - set(self._rt.tools.names()))
        if unregistered and not self._unregistered_meta_warned:
            self._unregistered_meta_warned = True
            log.warning(
                "meta tools %s have no registered tool, so no model is offered them: register "
                "a Tool of that name (what it does) or leave it out of meta_tool_names",
                unregistered,
            )
        return TurnContext(self._rt, session, turn_id)

    def model_stream(
        self, provider: Provider, request: ProviderRequest, ctx: TurnContext
    ) -> AsyncGenerator[ProviderEvent, None]:
        """One model call through the plugins' middleware and the safety policies; closing it
        closes every layer and the provider's stream."""
        if not self._model_mw and not self._chunk and not self._rt.safety.in_force:
            return provider.stream(request)
        return self._chain(provider, request, ctx)

    async def _chain(
        self, provider: Provider, request: ProviderRequest, ctx: TurnContext
    ) -> AsyncGenerator[ProviderEvent, None]:
        safety = self._rt.safety
        layers = self._model_mw
        opened: builtins.list[AsyncIterator[ProviderEvent]] = []

        async def innermost(req: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
            sent = await safety.check_request(req, ctx)
            stream = provider.stream(sent)
            opened.append(stream)
            async for event in stream:
                yield event

        def call_at(index: int) -> ModelCallNext:
            def call(req: ProviderRequest) -> AsyncIterator[ProviderEvent]:
                if index == len(layers):
                    stream: AsyncIterator[ProviderEvent] = innermost(req)
                else:
                    stream = layers[index][1](ctx, req, call_at(index + 1))
                opened.append(stream)
                return stream

            return call

        try:
            async for event in call_at(0)(request):
                for origin, handler in self._chunk:
                    try:
                        handler(ctx, event)
                    except Exception:  # an observer's bug must not break the call
                        log.exception("plugin %r's on_stream_chunk failed", origin)
                yield event
        except ProviderError:
            raise
        except Exception as exc:
            raise ProviderError(
                f"a plugin's model middleware failed: {type(exc).__name__}: {exc}",
                code="plugin_error",
            ) from exc
        finally:
            for stream in opened:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def call_tool(self, ctx: TurnContext, tool: Tool, call: ToolInvocation) -> str:
        """Run a tool call through the plugins' middleware and the safety policies (right
        before the tool). ``ToolRefused`` when a policy refuses; ``ToolError`` when it fails."""
        safety = self._rt.safety
        layers = self._tool_mw

        async def run(index: int, invocation: ToolInvocation) -> Any:
            if index == len(layers):
                checked = await safety.check_tool(invocation, ctx)
                return await tool.call(checked.input)
            return await layers[index][1](ctx, invocation, lambda i: run(index + 1, i))

        try:
            result = await run(0, call)
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(
                f"a plugin's tool middleware failed: {type(exc).__name__}: {exc}"
            ) from exc
        return result if isinstance(result, str) else str(result)

    def retry_delay(self, error: ProviderError, attempt: int, ctx: TurnContext) -> float | None:
        """Seconds to wait before calling the model again after ``error`` (the ``attempt``-th
        failure of the turn), or None to end the turn with the error. A policy refusal is
        never retried; a retry policy that raises gives up (logged)."""
        if self._retry is None or isinstance(error, RequestRefused):
            return None
        try:
            delay = self._retry.retry_delay(error, attempt, ctx)
        except Exception:
            log.exception("the retry policy failed; the call is not retried")
            return None
        return None if delay is None else max(float(delay), 0.0)

    async def continuation(self, step: ToolStep, ctx: TurnContext) -> str | None:
        """What ends the turn after a round of tool calls (the flow-control tool's name, or
        ``"continuation_policy"``), or None to call the model again."""
        verdict: ContinuationVerdict | None = None
        if self._continuation is not None:
            try:
                found = self._continuation.decide(step, ctx)
                verdict = await found if inspect.isawaitable(found) else found
            except Exception:
                log.exception("the continuation policy failed; the default applies")
                verdict = None
        if verdict == "continue":
            return None
        if step.meta_tools:
            return step.meta_tools[0]
        return "continuation_policy" if verdict == "stop" else None

    def step(
        self, ctx: TurnContext, seq: int, tool_uses: Iterable[Mapping[str, Any]], failed: bool
    ) -> ToolStep:
        """The ``ToolStep`` of a round of the tool loop (the reply's ``tool_use`` blocks)."""
        calls = tuple(
            ToolInvocation(
                id=str(b.get("id")), name=str(b.get("name")), input=dict(b.get("input") or {})
            )
            for b in tool_uses
        )
        meta = tuple(dict.fromkeys(c.name for c in calls if c.name in self.meta_tool_names))
        return ToolStep(
            session_id=ctx.session_id,
            turn_id=ctx.turn_id,
            seq=seq,
            calls=calls,
            meta_tools=meta,
            failed=failed,
        )


FLOW_CONTROL_TOOLS = frozenset({"set_step_complete", "wait_for_jobs"})
"""The reference's flow-control tools: registered without ``meta_tool_names``, they are
ordinary tool calls, and the runtime says so once."""


def _capability(plugin: Plugin, hook: str) -> Any:
    found = getattr(plugin, hook, None)
    return found() if callable(found) else None


def _items(plugin: Plugin, hook: str) -> builtins.list[Any]:
    found = getattr(plugin, hook, None)
    if not callable(found):
        return []
    return builtins.list(found() or ())


async def pause(seconds: float, abort_wait: asyncio.Future[Any] | None) -> bool:
    """Wait ``seconds`` (a retry's delay) unless the abort comes first; True if it did."""
    if seconds <= 0:
        return abort_wait is not None and abort_wait.done()
    if abort_wait is None:
        await asyncio.sleep(seconds)
        return False
    await asyncio.wait({abort_wait}, timeout=seconds)
    return abort_wait.done()
