"""Stream events: what ``execute_message`` yields and the runtime's live bus carries.

Every event is a ``msgspec.Struct`` tagged by ``type`` (``event.type`` reads it), so a host can
``msgspec.json.encode`` any event straight onto its own wire. ``StreamManager`` fans events out
to subscribers by mode, with an optional throttle for deltas and an event-type allowlist.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

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
    interrupt_states,
    parse_resolution,
)

log = logging.getLogger("pleach.stream")

JSON = Any


class StreamEventBase(msgspec.Struct, kw_only=True, tag_field="type"):
    session_id: str

    @property
    def type(self) -> str:
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]
        return tag


class SessionCreated(StreamEventBase, tag="session.created"):
    provider: str
    model: str


class SessionResumed(StreamEventBase, tag="session.resumed"):
    layers: list[str] = []


class MessageAdded(StreamEventBase, tag="message.added"):
    message_id: str
    role: str
    turn_id: str | None = None


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


class ToolCompleted(StreamEventBase, tag="tool.completed"):
    tool_call_id: str
    name: str
    output: str


class ToolFailed(StreamEventBase, tag="tool.failed"):
    tool_call_id: str
    name: str
    error: str


class MessageComplete(StreamEventBase, tag="message.complete"):
    message_id: str
    content: list[dict[str, JSON]]
    stop_reason: str | None = None
    aborted: bool = False


class CheckpointCreated(StreamEventBase, tag="checkpoint.created"):
    checkpoint_id: str
    parent_id: str | None
    turn_id: str | None
    reason: str


class TurnComplete(StreamEventBase, tag="turn.complete"):
    turn_id: str
    outcome: Literal["ok", "user-aborted", "provider-error", "tool-error"]
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    provider_calls: int


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


class SyncApplied(StreamEventBase, tag="sync.applied"):
    """Remote changes touched this session (emitted once per applied page)."""

    records: int


class CustomEvent(StreamEventBase, tag="custom"):
    name: str
    data: dict[str, JSON] = {}


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
    | TurnComplete
    | ErrorEvent
    | InterruptRequested
    | InterruptResolved
    | TurnSuspended
    | SyncConflict
    | SyncApplied
    | CustomEvent
)


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
            "interrupt.requested",
            "interrupt.resolved",
            "turn.suspended",
            "sync.conflict",
            "sync.applied",
        }
    ),
    "messages": frozenset(
        {"message.delta", "message.complete", "thinking.delta", "thinking.complete"}
    ),
    "custom": frozenset({"custom"}),
    "debug": None,
    "all": None,
}

Callback = Callable[[StreamEventBase], object]
_THROTTLED = frozenset({"message.delta", "thinking.delta"})


class _Subscription:
    __slots__ = ("callback", "mode", "types")

    def __init__(self, mode: str, callback: Callback) -> None:
        self.mode = mode
        self.types = _MODES[mode]
        self.callback = callback


class StreamManager:
    """Delivers events to subscribers. Callbacks run inline; one that raises is logged."""

    def __init__(self) -> None:
        self._subs: list[_Subscription] = []
        self._filter: frozenset[str] | None = None
        self._throttle_s = 0.0
        self._last_delta: dict[str, float] = {}

    def subscribe(self, mode: Mode, callback: Callback) -> Callable[[], bool]:
        """Call ``callback`` for each event of ``mode``; returns an unsubscribe function."""
        if mode not in _MODES:
            raise ValueError(f"unknown stream mode {mode!r}; use one of {sorted(_MODES)}")
        sub = _Subscription(mode, callback)
        self._subs.append(sub)

        def unsubscribe() -> bool:
            if sub in self._subs:
                self._subs.remove(sub)
                return True
            return False

        return unsubscribe

    def set_throttle_interval(self, ms: float) -> None:
        """Deliver at most one delta event per session every ``ms`` (0 turns it off)."""
        self._throttle_s = max(ms, 0.0) / 1000.0

    def set_event_filter(self, types: list[str] | None) -> None:
        """Only deliver these event types (None delivers all)."""
        self._filter = frozenset(types) if types is not None else None

    def emit(self, event: StreamEventBase) -> None:
        kind = event.type
        if self._filter is not None and kind not in self._filter:
            return
        if self._throttle_s and kind in _THROTTLED:
            now = time.monotonic()
            key = f"{event.session_id}:{kind}"
            if now - self._last_delta.get(key, 0.0) < self._throttle_s:
                return
            self._last_delta[key] = now
        for sub in list(self._subs):
            if sub.types is None or kind in sub.types:
                try:
                    sub.callback(event)
                except Exception:  # a subscriber's bug must not break the turn
                    log.exception("stream subscriber %r failed on %s", sub.callback, kind)
