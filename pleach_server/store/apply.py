"""Store-independent push logic: what one push batch does, written against ``StoreTx``.

A store opens ONE transaction, wraps it in its ``BatchTx`` and calls ``apply_push``; it commits
when that returns and rolls back when it raises. Every rule of the sync protocol lives here, so
the SQLite and PostgreSQL stores cannot drift apart:

- **Idempotency** by ``(tenant, client_id, client_seq)``: ``seq <= last_seq`` is a
  ``duplicate`` when the server holds that change (its id is stored, it was refused, or a
  delete drained it), else 3012 (``IdentityReused``: another copy of the device, restored or
  copied, wrote under the same numbers; it takes a new id and resends); ``last_seq + 1`` is
  processed; a gap rejects that change and every later one
  of the batch with 3006 and leaves ``last_seq`` alone (the device resends from
  ``last_seq + 1``).
- **Validation** rejects a change with a code and still advances ``last_seq``, so one bad change
  never blocks the queue: foreign tenant 3002, another tenant's id 3002, wrong ``client_id`` or
  malformed ids/stamps 3007. A stamp too far in the future (3011, retryable, the message says
  by how much) is the device's clock, not the change: like a gap, it and the rest of the batch
  are refused and ``last_seq`` stays, so the device keeps them and resends them later.
- **Sessions** merge by version vector; concurrent versions are settled last-writer-wins and
  the loser is kept as a fork (a new session), reported in a ``ConflictReceipt``.
- **Immutable kinds** (message, checkpoint, audit row, artifact update) are a union by id.
- **Events** get their canonical place from the server: the next ``sequence_number`` of their
  session, hash-chained onto the last canonical row.
- **Audit chains are continued, never forked or holed** (``chains=True``, protocol 3): a new
  audit row must take the next place of its device's chain as the server holds it (the
  ``sequence_number`` after the chain's last row, whose ``row_hash`` is its ``prev_hash``).
  One that does not is refused with 3013 (``ChainBroken``, naming the chain's last place), and
  so is every later change of the batch, with ``last_seq`` left before it (as for 3011): the
  device chains its queued rows on from that place and sends them again. (Two copies of one
  file that both moved the same queued rows onto their new ids' chains: the server keeps the
  first placement, and the second chain would otherwise begin with a hole.)
- **Delete wins.** A session tombstone (``deleted=True``) is final: once one reaches the
  server, every later version of the session is a tombstone. Writing one deletes the session's
  content (the kinds ``deleted_with_session``: messages, checkpoints, artifact updates), rows
  and feed entries, except what a live session still refers to (a fork shares its origin's
  messages and artifacts); events and audit rows stay. Content that arrives later for a deleted
  session is ``superseded`` and not stored; a live version of it that the tombstone does not
  dominate is ``superseded`` too, and the server writes the tombstone again under a vector
  that dominates it, so that device adopts the delete when it pulls. One exception keeps what
  a conflict resolution moved: a live version written by a resolve (``SessionState.resolved``)
  that the deleting device never saw holds messages that were in the session's fork, a live
  session, as that device knew them. The delete still wins, and that version is kept as a new
  session (forked from the deleted one, announced by a ``sync.delete.kept`` event in the
  deleted session's log), with the content it names (``shared.merge.kept_beside_delete``).

The kinds are told apart by ``shared.records.RECORD_KINDS``: a ``versioned`` kind is the
session row, a ``server_placed`` kind is an event, every other kind is an immutable record.

Every record written goes to the tenant's feed; its cursor is reported in the result.

**A handful of database calls per batch, whatever its size.** The rules are written change by
change against ``StoreTx``, a view that ``apply_push`` serves from memory. It speaks to the
store's ``BatchTx`` only a few times per batch:

1. ``lock_tenant``, then ``get_last_seq``;
2. ``load``: one query per table for every id the batch's changes will ask about
   (``batch_keys``): the owners of their record, event and session ids, the current rows of
   their sessions, the tail of each event chain they extend;
3. the rules run. Their writes stay in the view, and later changes of the same batch read them:
   a second version of a session is compared with the first one's result, the events of one
   session chain in order, a record id seen twice is a duplicate the second time, and a session
   created earlier in the batch is owned by the tenant;
4. ``write``: one multi-row statement per table; the feed rows get their cursors, in order;
5. ``head_cursor``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgspec

from shared.clock import (
    HybridClock,
    Order,
    Timestamp,
    vector_problem,
    vv_bump,
    vv_compare,
    vv_merge,
)
from shared.compact import Bodies, canonical_body
from shared.errors import (
    ChainBroken,
    ClockSkew,
    Forbidden,
    IdentityReused,
    InvalidRecord,
    SequenceGap,
    StorageUnavailable,
    SyncError,
)
from shared.hashchain import GENESIS, chain_event
from shared.ids import uuid7
from shared.merge import kept_beside_delete, resolve_conflicts, unmarked
from shared.messages import ChangeResult, ConflictReceipt, KeptReceipt, Side, Status
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Change,
    Checkpoint,
    Event,
    FeedChange,
    Message,
    Record,
    RecordKind,
    RecordKindInfo,
    Session,
    kind_info,
    kind_of,
    record_kind,
)

from .base import PushResult, Tenant

__all__ = [
    "BatchKeys",
    "BatchTx",
    "BatchWrites",
    "Snapshot",
    "StoreTx",
    "apply_push",
    "batch_keys",
    "claimed_concurrently",
    "content_to_delete",
    "validate_record",
]


@dataclass(frozen=True, slots=True)
class BatchKeys:
    """The ids a batch's changes will ask about: what ``BatchTx.load`` reads."""

    records: frozenset[tuple[RecordKind, str]] = frozenset()
    """``(kind, id)`` of immutable records: messages, checkpoints, audit rows, artifact updates."""
    events: frozenset[str] = frozenset()
    """Event ids."""
    session_owners: frozenset[str] = frozenset()
    """Session ids whose owner is checked."""
    sessions: frozenset[str] = frozenset()
    """Session ids whose current row is read (a pushed session, or the session of a record
    deleted with it: is it deleted?)."""
    chains: frozenset[str] = frozenset()
    """Session ids whose last canonical event is read."""
    audit_chains: frozenset[str] = frozenset()
    """Client ids whose audit chain's last row is read."""
    verdicts: Mapping[int, SyncError | None] = field(
        default_factory=dict, compare=False, hash=False
    )
    """``validate_record`` of each change these keys were read for, by ``client_seq``: the
    rules take it from here instead of checking the record a second time."""

    def __bool__(self) -> bool:
        return bool(
            self.records
            or self.events
            or self.session_owners
            or self.sessions
            or self.chains
            or self.audit_chains
        )


@dataclass(slots=True)
class Snapshot:
    """What ``BatchTx.load`` found for a ``BatchKeys``; an id it did not find is left out."""

    record_owners: dict[tuple[RecordKind, str], Tenant] = field(default_factory=dict)
    event_owners: dict[str, Tenant] = field(default_factory=dict)
    session_owners: dict[str, Tenant] = field(default_factory=dict)
    """The tenant of the session row, else of any event, else of any record filed under the id."""
    sessions: dict[str, Session] = field(default_factory=dict)
    chain_tails: dict[str, tuple[int, str]] = field(default_factory=dict)
    """``(sequence_number, row_hash)`` of the session's last canonical event."""
    audit_tails: dict[str, tuple[int, str]] = field(default_factory=dict)
    """``(sequence_number, row_hash)`` of the last audit row of the client id's chain (the
    highest ``sequence_number``); a chain the tenant holds no row of is left out."""


@dataclass(slots=True)
class BatchWrites:
    """Everything one batch writes, for ``BatchTx.write``."""

    records: list[Record] = field(default_factory=list)
    """New immutable records (never a session or an event)."""
    events: list[Event] = field(default_factory=list)
    """New canonical events; ``(session_id, sequence_number)`` is unique."""
    sessions: list[Session] = field(default_factory=list)
    """Session rows to insert or replace, one per id."""
    feed: list[Record] = field(default_factory=list)
    """The tenant's new feed entries, in order."""
    last_seq: int | None = None
    """The device's new ``last_seq`` (insert or update), or None when it did not move."""
    deleted_sessions: list[str] = field(default_factory=list)
    """Sessions tombstoned by this batch. When any, ``write`` ends (after the feed) by deleting
    the tenant's content of deleted sessions: see ``content_to_delete``."""
    bodies: Bodies = field(default_factory=Bodies)
    """The bytes to store of each record written (``Bodies.of``): a record stored as it was
    pushed keeps the bytes it came in."""

    def entries(self) -> tuple[list[int], list[int]]:
        """The index in ``feed`` of each record's entry and of each event's, in the order of
        ``records`` and ``events``: every record and event a batch writes has one, which a
        store keeps with its row (its cursor, once the feed rows have theirs)."""
        at = {(record_kind(r), r.id): i for i, r in enumerate(self.feed)}
        try:
            return (
                [at[record_kind(r), r.id] for r in self.records],
                [at["Event", e.id] for e in self.events],
            )
        except KeyError as exc:  # pragma: no cover - a bug of the push rules
            raise RuntimeError(f"{exc.args[0]} is written with no feed entry") from None

    def __bool__(self) -> bool:
        return bool(
            self.records
            or self.events
            or self.sessions
            or self.feed
            or self.last_seq is not None
            or self.deleted_sessions
        )


class BatchTx(Protocol):
    """One open write transaction of a server store, as ``apply_push`` speaks to it.

    A few calls per batch, whatever its size, in this order: ``lock_tenant``, ``get_last_seq``,
    ``load`` (skipped when the batch has nothing to look up), ``write`` (skipped when it has
    nothing to write), ``head_cursor``. All run inside the same transaction; the store owns
    BEGIN / COMMIT / ROLLBACK. A method raises only when the database fails (translated to
    ``StorageUnavailable`` by the store), and the whole batch is then rolled back.
    """

    def keys_read(self, last_seq: int) -> BatchKeys | None:
        """The ``batch_keys`` of this push's changes after ``last_seq``, when the store already
        made them and read their rows with its ``BEGIN`` (``load`` then answers from those
        rows, with no further read), else None: ``apply_push`` makes them. (SQLite reads
        everything before the rules in one hop to its connection's thread.)"""
        ...

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

    async def load(self, tenant: Tenant, keys: BatchKeys) -> Snapshot:
        """Read what ``keys`` lists among ``tenant``'s rows, at most one query per kind of key
        (see ``Snapshot``). Ids are scoped to their tenant: another tenant's rows under the
        same ids are never read (nobody can take another user's ids). An audit row's place in
        its chain (client id, sequence number, row hash) is written with it (``write``), so
        that ``audit_tails`` can be read."""
        ...

    async def write(self, tenant: Tenant, client_id: str, writes: BatchWrites) -> list[int]:
        """Write ``writes`` (at most one multi-row statement per table); return the feed cursors.

        The cursors are new, increasing and in the order of ``writes.feed``: each is higher than
        any cursor the tenant had, and they are allocated under the tenant's lock. Records and
        events are inserted only where absent; if one is already there (another tenant's push
        took the id after ``load``, which the tenant lock cannot prevent), raise
        ``claimed_concurrently()``: the device retries, and the rules then see the owner.

        When ``writes.deleted_sessions`` is not empty, last (after the feed rows, so content
        written by this batch is covered too): read the tenant's session rows and the records
        of ``CASCADE_KINDS`` filed under its deleted sessions, and delete the records
        ``content_to_delete`` names together with their feed entries (same kind and id).
        """
        ...

    async def head_cursor(self, tenant: Tenant) -> int:
        """The tenant's latest feed cursor (0 when none), as this transaction sees it."""
        ...


class StoreTx(Protocol):
    """The per-change view of a push transaction that the rules are written against.

    ``apply_push`` serves it from memory over the store's ``BatchTx``; a store's ``_wrap_tx``
    hook may wrap it (the tests inject faults that way). Reads see the database as
    ``BatchTx.load`` read it under the tenant lock, plus every write made through this view
    earlier in the batch. They answer only for the ids of the batch's changes (``batch_keys``)
    and raise ``LookupError`` for any other id. Writes stay in memory until ``apply_push`` hands
    them all to ``BatchTx.write``, after the last change and before ``head_cursor``: a failure
    before that point leaves nothing in the database, a failure after it rolls everything back.
    """

    async def lock_tenant(self, tenant: Tenant) -> None:
        """Take the tenant's lock (``BatchTx.lock_tenant``); called first."""
        ...

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        """The device's ``last_seq`` in the database; 0 for a device never seen."""
        ...

    async def set_last_seq(self, tenant: Tenant, client_id: str, last_seq: int) -> None:
        """Store the batch's device's new ``last_seq`` (written with the batch)."""
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

    async def audit_tail(self, client_id: str) -> tuple[int, str]:
        """``(sequence_number, row_hash)`` of the last audit row of ``client_id``'s chain, with
        the rows inserted earlier in the batch; ``(0, GENESIS)`` when there is none."""
        ...

    async def delete_content(self, session_id: str) -> None:
        """The session was tombstoned: delete its content when the batch is written.

        Its messages, checkpoints and artifact updates go, rows and feed entries, except what a
        live session refers to (``content_to_delete``); its events and audit rows stay.
        """
        ...

    async def head_cursor(self, tenant: Tenant) -> int:
        """The tenant's latest feed cursor (0 when none), once the batch is written."""
        ...


def claimed_concurrently(what: str = "a record id") -> StorageUnavailable:
    """The error ``BatchTx.write`` raises when another push took one of the batch's ids."""
    return StorageUnavailable(
        f"{what} of this batch was written by a concurrent push; retry", retryable=True
    )


_SESSION = kind_info("Session")
_EVENT = kind_info("Event")


def _is_session(info: RecordKindInfo) -> bool:
    return info.merge == "versioned"


def _is_record(info: RecordKindInfo) -> bool:
    """Stored by ``insert_if_absent`` (the ``records`` table): not a session, not an event."""
    return not (_is_session(info) or info.server_placed)


def _non_empty(value: object) -> bool:
    # No NUL: PostgreSQL text cannot hold one (a 3007 here, not a 3009 from the database).
    return isinstance(value, str) and value != "" and "\x00" not in value


def _tenant_of(record: Record) -> Tenant:
    return Tenant(org_id=record.org_id, user_id=record.user_id)


def _filed_under(record: Record) -> list[str]:
    """The session ids ``record`` claims besides its own id: its session, or a fork's origin."""
    session_id = kind_of(record).session_of(record)
    if session_id is not None:
        return [session_id]
    if isinstance(record, Session) and record.forked_from:
        return [record.forked_from]
    return []


def _relayed(record: Record, tenant: Tenant, client_id: str, aliases: Collection[str] = ()) -> bool:
    """A session version of this tenant that another of its devices wrote."""
    return (
        isinstance(record, Session)
        and record.client_id != client_id
        and record.client_id not in aliases
        and _tenant_of(record) == tenant
    )


def validate_record(
    record: Record, tenant: Tenant, client_id: str, aliases: Collection[str] = ()
) -> SyncError | None:
    """The checks that need no database: tenant, origin device, ids and stamps.

    ``aliases`` are the pushing device's earlier client ids (``Hello.previous_client_ids``):
    records it wrote before it took a new id still carry one. Returns the error to reject
    with, or None when the record may proceed.
    """
    if record.org_id != tenant.org_id or record.user_id != tenant.user_id:
        return Forbidden("record belongs to another tenant")
    if record.client_id != client_id and record.client_id not in aliases:
        return InvalidRecord(
            f"record client_id {record.client_id!r} is not the pushing device {client_id!r}"
        )
    for name in kind_of(record).required_ids:
        if not _non_empty(getattr(record, name)):
            what = "record id" if name == "id" else name
            return InvalidRecord(f"{what} must be a non-empty string without NUL")
    try:
        Timestamp.decode(record.hlc)
        if isinstance(record, Session):
            Timestamp.decode(record.updated_at)
    except InvalidRecord as exc:
        return exc
    if isinstance(record, Session):
        problem = vector_problem(record.vv)
        if problem is not None:
            return InvalidRecord(problem)
    return None


def _duplicate_keys(
    record: Record,
    tenant: Tenant,
    client_id: str,
    aliases: Collection[str],
    records: set[tuple[RecordKind, str]],
    events: set[str],
    owners: set[str],
    sessions: set[str],
) -> None:
    """What ``_held`` asks about a change resent under a used ``client_seq``."""
    if validate_record(record, tenant, client_id, aliases) is not None:
        return
    info = kind_of(record)
    if _is_session(info):
        owners.add(record.id)
        sessions.add(record.id)
    elif info.server_placed:
        events.add(record.id)
    else:
        records.add((info.name, record.id))
    session_id = info.session_of(record)
    if info.deleted_with_session and session_id is not None:
        sessions.add(session_id)


async def _held(
    tx: StoreTx, record: Record, tenant: Tenant, client_id: str, aliases: Collection[str]
) -> bool:
    """Whether a change resent under a ``client_seq`` at or below the device's ``last_seq``
    is one the server took (or refused) when it first came.

    A device resends such changes when an ack was lost; then the server holds them (or holds
    that it refused them). Another copy of the device (a restored backup, a copied file)
    sends different changes under the same numbers: the server has never seen their ids, and
    answering ``duplicate`` would make that copy drop them unsent.

    A session's id is no such proof: both copies write versions of the same sessions, and
    the id is the tenant's as soon as any record filed under it is stored (a new session's
    ``session.created`` event, pushed under the number before its row). Every version the
    server took is included in the row it stores (a newer version, a conflict's winner and a
    tombstone are all written under a vector at or above it), so a version the stored row
    does not include (its vector is ahead of the row's or beside it), or one of a session with
    no row here, was never taken; and one under the row's very vector but with another stamp
    is another copy's.
    """
    if validate_record(record, tenant, client_id, aliases) is not None:
        return True  # refused when it first came, and the device was told why
    info = kind_of(record)
    if isinstance(record, Session):
        current = await tx.get_session(record.id)
        if current is not None:
            return _includes(current, record)
        owner = await tx.owner_of(info.name, record.id)
        return owner is not None and owner != tenant  # another tenant's id: refused at first
    if await tx.owner_of(info.name, record.id) is not None:
        return True  # stored (or, for another tenant's id, refused when it first came)
    session_id = info.session_of(record)
    if info.deleted_with_session and session_id is not None:
        session = await tx.get_session(session_id)
        return session is not None and session.deleted  # drained by the session's delete
    return False


def _includes(stored: Session, version: Session) -> bool:
    """Whether the stored row of a session includes ``version``: its vector is at or above
    the version's, and equal only with the same stamp (a different version under one vector
    is another copy's)."""
    order = vv_compare(stored.vv, version.vv)
    if order is Order.EQUAL:
        return (stored.hlc, stored.client_id) == (version.hlc, version.client_id)
    return order is Order.DOMINATES


def batch_keys(
    changes: list[Change],
    last_seq: int,
    tenant: Tenant,
    client_id: str,
    aliases: Collection[str] = (),
    *,
    audit: bool = False,
    skipped: Collection[int] = (),
) -> BatchKeys:
    """Every id the rules will ask ``StoreTx`` about for ``changes`` after ``last_seq``.

    Only the changes that will be processed count: those after ``last_seq`` and before any gap
    (``skipped`` numbers fill the sequence too), that pass ``validate_record``. ``audit``: the
    chains of the audit rows too.
    """
    records: set[tuple[RecordKind, str]] = set()
    events: set[str] = set()
    owners: set[str] = set()
    sessions: set[str] = set()
    chains: set[str] = set()
    audit_chains: set[str] = set()
    verdicts: dict[int, SyncError | None] = {}
    expected = last_seq + 1
    for change in changes:
        while expected in skipped and expected < change.client_seq:
            expected += 1
        if change.client_seq < expected:
            _duplicate_keys(
                change.record, tenant, client_id, aliases, records, events, owners, sessions
            )
            continue
        if change.client_seq > expected:
            break  # a gap: nothing after it is processed
        expected += 1
        record = change.record
        verdict = verdicts[change.client_seq] = validate_record(record, tenant, client_id, aliases)
        if verdict is not None:
            if _relayed(record, tenant, client_id, aliases):
                sessions.add(record.id)
            continue
        owners.update(_filed_under(record))
        info = kind_of(record)
        session_id = info.session_of(record)
        if _is_session(info):
            owners.add(record.id)
            sessions.add(record.id)
            chains.add(record.id)  # a conflict appends a sync.conflict event to its log
        elif info.server_placed:
            events.add(record.id)
            if session_id is not None:
                chains.add(session_id)
        else:
            records.add((info.name, record.id))
            if audit and isinstance(record, AuditRow):
                audit_chains.add(record.client_id)
        if info.deleted_with_session and session_id is not None:
            sessions.add(session_id)  # is it deleted?
    return BatchKeys(
        records=frozenset(records),
        events=frozenset(events),
        session_owners=frozenset(owners),
        sessions=frozenset(sessions),
        chains=frozenset(chains),
        audit_chains=frozenset(audit_chains),
        verdicts=verdicts,
    )


class _BufferedTx:
    """``StoreTx`` over a ``BatchTx``: reads from the loaded ``Snapshot`` and the batch's own
    writes; the writes are kept in order and handed to ``BatchTx.write`` by ``flush``."""

    def __init__(self, tx: BatchTx, bodies: Bodies) -> None:
        self._tx = tx
        self.bodies = bodies
        self._keys = BatchKeys()
        self._loaded = Snapshot()
        self._records: dict[tuple[RecordKind, str], Record] = {}
        self._events: list[Event] = []
        self._event_owners: dict[str, Tenant] = {}
        self._sessions: dict[str, Session] = {}
        self._tails: dict[str, tuple[int, str]] = {}
        self._audit_tails: dict[str, tuple[int, str]] = {}
        self._claims: dict[str, Tenant] = {}  # session ids filed under by new events and records
        self._last_seq: int | None = None
        self._deleted: list[str] = []

    async def load(self, tenant: Tenant, keys: BatchKeys) -> None:
        self._keys = keys
        if keys:
            self._loaded = await self._tx.load(tenant, keys)

    async def flush(self, tenant: Tenant, client_id: str, feed: list[Record]) -> list[int]:
        """Write everything the batch wrote through this view; the cursors of ``feed``."""
        writes = BatchWrites(
            records=list(self._records.values()),
            events=self._events,
            sessions=list(self._sessions.values()),
            feed=feed,
            last_seq=self._last_seq,
            deleted_sessions=self._deleted,
            bodies=self.bodies,
        )
        if not writes:
            return []
        cursors = await self._tx.write(tenant, client_id, writes)
        if len(cursors) != len(feed):  # pragma: no cover - a store bug
            raise RuntimeError(f"write returned {len(cursors)} cursors for {len(feed)} entries")
        return cursors

    @property
    def deletes_sessions(self) -> bool:
        """Whether this batch tombstones a session (its content goes at the end of ``flush``)."""
        return bool(self._deleted)

    def _need(self, loaded: Collection[Hashable], key: Hashable, what: str) -> None:
        if key not in loaded:
            raise LookupError(f"{what} {key!r} is not among the ids this batch loaded")

    def _claim(self, session_id: str, record: Record) -> None:
        self._claims.setdefault(session_id, _tenant_of(record))

    # -- StoreTx -----------------------------------------------------------------------------

    async def lock_tenant(self, tenant: Tenant) -> None:
        await self._tx.lock_tenant(tenant)

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        return await self._tx.get_last_seq(tenant, client_id)

    async def set_last_seq(self, tenant: Tenant, client_id: str, last_seq: int) -> None:
        self._last_seq = last_seq

    async def owner_of(self, kind: RecordKind, record_id: str) -> Tenant | None:
        info = kind_info(kind)
        if _is_session(info):
            # The row comes first, as in the database: a row written here replaces the old one.
            row = self._sessions.get(record_id)
            if row is not None:
                return _tenant_of(row)
            self._need(self._keys.session_owners, record_id, "session id")
            owner = self._loaded.session_owners.get(record_id)
            return owner if owner is not None else self._claims.get(record_id)
        if info.server_placed:
            owner = self._event_owners.get(record_id)
            if owner is not None:
                return owner
            self._need(self._keys.events, record_id, "event id")
            return self._loaded.event_owners.get(record_id)
        key = (kind, record_id)
        record = self._records.get(key)
        if record is not None:
            return _tenant_of(record)
        self._need(self._keys.records, key, "record")
        return self._loaded.record_owners.get(key)

    async def get_session(self, session_id: str) -> Session | None:
        row = self._sessions.get(session_id)
        if row is not None:
            return row
        self._need(self._keys.sessions, session_id, "session")
        return self._loaded.sessions.get(session_id)

    async def put_session(self, session: Session) -> None:
        self._sessions[session.id] = session

    async def insert_if_absent(self, record: Record) -> bool:
        info = kind_of(record)
        if not _is_record(info):
            raise TypeError(f"{info.name} records are not stored by insert_if_absent")
        key = (info.name, record.id)
        if key in self._records:
            return False
        self._need(self._keys.records, key, "record")
        if key in self._loaded.record_owners:
            return False
        self._records[key] = record
        for session_id in _filed_under(record):
            self._claim(session_id, record)
        if isinstance(record, AuditRow) and record.client_id in self._keys.audit_chains:
            tail = self._audit_tails.get(record.client_id)
            if tail is None or record.sequence_number > tail[0]:
                self._audit_tails[record.client_id] = (record.sequence_number, record.row_hash)
        return True

    async def last_event(self, session_id: str) -> tuple[int, str] | None:
        tail = self._tails.get(session_id)
        if tail is not None:
            return tail
        self._need(self._keys.chains, session_id, "event chain")
        return self._loaded.chain_tails.get(session_id)

    async def insert_event(self, event: Event) -> None:
        self._events.append(event)
        self._event_owners.setdefault(event.id, _tenant_of(event))
        self._claim(event.session_id, event)
        tail = self._tails.get(event.session_id, self._loaded.chain_tails.get(event.session_id))
        if tail is None or event.sequence_number > tail[0]:
            self._tails[event.session_id] = (event.sequence_number, event.row_hash)

    async def audit_tail(self, client_id: str) -> tuple[int, str]:
        tail = self._audit_tails.get(client_id)
        if tail is not None:
            return tail
        self._need(self._keys.audit_chains, client_id, "audit chain")
        return self._loaded.audit_tails.get(client_id, (0, GENESIS))

    async def delete_content(self, session_id: str) -> None:
        if session_id not in self._deleted:
            self._deleted.append(session_id)

    async def held(self, tenant: Tenant, kind: RecordKind, ids: Iterable[str]) -> set[str]:
        """Which of ``ids`` of ``kind`` the tenant holds, stored or written by this batch. Ids
        the batch's keys did not name are read in one more ``load``: for a rule that needs
        them only rarely (``_Batch._keep``), not for every batch."""
        ids = list(ids)
        wanted = frozenset(
            (kind, i)
            for i in ids
            if (kind, i) not in self._records and (kind, i) not in self._keys.records
        )
        if wanted:
            found = await self._tx.load(tenant, BatchKeys(records=wanted))
            self._loaded.record_owners.update(found.record_owners)
            self._keys = replace(self._keys, records=self._keys.records | wanted)
        return {
            i
            for i in ids
            if (kind, i) in self._records or self._loaded.record_owners.get((kind, i)) == tenant
        }

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self._tx.head_cursor(tenant)


def content_to_delete(
    sessions: Iterable[Session], candidates: Iterable[Record]
) -> list[tuple[RecordKind, str]]:
    """What a tenant's deleted sessions take with them: ``(kind, id)`` of records to delete.

    ``sessions`` are all the tenant's session rows; ``candidates`` its records of
    ``CASCADE_KINDS`` filed under deleted sessions (more may be given: they are filtered).
    A candidate goes unless a live session still refers to it: a message in its
    ``state.message_ids``, an artifact update of a document in its ``state.artifacts`` (a fork
    shares these with its origin), a checkpoint on the parent chain of its
    ``head_checkpoint_id`` or ``forked_at_checkpoint`` (a conflict fork keeps the loser's head,
    a checkpoint of the origin). And while a live conflict fork of a deleted session exists,
    or a live session kept beside its delete (``SessionState.kept_from``), none of that
    session's content goes, nor that of the deleted sessions it was forked from in turn: the
    fork shares it by id, and a version of the fork that a device wrote before it learned of
    a later change (a resolve gave the fork copies of its own, say) may still name any of it,
    and arrive after this deletion. Once those live sessions are deleted too, the next
    deletion takes what they kept.
    """
    candidates = list(candidates)
    deleted: set[str] = set()
    messages: set[str] = set()
    artifacts: set[str] = set()
    heads: list[str] = []
    shared: set[str] = set()  # deleted sessions whose content a live session may name by id
    origins: dict[str, str | None] = {}
    sharing: list[str] = []  # what live conflict forks and kept sessions were made from
    for session in sessions:
        origins[session.id] = session.forked_from
        if session.deleted:
            deleted.add(session.id)
        else:
            messages.update(session.state.message_ids)
            artifacts.update(session.state.artifacts)
            heads.extend(c for c in (session.head_checkpoint_id, session.forked_at_checkpoint) if c)
            if session.conflict_id is not None and session.forked_from is not None:
                sharing.append(session.forked_from)
            if session.state.kept_from is not None:
                sharing.append(session.state.kept_from)
    for start in sharing:
        # Up the deleted sessions it came from: a conflict fork of a conflict fork (or a kept
        # session of a kept one) may name content filed under either.
        up: str | None = start
        while up is not None and up in deleted and up not in shared:
            shared.add(up)
            up = origins.get(up)
    parents = {r.id: r.parent_id for r in candidates if isinstance(r, Checkpoint)}
    checkpoints: set[str] = set()
    for head in heads:
        at: str | None = head
        while at is not None and at in parents and at not in checkpoints:
            checkpoints.add(at)
            at = parents[at]
    doomed: list[tuple[RecordKind, str]] = []
    for record in candidates:
        info = kind_of(record)
        session_id = info.session_of(record)
        if not info.deleted_with_session or session_id not in deleted or session_id in shared:
            continue
        if isinstance(record, Message) and record.id in messages:
            continue
        if isinstance(record, ArtifactUpdate) and record.artifact_id in artifacts:
            continue
        if isinstance(record, Checkpoint) and record.id in checkpoints:
            continue
        doomed.append((info.name, record.id))
    return doomed


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
    for session_id in _filed_under(record):
        other = await tx.owner_of(_SESSION.name, session_id)
        if other is not None and other != tenant:
            return Forbidden(f"session {session_id!r} belongs to another tenant"), False
    return None, owner is not None


def _observe(clock: HybridClock, record: Record) -> SyncError | None:
    try:
        clock.advance(record.hlc)
        if isinstance(record, Session) and record.updated_at != record.hlc:
            # updated_at decides last-writer-wins: a stamp far ahead must not win for a day.
            clock.advance(record.updated_at)
    except (ClockSkew, InvalidRecord) as exc:
        return exc
    return None


def _rejected(seq: int, error: SyncError) -> ChangeResult:
    return ChangeResult(
        client_seq=seq, status="rejected", code=int(error.code), message=error.message
    )


class _Batch:
    """The state of one ``apply_push`` call: its ``StoreTx`` and the feed entries it adds.

    A result that reports a cursor gets it once the batch is written (``set_cursors``).
    ``as_pushed`` stays True while every feed entry is an ``applied`` change as it was pushed
    (an event at the pushed place and hashes, only marked canonical).
    """

    def __init__(
        self,
        tx: StoreTx,
        tenant: Tenant,
        clock: HybridClock,
        server_id: str,
        bodies: Bodies,
        held: Callable[[Tenant, RecordKind, Iterable[str]], Awaitable[set[str]]],
    ) -> None:
        self.tx = tx
        self._held_ids = held  # ``_BufferedTx.held``: a read beyond the batch's keys
        self.bodies = bodies
        self.tenant = tenant
        self.clock = clock
        self.server_id = server_id
        self.feed: list[Record] = []
        self.as_pushed = True
        self._cursor_of: list[tuple[ChangeResult, int]] = []  # (result, index in self.feed)
        self._keeping: set[str] = set()  # deleted sessions whose pushed content is kept: prepare

    def _applied(
        self,
        seq: int,
        record: Record,
        status: Status = "applied",
        conflict: ConflictReceipt | None = None,
        *,
        as_pushed: bool = True,
    ) -> ChangeResult:
        """Append ``record`` to the feed; a result that will report its cursor. ``as_pushed``:
        the entry is the change as pushed (see the class)."""
        self.as_pushed = self.as_pushed and as_pushed and status == "applied"
        self.feed.append(record)
        result = ChangeResult(client_seq=seq, status=status, conflict=conflict)
        self._cursor_of.append((result, len(self.feed) - 1))
        return result

    def set_cursors(self, cursors: list[int]) -> None:
        """Fill in the cursors of the feed entries, once ``BatchTx.write`` allocated them."""
        for result, index in self._cursor_of:
            result.cursor = cursors[index]

    async def apply(self, seq: int, record: Record, present: bool) -> ChangeResult:
        """Apply one validated record; ``present`` says the tenant already has its id."""
        info = kind_of(record)
        if isinstance(record, Session):
            return await self._session(seq, record)
        session_id = info.session_of(record)
        if info.deleted_with_session and session_id is not None:
            session = await self.tx.get_session(session_id)
            if session is not None and session.deleted and session_id not in self._keeping:
                # Content of a deleted session, pushed late: drained, never stored.
                return ChangeResult(client_seq=seq, status="superseded")
        if present:
            return ChangeResult(client_seq=seq, status="duplicate")
        if isinstance(record, Event):
            return await self._event(seq, record)
        if not await self.tx.insert_if_absent(record):
            return ChangeResult(client_seq=seq, status="duplicate")
        return self._applied(seq, record)

    async def _event(self, seq: int, event: Event) -> ChangeResult:
        last = await self.tx.last_event(event.session_id)
        number, prev_hash = (last[0] + 1, last[1]) if last is not None else (1, GENESIS)
        placed = msgspec.structs.replace(chain_event(event, prev_hash, number), canonical=True)
        await self.tx.insert_event(placed)
        where = (placed.sequence_number, placed.prev_hash, placed.row_hash)
        same = where == (event.sequence_number, event.prev_hash, event.row_hash)
        sent = self.bodies.known(event) if same else None
        if sent is not None:
            # At the pushed place, the canonical event is the pushed one marked canonical:
            # its bytes follow from the pushed bytes alone (``compact.canonical_body``).
            body = canonical_body(sent)
            if body is not None:
                self.bodies.keep(placed, body)
        return self._applied(seq, placed, as_pushed=same)

    async def _session(self, seq: int, pushed: Session) -> ChangeResult:
        current = await self.tx.get_session(pushed.id)
        if current is None:
            await self.tx.put_session(pushed)
            if pushed.deleted:  # content pushed before the session row may be here already
                await self.tx.delete_content(pushed.id)
            return self._applied(seq, pushed)
        if pushed.deleted or current.deleted:
            return await self._deleted(seq, pushed, current)
        marked = _with_mark(pushed, current)
        resolution = resolve_conflicts(local=marked, remote=current)
        if not resolution.concurrent:
            if resolution.order is not Order.DOMINATES:
                return ChangeResult(client_seq=seq, status="superseded")
            stored = msgspec.structs.replace(marked, vv=resolution.merged_vv)
            same = marked is pushed and stored.vv == pushed.vv
            if same:
                stored = pushed  # the very version pushed: stored in the bytes it came in
            await self.tx.put_session(stored)
            return self._applied(seq, stored, as_pushed=same)

        # Concurrent: the HLC winner keeps the id under a vector above both versions; the
        # loser lives on as a new session, so nothing written on either device is lost.
        now = self.clock.now()
        conflict_id = uuid7()
        pushed_won = resolution.winner == "local"
        winner, loser = (marked, current) if pushed_won else (current, marked)
        winner_row = msgspec.structs.replace(
            winner,
            vv=vv_bump(resolution.merged_vv, self.server_id),
            conflict_id=conflict_id,
            # The winner is not a loser of this conflict, whatever it was before.
            conflict_loser_side=None,
        )
        fork = self._fork(loser, now, conflict_id, "remote" if pushed_won else "local")
        await self.tx.put_session(winner_row)
        self.as_pushed = False
        self.feed.append(winner_row)
        await self.tx.put_session(fork)
        receipt = ConflictReceipt(
            conflict_id=conflict_id,
            session_id=pushed.id,
            winner=resolution.winner,
            fork_session_id=fork.id,
            conflicted_paths=resolution.conflicted_paths,
            detected_at=now,
            pushed_by=pushed.client_id,
            stored_by=current.client_id,
        )
        # The server logs the conflict in the session's event log itself, so every device
        # learns of it from the feed, even when the pusher never sees its acknowledgement.
        await self._log(pushed, "sync.conflict", msgspec.to_builtins(receipt), now)
        return self._applied(seq, fork, status="resolved", conflict=receipt)

    def _fork(
        self, version: Session, now: str, conflict_id: str | None, loser_side: Side | None
    ) -> Session:
        """``version`` of a session as a new session forked from it, made by the server: a
        new id and vector, the same content (a resolve's mark cleared:
        ``shared.merge.unmarked``)."""
        return msgspec.structs.replace(
            version,
            id=uuid7(),
            client_id=self.server_id,
            hlc=now,
            updated_at=now,
            vv={self.server_id: 1},
            state=unmarked(version.state),
            forked_from=version.id,
            forked_at_checkpoint=version.head_checkpoint_id,
            conflict_id=conflict_id,
            conflict_loser_side=loser_side,
        )

    async def _log(self, session: Session, type_: str, payload: dict[str, Any], now: str) -> None:
        """An event the server writes in ``session``'s log, at its next canonical place."""
        last = await self.tx.last_event(session.id)
        number, prev_hash = (last[0] + 1, last[1]) if last is not None else (1, GENESIS)
        logged = Event(
            id=uuid7(),
            session_id=session.id,
            org_id=session.org_id,
            user_id=session.user_id,
            client_id=self.server_id,
            hlc=now,
            type=type_,
            payload=payload,
        )
        placed = msgspec.structs.replace(chain_event(logged, prev_hash, number), canonical=True)
        await self.tx.insert_event(placed)
        self.feed.append(placed)

    async def prepare(self, records: Iterable[Record]) -> None:
        """Before the push's changes apply: the sessions whose content, pushed ahead of their
        row, must not drain as late content of a deleted session, because the row is a live
        version that ``_deleted`` will keep as a fork (``shared.merge.kept_beside_delete``).
        Their content is stored; the batch ends by deleting what the kept fork does not name,
        as for any tombstone it writes. (A resolve's copies that came in earlier pushes, after
        the delete, have drained: the device that wrote the version copies them into the kept
        session when it learns of it, ``pleach_client.apply._own_kept``.)"""
        for record in records:
            if isinstance(record, Session) and not record.deleted and record.state.resolved:
                stored = await self.tx.get_session(record.id)
                if stored is not None and kept_beside_delete(record, stored):
                    self._keeping.add(record.id)
                    await self.tx.delete_content(record.id)

    async def _keep(self, live: Session, tombstone: Session, pushed: Session) -> None:
        """Keep ``live``, which loses to ``tombstone``, as a new session forked from it: the
        fork goes to the feed ahead of the tombstone, so a device that takes the tombstone
        already knows the fork, and keeps the content it names."""
        now = self.clock.now()
        fork = self._fork(live, now, None, None)
        named = live.state.message_ids
        if live is pushed:
            # The kept session names only messages stored here: a resolve's copies that came
            # in pushes after the delete drained, and a device that took this session and
            # wrote it before the resolving device gave it copies (``_own_kept`` there) would
            # otherwise carry names no one can read. (A stored version's copies were stored.)
            held = await self._held_ids(self.tenant, "Message", named)
            named = [m for m in named if m in held]
        # Marked with what it was kept from: while it lives, ``content_to_delete`` spares that.
        state = msgspec.structs.replace(fork.state, message_ids=named, kept_from=live.id)
        fork = msgspec.structs.replace(fork, state=state)
        await self.tx.put_session(fork)
        self.as_pushed = False
        self.feed.append(fork)
        receipt = KeptReceipt(
            session_id=live.id,
            fork_session_id=fork.id,
            version_by=live.client_id,
            deleted_by=tombstone.client_id,
            detected_at=now,
        )
        await self._log(live, "sync.delete.kept", msgspec.to_builtins(receipt), now)

    async def _deleted(self, seq: int, pushed: Session, current: Session) -> ChangeResult:
        """A version of a session meets a tombstone (pushed, stored or both): delete wins.

        - The stored tombstone dominates or equals the pushed version: ``superseded``.
        - A pushed tombstone that dominates the stored row is stored as it is: ``applied``.
        - Otherwise (concurrent versions, or a live version that dominates a tombstone, or a
          tombstone dominated by a live row) the tombstone is written again under a vector
          bumped on the server's entry, above both versions, so every device adopts it:
          ``applied`` when it is the pushed tombstone, ``superseded`` when the pushed version
          lost to the stored one. Nothing is forked: a fork would bring the content back.

        Every tombstone written deletes the session's content (``delete_content``).
        """
        order = vv_compare(pushed.vv, current.vv)
        if current.deleted and order in (Order.DOMINATED, Order.EQUAL):
            return ChangeResult(client_seq=seq, status="superseded")
        merged = vv_merge(pushed.vv, current.vv)
        status: Status
        if pushed.deleted and order is Order.DOMINATES:
            row, status = msgspec.structs.replace(pushed, vv=merged), "applied"
        elif current.deleted:  # the stored tombstone beats the pushed version
            bumped = vv_bump(merged, self.server_id)
            row, status = msgspec.structs.replace(current, vv=bumped), "superseded"
        else:  # a pushed tombstone beats a live row it does not dominate
            bumped = vv_bump(merged, self.server_id)
            row, status = msgspec.structs.replace(pushed, vv=bumped), "applied"
        live, tombstone = (current, pushed) if pushed.deleted else (pushed, current)
        if kept_beside_delete(live, tombstone):
            await self._keep(live, tombstone, pushed)
        await self.tx.put_session(row)
        await self.tx.delete_content(row.id)
        return self._applied(seq, row, status=status, as_pushed=False)


def _with_mark(pushed: Session, stored: Session) -> Session:
    """``pushed``, a live version of a session stored live, with the stored row's
    ``state.kept_from`` when it has none: a device that does not know the mark (an older
    release) drops it when it writes the session, and must not lift what it protects
    (``content_to_delete``). Only a session the server kept beside a delete gets the mark, and
    nothing on a device removes it."""
    mark = stored.state.kept_from
    if mark is None or pushed.state.kept_from is not None:
        return pushed
    state = msgspec.structs.replace(pushed.state, kept_from=mark)
    return msgspec.structs.replace(pushed, state=state)


def _numbered(changes: list[Change], skipped: frozenset[int]) -> list[tuple[int, Change | None]]:
    """The push's numbers in order: its changes, and its skipped numbers (None) among them. A
    number both skipped and sent is the change's."""
    numbered: list[tuple[int, Change | None]] = [(c.client_seq, c) for c in changes]
    if not skipped:
        return numbered
    sent = {c.client_seq for c in changes}
    numbered += [(seq, None) for seq in skipped if seq not in sent]
    numbered.sort(key=lambda item: item[0])
    return numbered


async def apply_push(
    tx: BatchTx,
    tenant: Tenant,
    client_id: str,
    changes: list[Change],
    clock: HybridClock,
    server_id: str,
    *,
    wrap: Callable[[StoreTx], StoreTx] | None = None,
    aliases: Collection[str] = (),
    chains: bool = True,
    skipped: Collection[int] = (),
    bodies: Collection[bytes] = (),
) -> PushResult:
    """Apply one push batch inside ``tx``, in order; see the module docstring for the rules.

    ``clock`` is the server's HLC (it observes every accepted stamp and stamps forks);
    ``server_id`` is the vector entry the server bumps when it settles a conflict. ``aliases``
    are the device's earlier client ids (see ``validate_record``). ``wrap`` (a store's
    ``_wrap_tx`` hook) wraps the ``StoreTx`` the rules run against. ``chains``: check that
    audit rows continue their chains (protocol 3; a device at 2 or earlier is not checked).
    ``skipped``: numbers that carry no record (protocol 4), in sequence with the changes: each
    fills its number and is answered ``superseded`` (``duplicate`` at or below ``last_seq``).
    ``bodies``: the bytes each change's record arrived in, in order (protocol 6; empty: none),
    kept as its stored bytes when it is stored as pushed (see ``Bodies``).
    The caller commits ``tx`` when this returns and rolls it back when it raises.
    """
    stored = Bodies.pairs([c.record for c in changes], list(bodies)) if bodies else Bodies()
    buffered = _BufferedTx(tx, stored)
    view: StoreTx = buffered if wrap is None else wrap(buffered)
    await view.lock_tenant(tenant)
    start_seq = last_seq = await view.get_last_seq(tenant, client_id)
    skip = frozenset(skipped)
    keys = tx.keys_read(start_seq)
    if keys is None:
        keys = batch_keys(
            changes, start_seq, tenant, client_id, aliases, audit=chains, skipped=skip
        )
    await buffered.load(tenant, keys)
    batch = _Batch(view, tenant, clock, server_id, stored, buffered.held)
    await batch.prepare(c.record for c in changes if keys.verdicts.get(c.client_seq, 0) is None)
    results: list[ChangeResult] = []
    gap = False
    reused = False
    held_back: ClockSkew | ChainBroken | None = None
    for seq, change in _numbered(changes, skip):
        if held_back is not None:
            # Like a gap: the device keeps this and everything after it, and resends it all
            # once its stamps are no longer ahead of this server's clock, or once it chained
            # its audit rows on from the server's place.
            results.append(_rejected(seq, held_back))
            continue
        if reused and seq > last_seq:
            # Nothing new may apply under an id another copy also writes under: the device
            # takes a new id and resends it. (Numbers at or below last_seq are still each
            # answered for, so that it knows which of them the server holds.)
            results.append(_rejected(seq, IdentityReused("client id reused earlier in this batch")))
            continue
        if gap or seq > last_seq + 1:
            # Nothing after a gap may apply: the device resends from last_seq + 1.
            gap = True
            results.append(
                _rejected(seq, SequenceGap(f"expected client_seq {last_seq + 1}, got {seq}"))
            )
            continue
        if seq <= last_seq:
            if change is None or await _held(view, change.record, tenant, client_id, aliases):
                results.append(ChangeResult(client_seq=seq, status="duplicate"))
            else:
                reused = True
                copy = IdentityReused(
                    f"client_seq {seq} of this client id was used for another change: another "
                    "copy of this device (a restored or copied file) writes under the same id"
                )
                results.append(_rejected(seq, copy))
            continue
        last_seq = seq
        if change is None:  # a number whose record comes later in the push: nothing to do
            results.append(ChangeResult(client_seq=seq, status="superseded"))
            continue
        record = change.record
        present = False
        error = (
            keys.verdicts[seq]
            if seq in keys.verdicts
            else validate_record(record, tenant, client_id, aliases)
        )
        if error is not None and _relayed(record, tenant, client_id, aliases):
            # Another device's version, relayed: the device's queued row now refers to a
            # version it pulled. Harmless if the server already includes it.
            current = await view.get_session(record.id)
            assert isinstance(record, Session)
            if current is not None and vv_compare(current.vv, record.vv) in (
                Order.DOMINATES,
                Order.EQUAL,
            ):
                results.append(ChangeResult(client_seq=seq, status="superseded"))
                continue
        if error is None:
            error, present = await _check_owners(view, record, tenant)
        if error is None:
            error = _observe(clock, record)
            if isinstance(error, ClockSkew):
                last_seq = seq - 1  # not taken: nothing is lost to a wrong clock
                held_back = error
        if error is None and chains and not present and isinstance(record, AuditRow):
            tail = await view.audit_tail(record.client_id)
            if (record.sequence_number, record.prev_hash) != (tail[0] + 1, tail[1]):
                last_seq = seq - 1  # not taken: the device chains it on and sends it again
                held_back = ChainBroken(
                    f"audit row {record.id} is at place {record.sequence_number} of the chain "
                    f"of {record.client_id}, which the server holds up to place {tail[0]}: "
                    "chain it on from there"
                )
                result = _rejected(seq, held_back)
                result.chain_sequence, result.chain_hash = tail
                results.append(result)
                continue
        if error is not None:
            results.append(_rejected(seq, error))
            continue
        results.append(await batch.apply(seq, record, present))
    if last_seq != start_seq:
        await view.set_last_seq(tenant, client_id, last_seq)
    # The tenant's head before this batch's feed rows, read under the tenant's lock: when it
    # is the head the live frame starts from, the frame is exactly these rows, and the server
    # publishes them without reading them back. Not when the batch deletes a session: the
    # delete cascade may remove some of its own feed rows again. (Read on the batch's own
    # view, not the hooked one: fault injection places its hooks at the reads after the writes.)
    deletes = buffered.deletes_sessions
    previous_head = await buffered.head_cursor(tenant) if batch.feed and not deletes else None
    cursors = await buffered.flush(tenant, client_id, batch.feed)
    batch.set_cursors(cursors)
    return PushResult(
        results=results,
        last_seq=last_seq,
        head_cursor=await view.head_cursor(tenant),
        cursors=cursors,
        feed=(
            [FeedChange(cursor=c, record=r) for c, r in zip(cursors, batch.feed, strict=True)]
            if previous_head is not None
            else []
        ),
        previous_head=previous_head,
        as_pushed=batch.as_pushed and bool(batch.feed),
        bodies=[stored.of(r) for r in batch.feed] if previous_head is not None else [],
    )
