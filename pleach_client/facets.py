"""The event-log, checkpoint, audit and interrupt facets of ``SessionRuntime``."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from shared.errors import InvalidState, NotFound
from shared.hashchain import ChainVerification, Proof, generate_proof, verify_chain
from shared.ids import uuid7
from shared.records import AuditRow, Checkpoint, Event, Message, Record, Session

from .core import SessionChange, existing
from .interrupts import (
    REQUESTED,
    RESOLVED,
    ApprovalDecision,
    Interrupt,
    ResolvePlan,
    as_decision,
    interrupt_states,
    next_deadline,
    plan_resolve,
    plan_settle,
)
from .lineage import root_turn_ids
from .receipts import (
    AuditRollup,
    ForkReceipt,
    GdprSoftDeleteReceipt,
    InterruptResolveReceipt,
    RollbackReceipt,
    TurnRollup,
)
from .store.base import TxReader
from .stream import Callback, CheckpointCreated, StreamEvent, StreamEventBase

if TYPE_CHECKING:
    from .runtime import SessionRuntime

S = TypeVar("S")


@dataclass(frozen=True)
class Projection(Generic[S]):
    """A fold over event-log rows: ``initial()`` then ``apply(state, event)`` per row."""

    name: str
    initial: Callable[[], S]
    apply: Callable[[S, Event], S]


@dataclass(frozen=True)
class FoldResult(Generic[S]):
    state: S
    rows_processed: int
    projection: str


class EventsFacet:
    """The durable event log (iterate, fold, verify, prove) and the live bus."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    async def iterate(
        self, session_id: str, *, from_sequence: int = 0, page_size: int = 500
    ) -> AsyncIterator[Event]:
        """Rows of a session's log in chain order, read a page at a time."""
        start = from_sequence
        while True:
            rows = await self._rt.store.list_events(session_id, from_sequence=start)
            page = rows[:page_size]
            for row in page:
                yield row
            if len(rows) <= page_size:
                return
            start = page[-1].sequence_number + 1

    async def fold(
        self, projection: Projection[S], session_id: str, *, from_sequence: int = 0
    ) -> FoldResult[S]:
        state = projection.initial()
        count = 0
        async for row in self.iterate(session_id, from_sequence=from_sequence):
            state = projection.apply(state, row)
            count += 1
        return FoldResult(state=state, rows_processed=count, projection=projection.name)

    async def verify_chain(self, session_id: str) -> ChainVerification:
        """Verify the session's chain; ``first_bad_index`` names the first bad row."""
        return verify_chain(await self._rt.store.list_events(session_id))

    async def generate_proof(self, event_id: str) -> Proof:
        event = await self._rt.store.get_event(event_id)
        if event is None:
            raise NotFound(f"no event {event_id}")
        return generate_proof(await self._rt.store.list_events(event.session_id), event_id)

    def on(self, event_type: str, handler: Callback) -> None:
        self._rt.bus.on(event_type, handler)

    def once(self, event_type: str, handler: Callback) -> None:
        self._rt.bus.once(event_type, handler)

    def off(self, event_type: str, handler: Callback) -> bool:
        return self._rt.bus.off(event_type, handler)


class CheckpointsFacet:
    """Checkpoints: list, rollback, fork, and time travel (``state_at``)."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    async def list(self, session_id: str) -> list[Checkpoint]:
        return await self._rt.store.list_checkpoints(session_id)

    async def _checkpoint_ids(self, session_id: str, checkpoint_id: str) -> builtins.list[str]:
        checkpoints = await self._rt.store.list_checkpoints(session_id)
        by_id = {c.id: c for c in checkpoints}
        if checkpoint_id not in by_id:
            raise NotFound(f"no checkpoint {checkpoint_id} in session {session_id}")
        return rebuild_message_ids(checkpoint_id, by_id)

    async def state_at(self, session_id: str, checkpoint_id: str) -> builtins.list[Message]:
        """Time travel: the transcript as it stood at ``checkpoint_id``."""
        ids = await self._checkpoint_ids(session_id, checkpoint_id)
        return await self._rt.core.messages(ids)

    async def rollback(self, session_id: str, checkpoint_id: str) -> RollbackReceipt:
        """Restore the session to a checkpoint as a NEW checkpoint; lineage and audit stay."""
        core = self._rt.core
        ids = await self._checkpoint_ids(session_id, checkpoint_id)
        before: builtins.list[Any] = []
        cp_id = uuid7()

        def rollback(current: Session) -> SessionChange:
            before[:] = [len(current.state.message_ids), current.head_checkpoint_id]
            cp = core.draft_checkpoint(
                session_id,
                parent_id=current.head_checkpoint_id,
                turn_id=None,
                kind="rollback",
                appended=[],
                snapshot=ids,
                checkpoint_id=cp_id,
            )
            state = msgspec.structs.replace(current.state, message_ids=ids, pending_tool_calls=[])
            row = msgspec.structs.replace(current, head_checkpoint_id=cp.id, state=state)
            event = core.draft_event(
                session_id,
                "checkpoint.rollback",
                {"to_checkpoint": checkpoint_id, "checkpoint_id": cp.id},
            )
            return SessionChange(row=row, records=[cp], events=[event])

        await core.write([(session_id, existing(rollback))])
        self._rt.emit(
            CheckpointCreated(
                session_id=session_id,
                checkpoint_id=cp_id,
                parent_id=before[1],
                turn_id=None,
                reason="rollback",
            )
        )
        return RollbackReceipt(
            session_id=session_id,
            checkpoint_id=checkpoint_id,
            new_checkpoint_id=cp_id,
            messages_before=before[0],
            messages_after=len(ids),
        )

    async def fork(self, session_id: str, checkpoint_id: str | None = None) -> ForkReceipt:
        """A new session at ``checkpoint_id`` (default: the head); the original is untouched.

        The fork gets its own copies of the transcript's messages and of the artifacts (new
        ids, same content), so it never depends on its origin: deleting the origin, here or
        on another device that has not seen the fork yet, cannot take anything from it.
        """
        core = self._rt.core
        source = await core.session(session_id)
        if checkpoint_id is None:
            ids = list(source.state.message_ids)
        else:
            ids = await self._checkpoint_ids(session_id, checkpoint_id)
        fork_id = uuid7()
        now = core.now()
        copy = await copy_into(self._rt, fork_id, ids, source.state.artifacts, kind="fork")
        fork = msgspec.structs.replace(
            source,
            id=fork_id,
            created_at=now,
            vv={},
            state=msgspec.structs.replace(
                source.state,
                message_ids=copy.message_ids,
                pending_tool_calls=[],
                artifacts=copy.artifact_ids,
                resolved={},
                kept_from=None,
            ),
            forked_from=session_id,
            forked_at_checkpoint=checkpoint_id or source.head_checkpoint_id,
            conflict_id=None,
            conflict_loser_side=None,
            head_checkpoint_id=copy.checkpoint.id,
        )
        event = core.draft_event(
            fork_id, "session.forked", {"forked_from": session_id, "checkpoint_id": checkpoint_id}
        )

        def create(current: Session | None) -> SessionChange:
            if current is not None:
                raise InvalidState(f"session {fork_id} already exists")
            return SessionChange(row=fork, records=copy.records, events=[event])

        await core.write([(fork_id, create)])
        return ForkReceipt(
            session_id=fork_id,
            forked_from=session_id,
            checkpoint_id=checkpoint_id,
            messages=len(copy.message_ids),
        )


@dataclass
class Copy:
    """A transcript and artifacts copied into another session, ready to write with it."""

    message_ids: builtins.list[str]
    artifact_ids: builtins.list[str]
    checkpoint: Checkpoint
    records: builtins.list[Record]


async def copy_into(
    rt: SessionRuntime,
    session_id: str,
    message_ids: builtins.list[str],
    artifact_ids: builtins.list[str],
    *,
    kind: str,
) -> Copy:
    """Copies of messages and artifacts under new ids, owned by ``session_id``, and a snapshot
    checkpoint of them: a session that holds copies never depends on another one's content
    (deleting that one, anywhere and at any time, takes nothing from it)."""
    core = rt.core
    messages = [
        msgspec.structs.replace(
            m,
            id=uuid7(),
            session_id=session_id,
            org_id=core.org_id,
            user_id=core.user_id,
            client_id=core.client_id,
            hlc=core.now(),
        )
        for m in await rt.core.messages(message_ids)
    ]
    artifacts = [
        update
        for artifact_id in artifact_ids
        if (update := await rt.artifacts.copy_to(artifact_id, session_id)) is not None
    ]
    ids = [m.id for m in messages]
    checkpoint = core.draft_checkpoint(
        session_id, parent_id=None, turn_id=None, kind=kind, appended=[], snapshot=ids
    )
    return Copy(
        message_ids=ids,
        artifact_ids=[a.artifact_id for a in artifacts],
        checkpoint=checkpoint,
        records=[*messages, *artifacts, checkpoint],
    )


def rebuild_message_ids(checkpoint_id: str, by_id: dict[str, Checkpoint]) -> builtins.list[str]:
    """Message ids at a checkpoint: walk parents to a snapshot or the root, replay."""
    chain: builtins.list[Checkpoint] = []
    current = by_id.get(checkpoint_id)
    while current is not None and len(chain) <= len(by_id):
        chain.append(current)
        if current.snapshot is not None or current.parent_id is None:
            break
        current = by_id.get(current.parent_id)
    ids: builtins.list[str] = []
    for cp in reversed(chain):
        if cp.snapshot is not None:
            ids = list(cp.snapshot)
        if cp.truncate_to is not None:
            ids = ids[: cp.truncate_to]
        ids.extend(cp.appended)
    return ids


class AuditFacet:
    """The append-only ledger: rows, rollups, chain checks and GDPR soft delete."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    async def rows(self, session_id: str | None = None) -> list[AuditRow]:
        return await self._rt.store.list_audit(session_id=session_id)

    async def rollup(self, session_id: str | None = None) -> AuditRollup:
        """Tokens and cost by session (or all) and by turn. A session's rollup includes its
        subagents' rows, each under the top-level turn it was spent for."""
        rows = await self.rows(session_id)
        if session_id is not None:
            rows += await self._rt.tasks.subagent_audit_rows(session_id)
        roots = root_turn_ids(rows)
        turns: dict[str, list[AuditRow]] = {}
        for row in rows:
            turns.setdefault(roots.get(row.turn_id, row.turn_id), []).append(row)
        turn_rollups = [_sum_rows(rows_, turn_id=t) for t, rows_ in turns.items()]
        total = _sum_rows(rows, turn_id="")
        return AuditRollup(
            session_id=session_id,
            calls=total.calls,
            input_tokens=total.input_tokens,
            output_tokens=total.output_tokens,
            cache_creation_input_tokens=total.cache_creation_input_tokens,
            cache_read_input_tokens=total.cache_read_input_tokens,
            cost_usd=total.cost_usd,
            turns=turn_rollups,
            outcomes=total.outcomes,
            subagent_calls=total.subagent_calls,
            subagent_cost_usd=total.subagent_cost_usd,
        )

    async def verify_chain(self, client_id: str | None = None) -> ChainVerification:
        """Verify one device's chain of audit rows (this device by default)."""
        rows = await self._rt.store.list_audit(client_id=client_id or self._rt.client_id)
        return verify_chain(rows)

    async def gdpr_soft_delete(self, subject_key: str) -> GdprSoftDeleteReceipt:
        """Clear identifying fields of a subject's rows; ids and the chain stay intact."""
        count = await self._rt.store.gdpr_soft_delete(subject_key)
        report = await self.verify_chain()
        return GdprSoftDeleteReceipt(
            subject_key=subject_key, rows_redacted=count, chain_verified=report.ok
        )


WaitEnd = Literal["resolved", "abort", "closing"]
Decision = ApprovalDecision | Mapping[str, Any] | str
"""A decision as callers give it: ``Approve()``, ``Reject(reason=...)``, ``Edit(input=...)``,
their wire shape (``{"kind": "reject", "reason": "..."}``), or ``"approve"``/``"reject"``."""


class InterruptsFacet:
    """Human in the loop: interrupts waiting for a decision, deciding them, and continuing a
    turn that waited through a restart (the rules: ``pleach_client.interrupts``).

    Any device of the user can decide: the request syncs to it. Only the device whose turn
    waits runs the tool, so only its word is final. A waiting turn wakes when a decision is
    made here or arrives by sync (the ``sync.applied`` stream event), never by polling.
    """

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt
        self._wakes: dict[str, set[asyncio.Event]] = {}
        self._turns: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = asyncio.Event()
        rt.bus.on("sync.applied", self._on_applied)

    # -- reads ------------------------------------------------------------------------------
    async def list(
        self, session_id: str | None = None, *, include_resolved: bool = False
    ) -> builtins.list[Interrupt]:
        """The interrupts waiting for a decision (not final yet), of one session or of all
        (found through the sessions' ``state.pending_tool_calls``, so this reads only the logs
        of sessions where something waits), in log order; ``include_resolved`` adds the
        settled ones (and reads whole logs)."""
        rt = self._rt
        if session_id is not None:
            sessions = [await rt.core.session(session_id)]
        else:
            sessions = await rt.store.list_sessions()
        out: builtins.list[Interrupt] = []
        for session in sessions:
            if include_resolved:
                found = interrupt_states(await rt.store.list_events(session.id))
                out.extend(found.values())
                continue
            ids = [
                call["interrupt_id"]
                for call in session.state.pending_tool_calls
                if isinstance(call.get("interrupt_id"), str)
            ]
            if ids:
                states = await self.states(session.id, ids)
                out.extend(s for s in states.values() if not s.final)
        return out

    async def get(self, interrupt_id: str) -> Interrupt:
        """One interrupt as this device's log has it; ``NotFound`` when this device has not
        seen its request (a wrong id, or one not synced here yet)."""
        requested = await self._requested(interrupt_id)
        found = (await self.states(requested.session_id, [interrupt_id])).get(interrupt_id)
        if found is None:
            raise NotFound(f"interrupt {interrupt_id} has a malformed request; it was refused")
        return found

    async def states(self, session_id: str, interrupt_ids: Iterable[str]) -> dict[str, Interrupt]:
        """The named interrupts of a session, folded from its log (from the oldest request)."""
        ids = builtins.list(interrupt_ids)
        low = await self._lowest(ids)
        if low is None:
            return {}
        found = interrupt_states(await self._rt.store.list_events(session_id, from_sequence=low))
        return {i: found[i] for i in ids if i in found}

    async def asked_here(self, interrupt: Interrupt) -> bool:
        """Whether this device asked (its turn is the one waiting on ``interrupt``)."""
        core = self._rt.core
        return interrupt.requested_by in {core.client_id, *await core.previous_client_ids()}

    def waiting_here(self, session_id: str) -> bool:
        """Whether a turn of this process is waiting on the session's interrupts now."""
        return self._turns.get(session_id, 0) > 0

    # -- decisions --------------------------------------------------------------------------
    async def resolve(
        self, interrupt_id: str, decision: Decision, *, wait: float | None = None
    ) -> InterruptResolveReceipt:
        """Decide an interrupt: ``Approve()``, ``Reject(reason=...)`` or ``Edit(input=...)``.

        The first decision wins. On the device whose turn waits the decision is final at
        once and the turn goes on; on another device it is a proposal that syncs to it
        (``final=False``), and ``wait`` (seconds) waits for the final word. ``NotFound``
        when this device has not seen the request (sync first); ``InvalidInput`` for a
        decision the request does not allow.
        """
        chosen = as_decision(decision)
        requested = await self._requested(interrupt_id)
        session_id = requested.session_id
        core = self._rt.core
        mine = {core.client_id, *await core.previous_client_ids()}
        plans: builtins.list[ResolvePlan] = []
        drafts: builtins.list[Event] = []

        async def prepare(tx: TxReader) -> tuple[builtins.list[Any], builtins.list[AuditRow]]:
            events = await tx.list_events(session_id, from_sequence=requested.sequence_number)
            state = interrupt_states(events).get(interrupt_id)
            if state is None:
                raise NotFound(f"interrupt {interrupt_id} has a malformed request; it was refused")
            plan = plan_resolve(state, chosen, by=core.client_id, asker=state.requested_by in mine)
            plans[:] = [plan]
            if plan.write is None or plan.payload is None:
                return [], []
            draft = core.draft_event(session_id, plan.write, plan.payload)
            drafts[:] = [draft]

            def add(current: Session | None) -> SessionChange:
                if current is None or current.deleted:
                    raise NotFound(f"session {session_id} was deleted: nothing waits any more")
                return SessionChange(events=[draft])

            return [(session_id, add)], []

        await core.write(prepare=prepare)
        self.wake(session_id)
        plan = plans[0]
        receipt = InterruptResolveReceipt(
            interrupt_id=interrupt_id,
            session_id=session_id,
            accepted=plan.accepted,
            final=plan.final,
            decision=plan.decision,
            decided_by=plan.decided_by,
            source=plan.source,
            event_id=drafts[0].id if drafts else None,
            resolved_at=drafts[0].hlc if drafts else core.now(),
        )
        if wait is not None and wait > 0 and not receipt.final:
            return await self._final(receipt, wait)
        return receipt

    def resume(
        self, session_id: str, *, abort: asyncio.Event | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Continue a turn that waited for decisions when its runtime closed or its process
        died (``rt.resume_turn``): it waits for what is still undecided, then goes on."""
        return self._rt.resume_turn(session_id, abort=abort)

    # -- the waiting turn's side -------------------------------------------------------------
    async def wait(
        self,
        session_id: str,
        interrupt_ids: builtins.list[str],
        abort_wait: asyncio.Future[Any] | None,
    ) -> tuple[WaitEnd, dict[str, Interrupt]]:
        """Wait until every interrupt named is final (the turn's side).

        Applies what is due on the way, under the store's write lock: a proposal that came
        (adopted), a deadline that passed (the default decision). Returns early on abort, or
        when the runtime closes (the turn is suspended; it resumes after a restart).
        """
        wake = asyncio.Event()
        self._wakes.setdefault(session_id, set()).add(wake)
        self._turns[session_id] = self._turns.get(session_id, 0) + 1
        self._idle.clear()
        try:
            while True:
                wake.clear()
                if self._closing.is_set():  # (before any read: the store may be closing)
                    return "closing", {}
                row = await self._rt.store.get_session(session_id)
                if row is None or row.deleted:
                    return "abort", {}  # deleted meanwhile (the delete wins): nothing to wait for
                states = await self.states(session_id, interrupt_ids)
                if abort_wait is not None and abort_wait.done():
                    return "abort", states
                now, by = self._rt.wall_ms(), self._rt.core.client_id
                if any(plan_settle(s, now_ms=now, abort=False, by=by) for s in states.values()):
                    states = await self.settle(session_id, interrupt_ids, abort=False)
                if len(states) == len(interrupt_ids) and all(s.final for s in states.values()):
                    return "resolved", states
                deadline = next_deadline(states.values())
                timeout = None if deadline is None else max(0.0, (deadline - now) / 1000)
                await _first([wake.wait(), self._closing.wait()], abort_wait, timeout=timeout)
        finally:
            self._unwake(session_id, wake)
            self._turns[session_id] -= 1
            if not self._turns[session_id]:
                del self._turns[session_id]
            if not self._turns:
                self._idle.set()

    async def settle(
        self, session_id: str, interrupt_ids: builtins.list[str], *, abort: bool
    ) -> dict[str, Interrupt]:
        """Write what the waiting turn owes (``plan_settle``), decided under the write lock:
        the adoption of a proposal, a deadline's default, or, with ``abort``, a rejection of
        whatever is not final yet. Returns the interrupts as they are then."""
        core = self._rt.core
        low = await self._lowest(interrupt_ids)
        if low is None:
            return {}

        async def prepare(tx: TxReader) -> tuple[builtins.list[Any], builtins.list[AuditRow]]:
            states = interrupt_states(await tx.list_events(session_id, from_sequence=low))
            now = self._rt.wall_ms()
            drafts = [
                core.draft_event(session_id, RESOLVED, payload)
                for i in interrupt_ids
                if (state := states.get(i)) is not None
                and (payload := plan_settle(state, now_ms=now, abort=abort, by=core.client_id))
                is not None
            ]
            if not drafts:
                return [], []
            return [(session_id, lambda current: SessionChange(events=drafts))], []

        await core.write(prepare=prepare)
        self.wake(session_id)
        return await self.states(session_id, interrupt_ids)

    def open(self) -> None:
        self._closing.clear()

    async def close(self) -> None:
        """Suspend every waiting turn (what they committed stays; they resume after a
        restart) and return once none is waiting any more."""
        self._closing.set()
        await self._idle.wait()

    # -- internals --------------------------------------------------------------------------
    async def _final(
        self, receipt: InterruptResolveReceipt, wait: float
    ) -> InterruptResolveReceipt:
        """``receipt`` once the asking device's resolution is here (or as it was, if it does
        not come within ``wait`` seconds)."""
        session_id, interrupt_id = receipt.session_id, receipt.interrupt_id
        wake = asyncio.Event()
        self._wakes.setdefault(session_id, set()).add(wake)
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        try:
            while True:
                wake.clear()
                state = (await self.states(session_id, [interrupt_id])).get(interrupt_id)
                remaining = until - loop.time()
                if state is None or state.final or remaining <= 0 or self._closing.is_set():
                    break
                await _first([wake.wait(), self._closing.wait()], None, timeout=remaining)
        finally:
            self._unwake(session_id, wake)
        if state is None or not state.final or state.decision is None:
            return receipt
        return InterruptResolveReceipt(
            interrupt_id=interrupt_id,
            session_id=session_id,
            accepted=receipt.event_id is not None and state.decision_event_id == receipt.event_id,
            final=True,
            decision=state.decision,
            decided_by=state.decided_by or "",
            source=state.source or "user",
            event_id=receipt.event_id,
            resolved_at=receipt.resolved_at,
        )

    async def _requested(self, interrupt_id: str) -> Event:
        requested = await self._rt.store.get_event(interrupt_id)
        if requested is None or requested.type != REQUESTED:
            raise NotFound(
                f"no interrupt {interrupt_id} on this device: its request was never made or "
                "has not synced here yet (sync, then decide); nothing was written"
            )
        return requested

    async def _lowest(self, interrupt_ids: Iterable[str]) -> int | None:
        """The lowest place of the requests in their log. A place only ever grows (a rebase
        moves the provisional tail after newly placed events), so reading from it later
        still reads every request and every decision after it."""
        places = [
            e.sequence_number
            for i in interrupt_ids
            if (e := await self._rt.store.get_event(i)) is not None
        ]
        return min(places) if places else None

    def _on_applied(self, event: StreamEventBase) -> None:
        self.wake(event.session_id)

    def wake(self, session_id: str) -> None:
        """Have whatever waits on the session's interrupts here look again (a write that
        may matter to them, such as a delete, calls this; a sync page does it by itself)."""
        for wake in self._wakes.get(session_id, ()):
            wake.set()

    def _unwake(self, session_id: str, wake: asyncio.Event) -> None:
        wakes = self._wakes.get(session_id)
        if wakes is not None:
            wakes.discard(wake)
            if not wakes:
                del self._wakes[session_id]


async def _first(
    own: builtins.list[Awaitable[Any]], shared: asyncio.Future[Any] | None, *, timeout: float | None
) -> None:
    """Wait until one of ``own`` or ``shared`` is done, or ``timeout`` seconds pass. ``own``
    are started here and cancelled after; ``shared`` belongs to the caller and is left as is."""
    tasks = [asyncio.ensure_future(a) for a in own]
    try:
        waits: set[asyncio.Future[Any]] = set(tasks)
        if shared is not None:
            waits.add(shared)
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sum_rows(rows: list[AuditRow], *, turn_id: str) -> TurnRollup:
    cost: float | None = 0.0
    outcomes: dict[str, int] = {}
    sub = [r for r in rows if r.subagent_depth > 0]
    sub_cost: float | None = 0.0
    for row in sub:
        sub_cost = None if sub_cost is None or row.cost_usd is None else sub_cost + row.cost_usd
    for row in rows:
        outcomes[row.outcome.status] = outcomes.get(row.outcome.status, 0) + 1
        cost = None if cost is None or row.cost_usd is None else cost + row.cost_usd
    return TurnRollup(
        turn_id=turn_id,
        calls=len(rows),
        input_tokens=sum(r.usage.input_tokens for r in rows),
        output_tokens=sum(r.usage.output_tokens for r in rows),
        cache_creation_input_tokens=sum(r.usage.cache_creation_input_tokens for r in rows),
        cache_read_input_tokens=sum(r.usage.cache_read_input_tokens for r in rows),
        cost_usd=cost,
        outcomes=outcomes,
        subagent_calls=len(sub),
        subagent_cost_usd=sub_cost,
    )


__all__ = [
    "AuditFacet",
    "CheckpointsFacet",
    "EventsFacet",
    "FoldResult",
    "InterruptsFacet",
    "Projection",
    "rebuild_message_ids",
]
