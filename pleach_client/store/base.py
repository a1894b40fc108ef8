"""The ``StorageAdapter`` protocol: what the runtime needs from a device's local store.

Writes go through ``commit(batch)``: every record of the batch, its outbox rows and any
``sync_state`` keys land in ONE transaction, so after a crash either all exist or none.
Reads return records (msgspec Structs from ``shared.records``). Audit rows have no update or
delete, only ``gdpr_soft_delete``. Implementations: ``MemoryAdapter`` (non-durable),
``SQLiteAdapter`` (aiosqlite) and ``PostgresAdapter`` (asyncpg, many devices in one database),
run against one conformance suite.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from types import TracebackType
from typing import Any, NamedTuple, Protocol, Self, runtime_checkable

import msgspec

from shared import compact
from shared.compact import Bodies
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Record,
    Session,
)

from ..receipts import CommitReceipt as CommitReceipt


class WriteBatch(msgspec.Struct, kw_only=True):
    """Everything one logical mutation writes.

    ``records`` are upserted by id (a session replaces its row; an event may be replaced when
    its provisional place is rebased; other kinds are immutable and re-inserting is a no-op).
    With ``outbox`` true, each record also gets an outbox row with the next ``client_seq``.
    ``meta`` sets ``sync_state`` keys (``hlc``, ``cursor``, ...) in the same transaction.
    ``purge_checkpoints_for`` deletes every checkpoint of those session ids.
    ``purge_sessions`` deletes the contents of those sessions (messages, checkpoints, artifact
    updates): the delete cascade. Their queued outbox rows stay (``client_seq`` has no gaps)
    but send the session's tombstone instead, so the contents never leave the device. The
    session row (its tombstone), its event log and audit rows stay, and so does any content
    whose id (or, for artifact updates, artifact id) is in ``purge_keep``: what a live fork
    still refers to.
    The purges run before ``records`` are written, so a batch may purge a session and write
    its tombstone.
    ``queued`` records are written and always get outbox rows, whatever ``outbox`` says (a
    remote page that also produces a local write, such as a fork keeping a local version).
    ``renumber_outbox`` gives the rows already queued the sequence numbers 1..n, in their
    order, before this batch's own rows are queued after them: a device that took a new
    client id (its file was restored or copied) starts a new sequence.
    ``rechained_audit`` replaces stored audit rows by id (client id, place and hashes): the
    unsent rows of an old client id moved onto the new id's chain.
    ``canonical`` marks stored events canonical where they stand, by id, nothing else of them
    changed (the server placed them as pushed); an id not stored is ignored. It writes what
    ``records`` with each event replaced ``canonical=True`` would, without encoding them.
    """

    records: list[Record] = []
    outbox: bool = True
    meta: dict[str, str] = {}
    purge_checkpoints_for: list[str] = []
    purge_sessions: list[str] = []
    purge_keep: list[str] = []
    queued: list[Record] = []
    renumber_outbox: bool = False
    rechained_audit: list[AuditRow] = []
    canonical: list[str] = []
    bodies: Bodies | None = None
    """The compact bytes some of ``records`` arrived in (a page pulled at protocol 6): a store
    that keeps compact bodies writes a record that is one of them as those bytes instead of
    encoding it again (``shared.compact.Bodies``). Changes nothing of what is written."""

    def is_empty(self) -> bool:
        """Whether committing it would change nothing."""
        return not (
            self.records
            or self.queued
            or self.purge_checkpoints_for
            or self.purge_sessions
            or self.meta
            or self.renumber_outbox
            or self.rechained_audit
            or self.canonical
        )


class TxReader(Protocol):
    """Reads inside a write transaction (``StorageAdapter.transact``): they see the file as
    it is under the write lock, including other processes' commits."""

    async def get_meta(self, key: str) -> str | None: ...
    async def get_session(self, session_id: str) -> Session | None: ...
    async def event_head(self, session_id: str) -> tuple[int, str]:
        """``(sequence_number, row_hash)`` of the session's last event; ``(0, "")`` if none."""
        ...

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[Event]:
        """The session's events from ``from_sequence`` on, in chain order; the first
        ``limit`` of them when given."""
        ...

    async def event_places(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[EventPlace]:
        """What ``list_events`` gives, as each event's id and place only (its payload not
        decoded)."""
        ...

    async def list_sessions(self) -> list[Session]:
        """The sessions that are not deleted."""
        ...

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]: ...
    async def missing_messages(self, message_ids: list[str]) -> list[str]:
        """Those of ``message_ids`` this store does not hold."""
        ...

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        """Messages in the order of ``message_ids``; unknown ids are skipped."""
        ...

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        """Updates of one artifact (any order merges to the same document)."""
        ...

    async def session_queued(self, session_id: str) -> bool:
        """Whether an outbox row still refers to the session ``session_id`` (a version of
        its row not acknowledged yet)."""
        ...

    async def queued_records(self) -> list[Record]:
        """The records the outbox still refers to, in ``client_seq`` order."""
        ...

    async def audit_rows(self, row_ids: list[str]) -> list[AuditRow]:
        """Those of ``row_ids`` this store holds, as stored (any order)."""
        ...


Plan = Callable[[TxReader], Awaitable[WriteBatch | None]]


class Rerunnable:
    """A plan that may be called more than once, each call's batch replacing the last: one
    whose only effects are what it returns (and caches it keeps right whatever it reads).

    A store may then call it before it takes the write lock, on a reader of the meta keys it
    saw after its last commit, and write the batch in the same step that checks, under the
    lock, that those keys did not change: one step to the database where a locked plan takes
    two (``SQLiteAdapter``). When they changed, or the plan asks that reader for anything else
    (it raises ``NotInSnapshot``), the store calls it again under the lock, as any plan. A
    store may also ignore the mark."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def __call__(self, tx: TxReader) -> Awaitable[WriteBatch | None]:
        return self.plan(tx)


class InPlace:
    """A plan a store may run, its reads and its writes, on the caller's thread
    (``SQLiteAdapter``): a live page, where a hop to a connection's thread would cost more than
    the work, and a pulled page, whose work on that thread would contend with the caller's for
    the GIL. It runs under the write lock as any plan; a store may ignore the mark."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def __call__(self, tx: TxReader) -> Awaitable[WriteBatch | None]:
        return self.plan(tx)


class NotInSnapshot(Exception):
    """A ``Rerunnable`` plan, run before the write lock, read something the store's snapshot
    of its meta keys does not hold: the store runs it again under the lock."""


def fixed_plan(batch: WriteBatch) -> Plan:
    """The plan that writes ``batch`` as it is (how a store's ``commit`` uses ``transact``)."""

    async def plan(_: TxReader) -> WriteBatch:
        return batch

    return plan


class EventPlace(NamedTuple):
    """An event's id and place in its session's chain, without its payload
    (``TxReader.event_places``): what telling whether it stands where it was pushed needs."""

    id: str
    sequence_number: int
    prev_hash: str
    row_hash: str
    canonical: bool


HydrationKey = tuple[int, int, str]
"""``(events, sequence_number, row_hash)`` of a session's log (``hydration_key``): how many
events it holds, and its last one's place. Two reads that give the same key read the same log:
the last event's hash covers every event before it (``shared.hashchain``), and the count any
event that arrived below the last one since."""


class KeptHydration(NamedTuple):
    """A session's folded log as a store keeps it (``hydration.load_hydration``): the key of the
    log it was folded from, the fold's version, and its state as msgpack."""

    key: HydrationKey
    version: int
    body: bytes


class OutboxEntry(msgspec.Struct, kw_only=True):
    client_seq: int
    record: Record
    attempts: int = 0
    created_at: float = 0.0
    last_error_code: int | None = None
    last_error_message: str | None = None
    again_later: bool = False
    """A later queued number refers to the same stored session row. That row is its newest
    version, which may name messages queued after this number: it goes at its last number
    (after all of them), and this one is sent ``skipped``."""
    body: bytes = b""
    """The stored bytes ``record`` was read from (empty: unknown). A flush to a server at
    protocol 6 sends them as they are (``shared.messages.ChangeBody``)."""


class DeadLetter(msgspec.Struct, kw_only=True):
    client_seq: int
    record: Record
    code: int
    message: str
    attempts: int
    failed_at: float


@runtime_checkable
class StorageAdapter(Protocol):
    """A device's local store. Use as ``async with``; ``open()`` runs migrations."""

    durable: bool

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    # -- writes ---------------------------------------------------------------------------
    async def commit(self, batch: WriteBatch) -> CommitReceipt: ...
    async def transact(self, plan: Plan) -> CommitReceipt:
        """Take the write lock, call ``plan(reader)`` and commit the batch it returns, all in
        ONE transaction; ``None`` writes nothing. ``plan`` must only await the reader (it runs
        while the lock is held): decide from what it reads, then return the writes."""
        ...

    async def gdpr_soft_delete(self, subject_key: str) -> int:
        """Clear identifying fields of audit rows with ``subject_key``; returns rows touched."""
        ...

    # -- sync state -----------------------------------------------------------------------
    async def get_meta(self, key: str) -> str | None: ...
    async def peek_meta(self, key: str) -> str | None:
        """``get_meta`` of what is committed, as cheaply as the store can: it need not wait
        for a write of this store in progress (and may not see it). For a look whether
        another process wrote; a decision that must hold reads the key under the lock."""
        ...

    async def set_meta(self, key: str, value: str) -> None: ...

    # -- reads ----------------------------------------------------------------------------
    async def get_session(self, session_id: str) -> Session | None: ...
    async def list_sessions(self, *, include_deleted: bool = False) -> list[Session]:
        """Sessions newest first (by ``updated_at``)."""
        ...

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        """Messages in the order of ``message_ids``; unknown ids are skipped."""
        ...

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None: ...
    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        """Checkpoints of a session, oldest first (by hlc)."""
        ...

    async def child_checkpoints(self, session_id: str, parent_id: str) -> list[Checkpoint]:
        """The session's checkpoints whose parent is ``parent_id``, oldest first (by hlc).
        Only those are decoded: resume asks whether the row's head has any."""
        ...

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, types: Collection[str] | None = None
    ) -> list[Event]:
        """Events of a session with ``sequence_number >= from_sequence``, in chain order;
        only those of ``types`` when given (the others are not decoded: ``decode_events``)."""
        ...

    async def event_payloads(
        self, session_id: str, types: Collection[str]
    ) -> list[tuple[str, dict[str, Any]]]:
        """``(type, payload)`` of the session's events of ``types``, in chain order: only those
        two fields are decoded (``hydration_log`` with nothing read whole)."""
        ...

    async def hydration_log(
        self,
        session_id: str,
        tallied: Collection[str],
        whole: Collection[str],
        *,
        from_sequence: int = 0,
    ) -> tuple[list[tuple[str, dict[str, Any]]], list[Event]]:
        """What a resume folds, from ONE read of the session's log (its events with
        ``sequence_number >= from_sequence``): ``(type, payload)`` of its events of
        ``tallied`` (only those two fields decoded) and its events of ``whole`` decoded whole,
        each in chain order (``decode_log``). The same as ``event_payloads`` and
        ``list_events(types=...)`` would give, in one scan of the events instead of two."""
        ...

    async def hydration_key(self, session_id: str, *, upto: int | None = None) -> HydrationKey:
        """The key of the session's log as it stands (``HydrationKey``), or of its events
        with ``sequence_number <= upto``; ``(0, 0, "")`` when there is no such event."""
        ...

    async def kept_hydration(self, session_id: str) -> KeptHydration | None:
        """What ``keep_hydration`` last kept for the session, or None."""
        ...

    async def keep_hydration(self, session_id: str, kept: KeptHydration) -> None:
        """Keep the session's folded log, replacing what was kept: a cache of the runtime's
        (``hydration.load_hydration`` checks its key before it uses it), written in a small
        transaction of its own, never synced (no outbox row) and kept through a purge, as the
        log is."""
        ...

    async def get_event(self, event_id: str) -> Event | None: ...
    async def list_audit(
        self, *, session_id: str | None = None, client_id: str | None = None
    ) -> list[AuditRow]:
        """Audit rows ordered by (client_id, sequence_number): each device's chain in order."""
        ...

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]: ...

    # -- outbox ---------------------------------------------------------------------------
    async def outbox_pending(self, limit: int = 500, *, after: int = 0) -> list[OutboxEntry]:
        """Oldest first, by client_seq; only those after ``after`` (the flush reads the next
        push's entries while the pushes before it are in flight)."""
        ...

    async def outbox_count(self) -> int: ...
    async def last_client_seq(self) -> int:
        """The highest ``client_seq`` this store ever gave out (0 if none): a server that
        knows a higher one for this client id has seen another copy of this device."""
        ...

    async def outbox_remove(self, client_seqs: list[int]) -> None:
        """Drop acknowledged entries."""
        ...

    async def outbox_mark_attempt(
        self, client_seqs: list[int], code: int | None, message: str | None
    ) -> None:
        """Count one more failed attempt with its error (entries stay queued)."""
        ...

    async def outbox_dead_letter(self, client_seq: int, code: int, message: str) -> None:
        """Move one entry from the outbox to dead_letters (it stays visible)."""
        ...

    async def dead_letters(self) -> list[DeadLetter]: ...
    async def dead_letter_count(self) -> int: ...
    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Re-enqueue a dead letter under a new client_seq (returned); None if unknown."""
        ...

    async def discard_dead_letter(self, client_seq: int) -> bool: ...


def marked_canonical(
    body: bytes, decode: Callable[[], Event], encode: Callable[[Event], bytes]
) -> bytes:
    """``WriteBatch.canonical`` for one stored event: its body marked canonical from the bytes
    (``compact.canonical_body``), else decoded (``decode()``), replaced and encoded."""
    marked = compact.canonical_body(body)
    if marked is not None:
        return marked
    return encode(msgspec.structs.replace(decode(), canonical=True))


def event_place_of(body: object, decode: Callable[[], Event]) -> EventPlace:
    """A stored event's id and place: from the head of its compact ``body``
    (``compact.event_place``), else from the whole event (``decode()``: the map form, or a
    body the head does not read, which the decode then refuses)."""
    place = compact.event_place(body) if isinstance(body, bytes) else None
    if place is not None:
        return EventPlace(*place)
    event = decode()
    return EventPlace(
        event.id, event.sequence_number, event.prev_hash, event.row_hash, event.canonical
    )


def decode_events(
    rows: Iterable[Any], types: Collection[str] | None, decode: Callable[[Any, bytes], Event]
) -> list[Event]:
    """The stored event rows ``(key, body)`` decoded, only those of ``types`` when given: a
    compact body's type is read without decoding the rest (``compact.event_type``); any other
    body is decoded whole and then kept or not."""
    if types is None:
        return [decode(key, body) for key, body in rows]
    out = []
    for key, body in rows:
        kind = compact.event_type(body)
        if kind is None or kind in types:
            event = decode(key, body)
            if event.type in types:
                out.append(event)
    return out


def decode_log(
    rows: Iterable[Any],
    tallied: Collection[str],
    whole: Collection[str],
    decode: Callable[[Any, bytes], Event],
) -> tuple[list[tuple[str, dict[str, Any]]], list[Event]]:
    """The stored event rows ``(key, body)`` as ``hydration_log`` gives them: ``(type,
    payload)`` of those of ``tallied`` (a compact body's two fields read without the rest,
    ``compact.event_payload``) and those of ``whole`` decoded whole; a row of a type in both
    is in both, and any other body (the map form) is decoded whole first."""
    tallies: list[tuple[str, dict[str, Any]]] = []
    events: list[Event] = []
    for key, body in rows:
        head = compact.event_payload(body)
        event = None
        if head is None:
            event = decode(key, body)
            head = (event.type, event.payload)
        if head[0] in tallied:
            tallies.append(head)
        if head[0] in whole:
            events.append(event if event is not None else decode(key, body))
    return tallies, events


def decode_children(
    rows: Iterable[Any], parent_id: str, decode: Callable[[Any, bytes], Checkpoint]
) -> list[Checkpoint]:
    """The stored checkpoint rows ``(key, body)`` whose parent is ``parent_id``, decoded: a
    compact body's parent is read without decoding the rest (``compact.checkpoint_parent``);
    any other body is decoded whole and then kept or not."""
    want = compact.packed(parent_id)
    out = []
    for key, body in rows:
        parent = compact.checkpoint_parent(body)
        if parent is None or parent == want:
            checkpoint = decode(key, body)
            if checkpoint.parent_id == parent_id:
                out.append(checkpoint)
    return out


def outbox_entries(
    rows: Iterable[Any],
    decode: Callable[[int, bytes], Record],
    known: Mapping[bytes, Record] | None = None,
) -> list[OutboxEntry]:
    """Outbox rows ``(client_seq, body, attempts, created_at, code, message, again_later)``
    as entries. A session queued once per turn refers to one stored row: each body is decoded
    once, and not at all when ``known`` holds the record it was made from."""
    decoded: dict[bytes, Record] = dict(known or {})
    out = []
    for seq, body, attempts, created_at, code, message, later in rows:
        record = decoded.get(body)
        if record is None:
            record = decoded[body] = decode(seq, body)
        out.append(
            OutboxEntry(
                client_seq=seq,
                record=record,
                attempts=attempts,
                created_at=created_at,
                last_error_code=code,
                last_error_message=message,
                again_later=bool(later),
                body=body,
            )
        )
    return out
