"""``SQLiteServerStore``: the embedded default server store, over aiosqlite.

One file, WAL mode, two connections: a writer (every push and compaction runs in ONE
``BEGIN IMMEDIATE`` transaction, serialized by a lock because aiosqlite shares one connection
between callers) and a reader (pulls and lookups, each in one read transaction, so they never
see a push that has not committed). The push rules live in ``apply.py``; this module only
speaks SQL: a push batch is a handful of statements whatever its size (``_SQLiteTx``, one
``execute_fetchall`` per lookup and one ``executemany`` per table written); a small push runs
them on the event loop's thread, on the writer's own connection, and only its ``COMMIT`` (the
fsync) on aiosqlite's (``SQLiteServerStore._write``). ``sqlite3`` errors are translated to
``StorageUnavailable`` (3009, retryable).

Schema (versioned by ``PRAGMA user_version``, migrated at ``open()``):

- ``tenants``: each ``(org_id, user_id)`` under a number, ``tid``; every other table names
  its tenant by it (a push adds its tenant in its first hop; statements find the number by
  the ``(org_id, user_id)`` key, once per statement).
- ``sessions``: one row per session id, its body.
- ``records``: immutable records (checkpoints, audit rows, artifact updates), keyed by
  ``(tid, kind, id)`` in a unique index (a rowid table: bodies pack into its pages); a
  record's rowid is its feed entry's cursor (schema 11). An audit row whose body leaves out
  its prev_hash names the row that holds it (``prev_row``, schema 22).
- ``messages``: the messages, as ``records`` keeps the others (schema 14): rows appended in
  feed order fill their pages when rows of like sizes follow each other; a turn's reply
  after its small rows closed a page with a fifth of it unused.
- ``events``: canonical events; ``(chain, sequence_number)`` is unique; an event's rowid is
  its feed entry's cursor, too.
- ``chains``: each tenant's session that has events or records, under a number, ``n``: an
  event names its session's chain by it (``chain``, schema 19), a record its session
  (``session``, schema 20).
- ``feed``: every applied change per tenant under a global monotonic ``cursor``, by kind (a
  pull reads each body from its row: a record's or an event's at the rowid of its cursor, so
  its entry names no id, schema 16; a session's by its id), kept by ``(tid, cursor)`` (a
  ``WITHOUT ROWID`` table, schema 17: a pull reads it in order), the last cursor given in
  ``feed_head``; a session keeps one entry, its latest version's, found through
  ``feed_session``, an index of sessions' entries alone.
- ``clients``: ``last_seq`` per ``(tid, client_id)``.
- ``meta``: the feed floor per tenant (entries at or below it were compacted away).
- ``audit_chains``: each tenant's device (client id) with audit rows, under a number, ``n``.
- ``audit_places``: where each audit row sits in its device's chain: the chain's number, the
  sequence number, and the rowid of its row in ``records`` (schema 21), so that a push reads
  a chain's last place with one index probe, and its row hash from that row's body.

Every id in a row or an index is kept as its key (``_key``, ``pleach_key`` in SQL): a
canonical UUID as its 16 bytes, any other id as its text, as the device's file keeps them; a
row hash as its 32 bytes (``pleach_digest``). Statements take and give ids as text: a lookup
converts its keys in SQL and answers with the keys as it was given them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import os
import sqlite3
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, Final, Literal, TypeVar

import aiosqlite
import msgspec

from shared import compact
from shared.aio import Every
from shared.clock import HybridClock
from shared.compact import KINDS
from shared.errors import CursorTooOld, InvalidState, StorageError, StorageUnavailable
from shared.idrefs import SQLITE_ID_LAYOUT, IdLayout, joined_blocks, rechunked
from shared.records import (
    CASCADE_KINDS,
    AuditRow,
    Change,
    Event,
    Message,
    Session,
    kind_of,
    record_kind,
)
from shared.resource import AsyncResource

from .apply import (
    BatchKeys,
    BatchWrites,
    Snapshot,
    StoreTx,
    apply_push,
    batch_keys,
    claimed_concurrently,
    content_to_delete,
)
from .base import (
    MAX_DEVICES_PER_TENANT,
    DeviceHealth,
    PullResult,
    PushResult,
    Tenant,
    decode_body,
    decode_stored,
    device_node,
    feed_page,
    packed_tenant,
    session_row,
    stored_body,
    stored_session,
)

__all__ = ["DEFAULT_MAX_PULL_LIMIT", "SQLiteServerStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_PULL_LIMIT = 1000
"""A pull returns at most this many feed entries, whatever limit it asks for."""

DEFAULT_BUSY_TIMEOUT_MS = 5000

# Every feed entry of a versioned record (a session) but its latest: a later entry refers to
# the same row, which holds the latest version only.
_DROP_SUPERSEDED_SQL = """
    DELETE FROM feed WHERE kind = 'Session' AND EXISTS (
        SELECT 1 FROM feed AS later WHERE later.org_id = feed.org_id
        AND later.user_id = feed.user_id AND later.kind = feed.kind
        AND later.record_id = feed.record_id AND later.cursor > feed.cursor)"""


def _kind_number(column: str) -> str:
    """SQL: the number of the kind named in ``column`` (its index in ``compact.KINDS``, which
    never changes); NULL for a name that is no kind."""
    cases = " ".join(f"WHEN '{name}' THEN {number}" for number, name in enumerate(KINDS))
    return f"CASE {column} {cases} END"


_KIND_NUMBERS: Final = {name: number for number, name in enumerate(KINDS)}
_SESSION_KIND: Final = _KIND_NUMBERS["Session"]
_EVENT_KIND: Final = _KIND_NUMBERS["Event"]
_MESSAGE_KIND: Final = _KIND_NUMBERS["Message"]
_AUDIT_KIND: Final = _KIND_NUMBERS["AuditRow"]


# One tuple of statements per schema version; never edit a shipped version, append a new one.
Step = str | Callable[[aiosqlite.Connection], Awaitable[None]]
"""A migration step: a statement, or a function run on the connection (a backfill)."""


async def _backfill_audit_places(conn: aiosqlite.Connection) -> None:
    """Migration 5: the place of every audit row already stored (read from its body)."""
    rows = await _fetchall(
        conn, "SELECT org_id, user_id, body FROM records WHERE kind = ?", ("AuditRow",)
    )
    places = []
    for org_id, user_id, body in rows:
        row = decode_body(body)
        if isinstance(row, AuditRow):
            places.append(
                (org_id, user_id, row.client_id, row.sequence_number, row.row_hash, row.id)
            )
    await conn.executemany(
        "INSERT INTO audit_places (org_id, user_id, client_id, sequence_number, row_hash, id) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        places,
    )


async def _backfill_packed_tenants(conn: aiosqlite.Connection) -> None:
    """Migration 12: each tenant's org and user packed as a body holds them (``_packed``)."""
    rows = await _fetchall(conn, "SELECT tid, org_id, user_id FROM tenants")
    await conn.executemany(
        "UPDATE tenants SET packed = ? WHERE tid = ?",
        [(packed_tenant(Tenant(org_id=org, user_id=user)), tid) for tid, org, user in rows],
    )


# The records and events tables as migration 8 made them (migration 11 makes them again).
_RECORDS_COLUMNS: Final = """(
    kind INTEGER NOT NULL,
    id BLOB NOT NULL,
    tid INTEGER NOT NULL,
    session_id BLOB,
    body BLOB NOT NULL
)"""
_RECORDS_COLUMNS_13: Final = """(
    kind INTEGER NOT NULL,
    id BLOB NOT NULL,
    tid INTEGER NOT NULL,
    session_id BLOB,
    body BLOB NOT NULL,
    device INTEGER
)"""
"""The records' columns since migration 13 (``records`` and, since 14, ``messages``)."""
_RECORDS_COLUMNS_20: Final = """(
    kind INTEGER NOT NULL,
    id BLOB NOT NULL,
    tid INTEGER NOT NULL,
    session INTEGER,
    body BLOB NOT NULL,
    device INTEGER
)"""
"""The records' columns since migration 20: the session's number (``chains``)."""
_EVENTS_COLUMNS: Final = """(
    id BLOB NOT NULL,
    session_id BLOB NOT NULL,
    sequence_number INTEGER NOT NULL,
    tid INTEGER NOT NULL,
    body BLOB NOT NULL,
    UNIQUE (tid, id),
    UNIQUE (tid, session_id, sequence_number)
)"""


async def _rechunk_id_blocks(conn: aiosqlite.Connection) -> None:
    """Migration 18: ``session_ids`` made again as a rowid table, every session's id blocks
    cut again into ``SQLITE_ID_LAYOUT``'s."""
    rows = await _fetchall(conn, "SELECT tid, id, part, ids FROM session_ids ORDER BY tid, id")
    sessions: dict[tuple[int, Any], list[tuple[int, bytes]]] = {}
    for tid, key, part, ids in rows:
        sessions.setdefault((tid, key), []).append((int(part), bytes(ids)))
    await conn.execute("DROP TABLE session_ids")
    await conn.execute(
        """CREATE TABLE session_ids (
            tid INTEGER NOT NULL,
            id BLOB NOT NULL,
            part INTEGER NOT NULL,
            ids BLOB NOT NULL,
            PRIMARY KEY (tid, id, part)
        )"""
    )
    await conn.executemany(
        "INSERT INTO session_ids (tid, id, part, ids) VALUES (?, ?, ?, ?)",
        [
            (tid, key, part, ids)
            for (tid, key), blocks in sessions.items()
            for part, ids in rechunked(blocks, SQLITE_ID_LAYOUT.block)
        ],
    )


_OWN_ROW_16: Final = f"""CASE f.kind
    WHEN {_SESSION_KIND} THEN 0
    WHEN {_EVENT_KIND} THEN EXISTS (SELECT 1 FROM events AS e WHERE e.rowid = f.cursor
        AND e.tid = f.tid AND e.id = f.record_id)
    WHEN {_MESSAGE_KIND} THEN EXISTS (SELECT 1 FROM messages AS r WHERE r.rowid = f.cursor
        AND r.tid = f.tid AND r.kind = f.kind AND r.id = f.record_id)
    ELSE EXISTS (SELECT 1 FROM records AS r WHERE r.rowid = f.cursor
        AND r.tid = f.tid AND r.kind = f.kind AND r.id = f.record_id) END"""
"""Migration 16: whether feed entry ``f``'s row is at its cursor, in the table of its kind,
and bears its id (then the entry need not name it: ``_own_row``). Frozen with its version."""

_PLACES_21_SQL: Final = f"""
    INSERT INTO audit_places_21 (chain, sequence_number, row)
    SELECT c.n, p.sequence_number, r.rowid FROM audit_places AS p
    CROSS JOIN audit_chains AS c ON c.tid = p.tid AND c.client_id = p.client_id
    CROSS JOIN records AS r ON r.tid = p.tid AND r.kind = {_AUDIT_KIND} AND r.id = p.id
    ORDER BY c.n, p.sequence_number, r.rowid"""
"""Migration 21: each place with its chain's number and its row's rowid, the places the outer
loop (``CROSS JOIN``: with a plain one the planner scanned the records and searched each
tenant's places for each, 23 s for 11,050 places where 0.05)."""

_MIGRATIONS: tuple[tuple[Step, ...], ...] = (
    (
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            body BLOB NOT NULL
        )""",
        "CREATE INDEX sessions_tenant ON sessions (org_id, user_id, updated_at)",
        """CREATE TABLE records (
            kind TEXT NOT NULL,
            id TEXT NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            session_id TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (kind, id)
        ) WITHOUT ROWID""",
        "CREATE INDEX records_session ON records (session_id)",
        "CREATE INDEX records_tenant ON records (org_id, user_id, session_id)",
        """CREATE TABLE events (
            id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            row_hash TEXT NOT NULL,
            body BLOB NOT NULL,
            UNIQUE (session_id, sequence_number)
        )""",
        "CREATE INDEX events_tenant ON events (org_id, user_id, session_id)",
        """CREATE TABLE feed (
            cursor INTEGER PRIMARY KEY AUTOINCREMENT,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            record_id TEXT NOT NULL,
            body BLOB NOT NULL
        )""",
        "CREATE INDEX feed_tenant ON feed (org_id, user_id, cursor)",
        """CREATE TABLE clients (
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            client_id TEXT NOT NULL,
            last_seq INTEGER NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id)
        ) WITHOUT ROWID""",
        """CREATE TABLE meta (
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            feed_floor INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (org_id, user_id)
        ) WITHOUT ROWID""",
    ),
    # 2: compaction finds the later versions of a record.
    ("CREATE INDEX feed_record ON feed (org_id, user_id, kind, record_id, cursor)",),
    # 3: the latest health each device reported (the /status page).
    (
        """CREATE TABLE devices (
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            client_id TEXT NOT NULL,
            seen_at REAL NOT NULL,
            health BLOB NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id)
        ) WITHOUT ROWID""",
        "CREATE INDEX devices_seen ON devices (seen_at)",
    ),
    # 4: ids are scoped to their tenant: a record, event or session id one user holds does not
    # stop another user from holding the same id (nobody can squat another user's ids).
    (
        """CREATE TABLE sessions_4 (
            id TEXT NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (org_id, user_id, id)
        ) WITHOUT ROWID""",
        "INSERT INTO sessions_4 SELECT id, org_id, user_id, updated_at, body FROM sessions",
        "DROP TABLE sessions",
        "ALTER TABLE sessions_4 RENAME TO sessions",
        "CREATE INDEX sessions_tenant ON sessions (org_id, user_id, updated_at)",
        """CREATE TABLE records_4 (
            kind TEXT NOT NULL,
            id TEXT NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            session_id TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (org_id, user_id, kind, id)
        ) WITHOUT ROWID""",
        "INSERT INTO records_4 SELECT kind, id, org_id, user_id, session_id, body FROM records",
        "DROP TABLE records",
        "ALTER TABLE records_4 RENAME TO records",
        "CREATE INDEX records_tenant ON records (org_id, user_id, session_id)",
        """CREATE TABLE events_4 (
            id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            row_hash TEXT NOT NULL,
            body BLOB NOT NULL,
            UNIQUE (org_id, user_id, id),
            UNIQUE (org_id, user_id, session_id, sequence_number)
        )""",
        "INSERT INTO events_4 (id, session_id, sequence_number, org_id, user_id, row_hash, body) "
        "SELECT id, session_id, sequence_number, org_id, user_id, row_hash, body FROM events "
        "ORDER BY rowid",
        "DROP TABLE events",
        "ALTER TABLE events_4 RENAME TO events",
    ),
    # 5: each audit row's place in its device's chain: a push checks that a row continues it.
    (
        """CREATE TABLE audit_places (
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            client_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            row_hash TEXT NOT NULL,
            id TEXT NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id, sequence_number, id)
        ) WITHOUT ROWID""",
        _backfill_audit_places,
    ),
    # 6: records in a rowid table (the key in a unique index): a WITHOUT ROWID table keeps at
    # most about a quarter of a page of each row in the tree, so every body of a kilobyte or
    # so (a message) took an overflow page of its own, and the table grew to 3.4x its bodies.
    (
        """CREATE TABLE records_6 (
            kind TEXT NOT NULL,
            id TEXT NOT NULL,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            session_id TEXT,
            body BLOB NOT NULL
        )""",
        "INSERT INTO records_6 (kind, id, org_id, user_id, session_id, body) "
        "SELECT kind, id, org_id, user_id, session_id, body FROM records",
        "DROP TABLE records",
        "ALTER TABLE records_6 RENAME TO records",
        "CREATE UNIQUE INDEX records_key ON records (org_id, user_id, kind, id)",
        "CREATE INDEX records_tenant ON records (org_id, user_id, session_id)",
    ),
    # 7: the feed refers to its records (kind and id) instead of holding a second copy of
    # each body, and a session keeps one entry, its latest version's: every version of a
    # session row a device pushed stayed in the feed, so a session synced turn by turn cost
    # the sum of all its versions (about 5 MB for 300 turns, growing with the square).
    # AUTOINCREMENT's high-water mark is carried over, so no cursor is ever handed out twice.
    (
        _DROP_SUPERSEDED_SQL,
        """CREATE TABLE feed_7 (
            cursor INTEGER PRIMARY KEY AUTOINCREMENT,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            record_id TEXT NOT NULL
        )""",
        "INSERT INTO feed_7 (cursor, org_id, user_id, kind, record_id) "
        "SELECT cursor, org_id, user_id, kind, record_id FROM feed",
        "DELETE FROM sqlite_sequence WHERE name = 'feed_7'",
        "INSERT INTO sqlite_sequence (name, seq) "
        "SELECT 'feed_7', seq FROM sqlite_sequence WHERE name = 'feed'",
        "DROP TABLE feed",
        "ALTER TABLE feed_7 RENAME TO feed",
        "CREATE INDEX feed_tenant ON feed (org_id, user_id, cursor)",
        "CREATE INDEX feed_record ON feed (org_id, user_id, kind, record_id, cursor)",
    ),
    # 8: a tenant is a number (``tenants``), an id is kept as its key (a canonical UUID as its
    # 16 bytes, any other id as its text: ``pleach_key``, the device file's rule), a kind as its
    # number in ``compact.KINDS`` and a row hash as its 32 bytes (``pleach_digest``), in every
    # row and index; an event's row hash is read from its body (which holds it) instead of a
    # column of its own. The tenant as text and ids
    # and hashes as text were about two fifths of the file: a 1,000-turn conversation took
    # 7.5 MB for 3.2 MB of bodies. Rows keep their order; the feed keeps its cursors and
    # AUTOINCREMENT's high-water mark.
    (
        """CREATE TABLE tenants (
            tid INTEGER PRIMARY KEY,
            org_id TEXT NOT NULL,
            user_id TEXT NOT NULL,
            UNIQUE (org_id, user_id)
        )""",
        "INSERT INTO tenants (org_id, user_id) SELECT org_id, user_id FROM ("
        + " UNION ".join(
            f"SELECT org_id, user_id FROM {table}"
            for table in ("feed", "sessions", "records", "events", "clients", "meta")
        )
        + " UNION SELECT org_id, user_id FROM audit_places) ORDER BY org_id, user_id",
        """CREATE TABLE sessions_8 (
            tid INTEGER NOT NULL,
            id BLOB NOT NULL,
            updated_at TEXT NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (tid, id)
        ) WITHOUT ROWID""",
        "INSERT INTO sessions_8 (tid, id, updated_at, body) "
        "SELECT t.tid, pleach_key(s.id), s.updated_at, s.body "
        "FROM sessions AS s JOIN tenants AS t USING (org_id, user_id)",
        "DROP TABLE sessions",
        "ALTER TABLE sessions_8 RENAME TO sessions",
        "CREATE INDEX sessions_tenant ON sessions (tid, updated_at)",
        "CREATE TABLE records_8 " + _RECORDS_COLUMNS,
        "INSERT INTO records_8 (kind, id, tid, session_id, body) "
        f"SELECT {_kind_number('r.kind')}, pleach_key(r.id), t.tid, pleach_key(r.session_id), "
        "r.body "
        "FROM records AS r JOIN tenants AS t USING (org_id, user_id) ORDER BY r.rowid",
        "DROP TABLE records",
        "ALTER TABLE records_8 RENAME TO records",
        "CREATE UNIQUE INDEX records_key ON records (tid, kind, id)",
        "CREATE INDEX records_tenant ON records (tid, session_id)",
        "CREATE TABLE events_8 " + _EVENTS_COLUMNS,
        "INSERT INTO events_8 (id, session_id, sequence_number, tid, body) "
        "SELECT pleach_key(e.id), pleach_key(e.session_id), e.sequence_number, t.tid, e.body "
        "FROM events AS e JOIN tenants AS t USING (org_id, user_id) ORDER BY e.rowid",
        "DROP TABLE events",
        "ALTER TABLE events_8 RENAME TO events",
        """CREATE TABLE feed_8 (
            cursor INTEGER PRIMARY KEY AUTOINCREMENT,
            tid INTEGER NOT NULL,
            kind INTEGER NOT NULL,
            record_id BLOB NOT NULL
        )""",
        "INSERT INTO feed_8 (cursor, tid, kind, record_id) "
        f"SELECT f.cursor, t.tid, {_kind_number('f.kind')}, pleach_key(f.record_id) "
        "FROM feed AS f JOIN tenants AS t USING (org_id, user_id) ORDER BY f.cursor",
        "DELETE FROM sqlite_sequence WHERE name = 'feed_8'",
        "INSERT INTO sqlite_sequence (name, seq) "
        "SELECT 'feed_8', seq FROM sqlite_sequence WHERE name = 'feed'",
        "DROP TABLE feed",
        "ALTER TABLE feed_8 RENAME TO feed",
        "CREATE INDEX feed_tenant ON feed (tid, cursor)",
        "CREATE INDEX feed_record ON feed (tid, kind, record_id, cursor)",
        """CREATE TABLE clients_8 (
            tid INTEGER NOT NULL,
            client_id TEXT NOT NULL,
            last_seq INTEGER NOT NULL,
            PRIMARY KEY (tid, client_id)
        ) WITHOUT ROWID""",
        "INSERT INTO clients_8 (tid, client_id, last_seq) SELECT t.tid, c.client_id, c.last_seq "
        "FROM clients AS c JOIN tenants AS t USING (org_id, user_id)",
        "DROP TABLE clients",
        "ALTER TABLE clients_8 RENAME TO clients",
        """CREATE TABLE meta_8 (
            tid INTEGER PRIMARY KEY,
            feed_floor INTEGER NOT NULL DEFAULT 0
        )""",
        "INSERT INTO meta_8 (tid, feed_floor) SELECT t.tid, m.feed_floor "
        "FROM meta AS m JOIN tenants AS t USING (org_id, user_id)",
        "DROP TABLE meta",
        "ALTER TABLE meta_8 RENAME TO meta",
        # The key's columns first: SQLite 3.40's integrity_check reports a false NULL in a
        # WITHOUT ROWID table's column that precedes a key column.
        """CREATE TABLE audit_places_8 (
            tid INTEGER NOT NULL,
            client_id TEXT NOT NULL,
            sequence_number INTEGER NOT NULL,
            id BLOB NOT NULL,
            row_hash BLOB NOT NULL,
            PRIMARY KEY (tid, client_id, sequence_number, id)
        ) WITHOUT ROWID""",
        "INSERT INTO audit_places_8 (tid, client_id, sequence_number, row_hash, id) "
        "SELECT t.tid, p.client_id, p.sequence_number, pleach_digest(p.row_hash), "
        "pleach_key(p.id) FROM audit_places AS p JOIN tenants AS t USING (org_id, user_id)",
        "DROP TABLE audit_places",
        "ALTER TABLE audit_places_8 RENAME TO audit_places",
    ),
    # 9: a long session's message ids in blocks beside its row (``base.session_row``): the
    # row was rewritten whole at each turn, every id the session had (320 KB at 20,000).
    (
        "ALTER TABLE sessions ADD COLUMN ids_count INTEGER",
        """CREATE TABLE session_ids (
            tid INTEGER NOT NULL,
            id BLOB NOT NULL,
            part INTEGER NOT NULL,
            ids BLOB NOT NULL,
            PRIMARY KEY (tid, id, part)
        ) WITHOUT ROWID""",
    ),
    # 10: records pushed at protocol 8 are stored in its form (``shared.compact``), which a
    # build before reads as corrupt rows. No table changes: the version makes such a build
    # refuse the file ("upgrade pleach") instead of failing row by row.
    ("SELECT 1",),
    # 11: an immutable record's or an event's rowid is its feed cursor (its one entry: a
    # record is written once, with its entry, in the same batch), so that deleting a session's
    # content finds the entries by cursor, and the feed's index by record keeps the entries of
    # sessions alone: it held every entry's kind and id a second time (0.27 MB of a 4.5 MB
    # file at 1,000 turns). A row whose entry has gone keeps a negative rowid, which no
    # cursor takes. An immutable record's older entries (none since version 7) go first: its
    # one row answers them all, and a delete must leave none behind. The feed's index by
    # tenant holds the cursor once: it is the rowid every entry of an index ends with, and
    # (tid, cursor) held it twice.
    (
        f"DELETE FROM feed WHERE kind <> {_SESSION_KIND} AND EXISTS (SELECT 1 FROM feed AS "
        "later WHERE later.tid = feed.tid AND later.kind = feed.kind "
        "AND later.record_id = feed.record_id AND later.cursor > feed.cursor)",
        "CREATE TABLE records_11 " + _RECORDS_COLUMNS,
        "INSERT INTO records_11 (rowid, kind, id, tid, session_id, body) "
        "SELECT COALESCE((SELECT f.cursor FROM feed AS f WHERE f.tid = r.tid "
        "AND f.kind = r.kind AND f.record_id = r.id), -r.rowid) AS place, "
        "r.kind, r.id, r.tid, r.session_id, r.body FROM records AS r ORDER BY place",
        "DROP TABLE records",
        "ALTER TABLE records_11 RENAME TO records",
        "CREATE UNIQUE INDEX records_key ON records (tid, kind, id)",
        "CREATE INDEX records_tenant ON records (tid, session_id)",
        "CREATE TABLE events_11 " + _EVENTS_COLUMNS,
        "INSERT INTO events_11 (rowid, id, session_id, sequence_number, tid, body) "
        "SELECT COALESCE((SELECT f.cursor FROM feed AS f WHERE f.tid = e.tid "
        f"AND f.kind = {_EVENT_KIND} AND f.record_id = e.id), -e.rowid) AS place, "
        "e.id, e.session_id, e.sequence_number, e.tid, e.body FROM events AS e ORDER BY place",
        "DROP TABLE events",
        "ALTER TABLE events_11 RENAME TO events",
        "DROP INDEX feed_record",
        f"CREATE INDEX feed_session ON feed (tid, record_id) WHERE kind = {_SESSION_KIND}",
        "DROP INDEX feed_tenant",
        "CREATE INDEX feed_tenant ON feed (tid)",
    ),
    # 12: a message's, checkpoint's or event's body stored without the id and session id
    # its row's columns hold, nor its tenant's org and user (``compact.short_body``; every
    # read gives it back whole, ``_WHOLE_EVENT`` and ``_WHOLE_RECORD``), which a build before
    # reads as corrupt rows. A tenant keeps its org and user packed as a body holds them
    # (``_packed``), filled here for the tenants there are. Rows written before keep their
    # whole bodies; the version is there so that a build before refuses the file whole.
    ("ALTER TABLE tenants ADD COLUMN packed BLOB", _backfill_packed_tenants),
    # 13: such a body also without its stamp's node when the device that pushed it wrote it
    # (``compact.short_body``'s ``node``): each device's node is kept once (``nodes``, its
    # number in the row's ``device``; ``_WHOLE_EVENT`` and ``_WHOLE_RECORD`` put it back),
    # which a build before reads as corrupt rows. Rows written before keep their node.
    (
        "CREATE TABLE nodes (n INTEGER PRIMARY KEY, node BLOB NOT NULL UNIQUE)",
        "ALTER TABLE records ADD COLUMN device INTEGER",
        "ALTER TABLE events ADD COLUMN device INTEGER",
    ),
    # 14: messages in a table of their own (``messages``, the columns and keys of
    # ``records``). Rows are appended in feed order, and a page is closed when the next row
    # does not fit: a turn's big reply after its small rows left a fifth of each page of
    # ``records`` unused (0.36 MB of a 3.85 MB file at 1,000 turns); messages apart, and the
    # small rows apart, fill their pages. Each row keeps its rowid (its entry's cursor).
    (
        "CREATE TABLE messages " + _RECORDS_COLUMNS_13,
        "INSERT INTO messages (rowid, kind, id, tid, session_id, body, device) "
        "SELECT rowid, kind, id, tid, session_id, body, device FROM records "
        f"WHERE kind = {_MESSAGE_KIND} ORDER BY rowid",
        "CREATE TABLE records_14 " + _RECORDS_COLUMNS_13,
        "INSERT INTO records_14 (rowid, kind, id, tid, session_id, body, device) "
        "SELECT rowid, kind, id, tid, session_id, body, device FROM records "
        f"WHERE kind <> {_MESSAGE_KIND} ORDER BY rowid",
        "DROP TABLE records",
        "ALTER TABLE records_14 RENAME TO records",
        "CREATE UNIQUE INDEX records_key ON records (tid, kind, id)",
        "CREATE INDEX records_tenant ON records (tid, session_id)",
        "CREATE UNIQUE INDEX messages_key ON messages (tid, kind, id)",
        "CREATE INDEX messages_tenant ON messages (tid, session_id)",
    ),
    # 15: an event's body stored without its prev_hash where the row before it in its chain
    # holds it as its row_hash (``compact.prev_apart``; ``_INSERT_EVENT_SQL``, every read puts
    # it back from that row: ``_prev_digest``), which a build before reads as corrupt rows.
    # No table changes: the version makes such a build refuse the file whole.
    ("SELECT 1",),
    # 16: a feed entry of an immutable record or an event names no id (``record_id`` NULL)
    # where the row at its cursor, in the table of its kind, is its own: as every such row
    # is written since schema 11. Its id was held a second time (16 bytes of
    # each entry, 0.14 MB of a 3.5 MB file at 1,000 turns: ``_own_row``). A session's keep theirs
    # (a session's row is not at its cursor), and so does a row a process of a build before
    # 11 wrote at a rowid of its own (found by kind and id, as before).
    (
        """CREATE TABLE feed_16 (
            cursor INTEGER PRIMARY KEY AUTOINCREMENT,
            tid INTEGER NOT NULL,
            kind INTEGER NOT NULL,
            record_id BLOB
        )""",
        "INSERT INTO feed_16 (cursor, tid, kind, record_id) SELECT f.cursor, f.tid, f.kind, "
        f"CASE WHEN {_OWN_ROW_16} THEN NULL ELSE f.record_id END FROM feed AS f ORDER BY f.cursor",
        "DELETE FROM sqlite_sequence WHERE name = 'feed_16'",
        "INSERT INTO sqlite_sequence (name, seq) "
        "SELECT 'feed_16', seq FROM sqlite_sequence WHERE name = 'feed'",
        "DROP TABLE feed",
        "ALTER TABLE feed_16 RENAME TO feed",
        f"CREATE INDEX feed_session ON feed (tid, record_id) WHERE kind = {_SESSION_KIND}",
        "CREATE INDEX feed_tenant ON feed (tid)",
    ),
    # 17: the feed kept in the order a pull reads it, by tenant and cursor (``WITHOUT ROWID``,
    # its key ``(tid, cursor)``): its index by tenant held every entry a second time (0.08 MB
    # of 3.4 at 1,000 turns), and a pull read the index, then the row. The feed's high-water
    # mark, which AUTOINCREMENT kept (no cursor is ever given twice, a deleted one neither),
    # is kept in ``feed_head`` (``_TAKE_CURSORS_SQL``).
    (
        """CREATE TABLE feed_17 (
            tid INTEGER NOT NULL,
            cursor INTEGER NOT NULL,
            kind INTEGER NOT NULL,
            record_id BLOB,
            PRIMARY KEY (tid, cursor)
        ) WITHOUT ROWID""",
        "INSERT INTO feed_17 (tid, cursor, kind, record_id) "
        "SELECT tid, cursor, kind, record_id FROM feed ORDER BY tid, cursor",
        "CREATE TABLE feed_head (one INTEGER PRIMARY KEY CHECK (one = 1), cursor INTEGER NOT NULL)",
        "INSERT INTO feed_head (one, cursor) SELECT 1, "
        "MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'feed'), 0), "
        "COALESCE((SELECT MAX(cursor) FROM feed), 0))",
        "DROP TABLE feed",
        "DELETE FROM sqlite_sequence WHERE name = 'feed'",
        "ALTER TABLE feed_17 RENAME TO feed",
        f"CREATE INDEX feed_session ON feed (tid, record_id) WHERE kind = {_SESSION_KIND}",
    ),
    # 18: a long session's message ids in blocks of 124 (``SQLITE_ID_LAYOUT``) where 128, in
    # a rowid table where a WITHOUT ROWID one: a block of 2 KB went past what a page of that
    # table keeps of a row, and its last 1.5 KB took a page of its own; two of 1,984 bytes
    # fit a page of a rowid table. The blocks already there are cut again.
    (_rechunk_id_blocks,),
    # 19: an event names its session's chain by a number (``chains``: each tenant's session
    # with events, once) where it held the session's id, as did the events' unique key by
    # place, which the number alone scopes to its tenant: 16 bytes fewer in each row and in
    # each entry of that key (0.12 MB of 3.3 at 1,000 turns). Each event keeps its rowid.
    (
        """CREATE TABLE chains (
            n INTEGER PRIMARY KEY,
            tid INTEGER NOT NULL,
            session_id BLOB NOT NULL,
            UNIQUE (tid, session_id)
        )""",
        "INSERT INTO chains (tid, session_id) "
        "SELECT tid, session_id FROM events GROUP BY tid, session_id ORDER BY MIN(rowid)",
        """CREATE TABLE events_19 (
            id BLOB NOT NULL,
            chain INTEGER NOT NULL,
            sequence_number INTEGER NOT NULL,
            tid INTEGER NOT NULL,
            body BLOB NOT NULL,
            device INTEGER,
            UNIQUE (tid, id),
            UNIQUE (chain, sequence_number)
        )""",
        "INSERT INTO events_19 (rowid, id, chain, sequence_number, tid, body, device) "
        "SELECT e.rowid, e.id, c.n, e.sequence_number, e.tid, e.body, e.device FROM events AS e "
        "JOIN chains AS c ON c.tid = e.tid AND c.session_id = e.session_id ORDER BY e.rowid",
        "DROP TABLE events",
        "ALTER TABLE events_19 RENAME TO events",
    ),
    # 20: a record (a message too) names its session by the same number (``session``: its
    # ``chains`` row, given it with its first record or event; NULL for none), where it held
    # the session's id, and the index by session (which a session's delete reads) is on that
    # number alone, where it held the tenant and the id: 16 and 17 bytes fewer (0.14 MB of
    # 3.2 at 1,000 turns). Each record keeps its rowid.
    (
        "INSERT INTO chains (tid, session_id) SELECT tid, session_id FROM ("
        "SELECT rowid AS at, tid, session_id FROM records WHERE session_id IS NOT NULL "
        "UNION ALL SELECT rowid, tid, session_id FROM messages WHERE session_id IS NOT NULL) "
        "GROUP BY tid, session_id ORDER BY MIN(at) ON CONFLICT (tid, session_id) DO NOTHING",
        *(
            statement.replace("@table", table)
            for table in ("records", "messages")
            for statement in (
                "CREATE TABLE @table_20 " + _RECORDS_COLUMNS_20,
                "INSERT INTO @table_20 (rowid, kind, id, tid, session, body, device) "
                "SELECT r.rowid, r.kind, r.id, r.tid, c.n, r.body, r.device FROM @table AS r "
                "LEFT JOIN chains AS c ON c.tid = r.tid AND c.session_id = r.session_id "
                "ORDER BY r.rowid",
                "DROP TABLE @table",
                "ALTER TABLE @table_20 RENAME TO @table",
                "CREATE UNIQUE INDEX @table_key ON @table (tid, kind, id)",
                "CREATE INDEX @table_session ON @table (session)",
            )
        ),
    ),
    # 21: an audit row's place names its device's chain by a number (``audit_chains``: each
    # tenant's client id with audit rows, once) and its row by the rowid of its row in
    # ``records``, where it held the tenant, the client id as text, the row's id and its row
    # hash, which the row's body holds (a push reads it there: ``_AUDIT_TAILS_SQL``): 60
    # bytes fewer a row (0.07 MB of 3.0 at 1,000 turns). A place whose row is not in the
    # file, which no build wrote (a row and its place go in in one transaction), is dropped.
    (
        """CREATE TABLE audit_chains (
            n INTEGER PRIMARY KEY,
            tid INTEGER NOT NULL,
            client_id TEXT NOT NULL,
            UNIQUE (tid, client_id)
        )""",
        "INSERT INTO audit_chains (tid, client_id) "
        "SELECT DISTINCT tid, client_id FROM audit_places ORDER BY tid, client_id",
        """CREATE TABLE audit_places_21 (
            chain INTEGER NOT NULL,
            sequence_number INTEGER NOT NULL,
            row INTEGER NOT NULL,
            PRIMARY KEY (chain, sequence_number, row)
        ) WITHOUT ROWID""",
        _PLACES_21_SQL,
        "DROP TABLE audit_places",
        "ALTER TABLE audit_places_21 RENAME TO audit_places",
    ),
    # 22: an audit row's body keeps its row hash in front, and leaves out its prev_hash where
    # the row at the place before it in its chain holds that digest there (``prev_row``
    # names that row; ``compact.audit_apart``, ``_INSERT_RECORD_SQL``; every read puts it
    # back: ``_whole_sql``): 36 bytes fewer a row (0.04 MB of 2.96 at 1,000 turns), which a
    # build before reads as corrupt rows. Rows written before keep their bodies; the first
    # row of a chain after them keeps its prev_hash, and the rows after that leave it out.
    ("ALTER TABLE records ADD COLUMN prev_row INTEGER",),
    # 23: records pushed at protocol 9 are stored in its form, a long text deflated
    # (``shared.compact``), which a build before reads as corrupt rows. No table changes: the
    # version makes such a build refuse the file ("upgrade pleach").
    ("SELECT 1",),
)
_PUT_HEALTH_SQL = (
    "INSERT INTO devices (org_id, user_id, client_id, seen_at, health) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (org_id, user_id, client_id) DO UPDATE SET "
    "seen_at = excluded.seen_at, health = excluded.health "
    "WHERE excluded.seen_at >= devices.seen_at"
)
_TRIM_DEVICES_SQL = (
    "DELETE FROM devices WHERE org_id = ? AND user_id = ? AND client_id IN ("
    "SELECT client_id FROM devices WHERE org_id = ? AND user_id = ? "
    "ORDER BY seen_at DESC LIMIT -1 OFFSET ?)"
)
_LIST_HEALTH_SQL = (
    "SELECT org_id, user_id, client_id, seen_at, health FROM devices ORDER BY seen_at DESC LIMIT ?"
)
SCHEMA_VERSION = len(_MIGRATIONS)


def _whole_sql(
    row: str, tenant: str | None = None, *, event: bool = False, audit: bool = False
) -> str:
    """SQL: the body of the events or records row aliased ``row`` as its record was written
    (``compact.short_body`` less its ids and its tenant, schema 12: ``_packed``, and its
    stamp's node, schema 13: ``nodes``, and an event's ``prev_hash``, schema 15: the row
    before it in its chain, ``_prev_digest``); ``tenant``: an expression of the row's
    tenant's packed org and user (by default, its tenant's row, probed for each row). The
    session's id is read by its number (``chains``: an event's ``chain``, schema 19, a
    record's ``session``, schema 20). ``audit``: the row is of ``records``, whose audit rows
    may leave out their prev_hash, which the row their ``prev_row`` names holds in front of
    its body (schema 22: ``compact.audit_apart``, ``_INSERT_RECORD_SQL``); a statement over
    ``messages`` too reads no audit row and leaves it out (such a body then reads as NULL)."""
    number = f"{row}.chain" if event else f"{row}.session"
    if event:
        prev = _prev_digest(f"{row}.chain", f"{row}.sequence_number")
    elif audit:
        prev = f"(SELECT {_AUDIT_DIGEST} FROM records AS q WHERE q.rowid = {row}.prev_row)"
    else:
        prev = "NULL"
    return compact.whole_body_sql(
        f"{row}.body",
        f"{row}.id",
        f"(SELECT c.session_id FROM chains AS c WHERE c.n = {number})",
        tenant or f"(SELECT packed FROM tenants WHERE tid = {row}.tid)",
        f"(SELECT node FROM nodes WHERE n = {row}.device)",
        prev,
    )


_AUDIT_DIGEST: Final = compact.audit_digest_sql("q.body")
"""SQL: the row hash in front of the body of the audit row ``q`` (NULL: none there)."""


def _prev_digest(chain: str, number: str) -> str:
    """SQL: the ``row_hash`` of the event before the one at ``number`` in ``chain`` (its
    session's number in ``chains``, schema 19; each an expression; one probe of the events'
    unique key), read from that row's body (``compact.chain_digest_sql``); NULL when there
    is none. The one expression both decides whether an event's body is stored without its
    ``prev_hash`` (``_INSERT_EVENT_SQL``) and reads it back: events are never deleted nor
    rewritten, so a body that left it out finds it there for good."""
    return (
        f"(SELECT {compact.chain_digest_sql('p.body')} FROM events AS p "
        f"WHERE p.chain = {chain} AND p.sequence_number = {number} - 1)"
    )


_WHOLE_EVENT = _whole_sql("e", event=True)
"""SQL: an event row's body as the event was written (``_whole_sql``)."""
_WHOLE_RECORD = _whole_sql("r", audit=True)
"""SQL: a row of ``records``' body as the record was written (``_whole_sql``)."""
_WHOLE_EITHER = _whole_sql("r")
"""The same for a statement over ``records`` and ``messages`` alike (``_in_both``), which
reads no audit row."""


_TENANT = "(SELECT tid FROM tenants WHERE org_id = ? AND user_id = ?)"
"""The tenant's number (schema 8), for statements that take the tenant as ``?, ?``."""
_TENANT_12 = "(SELECT tid FROM tenants WHERE org_id = ?1 AND user_id = ?2)"
"""The same, for statements that number their parameters (the tenant as ``?1, ?2``)."""

_HEAD_SQL = f"""SELECT MAX(
    COALESCE((SELECT MAX(cursor) FROM feed WHERE tid = {_TENANT}), 0),
    COALESCE((SELECT feed_floor FROM meta WHERE tid = {_TENANT}), 0))"""

_FLOOR_SQL = f"SELECT feed_floor FROM meta WHERE tid = {_TENANT}"

_LAST_SEQ_SQL = f"SELECT last_seq FROM clients WHERE tid = {_TENANT} AND client_id = ?"

# A push names its tenant before its first read: every row it writes refers to the number.
# (Its packed org and user too: the short bodies of its rows leave them out, schema 12. A row
# without them, which no build since writes, gets them at its tenant's next push.)
_ADD_TENANT_SQL = (
    "INSERT INTO tenants (org_id, user_id, packed) VALUES (?, ?, ?) "
    "ON CONFLICT (org_id, user_id) DO UPDATE SET packed = excluded.packed WHERE packed IS NULL"
)


def _in_both(template: str) -> str:
    """SQL: ``template`` over ``records`` and over ``messages`` (migration 14), as one
    statement (``UNION ALL``): ``@table`` names each in turn."""
    return " UNION ALL ".join(template.replace("@table", t) for t in ("records", "messages"))


# The batch lookups of a push: each takes the tenant, then its keys as ONE JSON array
# parameter (no limit on how many, one statement per kind of key) and reads each key through
# an index; an id is looked up by its stored key (``pleach_key``: a UUID's 16 bytes). Every id
# is the tenant's own: another tenant's rows are never read, so whatever is found is the
# tenant's (each lookup answers with the keys it found, as the push named them). CROSS JOIN
# keeps the keys as the outer loop: with a plain JOIN the planner may walk all of the tenant's
# rows once per key (a push read 0.3 ms per change that way, and more as the history grew).
_RECORD_OWNERS_SQL = _in_both(f"""
    SELECT json_extract(k.value, '$[0]'), json_extract(k.value, '$[1]') FROM json_each(?3) AS k
    CROSS JOIN @table AS r ON r.tid = {_TENANT_12}
        AND r.kind = json_extract(k.value, '$[0]')
        AND r.id = pleach_key(json_extract(k.value, '$[1]'))""")
_EVENT_OWNERS_SQL = f"""
    SELECT k.value FROM json_each(?3) AS k
    CROSS JOIN events AS e ON e.tid = {_TENANT_12} AND e.id = pleach_key(k.value)"""
# A session id is held by its row, else by any event, else by any record filed under it.
_SESSION_OWNERS_SQL = f"""
    SELECT k.value FROM json_each(?3) AS k
    WHERE EXISTS (SELECT 1 FROM sessions AS s
            WHERE s.tid = {_TENANT_12} AND s.id = pleach_key(k.value))
        OR EXISTS (SELECT 1 FROM chains AS c
            WHERE c.tid = {_TENANT_12} AND c.session_id = pleach_key(k.value))"""
# (A row a block, the blocks of a session after its row: ``_sessions_of``.)
_SESSIONS_SQL = f"""
    SELECT k.value, s.body, s.ids_count, b.part, b.ids FROM json_each(?3) AS k
    CROSS JOIN sessions AS s ON s.tid = {_TENANT_12} AND s.id = pleach_key(k.value)
    LEFT JOIN session_ids AS b ON b.tid = s.tid AND b.id = s.id"""
_CHAIN_TAILS_SQL = f"""
    SELECT k.value, e.sequence_number, {_WHOLE_EVENT} FROM json_each(?3) AS k
    CROSS JOIN events AS e ON e.rowid = (
        SELECT rowid FROM events WHERE chain = (SELECT n FROM chains
            WHERE tid = {_TENANT_12} AND session_id = pleach_key(k.value))
        ORDER BY sequence_number DESC LIMIT 1)"""

# The last place of each client id's audit chain (the highest sequence number; of two rows
# there, which only a device of protocol 2 or earlier leaves, the later), one probe of the
# primary key per client id, and the body of its row (which holds its row hash, schema 21).
_AUDIT_TAILS_SQL = f"""
    SELECT k.value, p.sequence_number, p.row, {_WHOLE_RECORD} FROM json_each(?3) AS k
    CROSS JOIN audit_chains AS c ON c.tid = {_TENANT_12} AND c.client_id = k.value
    CROSS JOIN audit_places AS p ON p.chain = c.n AND p.sequence_number = (
        SELECT MAX(sequence_number) FROM audit_places WHERE chain = c.n)
    CROSS JOIN records AS r ON r.rowid = p.row"""
# A device's audit chain numbered before its first place goes in (schema 21).
_ADD_AUDIT_CHAIN_SQL = (
    f"INSERT INTO audit_chains (tid, client_id) SELECT {_TENANT}, ? WHERE true "
    "ON CONFLICT (tid, client_id) DO NOTHING"
)
_INSERT_PLACE_SQL = f"""
    INSERT INTO audit_places (chain, sequence_number, row)
    SELECT c.n, ?4, ?5 FROM audit_chains AS c WHERE c.tid = {_TENANT_12} AND c.client_id = ?3"""
# A record's and an event's rowid is the cursor of its feed entry (migration 11); a message
# is in a table of its own (migration 14).
_INSERT_MESSAGE_SQL = """
    INSERT INTO messages (rowid, kind, id, tid, session, body, device)
    SELECT ?1, ?2, ?3, t.tid, (SELECT c.n FROM chains AS c WHERE c.tid = t.tid
        AND c.session_id = ?6), ?7, ?8
    FROM tenants AS t WHERE t.org_id = ?4 AND t.user_id = ?5
    ON CONFLICT (tid, kind, id) DO NOTHING"""
# The same into ``records``, whose rows go in in their cursors' order, appended (one
# statement for every kind: rows of two statements in turn would go in out of order, and
# split pages). An audit row's body leaves its prev_hash out (``?9``: ``compact.audit_apart``'s
# second form, schema 22; None for any other row) when a row at the place before it in its
# chain (``?11``'s, place ``?12`` less one), stored now (this batch's places go in first, its
# rows in chain order), holds exactly that digest (``?10``) in front of its body, read as
# every read of this row will read it; the row then names that row (``prev_row``). Else it is
# stored as ``?7``.
_INSERT_RECORD_SQL = f"""
    INSERT INTO records (rowid, kind, id, tid, session, body, device, prev_row)
    SELECT ?1, ?2, ?3, t.tid, (SELECT c.n FROM chains AS c WHERE c.tid = t.tid
        AND c.session_id = ?6), CASE WHEN x.prev IS NULL THEN ?7 ELSE ?9 END, ?8, x.prev
    FROM tenants AS t CROSS JOIN (SELECT (SELECT p.row FROM audit_places AS p
        CROSS JOIN records AS q ON q.rowid = p.row
        WHERE ?9 IS NOT NULL AND p.chain = (SELECT a.n FROM audit_chains AS a
            WHERE a.tid = (SELECT tid FROM tenants WHERE org_id = ?4 AND user_id = ?5)
            AND a.client_id = ?11)
        AND p.sequence_number = ?12 - 1 AND {_AUDIT_DIGEST} = ?10 LIMIT 1) AS prev) AS x
    WHERE t.org_id = ?4 AND t.user_id = ?5
    ON CONFLICT (tid, kind, id) DO NOTHING"""
# An event's body leaves its prev_hash out (``?9``: ``compact.prev_apart``, schema 15) when
# the row before it in its chain, stored now (this batch's rows go in in chain order), holds
# exactly that digest (``?10``) as its row_hash, read as every read of this row will read it;
# else it is stored as it is (``?7``).
_INSERT_EVENT_SQL = f"""
    INSERT INTO events (rowid, id, chain, sequence_number, tid, body, device)
    SELECT ?1, ?2, c.n, ?4, c.tid,
        CASE WHEN ?9 IS NOT NULL AND {_prev_digest("c.n", "?4")} = ?10
        THEN ?9 ELSE ?7 END, ?8
    FROM chains AS c WHERE c.tid = (SELECT tid FROM tenants WHERE org_id = ?5 AND user_id = ?6)
        AND c.session_id = ?3
    ON CONFLICT DO NOTHING"""
# A session's number (schema 19: its events' chain; 20: its records' session), given it
# before its first event or record goes in.
_ADD_CHAIN_SQL = (
    f"INSERT INTO chains (tid, session_id) SELECT {_TENANT}, ? WHERE true "
    "ON CONFLICT (tid, session_id) DO NOTHING"
)
_NODE_SQL = "SELECT n FROM nodes WHERE node = ?"
_ADD_NODE_SQL = "INSERT INTO nodes (node) VALUES (?)"
_NODE_OUT: Final = frozenset(compact.SHORT + form for form in (b"\x01", b"\x02", b"\x12"))
"""The heads of the bodies ``short_body`` left their stamp's node out of (a message's,
checkpoint's or event's; an audit row's, and such a row with its row hash in front,
``compact.audit_apart``): their rows name the node (so does an event's without its
prev_hash too, ``compact.prev_apart`` of such a body, and an audit row's, whatever is
stored)."""
_PUT_SESSION_SQL = (
    f"INSERT INTO sessions (id, tid, updated_at, body, ids_count) VALUES (?, {_TENANT}, ?, ?, ?) "
    "ON CONFLICT (tid, id) DO UPDATE SET updated_at = excluded.updated_at, "
    "body = excluded.body, ids_count = excluded.ids_count"
)
_PUT_ID_BLOCK_SQL = (
    f"INSERT OR REPLACE INTO session_ids (tid, id, part, ids) VALUES ({_TENANT}, ?, ?, ?)"
)
_DROP_ID_BLOCKS_SQL = f"DELETE FROM session_ids WHERE tid = {_TENANT} AND id = ? AND part >= ?"
_APPEND_FEED_SQL = f"INSERT INTO feed (tid, cursor, kind, record_id) VALUES ({_TENANT}, ?, ?, ?)"
# A push's cursors (schema 17): the next ``?`` after the feed's high-water mark, taken inside
# its BEGIN IMMEDIATE, so no two pushes, of this process or another, share one.
_TAKE_CURSORS_SQL = "UPDATE feed_head SET cursor = cursor + ? WHERE one = 1"
_LAST_CURSOR_SQL = "SELECT cursor FROM feed_head WHERE one = 1"


def _own_row(row: str, entry: str = "f") -> str:
    """SQL: whether ``row``, found at feed entry ``entry``'s cursor in the table of its kind
    (and of its tenant and kind), is that entry's own: an entry that names no id (schema 16)
    has its row there, as every immutable record's and event's is written since schema 11;
    one that names an id (a session's, or a row a process of a build before 11 wrote at a
    rowid of its own) is its row's only where the ids agree."""
    return f"({entry}.record_id IS NULL OR {row}.id = {entry}.record_id)"


# The entries a session's new entry supersedes (see migration 7): through feed_session (a
# search of the feed's key by tenant and cursor would read every entry below the cursor).
_SUPERSEDED_SQL = (
    f"DELETE FROM feed INDEXED BY feed_session WHERE tid = {_TENANT} "
    f"AND kind = {_SESSION_KIND} AND record_id = ? AND cursor < ?"
)
# Deleting a session's content: the tenant's session rows, the records of the kinds deleted
# with a session filed under its deleted ones, then the chosen records and their feed entries.
_TENANT_SESSIONS_SQL = f"""
    SELECT s.id, s.body, s.ids_count, b.part, b.ids FROM sessions AS s
    LEFT JOIN session_ids AS b ON s.ids_count IS NOT NULL AND b.tid = s.tid AND b.id = s.id
    WHERE s.tid = {_TENANT}"""
_CASCADE_CANDIDATES_SQL = _in_both(f"""
    SELECT r.kind, r.id, {_WHOLE_EITHER} FROM json_each(?1) AS k
    CROSS JOIN @table AS r INDEXED BY @table_session
        ON r.session = (SELECT n FROM chains WHERE session_id = pleach_key(k.value)
            AND tid = (SELECT tid FROM tenants WHERE org_id = ?2 AND user_id = ?3))
    WHERE r.kind IN (SELECT value FROM json_each(?4))""")
# The records ``?3`` names (a JSON array of [kind, id]), each found through its table's key
# (``records_key``, ``messages_key``):
# its rowid, kind and id, and whether the feed entry at its rowid is its own (migration 11:
# a record's rowid is its entry's cursor; not so for a row a process of the build before
# wrote after the migration, whose entry is then found by kind and id).
_DOOMED_SQL = _in_both(f"""
    SELECT r.rowid, r.kind, r.id, EXISTS (SELECT 1 FROM feed AS f WHERE f.cursor = r.rowid
        AND f.tid = r.tid AND f.kind = r.kind AND {_own_row("r")})
    FROM json_each(?3) AS d CROSS JOIN @table AS r
        ON r.tid = {_TENANT_12} AND r.kind = json_extract(d.value, '$[0]')
        AND r.id = pleach_key(json_extract(d.value, '$[1]'))""")
_DROP_ENTRY_SQL = f"DELETE FROM feed WHERE tid = {_TENANT} AND cursor = ?"
_DROP_ENTRY_BY_ID_SQL = f"DELETE FROM feed WHERE tid = {_TENANT} AND kind = ? AND record_id = ?"
_DELETE_RECORD_SQL = "DELETE FROM records WHERE rowid = ?"
_DELETE_MESSAGE_SQL = "DELETE FROM messages WHERE rowid = ?"
_SET_LAST_SEQ_SQL = (
    f"INSERT INTO clients (tid, client_id, last_seq) VALUES ({_TENANT}, ?, ?) "
    "ON CONFLICT (tid, client_id) DO UPDATE SET last_seq = excluded.last_seq"
)


async def _fetchall(
    conn: aiosqlite.Connection, sql: str, params: Sequence[Any] = ()
) -> list[sqlite3.Row]:
    """Run ``sql`` and return its rows: one hop to aiosqlite's thread."""
    return list(await conn.execute_fetchall(sql, params))


async def _fetchone(
    conn: aiosqlite.Connection, sql: str, params: Sequence[Any] = ()
) -> sqlite3.Row | None:
    rows = await _fetchall(conn, sql, params)
    return rows[0] if rows else None


async def _rowcount(conn: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> int:
    async with conn.execute(sql, params) as cur:
        return cur.rowcount


async def _head(conn: aiosqlite.Connection, tenant: Tenant) -> int:
    t = (tenant.org_id, tenant.user_id)
    row = await _fetchone(conn, _HEAD_SQL, t + t)
    return int(row[0]) if row is not None else 0


async def _floor(conn: aiosqlite.Connection, tenant: Tenant) -> int:
    row = await _fetchone(conn, _FLOOR_SQL, (tenant.org_id, tenant.user_id))
    return int(row[0]) if row is not None else 0


def _key(value: str) -> bytes | str:
    """How an id is kept (schema 8): a canonical UUID as its 16 bytes, any other id as its
    text (the rule ``compact`` packs ids by, and the device file's)."""
    return compact.uuid_bytes(value) or value


def _sql_key(value: Any) -> Any:
    """``pleach_key(id)`` in SQL: ``_key`` of a text, anything else as it is."""
    return _key(value) if type(value) is str else value


def _digest_key(value: str) -> bytes | str:
    """How a row hash is kept: a 64-character lowercase hex digest as its 32 bytes (the rule
    ``compact`` packs hashes by), anything else as its text."""
    return compact.digest_bytes(value) or value


def _sql_digest(value: Any) -> Any:
    """``pleach_digest(hash)`` in SQL: ``_digest_key`` of a text, anything else as it is."""
    return _digest_key(value) if type(value) is str else value


def _id_text(value: bytes | str) -> str:
    """An id as stored, read back as its text."""
    return compact.uuid_text(value) if type(value) is bytes and len(value) == 16 else str(value)


def _row_hash(session_id: str, body: bytes) -> str:
    """The row hash of the stored event ``body`` (the last of ``session_id``'s chain), read
    without decoding its payload when it is compact; ``StorageError`` when it is corrupt."""
    place = compact.event_place(body)
    if place is not None:
        return place[3]
    return _decoded_hash(body, Event, f"event row of session {session_id!r}", "an event")


def _audit_hash(client_id: str, body: bytes) -> str:
    """The row hash of the stored audit row ``body`` (the last of ``client_id``'s chain,
    whose place names its row and no hash since schema 21); ``StorageError`` when it is
    corrupt."""
    return _decoded_hash(body, AuditRow, f"audit row of the chain of {client_id!r}", "an audit row")


def _decoded_hash(body: bytes, kind: type[Event | AuditRow], what: str, noun: str) -> str:
    """The row hash of the stored body of a ``kind`` (``what``: which row, for the error)."""
    try:
        record = decode_body(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StorageError(f"corrupt {what}") from exc
    if not isinstance(record, kind):
        raise StorageError(f"corrupt {what}: not {noun}")
    return record.row_hash


def _json(keys: Iterable[Any]) -> str:
    return msgspec.json.encode(sorted(keys)).decode()


_R = TypeVar("_R")


async def _on_thread(
    conn: aiosqlite.Connection | sqlite3.Connection, fn: Callable[..., _R], *args: Any
) -> _R:
    """``fn(raw, *args)`` on the connection's own thread, where aiosqlite runs its statements
    in order: a push's lookups, or its writes, are one hop instead of one per statement (each
    hop is a thread handoff that costs more than the SQLite work). aiosqlite has no public
    name for this; ``_execute`` and ``_conn`` are pinned with it (aiosqlite < 0.23), as the
    device's store does. ``conn`` a plain ``sqlite3`` connection (a push in place,
    ``SQLiteServerStore._write``): ``fn`` runs at once, on the caller's thread."""
    if isinstance(conn, sqlite3.Connection):
        return fn(conn, *args)
    raw: sqlite3.Connection = conn._conn
    result: _R = await conn._execute(fn, raw, *args)  # type: ignore[no-untyped-call]
    return result


def _fetch_each(
    raw: sqlite3.Connection, lookups: list[tuple[str, tuple[Any, ...]]]
) -> list[list[Any]]:
    return [raw.execute(sql, params).fetchall() for sql, params in lookups]


class _Rows(msgspec.Struct):
    """A push's encoded rows, per statement (``_SQLiteTx.write``)."""

    records: list[tuple[Any, ...]]
    """``_INSERT_RECORD_SQL``'s rows (a message's, ``_INSERT_MESSAGE_SQL``'s), each led by the
    index of its entry in ``feed`` (in place of the rowid, the entry's cursor once the feed
    rows are in); after the body (an audit row's with its row hash in front), an audit row's
    form without its prev_hash, that digest's bytes, its client id and its place (None, for
    a row that is no audit row; a message's row ends with its body)."""
    events: list[tuple[Any, ...]]
    """``_INSERT_EVENT_SQL``'s rows, led likewise; after the body, its form without its
    prev_hash (None: none) and that digest's bytes."""
    sessions: list[tuple[Any, ...]]
    id_blocks: list[tuple[Any, ...]]
    """``_PUT_ID_BLOCK_SQL``'s rows: the sessions' blocks that changed."""
    id_drops: list[tuple[Any, ...]]
    """``_DROP_ID_BLOCKS_SQL``'s rows: blocks past a session's ids."""
    feed: list[tuple[Any, ...]]
    versioned: dict[bytes | str, int]
    """Sessions in ``feed``: key -> the index of its last entry."""
    last_seq: tuple[Any, ...] | None
    places: list[tuple[Any, ...]]
    """``_INSERT_PLACE_SQL``'s rows, each ending with the index of its row's entry in ``feed``
    (in place of its row's rowid, that entry's cursor)."""
    head: tuple[Any, ...] | None
    """``_HEAD_SQL``'s parameters: the tenant's head is read once the rows are in (None: not)."""
    node: bytes = b""
    """The pushing device's stamp node (``compact.stamp_node``), which the bodies of its own
    records leave out; the rows that did name it by its number in ``nodes``."""


def _write_rows(raw: sqlite3.Connection, rows: _Rows) -> tuple[list[int], int | None]:
    """``_SQLiteTx.write``'s statements, run on the connection's own thread; the feed rows'
    cursors, and the tenant's head after them (when ``rows.head`` asks)."""
    cursors: list[int] = []
    if rows.feed:
        # The consecutive cursors after the feed's high-water mark (``feed_head``: nothing
        # else writes inside this BEGIN IMMEDIATE), each entry under its own.
        raw.execute(_TAKE_CURSORS_SQL, (len(rows.feed),))
        last = int(raw.execute(_LAST_CURSOR_SQL).fetchone()[0])
        cursors = list(range(last - len(rows.feed) + 1, last + 1))
        raw.executemany(
            _APPEND_FEED_SQL,
            [(o, u, c, kind, key) for (o, u, kind, key), c in zip(rows.feed, cursors, strict=True)],
        )
        if rows.versioned:
            t = rows.feed[0][:2]
            raw.executemany(
                _SUPERSEDED_SQL, [(*t, key, cursors[i]) for key, i in rows.versioned.items()]
            )
    # Each record and event in the rowid of its entry's cursor (``_Rows.records``), and
    # naming the pushing device's stamp node where its body left it out (``device``): each
    # row's body is its seventh value (an event's form without its prev_hash follows it).
    both = itertools.chain(rows.records, rows.events)
    named = any(row[6][:2] in _NODE_OUT for row in both)
    device = _device_number(raw, rows.node) if named else None
    # Each event's and record's session numbered first (``chains``).
    chains = {(org, user, session): None for _, _, session, _, org, user, *_ in rows.events}
    chains.update(
        ((org, user, session), None)
        for _, _, _, org, user, session, *_ in rows.records
        if session is not None
    )
    if chains:
        raw.executemany(_ADD_CHAIN_SQL, list(chains))
    if rows.places:
        # Each place after its chain's number (``audit_chains``), naming its row by its rowid,
        # before the rows (an audit row's ``prev_row`` is found through the place before it).
        raw.executemany(_ADD_AUDIT_CHAIN_SQL, list(dict.fromkeys(p[:3] for p in rows.places)))
        placed = [(*p[:4], cursors[p[4]]) for p in rows.places]
        if raw.executemany(_INSERT_PLACE_SQL, placed).rowcount != len(placed):
            raise StorageError("an audit row's place was not written")
    for sql, written, what in (
        (_INSERT_RECORD_SQL, [r for r in rows.records if r[1] != _MESSAGE_KIND], "a record id"),
        (_INSERT_MESSAGE_SQL, [r for r in rows.records if r[1] == _MESSAGE_KIND], "a record id"),
        (_INSERT_EVENT_SQL, rows.events, "an event id"),
    ):
        if written:
            placed = [
                (cursors[row[0]], *row[1:7], device if row[6][:2] in _NODE_OUT else None, *row[7:])
                for row in written
            ]
            if raw.executemany(sql, placed).rowcount != len(placed):
                raise claimed_concurrently(what)
    if rows.sessions:
        raw.executemany(_PUT_SESSION_SQL, rows.sessions)
    if rows.id_drops:
        raw.executemany(_DROP_ID_BLOCKS_SQL, rows.id_drops)
    if rows.id_blocks:
        raw.executemany(_PUT_ID_BLOCK_SQL, rows.id_blocks)
    if rows.last_seq is not None:
        raw.execute(_SET_LAST_SEQ_SQL, rows.last_seq)
    head = None if rows.head is None else int(raw.execute(_HEAD_SQL, rows.head).fetchone()[0])
    return cursors, head


def _device_number(raw: sqlite3.Connection, node: bytes) -> int:
    """The number ``nodes`` keeps ``node`` under, given it in this transaction if it has none
    (schema 13). A device's node is its client id's (``compact.stamp_node``): one row each."""
    row = raw.execute(_NODE_SQL, (node,)).fetchone()
    if row is not None:
        return int(row[0])
    added = raw.execute(_ADD_NODE_SQL, (node,)).lastrowid  # (its n: the rowid)
    if added is None:
        raise StorageError("a device's stamp node was not numbered")
    return added


def _fetch_each_and_head(
    raw: sqlite3.Connection, lookups: list[tuple[str, tuple[Any, ...]]], head: tuple[Any, ...]
) -> tuple[list[list[Any]], int]:
    return _fetch_each(raw, lookups), int(raw.execute(_HEAD_SQL, head).fetchone()[0])


def _twice(tenant: Tenant) -> tuple[str, str, str, str]:
    return (tenant.org_id, tenant.user_id, tenant.org_id, tenant.user_id)


def _lookups(tenant: Tenant, keys: BatchKeys) -> list[tuple[str, tuple[Any, ...]]]:
    """The statements that read what ``keys`` lists, each with its parameters; one per kind
    of key the batch has (``_snapshot`` reads their answers in this order)."""
    t = (tenant.org_id, tenant.user_id)
    return [
        (sql, (*t, _json(wanted)))
        for sql, wanted in (
            (_RECORD_OWNERS_SQL, [(_KIND_NUMBERS[k], i) for k, i in keys.records]),
            (_EVENT_OWNERS_SQL, keys.events),
            (_SESSION_OWNERS_SQL, keys.session_owners),
            (_SESSIONS_SQL, keys.sessions),
            (_CHAIN_TAILS_SQL, keys.chains),
            (_AUDIT_TAILS_SQL, keys.audit_chains),
        )
        if wanted
    ]


def _sessions_of(rows: Iterable[Any], held: dict[str, bytes]) -> list[tuple[str, Session]]:
    """The sessions of rows ``(id, body, ids_count, part, ids)`` (``_SESSIONS_SQL``: a row a
    block, a session's rows together), each with the ids its blocks hold in ``held`` (``b""``
    for none; left out when they are not in order, so that a write drops them all)."""
    out: list[tuple[str, Session]] = []
    for session_id, group in itertools.groupby(rows, _FIRST):
        session_rows = list(group)
        _, body, count, *_ = session_rows[0]
        name = session_id if type(session_id) is str else _id_text(session_id)
        blocks = [(part, b) for *_, part, b in session_rows if part is not None]
        ids = joined_blocks(blocks)
        out.append((name, stored_session(name, body, count, ids if count is not None else None)))
        if ids is not None:
            held[name] = ids
    return out


_FIRST: Final = operator.itemgetter(0)


def _snapshot(
    tenant: Tenant, keys: BatchKeys, each: list[list[Any]], held: dict[str, bytes]
) -> Snapshot:
    """What the answers of ``_lookups(tenant, keys)`` found, as ``BatchTx.load`` gives it;
    the ids in the blocks of each session it read go into ``held``."""
    answers = iter(each)
    found = Snapshot()
    # Every lookup reads the tenant's own rows only: whatever it finds is the tenant's.
    if keys.records:
        for kind, record_id in next(answers):
            found.record_owners[(KINDS[kind], record_id)] = tenant
    if keys.events:
        for (event_id,) in next(answers):
            found.event_owners[event_id] = tenant
    if keys.session_owners:
        for (session_id,) in next(answers):
            found.session_owners[session_id] = tenant
    if keys.sessions:
        found.sessions.update(_sessions_of(next(answers), held))
        for session_id in keys.sessions:
            if session_id not in found.sessions:
                held[session_id] = b""  # (no row: no blocks)
    if keys.chains:
        for session_id, number, body in next(answers):
            found.chain_tails[session_id] = (int(number), _row_hash(session_id, body))
    if keys.audit_chains:
        # (Of two rows at a chain's last place, the later one's: ``_AUDIT_TAILS_SQL``.)
        for chain, number, _, body in sorted(next(answers), key=_AUDIT_TAIL_ORDER):
            found.audit_tails[chain] = (int(number), _audit_hash(chain, body))
    return found


_AUDIT_TAIL_ORDER: Final = operator.itemgetter(2)


class _Read(msgspec.Struct):
    """What a push reads with its ``BEGIN``, in that hop (``push``'s ``read_first``): the device's
    ``last_seq``, the batch's keys after it, their rows (``_lookups``) and the tenant's head."""

    last_seq: int
    keys: BatchKeys
    answers: list[list[Any]]
    head: int


class _SQLiteTx:
    """``BatchTx`` over the writer connection, inside the push's ``BEGIN IMMEDIATE``.

    A large push is three hops to aiosqlite's thread, whatever the size of the batch: every
    lookup with the ``BEGIN`` (``read``, made by ``push``), every write in one, the
    ``COMMIT``. A small one (``IN_PLACE_MAX_CHANGES``) runs its ``BEGIN``, lookups and writes
    on the caller's thread (``raw``: the same connection, no hop) and only its ``COMMIT`` on
    aiosqlite's, whose fsync never holds the event loop. The tenant's head is read with the
    lookups and with the writes: nothing else writes inside this ``BEGIN IMMEDIATE``, so
    ``head_cursor`` answers from it. ``load`` reads in a hop of its own only when the keys
    it is asked for are not the ones read with the ``BEGIN``. A deleted session's content is
    deleted on aiosqlite's thread in either case (a cascade can be large).
    """

    def __init__(
        self,
        conn: aiosqlite.Connection,
        read: _Read | None = None,
        raw: sqlite3.Connection | None = None,
        layout: IdLayout = SQLITE_ID_LAYOUT,
    ) -> None:
        self._conn = conn
        self._layout = layout
        self._run: aiosqlite.Connection | sqlite3.Connection = conn if raw is None else raw
        """Where the lookups and the writes run: the connection's thread, or in place."""
        self._read = read
        """What the push read with its ``BEGIN`` (``push``'s ``read_first``), None: nothing."""
        self._head: int | None = None if read is None else read.head
        self._last_seq = None if read is None else read.last_seq
        """The pushing device's ``last_seq``, read with the ``BEGIN`` (None: not read)."""
        self._held_ids: dict[str, bytes] = {}
        """The ids in the blocks of each session read in this transaction (``b""``: none)."""

    def keys_read(self, last_seq: int) -> BatchKeys | None:
        read = self._read
        return read.keys if read is not None and read.last_seq == last_seq else None

    async def lock_tenant(self, tenant: Tenant) -> None:
        # BEGIN IMMEDIATE already holds the only write lock of the database file.
        return None

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        if self._last_seq is not None:
            last_seq, self._last_seq = self._last_seq, None  # read once, by the batch's start
            return last_seq
        row = await _fetchone(self._conn, _LAST_SEQ_SQL, (tenant.org_id, tenant.user_id, client_id))
        return int(row[0]) if row is not None else 0

    async def load(self, tenant: Tenant, keys: BatchKeys) -> Snapshot:
        read = self._read
        if read is not None and keys is read.keys:  # read with the BEGIN, head and all
            return _snapshot(tenant, keys, read.answers, self._held_ids)
        # Every lookup of the batch, and the head, in one hop to the connection's thread.
        each, self._head = await _on_thread(
            self._run, _fetch_each_and_head, _lookups(tenant, keys), _twice(tenant)
        )
        return _snapshot(tenant, keys, each, self._held_ids)

    async def write(self, tenant: Tenant, client_id: str, writes: BatchWrites) -> list[int]:
        t = (tenant.org_id, tenant.user_id)
        body = writes.bodies.of  # the feed refers to these rows: each body is stored once
        short, packed = compact.short_body, packed_tenant(tenant)  # (less what its row holds: 12)
        node = device_node(client_id)  # (and the pushing device's stamp node: 13)
        record_entries, event_entries = writes.entries()
        # An entry whose row this batch writes at its cursor names no id (schema 16: _own_row).
        at_cursor = {*record_entries, *event_entries}
        feed = [
            (*t, _KIND_NUMBERS[record_kind(r)], None if i in at_cursor else _key(r.id))
            for i, r in enumerate(writes.feed)
        ]
        records: list[tuple[Any, ...]] = []
        for r, at in zip(writes.records, record_entries, strict=True):
            info = kind_of(r)
            if info.merge == "versioned" or info.server_placed:
                raise TypeError(f"{info.name} records are not written as records")
            session_id = info.session_of(r)
            key, session_key = _key(r.id), None if session_id is None else _key(session_id)
            stored = short(body(r), key, session_key, packed, node)
            head = (at, _KIND_NUMBERS[info.name], key, r.org_id, r.user_id, session_key)
            if isinstance(r, AuditRow):
                # Its row hash in front; without its prev_hash where the row before holds it.
                prev = compact.digest_bytes(r.prev_hash) or b""
                hashed, chained = compact.audit_apart(
                    stored, compact.digest_bytes(r.row_hash) or b"", prev
                )
                records.append((*head, hashed, chained, prev, r.client_id, r.sequence_number))
            elif isinstance(r, Message):
                records.append((*head, stored))
            else:
                records.append((*head, stored, None, None, None, None))
        events: list[tuple[Any, ...]] = []
        for e, at in zip(writes.events, event_entries, strict=True):
            key, session_key = _key(e.id), _key(e.session_id)
            stored = short(body(e), key, session_key, packed, node)
            prev = compact.digest_bytes(e.prev_hash) or b""
            apart = compact.prev_apart(stored, prev)  # (kept where the row before holds prev)
            row = (at, key, session_key, e.sequence_number, e.org_id, e.user_id, stored)
            events.append((*row, None if apart is stored else apart, prev))
        rows = _Rows(
            records=records,
            events=events,
            sessions=[],
            id_blocks=[],
            id_drops=[],
            feed=feed,
            versioned={
                key: i
                for i, (_, _, kind, key) in enumerate(feed)
                if kind == _SESSION_KIND and key is not None
            },
            last_seq=None if writes.last_seq is None else (*t, client_id, writes.last_seq),
            places=[
                (*t, r.client_id, r.sequence_number, at)
                for r, at in zip(writes.records, record_entries, strict=True)
                if isinstance(r, AuditRow)
            ],
            head=None if writes.deleted_sessions else t + t,
            node=node,
        )
        for s in writes.sessions:
            key, laid = (
                _key(s.id),
                session_row(body(s), self._held_ids.pop(s.id, None), self._layout),
            )
            rows.sessions.append((key, *t, s.updated_at, laid.body, laid.ids_count))
            if laid.drop_from is not None:
                rows.id_drops.append((*t, key, laid.drop_from))
            rows.id_blocks += [(*t, key, part, ids) for part, ids in laid.puts]
        # Every statement of the batch in one hop to the connection's thread (see _on_thread),
        # or in place.
        cursors, self._head = await _on_thread(self._run, _write_rows, rows)
        if writes.deleted_sessions:
            await self._delete_content(tenant)
        return cursors

    async def head_cursor(self, tenant: Tenant) -> int:
        if self._head is None:
            self._head = await _head(self._conn, tenant)
        return self._head

    async def _delete_content(self, tenant: Tenant) -> None:
        """Delete the content of the tenant's deleted sessions (``BatchTx.write``)."""
        conn, t = self._conn, (tenant.org_id, tenant.user_id)
        rows = await _fetchall(conn, _TENANT_SESSIONS_SQL, t)
        sessions = [session for _, session in _sessions_of(rows, {})]
        deleted = [x.id for x in sessions if x.deleted]
        kinds = [_KIND_NUMBERS[kind] for kind in CASCADE_KINDS]
        rows = await _fetchall(conn, _CASCADE_CANDIDATES_SQL, (_json(deleted), *t, _json(kinds)))
        candidates = [
            decode_stored(KINDS[kind], _id_text(record_id), body) for kind, record_id, body in rows
        ]
        doomed = _json(
            [_KIND_NUMBERS[kind], record_id]
            for kind, record_id in content_to_delete(sessions, candidates)
        )
        if doomed != "[]":
            await _on_thread(conn, _drop_doomed, t, doomed)


def _drop_doomed(raw: sqlite3.Connection, t: tuple[str, str], doomed: str) -> None:
    """The records ``doomed`` names (``_DOOMED_SQL``) and their feed entries, on the
    connection's own thread: one hop (``_SQLiteTx._delete_content``)."""
    rows = raw.execute(_DOOMED_SQL, (*t, doomed)).fetchall()
    raw.executemany(_DROP_ENTRY_SQL, [(*t, rowid) for rowid, _, _, placed in rows if placed])
    astray = [(*t, kind, key) for _, kind, key, placed in rows if not placed]
    if astray:
        raw.executemany(_DROP_ENTRY_BY_ID_SQL, astray)
    for sql, message in ((_DELETE_RECORD_SQL, False), (_DELETE_MESSAGE_SQL, True)):
        raw.executemany(sql, [(at,) for at, kind, *_ in rows if (kind == _MESSAGE_KIND) == message])


# Only a session has more than one entry (an immutable record has one: migration 11).
_COMPACT = (
    f"DELETE FROM feed INDEXED BY feed_session WHERE tid = {_TENANT} "
    f"AND kind = {_SESSION_KIND} AND cursor <= ? "
    f"AND EXISTS (SELECT 1 FROM feed AS later INDEXED BY feed_session WHERE later.tid = feed.tid "
    f"AND later.kind = {_SESSION_KIND} AND later.record_id = feed.record_id "
    "AND later.cursor > feed.cursor)"
)
_SET_FLOOR_SQL = (
    f"INSERT INTO meta (tid, feed_floor) VALUES ({_TENANT}, ?) "
    "ON CONFLICT (tid) DO UPDATE SET feed_floor = excluded.feed_floor"
)
_RETAIN_SQL = f"SELECT cursor FROM feed WHERE tid = {_TENANT} ORDER BY cursor DESC LIMIT 1 OFFSET ?"


async def _compact(conn: aiosqlite.Connection, tenant: Tenant, keep_after_cursor: int) -> int:
    """Compact the feed at or below ``keep_after_cursor`` and raise the floor; in a write tx.

    Log compaction: only entries superseded by a later entry of the same record go (older
    versions of a session). The latest version of every record stays, so a pull from cursor
    0 is always a complete resync.
    """
    floor = await _floor(conn, tenant)
    new_floor = min(keep_after_cursor, await _head(conn, tenant))
    if new_floor <= floor:
        return 0
    dropped = await _rowcount(
        conn,
        _COMPACT,
        (tenant.org_id, tenant.user_id, new_floor),
    )
    await conn.execute(_SET_FLOOR_SQL, (tenant.org_id, tenant.user_id, new_floor))
    return dropped


IN_PLACE_MAX_CHANGES: Final = 64
IN_PLACE_MAX_BYTES: Final = 256 * 1024
"""A push of at most this many changes (and bytes of bodies, when the device sent them) runs
its ``BEGIN``, lookups and writes on the event loop's thread (``SQLiteServerStore._write``):
the SQLite work of a turn's push is smaller than the hops it would take. A larger one goes to
aiosqlite's thread, so that no push holds every other connection for long."""

CHECKPOINT_EVERY = 16
"""Write transactions between two checkpoints of the WAL, each run on a connection of its own
beside the writer's (``PRAGMA wal_checkpoint(PASSIVE)``: it copies what no reader still needs
and never waits for a lock), so that no push waits for one. SQLite's own checkpoint runs inside
the commit that takes the WAL past ``AUTOCHECKPOINT_PAGES`` (1,000 by default): that push then
copies and syncs the whole WAL before its ack goes out."""
AUTOCHECKPOINT_PAGES = 4000
"""SQLite's own checkpoint, kept as a safety net for side checkpoints that cannot keep up (a
long read holding an old snapshot): the WAL stays under about 16 MB."""


class SQLiteServerStore(AsyncResource):
    """The embedded server store: one SQLite file. Use as ``async with``.

    ``feed_retention`` (None: keep everything) keeps at most that many of a tenant's newest
    feed entries: every push compacts older ones away in its own transaction, and devices
    behind them get ``CursorTooOld`` and resync. ``synchronous`` is ``FULL`` by default: a push
    is acknowledged to the device, which then drops it, so it must survive power loss.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        feed_retention: int | None = None,
        synchronous: Literal["NORMAL", "FULL"] = "FULL",
        max_pull_limit: int = DEFAULT_MAX_PULL_LIMIT,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    ) -> None:
        if feed_retention is not None and feed_retention < 1:
            raise ValueError("feed_retention must be at least 1 (or None to keep everything)")
        if max_pull_limit < 1:
            raise ValueError("max_pull_limit must be at least 1")
        self.path = os.fspath(path)
        self.feed_retention = feed_retention
        self.synchronous = synchronous
        self.max_pull_limit = max_pull_limit
        self.busy_timeout_ms = busy_timeout_ms
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        self._checkpointer: aiosqlite.Connection | None = None
        self._checkpoints = Every(CHECKPOINT_EVERY, self._checkpoint)
        """A side checkpoint every ``CHECKPOINT_EVERY`` commits (``close`` waits for it)."""
        self._id_layout = SQLITE_ID_LAYOUT  # (where sessions keep their message ids)

    def __repr__(self) -> str:
        state = "open" if self._writer is not None else "closed"
        return f"<SQLiteServerStore {self.path!r} {state}>"

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, switch to WAL and migrate the schema; call once before anything else."""
        if self._writer is not None:
            raise InvalidState("store is already open")
        try:
            self._writer = await self._connect()
            await self._writer.execute("PRAGMA journal_mode = WAL")
            await self._writer.execute(f"PRAGMA synchronous = {self.synchronous}")
            await self._writer.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES}")
            await self._migrate(self._writer)
            self._reader = await self._connect()
            await self._reader.execute("PRAGMA query_only = 1")
        except BaseException as exc:
            await self.close()
            if isinstance(exc, sqlite3.Error):
                raise StorageUnavailable(f"cannot open {self.path}: {exc}") from exc
            raise

    async def close(self) -> None:
        """Close both connections; idempotent, and finishes even if the caller is cancelled."""
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        # Taking both locks lets an in-flight push or pull finish before its connection goes.
        async with self._write_lock, self._read_lock:
            await self._checkpoints.wait()  # never raises: it logs what fails
            writer, reader, checkpointer = self._writer, self._reader, self._checkpointer
            self._writer = self._reader = self._checkpointer = None
            for conn in (checkpointer, reader, writer):
                if conn is not None:
                    await conn.close()

    async def _checkpoint(self) -> None:
        try:
            if self._checkpointer is None:
                self._checkpointer = await self._connect()
            await self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:  # best effort: SQLite's own checkpoint still runs
            log.info("side checkpoint of %s failed: %s", self.path, exc)

    async def _connect(self) -> aiosqlite.Connection:
        # aiosqlite leaves its worker thread behind when connecting fails, and that thread
        # later crashes against a closed event loop: find out first, with plain sqlite3.
        await asyncio.to_thread(_probe, str(self.path))
        # isolation_level=None: we issue BEGIN / COMMIT ourselves, sqlite3 never does.
        # check_same_thread=False: a small push runs on the writer's connection in place
        # (``_write``), under the write lock, while aiosqlite's thread is idle.
        conn = await aiosqlite.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            await conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            await conn.create_function("pleach_key", 1, _sql_key, deterministic=True)
            await conn.create_function("pleach_digest", 1, _sql_digest, deterministic=True)
        except BaseException:
            await asyncio.shield(conn.close())
            raise
        return conn

    async def _migrate(self, conn: aiosqlite.Connection) -> None:
        await conn.execute("BEGIN IMMEDIATE")
        try:
            row = await _fetchone(conn, "PRAGMA user_version")
            version = int(row[0]) if row is not None else 0
            if version > SCHEMA_VERSION:
                raise StorageError(
                    f"{self.path} has schema version {version}; this build knows up to "
                    f"{SCHEMA_VERSION}: upgrade pleach"
                )
            for number, statements in enumerate(_MIGRATIONS[version:], start=version + 1):
                for statement in statements:
                    if isinstance(statement, str):
                        await conn.execute(statement)
                    else:
                        await statement(conn)
                await conn.execute(f"PRAGMA user_version = {number}")
            await conn.execute("COMMIT")
        except BaseException:
            await asyncio.shield(_rollback(conn))
            raise

    # -- transactions ------------------------------------------------------------------------

    def _wrap_tx(self, tx: StoreTx) -> StoreTx:
        """Hook: wraps the ``StoreTx`` view a push's rules run against (tests inject faults)."""
        return tx

    async def _write(
        self,
        body: Callable[[aiosqlite.Connection, sqlite3.Connection | None], Awaitable[T]],
        *,
        first: Callable[[sqlite3.Connection], None] | None = None,
        in_place: bool = False,
    ) -> T:
        """Run ``body(conn, raw)`` in one ``BEGIN IMMEDIATE`` transaction; roll back if it
        raises. ``first(raw)`` runs right after the ``BEGIN``, in its hop (a push's first read).

        ``in_place``: the ``BEGIN`` and ``first`` run on the caller's thread, on the writer's
        own ``sqlite3`` connection (``raw``, given to ``body``: what it runs there costs no
        hop), and only a ``COMMIT`` that wrote something goes to aiosqlite's thread, so that
        its fsync never holds the event loop. The ``BEGIN`` there never waits: when another
        process holds the write lock, the transaction is begun on aiosqlite's thread instead,
        which waits for it (``busy_timeout_ms``), and ``raw`` is None."""
        async with self._write_lock:
            conn = self._require(self._writer)
            written = conn._conn.total_changes  # rows changed by this connection so far
            raw = self._begin_in_place(conn, first) if in_place else None
            if raw is None:
                await _begin(conn, "BEGIN IMMEDIATE", first)
            try:
                result = await body(conn, raw)
                if raw is not None and raw.total_changes == written:
                    raw.execute("COMMIT")  # nothing written: nothing to sync
                else:
                    await conn.execute("COMMIT")
            except BaseException as exc:
                await asyncio.shield(_rollback(conn))
                if isinstance(exc, sqlite3.Error):
                    raise StorageUnavailable(f"write failed, rolled back: {exc}") from exc
                raise
            self._checkpoints.tick()
            return result

    def _begin_in_place(
        self, conn: aiosqlite.Connection, first: Callable[[sqlite3.Connection], None] | None
    ) -> sqlite3.Connection | None:
        """``BEGIN IMMEDIATE`` and ``first`` on the caller's thread (``_write``), on the writer's
        ``sqlite3`` connection, idle under the write lock; None when the write lock is another
        process's (not waited for here) or a transaction is open (``_begin`` mends it)."""
        raw: sqlite3.Connection = conn._conn
        try:
            raw.execute("PRAGMA busy_timeout = 0")
            try:
                raw.execute("BEGIN IMMEDIATE")
            finally:
                raw.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        except sqlite3.OperationalError as exc:
            log.debug("push not begun in place on %s: %s", self.path, exc)
            return None
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"cannot start a transaction: {exc}") from exc
        try:
            if first is not None:
                first(raw)
        except BaseException as exc:
            raw.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise StorageUnavailable(f"cannot start a transaction: {exc}") from exc
            raise
        return raw

    async def _read(self, body: Callable[[aiosqlite.Connection], Awaitable[T]]) -> T:
        """Run ``body`` in one read transaction (one consistent snapshot) on the reader."""
        async with self._read_lock:
            conn = self._require(self._reader)
            await _begin(conn, "BEGIN")
            try:
                try:
                    return await body(conn)
                finally:
                    await asyncio.shield(_rollback(conn))
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"read failed: {exc}") from exc

    def _require(self, conn: aiosqlite.Connection | None) -> aiosqlite.Connection:
        if conn is None:
            raise InvalidState("store is not open: use `async with` or call open() first")
        return conn

    # -- ServerStore -------------------------------------------------------------------------

    async def healthy(self) -> bool:
        if self._reader is None:
            return False
        try:
            await self._read(lambda conn: _fetchone(conn, "SELECT 1"))
        except (StorageUnavailable, InvalidState, ValueError):
            return False
        return True

    async def client_state(self, tenant: Tenant, client_id: str) -> tuple[int, int]:
        async def body(conn: aiosqlite.Connection) -> tuple[int, int]:
            row = await _fetchone(conn, _LAST_SEQ_SQL, (tenant.org_id, tenant.user_id, client_id))
            return (int(row[0]) if row is not None else 0), await _head(conn, tenant)

        return await self._read(body)

    async def push(
        self,
        tenant: Tenant,
        client_id: str,
        changes: list[Change],
        clock: HybridClock,
        *,
        aliases: Collection[str] = (),
        chains: bool = True,
        skipped: Collection[int] = (),
        bodies: Collection[bytes] = (),
    ) -> PushResult:
        read: list[_Read] = []

        def read_first(raw: sqlite3.Connection) -> None:
            # Right after the BEGIN, in its hop: everything the rules will look up (the
            # keys are pure work on the changes, done here rather than in a hop of their own).
            raw.execute(_ADD_TENANT_SQL, (tenant.org_id, tenant.user_id, packed_tenant(tenant)))
            row = raw.execute(_LAST_SEQ_SQL, (tenant.org_id, tenant.user_id, client_id)).fetchone()
            last_seq = int(row[0]) if row is not None else 0
            keys = batch_keys(
                changes,
                last_seq,
                tenant,
                client_id,
                aliases,
                audit=chains,
                skipped=frozenset(skipped),
            )
            answers, head = _fetch_each_and_head(raw, _lookups(tenant, keys), _twice(tenant))
            read.append(_Read(last_seq, keys, answers, head))

        async def body(conn: aiosqlite.Connection, raw: sqlite3.Connection | None) -> PushResult:
            result = await apply_push(
                _SQLiteTx(conn, read[-1] if read else None, raw, self._id_layout),
                tenant,
                client_id,
                changes,
                clock,
                clock.client_id,
                wrap=self._wrap_tx,
                aliases=aliases,
                chains=chains,
                skipped=skipped,
                bodies=bodies,
            )
            if self.feed_retention is not None and result.cursors:
                await self._retain(conn, tenant, self.feed_retention)
                result.feed, result.previous_head = [], None  # read the page back instead
            return result

        small = len(changes) + len(skipped) <= IN_PLACE_MAX_CHANGES
        in_place = small and sum(map(len, bodies)) <= IN_PLACE_MAX_BYTES
        return await self._write(body, first=read_first, in_place=in_place)

    async def _retain(self, conn: aiosqlite.Connection, tenant: Tenant, keep: int) -> None:
        row = await _fetchone(conn, _RETAIN_SQL, (tenant.org_id, tenant.user_id, keep))
        if row is not None:
            await _compact(conn, tenant, int(row[0]))

    async def pull(
        self,
        tenant: Tenant,
        cursor: int,
        limit: int,
        max_bytes: int | None = None,
        *,
        raw: bool = False,
    ) -> PullResult:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        limit = min(limit, self.max_pull_limit)
        budget = max_bytes if max_bytes is not None else _NO_BUDGET

        async def body(conn: aiosqlite.Connection) -> PullResult:
            # The floor, the page and its sessions' blocks in one hop to the reader's thread.
            params = (budget, tenant.org_id, tenant.user_id, cursor, limit + 1)
            floor, rows, blocks = await _on_thread(conn, _page_now, params, limit)
            if 0 < cursor < floor:  # cursor 0: a full resync, always complete
                raise CursorTooOld(
                    f"cursor {cursor} predates the retained feed (floor {floor}): resync"
                )
            page = [row for row in rows[:limit] if row[2]]
            taken = [
                (
                    int(c),
                    b
                    if count is None  # (taken as it is: a catch-up reads many such rows)
                    else stored_body(int(c), b, count, joined_blocks(blocks.get(key, ()))),
                )
                for c, b, _, count, key in page
            ]
            return feed_page(taken, cursor, len(rows) > len(taken), raw=raw)

        return await self._read(body)

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self._read(lambda conn: _head(conn, tenant))

    async def put_health(self, reports: Sequence[DeviceHealth]) -> None:
        if not reports:
            return
        rows = [(r.org_id, r.user_id, r.client_id, r.seen_at, r.health) for r in reports]
        tenants = dict.fromkeys((r.org_id, r.user_id) for r in reports)
        trims = [(*t, *t, MAX_DEVICES_PER_TENANT) for t in tenants]

        async def body(conn: aiosqlite.Connection, raw: sqlite3.Connection | None) -> None:
            await conn.executemany(_PUT_HEALTH_SQL, rows)
            await conn.executemany(_TRIM_DEVICES_SQL, trims)

        await self._write(body)

    async def list_health(self, limit: int = 1000) -> list[DeviceHealth]:
        rows = await self._read(lambda conn: _fetchall(conn, _LIST_HEALTH_SQL, (limit,)))
        return [
            DeviceHealth(org_id=o, user_id=u, client_id=c, seen_at=float(s), health=bytes(h))
            for o, u, c, s, h in rows
        ]

    async def compact_feed(self, tenant: Tenant, keep_after_cursor: int) -> int:
        return await self._write(lambda conn, _: _compact(conn, tenant, keep_after_cursor))


_NO_BUDGET = 1 << 62
_PULLER = "(SELECT packed FROM tenants WHERE org_id = ?2 AND user_id = ?3)"
_PULLED_EVENT = _whole_sql("e", _PULLER, event=True)
_PULLED_RECORD = _whole_sql("r", _PULLER, audit=True)
_PULLED_MESSAGE = _whole_sql("r", _PULLER)
"""``_WHOLE_EVENT``, ``_WHOLE_RECORD`` and ``_WHOLE_EITHER`` in a pull, whose rows are all
the pulling tenant's: its packed org and user read once a statement, not a probe a row (0.4
µs of the 1.25 a row takes to put a body together)."""

# A page of the feed (at most ?5 entries after cursor ?4), each entry's body read from the
# row it refers to: a record's or an event's by its rowid, the entry's cursor (migration 11;
# ``_own_row``: an entry that names no id, schema 16, has its row there; one that names an id
# is read through the table's key when its row is not there, as a process of a build before
# 11 wrote them), a session's through its key; ``within``: the entry is inside the byte budget
# (the first always is). A missing row reads as a NULL body, within the budget. A session
# whose ids are in blocks also answers their count and its key (its blocks are read next,
# in the same transaction: ``_PAGE_ID_BLOCKS_SQL``), and is counted with its ids.
_PULL_SQL = f"""
    SELECT cursor, body, n = 1 OR total <= ?1 AS within, ids_count, record_id FROM (
        SELECT cursor, body, ids_count, record_id,
            SUM(length(body) + 16 * COALESCE(ids_count, 0)) OVER w AS total,
            ROW_NUMBER() OVER w AS n
        FROM (
            SELECT f.cursor, f.record_id, CASE f.kind
                WHEN {_SESSION_KIND} THEN s.body
                WHEN {_EVENT_KIND} THEN COALESCE((SELECT {_PULLED_EVENT} FROM events AS e
                    WHERE e.rowid = f.cursor AND e.tid = f.tid AND {_own_row("e")}),
                    (SELECT {_PULLED_EVENT} FROM events AS e
                    WHERE e.tid = f.tid AND e.id = f.record_id))
                WHEN {_MESSAGE_KIND} THEN COALESCE((SELECT {_PULLED_MESSAGE} FROM messages AS r
                    WHERE r.rowid = f.cursor AND r.tid = f.tid AND r.kind = f.kind
                    AND {_own_row("r")}),
                    (SELECT {_PULLED_MESSAGE} FROM messages AS r
                    WHERE r.tid = f.tid AND r.kind = f.kind AND r.id = f.record_id))
                ELSE COALESCE((SELECT {_PULLED_RECORD} FROM records AS r WHERE r.rowid = f.cursor
                    AND r.tid = f.tid AND r.kind = f.kind AND {_own_row("r")}),
                    (SELECT {_PULLED_RECORD} FROM records AS r
                    WHERE r.tid = f.tid AND r.kind = f.kind AND r.id = f.record_id))
                END AS body, s.ids_count
            FROM feed AS f
            LEFT JOIN sessions AS s ON f.kind = {_SESSION_KIND}
                AND s.tid = f.tid AND s.id = f.record_id
            WHERE f.tid = (SELECT tid FROM tenants WHERE org_id = ?2 AND user_id = ?3)
                AND f.cursor > ?4
            ORDER BY f.cursor LIMIT ?5)
        WINDOW w AS (ORDER BY cursor ROWS UNBOUNDED PRECEDING))
    ORDER BY cursor"""
# The blocks of the page's sessions kept in blocks (their ids as one JSON array).
_PAGE_ID_BLOCKS_SQL = f"""
    SELECT b.id, b.part, b.ids FROM json_each(?3) AS k
    CROSS JOIN session_ids AS b ON b.tid = {_TENANT_12} AND b.id = pleach_key(k.value)"""


def _page_now(
    raw: sqlite3.Connection, params: tuple[Any, ...], limit: int
) -> tuple[int, list[Any], dict[Any, list[tuple[int, bytes]]]]:
    """A pull's reads (``_PULL_SQL``'s ``params``): the tenant's floor, the page's rows (at
    most ``limit`` + 1), and the blocks of the sessions among the first ``limit`` that keep
    their ids in blocks, by session key."""
    t = params[1:3]
    floor = raw.execute(_FLOOR_SQL, t).fetchone()
    rows = raw.execute(_PULL_SQL, params).fetchall()
    keys = [key for _, _, within, count, key in rows[:limit] if within and count is not None]
    blocks: dict[Any, list[tuple[int, bytes]]] = {}
    if keys:
        found = raw.execute(_PAGE_ID_BLOCKS_SQL, (*t, _json(map(_id_text, keys))))
        for key, part, ids in found:
            blocks.setdefault(key, []).append((part, ids))
    return (int(floor[0]) if floor is not None else 0), rows, blocks


def _begin_now(
    raw: sqlite3.Connection, statement: str, first: Callable[[sqlite3.Connection], None] | None
) -> None:
    raw.execute(statement)
    if first is None:
        return
    try:
        first(raw)
    except BaseException:
        raw.execute("ROLLBACK")
        raise


async def _begin(
    conn: aiosqlite.Connection,
    statement: str,
    first: Callable[[sqlite3.Connection], None] | None = None,
) -> None:
    """Open a transaction, never leaving one open behind a failure; ``first(raw)`` runs in
    the same hop to the connection's thread, right after it (the transaction is rolled back
    if it raises).

    A BEGIN whose caller was cancelled still runs on aiosqlite's thread: the transaction is
    then rolled back (shielded) before the cancellation goes on. A transaction left open
    anyway (by a bug, or a process state this code did not foresee) is rolled back and the
    BEGIN tried once more, so the store can never stay wedged on "cannot start a
    transaction within a transaction".
    """
    try:
        await _on_thread(conn, _begin_now, statement, first)
    except sqlite3.OperationalError as exc:
        if "within a transaction" not in str(exc):
            raise StorageUnavailable(f"cannot start a transaction: {exc}") from exc
        log.warning("a transaction was left open on %r; rolling it back", conn)
        await asyncio.shield(_rollback(conn))
        try:
            await _on_thread(conn, _begin_now, statement, first)
        except sqlite3.Error as again:
            raise StorageUnavailable(f"cannot start a transaction: {again}") from again
    except sqlite3.Error as exc:
        raise StorageUnavailable(f"cannot start a transaction: {exc}") from exc
    except BaseException:
        await asyncio.shield(_rollback(conn))
        raise


async def _rollback(conn: aiosqlite.Connection) -> None:
    """End the open transaction without keeping its writes; quiet when none is open."""
    try:
        await conn.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        # A COMMIT that went through before a cancellation leaves nothing to roll back.
        if "no transaction is active" not in str(exc):
            log.warning("rollback failed on %r: %s", conn, exc)


def _probe(path: str) -> None:
    sqlite3.connect(path).close()
