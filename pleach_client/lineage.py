"""Who runs inside what: the turn a tool call belongs to, and a subagent's place in its tree.

A turn runs each tool call inside ``tool_call_scope(ToolCallContext(...))``, so a tool (the
built-in ``subagent`` and ``wait_for_jobs`` tools, or a host's own) can ask
``current_tool_call()`` which runtime, session, turn and call it serves, and so a subagent it
spawns knows its parent turn. The context is a ``contextvars.ContextVar``: a task the tool
starts inherits it, another turn's tools never see it.

A subagent's turn runs with a ``Lineage``: its parent turn, its depth, the span to hang its
own spans on, its budget (tool iterations, reply tokens, system prompt) and the concurrency
slot it holds. ``root_turn_ids`` maps audit rows to the top-level turn they were spent for,
so a parent turn's rollup includes its subagents'. Pure: no I/O, no runtime imports.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from shared.records import AuditRow
from shared.tracing import SpanHandle

from .interrupts import Edit, Interrupt, Reject

if TYPE_CHECKING:
    from .runtime import SessionRuntime

JSON = Any


class Slot(Protocol):
    """A subagent's concurrency slot (``pleach_client.subagents``): lent to its own
    subagents while it waits for them, so nested spawns never deadlock on the bound."""

    def lend(self) -> contextlib.AbstractAsyncContextManager[None]: ...


@dataclass(frozen=True)
class Lineage:
    """Where a subagent's turn sits: ``parent_turn_id`` (None when the host spawned it
    outside a turn), ``depth`` (1 for a child of a top-level turn), the ``span`` of its
    ``pleach.subagent`` span, its ``slot``, and its budget: ``max_tool_iterations``,
    ``max_tokens`` and ``system`` replace the runtime's for this turn when set."""

    parent_session_id: str
    parent_turn_id: str | None
    depth: int
    span: SpanHandle | None = None
    slot: Slot | None = None
    max_tool_iterations: int | None = None
    max_tokens: int | None = None
    system: str | None = None


@dataclass(frozen=True)
class PlannedCall:
    """A tool call of the current reply that will run (after any approval decision)."""

    id: str
    name: str
    input: Mapping[str, JSON]


@dataclass(frozen=True)
class ToolCallContext:
    """The tool call being run: its runtime, session, turn, call id and name, the turn's
    lineage (None for a top-level turn), the turn's span, and ``calls``: every call of the
    same reply that runs (so the ``subagent`` tool can start its siblings at once)."""

    rt: SessionRuntime
    session_id: str
    turn_id: str
    tool_call_id: str
    name: str
    lineage: Lineage | None = None
    span: SpanHandle | None = None
    calls: Sequence[PlannedCall] = field(default_factory=tuple)

    @property
    def depth(self) -> int:
        """The depth of the turn this call runs in (0: a top-level turn)."""
        return self.lineage.depth if self.lineage is not None else 0


_CURRENT: contextvars.ContextVar[ToolCallContext | None] = contextvars.ContextVar(
    "pleach_tool_call", default=None
)


def current_tool_call() -> ToolCallContext | None:
    """The tool call this code runs for, or None outside a tool call."""
    return _CURRENT.get()


@contextlib.contextmanager
def tool_call_scope(context: ToolCallContext) -> Iterator[ToolCallContext]:
    """Run a tool call with ``context`` as its ``current_tool_call()`` (a turn wraps each
    call in this; nothing yields inside it, so it never leaks into the turn's consumer)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        with contextlib.suppress(ValueError):  # reset from another context: nothing to undo
            _CURRENT.reset(token)


def planned_calls(
    tool_uses: Iterable[Mapping[str, JSON]], decisions: Mapping[str, Interrupt] | None = None
) -> tuple[PlannedCall, ...]:
    """The calls of a reply that will run: its ``tool_use`` blocks, minus those an approval
    decision rejected, with the input of those it edited (``decisions`` by call id)."""
    out: list[PlannedCall] = []
    for block in tool_uses:
        call_id = str(block.get("id"))
        decided = (decisions or {}).get(call_id)
        decision = decided.decision if decided is not None else None
        if isinstance(decision, Reject):
            continue
        tool_input = decision.input if isinstance(decision, Edit) else block.get("input") or {}
        out.append(PlannedCall(id=call_id, name=str(block.get("name")), input=tool_input))
    return tuple(out)


def turn_limits(
    lineage: Lineage | None, *, max_tool_iterations: int, max_tokens: int
) -> tuple[int, int]:
    """A turn's tool-iteration cap and reply token limit: the runtime's, or a subagent's
    own budget where its lineage sets one."""
    if lineage is None:
        return max_tool_iterations, max_tokens
    return (
        lineage.max_tool_iterations or max_tool_iterations,
        lineage.max_tokens or max_tokens,
    )


def turn_system(system: str | None, lineage: Lineage | None) -> str | None:
    """A turn's system prompt: the runtime's, followed by a subagent's own when it has one."""
    if lineage is None or not lineage.system:
        return system
    return f"{system}\n\n{lineage.system}" if system else lineage.system


def root_turn_ids(rows: Iterable[AuditRow]) -> dict[str, str]:
    """Each turn id of ``rows`` mapped to the top-level turn it was spent for, following
    ``parent_turn_id`` (a subagent's parent, its parent's parent...). Cycles (a peer's junk)
    stop the walk where they close; a parent turn not among ``rows`` is a root."""
    rows = list(rows)
    parent: dict[str, str] = {}
    for row in rows:
        if row.parent_turn_id and row.parent_turn_id != row.turn_id:
            parent.setdefault(row.turn_id, row.parent_turn_id)
    roots: dict[str, str] = {}
    for turn in {r.turn_id for r in rows} | set(parent):
        seen = {turn}
        root = turn
        while root in parent and parent[root] not in seen:
            root = parent[root]
            seen.add(root)
        roots[turn] = root
    return roots


__all__ = [
    "Lineage",
    "PlannedCall",
    "Slot",
    "ToolCallContext",
    "current_tool_call",
    "planned_calls",
    "root_turn_ids",
    "tool_call_scope",
    "turn_limits",
    "turn_system",
]
