"""``SQLiteServerStore``: the embedded default server store, over aiosqlite.

One file, WAL mode, two connections: a writer (every push and compaction runs in ONE
``BEGIN IMMEDIATE`` transaction, serialized by a lock because aiosqlite shares one connection
between callers) and a reader (pulls and lookups, each in one read transaction, so they never
see a push that has not committed). The push rules live in ``apply.py``; this module only
speaks SQL. ``sqlite3`` errors are translated to ``StorageUnavailable`` (3009, retryable).

Schema (versioned by ``PRAGMA user_version``, migrated at ``open()``):

- ``sessions``: one row per session id, its msgpack body.
- ``records``: immutable records (messages, checkpoints, audit rows, artifact updates) by
  ``(kind, id)``.
- ``events``: canonical events; ``(session_id, sequence_number)`` is unique.
- ``feed``: every applied change per tenant under a global monotonic ``cursor``.
- ``clients``: ``last_seq`` per ``(tenant, client_id)``.
- ``meta``: the feed floor per tenant (entries at or below it were compacted away).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import aiosqlite
import msgspec

from shared.clock import HybridClock
from shared.errors import CursorTooOld, InvalidState, StorageError, StorageUnavailable
from shared.records import (
    Change,
    Event,
    FeedChange,
    Record,
    RecordKind,
    Session,
    decode_record,
    encode_record,
    record_kind,
)

from .apply import StoreTx, apply_push
from .base import PullResult, PushResult, Tenant

__all__ = ["DEFAULT_MAX_PULL_LIMIT", "SQLiteServerStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_PULL_LIMIT = 1000
"""A pull returns at most this many feed entries, whatever limit it asks for."""

DEFAULT_BUSY_TIMEOUT_MS = 5000

# One tuple of statements per schema version; never edit a shipped version, append a new one.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
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
)
SCHEMA_VERSION = len(_MIGRATIONS)

_SESSION_DECODER = msgspec.msgpack.Decoder(Session)

_HEAD_SQL = """SELECT MAX(
    COALESCE((SELECT MAX(cursor) FROM feed WHERE org_id = ? AND user_id = ?), 0),
    COALESCE((SELECT feed_floor FROM meta WHERE org_id = ? AND user_id = ?), 0))"""

_FLOOR_SQL = "SELECT feed_floor FROM meta WHERE org_id = ? AND user_id = ?"

_SESSION_OWNER_SQL = """
    SELECT org_id, user_id FROM sessions WHERE id = ?
    UNION ALL SELECT org_id, user_id FROM events WHERE session_id = ?
    UNION ALL SELECT org_id, user_id FROM records WHERE session_id = ?
    LIMIT 1"""


async def _fetchone(
    conn: aiosqlite.Connection, sql: str, params: Sequence[Any] = ()
) -> sqlite3.Row | None:
    async with conn.execute(sql, params) as cur:
        return await cur.fetchone()


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


class _SQLiteTx:
    """``StoreTx`` over the writer connection, inside the push's ``BEGIN IMMEDIATE``."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def lock_tenant(self, tenant: Tenant) -> None:
        # BEGIN IMMEDIATE already holds the only write lock of the database file.
        return None

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        row = await _fetchone(
            self._conn,
            "SELECT last_seq FROM clients WHERE org_id = ? AND user_id = ? AND client_id = ?",
            (tenant.org_id, tenant.user_id, client_id),
        )
        return int(row[0]) if row is not None else 0

    async def set_last_seq(self, tenant: Tenant, client_id: str, last_seq: int) -> None:
        await self._conn.execute(
            "INSERT INTO clients (org_id, user_id, client_id, last_seq) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (org_id, user_id, client_id) DO UPDATE SET last_seq = excluded.last_seq",
            (tenant.org_id, tenant.user_id, client_id, last_seq),
        )

    async def owner_of(self, kind: RecordKind, record_id: str) -> Tenant | None:
        if kind == "Session":
            row = await _fetchone(self._conn, _SESSION_OWNER_SQL, (record_id,) * 3)
        elif kind == "Event":
            row = await _fetchone(
                self._conn, "SELECT org_id, user_id FROM events WHERE id = ?", (record_id,)
            )
        else:
            row = await _fetchone(
                self._conn,
                "SELECT org_id, user_id FROM records WHERE kind = ? AND id = ?",
                (kind, record_id),
            )
        return Tenant(org_id=row[0], user_id=row[1]) if row is not None else None

    async def get_session(self, session_id: str) -> Session | None:
        row = await _fetchone(self._conn, "SELECT body FROM sessions WHERE id = ?", (session_id,))
        if row is None:
            return None
        try:
            return _SESSION_DECODER.decode(row[0])
        except msgspec.DecodeError as exc:
            raise StorageError(f"corrupt session row {session_id!r}") from exc

    async def put_session(self, session: Session) -> None:
        await self._conn.execute(
            "INSERT INTO sessions (id, org_id, user_id, updated_at, body) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET org_id = excluded.org_id, "
            "user_id = excluded.user_id, updated_at = excluded.updated_at, body = excluded.body",
            (
                session.id,
                session.org_id,
                session.user_id,
                session.updated_at,
                encode_record(session),
            ),
        )

    async def insert_if_absent(self, record: Record) -> bool:
        if isinstance(record, Session | Event):
            raise TypeError(f"{record_kind(record)} records are not stored by insert_if_absent")
        count = await _rowcount(
            self._conn,
            "INSERT INTO records (kind, id, org_id, user_id, session_id, body) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (kind, id) DO NOTHING",
            (
                record_kind(record),
                record.id,
                record.org_id,
                record.user_id,
                record.session_id,
                encode_record(record),
            ),
        )
        return count == 1

    async def last_event(self, session_id: str) -> tuple[int, str] | None:
        row = await _fetchone(
            self._conn,
            "SELECT sequence_number, row_hash FROM events WHERE session_id = ? "
            "ORDER BY sequence_number DESC LIMIT 1",
            (session_id,),
        )
        return (int(row[0]), str(row[1])) if row is not None else None

    async def insert_event(self, event: Event) -> None:
        await self._conn.execute(
            "INSERT INTO events (id, session_id, sequence_number, org_id, user_id, row_hash, body)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                event.id,
                event.session_id,
                event.sequence_number,
                event.org_id,
                event.user_id,
                event.row_hash,
                encode_record(event),
            ),
        )

    async def append_feed(self, tenant: Tenant, record: Record) -> int:
        row = await _fetchone(
            self._conn,
            "INSERT INTO feed (org_id, user_id, kind, record_id, body) VALUES (?, ?, ?, ?, ?) "
            "RETURNING cursor",
            (tenant.org_id, tenant.user_id, record_kind(record), record.id, encode_record(record)),
        )
        if row is None:  # pragma: no cover - RETURNING always yields the row
            raise StorageError("feed insert returned no cursor")
        return int(row[0])

    async def head_cursor(self, tenant: Tenant) -> int:
        return await _head(self._conn, tenant)


async def _compact(conn: aiosqlite.Connection, tenant: Tenant, keep_after_cursor: int) -> int:
    """Drop feed entries at or below ``keep_after_cursor``, raising the floor; in a write tx."""
    floor = await _floor(conn, tenant)
    new_floor = min(keep_after_cursor, await _head(conn, tenant))
    if new_floor <= floor:
        return 0
    dropped = await _rowcount(
        conn,
        "DELETE FROM feed WHERE org_id = ? AND user_id = ? AND cursor <= ?",
        (tenant.org_id, tenant.user_id, new_floor),
    )
    await conn.execute(
        "INSERT INTO meta (org_id, user_id, feed_floor) VALUES (?, ?, ?) "
        "ON CONFLICT (org_id, user_id) DO UPDATE SET feed_floor = excluded.feed_floor",
        (tenant.org_id, tenant.user_id, new_floor),
    )
    return dropped


class SQLiteServerStore:
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

    def __repr__(self) -> str:
        state = "open" if self._writer is not None else "closed"
        return f"<SQLiteServerStore {self.path!r} {state}>"

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Connect, switch to WAL and migrate the schema; call once before anything else."""
        if self._writer is not None:
            raise InvalidState("store is already open")
        try:
            self._writer = await self._connect()
            await self._writer.execute("PRAGMA journal_mode = WAL")
            await self._writer.execute(f"PRAGMA synchronous = {self.synchronous}")
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
            writer, reader = self._writer, self._reader
            self._writer = self._reader = None
            for conn in (reader, writer):
                if conn is not None:
                    await conn.close()

    async def _connect(self) -> aiosqlite.Connection:
        # isolation_level=None: we issue BEGIN / COMMIT ourselves, sqlite3 never does.
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
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
                    await conn.execute(statement)
                await conn.execute(f"PRAGMA user_version = {number}")
            await conn.execute("COMMIT")
        except BaseException:
            await asyncio.shield(_rollback(conn))
            raise

    # -- transactions ------------------------------------------------------------------------

    def _wrap_tx(self, tx: StoreTx) -> StoreTx:
        """Hook: the ``StoreTx`` a push runs against. Tests override it to inject faults."""
        return tx

    async def _write(self, body: Callable[[aiosqlite.Connection], Awaitable[T]]) -> T:
        """Run ``body`` in one ``BEGIN IMMEDIATE`` transaction; roll back if it raises."""
        async with self._write_lock:
            conn = self._require(self._writer)
            try:
                await conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"cannot start a write transaction: {exc}") from exc
            try:
                result = await body(conn)
                await conn.execute("COMMIT")
            except BaseException as exc:
                await asyncio.shield(_rollback(conn))
                if isinstance(exc, sqlite3.Error):
                    raise StorageUnavailable(f"write failed, rolled back: {exc}") from exc
                raise
            return result

    async def _read(self, body: Callable[[aiosqlite.Connection], Awaitable[T]]) -> T:
        """Run ``body`` in one read transaction (one consistent snapshot) on the reader."""
        async with self._read_lock:
            conn = self._require(self._reader)
            try:
                await conn.execute("BEGIN")
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
            row = await _fetchone(
                conn,
                "SELECT last_seq FROM clients WHERE org_id = ? AND user_id = ? AND client_id = ?",
                (tenant.org_id, tenant.user_id, client_id),
            )
            return (int(row[0]) if row is not None else 0), await _head(conn, tenant)

        return await self._read(body)

    async def push(
        self, tenant: Tenant, client_id: str, changes: list[Change], clock: HybridClock
    ) -> PushResult:
        async def body(conn: aiosqlite.Connection) -> PushResult:
            tx = self._wrap_tx(_SQLiteTx(conn))
            result = await apply_push(tx, tenant, client_id, changes, clock, clock.client_id)
            if self.feed_retention is not None and result.cursors:
                await self._retain(conn, tenant, self.feed_retention)
            return result

        return await self._write(body)

    async def _retain(self, conn: aiosqlite.Connection, tenant: Tenant, keep: int) -> None:
        row = await _fetchone(
            conn,
            "SELECT cursor FROM feed WHERE org_id = ? AND user_id = ? "
            "ORDER BY cursor DESC LIMIT 1 OFFSET ?",
            (tenant.org_id, tenant.user_id, keep),
        )
        if row is not None:
            await _compact(conn, tenant, int(row[0]))

    async def pull(self, tenant: Tenant, cursor: int, limit: int) -> PullResult:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        limit = min(limit, self.max_pull_limit)

        async def body(conn: aiosqlite.Connection) -> PullResult:
            floor = await _floor(conn, tenant)
            if cursor < floor:
                raise CursorTooOld(
                    f"cursor {cursor} predates the retained feed (floor {floor}): resync"
                )
            async with conn.execute(
                "SELECT cursor, body FROM feed WHERE org_id = ? AND user_id = ? AND cursor > ? "
                "ORDER BY cursor LIMIT ?",
                (tenant.org_id, tenant.user_id, cursor, limit + 1),
            ) as cur:
                rows = list(await cur.fetchall())
            changes = [
                FeedChange(cursor=int(c), record=_decode(int(c), b)) for c, b in rows[:limit]
            ]
            return PullResult(
                changes=changes,
                to_cursor=changes[-1].cursor if changes else cursor,
                more=len(rows) > limit,
            )

        return await self._read(body)

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self._read(lambda conn: _head(conn, tenant))

    async def compact_feed(self, tenant: Tenant, keep_after_cursor: int) -> int:
        return await self._write(lambda conn: _compact(conn, tenant, keep_after_cursor))


def _decode(cursor: int, body: bytes) -> Record:
    try:
        return decode_record(body)
    except msgspec.DecodeError as exc:
        raise StorageError(f"corrupt feed entry at cursor {cursor}") from exc


async def _rollback(conn: aiosqlite.Connection) -> None:
    """End the open transaction without keeping its writes; quiet when none is open."""
    try:
        await conn.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        # A COMMIT that went through before a cancellation leaves nothing to roll back.
        if "no transaction is active" not in str(exc):
            log.warning("rollback failed on %r: %s", conn, exc)
