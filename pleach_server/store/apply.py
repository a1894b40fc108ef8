"""Store-independent push logic: what one push batch does, written against ``StoreTx``.

A store opens ONE transaction, wraps it in its ``StoreTx`` and calls ``apply_push``; it commits
when that returns and rolls back when it raises. Every rule of the sync protocol lives here, so
the SQLite and PostgreSQL stores cannot drift apart:

- **Idempotency** by ``(tenant, client_id, client_seq)``: ``seq <= last_seq`` is a
  ``duplicate``; ``last_seq + 1`` is processed; a gap rejects that change and every later one
  of the batch with 3006 and leaves ``last_seq`` alone (the device resends from
  ``last_seq + 1``).
- **Validation** rejects a change with a code and still advances ``last_seq``, so one bad change
  never blocks the queue: foreign tenant 3002, another tenant's id 3002, wrong ``client_id`` or
  malformed ids/stamps 3007, a stamp too far in the future 3011.
- **Sessions** merge by version vector; concurrent versions are settled last-writer-wins and
  the loser is kept as a fork (a new session), reported in a ``ConflictReceipt``.
- **Immutable kinds** (message, checkpoint, audit row, artifact update) are a union by id.
- **Events** get their canonical place from the server: the next ``sequence_number`` of their
  session, hash-chained onto the last canonical row.

Every record written goes to the tenant's feed; its cursor is reported in the result.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from shared.clock import HybridClock, Order, Timestamp, vv_bump
from shared.errors import ClockSkew, Forbidden, InvalidRecord, SequenceGap, SyncError
from shared.hashchain import GENESIS, chain_event
from shared.ids import uuid7
from shared.merge import resolve_conflicts
from shared.messages import ChangeResult, ConflictReceipt
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Change,
    Checkpoint,
    Event,
    Message,
    Record,
    RecordKind,
    Session,
    record_kind,
)

from .base import PushResult, Tenant

__all__ = ["StoreTx", "apply_push", "validate_record"]


class StoreTx(Protocol):
    """One open write transaction of a server store, as ``apply_push`` needs it.

    Every method runs inside the same transaction and sees its earlier writes. The store owns
    BEGIN / COMMIT / ROLLBACK; a method raises only when the database fails (translated to
    ``StorageUnavailable`` by the store) and the whole batch is then rolled back.
    """

    async def lock_tenant(self, tenant: Tenant) -> None:
        """Serialize this transaction against every other push of ``tenant`` until it ends.

        Called first. Under it, the tenant's ``last_seq``, session rows, event chains and feed
        cursors cannot race, and its feed cursors commit in increasing order. (SQLite's
        ``BEGIN IMMEDIATE`` already serializes everything: a no-op there. PostgreSQL: a
        transaction-scoped advisory lock on the tenant.)
        """
        ...

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        """The device's ``last_seq``; 0 for a device never seen."""
        ...

    async def set_last_seq(self, tenant: Tenant, client_id: str, last_seq: int) -> None:
        """Store the device's ``last_seq`` (insert or update)."""
        ...

    async def owner_of(self, kind: RecordKind, record_id: str) -> Tenant | None:
        """The tenant that already owns ``record_id`` of ``kind``, or None when it is free.

        For ``"Session"`` an id is owned by the tenant of its session row OR of any stored
        record filed under it (``session_id``), so events pushed before their session row
        still claim the session id for their tenant.
        """
        ...

    async def get_session(self, session_id: str) -> Session | None:
        """The current row of a session, or None."""
        ...

    async def put_session(self, session: Session) -> None:
        """Insert or replace a session row."""
        ...

    async def insert_if_absent(self, record: Record) -> bool:
        """Insert an immutable record (not a session, not an event) unless its id exists.

        Returns True when inserted, False when a record of that kind and id was already there.
        """
        ...

    async def last_event(self, session_id: str) -> tuple[int, str] | None:
        """``(sequence_number, row_hash)`` of the session's last canonical event, or None."""
        ...

    async def insert_event(self, event: Event) -> None:
        """Insert a canonical event; ``(session_id, sequence_number)`` is unique."""
        ...

    async def append_feed(self, tenant: Tenant, record: Record) -> int:
        """Append ``record`` to the tenant's feed; returns its new cursor (monotonic)."""
        ...

    async def head_cursor(self, tenant: Tenant) -> int:
        """The tenant's latest feed cursor (0 when none), as this transaction sees it."""
        ...


_SESSION_SCOPED = (Message, Checkpoint, Event, AuditRow, ArtifactUpdate)


def _non_empty(value: object) -> bool:
    return isinstance(value, str) and value != ""


def validate_record(record: Record, tenant: Tenant, client_id: str) -> SyncError | None:
    """The checks that need no database: tenant, origin device, ids and stamps.

    Returns the error to reject with, or None when the record may proceed.
    """
    if record.org_id != tenant.org_id or record.user_id != tenant.user_id:
        return Forbidden("record belongs to another tenant")
    if record.client_id != client_id:
        return InvalidRecord(
            f"record client_id {record.client_id!r} is not the pushing device {client_id!r}"
        )
    if not _non_empty(record.id):
        return InvalidRecord("record id must be a non-empty string")
    if isinstance(record, _SESSION_SCOPED) and not _non_empty(record.session_id):
        return InvalidRecord("session_id must be a non-empty string")
    if isinstance(record, ArtifactUpdate) and not _non_empty(record.artifact_id):
        return InvalidRecord("artifact_id must be a non-empty string")
    try:
        Timestamp.decode(record.hlc)
        if isinstance(record, Session):
            Timestamp.decode(record.updated_at)
    except InvalidRecord as exc:
        return exc
    if isinstance(record, Session) and any(n < 0 for n in record.vv.values()):
        return InvalidRecord("version vector entries must be >= 0")
    return None


async def _check_owners(
    tx: StoreTx, record: Record, tenant: Tenant
) -> tuple[SyncError | None, bool]:
    """Reject ids (and session ids) another tenant already owns.

    Returns ``(error, present)``: ``present`` is True when the tenant already has this id.
    """
    kind = record_kind(record)
    owner = await tx.owner_of(kind, record.id)
    if owner is not None and owner != tenant:
        return Forbidden(f"{kind} id {record.id!r} belongs to another tenant"), False
    session_ids: list[str] = []
    if isinstance(record, _SESSION_SCOPED):
        session_ids.append(record.session_id)
    elif record.forked_from:
        session_ids.append(record.forked_from)
    for session_id in session_ids:
        other = await tx.owner_of("Session", session_id)
        if other is not None and other != tenant:
            return Forbidden(f"session {session_id!r} belongs to another tenant"), False
    return None, owner is not None


def _observe(clock: HybridClock, record: Record) -> SyncError | None:
    try:
        clock.observe(record.hlc)
        if isinstance(record, Session) and record.updated_at != record.hlc:
            # updated_at decides last-writer-wins: a stamp far ahead must not win for a day.
            clock.observe(record.updated_at)
    except (ClockSkew, InvalidRecord) as exc:
        return exc
    return None


def _rejected(seq: int, error: SyncError) -> ChangeResult:
    return ChangeResult(
        client_seq=seq, status="rejected", code=int(error.code), message=error.message
    )


class _Batch:
    """The state of one ``apply_push`` call: its transaction and the cursors it wrote."""

    def __init__(self, tx: StoreTx, tenant: Tenant, clock: HybridClock, server_id: str) -> None:
        self.tx = tx
        self.tenant = tenant
        self.clock = clock
        self.server_id = server_id
        self.cursors: list[int] = []

    async def feed(self, record: Record) -> int:
        cursor = await self.tx.append_feed(self.tenant, record)
        self.cursors.append(cursor)
        return cursor

    async def apply(self, seq: int, record: Record, present: bool) -> ChangeResult:
        """Apply one validated record; ``present`` says the tenant already has its id."""
        match record:
            case Session():
                return await self._session(seq, record)
            case _ if present:
                return ChangeResult(client_seq=seq, status="duplicate")
            case Event():
                return await self._event(seq, record)
            case _:
                if not await self.tx.insert_if_absent(record):
                    return ChangeResult(client_seq=seq, status="duplicate")
                cursor = await self.feed(record)
                return ChangeResult(client_seq=seq, status="applied", cursor=cursor)

    async def _event(self, seq: int, event: Event) -> ChangeResult:
        last = await self.tx.last_event(event.session_id)
        number, prev_hash = (last[0] + 1, last[1]) if last is not None else (1, GENESIS)
        placed = msgspec.structs.replace(chain_event(event, prev_hash, number), canonical=True)
        await self.tx.insert_event(placed)
        cursor = await self.feed(placed)
        return ChangeResult(client_seq=seq, status="applied", cursor=cursor)

    async def _session(self, seq: int, pushed: Session) -> ChangeResult:
        current = await self.tx.get_session(pushed.id)
        if current is None:
            await self.tx.put_session(pushed)
            cursor = await self.feed(pushed)
            return ChangeResult(client_seq=seq, status="applied", cursor=cursor)
        resolution = resolve_conflicts(local=pushed, remote=current)
        if not resolution.concurrent:
            if resolution.order is not Order.DOMINATES:
                return ChangeResult(client_seq=seq, status="superseded")
            stored = msgspec.structs.replace(pushed, vv=resolution.merged_vv)
            await self.tx.put_session(stored)
            cursor = await self.feed(stored)
            return ChangeResult(client_seq=seq, status="applied", cursor=cursor)

        # Concurrent: the HLC winner keeps the id under a vector above both versions; the
        # loser lives on as a new session, so nothing written on either device is lost.
        now = self.clock.now()
        conflict_id = uuid7()
        pushed_won = resolution.winner == "local"
        winner, loser = (pushed, current) if pushed_won else (current, pushed)
        winner_row = msgspec.structs.replace(
            winner,
            vv=vv_bump(resolution.merged_vv, self.server_id),
            conflict_id=conflict_id,
            # The winner is not a loser of this conflict, whatever it was before.
            conflict_loser_side=None,
        )
        fork = msgspec.structs.replace(
            loser,
            id=uuid7(),
            client_id=self.server_id,
            hlc=now,
            updated_at=now,
            vv={self.server_id: 1},
            forked_from=pushed.id,
            forked_at_checkpoint=loser.head_checkpoint_id,
            conflict_id=conflict_id,
            conflict_loser_side="remote" if pushed_won else "local",
        )
        await self.tx.put_session(winner_row)
        await self.feed(winner_row)
        await self.tx.put_session(fork)
        cursor = await self.feed(fork)
        receipt = ConflictReceipt(
            conflict_id=conflict_id,
            session_id=pushed.id,
            winner=resolution.winner,
            fork_session_id=fork.id,
            conflicted_paths=resolution.conflicted_paths,
            detected_at=now,
        )
        return ChangeResult(client_seq=seq, status="resolved", conflict=receipt, cursor=cursor)


async def apply_push(
    tx: StoreTx,
    tenant: Tenant,
    client_id: str,
    changes: list[Change],
    clock: HybridClock,
    server_id: str,
) -> PushResult:
    """Apply one push batch inside ``tx``, in order; see the module docstring for the rules.

    ``clock`` is the server's HLC (it observes every accepted stamp and stamps forks);
    ``server_id`` is the vector entry the server bumps when it settles a conflict. The caller
    commits ``tx`` when this returns and rolls it back when it raises.
    """
    await tx.lock_tenant(tenant)
    start_seq = last_seq = await tx.get_last_seq(tenant, client_id)
    batch = _Batch(tx, tenant, clock, server_id)
    results: list[ChangeResult] = []
    gap = False
    for change in changes:
        seq = change.client_seq
        if gap or seq > last_seq + 1:
            # Nothing after a gap may apply: the device resends from last_seq + 1.
            gap = True
            results.append(
                _rejected(seq, SequenceGap(f"expected client_seq {last_seq + 1}, got {seq}"))
            )
            continue
        if seq <= last_seq:
            results.append(ChangeResult(client_seq=seq, status="duplicate"))
            continue
        last_seq = seq
        record = change.record
        present = False
        error = validate_record(record, tenant, client_id)
        if error is None:
            error, present = await _check_owners(tx, record, tenant)
        if error is None:
            error = _observe(clock, record)
        if error is not None:
            results.append(_rejected(seq, error))
            continue
        results.append(await batch.apply(seq, record, present))
    if last_seq != start_seq:
        await tx.set_last_seq(tenant, client_id, last_seq)
    return PushResult(
        results=results,
        last_seq=last_seq,
        head_cursor=await tx.head_cursor(tenant),
        cursors=batch.cursors,
    )
