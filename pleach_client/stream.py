"""Stream events: what ``execute_message`` yields and the runtime's live bus carries.

Every event is a ``msgspec.Struct`` tagged by ``type`` (``event.type`` reads it), so a host can
``msgspec.json.encode`` any event straight onto its own wire. ``StreamManager`` fans events out
to subscribers by mode, with an optional throttle for deltas and an event-type allowlist.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import typing
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from shared.merge import ConflictedPath
from shared.records import Event

from .interrupts import (
    REQUESTED,
    RESOLVED,
    ApprovalDecision,
    DecisionKind,
    DecisionSource,
    Interrupt,
    ToolCall,
    interrupt_states,
    parse_resolution,
)
from .jobs import QUEUED as JOB_QUEUED
from .jobs import job_event_fields

log = logging.getLogger("pleach.stream")

JSON = Any


class StreamEventBase(msgspec.Struct, kw_only=True, tag_field="type"):
    session_id: str

    @property
    def type(self) -> str:
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]
        return tag


_TAG_PROPERTY: Final = StreamEventBase.__dict__["type"]


class SessionCreated(StreamEventBase, tag="session.created"):
    provider: str
    model: str


class SessionResumed(StreamEventBase, tag="session.resumed"):
    layers: list[str] = []


class MessageView(msgspec.Struct, frozen=True, kw_only=True):
    """``event.message``: the reference's nested shape of a message event."""

    id: str
    session_id: str
    role: str
    content: list[dict[str, JSON]] = []


class CheckpointView(msgspec.Struct, frozen=True, kw_only=True):
    """``event.checkpoint``: the reference's nested shape of ``checkpoint.created``."""

    id: str
    session_id: str
    parent_id: str | None
    turn_id: str | None
    reason: str


class MessageAdded(StreamEventBase, tag="message.added"):
    message_id: str
    role: str
    turn_id: str | None = None

    @property
    def message(self) -> MessageView:
        return MessageView(id=self.message_id, session_id=self.session_id, role=self.role)


class MessageDelta(StreamEventBase, tag="message.delta"):
    message_id: str
    delta: str


class ThinkingDelta(StreamEventBase, tag="thinking.delta"):
    message_id: str
    delta: str


class ThinkingComplete(StreamEventBase, tag="thinking.complete"):
    message_id: str
    thinking: str


class ToolStarted(StreamEventBase, tag="tool.started"):
    tool_call_id: str
    name: str
    input: dict[str, JSON]

    @property
    def tool_call(self) -> ToolCall:
        """The reference's nested shape: ``event.tool_call.name``."""
        return ToolCall(id=self.tool_call_id, name=self.name, input=self.input)


class ToolCompleted(StreamEventBase, tag="tool.completed"):
    tool_call_id: str
    name: str
    output: str

    @property
    def tool_call(self) -> ToolCall:
        """The reference's nested shape: ``event.tool_call.name`` (``input`` is empty here)."""
        return ToolCall(id=self.tool_call_id, name=self.name)


class ToolFailed(StreamEventBase, tag="tool.failed"):
    tool_call_id: str
    name: str
    error: str

    @property
    def tool_call(self) -> ToolCall:
        """The reference's nested shape: ``event.tool_call.name`` (``input`` is empty here)."""
        return ToolCall(id=self.tool_call_id, name=self.name)


class MessageComplete(StreamEventBase, tag="message.complete"):
    message_id: str
    content: list[dict[str, JSON]]
    stop_reason: str | None = None
    aborted: bool = False

    @property
    def message(self) -> MessageView:
        return MessageView(
            id=self.message_id, session_id=self.session_id, role="assistant", content=self.content
        )


class CheckpointCreated(StreamEventBase, tag="checkpoint.created"):
    checkpoint_id: str
    parent_id: str | None
    turn_id: str | None
    reason: str

    @property
    def checkpoint(self) -> CheckpointView:
        """The reference's nested shape: ``event.checkpoint.session_id``."""
        return CheckpointView(
            id=self.checkpoint_id,
            session_id=self.session_id,
            parent_id=self.parent_id,
            turn_id=self.turn_id,
            reason=self.reason,
        )


class ArtifactCreated(StreamEventBase, tag="artifact.created"):
    """An artifact was added to the session: a document (``rt.artifacts.create``) or a file
    the user attached to a message (``kind="file"``, with its ``name`` and ``media_type``)."""

    artifact_id: str
    kind: Literal["document", "file"] = "document"
    name: str | None = None
    media_type: str | None = None


class TurnComplete(StreamEventBase, tag="turn.complete"):
    turn_id: str
    outcome: Literal["ok", "user-aborted", "provider-error", "tool-error"]
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    provider_calls: int
    stopped_by: str | None = None
    """The flow-control (meta) tool that ended the turn (``set_step_complete``...), if one did."""


class ErrorEvent(StreamEventBase, tag="error"):
    code: str
    error: str
    retryable: bool = False


class InterruptRequested(StreamEventBase, tag="interrupt.requested"):
    """A tool call waits for a decision: ``rt.interrupts.resolve(interrupt_id, decision)``
    on any device of the user. ``requested_by`` is the client id whose turn waits;
    ``deadline_ms`` (wall clock) is when its default decision applies, if it has a timeout."""

    interrupt_id: str
    turn_id: str
    tool_call_id: str
    name: str
    input: dict[str, JSON]
    decisions: list[DecisionKind]
    requested_by: str
    deadline_ms: int | None = None


class InterruptResolved(StreamEventBase, tag="interrupt.resolved"):
    """The waiting turn applied a decision (made by ``decided_by``; ``source`` is ``user``,
    ``timeout`` or ``abort``): the tool call runs, runs with edited input, or is rejected."""

    interrupt_id: str
    turn_id: str
    tool_call_id: str
    name: str
    decision: ApprovalDecision
    decided_by: str
    source: DecisionSource


class TurnSuspended(StreamEventBase, tag="turn.suspended"):
    """The runtime closed while the turn waited for decisions: everything up to the wait is
    committed; ``rt.interrupts.resume(session_id)`` continues it after a restart."""

    turn_id: str
    interrupt_ids: list[str]


class SyncConflict(StreamEventBase, tag="sync.conflict"):
    conflict_id: str
    fork_session_id: str
    winner: str
    conflicted_paths: list[ConflictedPath] = []


class SyncDeleteKept(StreamEventBase, tag="sync.delete.kept"):
    """Another device deleted ``session_id`` without having seen a conflict resolution of it
    (which moved the fork's messages into it): the delete stands, and the resolved version
    lives on as a new session, ``fork_session_id``. ``version_by`` wrote that version,
    ``deleted_by`` the delete."""

    fork_session_id: str
    version_by: str = ""
    deleted_by: str = ""


class SyncApplied(StreamEventBase, tag="sync.applied"):
    """Remote changes touched this session (emitted once per applied page)."""

    records: int


class CustomEvent(StreamEventBase, tag="custom"):
    """An event a host (``rt.emit_custom``) or a plugin (``ctx.emit``) adds to the stream.

    Its ``type`` is ``"custom." + name`` (the ``custom`` stream mode delivers every one); on
    the wire its tag stays ``"custom"``, with ``name`` beside it."""

    name: str
    data: dict[str, JSON] = {}

    @property
    def type(self) -> str:
        return f"custom.{self.name}"


class _JobEvent(StreamEventBase):
    """A step of a background job's lifecycle (``pleach_client.jobs``), written by the device
    that runs it (``by``) and raised on every device as it arrives: ``rt.tasks.get_job``."""

    job_id: str
    name: str = ""
    status: str = ""
    by: str = ""
    attempt: int = 0
    progress: float | None = None
    message: str = ""
    result: JSON = None
    error: str | None = None
    reason: str | None = None


class JobQueued(_JobEvent, tag="job.queued"):
    pass


class JobStarted(_JobEvent, tag="job.started"):
    pass


class JobProgress(_JobEvent, tag="job.progress"):
    pass


class JobCompleted(_JobEvent, tag="job.completed"):
    pass


class JobFailed(_JobEvent, tag="job.failed"):
    pass


class JobCancelled(_JobEvent, tag="job.cancelled"):
    pass


JobEvent = JobQueued | JobStarted | JobProgress | JobCompleted | JobFailed | JobCancelled
_JOB_EVENT_TYPES: dict[str, type[_JobEvent]] = {
    "job.queued": JobQueued,
    "job.started": JobStarted,
    "job.progress": JobProgress,
    "job.completed": JobCompleted,
    "job.failed": JobFailed,
    "job.cancelled": JobCancelled,
}


class SubagentStarted(StreamEventBase, tag="subagent.started"):
    """A subagent (a child session with its own turn) started for ``parent_turn_id``
    (None: the host spawned it); ``session_id`` is the parent session's."""

    subagent_id: str
    parent_turn_id: str | None
    depth: int
    title: str = ""


class SubagentCompleted(StreamEventBase, tag="subagent.completed"):
    """A subagent's turn ended (``outcome`` as a turn's); its tokens and cost."""

    subagent_id: str
    parent_turn_id: str | None
    turn_id: str
    outcome: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None


StreamEvent = (
    SessionCreated
    | SessionResumed
    | MessageAdded
    | MessageDelta
    | ThinkingDelta
    | ThinkingComplete
    | ToolStarted
    | ToolCompleted
    | ToolFailed
    | MessageComplete
    | CheckpointCreated
    | ArtifactCreated
    | TurnComplete
    | ErrorEvent
    | InterruptRequested
    | InterruptResolved
    | TurnSuspended
    | SyncConflict
    | SyncDeleteKept
    | SyncApplied
    | CustomEvent
    | JobQueued
    | JobStarted
    | JobProgress
    | JobCompleted
    | JobFailed
    | JobCancelled
    | SubagentStarted
    | SubagentCompleted
)


def _types_as_attributes() -> None:
    """Each event class of ``StreamEvent`` gets its tag as ``type``, a plain class attribute,
    in place of ``StreamEventBase.type`` (a property that builds msgspec's ``StructConfig``
    at each read, and a turn reads it for every streamed chunk). A class whose ``type`` is
    its own (``CustomEvent``) keeps it. (msgspec resets what ``__init_subclass__`` sets on a
    class it is still making: this runs once the classes are made.)"""
    for cls in typing.get_args(StreamEvent):
        if inspect.getattr_static(cls, "type") is _TAG_PROPERTY:
            cls.type = cls.__struct_config__.tag


_types_as_attributes()


def interrupt_requested(state: Interrupt) -> InterruptRequested:
    return InterruptRequested(
        session_id=state.session_id,
        interrupt_id=state.id,
        turn_id=state.turn_id,
        tool_call_id=state.tool_call.id,
        name=state.tool_call.name,
        input=state.tool_call.input,
        decisions=state.decisions,
        requested_by=state.requested_by,
        deadline_ms=state.deadline_ms,
    )


def interrupt_resolved(state: Interrupt) -> InterruptResolved:
    assert state.decision is not None and state.source is not None
    return InterruptResolved(
        session_id=state.session_id,
        interrupt_id=state.id,
        turn_id=state.turn_id,
        tool_call_id=state.tool_call.id,
        name=state.tool_call.name,
        decision=state.decision,
        decided_by=state.decided_by or "",
        source=state.source,
    )


def remote_interrupt_events(
    events: list[Event],
) -> list[InterruptRequested | InterruptResolved]:
    """Stream events for interrupt events another device wrote, raised on first sight
    (``events`` are newly placed remote events, as sync applies them); malformed ones are
    skipped (and logged)."""
    out: list[InterruptRequested | InterruptResolved] = []
    for event in events:
        if event.type == REQUESTED:
            state = interrupt_states([event]).get(event.id)
            if state is not None:
                out.append(interrupt_requested(state))
        elif event.type == RESOLVED:
            found = parse_resolution(event)
            if found is not None:
                out.append(
                    InterruptResolved(
                        session_id=event.session_id,
                        interrupt_id=found.interrupt_id,
                        turn_id=found.turn_id,
                        tool_call_id=found.tool_call_id,
                        name=found.name,
                        decision=found.decision,
                        decided_by=found.decided_by,
                        source=found.source,
                    )
                )
    return out


def job_events(events: list[Event], names: dict[str, str] | None = None) -> list[JobEvent]:
    """Stream events for the job lifecycle events among ``events`` (as written, or newly
    placed by sync); ``names`` gives job kinds by job id where known. Malformed ones are
    skipped (and logged)."""
    out: list[JobEvent] = []
    known = dict(names or {})
    for event in events:
        cls = _JOB_EVENT_TYPES.get(event.type)
        fields = job_event_fields(event) if cls is not None else None
        if cls is None or fields is None:
            continue
        job_id = str(fields["job_id"])
        if event.type == JOB_QUEUED:
            known[job_id] = str(fields["name"])
        fields["name"] = known.get(job_id, "")
        out.append(cls(session_id=event.session_id, by=event.client_id, **fields))  # type: ignore[arg-type]
    return out


Mode = Literal["values", "updates", "messages", "custom", "debug", "all"]

_MODES: dict[str, frozenset[str] | None] = {
    "values": frozenset({"session.created", "session.resumed", "checkpoint.created"}),
    "updates": frozenset(
        {
            "message.added",
            "message.complete",
            "tool.started",
            "tool.completed",
            "tool.failed",
            "artifact.created",
            "interrupt.requested",
            "interrupt.resolved",
            "turn.suspended",
            "sync.conflict",
            "sync.delete.kept",
            "sync.applied",
            *_JOB_EVENT_TYPES,
            "subagent.started",
            "subagent.completed",
        }
    ),
    "messages": frozenset(
        {"message.delta", "message.complete", "thinking.delta", "thinking.complete"}
    ),
    "custom": frozenset(),  # every ``custom.*`` type (``_Subscription.wants``)
    "debug": None,
    "all": None,
}

Callback = Callable[[StreamEventBase], object]


class _Subscription:
    __slots__ = ("callback", "mode", "types")

    def __init__(self, mode: str, callback: Callback) -> None:
        self.mode = mode
        self.types = _MODES[mode]
        self.callback = callback

    def wants(self, kind: str) -> bool:
        if self.types is None or kind in self.types:
            return True
        return self.mode == "custom" and kind.startswith("custom.")


class _Held:
    """Deltas of one message that the throttle holds back, delivered as one delta."""

    __slots__ = ("first", "parts", "timer")

    def __init__(self, first: MessageDelta | ThinkingDelta) -> None:
        self.first = first
        self.parts = [first.delta]
        self.timer: asyncio.TimerHandle | None = None

    def takes(self, event: MessageDelta | ThinkingDelta) -> bool:
        return type(event) is type(self.first) and event.message_id == self.first.message_id

    def merged(self) -> MessageDelta | ThinkingDelta:
        return msgspec.structs.replace(self.first, delta="".join(self.parts))


class StreamManager:
    """Delivers events to subscribers. Callbacks run inline; one that raises is logged.

    ``clock`` (seconds, monotonic) times the throttle. ``idle`` is True exactly when ``emit``
    would do nothing: no subscriber, no throttle, nothing held or timed (a turn asks it for
    each streamed chunk, a plain attribute, and skips the call; kept by ``_changed``)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._subs: list[_Subscription] = []
        self._filter: frozenset[str] | None = None
        self._prefixes: tuple[str, ...] = ()
        self._throttle_s = 0.0
        self._clock = clock
        self._last_delta: dict[str, float] = {}
        self._held: dict[str, _Held] = {}
        self.idle = True

    def _changed(self) -> None:
        """Recompute ``idle`` after any change to what ``emit`` reads."""
        self.idle = not (self._subs or self._throttle_s or self._held or self._last_delta)

    def subscribe(self, mode: Mode, callback: Callback) -> Callable[[], bool]:
        """Call ``callback`` for each event of ``mode``; returns an unsubscribe function."""
        if mode not in _MODES:
            raise ValueError(f"unknown stream mode {mode!r}; use one of {sorted(_MODES)}")
        sub = _Subscription(mode, callback)
        self._subs.append(sub)
        self._changed()

        def unsubscribe() -> bool:
            if sub in self._subs:
                self._subs.remove(sub)
                self._changed()
                return True
            return False

        return unsubscribe

    def set_throttle_interval(self, ms: float) -> None:
        """Deliver a session's delta events at most once every ``ms``. Deltas in between are
        coalesced, not dropped: their text is joined into one delta, delivered when the
        interval is up or before the session's next other event, whichever comes first.
        0 turns the throttle off (and delivers what it holds)."""
        self._throttle_s = max(ms, 0.0) / 1000.0
        if not self._throttle_s:
            self.flush()
        self._changed()

    def set_event_filter(self, types: list[str] | None) -> None:
        """Only deliver these event types (None delivers all); an entry ending in ``.*``
        matches a prefix (``"custom.*"`` lets every custom event through)."""
        if types is None:
            self._filter, self._prefixes = None, ()
            return
        self._filter = frozenset(types)
        self._prefixes = tuple(t[:-1] for t in types if t.endswith(".*"))

    def flush(self, session_id: str | None = None) -> None:
        """Deliver what the throttle holds now (of one session, or of all)."""
        for held_id in [session_id] if session_id is not None else list(self._held):
            self._release(held_id)

    def clear(self) -> None:
        """Detach every subscriber (what the throttle holds is delivered first)."""
        self.flush()
        self._subs.clear()
        self._last_delta.clear()
        self._changed()

    def emit(self, event: StreamEventBase) -> None:
        if self._throttle_s and isinstance(event, MessageDelta | ThinkingDelta):
            if self._allowed(event.type):
                self._throttle(event)
            return
        session_id = event.session_id
        if self._held and session_id in self._held:
            self._release(session_id)  # the held text comes before this event, in order
        if self._last_delta:
            self._last_delta.pop(session_id, None)
            self._changed()
        if self._subs and self._allowed(event.type):  # (no subscriber: nobody to tell)
            self._deliver(event)

    def _allowed(self, kind: str) -> bool:
        if self._filter is None or kind in self._filter:
            return True
        return any(kind.startswith(prefix) for prefix in self._prefixes)

    def _throttle(self, event: MessageDelta | ThinkingDelta) -> None:
        session_id = event.session_id
        held = self._held.get(session_id)
        if held is not None:
            if held.takes(event):
                held.parts.append(event.delta)
                return
            self._release(session_id)
        now = self._clock()
        last = self._last_delta.get(session_id)
        if last is None or now - last >= self._throttle_s:
            self._last_delta[session_id] = now
            self._changed()
            self._deliver(event)
            return
        held = self._held[session_id] = _Held(event)
        self._changed()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to time it: the session's next event delivers it
        wait = max(self._throttle_s - (now - last), 0.0)
        held.timer = loop.call_later(wait, self._release, session_id)

    def _release(self, session_id: str) -> None:
        held = self._held.pop(session_id, None)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        self._last_delta[session_id] = self._clock()
        self._changed()
        self._deliver(held.merged())

    def _deliver(self, event: StreamEventBase) -> None:
        kind = event.type
        for sub in list(self._subs):
            if sub.wants(kind):
                try:
                    sub.callback(event)
                except Exception:  # a subscriber's bug must not break the turn
                    log.exception("stream subscriber %r failed on %s", sub.callback, kind)
