"""``DeviceCore``: the one owner of a device's state, and its only write path.

The device's state is its store plus what a process keeps of it in memory: the HLC clock, the
head of each session's event chain (whole log and canonical part), the head of this device's
audit chain, decoded session rows and transcripts, the active session and the per-session turn
locks. All of it lives here. Facets, turns and sync ask the core; nothing else keeps a copy.

Every write is ``StorageAdapter.transact``: under the store's write lock (SQLite's ``BEGIN
IMMEDIATE``, so another process on the same file waits its turn) the core checks the store's
``generation`` counter; when another process wrote since this one last looked, every cached
row and head is dropped and re-read inside the same transaction. An edit is a pure function of
the session's *current* row, so a turn that streamed for a minute appends to the row as it is
at commit time (a remote page applied meanwhile, another process's turn), never to the row it
started from: nothing is overwritten, and event and audit chains are extended from their real
heads. Caches change only after a commit succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from shared.clock import HybridClock, vv_bump, vv_merge, wall_clock_ms
from shared.errors import NotFound, RecordTooLarge
from shared.hashchain import chain_audit, chain_event
from shared.ids import uuid7
from shared.messages import MAX_PREVIOUS_IDS, MAX_RECORD_BYTES
from shared.records import (
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Record,
    Session,
    encode_record,
    kind_of,
)

from .cache import RecordCache
from .store.base import (
    CommitReceipt,
    InPlace,
    Rerunnable,
    StorageAdapter,
    TxReader,
    WriteBatch,
)
from .syncplan import stored_ids
from .transcript import Transcript

_R = TypeVar("_R", bound=Record)
GENERATION = "generation"
PREVIOUS_IDS = "previous_client_ids"
HISTORY_CACHE_SESSIONS = 16  # transcripts kept decoded in memory, least recently used dropped

log = logging.getLogger("pleach.core")
_ENCODER = msgspec.msgpack.Encoder()


@dataclass
class SessionChange:
    """What an edit does to one session, decided from its current row.

    ``row`` is the new content (the core stamps it: vector bumped, HLC now); ``None`` leaves
    the row as it is. ``records`` (messages, checkpoints, artifact updates) are written with
    it; ``events`` are unchained drafts that the core chains from the session's real head.
    ``purge`` deletes the session's contents (the delete cascade).
    """

    row: Session | None = None
    records: list[Record] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    purge: bool = False
    own_vector: bool = False
    """Stamp ``row`` on its own vector, not merged with the current row's (a re-key)."""


Edit = Callable[[Session | None], SessionChange | None]


@dataclass
class WriteResult:
    """What a write committed: the stamped rows by id, chained events and audit rows."""

    sessions: dict[str, Session]
    events: list[Event]
    audit: list[AuditRow]
    receipt: CommitReceipt
    purged: list[str] = field(default_factory=list)
    moved: int = 0
    """Stored audit rows moved onto this device's chain (``prepare``)."""


@dataclass
class SessionHandle:
    """A session loaded into the runtime. ``id`` is what every other call takes.

    ``hydrated`` is transient state folded from the event log on resume (turn counts, last
    outcome, conflicts); it is never written back to the row.
    """

    id: str
    record: Session
    hydrated: dict[str, Any] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)

    @property
    def provider(self) -> str:
        return self.record.provider

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def title(self) -> str:
        return self.record.title

    @property
    def message_ids(self) -> list[str]:
        return list(self.record.state.message_ids)


def existing(edit: Callable[[Session], SessionChange | None]) -> Edit:
    """An edit that needs the session to exist and not be deleted (``NotFound`` otherwise)."""

    def run(current: Session | None) -> SessionChange | None:
        if current is None or current.deleted:
            raise NotFound("session does not exist or was deleted")
        return edit(current)

    return run


class DeviceCore:
    """The device's clock, chain heads, caches and single write path (see module docstring).

    Opened by ``SessionRuntime.open``; ``client_id`` is the store's (minted on first open).
    """

    def __init__(
        self,
        store: StorageAdapter,
        *,
        org_id: str,
        user_id: str,
        client_id: str | None = None,
        wall_clock: Callable[[], int] = wall_clock_ms,
        cache: RecordCache[Message] | None = None,
    ) -> None:
        self.store = store
        self._wall_clock = wall_clock
        # Immutable messages read from the store, by id (``runtime.cache``; None: off).
        self.cache = cache
        self.org_id = org_id
        self.user_id = user_id
        self._requested_client_id = client_id
        self.client_id = client_id or ""
        self.clock = HybridClock("pending")
        self._generation: str | None = None
        self._sessions: dict[str, Session] = {}
        self._event_heads: dict[str, tuple[int, str]] = {}
        self._canonical_heads: dict[str, tuple[int, str]] = {}
        self._histories: dict[str, Transcript] = {}
        self._audit_head: tuple[int, str] | None = None
        self._turn_locks: dict[str, asyncio.Lock] = {}
        # One re-key at a time, each reading the id it replaces under the lock, and each run
        # to its end whatever becomes of its caller (``rekey``).
        self._rekey_lock = asyncio.Lock()
        self._rekeying: set[asyncio.Task[str]] = set()  # kept until done (see ``rekey``)
        self.active: SessionHandle | None = None
        self._listeners: list[Callable[[], None]] = []

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> None:
        await self.store.open()
        stored = await self.store.get_meta("client_id")
        if stored is None:
            self.client_id = self._requested_client_id or uuid7()
            await self.store.set_meta("client_id", self.client_id)
        else:
            self.client_id = stored
        self.clock = HybridClock(
            self.client_id, last=await self.store.get_meta("hlc"), wall=self._wall_clock
        )
        self._forget()

    def on_local_write(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every commit that queued outbox rows."""
        self._listeners.append(listener)

    # -- reads ------------------------------------------------------------------------------
    def now(self) -> str:
        return self.clock.now()

    def turn_lock(self, session_id: str) -> asyncio.Lock:
        return self._turn_locks.setdefault(session_id, asyncio.Lock())

    async def session(self, session_id: str) -> Session:
        """The session's current row; ``NotFound`` if it does not exist or was deleted."""
        await self._check_generation()
        row = self._sessions.get(session_id)
        if row is None:
            row = await self.store.get_session(session_id)
            if row is not None:
                self._sessions[session_id] = row
        if row is None or row.deleted:
            raise NotFound(f"no session {session_id}")
        return row

    def cached(self, session_id: str) -> bool:
        """Whether this process holds the session's row in memory."""
        return session_id in self._sessions

    async def history(self, session: Session) -> list[Message]:
        """The session's transcript, in order (see ``transcript``)."""
        return list((await self.transcript(session)).messages)

    async def transcript(self, session: Session) -> Transcript:
        """The session's transcript and its API form, from a small per-session cache when it
        is current.

        The cache is checked against the row's message ids, so a rollback, fork or remote
        change simply misses it and reloads. The result is shared: do not mutate it.
        """
        cached = self._histories.get(session.id)
        if cached is not None and cached.ids == session.state.message_ids:
            return cached
        history = await self.messages(session.state.message_ids)
        transcript = Transcript.of(session.state.message_ids, history)
        if len(history) == len(session.state.message_ids):
            # Only whole: a row may name messages not here yet (a later page of a pull), and
            # a transcript kept without them would be given again while its ids match.
            self._remember(session.id, transcript)
        return transcript

    async def messages(self, message_ids: list[str]) -> list[Message]:
        """The stored messages of ``message_ids``, in order (missing ones left out): from the
        record cache where it holds them, the rest in one store read. Messages never change
        once written, so a cached copy is never stale; a purge (delete) or another process's
        write clears the cache."""
        cache = self.cache
        if cache is None:
            return await self.store.get_messages(message_ids)
        found, missing = cache.get_many(message_ids)
        if missing:
            read = await self.store.get_messages(missing)
            # Only the last ones the cache can hold are sized and kept: the rest would be
            # evicted by those at once (a long transcript read whole).
            kept = len(read) - cache.max_entries
            for at, message in enumerate(read):
                found[message.id] = message
                if at >= kept:
                    cache.put(message.id, message, len(_ENCODER.encode(message)))
        return [found[i] for i in message_ids if i in found]

    # -- drafts -----------------------------------------------------------------------------
    def draft_event(self, session_id: str, kind: str, payload: dict[str, Any]) -> Event:
        """An event not yet placed in its chain: the write chains it."""
        return Event(
            id=uuid7(),
            session_id=session_id,
            org_id=self.org_id,
            user_id=self.user_id,
            client_id=self.client_id,
            hlc=self.clock.now(),
            type=kind,
            payload=payload,
        )

    def draft_checkpoint(
        self,
        session_id: str,
        *,
        parent_id: str | None,
        turn_id: str | None,
        kind: str,
        appended: list[str],
        snapshot: list[str] | None = None,
        checkpoint_id: str | None = None,
    ) -> Checkpoint:
        return Checkpoint(
            id=checkpoint_id or uuid7(),
            session_id=session_id,
            org_id=self.org_id,
            user_id=self.user_id,
            client_id=self.client_id,
            hlc=self.clock.now(),
            parent_id=parent_id,
            turn_id=turn_id,
            kind=kind,  # type: ignore[arg-type]
            appended=appended,
            snapshot=snapshot,
        )

    # -- writes -----------------------------------------------------------------------------
    async def write(
        self,
        edits: Iterable[tuple[str, Edit]] = (),
        *,
        records: Iterable[Record] = (),
        audit: Iterable[AuditRow] = (),
        meta: dict[str, str] | Callable[[TxReader], Awaitable[dict[str, str]]] | None = None,
        renumber_outbox: bool = False,
        identity: tuple[str, HybridClock] | None = None,
        prepare: Callable[[TxReader], Awaitable[tuple[list[tuple[str, Edit]], list[AuditRow]]]]
        | None = None,
        audit_from: tuple[int, str] | None = None,
    ) -> WriteResult:
        """Commit local changes with their outbox rows, in ONE transaction.

        ``edits`` are ``(session_id, edit)``: each edit gets the session's current row (None
        if absent) and returns a ``SessionChange`` (or None: nothing for that session).
        ``records`` are immutable records to write as they are; ``audit`` rows are unchained
        drafts that join this device's audit chain. ``meta`` sets ``sync_state`` keys (or,
        as ``meta(tx)``, computes them inside the transaction: a read-modify-write of a key
        that another process may write too) and
        ``renumber_outbox`` restarts the outbox sequence (``WriteBatch``); ``identity``
        (client id and clock) is taken inside the transaction, and given back if it does not
        commit; ``prepare(tx)``, inside the transaction, adds edits and stored audit rows to
        move onto this device's chain, before ``audit`` (from what the store holds then);
        ``audit_from`` (sequence number, row hash) is where they go on from, instead of the
        chain's stored head (the server's place, after it refused a row: 3013). Every record
        is labelled with the client id it commits under (a draft made before the device took
        a new id joins the new one). Raises what an edit raises, with nothing written.
        """
        extra_meta: dict[str, str] = {} if meta is None or callable(meta) else dict(meta)
        compute_meta = meta if callable(meta) else None
        edit_list = list(edits)
        record_list = list(records)
        audit_list = list(audit)
        result: WriteResult | None = None
        pending: tuple[str, dict[str, tuple[int, str]], tuple[int, str] | None] | None = None

        previous: tuple[str, HybridClock] | None = None

        async def plan(tx: TxReader) -> WriteBatch:
            nonlocal result, pending, previous
            await self._refresh(tx)
            if identity is not None and previous is None:
                previous = (self.client_id, self.clock)
                self.client_id, self.clock = identity
                self._audit_head = None  # the new id's chain starts at its genesis
            all_edits, moving = list(edit_list), list[AuditRow]()
            if compute_meta is not None:
                extra_meta.update(await compute_meta(tx))
            if prepare is not None:
                more_edits, moving = await prepare(tx)
                all_edits += more_edits
            heads: dict[str, tuple[int, str]] = {}
            rows: dict[str, Session] = {}
            contents: list[Record] = [self._own(r) for r in record_list]
            events: list[Event] = []
            purge: list[str] = []
            for session_id, edit in all_edits:
                current = rows.get(session_id) or await self._row(tx, session_id)
                change = edit(current)
                if change is None:
                    continue
                if change.row is not None:
                    base = None if change.own_vector else current
                    rows[session_id] = self._stamp(change.row, base=base)
                contents.extend(self._own(r) for r in change.records)
                if change.purge:
                    purge.append(session_id)
                seq, prev = heads.get(session_id) or await self._event_head(tx, session_id)
                for draft in change.events:
                    seq += 1
                    placed = chain_event(self._own(draft), prev, seq)
                    prev = placed.row_hash
                    events.append(placed)
                heads[session_id] = (seq, prev)
            # Moved rows first, then the new ones; each labelled with the id whose chain it
            # joins (a draft made before this device took a new id goes on the new id's).
            seq, prev = audit_from or await self._audit_chain_head(tx)
            placed_rows: list[AuditRow] = []
            for audit_row in [*moving, *audit_list]:
                seq += 1
                placed_rows.append(chain_audit(self._own(audit_row), prev, seq))
                prev = placed_rows[-1].row_hash
            moved, chained = placed_rows[: len(moving)], placed_rows[len(moving) :]
            generation = _next_generation()
            meta = {**extra_meta, "hlc": self.clock.last, GENERATION: generation}
            if placed_rows:
                meta[f"audit_head:{self.client_id}"] = f"{seq}:{prev}"
            result = WriteResult(
                sessions=rows,
                events=events,
                audit=chained,
                receipt=CommitReceipt(client_seqs=[], records=0),
                purged=purge,
                moved=len(moved),
            )
            pending = (generation, heads, (seq, prev) if placed_rows else None)
            _check_sizes([*contents, *events, *chained])
            keep = await purge_keep(tx, purge, rows.values()) if purge else []
            # Order matters for sync: referenced records precede the session row.
            return WriteBatch(
                records=[*contents, *events, *chained, *rows.values()],
                meta=meta,
                purge_sessions=purge,
                purge_keep=keep,
                renumber_outbox=renumber_outbox,
                rechained_audit=moved,
            )

        # Its only effects are what it returns (and caches that stay right): without a
        # callback of the caller's or an identity to take, it may be planned on the store's
        # last meta and committed in one step (``Rerunnable``).
        rerunnable = prepare is None and compute_meta is None and identity is None
        try:
            receipt = await self.store.transact(Rerunnable(plan) if rerunnable else plan)
        except BaseException:
            if previous is not None:
                self.client_id, self.clock = previous
            self._forget()
            raise
        assert result is not None and pending is not None
        result.receipt = receipt
        generation, heads, audit_head = pending
        self._generation = generation
        self._event_heads.update(heads)
        if audit_head is not None:
            self._audit_head = audit_head
        self._took(result.sessions.values(), purged=result.purged)
        if receipt.client_seqs:
            for listener in self._listeners:
                listener()
        return result

    async def rekey(self) -> str:
        """Take a new client id, because another copy of this device's file (a restored
        backup, a copied file) has used this one. Returns the new id.

        In one transaction, on what the store holds then: the new id is stored, the queued
        rows are renumbered from 1 (the server has never seen the new id, so it takes them
        all), each session with queued changes gets a new version stamped by the new id on a
        vector without the old id (concurrent with whatever the other copy wrote under the
        old id, so the server settles them as conflicts and keeps both sides, instead of
        taking one for an old version of the other), and the queued audit rows of the old id
        (which the server does not hold) move onto the new id's chain, so the old id's chain
        here stays the one the server holds.
        """
        # Shielded: a caller cancelled while the write was in flight (a disconnect) used to
        # give the old id back in memory although the new one had committed, with the queued
        # audit rows moved onto its chain; the next re-key then replaced the old id again and
        # the new one never became a previous id, so the server refused those rows (3007).
        task = asyncio.ensure_future(self._rekey_in_turn())
        self._rekeying.add(task)
        task.add_done_callback(self._rekeying.discard)
        task.add_done_callback(_rekeyed)
        return await asyncio.shield(task)

    async def _rekey_in_turn(self) -> str:
        async with self._rekey_lock:
            return await self._rekey()

    async def _rekey(self) -> str:
        old_id = self.client_id
        previous = [old_id, *(await self.previous_client_ids())][:MAX_PREVIOUS_IDS]
        new_id = uuid7()
        clock = HybridClock(new_id, last=self.clock.last, wall=self._wall_clock)

        def restamp(current: Session | None) -> SessionChange | None:
            if current is None:
                return None
            # The old id's entry goes: the other copy counted under it too, so this copy's
            # count proves nothing.
            vv = {k: v for k, v in current.vv.items() if k != old_id}
            return SessionChange(row=msgspec.structs.replace(current, vv=vv), own_vector=True)

        async def queued(tx: TxReader) -> tuple[list[tuple[str, Edit]], list[AuditRow]]:
            records = await tx.queued_records()
            sessions = [
                r.id if isinstance(r, Session) else kind_of(r).session_of(r) for r in records
            ]
            edits: list[tuple[str, Edit]] = [
                (sid, restamp) for sid in dict.fromkeys(sessions) if sid is not None
            ]
            audit = [r for r in records if isinstance(r, AuditRow) and r.client_id == old_id]
            return edits, sorted(audit, key=lambda row: row.sequence_number)

        await self.write(
            meta={"client_id": new_id, PREVIOUS_IDS: msgspec.json.encode(previous).decode()},
            renumber_outbox=True,
            identity=(new_id, clock),
            prepare=queued,
        )
        self._forget()
        return new_id

    async def rechain_audit(self, chain: str, after: tuple[int, str]) -> int:
        """Chain the queued audit rows of ``chain`` (a client id) on from ``after``, the
        server's last place in that chain (sequence number, row hash), because it refused one
        of them for not continuing it (3013). Returns how many rows moved.

        So it goes when another copy of this device's file placed rows of the same chain
        first, or when rows this device placed were kept by the server at another place (two
        copies of one file that both moved the same queued rows onto their new ids). Queued
        rows of an earlier id of this device move onto its current chain, after its head.
        """

        async def queued(tx: TxReader) -> tuple[list[tuple[str, Edit]], list[AuditRow]]:
            rows = [
                r
                for r in await tx.queued_records()
                if isinstance(r, AuditRow) and r.client_id == chain
            ]
            return [], sorted(rows, key=lambda row: row.sequence_number)

        result = await self.write(
            prepare=queued, audit_from=after if chain == self.client_id else None
        )
        return result.moved

    async def previous_client_ids(self) -> list[str]:
        """The ids this device wrote under before its current one, newest first."""
        return previous_ids(await self.store.get_meta(PREVIOUS_IDS))

    async def transact_remote(
        self, plan: Callable[[TxReader, RemoteView], Any], *, in_place: bool = False
    ) -> tuple[CommitReceipt, Any]:
        """Run a sync plan in one transaction with a view of the core's heads.

        ``plan(tx, view)`` returns ``(batch | None, outcome)``; on success the core adopts what
        the view recorded (rows taken, new heads) and the outcome is returned. ``in_place``: the
        store may run it, its reads and its write, on the caller's thread (``InPlace``: a page
        of up to ``sync.IN_PLACE_PAGE`` changes).
        """
        view = RemoteView(self)
        outcome: Any = None
        wrote = False
        generation = _next_generation()

        async def run(tx: TxReader) -> WriteBatch | None:
            nonlocal outcome, wrote
            await self._refresh(tx)
            batch: WriteBatch | None
            batch, outcome = await plan(tx, view)
            if batch is not None:
                wrote = True
                batch.meta = {**batch.meta, "hlc": self.clock.last, GENERATION: generation}
            return batch

        try:
            receipt = await self.store.transact(InPlace(run) if in_place else run)
        except BaseException:
            self._forget()
            raise
        if wrote:
            self._generation = generation
            self._event_heads.update(view.heads)
            self._canonical_heads.update(view.canonical_heads)
            self._took(view.rows.values(), purged=view.purged)
        if receipt.client_seqs:
            for listener in self._listeners:
                listener()
        return receipt, outcome

    # -- internals --------------------------------------------------------------------------
    def _own(self, record: _R) -> _R:
        """``record`` labelled with this device's client id (as it commits)."""
        if record.client_id == self.client_id:
            return record
        return msgspec.structs.replace(record, client_id=self.client_id)

    def _stamp(self, row: Session, *, base: Session | None) -> Session:
        """``row`` as a new local version after ``base``: vector bumped, stamped now."""
        now = self.clock.now()
        vv = row.vv if base is None else vv_merge(base.vv, row.vv)
        return msgspec.structs.replace(
            row,
            client_id=self.client_id,
            hlc=now,
            updated_at=now,
            vv=vv_bump(vv, self.client_id),
        )

    def _took(self, rows: Iterable[Session], *, purged: Iterable[str] = ()) -> None:
        for row in rows:
            if row.deleted:
                self._sessions.pop(row.id, None)
            else:
                self._sessions[row.id] = row
            if self.active is not None and self.active.id == row.id:
                if row.deleted:
                    self.active = None
                else:
                    self.active.record = row
        for session_id in purged:
            self._histories.pop(session_id, None)
            if self.cache is not None:
                self.cache.clear()

    async def _row(self, tx: TxReader, session_id: str) -> Session | None:
        row = self._sessions.get(session_id)
        if row is None:
            row = await tx.get_session(session_id)
        return row

    async def _event_head(self, tx: TxReader, session_id: str) -> tuple[int, str]:
        head = self._event_heads.get(session_id)
        if head is None:
            head = await tx.event_head(session_id)
        return head

    async def _audit_chain_head(self, tx: TxReader) -> tuple[int, str]:
        if self._audit_head is None:
            stored = await tx.get_meta(f"audit_head:{self.client_id}")
            seq, _, digest = (stored or "0:").partition(":")
            self._audit_head = (int(seq), digest)
        return self._audit_head

    async def _refresh(self, tx: TxReader) -> None:
        """Inside a write: drop everything cached if another process wrote since."""
        generation = await tx.get_meta(GENERATION)
        if generation != self._generation:
            self._forget()
            self._generation = generation
            stored = await tx.get_meta("hlc")
            if stored:
                self.clock.advance(stored)

    async def _check_generation(self) -> None:
        """Outside a write: a cheap look whether another process wrote (caches dropped). It
        need not wait for a write of this process in progress: that one keeps the caches."""
        generation = await self.store.peek_meta(GENERATION)
        if generation != self._generation:
            self._forget()
            self._generation = generation

    def _forget(self) -> None:
        self._generation = None
        if self.cache is not None:
            self.cache.clear()
        self._sessions.clear()
        self._event_heads.clear()
        self._canonical_heads.clear()
        self._audit_head = None

    def _remember(self, session_id: str, transcript: Transcript) -> None:
        self._histories.pop(session_id, None)
        self._histories[session_id] = transcript
        while len(self._histories) > HISTORY_CACHE_SESSIONS:
            self._histories.pop(next(iter(self._histories)))

    def remember_turn(self, before: Session, after: Session, messages: list[Message]) -> None:
        """Extend the cached transcript with a committed turn's messages, when it applies."""
        cached = self._histories.get(before.id)
        if cached is None:
            return
        extended = cached.extended(messages)
        if extended.ids == after.state.message_ids:
            self._remember(after.id, extended)


class RemoteView:
    """What a sync plan may know and change of the core's state inside its transaction."""

    def __init__(self, core: DeviceCore) -> None:
        self._core = core
        self.rows: dict[str, Session] = {}
        self.heads: dict[str, tuple[int, str]] = {}
        self.canonical_heads: dict[str, tuple[int, str]] = {}
        self.purged: list[str] = []
        self.before: dict[str, Session | None] = {}
        """Each session's row as it was before this page (as first read)."""
        self.identity_reused = False
        """The page holds a version another copy of this device wrote under its id."""

    @property
    def client_id(self) -> str:
        return self._core.client_id

    @property
    def clock(self) -> HybridClock:
        return self._core.clock

    async def row(self, tx: TxReader, session_id: str) -> Session | None:
        if session_id in self.rows:
            return self.rows[session_id]
        current = await self._core._row(tx, session_id)
        self.before.setdefault(session_id, current)
        return current

    def canonical_head(self, session_id: str) -> tuple[int, str] | None:
        return self.canonical_heads.get(session_id) or self._core._canonical_heads.get(session_id)

    async def event_head(self, tx: TxReader, session_id: str) -> tuple[int, str]:
        """The last event of the session's log, canonical or not (as the core knows it)."""
        head = self.heads.get(session_id)
        return head if head is not None else await self._core._event_head(tx, session_id)

    def stamp(self, row: Session, *, base: Session | None) -> Session:
        return self._core._stamp(row, base=base)

    def draft_checkpoint(self, session_id: str, **fields: Any) -> Checkpoint:
        """A checkpoint of ``session_id`` written by this device (``DeviceCore``'s)."""
        return self._core.draft_checkpoint(session_id, **fields)


def previous_ids(stored: str | None) -> list[str]:
    """The ids a device wrote under before its current one, from their meta value."""
    return stored_ids(stored, MAX_PREVIOUS_IDS)


async def purge_keep(
    tx: TxReader, purged: Iterable[str], written: Iterable[Session] = ()
) -> list[str]:
    """Ids of the purged sessions' contents that a live session still refers to.

    A fork (a user's, or a conflict's) shares its origin's messages, artifacts and, for a
    conflict fork, its checkpoint lineage: deleting the origin must not take them from it.
    ``written`` are rows of the same batch, which count as they will be after it.
    """
    gone = set(purged)
    live = {s.id: s for s in await tx.list_sessions()}
    for row in written:
        live[row.id] = row
    keep: set[str] = set()
    heads: set[str] = set()
    for session in live.values():
        if session.id in gone or session.deleted:
            continue
        keep.update(session.state.message_ids)
        keep.update(session.state.artifacts)
        if session.head_checkpoint_id is not None:
            heads.add(session.head_checkpoint_id)
    for session_id in gone:
        by_id = {c.id: c for c in await tx.list_checkpoints(session_id)}
        for head in heads:
            current = by_id.get(head)
            while current is not None and current.id not in keep:
                keep.add(current.id)
                current = by_id.get(current.parent_id) if current.parent_id else None
    return sorted(keep)


def _check_sizes(records: Iterable[Record]) -> None:
    """Refuse a record too large to ever sync (``RecordTooLarge``), before anything is written."""
    for record in records:
        size = len(encode_record(record))
        if size > MAX_RECORD_BYTES:
            raise RecordTooLarge(
                f"{type(record).__name__} {record.id} is {size:,} bytes encoded, over the "
                f"{MAX_RECORD_BYTES:,}-byte limit for a record that syncs"
            )


def _next_generation() -> str:
    # A fresh unique token rather than a counter: it names one commit, so a process that
    # sees its own last token knows nobody else has written since.
    return uuid7()


__all__ = [
    "GENERATION",
    "DeviceCore",
    "Edit",
    "RemoteView",
    "SessionChange",
    "SessionHandle",
    "WriteResult",
    "existing",
    "purge_keep",
]


def _rekeyed(task: asyncio.Task[str]) -> None:
    """A re-key's error is logged (its caller, if still there, gets it raised too): one whose
    caller went away is not left unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("re-key failed: %s", task.exception())
