"""Subagents: child sessions with their own turn, tools and budget, run for a parent turn.

A subagent is a session of its own (it syncs like any other, so its transcript is on every
device) whose one turn answers a prompt from its parent: the model's ``subagent`` tool call
(``pleach_client.tasks.SUBAGENT_TOOL``), or the host (``rt.tasks.spawn``). Its final text
comes back to the parent turn as the tool call's result. The parent session's log records
``subagent.started`` and ``subagent.completed`` (with its tokens and cost); the child's
``session.created`` names its parent; its audit rows carry ``parent_turn_id`` and
``subagent_depth``, so the parent's rollup includes them (``rt.audit.rollup``).

Concurrency: at most ``max_concurrent`` subagents run at once (1 unless
``enable_subagent_concurrency``); more wait for a slot. With concurrency, every ``subagent``
call of one model reply starts at once when the first of them runs (the turn runs tool calls
one after another; each then takes its own result), unless safety policies or plugins' tool
middleware check each call as it runs (they could refuse or rewrite a later one). A
subagent that waits for its own subagents lends them its slot meanwhile, so nesting (up to
``max_depth``) never deadlocks on the bound.

Abort: aborting the parent turn (its abort event, cancelling it, closing it) aborts every
subagent it started, each accounted as any aborted turn (a ``user-aborted`` audit row with the
input tokens the provider reported), before the parent commits. ``rt.close()`` aborts them
all. Each subagent is one ``pleach.subagent`` span, a child of its parent turn's span, with
the child's ``pleach.turn`` under it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from shared.aio import reap
from shared.errors import InvalidInput, InvalidState, NotFound
from shared.ids import uuid7
from shared.records import AuditRow, Event, Session, SessionState
from shared.tracing import SpanHandle

from .core import SessionChange
from .lineage import Lineage, ToolCallContext, current_tool_call
from .payloads import read_payload
from .receipts import SubagentResult
from .stream import (
    MessageComplete,
    SubagentCompleted,
    SubagentStarted,
    TurnComplete,
)
from .turn import MAX_MESSAGE_BYTES, run_turn, set_turn_outcome

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.subagents")

SUBAGENT_TOOL_NAME = "subagent"
STARTED = "subagent.started"
COMPLETED = "subagent.completed"
SUBAGENT_EVENTS = frozenset({STARTED, COMPLETED})
"""The event types ``subagent_runs`` reads (it skips every other)."""
DEFAULT_MAX_CONCURRENT = 4
DEFAULT_MAX_DEPTH = 1
MAX_DEPTH_LIMIT = 8
"""The deepest nesting a runtime may allow (``max_subagent_depth``)."""
MAX_TITLE_CHARS = 200


class _Slot:
    """One subagent's place under the concurrency bound (see the module docstring)."""

    def __init__(self, manager: SubagentManager) -> None:
        self._manager = manager
        self.held = False

    async def acquire(self, abort: asyncio.Event) -> bool:
        """Take a slot, or give up when ``abort`` is set first (False)."""
        manager = self._manager
        manager._waiting += 1
        try:
            if abort.is_set():
                return False
            take = asyncio.ensure_future(manager._slots.acquire())
            stop = asyncio.ensure_future(abort.wait())
            try:
                await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not take.done():
                    await reap(take)
            if take.cancelled() or not take.done():
                return False
            self._took()
            return True
        finally:
            manager._waiting -= 1

    def _took(self) -> None:
        manager = self._manager
        self.held = True
        manager._running += 1
        manager.peak = max(manager.peak, manager._running)

    def release(self) -> None:
        if self.held:
            self.held = False
            self._manager._running -= 1
            self._manager._slots.release()

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[None]:
        """Give the slot up while the caller waits for its own subagents; take it back after
        (not when the wait was cancelled: the caller is being aborted then)."""
        had = self.held
        self.release()
        cancelled = False
        try:
            yield
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if had and not cancelled:
                await self._manager._slots.acquire()
                self._took()


@dataclass(eq=False)
class _Child:
    id: str
    parent_session_id: str
    parent_turn_id: str | None
    depth: int
    prompt: str
    title: str
    abort: asyncio.Event
    span_parent: SpanHandle | None
    max_tool_iterations: int | None = None
    max_tokens: int | None = None
    system: str | None = None
    tool_call_id: str | None = None
    task: asyncio.Task[SubagentResult] | None = field(default=None, repr=False)


class SubagentRun(msgspec.Struct, kw_only=True):
    """A subagent as its parent session's log has it (``SubagentManager.list``)."""

    subagent_id: str
    parent_turn_id: str | None
    depth: int
    title: str = ""
    started_by: str = ""
    status: str = "running"
    """``running`` until its ``subagent.completed``; then ``ended``."""
    turn_id: str | None = None
    outcome: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None


class _Started(msgspec.Struct, kw_only=True):
    subagent_id: str
    parent_turn_id: str | None = None
    depth: int = 1
    title: str = ""


class _Completed(msgspec.Struct, kw_only=True):
    subagent_id: str
    turn_id: str
    outcome: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None


def subagent_runs(
    events: Iterable[Event], start: dict[str, SubagentRun] | None = None
) -> dict[str, SubagentRun]:
    """Fold a parent session's log into its subagents by id (malformed events skipped).
    ``start``: what the log before ``events`` folded to (taken over and changed)."""
    out: dict[str, SubagentRun] = {} if start is None else start
    for event in events:
        if event.type == STARTED:
            started = read_payload(event, _Started)
            if started is None:
                continue
            out.setdefault(
                started.subagent_id,
                SubagentRun(
                    subagent_id=started.subagent_id,
                    parent_turn_id=started.parent_turn_id,
                    depth=started.depth,
                    title=started.title,
                    started_by=event.client_id,
                ),
            )
        elif event.type == COMPLETED:
            done = read_payload(event, _Completed)
            if done is None:
                continue
            run = out.get(done.subagent_id)
            if run is None or run.status == "ended":
                continue
            run.status, run.turn_id, run.outcome = "ended", done.turn_id, done.outcome
            run.input_tokens, run.output_tokens = done.input_tokens, done.output_tokens
            run.cost_usd = done.cost_usd
    return out


class SubagentManager:
    """Spawns subagents and bounds how many run at once (see the module docstring).

    ``rt.tasks.subagents``; ``rt.get_subagent_manager()`` returns it only when concurrency
    is enabled. ``running()`` and ``waiting()`` count subagents holding and waiting for a
    slot now; ``peak`` is the most that ever held one at once.
    """

    def __init__(
        self,
        rt: SessionRuntime,
        *,
        concurrency: bool = False,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise InvalidInput(f"max_concurrent_subagents must be >= 1, not {max_concurrent!r}")
        if not isinstance(max_depth, int) or not 1 <= max_depth <= MAX_DEPTH_LIMIT:
            raise InvalidInput(
                f"max_subagent_depth must be between 1 and {MAX_DEPTH_LIMIT}, not {max_depth!r}"
            )
        self._rt = rt
        self.concurrency = concurrency
        self.max_concurrent = max_concurrent if concurrency else 1
        self.max_depth = max_depth
        self._slots = asyncio.Semaphore(self.max_concurrent)
        self._running = 0
        self._waiting = 0
        self.peak = 0
        self._children: dict[str, _Child] = {}
        self._by_turn: dict[str, dict[str, _Child]] = {}
        self._prefetched: dict[tuple[str, str], _Child] = {}
        self._closing = False

    def running(self) -> int:
        """Subagents holding a slot now (running their turn)."""
        return self._running

    def waiting(self) -> int:
        """Subagents waiting for a slot now."""
        return self._waiting

    # -- spawning ---------------------------------------------------------------------------
    async def spawn(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        tools: Sequence[str] | None = None,
        system: str | None = None,
        max_tool_iterations: int | None = None,
        max_tokens: int | None = None,
        title: str = "",
        abort: asyncio.Event | None = None,
    ) -> SubagentResult:
        """Run a subagent on ``prompt`` and return what it did.

        Inside a tool call (``current_tool_call()``) it is that turn's child: its session,
        turn and depth come from there (``session_id`` may be left out), and the turn's
        abort aborts it. From the host, name the parent ``session_id``; ``abort`` aborts it.
        ``tools`` (default: the parent session's), ``system``, ``max_tool_iterations`` and
        ``max_tokens`` (default: the runtime's) are its own. ``InvalidState`` past
        ``max_subagent_depth`` or while the runtime closes.
        """
        ctx = current_tool_call()
        if ctx is not None and session_id in (None, ctx.session_id):
            child = await self._start(
                prompt,
                parent_session_id=ctx.session_id,
                parent_turn_id=ctx.turn_id,
                depth=ctx.depth + 1,
                span_parent=ctx.span,
                tools=tools,
                system=system,
                max_tool_iterations=max_tool_iterations,
                max_tokens=max_tokens,
                title=title,
                abort=abort,
                tool_call_id=ctx.tool_call_id,
            )
            return await self._await(child, ctx)
        if session_id is None:
            raise InvalidInput("spawn needs the parent session_id outside a tool call")
        child = await self._start(
            prompt,
            parent_session_id=session_id,
            parent_turn_id=None,
            depth=1,
            span_parent=None,
            tools=tools,
            system=system,
            max_tool_iterations=max_tool_iterations,
            max_tokens=max_tokens,
            title=title,
            abort=abort,
        )
        return await self._await(child, None)

    async def run_tool_call(
        self, ctx: ToolCallContext, tool_input: dict[str, Any]
    ) -> SubagentResult:
        """The ``subagent`` tool: run this call's subagent. With concurrency, the first
        ``subagent`` call of a reply starts every later one of the reply too (unless safety
        policies or tool middleware check each call as it runs: they could refuse it)."""
        child = self._prefetched.pop((ctx.turn_id, ctx.tool_call_id), None)
        if child is None:
            child = await self._start_for(ctx, tool_input)
        if self.concurrency and not self._checked_per_call():
            ids = [c.id for c in ctx.calls]
            later = ctx.calls[ids.index(ctx.tool_call_id) + 1 :] if ctx.tool_call_id in ids else ()
            for call in later:  # the reply's later subagent calls, in order
                key = (ctx.turn_id, call.id)
                if call.name != ctx.name or call.id == ctx.tool_call_id or key in self._prefetched:
                    continue
                if self._started_for(ctx.turn_id, call.id):
                    continue
                try:
                    self._prefetched[key] = await self._start_for(ctx, dict(call.input), call.id)
                except (InvalidInput, InvalidState, NotFound) as exc:
                    log.info("subagent call %s not started ahead: %s", call.id, exc)
        return await self._await(child, ctx)

    def _checked_per_call(self) -> bool:
        """Whether safety policies or plugins' tool middleware see each tool call as it runs
        (they may refuse or rewrite it): then no call is started ahead of its turn."""
        rt = self._rt
        return rt.safety.in_force or bool(rt.plugins.collect_tool_middleware())

    def _started_for(self, turn_id: str, tool_call_id: str) -> bool:
        """Whether the call ``tool_call_id`` of turn ``turn_id`` has its subagent already."""
        return any(c.tool_call_id == tool_call_id for c in self._by_turn.get(turn_id, {}).values())

    async def _start_for(
        self, ctx: ToolCallContext, tool_input: dict[str, Any], tool_call_id: str | None = None
    ) -> _Child:
        prompt = tool_input.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInput("the subagent tool needs a non-empty string 'prompt'")
        tools = tool_input.get("tools")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)
        ):
            raise InvalidInput("the subagent tool's 'tools' must be a list of tool names")
        title = tool_input.get("title")
        parent = await self._rt.core.session(ctx.session_id)
        if tools is not None:
            extra = sorted(set(tools) - set(parent.tools))
            if extra:
                raise InvalidInput(f"a subagent may only use its parent's tools, not {extra}")
        return await self._start(
            prompt,
            parent_session_id=ctx.session_id,
            parent_turn_id=ctx.turn_id,
            depth=ctx.depth + 1,
            span_parent=ctx.span,
            tools=tools,
            title=title if isinstance(title, str) else "",
            tool_call_id=tool_call_id or ctx.tool_call_id,
        )

    async def _start(
        self,
        prompt: str,
        *,
        parent_session_id: str,
        parent_turn_id: str | None,
        depth: int,
        span_parent: SpanHandle | None,
        tools: Sequence[str] | None = None,
        system: str | None = None,
        max_tool_iterations: int | None = None,
        max_tokens: int | None = None,
        title: str = "",
        abort: asyncio.Event | None = None,
        tool_call_id: str | None = None,
    ) -> _Child:
        """Write the child session (and ``subagent.started`` in the parent's log) and start
        its task; it runs once it has a slot."""
        rt, core = self._rt, self._rt.core
        if self._closing:
            raise InvalidState("the runtime is closing: no new subagents")
        if depth > self.max_depth:
            raise InvalidState(
                f"a subagent at depth {depth} is deeper than max_subagent_depth={self.max_depth}"
            )
        if len(prompt.encode("utf-8", "replace")) > MAX_MESSAGE_BYTES:
            raise InvalidInput(f"the subagent prompt is over {MAX_MESSAGE_BYTES:,} bytes")
        for name, value in (
            ("max_tool_iterations", max_tool_iterations),
            ("max_tokens", max_tokens),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidInput(f"{name} must be a positive int, not {value!r}")
        parent = await core.session(parent_session_id)
        names = list(tools) if tools is not None else list(parent.tools)
        if depth >= self.max_depth:
            names = [n for n in names if n != SUBAGENT_TOOL_NAME]  # it could not spawn anyway
        unknown = [n for n in names if rt.tools.get(n) is None]
        if unknown:
            raise InvalidInput(f"no registered tool(s) {unknown} for the subagent")
        label = (title.strip() or _first_line(prompt))[:MAX_TITLE_CHARS]
        now = core.now()
        row = Session(
            id=uuid7(),
            org_id=core.org_id,
            user_id=core.user_id,
            client_id=core.client_id,
            hlc=now,
            provider=parent.provider,
            model=parent.model,
            created_at=now,
            updated_at=now,
            vv={},
            title=f"subagent: {label}",
            state=SessionState(),
            tools=names,
        )
        created = core.draft_event(
            row.id,
            "session.created",
            {
                "provider": row.provider,
                "model": row.model,
                "parent_session_id": parent_session_id,
                "parent_turn_id": parent_turn_id,
                "subagent_depth": depth,
            },
        )
        started = core.draft_event(
            parent_session_id,
            STARTED,
            {
                "subagent_id": row.id,
                "parent_turn_id": parent_turn_id,
                "tool_call_id": tool_call_id,
                "depth": depth,
                "title": label,
            },
        )

        def create(current: Session | None) -> SessionChange:
            if current is not None:
                raise InvalidState(f"session {row.id} already exists")
            return SessionChange(row=row, events=[created])

        await core.write(
            [(row.id, create), (parent_session_id, lambda _: SessionChange(events=[started]))]
        )
        child = _Child(
            id=row.id,
            parent_session_id=parent_session_id,
            parent_turn_id=parent_turn_id,
            depth=depth,
            prompt=prompt,
            title=label,
            abort=abort if abort is not None else asyncio.Event(),
            span_parent=span_parent,
            max_tool_iterations=max_tool_iterations,
            max_tokens=max_tokens,
            system=system,
            tool_call_id=tool_call_id,
        )
        self._children[child.id] = child
        if parent_turn_id is not None:
            self._by_turn.setdefault(parent_turn_id, {})[child.id] = child
        child.task = asyncio.create_task(self._run(child), name=f"pleach-subagent-{child.id}")
        rt.emit(
            SubagentStarted(
                session_id=parent_session_id,
                subagent_id=child.id,
                parent_turn_id=parent_turn_id,
                depth=depth,
                title=label,
            )
        )
        return child

    async def _await(self, child: _Child, ctx: ToolCallContext | None) -> SubagentResult:
        """The child's result. Cancelled meanwhile (the parent aborts): abort the child and
        wait for its accounting, then go on being cancelled."""
        task = child.task
        assert task is not None
        slot = ctx.lineage.slot if ctx is not None and ctx.lineage is not None else None
        lend = slot.lend() if slot is not None else contextlib.nullcontext()
        async with lend:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                child.abort.set()
                await asyncio.wait({task})
                raise

    async def _run(self, child: _Child) -> SubagentResult:
        rt = self._rt
        slot = _Slot(self)
        span: SpanHandle | None = None
        result: SubagentResult | None = None
        try:
            await slot.acquire(child.abort)  # aborted first: the turn below ends at once
            span = rt.spans.start(
                "pleach.subagent",
                kind="subagent",
                parent=child.span_parent,
                attributes={
                    "pleach.session_id": child.parent_session_id,
                    "pleach.subagent_id": child.id,
                    "pleach.parent_turn_id": child.parent_turn_id or "",
                    "pleach.subagent_depth": child.depth,
                },
            )
            lineage = Lineage(
                parent_session_id=child.parent_session_id,
                parent_turn_id=child.parent_turn_id,
                depth=child.depth,
                span=span,
                slot=slot,
                max_tool_iterations=child.max_tool_iterations,
                max_tokens=child.max_tokens,
                system=child.system,
            )
            result = await self._turn(child, lineage)
            set_turn_outcome(
                span,
                result.turn_id,
                result.outcome,
                result.input_tokens,
                result.output_tokens,
                result.cost_usd,
            )
        except BaseException as exc:
            if span is not None:
                span.error(exc)
            raise
        finally:
            slot.release()
            if span is not None:
                span.end()
            self._children.pop(child.id, None)
            if child.parent_turn_id is not None:
                siblings = self._by_turn.get(child.parent_turn_id)
                if siblings is not None:
                    siblings.pop(child.id, None)
                    if not siblings:
                        del self._by_turn[child.parent_turn_id]
        assert result is not None  # (an exception above propagates past this)
        await self._record(child, result)
        return result

    async def _turn(self, child: _Child, lineage: Lineage) -> SubagentResult:
        rt = self._rt
        text = ""
        done: TurnComplete | None = None
        events = run_turn(rt, child.id, child.prompt, child.abort, lineage=lineage)
        async with contextlib.aclosing(events) as turn:  # (the turn locks and emits)
            async for event in turn:
                if isinstance(event, MessageComplete):
                    said = _text(event.content)
                    text = said or text
                elif isinstance(event, TurnComplete):
                    done = event
        if done is None:
            raise InvalidState(f"the subagent {child.id} ended without completing its turn")
        return SubagentResult(
            subagent_id=child.id,
            parent_session_id=child.parent_session_id,
            parent_turn_id=child.parent_turn_id,
            depth=child.depth,
            turn_id=done.turn_id,
            outcome=done.outcome,
            text=text,
            input_tokens=done.input_tokens,
            output_tokens=done.output_tokens,
            cost_usd=done.cost_usd,
            provider_calls=done.provider_calls,
        )

    async def _record(self, child: _Child, result: SubagentResult) -> None:
        """``subagent.completed`` in the parent's log, and its stream event."""
        payload = {
            "subagent_id": child.id,
            "turn_id": result.turn_id,
            "outcome": result.outcome,
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "cost_usd": result.cost_usd,
        }
        core = self._rt.core
        draft = core.draft_event(child.parent_session_id, COMPLETED, payload)
        await core.write([(child.parent_session_id, lambda _: SessionChange(events=[draft]))])
        self._rt.emit(
            SubagentCompleted(
                session_id=child.parent_session_id,
                subagent_id=child.id,
                parent_turn_id=child.parent_turn_id,
                turn_id=result.turn_id,
                outcome=result.outcome,
                input_tokens=result.input_tokens,
                output_tokens=result.output_tokens,
                cost_usd=result.cost_usd,
            )
        )

    # -- aborting ---------------------------------------------------------------------------
    async def abort_turn(self, turn_id: str) -> int:
        """Abort every subagent the turn ``turn_id`` started that still runs, and return
        once each has committed its (aborted) turn. Returns how many there were."""
        for key in [k for k in self._prefetched if k[0] == turn_id]:
            self._prefetched.pop(key, None)
        children = list(self._by_turn.get(turn_id, {}).values())
        return await self._abort(children)

    async def close(self) -> None:
        """Abort every running subagent (accounted) and refuse new ones until ``open``."""
        self._closing = True
        self._prefetched.clear()
        await self._abort(list(self._children.values()))

    def open(self) -> None:
        self._closing = False

    async def _abort(self, children: builtins.list[_Child]) -> int:
        tasks = []
        for child in children:
            child.abort.set()
            if child.task is not None:
                tasks.append(child.task)
        if tasks:
            await asyncio.wait(tasks)
        return len(children)

    # -- reads ------------------------------------------------------------------------------
    async def list(self, session_id: str) -> list[SubagentRun]:
        """The subagents a session started, from its log (any device's), oldest first."""
        events = await self._rt.store.list_events(session_id)
        return [*subagent_runs(events).values()]

    async def audit_rows(self, session_id: str) -> builtins.list[AuditRow]:
        """The audit rows of the subagents a session started, and of theirs, found through
        the sessions' logs (``subagent.started``); the session's own rows are not included."""
        store = self._rt.store
        rows: builtins.list[AuditRow] = []
        seen = {session_id}
        frontier = [session_id]
        for _ in range(MAX_DEPTH_LIMIT):
            found: builtins.list[str] = []
            for sid in frontier:
                for run in subagent_runs(await store.list_events(sid)).values():
                    if run.subagent_id not in seen:
                        seen.add(run.subagent_id)
                        found.append(run.subagent_id)
            for sid in found:
                rows.extend(await store.list_audit(session_id=sid))
            if not found:
                break
            frontier = found
        return rows


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(
        str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text"
    )


__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_MAX_DEPTH",
    "SUBAGENT_TOOL_NAME",
    "SubagentManager",
    "SubagentRun",
    "subagent_runs",
]
