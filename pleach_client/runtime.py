"""``SessionRuntime``: one device's sessions, turns, ledger, event log and checkpoints.

The runtime is per process, the session per conversation. Every write goes through the
runtime's store in one transaction together with its outbox rows, so the device works offline
and sync drains the outbox later. Facets group the API as in the reference runtime:
``sessions``, ``events``, ``checkpoints``, ``audit``, ``tools`` and ``sync``.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec

from shared.clock import HybridClock, vv_bump
from shared.errors import NotFound, SessionLocked
from shared.hashchain import chain_audit, chain_event
from shared.ids import uuid7
from shared.records import (
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Outcome,
    Record,
    Session,
    SessionState,
    Usage,
)

from .artifacts import ArtifactsFacet
from .facets import AuditFacet, CheckpointsFacet, EventsFacet
from .providers.base import Provider
from .receipts import SessionDeleteReceipt
from .store.base import StorageAdapter, WriteBatch
from .store.memory import MemoryAdapter
from .stream import Callback, Mode, SessionCreated, SessionResumed, StreamEventBase, StreamManager
from .tools import Tool, ToolRegistry, default_registry
from .turn import run_turn

log = logging.getLogger("pleach.runtime")

DEFAULT_PROVIDER = "anthropic"
# The reference defaults to claude-sonnet-4-20250514, which the current API no longer lists.
DEFAULT_MODELS = {"anthropic": "claude-sonnet-4-6", "scripted": "scripted-1"}

_memory_warned = False
HISTORY_CACHE_SESSIONS = 16  # transcripts kept decoded in memory, least recently used dropped

S = TypeVar("S")


@dataclass
class SessionHandle:
    """A session loaded into the runtime. ``id`` is what every other call takes.

    ``hydrated`` is transient state folded from the event log on resume (turn counts, last
    outcome, conflicts); it is never written back to the row.
    """

    id: str
    record: Session
    hydrated: dict[str, Any] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)

    @property
    def provider(self) -> str:
        return self.record.provider

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def title(self) -> str:
        return self.record.title

    @property
    def message_ids(self) -> list[str]:
        return list(self.record.state.message_ids)


class SessionsFacet:
    """Session lifecycle: create, resume, find, list, save, delete."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    async def create(
        self,
        *,
        provider: str | None = None,
        model: str | None = None,
        title: str = "",
        tools: list[str] | None = None,
    ) -> SessionHandle:
        """Mint a session and persist it before returning; provider and model are locked."""
        rt = self._rt
        provider_name = provider or rt.default_provider_name
        model_id = model or DEFAULT_MODELS.get(provider_name, DEFAULT_MODELS["anthropic"])
        now = rt._clock.now()
        session = Session(
            id=uuid7(),
            org_id=rt.org_id,
            user_id=rt.user_id,
            client_id=rt.client_id,
            hlc=now,
            provider=provider_name,
            model=model_id,
            created_at=now,
            updated_at=now,
            vv={rt.client_id: 1},
            title=title,
            state=SessionState(),
            tools=list(tools) if tools is not None else rt.tools.names(),
        )
        rt._event_heads[session.id] = (0, "")
        created = rt._new_event(
            session, "session.created", {"provider": provider_name, "model": model_id}
        )
        await rt._write([created, session])
        handle = SessionHandle(id=session.id, record=session, layers=["created"])
        rt._active = handle
        rt._emit(SessionCreated(session_id=session.id, provider=provider_name, model=model_id))
        return handle

    async def resume(self, session_id: str) -> SessionHandle:
        """Rebuild a session from its row, a newer checkpoint, and its event log."""
        rt = self._rt
        row = await rt.store.get_session(session_id)
        if row is None or row.deleted:
            raise NotFound(f"no session {session_id}")
        layers = ["row"]
        checkpoints = await rt.store.list_checkpoints(session_id)
        if checkpoints:
            latest = checkpoints[-1]
            if latest.hlc >= row.updated_at and latest.id != row.head_checkpoint_id:
                ids = rt.checkpoints._rebuild(latest.id, {c.id: c for c in checkpoints})
                row = msgspec.structs.replace(
                    row,
                    head_checkpoint_id=latest.id,
                    state=msgspec.structs.replace(row.state, message_ids=ids),
                )
                layers.append("checkpoint")
        events = await rt.store.list_events(session_id)
        rt._event_heads[session_id] = (
            (events[-1].sequence_number, events[-1].row_hash) if events else (0, "")
        )
        hydrated = hydrate(events)
        layers.append("events")
        rt._cache[session_id] = row
        handle = SessionHandle(id=session_id, record=row, hydrated=hydrated, layers=layers)
        rt._active = handle
        rt._emit(SessionResumed(session_id=session_id, layers=layers))
        return handle

    async def find(self, session_id: str) -> Session | None:
        row = await self._rt.store.get_session(session_id)
        return None if row is None or row.deleted else row

    async def list(self, *, include_deleted: bool = False) -> list[Session]:
        return await self._rt.store.list_sessions(include_deleted=include_deleted)

    async def messages(self, session_id: str) -> builtins.list[Message]:
        """The session's current transcript, in order."""
        session = await self._rt._load_session(session_id)
        return await self._rt.store.get_messages(session.state.message_ids)

    async def save(self, session: Session) -> Session:
        """Persist an explicit change to a session row (title, jobs, artifacts...).

        Provider and model cannot change (``SessionLocked``). Returns the stored version.
        """
        rt = self._rt
        current = await rt._load_session(session.id)
        if (session.provider, session.model) != (current.provider, current.model):
            raise SessionLocked("provider and model are locked; create a new session instead")
        updated = rt._bump(session, base=current)
        saved = rt._new_event(updated, "session.saved", {"title": updated.title})
        await rt._write([saved, updated])
        return updated

    async def rename(self, session_id: str, title: str) -> Session:
        current = await self._rt._load_session(session_id)
        return await self.save(msgspec.structs.replace(current, title=title))

    async def update_provider_model(self, session_id: str, provider: str, model: str) -> None:
        """Always refused: a different provider or model means a new session."""
        raise SessionLocked(
            f"session {session_id} is locked to its provider and model; "
            "create a new session for another model"
        )

    async def delete(self, session_id: str) -> SessionDeleteReceipt:
        """Tombstone the session, drop its checkpoints; audit rows stay (append-only)."""
        rt = self._rt
        row = await rt.store.get_session(session_id)
        if row is None or row.deleted:
            return SessionDeleteReceipt(
                deleted=False, session_id=session_id, removed_from_cache=False
            )
        checkpoints = await rt.store.list_checkpoints(session_id)
        tomb = rt._bump(msgspec.structs.replace(row, deleted=True), base=row)
        deleted_event = rt._new_event(tomb, "session.deleted", {})
        await rt._write([deleted_event, tomb], purge_checkpoints_for=[session_id])
        removed = rt._cache.pop(session_id, None) is not None
        rt._event_heads.pop(session_id, None)
        if rt._active is not None and rt._active.id == session_id:
            rt._active = None
        return SessionDeleteReceipt(
            deleted=True,
            session_id=session_id,
            removed_from_cache=removed,
            checkpoints_removed=len(checkpoints),
        )


def hydrate(events: list[Event]) -> dict[str, Any]:
    """Fold the event log into transient card-lifecycle state (never stored on the row)."""
    state: dict[str, Any] = {
        "turns": 0,
        "aborted_turns": 0,
        "errors": 0,
        "tool_calls": 0,
        "tool_failures": 0,
        "last_outcome": None,
        "rollbacks": 0,
        "conflicts": [],
    }
    for ev in events:
        match ev.type:
            case "turn.complete":
                state["turns"] += 1
                state["last_outcome"] = ev.payload.get("outcome")
                if ev.payload.get("outcome") == "user-aborted":
                    state["aborted_turns"] += 1
            case "error":
                state["errors"] += 1
            case "tool.completed":
                state["tool_calls"] += 1
            case "tool.failed":
                state["tool_calls"] += 1
                state["tool_failures"] += 1
            case "checkpoint.rollback":
                state["rollbacks"] += 1
            case "sync.conflict":
                state["conflicts"].append(ev.payload.get("conflict_id"))
    return state


class EventBus:
    """The live in-process bus: ``on``, ``once``, ``off`` by event type ("*" for all)."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[tuple[Callback, bool]]] = {}

    def on(self, event_type: str, handler: Callback) -> None:
        self._handlers.setdefault(event_type, []).append((handler, False))

    def once(self, event_type: str, handler: Callback) -> None:
        self._handlers.setdefault(event_type, []).append((handler, True))

    def off(self, event_type: str, handler: Callback) -> bool:
        handlers = self._handlers.get(event_type, [])
        for i, (h, _) in enumerate(handlers):
            if h == handler:
                del handlers[i]
                return True
        return False

    def emit(self, event: StreamEventBase) -> None:
        for key in (event.type, "*"):
            handlers = self._handlers.get(key)
            if not handlers:
                continue
            for handler, once in list(handlers):
                if once:
                    handlers.remove((handler, once))
                try:
                    handler(event)
                except Exception:  # a listener's bug must not break the runtime
                    log.exception("event handler failed on %s", event.type)


class SessionRuntime:
    """One user's sessions on this device. Use ``async with SessionRuntime(...) as rt``.

    With no arguments: a non-durable ``MemoryAdapter`` (a warning is logged once), user
    ``"anonymous"`` and a generated client id that the store keeps.
    """

    def __init__(
        self,
        storage: StorageAdapter | None = None,
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
    ) -> None:
        global _memory_warned
        if storage is None:
            storage = MemoryAdapter()
            if not _memory_warned:
                _memory_warned = True
                log.warning(
                    "SessionRuntime is using the in-memory store: nothing survives a restart. "
                    "Pass SQLiteAdapter(path) for a durable device store."
                )
        self.store: StorageAdapter = storage
        self._provider = provider
        self.user_id = user_id
        self.org_id = org_id
        self._requested_client_id = client_id
        self.client_id = client_id or ""
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
        self.sessions = SessionsFacet(self)
        self.events = EventsFacet(self)
        self.checkpoints = CheckpointsFacet(self)
        self.audit = AuditFacet(self)
        self.artifacts = ArtifactsFacet(self)
        self._clock = HybridClock("pending")
        self._cache: dict[str, Session] = {}
        self._event_heads: dict[str, tuple[int, str]] = {}
        self._histories: dict[str, tuple[list[str], list[Message]]] = {}
        self._audit_head: tuple[int, str] = (0, "")
        self._active: SessionHandle | None = None
        self._turn_locks: dict[str, asyncio.Lock] = {}
        self._opened = False
        from .sync import SyncFacet  # sync builds on the runtime; imported late on purpose

        self.sync = SyncFacet(self)

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> SessionRuntime:
        if self._opened:
            return self
        await self.store.open()
        stored = await self.store.get_meta("client_id")
        if stored is None:
            self.client_id = self._requested_client_id or uuid7()
            await self.store.set_meta("client_id", self.client_id)
        else:
            self.client_id = stored
        self._clock = HybridClock(self.client_id, last=await self.store.get_meta("hlc"))
        head = await self.store.get_meta(f"audit_head:{self.client_id}")
        if head:
            seq, _, digest = head.partition(":")
            self._audit_head = (int(seq), digest)
        self._opened = True
        return self

    async def close(self) -> None:
        if not self._opened:
            return
        self._opened = False
        try:
            await asyncio.shield(self.sync.disconnect())
        finally:
            await asyncio.shield(self.store.close())

    async def destroy(self) -> None:
        await self.close()

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
        return self._active

    async def execute_message(
        self, session_id: str, content: str, *, abort: asyncio.Event | None = None
    ) -> AsyncIterator[StreamEventBase]:
        """Run one turn, yielding stream events as they happen.

        Set ``abort`` (or cancel the consuming task, or ``aclose()`` the generator) to abort:
        the partial turn is still committed and accounted. Close the generator when you stop
        early: ``async with contextlib.aclosing(rt.execute_message(...)) as events``.
        """
        lock = self._turn_locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            turn = cast(
                AsyncGenerator[StreamEventBase, None], run_turn(self, session_id, content, abort)
            )
            try:
                async for event in turn:
                    self._emit(event)
                    yield event
            finally:
                await turn.aclose()

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

    # -- internals used by the turn, the facets and sync ------------------------------------
    def _emit(self, event: StreamEventBase) -> None:
        self.stream.emit(event)
        self.bus.emit(event)

    def _provider_for(self, session: Session) -> Provider:
        from shared.errors import ProviderError

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

    async def _load_session(self, session_id: str) -> Session:
        cached = self._cache.get(session_id)
        if cached is not None:
            return cached
        row = await self.store.get_session(session_id)
        if row is None or row.deleted:
            raise NotFound(f"no session {session_id}")
        if session_id not in self._event_heads:
            events = await self.store.list_events(session_id)
            self._event_heads[session_id] = (
                (events[-1].sequence_number, events[-1].row_hash) if events else (0, "")
            )
        self._cache[session_id] = row
        return row

    def _bump(self, session: Session, *, base: Session) -> Session:
        """``session`` as a new local version after ``base``: vector bumped, stamped now."""
        now = self._clock.now()
        return msgspec.structs.replace(
            session,
            client_id=self.client_id,
            hlc=now,
            updated_at=now,
            vv=vv_bump(base.vv, self.client_id),
        )

    def _new_event(self, session: Session, kind: str, payload: dict[str, Any]) -> Event:
        seq, prev = self._event_heads.get(session.id, (0, ""))
        event = chain_event(
            Event(
                id=uuid7(),
                session_id=session.id,
                org_id=session.org_id,
                user_id=session.user_id,
                client_id=self.client_id,
                hlc=self._clock.now(),
                type=kind,
                payload=payload,
            ),
            prev,
            seq + 1,
        )
        self._event_heads[session.id] = (event.sequence_number, event.row_hash)
        return event

    def _new_audit(
        self,
        *,
        session: Session,
        turn_id: str,
        stage_id: str,
        seq_within_turn: int,
        provider: str,
        request_id: str | None,
        usage: Usage,
        latency_ms: float,
        cost: float | None,
        outcome: Outcome,
    ) -> AuditRow:
        seq, prev = self._audit_head
        row = chain_audit(
            AuditRow(
                id=uuid7(),
                org_id=self.org_id,
                user_id=self.user_id,
                client_id=self.client_id,
                hlc=self._clock.now(),
                session_id=session.id,
                turn_id=turn_id,
                stage_id=stage_id,
                seq_within_turn=seq_within_turn,
                provider=provider,
                model=session.model,
                outcome=outcome,
                usage=usage,
                request_id=request_id,
                latency_ms=round(latency_ms, 3),
                cost_usd=cost,
                subject_key=self.subject_key,
                detail={"user_id": self.user_id},
            ),
            prev,
            seq + 1,
        )
        self._audit_head = (row.sequence_number, row.row_hash)
        return row

    def _new_checkpoint(
        self,
        session: Session,
        *,
        turn_id: str | None,
        reason: str,
        appended: list[str],
        snapshot: list[str] | None = None,
        parent_id: str | None = None,
    ) -> Checkpoint:
        return Checkpoint(
            id=uuid7(),
            session_id=session.id,
            org_id=session.org_id,
            user_id=session.user_id,
            client_id=self.client_id,
            hlc=self._clock.now(),
            parent_id=parent_id if parent_id is not None else session.head_checkpoint_id,
            turn_id=turn_id,
            kind=reason,  # type: ignore[arg-type]
            appended=appended,
            snapshot=snapshot,
        )

    async def _write(self, records: list[Record], **batch: Any) -> None:
        """Commit records with their outbox rows and the clock, in one transaction."""
        meta = {
            "hlc": self._clock.last,
            f"audit_head:{self.client_id}": f"{self._audit_head[0]}:{self._audit_head[1]}",
        }
        try:
            await self.store.commit(WriteBatch(records=records, meta=meta, **batch))
        except BaseException:
            # Chain heads were advanced for rows that did not land: reload them next time.
            for record in records:
                if isinstance(record, Event):
                    self._event_heads.pop(record.session_id, None)
                    self._cache.pop(record.session_id, None)
            await self._reload_audit_head()
            raise
        self.sync.notify_local_write()
        for record in records:
            if isinstance(record, Session):
                self._cache[record.id] = record
                if self._active is not None and self._active.id == record.id:
                    self._active.record = record

    async def _reload_audit_head(self) -> None:
        head = await self.store.get_meta(f"audit_head:{self.client_id}")
        seq, _, digest = (head or "0:").partition(":")
        self._audit_head = (int(seq), digest)

    async def _commit_turn(
        self,
        session: Session,
        messages: list[Message],
        checkpoint: Checkpoint,
        events: list[Event],
        audit: list[AuditRow],
    ) -> None:
        # Order matters for sync: referenced records precede the session row in the outbox.
        before = self._histories.get(session.id)
        await self._write([*messages, checkpoint, *events, *audit, session])
        if before is not None:
            ids, history = before
            if ids + [m.id for m in messages] == session.state.message_ids:
                self._remember(session.id, session.state.message_ids, history + messages)

    async def _history(self, session: Session) -> list[Message]:
        """The session's transcript, from a small per-session cache when it is current.

        A turn needs the whole history to build its request; decoding it from the store on
        every turn made long sessions slow. The cache is checked against the row's message
        ids, so a rollback, fork or remote change simply misses it and reloads.
        """
        cached = self._histories.get(session.id)
        if cached is not None and cached[0] == session.state.message_ids:
            return list(cached[1])
        history = await self.store.get_messages(session.state.message_ids)
        self._remember(session.id, session.state.message_ids, history)
        return list(history)

    def _remember(self, session_id: str, ids: list[str], history: list[Message]) -> None:
        self._histories.pop(session_id, None)
        self._histories[session_id] = (list(ids), history)
        while len(self._histories) > HISTORY_CACHE_SESSIONS:
            self._histories.pop(next(iter(self._histories)))


__all__ = ["SessionHandle", "SessionRuntime", "hydrate"]
