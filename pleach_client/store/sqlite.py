"""``SQLiteAdapter``: the device's durable local store, one SQLite file over aiosqlite.

WAL mode, ``synchronous`` NORMAL by default (FULL as an option), one connection, one writer.
Each record is kept as its msgpack bytes (``body``) beside the columns its queries filter and
sort on. Every write is one explicit ``BEGIN IMMEDIATE`` transaction built from one
``executemany`` per table: aiosqlite costs ~50-150 us per awaited call, so a commit costs a
fixed handful of round trips to the connection thread however many records it holds.

The schema version is ``PRAGMA user_version``. ``_MIGRATIONS`` are applied in order, in one
transaction, by ``open()``; re-opening is a no-op, and a file written by a newer pleach is
refused without being touched.

A new file is created with ``auto_vacuum = INCREMENTAL``: the outbox's rows go once the server
has them, and when a removal leaves at least ``RECLAIM_PAGES`` free pages (or empties the
outbox and leaves ``DRAINED_RECLAIM_PAGES``) the file gives them back (``PRAGMA
incremental_vacuum``), so a device that synced a long offline stretch does not keep its
high-water size. Files created before keep their mode (changing it needs a VACUUM).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import os
import sqlite3
import time
import warnings
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from enum import Enum
from functools import partial
from typing import Any, Final, Generic, Literal, TypeVar, cast

import aiosqlite
import msgspec

from shared import compact
from shared.aio import Every
from shared.errors import InvalidState, StorageError
from shared.hashchain import audit_digests
from shared.idrefs import ID_LAYOUT, SQLITE_ID_LAYOUT, IdLayout, id_blocks, rechunked
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Record,
    Session,
)
from shared.resource import AsyncResource

from . import queued
from .base import (
    CommitReceipt,
    DeadLetter,
    EventPlace,
    HydrationKey,
    InPlace,
    KeptHydration,
    NotInSnapshot,
    OutboxEntry,
    Plan,
    Rerunnable,
    TxReader,
    WriteBatch,
    decode_children,
    decode_events,
    decode_log,
    event_place_of,
    fixed_plan,
    marked_canonical,
    outbox_entries,
)

__all__ = [
    "ID_LAYOUT",
    "SCHEMA_VERSION",
    "SQLITE_ID_LAYOUT",
    "IdLayout",
    "SQLiteAdapter",
    "Synchronous",
    "create_schema",
    "id_blocks",
    "sql_functions",
]

log = logging.getLogger("pleach.store")

Synchronous = Literal["NORMAL", "FULL"]

_KIND_CASE: Final = (
    "CASE kind "
    + " ".join(f"WHEN '{name}' THEN {code}" for code, name in enumerate(compact.KINDS))
    + " ELSE kind END"
)
"""SQL: an outbox row's kind text as its index in ``compact.KINDS`` (schema 9)."""
_KIND_CODE: Final = {name: code for code, name in enumerate(compact.KINDS)}
_SESSION_KIND: Final = _KIND_CODE["Session"]

_Step = str | Callable[[sqlite3.Connection], None]
"""A migration's statement, or (schema 17 on) a function of the connection, run in its
transaction, for what SQL alone does not say plainly."""


def _run_step(raw: sqlite3.Connection, statement: _Step) -> None:
    """One statement of a migration (``_Step``)."""
    if isinstance(statement, str):
        raw.execute(statement)
    else:
        statement(raw)


def _rechunk_id_blocks(raw: sqlite3.Connection) -> None:
    """Schema 17: every session's id blocks cut again into ``SQLITE_ID_LAYOUT``'s. The ids
    they hold are the same bytes, so a session's ``ids_mark`` (and a process's
    ``_id_blocks`` entry under it) still stands; a session whose blocks are not all there,
    or not all bytes, keeps them as they are (its reads fail alike before and after)."""
    sessions: dict[object, list[tuple[int, Any]]] = {}
    for key, part, ids in raw.execute("SELECT session_id, part, ids FROM session_ids"):
        sessions.setdefault(key, []).append((part, ids))
    rows = []
    for key, blocks in sessions.items():
        if all(isinstance(part, int) and isinstance(ids, bytes) for part, ids in blocks):
            blocks = rechunked(blocks, SQLITE_ID_LAYOUT.block)
        rows += [(key, part, ids) for part, ids in blocks]
    raw.execute("DELETE FROM session_ids")
    raw.executemany(_PUT_ID_BLOCK, rows)


def _outbox_by_commit(raw: sqlite3.Connection) -> None:
    """Schema 18: the outbox as a row a commit (``queued``). Each run of rows queued by one
    commit (consecutive numbers, one ``created_at``) becomes one row of at most
    ``queued.ROW_ENTRIES`` entries, each row's own copy of a body kept in its entry; the
    numbers, the sequence after them and every attempt and error stay as they were."""
    old = raw.execute(
        "SELECT client_seq, record_id, kind, body, attempts, created_at, last_error_code, "
        "last_error_message FROM outbox ORDER BY client_seq"
    ).fetchall()
    last = raw.execute(_LAST_SEQ).fetchone()
    raw.execute("DROP TABLE outbox")  # (its index with it)
    for statement in _OUTBOX_TABLES_18:
        raw.execute(statement)
    runs: list[tuple[int, int, list[queued.Queued]]] = []
    tries: dict[int, queued.Tried] = {}
    for seq, record_id, kind, body, attempts, created_at, code, message in old:
        if not (isinstance(record_id, str) or _is_uuid_key(record_id)):
            record_id = repr(record_id)  # (no record has that key: its entry reads as corrupt)
        copy = body if isinstance(body, bytes) or body is None else str(body).encode()
        entry = queued.Queued(_kind_code(kind), record_id, copy)
        run = runs[-1] if runs else None
        if (
            run is None
            or run[0] + len(run[2]) != seq
            or run[1] != created_at
            or len(run[2]) >= queued.ROW_ENTRIES
        ):
            runs.append((seq, created_at, [entry]))
        else:
            run[2].append(entry)
        if attempts or code is not None or message is not None:
            tries[seq] = (attempts, code, message)
    for first, created_at, entries in runs:
        _put_queued(raw, first, entries, int(created_at))
        held = {n - first: tries[n] for n in range(first, first + len(entries)) if n in tries}
        if held:  # (a run is one row: at most ``ROW_ENTRIES``)
            update = "UPDATE outbox SET tried = ? WHERE client_seq = ?"
            raw.execute(update, (queued.tried(held), first))
    raw.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
    if last is not None:
        raw.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('outbox', ?)", (last[0],))


def _kind_code(kind: object) -> int:
    """An outbox row's kind before schema 18 (its index in ``compact.KINDS`` as the column's
    text, schema 9, or the kind's name before) as the index; a kind that is neither (a
    corrupt row) as ``_NO_KIND``, whose entry reads as no record (its flush names it)."""
    text = str(kind)
    if text.isdigit():
        return int(text) if int(text) < _NO_KIND else _NO_KIND
    return _KIND_CODE.get(text, _NO_KIND)


_NO_KIND: Final = 14
"""The kind of an entry whose row named none this build knows (the last ``queued`` keeps)."""


def _is_uuid_key(key: object) -> bool:
    return isinstance(key, bytes) and len(key) == 16


# One tuple of statements per schema version; append, never edit a released step.
_MIGRATIONS: Final[tuple[tuple[_Step, ...], ...]] = (
    (  # 1: the initial schema
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY NOT NULL,
            updated_at TEXT NOT NULL,
            deleted INTEGER NOT NULL,
            body BLOB NOT NULL)""",
        "CREATE INDEX ix_sessions_updated ON sessions (updated_at, id)",
        "CREATE INDEX ix_sessions_live ON sessions (updated_at, id) WHERE deleted = 0",
        """CREATE TABLE messages (
            id TEXT PRIMARY KEY NOT NULL,
            session_id TEXT NOT NULL,
            hlc TEXT NOT NULL,
            body BLOB NOT NULL)""",
        """CREATE TABLE checkpoints (
            id TEXT PRIMARY KEY NOT NULL,
            session_id TEXT NOT NULL,
            hlc TEXT NOT NULL,
            body BLOB NOT NULL)""",
        "CREATE INDEX ix_checkpoints_session ON checkpoints (session_id, hlc, id)",
        """CREATE TABLE events (
            id TEXT PRIMARY KEY NOT NULL,
            session_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            hlc TEXT NOT NULL,
            body BLOB NOT NULL)""",
        "CREATE INDEX ix_events_session ON events (session_id, sequence_number, id)",
        """CREATE TABLE audit (
            id TEXT PRIMARY KEY NOT NULL,
            client_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            subject_key TEXT,
            body BLOB NOT NULL)""",
        "CREATE INDEX ix_audit_client ON audit (client_id, sequence_number, id)",
        "CREATE INDEX ix_audit_session ON audit (session_id, client_id, sequence_number, id)",
        "CREATE INDEX ix_audit_subject ON audit (subject_key) WHERE subject_key IS NOT NULL",
        """CREATE TABLE artifact_updates (
            id TEXT PRIMARY KEY NOT NULL,
            artifact_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            hlc TEXT NOT NULL,
            body BLOB NOT NULL)""",
        "CREATE INDEX ix_artifact_updates ON artifact_updates (artifact_id, hlc, id)",
        # AUTOINCREMENT: sqlite_sequence remembers the largest client_seq ever used, so a
        # sequence number is never handed out twice, even after its row is removed.
        # body is NULL: the row refers to its record by kind and id and the flush reads the
        # stored version, so the outbox costs a small row per change, never a second copy.
        """CREATE TABLE outbox (
            client_seq INTEGER PRIMARY KEY AUTOINCREMENT,
            record_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            body BLOB,
            attempts INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            last_error_code INTEGER,
            last_error_message TEXT)""",
        """CREATE TABLE dead_letters (
            client_seq INTEGER PRIMARY KEY NOT NULL,
            record_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            body BLOB NOT NULL,
            code INTEGER NOT NULL,
            message TEXT NOT NULL,
            attempts INTEGER NOT NULL,
            failed_at REAL NOT NULL)""",
        """CREATE TABLE sync_state (
            key TEXT PRIMARY KEY NOT NULL,
            value TEXT NOT NULL)""",
    ),
    (  # 2: is a record still queued (a session's unacknowledged version)?
        "CREATE INDEX ix_outbox_record ON outbox (record_id)",
    ),
    # 3: an event's type beside its body, so that a reader of some types (a resume reads
    # the few the fold needs) leaves the others' rows in the file. Rows written before have
    # NULL there, and are read and sorted by their body as before.
    ("ALTER TABLE events ADD COLUMN type TEXT",),
    # 4: a checkpoint's parent beside its body ('' for a root), so that resume asks for the
    # head's children without reading every checkpoint of the session; rows written before
    # have NULL there and are read by their body as before. The outbox's index on record_id
    # served one question, whether a session's version is still queued: it now holds the
    # session rows only (a tenth of the entries of a turn). And messages' and events' hlc
    # columns, which no query reads, are written '' from now on: the stamp is in the body.
    (
        "ALTER TABLE checkpoints ADD COLUMN parent_id TEXT",
        "DROP INDEX ix_outbox_record",
        "CREATE INDEX ix_outbox_session ON outbox (record_id) WHERE kind = 'Session'",
    ),
    # 5: ids as their 16 bytes (``_key``): a canonical UUID took 36 characters in its column
    # and again in every index that holds it (a turn keeps about 40 ids in its rows and
    # indexes). Any other id stays its text. ``pleach_key`` is registered on the connection
    # before migrating (``_sql_key``); it leaves a converted key as it is.
    (
        "UPDATE sessions SET id = pleach_key(id)",
        "UPDATE messages SET id = pleach_key(id), session_id = pleach_key(session_id)",
        "UPDATE checkpoints SET id = pleach_key(id), session_id = pleach_key(session_id), "
        "parent_id = pleach_key(parent_id)",
        "UPDATE events SET id = pleach_key(id), session_id = pleach_key(session_id)",
        "UPDATE audit SET id = pleach_key(id), client_id = pleach_key(client_id), "
        "session_id = pleach_key(session_id)",
        "UPDATE artifact_updates SET id = pleach_key(id), "
        "artifact_id = pleach_key(artifact_id), session_id = pleach_key(session_id)",
        "UPDATE outbox SET record_id = pleach_key(record_id)",
        "UPDATE dead_letters SET record_id = pleach_key(record_id)",
    ),
    # 6: a session's folded log, kept under the key of the log it was folded from
    # (``hydration.load_hydration``): a resume whose log has not changed since reads one row
    # instead of the log. A cache: never synced, never in the outbox.
    (
        """CREATE TABLE hydrations (
            session_id TEXT PRIMARY KEY NOT NULL,
            events INTEGER NOT NULL,
            sequence_number INTEGER NOT NULL,
            row_hash TEXT NOT NULL,
            version INTEGER NOT NULL,
            body BLOB NOT NULL)""",
    ),
    # 7: a long session's message ids in blocks (``IdLayout``) beside its row
    # (``session_ids``), so that a turn rewrites the block it appends to instead of every id
    # the session holds (a row of 2,000 ids was 32 KB written again at each turn). The row's
    # body then holds no ids and ``ids_count`` says how many its blocks hold; ``ids_mark``
    # is drawn anew at each write of the blocks (``_put_sessions``). Rows written before,
    # and any session of few ids, keep them in the body (``ids_count`` NULL).
    (
        "ALTER TABLE sessions ADD COLUMN ids_count INTEGER",
        "ALTER TABLE sessions ADD COLUMN ids_mark INTEGER",
        """CREATE TABLE session_ids (
            session_id TEXT NOT NULL,
            part INTEGER NOT NULL,
            ids BLOB NOT NULL,
            PRIMARY KEY (session_id, part))""",
    ),
    # 8: records in protocol 8's form (``shared.compact``: a device implied by its stamp, an
    # audit row's usage as an array, an event's words as indexes), which a build before reads
    # as corrupt rows. No table changes: the version is there so that such a build refuses
    # the file whole ("upgrade pleach"), as for any newer file, instead of failing row by row.
    ("SELECT 1",),
    # 9: the outbox's kind as its index in ``compact.KINDS`` (0 a session; one character,
    # by the column's text affinity) and its created_at as whole milliseconds (an integer
    # on disk): the kind's name and a float were 12-22 bytes of each of the nine rows a
    # turn queues. Dead letters keep their kind the same way. An event's type is written as
    # the digits of its index in ``compact.WORDS`` when it is one of them (``_type_key``:
    # one or two characters for 13-18); rows written before keep their text, which a read
    # by type asks for too (``_type_keys``), so the log is not rewritten.
    (
        f"UPDATE outbox SET kind = {_KIND_CASE}, "
        "created_at = CAST(round(created_at * 1000) AS INTEGER)",
        f"UPDATE dead_letters SET kind = {_KIND_CASE}",
        "DROP INDEX ix_outbox_session",
        "CREATE INDEX ix_outbox_session ON outbox (record_id) WHERE kind = 0",
    ),
    # 10: a message's, checkpoint's or event's body stored without the id and session id
    # its row's columns hold, nor the org and user of the file's tenant (``_shortened``;
    # ``_whole_body`` puts them back as a query reads it), which a build
    # before reads as corrupt rows. The tenant is the first whose record a commit wrote short
    # (``tenant``: one row, never changed once written; a record of another tenant keeps its
    # org and user). Rows written before keep their whole bodies and read as they are.
    (
        """CREATE TABLE tenant (
            one INTEGER PRIMARY KEY CHECK (one = 1),
            packed BLOB NOT NULL)""",
    ),
    # 11: such a body also without its stamp's node when its device is the file's
    # (``compact.short_body``'s ``node``: ``tenant.node``, from the file's client id when a
    # commit first shortens a body with the column NULL; ``b""`` for an id no stamp node of
    # that form fits), and an audit row's without its id, tenant, device, node and session
    # id at once, which a build before reads as corrupt rows. Rows written before keep
    # their node and read as they are.
    ("ALTER TABLE tenant ADD COLUMN node BLOB",),
    # 12: events and checkpoints kept in the order they are read, under their session's
    # number. A session's id is numbered once in the file (``session_keys``); an event and a
    # checkpoint name their session by that number (``session_n``), in a ``WITHOUT ROWID``
    # table keyed by session and place (an event's sequence number, a checkpoint's stamp), so
    # the table is its own index by session. Each was a table by rowid with an index by id
    # and another by session, and the table and both indexes held the session's 16-byte id
    # again for every row. The index by id stays (``UNIQUE``: a lookup, an upsert's target,
    # the outbox's join). An event's ``hlc`` column, '' since schema 4, is gone. An audit
    # row names its session so too, and its device by a number of its own (``client_keys``),
    # in its row and its indexes, where each held the id (a device's as its text when it is
    # no UUID); its table stays by rowid (a ``WITHOUT ROWID`` one keyed by device and place
    # made its index by subject hold that key: larger). Bodies do not change; a read puts
    # the session's id back from its number (``_whole_body``).
    (
        """CREATE TABLE session_keys (
            n INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE)""",
        "INSERT INTO session_keys (id) SELECT session_id FROM events "
        "UNION SELECT session_id FROM checkpoints UNION SELECT session_id FROM audit",
        """CREATE TABLE client_keys (
            n INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE)""",
        "INSERT INTO client_keys (id) SELECT DISTINCT client_id FROM audit ORDER BY client_id",
        """CREATE TABLE events_12 (
            id TEXT NOT NULL UNIQUE,
            session_n INTEGER NOT NULL,
            sequence_number INTEGER NOT NULL,
            type TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (session_n, sequence_number, id)) WITHOUT ROWID""",
        "INSERT INTO events_12 (id, session_n, sequence_number, type, body) "
        "SELECT e.id, k.n, e.sequence_number, e.type, e.body FROM events e "
        "JOIN session_keys k ON k.id = e.session_id ORDER BY k.n, e.sequence_number, e.id",
        "DROP TABLE events",
        "ALTER TABLE events_12 RENAME TO events",
        """CREATE TABLE checkpoints_12 (
            id TEXT NOT NULL UNIQUE,
            session_n INTEGER NOT NULL,
            hlc TEXT NOT NULL,
            parent_id TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (session_n, hlc, id)) WITHOUT ROWID""",
        "INSERT INTO checkpoints_12 (id, session_n, hlc, parent_id, body) "
        "SELECT c.id, k.n, c.hlc, c.parent_id, c.body FROM checkpoints c "
        "JOIN session_keys k ON k.id = c.session_id ORDER BY k.n, c.hlc, c.id",
        "DROP TABLE checkpoints",
        "ALTER TABLE checkpoints_12 RENAME TO checkpoints",
        """CREATE TABLE audit_12 (
            id TEXT PRIMARY KEY NOT NULL,
            client_n INTEGER NOT NULL,
            session_n INTEGER NOT NULL,
            sequence_number INTEGER NOT NULL,
            subject_key TEXT,
            body BLOB NOT NULL)""",
        "INSERT INTO audit_12 (rowid, id, client_n, session_n, sequence_number, subject_key, "
        "body) SELECT a.rowid, a.id, c.n, k.n, a.sequence_number, a.subject_key, a.body "
        "FROM audit a JOIN client_keys c ON c.id = a.client_id "
        "JOIN session_keys k ON k.id = a.session_id ORDER BY a.rowid",
        "DROP TABLE audit",
        "ALTER TABLE audit_12 RENAME TO audit",
        "CREATE INDEX ix_audit_client ON audit (client_n, sequence_number, id)",
        "CREATE INDEX ix_audit_session ON audit (session_n, client_n, sequence_number, id)",
        "CREATE INDEX ix_audit_subject ON audit (subject_key) WHERE subject_key IS NOT NULL",
    ),
    # 13: records in protocol 9's form (``shared.compact``: a long text deflated), which a
    # build before reads as corrupt rows. No table changes: such a build refuses the file
    # whole ("upgrade pleach").
    ("SELECT 1",),
    # 14: an event's body without the prev_hash the row before it in its log holds
    # (``compact.event_apart``; ``_PUT_EVENT`` and ``_mark_canonical`` decide it, every read
    # puts it back: ``_ROW_BEFORE``), which a build before reads as corrupt rows. No table
    # changes: such a build refuses the file whole.
    ("SELECT 1",),
    # 15: checkpoints keyed by their session and id, without their stamp's text (``hlc``,
    # 46 bytes and more, which the key and the id's index each held): a session's are read
    # by their number and put in order of stamp and id as they are decoded (``_in_order``).
    (
        """CREATE TABLE checkpoints_15 (
            id TEXT NOT NULL UNIQUE,
            session_n INTEGER NOT NULL,
            parent_id TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (session_n, id)) WITHOUT ROWID""",
        "INSERT INTO checkpoints_15 (id, session_n, parent_id, body) "
        "SELECT id, session_n, parent_id, body FROM checkpoints ORDER BY session_n, id",
        "DROP TABLE checkpoints",
        "ALTER TABLE checkpoints_15 RENAME TO checkpoints",
    ),
    # 16: messages name their session by its number, as events, checkpoints and audit rows
    # do (16 bytes of each row), and keep no ``hlc`` ('' since schema 4). Each keeps its
    # rowid: a transcript is read as a span of them (``message_span``).
    (
        "INSERT INTO session_keys (id) SELECT DISTINCT session_id FROM messages WHERE true "
        "ON CONFLICT (id) DO NOTHING",
        """CREATE TABLE messages_16 (
            id TEXT PRIMARY KEY NOT NULL,
            session_n INTEGER NOT NULL,
            body BLOB NOT NULL)""",
        "INSERT INTO messages_16 (rowid, id, session_n, body) "
        "SELECT m.rowid, m.id, k.n, m.body FROM messages m "
        "JOIN session_keys k ON k.id = m.session_id ORDER BY m.rowid",
        "DROP TABLE messages",
        "ALTER TABLE messages_16 RENAME TO messages",
    ),
    # 17: a long session's message ids in blocks of 124 (``SQLITE_ID_LAYOUT``: two to a
    # page) where 128 (one to a page, half of it unused). Audit rows indexed by device and
    # place, and by session alone, without the id (and the device and place) each entry
    # held: ``list_audit`` puts them in order (a session's rows, by rowid, are its devices'
    # runs as they were written, which its sort merges). 26 and 22 bytes fewer an entry.
    # An audit row's body leaves out the two digests its content gives (``_audit_apart``;
    # every read puts them back: ``_AUDIT_WHOLE``), which a build before reads as corrupt
    # rows: the version makes it refuse the file whole.
    (
        _rechunk_id_blocks,
        "DROP INDEX ix_audit_client",
        "DROP INDEX ix_audit_session",
        "CREATE INDEX ix_audit_client ON audit (client_n, sequence_number)",
        "CREATE INDEX ix_audit_session ON audit (session_n)",
    ),
    # 18: the outbox a row a commit (``queued``: its entries' kinds and keys in one blob,
    # numbered from the row's key), where it was a row an entry, each with its key, kind,
    # time and counts (about 37 bytes, nine a turn); an entry's failed attempts in its row
    # (``tried``, NULL while none failed). The sessions queued are counted beside it
    # (``outbox_sessions``: whether a session is queued, and whether an entry's version is
    # queued again later). ``sync_state`` keyed by its key alone (``WITHOUT ROWID``: one
    # page fewer in every file).
    (
        _outbox_by_commit,
        """CREATE TABLE sync_state_18 (
            key TEXT PRIMARY KEY NOT NULL,
            value TEXT NOT NULL) WITHOUT ROWID""",
        "INSERT INTO sync_state_18 (key, value) SELECT key, value FROM sync_state",
        "DROP TABLE sync_state",
        "ALTER TABLE sync_state_18 RENAME TO sync_state",
    ),
)
SCHEMA_VERSION: Final = len(_MIGRATIONS)


def _key(record_id: str) -> str | bytes:
    """An id as the columns keep it (schema 5): a canonical (lowercase) UUID as its 16 bytes
    (``compact.uuid_bytes``: the ids a body packs as ext 1), any other id as its text. One to
    one, since a column's BLOB never equals a TEXT: every statement binds ``_key(id)``, or
    converts in SQL with ``pleach_key``. (A value that is no text, which only a malformed
    record holds, is bound as it is: the constraint refuses it.)"""
    if type(record_id) is not str:
        return record_id
    return compact.uuid_bytes(record_id) or record_id


def _sql_key(value: object) -> str | bytes | int | float | None:
    """``pleach_key(x)`` in SQL: ``_key`` of a text, anything else as it is (a converted key,
    NULL)."""
    if type(value) is str:
        return _key(value)
    return value if isinstance(value, bytes | int | float) else None


def _id(key: object) -> str:
    """The id a column's key stands for (``_key`` reversed)."""
    if isinstance(key, bytes) and len(key) == 16:
        return compact.uuid_text(key)
    return str(key)


def _audit_whole(body: object) -> str | bytes | int | float | None:
    """``pleach_audit(body)`` in SQL: a whole audit body that left out its content digests
    (schema 17: ``compact.audit_digests_apart``) with them put back, as its row's content
    gives them (``shared.hashchain``), byte for byte what was written; any other value as
    it is (a body that does not decode is read, and named corrupt, by its reader)."""
    if type(body) is not bytes:
        return body if isinstance(body, str | int | float) else None
    at = compact.audit_digests_left_out(body)
    if at is None:
        return body
    try:
        row = compact.decode(compact.audit_placeholders(body, at))
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
        return body
    if not isinstance(row, AuditRow):
        return body
    payload, identity = map(compact.digest_bytes, audit_digests(row))
    if payload is None or identity is None:
        return body
    return compact.audit_digests_put(body, at, payload, identity)


def _audit_apart(row: AuditRow, body: bytes) -> bytes:
    """``body``, the compact body of ``row``, without its content digests (schema 17:
    ``compact.audit_digests_apart``) where the row holds those its content gives
    (``audit_digests``), so that ``_audit_whole`` puts them back; else ``body``. Decided on
    the record at hand as its row is made: no decode of the bytes just encoded (or of those
    a pull brought). Its row's short form keeps the same tail (``_shortened``)."""
    apart = None if row.redacted else compact.audit_digests_apart(body)
    if apart is None:
        return body
    left, payload, identity = apart
    held = (row.payload_digest, row.identity_digest)
    if (payload.hex(), identity.hex()) != held:  # (bytes that are not this row's: kept)
        return body
    return left if audit_digests(row) == held else body


def sql_functions(raw: sqlite3.Connection) -> None:
    """The SQL functions every connection to a device file reads it with: ``pleach_key``
    (``_sql_key``) and ``pleach_audit`` (``_audit_whole``)."""
    raw.create_function("pleach_key", 1, _sql_key, deterministic=True)
    raw.create_function("pleach_audit", 1, _audit_whole, deterministic=True)


def create_schema(raw: sqlite3.Connection) -> None:
    """The device schema, as ``open()`` migrates a new file to it, on a plain ``sqlite3``
    connection (for a tool or a baseline that writes the rows directly); its functions
    (``sql_functions``) are registered on it."""
    sql_functions(raw)
    for step in _MIGRATIONS:
        for statement in step:
            _run_step(raw, statement)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _keys(ids: Sequence[str]) -> list[str | bytes]:
    """``_key`` of each of ``ids``: a list of canonical UUIDs (a transcript's message ids)
    converted at once (``compact.uuids_bytes``), any other list one by one."""
    joined = compact.uuids_bytes(ids)
    if joined is None:
        return [_key(record_id) for record_id in ids]
    return [joined[at : at + 16] for at in range(0, len(joined), 16)]


_IN_SIZES: Final = (1, 4, 16, 64, 256)
"""How many keys one ``IN`` list binds: a read of more keys runs in lists of the largest, the
last one padded (with a key it holds already) to the next size. A few statement texts, each
prepared once (the connection's statement cache), and far below SQLite's bound variables."""


def _select_in(raw: sqlite3.Connection, sql: str, keys: Sequence[object]) -> list[Any]:
    """The rows of ``sql`` (its ``IN ({keys})`` a list of bound keys) for ``keys``, in lists of
    ``_IN_SIZES``, on the connection's thread: one round trip, no SQL function per key.
    A key asked twice gives its row once, as ``IN`` does."""
    rows: list[Any] = []
    size = _IN_SIZES[-1]
    for at in range(0, len(keys), size):
        chunk = list(keys[at : at + size])
        fit = next(n for n in _IN_SIZES if n >= len(chunk))
        chunk += chunk[-1:] * (fit - len(chunk))
        rows += raw.execute(_in_text(sql, fit), chunk).fetchall()
    return rows


def _in_text(sql: str, fit: int) -> str:
    """``sql`` with its ``{keys}`` a list of ``fit`` marks, made once (``_IN_TEXTS``)."""
    text = _IN_TEXTS.get((sql, fit))
    if text is None:
        text = _IN_TEXTS[sql, fit] = sql.format(keys=_MARKS[fit])
    return text


_MARKS: Final = {n: ", ".join("?" * n) for n in _IN_SIZES}
_IN_TEXTS: dict[tuple[str, int], str] = {}
"""Each ``_select_in`` statement's text for each of ``_IN_SIZES`` (``_in_text``): the texts that
put a body together are kilobytes long, and ``str.format`` read all of it at each call (about
10 µs a statement)."""

SPAN_MIN_KEYS: Final = 256
"""Messages asked for at once from which ``_select_messages`` tries their span of the table."""
SPAN_SLACK: Final = 2
"""The most rows a span may hold for each message asked for (other sessions' rows between)."""


def _select_messages(raw: sqlite3.Connection, keys: Sequence[object]) -> _Transcript:
    """``get_messages``' rows ``(id, body, session_id)`` for ``keys`` (a transcript, in order;
    each body as stored), with rows of other ids among them, which the caller leaves out,
    and the file's tenant (``_tenant_of``, in the same snapshot). A long transcript is
    mostly a run of the table, written turn after turn: its rows between the rowids of its
    first and last message are read as one span (one walk along the table, where each key
    looked up by the id index costs two descents of the B-trees: 6 ms against 10 for 5,000
    messages), and only the keys the span did not hold (a fork's earlier messages, another
    device's pulled later) are looked up. A span of more than ``SPAN_SLACK`` rows a key, or
    a short list, is read by the keys alone, so no read walks far for few rows."""
    if len(keys) >= SPAN_MIN_KEYS:
        low, high = raw.execute(QUERIES["message_span"], (keys[0], keys[-1])).fetchone()
        if low is not None and high is not None and 0 <= high - low < SPAN_SLACK * len(keys):
            rows: list[Any] = raw.execute(QUERIES["message_range"], (low, high)).fetchall()
            held = set(map(_FIRST, rows))
            missing = [key for key in keys if key not in held]
            if missing:
                rows += _select_in(raw, QUERIES["get_messages"], missing)
            return rows, *_tenant_of(raw)
    return _select_in(raw, QUERIES["get_messages"], keys), *_tenant_of(raw)


_S = TypeVar("_S")


def _rows_now(raw: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
    """``sql``'s rows, on ``raw`` (``_read_now``)."""
    rows: list[Any] = raw.execute(sql, params).fetchall()
    return rows


async def _selected(
    conn: aiosqlite.Connection | sqlite3.Connection,
    select: Callable[..., _S],
    *args: Any,
) -> _S:
    """``select(raw, *args)`` (``_select_in``, ``_select_messages``) on the caller's own
    connection (``InPlace``: no hop), or in one hop to the connection's thread."""
    if isinstance(conn, sqlite3.Connection):
        return select(conn, *args)
    rows: _S = await conn._execute(select, conn._conn, *args)  # type: ignore[no-untyped-call]
    return rows


def _select_events(
    raw: sqlite3.Connection,
    session_key: str | bytes,
    start: int,
    limit: int = -1,
    types: str | None = None,
) -> list[tuple[Any, bytes | None]]:
    """A session's events from sequence number ``start`` (``limit`` of them, -1 all; those
    of ``types``, ``_type_keys``, and those that keep no type, when given), in order, as
    ``(id, body)`` with each body whole as it was written: SQL reads the digest of the row
    before a body that left its prev_hash out (schema 14, ``_ROW_BEFORE``), and Python puts
    it together (``compact._whole``, held to ``whole_body_sql``'s bytes by the generated
    tests; SQL's expression costs more than the look-up)."""
    if types is None:
        rows = raw.execute(QUERIES["event_rows"], (session_key, start, limit))
    else:
        rows = raw.execute(QUERIES["event_rows_of_types"], (session_key, start, types))
    tenant, node = _tenant_of(raw)
    packed_session = _packed_key(session_key)
    return [
        (key, body)
        if body[:1] != compact.SHORT
        else (key, compact._whole(body, _packed_key(key), packed_session, tenant, node, prev))
        for key, body, prev in rows.fetchall()
    ]


def _packed_key(key: str | bytes) -> bytes:
    """A row's key as ``compact`` packs the id it holds: a UUID's 16 bytes as ext 1."""
    if isinstance(key, bytes):
        return b"\xd8\x01" + key
    return compact.packed(key)


async def _fetch_in(
    conn: aiosqlite.Connection | sqlite3.Connection, sql: str, keys: Sequence[object]
) -> list[Any]:
    return await _selected(conn, _select_in, sql, keys)


# Immutable kinds: "ON CONFLICT DO NOTHING" rather than "INSERT OR IGNORE", which would also
# silently skip a row that breaks a NOT NULL constraint.
_PUT_SESSION = (
    "INSERT INTO sessions (id, updated_at, deleted, body, ids_count, ids_mark) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at, "
    "deleted = excluded.deleted, body = excluded.body, ids_count = excluded.ids_count, "
    "ids_mark = excluded.ids_mark"
)
_SESSION_IDS_HELD = "SELECT ids_count, ids_mark FROM sessions WHERE id = ?"
_READ_ID_BLOCKS = "SELECT part, ids FROM session_ids WHERE session_id = ?"
_PUT_ID_BLOCK = (
    "INSERT INTO session_ids (session_id, part, ids) VALUES (?, ?, ?) "
    "ON CONFLICT (session_id, part) DO UPDATE SET ids = excluded.ids"
)
_DROP_ID_BLOCKS = "DELETE FROM session_ids WHERE session_id = ? AND part >= ?"
_SESSION_N: Final = "(SELECT n FROM session_keys WHERE id = {})"
"""SQL: the number of the session whose key is ``{}`` (schema 12: events, checkpoints and audit
rows name their session so; ``_NUMBER_SESSION`` gives it one as the first of them is
written)."""
_NUMBER_SESSION = "INSERT INTO session_keys (id) VALUES (?) ON CONFLICT (id) DO NOTHING"
_PUT_MESSAGE = (
    f"INSERT INTO messages (id, session_n, body) VALUES (?1, {_SESSION_N.format('?2')}, ?3) "
    "ON CONFLICT (id) DO NOTHING"
)
_CLIENT_N: Final = "(SELECT n FROM client_keys WHERE id = {})"
"""SQL: the number of the device whose key is ``{}`` (schema 12: an audit row names its device
so; ``_NUMBER_CLIENT`` gives it one as its first audit row is written)."""
_NUMBER_CLIENT = "INSERT INTO client_keys (id) VALUES (?) ON CONFLICT (id) DO NOTHING"
_PUT_CHECKPOINT = (
    "INSERT INTO checkpoints (id, session_n, parent_id, body) "
    f"VALUES (?1, {_SESSION_N.format('?2')}, ?3, ?4) ON CONFLICT (id) DO NOTHING"
)
_ROW_BEFORE: Final = (
    "(SELECT " + compact.chain_digest_sql("p.body") + " FROM events AS p "
    "WHERE p.session_n = {session} AND p.sequence_number = {number} - 1 "
    "AND (substr(p.body, -1) = X'c3' OR NOT {placed}) LIMIT 1)"
)
"""SQL: the ``row_hash`` of the event before the one in session ``{session}`` at ``{number}``
(schema 14), read from the end of its body (``compact.chain_digest_sql``); NULL when no row
is there. ``{placed}``: whether that event is placed (its body ends ``canonical``), and then
the row before is a placed one. One row is at each place of a log at rest. While a rebase
moves the provisional tail, a placed event and a provisional one may share a place as it
writes: a placed event is never moved, and finds the placed row; a provisional one written
then may find the other, whose digest is not its ``prev_hash``, and keeps it. An event whose
row before changes its hash is always written again with it (``syncplan.rebase``), so what
a read finds here is what the write found."""
_ROW_BEFORE_WRITTEN: Final = (
    "COALESCE("
    + _ROW_BEFORE.format(session="{session}", number="{number}", placed="true")
    + ", "
    + _ROW_BEFORE.format(session="{session}", number="{number}", placed="{placed}")
    + ")"
)
"""SQL: ``_ROW_BEFORE`` as an event is written: a placed row there first, where a rebase
moving the tail may leave a provisional one beside it as it writes (one probe more, as
the row is written, so that a provisional event written after a placed one keeps its
``prev_hash`` out too)."""
_PLACED: Final = "substr({}, -1) = X'c3'"
"""SQL: whether the event body in ``{}`` is a placed event's (it ends ``canonical``: true)."""
_PUT_EVENT = (
    "INSERT INTO events (id, session_n, sequence_number, type, body) "
    f"VALUES (?1, {_SESSION_N.format('?2')}, ?3, ?4, CASE WHEN ?6 IS NOT NULL AND "
    + _ROW_BEFORE_WRITTEN.format(
        session=_SESSION_N.format("?2"), number="?3", placed=_PLACED.format("?6")
    )
    + " = ?7 THEN ?6 ELSE ?5 END) "
    "ON CONFLICT (id) DO UPDATE SET session_n = excluded.session_n, "
    "sequence_number = excluded.sequence_number, type = excluded.type, body = excluded.body"
)
"""An event's row. ``?6``: its body without its prev_hash (``compact.event_apart``, ``?7``
that digest), stored where the row before it holds that digest as it is stored now
(this batch's events go in in chain order), else NULL and ``?5``, its short body, is."""
_PUT_AUDIT = (
    "INSERT INTO audit (id, client_n, session_n, sequence_number, subject_key, body) "
    f"VALUES (?1, {_CLIENT_N.format('?2')}, {_SESSION_N.format('?3')}, ?4, ?5, ?6) "
    "ON CONFLICT (id) DO NOTHING"
)
_SESSION_AT: Final = {_PUT_MESSAGE: 1, _PUT_CHECKPOINT: 1, _PUT_EVENT: 1, _PUT_AUDIT: 2}
"""The inserts whose bodies are written short (``_shortened``: each row begins with its key and
ends with its body), and whose rows name their session by its number (``_NUMBER_SESSION``
first; messages since schema 16): where their session's key is in the row (audit rows: their
device's at 1, ``_NUMBER_CLIENT``)."""
_PUT_ARTIFACT = (
    "INSERT INTO artifact_updates (id, artifact_id, session_id, hlc, body) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING"
)
_PURGED_CHECKPOINTS = f"SELECT id FROM checkpoints WHERE session_n = {_SESSION_N.format('?1')}"
"""The checkpoints a purge of session ?1's checkpoints removes (their queued entries go as
references to the session's row: ``_queued_as_session``)."""
_PURGE_CHECKPOINTS = (f"DELETE FROM checkpoints WHERE session_n = {_SESSION_N.format('?1')}",)
_PUT_META = (
    "INSERT INTO sync_state (key, value) VALUES (?, ?) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
_LAST_SEQ = "SELECT seq FROM sqlite_sequence WHERE name = 'outbox'"
_OUTBOX_TABLES_18: Final = (
    # AUTOINCREMENT: sqlite_sequence remembers the largest client_seq ever handed out (the
    # last entry of the last row, ``_put_queued``), so a number is never handed out twice.
    """CREATE TABLE outbox (
        client_seq INTEGER PRIMARY KEY AUTOINCREMENT,
        refs BLOB NOT NULL,
        live INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        tried BLOB)""",
    """CREATE TABLE outbox_sessions (
        session_id TEXT PRIMARY KEY NOT NULL,
        entries INTEGER NOT NULL,
        last_ref INTEGER) WITHOUT ROWID""",
)
"""Schema 18's outbox (``queued``): a row a commit; a row a session queued (``sessions_of``:
its entries queued, and the last number under which it is queued by reference, which makes
every entry of it before that one ``again_later``)."""
_ENQUEUE = "INSERT INTO outbox (client_seq, refs, live, created_at) VALUES (?, ?, ?, ?)"
_QUEUE_SESSION = (
    "INSERT INTO outbox_sessions (session_id, entries, last_ref) VALUES (?1, ?2, ?3) "
    "ON CONFLICT (session_id) DO UPDATE SET entries = entries + ?2, last_ref = CASE "
    "WHEN ?3 IS NULL THEN last_ref WHEN last_ref IS NULL THEN ?3 ELSE max(last_ref, ?3) END"
)
"""A session's entries queued (``queued.sessions_of``'s count and last number), added to
those it has."""
_SEQUENCE_AT = "UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'outbox'"
_REDACT_AUDIT = "UPDATE audit SET subject_key = NULL, body = ? WHERE id = ?"
_LAST_SEQUENCE: Final = 2**63 - 1
"""Above every sequence number: ``event_head`` and ``hydration_key`` of the whole log."""
_KEEP_HYDRATION = (
    "INSERT INTO hydrations (session_id, events, sequence_number, row_hash, version, body) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET events = excluded.events, "
    "sequence_number = excluded.sequence_number, row_hash = excluded.row_hash, "
    "version = excluded.version, body = excluded.body"
)


_short: Final = compact.short_body
"""A body of a message, checkpoint or event as its row stores it (schema 10): without the id
and session id the row's ``id`` and ``session_id`` columns hold (35 bytes fewer in 7 of the 8
rows a turn writes, when the ids are UUIDs), nor the file's tenant, nor (schema 11) the stamp's
node when the record is the file's device's, in the transaction that writes it
(``_shortened``); an audit row's (schema 11) without all of those at once or none.
``_whole_body`` gives it back whole as a query reads the row, so every reader, the flush
included, gets the bytes the record was written in."""
_SHORT_TABLES: Final = ("messages", "checkpoints", "events", "audit")
_FILE_TENANT = "SELECT packed, node FROM tenant WHERE one = 1"


def _whole_body(table: str = "", *, numbered: bool = False, chained: bool = False) -> str:
    """SQL: a stored body of messages, checkpoints, events or audit rows (``table``: its alias,
    if any) as the record was written (``compact.whole_body_sql`` over the row's columns).
    ``numbered``: a row of events, checkpoints or audit rows, which names its session by
    number (schema 12), its id read back from ``session_keys``. ``chained``: a row of events
    (``table`` then its alias, or ``events``), whose body may leave out the prev_hash the
    row before it holds (schema 14: ``_ROW_BEFORE``, read for such a body alone)."""
    at = f"{table}." if table else ""
    tenant = "(SELECT packed FROM tenant WHERE one = 1)"  # (one row: read once a statement)
    node = "(SELECT node FROM tenant WHERE one = 1)"
    session = _SESSION_OF.format(f"{at}session_n") if numbered else f"{at}session_id"
    prev = "NULL"
    if chained:
        row = table or "events"
        prev = _ROW_BEFORE.format(
            session=f"{row}.session_n",
            number=f"{row}.sequence_number",
            placed=_PLACED.format(f"{row}.body"),
        )
    return compact.whole_body_sql(f"{at}body", f"{at}id", session, tenant, node, prev)


def _whole_row(table: str, alias: str = "") -> str:
    """``_whole_body`` of a row of ``table`` (under ``alias``, if any), as its table keeps it
    (an audit row's digests put back: ``_AUDIT_WHOLE``)."""
    whole = _whole_body(alias, numbered=table in _NUMBERED, chained=table == "events")
    return _AUDIT_WHOLE.format(whole) if table == "audit" else whole


_AUDIT_WHOLE: Final = "pleach_audit({})"
"""SQL: the whole audit body in ``{}`` with its content digests where it left them out
(schema 17: ``_audit_whole``, a function of each connection, ``sql_functions``)."""


_SESSION_OF: Final = "(SELECT id FROM session_keys WHERE n = {})"
"""SQL: the key of the session numbered ``{}`` (``_SESSION_N`` reversed)."""
_WHOLE: Final = _whole_body()
"""SQL: a row's body as its record was written (``_whole_body``)."""
_WHOLE_N: Final = _whole_body(numbered=True)
"""SQL: ``_WHOLE`` of a row of checkpoints (``_NUMBERED``)."""
_WHOLE_E: Final = _whole_body(numbered=True, chained=True)
"""SQL: ``_WHOLE`` of a row of events (``_NUMBERED``, and ``chained``)."""
_NUMBERED: Final = ("messages", "checkpoints", "events", "audit")
"""The tables whose rows name their session by number (schema 12; messages, 16)."""
_WHOLE_A: Final = _whole_row("audit")
"""SQL: ``_WHOLE`` of a row of audit rows (``_NUMBERED``, and its digests: ``_AUDIT_WHOLE``)."""
_PREV_WHERE_LEFT_OUT: Final = (
    "CASE WHEN substr(body, 2, 1) IN (X'10', X'11') THEN "
    + _ROW_BEFORE.format(
        session="events.session_n", number="events.sequence_number", placed=_PLACED.format("body")
    )
    + " END"
)
"""SQL: ``_ROW_BEFORE`` of a row of ``events`` whose body left its prev_hash out (forms 16
and 17, ``compact.prev_apart``), else NULL."""
_MESSAGE_SESSION: Final = _SESSION_OF.format("session_n")
"""SQL: a message row's session key (schema 16)."""

# Every read, named so the tests can check each one's query plan uses an index.
# A session row with its id blocks (schema 7), one row a block, in one statement (one read
# of the file: a row and its blocks always agree); ``_sessions_of`` joins them.
_SESSION_ROWS = (
    "SELECT s.id, s.body, s.ids_count, b.part, b.ids FROM sessions s "
    "LEFT JOIN session_ids b ON s.ids_count IS NOT NULL AND b.session_id = s.id"
)

QUERIES: Final[dict[str, str]] = {
    "get_session": f"{_SESSION_ROWS} WHERE s.id = ?",
    "list_sessions": (f"{_SESSION_ROWS} WHERE s.deleted = 0 ORDER BY s.updated_at DESC, s.id DESC"),
    "list_sessions_all": f"{_SESSION_ROWS} ORDER BY s.updated_at DESC, s.id DESC",
    # {keys}: a list of bound keys (``_select_in``: any number of ids in one round trip).
    # (A transcript's bodies as stored, beside their session's key: ``_messages_in_order``
    # reads a short one as it is, ``compact.decode_short``.)
    "get_messages": f"SELECT id, body, {_MESSAGE_SESSION} FROM messages WHERE id IN ({{keys}})",
    "audit_rows": "SELECT id, " + _WHOLE_A + " FROM audit WHERE id IN ({keys})",
    "get_checkpoint": "SELECT id, " + _WHOLE_N + " FROM checkpoints WHERE id = ?",
    "held_messages": "SELECT id FROM messages WHERE id IN ({keys})",
    # A long transcript's rows as one span of the table (``_select_messages``): the rowids
    # of its first and last message, then the rows between them.
    "message_span": (
        "SELECT (SELECT rowid FROM messages WHERE id = ?1), "
        "(SELECT rowid FROM messages WHERE id = ?2)"
    ),
    "message_range": (
        f"SELECT id, body, {_MESSAGE_SESSION} FROM messages WHERE rowid BETWEEN ?1 AND ?2"
    ),
    # (In order of id; ``_in_order`` puts them in order of stamp and id: schema 15.)
    "list_checkpoints": (
        "SELECT id, " + _WHOLE_N + f" FROM checkpoints WHERE session_n = {_SESSION_N.format('?1')}"
    ),
    # A row written before schema 4 has no parent_id (NULL): it is read, and its body tells.
    "child_checkpoints": (
        "SELECT id, " + _WHOLE_N + " FROM checkpoints "
        f"WHERE session_n = {_SESSION_N.format('?1')} "
        "AND (parent_id = ?2 OR parent_id IS NULL)"
    ),
    "get_event": "SELECT id, " + _WHOLE_E + " FROM events WHERE id = ?",
    # ?2: the last sequence number looked at (``_LAST_SEQUENCE``: the whole log).
    "event_head": (
        "SELECT id, " + _WHOLE_E + " FROM events "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND sequence_number <= ?2 "
        "ORDER BY sequence_number DESC, id DESC LIMIT 1"
    ),
    # The log's size up to ?2 beside its last event there, in one statement.
    "hydration_key": (
        "SELECT (SELECT count(*) FROM events "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND sequence_number <= ?2), "
        "id, " + _WHOLE_E + " FROM events "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND sequence_number <= ?2 "
        "ORDER BY sequence_number DESC, id DESC LIMIT 1"
    ),
    "kept_hydration": (
        "SELECT events, sequence_number, row_hash, version, body FROM hydrations "
        "WHERE session_id = ?"
    ),
    # A session's events from ?2 as they are stored, each beside the digest of the row before
    # it where its body left that out (``_select_events`` puts them together); LIMIT -1: all
    # of them. Of some types (?3: a JSON array, ``_type_keys``; a row without its type,
    # written before schema 3, is read): ``event_rows_of_types``.
    "event_rows": (
        f"SELECT id, body, {_PREV_WHERE_LEFT_OUT} FROM events "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND sequence_number >= ?2 "
        "ORDER BY sequence_number, id LIMIT ?3"
    ),
    "event_rows_of_types": (
        f"SELECT id, body, {_PREV_WHERE_LEFT_OUT} FROM events "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND sequence_number >= ?2 "
        "AND (type IS NULL OR type IN (SELECT value FROM json_each(?3))) "
        "ORDER BY sequence_number, id"
    ),
    # (Each as its index keeps the rows, a run of each device's in order: ``list_audit``
    # puts them in order of device, place and id's text. A session's, schema 17: by rowid.)
    "list_audit": ("SELECT id, " + _WHOLE_A + " FROM audit ORDER BY client_n, sequence_number"),
    "list_audit_session": (
        "SELECT id, " + _WHOLE_A + f" FROM audit WHERE session_n = {_SESSION_N.format('?1')}"
    ),
    "list_audit_client": (
        "SELECT id, " + _WHOLE_A + " FROM audit "
        f"WHERE client_n = {_CLIENT_N.format('?1')} ORDER BY sequence_number"
    ),
    "list_audit_both": (
        "SELECT id, " + _WHOLE_A + " FROM audit "
        f"WHERE session_n = {_SESSION_N.format('?1')} AND client_n = {_CLIENT_N.format('?2')}"
    ),
    "audit_subject": "SELECT id, " + _WHOLE_A + " FROM audit WHERE subject_key = ?",
    "list_artifact_updates": (
        "SELECT id, body FROM artifact_updates WHERE artifact_id = ? ORDER BY hlc, id"
    ),
    "get_meta": "SELECT value FROM sync_state WHERE key = ?",
    # The outbox rows that may hold entries after ?1: from the one holding ?1 on (schema 18:
    # a row a commit, keyed by its first number; ``_queued_after``).
    "outbox_rows": (
        "SELECT client_seq, refs, created_at, tried FROM outbox WHERE client_seq >= "
        "coalesce((SELECT max(client_seq) FROM outbox WHERE client_seq <= ?1), ?1) "
        "ORDER BY client_seq"
    ),
    # The outbox rows that may hold numbers ?1 to ?2 (``_delete_queued``).
    "outbox_rows_between": (
        "SELECT client_seq, refs, tried FROM outbox WHERE client_seq BETWEEN "
        "coalesce((SELECT max(client_seq) FROM outbox WHERE client_seq <= ?1), ?1) AND ?2 "
        "ORDER BY client_seq"
    ),
    # The records an outbox read refers to, by kind, each as (its kind, its key, its body
    # whole, and two values more): a session's with its ids count (its blocks:
    # ``outbox_id_blocks``) and the last number under which it is queued by reference
    # (``again_later``). One statement of them all (``_queued_records``).
    "queued_sessions": (
        f"SELECT {_SESSION_KIND}, id, body, ids_count, (SELECT l.last_ref "
        "FROM outbox_sessions l WHERE l.session_id = sessions.id) "
        "FROM sessions WHERE id IN ({keys})"
    ),
    "queued_messages": (
        f"SELECT {_KIND_CODE['Message']}, id, {_WHOLE_N}, NULL, NULL FROM messages "
        "WHERE id IN ({keys})"
    ),
    "queued_checkpoints": (
        f"SELECT {_KIND_CODE['Checkpoint']}, id, {_WHOLE_N}, NULL, NULL FROM checkpoints "
        "WHERE id IN ({keys})"
    ),
    "queued_events": (
        f"SELECT {_KIND_CODE['Event']}, id, {_WHOLE_E}, NULL, NULL FROM events "
        "WHERE id IN ({keys})"
    ),
    "queued_audit": (
        f"SELECT {_KIND_CODE['AuditRow']}, id, {_WHOLE_A}, NULL, NULL FROM audit "
        "WHERE id IN ({keys})"
    ),
    "queued_artifacts": (
        f"SELECT {_KIND_CODE['ArtifactUpdate']}, id, body, NULL, NULL FROM artifact_updates "
        "WHERE id IN ({keys})"
    ),
    # The id blocks of the long sessions an outbox read holds, each session's once, however
    # many of its numbers the read holds (``_outbox_read``).
    "outbox_id_blocks": (
        "SELECT session_id, part, ids FROM session_ids WHERE session_id IN ({keys})"
    ),
    "outbox_count": "SELECT coalesce(sum(live), 0) FROM outbox",
    "session_queued": "SELECT 1 FROM outbox_sessions WHERE session_id = ?",
    "outbox_sessions_of": (
        "SELECT session_id, entries, last_ref FROM outbox_sessions WHERE session_id IN ({keys})"
    ),
    "dead_letters": (
        "SELECT client_seq, body, code, message, attempts, failed_at "
        "FROM dead_letters ORDER BY client_seq"
    ),
    "dead_letter_count": "SELECT count(*) FROM dead_letters",
}

_QUEUED_BODIES: Final = {
    _KIND_CODE["Session"]: QUERIES["queued_sessions"],
    _KIND_CODE["Message"]: QUERIES["queued_messages"],
    _KIND_CODE["Checkpoint"]: QUERIES["queued_checkpoints"],
    _KIND_CODE["Event"]: QUERIES["queued_events"],
    _KIND_CODE["AuditRow"]: QUERIES["queued_audit"],
    _KIND_CODE["ArtifactUpdate"]: QUERIES["queued_artifacts"],
}
"""The read of the records an outbox read refers to, by kind (``_queued_records``)."""
_UNION_TEXTS: dict[tuple[tuple[str, int], ...], str] = {}
"""``_queued_records``' statements, by their parts (a query and its ``IN`` list's size),
each text made once."""

_T = TypeVar("_T")


class _Body(Generic[_T]):
    """Reads a stored body (``shared.compact``, or the map form older versions wrote) as a
    record of one kind."""

    def __init__(self, cls: type[_T] | None = None) -> None:
        self.cls = cls

    def decode(self, body: bytes, read: Callable[[bytes], Record] = compact.decode) -> _T:
        """The record in ``body`` read by ``read`` (a whole body's ``compact.decode``, or a
        row's ``compact.decode_short`` with its ids), refused when it is of another kind."""
        record = read(body)
        if self.cls is not None and not isinstance(record, self.cls):
            raise TypeError(f"holds a {type(record).__name__}, not a {self.cls.__name__}")
        return record  # type: ignore[return-value]


_AUDIT_ORDER: Final = operator.attrgetter("client_id", "sequence_number", "id")
"""``list_audit``'s order (the memory store's)."""
_SESSION: _Body[Session] = _Body(Session)
_MESSAGE: _Body[Message] = _Body(Message)
_CHECKPOINT: _Body[Checkpoint] = _Body(Checkpoint)
_EVENT: _Body[Event] = _Body(Event)
_AUDIT: _Body[AuditRow] = _Body(AuditRow)
_ARTIFACT: _Body[ArtifactUpdate] = _Body(ArtifactUpdate)
_RECORD: _Body[Record] = _Body()

# Errors that can come out of the sqlite3 module: OverflowError when binding an int that
# does not fit in 64 bits.
_DB_ERRORS = (sqlite3.Error, OverflowError)
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6
_SYNCHRONOUS_NAMES = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


class _State(Enum):
    CLOSED = "closed"
    OPENING = "opening"
    OPEN = "open"


def _storage_error(action: str, exc: BaseException) -> StorageError:
    """Translate a sqlite3 error; "database is locked" / busy is worth retrying."""
    text = str(exc)
    code = getattr(exc, "sqlite_errorcode", None)
    busy = (isinstance(code, int) and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)) or (
        "locked" in text or "busy" in text
    )
    return StorageError(f"{action} failed: {text}", retryable=busy)


def _decode(
    decoder: _Body[_T],
    table: str,
    key: object,
    body: object,
    read: Callable[[bytes], Record] = compact.decode,
) -> _T:
    try:
        if not isinstance(body, bytes):
            raise TypeError(f"body is {type(body).__name__}, not bytes")
        return decoder.decode(body, read)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        shown = _id(key) if isinstance(key, bytes) else key
        raise StorageError(f"corrupt row in {table} (id {shown!r}): {exc}") from exc


def _decode_all(decoder: _Body[_T], table: str, rows: Sequence[Any]) -> list[_T]:
    """``_decode`` of each ``(key, body)`` of ``rows``, in order: one loop over
    ``compact.decode`` (two calls fewer a row: about a tenth of reading a long transcript),
    then each row alone, which names the corrupt one, only when that loop met one."""
    decode, cls = compact.decode, decoder.cls
    try:
        records = [decode(body) for _, body in rows]
        if cls is None or all(type(record) is cls for record in records):
            return records  # type: ignore[return-value]
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        pass
    return [_decode(decoder, table, key, body) for key, body in rows]


_ABSENT: Final = object()
_LEARNED_PART: Final = 2048
"""Messages decoded a part at a time, their ids told to the decode cache first
(``compact.learn_uuids``): well inside the cache's bound, however long the transcript."""


_Transcript = tuple[list[Any], bytes, bytes]
"""A transcript's rows ``(id, body, session_id)`` as stored, and the file's tenant and stamp
node (``_tenant_of``)."""


def _messages_in_order(
    keys: Sequence[str | bytes], ids: Sequence[str], selected: _Transcript
) -> list[Message]:
    """The message rows read for ``keys`` (the keys of ``ids``; ``_select_messages``), decoded in
    the order of ``keys`` (an unknown key skipped; a key asked twice decoded twice: each
    place its own copy). A key of bytes is a canonical UUID's (``_key``) and its id is that
    UUID's text, so each part's ids are told to the decode cache before its bodies are
    decoded. A body stored short is read as it is, given the row's ids and the file's
    tenant (``compact.decode_short``, as quick as decoding the whole body): nothing is put
    together, which costs about 0.9 µs a row in SQL (``_whole_body``). The common case
    (every key held, every id a UUID) runs in C loops: a pass in Python per message cost
    about 0.3 µs of the 3-4 µs a message takes."""
    rows, tenant, node = selected
    held_rows: dict[str | bytes, Any] = dict(zip(map(_FIRST, rows), rows))  # noqa: B905
    picked = list(map(held_rows.get, keys, itertools.repeat(_ABSENT, len(keys))))
    if _ABSENT in picked:  # unknown keys are left out (a held row is read whatever its body,
        # so a corrupt one is named by ``_decode_messages``)
        held = [at for at, row in enumerate(picked) if row is not _ABSENT]
        keys, ids = [keys[at] for at in held], [ids[at] for at in held]
        picked = [picked[at] for at in held]
    uuid_keys = set(map(type, keys)) == {bytes}
    org_user = compact.tenant_texts(tenant) if tenant else None
    messages: list[Message] = []
    for at in range(0, len(picked), _LEARNED_PART):
        part = slice(at, at + _LEARNED_PART)
        pairs = cast(list[tuple[bytes, str]], list(zip(keys[part], ids[part], strict=True)))
        compact.learn_uuids(pairs if uuid_keys else [p for p in pairs if type(p[0]) is bytes])
        messages += _decode_messages(picked[part], ids[part], org_user, node)
    return messages


def _decode_messages(
    rows: Sequence[Any], ids: Sequence[str], tenant: tuple[str, str] | None, node: bytes
) -> list[Message]:
    """Each message row ``(key, body, session_id)`` of ``rows`` decoded, its id ``ids``' text
    at its place (``compact.decode_short``): one loop in C, then each row alone, which names
    the corrupt one, only when that loop met one (as ``_decode_all``)."""
    sessions = {key: _id(key) for key in set(map(_THIRD, rows))}
    texts = list(map(sessions.__getitem__, map(_THIRD, rows)))
    decode = compact.decode_short
    try:
        bodies = list(map(_SECOND, rows))
        many = itertools.repeat
        records = list(map(decode, bodies, ids, texts, many(tenant, len(rows)), many(node)))
        if all(type(record) is Message for record in records):
            return records  # type: ignore[return-value]
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        pass
    return [
        _decode(
            _MESSAGE,
            "messages",
            key,
            body,
            partial(decode, record_id=i, session_id=t, tenant=tenant, node=node),
        )
        for (key, body, _), i, t in zip(rows, ids, texts, strict=True)
    ]


# -- a session's id blocks (schema 7) --------------------------------------------------------


_ID_BLOCKS_BUDGET: Final = 8 << 20
"""Bytes of ``_id_blocks`` at most; past it, the cache is emptied."""
_id_blocks: dict[tuple[object, int], bytes] = {}
"""(session key, ``ids_mark``) -> the ids its blocks held when that mark was written, for the
blocks written by this process. A mark is drawn at random at each write of a session's blocks,
in the transaction that writes them, so the stored mark equal to an entry's means the stored
blocks are its bytes, whichever connection or process reads it (another's write, a rollback,
a file copied or restored: another mark, or the same blocks). Keyed by the mark too, so that
two stores of one process holding the same session (two devices of a test or a benchmark, an
app's second file) keep an entry each: keyed by the session alone, each write took the other's
entry out, and every turn of a long session read its blocks back from the file. A write takes
out the entry of the mark it replaces. Dict reads and writes are atomic under the GIL."""
_id_blocks_held = 0


def _new_mark() -> int:
    return int.from_bytes(os.urandom(8), "big") >> 1  # (a positive 63-bit SQLite integer)


def _remember_blocks(
    key: object, replaced: int | None, mark: int | None, data: bytes | None
) -> None:
    """The blocks just written under ``mark`` (None: none), in place of ``replaced``'s."""
    global _id_blocks_held
    known = _id_blocks.pop((key, replaced), None) if replaced is not None else None
    if known is not None:
        _id_blocks_held -= len(known)
    if mark is None or data is None:
        return
    if _id_blocks_held + len(data) > _ID_BLOCKS_BUDGET:
        _id_blocks.clear()
        _id_blocks_held = 0
    _id_blocks[(key, mark)] = data
    _id_blocks_held += len(data)


def _stored_blocks(raw: sqlite3.Connection, key: object, count: int, mark: int) -> bytes | None:
    """The ids a session's blocks hold (``count`` ids, under ``mark``), from the cache or the
    file; None when the blocks do not hold ``count`` ids in order (then all are rewritten)."""
    known = _id_blocks.get((key, mark))
    if known is not None:
        return known
    found = sorted(raw.execute(_READ_ID_BLOCKS, (key,)).fetchall())
    if [part for part, _ in found] != list(range(len(found))):
        return None
    data = b"".join(ids if isinstance(ids, bytes) else b"" for _, ids in found)
    return data if len(data) == 16 * count else None


def _put_sessions(raw: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    """Session rows ``(key, updated_at, deleted, ids, block, body)`` (``_encode_batch``):
    ``ids`` the 16-byte ids of a long session's message ids, written to its blocks of
    ``block`` ids (only the blocks that differ from the stored ones), or None (they are in
    the body: any blocks are dropped)."""
    for key, updated_at, deleted, data, block, body in rows:
        size = 16 * block
        held = raw.execute(_SESSION_IDS_HELD, (key,)).fetchone()
        held_count, held_mark = held if held is not None else (None, None)
        mark: int | None = None
        if data is not None:
            mark = _new_mark()
            stored = (
                b""
                if held_count is None
                else _stored_blocks(raw, key, int(held_count), int(held_mark or 0))
            )
            old_parts = -(-len(stored) // size) if stored is not None else 0
            if stored is None:
                raw.execute(_DROP_ID_BLOCKS, (key, 0))
                stored = b""
            changed = id_blocks(data, stored, block)
            raw.executemany(_PUT_ID_BLOCK, [(key, part, ids) for part, ids in changed])
            parts = -(-len(data) // size)
            if parts < old_parts:
                raw.execute(_DROP_ID_BLOCKS, (key, parts))
        elif held_count is not None:
            raw.execute(_DROP_ID_BLOCKS, (key, 0))
        count = None if data is None else len(data) // 16
        raw.execute(_PUT_SESSION, (key, updated_at, deleted, body, count, mark))
        _remember_blocks(key, None if held_mark is None else int(held_mark), mark, data)


def _without_ids(session: Session) -> Session:
    state = msgspec.structs.replace(session.state, message_ids=[])
    return msgspec.structs.replace(session, state=state)


def _with_ids(session: Session, key: object, count: int, blocks: list[tuple[int, Any]]) -> Session:
    """``session`` (its row's body) with the message ids of its ``blocks`` ``(part, ids)``;
    ``StorageError`` (a corrupt row) when they do not hold ``count`` ids in order, or the body
    holds ids too."""
    blocks.sort(key=lambda block: block[0])
    data = b"".join(ids if isinstance(ids, bytes) else b"" for _, ids in blocks)
    problem = None
    if [part for part, _ in blocks] != list(range(len(blocks))) or len(data) != 16 * count:
        problem = f"its id blocks hold {len(data) // 16} ids, not {count}"
    elif session.state.message_ids:
        problem = "its body holds message ids beside its id blocks"
    if problem is not None:
        raise StorageError(f"corrupt row in sessions (id {_id(key)!r}): {problem}")
    try:
        session.state.message_ids = compact.id_list_texts(data)
    except msgspec.DecodeError as exc:  # (a length checked above: not reached)
        raise StorageError(f"corrupt row in sessions (id {_id(key)!r}): {exc}") from exc
    return session


def _sessions_of(rows: Sequence[Any]) -> list[Session]:
    """The sessions of ``_SESSION_ROWS``'s rows ``(key, body, ids_count, part, ids)``, in
    their order: a session's rows come together (one row a block)."""
    out: list[Session] = []
    for key, group in itertools.groupby(rows, _FIRST):
        session_rows = list(group)
        _, body, count, *_ = session_rows[0]
        session = _decode(_SESSION, "sessions", key, body)
        if count is not None:
            blocks = [(part, ids) for *_, part, ids in session_rows if part is not None]
            session = _with_ids(session, key, int(count), blocks)
        out.append(session)
    return out


_FIRST: Final = operator.itemgetter(0)
_SECOND: Final = operator.itemgetter(1)
_THIRD: Final = operator.itemgetter(2)


def _outbox_read(raw: sqlite3.Connection, after: int, limit: int) -> tuple[list[Any], list[Any]]:
    """The queued entries after ``after`` (``limit`` of them, -1 for all), in client_seq
    order, as rows ``(client_seq, body, attempts, created_at, code, message, again_later,
    ids_count, session_key)`` with each record's body whole (a long session's without its
    ids: ``ids_count`` says how many its blocks hold), and the id blocks of the long sessions
    among them (``outbox_id_blocks``), each session's once, in one snapshot: in a read
    transaction of its own when the connection is in none, so that an entry, its record and
    a session's count and blocks agree. The records are read in one statement
    (``_queued_records``); an entry whose record is not there has no body (its decode names
    it corrupt)."""
    own = not raw.in_transaction
    if own:
        raw.execute("BEGIN")
    try:
        entries = _queued_after(raw, after, limit)
        keys: dict[int, dict[object, None]] = {}
        for _, entry, _, _ in entries:
            if entry.body is None:
                keys.setdefault(entry.kind, {})[entry.key] = None
        found = _queued_records(raw, {kind: list(held) for kind, held in keys.items()})
        rows: list[Any] = []
        for seq, entry, created_at, (attempts, code, message) in entries:
            if entry.body is not None:
                rows.append((seq, entry.body, attempts, created_at, code, message, 0, None, None))
                continue
            record = found.get((entry.kind, entry.key))
            body = None if record is None else record[0]
            count = key = None
            later = 0
            if entry.kind == _SESSION_KIND and record is not None:
                later = int(record[2] is not None and seq < record[2])
                if record[1] is not None:
                    count, key = record[1], entry.key
            rows.append((seq, body, attempts, created_at, code, message, later, count, key))
        held = list(dict.fromkeys(row[8] for row in rows if row[7] is not None))
        blocks = _select_in(raw, QUERIES["outbox_id_blocks"], held) if held else []
    finally:
        if own and raw.in_transaction:
            raw.execute("COMMIT")  # (a read: nothing written)
    return rows, blocks


_UNTRIED: Final = (0, None, None)
"""An entry's attempts, last error code and message while none failed (``queued.Tried``)."""


def _queued_records(
    raw: sqlite3.Connection, keys: dict[int, list[object]]
) -> dict[tuple[int, object], tuple[Any, ...]]:
    """The records of ``keys`` (their keys by kind), each ``(body, a, b)`` under its kind
    and key (``_QUEUED_BODIES``: a session's ids count and last number queued by reference,
    else NULLs). In one statement (``UNION ALL``) when no kind has more keys than one ``IN``
    list binds (a turn's nine in one: a statement a kind cost about 5 µs each), else a
    statement a list."""
    rows: list[Any] = []
    if not keys:
        return {}
    if all(len(wanted) <= _IN_SIZES[-1] for wanted in keys.values()):
        parts: list[tuple[str, int]] = []
        params: list[object] = []
        for kind, wanted in keys.items():
            sql = _QUEUED_BODIES.get(kind)
            if sql is not None and wanted:
                fit = next(n for n in _IN_SIZES if n >= len(wanted))
                parts.append((sql, fit))
                params += wanted + wanted[-1:] * (fit - len(wanted))
        shape = tuple(parts)
        text = _UNION_TEXTS.get(shape)
        if text is None:
            text = _UNION_TEXTS[shape] = " UNION ALL ".join(
                _in_text(sql, fit) for sql, fit in parts
            )
        rows = raw.execute(text, params).fetchall() if parts else []
    else:
        rows = [
            row
            for kind, wanted in keys.items()
            if (sql := _QUEUED_BODIES.get(kind)) is not None
            for row in _select_in(raw, sql, wanted)
        ]
    return {(tag, key): (body, a, b) for tag, key, body, a, b in rows}


def _queued_after(
    raw: sqlite3.Connection, after: int, limit: int
) -> list[tuple[int, queued.Queued, int, queued.Tried]]:
    """The queued entries after ``after`` (``limit`` of them, -1 for all), in order: each its
    number, itself, its row's ``created_at`` and its failed attempts. Reads rows until it
    has enough."""
    out: list[tuple[int, queued.Queued, int, queued.Tried]] = []
    cursor = raw.execute(QUERIES["outbox_rows"], (after,))
    try:
        while limit < 0 or len(out) < limit:
            rows = cursor.fetchmany(16)
            if not rows:
                break
            for first, refs, created_at, tried in rows:
                tries = _tries(first, tried)
                for at, entry in enumerate(_unpacked(first, refs)):
                    if entry is not None and first + at > after:
                        out.append((first + at, entry, created_at, tries.get(at, _UNTRIED)))
    finally:
        cursor.close()
    return out if limit < 0 else out[:limit]


def _tries(first: int, tried: object) -> dict[int, queued.Tried]:
    """``queued.tries_of`` of the outbox row numbered ``first``; ``StorageError`` naming it
    when its bytes are not a ``tried``."""
    try:
        return queued.tries_of(tried)  # type: ignore[arg-type]  # (checked there)
    except ValueError as exc:
        raise StorageError(f"corrupt row in outbox (id {first}): {exc}") from exc


def _unpacked(first: int, refs: object) -> list[queued.Entry]:
    """``queued.unpack`` of the outbox row numbered ``first``; ``StorageError`` naming it
    when its bytes are not an outbox row's."""
    try:
        return queued.unpack(refs)  # type: ignore[arg-type]  # (checked there)
    except ValueError as exc:
        raise StorageError(f"corrupt row in outbox (id {first}): {exc}") from exc


def _entries_of(
    rows: Sequence[Any], blocks: Sequence[Any]
) -> tuple[list[tuple[Any, ...]], dict[bytes, Record]]:
    """``_outbox_read``'s rows (in client_seq order) and blocks as ``outbox_entries`` takes
    them: a long session's row, with its blocks, as the whole body it stands for (what a push
    sends); and each such body with the session it was made from, so that it is not decoded
    again (``outbox_entries``' ``known``)."""
    out: list[tuple[Any, ...]] = []
    # (key, count) -> (whole body, session): a session queued at each turn is made once.
    whole: dict[tuple[object, int], tuple[bytes, Session]] = {}
    held: dict[object, list[tuple[int, Any]]] = {}
    for key, part, ids in blocks:
        held.setdefault(key, []).append((part, ids))
    for row in rows:
        count, key, body = row[7], row[8], row[1]
        if count is not None and isinstance(body, bytes):
            made = whole.get((key, int(count)))
            if made is None:
                session = _decode(_SESSION, "sessions", key, body)
                session = _with_ids(session, key, int(count), list(held.get(key, ())))
                made = whole[(key, int(count))] = (compact.encode(session), session)
            body = made[0]
        # created_at in whole milliseconds (schema 9), an entry's in seconds
        out.append((row[0], body, row[2], row[3] / 1000, *row[4:7]))
    return out, dict(whole.values())


def _in_order(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    """``checkpoints`` oldest first: by stamp, then id (schema 15 keeps no stamp beside a
    row; they are read in order of id, which for a device's own is nearly this order)."""
    return sorted(checkpoints, key=_STAMP_AND_ID)


_STAMP_AND_ID: Final = operator.attrgetter("hlc", "id")


def _outbox_entries(rows: Sequence[Any], blocks: Sequence[Any]) -> list[OutboxEntry]:
    """``_outbox_read``'s rows and blocks as entries (``_entries_of``, then
    ``outbox_entries``)."""
    entries, built = _entries_of(rows, blocks)
    return outbox_entries(
        entries, lambda seq, body: _decode(_RECORD, "outbox", seq, body), known=built
    )


_OutboxRows = list[queued.Queued]
"""Outbox entries to queue: each record's kind (its index in ``compact.KINDS``), its key and
no body (the entry refers to its record)."""


def _put_queued(
    raw: sqlite3.Connection, first: int, entries: Sequence[queued.Queued], created_at: int
) -> None:
    """``entries`` queued under ``first``, ``first + 1``, ...: ``_queued_rows`` written."""
    for sql, rows in _queued_rows(first, entries, created_at):
        raw.executemany(sql, rows)


def _queued_rows(
    first: int, entries: Sequence[queued.Queued], created_at: int
) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The statements, each with its rows, that queue ``entries`` under ``first``,
    ``first + 1``, ... (schema 18): their outbox rows (``queued.rows_of``), the sessions
    among them (``outbox_sessions``) and the sequence past the last of them. (A benchmark's
    floor writes them too.)"""
    if not entries:
        return []
    out: list[tuple[str, list[tuple[Any, ...]]]] = [
        (
            _ENQUEUE,
            [
                (start, queued.pack(part), len(part), created_at)
                for start, part in queued.rows_of(first, entries)
            ],
        )
    ]
    sessions = queued.sessions_of([(first, entries)], _SESSION_KIND)
    if sessions:
        out.append((_QUEUE_SESSION, [(key, *held) for key, held in sessions.items()]))
    return [*out, (_SEQUENCE_AT, [(first + len(entries) - 1,)])]


def _now_ms() -> int:
    """An outbox row's ``created_at``: the time in whole milliseconds (schema 9)."""
    return int(time.time() * 1000)


_TYPE_KEYS: Final = {word: str(index) for index, word in enumerate(compact.WORDS)}


def _type_key(event_type: str) -> str:
    """An event's type as its column keeps it (schema 9): the digits of its index in
    ``compact.WORDS`` (one or two characters), any other type as itself. (A type that is
    itself such digits shares its key with a word: a read by type decodes each row's type
    from its body and keeps only the types asked for.)"""
    return _TYPE_KEYS.get(event_type, event_type)


def _type_keys(types: Collection[str]) -> str:
    """``_select_events``' ``types``: a JSON array of each type as a row may keep it, its
    key (rows since schema 9) and its text (rows before)."""
    texts = sorted(types)
    keys = [_TYPE_KEYS[text] for text in texts if text in _TYPE_KEYS]
    return msgspec.json.encode([*texts, *keys]).decode()


def _encode_batch(
    records: Sequence[Record],
    bodies: compact.Bodies | None = None,
    layout: IdLayout = SQLITE_ID_LAYOUT,
) -> tuple[dict[str, list[tuple[Any, ...]]], _OutboxRows]:
    """Rows per insert statement (in order of first appearance) and the outbox rows.
    ``bodies``: bytes some records arrived in (``WriteBatch.bodies``), stored as they are;
    ``layout``: where sessions keep their message ids."""
    groups: dict[str, list[tuple[Any, ...]]] = {}
    outbox: _OutboxRows = []
    key: str | bytes
    encode = compact.encode if bodies is None else bodies.of
    for record in records:
        ids: bytes | None = None
        try:
            if isinstance(record, Session) and len(record.state.message_ids) > layout.inline:
                ids = compact.id_list_bytes(record.state.message_ids)
                if ids is not None:
                    body = compact.encode(_without_ids(record))
            if ids is None:
                body = encode(record)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            name = getattr(record, "id", "?")
            raise StorageError(
                f"commit failed: cannot encode {type(record).__name__} {name!r}: {exc}"
            ) from exc
        sql: str
        row: tuple[Any, ...]
        match record:
            case Session():
                key = _key(record.id)
                sql = _PUT_SESSION
                row = (key, record.updated_at, record.deleted, ids, layout.block, body)
            case Message():
                key = _key(record.id)  # (its body written short in the transaction: _shortened)
                sql, row = _PUT_MESSAGE, (key, _key(record.session_id), body)
            case Checkpoint():
                sql, key = _PUT_CHECKPOINT, _key(record.id)
                parent = _key(record.parent_id or "")
                row = (key, _key(record.session_id), parent, body)
            case Event():
                sql, key = _PUT_EVENT, _key(record.id)
                session_key = _key(record.session_id)
                row = (key, session_key, record.sequence_number, _type_key(record.type), body)
            case AuditRow():
                sql, key = _PUT_AUDIT, _key(record.id)
                row = (
                    key,
                    _key(record.client_id),
                    _key(record.session_id),
                    record.sequence_number,
                    record.subject_key,
                    _audit_apart(record, body),
                )
            case ArtifactUpdate():
                sql, key = _PUT_ARTIFACT, _key(record.id)
                artifact, session_key = _key(record.artifact_id), _key(record.session_id)
                row = (key, artifact, session_key, record.hlc, body)
            case _:
                raise StorageError(f"commit failed: not a record: {type(record).__name__}")
        groups.setdefault(sql, []).append(row)
        outbox.append(queued.Queued(_KIND_CODE[type(record).__name__], key))
    return groups, outbox


async def _fetch(
    conn: aiosqlite.Connection | sqlite3.Connection, sql: str, params: Sequence[Any] = ()
) -> list[sqlite3.Row]:
    if isinstance(conn, sqlite3.Connection):  # the caller's own (``InPlace``): no hop
        return conn.execute(sql, params).fetchall()
    return list(await conn.execute_fetchall(sql, params))


async def _last_seq(conn: aiosqlite.Connection) -> int:
    rows = await _fetch(conn, _LAST_SEQ)
    return int(rows[0][0]) if rows else 0


async def _rollback(conn: aiosqlite.Connection, cause: BaseException) -> None:
    try:
        await conn.execute("ROLLBACK")
    except sqlite3.Error as exc:
        # SQLite rolls back by itself on some errors (SQLITE_FULL, IOERR...): nothing to undo.
        if "no transaction is active" not in str(exc):
            cause.add_note(f"rollback also failed: {exc}")


_META_PREFETCH: Final = 256
"""At most this many ``sync_state`` rows are read with a plan's ``BEGIN`` (there are about ten);
past it, a plan reads each key it asks for."""


def _begin_reading_meta(raw: sqlite3.Connection) -> dict[str, str] | None:
    """``BEGIN IMMEDIATE`` and the whole of ``sync_state``, in one hop: a plan's reads of the
    device's meta keys (its generation, clock, chain heads) then cost no hop each."""
    raw.execute("BEGIN IMMEDIATE")
    try:
        query = "SELECT key, value FROM sync_state LIMIT ?"
        rows = raw.execute(query, (_META_PREFETCH,)).fetchall()
    except BaseException:
        raw.execute("ROLLBACK")  # the caller sees a failed BEGIN: no transaction is left open
        raise
    return None if len(rows) >= _META_PREFETCH else {str(k): str(v) for k, v in rows}


@contextlib.asynccontextmanager
async def _immediate(
    conn: aiosqlite.Connection, action: str, *, read_meta: bool = False
) -> AsyncIterator[dict[str, str] | None]:
    """One ``BEGIN IMMEDIATE`` transaction: committed on exit (unless the body committed it
    already, as ``_write_batch`` does in its hop), rolled back on any error (cancellation
    included; the rollback itself is shielded), sqlite errors translated. ``read_meta``: yield
    ``sync_state`` as it stands inside the transaction (``_begin_reading_meta``), else None."""
    meta: dict[str, str] | None = None
    try:
        if read_meta:
            raw: sqlite3.Connection = conn._conn
            meta = await conn._execute(_begin_reading_meta, raw)  # type: ignore[no-untyped-call]
        else:
            await conn.execute("BEGIN IMMEDIATE")
    except _DB_ERRORS as exc:
        raise _storage_error(action, exc) from exc
    except BaseException as exc:
        # Cancelled while waiting for the write lock: BEGIN may still go through.
        await asyncio.shield(_rollback(conn, exc))
        raise
    try:
        yield meta
        if conn.in_transaction:
            await conn.execute("COMMIT")
    except BaseException as exc:
        await asyncio.shield(_rollback(conn, exc))
        if isinstance(exc, _DB_ERRORS):
            raise _storage_error(action, exc) from exc
        raise


def _prepare_now(raw: sqlite3.Connection, path: str, synchronous: str, busy_ms: int) -> bool:
    """A connection made ready, on its own thread: its SQL functions (``sql_functions``), the
    file checked (``_check_version``), WAL and ``synchronous``, migrations applied under the
    write lock. Whether the file reclaims freed pages (``auto_vacuum`` incremental)."""
    sql_functions(raw)
    # Refuse a newer file before changing anything in it (even its journal mode).
    new = _check_version(raw, path) == 0
    if new:
        # A new file: before the first table, and before WAL mode writes the header.
        raw.execute("PRAGMA auto_vacuum = INCREMENTAL")
    raw.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    raw.execute("PRAGMA journal_mode = WAL")
    raw.execute(f"PRAGMA synchronous = {synchronous}")
    raw.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES}")
    migrated = _check_version(raw, path) < SCHEMA_VERSION
    if migrated:  # (read again under the write lock: another process may have migrated)
        _atomically(raw, _migrate_now, path)
    reclaims = int(raw.execute("PRAGMA auto_vacuum").fetchone()[0]) == 2
    if migrated and reclaims and _free_pages(raw) >= (1 if new else RECLAIM_PAGES):
        # (a step that copied tables, as 12 and 18 did, freed the old ones' pages: a new
        # file, made by every step, keeps none of them)
        _reclaim(raw)
    return reclaims


def _migrate_now(raw: sqlite3.Connection, path: str) -> None:
    for step in _MIGRATIONS[_check_version(raw, path) :]:
        for statement in step:
            _run_step(raw, statement)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _check_version(raw: sqlite3.Connection, path: str) -> int:
    """The file's schema version; ``StorageError`` for a server's file or a newer one."""
    tables = {str(r[0]) for r in raw.execute("SELECT name FROM sqlite_master")}
    if "feed" in tables and "outbox" not in tables:
        raise StorageError(
            f"{path!r} is a pleach server database (pleach-server's), not a device "
            "one: give the device its own file"
        )
    version = int(raw.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StorageError(
            f"{path!r} has schema version {version}, newer than this pleach "
            f"supports ({SCHEMA_VERSION}): upgrade pleach to open it"
        )
    return version


def _atomically(raw: sqlite3.Connection, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(raw, *args)`` in one ``BEGIN IMMEDIATE`` transaction, on the connection's own
    thread: committed, or rolled back when it raises. Once started it runs to its end, so a
    cancelled caller leaves no transaction open."""
    raw.execute("BEGIN IMMEDIATE")
    try:
        result = fn(raw, *args)
        raw.execute("COMMIT")
    except BaseException:
        if raw.in_transaction:
            raw.execute("ROLLBACK")
        raise
    return result


async def _in_one_hop(
    conn: aiosqlite.Connection, action: str, fn: Callable[..., _T], *args: Any
) -> _T:
    """A small write transaction (``_atomically``) in ONE hop to the connection's thread,
    instead of three (``BEGIN``, the statement, ``COMMIT``); sqlite errors translated."""
    raw: sqlite3.Connection = conn._conn
    try:
        result: _T = await conn._execute(_atomically, raw, fn, *args)  # type: ignore[no-untyped-call]
    except _DB_ERRORS as exc:
        raise _storage_error(action, exc) from exc
    return result


def _delete_queued(raw: sqlite3.Connection, client_seqs: list[int]) -> None:
    """The entries numbered ``client_seqs`` gone from the outbox (``queued.gone``): a row none
    of whose entries is left removed, another rewritten with its gaps; their sessions'
    index rows and failed attempts with them. Unknown numbers are ignored."""
    if not client_seqs:
        return
    numbers = set(client_seqs)
    removed: list[tuple[int]] = []
    rewritten: list[tuple[bytes, int, bytes | None, int]] = []
    went: list[tuple[int, list[queued.Entry]]] = []  # the entries removed, in their rows
    for first, entries, tries in _rows_holding(raw, numbers):
        left = queued.gone(first, entries, numbers)
        if left == entries:
            continue
        pairs = zip(entries, left, strict=True)
        went.append((first, [entry if kept is None else None for entry, kept in pairs]))
        count = queued.live(left)
        if count:
            kept = {at: held for at, held in tries.items() if left[at] is not None}
            rewritten.append((queued.pack(left), count, queued.tried(kept), first))
        else:
            removed.append((first,))
    raw.executemany("DELETE FROM outbox WHERE client_seq = ?", removed)
    raw.executemany(
        "UPDATE outbox SET refs = ?, live = ?, tried = ? WHERE client_seq = ?", rewritten
    )
    _sessions_gone(raw, queued.sessions_of(went, _SESSION_KIND), numbers)


def _rows_holding(
    raw: sqlite3.Connection, numbers: Collection[int]
) -> list[tuple[int, list[queued.Entry], dict[int, queued.Tried]]]:
    """The outbox rows that may hold the entries numbered ``numbers`` (those from the row
    holding the least to the greatest): each its first number, its entries and its failed
    attempts (``_delete_queued``, ``_mark_attempt``)."""
    span = (min(numbers), max(numbers))
    rows = raw.execute(QUERIES["outbox_rows_between"], span).fetchall()
    return [(first, _unpacked(first, refs), _tries(first, tried)) for first, refs, tried in rows]


def _sessions_gone(
    raw: sqlite3.Connection, went: dict[str | bytes, tuple[int, int | None]], numbers: set[int]
) -> None:
    """``outbox_sessions`` after the entries ``went`` (``queued.sessions_of`` of them) left
    the outbox: each session's count taken down, its row removed at none, and its last
    number by reference found again (one read of the outbox) when it was one of
    ``numbers``, the numbers removed."""
    if not went:
        return
    raw.executemany(
        "UPDATE outbox_sessions SET entries = entries - ? WHERE session_id = ?",
        [(count, key) for key, (count, _) in went.items()],
    )
    raw.execute("DELETE FROM outbox_sessions WHERE entries <= 0")
    stale = [
        key
        for key, _, last in _select_in(raw, QUERIES["outbox_sessions_of"], list(went))
        if last in numbers
    ]
    if stale:
        held = _outbox_sessions(raw)
        raw.executemany(
            "UPDATE outbox_sessions SET last_ref = ? WHERE session_id = ?",
            [(held.get(key, (0, None))[1], key) for key in stale],
        )


def _outbox_sessions(raw: sqlite3.Connection) -> dict[str | bytes, tuple[int, int | None]]:
    """``queued.sessions_of`` the whole outbox (one read of it)."""
    rows = raw.execute("SELECT client_seq, refs FROM outbox ORDER BY 1").fetchall()
    held = ((first, _unpacked(first, refs)) for first, refs in rows)
    return queued.sessions_of(held, _SESSION_KIND)


CHECKPOINT_EVERY: Final = 8
"""Batch commits (``transact``: every turn's) between two checkpoints of the WAL, each run on a
connection of its own beside the writer's (``PRAGMA wal_checkpoint(PASSIVE)``: it copies what
no reader still needs, and takes no write lock, so other processes' commits never wait for it).
It runs twice: first beside this process's commits, copying and syncing what the WAL holds,
then under the store's own lock, copying what they wrote meanwhile: the next commit waits for
that one and then starts the WAL over, which no commit does while a checkpoint runs beside it.
Measured over 1,000 back-to-back turns, the lock was held 2.4-2.8 ms a checkpoint (mostly its
two fsyncs) against 3.1-3.3 ms in one step, and the late turns' p99 read 4.6-4.9x their p50
against 5.4-6.0x (three runs each). SQLite's own checkpoint runs inside the commit that takes
the WAL past ``AUTOCHECKPOINT_PAGES``: at its default of 1,000 pages, a 1,000-turn conversation
(about 40 pages a turn) made every 24th turn 25-30 ms where the others took 4-5 ms."""
AUTOCHECKPOINT_PAGES: Final = 4000
"""SQLite's own checkpoint, kept as a safety net for side checkpoints that cannot keep up (a
reader of another process holding an old snapshot): the WAL stays under about 16 MB."""

IN_PLACE_MAX_RECORDS: Final = 64
IN_PLACE_MAX_BYTES: Final = 256 * 1024
"""A ``Rerunnable`` plan's batch of at most this many records and body bytes (a turn's: nine
records, a few KiB) is written on the caller's thread (``SQLiteAdapter._write_in_place``):
its SQLite work (about 0.25 ms) is less than a hop to the connection's thread and back."""

RECLAIM_PAGES: Final = 64
"""Free pages (256 KiB at 4 KiB each) after which an outbox removal gives them back to the OS.
The outbox of a 1,000-turn conversation is about 150 pages since schema 4 (its record index
holds the session rows only), under the 256 pages this was: a full sync then gave nothing
back."""
DRAINED_RECLAIM_PAGES: Final = 1
"""Free pages after which a removal that empties the outbox gives them back: a device that has
synced keeps none unused. A full sync of a 1,000-turn conversation left 25 free pages (100 KB,
4% of the file) under ``RECLAIM_PAGES``. A device online empties its outbox at each turn, whose
few rows share the table's one page, which stays: over 300 such turns one reclaim ran."""


def _delete_queued_and_reclaim(raw: sqlite3.Connection, client_seqs: list[int]) -> int:
    """Remove the entries (one transaction); then, past ``RECLAIM_PAGES`` free pages, or
    ``DRAINED_RECLAIM_PAGES`` when the outbox is now empty, give them back in a transaction of
    its own (best effort: the removal stands whatever happens to it). Returns the pages
    given back."""
    _atomically(raw, _delete_queued, client_seqs)
    free = _free_pages(raw)
    if free < DRAINED_RECLAIM_PAGES:
        return 0
    if free < RECLAIM_PAGES and raw.execute("SELECT 1 FROM outbox LIMIT 1").fetchone():
        return 0
    return _reclaim(raw)


def _free_pages(raw: sqlite3.Connection) -> int:
    return int(raw.execute("PRAGMA freelist_count").fetchone()[0])


def _reclaim(raw: sqlite3.Connection) -> int:
    """The file's free pages given back to the OS, in a transaction of its own (best effort:
    0 when another process holds the write lock, and they go next time); how many."""
    free = _free_pages(raw)
    try:
        # executescript steps the pragma to its end (execute would free one page per call).
        raw.executescript("PRAGMA incremental_vacuum")
    except sqlite3.Error:
        return 0
    return free - _free_pages(raw)


# ?1: the session id; ?2: a JSON array of ids to keep (what a live fork refers to).
_KEEP = "NOT IN (SELECT pleach_key(value) FROM json_each(?2))"
# Queued entries of purged contents are not removed (client_seq must stay gap-free: the
# server refuses a gap) but turned into references to the deleted session's row
# (``_queued_as_session``): they send its tombstone, and the contents never leave the device.
_PURGED = (
    f"SELECT {_KIND_CODE['Message']}, id FROM messages "
    f"WHERE session_n = {_SESSION_N.format('?1')} AND id {_KEEP} "
    f"UNION ALL SELECT {_KIND_CODE['Checkpoint']}, id FROM checkpoints "
    f"WHERE session_n = {_SESSION_N.format('?1')} AND id {_KEEP} "
    f"UNION ALL SELECT {_KIND_CODE['ArtifactUpdate']}, id FROM artifact_updates "
    f"WHERE session_id = ?1 AND artifact_id {_KEEP}"
)
"""The records a purge of session ?1 removes, each its kind and key (?2: those it keeps)."""
_PURGE_SESSION = (
    f"DELETE FROM messages WHERE session_n = {_SESSION_N.format('?1')} AND id {_KEEP}",
    f"DELETE FROM checkpoints WHERE session_n = {_SESSION_N.format('?1')} AND id {_KEEP}",
    f"DELETE FROM artifact_updates WHERE session_id = ?1 AND artifact_id {_KEEP}",
)


def _queued_as_session(raw: sqlite3.Connection, wanted: dict[tuple[int, object], object]) -> None:
    """Every queued entry of a record of ``wanted`` (its kind and key, each to the key of the
    session purged of it), referring or carrying its copy, turned into a reference to that
    session's row (counted as such in ``outbox_sessions``): rows rewritten in place, numbers
    kept; one read of the outbox for all of a batch's purges."""
    if not wanted or raw.execute("SELECT 1 FROM outbox LIMIT 1").fetchone() is None:
        return
    updates: list[tuple[bytes, int]] = []
    turned: list[tuple[int, list[queued.Entry]]] = []  # the entries turned, in their rows
    for first, refs in raw.execute("SELECT client_seq, refs FROM outbox").fetchall():
        entries = _unpacked(first, refs)
        now: list[queued.Entry] = [None] * len(entries)
        for at, entry in enumerate(entries):
            session_key = None if entry is None else wanted.get((entry.kind, entry.key))
            if session_key is not None:
                entries[at] = now[at] = queued.Queued(_SESSION_KIND, cast(Any, session_key))
        if any(now):
            updates.append((queued.pack(entries), first))
            turned.append((first, now))
    raw.executemany("UPDATE outbox SET refs = ? WHERE client_seq = ?", updates)
    sessions = queued.sessions_of(turned, _SESSION_KIND)
    raw.executemany(_QUEUE_SESSION, [(key, *held) for key, held in sessions.items()])


async def _write_batch(
    conn: aiosqlite.Connection, batch: WriteBatch, layout: IdLayout, *, commit: bool = False
) -> CommitReceipt:
    """Write ``batch`` inside the open transaction, in ONE hop to the connection's thread:
    every statement of a batch runs there back to back (a turn's commit was about ten awaited
    hops, each a thread handoff, for well under a millisecond of SQLite work). ``commit``:
    end the transaction in the same hop (``_immediate`` then has nothing left to commit)."""
    # aiosqlite runs queued functions on its connection thread, in order; it has no public
    # name for that, so this uses its ``_execute`` and ``_conn`` (pinned: aiosqlite < 0.23).
    raw: sqlite3.Connection = conn._conn
    receipt: CommitReceipt = await conn._execute(  # type: ignore[no-untyped-call]
        _write_batch_now, raw, batch, *_encoded(batch, layout), commit
    )
    return receipt


def _encoded(batch: WriteBatch, layout: IdLayout) -> tuple[Any, ...]:
    """``_write_batch_now``'s rows of ``batch``, encoded on the caller's thread."""
    return (
        *_encode_batch(batch.records, batch.bodies, layout),
        *_encode_batch(batch.queued, None, layout),
    )


def _write_if_unchanged(
    raw: sqlite3.Connection, seen: dict[str, str], batch: WriteBatch, *encoded: Any
) -> CommitReceipt | None:
    """A ``Rerunnable`` plan's batch in one hop: ``BEGIN IMMEDIATE``, and when ``sync_state``
    is still ``seen`` (what the plan decided on) the batch and ``COMMIT``; else ``ROLLBACK``
    and None (another connection wrote since: the caller plans again under the lock)."""
    return _write_if_seen(raw, _begin_reading_meta(raw), seen, batch, *encoded)


def _write_if_seen(
    raw: sqlite3.Connection,
    meta: dict[str, str] | None,
    seen: dict[str, str],
    batch: WriteBatch,
    *encoded: Any,
) -> CommitReceipt | None:
    """``_write_if_unchanged`` after its ``BEGIN IMMEDIATE``, which read ``meta``."""
    if meta != seen:
        raw.execute("ROLLBACK")
        return None
    groups, outbox, queued_groups, queued_outbox = encoded
    try:
        return _write_batch_now(raw, batch, groups, outbox, queued_groups, queued_outbox, True)
    except BaseException:
        if raw.in_transaction:
            raw.execute("ROLLBACK")
        raise


def _write_batch_now(
    raw: sqlite3.Connection,
    batch: WriteBatch,
    groups: dict[str, list[tuple[Any, ...]]],
    outbox: _OutboxRows,
    queued_groups: dict[str, list[tuple[Any, ...]]],
    queued_outbox: _OutboxRows,
    commit: bool,
) -> CommitReceipt:
    """``_write_batch``'s statements, run on the connection's own thread."""
    groups, queued_groups = _shortened(raw, groups, queued_groups)
    keep = msgspec.json.encode(batch.purge_keep).decode()
    purged_sessions = [_key(session_id) for session_id in batch.purge_sessions]
    _queued_as_session(
        raw,
        {
            (int(kind), key): session_key
            for session_key in purged_sessions
            for kind, key in raw.execute(_PURGED, (session_key, keep)).fetchall()
        },
    )
    for session_key in purged_sessions:
        for statement in _PURGE_SESSION:
            raw.execute(statement, (session_key, keep))
    written = [*groups.items(), *queued_groups.items()]
    for sql, rows in _numbers_for(written):  # (before the rows that name them)
        raw.executemany(sql, rows)
    for sql, rows in written:
        if sql is _PUT_SESSION:
            _put_sessions(raw, rows)
        else:
            raw.executemany(sql, rows)
    if batch.purge_checkpoints_for:
        purge = [(_key(session_id),) for session_id in batch.purge_checkpoints_for]
        checkpoint = _KIND_CODE["Checkpoint"]
        _queued_as_session(
            raw,
            {
                (checkpoint, key): session_key
                for (session_key,) in purge
                for (key,) in raw.execute(_PURGED_CHECKPOINTS, (session_key,)).fetchall()
            },
        )
        for statement in _PURGE_CHECKPOINTS:
            raw.executemany(statement, purge)
    if batch.rechained_audit:
        clients = dict.fromkeys(_key(row.client_id) for row in batch.rechained_audit)
        raw.executemany(_NUMBER_CLIENT, [(key,) for key in clients])
        raw.executemany(
            f"UPDATE audit SET client_n = {_CLIENT_N.format('?1')}, sequence_number = ?2, "
            "body = ?3 WHERE id = ?4",
            [
                (_key(row.client_id), row.sequence_number, compact.encode(row), _key(row.id))
                for row in batch.rechained_audit
            ],
        )
    if batch.canonical:
        _mark_canonical(raw, batch.canonical, *_tenant_of(raw))
    if batch.renumber_outbox:
        _renumber_outbox(raw)
    to_queue = (outbox if batch.outbox else []) + queued_outbox
    seqs: list[int] = []
    if to_queue:
        row = raw.execute(_LAST_SEQ).fetchone()
        first = (int(row[0]) if row is not None else 0) + 1
        seqs = list(range(first, first + len(to_queue)))
        _put_queued(raw, first, to_queue, _now_ms())
    if batch.meta:
        raw.executemany(_PUT_META, list(batch.meta.items()))
    if commit:
        raw.execute("COMMIT")
    return CommitReceipt(client_seqs=seqs, records=len(batch.records) + len(batch.queued))


def _numbers_for(
    written: Sequence[tuple[str, list[tuple[Any, ...]]]],
) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The statements that number the sessions, and the audit rows' devices, that the rows of
    ``written`` (insert statements with their rows) name by number (schema 12), each key
    once: to run before them (``_write_batch_now``; a benchmark's floor writes them too)."""
    sessions: dict[Any, None] = {}
    clients: dict[Any, None] = {}
    for sql, rows in written:
        at = _SESSION_AT.get(sql)
        if at is not None:
            sessions.update(dict.fromkeys(row[at] for row in rows))
        if sql is _PUT_AUDIT:
            clients.update(dict.fromkeys(row[1] for row in rows))
    numbers = [(_NUMBER_SESSION, [(key,) for key in sessions])] if sessions else []
    return numbers + ([(_NUMBER_CLIENT, [(key,) for key in clients])] if clients else [])


def _tenant_of(raw: sqlite3.Connection) -> tuple[bytes, bytes]:
    """The file's tenant (``tenant``: its org and user packed; ``b""`` while none is) and its
    stamp node (``compact.stamp_node`` of its client id; ``b""`` while none is)."""
    tenant, node = _file_tenant(raw)
    return tenant, node or b""


def _file_tenant(raw: sqlite3.Connection) -> tuple[bytes, bytes | None]:
    """The file's ``tenant`` row: its packed org and user (``b""``: no row yet) and its node
    (None while the column is NULL: not set yet)."""
    row = raw.execute(_FILE_TENANT).fetchone()
    if row is None:
        return b"", None
    return bytes(row[0]), None if row[1] is None else bytes(row[1])


def _shortened(
    raw: sqlite3.Connection, *groups: dict[str, list[tuple[Any, ...]]]
) -> list[dict[str, list[tuple[Any, ...]]]]:
    """``groups`` (rows per insert statement) with the bodies of messages, checkpoints, events
    and audit rows written short (``_short``: each row begins with its key, its session's
    key at ``_SESSION_AT``), the file's tenant left out too where it is theirs, and the
    stamp's node where the device is the file's, in one copy, in the write's transaction
    (both are read there, so every connection and process of the file agrees): a file with
    no tenant yet takes the first short body's (``compact.body_tenant``) as it is written,
    one with no node the node of its client id then (``sync_state``; none while it has
    none). One read of a one-row table a commit; a body of another tenant keeps its org and
    user, one of another device its node."""
    if not any(sql in _SESSION_AT for group in groups for sql in group):
        return list(groups)
    held, node = _file_tenant(raw)
    tenant = held
    if not tenant:  # (an audit row's body never gives it: the others' do)
        bodies = (
            _short(row[-1], row[0], row[1])
            for group in groups
            for sql, rows in group.items()
            if _SESSION_AT.get(sql) == 1
            for row in rows
        )
        tenant = next(filter(None, map(compact.body_tenant, bodies)), b"")
    if tenant and node is None:
        client = raw.execute(QUERIES["get_meta"], ("client_id",)).fetchone()
        node = None if client is None else compact.stamp_node(str(client[0]))
        if not held or node is not None:
            raw.execute(_SET_TENANT, (tenant, node))
    node = node or b""
    return [
        {sql: _short_rows(sql, rows, tenant, node) for sql, rows in group.items()}
        for group in groups
    ]


def _short_rows(
    sql: str, rows: list[tuple[Any, ...]], tenant: bytes, node: bytes
) -> list[tuple[Any, ...]]:
    """``sql``'s rows with their bodies written short (``_shortened``), or as they are for an
    insert whose bodies are kept whole."""
    at = _SESSION_AT.get(sql)
    if at is None:
        return rows
    if sql is _PUT_EVENT:
        return [_event_row(row, _short(row[-1], row[0], row[1], tenant, node)) for row in rows]
    return [(*row[:-1], _short(row[-1], row[0], row[at], tenant, node)) for row in rows]


def _event_row(row: tuple[Any, ...], short: bytes) -> tuple[Any, ...]:
    """``_PUT_EVENT``'s row: ``row`` with its short body, then that body without its prev_hash
    and the digest left out (``compact.event_apart``), or two NULLs."""
    apart = compact.event_apart(short)
    return (*row[:-1], short, *(apart or (None, None)))


_SET_TENANT: Final = (
    "INSERT INTO tenant (one, packed, node) VALUES (1, ?1, ?2) "
    "ON CONFLICT (one) DO UPDATE SET node = excluded.node WHERE node IS NULL"
)
"""The file's tenant, or its node when it has its tenant (never changed once set)."""


_PLACE: Final = operator.itemgetter(3, 4)
"""A row of ``_mark_canonical``'s read: its session's number and its sequence number."""
_MARK_PLACED: Final = (
    "UPDATE events SET body = CASE WHEN ?2 IS NOT NULL AND "
    + _ROW_BEFORE.format(session="?5", number="?6", placed="true")
    + " = ?3 THEN ?2 ELSE ?1 END WHERE id = ?4"
)
"""An event marked placed: its short body (``?1``), or that body without its prev_hash
(``?2``, ``compact.event_apart``, ``?3`` the digest) where the row before it holds it
(``_PUT_EVENT``'s rule)."""


def _mark_canonical(
    raw: sqlite3.Connection, event_ids: list[str], tenant: bytes, node: bytes
) -> None:
    """``WriteBatch.canonical``: each stored event's body marked canonical from its bytes
    (``compact.canonical_body``), or decoded, replaced and encoded when its form is another."""
    rows = _select_in(
        raw,
        "SELECT id, "
        + _WHOLE_E
        + ", "
        + _SESSION_OF.format("session_n")
        + ", session_n, sequence_number FROM events WHERE id IN ({keys})",
        _keys(event_ids),
    )
    updates = []
    for event_id, body, session_key, session_n, number in sorted(rows, key=_PLACE):
        marked = marked_canonical(
            body, partial(_decode, _EVENT, "events", event_id, body), compact.encode
        )
        if marked != body:
            short = _short(marked, event_id, session_key, tenant, node)
            apart, prev = compact.event_apart(short) or (None, None)
            updates.append((short, apart, prev, event_id, session_n, number))
    # (in chain order: the row before may be one this marks)
    raw.executemany(_MARK_PLACED, updates)


def _renumber_outbox(raw: sqlite3.Connection) -> None:
    """Queued entries get client_seq 1..n in order (``queued.renumbered``), with their
    sessions' index rows and failed attempts, and the sequence restarts after them."""
    rows = raw.execute(
        "SELECT client_seq, refs, created_at, tried FROM outbox ORDER BY 1"
    ).fetchall()
    new_rows, moved = queued.renumbered(
        (first, _unpacked(first, refs), created_at) for first, refs, created_at, _ in rows
    )
    tries = {  # each failed entry's attempts under its new number
        moved[first + at]: held
        for first, _, _, tried in rows
        for at, held in _tries(first, tried).items()
        if first + at in moved
    }
    for table in ("outbox", "outbox_sessions"):
        raw.execute(f"DELETE FROM {table}")
    raw.executemany(
        "INSERT INTO outbox (client_seq, refs, live, created_at, tried) VALUES (?, ?, ?, ?, ?)",
        [
            (
                first,
                queued.pack(part),
                queued.live(part),
                created_at,
                queued.tried(
                    {at: tries[n] for at in range(len(part)) if (n := first + at) in tries}
                ),
            )
            for first, part, created_at in new_rows
        ],
    )
    sessions = queued.sessions_of([(first, part) for first, part, _ in new_rows], _SESSION_KIND)
    raw.executemany(_QUEUE_SESSION, [(key, *held) for key, held in sessions.items()])
    raw.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
    if moved:
        raw.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('outbox', ?)", (len(moved),))


class _Reader:
    """``TxReader`` on the connection that holds the write transaction: the store's own (each
    read a hop to its thread) or the caller's (``InPlace``: read where it is asked). ``meta``:
    the ``sync_state`` rows read with its ``BEGIN`` (the plan writes them only in its batch,
    after its last read), or None to read each key."""

    def __init__(
        self, conn: aiosqlite.Connection | sqlite3.Connection, meta: dict[str, str] | None = None
    ) -> None:
        self._conn = conn
        self._meta = meta

    async def get_meta(self, key: str) -> str | None:
        if self._meta is not None:
            return self._meta.get(key)
        rows = await _fetch(self._conn, QUERIES["get_meta"], (key,))
        return str(rows[0][0]) if rows else None

    async def get_session(self, session_id: str) -> Session | None:
        rows = await _fetch(self._conn, QUERIES["get_session"], (_key(session_id),))
        return _sessions_of(rows)[0] if rows else None

    async def event_head(self, session_id: str) -> tuple[int, str]:
        rows = await _fetch(self._conn, QUERIES["event_head"], (_key(session_id), _LAST_SEQUENCE))
        if not rows:
            return (0, "")
        event = _decode(_EVENT, "events", rows[0][0], rows[0][1])
        return (event.sequence_number, event.row_hash)

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[Event]:
        rows = await _selected(
            self._conn,
            _select_events,
            _key(session_id),
            from_sequence,
            -1 if limit is None else limit,
        )
        return [_decode(_EVENT, "events", row_id, body) for row_id, body in rows]

    async def event_places(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[EventPlace]:
        rows = await _selected(
            self._conn,
            _select_events,
            _key(session_id),
            from_sequence,
            -1 if limit is None else limit,
        )
        return [
            event_place_of(body, partial(_decode, _EVENT, "events", row_id, body))
            for row_id, body in rows
        ]

    async def list_sessions(self) -> list[Session]:
        return _sessions_of(await _fetch(self._conn, QUERIES["list_sessions"]))

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        rows = await _fetch(self._conn, QUERIES["list_checkpoints"], (_key(session_id),))
        return _in_order([_decode(_CHECKPOINT, "checkpoints", key, body) for key, body in rows])

    async def missing_messages(self, message_ids: list[str]) -> list[str]:
        if not message_ids:
            return []
        keys = _keys(message_ids)
        held = {row[0] for row in await _fetch_in(self._conn, QUERIES["held_messages"], keys)}
        return [m for m, key in zip(message_ids, keys, strict=True) if key not in held]

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        if not message_ids:
            return []
        keys = _keys(message_ids)
        rows = await _selected(self._conn, _select_messages, keys)
        return _messages_in_order(keys, message_ids, rows)

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        key = (_key(artifact_id),)
        rows = await _fetch(self._conn, QUERIES["list_artifact_updates"], key)
        return [_decode(_ARTIFACT, "artifact_updates", row_id, body) for row_id, body in rows]

    async def session_queued(self, session_id: str) -> bool:
        return bool(await _fetch(self._conn, QUERIES["session_queued"], (_key(session_id),)))

    async def queued_records(self) -> list[Record]:
        read = await _selected(self._conn, _outbox_read, 0, -1)
        return [entry.record for entry in _outbox_entries(*read)]

    async def audit_rows(self, row_ids: list[str]) -> list[AuditRow]:
        if not row_ids:
            return []
        rows = await _fetch_in(self._conn, QUERIES["audit_rows"], _keys(row_ids))
        return [_decode(_AUDIT, "audit", row_id, body) for row_id, body in rows]


class _SnapshotReader:
    """``TxReader`` of a ``Rerunnable`` plan run before the write lock: the meta keys as the
    store saw them after its last commit, and nothing else (``NotInSnapshot``)."""

    def __init__(self, meta: dict[str, str]) -> None:
        self._meta = meta

    async def get_meta(self, key: str) -> str | None:
        return self._meta.get(key)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        async def not_here(*args: Any, **kwargs: Any) -> Any:
            raise NotInSnapshot(name)

        return not_here


class SQLiteAdapter(AsyncResource):
    """A ``StorageAdapter`` over one SQLite file (``durable = True``).

    Use as ``async with SQLiteAdapter(path) as store``, or call ``open()`` and ``close()``.
    ``synchronous="FULL"`` also survives power loss (not just a crash) at some write cost.
    ``busy_timeout_ms`` is how long a write waits for another process's lock before failing
    with a retryable ``StorageError``. Calls are serialised on one connection; a store dropped
    while open warns with ``ResourceWarning``.
    """

    durable = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Synchronous = "NORMAL",
        busy_timeout_ms: int = 5000,
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', not {synchronous!r}")
        if busy_timeout_ms < 0:
            raise ValueError("busy_timeout_ms must be >= 0")
        self.path = os.fspath(path)
        self.synchronous: Synchronous = synchronous
        self.busy_timeout_ms = int(busy_timeout_ms)
        self._state = _State.CLOSED
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        self._closing: asyncio.Future[None] | None = None
        self._reclaims = False
        """The file's ``auto_vacuum`` is INCREMENTAL: an outbox removal may give pages back."""
        self._seen: dict[str, str] | None = None
        """``sync_state`` as this connection left it after its last ``transact`` (None: not
        known), on which a ``Rerunnable`` plan runs before the write lock."""
        self._checkpointer: aiosqlite.Connection | None = None
        self._checkpoints = Every(CHECKPOINT_EVERY, self._checkpoint)
        """A side checkpoint every ``CHECKPOINT_EVERY`` commits (``close`` waits for it)."""
        self._local: sqlite3.Connection | None = None
        """A connection of the caller's (the event loop's) thread, made at first use: for
        ``peek_meta`` and for small batches written in place (``_write_in_place``)."""
        self._wal_long = False
        """The WAL held more than half of ``AUTOCHECKPOINT_PAGES`` at the last side checkpoint:
        batches go to the connection's thread, whose commits run SQLite's own checkpoint and
        then start the WAL over, never on the caller's (see ``_checkpoint``)."""
        self._id_layout = SQLITE_ID_LAYOUT  # (where sessions keep their message ids)
        self._lock_reads = False
        """The lock is held for a read (``_reading``), not a write: a read in place
        (``_read_now``) need not wait for it."""

    def __repr__(self) -> str:
        return f"<SQLiteAdapter {self.path!r} {self._state.value}>"

    def __del__(self, _warn: Any = warnings.warn) -> None:
        if getattr(self, "_conn", None) is not None:
            _warn(
                f"unclosed {self!r}: use 'async with' or 'await store.close()'",
                ResourceWarning,
                source=self,
            )

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, set WAL and ``synchronous``, apply migrations. Raises ``StorageError``
        if the file cannot be opened or was written by a newer pleach."""
        if self._closing is not None and not self._closing.done():
            await asyncio.shield(self._closing)
        if self._state is not _State.CLOSED:
            raise InvalidState(f"{self!r} cannot open: it is {self._state.value}")
        self._state = _State.OPENING
        try:
            try:
                # When connecting fails, aiosqlite leaves its worker thread to finish on its
                # own, possibly after the event loop is gone; so try the file on a plain
                # thread first, and only connect when it opens.
                await asyncio.to_thread(_probe, self.path)
                conn = await aiosqlite.connect(
                    self.path, timeout=self.busy_timeout_ms / 1000, isolation_level=None
                )
            except _DB_ERRORS as exc:
                raise _storage_error(f"open {self.path!r}", exc) from exc
            try:
                await self._prepare(conn)
            except BaseException as exc:
                await asyncio.shield(_close_after_error(conn, exc))
                if isinstance(exc, _DB_ERRORS):
                    raise _storage_error(f"open {self.path!r}", exc) from exc
                raise
        except BaseException:
            self._state = _State.CLOSED
            raise
        self._conn = conn
        self._seen = None
        self._closing = None
        self._state = _State.OPEN

    async def _prepare(self, conn: aiosqlite.Connection) -> None:
        # Every step in one hop to the connection's thread (a dozen hops cost an open about
        # two milliseconds).
        raw: sqlite3.Connection = conn._conn
        self._reclaims = await conn._execute(  # type: ignore[no-untyped-call]
            _prepare_now, raw, self.path, self.synchronous, self.busy_timeout_ms
        )

    async def close(self) -> None:
        """Close the file after any call in progress; idempotent. The close completes even
        if the caller is cancelled; a second call waits for the first."""
        if self._closing is None:
            conn = self._conn
            if conn is None:
                return
            self._conn = None
            self._state = _State.CLOSED
            self._close_local()
            self._closing = asyncio.ensure_future(self._shutdown(conn))
        await asyncio.shield(self._closing)

    async def _shutdown(self, conn: aiosqlite.Connection) -> None:
        async with self._lock:  # let the transaction in progress finish (none starts after)
            pass
        await self._checkpoints.wait()  # (it takes the lock) never raises: it logs what fails
        async with self._lock:
            checkpointer, self._checkpointer = self._checkpointer, None
            try:
                if checkpointer is not None:
                    await checkpointer.close()
                await conn.close()
            except _DB_ERRORS as exc:
                raise _storage_error(f"close {self.path!r}", exc) from exc

    async def _checkpoint(self) -> None:
        try:
            if self._checkpointer is None:
                self._checkpointer = await aiosqlite.connect(self.path, isolation_level=None)
            # Under this store's lock: a checkpoint copies the WAL back, but only a writer
            # starts it over, and only when its transaction begins on a WAL copied back to its
            # end. With this process's commits held meanwhile (other processes are not: a
            # PASSIVE checkpoint takes no write lock), the next one starts it over; with them
            # running beside it, under steady writes, none did, and the WAL grew for ever
            # (33,000 pages after 1,000 turns, each read of a page in it the slower).
            # First beside them: it copies (and syncs) what is there, so that the one under the
            # lock copies only what they wrote meanwhile.
            await self._checkpointer.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
            async with self._lock:
                if self._checkpointer is None:  # (closed meanwhile)
                    return
                rows = await self._checkpointer.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
            frames = int(next(iter(rows), (0, 0, 0))[1])
            # A reader's old snapshot (another process's) keeps frames from being copied, and
            # the WAL from starting over: past half the safety net, commits go to the
            # connection's thread, whose own checkpoint at AUTOCHECKPOINT_PAGES runs there.
            self._wal_long = frames > AUTOCHECKPOINT_PAGES // 2
        except _DB_ERRORS as exc:  # best effort: SQLite's own checkpoint still runs
            log.info("side checkpoint of %r failed: %s", self.path, exc)

    def _require_open(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise InvalidState(f"{self!r} is not open")
        return self._conn

    @contextlib.asynccontextmanager
    async def _transaction(self, action: str) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock:
            conn = self._require_open()
            async with _immediate(conn, action):
                yield conn

    @contextlib.asynccontextmanager
    async def _reading(self, action: str) -> AsyncIterator[aiosqlite.Connection]:
        # Reads wait for the lock too, so they never see a transaction in progress.
        async with self._lock:
            conn = self._require_open()
            self._lock_reads = True
            try:
                yield conn
            except _DB_ERRORS as exc:
                raise _storage_error(action, exc) from exc
            finally:
                self._lock_reads = False

    # -- diagnostics ----------------------------------------------------------------------

    async def settings(self) -> dict[str, str | int]:
        """The connection's effective ``journal_mode``, ``synchronous``, ``busy_timeout_ms``
        and ``schema_version``."""
        async with self._reading("settings") as conn:
            journal = (await _fetch(conn, "PRAGMA journal_mode"))[0][0]
            sync = (await _fetch(conn, "PRAGMA synchronous"))[0][0]
            busy = (await _fetch(conn, "PRAGMA busy_timeout"))[0][0]
            version = (await _fetch(conn, "PRAGMA user_version"))[0][0]
        return {
            "journal_mode": str(journal),
            "synchronous": _SYNCHRONOUS_NAMES.get(int(sync), str(sync)),
            "busy_timeout_ms": int(busy),
            "schema_version": int(version),
        }

    async def integrity_check(self) -> list[str]:
        """Run ``PRAGMA integrity_check``; returns the problems found (empty: file is sound)."""
        async with self._reading("integrity check") as conn:
            rows = await _fetch(conn, "PRAGMA integrity_check")
        problems = [str(row[0]) for row in rows]
        return [] if problems == ["ok"] else problems

    # -- writes ---------------------------------------------------------------------------

    async def commit(self, batch: WriteBatch) -> CommitReceipt:
        """Write the batch in one transaction: the purges, records (one executemany per
        table), the outbox rows and the meta keys. Raises ``StorageError`` with nothing
        written on any failure."""
        if batch.is_empty():
            return CommitReceipt(client_seqs=[], records=0)
        return await self.transact(fixed_plan(batch))

    async def transact(self, plan: Plan) -> CommitReceipt:
        """Call ``plan`` under the write lock (``BEGIN IMMEDIATE``: other processes wait, up
        to ``busy_timeout_ms``) with a reader on the same transaction, then write its batch."""
        receipt, in_place = await self._transact(plan)
        if in_place:
            # Written with no hop, so with no turn of the loop: give it one, or a loop of
            # commits would hold it (the side checkpoints, a sync loop, a UI wait on it).
            await asyncio.sleep(0)
        return receipt

    async def _transact(self, plan: Plan) -> tuple[CommitReceipt, bool]:
        """``transact``, and whether it was done on the caller's thread."""
        async with self._lock:
            conn = self._require_open()
            seen, self._seen = self._seen, None  # (known again only once this one commits)
            receipt: CommitReceipt | None = None
            in_place = False
            if seen is not None and isinstance(plan, Rerunnable):
                receipt, in_place = await self._transact_as_seen(conn, plan, seen)
            if receipt is None and isinstance(plan, InPlace):
                receipt = await self._transact_in_place(plan)
                in_place = receipt is not None
            if receipt is None:
                async with _immediate(conn, "commit", read_meta=True) as meta:
                    batch = await plan(_Reader(conn, meta))
                    if batch is None:
                        self._seen = meta
                        return CommitReceipt(client_seqs=[], records=0), False
                    receipt = await _write_batch(conn, batch, self._id_layout, commit=True)
                self._seen = None if meta is None else {**meta, **batch.meta}
            self._checkpoints.tick()
            return receipt, in_place

    async def _transact_as_seen(
        self, conn: aiosqlite.Connection, plan: Rerunnable, seen: dict[str, str]
    ) -> tuple[CommitReceipt | None, bool]:
        """``plan`` on the meta keys ``seen`` after the last commit, its batch written in place
        or in one hop if nothing changed them since (``_write_if_unchanged``), and whether it
        was in place; None when the plan must run under the lock (it read more than those
        keys, decided nothing, or another connection wrote). The lock is held, so no other
        call of this store runs between."""
        try:
            batch = await plan(cast(TxReader, _SnapshotReader(seen)))
        except NotInSnapshot:
            return None, False
        if batch is None:
            return None, False
        encoded = _encoded(batch, self._id_layout)
        receipt: CommitReceipt | None
        try:
            done, receipt = self._write_in_place(seen, batch, encoded)
            if not done:
                raw: sqlite3.Connection = conn._conn
                receipt = await conn._execute(  # type: ignore[no-untyped-call]
                    _write_if_unchanged, raw, seen, batch, *encoded
                )
        except _DB_ERRORS as exc:
            raise _storage_error("commit", exc) from exc
        if receipt is not None:
            self._seen = {**seen, **batch.meta}
        return receipt, done

    async def _transact_in_place(self, plan: InPlace) -> CommitReceipt | None:
        """An ``InPlace`` plan's transaction on the caller's thread (``_local``): ``BEGIN
        IMMEDIATE`` with ``sync_state``, the plan's reads, its batch and the ``COMMIT``, with
        no hop. None when it is not run here (then the caller runs it on the connection's
        thread; nothing was read or written): ``synchronous=FULL``, a long WAL
        (``_wal_long``), another process's write lock (never waited for here).
        Any error once the transaction is open rolls it back and is raised, as there."""
        begun = self._begin_in_place()
        if begun is None:
            return None
        local, meta = begun
        try:
            batch = await plan(_Reader(local, meta))
            if batch is None:
                local.execute("ROLLBACK")
                self._seen = meta
                return CommitReceipt(client_seqs=[], records=0)
            groups, outbox, queued_groups, queued_outbox = _encoded(batch, self._id_layout)
            receipt = _write_batch_now(
                local, batch, groups, outbox, queued_groups, queued_outbox, True
            )
        except BaseException as exc:
            _rollback_now(local, exc)
            if isinstance(exc, _DB_ERRORS):
                raise _storage_error("commit", exc) from exc
            raise
        self._seen = None if meta is None else {**meta, **batch.meta}
        return receipt

    def _write_in_place(
        self, seen: dict[str, str], batch: WriteBatch, encoded: tuple[Any, ...]
    ) -> tuple[bool, CommitReceipt | None]:
        """``_write_if_unchanged`` on the caller's thread (``_local``), for a small batch of
        new rows (a turn's): no hop to the connection's thread, whose handoff costs more than
        the batch's SQLite work. ``(False, None)`` when it is not done here: a large batch, or
        one that purges, moves or renumbers rows (those go to the connection's thread, so the
        caller's thread is never held for long), ``synchronous=FULL`` (a commit's fsync),
        a long WAL (``_wal_long``), or the write lock held by another process
        (no wait here: the connection's thread waits for it). Errors once the transaction
        is open are raised (rolled back, nothing written), as on the connection's thread."""
        if (
            batch.purge_sessions
            or batch.purge_checkpoints_for
            or batch.rechained_audit
            or batch.canonical
            or batch.renumber_outbox
            or len(batch.records) + len(batch.queued) > IN_PLACE_MAX_RECORDS
        ):
            return False, None
        groups, _, queued_groups, _ = encoded
        size = sum(len(row[-1]) for rows in groups.values() for row in rows)
        size += sum(len(row[-1]) for rows in queued_groups.values() for row in rows)
        if size > IN_PLACE_MAX_BYTES:
            return False, None
        begun = self._begin_in_place()
        if begun is None:
            return False, None
        local, meta = begun
        return True, _write_if_seen(local, meta, seen, batch, *encoded)

    def _begin_in_place(self) -> tuple[sqlite3.Connection, dict[str, str] | None] | None:
        """``BEGIN IMMEDIATE`` and ``sync_state`` on the caller's connection (``_local``), or
        None when a transaction may not be done there: ``synchronous=FULL`` (a commit's
        fsync), a long WAL (``_wal_long``), no connection there, or the write lock held by
        another process (never waited for here: the connection's thread waits for it)."""
        if self.synchronous != "NORMAL" or self._wal_long:
            return None
        local = self._local_connection()
        if local is None:
            return None
        try:
            return local, _begin_reading_meta(local)  # (in a transaction already: raises)
        except sqlite3.Error as exc:  # (busy: another process writes; or another thread)
            log.debug("no transaction in place on %r: %s", self.path, exc)
            return None

    async def gdpr_soft_delete(self, subject_key: str) -> int:
        """Clear ``subject_key``, ``request_id`` and ``detail`` of the subject's audit rows and
        mark them ``redacted``; ids, digests and hashes stay. Returns the rows touched."""
        async with self._transaction("gdpr soft delete") as conn:
            rows = await _fetch(conn, QUERIES["audit_subject"], (subject_key,))
            updates = []
            for row_id, body in rows:
                old = _decode(_AUDIT, "audit", row_id, body)
                new = msgspec.structs.replace(
                    old, subject_key=None, request_id=None, detail={}, redacted=True
                )
                updates.append((compact.encode(new), row_id))  # (the stored key)
            if updates:
                await conn.executemany(_REDACT_AUDIT, updates)
        return len(updates)

    # -- sync state -----------------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        async with self._reading("get meta") as conn:
            rows = await _fetch(conn, QUERIES["get_meta"], (key,))
        return str(rows[0][0]) if rows else None

    async def peek_meta(self, key: str) -> str | None:
        """``get_meta`` of what is committed, read at once on the caller's thread: no hop to
        the connection's thread and no wait for a write of this store in progress (whose
        value it does not see yet). On the caller's own connection (``_local``), which never
        waits for a lock (busy timeout 0): a WAL reader waits for none but in rare moments (a
        recovery), and then, as on any error, the key is read by ``get_meta``."""
        rows = self._read_now(QUERIES["get_meta"], (key,), beside_writes=True)
        if rows is None:
            return await self.get_meta(key)
        return str(rows[0][0]) if rows else None

    def _local_connection(self) -> sqlite3.Connection | None:
        """``_local``, made now if need be; None when the store is not open or it cannot be
        made (the caller then uses the connection's thread)."""
        if self._state is not _State.OPEN:
            return None
        if self._local is None:
            try:
                self._local = _local_connection(self.path, self.synchronous)
            except sqlite3.Error as exc:
                log.debug("no connection on the caller's thread for %r: %s", self.path, exc)
                return None
        return self._local

    def _close_local(self) -> None:
        local, self._local = self._local, None
        if local is not None:
            try:
                local.close()
            except sqlite3.Error as exc:  # made on another thread: its finalizer closes it
                log.debug("local connection of %r not closed here: %s", self.path, exc)

    async def set_meta(self, key: str, value: str) -> None:
        if not isinstance(value, str):
            raise StorageError(f"meta {key!r} must be a string, not {type(value).__name__}")
        self._seen = None
        async with self._transaction("set meta") as conn:
            await conn.execute(_PUT_META, (key, value))

    # -- reads ----------------------------------------------------------------------------

    async def _one(self, decoder: _Body[_T], table: str, query: str, key: str) -> _T | None:
        async with self._reading(f"read {table}") as conn:
            rows = await _fetch(conn, QUERIES[query], (_key(key),))
        return _decode(decoder, table, rows[0][0], rows[0][1]) if rows else None

    async def _many(
        self, decoder: _Body[_T], table: str, query: str, params: Sequence[Any]
    ) -> list[_T]:
        async with self._reading(f"read {table}") as conn:
            rows = await _fetch(conn, QUERIES[query], params)
        return _decode_all(decoder, table, rows)

    async def get_session(self, session_id: str) -> Session | None:
        async with self._reading("read sessions") as conn:
            rows = await _fetch(conn, QUERIES["get_session"], (_key(session_id),))
        return _sessions_of(rows)[0] if rows else None

    async def list_sessions(self, *, include_deleted: bool = False) -> list[Session]:
        """Sessions newest first (by ``updated_at``, then id, both descending)."""
        query = "list_sessions_all" if include_deleted else "list_sessions"
        async with self._reading("read sessions") as conn:
            rows = await _fetch(conn, QUERIES[query])
        return _sessions_of(rows)

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        """Messages in the order of ``message_ids``; unknown ids are skipped."""
        if not message_ids:
            return []
        keys = _keys(message_ids)
        async with self._reading("read messages") as conn:
            rows = await _selected(conn, _select_messages, keys)
        return _messages_in_order(keys, message_ids, rows)  # (decoded once the lock is let go)

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return await self._one(_CHECKPOINT, "checkpoints", "get_checkpoint", checkpoint_id)

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        """Checkpoints of a session, oldest first (by hlc, then id)."""
        key = _key(session_id)
        return _in_order(await self._many(_CHECKPOINT, "checkpoints", "list_checkpoints", (key,)))

    async def child_checkpoints(self, session_id: str, parent_id: str) -> list[Checkpoint]:
        """The session's checkpoints whose parent is ``parent_id``, oldest first."""
        async with self._reading("read checkpoints") as conn:
            keys = (_key(session_id), _key(parent_id))
            rows = await _fetch(conn, QUERIES["child_checkpoints"], keys)
        return _in_order(
            decode_children(
                rows, parent_id, lambda key, body: _decode(_CHECKPOINT, "checkpoints", key, body)
            )
        )

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, types: Collection[str] | None = None
    ) -> list[Event]:
        """Events with ``sequence_number >= from_sequence``, by sequence number, then id;
        only those of ``types`` when given."""
        async with self._reading("read events") as conn:
            wanted = None if types is None else _type_keys(types)
            key = _key(session_id)
            rows = await _selected(conn, _select_events, key, from_sequence, -1, wanted)
        return decode_events(rows, types, lambda key, body: _decode(_EVENT, "events", key, body))

    async def event_payloads(
        self, session_id: str, types: Collection[str]
    ) -> list[tuple[str, dict[str, Any]]]:
        """``(type, payload)`` of the session's events of ``types``, by sequence number, then
        id; only those two fields are decoded."""
        return (await self.hydration_log(session_id, types, ()))[0]

    async def hydration_log(
        self,
        session_id: str,
        tallied: Collection[str],
        whole: Collection[str],
        *,
        from_sequence: int = 0,
    ) -> tuple[list[tuple[str, dict[str, Any]]], list[Event]]:
        async with self._reading("read events") as conn:
            wanted = _type_keys({*tallied, *whole})
            key = _key(session_id)
            rows = await _selected(conn, _select_events, key, from_sequence, -1, wanted)
        return decode_log(
            rows, tallied, whole, lambda key, body: _decode(_EVENT, "events", key, body)
        )

    async def hydration_key(self, session_id: str, *, upto: int | None = None) -> HydrationKey:
        params = (_key(session_id), _LAST_SEQUENCE if upto is None else upto)
        async with self._reading("read events") as conn:
            rows = await _fetch(conn, QUERIES["hydration_key"], params)
        if not rows:
            return (0, 0, "")
        count, key, body = rows[0]
        place = event_place_of(body, partial(_decode, _EVENT, "events", key, body))
        return (int(count), place.sequence_number, place.row_hash)

    async def kept_hydration(self, session_id: str) -> KeptHydration | None:
        async with self._reading("read hydrations") as conn:
            rows = await _fetch(conn, QUERIES["kept_hydration"], (_key(session_id),))
        if not rows:
            return None
        events, sequence_number, row_hash, version, body = rows[0]
        return KeptHydration((events, sequence_number, row_hash), version, bytes(body))

    async def keep_hydration(self, session_id: str, kept: KeptHydration) -> None:
        (events, sequence_number, row_hash), version, body = kept
        async with self._transaction("keep hydration") as conn:
            await conn.execute(
                _KEEP_HYDRATION,
                (_key(session_id), events, sequence_number, row_hash, version, body),
            )

    async def get_event(self, event_id: str) -> Event | None:
        return await self._one(_EVENT, "events", "get_event", event_id)

    async def list_audit(
        self, *, session_id: str | None = None, client_id: str | None = None
    ) -> list[AuditRow]:
        """Audit rows ordered by (client_id, sequence_number, id), each id as its text (the
        memory store's order). The file reads them by device number and place (schema 12),
        or a session's in the order they were written (schema 17), each device's rows a run
        in order, which the sort here merges."""
        if session_id is not None and client_id is not None:
            both = (_key(session_id), _key(client_id))
            rows = await self._many(_AUDIT, "audit", "list_audit_both", both)
        elif session_id is not None:
            rows = await self._many(_AUDIT, "audit", "list_audit_session", (_key(session_id),))
        elif client_id is not None:
            rows = await self._many(_AUDIT, "audit", "list_audit_client", (_key(client_id),))
        else:
            rows = await self._many(_AUDIT, "audit", "list_audit", ())
        rows.sort(key=_AUDIT_ORDER)
        return rows

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        """Updates of one artifact by hlc, then id (any order merges to the same document)."""
        return await self._many(
            _ARTIFACT, "artifact_updates", "list_artifact_updates", (_key(artifact_id),)
        )

    # -- outbox ---------------------------------------------------------------------------

    async def outbox_pending(self, limit: int = 500, *, after: int = 0) -> list[OutboxEntry]:
        """Oldest first, by client_seq; those after ``after``. Read in place (``_read_now``)
        when it can be: a flush reads here right after a turn's commit, on the live path."""
        params = (after, max(limit, 0))
        read = self._read_now_with(_outbox_read, *params)
        if read is None:
            async with self._reading("read outbox") as conn:
                read = await _selected(conn, _outbox_read, *params)
        return _outbox_entries(*read)

    def _read_now(
        self, sql: str, params: Sequence[Any], *, beside_writes: bool = False
    ) -> list[Any] | None:
        """``sql``'s rows read at once on the caller's thread, on its own connection
        (``_local``), with no hop; None when they cannot be: a write of this store in progress
        (``_lock`` held for anything but a read: a read waits for it, as under ``_reading``;
        ``beside_writes``: read what is committed anyway), a transaction open there (an
        ``InPlace`` plan waiting on something else), or any error (the busy timeout there is
        0: a WAL read waits for nothing but in rare moments, a recovery). The caller then
        reads on the connection's thread. A read holding the lock (an app's, say, right after
        a turn, as the flush reads the turn's outbox rows) is no reason to wait: the two read
        on connections of their own."""
        rows: list[Any] | None = self._read_now_with(
            _rows_now, sql, params, beside_writes=beside_writes
        )
        return rows

    def _read_now_with(
        self, read: Callable[..., _S], *args: Any, beside_writes: bool = False
    ) -> _S | None:
        """``read(local, *args)`` at once on the caller's own connection, as ``_read_now``
        reads a statement's rows; None when it cannot be (the same cases)."""
        if self._lock.locked() and not (beside_writes or self._lock_reads):
            return None
        local = self._local_connection()
        if local is None:
            return None
        try:
            if local.in_transaction:
                return None
            return read(local, *args)
        except sqlite3.Error as exc:  # (and another thread's call: ProgrammingError)
            with contextlib.suppress(sqlite3.Error):  # (a read of its own that failed)
                if local.in_transaction:
                    local.execute("ROLLBACK")
            log.debug("read in place on %r failed, read on the connection: %s", self.path, exc)
            return None

    async def outbox_count(self) -> int:
        return await self._count("outbox_count")

    async def last_client_seq(self) -> int:
        async with self._reading("read last client_seq") as conn:
            return await _last_seq(conn)

    async def _count(self, query: str) -> int:
        async with self._reading(query) as conn:
            rows = await _fetch(conn, QUERIES[query])
        return int(rows[0][0])

    async def outbox_remove(self, client_seqs: list[int]) -> None:
        """Drop acknowledged entries; unknown sequence numbers are ignored."""
        if not client_seqs:
            return
        async with self._lock:
            conn = self._require_open()
            if not self._reclaims:
                await _in_one_hop(conn, "outbox remove", _delete_queued, client_seqs)
                return
            try:  # one hop: the removal, then the reclaim
                await conn._execute(_delete_queued_and_reclaim, conn._conn, client_seqs)  # type: ignore[no-untyped-call]
            except _DB_ERRORS as exc:
                raise _storage_error("outbox remove", exc) from exc

    async def outbox_mark_attempt(
        self, client_seqs: list[int], code: int | None, message: str | None
    ) -> None:
        """Count one more failed attempt with its error; entries stay queued."""
        if not client_seqs:
            return
        async with self._transaction("outbox mark attempt") as conn:
            await _selected(conn, _mark_attempt, client_seqs, code, message)

    async def outbox_dead_letter(self, client_seq: int, code: int, message: str) -> None:
        """Move one entry to dead_letters, keeping its attempts count (count the rejecting
        attempt with ``outbox_mark_attempt`` first if it should show); unknown seq: no-op."""
        async with self._transaction("outbox dead letter") as conn:
            await _selected(conn, _dead_letter, client_seq, code, message, time.time())

    async def dead_letters(self) -> list[DeadLetter]:
        """Dead letters by client_seq."""
        async with self._reading("read dead letters") as conn:
            rows = await _fetch(conn, QUERIES["dead_letters"])
        return [
            DeadLetter(
                client_seq=seq,
                record=_decode(_RECORD, "dead_letters", seq, body),
                code=code,
                message=message,
                attempts=attempts,
                failed_at=failed_at,
            )
            for seq, body, code, message, attempts, failed_at in rows
        ]

    async def dead_letter_count(self) -> int:
        return await self._count("dead_letter_count")

    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Re-enqueue a dead letter under a new client_seq (returned, with attempts reset);
        None if unknown."""
        async with self._transaction("retry dead letter") as conn:
            seq: int | None = await _selected(conn, _retry_dead_letter, client_seq)
        return seq

    async def discard_dead_letter(self, client_seq: int) -> bool:
        """Forget a dead letter for good; False if unknown."""
        async with self._transaction("discard dead letter") as conn:
            cursor = await conn.execute(
                "DELETE FROM dead_letters WHERE client_seq = ?", (client_seq,)
            )
            return cursor.rowcount > 0


def _mark_attempt(
    raw: sqlite3.Connection, client_seqs: list[int], code: int | None, message: str | None
) -> None:
    """``outbox_mark_attempt`` in the open transaction: one more failed attempt, with its
    error, for each queued entry of ``client_seqs`` (its row's ``tried``); others are
    ignored."""
    numbers = set(client_seqs)
    updates: list[tuple[bytes | None, int]] = []
    for first, entries, tries in _rows_holding(raw, numbers):
        changed = False
        for at, entry in enumerate(entries):
            if entry is not None and first + at in numbers:
                tries[at] = (tries.get(at, _UNTRIED)[0] + 1, code, message)
                changed = True
        if changed:
            updates.append((queued.tried(tries), first))
    raw.executemany("UPDATE outbox SET tried = ? WHERE client_seq = ?", updates)


def _dead_letter(
    raw: sqlite3.Connection, client_seq: int, code: int, message: str, failed_at: float
) -> None:
    """``outbox_dead_letter`` in the open transaction: the entry with the body a push sends
    (a long session's with its blocks: ``_entries_of``) and its attempts into
    ``dead_letters``, and gone from the outbox; an unknown number does nothing."""
    found = _queued_after(raw, client_seq - 1, 1)
    if not found or found[0][0] != client_seq:
        return
    _, entry, _, _ = found[0]
    rows, _ = _entries_of(*_outbox_read(raw, client_seq - 1, 1))
    attempts = rows[0][2] if rows else 0
    raw.execute(
        "INSERT INTO dead_letters "
        "(client_seq, record_id, kind, body, code, message, attempts, failed_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            client_seq,
            entry.key,
            entry.kind,
            rows[0][1] if rows else None,
            code,
            message,
            attempts,
            failed_at,
        ),
    )
    _delete_queued(raw, [client_seq])


def _retry_dead_letter(raw: sqlite3.Connection, client_seq: int) -> int | None:
    """``retry_dead_letter`` in the open transaction: the dead letter queued again, its own
    copy of the body in its entry, under the next number (returned); None if unknown."""
    row = raw.execute(
        "SELECT record_id, kind, body FROM dead_letters WHERE client_seq = ?", (client_seq,)
    ).fetchone()
    if row is None:
        return None
    record_id, kind, body = row
    last = raw.execute(_LAST_SEQ).fetchone()
    seq = (int(last[0]) if last is not None else 0) + 1
    _put_queued(raw, seq, [queued.Queued(_kind_code(kind), record_id, bytes(body))], _now_ms())
    raw.execute("DELETE FROM dead_letters WHERE client_seq = ?", (client_seq,))
    return seq


def _rollback_now(raw: sqlite3.Connection, cause: BaseException) -> None:
    """``_rollback`` on the caller's thread."""
    try:
        if raw.in_transaction:
            raw.execute("ROLLBACK")
    except sqlite3.Error as exc:
        cause.add_note(f"rollback also failed: {exc}")


def _local_connection(path: str, synchronous: Synchronous) -> sqlite3.Connection:
    """A connection of the caller's thread (``SQLiteAdapter._local``): it never waits for a
    lock (busy timeout 0: the caller then uses the connection's thread, which waits) and
    never checkpoints the WAL itself (``wal_autocheckpoint = 0``: the side checkpoints do,
    and the connection's own when they fall behind), so nothing it runs blocks its thread
    for longer than its own statements."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        sql_functions(conn)  # (as the store's)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
    except BaseException:
        conn.close()
        raise
    return conn


def _probe(path: str) -> None:
    sqlite3.connect(path).close()


async def _close_after_error(conn: aiosqlite.Connection, cause: BaseException) -> None:
    try:
        await conn.close()
    except _DB_ERRORS as exc:
        cause.add_note(f"closing the connection also failed: {exc}")
