"""``SessionRuntime``: one device's sessions, turns, ledger, event log and checkpoints.

The runtime is per process, the session per conversation. Every write goes through the
runtime's store in one transaction together with its outbox rows, so the device works offline
and sync drains the outbox later. Facets group the API as in the reference runtime:
``sessions``, ``events``, ``checkpoints``, ``audit``, ``tools``, ``interrupts`` and ``sync``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, KeysView, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from shared.clock import wall_clock_ms
from shared.errors import InvalidState, NotFound, PleachError, ProviderError, SessionLocked
from shared.ids import uuid7
from shared.records import Checkpoint, Message, Session, SessionState
from shared.tracing import Spans

from .artifacts import ArtifactsFacet
from .cache import RecordCache
from .core import DeviceCore, SessionChange, SessionHandle, existing
from .degradation import DegradationFacet
from .diagnostics import DiagnosticsFacet
from .facets import (
    AuditFacet,
    CheckpointsFacet,
    Decision,
    EventsFacet,
    InterruptsFacet,
    rebuild_message_ids,
)
from .files import FileRef, FilesFacet
from .hydration import hydrate, load_hydration
from .interrupts import InterruptConfig
from .legacy import LegacySurface, TenantFacet, deprecated
from .plugins import ObserverRouter, Plugin, PluginManager, custom_event
from .prompts import PromptsFacet
from .providers.base import Provider
from .receipts import InterruptResolveReceipt, SessionDeleteReceipt
from .safety import SafetyFacet, SafetyPolicy
from .store import STORE_ENV, from_env, from_url
from .store.base import StorageAdapter
from .store.memory import MemoryAdapter
from .stream import (
    Callback,
    Mode,
    SessionCreated,
    SessionResumed,
    StreamEvent,
    StreamEventBase,
    StreamManager,
)
from .subagents import SubagentManager
from .tasks import JobHandler, TasksFacet
from .tools import Tool, ToolRegistry, default_registry
from .turn import Resume, load_resume, run_turn

if TYPE_CHECKING:
    from .sync import SyncFacet

log = logging.getLogger("pleach.runtime")

DEFAULT_PROVIDER = "anthropic"
# The reference defaults to claude-sonnet-4-20250514, which the current API no longer lists.
DEFAULT_MODELS = {"anthropic": "claude-sonnet-4-6", "scripted": "scripted-1"}

_memory_warned = False

S = TypeVar("S")


class SessionConfigError(PleachError, ValueError):
    """``create_session`` got a config it cannot take; the message names the field."""


def session_config(
    provider: object = None,
    model: object = None,
    tools: object = None,
    title: object = "",
    **unknown: object,
) -> tuple[str | None, str | None, list[str] | None, str]:
    """Plain values from a session config, in either of its two shapes.

    Accepts plain values (``provider="anthropic"``, ``model="claude-sonnet-4-6"``,
    ``tools=["calculator"]``) or the reference's nested shape (``provider={"type": ...}``,
    ``model={"id": ...}``, ``tools={"enabled": [...]}``). Anything else raises
    ``SessionConfigError`` before anything is written.
    """
    if unknown:
        names = ", ".join(sorted(unknown))
        raise SessionConfigError(
            f"unknown session config field(s): {names}; expected provider, model, tools, title"
        )
    return (
        _config_value("provider", provider, "type"),
        _config_value("model", model, "id"),
        _config_tools(tools),
        _config_title(title),
    )


def _config_value(name: str, value: object, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        extra = sorted(str(k) for k in value if k != key)
        if extra or not isinstance(value.get(key), str) or not value.get(key):
            raise SessionConfigError(
                f"session config {name!r} must be a non-empty string or "
                f"{{{key!r}: <non-empty string>}}, not {value!r}"
            )
        return str(value[key])
    if isinstance(value, str) and value:
        return value
    raise SessionConfigError(
        f"session config {name!r} must be a non-empty string or "
        f"{{{key!r}: <non-empty string>}}, not {value!r}"
    )


def _config_tools(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        if set(value) != {"enabled"}:
            raise SessionConfigError(
                f"session config 'tools' must be a list of tool names or "
                f"{{'enabled': [names]}}, not {value!r}"
            )
        value = value["enabled"]
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise SessionConfigError(
        f"session config 'tools' must be a list of tool names or {{'enabled': [names]}}, "
        f"not {value!r}"
    )


MIN_THINKING_BUDGET = 1024
"""The smallest thinking budget the Messages API takes."""


def thinking_config(budget: object = None, thinking: object = None) -> int | None:
    """A session's thinking budget from ``thinking_budget=N`` or the nested
    ``thinking={"budget_tokens": N}``; ``SessionConfigError`` unless N >= 1024 (or None)."""
    if budget is not None and thinking is not None:
        raise SessionConfigError("give thinking_budget or thinking, not both")
    if isinstance(thinking, dict):
        if (
            set(thinking) - {"budget_tokens", "type"}
            or thinking.get("type", "enabled") != "enabled"
        ):
            raise SessionConfigError(
                f"session config 'thinking' must be {{'budget_tokens': N}}, not {thinking!r}"
            )
        budget = thinking.get("budget_tokens")
    elif thinking is not None:
        raise SessionConfigError(
            f"session config 'thinking' must be {{'budget_tokens': N}}, not {thinking!r}"
        )
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise SessionConfigError(
            f"session config 'thinking_budget' must be a whole number of tokens >= "
            f"{MIN_THINKING_BUDGET}, not {budget!r}"
        )
    return budget


def _config_title(value: object) -> str:
    if isinstance(value, str):
        return value
    raise SessionConfigError(f"session config 'title' must be a string, not {value!r}")


class SessionsFacet:
    """Session lifecycle: create, resume, find, list, save, delete."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt
        self._core = rt.core

    async def create(self, **config: Any) -> SessionHandle:
        """Mint a session and persist it before returning; provider and model are locked.

        ``config``: ``provider``, ``model``, ``tools``, ``title`` as plain values or in the
        reference's nested shape; anything else raises ``SessionConfigError`` at once.
        ``thinking_budget=N`` (or ``thinking={"budget_tokens": N}``, N >= 1024): every model
        call of the session thinks with up to N tokens, streamed as ``thinking.*`` events.
        """
        rt, core = self._rt, self._core
        thinking = thinking_config(
            config.pop("thinking_budget", None), config.pop("thinking", None)
        )
        provider, model, tools, title = session_config(**config)
        provider_name = provider or rt.default_provider_name
        model_id = model or DEFAULT_MODELS.get(provider_name, DEFAULT_MODELS["anthropic"])
        now = core.now()
        session = Session(
            id=uuid7(),
            org_id=core.org_id,
            user_id=core.user_id,
            client_id=core.client_id,
            hlc=now,
            provider=provider_name,
            model=model_id,
            created_at=now,
            updated_at=now,
            vv={},
            title=title,
            state=SessionState(),
            tools=list(tools) if tools is not None else rt.tools.names(),
            thinking_budget=thinking,
        )
        created = core.draft_event(
            session.id, "session.created", {"provider": provider_name, "model": model_id}
        )

        def create(current: Session | None) -> SessionChange:
            if current is not None:
                raise InvalidState(f"session {session.id} already exists")
            return SessionChange(row=session, events=[created])

        result = await core.write([(session.id, create)])
        row = result.sessions[session.id]
        handle = SessionHandle(id=row.id, record=row, layers=["created"])
        core.active = handle
        rt.emit(SessionCreated(session_id=row.id, provider=provider_name, model=model_id))
        return handle

    async def resume(self, session_id: str) -> SessionHandle:
        """Rebuild a session from its row, a newer checkpoint of its own lineage, and its
        event log.

        The checkpoint layer only ever moves the row forward along its own lineage: a
        checkpoint that descends from the row's head and extends its transcript. A checkpoint
        of a concurrent branch (another device's, pulled before this device's own version
        was pushed) is never overlaid, however recent its clock.
        """
        rt, core = self._rt, self._core
        row = await core.session(session_id)
        layers = ["row"]
        # A head without children has no descendant to overlay: the common case (the row at
        # its tip) reads which checkpoints hang off the head, not every checkpoint whole.
        head = row.head_checkpoint_id
        overlay = None
        if head is not None and await rt.store.child_checkpoints(session_id, head):
            overlay = _lineage_overlay(row, await rt.store.list_checkpoints(session_id))
        if overlay is not None:
            head_id, ids = overlay

            def forward(current: Session) -> SessionChange | None:
                if current.head_checkpoint_id != row.head_checkpoint_id:
                    return None  # the row moved on meanwhile: it is newer than the overlay
                state = msgspec.structs.replace(current.state, message_ids=ids)
                return SessionChange(
                    row=msgspec.structs.replace(current, head_checkpoint_id=head_id, state=state)
                )

            result = await core.write([(session_id, existing(forward))])
            row = result.sessions.get(session_id, row)
            layers.append("checkpoint")
        # The log's fold, kept by the store between resumes: read as it is when the log has
        # not changed since, folded on over the events after it when the log only grew
        # (``load_hydration``). A log read reads only the types the fold uses (a long
        # session's log is mostly message and checkpoint events); of the ones it counts (a
        # turn's turn.complete...) only the type and payload.
        hydrated, _ = await load_hydration(rt.store, session_id)
        layers.append("events")
        handle = SessionHandle(id=session_id, record=row, hydrated=hydrated, layers=layers)
        core.active = handle
        rt.emit(SessionResumed(session_id=session_id, layers=layers))
        return handle

    async def find(self, session_id: str) -> Session | None:
        row = await self._rt.store.get_session(session_id)
        return None if row is None or row.deleted else row

    async def list(self, *, include_deleted: bool = False) -> builtins.list[Session]:
        return await self._rt.store.list_sessions(include_deleted=include_deleted)

    async def messages(self, session_id: str) -> builtins.list[Message]:
        """The session's current transcript, in order (a message the row names but this
        device does not hold yet is left out). Kept, when whole, for the session's next turn
        (``DeviceCore.transcript``), which then reads no message again."""
        session = await self._core.session(session_id)
        return await self._core.history(session)

    async def save(self, session: Session) -> Session:
        """Persist an explicit change to a session row (title, tools, state...).

        Provider and model cannot change (``SessionLocked``). Returns the stored version.
        """

        def save(current: Session) -> SessionChange:
            if (session.provider, session.model) != (current.provider, current.model):
                raise SessionLocked("provider and model are locked; create a new session instead")
            row = msgspec.structs.replace(
                current, title=session.title, tools=session.tools, state=session.state
            )
            event = self._core.draft_event(session.id, "session.saved", {"title": row.title})
            return SessionChange(row=row, events=[event])

        result = await self._core.write([(session.id, existing(save))])
        return result.sessions[session.id]

    async def set_tools(self, session_id: str, names: Iterable[str]) -> Session:
        """Set which registered tools the session's model is offered (a session lists its tools
        when it is created, so a tool registered later is offered only once set here)."""
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if self._rt.tools.get(n) is None]
        if unknown:
            raise NotFound(f"no registered tool(s) {unknown}: register them first")

        def set_tools(current: Session) -> SessionChange:
            row = msgspec.structs.replace(current, tools=wanted)
            event = self._core.draft_event(current.id, "session.tools", {"tools": wanted})
            return SessionChange(row=row, events=[event])

        result = await self._core.write([(session_id, existing(set_tools))])
        return result.sessions[session_id]

    async def rename(self, session_id: str, title: str) -> Session:
        """Set the title of the session as it is now (concurrent edits are not undone)."""

        def rename(current: Session) -> SessionChange:
            event = self._core.draft_event(session_id, "session.saved", {"title": title})
            return SessionChange(row=msgspec.structs.replace(current, title=title), events=[event])

        result = await self._core.write([(session_id, existing(rename))])
        return result.sessions[session_id]

    async def update_provider_model(self, session_id: str, provider: str, model: str) -> None:
        """Always refused: a different provider or model means a new session."""
        raise SessionLocked(
            f"session {session_id} is locked to its provider and model; "
            "create a new session for another model"
        )

    async def delete(self, session_id: str) -> SessionDeleteReceipt:
        """Delete a session and its contents, here and, through sync, on every device.

        The row becomes a tombstone (so the delete syncs) and the session's messages,
        checkpoints and artifact updates are removed; its event log (with a
        ``session.deleted`` event) and audit rows stay: the log and the ledger are
        append-only. ``removed_from_cache`` says whether this runtime had the session loaded.
        """
        core = self._core
        was_loaded = core.cached(session_id) or (
            core.active is not None and core.active.id == session_id
        )
        found = await self._rt.store.get_session(session_id)
        checkpoints = (
            len(await self._rt.store.list_checkpoints(session_id)) if found is not None else 0
        )

        def delete(current: Session | None) -> SessionChange | None:
            if current is None or current.deleted:
                return None
            tomb = msgspec.structs.replace(
                current, deleted=True, state=SessionState(), head_checkpoint_id=None
            )
            event = core.draft_event(session_id, "session.deleted", {})
            return SessionChange(row=tomb, events=[event], purge=True)

        result = await core.write([(session_id, delete)])
        self._rt.interrupts.wake(session_id)  # a turn waiting there ends (the delete wins)
        if session_id not in result.sessions:
            return SessionDeleteReceipt(
                deleted=False, session_id=session_id, removed_from_cache=False
            )
        return SessionDeleteReceipt(
            deleted=True,
            session_id=session_id,
            removed_from_cache=was_loaded,
            checkpoints_removed=checkpoints,
        )


def _lineage_overlay(
    row: Session, checkpoints: builtins.list[Checkpoint]
) -> tuple[str, builtins.list[str]] | None:
    """The newest checkpoint that descends from the row's head and extends its transcript,
    as ``(checkpoint_id, message_ids)``; None when the row is already at its lineage's tip."""
    head = row.head_checkpoint_id
    if head is None or not checkpoints:
        return None
    by_id = {c.id: c for c in checkpoints}
    children: dict[str, builtins.list[Checkpoint]] = {}
    for cp in checkpoints:
        if cp.parent_id is not None:
            children.setdefault(cp.parent_id, []).append(cp)
    # the head's descendants, in one walk down (a walk up from every checkpoint was quadratic)
    descendants: builtins.list[Checkpoint] = []
    seen = {head}
    frontier = [head]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child.id not in seen:
                seen.add(child.id)
                descendants.append(child)
                frontier.append(child.id)
    # newest first; among equal clocks the first in the store's order, as before
    order = {cp.id: i for i, cp in enumerate(checkpoints)}
    descendants.sort(key=lambda cp: order[cp.id])
    descendants.sort(key=lambda cp: cp.hlc, reverse=True)
    for cp in descendants:
        ids = rebuild_message_ids(cp.id, by_id)
        if ids[: len(row.state.message_ids)] == row.state.message_ids:
            return cp.id, ids
    return None


class EventBus:
    """The live in-process bus: ``on``, ``once``, ``off`` by event type ("*" for all).

    ``idle`` is True exactly when no handler is attached (``emit`` would do nothing).
    ``types`` is a live view of the event types some handler takes ("*": every type): the
    runtime's own facets keep handlers of ``sync.applied`` here, so the bus is seldom idle,
    and a turn asks ``types`` for each streamed chunk, without a call, instead of ``emit``."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[tuple[Callback, bool]]] = {}
        self.types: KeysView[str] = self._handlers.keys()
        self.idle = True

    def on(self, event_type: str, handler: Callback) -> None:
        self._handlers.setdefault(event_type, []).append((handler, False))
        self.idle = False

    def once(self, event_type: str, handler: Callback) -> None:
        self._handlers.setdefault(event_type, []).append((handler, True))
        self.idle = False

    def off(self, event_type: str, handler: Callback) -> bool:
        handlers = self._handlers.get(event_type, [])
        for i, (h, _) in enumerate(handlers):
            if h == handler:
                del handlers[i]
                self._drop_empty(event_type)
                return True
        return False

    def clear(self) -> None:
        """Detach every handler."""
        self._handlers.clear()
        self.idle = True

    def _drop_empty(self, event_type: str) -> None:
        if not self._handlers.get(event_type, True):
            del self._handlers[event_type]
        self.idle = not self._handlers

    def emit(self, event: StreamEventBase) -> None:
        found = self._handlers
        if not found:  # (every streamed chunk comes here)
            return
        kind = event.type
        if kind not in found and "*" not in found:
            return
        for key in (kind, "*"):
            handlers = found.get(key)
            if not handlers:
                continue
            for handler, once in list(handlers):
                if once:
                    handlers.remove((handler, once))
                    self._drop_empty(key)
                try:
                    handler(event)
                except Exception:  # a listener's bug must not break the runtime
                    log.exception("event handler failed on %s", event.type)


class SessionRuntime(LegacySurface):
    """One user's sessions on this device. Use ``async with SessionRuntime(...) as rt``.

    ``storage`` is a store or a store URL (``pleach_client.store.from_url``); with none, the one
    ``$PLEACH_STORE`` names, else a non-durable ``MemoryAdapter`` (a warning is logged once), user
    ``"anonymous"`` and a generated client id that the store keeps. The device's state (clock,
    chain heads, caches, the write path) belongs to ``rt.core`` (a ``DeviceCore``).
    ``wall_clock`` (milliseconds since the epoch) replaces the system clock under the HLC, for
    simulations and tests of skew (and of interrupt deadlines).
    ``interrupt``: which tool calls wait for a person's decision (``InterruptConfig``); any
    runtime can decide interrupts (``rt.interrupts``), with or without one.
    ``span_exporter`` (an OpenTelemetry ``SpanExporter``) or ``tracer_provider``: export spans
    of every turn, model call, tool call, sync flush and pull (``rt.spans``; needs
    ``pleach[otel]``). Neither: spans are counted, not exported.
    ``fallbacks``: the model to call while a model is degraded (``rt.degradation``).
    ``cache``: the record cache of immutable messages (``rt.cache``; by default 1,000 entries
    and 64 MB; a ``RecordCache`` of your own, or None to turn it off).
    ``plugins``: what they contribute (prompts, tools, middleware, policies, observers;
    ``rt.plugins``, ``pleach_client.plugins``). ``meta_tool_names``: the flow-control tools
    that end a turn (``set_step_complete``, ``wait_for_jobs``; a warning is logged once when
    it is not given). ``safety_policies`` (the host's) and ``enabled_safety_policies`` (the
    ids that run; ``rt.safety``). ``seed_core_defaults``: the core prompt fragments
    (``rt.prompts``).
    Subagents and jobs (``rt.tasks``, ``pleach_client.tasks``): ``enable_subagent_concurrency``
    and ``max_concurrent_subagents`` (default 4; 1 at a time without concurrency) bound how
    many subagents run at once, ``max_subagent_depth`` (default 1) how deep they nest;
    ``job_handlers`` run job kinds here, ``job_dispatch_endpoint`` receives (as a POST, with
    ``auth_token`` as its bearer token) the jobs no handler runs.
    """

    def __init__(
        self,
        storage: StorageAdapter | str | None = None,
        provider: Provider | None = None,
        *,
        user_id: str = "anonymous",
        org_id: str = "default",
        client_id: str | None = None,
        tools: Iterable[Tool] | ToolRegistry | None = None,
        system: str | None = None,
        max_tool_iterations: int = 8,
        max_tokens: int = 4096,
        subject_key: str | None = None,
        wall_clock: Callable[[], int] | None = None,
        interrupt: InterruptConfig | None = None,
        span_exporter: Any | None = None,
        tracer_provider: Any | None = None,
        fallbacks: dict[str, str] | None = None,
        cache: RecordCache[Message] | bool | None = True,
        plugins: Iterable[Plugin] = (),
        meta_tool_names: Iterable[str] | None = None,
        safety_policies: Iterable[SafetyPolicy] = (),
        enabled_safety_policies: Iterable[str] = (),
        seed_core_defaults: bool = True,
        enable_subagent_concurrency: bool = False,
        max_concurrent_subagents: int = 4,
        max_subagent_depth: int = 1,
        job_dispatch_endpoint: str | None = None,
        auth_token: str | None = None,
        job_handlers: Iterable[JobHandler] = (),
    ) -> None:
        global _memory_warned
        if isinstance(storage, str):
            storage = from_url(storage)
        elif storage is None and os.environ.get(STORE_ENV):
            storage = from_env()
        if storage is None:
            storage = MemoryAdapter()
            if not _memory_warned:
                _memory_warned = True
                log.warning(
                    "SessionRuntime is using the in-memory store: nothing survives a restart. "
                    "Pass SQLiteAdapter(path) for a durable device store."
                )
        self.store: StorageAdapter = storage
        self._wall_clock = wall_clock or wall_clock_ms
        self.core = DeviceCore(
            storage,
            org_id=org_id,
            user_id=user_id,
            client_id=client_id,
            wall_clock=self._wall_clock,
            cache=RecordCache() if cache is True else (None if cache is False else cache),
        )
        self.interrupt = interrupt
        self._provider = provider
        self._unoffered_warned: set[tuple[str, str]] = set()
        if isinstance(tools, ToolRegistry):
            self.tools = tools
        else:
            self.tools = default_registry()
            for tool in tools or ():
                self.tools.register(tool)
        self.system = system
        self.max_tool_iterations = max_tool_iterations
        self.max_tokens = max_tokens
        self.subject_key = subject_key or user_id
        self.stream = StreamManager()
        self.bus = EventBus()
        # runtime.spans: OpenTelemetry spans of turns, model and tool calls and sync (no-op
        # without an exporter or a provider; see shared.tracing).
        self.spans = Spans(
            exporter=span_exporter, tracer_provider=tracer_provider, service_name="pleach-client"
        )
        self.diagnostics = DiagnosticsFacet(self)
        # runtime.degradation: failing models routed around (``fallbacks`` maps a model to
        # the one to call while it is degraded).
        self.degradation = DegradationFacet(fallbacks=fallbacks)
        self.sessions = SessionsFacet(self)
        self.events = EventsFacet(self)
        self.checkpoints = CheckpointsFacet(self)
        self.audit = AuditFacet(self)
        self.artifacts = ArtifactsFacet(self)
        self.interrupts = InterruptsFacet(self)
        # runtime.tasks (the reference's runtime.async): subagents and background jobs.
        self.tasks = TasksFacet(
            self,
            enable_subagent_concurrency=enable_subagent_concurrency,
            max_concurrent_subagents=max_concurrent_subagents,
            max_subagent_depth=max_subagent_depth,
            job_dispatch_endpoint=job_dispatch_endpoint,
            auth_token=auth_token,
            job_handlers=job_handlers,
        )
        # rt.tenant, rt.files, rt.observer_router, rt.safety, rt.prompts and rt.plugins; the
        # plugins' contributions are installed last, on the runtime as built so far.
        self.tenant = TenantFacet(self.core)
        self.files = FilesFacet(self)
        self.observer_router = ObserverRouter(self.stream)
        self.safety = SafetyFacet(enabled=enabled_safety_policies, policies=safety_policies)
        self.prompts = PromptsFacet(self, seed_core_defaults=seed_core_defaults)
        self.plugins = PluginManager(self, plugins, meta_tool_names=meta_tool_names)
        self.plugins.install()
        self._opened = False
        self._sync: SyncFacet | None = None

    @property
    def sync(self) -> SyncFacet:
        """``rt.sync`` (``pleach_client.sync``), made when first asked for: a runtime that
        never syncs never imports the sync client and its WebSocket stack (about 35 ms of a
        process's start). Nothing is lost before: a connection's first round flushes whatever
        is queued."""
        if self._sync is None:
            from .sync import SyncFacet  # sync builds on the runtime; imported late on purpose

            self._sync = SyncFacet(self)
            self.core.on_local_write(self._sync.notify_local_write)
        return self._sync

    @property
    def client_id(self) -> str:
        return self.core.client_id

    @property
    def cache(self) -> RecordCache[Message] | None:
        """``runtime.cache``: the record cache (``metrics_snapshot()``), None when disabled."""
        return self.core.cache

    @property
    def org_id(self) -> str:
        return self.core.org_id

    @property
    def user_id(self) -> str:
        return self.core.user_id

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> SessionRuntime:
        if self._opened:
            return self
        await self.core.open()
        self.interrupts.open()
        self._opened = True
        await self.tasks.open()
        return self

    async def close(self) -> None:
        """Close the store (and the sync connection). A turn waiting for decisions is
        suspended first: what it committed stays, and ``rt.interrupts.resume`` continues it
        after the runtime is opened again."""
        if not self._opened:
            return
        self._opened = False
        try:
            await asyncio.shield(self.interrupts.close())
            await asyncio.shield(self.tasks.close())
            if self._sync is not None:
                await asyncio.shield(self._sync.disconnect())
        finally:
            await asyncio.shield(self.store.close())

    async def destroy(self) -> None:
        """Close, and detach every listener: the live bus's handlers, stream subscribers and
        observers. The runtime is done; build a new one to go on."""
        await self.close()
        self.stream.clear()
        self.observer_router.clear()
        self.bus.clear()

    async def __aenter__(self) -> SessionRuntime:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- flat surface (as in the reference) --------------------------------------------------
    async def create_session(self, **config: Any) -> SessionHandle:
        return await self.sessions.create(**config)

    async def resume_session(self, session_id: str) -> SessionHandle:
        return await self.sessions.resume(session_id)

    async def delete_session(self, session_id: str) -> SessionDeleteReceipt:
        return await self.sessions.delete(session_id)

    def get_active_session(self) -> SessionHandle | None:
        return self.core.active

    def execute_message(
        self,
        session_id: str,
        content: str,
        *,
        abort: asyncio.Event | None = None,
        file_references: Sequence[FileRef] = (),
    ) -> AsyncGenerator[StreamEvent, None]:
        """Run one turn, yielding stream events as they happen.

        Set ``abort`` (or cancel the consuming task, or ``aclose()`` the generator) to abort:
        the partial turn is still committed and accounted. Close the generator when you stop
        early: ``async with contextlib.aclosing(rt.execute_message(...)) as events``.
        ``file_references``: files the model sees with the message (``pleach_client.files``).
        """
        # The turn itself (``run_turn``: the session's turn lock, each event emitted): no
        # generator of its own here, which every streamed chunk would pass through.
        return run_turn(self, session_id, content, abort, files=file_references)

    async def resume_turn(
        self, session_id: str, *, abort: asyncio.Event | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Continue the turn that waits for decisions in ``session_id`` after a restart (its
        runtime closed or its process died while it waited; ``rt.interrupts.resume``).

        It waits for what is still undecided (deadlines that passed apply their default at
        once), runs the tool calls as decided and goes on like any turn. ``InvalidState``
        when no turn waits there, when it waits in this process already, or when it is
        another device's turn (decide there, or here with ``rt.interrupts.resolve``).
        """
        if self.interrupts.waiting_here(session_id):
            raise InvalidState(
                f"the turn of session {session_id} is waiting in this process: decide with "
                "rt.interrupts.resolve and it goes on"
            )
        async with self.core.turn_lock(session_id):
            resume: Resume = await load_resume(self, session_id)
            events = run_turn(self, session_id, None, abort, resume, locked=True)
            async with contextlib.aclosing(events) as turn:
                async for event in turn:
                    yield event

    async def resolve_interrupt(
        self, interrupt_id: str, decision: Decision, *, wait: float | None = None
    ) -> InterruptResolveReceipt:
        """Decide an interrupt (``rt.interrupts.resolve``)."""
        return await self.interrupts.resolve(interrupt_id, decision, wait=wait)

    def get_interrupt_manager(self) -> InterruptsFacet | None:
        """``rt.interrupts`` when this runtime's turns ask for approval (an enabled
        ``InterruptConfig``), else None (as in the reference; ``rt.interrupts`` itself is
        always there, so any device can decide another's interrupts)."""
        deprecated("get_interrupt_manager", "rt.interrupts")
        enabled = self.interrupt is not None and self.interrupt.enabled
        return self.interrupts if enabled else None

    def get_async_task_manager(self) -> TasksFacet:
        """``rt.tasks``: subagents and background jobs (the reference's ``runtime.async``)."""
        return self.tasks

    def get_subagent_manager(self) -> SubagentManager | None:
        """``rt.tasks.subagents`` when subagent concurrency is enabled, else None (as in the
        reference; subagents still run one at a time through ``rt.tasks.spawn``)."""
        return self.tasks.subagents if self.tasks.subagents.concurrency else None

    def wall_ms(self) -> int:
        """The wall clock (ms since the epoch) under this runtime's HLC and deadlines."""
        return self._wall_clock()

    def warn_unoffered_tools(self, session: Session) -> None:
        """Log once per session and tool a registered tool the session does not offer (it
        lists its tools at creation): ``rt.sessions.set_tools`` enables it."""
        for name in self.tools.names():
            key = (session.id, name)
            if name not in session.tools and key not in self._unoffered_warned:
                self._unoffered_warned.add(key)
                log.warning(
                    "tool %r is registered but not offered in session %s (a session lists its "
                    "tools when created): rt.sessions.set_tools(%r, [...]) enables it",
                    name,
                    session.id,
                    session.id,
                )

    def subscribe_to_stream(self, mode: Mode, callback: Callback) -> Callable[[], bool]:
        """Call ``callback`` for every event of ``mode``; returns the unsubscribe function."""
        return self.stream.subscribe(mode, callback)

    def get_stream_manager(self) -> StreamManager:
        return self.stream

    def get_store(self) -> StorageAdapter:
        return self.store

    @property
    def default_provider_name(self) -> str:
        return self._provider.name if self._provider is not None else DEFAULT_PROVIDER

    def emit(self, event: StreamEventBase) -> None:
        """Deliver a stream event to stream subscribers and the event bus."""
        if not self.stream.idle:
            self.stream.emit(event)
        if not self.bus.idle:
            self.bus.emit(event)

    def emit_custom(
        self, session_id: str, name: str, data: dict[str, Any] | None = None
    ) -> StreamEventBase:
        """Deliver a ``custom.<name>`` event to stream subscribers (the ``custom`` mode) and
        the bus now; returns it. (A plugin's ``ctx.emit`` goes through its turn instead.)"""
        event = custom_event(session_id, name, data)
        self.emit(event)
        return event

    def provider_for(self, session: Session) -> Provider:
        """The provider for a turn of ``session``; ``ProviderError`` if it is locked to
        another provider than this runtime's."""
        if self._provider is None:
            from .providers.anthropic import AnthropicProvider

            self._provider = AnthropicProvider.from_env()
        if self._provider.name != session.provider:
            raise ProviderError(
                f"session is locked to provider {session.provider!r}; this runtime has "
                f"{self._provider.name!r}",
                code="provider_unavailable",
            )
        return self._provider


__all__ = [
    "InterruptConfig",
    "SessionConfigError",
    "SessionHandle",
    "SessionRuntime",
    "hydrate",
    "session_config",
]
