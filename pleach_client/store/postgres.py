"""``PostgresAdapter``: the device store on PostgreSQL, for hosts that run the runtime
server-side: one database, many devices (each user's runtime is one), over asyncpg.

It keeps the semantics of ``SQLiteAdapter`` (the same conformance suite runs against both):
every record is stored as its compact bytes (``shared.compact``) beside the columns its queries
filter and sort on; a commit is one transaction; the outbox refers to records by kind and id;
``client_seq`` is never handed out twice; a schema written by a newer pleach is refused.

**Devices.** Every table has ``device`` as the first column of its primary key, and every
statement names the adapter's ``device_key``: adapters on one database with different keys
never see or wait for each other's rows. One key is what one SQLite file is: one device, its
sessions, outbox, cursor and client id.

**One writer per device.** A write transaction first locks its device's row in ``devices``
(``SELECT ... FOR UPDATE``; the row also holds the highest ``client_seq`` given out) and holds
the lock until COMMIT or ROLLBACK: SQLite's ``BEGIN IMMEDIATE``. Two adapters on one key (two
processes, two pools) write one at a time; a writer that waits longer than ``lock_timeout_ms``
gets a retryable ``StorageError``. Once the lock is granted, the transaction's statements see
every commit made before (READ COMMITTED takes a snapshot per statement, and PostgreSQL makes
a commit visible before it releases the committer's locks), so a ``transact`` plan decides on
the store as it is. Within one adapter, writes queue on an ``asyncio.Lock`` first and never
hold pool connections waiting on each other. Reads run outside transactions and see committed
data only.

**Failures.** asyncpg errors become ``StorageError``: retryable for a lost connection, a
server shutting down or refusing connections, a lock or statement timeout, a serialization
failure; not retryable otherwise (a constraint, a value out of range). A pooled connection
found dead is terminated, and a read (or a write that failed at ``BEGIN``) is retried once on
a fresh one; a write that failed later is never retried here.

The schema is versioned in ``<schema>.schema_migrations``; ``open()`` applies what is missing
under a session advisory lock (several processes may start at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import warnings
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from enum import Enum
from functools import partial
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import msgspec

from shared import compact
from shared.errors import InvalidState, StorageError
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
    event_place_of,
    fixed_plan,
    marked_canonical,
    outbox_entries,
)

__all__ = ["DEFAULT_SCHEMA", "SCHEMA_VERSION", "PostgresAdapter"]

DEFAULT_SCHEMA: Final = "pleach_client"
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MAX_DEVICE_KEY = 200

_T = TypeVar("_T")

# One tuple of statements per schema version; append, never edit a released step. ``{s}`` is
# the schema (checked against _SCHEMA_RE). Text that is sorted or compared is COLLATE "C":
# byte order, as SQLite and MemoryAdapter sort, whatever the database's default collation.
_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (  # 1: the initial schema
        """CREATE TABLE {s}.devices (
            device text COLLATE "C" PRIMARY KEY,
            last_seq bigint NOT NULL DEFAULT 0,
            created_at timestamptz NOT NULL DEFAULT now())""",
        """CREATE TABLE {s}.sessions (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            updated_at text COLLATE "C" NOT NULL,
            deleted boolean NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX sessions_updated ON {s}.sessions (device, updated_at, id)",
        "CREATE INDEX sessions_live ON {s}.sessions (device, updated_at, id) WHERE NOT deleted",
        """CREATE TABLE {s}.messages (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            hlc text COLLATE "C" NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX messages_session ON {s}.messages (device, session_id)",
        """CREATE TABLE {s}.checkpoints (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            hlc text COLLATE "C" NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX checkpoints_session ON {s}.checkpoints (device, session_id, hlc, id)",
        """CREATE TABLE {s}.events (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            sequence_number bigint NOT NULL,
            hlc text COLLATE "C" NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX events_session ON {s}.events (device, session_id, sequence_number, id)",
        """CREATE TABLE {s}.audit (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            client_id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            sequence_number bigint NOT NULL,
            subject_key text COLLATE "C",
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX audit_client ON {s}.audit (device, client_id, sequence_number, id)",
        "CREATE INDEX audit_session ON {s}.audit "
        "(device, session_id, client_id, sequence_number, id)",
        "CREATE INDEX audit_subject ON {s}.audit (device, subject_key) "
        "WHERE subject_key IS NOT NULL",
        """CREATE TABLE {s}.artifact_updates (
            device text COLLATE "C" NOT NULL,
            id text COLLATE "C" NOT NULL,
            artifact_id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            hlc text COLLATE "C" NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, id))""",
        "CREATE INDEX artifact_updates_artifact ON {s}.artifact_updates "
        "(device, artifact_id, hlc, id)",
        "CREATE INDEX artifact_updates_session ON {s}.artifact_updates (device, session_id)",
        # body is NULL: the row refers to its record by kind and id, and a flush reads the
        # stored version. A retried dead letter carries its copy.
        """CREATE TABLE {s}.outbox (
            device text COLLATE "C" NOT NULL,
            client_seq bigint NOT NULL,
            record_id text COLLATE "C" NOT NULL,
            kind text COLLATE "C" NOT NULL,
            body bytea,
            attempts integer NOT NULL DEFAULT 0,
            created_at double precision NOT NULL,
            last_error_code bigint,
            last_error_message text,
            PRIMARY KEY (device, client_seq))""",
        "CREATE INDEX outbox_record ON {s}.outbox (device, record_id)",
        """CREATE TABLE {s}.dead_letters (
            device text COLLATE "C" NOT NULL,
            client_seq bigint NOT NULL,
            record_id text COLLATE "C" NOT NULL,
            kind text COLLATE "C" NOT NULL,
            body bytea NOT NULL,
            code bigint NOT NULL,
            message text NOT NULL,
            attempts integer NOT NULL,
            failed_at double precision NOT NULL,
            PRIMARY KEY (device, client_seq))""",
        """CREATE TABLE {s}.sync_state (
            device text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            value text NOT NULL,
            PRIMARY KEY (device, key))""",
    ),
    # 2: a checkpoint's parent ('' for a root) and an event's type beside its body, as the
    # SQLite store keeps them: resume asks for the head's children and for the events the
    # fold counts, and read every checkpoint and every event of the session to find them.
    # Rows written before hold NULL there: they are read, and their bodies tell.
    (
        'ALTER TABLE {s}.checkpoints ADD COLUMN parent_id text COLLATE "C"',
        'ALTER TABLE {s}.events ADD COLUMN type text COLLATE "C"',
    ),
    # 3: a session's folded log, kept under the key of the log it was folded from
    # (``hydration.load_hydration``), as the SQLite store keeps it. A cache: never synced.
    (
        """CREATE TABLE {s}.hydrations (
            device text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            events bigint NOT NULL,
            sequence_number bigint NOT NULL,
            row_hash text NOT NULL,
            version integer NOT NULL,
            body bytea NOT NULL,
            PRIMARY KEY (device, session_id))""",
    ),
    # 4: records in protocol 8's form (``shared.compact``), which a build before reads as
    # corrupt rows: no table changes, the version makes such a build refuse the schema whole.
    ("SELECT 1",),
    # 5: records in protocol 9's form (``shared.compact``: a long text deflated): no table
    # changes, the version makes a build before refuse the schema whole.
    ("SELECT 1",),
)
SCHEMA_VERSION: Final = len(_MIGRATIONS)

# Errors after which trying again may succeed: the connection or the server went away, the
# server is starting or stopping, it ran out of connections, a lock or statement timed out,
# or a transaction lost a serialization race.
_TRANSIENT: Final[tuple[type[BaseException], ...]] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,  # 57: shutdown, query canceled (timeout)
    asyncpg.exceptions.InsufficientResourcesError,  # 53: too many connections
    asyncpg.exceptions.TransactionRollbackError,  # 40: serialization failure, deadlock
    asyncpg.exceptions.LockNotAvailableError,  # 55P03: lock_timeout
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
)
# Errors after which a connection must not go back into the pool.
_BROKEN: Final[tuple[type[BaseException], ...]] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    OSError,
    TimeoutError,
)
_DB_ERRORS: Final[tuple[type[BaseException], ...]] = (*_TRANSIENT, asyncpg.PostgresError)


class _State(Enum):
    CLOSED = "closed"
    OPENING = "opening"
    OPEN = "open"


def _redact(dsn: str) -> str:
    """``host:port/database`` of a DSN, without user or password (for messages)."""
    try:
        parts = urlsplit(dsn)
        host, port = parts.hostname or "localhost", parts.port or 5432
    except ValueError:
        return "<invalid dsn>"
    return f"{host}:{port}{parts.path or '/'}"


def _storage_error(action: str, exc: BaseException) -> StorageError:
    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return StorageError(f"{action} failed: {detail}", retryable=isinstance(exc, _TRANSIENT))


def _lock_key(*parts: str) -> int:
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _row_count(status: str) -> int:
    """The row count of a command status such as ``DELETE 3``."""
    return int(status.rsplit(" ", 1)[-1])


# -- records <-> rows ----------------------------------------------------------------------

_KINDS: Final = (Session, Message, Checkpoint, Event, AuditRow, ArtifactUpdate)
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError)


def _decode(cls: type[_T] | None, table: str, key: object, body: object) -> _T:
    """A stored body as a record (of ``cls``); a corrupt one is a ``StorageError``."""
    try:
        if not isinstance(body, bytes):
            raise TypeError(f"body is {type(body).__name__}, not bytes")
        record = compact.decode(body)
        if cls is not None and not isinstance(record, cls):
            raise TypeError(f"holds a {type(record).__name__}, not a {cls.__name__}")
    except _DECODE_ERRORS as exc:
        raise StorageError(f"corrupt row in {table} (id {key!r}): {exc}") from exc
    return record  # type: ignore[return-value]


def _encode(record: object) -> bytes:
    try:
        return compact.encode(record)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError, msgspec.EncodeError) as exc:
        name = getattr(record, "id", "?")
        raise StorageError(
            f"commit failed: cannot encode {type(record).__name__} {name!r}: {exc}"
        ) from exc


class _Rows:
    """A batch's records as column arrays per table (one statement per table). Upserted
    kinds keep the last version of an id, the immutable kinds the first, as one
    ``executemany`` per table does in SQLite."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[str, bool, bytes]] = {}
        self.events: dict[str, tuple[str, int, str, str, bytes]] = {}
        self.messages: dict[str, tuple[str, str, bytes]] = {}
        self.checkpoints: dict[str, tuple[str, str, str, bytes]] = {}
        self.audit: dict[str, tuple[str, str, int, str | None, bytes]] = {}
        self.artifacts: dict[str, tuple[str, str, str, bytes]] = {}

    def add(self, records: Iterable[Record]) -> list[tuple[str, str]]:
        """Take ``records`` in; returns ``(id, kind)`` of each, in order, for the outbox."""
        refs: list[tuple[str, str]] = []
        for record in records:
            if not isinstance(record, _KINDS):
                raise StorageError(f"commit failed: not a record: {type(record).__name__}")
            body = _encode(record)
            match record:
                case Session():
                    self.sessions[record.id] = (record.updated_at, bool(record.deleted), body)
                case Event():
                    self.events[record.id] = (
                        record.session_id,
                        record.sequence_number,
                        record.hlc,
                        record.type,
                        body,
                    )
                case Message():
                    self.messages.setdefault(record.id, (record.session_id, record.hlc, body))
                case Checkpoint():
                    self.checkpoints.setdefault(
                        record.id, (record.session_id, record.hlc, record.parent_id or "", body)
                    )
                case AuditRow():
                    self.audit.setdefault(
                        record.id,
                        (
                            record.client_id,
                            record.session_id,
                            record.sequence_number,
                            record.subject_key,
                            body,
                        ),
                    )
                case ArtifactUpdate():
                    self.artifacts.setdefault(
                        record.id, (record.artifact_id, record.session_id, record.hlc, body)
                    )
            refs.append((record.id, type(record).__name__))
        return refs

    def statements(self, sql: _Sql) -> list[tuple[str, list[list[Any]]]]:
        """``(statement, column arrays)`` for every table with rows."""
        out: list[tuple[str, list[list[Any]]]] = []
        tables: tuple[tuple[str, Mapping[str, tuple[Any, ...]]], ...] = (
            (sql.put_sessions, self.sessions),
            (sql.put_messages, self.messages),
            (sql.put_checkpoints, self.checkpoints),
            (sql.put_events, self.events),
            (sql.put_audit, self.audit),
            (sql.put_artifacts, self.artifacts),
        )
        for statement, rows in tables:
            if rows:
                values = list(rows.values())
                columns = [list(rows), *(list(column) for column in zip(*values, strict=True))]
                out.append((statement, columns))
        return out


# -- SQL -----------------------------------------------------------------------------------

# The outbox refers to every record by kind and id (``body`` NULL); a flush reads the record
# where it is stored. A retried dead letter carries its own copy.
_OUTBOX_TABLES: Final[dict[str, str]] = {
    "Session": "sessions",
    "Message": "messages",
    "Checkpoint": "checkpoints",
    "Event": "events",
    "AuditRow": "audit",
    "ArtifactUpdate": "artifact_updates",
}


class _Sql:
    """The statements of one schema, formatted once. ``$1`` is always the device key."""

    def __init__(self, s: str) -> None:
        # An outbox row's record: its copy, else one primary-key probe into the table its
        # kind names (CASE runs only the matching branch), so reading n rows costs n probes
        # however much the device stores.
        body = (
            "COALESCE(o.body, CASE o.kind "
            + " ".join(
                f"WHEN '{kind}' THEN (SELECT t.body FROM {s}.{table} AS t "
                "WHERE t.device = o.device AND t.id = o.record_id)"
                for kind, table in _OUTBOX_TABLES.items()
            )
            + " END)"
        )
        self.lock_device = f"SELECT last_seq FROM {s}.devices WHERE device = $1 FOR UPDATE"
        self.add_device = f"INSERT INTO {s}.devices (device) VALUES ($1) ON CONFLICT DO NOTHING"
        self.last_seq = f"SELECT last_seq FROM {s}.devices WHERE device = $1"
        self.set_last_seq = f"UPDATE {s}.devices SET last_seq = $2 WHERE device = $1"
        # -- writes: one statement per table, the rows as column arrays --
        self.put_sessions = (
            f"INSERT INTO {s}.sessions (device, id, updated_at, deleted, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::boolean[], $5::bytea[]) "
            "ON CONFLICT (device, id) DO UPDATE SET updated_at = excluded.updated_at, "
            "deleted = excluded.deleted, body = excluded.body"
        )
        self.put_messages = (
            f"INSERT INTO {s}.messages (device, id, session_id, hlc, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[]) "
            "ON CONFLICT DO NOTHING"
        )
        self.put_checkpoints = (
            f"INSERT INTO {s}.checkpoints (device, id, session_id, hlc, parent_id, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], "
            "$6::bytea[]) ON CONFLICT DO NOTHING"
        )
        self.put_events = (
            f"INSERT INTO {s}.events (device, id, session_id, sequence_number, hlc, type, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::bigint[], $5::text[], "
            "$6::text[], $7::bytea[]) ON CONFLICT (device, id) DO UPDATE SET "
            "session_id = excluded.session_id, sequence_number = excluded.sequence_number, "
            "hlc = excluded.hlc, type = excluded.type, body = excluded.body"
        )
        self.put_audit = (
            f"INSERT INTO {s}.audit "
            "(device, id, client_id, session_id, sequence_number, subject_key, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[], "
            "$6::text[], $7::bytea[]) ON CONFLICT DO NOTHING"
        )
        self.put_artifacts = (
            f"INSERT INTO {s}.artifact_updates (device, id, artifact_id, session_id, hlc, body) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], "
            "$6::bytea[]) ON CONFLICT DO NOTHING"
        )
        self.put_meta = (
            f"INSERT INTO {s}.sync_state (device, key, value) "
            "SELECT $1, * FROM unnest($2::text[], $3::text[]) "
            "ON CONFLICT (device, key) DO UPDATE SET value = excluded.value"
        )
        # n outbox rows and the device's new last_seq ($2) in one statement.
        self.enqueue = (
            f"WITH queued AS (INSERT INTO {s}.outbox "
            "(device, client_seq, record_id, kind, body, attempts, created_at) "
            "SELECT $1, seq, record_id, kind, NULL, 0, $3 "
            "FROM unnest($4::bigint[], $5::text[], $6::text[]) AS r (seq, record_id, kind)) "
            f"UPDATE {s}.devices SET last_seq = $2 WHERE device = $1"
        )
        self.rechain_audit = (
            f"UPDATE {s}.audit AS a SET client_id = u.client_id, "
            "sequence_number = u.sequence_number, body = u.body "
            "FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bytea[]) "
            "AS u (id, client_id, sequence_number, body) WHERE a.device = $1 AND a.id = u.id"
        )
        self.event_bodies = f"SELECT id, body FROM {s}.events WHERE device = $1 AND id = ANY($2)"
        self.put_event_bodies = (
            f"UPDATE {s}.events AS e SET body = u.body "
            "FROM unnest($2::text[], $3::bytea[]) AS u (id, body) "
            "WHERE e.device = $1 AND e.id = u.id"
        )
        # Purges. Queued rows of purged contents are not removed (client_seq must stay
        # gap-free: the server refuses a gap) but turned into references to the deleted
        # session's row: they send its tombstone, and the contents never leave the device.
        # $2: the session ids; $3: the ids (artifact ids for updates) a live fork still uses.
        self.purge_sessions = (
            f"UPDATE {s}.outbox AS o SET kind = 'Session', record_id = p.session_id, "
            "body = NULL FROM ("
            f"SELECT 'Message' AS kind, id, session_id FROM {s}.messages "
            "WHERE device = $1 AND session_id = ANY($2::text[]) AND id <> ALL($3::text[]) "
            f"UNION ALL SELECT 'Checkpoint', id, session_id FROM {s}.checkpoints "
            "WHERE device = $1 AND session_id = ANY($2::text[]) AND id <> ALL($3::text[]) "
            f"UNION ALL SELECT 'ArtifactUpdate', id, session_id FROM {s}.artifact_updates "
            "WHERE device = $1 AND session_id = ANY($2::text[]) "
            "AND artifact_id <> ALL($3::text[])) AS p "
            "WHERE o.device = $1 AND o.kind = p.kind AND o.record_id = p.id",
            f"DELETE FROM {s}.messages WHERE device = $1 AND session_id = ANY($2::text[]) "
            "AND id <> ALL($3::text[])",
            f"DELETE FROM {s}.checkpoints WHERE device = $1 AND session_id = ANY($2::text[]) "
            "AND id <> ALL($3::text[])",
            f"DELETE FROM {s}.artifact_updates WHERE device = $1 "
            "AND session_id = ANY($2::text[]) AND artifact_id <> ALL($3::text[])",
        )
        self.purge_checkpoints = (
            f"UPDATE {s}.outbox AS o SET kind = 'Session', record_id = c.session_id, "
            f"body = NULL FROM {s}.checkpoints AS c WHERE o.device = $1 "
            "AND o.kind = 'Checkpoint' AND c.device = $1 AND c.id = o.record_id "
            "AND c.session_id = ANY($2::text[])",
            f"DELETE FROM {s}.checkpoints WHERE device = $1 AND session_id = ANY($2::text[])",
        )
        # Through negative numbers, so no two rows ever hold one key mid-statement.
        self.renumber_outbox = (
            f"UPDATE {s}.outbox AS o SET client_seq = -r.n FROM (SELECT client_seq, "
            f"row_number() OVER (ORDER BY client_seq) AS n FROM {s}.outbox WHERE device = $1) "
            "AS r WHERE o.device = $1 AND o.client_seq = r.client_seq",
            f"UPDATE {s}.outbox SET client_seq = -client_seq WHERE device = $1 AND client_seq < 0",
        )
        self.audit_rows = f"SELECT id, body FROM {s}.audit WHERE device = $1 AND id = ANY($2)"
        self.audit_subject = (
            f"SELECT id, body FROM {s}.audit WHERE device = $1 AND subject_key = $2"
        )
        self.redact_audit = (
            f"UPDATE {s}.audit AS a SET subject_key = NULL, body = u.body "
            "FROM unnest($2::text[], $3::bytea[]) AS u (id, body) "
            "WHERE a.device = $1 AND a.id = u.id"
        )
        self.outbox_remove = (
            f"DELETE FROM {s}.outbox WHERE device = $1 AND client_seq = ANY($2::bigint[])"
        )
        self.outbox_mark_attempt = (
            f"UPDATE {s}.outbox SET attempts = attempts + 1, last_error_code = $3, "
            "last_error_message = $4 WHERE device = $1 AND client_seq = ANY($2::bigint[])"
        )
        self.dead_letter = (
            f"WITH o AS (DELETE FROM {s}.outbox WHERE device = $1 AND client_seq = $2 "
            f"RETURNING *) INSERT INTO {s}.dead_letters "
            "(device, client_seq, record_id, kind, body, code, message, attempts, failed_at) "
            f"SELECT o.device, o.client_seq, o.record_id, o.kind, {body}, $3, $4, o.attempts, "
            "$5 FROM o"
        )
        # The new client_seq ($2), or no row when the dead letter is unknown.
        self.retry_dead_letter = (
            f"WITH d AS (DELETE FROM {s}.dead_letters WHERE device = $1 AND client_seq = $3 "
            f"RETURNING record_id, kind, body), q AS (INSERT INTO {s}.outbox "
            "(device, client_seq, record_id, kind, body, attempts, created_at) "
            "SELECT $1, $2, record_id, kind, body, 0, $4 FROM d RETURNING client_seq) "
            f"UPDATE {s}.devices SET last_seq = q.client_seq FROM q WHERE device = $1 "
            "RETURNING last_seq"
        )
        self.discard_dead_letter = (
            f"DELETE FROM {s}.dead_letters WHERE device = $1 AND client_seq = $2"
        )
        # -- reads --
        self.get_session = f"SELECT id, body FROM {s}.sessions WHERE device = $1 AND id = $2"
        self.list_sessions = (
            f"SELECT id, body FROM {s}.sessions WHERE device = $1 AND NOT deleted "
            "ORDER BY updated_at DESC, id DESC"
        )
        self.list_sessions_all = (
            f"SELECT id, body FROM {s}.sessions WHERE device = $1 ORDER BY updated_at DESC, id DESC"
        )
        self.get_messages = (
            f"SELECT id, body FROM {s}.messages WHERE device = $1 AND id = ANY($2::text[])"
        )
        self.missing_messages = (
            "SELECT k.id FROM unnest($2::text[]) WITH ORDINALITY AS k (id, n) WHERE NOT EXISTS "
            f"(SELECT 1 FROM {s}.messages AS m WHERE m.device = $1 AND m.id = k.id) "
            "ORDER BY k.n"
        )
        self.get_checkpoint = f"SELECT id, body FROM {s}.checkpoints WHERE device = $1 AND id = $2"
        self.list_checkpoints = (
            f"SELECT id, body FROM {s}.checkpoints WHERE device = $1 AND session_id = $2 "
            "ORDER BY hlc, id"
        )
        # A row written before schema 2 has NULL parent_id: it is read, and its body tells.
        self.child_checkpoints = (
            f"SELECT id, body FROM {s}.checkpoints WHERE device = $1 AND session_id = $2 "
            "AND (parent_id = $3 OR parent_id IS NULL) ORDER BY hlc, id"
        )
        self.get_event = f"SELECT id, body FROM {s}.events WHERE device = $1 AND id = $2"
        self.event_head = (
            f"SELECT id, body FROM {s}.events WHERE device = $1 AND session_id = $2 "
            "ORDER BY sequence_number DESC, id DESC LIMIT 1"
        )
        # The size and the last event of the log's events up to $3, in one snapshot.
        self.hydration_key = (
            f"SELECT c.n, h.id, h.body FROM (SELECT count(*) AS n FROM {s}.events "
            "WHERE device = $1 AND session_id = $2 AND sequence_number <= $3) AS c "
            f"LEFT JOIN LATERAL (SELECT id, body FROM {s}.events WHERE device = $1 "
            "AND session_id = $2 AND sequence_number <= $3 "
            "ORDER BY sequence_number DESC, id DESC LIMIT 1) AS h ON true"
        )
        self.kept_hydration = (
            "SELECT events, sequence_number, row_hash, version, body "
            f"FROM {s}.hydrations WHERE device = $1 AND session_id = $2"
        )
        self.keep_hydration = (
            f"INSERT INTO {s}.hydrations "
            "(device, session_id, events, sequence_number, row_hash, version, body) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (device, session_id) DO UPDATE "
            "SET events = excluded.events, sequence_number = excluded.sequence_number, "
            "row_hash = excluded.row_hash, version = excluded.version, body = excluded.body"
        )
        self.list_events = (
            f"SELECT id, body FROM {s}.events WHERE device = $1 AND session_id = $2 "
            "AND sequence_number >= $3 ORDER BY sequence_number, id LIMIT $4"  # NULL: all
        )
        # Only the events of the types in $4 (a NULL type: written before schema 2, its body
        # tells), along the session's index.
        self.list_events_of_types = (
            f"SELECT id, body FROM {s}.events WHERE device = $1 AND session_id = $2 "
            "AND sequence_number >= $3 AND (type IS NULL OR type = ANY($4::text[])) "
            "ORDER BY sequence_number, id"
        )
        self.list_audit = (
            f"SELECT id, body FROM {s}.audit WHERE device = $1 "
            "ORDER BY client_id, sequence_number, id"
        )
        self.list_audit_session = (
            f"SELECT id, body FROM {s}.audit WHERE device = $1 AND session_id = $2 "
            "ORDER BY client_id, sequence_number, id"
        )
        self.list_audit_client = (
            f"SELECT id, body FROM {s}.audit WHERE device = $1 AND client_id = $2 "
            "ORDER BY sequence_number, id"
        )
        self.list_audit_both = (
            f"SELECT id, body FROM {s}.audit WHERE device = $1 AND session_id = $2 "
            "AND client_id = $3 ORDER BY sequence_number, id"
        )
        self.list_artifact_updates = (
            f"SELECT id, body FROM {s}.artifact_updates WHERE device = $1 "
            "AND artifact_id = $2 ORDER BY hlc, id"
        )
        self.get_meta = f"SELECT value FROM {s}.sync_state WHERE device = $1 AND key = $2"
        # $2: the page size, NULL for all.
        self.outbox_pending = (
            f"SELECT o.client_seq, {body}, o.attempts, o.created_at, o.last_error_code, "
            "o.last_error_message, o.body IS NULL AND o.kind = 'Session' AND EXISTS ("
            f"SELECT 1 FROM {s}.outbox l WHERE l.device = o.device "
            "AND l.record_id = o.record_id AND l.kind = 'Session' AND l.body IS NULL "
            "AND l.client_seq > o.client_seq) "
            f"FROM (SELECT * FROM {s}.outbox WHERE device = $1 "
            "AND client_seq > $3 ORDER BY client_seq LIMIT $2) AS o ORDER BY o.client_seq"
        )
        self.outbox_count = f"SELECT count(*) FROM {s}.outbox WHERE device = $1"
        self.session_queued = (
            f"SELECT 1 FROM {s}.outbox WHERE device = $1 AND kind = 'Session' "
            "AND record_id = $2 LIMIT 1"
        )
        self.dead_letters = (
            "SELECT client_seq, body, code, message, attempts, failed_at "
            f"FROM {s}.dead_letters WHERE device = $1 ORDER BY client_seq"
        )
        self.dead_letter_count = f"SELECT count(*) FROM {s}.dead_letters WHERE device = $1"


# -- migrations ------------------------------------------------------------------------------


async def _schema_version(conn: Any, s: str) -> int:
    """The schema's version (0: not created yet). Refuses a pleach-server schema."""
    row = await conn.fetchrow(
        "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, "
        "to_regclass($3) IS NOT NULL",
        f"{s}.feed",
        f"{s}.outbox",
        f"{s}.schema_migrations",
    )
    has_feed, has_outbox, has_versions = row
    if has_feed and not has_outbox:
        raise StorageError(
            f"schema {s} holds a pleach server store (pleach-server's), not device stores: "
            "give the client store its own schema"
        )
    if not has_versions:
        return 0
    version = int(
        await conn.fetchval(f"SELECT COALESCE(MAX(version), 0) FROM {s}.schema_migrations")
    )
    if version > SCHEMA_VERSION:
        raise StorageError(
            f"schema {s} has version {version}, newer than this pleach supports "
            f"({SCHEMA_VERSION}): upgrade pleach to open it"
        )
    return version


async def _migrate(conn: Any, s: str) -> int:
    """Bring schema ``s`` to ``SCHEMA_VERSION``; returns the version it had. Concurrent
    callers wait for each other on a session advisory lock; each version commits in one
    transaction with its ``schema_migrations`` row."""
    version = await _schema_version(conn, s)
    if version == SCHEMA_VERSION:
        return version
    key = _lock_key("pleach-client-migrate", s)
    await conn.execute("SELECT pg_advisory_lock($1)", key)
    try:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.schema_migrations ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        version = await _schema_version(conn, s)  # again, under the lock
        for number, statements in enumerate(_MIGRATIONS[version:], start=version + 1):
            async with conn.transaction():
                for statement in statements:
                    await conn.execute(statement.format(s=s))
                await conn.execute(
                    f"INSERT INTO {s}.schema_migrations (version) VALUES ($1)", number
                )
        return version
    finally:
        await asyncio.shield(conn.execute("SELECT pg_advisory_unlock($1)", key))


# -- the reader inside a write transaction ----------------------------------------------------


class _Reader:
    """``TxReader`` on the connection that holds the device's write lock."""

    def __init__(self, conn: Any, sql: _Sql, device: str) -> None:
        self._conn = conn
        self._sql = sql
        self._device = device

    async def _rows(self, statement: str, *args: Any) -> list[Any]:
        return list(await self._conn.fetch(statement, self._device, *args))

    async def get_meta(self, key: str) -> str | None:
        value = await self._conn.fetchval(self._sql.get_meta, self._device, key)
        return None if value is None else str(value)

    async def get_session(self, session_id: str) -> Session | None:
        rows = await self._rows(self._sql.get_session, session_id)
        return _decode(Session, "sessions", rows[0][0], rows[0][1]) if rows else None

    async def event_head(self, session_id: str) -> tuple[int, str]:
        rows = await self._rows(self._sql.event_head, session_id)
        if not rows:
            return (0, "")
        event = _decode(Event, "events", rows[0][0], rows[0][1])
        return (event.sequence_number, event.row_hash)

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[Event]:
        rows = await self._rows(self._sql.list_events, session_id, from_sequence, limit)
        return [_decode(Event, "events", key, body) for key, body in rows]

    async def event_places(
        self, session_id: str, *, from_sequence: int = 0, limit: int | None = None
    ) -> list[EventPlace]:
        rows = await self._rows(self._sql.list_events, session_id, from_sequence, limit)
        return [
            event_place_of(body, partial(_decode, Event, "events", key, body)) for key, body in rows
        ]

    async def list_sessions(self) -> list[Session]:
        rows = await self._rows(self._sql.list_sessions)
        return [_decode(Session, "sessions", key, body) for key, body in rows]

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        rows = await self._rows(self._sql.list_checkpoints, session_id)
        return [_decode(Checkpoint, "checkpoints", key, body) for key, body in rows]

    async def missing_messages(self, message_ids: list[str]) -> list[str]:
        if not message_ids:
            return []
        rows = await self._rows(self._sql.missing_messages, message_ids)
        return [str(row[0]) for row in rows]

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        if not message_ids:
            return []
        rows = await self._rows(self._sql.get_messages, message_ids)
        bodies: dict[str, bytes] = {row_id: body for row_id, body in rows}
        return [
            _decode(Message, "messages", message_id, bodies[message_id])
            for message_id in message_ids
            if message_id in bodies
        ]

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        rows = await self._rows(self._sql.list_artifact_updates, artifact_id)
        return [_decode(ArtifactUpdate, "artifact_updates", key, body) for key, body in rows]

    async def session_queued(self, session_id: str) -> bool:
        return bool(await self._rows(self._sql.session_queued, session_id))

    async def queued_records(self) -> list[Record]:
        rows = await self._rows(self._sql.outbox_pending, None, 0)
        return [_decode(None, "outbox", row[0], row[1]) for row in rows]

    async def audit_rows(self, row_ids: list[str]) -> list[AuditRow]:
        if not row_ids:
            return []
        rows = await self._rows(self._sql.audit_rows, row_ids)
        return [_decode(AuditRow, "audit", key, body) for key, body in rows]


async def _write_batch(
    conn: Any, sql: _Sql, device: str, last_seq: int, batch: WriteBatch
) -> CommitReceipt:
    """Write ``batch`` inside the transaction that holds the device's lock (``last_seq`` is
    the device's highest ``client_seq`` as locked). Everything is encoded and checked before
    the first statement."""
    rows = _Rows()
    refs = rows.add(batch.records)
    queued_refs = rows.add(batch.queued)
    for key, value in batch.meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise StorageError(f"commit failed: meta {key!r} must map str to str")
    rechained = {
        row.id: (row.client_id, row.sequence_number, _encode(row)) for row in batch.rechained_audit
    }

    if batch.purge_sessions:
        for statement in sql.purge_sessions:
            await conn.execute(statement, device, batch.purge_sessions, batch.purge_keep)
    for statement, columns in rows.statements(sql):
        await conn.execute(statement, device, *columns)
    if batch.purge_checkpoints_for:
        for statement in sql.purge_checkpoints:
            await conn.execute(statement, device, batch.purge_checkpoints_for)
    if rechained:
        values = list(rechained.values())
        await conn.execute(
            sql.rechain_audit,
            device,
            list(rechained),
            [v[0] for v in values],
            [v[1] for v in values],
            [v[2] for v in values],
        )
    if batch.canonical:
        await _mark_canonical(conn, sql, device, batch.canonical)
    if batch.renumber_outbox:
        for statement in sql.renumber_outbox:
            await conn.execute(statement, device)
        last_seq = int(await conn.fetchval(sql.outbox_count, device))
        await conn.execute(sql.set_last_seq, device, last_seq)
    to_queue = (refs if batch.outbox else []) + queued_refs
    seqs = list(range(last_seq + 1, last_seq + 1 + len(to_queue)))
    if to_queue:
        await conn.execute(
            sql.enqueue,
            device,
            seqs[-1],
            time.time(),
            seqs,
            [record_id for record_id, _ in to_queue],
            [kind for _, kind in to_queue],
        )
    if batch.meta:
        await conn.execute(sql.put_meta, device, list(batch.meta), list(batch.meta.values()))
    return CommitReceipt(client_seqs=seqs, records=len(batch.records) + len(batch.queued))


async def _mark_canonical(conn: Any, sql: _Sql, device: str, event_ids: list[str]) -> None:
    """``WriteBatch.canonical``: each stored event's body marked canonical from its bytes
    (``compact.canonical_body``), or decoded, replaced and encoded when its form is another."""
    ids: list[str] = []
    bodies: list[bytes] = []
    for event_id, body in await conn.fetch(sql.event_bodies, device, event_ids):
        marked = marked_canonical(body, partial(_decode, Event, "events", event_id, body), _encode)
        if marked != body:
            ids.append(event_id)
            bodies.append(marked)
    if ids:
        await conn.execute(sql.put_event_bodies, device, ids, bodies)


# -- the adapter ---------------------------------------------------------------------------------


class PostgresAdapter(AsyncResource):
    """A ``StorageAdapter`` on PostgreSQL (``durable = True``): the device ``device_key``'s
    rows in ``schema`` of the database at ``dsn``.

    Use as ``async with PostgresAdapter(dsn, device_key="alice") as store``. Give each device
    (each user's runtime) its own key; adapters on one key share one device, as processes
    opening one SQLite file do, and write one at a time.

    - ``device_key``: the device's key in every table (1 to 200 characters).
    - ``schema`` (``pleach_client``): the schema holding the tables; ``open()`` creates and
      migrates it. Keep it apart from a pleach-server schema (refused).
    - ``pool``: an asyncpg pool to share between many adapters (one per device) instead of
      ``dsn``; the caller creates and closes it. With ``dsn``, the adapter opens its own pool
      of ``pool_min`` to ``pool_max`` (1 / 4) connections and closes it with the store.
    - ``lock_timeout_ms`` (5000): how long a write waits for another writer of the same device
      before failing with a retryable ``StorageError`` (SQLite's ``busy_timeout_ms``).
    - ``statement_timeout_ms`` (30000): a write's statements are cancelled after this long,
      and with an own pool every statement (0 disables it).
    - ``connect_timeout`` / ``acquire_timeout`` (5 s / 10 s): connecting, and waiting for a
      free pool connection; beyond them the call fails with a retryable ``StorageError``.

    A write transaction also ends the session if it sits idle for 60 s: a hung caller cannot
    hold a device's lock for long.
    """

    durable = True

    def __init__(
        self,
        dsn: str | None = None,
        *,
        device_key: str,
        schema: str = DEFAULT_SCHEMA,
        pool: Any = None,
        pool_min: int = 1,
        pool_max: int = 4,
        lock_timeout_ms: int = 5000,
        statement_timeout_ms: int = 30_000,
        connect_timeout: float = 5.0,
        acquire_timeout: float = 10.0,
        application_name: str | None = None,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise ValueError("give PostgresAdapter a dsn or a pool (exactly one)")
        if (
            not isinstance(device_key, str)
            or not 0 < len(device_key) <= _MAX_DEVICE_KEY
            or "\x00" in device_key
        ):
            raise ValueError(
                f"device_key must be 1 to {_MAX_DEVICE_KEY} characters without NUL, "
                f"not {device_key!r}"
            )
        if not _SCHEMA_RE.fullmatch(schema):
            raise ValueError(
                f"schema must be a lowercase SQL identifier ([a-z_][a-z0-9_]*), not {schema!r}"
            )
        if not 0 <= pool_min <= pool_max or pool_max < 1:
            raise ValueError(f"need 0 <= pool_min <= pool_max >= 1, got {pool_min}, {pool_max}")
        if lock_timeout_ms < 0 or statement_timeout_ms < 0:
            raise ValueError("timeouts must be >= 0 (0 disables them)")
        self.dsn = dsn
        self.device_key = device_key
        self.schema = schema
        self.pool_min = pool_min
        self.pool_max = pool_max
        self.lock_timeout_ms = int(lock_timeout_ms)
        self.statement_timeout_ms = int(statement_timeout_ms)
        self.connect_timeout = connect_timeout
        self.acquire_timeout = acquire_timeout
        self.application_name = application_name or "pleach-client"
        self.migrated_from: int | None = None
        self._shared_pool = pool
        self._pool: Any = None
        self._sql = _Sql(schema)
        # One simple-query round trip: the transaction and its limits.
        self._begin = (
            "BEGIN ISOLATION LEVEL READ COMMITTED; "
            f"SET LOCAL lock_timeout = {self.lock_timeout_ms}; "
            f"SET LOCAL statement_timeout = {self.statement_timeout_ms}; "
            "SET LOCAL idle_in_transaction_session_timeout = 60000"
        )
        self._state = _State.CLOSED
        self._write_lock = asyncio.Lock()
        self._closing: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        where = _redact(self.dsn) if self.dsn is not None else "shared pool"
        return (
            f"<PostgresAdapter {where} schema={self.schema} device={self.device_key!r} "
            f"{self._state.value}>"
        )

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # Only an own pool leaks connections; a shared one is its creator's to close.
        owns = getattr(self, "_shared_pool", None) is None
        if owns and getattr(self, "_pool", None) is not None:
            _warn(
                f"unclosed {self!r}: use 'async with' or 'await store.close()'",
                ResourceWarning,
                source=self,
            )

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect (or take the shared pool), migrate the schema and register the device.
        Raises ``StorageError`` (retryable when the database cannot be reached) with nothing
        left open, or when the schema is newer than this pleach or is a server's."""
        if self._closing is not None and not self._closing.done():
            await asyncio.shield(self._closing)
        if self._state is not _State.CLOSED:
            raise InvalidState(f"{self!r} cannot open: it is {self._state.value}")
        self._state = _State.OPENING
        pool = self._shared_pool
        try:
            try:
                if pool is None:
                    pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=self.pool_min,
                        max_size=self.pool_max,
                        timeout=self.connect_timeout,
                        server_settings={
                            "application_name": self.application_name,
                            "statement_timeout": str(self.statement_timeout_ms),
                        },
                    )
                async with pool.acquire(timeout=self.acquire_timeout) as conn:
                    self.migrated_from = await _migrate(conn, self.schema)
                    await conn.execute(self._sql.add_device, self.device_key)
            except BaseException as exc:
                if pool is not None and pool is not self._shared_pool:
                    await asyncio.shield(_close_pool(pool, self.acquire_timeout))
                if isinstance(exc, _DB_ERRORS):
                    where = "shared pool" if self.dsn is None else _redact(self.dsn)
                    raise _storage_error(f"open {where}", exc) from exc
                raise
        except BaseException:
            self._state = _State.CLOSED
            raise
        self._pool = pool
        self._closing = None
        self._state = _State.OPEN

    async def close(self) -> None:
        """Close after the write in progress; idempotent. The close completes even if the
        caller is cancelled; a second call waits for the first. A shared pool stays open."""
        if self._closing is None:
            if self._state is not _State.OPEN:
                return
            self._state = _State.CLOSED
            self._closing = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._closing)

    async def _shutdown(self) -> None:
        async with self._write_lock:  # let the transaction in progress finish
            pool, self._pool = self._pool, None
            if pool is not None and pool is not self._shared_pool:
                await _close_pool(pool, self.acquire_timeout)

    def _require_open(self) -> Any:
        if self._state is not _State.OPEN or self._pool is None:
            raise InvalidState(f"{self!r} is not open")
        return self._pool

    # -- running statements ---------------------------------------------------------------

    async def _run(self, action: str, body: Callable[[Any], Awaitable[_T]], *, write: bool) -> _T:
        """Run ``body`` on a pool connection; with ``write``, in one transaction holding the
        device's lock, committed when ``body`` returns and rolled back (shielded) when it
        raises. Database errors become ``StorageError``; others (and cancellation) propagate
        as they are. A dead pooled connection is retried once when nothing was written."""
        retried = False
        while True:
            pool = self._require_open()
            try:
                async with pool.acquire(timeout=self.acquire_timeout) as conn:
                    began = False
                    try:
                        if not write:
                            return await body(conn)
                        try:
                            await conn.execute(self._begin)
                        except BaseException:
                            await asyncio.shield(_rollback(conn))  # BEGIN may have gone through
                            raise
                        began = True
                        try:
                            result = await body(conn)
                            await conn.execute("COMMIT")
                        except BaseException:
                            await asyncio.shield(_rollback(conn))
                            raise
                        return result
                    except _BROKEN:
                        _discard(conn)
                        if retried or began:
                            raise
                        retried = True
            except _DB_ERRORS as exc:
                raise _storage_error(action, exc) from exc

    async def _write(self, action: str, body: Callable[[Any, int], Awaitable[_T]]) -> _T:
        """``body(conn, last_seq)`` in a transaction that holds the device's lock."""

        async def locked(conn: Any) -> _T:
            last_seq = await conn.fetchval(self._sql.lock_device, self.device_key)
            if last_seq is None:
                raise StorageError(
                    f"{action} failed: device {self.device_key!r} is not registered in schema "
                    f"{self.schema} (its row in devices was removed)"
                )
            return await body(conn, int(last_seq))

        async with self._write_lock:
            return await self._run(action, locked, write=True)

    async def _fetch(self, action: str, statement: str, *args: Any) -> list[Any]:
        async def fetch(conn: Any) -> list[Any]:
            return list(await conn.fetch(statement, self.device_key, *args))

        return await self._run(action, fetch, write=False)

    async def _one(self, cls: type[_T], table: str, statement: str, key: str) -> _T | None:
        rows = await self._fetch(f"read {table}", statement, key)
        return _decode(cls, table, rows[0][0], rows[0][1]) if rows else None

    async def _many(self, cls: type[_T], table: str, statement: str, *args: Any) -> list[_T]:
        rows = await self._fetch(f"read {table}", statement, *args)
        return [_decode(cls, table, key, body) for key, body in rows]

    async def _count(self, table: str, statement: str) -> int:
        rows = await self._fetch(f"count {table}", statement)
        return int(rows[0][0])

    # -- writes ---------------------------------------------------------------------------

    async def commit(self, batch: WriteBatch) -> CommitReceipt:
        """Write the batch in one transaction: the purges, the records (one statement per
        table), the outbox rows and the meta keys. Raises ``StorageError`` with nothing
        written on any failure."""
        self._require_open()
        if batch.is_empty():
            return CommitReceipt(client_seqs=[], records=0)
        return await self.transact(fixed_plan(batch))

    async def transact(self, plan: Plan) -> CommitReceipt:
        """Call ``plan`` under the device's write lock with a reader on the same transaction
        (it sees every earlier commit, other processes' included), then write its batch."""

        async def run(conn: Any, last_seq: int) -> CommitReceipt:
            batch = await plan(_Reader(conn, self._sql, self.device_key))
            if batch is None:
                return CommitReceipt(client_seqs=[], records=0)
            return await _write_batch(conn, self._sql, self.device_key, last_seq, batch)

        return await self._write("commit", run)

    async def gdpr_soft_delete(self, subject_key: str) -> int:
        """Clear ``subject_key``, ``request_id`` and ``detail`` of the subject's audit rows and
        mark them ``redacted``; ids, digests and hashes stay. Returns the rows touched."""

        async def redact(conn: Any, _: int) -> int:
            rows = await conn.fetch(self._sql.audit_subject, self.device_key, subject_key)
            ids: list[str] = []
            bodies: list[bytes] = []
            for row_id, body in rows:
                old = _decode(AuditRow, "audit", row_id, body)
                new = msgspec.structs.replace(
                    old, subject_key=None, request_id=None, detail={}, redacted=True
                )
                ids.append(row_id)
                bodies.append(compact.encode(new))
            if ids:
                await conn.execute(self._sql.redact_audit, self.device_key, ids, bodies)
            return len(ids)

        return await self._write("gdpr soft delete", redact)

    # -- sync state -----------------------------------------------------------------------

    async def get_meta(self, key: str) -> str | None:
        rows = await self._fetch("get meta", self._sql.get_meta, key)
        return str(rows[0][0]) if rows else None

    async def peek_meta(self, key: str) -> str | None:
        return await self.get_meta(key)  # (a query on the pool: nothing cheaper to do)

    async def set_meta(self, key: str, value: str) -> None:
        if not isinstance(value, str):
            raise StorageError(f"meta {key!r} must be a string, not {type(value).__name__}")
        self._require_open()

        async def put(conn: Any, _: int) -> None:
            await conn.execute(self._sql.put_meta, self.device_key, [key], [value])

        await self._write("set meta", put)

    # -- reads ----------------------------------------------------------------------------

    async def get_session(self, session_id: str) -> Session | None:
        return await self._one(Session, "sessions", self._sql.get_session, session_id)

    async def list_sessions(self, *, include_deleted: bool = False) -> list[Session]:
        """Sessions newest first (by ``updated_at``, then id, both descending)."""
        statement = self._sql.list_sessions_all if include_deleted else self._sql.list_sessions
        return await self._many(Session, "sessions", statement)

    async def get_messages(self, message_ids: list[str]) -> list[Message]:
        """Messages in the order of ``message_ids``; unknown ids are skipped."""
        if not message_ids:
            self._require_open()
            return []
        rows = await self._fetch("read messages", self._sql.get_messages, message_ids)
        bodies: dict[str, bytes] = {row_id: body for row_id, body in rows}
        # Decoding per position: a repeated id gets its own copy.
        return [
            _decode(Message, "messages", message_id, bodies[message_id])
            for message_id in message_ids
            if message_id in bodies
        ]

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return await self._one(Checkpoint, "checkpoints", self._sql.get_checkpoint, checkpoint_id)

    async def list_checkpoints(self, session_id: str) -> list[Checkpoint]:
        """Checkpoints of a session, oldest first (by hlc, then id)."""
        return await self._many(Checkpoint, "checkpoints", self._sql.list_checkpoints, session_id)

    async def child_checkpoints(self, session_id: str, parent_id: str) -> list[Checkpoint]:
        """The session's checkpoints whose parent is ``parent_id``, oldest first."""
        rows = await self._fetch(
            "read checkpoints", self._sql.child_checkpoints, session_id, parent_id
        )
        return decode_children(
            rows, parent_id, lambda key, body: _decode(Checkpoint, "checkpoints", key, body)
        )

    async def list_events(
        self, session_id: str, *, from_sequence: int = 0, types: Collection[str] | None = None
    ) -> list[Event]:
        """Events with ``sequence_number >= from_sequence``, by sequence number, then id;
        only those of ``types`` when given."""
        if types is None:
            rows = await self._fetch(
                "read events", self._sql.list_events, session_id, from_sequence, None
            )
        else:
            rows = await self._fetch(
                "read events",
                self._sql.list_events_of_types,
                session_id,
                from_sequence,
                sorted(types),
            )
        return decode_events(rows, types, lambda key, body: _decode(Event, "events", key, body))

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
        types = sorted({*tallied, *whole})
        rows = await self._fetch(
            "read events", self._sql.list_events_of_types, session_id, from_sequence, types
        )
        return decode_log(
            rows, tallied, whole, lambda key, body: _decode(Event, "events", key, body)
        )

    async def hydration_key(self, session_id: str, *, upto: int | None = None) -> HydrationKey:
        last = 2**63 - 1 if upto is None else upto
        rows = await self._fetch("read events", self._sql.hydration_key, session_id, last)
        count, key, body = rows[0]
        if not count or key is None:
            return (0, 0, "")
        place = event_place_of(body, partial(_decode, Event, "events", key, body))
        return (int(count), place.sequence_number, place.row_hash)

    async def kept_hydration(self, session_id: str) -> KeptHydration | None:
        rows = await self._fetch("read hydrations", self._sql.kept_hydration, session_id)
        if not rows:
            return None
        events, sequence_number, row_hash, version, body = rows[0]
        return KeptHydration((int(events), int(sequence_number), row_hash), version, bytes(body))

    async def keep_hydration(self, session_id: str, kept: KeptHydration) -> None:
        self._require_open()
        (events, sequence_number, row_hash), version, body = kept

        async def put(conn: Any, _: int) -> None:
            await conn.execute(
                self._sql.keep_hydration,
                self.device_key,
                session_id,
                events,
                sequence_number,
                row_hash,
                version,
                body,
            )

        await self._write("keep hydration", put)

    async def get_event(self, event_id: str) -> Event | None:
        return await self._one(Event, "events", self._sql.get_event, event_id)

    async def list_audit(
        self, *, session_id: str | None = None, client_id: str | None = None
    ) -> list[AuditRow]:
        """Audit rows ordered by (client_id, sequence_number, id)."""
        sql = self._sql
        if session_id is not None and client_id is not None:
            return await self._many(AuditRow, "audit", sql.list_audit_both, session_id, client_id)
        if session_id is not None:
            return await self._many(AuditRow, "audit", sql.list_audit_session, session_id)
        if client_id is not None:
            return await self._many(AuditRow, "audit", sql.list_audit_client, client_id)
        return await self._many(AuditRow, "audit", sql.list_audit)

    async def list_artifact_updates(self, artifact_id: str) -> list[ArtifactUpdate]:
        """Updates of one artifact by hlc, then id (any order merges to the same document)."""
        return await self._many(
            ArtifactUpdate, "artifact_updates", self._sql.list_artifact_updates, artifact_id
        )

    # -- outbox ---------------------------------------------------------------------------

    async def outbox_pending(self, limit: int = 500, *, after: int = 0) -> list[OutboxEntry]:
        """Oldest first, by client_seq; at most ``limit`` entries, those after ``after``."""
        rows = await self._fetch("read outbox", self._sql.outbox_pending, max(limit, 0), after)
        return outbox_entries(rows, lambda seq, body: _decode(None, "outbox", seq, body))

    async def outbox_count(self) -> int:
        return await self._count("outbox", self._sql.outbox_count)

    async def last_client_seq(self) -> int:
        rows = await self._fetch("read last client_seq", self._sql.last_seq)
        return int(rows[0][0]) if rows else 0

    async def outbox_remove(self, client_seqs: list[int]) -> None:
        """Drop acknowledged entries; unknown sequence numbers are ignored."""
        if not client_seqs:
            self._require_open()
            return

        async def remove(conn: Any, _: int) -> None:
            await conn.execute(self._sql.outbox_remove, self.device_key, client_seqs)

        await self._write("outbox remove", remove)

    async def outbox_mark_attempt(
        self, client_seqs: list[int], code: int | None, message: str | None
    ) -> None:
        """Count one more failed attempt with its error; entries stay queued."""
        if not client_seqs:
            self._require_open()
            return

        async def mark(conn: Any, _: int) -> None:
            await conn.execute(
                self._sql.outbox_mark_attempt, self.device_key, client_seqs, code, message
            )

        await self._write("outbox mark attempt", mark)

    async def outbox_dead_letter(self, client_seq: int, code: int, message: str) -> None:
        """Move one entry to dead_letters, keeping its attempts count (count the rejecting
        attempt with ``outbox_mark_attempt`` first if it should show); unknown seq: no-op."""

        async def move(conn: Any, _: int) -> None:
            await conn.execute(
                self._sql.dead_letter, self.device_key, client_seq, code, message, time.time()
            )

        await self._write("outbox dead letter", move)

    async def dead_letters(self) -> list[DeadLetter]:
        """Dead letters by client_seq."""
        rows = await self._fetch("read dead letters", self._sql.dead_letters)
        return [
            DeadLetter(
                client_seq=seq,
                record=_decode(None, "dead_letters", seq, body),
                code=code,
                message=message,
                attempts=attempts,
                failed_at=failed_at,
            )
            for seq, body, code, message, attempts, failed_at in rows
        ]

    async def dead_letter_count(self) -> int:
        return await self._count("dead_letters", self._sql.dead_letter_count)

    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Re-enqueue a dead letter under a new client_seq (returned, with attempts reset);
        None if unknown."""

        async def retry(conn: Any, last_seq: int) -> int | None:
            seq = await conn.fetchval(
                self._sql.retry_dead_letter, self.device_key, last_seq + 1, client_seq, time.time()
            )
            return None if seq is None else int(seq)

        return await self._write("retry dead letter", retry)

    async def discard_dead_letter(self, client_seq: int) -> bool:
        """Forget a dead letter for good; False if unknown."""

        async def discard(conn: Any, _: int) -> bool:
            status = await conn.execute(self._sql.discard_dead_letter, self.device_key, client_seq)
            return _row_count(status) > 0

        return await self._write("discard dead letter", discard)


async def _rollback(conn: Any) -> None:
    """Roll back; a connection too broken to is terminated (never reused)."""
    try:
        await conn.execute("ROLLBACK")
    except _DB_ERRORS:
        _discard(conn)


def _discard(conn: Any) -> None:
    """Terminate a pool connection so that it is never reused (the pool replaces it)."""
    with contextlib.suppress(asyncpg.InterfaceError):  # already released
        conn.terminate()


async def _close_pool(pool: Any, timeout: float) -> None:
    """Close gracefully, waiting up to ``timeout`` for calls in flight; then terminate."""
    try:
        async with asyncio.timeout(timeout):
            await pool.close()
    except _DB_ERRORS:  # TimeoutError included
        pool.terminate()
