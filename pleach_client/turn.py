"""One turn: the provider stream into stream events, the tool loop, abort accounting.

``run_turn`` is the body of ``SessionRuntime.execute_message``. It collects everything the turn
writes (messages, events, audit rows, the checkpoint and the new session row) and commits it
in ONE transaction at the end, whatever the outcome: ok, provider error, tool error or abort.
Abort arrives either as the ``abort`` event being set or as cancellation of the consuming task
(or ``aclose()`` of the generator); the partial turn is then committed, shielded.

A tool call that needs approval (``SessionRuntime(interrupt=InterruptConfig(...))``) makes
the turn commit what it has first (its messages, events, audit rows and the session row with
the calls now waiting in ``state.pending_tool_calls``, but no checkpoint: every checkpoint is
a transcript the API accepts), yield ``interrupt.requested`` and wait for the decisions of
all the reply's calls that need one (``InterruptsFacet.wait``). The rest of the turn commits
at its end as usual. If the process dies while waiting, ``load_resume`` rebuilds the turn
from the store and ``run_turn(resume=...)`` goes on from the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from shared.errors import (
    InvalidInput,
    InvalidState,
    NotFound,
    ProviderError,
    RecordTooLarge,
    ToolError,
    ToolRefused,
)
from shared.ids import uuid7
from shared.messages import MAX_RECORD_BYTES
from shared.records import AuditRow, Checkpoint, Event, Message, Outcome, Session, Usage
from shared.tracing import SpanHandle

from .core import SessionChange
from .degradation import failure_kind
from .interrupts import (
    REQUESTED,
    Edit,
    Interrupt,
    Reject,
    ToolCall,
    interrupt_states,
    tool_result_text,
)
from .lineage import (
    Lineage,
    ToolCallContext,
    planned_calls,
    tool_call_scope,
    turn_limits,
    turn_system,
)
from .plugins import ToolInvocation, pause
from .providers.base import (
    BlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    ProviderEvent,
    ProviderRequest,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolUseStart,
    UnavailableProvider,
)
from .providers.pricing import cost_usd
from .stream import (
    CheckpointCreated,
    ErrorEvent,
    MessageAdded,
    MessageComplete,
    StreamEvent,
    ThinkingComplete,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnComplete,
    TurnSuspended,
    interrupt_requested,
    interrupt_resolved,
)
from .stream import MessageDelta as MessageDeltaEvent
from .stream import ThinkingDelta as ThinkingDeltaEvent
from .transcript import Transcript, extend_api, has_file_blocks, to_api_messages

if TYPE_CHECKING:
    from .files import FileRef
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.turn")

ABORTED_TOOL_RESULT = "Tool call was not run: the user aborted the turn."
MAX_MESSAGE_BYTES = MAX_RECORD_BYTES // 2
"""The largest user message a turn takes (UTF-8): its record stays well under the limit."""
MAX_TOOL_RESULT_CHARS = 200_000
"""A tool's output is cut to this many characters (and says so) before the model sees it."""
SNAPSHOT_EVERY = 32


class _Aborted(Exception):
    """The abort event was set while waiting on the provider or a tool."""


class _Suspended(Exception):
    """The runtime closed while the turn waited for decisions (resume it after a restart)."""


@dataclass
class _Call:
    """Accounting for one provider call."""

    seq: int
    started: float
    model: str = ""
    """The model actually called (the session's, or its fallback while it is degraded)."""
    span: SpanHandle | None = None
    request_id: str | None = None
    input_tokens: int | None = None
    cache_creation: int = 0
    cache_read: int = 0
    output_tokens: int = 0
    tool_input_chars: int = 0
    finished: bool = False
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    partial_text: defaultdict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    """The pieces of each text block streamed so far (joined when kept: adding each piece to
    one growing string copied the whole block at every chunk). A ``defaultdict``: a chunk
    appends to its block's list with no ``setdefault`` call and no empty list made."""
    partial_thinking: defaultdict[int, list[str]] = field(default_factory=lambda: defaultdict(list))

    @property
    def chars_out(self) -> int:
        """The characters streamed so far (text, thinking and tool input): what a call cut
        off is estimated from. Summed when asked (an abort), not counted at every chunk."""
        parts = [*self.partial_text.values(), *self.partial_thinking.values()]
        return self.tool_input_chars + sum(len(piece) for pieces in parts for piece in pieces)


@dataclass
class _TurnWrites:
    """What the turn wrote; the first ``committed_*`` of each are committed already (at an
    interrupt), the rest commit at the end."""

    messages: list[Message] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    audit: list[AuditRow] = field(default_factory=list)
    committed_messages: int = 0
    committed_events: int = 0
    committed_audit: int = 0

    def uncommitted(self) -> tuple[list[Message], list[Event], list[AuditRow]]:
        return (
            self.messages[self.committed_messages :],
            self.events[self.committed_events :],
            self.audit[self.committed_audit :],
        )

    def mark_committed(self) -> None:
        self.committed_messages = len(self.messages)
        self.committed_events = len(self.events)
        self.committed_audit = len(self.audit)


@dataclass
class Resume:
    """A turn that waited for decisions, as the store holds it (see ``load_resume``)."""

    turn_id: str
    before: Transcript
    """The session's transcript before the turn."""
    messages: list[Message]
    """The turn's committed messages; the last is the reply whose tool calls wait."""
    tool_uses: list[dict[str, Any]]
    interrupts: dict[str, str]
    """Interrupt ids by tool call id."""
    next_seq: int
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0
    calls: int = 0


def _capped(output: Any) -> Any:
    """A tool output a turn can store and sync: long text is cut, and says where."""
    if isinstance(output, str) and len(output) > MAX_TOOL_RESULT_CHARS:
        dropped = len(output) - MAX_TOOL_RESULT_CHARS
        return f"{output[:MAX_TOOL_RESULT_CHARS]}\n[... {dropped:,} more characters cut]"
    return output


async def _next_event(
    stream: AsyncGenerator[ProviderEvent, None], abort_wait: asyncio.Future[Any]
) -> ProviderEvent:
    """The stream's next event, or ``_Aborted`` when the abort comes first (a turn without an
    abort event awaits ``anext`` itself: no task per chunk)."""
    step: asyncio.Future[ProviderEvent] = asyncio.ensure_future(anext(stream))
    await asyncio.wait({step, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
    if step.done():
        return step.result()
    step.cancel()
    try:
        await step
    except (asyncio.CancelledError, StopAsyncIteration):
        pass  # cancelled on purpose: the abort wins
    raise _Aborted


async def run_turn(
    rt: SessionRuntime,
    session_id: str,
    content: str | None,
    abort: asyncio.Event | None,
    resume: Resume | None = None,
    *,
    files: Sequence[FileRef] = (),
    lineage: Lineage | None = None,
    locked: bool = False,
) -> AsyncGenerator[StreamEvent, None]:
    """One turn: ``content`` from the user (with ``files``, ``pleach_client.files``), or
    (``resume``) a turn that waited for decisions.

    It holds the session's turn lock from its first step to its end (``locked``: the caller
    holds it already), and delivers each event to the runtime's subscribers and bus
    (``rt.emit``) as it yields it. Closing it closes the turn: an abort, committed before the
    close returns. (The one generator between a caller and ``_run_turn``: each layer costs
    every streamed chunk, about 0.15 µs here, measured bare.)

    The turn is one span (``pleach.turn``) with a child for each model and tool call.
    ``lineage``: a subagent's turn (``pleach_client.subagents``): its span hangs under the
    subagent's, its audit rows name the parent turn, and its budget is its own."""
    lock = contextlib.nullcontext() if locked else rt.core.turn_lock(session_id)
    async with lock:
        span = rt.spans.start(
            "pleach.turn",
            kind="turn",
            parent=lineage.span if lineage is not None else None,
            attributes={
                "pleach.subagent_depth": lineage.depth if lineage is not None else 0,
                "pleach.session_id": session_id,
                "pleach.org_id": rt.org_id,
                "pleach.user_id": rt.user_id,
                "pleach.resumed": resume is not None,
            },
        )
        inner = _run_turn(rt, session_id, content, abort, resume, span, files, lineage)
        # Whether anyone hears an event: a stream subscriber, or a bus handler of its type
        # (the bus keeps the runtime's own handlers of other types: asking its ``emit`` cost
        # three calls a streamed chunk).
        emit, stream, heard = rt.emit, rt.stream, rt.bus.types
        try:
            async for ev in inner:  # (the turn's outcome: on the span as it is yielded)
                if not stream.idle or (heard and (ev.type in heard or "*" in heard)):
                    emit(ev)
                yield ev
        except (GeneratorExit, asyncio.CancelledError):
            span.set(**{"pleach.outcome": "user-aborted"})
            raise
        except BaseException as exc:
            span.error(exc)
            raise
        finally:
            # Closing the inner turn runs its abort accounting when the consumer stopped early.
            await inner.aclose()
            span.end()


def set_turn_outcome(
    span: SpanHandle,
    turn_id: str,
    outcome: str,
    input_tokens: int,
    output_tokens: int,
    cost_usd: float | None,
    **more: str | int | float | bool | None,
) -> None:
    """A finished turn's attributes on its span (a turn's, or a subagent's around its turn),
    and an error for any outcome but ``ok`` and ``user-aborted``."""
    done: dict[str, str | int | float | bool | None] = {
        "pleach.turn_id": turn_id,
        "pleach.outcome": outcome,
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "pleach.cost_usd": cost_usd,
    }
    span.set(**done, **more)
    if outcome not in ("ok", "user-aborted"):
        span.error(outcome)


async def _expanded(
    rt: SessionRuntime, transcript: Transcript, fresh: list[Message]
) -> list[dict[str, Any]]:
    """The request's messages; attached files expanded only where some message has one (a
    scan of the whole transcript per call made a turn's cost grow with the session)."""
    messages = extend_api(list(transcript.api), fresh)
    if transcript.has_files or has_file_blocks(fresh):
        return await rt.files.expand(messages)
    return messages


def _end_call_span(
    call: _Call, *, error: BaseException | None = None, stop_reason: str | None = None
) -> None:
    span, call.span = call.span, None
    if span is None:
        return
    span.set(
        **{
            "gen_ai.usage.input_tokens": call.input_tokens,
            "gen_ai.usage.output_tokens": call.output_tokens,
            "gen_ai.response.finish_reasons": stop_reason,
            "pleach.request_id": call.request_id,
        }
    )
    if error is not None:
        span.error(error)
    span.end()


async def _run_turn(
    rt: SessionRuntime,
    session_id: str,
    content: str | None,
    abort: asyncio.Event | None,
    resume: Resume | None,
    turn_span: SpanHandle,
    files: Sequence[FileRef] = (),
    lineage: Lineage | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    core = rt.core
    limit, max_tokens = turn_limits(
        lineage, max_tool_iterations=rt.max_tool_iterations, max_tokens=rt.max_tokens
    )
    if resume is None:
        content = content or ""
        try:
            size = len(content.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidInput(
                f"the message is not valid text ({exc.reason} at {exc.start}); nothing was sent"
            ) from exc
        if size > MAX_MESSAGE_BYTES:
            raise RecordTooLarge(
                f"the message is {size:,} bytes, over the {MAX_MESSAGE_BYTES:,}-byte limit for "
                "a message that syncs; attach large content as an artifact or a file instead"
            )
    session = await core.session(session_id)
    if resume is None and session.state.pending_tool_calls:
        raise InvalidState(_waiting_message(session))
    turn_id = resume.turn_id if resume is not None else uuid7()
    writes = _TurnWrites()
    if resume is not None:
        writes.messages = list(resume.messages)
        writes.mark_committed()
        transcript = resume.before
    else:
        transcript = await core.transcript(session)
    unavailable: ProviderError | None = None
    try:
        provider = rt.provider_for(session)
    except ProviderError as exc:  # (a mismatch, a missing key): an error event, not a raise
        provider, unavailable = UnavailableProvider(session.provider, exc), exc
    ctx = rt.plugins.turn_context(session, turn_id)  # what plugins' hooks see of the turn
    stopped_by: str | None = None
    retries = 0
    if lineage is None:  # a subagent's tools are chosen for it, on purpose
        rt.warn_unoffered_tools(session)
    tool_specs = rt.tools.specs(session.tools)
    outcome = "ok"
    totals = {"input": 0, "output": 0}
    cost_total: float | None = 0.0
    calls = 0
    if resume is not None:
        totals = {"input": resume.input_tokens, "output": resume.output_tokens}
        cost_total, calls = resume.cost_usd, resume.calls
    aborted = suspended = False
    waiting: list[str] = []
    call: _Call | None = None
    abort_wait: asyncio.Future[Any] | None = (
        asyncio.ensure_future(abort.wait()) if abort is not None else None
    )

    def event(kind: str, payload: dict[str, Any]) -> None:
        payload = rt.safety.scrub_payload(payload)  # (a redaction policy's patterns)
        writes.events.append(core.draft_event(session.id, kind, payload))

    def add_message(role: str, blocks: list[dict[str, Any]], **extra: Any) -> Message:
        message = Message(
            id=uuid7(),
            session_id=session.id,
            org_id=session.org_id,
            user_id=session.user_id,
            client_id=core.client_id,
            hlc=core.now(),
            role=role,  # type: ignore[arg-type]
            content=blocks,
            turn_id=turn_id,
            **extra,
        )
        writes.messages.append(message)
        return message

    def audit(c: _Call, status: str, code: str | None = None, message: str | None = None) -> None:
        nonlocal cost_total
        estimated = status == "user-aborted" and not c.finished
        output = c.output_tokens
        if estimated:
            output = max(output, math.ceil(c.chars_out / 4))
        usage = Usage(
            input_tokens=c.input_tokens or 0,
            output_tokens=output,
            cache_creation_input_tokens=c.cache_creation,
            cache_read_input_tokens=c.cache_read,
            output_estimated=estimated,
        )
        cost = cost_usd(
            c.model or session.model,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_creation_input_tokens=usage.cache_creation_input_tokens,
            cache_read_input_tokens=usage.cache_read_input_tokens,
        )
        cost_total = None if cost is None or cost_total is None else cost_total + cost
        totals["input"] += usage.input_tokens
        totals["output"] += usage.output_tokens
        writes.audit.append(
            AuditRow(
                id=uuid7(),
                org_id=core.org_id,
                user_id=core.user_id,
                client_id=core.client_id,
                hlc=core.now(),
                session_id=session.id,
                turn_id=turn_id,
                stage_id="tool-loop" if c.seq < limit else "synthesis",
                seq_within_turn=c.seq,
                provider=provider.name,
                model=c.model or session.model,
                outcome=Outcome(status=status, code=code, message=rt.safety.scrub(message)),  # type: ignore[arg-type]
                usage=usage,
                request_id=c.request_id,
                latency_ms=round((time.monotonic() - c.started) * 1000.0, 3),
                cost_usd=cost,
                subject_key=rt.subject_key,
                parent_turn_id=lineage.parent_turn_id if lineage is not None else None,
                subagent_depth=lineage.depth if lineage is not None else 0,
                detail={"user_id": core.user_id},
            )
        )

    if resume is None:
        attached = await rt.files.attach(session, files) if files else None
        blocks = [*(attached.blocks if attached else []), {"type": "text", "text": content}]
        user = add_message("user", blocks)
        event("message.added", {"message_id": user.id, "role": "user", "turn_id": turn_id})
        yield MessageAdded(session_id=session.id, message_id=user.id, role="user", turn_id=turn_id)
        for created in attached.events if attached else ():
            yield created

    resumed = resume
    try:
        # A resumed turn first runs the tool calls it waited on (their reply came from call
        # ``next_seq - 1``), then calls the provider again as usual.
        first = resume.next_seq - 1 if resume is not None else 0
        for seq in range(first, limit + 1):
            if abort is not None and abort.is_set():
                raise _Aborted
            asked: dict[str, str] = {}
            if resumed is not None:
                tool_uses, asked, resumed = resumed.tool_uses, dict(resumed.interrupts), None
            else:
                if unavailable is not None:
                    outcome = "provider-error"
                    code, text = unavailable.code, str(unavailable)
                    event("error", {"code": code, "message": text, "turn_id": turn_id})
                    yield ErrorEvent(
                        session_id=session.id,
                        code=code,
                        error=text,
                        retryable=unavailable.retryable,
                    )
                    break
                model = rt.degradation.route(session.model)
                if model != session.model:
                    log.warning(
                        "model %s is degraded; this call goes to its fallback %s",
                        session.model,
                        model,
                    )
                budget = session.thinking_budget
                request = ProviderRequest(
                    model=model,
                    messages=await _expanded(rt, transcript, writes.messages),
                    system=turn_system(rt.prompts.compose(session), lineage),
                    tools=tool_specs,
                    # The API wants max_tokens above the thinking budget.
                    max_tokens=max_tokens + budget if budget else max_tokens,
                    thinking_budget=budget,
                )
                ctx.seq, ctx.model = seq, model
                call = _Call(seq=seq, started=time.monotonic(), model=model)
                call.span = rt.spans.start(
                    "pleach.model_call",
                    kind="model_call",
                    parent=turn_span,
                    attributes={
                        "gen_ai.system": provider.name,
                        "gen_ai.request.model": model,
                        "pleach.session_id": session.id,
                        "pleach.turn_id": turn_id,
                        "pleach.seq": seq,
                    },
                )
                calls += 1
                reply_id = uuid7()
                stream = rt.plugins.model_stream(provider, request, ctx)
                stop: MessageStop | None = None
                retry_in: float | None = None
                try:
                    while True:
                        if abort is not None and abort.is_set():
                            raise _Aborted
                        try:
                            if abort_wait is None:  # (each chunk: no task of its own)
                                pev = await anext(stream)
                            else:
                                pev = await _next_event(stream, abort_wait)
                        except StopAsyncIteration:
                            break
                        if isinstance(pev, TextDelta):  # nearly every chunk: no match to walk
                            text = pev.text
                            call.partial_text[pev.index].append(text)
                            yield MessageDeltaEvent(
                                session_id=session.id, message_id=reply_id, delta=text
                            )
                        else:
                            match pev:
                                case MessageStart():
                                    call.request_id = pev.request_id
                                    call.input_tokens = pev.input_tokens
                                    call.cache_creation = pev.cache_creation_input_tokens
                                    call.cache_read = pev.cache_read_input_tokens
                                case ThinkingDelta(index=i, thinking=text):
                                    call.partial_thinking[i].append(text)
                                    yield ThinkingDeltaEvent(
                                        session_id=session.id, message_id=reply_id, delta=text
                                    )
                                case ToolUseStart():
                                    pass
                                case ToolInputDelta(partial_json=chunk):
                                    call.tool_input_chars += len(chunk)
                                case BlockStop(index=i, block=block):
                                    call.blocks[i] = block
                                    if block.get("type") == "thinking":
                                        yield ThinkingComplete(
                                            session_id=session.id,
                                            message_id=reply_id,
                                            thinking=str(block.get("thinking", "")),
                                        )
                                case MessageDelta(output_tokens=n):
                                    call.output_tokens = n
                                case MessageStop():
                                    stop = pev
                                    call.finished = True
                                    call.output_tokens = pev.output_tokens
                                    call.input_tokens = pev.input_tokens
                                    call.request_id = pev.request_id or call.request_id
                        if ctx.pending:  # what plugins emitted on this chunk
                            for custom in ctx.drain(event):
                                yield custom
                except ProviderError as exc:
                    # A retry policy may call the model again (the partial reply is dropped).
                    retry_in = (
                        rt.plugins.retry_delay(exc, retries + 1, ctx) if seq < limit else None
                    )
                    kind = failure_kind(exc)
                    if kind is not None:
                        rt.degradation.record_failure(call.model, kind)
                    _end_call_span(call, error=exc)
                    audit(call, "provider-error", exc.code, str(exc))
                    if retry_in is None:
                        outcome = "provider-error"
                        _keep_partial(call, add_message, aborted=True)
                    event(
                        "error",
                        {
                            "code": exc.code,
                            "message": str(exc),
                            "turn_id": turn_id,
                            "retry_in": retry_in,
                        },
                    )
                    yield ErrorEvent(
                        session_id=session.id,
                        code=exc.code,
                        error=str(exc),
                        retryable=exc.retryable,
                    )
                    if retry_in is None:
                        call = None
                        break
                finally:
                    await stream.aclose()
                if retry_in is not None:  # (the failed call was accounted above)
                    call = None
                    retries += 1
                    if await pause(retry_in, abort_wait):
                        raise _Aborted
                    continue

                if stop is None:
                    cut = ProviderError(
                        "provider stream ended without message_stop", code="truncated"
                    )
                    rt.degradation.record_failure(call.model, "server_error")
                    _end_call_span(call, error=cut)
                    outcome = "provider-error"
                    audit(call, "provider-error", cut.code, str(cut))
                    _keep_partial(call, add_message, aborted=True)
                    event("error", {"code": cut.code, "message": str(cut), "turn_id": turn_id})
                    yield ErrorEvent(session_id=session.id, code=cut.code, error=str(cut))
                    call = None
                    break

                rt.degradation.record_success(call.model)
                _end_call_span(call, stop_reason=stop.stop_reason)
                reply = Message(
                    id=reply_id,
                    session_id=session.id,
                    org_id=session.org_id,
                    user_id=session.user_id,
                    client_id=core.client_id,
                    hlc=core.now(),
                    role="assistant",
                    content=stop.content,
                    turn_id=turn_id,
                )
                writes.messages.append(reply)
                event(
                    "message.complete",
                    {"message_id": reply.id, "stop_reason": stop.stop_reason, "turn_id": turn_id},
                )
                yield MessageComplete(
                    session_id=session.id,
                    message_id=reply.id,
                    content=stop.content,
                    stop_reason=stop.stop_reason,
                )
                tool_uses = [b for b in stop.content if b.get("type") == "tool_use"]
                if stop.stop_reason != "tool_use" or not tool_uses:
                    audit(call, "ok")
                    call = None
                    break
                if seq >= limit:
                    audit(call, "tool-error", "tool_iteration_limit", "tool loop cap reached")
                    call = None
                    outcome = "tool-error"
                    msg = f"tool loop stopped after {limit} iterations"
                    event("error", {"code": "tool_iteration_limit", "message": msg})
                    yield ErrorEvent(session_id=session.id, code="tool_iteration_limit", error=msg)
                    break

            config = rt.interrupt
            if not asked and config is not None and config.enabled:
                # Every call of the reply that needs approval is asked at once, before any of
                # them runs, so the commit below never holds half of a reply's results.
                now_ms = rt.wall_ms()
                requests: list[Event] = []
                for block in tool_uses:
                    name, tool_input = str(block["name"]), block.get("input") or {}
                    if rt.tools.get(name) is None or name not in session.tools:
                        continue  # it cannot run anyway: it fails as usual, nothing to ask
                    if not config.needs_approval(name, tool_input):
                        continue
                    tool_call = ToolCall(id=str(block["id"]), name=name, input=dict(tool_input))
                    payload = config.request_payload(turn_id, tool_call, now_ms)
                    requests.append(core.draft_event(session.id, REQUESTED, payload))
                    asked[tool_call.id] = requests[-1].id
                writes.events.extend(requests)
                if asked:
                    if call is not None:
                        audit(
                            call, "ok", "interrupt", f"{len(asked)} tool call(s) wait for approval"
                        )
                        call = None
                    waiting = list(asked.values())
                    pending = [
                        {"id": str(b["id"]), "name": str(b["name"]), "interrupt_id": asked[b["id"]]}
                        for b in tool_uses
                        if b["id"] in asked
                    ]
                    session = await _commit_so_far(rt, session, writes, pending)
                    for ask in interrupt_states(requests).values():
                        yield interrupt_requested(ask)
            decisions: dict[str, Interrupt] = {}
            if asked:
                waiting = list(asked.values())
                if abort is not None and abort.is_set():
                    raise _Aborted
                end, states = await rt.interrupts.wait(session.id, waiting, abort_wait)
                if end == "abort":
                    raise _Aborted
                if end == "closing":
                    raise _Suspended
                if any(s.source == "abort" for s in states.values()):
                    raise _Aborted  # an abort settled these before the process stopped
                waiting = []
                for tool_id, interrupt_id in asked.items():
                    decisions[tool_id] = states[interrupt_id]
                    yield interrupt_resolved(states[interrupt_id])

            results: list[dict[str, Any]] = []
            failures: list[str] = []
            refused = False
            add_message("user", results)
            planned = planned_calls(tool_uses, decisions)  # (a subagent call starts its siblings)
            for block in tool_uses:
                for custom in ctx.drain(event):  # what plugins emitted during the last call
                    yield custom
                if abort is not None and abort.is_set():
                    raise _Aborted
                name, tool_id = str(block["name"]), str(block["id"])
                tool_input = block.get("input") or {}
                decided = decisions.get(tool_id)
                if decided is not None and isinstance(decided.decision, Reject):
                    results.append(
                        {
                            "type": "tool_result",
                            "tool_use_id": tool_id,
                            "content": tool_result_text(decided),
                            "is_error": True,
                        }
                    )
                    continue
                if decided is not None and isinstance(decided.decision, Edit):
                    tool_input = decided.decision.input
                yield ToolStarted(
                    session_id=session.id, tool_call_id=tool_id, name=name, input=tool_input
                )
                tool_span = rt.spans.start(
                    "pleach.tool_call",
                    kind="tool_call",
                    parent=turn_span,
                    attributes={
                        "pleach.tool": name,
                        "pleach.tool_call_id": tool_id,
                        "pleach.session_id": session.id,
                        "pleach.turn_id": turn_id,
                    },
                )
                try:
                    tool = rt.tools.get(name)
                    if tool is None or name not in session.tools:
                        raise ToolError(f"tool {name!r} is not enabled for this session")
                    invocation = ToolInvocation(id=tool_id, name=name, input=dict(tool_input))
                    with tool_call_scope(
                        ToolCallContext(
                            rt=rt,
                            session_id=session.id,
                            turn_id=turn_id,
                            tool_call_id=tool_id,
                            name=name,
                            lineage=lineage,
                            span=turn_span,
                            calls=planned,
                        )
                    ):  # (what the tool may ask: ``lineage.current_tool_call()``)
                        output = await _run_tool(
                            rt.plugins.call_tool(ctx, tool, invocation), abort_wait
                        )
                except ToolError as exc:
                    tool_span.error(exc)
                    tool_span.end()
                    failures.append(f"{name}: {exc}")
                    if isinstance(exc, ToolRefused):  # a safety policy's: also an error event
                        refused = True
                        event(
                            "error",
                            {"code": "policy_refused", "message": str(exc), "turn_id": turn_id},
                        )
                        yield ErrorEvent(
                            session_id=session.id, code="policy_refused", error=str(exc)
                        )
                    results.append(
                        {
                            "type": "tool_result",
                            "tool_use_id": tool_id,
                            "content": str(exc),
                            "is_error": True,
                        }
                    )
                    event("tool.failed", {"tool_call_id": tool_id, "name": name, "error": str(exc)})
                    yield ToolFailed(
                        session_id=session.id, tool_call_id=tool_id, name=name, error=str(exc)
                    )
                    continue
                except BaseException as exc:
                    tool_span.error(exc)
                    tool_span.end()
                    raise
                tool_span.end()
                output = _capped(output)
                results.append({"type": "tool_result", "tool_use_id": tool_id, "content": output})
                event("tool.completed", {"tool_call_id": tool_id, "name": name})
                yield ToolCompleted(
                    session_id=session.id, tool_call_id=tool_id, name=name, output=output
                )
            for custom in ctx.drain(event):
                yield custom
            if failures:
                if call is not None:  # (a call whose tools waited was accounted at the wait)
                    code = "policy_refused" if refused else "tool_failed"
                    audit(call, "tool-error", code, "; ".join(failures))
                outcome = "tool-error"
            elif call is not None:
                audit(call, "ok")
            call = None
            # A flow-control (meta) tool ends the turn here, unless a continuation policy
            # says to go on (``rt.plugins.continuation``).
            step = rt.plugins.step(ctx, seq, tool_uses, bool(failures))
            stopped_by = await rt.plugins.continuation(step, ctx)
            if stopped_by is not None:
                event("turn.stopped", {"turn_id": turn_id, "stopped_by": stopped_by})
                break
        # The loop ran out of iterations only through the cap branch above.
    except _Suspended:
        suspended = True
    except _Aborted:
        aborted = True
    except (asyncio.CancelledError, GeneratorExit):
        aborted = True
        await asyncio.shield(
            _finish(
                rt,
                session,
                turn_id,
                writes,
                call,
                add_message,
                audit,
                event,
                True,
                outcome,
                waiting,
            )
        )
        raise
    finally:
        if abort_wait is not None and not abort_wait.done():
            abort_wait.cancel()
        if call is not None and call.span is not None:
            call.span.set(**{"pleach.aborted": aborted, "pleach.suspended": suspended})
            _end_call_span(call)

    if suspended:
        # Everything up to the wait is committed; nothing after it happened. A restart
        # continues from here (``rt.interrupts.resume``).
        yield TurnSuspended(session_id=session.id, turn_id=turn_id, interrupt_ids=waiting)
        return
    finished = await _finish(
        rt, session, turn_id, writes, call, add_message, audit, event, aborted, outcome, waiting
    )
    for ev in finished:
        yield ev
    for custom in ctx.drain():
        yield custom
    complete = TurnComplete(
        session_id=session.id,
        turn_id=turn_id,
        outcome="user-aborted" if aborted else outcome,  # type: ignore[arg-type]
        input_tokens=totals["input"],
        output_tokens=totals["output"],
        cost_usd=cost_total,
        provider_calls=calls,
        stopped_by=stopped_by,
    )
    # Here, not in ``run_turn``: it would ask every event it passes on whether it is this one.
    set_turn_outcome(
        turn_span,
        turn_id,
        complete.outcome,
        complete.input_tokens,
        complete.output_tokens,
        complete.cost_usd,
        **{"pleach.provider_calls": calls},
    )
    yield complete


async def _run_tool(call: Any, abort_wait: asyncio.Future[Any] | None) -> str:
    if abort_wait is None:
        result: str = await call
        return result
    step: asyncio.Future[str] = asyncio.ensure_future(call)
    await asyncio.wait({step, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
    if step.done():
        return step.result()
    step.cancel()
    try:
        await step
    except (asyncio.CancelledError, ToolError):
        pass  # the abort wins; the tool's own outcome no longer matters
    raise _Aborted


def _keep_partial(call: _Call, add_message: Any, *, aborted: bool) -> Message | None:
    """Keep what a cut-off call produced: finished blocks, partial text and thinking."""
    blocks: dict[int, dict[str, Any]] = dict(call.blocks)
    for partial, kind in ((call.partial_text, "text"), (call.partial_thinking, "thinking")):
        for i, pieces in partial.items():
            text = "".join(pieces)
            if i not in blocks and text:
                blocks[i] = {"type": kind, kind: text}
    content = [blocks[i] for i in sorted(blocks)]
    if not content:
        return None
    message: Message = add_message("assistant", content, aborted=aborted)
    return message


def _close_dangling(messages: list[Message], add_message: Any) -> None:
    """Give every tool_use of the last assistant reply a tool_result, synthetic if needed."""
    last_assistant = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last_assistant is None:
        return
    wanted = [b["id"] for b in last_assistant.content if b.get("type") == "tool_use"]
    if not wanted:
        return
    after = messages[messages.index(last_assistant) + 1 :]
    answered = {
        b.get("tool_use_id") for m in after for b in m.content if b.get("type") == "tool_result"
    }
    missing = [tool_id for tool_id in wanted if tool_id not in answered]
    if not missing:
        return
    blocks = [
        {
            "type": "tool_result",
            "tool_use_id": tool_id,
            "content": ABORTED_TOOL_RESULT,
            "is_error": True,
        }
        for tool_id in missing
    ]
    target = next((m for m in after if m.role == "user"), None)
    if target is not None:
        target.content.extend(blocks)
    else:
        add_message("user", blocks, synthetic=True)


async def _commit_so_far(
    rt: SessionRuntime, session: Session, writes: _TurnWrites, pending: list[dict[str, Any]]
) -> Session:
    """Commit the turn's rows so far, before it waits: its messages, events (the requests
    among them) and audit rows, with the session row listing the calls that now wait
    (``state.pending_tool_calls``). No checkpoint: the turn's checkpoint comes at its end,
    so every checkpoint is a transcript the API accepts (this one ends in unanswered tool
    calls). Raises ``_Aborted`` when the session was deleted meanwhile (the delete wins)."""
    core = rt.core
    messages, events, audit = writes.uncommitted()
    appended = [m.id for m in messages]

    def commit(current: Session | None) -> SessionChange:
        if current is None:
            raise NotFound(f"session {session.id} does not exist")
        if current.deleted:
            return SessionChange(events=events)
        state = msgspec.structs.replace(
            current.state,
            message_ids=current.state.message_ids + appended,
            pending_tool_calls=pending,
        )
        row = msgspec.structs.replace(current, state=state)
        return SessionChange(row=row, records=list(messages), events=events)

    result = await core.write([(session.id, commit)], audit=audit)
    writes.mark_committed()
    updated = result.sessions.get(session.id)
    if updated is None:
        raise _Aborted
    core.remember_turn(session, updated, messages)
    return updated


def _waiting_message(session: Session) -> str:
    calls = session.state.pending_tool_calls
    names = ", ".join(str(c.get("name")) for c in calls)
    ids = ", ".join(str(c.get("interrupt_id")) for c in calls)
    return (
        f"session {session.id} has a turn waiting for approval of {names} (interrupt {ids}): "
        "decide with rt.interrupts.resolve(id, decision); the device whose turn waits goes "
        f"on by itself, or after a restart with rt.interrupts.resume({session.id!r}) "
        "(which an abort also ends)"
    )


async def load_resume(rt: SessionRuntime, session_id: str) -> Resume:
    """The turn waiting in ``session_id`` as the store holds it, to continue with
    ``run_turn(resume=...)``. ``InvalidState`` when no turn waits there, or when it waits on
    another device (only the device whose turn it is runs its tools)."""
    session = await rt.core.session(session_id)
    asked = {
        str(c["id"]): str(c["interrupt_id"])
        for c in session.state.pending_tool_calls
        if isinstance(c.get("id"), str) and isinstance(c.get("interrupt_id"), str)
    }
    if not asked:
        raise InvalidState(f"session {session_id} has no turn waiting for a decision")
    states = await rt.interrupts.states(session_id, asked.values())
    if len(states) != len(asked):
        raise InvalidState(
            f"the requests of the turn waiting in session {session_id} are not on this device "
            "yet: sync first"
        )
    first = next(iter(states.values()))
    if not await rt.interrupts.asked_here(first):
        raise InvalidState(
            f"the turn waiting in session {session_id} runs on device {first.requested_by}: "
            "only that device can continue it; a decision made here (rt.interrupts.resolve) "
            "reaches it by sync"
        )
    messages = await rt.core.messages(session.state.message_ids)
    start = next((i for i, m in enumerate(messages) if m.turn_id == first.turn_id), None)
    reply = next((m for m in reversed(messages) if m.role == "assistant"), None)
    tool_uses = [] if reply is None else [b for b in reply.content if b.get("type") == "tool_use"]
    called = {str(b.get("id")) for b in tool_uses}
    if (
        start is None
        or reply is None
        or reply.turn_id != first.turn_id
        or any(t not in called for t in asked)
    ):
        raise InvalidState(
            f"the turn waiting in session {session_id} is no longer at the end of its "
            "transcript (rolled back or replaced meanwhile)"
        )
    rows = [
        r for r in await rt.store.list_audit(session_id=session_id) if r.turn_id == first.turn_id
    ]
    cost: float | None = 0.0
    for row in rows:
        cost = None if cost is None or row.cost_usd is None else cost + row.cost_usd
    before = messages[:start]
    return Resume(
        turn_id=first.turn_id,
        before=Transcript.of([m.id for m in before], before),
        messages=messages[start:],
        tool_uses=tool_uses,
        interrupts=asked,
        next_seq=max([r.seq_within_turn + 1 for r in rows] or [1]),
        input_tokens=sum(r.usage.input_tokens for r in rows),
        output_tokens=sum(r.usage.output_tokens for r in rows),
        cost_usd=cost,
        calls=len(rows),
    )


async def _finish(
    rt: SessionRuntime,
    session: Session,
    turn_id: str,
    writes: _TurnWrites,
    call: _Call | None,
    add_message: Any,
    audit: Any,
    event: Any,
    aborted: bool,
    outcome: str,
    waiting: list[str],
) -> list[StreamEvent]:
    """Account for an unfinished call, close dangling tool calls, commit the turn."""
    out: list[StreamEvent] = []
    # Subagents the turn started that still run are aborted, and accounted, first.
    await rt.tasks.end_turn(turn_id)
    if aborted and waiting:
        # The calls that waited are rejected (source ``abort``), once, under the write lock:
        # a decision that came meanwhile loses, and a restart sees the turn as aborted.
        await rt.interrupts.settle(session.id, waiting, abort=True)
    if aborted and call is not None:
        audit(call, "user-aborted", "user_aborted", "aborted by the user")
        partial = None if call.finished else _keep_partial(call, add_message, aborted=True)
        if partial is not None:
            event(
                "message.complete", {"message_id": partial.id, "aborted": True, "turn_id": turn_id}
            )
            out.append(
                MessageComplete(
                    session_id=session.id,
                    message_id=partial.id,
                    content=partial.content,
                    aborted=True,
                )
            )
    _close_dangling(writes.messages, add_message)
    # Empty tool-result holders (an abort before any tool ran) carry no content: drop them.
    done = writes.committed_messages
    writes.messages[done:] = [m for m in writes.messages[done:] if m.content]
    final = "user-aborted" if aborted else outcome
    core = rt.core
    kept = [m.id for m in writes.messages[:done]]
    fresh = [m.id for m in writes.messages[done:]]
    checkpoint_id = uuid7()
    kind = "aborted" if aborted else "turn"
    event(
        "checkpoint.created",
        {"checkpoint_id": checkpoint_id, "turn_id": turn_id, "reason": kind},
    )
    event("turn.complete", {"turn_id": turn_id, "outcome": final})
    messages, events, audit_rows = writes.uncommitted()
    placed: list[Checkpoint] = []

    def commit_turn(current: Session | None) -> SessionChange:
        """The turn onto the session as it is NOW: its messages follow whatever the row
        holds at commit time (a remote page or another process may have added to it)."""
        if current is None:
            raise NotFound(f"session {session.id} does not exist")
        if current.deleted:
            # Deleted while the turn ran: the delete wins; the log and the ledger keep the turn.
            return SessionChange(events=events)
        # The turn's checkpoint holds all its messages, those committed when it waited too.
        # A rollback while it waited took those from the row: the turn then lands whole
        # after what the row holds (its tool results never come without their calls).
        # (Only a turn that waited has committed messages: the common turn reads no set of
        # the row's ids, which grows with the session.)
        ids = current.state.message_ids
        if kept and not set(kept) <= set(ids):
            turn = set(kept)
            ids = [i for i in ids if i not in turn] + kept
        checkpoint = core.draft_checkpoint(
            session.id,
            parent_id=current.head_checkpoint_id,
            turn_id=turn_id,
            kind=kind,
            appended=kept + fresh,
            checkpoint_id=checkpoint_id,
        )
        placed[:] = [checkpoint]
        state = msgspec.structs.replace(
            current.state, message_ids=ids + fresh, pending_tool_calls=[]
        )
        row = msgspec.structs.replace(current, state=state, head_checkpoint_id=checkpoint.id)
        return SessionChange(row=row, records=[*messages, checkpoint], events=events)

    result = await core.write([(session.id, commit_turn)], audit=audit_rows)
    writes.mark_committed()
    updated = result.sessions.get(session.id)
    if updated is not None:
        core.remember_turn(session, updated, messages)
    checkpoint = placed[0] if placed and updated is not None else None
    if checkpoint is None:
        return out
    out.append(
        CheckpointCreated(
            session_id=session.id,
            checkpoint_id=checkpoint.id,
            parent_id=checkpoint.parent_id,
            turn_id=turn_id,
            reason=checkpoint.kind,
        )
    )
    return out


__all__ = ["Resume", "load_resume", "run_turn", "to_api_messages"]
