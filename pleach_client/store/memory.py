"""``MemoryAdapter``: the non-durable local store, for tests, demos and throwaway sessions.

It keeps the semantics of ``SQLiteAdapter`` (one conformance suite runs against both): every
record is held as its msgpack bytes, so a caller only ever gets copies and cannot mutate stored
state; a commit is staged in full before anything is applied, so a failing batch leaves no
trace; outbox sequence numbers are never reused. Data lives as long as the object: closing and
re-opening the same adapter keeps it, like re-opening a file.

No method awaits anything, so each one is atomic with respect to other tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any, TypeVar, cast

import msgspec

from shared.errors import InvalidState, StorageError
from shared.records import (
    RECORD_KINDS,
    ArtifactUpdate,
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Record,
    Session,
    encode_record,
)
from shared.resource import AsyncResource

from .base import (
    CommitReceipt,
    DeadLetter,
    EventPlace,
    HydrationKey,
    KeptHydration,
    OutboxEntry,
    Plan,
    WriteBatch,
    decode_children,
    decode_events,
    decode_log,
    marked_canonical,
)

__all__ = ["MemoryAdapter"]

_T = TypeVar("_T")

_SESSION: msgspec.msgpack.Decoder[Session] = msgspec.msgpack.Decoder(Session)
_MESSAGE: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_CHECKPOINT: msgspec.msgpack.Decoder[Checkpoint] = msgspec.msgpack.Decoder(Checkpoint)
_EVENT: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(Event)
_AUDIT: msgspec.msgpack.Decoder[AuditRow] = msgspec.msgpack.Decoder(AuditRow)
_ARTIFACT: msgspec.msgpack.Decoder[ArtifactUpdate] = msgspec.msgpack.Decoder(ArtifactUpdate)
_RECORD: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)
_KINDS = tuple(info.cls for info in RECORD_KINDS.values())


class _State(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class _SessionRow:
    updated_at: str
    deleted: bool
    body: bytes


@dataclass(slots=True)
class _ChildRow:
    """A checkpoint, event or artifact update: its group (session or artifact) and sort key."""

    group: str
    order: str | int
    body: bytes


@dataclass(slots=True)
class _AuditRow:
    client_id: str
    session_id: str
    sequence_number: int
    subject_key: str | None
    body: bytes


@dataclass(slots=True)
class _OutboxRow:
    body: bytes | None  # None: refers to the current version of a mutable record (``ref``)
    attempts: int
    created_at: float
    last_error_code: int | None = None
    last_error_message: str | None = None
    ref: tuple[str, str] | None = None


@dataclass(slots=True)
class _DeadRow:
    body: bytes
    code: int
    message: str
    attempts: int
    failed_at: float
    ref: tuple[str, str] | None = None  # the record it was queued for (a purge's: ``_unqueue``)


class _Index:
    """Rows of one table by id, plus the ids of each group (session or artifact)."""

    def __init__(self) -> None:
        self.rows: dict[str, _ChildRow] = {}
        self.groups: dict[str, set[str]] = {}

    def put(self, row_id: str, row: _ChildRow) -> None:
        old = self.rows.get(row_id)
        if old is not None and old.group != row.group:
            self.groups[old.group].discard(row_id)
        self.rows[row_id] = row
        self.groups.setdefault(row.group, set()).add(row_id)

    def group(self, group: str) -> list[tuple[str, _ChildRow]]:
        """The rows of ``group``, sorted by their key then id."""
        rows = [(row_id, self.rows[row_id]) for row_id in self.groups.get(group, ())]
        rows.sort(key=lambda item: (item[1].order, item[0]))
        return rows

    def drop_group(self, group: str) -> None:
        for row_id in self.groups.pop(group, ()):
            del self.rows[row_id]


def _decode(decoder: msgspec.msgpack.Decoder[_T], body: bytes) -> _T:
    # Bodies were made by ``encode_record`` in this process, so they always decode.
    return decoder.decode(body)


class MemoryAdapter(AsyncResource):
    """A ``StorageAdapter`` that keeps everything in the heap (``durable = False``).

    Use as ``async with MemoryAdapter() as store``; every call needs the store open.
    """

    durable = False

    def __init__(self) -> None:
        self._state = _State.NEW
        self._sessions: dict[str, _SessionRow] = {}
        self._messages: dict[str, bytes] = {}
        self._checkpoints = _Index()
        self._events = _Index()
        self._artifacts = _Index()
        self._audit: dict[str, _AuditRow] = {}
        self._outbox: dict[int, _OutboxRow] = {}
        self._dead: dict[int, _DeadRow] = {}
        self._meta: dict[str, str] = {}
        self._hydrations: dict[str, KeptHydration] = {}
        self._last_seq = 0
        self._write_lock = asyncio.Lock()

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the store (a closed one re-opens with its data); raises if already open."""
        if self._state is _State.OPEN:
            raise InvalidState("MemoryAdapter is already open")
        self._state = _State.OPEN

    async def close(self) -> None:
        """Close the store; idempotent. The data stays with the object."""
        if self._state is _State.OPEN:
            self._state = _State.CLOSED

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise InvalidState(f"MemoryAdapter is {self._state.value}; open it first")

    # -- writes ---------------------------------------------------------------------------

    async def commit(self, batch: WriteBatch) -> CommitReceipt:
        """Write the batch all-or-nothing; raises ``StorageError`` and changes nothing if any
        record cannot be encoded or a meta value is not a string."""
        self._check_open()
        return self._apply(batch)

    async def transact(self, plan: Plan) -> CommitReceipt:
        """Call ``plan`` with this store as its reader, then write its batch; transactions
        run one at a time."""
        self._check_open()
        async with self._write_lock:
            batch = await plan(self)
            self._check_open()
            return CommitReceipt(client_seqs=[], records=0) if batch is None else self._apply(batch)

    async def missing_messages(self, message_ids: list[str]) -> list[str]:
        self._check_open()
        return [m for m in message_ids if m not in self._messages]

    async def session_queued(self, session_id: str) -> bool:
        self._check_open()
        return any(row.ref == ("Session", session_id) for row in self._outbox.values())

    async def queued_records(self) -> list[Record]:
        self._check_open()
        return [_decode(_RECORD, self._body_of(self._outbox[seq])) for seq in sorted(self._outbox)]

    async def audit_rows(self, row_ids: list[str]) -> list[AuditRow]:
        self._check_open()
        return [_decode(_AUDIT, self._audit[i].body) for i in row_ids if i in self._audit]

    async def event_head(self, session_id: str) -> tuple[int, str]:
        self._check_open()
        rows = self._events.group(session_id)
        if not rows:
            return (0, "")
        event = _decode(_EVENT, rows[-1][1].body)
        return (event.sequence_number, event.row_hash)

    def _apply(self, batch: WriteBatch) -> CommitReceipt:
        encoded: list[tuple[Record, bytes]] = []
        queued: list[tuple[Record, bytes]] = []
        for target, records in ((encoded, batch.records), (queued, batch.queued)):
            for record in records:
                if not isinstance(record, _KINDS):
                    raise StorageError(f"commit failed: not a record: {type(record).__name__}")
                try:
                    target.append((record, encode_record(record)))
                except (TypeError, OverflowError, msgspec.EncodeError) as exc:
                    raise StorageError(
                        f"commit failed: cannot encode {type(record).__name__} {record.id!r}: {exc}"
                    ) from exc
        for key, value in batch.meta.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise StorageError(f"commit failed: meta {key!r} must map str to str")

        rechained = [(row, encode_record(row)) for row in batch.rechained_audit]
        # Nothing below can fail: the batch is applied whole.
        for row, body in rechained:
            if row.id in self._audit:
                self._audit[row.id] = _AuditRow(
                    row.client_id, row.session_id, row.sequence_number, row.subject_key, body
                )
        if batch.renumber_outbox:
            rows = [self._outbox[seq] for seq in sorted(self._outbox)]
            self._outbox = dict(enumerate(rows, start=1))
            self._last_seq = len(rows)
        keep = set(batch.purge_keep)
        for session_id in batch.purge_sessions:
            self._purge_session(session_id, keep)
        for record, body in encoded + queued:
            self._put(record, body)
        for event_id in batch.canonical:
            stored = self._events.rows.get(event_id)
            if stored is not None:
                body = stored.body
                marked = marked_canonical(body, partial(_decode, _EVENT, body), encode_record)
                if marked != body:
                    self._events.put(event_id, _ChildRow(stored.group, stored.order, marked))
        for session_id in batch.purge_checkpoints_for:
            dropped = {
                ("Checkpoint", row_id) for row_id in self._checkpoints.groups.get(session_id, ())
            }
            self._unqueue(dropped, session_id)
            self._checkpoints.drop_group(session_id)
        seqs: list[int] = []
        now = time.time()
        for record, body in (encoded if batch.outbox else []) + queued:
            seqs.append(self._enqueue(record, body, now))
        self._meta.update(batch.meta)
        return CommitReceipt(client_seqs=seqs, records=len(encoded) + len(queued))

    def _purge_session(self, session_id: str, keep: set[str]) -> None:
        gone: set[tuple[str, str]] = set()
        for message_id, body in list(self._messages.items()):
            if message_id not in keep and _decode(_MESSAGE, body).session_id == session_id:
                gone.add(("Message", message_id))
                del self._messages[message_id]
        for index in (self._checkpoints, self._artifacts):
            for row_id, row in list(index.rows.items()):
                child = _decode(_RECORD, row.body)
                kept = child.artifact_id if isinstance(child, ArtifactUpdate) else row_id
                if (
                    isinstance(child, Checkpoint | ArtifactUpdate)
                    and child.session_id == session_id
                    and kept not in keep
                ):
                    gone.add((type(child).__name__, row_id))
                    index.rows.pop(row_id)
                    index.groups.get(row.group, set()).discard(row_id)
        self._unqueue(gone, session_id)

    def _unqueue(self, refs: set[tuple[str, str]], session_id: str) -> None:
        """Queued rows of purged contents refer to the deleted session's row instead: they
        send its tombstone (client_seq stays gap-free) and the contents never leave."""
        for outbox_row in self._outbox.values():
            if outbox_row.ref in refs:
                outbox_row.ref = ("Session", session_id)
                outbox_row.body = None  # (a dead letter queued again carried its copy)

    def _put(self, record: Record, body: bytes) -> None:
        match record:
            case Session():
                self._sessions[record.id] = _SessionRow(record.updated_at, record.deleted, body)
            case Message():
                self._messages.setdefault(record.id, body)
            case Checkpoint():
                if record.id not in self._checkpoints.rows:
                    row = _ChildRow(record.session_id, record.hlc, body)
                    self._checkpoints.put(record.id, row)
            case Event():
                # Upsert: a provisional event is rebased to its canonical place.
                row = _ChildRow(record.session_id, record.sequence_number, body)
                self._events.put(record.id, row)
            case AuditRow():
                if record.id not in self._audit:
                    self._audit[record.id] = _AuditRow(
                        record.client_id,
                        record.session_id,
                        record.sequence_number,
                        record.subject_key,
                        body,
                    )
            case ArtifactUpdate():
                if record.id not in self._artifacts.rows:
                    row = _ChildRow(record.artifact_id, record.hlc, body)
                    self._artifacts.put(record.id, row)

    def _enqueue(self, record: Record, body: bytes, now: float) -> int:
        # Every record is queued by reference, as in SQLiteAdapter: the flush sends the stored
        # version (the current one, for sessions and events).
        self._last_seq += 1
        ref = (type(record).__name__, record.id)
        self._outbox[self._last_seq] = _OutboxRow(body=None, attempts=0, created_at=now, ref=ref)
        return self._last_seq

    def _body_of(self, row: _OutboxRow) -> bytes:
        if row.body is not None:
            return row.body
        assert row.ref is not None
        kind, record_id = row.ref
        match kind:
            case "Session":
                return self._sessions[record_id].body
            case "Message":
                return self._messages[record_id]
            case "Checkpoint":
                return self._checkpoints.rows[record_id].body
            case "AuditRow":
                return self._audit[record_id].body
            case "ArtifactUpdate":
                return self._artifacts.rows[record_id].body
        return self._events.rows[record_id].body

    async def gdpr_soft_delete(self, subject_key: str) -> int:
        """Clear ``subject_key``, ``request_id`` and ``detail`` of the subject's audit rows and
        mark them ``redacted``; ids, digests and hashes stay. Returns the rows touched."""
        self._check_open()
        touched = 0
        for row in self._audit.values():
            if row.subject_key != subject_key:
                continue
            old = _decode(_AUDIT, row.body)
            new = msgspec.structs.replace(
                old, subject_key=None, request_id=None, detail={}, redacted=True
            )
            row.body = encode_record(new)
            row.subject_key = None
            touched += 1
        return touched

    # -- sync state -----------------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        self._check_open()
        return self._meta.get(key)

    async def peek_meta(self, key: str) -> str | None:
        return await self.get_meta(key)  # (no other process shares this store)

    async def set_meta(self, key: str, value: str) -> None:
        self._check_open()
        if not isinstance(value, str):
            raise StorageError(f"meta {key!r} must be a string, not {type(value).__name__}")
        self._meta[key] = value

    # -- reads ----------------------------------------------------------------------------

    async def get_session(self, session_id: str) -> Session | None:
        self._check_open()
        row = self._sessions.get(session_id)
        return None if row is None else _decode(_SESSION, row.body)

    async def list_sessions(self, *, include_deleted: bool = False) -> list[Session]:
        """Sessions newest first (by ``updated_at``, then id, both descending)."""
        self._check_open()
        rows = [
            (row.updated_at, session_id, row.body)
            for session_id, row in self._sessions.items()
            if include_deleted or not row.deleted
        ]
        rows.sort(reverse=True)
        return [_decode(_SESSION, body) for _, _, body in rows]

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        """Messages in the order of ``message_ids``; unknown ids are skipped."""
        self._check_open()
        return [
            _decode(_MESSAGE, self._messages[message_id])
            for message_id in message_ids
            if message_id in self._messages
        ]

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        self._check_open()
        row = self._checkpoints.rows.get(checkpoint_id)
        return None if row is None else _decode(_CHECKPOINT, row.body)

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        """Checkpoints of a session, oldest first (by hlc, then id)."""
        self._check_open()
        return [_decode(_CHECKPOINT, row.body) for _, row in self._checkpoints.group(session_id)]

    async def child_checkpoints(self, session_id: str, parent_id: str) -> list[Checkpoint]:
        """The session's checkpoints whose parent is ``parent_id``, oldest first."""
        self._check_open()
        rows = [(key, row.body) for key, row in self._checkpoints.group(session_id)]
        return decode_children(rows, parent_id, lambda _, body: _decode(_CHECKPOINT, body))

    async def list_events(
        self,
        session_id: str,
        *,
        from_sequence: int = 0,
        types: Collection[str] | None = None,
        limit: int | None = None,
    ) -> list[Event]:
        """Events with ``sequence_number >= from_sequence``, by sequence number, then id;
        only those of ``types`` when given; the first ``limit`` when given."""
        self._check_open()
        rows = [
            (key, row.body)
            for key, row in self._events.group(session_id)
            if int(row.order) >= from_sequence
        ][:limit]
        return decode_events(rows, types, lambda _, body: _decode(_EVENT, body))

    async def event_places(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[EventPlace]:
        """``list_events``, as each event's id and place."""
        return [
            EventPlace(e.id, e.sequence_number, e.prev_hash, e.row_hash, e.canonical)
            for e in await self.list_events(session_id, from_sequence=from_sequence, limit=limit)
        ]

    async def event_payloads(
        self, session_id: str, types: Collection[str]
    ) -> list[tuple[str, dict[str, Any]]]:
        """``(type, payload)`` of the session's events of ``types``, in chain order."""
        return (await self.hydration_log(session_id, types, ()))[0]

    async def hydration_log(
        self,
        session_id: str,
        tallied: Collection[str],
        whole: Collection[str],
        *,
        from_sequence: int = 0,
    ) -> tuple[list[tuple[str, dict[str, Any]]], list[Event]]:
        self._check_open()
        rows = [
            (key, row.body)
            for key, row in self._events.group(session_id)
            if cast(int, row.order) >= from_sequence
        ]
        return decode_log(rows, tallied, whole, lambda _, body: _decode(_EVENT, body))

    async def hydration_key(self, session_id: str, *, upto: int | None = None) -> HydrationKey:
        self._check_open()
        rows = [
            row
            for _, row in self._events.group(session_id)
            if upto is None or cast(int, row.order) <= upto
        ]
        if not rows:
            return (0, 0, "")
        head = _decode(_EVENT, rows[-1].body)
        return (len(rows), head.sequence_number, head.row_hash)

    async def kept_hydration(self, session_id: str) -> KeptHydration | None:
        self._check_open()
        return self._hydrations.get(session_id)

    async def keep_hydration(self, session_id: str, kept: KeptHydration) -> None:
        self._check_open()
        async with self._write_lock:
            self._hydrations[session_id] = KeptHydration(kept.key, kept.version, bytes(kept.body))

    async def get_event(self, event_id: str) -> Event | None:
        self._check_open()
        row = self._events.rows.get(event_id)
        return None if row is None else _decode(_EVENT, row.body)

    async def list_audit(
        self, *, session_id: str | None = None, client_id: str | None = None
    ) -> list[AuditRow]:
        """Audit rows ordered by (client_id, sequence_number, id)."""
        self._check_open()
        rows = [
            (row.client_id, row.sequence_number, row_id, row.body)
            for row_id, row in self._audit.items()
            if (session_id is None or row.session_id == session_id)
            and (client_id is None or row.client_id == client_id)
        ]
        rows.sort(key=lambda item: item[:3])
        return [_decode(_AUDIT, body) for *_, body in rows]

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        """Updates of one artifact by hlc, then id (any order merges to the same document)."""
        self._check_open()
        return [_decode(_ARTIFACT, row.body) for _, row in self._artifacts.group(artifact_id)]

    # -- outbox ---------------------------------------------------------------------------

    async def outbox_pending(self, limit: int = 500, *, after: int = 0) -> list[OutboxEntry]:
        """Oldest first, by client_seq; those after ``after``."""
        self._check_open()
        seqs = sorted(seq for seq in self._outbox if seq > after)[: max(limit, 0)]
        last: dict[tuple[str, str], int] = {}  # a session row -> its last number referring
        for seq, row in self._outbox.items():
            if row.body is None and row.ref is not None and row.ref[0] == "Session":
                last[row.ref] = max(seq, last.get(row.ref, 0))
        return [self._entry(seq, self._outbox[seq], last) for seq in seqs]

    def _entry(self, seq: int, row: _OutboxRow, last: dict[tuple[str, str], int]) -> OutboxEntry:
        again_later = row.body is None and row.ref is not None and last.get(row.ref, 0) > seq
        body = self._body_of(row)
        return OutboxEntry(
            client_seq=seq,
            record=_decode(_RECORD, body),
            body=body,
            attempts=row.attempts,
            created_at=row.created_at,
            last_error_code=row.last_error_code,
            last_error_message=row.last_error_message,
            again_later=again_later,
        )

    async def last_client_seq(self) -> int:
        self._check_open()
        return self._last_seq

    async def outbox_count(self) -> int:
        self._check_open()
        return len(self._outbox)

    async def outbox_remove(self, client_seqs: list[int]) -> None:
        """Drop acknowledged entries; unknown sequence numbers are ignored."""
        self._check_open()
        for seq in client_seqs:
            self._outbox.pop(seq, None)

    async def outbox_mark_attempt(
        self, client_seqs: list[int], code: int | None, message: str | None
    ) -> None:
        """Count one more failed attempt with its error; entries stay queued."""
        self._check_open()
        for seq in _unique(client_seqs):
            row = self._outbox.get(seq)
            if row is not None:
                row.attempts += 1
                row.last_error_code = code
                row.last_error_message = message

    async def outbox_dead_letter(self, client_seq: int, code: int, message: str) -> None:
        """Move one entry to dead_letters, keeping its attempts count (count the rejecting
        attempt with ``outbox_mark_attempt`` first if it should show); unknown seq: no-op."""
        self._check_open()
        row = self._outbox.pop(client_seq, None)
        if row is not None:
            body = self._body_of(row)
            self._dead[client_seq] = _DeadRow(
                body, code, message, row.attempts, time.time(), row.ref
            )

    async def dead_letters(self) -> list[DeadLetter]:
        """Dead letters by client_seq."""
        self._check_open()
        return [
            DeadLetter(
                client_seq=seq,
                record=_decode(_RECORD, row.body),
                code=row.code,
                message=row.message,
                attempts=row.attempts,
                failed_at=row.failed_at,
            )
            for seq, row in sorted(self._dead.items())
        ]

    async def dead_letter_count(self) -> int:
        self._check_open()
        return len(self._dead)

    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Re-enqueue a dead letter under a new client_seq (returned, with attempts reset);
        None if unknown."""
        self._check_open()
        row = self._dead.pop(client_seq, None)
        if row is None:
            return None
        self._last_seq += 1
        self._outbox[self._last_seq] = _OutboxRow(
            body=row.body, attempts=0, created_at=time.time(), ref=row.ref
        )
        return self._last_seq

    async def discard_dead_letter(self, client_seq: int) -> bool:
        """Forget a dead letter for good; False if unknown."""
        self._check_open()
        return self._dead.pop(client_seq, None) is not None


def _unique(values: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(values))
