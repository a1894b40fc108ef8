"""Human in the loop, as pure code: which tool calls wait for a person, and what was decided.

An interrupt lives in its session's hash-chained event log, so it is committed with the turn,
survives a restart and syncs like every other event (no new record kind, no server change):

- ``interrupt.requested``: written by the device whose turn waits (the *asking* device), with
  the turn's rows so far. Its event id is the interrupt's id. It names the tool call, the
  decisions allowed, and the deadline and default decision when there is a timeout.
- ``interrupt.decided``: a decision made on another device. A proposal: only the asking
  device runs the tool, so only it can make a decision final.
- ``interrupt.resolved``: the asking device applied a decision (its own user's, another
  device's proposal, the timeout's default, or the rejection of an aborted turn). Final: the
  tool ran (or did not) as it says. The asking device writes it at most once per interrupt,
  deciding under its store's write lock.

The decision in force, on every device, from the log alone (``interrupt_states``):

1. the first ``interrupt.resolved`` in log order (final); else
2. the first valid ``interrupt.decided`` in log order (tentative); else
3. none: the interrupt is pending.

Rule 2 converges: a proposal reaches the asking device only through the server's feed, in the
canonical order every device sees, so the first proposal the asking device holds is the first
one anywhere, and it adopts that one. A proposal still provisional on the device that made it
may lose; that device's receipt says ``final=False`` until the resolution syncs back.

``plan_resolve`` decides what a caller's decision writes and what its receipt says;
``plan_settle`` decides what the waiting turn writes (adopting a proposal, the timeout's
default, an abort). ``InterruptsFacet`` (``pleach_client.facets``) loads, calls and writes.
Every payload from a peer is validated here: a malformed event is refused alone (logged and
skipped), and the rest of the log still counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from shared.errors import InvalidInput
from shared.records import Event

from .payloads import read_payload

log = logging.getLogger("pleach.interrupts")

JSON = Any
DecisionKind = Literal["approve", "reject", "edit"]
DecisionSource = Literal["user", "timeout", "abort"]
InterruptStatus = Literal["pending", "decided", "resolved"]

REQUESTED = "interrupt.requested"
DECIDED = "interrupt.decided"
RESOLVED = "interrupt.resolved"
INTERRUPT_EVENTS = frozenset({REQUESTED, DECIDED, RESOLVED})
"""The event types ``interrupt_states`` reads (it skips every other)."""
ALL_DECISIONS: tuple[DecisionKind, ...] = ("approve", "reject", "edit")
MAX_REASON_CHARS = 2_000
"""The longest rejection reason a decision may carry (the model reads it)."""
ABORT_REASON = "the turn was aborted while this tool call waited for approval"
TIMEOUT_REASON = "no decision came within the time allowed"


class Approve(msgspec.Struct, frozen=True, kw_only=True, tag="approve", tag_field="kind"):
    """Run the tool call as the model asked."""


class Reject(msgspec.Struct, frozen=True, kw_only=True, tag="reject", tag_field="kind"):
    """Do not run the tool call; the model gets a tool result that says so, with ``reason``."""

    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] = ""


class Edit(msgspec.Struct, frozen=True, kw_only=True, tag="edit", tag_field="kind"):
    """Run the tool call with ``input`` instead of the model's input."""

    input: dict[str, JSON]


ApprovalDecision = Approve | Reject | Edit


def decision_kind(decision: ApprovalDecision) -> DecisionKind:
    """``"approve"``, ``"reject"`` or ``"edit"``."""
    match decision:
        case Approve():
            return "approve"
        case Reject():
            return "reject"
        case Edit():
            return "edit"


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """The tool call an interrupt holds: the model's ``tool_use`` block."""

    id: str
    name: str
    input: dict[str, JSON] = {}


class Interrupt(msgspec.Struct, kw_only=True):
    """One interrupt as a session's log says it stands (see the module docstring).

    ``decision`` is the decision in force (None while pending), made by ``decided_by`` (a
    client id) in the event ``decision_event_id``; ``final`` once the asking device applied
    it (``resolution_event_id``). ``overruled`` are the ids of decision events that lost.
    """

    id: str
    session_id: str
    turn_id: str
    tool_call: ToolCall
    requested_by: str
    requested_at: str
    decisions: list[DecisionKind]
    deadline_ms: int | None = None
    default: ApprovalDecision | None = None
    status: InterruptStatus = "pending"
    decision: ApprovalDecision | None = None
    decided_by: str | None = None
    source: DecisionSource | None = None
    decision_event_id: str | None = None
    resolution_event_id: str | None = None
    overruled: list[str] = []

    @property
    def final(self) -> bool:
        return self.status == "resolved"


class _Requested(msgspec.Struct, kw_only=True):
    turn_id: str
    tool_call: ToolCall
    decisions: Annotated[list[DecisionKind], msgspec.Meta(min_length=1, max_length=3)]
    deadline_ms: int | None = None
    default: ApprovalDecision | None = None


class _Decided(msgspec.Struct, kw_only=True):
    interrupt_id: str
    decision: ApprovalDecision


class Resolution(msgspec.Struct, kw_only=True):
    """The payload of an ``interrupt.resolved`` event. It repeats the call it settles
    (``turn_id``, ``tool_call_id``, ``name``), so a device can show it on its own."""

    interrupt_id: str
    decision: ApprovalDecision
    decided_by: str
    source: DecisionSource
    decision_event_id: str | None = None
    turn_id: str = ""
    tool_call_id: str = ""
    name: str = ""


def parse_resolution(event: Event) -> Resolution | None:
    """The resolution an ``interrupt.resolved`` event carries; None (logged) if malformed."""
    return read_payload(event, Resolution) if event.type == RESOLVED else None


@dataclass(frozen=True)
class InterruptConfig:
    """Which tool calls wait for a person, and what a person may decide.

    ``tools``: names of tools whose every call needs approval. ``when(name, input)``: a
    predicate for finer choices (a call needs approval when either says so; a predicate that
    raises counts as yes). ``decisions``: what a decision may be (``approve``, ``reject``
    with a reason, ``edit`` the tool input). ``timeout`` (seconds): after it, ``default`` is
    applied, once, by the device whose turn waits; None waits until someone decides or the
    turn is aborted. ``enabled=False`` turns it all off.
    """

    tools: Collection[str] = ()
    when: Callable[[str, Mapping[str, Any]], bool] | None = None
    decisions: Collection[DecisionKind] = ALL_DECISIONS
    timeout: float | None = None
    default: ApprovalDecision = field(default_factory=lambda: Reject(reason=TIMEOUT_REASON))
    enabled: bool = True

    def __post_init__(self) -> None:
        kinds = list(self.decisions)
        if not kinds or any(k not in ALL_DECISIONS for k in kinds):
            raise InvalidInput(
                f"InterruptConfig.decisions must be a non-empty subset of {list(ALL_DECISIONS)},"
                f" not {kinds!r}"
            )
        if self.timeout is not None and not self.timeout > 0:
            raise InvalidInput(
                f"InterruptConfig.timeout must be > 0 seconds or None, not {self.timeout!r}"
            )
        if isinstance(self.tools, str):
            raise InvalidInput(
                "InterruptConfig.tools is a collection of tool names, not one string"
            )
        as_decision(self.default)

    def needs_approval(self, name: str, tool_input: Mapping[str, Any]) -> bool:
        """Whether a call of ``name`` with ``tool_input`` waits for a decision."""
        if not self.enabled:
            return False
        if name in self.tools:
            return True
        if self.when is None:
            return False
        try:
            return bool(self.when(name, tool_input))
        except Exception:  # a predicate's bug must not let a call through unapproved
            log.exception("interrupt predicate failed on %s: the call waits for approval", name)
            return True

    def request_payload(self, turn_id: str, call: ToolCall, now_ms: int) -> dict[str, JSON]:
        """The payload of the ``interrupt.requested`` event for ``call``."""
        deadline = None if self.timeout is None else now_ms + round(self.timeout * 1000)
        request = _Requested(
            turn_id=turn_id,
            tool_call=call,
            decisions=[k for k in ALL_DECISIONS if k in self.decisions],
            deadline_ms=deadline,
            default=self.default if deadline is not None else None,
        )
        payload: dict[str, JSON] = msgspec.to_builtins(request)
        return payload


def as_decision(value: object) -> ApprovalDecision:
    """A caller's decision, validated: an ``Approve``/``Reject``/``Edit``, a mapping in their
    wire shape (``{"kind": "reject", "reason": "..."}``), or ``"approve"``/``"reject"``.
    ``InvalidInput`` names what is wrong."""
    if isinstance(value, str):
        value = {"kind": value}
    elif isinstance(value, Approve | Reject | Edit):
        value = msgspec.to_builtins(value)
    try:
        decision: ApprovalDecision = msgspec.convert(value, ApprovalDecision)
    except msgspec.ValidationError as exc:
        raise InvalidInput(
            f"not a decision ({exc}): give Approve(), Reject(reason=...) or Edit(input={{...}})"
        ) from exc
    return decision


def interrupt_states(
    events: Iterable[Event], start: dict[str, Interrupt] | None = None
) -> dict[str, Interrupt]:
    """Fold a session's log, in chain order, into its interrupts by id (module docstring).

    Events of other types are skipped; a malformed interrupt event (a peer's junk) is logged
    and skipped alone. A decision for an interrupt that is not (yet) in the log is skipped:
    decisions are only ever made after their request, so in a whole log it cannot happen.
    ``start``: what the log before ``events`` folded to (taken over and changed): the states
    are all the fold carries from one event to the next.
    """
    out: dict[str, Interrupt] = {} if start is None else start
    for event in events:
        if event.type == REQUESTED:
            if event.id in out:
                continue
            request = read_payload(event, _Requested)
            if request is None:
                continue
            out[event.id] = Interrupt(
                id=event.id,
                session_id=event.session_id,
                turn_id=request.turn_id,
                tool_call=request.tool_call,
                requested_by=event.client_id,
                requested_at=event.hlc,
                decisions=list(dict.fromkeys(request.decisions)),
                deadline_ms=request.deadline_ms,
                default=request.default,
            )
        elif event.type == DECIDED:
            decided = read_payload(event, _Decided)
            if decided is None:
                continue
            found = out.get(decided.interrupt_id)
            if found is None:
                continue
            kind = decision_kind(decided.decision)
            if kind not in found.decisions:
                log.warning(
                    "interrupt decision %s refused: %r is not allowed for interrupt %s",
                    event.id,
                    kind,
                    found.id,
                )
                continue
            if found.status != "pending":
                found.overruled.append(event.id)
                continue
            found.status = "decided"
            found.decision = decided.decision
            found.decided_by = event.client_id
            found.source = "user"
            found.decision_event_id = event.id
        elif event.type == RESOLVED:
            resolved = read_payload(event, Resolution)
            if resolved is None:
                continue
            found = out.get(resolved.interrupt_id)
            if found is None:
                continue
            if found.status == "resolved":
                found.overruled.append(event.id)
                continue
            made_in = resolved.decision_event_id or event.id
            if found.decision_event_id is not None and found.decision_event_id != made_in:
                found.overruled.append(found.decision_event_id)
            found.status = "resolved"
            found.decision = resolved.decision
            found.decided_by = resolved.decided_by
            found.source = resolved.source
            found.decision_event_id = made_in
            found.resolution_event_id = event.id
    return out


@dataclass(frozen=True)
class ResolvePlan:
    """What a caller's decision does: the event to write (``write`` type and ``payload``, or
    None: nothing) and what its receipt says."""

    write: str | None
    payload: dict[str, JSON] | None
    accepted: bool
    final: bool
    decision: ApprovalDecision
    decided_by: str
    source: DecisionSource


def plan_resolve(
    state: Interrupt, decision: ApprovalDecision, *, by: str, asker: bool
) -> ResolvePlan:
    """Decide a caller's ``decision`` on ``state`` (as this device's log has it).

    ``by`` is this device's client id; ``asker`` whether this device is the one whose turn
    waits. The first decision wins: a decision that comes when one is already in force writes
    nothing and is not accepted (on the asking device, a proposal in force is adopted, so the
    receipt is final). Raises ``InvalidInput`` for a decision the request does not allow.
    """
    kind = decision_kind(decision)
    if kind not in state.decisions:
        raise InvalidInput(f"interrupt {state.id} allows {state.decisions}, not {kind!r}")
    if state.status == "resolved" or (state.status == "decided" and not asker):
        assert state.decision is not None and state.decided_by is not None
        return ResolvePlan(
            write=None,
            payload=None,
            accepted=False,
            final=state.status == "resolved",
            decision=state.decision,
            decided_by=state.decided_by,
            source=state.source or "user",
        )
    if state.status == "decided":
        adopt = plan_settle(state, now_ms=0, abort=False, by=by)
        assert adopt is not None and state.decision is not None and state.decided_by is not None
        return ResolvePlan(
            write=RESOLVED,
            payload=adopt,
            accepted=False,
            final=True,
            decision=state.decision,
            decided_by=state.decided_by,
            source=state.source or "user",
        )
    if asker:
        payload = msgspec.to_builtins(_resolution(state, decision, by=by, source="user"))
        return ResolvePlan(RESOLVED, payload, True, True, decision, by, "user")
    payload = msgspec.to_builtins(_Decided(interrupt_id=state.id, decision=decision))
    return ResolvePlan(DECIDED, payload, True, False, decision, by, "user")


def plan_settle(state: Interrupt, *, now_ms: int, abort: bool, by: str) -> dict[str, JSON] | None:
    """What the waiting turn (on the asking device ``by``) writes for ``state``: the payload
    of an ``interrupt.resolved`` event, or None when there is nothing to write.

    An abort rejects whatever is not final; a proposal in force is adopted as it is; a
    pending interrupt past its deadline gets its default decision (source ``timeout``).
    """
    if state.status == "resolved":
        return None
    resolved: Resolution | None = None
    if abort:
        resolved = _resolution(state, Reject(reason=ABORT_REASON), by=by, source="abort")
    elif state.status == "decided":
        assert state.decision is not None and state.decided_by is not None
        resolved = _resolution(
            state,
            state.decision,
            by=state.decided_by,
            source=state.source or "user",
            decision_event_id=state.decision_event_id,
        )
    elif state.deadline_ms is not None and now_ms >= state.deadline_ms:
        decision = state.default or Reject(reason=TIMEOUT_REASON)
        resolved = _resolution(state, decision, by=by, source="timeout")
    if resolved is None:
        return None
    payload: dict[str, JSON] = msgspec.to_builtins(resolved)
    return payload


def _resolution(
    state: Interrupt,
    decision: ApprovalDecision,
    *,
    by: str,
    source: DecisionSource,
    decision_event_id: str | None = None,
) -> Resolution:
    return Resolution(
        interrupt_id=state.id,
        decision=decision,
        decided_by=by,
        source=source,
        decision_event_id=decision_event_id,
        turn_id=state.turn_id,
        tool_call_id=state.tool_call.id,
        name=state.tool_call.name,
    )


def next_deadline(states: Iterable[Interrupt]) -> int | None:
    """The earliest deadline among the interrupts that are not final (wall-clock ms)."""
    deadlines = [s.deadline_ms for s in states if not s.final and s.deadline_ms is not None]
    return min(deadlines) if deadlines else None


def tool_result_text(state: Interrupt) -> str:
    """What the model reads for a rejected call: that it was rejected, how, and why."""
    decision = state.decision
    reason = decision.reason if isinstance(decision, Reject) else ""
    match state.source:
        case "timeout":
            head = "Tool call not run: no decision came within the time allowed"
        case "abort":
            return "Tool call not run: the turn was aborted while it waited for approval."
        case _:
            head = "Tool call rejected by the user; it was not run"
    return f"{head}. Reason: {reason}" if reason and reason != TIMEOUT_REASON else f"{head}."


__all__ = [
    "ALL_DECISIONS",
    "DECIDED",
    "REQUESTED",
    "RESOLVED",
    "ApprovalDecision",
    "Approve",
    "DecisionKind",
    "DecisionSource",
    "Edit",
    "Interrupt",
    "InterruptConfig",
    "InterruptStatus",
    "Reject",
    "Resolution",
    "ResolvePlan",
    "ToolCall",
    "as_decision",
    "decision_kind",
    "interrupt_states",
    "next_deadline",
    "parse_resolution",
    "plan_resolve",
    "plan_settle",
    "tool_result_text",
]
