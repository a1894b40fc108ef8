"""The event-log, checkpoint and audit facets of ``SessionRuntime``."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from shared.errors import InvalidState, NotFound
from shared.hashchain import ChainVerification, Proof, generate_proof, verify_chain
from shared.ids import uuid7
from shared.records import AuditRow, Checkpoint, Event, Message, Record, Session

from .core import SessionChange, existing
from .receipts import (
    AuditRollup,
    ForkReceipt,
    GdprSoftDeleteReceipt,
    RollbackReceipt,
    TurnRollup,
)
from .stream import Callback, CheckpointCreated

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
        return await self._rt.store.get_messages(ids)

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
        for m in await rt.store.get_messages(message_ids)
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
        """Tokens and cost by session (or all) and by turn."""
        rows = await self.rows(session_id)
        turns: dict[str, list[AuditRow]] = {}
        for row in rows:
            turns.setdefault(row.turn_id, []).append(row)
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


def _sum_rows(rows: list[AuditRow], *, turn_id: str) -> TurnRollup:
    cost: float | None = 0.0
    outcomes: dict[str, int] = {}
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
    )


__all__ = [
    "AuditFacet",
    "CheckpointsFacet",
    "EventsFacet",
    "FoldResult",
    "Projection",
    "rebuild_message_ids",
]
