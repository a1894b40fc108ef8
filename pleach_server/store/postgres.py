"""``PostgresServerStore``: the production server store, over an asyncpg pool.

Several ``pleach-server`` processes may share one database: every rule that matters runs in
the database, inside ONE transaction per push (an optimistic push: ONE statement for its
writes, see ``push``), and the push rules themselves live in ``apply.py`` (this module only
speaks SQL). A push batch is a handful of round trips whatever its size: each lookup and
each table's writes is one statement, its keys and rows passed as arrays (``_PostgresTx``).

**Cursor visibility.** Feed cursors come from one identity sequence, and a sequence hands out
numbers in allocation order, not commit order: transaction A may take cursor 10, B cursor 11,
B commit, a reader pull up to 11, and only then A commit cursor 10, which that reader has
already passed. We close that gap per tenant: ``lock_tenant`` takes a transaction-scoped
advisory lock on the tenant (``pg_advisory_xact_lock``) BEFORE any cursor is allocated and
holds it until COMMIT. PostgreSQL makes a commit visible before it releases the transaction's
locks, so the next push of the tenant allocates its cursors only after the previous one is
visible: a tenant's cursors become visible in increasing order, and a pull (one statement,
one snapshot) that sees cursor ``c`` sees every cursor of that tenant below ``c``. Pulls only
ever read one tenant, so other tenants' interleaved cursors do not matter.

**Cross-process fan-out.** A push that wrote cursors calls ``pg_notify('pleach_feed', ...)``
inside its own transaction: PostgreSQL delivers the notification only if and when the
transaction commits, in commit order. The JSON payload is
``{"schema", "org", "user", "from", "to", "server"}``: the tenant's page ``(from, to]`` and the
pushing server's id (``clock.client_id``), so each process can ignore its own commits (it
serves its own devices from its local hub). See ``pg_notify.PostgresNotifier``.

**Failures.** Connection loss, a shutting-down or restarting server, too many connections,
statement timeouts and serialization failures raise ``StorageUnavailable`` (3009,
retryable); nothing of the batch is committed. Any other database error raises
``StorageUnavailable`` with ``retryable=False``. The pool reconnects by itself: a connection
that broke is terminated on release and replaced on the next acquire.

Schema (versioned in ``<schema>.schema_migrations``, migrated at ``open()`` under a
session-wide advisory lock, so several processes may start at once):

Ids are kept as their keys (``_pg_key``, ``pleach_key`` in SQL: a canonical UUID as its 16
bytes, any other id as its text behind a marker) and kinds as their numbers (their index in
``KINDS``), since version 9; every statement binds keys converted in Python. Since version
10 the large tables name a tenant by its number (``tenants``, ``tid``), read once per
statement from its org and user ids.

- ``sessions``: one row per session id, its msgpack body.
- ``records``: immutable records (messages, checkpoints, audit rows, artifact updates), each
  at the feed cursor it was given (``cursor``; ``records_cursor (tid, cursor)``), a message's,
  a checkpoint's body without what its row holds (version 15, ``pleach_whole``).
- ``events``: canonical events; ``(session_id, sequence_number)`` is unique; each at its
  cursor too (``events_cursor``), its body without its ids, its tenant and (where the row
  before it keeps it) its ``prev_hash``; ``row_hash`` as its 32 bytes.
- ``feed``: every applied change per tenant takes a cursor from one sequence; a session's
  entry is a row here (a session keeps one, its latest version's), a record's and an event's
  is its own row (version 15). A pull merges the three by cursor (``_page``); the feed is
  keyed by ``(tid, cursor)``.
- ``tenants``: each tenant's number (``tid``) by its ``(org_id, user_id)``.
- ``clients``: ``last_seq`` per ``(tenant, client_id)``.
- ``meta``: the feed floor per tenant.
- ``lock_tenant_last_seq(lock_key, org, user, client)``: a push's tenant lock and its device's
  ``last_seq`` in one round trip (a plpgsql function: its read takes its own snapshot, after
  the lock).
- ``lock_last_seq_load(lock_key, org, user, client, <load's lookups>)``: the same, with every
  lookup of the batch as it is after the ``last_seq`` the push expects (migration 11; each
  read on its own snapshot, after the lock). A push is then two statements: this and
  ``write``.
- ``push_write_<digest>(<write's arrays>, lock_key, last_seq, head)``: an optimistic push's
  write (``PostgresServerStore.push``): the lock, the check that the device's ``last_seq`` and
  the tenant's head are those its read found, and ``write``, committed as one statement. Not a
  schema version: each build makes its own at ``open()`` (``_make_functions``).
- ``<table>_tenant``: extended statistics on ``(org_id, user_id)`` of the tables that keep
  the two (``clients``, ``meta``, ``devices``), so that the plans of a large tenant's lookups
  are those of a small one's (migration 8; the others name the tenant by number since 10).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import operator
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import msgspec

from shared.clock import HybridClock
from shared.compact import (
    KINDS,
    SHORT,
    chain_digest,
    digest_bytes,
    prev_apart,
    short_body,
    uuid_bytes,
    uuid_text,
)
from shared.errors import CursorTooOld, InvalidState, StorageError, StorageUnavailable
from shared.idrefs import ID_LAYOUT, IdLayout
from shared.ids import uuid7
from shared.records import (
    CASCADE_KINDS,
    AuditRow,
    Change,
    Event,
    Record,
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
    SessionRow,
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

__all__ = [
    "DEFAULT_KNOWN_BYTES",
    "DEFAULT_POOL_MAX",
    "DEFAULT_SCHEMA",
    "DEFAULT_STATEMENT_TIMEOUT_MS",
    "NOTIFY_CHANNEL",
    "SCHEMA_VERSION",
    "MigrateResult",
    "PostgresServerStore",
    "migrate",
    "redact_dsn",
    "tenant_lock_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SCHEMA = "pleach"
DEFAULT_POOL_MAX = 10
DEFAULT_STATEMENT_TIMEOUT_MS = 5000
DEFAULT_MAX_PULL_LIMIT = 1000
NOTIFY_CHANNEL = "pleach_feed"
"""The ``LISTEN`` channel every push commit notifies on (payload: see the module docstring)."""

_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")


async def _backfill_audit_places(conn: Any, s: str) -> None:
    """Migration 5: the place of every audit row already stored (read from its body)."""
    rows = await conn.fetch(
        f"SELECT org_id, user_id, body FROM {s}.records WHERE kind = 'AuditRow'"
    )
    places: list[list[Any]] = [[], [], [], [], [], []]
    for org_id, user_id, body in rows:
        row = decode_body(body)
        if isinstance(row, AuditRow):
            for column, value in zip(places, (org_id, user_id, *_place(row)), strict=True):
                column.append(value)
    if places[0]:
        await conn.execute(_insert_places(s), *places)


def _insert_places(s: str) -> str:
    return (
        f"INSERT INTO {s}.audit_places "
        "(org_id, user_id, client_id, sequence_number, row_hash, id) "
        "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], "
        "$6::text[]) ON CONFLICT DO NOTHING"
    )


def _place(row: AuditRow) -> tuple[str, int, str, str]:
    """An audit row's ``audit_places`` columns after the tenant's."""
    return (row.client_id, row.sequence_number, row.row_hash, row.id)


def _audit_tails(records: Iterable[Record]) -> list[list[Any]]:
    """The last place each device's audit chain takes among ``records`` (the greatest place,
    and of two rows there the greater id, as ``audit_tails`` orders them): ``_Sql.write``'s
    columns $17 to $20 (device, place, row hash, id), one row a device, so that the upsert
    meets each tail once."""
    last: dict[str, tuple[int, bytes, bytes]] = {}
    for r in records:
        if isinstance(r, AuditRow):
            place = (r.sequence_number, _pg_key(r.id), _pg_hash(r.row_hash))
            held = last.get(r.client_id)
            if held is None or place[:2] > held[:2]:
                last[r.client_id] = place
    return [
        list(last),
        [place for place, _, _ in last.values()],
        [digest for _, _, digest in last.values()],
        [key for _, key, _ in last.values()],
    ]


_KIND_NUMBERS: Final = {name: number for number, name in enumerate(KINDS)}
_SESSION_KIND: Final = _KIND_NUMBERS["Session"]
_CURSOR: Final = operator.itemgetter(1)
"""A pull's row's cursor (``_Sql.pull``)."""
_EVENT_KIND: Final = _KIND_NUMBERS["Event"]
_LONG_MARK: Final = b"\xff\xff"
_MARK: Final = b"\xff"
"""A key that is no UUID's: its text's UTF-8 behind 0xFF (a byte UTF-8 never holds), or
behind two when the text is 15 bytes long, so that no such key is 16 bytes (a UUID's) and
no two texts share one."""

# ``{{`` and ``}}``: the statements are formatted with the schema (``{s}``).
_PLEACH_KEY = (
    "CREATE FUNCTION {s}.pleach_key(t text) RETURNS bytea "
    "LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$ SELECT CASE "
    "WHEN t ~ '^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$' "
    "THEN decode(replace(t, '-', ''), 'hex') "
    "WHEN octet_length(t) = 15 THEN '\\xffff'::bytea || convert_to(t, 'UTF8') "
    "ELSE '\\xff'::bytea || convert_to(t, 'UTF8') END $$"
)
_PLEACH_KIND = (
    "CREATE FUNCTION {s}.pleach_kind(t text) RETURNS smallint "
    "LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$ SELECT CASE t "
    + " ".join(f"WHEN '{name}' THEN {number}" for number, name in enumerate(KINDS))
    + " END::smallint $$"
)


def _pg_key(record_id: str) -> bytes:
    """``pleach_key`` in Python: how the columns keep an id (schema 9)."""
    return _marked(uuid_bytes(record_id), record_id, 16)


def _pg_id(key: bytes) -> str:
    """The id a column's key stands for (``_pg_key`` reversed)."""
    return _unmarked(key, 16, uuid_text)


_HASH_SQL: Final = (
    "CASE WHEN row_hash ~ '^[0-9a-f]{{64}}$' THEN decode(row_hash, 'hex') "
    "WHEN octet_length(row_hash) = 31 THEN '\\xffff'::bytea || convert_to(row_hash, 'UTF8') "
    "ELSE '\\xff'::bytea || convert_to(row_hash, 'UTF8') END"
)
"""SQL (migration 15): ``_pg_hash`` of a ``row_hash`` column that kept the text."""


def _pg_hash(row_hash: str) -> bytes:
    """How the columns keep a chain's row hash (schema 15): a digest (64 lowercase hex
    characters, as every chain makes it) as its 32 bytes, any other text behind the marks
    of ``_pg_key``, so that no other text is 32 bytes and no two texts share one."""
    return _marked(digest_bytes(row_hash), row_hash, 32)


def _pg_hash_text(value: bytes) -> str:
    """The row hash a column keeps (``_pg_hash`` reversed)."""
    return _unmarked(value, 32, bytes.hex)


def _marked(value: bytes | None, text: str, size: int) -> bytes:
    """``value`` (``size`` bytes: what ``text`` is when it is of the column's one form), or
    ``text``'s UTF-8 behind 0xFF (a byte UTF-8 never holds), behind two when it is
    ``size - 1`` bytes long, so that no such text is ``size`` bytes and no two share one."""
    if value is not None:
        return value
    encoded = text.encode()
    return (_LONG_MARK if len(encoded) == size - 1 else _MARK) + encoded


def _unmarked(value: bytes, size: int, form: Callable[[bytes], str]) -> str:
    """The text ``_marked`` kept as ``value`` (``form`` of it when it is ``size`` bytes)."""
    value = bytes(value)
    if len(value) == size:
        return form(value)
    long = len(value) == size + 1 and value[1] == 0xFF
    return value[len(_LONG_MARK) if long else len(_MARK) :].decode()


_PLEACH_WHOLE = (
    "CREATE FUNCTION {s}.pleach_whole(b bytea, k bytea, sk bytea, t bytea, prev bytea) "
    "RETURNS bytea LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT CASE "
    "WHEN octet_length(b) < 4 THEN b WHEN get_byte(b, 0) <> 193 THEN b "
    "WHEN get_byte(b, 1) BETWEEN 144 AND 157 THEN "
    "{s}.pleach_head(get_byte(b, 1), 2) || substr(b, 3, 1) || '\\xd801'::bytea "
    "|| k || '\\xd801'::bytea || sk || substr(b, 4) "
    "WHEN get_byte(b, 1) = 0 THEN {s}.pleach_head(get_byte(b, 2), 4) "
    "|| substr(b, 4, 1) || '\\xd801'::bytea || k || '\\xd801'::bytea || sk || t "
    "|| substr(b, 5) "
    "WHEN get_byte(b, 1) = 16 AND {s}.pleach_cut(b) >= 4 THEN "
    "{s}.pleach_head(get_byte(b, 2), 4) "
    "|| substr(b, 4, 1) || '\\xd801'::bytea || k || '\\xd801'::bytea || sk || t "
    "|| substr(b, 5, {s}.pleach_cut(b) - 4) || '\\xc72002'::bytea || prev "
    "|| substr(b, {s}.pleach_cut(b) + 1) "
    "ELSE b END $$"
)
"""Migration 15: a stored body as its record was written (``_whole_body``), from what
``compact.short_body`` left out: its row's ids (its key and its session's key, 16 bytes each), its
tenant (``t``: ``compact.packed`` of its org and its user) and, for an event, its
``prev_hash`` (``prev``: the 32 bytes the row before it in its session keeps as its row
hash). Each form as ``compact.whole_body_sql`` reads it (ids as ext 1, the array's header
made longer again); any other body as it is (one too short for its form too). NULL where
``prev`` is needed and NULL."""
_IDS_SQL: Final = "'\\xd801'::bytea || k || '\\xd801'::bytea || sk"
_NODE_STAMP_SQL: Final = "substr(b, 5, 1) || substr(nd, 1, 3) || substr(b, 9, 9) || substr(nd, 4)"
_PLEACH_WHOLE_16 = (
    "CREATE FUNCTION {s}.pleach_whole(b bytea, k bytea, sk bytea, t bytea, nd bytea, "
    "prev bytea) RETURNS bytea LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT CASE "
    "WHEN octet_length(b) < 4 THEN b WHEN get_byte(b, 0) <> 193 THEN b "
    "WHEN get_byte(b, 1) BETWEEN 144 AND 157 THEN "
    f"{{s}}.pleach_head(get_byte(b, 1), 2) || substr(b, 3, 1) || {_IDS_SQL} || substr(b, 4) "
    "WHEN get_byte(b, 1) = 0 THEN {s}.pleach_head(get_byte(b, 2), 4) "
    f"|| substr(b, 4, 1) || {_IDS_SQL} || t || substr(b, 5) "
    "WHEN get_byte(b, 1) = 1 THEN {s}.pleach_head(get_byte(b, 2), 4) "
    f"|| substr(b, 4, 1) || {_IDS_SQL} || t || {_NODE_STAMP_SQL} || substr(b, 18) "
    "WHEN get_byte(b, 1) = 2 THEN substr(b, 3, 4) || '\\xd801'::bytea || k || t "
    "|| '\\xc0'::bytea || substr(nd, 1, 3) || substr(b, 10, 9) || substr(nd, 4) "
    "|| '\\xd801'::bytea || sk || substr(b, 19) "
    "WHEN get_byte(b, 1) = 16 AND {s}.pleach_cut(b) >= 4 THEN "
    "{s}.pleach_head(get_byte(b, 2), 4) "
    f"|| substr(b, 4, 1) || {_IDS_SQL} || t "
    "|| substr(b, 5, {s}.pleach_cut(b) - 4) || '\\xc72002'::bytea || prev "
    "|| substr(b, {s}.pleach_cut(b) + 1) "
    "WHEN get_byte(b, 1) = 17 AND {s}.pleach_cut(b) >= 17 THEN "
    "{s}.pleach_head(get_byte(b, 2), 4) "
    f"|| substr(b, 4, 1) || {_IDS_SQL} || t || {_NODE_STAMP_SQL} "
    "|| substr(b, 18, {s}.pleach_cut(b) - 17) || '\\xc72002'::bytea || prev "
    "|| substr(b, {s}.pleach_cut(b) + 1) "
    "ELSE b END $$"
)
"""Migration 16: ``_PLEACH_WHOLE`` given also the stamp node a body of the pushing device's
own left out (``nd``: ``compact.stamp_node`` of its client id, which the row names by its
number in ``nodes``): its forms 1 and 17 (a message's, a checkpoint's, an event's, as 0 and
16 less the node) and 2 (an audit row's: its id, tenant, device, stamp node and session id
left out). Each as ``compact._whole`` puts it together (its ``node`` then ``nd``); any other
body as it is (one too short for its form too). NULL where ``nd`` or ``prev`` is needed and
NULL."""
_PLEACH_HEAD = (
    "CREATE FUNCTION {s}.pleach_head(code integer, more integer) RETURNS bytea "
    "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT CASE "
    "WHEN code NOT BETWEEN 144 AND 159 THEN set_byte('\\x00'::bytea, 0, 143 + more) "
    "WHEN code + more <= 159 THEN set_byte('\\x00'::bytea, 0, code + more) "
    "ELSE ''::bytea END $$"
)
"""Migration 15: the fixarray header ``more`` values longer than ``code`` (``compact._head``,
as SQLite's lookup finds it: a byte that is no fixarray header reads as position 0, a
header past 15 values as none)."""
_PLEACH_CUT = (
    "CREATE FUNCTION {s}.pleach_cut(b bytea) RETURNS integer "
    "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT octet_length(b) - 35 - CASE "
    "WHEN substr(b, octet_length(b) - 35, 3) = '\\xc72002'::bytea "
    "AND substr(b, octet_length(b), 1) IN ('\\xc2'::bytea, '\\xc3'::bytea) THEN 1 "
    "ELSE 0 END $$"
)
"""Migration 15: where an event body without its ``prev_hash`` had it (``compact.prev_apart``):
the bytes before its row hash's ext (and the boolean after it, when the body ends so)."""
_PLEACH_DIGEST = (
    "CREATE FUNCTION {s}.pleach_digest(b bytea) RETURNS bytea "
    "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT CASE "
    "WHEN substr(b, {s}.pleach_cut(b) + 1, 3) = '\\xc72002'::bytea "
    "THEN substr(b, {s}.pleach_cut(b) + 4, 32) END $$"
)
"""Migration 16: ``compact.chain_digest`` in SQL: the 32 bytes of the ``row_hash`` a stored
event body ends with, whatever its form (NULL: a body that does not end so): the digest's
ext is right after where ``pleach_cut`` puts a body's cut."""


_NODE_OUT_FORMS: Final = frozenset((SHORT + b"\x01", SHORT + b"\x02"))
"""The heads of the bodies ``compact.short_body`` left the stamp node out of (forms 1 and 2;
an event's without its prev_hash too, 17, is made of a 1): their rows name it (version 16)."""


def _node_named(stored: bytes, number: int | None) -> int | None:
    """The stamp node's number a row of the body ``stored`` names: ``number`` where the body
    left its node out (``_NODE_OUT_FORMS``), else None."""
    return number if stored[:2] in _NODE_OUT_FORMS else None


def _event_hash(s: str, row: str) -> str:
    """SQL: the row hash of the events' row ``row``: its column, or (since version 16, where
    the column is NULL) the digest its body ends with (``pleach_digest``)."""
    return f"COALESCE({row}.row_hash, {s}.pleach_digest({row}.body))"


_TENANT_TABLES = (
    "sessions",
    "records",
    "events",
    "feed",
    "clients",
    "meta",
    "devices",
    "audit_places",
)
"""Every table whose rows belonged to a tenant (``org_id``, ``user_id``) before version 10."""
_ANALYZED_TABLES: Final = (
    "tenants",
    "sessions",
    "records",
    "events",
    "feed",
    "clients",
    "meta",
    "devices",
    "audit_tails",
    "chains",
    "session_ids",
    "nodes",
)
"""The tables the store analyzes itself while the database is young (``ANALYZE_AT``): every
table of the schema as this build makes it but ``schema_migrations`` (``_TENANT_TABLES``
names those of versions 8 to 10, for their migrations)."""
_NUMBERED_TABLES = ("sessions", "records", "events", "feed", "audit_places")
"""The tables that name a tenant by its number (``tid``) since version 10."""

Step = str | Callable[[Any, str], Awaitable[None]]
"""A migration step: a statement, or a function run on the connection and schema (a backfill)."""


async def _lock_last_seq_load_step(conn: Any, s: str) -> None:
    """Migration 11: ``lock_last_seq_load``, made from this build's ``_Sql.load`` (a later
    change of that statement adds a version that runs this step again)."""
    await conn.execute(_lock_last_seq_load_function(s))


def _lock_last_seq_load_function(s: str) -> str:
    """``CREATE OR REPLACE FUNCTION {s}.lock_last_seq_load``: the tenant lock, then (each on a
    snapshot of its own, after the lock) the device's last_seq as a row of its own (``what``
    7) and the rows of ``_Sql.load`` for the lookups given."""
    load = _Sql(s).load
    for number, name in reversed(list(enumerate(_LOAD_ARGS, start=1))):
        load = load.replace(f"${number}", name)
    return f"""CREATE OR REPLACE FUNCTION {s}.lock_last_seq_load(
            lock_key bigint, p_org text, p_usr text, p_client text, p_kinds smallint[],
            p_ids bytea[], p_events bytea[], p_owners bytea[], p_sessions bytea[],
            p_chains bytea[], p_audits text[]
        ) RETURNS TABLE (
            what integer, kind smallint, key bytea, body bytea, number bigint, row_hash bytea
        ) LANGUAGE plpgsql VOLATILE AS $$
        #variable_conflict use_column
        BEGIN
            PERFORM pg_advisory_xact_lock(lock_key);
            RETURN QUERY SELECT 7, NULL::smallint, NULL::bytea, NULL::bytea,
                (SELECT c.last_seq FROM {s}.clients AS c WHERE c.org_id = p_org
                 AND c.user_id = p_usr AND c.client_id = p_client)::bigint, NULL::bytea;
            RETURN QUERY SELECT l.a::integer, l.b::smallint, l.c::bytea, l.d::bytea,
                l.e::bigint, l.f::bytea FROM ({load}) AS l (a, b, c, d, e, f);
        END
        $$"""


_WRITE_TYPES: Final = (
    "text, text, smallint[], bytea[], bytea[], bytea[], bytea[], bytea[], bigint[], bytea[], "
    "bytea[], bytea[], text[], bytea[], text, bigint, text[], bigint[], bytea[], bytea[], "
    "smallint[], bytea[], bytea[], text, text, integer[], bytea[], integer[], bytea[], "
    "bytea[], integer[], bigint[], bigint[], bytea[], bytea[], integer[], integer[]"
)
"""The types of ``_Sql.write``'s parameters ($1 to $37), as its casts name them."""

CLAIMED_RECORD: Final = "PLR01"
CLAIMED_EVENT: Final = "PLE01"
"""The SQLSTATEs ``push_write`` raises when a row under an id the batch writes appeared between
the push's read and its write without moving the tenant's head (no build writes so: the check
behind the head's argument). The statement is undone whole; the device retries."""


def _push_write_function(s: str, write: str) -> tuple[str, str]:
    """``push_write``: an optimistic push's write, in one statement that commits on its own.

    Its parameters are ``write``'s (``_Sql.write``, $1 to $37), then the tenant's lock key
    ($38), the device's ``last_seq`` and the tenant's head cursor the push read ($39, $40). It
    takes the tenant lock; if the two are still what the push read, it runs ``write`` (on a
    snapshot taken after the lock) and answers its row; else it answers no row and writes
    nothing. When a record or an event id it writes was found taken, it raises
    (``CLAIMED_RECORD``, ``CLAIMED_EVENT``), which undoes the whole statement.

    Answers the function's name and its ``CREATE`` statement. The name carries a digest of
    the statement, so that each build calls the function made of its own ``_Sql.write``,
    whatever build made the schema's other functions (``_make_functions``).
    """
    head = f"GREATEST({_max_cursor(s)}, {_floor(s)})"
    body = f"""
        #variable_conflict use_column
        DECLARE
            v_records bigint; v_events bigint; v_sessions bigint; v_clients bigint;
            v_places bigint; v_cursors bigint[]; v_notices bigint;
        BEGIN
            PERFORM pg_advisory_xact_lock($38);
            IF COALESCE((SELECT c.last_seq FROM {s}.clients AS c WHERE c.org_id = $1
                    AND c.user_id = $2 AND c.client_id = $15), 0) <> $39
                OR {head} <> $40 THEN
                RETURN;
            END IF;
            {write} INTO v_records, v_events, v_sessions, v_clients, v_places, v_cursors,
                v_notices;
            IF v_records <> COALESCE(cardinality($4), 0) THEN
                RAISE EXCEPTION 'a record id of the push was claimed concurrently'
                    USING ERRCODE = '{CLAIMED_RECORD}';
            END IF;
            IF v_events <> COALESCE(cardinality($7), 0) THEN
                RAISE EXCEPTION 'an event id of the push was claimed concurrently'
                    USING ERRCODE = '{CLAIMED_EVENT}';
            END IF;
            RETURN QUERY SELECT v_records, v_events, v_sessions, v_clients, v_places,
                v_cursors, v_notices;
        END
        """
    name = "push_write_" + hashlib.sha256(body.encode()).hexdigest()[:12]
    create = f"""CREATE OR REPLACE FUNCTION {s}.{name}({_WRITE_TYPES}, bigint, bigint, bigint)
        RETURNS TABLE (o_records bigint, o_events bigint, o_sessions bigint, o_clients bigint,
            o_places bigint, o_cursors bigint[], o_notices bigint)
        LANGUAGE plpgsql VOLATILE AS $f${body}$f$"""
    return name, create


async def _make_functions(conn: Any, s: str) -> None:
    """Make this build's ``push_write`` when the schema lacks it (under the migration lock).

    Not a schema version: a build of another ``_Sql.write`` calls a function of another name,
    so processes of several builds share a schema, and no version has to remember to remake
    it when the statement changes. (The functions of builds gone stay, a few KB each.)"""
    name, create = _Sql(s).push_write_function
    found = await conn.fetchval(
        "SELECT 1 FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace "
        "WHERE n.nspname = $1 AND p.proname = $2",
        s,
        name,
    )
    if found is None:
        await conn.execute(create)


_LOAD_ARGS: Final = (
    "p_org",
    "p_usr",
    "p_kinds",
    "p_ids",
    "p_events",
    "p_owners",
    "p_sessions",
    "p_chains",
    "p_audits",
)
"""``_Sql.load``'s parameters ($1 to $9), as ``lock_last_seq_load`` names them."""

# One tuple of statements per schema version; never edit a shipped version, append a new one.
# ``{s}`` is the schema name (validated by _SCHEMA_RE, so it needs no quoting).
_MIGRATIONS: tuple[tuple[Step, ...], ...] = (
    (
        """CREATE TABLE {s}.sessions (
            id text PRIMARY KEY,
            org_id text NOT NULL,
            user_id text NOT NULL,
            updated_at text NOT NULL,
            body bytea NOT NULL
        )""",
        "CREATE INDEX sessions_tenant ON {s}.sessions (org_id, user_id, updated_at)",
        """CREATE TABLE {s}.records (
            kind text NOT NULL,
            id text NOT NULL,
            org_id text NOT NULL,
            user_id text NOT NULL,
            session_id text,
            body bytea NOT NULL,
            PRIMARY KEY (kind, id)
        )""",
        "CREATE INDEX records_session ON {s}.records (session_id)",
        "CREATE INDEX records_tenant ON {s}.records (org_id, user_id, session_id)",
        """CREATE TABLE {s}.events (
            id text PRIMARY KEY,
            session_id text NOT NULL,
            sequence_number bigint NOT NULL,
            org_id text NOT NULL,
            user_id text NOT NULL,
            row_hash text NOT NULL,
            body bytea NOT NULL,
            UNIQUE (session_id, sequence_number)
        )""",
        "CREATE INDEX events_tenant ON {s}.events (org_id, user_id, session_id)",
        """CREATE TABLE {s}.feed (
            cursor bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            org_id text NOT NULL,
            user_id text NOT NULL,
            kind text NOT NULL,
            record_id text NOT NULL,
            body bytea NOT NULL
        )""",
        "CREATE INDEX feed_tenant ON {s}.feed (org_id, user_id, cursor)",
        """CREATE TABLE {s}.clients (
            org_id text NOT NULL,
            user_id text NOT NULL,
            client_id text NOT NULL,
            last_seq bigint NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id)
        )""",
        """CREATE TABLE {s}.meta (
            org_id text NOT NULL,
            user_id text NOT NULL,
            feed_floor bigint NOT NULL DEFAULT 0,
            PRIMARY KEY (org_id, user_id)
        )""",
    ),
    # 2: compaction finds the later versions of a record.
    ("CREATE INDEX feed_record ON {s}.feed (org_id, user_id, kind, record_id, cursor)",),
    # 3: the latest health each device reported (the /status page).
    (
        """CREATE TABLE {s}.devices (
            org_id text NOT NULL,
            user_id text NOT NULL,
            client_id text NOT NULL,
            seen_at double precision NOT NULL,
            health bytea NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id)
        )""",
        "CREATE INDEX devices_seen ON {s}.devices (seen_at)",
    ),
    # 4: ids are scoped to their tenant: a record, event or session id one user holds does not
    # stop another user from holding the same id (nobody can squat another user's ids).
    (
        "ALTER TABLE {s}.sessions DROP CONSTRAINT sessions_pkey, "
        "ADD PRIMARY KEY (org_id, user_id, id)",
        "ALTER TABLE {s}.records DROP CONSTRAINT records_pkey, "
        "ADD PRIMARY KEY (org_id, user_id, kind, id)",
        "DROP INDEX {s}.records_session",
        "ALTER TABLE {s}.events DROP CONSTRAINT events_pkey, ADD PRIMARY KEY (org_id, user_id, id)",
        "ALTER TABLE {s}.events DROP CONSTRAINT events_session_id_sequence_number_key, "
        "ADD CONSTRAINT events_place UNIQUE (org_id, user_id, session_id, sequence_number)",
        "DROP INDEX {s}.events_tenant",
    ),
    # 5: each audit row's place in its device's chain: a push checks that a row continues it.
    (
        """CREATE TABLE {s}.audit_places (
            org_id text NOT NULL,
            user_id text NOT NULL,
            client_id text NOT NULL,
            sequence_number bigint NOT NULL,
            row_hash text NOT NULL,
            id text NOT NULL,
            PRIMARY KEY (org_id, user_id, client_id, sequence_number, id)
        )""",
        _backfill_audit_places,
    ),
    # 6: the feed refers to its records (kind and id) instead of holding a second copy of
    # each body, and a session keeps one entry, its latest version's: every version of a
    # session row a device pushed stayed in the feed, so a session synced turn by turn cost
    # the sum of all its versions (growing with the square of its length).
    (
        "DELETE FROM {s}.feed AS f WHERE f.kind = 'Session' AND EXISTS ("
        "SELECT 1 FROM {s}.feed AS later WHERE later.org_id = f.org_id "
        "AND later.user_id = f.user_id AND later.kind = f.kind "
        "AND later.record_id = f.record_id AND later.cursor > f.cursor)",
        "ALTER TABLE {s}.feed DROP COLUMN body",
    ),
    # 7: a push takes the tenant lock and reads the device's last_seq in one round trip. A
    # VOLATILE plpgsql function runs each of its statements on a fresh snapshot (READ
    # COMMITTED), so the read, taken after the lock is granted, sees every push of the tenant
    # committed before it, exactly as a statement of its own would (see "Cursor visibility").
    (
        """CREATE OR REPLACE FUNCTION {s}.lock_tenant_last_seq(
            lock_key bigint, org text, usr text, client text
        ) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            PERFORM pg_advisory_xact_lock(lock_key);
            RETURN (SELECT c.last_seq FROM {s}.clients AS c
                    WHERE c.org_id = org AND c.user_id = usr AND c.client_id = client);
        END
        $$""",
    ),
    # 8: the planner told that a tenant's user id decides its org id. Without it, it takes the two
    # columns as independent, puts a tenant at about one row in (tenants squared), and plans a key
    # lookup as a walk along any index that starts with the tenant, filtering the rest: right for
    # an average tenant, proportional to the size of a large one. PostgreSQL runs a prepared
    # statement (asyncpg prepares each) as a generic plan, planned for any tenant, once five runs
    # showed it no costlier, so those plans must be right for a tenant of any size
    # (test_plans_do_not_depend_on_a_tenants_size).
    (
        *(
            f"CREATE STATISTICS {{s}}.{table}_tenant (ndistinct, dependencies) "
            f"ON org_id, user_id FROM {{s}}.{table}"
            for table in _TENANT_TABLES
        ),
        "ANALYZE " + ", ".join(f"{{s}}.{table}" for table in _TENANT_TABLES),
    ),
    # 9: an id is kept as its key (``pleach_key``: a canonical UUID as its 16 bytes, any other
    # id as its text behind a marker) and a kind as its number (``pleach_kind``: its index in
    # ``shared.compact.KINDS``), as the SQLite store keeps them: a UUID took 37 bytes as text
    # in its row and again in every index entry that holds it, 17 as bytes. The two functions
    # are the store's conversions in SQL, for this migration and for a reader in psql; the
    # store binds keys converted in Python (``_pg_key``), alike
    # (test_keys_are_converted_alike_in_python_and_in_sql).
    (
        _PLEACH_KEY,
        _PLEACH_KIND,
        "ALTER TABLE {s}.sessions ALTER COLUMN id TYPE bytea USING {s}.pleach_key(id)",
        "ALTER TABLE {s}.records ALTER COLUMN kind TYPE smallint USING {s}.pleach_kind(kind), "
        "ALTER COLUMN id TYPE bytea USING {s}.pleach_key(id), "
        "ALTER COLUMN session_id TYPE bytea USING {s}.pleach_key(session_id)",
        "ALTER TABLE {s}.events ALTER COLUMN id TYPE bytea USING {s}.pleach_key(id), "
        "ALTER COLUMN session_id TYPE bytea USING {s}.pleach_key(session_id)",
        "ALTER TABLE {s}.feed ALTER COLUMN kind TYPE smallint USING {s}.pleach_kind(kind), "
        "ALTER COLUMN record_id TYPE bytea USING {s}.pleach_key(record_id)",
        "ALTER TABLE {s}.audit_places ALTER COLUMN id TYPE bytea USING {s}.pleach_key(id)",
        "ANALYZE " + ", ".join(f"{{s}}.{table}" for table in _TENANT_TABLES),
    ),
    # 10: a tenant is a number (``tenants``) in the large tables, as in the SQLite store: its
    # org and user ids, as text, were in every row and index entry of theirs. The small
    # tables (``clients``, ``meta``, ``devices``) keep the names. Dropping the two columns
    # drops the indexes, keys and statistics that held them; they are made again on ``tid``.
    # The old values stay in the rows' bytes until a row is rewritten: ``VACUUM FULL`` of
    # each table gives the space back at once (it locks the table while it runs).
    (
        "CREATE TABLE {s}.tenants (tid integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "org_id text NOT NULL, user_id text NOT NULL, UNIQUE (org_id, user_id))",
        "INSERT INTO {s}.tenants (org_id, user_id) "
        + " UNION ".join(f"SELECT org_id, user_id FROM {{s}}.{t}" for t in _NUMBERED_TABLES)
        + " ORDER BY 1, 2",
        *(
            statement
            for table in _NUMBERED_TABLES
            for statement in (
                f"ALTER TABLE {{s}}.{table} ADD COLUMN tid integer",
                f"UPDATE {{s}}.{table} AS x SET tid = t.tid FROM {{s}}.tenants AS t "
                "WHERE t.org_id = x.org_id AND t.user_id = x.user_id",
                f"ALTER TABLE {{s}}.{table} ALTER COLUMN tid SET NOT NULL, "
                "DROP COLUMN org_id, DROP COLUMN user_id",
            )
        ),
        "ALTER TABLE {s}.sessions ADD PRIMARY KEY (tid, id)",
        "CREATE INDEX sessions_tenant ON {s}.sessions (tid, updated_at)",
        "ALTER TABLE {s}.records ADD PRIMARY KEY (tid, kind, id)",
        "CREATE INDEX records_tenant ON {s}.records (tid, session_id)",
        "ALTER TABLE {s}.events ADD PRIMARY KEY (tid, id), "
        "ADD CONSTRAINT events_place UNIQUE (tid, session_id, sequence_number)",
        "CREATE INDEX feed_tenant ON {s}.feed (tid, cursor)",
        "CREATE INDEX feed_record ON {s}.feed (tid, kind, record_id, cursor)",
        "ALTER TABLE {s}.audit_places ADD PRIMARY KEY (tid, client_id, sequence_number, id)",
        "ANALYZE {s}.tenants, " + ", ".join(f"{{s}}.{t}" for t in _NUMBERED_TABLES),
    ),
    # 11: a push takes the tenant lock, reads the device's last_seq and makes every lookup of
    # its batch in one round trip (``lock_last_seq_load``, on the keys of the batch as it
    # would be after the last_seq the push expects; see ``_PostgresTx``). As in version 7,
    # each statement of the function runs on a fresh snapshot, taken after the lock.
    (_lock_last_seq_load_step,),
    # 12: a long session's message ids in blocks beside its row (``base.session_row``): the
    # row was rewritten whole at each turn, every id the session had (320 KB at 20,000). A
    # block (2 KB) is kept in its row as it is (``PLAIN``): neither compressed (ids do not
    # compress) nor moved out to the TOAST table. ``lock_last_seq_load`` reads the blocks.
    (
        "ALTER TABLE {s}.sessions ADD COLUMN ids_count integer",
        "CREATE TABLE {s}.session_ids (tid integer NOT NULL, id bytea NOT NULL, "
        "part integer NOT NULL, ids bytea NOT NULL, PRIMARY KEY (tid, id, part))",
        "ALTER TABLE {s}.session_ids ALTER COLUMN ids SET STORAGE PLAIN",
        _lock_last_seq_load_step,
    ),
    # 13: records pushed at protocol 8 are stored in its form (``shared.compact``), which a
    # process of a build before reads as corrupt rows. No table changes: the version makes
    # such a process refuse to start on the schema ("upgrade pleach"); one still running
    # serves the rows' bytes as they are (docs/POSTGRES.md).
    ("SELECT 1",),
    # 14: an immutable record and an event keep the cursor of their feed entry (their one
    # entry: each is written once, with it, in the same statement), so that deleting a
    # session's content finds the entries by cursor (``feed_pkey``), and the feed's index by
    # record keeps the entries of sessions alone: it held every entry's kind and id a second
    # time (0.67 MB of a 6.7 MB schema at 1,000 turns; the column takes 8 bytes a row). A row
    # whose entry has gone keeps NULL. An immutable record's older entries (none since
    # version 6) go first: its one row answers them all, and a delete must leave none behind.
    # As in version 10, the rows written here leave their old versions to ``VACUUM``.
    (
        f"DELETE FROM {{s}}.feed AS f WHERE f.kind <> {_SESSION_KIND} AND EXISTS ("
        "SELECT 1 FROM {s}.feed AS later WHERE later.tid = f.tid AND later.kind = f.kind "
        "AND later.record_id = f.record_id AND later.cursor > f.cursor)",
        "ALTER TABLE {s}.records ADD COLUMN cursor bigint",
        "UPDATE {s}.records AS r SET cursor = f.cursor FROM {s}.feed AS f "
        "WHERE f.tid = r.tid AND f.kind = r.kind AND f.record_id = r.id",
        "ALTER TABLE {s}.events ADD COLUMN cursor bigint",
        "UPDATE {s}.events AS e SET cursor = f.cursor FROM {s}.feed AS f "
        f"WHERE f.tid = e.tid AND f.kind = {_EVENT_KIND} AND f.record_id = e.id",
        "DROP INDEX {s}.feed_record",
        f"CREATE INDEX feed_session ON {{s}}.feed (tid, record_id) WHERE kind = {_SESSION_KIND}",
        "ANALYZE {s}.records, {s}.events, {s}.feed",
    ),
    # 15: fewer rows and fewer bytes a row. A record and an event are their own feed entries,
    # at the cursor each keeps (version 14), found by tenant and cursor (``records_cursor``,
    # ``events_cursor``; ``_page`` merges them with the feed's): the feed keeps sessions'
    # entries alone, keyed by tenant and cursor (its index by tenant was a second copy of the
    # key; every statement that names a cursor names its tenant). A row written with no
    # cursor by a process of a build before 14 takes its entry's first. A chain's row hash
    # is its 32 bytes (``_pg_hash``), not 64 hex characters. A message's, a checkpoint's and
    # an event's body leaves out the ids its row holds and its tenant, and an event's its
    # prev_hash where the row before it keeps that as its row hash (``compact.short_body``,
    # ``compact.prev_apart``; ``pleach_whole`` puts them back as a statement reads the body).
    # ``lock_last_seq_load`` answers the row hashes as bytes. As in version 10, the
    # rewritten tables leave their old rows to ``VACUUM``; the rows written before keep their
    # whole bodies, which read as they are.
    (
        "ALTER TABLE {s}.feed DROP CONSTRAINT feed_pkey, ADD PRIMARY KEY (tid, cursor)",
        "DROP INDEX {s}.feed_tenant",
        f"ALTER TABLE {{s}}.events ALTER COLUMN row_hash TYPE bytea USING {_HASH_SQL}",
        f"ALTER TABLE {{s}}.audit_places ALTER COLUMN row_hash TYPE bytea USING {_HASH_SQL}",
        _PLEACH_HEAD,
        _PLEACH_CUT,
        _PLEACH_WHOLE,
        "DROP FUNCTION {s}.lock_last_seq_load",
        _lock_last_seq_load_step,
        "UPDATE {s}.records AS r SET cursor = f.cursor FROM {s}.feed AS f "
        "WHERE r.cursor IS NULL AND f.tid = r.tid AND f.kind = r.kind AND f.record_id = r.id",
        "UPDATE {s}.events AS e SET cursor = f.cursor FROM {s}.feed AS f "
        f"WHERE e.cursor IS NULL AND f.tid = e.tid AND f.kind = {_EVENT_KIND} "
        "AND f.record_id = e.id",
        f"DELETE FROM {{s}}.feed WHERE kind <> {_SESSION_KIND}",
        "CREATE INDEX records_cursor ON {s}.records (tid, cursor) WHERE cursor IS NOT NULL",
        "CREATE INDEX events_cursor ON {s}.events (tid, cursor) WHERE cursor IS NOT NULL",
        "ANALYZE {s}.feed, {s}.records, {s}.events, {s}.audit_places",
    ),
    # 16: fewer bytes a row and an entry. The records' key in id order (tenant, id, kind):
    # keyed kind first, a push's records went in at as many places in the key as it had
    # kinds, and each page split there half full (0.26 MB of key for 4,000 records where
    # 0.18). An event's row hash is read from the end of its body, which holds it (NULL in
    # the column then: ``_event_hash``, ``pleach_digest``), 33 bytes a row fewer; rows
    # written before keep theirs. ``lock_last_seq_load`` reads it so. The bodies of a
    # device's own records leave out its stamp's node too (``compact.short_body``'s
    # ``node``; an audit row's, its id, tenant, device, node and session id: about 80
    # bytes), which the row names by its number in ``nodes`` (``device``; NULL where the
    # body keeps it); ``pleach_whole`` is given it (``_PLEACH_WHOLE_16``).
    (
        "ALTER TABLE {s}.records DROP CONSTRAINT records_pkey, ADD PRIMARY KEY (tid, id, kind)",
        "ALTER TABLE {s}.events ALTER COLUMN row_hash DROP NOT NULL",
        _PLEACH_DIGEST,
        "DROP FUNCTION {s}.lock_last_seq_load",
        _lock_last_seq_load_step,
        "CREATE TABLE {s}.nodes (n integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "node bytea NOT NULL UNIQUE)",
        "ALTER TABLE {s}.records ADD COLUMN device integer",
        "ALTER TABLE {s}.events ADD COLUMN device integer",
        "DROP FUNCTION {s}.pleach_whole(bytea, bytea, bytea, bytea, bytea)",
        _PLEACH_WHOLE_16,
    ),
    # 17: records pushed at protocol 9 are stored in its form, a long text deflated
    # (``shared.compact``), which a process of a build before reads as corrupt rows. No table
    # changes: the version makes such a process refuse to start on the schema ("upgrade
    # pleach"); one still running serves the rows' bytes as they are (docs/POSTGRES.md).
    ("SELECT 1",),
    # 18: fewer rows and fewer bytes a row.
    # - A push reads one place of a device's audit chain, its last, to take a row only at
    #   the next one; ``audit_places`` kept every row's (its tenant, its device's id as
    #   text, its place, id and row hash: 0.27 MB of 3.96 with its key at 1,000 turns). It
    #   keeps the last alone now (``audit_tails``, one row a tenant's device, moved on by
    #   each push that adds to its chain), the tail ``_audit_tail`` read before: the
    #   greatest place, and of two rows there, which only a device of protocol 2 or earlier
    #   leaves, the greater id.
    # - An event and a record name their session by its number in ``chains`` (4 bytes where
    #   17, in the row and in ``events_place``), as the SQLite store does. ``events`` and
    #   ``records`` are made anew: besides, each row of theirs kept a NULL for every column
    #   dropped before (the tenant's text ids, version 10; the session id now), which made
    #   its header 8 bytes longer; their columns go in the order that leaves no padding.
    (
        "CREATE TABLE {s}.audit_tails (tid integer NOT NULL, client_id text NOT NULL, "
        "sequence_number bigint NOT NULL, row_hash bytea NOT NULL, id bytea NOT NULL, "
        "PRIMARY KEY (tid, client_id))",
        "INSERT INTO {s}.audit_tails (tid, client_id, sequence_number, row_hash, id) "
        "SELECT DISTINCT ON (tid, client_id) tid, client_id, sequence_number, row_hash, id "
        "FROM {s}.audit_places ORDER BY tid, client_id, sequence_number DESC, id DESC",
        "DROP TABLE {s}.audit_places",
        "CREATE TABLE {s}.chains (n integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "tid integer NOT NULL, session_id bytea NOT NULL, UNIQUE (tid, session_id))",
        "INSERT INTO {s}.chains (tid, session_id) SELECT tid, session_id FROM {s}.events "
        "UNION SELECT tid, session_id FROM {s}.records WHERE session_id IS NOT NULL "
        "ORDER BY 1, 2",
        "CREATE TABLE {s}.events_18 (tid integer NOT NULL, chain integer NOT NULL, "
        "sequence_number bigint NOT NULL, cursor bigint, device integer, id bytea NOT NULL, "
        "row_hash bytea, body bytea NOT NULL)",
        "INSERT INTO {s}.events_18 (tid, chain, sequence_number, cursor, device, id, "
        "row_hash, body) SELECT e.tid, c.n, e.sequence_number, e.cursor, e.device, e.id, "
        "e.row_hash, e.body FROM {s}.events AS e JOIN {s}.chains AS c ON c.tid = e.tid "
        "AND c.session_id = e.session_id ORDER BY e.cursor",
        "DROP TABLE {s}.events",
        "ALTER TABLE {s}.events_18 RENAME TO events",
        "ALTER TABLE {s}.events ADD PRIMARY KEY (tid, id), "
        "ADD CONSTRAINT events_place UNIQUE (chain, sequence_number)",
        "CREATE INDEX events_cursor ON {s}.events (tid, cursor) WHERE cursor IS NOT NULL",
        "CREATE TABLE {s}.records_18 (tid integer NOT NULL, chain integer, cursor bigint, "
        "device integer, kind smallint NOT NULL, id bytea NOT NULL, body bytea NOT NULL)",
        "INSERT INTO {s}.records_18 (tid, chain, cursor, device, kind, id, body) "
        "SELECT r.tid, c.n, r.cursor, r.device, r.kind, r.id, r.body FROM {s}.records AS r "
        "LEFT JOIN {s}.chains AS c ON c.tid = r.tid AND c.session_id = r.session_id "
        "ORDER BY r.cursor",
        "DROP TABLE {s}.records",
        "ALTER TABLE {s}.records_18 RENAME TO records",
        "ALTER TABLE {s}.records ADD PRIMARY KEY (tid, id, kind)",
        "CREATE INDEX records_cursor ON {s}.records (tid, cursor) WHERE cursor IS NOT NULL",
        "CREATE INDEX records_chain ON {s}.records (chain)",
        "DROP FUNCTION {s}.lock_last_seq_load",
        _lock_last_seq_load_step,
        "ANALYZE {s}.audit_tails, {s}.chains, {s}.events, {s}.records",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)

# Errors after which trying again may succeed: the connection or the server went away, the
# server is starting or stopping, it ran out of connections, a statement timed out, or a
# transaction lost a serialization race.
_TRANSIENT: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,  # class 08, ConnectionDoesNotExistError included
    asyncpg.InterfaceError,  # the client side of a closed connection or pool
    # 57: admin or crash shutdown, cannot connect now, query canceled (statement timeout)
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,  # 53: too many connections, out of memory
    asyncpg.exceptions.TransactionRollbackError,  # 40: serialization failure, deadlock
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.InternalClientError,  # client state confused by a connection lost mid-call
    OSError,  # refused, reset, unreachable
    TimeoutError,  # connect or pool-acquire timeout
)
# Errors after which a connection must not go back into the pool: terminate it, the pool
# opens a fresh one on a later acquire.
_BROKEN: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    OSError,
    TimeoutError,
)
_DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    *_TRANSIENT,
    asyncpg.PostgresError,
)
_NODES_KEPT: Final = 4096
"""How many devices' stamp node numbers a process keeps (``PostgresServerStore._device_of``)."""
DEFAULT_KNOWN_BYTES: Final = 16 << 20
"""``PostgresServerStore.known_bytes``: what a process keeps of tenants' rows."""
_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*_DATABASE_ERRORS, TimeoutError)


def redact_dsn(dsn: str) -> str:
    """``host:port/database`` of a DSN, without user or password (for messages and logs)."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        port = parts.port or 5432
    except ValueError:
        return "<invalid dsn>"
    return f"{host}:{port}{parts.path or '/'}"


def _check_schema(schema: str) -> str:
    if not _SCHEMA_RE.fullmatch(schema):
        raise ValueError(
            f"schema must be a lowercase SQL identifier ([a-z_][a-z0-9_]*), got {schema!r}"
        )
    return schema


def _key(*parts: str) -> int:
    digest = hashlib.blake2b("\x00".join(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def tenant_lock_key(schema: str, tenant: Tenant) -> int:
    """The 64-bit advisory lock key of ``tenant`` in ``schema`` (stable across processes)."""
    return _key("pleach-tenant", schema, tenant.org_id, tenant.user_id)


def _migrate_lock_key(schema: str) -> int:
    return _key("pleach-migrate", schema)


def _translate(exc: BaseException, doing: str) -> StorageUnavailable:
    retryable = isinstance(exc, _TRANSIENT)
    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return StorageUnavailable(f"{doing}: {detail}", retryable=retryable)


class MigrateResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``migrate`` did: the schema went from ``from_version`` to ``to_version``."""

    schema: str
    from_version: int
    to_version: int

    @property
    def applied(self) -> int:
        return self.to_version - self.from_version


async def _migrate_conn(conn: Any, schema: str) -> MigrateResult:
    """Bring ``schema`` up to ``SCHEMA_VERSION`` on ``conn``; safe to run concurrently.

    Takes a session advisory lock (concurrent starts wait for each other), then applies the
    missing versions, each in its own transaction with its ``schema_migrations`` row.
    """
    s = _check_schema(schema)
    key = _migrate_lock_key(s)
    await conn.execute("SELECT pg_advisory_lock($1)", key)
    try:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        await conn.execute(
            f"""CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
                version integer PRIMARY KEY,
                applied_at timestamptz NOT NULL DEFAULT now()
            )"""
        )
        version = int(
            await conn.fetchval(f"SELECT COALESCE(MAX(version), 0) FROM {s}.schema_migrations")
        )
        if version > SCHEMA_VERSION:
            raise StorageError(
                f"schema {s} has version {version}; this build knows up to "
                f"{SCHEMA_VERSION}: upgrade pleach"
            )
        for number, statements in enumerate(_MIGRATIONS[version:], start=version + 1):
            async with conn.transaction():
                for statement in statements:
                    if isinstance(statement, str):
                        await conn.execute(statement.format(s=s))
                    else:
                        await statement(conn, s)
                await conn.execute(
                    f"INSERT INTO {s}.schema_migrations (version) VALUES ($1)", number
                )
            log.info("migrated schema %s to version %d", s, number)
        await _make_functions(conn, s)
        return MigrateResult(schema=s, from_version=version, to_version=SCHEMA_VERSION)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", key)


async def migrate(
    dsn: str, schema: str = DEFAULT_SCHEMA, *, connect_timeout: float = 30.0
) -> MigrateResult:
    """Apply the missing schema migrations to ``schema`` of ``dsn`` (``pleach-server migrate``).

    Idempotent, and safe while servers run or start. Raises ``StorageUnavailable`` when the
    database cannot be reached and ``StorageError`` when it has a newer schema than this build.
    """
    _check_schema(schema)
    try:
        conn = await asyncpg.connect(
            dsn, timeout=connect_timeout, server_settings={"application_name": "pleach-migrate"}
        )
    except _DATABASE_ERRORS as exc:
        raise _translate(exc, f"cannot connect to PostgreSQL at {redact_dsn(dsn)}") from exc
    try:
        return await _migrate_conn(conn, schema)
    except _DATABASE_ERRORS as exc:
        raise _translate(exc, "migration failed") from exc
    finally:
        await asyncio.shield(conn.close(timeout=connect_timeout))


# Every lookup by id is among the tenant's own rows ($1 org, $2 user): ids are scoped to
# their tenant, so another tenant's rows under the same id are never read. Since version 10
# the large tables name a tenant by its number (``tenants``): each statement reads it once
# (an uncorrelated subquery, run once before the rest as an InitPlan; NULL for a tenant that
# has written nothing, which no row matches).
def _tid(s: str) -> str:
    """The tenant's number, ``$1`` and ``$2`` its org and user."""
    return f"(SELECT tid FROM {s}.tenants WHERE org_id = $1 AND user_id = $2)"


_T = "org_id = $1 AND user_id = $2"
"""The tenant condition of the small tables (``clients``, ``meta``, ``devices``), which keep
its names."""


def _session_owner(s: str, key: str, tid: str | None = None) -> str:
    """A session id is held by its row, else by its chain (``chains``: an event or a record
    was filed under it, since version 18).
    ``key``: the id's key (``_pg_key``), as in every lookup below (a lookup converts its ids
    in Python: the planner does not read a key computed in SQL through an index). Each
    answers a row when the tenant holds the id. ``tid``: the tenant's number as the
    statement has it (``_Sql.load``: read once for all its lookups), else ``_tid``."""
    t = tid or _tid(s)
    return (
        f"SELECT 1 FROM {s}.sessions WHERE tid = {t} AND id = {key} "
        f"UNION ALL SELECT 1 FROM {s}.chains WHERE tid = {t} AND session_id = {key} "
        "LIMIT 1"
    )


def _event_owner(s: str, key: str, tid: str | None = None) -> str:
    return f"SELECT 1 FROM {s}.events WHERE tid = {tid or _tid(s)} AND id = {key}"


def _record_owner(s: str, kind: str, key: str, tid: str | None = None) -> str:
    return (
        f"SELECT 1 FROM {s}.records WHERE tid = {tid or _tid(s)} AND kind = {kind} AND id = {key}"
    )


def _get_session(s: str, key: str, tid: str | None = None) -> str:
    return f"SELECT body, ids_count FROM {s}.sessions WHERE tid = {tid or _tid(s)} AND id = {key}"


def _session_ids(s: str, key: str, tid: str) -> str:
    """The ids of a session's blocks, joined in order (NULL: it has none)."""
    return (
        f"SELECT string_agg(b.ids, ''::bytea ORDER BY b.part) AS ids FROM {s}.session_ids AS b "
        f"WHERE b.tid = {tid} AND b.id = {key}"
    )


def _last_event(s: str, key: str, tid: str | None = None) -> str:
    """The last event of session ``key``'s chain (its number in ``chains``, since version
    18): one probe of ``chains``' key, then of ``events_place`` backwards."""
    return (
        f"SELECT l.sequence_number, {_event_hash(s, 'l')} AS row_hash FROM {s}.events AS l "
        f"WHERE l.chain = (SELECT c.n FROM {s}.chains AS c WHERE c.tid = {tid or _tid(s)} "
        f"AND c.session_id = {key}) ORDER BY l.sequence_number DESC LIMIT 1"
    )


def _max_cursor(s: str, tid: str | None = None) -> str:
    """The tenant's highest feed cursor (0 when it has none).

    Each of its three places (since version 15: the feed's session entries, and the records
    and the events at their cursors) read as the first row of its index backwards, never as
    ``MAX(cursor)``: the planner estimates a tenant's rows from the whole table's
    statistics, so for a tenant far larger than the average it planned ``MAX`` as an
    aggregate over every entry the tenant has, or as a walk back along the primary key past
    everyone else's, which took 40-80 ms a call at 300,000 entries (docs/POSTGRES.md).
    Ordered as the index is, with ``LIMIT 1``, each is one probe whatever the estimates.
    """
    t = tid or _tid(s)
    return (
        "GREATEST("
        + ", ".join(
            f"COALESCE((SELECT cursor FROM {s}.{table} WHERE tid = {t}{kept} "
            "ORDER BY tid DESC, cursor DESC LIMIT 1), 0)"
            for table, kept in _CURSOR_PLACES
        )
        + ")"
    )


_CURSOR_PLACES: Final = (
    ("feed", ""),
    ("records", " AND cursor IS NOT NULL"),
    ("events", " AND cursor IS NOT NULL"),
)
"""Where a tenant's feed cursors are (schema 15): the feed (sessions' entries), and the
records and events at the cursors they keep (``records_cursor``, ``events_cursor``: partial
indexes, a row whose entry has gone keeping none), each with the condition its index has."""


def _floor(s: str) -> str:
    return f"COALESCE((SELECT feed_floor FROM {s}.meta WHERE {_T}), 0)"


def _audit_tail(s: str, key: str, tid: str | None = None) -> str:
    """SQL: the last place of the audit chain of device ``key`` (since version 18 its one row
    of ``audit_tails``): its sequence number and row hash."""
    return (
        f"SELECT sequence_number, row_hash FROM {s}.audit_tails WHERE tid = {tid or _tid(s)} "
        f"AND client_id = {key} LIMIT 1"
    )


def _page(s: str) -> str:
    """SQL: the tenant's first ``$4`` entries after cursor ``$3``, in cursor order, merged from
    the three places a cursor is kept (``_CURSOR_PLACES``), each read along its index from
    there: ``cursor``, ``place`` (0 the feed, 1 the records, 2 the events), ``tid``,
    ``record_id`` (a session entry's) and ``row`` (the row of a record's or an event's, which
    the pull reads its body from)."""
    t = _tid(s)
    return (
        "SELECT * FROM ("
        f"(SELECT cursor, 0 AS place, tid, record_id, NULL::tid AS row FROM {s}.feed "
        f"WHERE tid = {t} AND cursor > $3 ORDER BY tid, cursor LIMIT $4) "
        f"UNION ALL (SELECT cursor, 1, tid, NULL, ctid FROM {s}.records WHERE tid = {t} "
        "AND cursor IS NOT NULL AND cursor > $3 ORDER BY tid, cursor LIMIT $4) "
        f"UNION ALL (SELECT cursor, 2, tid, NULL, ctid FROM {s}.events WHERE tid = {t} "
        "AND cursor IS NOT NULL AND cursor > $3 ORDER BY tid, cursor LIMIT $4)"
        ") AS u ORDER BY cursor LIMIT $4"
    )


def _whole_body(s: str, row: str, tenant: str, prev: str = "NULL::bytea") -> str:
    """SQL: the body of the records' or the events' row ``row`` as its record was written
    (``pleach_whole``: schema 15 keeps it without what its row holds); ``tenant``: the
    parameter of ``packed_tenant``; the stamp node of the row's device and its session's id,
    joined as ``{row}_node`` and ``{row}_chain`` (``_node_of``); ``prev``: for an event,
    the row hash of the row before it
    (``_row_before``). Each argument a column or a parameter, so that PostgreSQL inlines
    the function into the statement (an argument holding a subquery kept it a call of its
    own, about 0.1 ms a row)."""
    return (
        f"{s}.pleach_whole({row}.body, {row}.id, {row}_chain.session_id, {tenant}, "
        f"{row}_node.node, {prev})"
    )


def _node_of(s: str, row: str) -> str:
    """SQL: the joins of the stamp node the row ``row`` names (``{row}_node.node``; NULL:
    the body keeps its own) and of its session's id (``{row}_chain.session_id``: the row
    names its chain, since version 18), for ``_whole_body``: one probe of ``nodes``' key
    and one of ``chains``'."""
    return (
        f"LEFT JOIN {s}.nodes AS {row}_node ON {row}_node.n = {row}.device "
        f"LEFT JOIN {s}.chains AS {row}_chain ON {row}_chain.n = {row}.chain"
    )


def _row_before(s: str, row: str) -> str:
    """SQL: a join of the row hash of the events' row before ``row`` in its session
    (``prev.row_hash``), for a body stored without its ``prev_hash`` (forms 16 and 17): one
    probe of ``events_place``."""
    return (
        f"LEFT JOIN LATERAL (SELECT {_event_hash(s, 'p')} AS row_hash FROM {s}.events AS p "
        f"WHERE substr({row}.body, 1, 2) IN ('\\xc110'::bytea, '\\xc111'::bytea) "
        f"AND p.chain = {row}.chain AND p.sequence_number = {row}.sequence_number - 1 "
        "LIMIT 1) AS prev ON true"
    )


class _Sql:
    """The statements of one schema, formatted once."""

    def __init__(self, s: str) -> None:
        self.put_health = (
            f"INSERT INTO {s}.devices (org_id, user_id, client_id, seen_at, health) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (org_id, user_id, client_id) "
            "DO UPDATE SET seen_at = excluded.seen_at, health = excluded.health "
            f"WHERE excluded.seen_at >= {s}.devices.seen_at"
        )
        self.trim_devices = (
            f"DELETE FROM {s}.devices WHERE org_id = $1 AND user_id = $2 AND client_id IN ("
            f"SELECT client_id FROM {s}.devices WHERE org_id = $1 AND user_id = $2 "
            "ORDER BY seen_at DESC OFFSET $3)"
        )
        self.list_health = (
            f"SELECT org_id, user_id, client_id, seen_at, health FROM {s}.devices "
            "ORDER BY seen_at DESC LIMIT $1"
        )
        self.get_last_seq = (
            f"SELECT last_seq FROM {s}.clients "
            "WHERE org_id = $1 AND user_id = $2 AND client_id = $3"
        )
        # The lookups of a push, per key. A push runs them all for all the keys of its batch
        # in ONE statement (``load`` below: a LATERAL join over the keys of each, passed as
        # arrays); the per-key forms are kept whole so that their plans can be checked
        # (test_per_tenant_queries_are_index_scans, docs/POSTGRES.md).
        # Every LATERAL body has a LIMIT (a no-op on a primary key): the planner cannot flatten
        # it into a join, so each key stays one index scan, however large the tables grow.
        self.session_owner = _session_owner(s, "$3")
        self.event_owner = _event_owner(s, "$3")
        self.record_owner = _record_owner(s, "$3", "$4")
        self.get_session = _get_session(s, "$3")
        self.last_event = _last_event(s, "$3")
        self.audit_tail = _audit_tail(s, "$3")
        # Each branch is tagged by its first column (0 record owners, 1 event owners, 2
        # session owners, 3 sessions with the count of ids in their blocks, 4 chain tails, 5
        # audit chain tails, 6 the tenant's head cursor, always one row, 8 the ids of the
        # sessions' blocks); an empty key array returns nothing.
        # The tenant's number is read once (``tt``, materialized) and each lookup takes it
        # from there (an InitPlan over one row, no index probe): eight probes of ``tenants``
        # a push were 0.17 ms of its time.
        t = "(SELECT tid FROM tt)"
        self.load = (
            f"WITH tt AS MATERIALIZED (SELECT tid FROM {s}.tenants "
            "WHERE org_id = $1 AND user_id = $2) "
            "SELECT 0, k.kind, k.id, NULL::bytea, NULL::bigint, NULL::bytea "
            "FROM unnest($3::smallint[], $4::bytea[]) AS k (kind, id) "
            f"CROSS JOIN LATERAL ({_record_owner(s, 'k.kind', 'k.id', t)} LIMIT 1) AS o "
            "UNION ALL SELECT 1, NULL, k.id, NULL, NULL, NULL "
            "FROM unnest($5::bytea[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_event_owner(s, 'k.id', t)} LIMIT 1) AS o "
            "UNION ALL SELECT 2, NULL, k.id, NULL, NULL, NULL "
            "FROM unnest($6::bytea[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_session_owner(s, 'k.id', t)}) AS o "
            "UNION ALL SELECT 3, NULL, k.id, o.body, o.ids_count, NULL "
            "FROM unnest($7::bytea[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_get_session(s, 'k.id', t)} LIMIT 1) AS o "
            "UNION ALL SELECT 8, NULL, k.id, o.ids, NULL, NULL "
            "FROM unnest($7::bytea[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_session_ids(s, 'k.id', t)}) AS o WHERE o.ids IS NOT NULL "
            "UNION ALL SELECT 4, NULL, k.id, NULL, o.sequence_number, o.row_hash "
            "FROM unnest($8::bytea[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_last_event(s, 'k.id', t)}) AS o "
            "UNION ALL SELECT 5, NULL, convert_to(k.id, 'UTF8'), NULL, "
            "o.sequence_number, o.row_hash "
            "FROM unnest($9::text[]) AS k (id) "
            f"CROSS JOIN LATERAL ({_audit_tail(s, 'k.id', t)}) AS o "
            "UNION ALL SELECT 6, NULL, NULL, NULL, ("
            f"SELECT GREATEST({_max_cursor(s, t)}, {_floor(s)})), NULL"
        )
        # The writes of a push, the rows passed as arrays (columns): records, events, sessions
        # and the device's last_seq in ONE round trip (``write``), data-modifying CTEs on four
        # tables, each run whatever the query reads; empty arrays (and a NULL last_seq) write
        # nothing. It answers the rows records and events took.
        self.write = (
            # The tenant's number: made here the first time the tenant writes (the tenant
            # lock keeps its other pushes out meanwhile), read otherwise. The sequence turns
            # only when a row is made (a NOT EXISTS, not a conflict).
            # (One probe of ``tenants``: ``t0`` is read by both.)
            f"WITH t0 AS MATERIALIZED (SELECT tid FROM {s}.tenants "
            "WHERE org_id = $1 AND user_id = $2), "
            f"t AS (INSERT INTO {s}.tenants (org_id, user_id) SELECT $1, $2 "
            "WHERE NOT EXISTS (SELECT 1 FROM t0) ON CONFLICT DO NOTHING RETURNING tid), "
            "tt AS (SELECT COALESCE((SELECT tid FROM t), (SELECT tid FROM t0)) AS tid), "
            # The feed rows' cursors ($21: their kinds): n from the identity sequence (the
            # caller holds the tenant lock), numbered in increasing order. One per element of
            # $21 (a generate_series of its length is a thousand rows to the planner, which
            # then planned the statement anew at every push: test_a_push_and_a_pull_are_
            # planned_once).
            "cur AS MATERIALIZED (SELECT a.cursor, row_number() OVER (ORDER BY a.cursor) AS n "
            f"FROM (SELECT nextval(pg_get_serial_sequence('{s}.feed', 'cursor')) AS cursor "
            "FROM unnest($21::smallint[])) AS a), "
            # The chains of the sessions the records ($5) and events ($8) are filed under
            # (since version 18 a row names its session by its number in ``chains``): those
            # found (``sk``, with NULL for a session that has none), those made here
            # (``made``, for those alone: an insert that meets a conflict would take a number
            # of the sequence, at every push), and the two (``ch``).
            "sk AS MATERIALIZED (SELECT k.session_key, c.n FROM tt CROSS JOIN (SELECT DISTINCT x "
            "AS session_key FROM unnest($5::bytea[] || $8::bytea[]) AS x WHERE x IS NOT NULL) "
            f"AS k LEFT JOIN LATERAL (SELECT c.n FROM {s}.chains AS c WHERE c.tid = tt.tid "
            "AND c.session_id = k.session_key LIMIT 1) AS c ON true), "
            f"made AS (INSERT INTO {s}.chains (tid, session_id) SELECT tt.tid, sk.session_key "
            "FROM tt, sk WHERE sk.n IS NULL ON CONFLICT DO NOTHING "
            "RETURNING n AS chain, session_id AS session_key), "
            "ch AS (SELECT sk.n AS chain, sk.session_key FROM sk WHERE sk.n IS NOT NULL "
            "UNION ALL SELECT chain, session_key FROM made), "
            # A record and an event keep their entry's cursor ($32, $33: the number of each
            # one's entry among the feed rows), its session's chain (``ch``), and the number
            # of the stamp node its body left out ($36, $37: ``nodes``; NULL: it keeps its
            # own); each table's rows go in in cursor order (their keys' pages fill in turn).
            "r AS ("
            f"INSERT INTO {s}.records (tid, kind, id, chain, body, cursor, device) "
            "SELECT tt.tid, u.kind, u.id, ch.chain, u.body, cur.cursor, u.device "
            "FROM tt, unnest($3::smallint[], $4::bytea[], $5::bytea[], $6::bytea[], "
            "$32::bigint[], $36::integer[]) AS u (kind, id, session_id, body, n, device) "
            "JOIN cur USING (n) LEFT JOIN ch ON ch.session_key = u.session_id "
            "ORDER BY cur.cursor ON CONFLICT (tid, id, kind) DO NOTHING RETURNING 1), "
            # An event's body without its prev_hash ($34; NULL: none) where the row before it
            # keeps that as its row hash: a row of this statement ($35 NULL), or one found
            # stored with it ($35); else its body as it is ($11).
            "e AS ("
            f"INSERT INTO {s}.events (tid, id, chain, sequence_number, row_hash, body, "
            "cursor, device) SELECT tt.tid, u.id, ch.chain, u.sequence_number, u.row_hash, "
            "CASE WHEN u.apart IS NULL THEN u.body WHEN u.prev IS NULL THEN u.apart "
            f"WHEN (SELECT {_event_hash(s, 'p')} FROM {s}.events AS p WHERE p.chain = ch.chain "
            "AND p.sequence_number = u.sequence_number - 1 "
            "LIMIT 1) = u.prev THEN u.apart ELSE u.body END, "
            "cur.cursor, u.device FROM tt, unnest($7::bytea[], $8::bytea[], $9::bigint[], "
            "$10::bytea[], $11::bytea[], $33::bigint[], $34::bytea[], $35::bytea[], "
            "$37::integer[]) AS u (id, session_id, sequence_number, row_hash, body, n, apart, "
            "prev, device) JOIN cur USING (n) JOIN ch ON ch.session_key = u.session_id "
            "ORDER BY cur.cursor ON CONFLICT DO NOTHING RETURNING 1), "
            "x AS ("
            f"INSERT INTO {s}.sessions (tid, id, updated_at, body, ids_count) "
            "SELECT tt.tid, u.* FROM tt, unnest($12::bytea[], $13::text[], $14::bytea[], "
            "$26::integer[]) AS u "
            "ON CONFLICT (tid, id) DO UPDATE SET updated_at = excluded.updated_at, "
            "body = excluded.body, ids_count = excluded.ids_count RETURNING 1), "
            # The sessions' id blocks ($26: how many ids each session's hold, NULL for
            # none): those that changed written ($27 sessions, $28 parts, $29 ids), those
            # past a list dropped ($30 sessions, $31 from which part on); never the same
            # block in both (``session_row``), as the two see the table as it was before.
            f"bp AS (INSERT INTO {s}.session_ids (tid, id, part, ids) "
            "SELECT tt.tid, u.* FROM tt, unnest($27::bytea[], $28::integer[], $29::bytea[]) AS u "
            "ON CONFLICT (tid, id, part) DO UPDATE SET ids = excluded.ids), "
            f"bd AS (DELETE FROM {s}.session_ids AS b "
            "USING tt, unnest($30::bytea[], $31::integer[]) AS k (id, part) "
            "WHERE b.tid = tt.tid AND b.id = k.id AND b.part >= k.part), "
            "c AS ("
            f"INSERT INTO {s}.clients (org_id, user_id, client_id, last_seq) "
            "SELECT $1, $2, $15, $16::bigint WHERE $16::bigint IS NOT NULL "
            "ON CONFLICT (org_id, user_id, client_id) DO UPDATE SET last_seq = excluded.last_seq "
            "RETURNING 1), "
            # The audit chains' last places ($17 devices, $18 places, $19 row hashes, $20
            # ids; one a device, the batch's last: ``_audit_tails``), each made or moved on
            # to where the batch leaves it; of two rows at one place, which only a device of
            # protocol 2 or earlier leaves, the one of the greater id (since version 18).
            "p AS ("
            f"INSERT INTO {s}.audit_tails AS a (tid, client_id, sequence_number, row_hash, id) "
            "SELECT tt.tid, u.* FROM tt, unnest($17::text[], $18::bigint[], $19::bytea[], "
            "$20::bytea[]) AS u ON CONFLICT (tid, client_id) DO UPDATE SET "
            "sequence_number = excluded.sequence_number, row_hash = excluded.row_hash, "
            "id = excluded.id WHERE (excluded.sequence_number, excluded.id) > "
            "(a.sequence_number, a.id) RETURNING 1), "
            # The feed's entries ($21 kinds, $22 ids): the cursors, paired in increasing order
            # with the entries in their given order (WITH ORDINALITY). A session's is a row of
            # the feed; a record's and an event's is its own row, at the cursor it keeps
            # (since version 15: ``_page``).
            f"f AS (INSERT INTO {s}.feed (cursor, tid, kind, record_id) "
            "OVERRIDING SYSTEM VALUE "
            "SELECT cur.cursor, tt.tid, r.kind, r.record_id "
            "FROM tt, unnest($21::smallint[], $22::bytea[]) "
            "WITH ORDINALITY AS r (kind, record_id, n) JOIN cur USING (n) "
            f"WHERE r.kind = {_SESSION_KIND} RETURNING cursor), "
            # The entries the new ones supersede: the earlier entries of the sessions in $23
            # (this DELETE sees the feed as it was before the statement, so never the rows f
            # adds; see migration 6).
            f"d AS (DELETE FROM {s}.feed AS old USING tt, unnest($23::bytea[]) AS k (id) "
            f"WHERE old.tid = tt.tid AND old.kind = {_SESSION_KIND} "
            "AND old.record_id = k.id), "
            # The notice to the other server processes ($24: the schema, $25: this server's
            # id), delivered at COMMIT, in commit order, never if the transaction rolls back.
            "n AS (SELECT pg_notify('" + NOTIFY_CHANNEL + "', json_build_object("
            "'schema', $24::text, 'org', $1::text, 'user', $2::text, "
            "'from', min(cursor) - 1, 'to', max(cursor), 'server', $25::text)::text) "
            "FROM cur HAVING count(*) > 0) "
            "SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM e), "
            "(SELECT count(*) FROM x), (SELECT count(*) FROM c), (SELECT count(*) FROM p), "
            "(SELECT array_agg(cursor) FROM cur), (SELECT count(*) FROM n)"
        )
        # A session written twice by one batch: its earlier entries of the batch, by their
        # cursors ($3), which this push's own feed rows took in this transaction: a probe of
        # the feed's key (tenant, cursor) each (``LIMIT 1``: a generic plan of ``tid = ...
        # AND cursor = ANY(...)`` filtered the tenant's whole feed, since version 15).
        self.drop_cursors = (
            f"DELETE FROM {s}.feed WHERE ctid = ANY(ARRAY(SELECT f.ctid FROM "
            "unnest($3::bigint[]) AS x (cursor) CROSS JOIN LATERAL (SELECT ctid "
            f"FROM {s}.feed WHERE tid = {_tid(s)} AND cursor = x.cursor LIMIT 1) AS f))"
        )
        self.head = f"SELECT GREATEST({_max_cursor(s)}, {_floor(s)})"
        self.client_state = (
            "SELECT COALESCE((SELECT last_seq FROM "
            f"{s}.clients WHERE org_id = $1 AND user_id = $2 AND client_id = $3), 0), "
            f"GREATEST({_max_cursor(s)}, {_floor(s)})"
        )
        self.floor = f"SELECT feed_floor FROM {s}.meta WHERE org_id = $1 AND user_id = $2"
        # One statement, so the floor check and the page share one snapshot: a compaction
        # between two statements could otherwise drop entries this page would skip silently.
        # The LEFT JOIN yields one row (floor, NULL, NULL) when the page is empty. No outer
        # ORDER BY (it would add a Sort node): ``pull`` sorts the page it got, in O(n).
        # Each entry's body is read from the row it refers to, through that table's key. The
        # running size is summed in cursor order over the page (at most $4 entries); bodies
        # past the byte budget ($5) come back NULL (octet_length of a TOASTed value reads
        # only its header), so the page knows there is more. ``within``: inside the budget
        # (the first entry always is); a missing row reads as a NULL body within it.
        self.pull = (
            "SELECT fl.floor, f.cursor, CASE WHEN f.within THEN f.body END, f.within, "
            "f.ids_count, CASE WHEN f.within AND f.ids_count IS NOT NULL THEN ("
            f"{_session_ids(s, 'f.record_id', 'f.tid')}) END "
            "FROM (SELECT COALESCE(("
            f"SELECT feed_floor FROM {s}.meta WHERE org_id = $1 AND user_id = $2), 0) AS floor"
            ") AS fl LEFT JOIN LATERAL ("
            "SELECT cursor, tid, record_id, body, ids_count, (ROW_NUMBER() OVER w = 1 "
            "OR SUM(octet_length(body) + 16 * COALESCE(ids_count, 0)) OVER w <= $5) AS within "
            "FROM (SELECT p.cursor, p.tid, p.record_id, x.ids_count, CASE p.place "
            f"WHEN 0 THEN x.body "
            f"WHEN 2 THEN (SELECT {_whole_body(s, 'e', '$6', 'prev.row_hash')} "
            f"FROM {s}.events AS e {_node_of(s, 'e')} {_row_before(s, 'e')} "
            "WHERE e.ctid = p.row) "
            f"ELSE (SELECT {_whole_body(s, 'r', '$6')} FROM {s}.records AS r "
            f"{_node_of(s, 'r')} WHERE r.ctid = p.row) END AS body "
            f"FROM ({_page(s)}) AS p LEFT JOIN LATERAL (SELECT x.body, x.ids_count "
            f"FROM {s}.sessions AS x WHERE p.place = 0 AND x.tid = p.tid "
            "AND x.id = p.record_id LIMIT 1) AS x ON true OFFSET 0) AS page "
            "WINDOW w AS (ORDER BY cursor ROWS UNBOUNDED PRECEDING)) AS f ON true"
        )
        self.retain_cursor = (
            "SELECT cursor FROM ("
            + " UNION ALL ".join(
                f"(SELECT cursor FROM {s}.{table} WHERE tid = {_tid(s)}{kept} "
                "ORDER BY tid DESC, cursor DESC LIMIT $3 + 1)"
                for table, kept in _CURSOR_PLACES
            )
            + ") AS u ORDER BY cursor DESC LIMIT 1 OFFSET $3"
        )
        # Log compaction: only versions superseded by a later entry of the same record go
        # (only a session has more than one entry: migration 14).
        self.compact = (
            f"DELETE FROM {s}.feed AS f WHERE f.tid = {_tid(s)} AND f.kind = {_SESSION_KIND} "
            f"AND f.cursor <= $3 AND EXISTS (SELECT 1 FROM {s}.feed AS later "
            f"WHERE later.tid = f.tid AND later.kind = {_SESSION_KIND} "
            "AND later.record_id = f.record_id AND later.cursor > f.cursor)"
        )
        self.set_floor = (
            f"INSERT INTO {s}.meta (org_id, user_id, feed_floor) VALUES ($1, $2, $3) "
            "ON CONFLICT (org_id, user_id) DO UPDATE SET feed_floor = excluded.feed_floor"
        )
        # Deleting a session's content: the tenant's session rows, the records of the kinds
        # deleted with a session filed under its deleted ones, then the chosen records and
        # their feed entries (sessions_tenant, records_tenant, records' key, the feed's key:
        # the records go last, by the cursors they kept).
        self.tenant_sessions = (
            f"SELECT x.id, x.body, x.ids_count, o.ids FROM {s}.sessions AS x "
            f"CROSS JOIN LATERAL ({_session_ids(s, 'x.id', 'x.tid')}) AS o "
            f"WHERE x.tid = {_tid(s)}"
        )
        self.cascade_candidates = (
            f"SELECT r.kind, r.id, {_whole_body(s, 'r', '$5')} FROM {s}.records AS r "
            f"{_node_of(s, 'r')} WHERE r.tid = {_tid(s)} "
            f"AND r.chain = ANY(ARRAY(SELECT c.n FROM {s}.chains AS c WHERE c.tid = {_tid(s)} "
            "AND c.session_id = ANY($3::bytea[]))) AND r.kind = ANY($4::smallint[])"
        )
        # Each record a probe of the records' key (LIMIT 1: no join the planner may turn
        # into a walk along the tenant's records, as a generic plan of one did).
        doomed = (
            "unnest($3::smallint[], $4::bytea[]) AS k (kind, id) CROSS JOIN LATERAL ("
            f"SELECT r.ctid FROM {s}.records AS r WHERE r.tid = {_tid(s)} "
            "AND r.kind = k.kind AND r.id = k.id LIMIT 1) AS x"
        )
        # (A record is its own feed entry, at the cursor it keeps, since version 15: it leaves
        # the feed with its row.)
        self.delete_records = (
            f"DELETE FROM {s}.records WHERE ctid = ANY(ARRAY(SELECT x.ctid FROM {doomed}))"
        )
        self.lock_tenant = "SELECT pg_advisory_xact_lock($1)"
        # A device's stamp node's number (version 16), made the first time it is asked for;
        # an update of a node found keeps the statement one that always answers its row,
        # even beside another process adding it at once.
        self.add_node = (
            f"INSERT INTO {s}.nodes (node) VALUES ($1) "
            "ON CONFLICT (node) DO UPDATE SET node = excluded.node RETURNING n"
        )
        self.lock_tenant_last_seq = f"SELECT {s}.lock_tenant_last_seq($1, $2, $3, $4)"
        self.lock_last_seq_load = (
            f"SELECT * FROM {s}.lock_last_seq_load($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
        )
        # An optimistic push (``PostgresServerStore.push``): its read, on no lock and in no
        # transaction (one statement, one snapshot: ``load``'s rows and the device's
        # last_seq, ``what`` 7, $10 its id), and its write (``push_write``).
        self.push_read = (
            f"{self.load} UNION ALL SELECT 7, NULL, NULL, NULL, (SELECT c.last_seq FROM "
            f"{s}.clients AS c WHERE c.org_id = $1 AND c.user_id = $2 AND c.client_id = $10), "
            "NULL"
        )
        self.push_write_function = _push_write_function(s, self.write)
        self.push_write = (
            f"SELECT * FROM {s}.{self.push_write_function[0]}("
            + ", ".join(f"${n}" for n in range(1, 41))
            + ")"
        )
        # The store's own statistics of a young database (``ANALYZE_AT``).
        self.analyze = "ANALYZE " + ", ".join(f"{s}.{table}" for table in _ANALYZED_TABLES)


def _lookups(keys: BatchKeys) -> tuple[dict[bytes, str], tuple[list[Any], ...]]:
    """``_Sql.load``'s lookup arrays ($3 to $9) for ``keys``, and each key's id (to name what
    the rows found)."""
    kinds, ids = zip(*keys.records, strict=True) if keys.records else ((), ())
    named: dict[bytes, str] = {}

    def keyed(values: Collection[str]) -> list[bytes]:
        out = []
        for value in values:
            key = _pg_key(value)
            named[key] = value
            out.append(key)
        return out

    lookups = (
        [_KIND_NUMBERS[kind] for kind in kinds],
        keyed(ids),
        keyed(keys.events),
        keyed(keys.session_owners),
        keyed(keys.sessions),
        keyed(keys.chains),
        list(keys.audit_chains),  # device ids: kept as their text
    )
    return named, lookups


@dataclasses.dataclass(slots=True)
class _Known:
    """What one server process knows of a tenant's rows as they stood when its head cursor
    was ``head``: what its own pushes read and wrote. Exact as long as the head has not moved
    (every write to a tenant's rows moves it: ``PostgresServerStore.push``), which the write
    of a push served from it checks under the tenant's lock."""

    head: int
    last_seqs: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each device's ``last_seq``."""
    sessions: dict[str, tuple[bytes, int | None, bytes]] = dataclasses.field(default_factory=dict)
    """Each session row: its stored body, the count of ids its blocks hold (None: they are
    in the body) and those ids (16 bytes each; ``b""``: none)."""
    chain_tails: dict[str, tuple[int, str] | None] = dataclasses.field(default_factory=dict)
    """Each session's last canonical event ``(sequence_number, row_hash)``; None: it has none."""
    audit_tails: dict[str, tuple[int, str] | None] = dataclasses.field(default_factory=dict)
    """Each device's last audit row ``(sequence_number, row_hash)``; None: none."""

    def size(self) -> int:
        """About the bytes it holds (what ``known_bytes`` bounds)."""
        rows = sum(len(body) + len(ids) + 64 for body, _, ids in self.sessions.values())
        tails = len(self.chain_tails) + len(self.audit_tails) + len(self.last_seqs)
        return 256 + rows + 96 * tails


class _Stale(Exception):
    """An optimistic push met a tenant changed since its read, or writes that need the lock
    held across statements (a delete's cascade, a session written twice): it runs again,
    locked (``PostgresServerStore.push``)."""


class _PostgresTx:
    """``BatchTx`` over one pool connection, inside the push's transaction (or, optimistic,
    in none: ``read_optimistic``).

    Every method is one round trip per table it touches, whatever the size of the batch: the
    keys and rows travel as arrays.
    """

    def __init__(
        self,
        conn: Any,
        sql: _Sql,
        schema: str,
        server_id: str,
        expected: tuple[int, BatchKeys] | None = None,
        layout: IdLayout = ID_LAYOUT,
        device: tuple[bytes, int] | None = None,
    ) -> None:
        self._conn = conn
        self._device: tuple[bytes, int | None] = device or (b"", None)
        """The pushing device's stamp node and its number in ``nodes`` (``_device_of``),
        which the bodies of its own records leave out and their rows name (version 16);
        ``b""``: none (its bodies keep theirs)."""
        self._sql = sql
        self._layout = layout
        self._held_ids: dict[str, bytes] = {}
        """The ids in the blocks of each session read in this transaction (``b""``: none)."""
        self._read_rows: dict[str, tuple[bytes, int | None, bytes]] = {}
        """Each session row read: its stored body, its count of ids in blocks, those ids."""
        self._schema = schema
        self._server_id = server_id
        """Named in the notice of new cursors (``_Sql.write``): this server process."""
        self._head: int | None = None
        """The tenant's head cursor as ``load`` read it, or as the feed rows ``write`` added
        left it (the tenant lock keeps every other writer out meanwhile); None: read it."""
        self._unlocked: Tenant | None = None
        """A tenant whose lock was asked for and not yet taken: the next call takes it first
        (``get_last_seq`` in the same round trip as its read)."""
        self._expected = expected
        """The device's ``last_seq`` the push expects (the number before its first) and the
        ``batch_keys`` after it: the lock, the read of ``last_seq`` and these lookups go in
        one round trip (``lock_last_seq_load``). When ``last_seq`` is another (a resend after
        a lost ack, a gap), the rows read are dropped and ``load`` reads the right ones."""
        self._loaded: tuple[BatchKeys, Snapshot] | None = None
        """The expected keys and what they read, once ``last_seq`` proved the expected one."""
        self._optimistic: tuple[int, int, int] | None = None
        """An optimistic push's tenant lock key, and the device's ``last_seq`` and the tenant's
        head it read (``read_optimistic``): no lock is taken before its write, which checks
        the two under the lock and writes only if neither moved (``_Sql.push_write``)."""
        self.between: Callable[[], Awaitable[None]] | None = None
        """Awaited between an optimistic push's read and its write (the tests push there)."""
        self._from_known = False
        """Whether an optimistic push's rows came from what the process knew (``read_known``),
        not from a read."""
        self._base: _Known | None = None
        """What the push's rows were read from or found as (``read_known``,
        ``read_optimistic``), for ``known_after``."""
        self.known_after: _Known | None = None
        """What the process knows of the tenant once an optimistic push's write committed:
        ``_base`` with the push's own writes (``write``)."""

    def read_known(self, tenant: Tenant, client_id: str, known: _Known) -> bool:
        """The expected keys' rows from ``known``, with no statement at all: True when it holds
        every row they ask about and the device's ``last_seq`` is the expected one. A record's
        or an event's id is taken to be new (the write refuses one that is not: it raises,
        and the push then reads, ``write``), a session's owner to be the tenant when its row
        is known. The write checks the head and ``last_seq`` under the lock, as after a read."""
        assert self._expected is not None
        expected, keys = self._expected
        if known.last_seqs.get(client_id) != expected:
            return False
        sessions = known.sessions
        if not (
            keys.sessions <= sessions.keys()
            and keys.session_owners <= sessions.keys()
            and keys.chains <= known.chain_tails.keys()
            and keys.audit_chains <= known.audit_tails.keys()
        ):
            return False
        found = Snapshot()
        for session_id in keys.session_owners:
            found.session_owners[session_id] = tenant
        for session_id in keys.sessions:
            body, count, ids = sessions[session_id]
            found.sessions[session_id] = stored_session(
                session_id, body, count, ids if count is not None else None
            )
            self._held_ids[session_id] = ids
        for session_id in keys.chains:
            if (tail := known.chain_tails[session_id]) is not None:
                found.chain_tails[session_id] = tail
        for device in keys.audit_chains:
            if (tail := known.audit_tails[device]) is not None:
                found.audit_tails[device] = tail
        self._head = known.head
        self._loaded = (keys, found)
        self._optimistic = (tenant_lock_key(self._schema, tenant), expected, known.head)
        self._from_known, self._base = True, known
        return True

    async def read_optimistic(
        self, tenant: Tenant, client_id: str, kept: _Known | None = None
    ) -> bool:
        """Read the device's ``last_seq``, the tenant's head and the expected keys' rows in one
        statement, in no transaction and under no lock (``_Sql.push_read``). True when
        ``last_seq`` is the one the push expects: the push then goes on from these rows and
        writes in one statement that commits on its own (``write``); else (a resend, a gap)
        it is to run locked."""
        assert self._expected is not None
        expected, keys = self._expected
        named, lookups = _lookups(keys)
        t = (tenant.org_id, tenant.user_id)
        rows = await self._conn.fetch(self._sql.push_read, *t, *lookups, client_id)
        seq = next((r[4] for r in rows if r[0] == 7), None)
        if (int(seq) if seq is not None else 0) != expected:
            return False
        found = self._snapshot(tenant, [r for r in rows if r[0] != 7], named, keys.sessions)
        assert self._head is not None  # (``what`` 6: always one row)
        self._loaded = (keys, found)
        self._optimistic = (tenant_lock_key(self._schema, tenant), expected, self._head)
        # What the read found, and what it found absent, as it stood at the head it read, over
        # what the process ``kept`` of the tenant when that was at the same head (both exact
        # there: the other devices' rows stay known, so that two devices of a tenant pushing
        # in turn are each served from what is known).
        prior = kept if kept is not None and kept.head == self._head else _Known(self._head)
        self._base = _Known(
            head=self._head,
            last_seqs={**prior.last_seqs, client_id: expected},
            sessions={**prior.sessions, **self._read_rows},
            chain_tails={**prior.chain_tails, **{c: found.chain_tails.get(c) for c in keys.chains}},
            audit_tails={
                **prior.audit_tails,
                **{a: found.audit_tails.get(a) for a in keys.audit_chains},
            },
        )
        return True

    def keys_read(self, last_seq: int) -> BatchKeys | None:
        # The lookups of the expected keys were read with the lock (``get_last_seq``) when
        # last_seq is the one expected; else they take a round trip of their own (``load``).
        return self._loaded[0] if self._loaded is not None else None

    async def lock_tenant(self, tenant: Tenant) -> None:
        # Held until COMMIT / ROLLBACK; see "Cursor visibility" in the module docstring. A
        # push asks for its device's last_seq next, which takes the lock with it. (An
        # optimistic push takes it in its write.)
        if self._optimistic is not None:
            return
        await self._take_lock()
        self._unlocked = tenant

    async def _take_lock(self) -> None:
        tenant, self._unlocked = self._unlocked, None
        if tenant is not None:
            await self._conn.execute(self._sql.lock_tenant, tenant_lock_key(self._schema, tenant))

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        if self._optimistic is not None:
            return self._optimistic[1]
        t = (tenant.org_id, tenant.user_id, client_id)
        if self._unlocked == tenant:
            self._unlocked = None
            key = tenant_lock_key(self._schema, tenant)
            if self._expected is not None:
                expected, keys = self._expected
                named, lookups = _lookups(keys)
                if any(lookups):
                    rows = await self._conn.fetch(self._sql.lock_last_seq_load, key, *t, *lookups)
                    seq = next((r[4] for r in rows if r[0] == 7), None)
                    last_seq = int(seq) if seq is not None else 0
                    if last_seq == expected:
                        found = self._snapshot(
                            tenant, [r for r in rows if r[0] != 7], named, keys.sessions
                        )
                        self._loaded = (keys, found)
                    return last_seq
            value = await self._conn.fetchval(self._sql.lock_tenant_last_seq, key, *t)
        else:
            await self._take_lock()
            value = await self._conn.fetchval(self._sql.get_last_seq, *t)
        return int(value) if value is not None else 0

    async def load(self, tenant: Tenant, keys: BatchKeys) -> Snapshot:
        """Every lookup of the batch in one round trip (``_Sql.load``); none when they were read
        with the lock (``get_last_seq``)."""
        if self._loaded is not None and keys is self._loaded[0]:
            return self._loaded[1]
        if self._optimistic is not None:
            raise _Stale  # (not the keys read: never, as apply_push asks)
        await self._take_lock()
        named, lookups = _lookups(keys)
        if not any(lookups):
            return Snapshot()
        rows = await self._conn.fetch(self._sql.load, tenant.org_id, tenant.user_id, *lookups)
        return self._snapshot(tenant, rows, named, keys.sessions)

    def _snapshot(
        self, tenant: Tenant, rows: list[Any], named: dict[bytes, str], sessions: Collection[str]
    ) -> Snapshot:
        """What the rows of ``_Sql.load`` found (``named``: each key's id; ``sessions``: the
        ids of the sessions read); the tenant's head (``what`` 6) is kept for
        ``head_cursor``, the ids in each session's blocks (``what`` 8) for ``write``."""
        found = Snapshot()
        bodies: dict[str, tuple[bytes, int | None]] = {}
        blocks: dict[str, bytes] = {}
        for what, kind, key, body, number, row_hash in rows:
            if what == 5:
                # (a device id, as its UTF-8: the column holds the other lookups' keys)
                found.audit_tails[bytes(key).decode()] = (int(number), _pg_hash_text(row_hash))
                continue
            if what == 6:
                self._head = int(number)
                continue
            record_id = named[bytes(key)]
            if what == 0:  # (a lookup reads the tenant's own rows only: it is the owner)
                found.record_owners[(KINDS[kind], record_id)] = tenant
            elif what == 1:
                found.event_owners[record_id] = tenant
            elif what == 2:
                found.session_owners[record_id] = tenant
            elif what == 3:
                bodies[record_id] = (body, None if number is None else int(number))
            elif what == 8:
                blocks[record_id] = bytes(body)
            else:
                found.chain_tails[record_id] = (int(number), _pg_hash_text(row_hash))
        for session_id, (body, count) in bodies.items():
            ids = blocks.get(session_id)
            found.sessions[session_id] = stored_session(session_id, body, count, ids)
            self._read_rows[session_id] = (bytes(body), count, ids or b"")
        for session_id in sessions:
            self._held_ids[session_id] = blocks.get(session_id, b"")
        return found

    async def write(self, tenant: Tenant, client_id: str, writes: BatchWrites) -> list[int]:
        """The batch's rows in ONE round trip (``_Sql.write``): records, events, sessions, the
        device's ``last_seq``, the feed rows (and the entries they supersede) and the notice
        to the other server processes; then, rarely, a second: a session written twice by
        the batch (an older device's push) keeps its last entry only; then (after a delete)
        the content the delete drains."""
        await self._take_lock()
        conn, sql = self._conn, self._sql
        # (Every record, event and session of a push is the tenant's: apply_push refused any
        # other. The statement files them all under the tenant's number.)
        records: list[list[Any]] = [[], [], [], []]
        devices: list[int | None] = []
        tenant_bytes = packed_tenant(tenant)
        node, node_number = self._device
        for r in writes.records:
            info = kind_of(r)
            if info.merge == "versioned" or info.server_placed:
                raise TypeError(f"{info.name} records are not written as records")
            session_id = info.session_of(r)
            key = _pg_key(r.id)
            session_key = None if session_id is None else _pg_key(session_id)
            stored = short_body(writes.bodies.of(r), key, session_key, tenant_bytes, node)
            row = (_KIND_NUMBERS[info.name], key, session_key, stored)
            for column, value in zip(records, row, strict=True):
                column.append(value)
            devices.append(_node_named(stored, node_number))
        events, sessions, feed = writes.events, writes.sessions, writes.feed
        places = _audit_tails(writes.records)
        versioned = [i for i, r in enumerate(feed) if kind_of(r).merge == "versioned"]
        # The number of each record's and event's entry among the feed rows (from 1).
        record_entries, event_entries = writes.entries()
        laid = [
            session_row(writes.bodies.of(x), self._held_ids.pop(x.id, None), self._layout)
            for x in sessions
        ]
        # The blocks to write (sessions, parts, ids) and to drop (sessions, from which part).
        blocks: tuple[list[bytes], list[int], list[bytes]] = ([], [], [])
        drops: tuple[list[bytes], list[int]] = ([], [])
        for x, lay in zip(sessions, laid, strict=True):
            for part, ids in lay.puts:
                blocks[0].append(_pg_key(x.id))
                blocks[1].append(part)
                blocks[2].append(ids)
            if lay.drop_from is not None:
                drops[0].append(_pg_key(x.id))
                drops[1].append(lay.drop_from)
        cursors: list[int] = []
        event_columns, apart, event_nodes = _event_columns(
            events, writes, tenant_bytes, self._device
        )
        if records[0] or events or sessions or feed or writes.last_seq is not None:
            checked: tuple[int, int, int] | tuple[()] = ()
            statement = sql.write
            if self._optimistic is not None:
                if writes.deleted_sessions or len({feed[i].id for i in versioned}) < len(versioned):
                    raise _Stale  # (the cascade, and dropping a superseded entry: locked)
                if self.between is not None:
                    await self.between()
                checked, statement = self._optimistic, sql.push_write
            taken = await _fetch_write(
                conn,
                self._from_known,
                statement,
                tenant.org_id,
                tenant.user_id,
                *records,
                *event_columns,
                [_pg_key(x.id) for x in sessions],
                [x.updated_at for x in sessions],
                [lay.body for lay in laid],
                client_id,
                writes.last_seq,
                *places,
                [_KIND_NUMBERS[record_kind(r)] for r in feed],
                [_pg_key(r.id) for r in feed],
                [_pg_key(feed[i].id) for i in versioned],
                self._schema,
                self._server_id,
                [lay.ids_count for lay in laid],
                *blocks,
                *drops,
                [i + 1 for i in record_entries],
                [i + 1 for i in event_entries],
                *apart,
                devices,
                event_nodes,
                *checked,
            )
            if taken is None:
                raise _Stale  # (optimistic: the tenant or the device moved since the read)
            if self._base is not None and self._optimistic is not None:
                expected = self._optimistic[1]
                self.known_after = _known_after(
                    self._base, client_id, expected, writes, laid, taken[5]
                )
            if taken[0] != len(writes.records):
                raise claimed_concurrently("a record id")
            if taken[1] != len(events):
                raise claimed_concurrently("an event id")
            # The n-th smallest cursor went to the n-th feed row (see _Sql.write).
            cursors = sorted(int(c) for c in taken[5] or ())
        if cursors:
            last = {feed[i].id: i for i in versioned}
            earlier = [cursors[i] for i in versioned if last[feed[i].id] != i]
            if earlier:
                await conn.execute(sql.drop_cursors, tenant.org_id, tenant.user_id, earlier)
            # New cursors are above every cursor the tenant had (one sequence), so the last
            # is the head; a delete below may take feed rows away again: read it then.
            self._head = cursors[-1]
        if writes.deleted_sessions:
            self._head = None
            await self._delete_content(tenant)
        return cursors

    async def head_cursor(self, tenant: Tenant) -> int:
        await self._take_lock()
        if self._head is None:
            self._head = await _head(self._conn, self._sql, tenant)
        return self._head

    async def _delete_content(self, tenant: Tenant) -> None:
        """Delete the content of the tenant's deleted sessions (``BatchTx.write``)."""
        conn, sql, t = self._conn, self._sql, (tenant.org_id, tenant.user_id)
        rows = await conn.fetch(sql.tenant_sessions, *t)
        sessions = [
            stored_session(_pg_id(key), body, count, None if ids is None else bytes(ids))
            for key, body, count, ids in rows
        ]
        deleted = [_pg_key(x.id) for x in sessions if x.deleted]
        cascade = [_KIND_NUMBERS[kind] for kind in CASCADE_KINDS]
        rows = await conn.fetch(sql.cascade_candidates, *t, deleted, cascade, packed_tenant(tenant))
        candidates = [decode_stored(KINDS[kind], _pg_id(key), body) for kind, key, body in rows]
        doomed = content_to_delete(sessions, candidates)
        if doomed:
            kinds = [_KIND_NUMBERS[kind] for kind, _ in doomed]
            ids = [_pg_key(record_id) for _, record_id in doomed]
            await conn.execute(sql.delete_records, *t, kinds, ids)


def _event_columns(
    events: Sequence[Event], writes: BatchWrites, tenant: bytes, device: tuple[bytes, int | None]
) -> tuple[tuple[list[Any], ...], tuple[list[bytes | None], list[bytes | None]], list[Any]]:
    """``_Sql.write``'s event columns ($7 to $11: keys, sequence numbers, row hashes as the
    column keeps them, None for one the body ends with, bodies as ``compact.short_body``
    keeps them), and ($34, $35) each body without its prev_hash too (``compact.prev_apart``;
    None: it keeps it) and that prev_hash, which the row before it must keep as its row hash,
    None where that row is the event before it in this batch (written by the same
    statement); and ($37) the number of
    the pushing device's stamp node (``device``) for each body that left it out, which its
    row names then (``_node_named``)."""
    node, number = device
    ids, sessions = [_pg_key(e.id) for e in events], [_pg_key(e.session_id) for e in events]
    bodies: list[Any] = []
    apart: list[bytes | None] = []
    prevs: list[bytes | None] = []
    last: dict[str, tuple[int, str]] = {}  # each session's last event of the batch so far
    for e, key, session_key in zip(events, ids, sessions, strict=True):
        stored = short_body(writes.bodies.of(e), key, session_key, tenant, node)
        prev = digest_bytes(e.prev_hash)
        kept = None if prev is None else prev_apart(stored, prev)
        bodies.append(stored)
        apart.append(None if kept is stored else kept)
        before = last.get(e.session_id) == (e.sequence_number - 1, e.prev_hash)
        prevs.append(None if before else prev)
        last[e.session_id] = (e.sequence_number, e.row_hash)
    # A row hash the body ends with is read from there (version 16: ``_event_hash``).
    hashes = [_pg_hash(e.row_hash) for e in events]
    held = [None if chain_digest(b) == h else h for b, h in zip(bodies, hashes, strict=True)]
    columns = (ids, sessions, [e.sequence_number for e in events], held, bodies)
    return columns, (apart, prevs), [_node_named(b, number) for b in bodies]


async def _fetch_write(conn: Any, known: bool, statement: str, *args: Any) -> Any:
    """The row of ``_Sql.write`` or ``_Sql.push_write`` (None: ``push_write`` found the push
    stale); the latter's refusals of an id found taken as the locked write's
    (``claimed_concurrently``), or, for a push whose rows came from what the process knew
    (``known``), as stale: it took the id for new, and runs again from a read."""
    try:
        return await conn.fetchrow(statement, *args)
    except asyncpg.PostgresError as exc:
        code = getattr(exc, "sqlstate", None)
        if known and code in (CLAIMED_RECORD, CLAIMED_EVENT):
            raise _Stale from exc
        if code == CLAIMED_RECORD:
            raise claimed_concurrently("a record id") from exc
        if code == CLAIMED_EVENT:
            raise claimed_concurrently("an event id") from exc
        raise


def _known_after(
    base: _Known,
    client_id: str,
    expected: int,
    writes: BatchWrites,
    laid: list[SessionRow],
    cursors: Sequence[int] | None,
) -> _Known:
    """``base`` (the tenant's rows a push read or knew, at its head) with the push's writes,
    at the head they left: the rows as they stand once its write committed, since the write
    found the head unmoved under the lock (``expected``: the device's ``last_seq`` it checked,
    which stays when the push moved it not). Pure."""
    last_seqs = dict(base.last_seqs)
    last_seqs[client_id] = writes.last_seq if writes.last_seq is not None else expected
    sessions = dict(base.sessions)
    for x, lay in zip(writes.sessions, laid, strict=True):
        sessions[x.id] = (lay.body, lay.ids_count, lay.held)
    # (A chain is followed only where its tail was known before: a session or a device the
    # push wrote to without reading its tail, as a fork's new log, is left to a later read.)
    chain_tails = dict(base.chain_tails)
    for e in writes.events:
        if e.session_id in chain_tails:
            tail = chain_tails[e.session_id]
            if tail is None or e.sequence_number > tail[0]:
                chain_tails[e.session_id] = (e.sequence_number, e.row_hash)
    audit_tails = dict(base.audit_tails)
    for r in writes.records:
        if isinstance(r, AuditRow) and r.client_id in audit_tails:
            tail = audit_tails[r.client_id]
            if tail is None or r.sequence_number > tail[0]:
                audit_tails[r.client_id] = (r.sequence_number, r.row_hash)
    head = max(cursors) if cursors else base.head
    return _Known(head, last_seqs, sessions, chain_tails, audit_tails)


async def _keep_session(conn: Any) -> None:
    """The pool's reset of a connection given back (asyncpg rolls back an open transaction
    before it calls this): nothing more. Its default reset is a round trip per release (4-5%
    of a push) that unlistens, closes cursors, resets settings and releases session advisory
    locks, none of which the store's connections take outside ``open``, which resets its own."""


def _row_count(status: str) -> int:
    """The row count of a command status such as ``INSERT 0 5``."""
    return int(status.rsplit(" ", 1)[-1])


async def _head(conn: Any, sql: _Sql, tenant: Tenant) -> int:
    return int(await conn.fetchval(sql.head, tenant.org_id, tenant.user_id))


async def _compact(conn: Any, sql: _Sql, tenant: Tenant, keep_after_cursor: int) -> int:
    """Drop feed entries at or below ``keep_after_cursor``, raising the floor; under the lock."""
    floor_value = await conn.fetchval(sql.floor, tenant.org_id, tenant.user_id)
    floor = int(floor_value) if floor_value is not None else 0
    new_floor = min(keep_after_cursor, await _head(conn, sql, tenant))
    if new_floor <= floor:
        return 0
    status: str = await conn.execute(sql.compact, tenant.org_id, tenant.user_id, new_floor)
    await conn.execute(sql.set_floor, tenant.org_id, tenant.user_id, new_floor)
    return _row_count(status)  # "DELETE <n>"


ANALYZE_AT: Final = (1_000, 10_000)
"""Feed cursors at which the store analyzes its tables itself, once each in a process that
sees the feed pass them (``analyze_due``).

PostgreSQL keeps a statement's plan per connection: after five runs it may keep a generic
plan, costed on the tables as they were then. On a new database they are empty, and that plan
reads them whole (a lookup by key as a scan of ``records``, the tenant's head as a scan and
sort of ``feed``); it stays until the tables are analyzed, which autovacuum does about a
minute later. Measured before this: one device's pushes of nine changes, on a new schema, went
from 4 ms to 20 ms over their first 2,400, each reading ``records`` nine times. ``ANALYZE``
invalidates the plans of every connection, and the next ones use the indexes; from a thousand
rows on, larger tables only make them more so."""


def analyze_due(seen_from: int, head: int, done: Collection[int]) -> list[int]:
    """The ``ANALYZE_AT`` cursors a push that took the feed to ``head`` passed, in a process
    that first saw the feed at ``seen_from`` (it passed none of those before it), that were
    not ``done`` already."""
    return [at for at in ANALYZE_AT if seen_from < at <= head and at not in done]


class PostgresServerStore(AsyncResource):
    """The PostgreSQL server store. Use as ``async with``.

    - ``dsn``: a ``postgresql://`` URL (libpq keywords in its query string work too).
    - ``schema`` (``pleach``): the schema holding the tables; created by ``open()``.
    - ``pool_min`` / ``pool_max`` (1 / 10): pool bounds per process. A push holds one
      connection for its transaction; pulls and lookups hold one for one statement.
    - ``statement_timeout_ms`` (5000): the server cancels a statement (a wait on a tenant's
      lock included) after this long; the push fails with 3009 and is retried by the device.
    - ``feed_retention`` (None: keep everything): keep at most that many of a tenant's newest
      feed entries; older ones are compacted by each push in its own transaction.
    - ``max_pull_limit`` (1000): the largest page a pull returns.
    - ``application_name`` (``pleach-<random>``): shows in ``pg_stat_activity``.
    - ``connect_timeout`` / ``acquire_timeout`` (5 s / 10 s): connecting to the server and
      waiting for a free pool connection; beyond them the call fails with 3009.
    - ``idle_in_transaction_timeout_ms`` (60000): the server ends a session that sits in an
      open transaction this long (a hung process must not hold a tenant's lock forever).
    - ``known_bytes`` (16 MiB): what the process keeps of tenants' rows from its own pushes
      (their sessions, chain tails and devices' ``last_seq``), so that a tenant's next push
      skips its read when nothing of the tenant moved meanwhile (``push``); 0 keeps nothing.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        pool_min: int = 1,
        pool_max: int = DEFAULT_POOL_MAX,
        statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
        feed_retention: int | None = None,
        max_pull_limit: int = DEFAULT_MAX_PULL_LIMIT,
        application_name: str | None = None,
        connect_timeout: float = 5.0,
        acquire_timeout: float = 10.0,
        idle_in_transaction_timeout_ms: int = 60_000,
        known_bytes: int = DEFAULT_KNOWN_BYTES,
    ) -> None:
        if feed_retention is not None and feed_retention < 1:
            raise ValueError("feed_retention must be at least 1 (or None to keep everything)")
        if max_pull_limit < 1:
            raise ValueError("max_pull_limit must be at least 1")
        if not 0 <= pool_min <= pool_max or pool_max < 1:
            raise ValueError(
                f"need 0 <= pool_min <= pool_max and pool_max >= 1, got {pool_min}, {pool_max}"
            )
        if statement_timeout_ms < 0 or idle_in_transaction_timeout_ms < 0:
            raise ValueError("timeouts must be >= 0 (0 disables them)")
        if known_bytes < 0:
            raise ValueError("known_bytes must be >= 0 (0 keeps nothing)")
        self.dsn = dsn
        self.schema = _check_schema(schema)
        self.pool_min = pool_min
        self.pool_max = pool_max
        self.statement_timeout_ms = statement_timeout_ms
        self.feed_retention = feed_retention
        self.max_pull_limit = max_pull_limit
        self.application_name = application_name or f"pleach-{uuid7()[-12:]}"
        self.connect_timeout = connect_timeout
        self.acquire_timeout = acquire_timeout
        self.idle_in_transaction_timeout_ms = idle_in_transaction_timeout_ms
        self.migrated: MigrateResult | None = None
        self._sql = _Sql(self.schema)
        self._id_layout = ID_LAYOUT  # (where sessions keep their message ids: ``IdLayout``)
        self._pool: Any = None
        self._seen_from: int | None = None  # the feed's head at this process's first push
        self._analyzed: set[int] = set()  # the ``ANALYZE_AT`` cursors done
        self._analyzing: asyncio.Task[None] | None = None
        self.known_bytes = known_bytes
        self._known: dict[Tenant, _Known] = {}
        """What this process knows of each tenant's rows (``_Known``), least recently used
        first (a dict keeps its order of insertion: ``_remember`` puts a tenant last)."""
        self._known_sizes: dict[Tenant, int] = {}
        self._known_total = 0
        self._nodes: dict[bytes, int] = {}
        """The numbers ``nodes`` keeps the stamp nodes of the devices seen lately under
        (``_device_of``; a node's row is never deleted, so a number stays right)."""
        self.optimistic = type(self)._wrap_tx is PostgresServerStore._wrap_tx
        """Push optimistically (``push``); a store whose ``_wrap_tx`` is hooked does not."""
        self.pushes: collections.Counter[str] = collections.Counter()
        """Pushes by how they ran: ``known`` (one write that commits on its own, its rows
        those the process knew), ``optimistic`` (a read, then that write); locked, as
        ``stale`` (tried so, the tenant moved between the two, or the batch needs the lock: a
        delete, a session written twice), ``resent`` (the device's ``last_seq`` was not the
        expected one) or ``locked`` (not tried so: a hooked ``_wrap_tx``,
        ``feed_retention``). Beside them, ``known_stale`` counts the tries from what was known
        that ran again from a read (not a push of its own)."""

    def __repr__(self) -> str:
        state = "open" if self._pool is not None else "closed"
        return f"<PostgresServerStore {redact_dsn(self.dsn)} schema={self.schema} {state}>"

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the pool and migrate the schema; call once before anything else.

        Raises ``StorageUnavailable`` when the database cannot be reached (nothing is left
        open then) and ``StorageError`` when its schema is newer than this build.
        """
        if self._pool is not None:
            raise InvalidState("store is already open")
        where = f"cannot open PostgreSQL at {redact_dsn(self.dsn)}"
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=self.pool_min,
                max_size=self.pool_max,
                timeout=self.connect_timeout,
                server_settings={
                    "application_name": self.application_name,
                    "statement_timeout": str(self.statement_timeout_ms),
                    "idle_in_transaction_session_timeout": str(self.idle_in_transaction_timeout_ms),
                },
                reset=_keep_session,
            )
            async with self._pool.acquire(timeout=self.acquire_timeout) as conn:
                self.migrated = await _migrate_conn(conn, self.schema)
                # The one use of session state (the migration's advisory lock), undone.
                await conn.reset()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, _DATABASE_ERRORS):
                raise _translate(exc, where) from exc
            raise

    async def close(self) -> None:
        """Close the pool; idempotent, and finishes even if the caller is cancelled.

        Waits up to ``acquire_timeout`` for in-flight calls to give their connections back,
        then terminates whatever is left.
        """
        pool, self._pool = self._pool, None
        analyzing, self._analyzing = self._analyzing, None
        if analyzing is not None:
            analyzing.cancel()
            await asyncio.gather(analyzing, return_exceptions=True)
        if pool is not None:
            await asyncio.shield(self._close_pool(pool))

    async def _close_pool(self, pool: Any) -> None:
        try:
            async with asyncio.timeout(self.acquire_timeout):
                await pool.close()
        except _CLOSE_ERRORS as exc:
            log.warning("closing the pool of %r failed (%s); terminating it", self, exc)
            pool.terminate()

    def _require(self) -> Any:
        if self._pool is None:
            raise InvalidState("store is not open: use `async with` or call open() first")
        return self._pool

    # -- transactions ------------------------------------------------------------------------

    def _wrap_tx(self, tx: StoreTx) -> StoreTx:
        """Hook: wraps the ``StoreTx`` view a push's rules run against (tests inject faults).
        Only a locked push runs through it: a store that overrides it pushes locked only."""
        return tx

    async def _between_read_and_write(self) -> None:
        """Hook: awaited between an optimistic push's read and its write (tests push there)."""

    def _remember(self, tenant: Tenant, known: _Known | None) -> None:
        """Keep what an optimistic push left known of ``tenant`` (``_Known``), unless what is
        kept is of a later head already (pushes of one tenant answer in any order), within
        ``known_bytes`` (the least recently used tenants go first)."""
        if known is None:
            return
        kept = self._known.get(tenant)
        if kept is not None and kept.head > known.head:
            return
        self._forget(tenant)
        size = known.size()
        if size > self.known_bytes // 8:
            return  # (one tenant never takes more than an eighth)
        self._known[tenant] = known
        self._known_sizes[tenant] = size
        self._known_total += size
        while self._known_total > self.known_bytes:
            oldest = next(iter(self._known))
            self._forget(oldest)

    def _forget(self, tenant: Tenant) -> None:
        if self._known.pop(tenant, None) is not None:
            self._known_total -= self._known_sizes.pop(tenant)

    async def _run(
        self, doing: str, body: Callable[[Any], Awaitable[T]], *, transaction: bool
    ) -> T:
        """Run ``body`` on a pool connection; database failures become ``StorageUnavailable``.

        With ``transaction``, ``body`` runs in one READ COMMITTED transaction, committed when
        it returns and rolled back when it raises; the error ``body`` raised is the one that
        propagates (a cancellation stays a cancellation) even if the rollback fails too.

        A pooled connection may have died while idle (the server restarted, an admin
        terminated it) without the pool noticing yet. Such a connection is terminated, never
        reused, and the call is retried ONCE on a fresh connection, but only when nothing can
        have been written: a read, or a transaction that failed at BEGIN. A failure later in
        a transaction is never retried here: the device retries the push, idempotently. (An
        optimistic push runs in no transaction and is retried like a read: had its write
        committed before the connection broke, the rerun finds the device's ``last_seq``
        moved and answers its changes as duplicates, as the device's own resend would.)
        """
        retried = False
        while True:
            pool = self._require()
            try:
                async with pool.acquire(timeout=self.acquire_timeout) as conn:
                    began = False
                    try:
                        if not transaction:
                            return await body(conn)
                        tx = conn.transaction()
                        await tx.start()
                        began = True
                        try:
                            result = await body(conn)
                        except BaseException:
                            await asyncio.shield(_rollback(conn, tx))
                            raise
                        await tx.commit()
                        return result
                    except _BROKEN as exc:
                        _discard(conn)
                        if retried or (transaction and began):
                            raise
                        retried = True
                        log.info("%s: stale pool connection (%s); retrying once", doing, exc)
            except _DATABASE_ERRORS as exc:
                raise _translate(exc, doing) from exc

    # -- ServerStore -------------------------------------------------------------------------

    async def healthy(self) -> bool:
        if self._pool is None:
            return False
        try:
            await self._run(
                "health check", lambda conn: conn.fetchval("SELECT 1"), transaction=False
            )
        except (StorageUnavailable, InvalidState):
            return False
        return True

    async def client_state(self, tenant: Tenant, client_id: str) -> tuple[int, int]:
        row = await self._run(
            "cannot read client state",
            lambda conn: conn.fetchrow(
                self._sql.client_state, tenant.org_id, tenant.user_id, client_id
            ),
            transaction=False,
        )
        return int(row[0]), int(row[1])

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
        """Apply one push batch (``apply_push``) in one round trip or two when it can, four
        when not.

        **Known** (one): the tenant's rows as this process's own pushes last read and wrote
        them (``_Known``, bounded by ``known_bytes``), when they cover the batch's keys and
        the device's ``last_seq`` is the expected one: the rules run on them, a record's or
        an event's id taken for new, and the write below checks under the lock that the
        head and ``last_seq`` are those known (so the rows known are the rows there). An id
        that is not new, a failed check or nothing to write: the push runs again, optimistic.

        **Optimistic** (two): one statement reads the device's ``last_seq``, the tenant's head
        cursor and every lookup of the batch, in no transaction and under no lock; the rules
        run on those rows; one more statement (``push_write``) takes the tenant lock, checks
        that ``last_seq`` and the head are still those read, and writes, committing on its
        own. Every write to a tenant's rows adds a feed entry above its head, and no write
        takes the head's entry away without adding a higher one (a compaction keeps a
        session's last entry; a delete's cascade runs beside its tombstone's entry), so an
        unchanged head means the rows read are the rows under the lock. Cursors are taken
        under the lock, as in the locked path ("Cursor visibility").

        **Locked** (four: ``BEGIN``, the lock with the reads, the write, ``COMMIT``): when the
        device's ``last_seq`` is not the one the push expects (a resend, a gap), when the
        batch deletes a session or writes one twice, when the tenant moved between the read
        and the write (``pushes["stale"]``), and with ``feed_retention``.
        """
        # The device's last_seq the push expects: the number before its first; the lookups
        # of the batch are those after it.
        numbers = [*(c.client_seq for c in changes), *skipped]
        expected = min(numbers) - 1 if numbers else 0
        keys = batch_keys(
            changes, expected, tenant, client_id, aliases, audit=chains, skipped=frozenset(skipped)
        )

        device = await self._device_of(client_id)

        def tx_on(conn: Any) -> _PostgresTx:
            return _PostgresTx(
                conn,
                self._sql,
                self.schema,
                clock.client_id,
                (expected, keys),
                self._id_layout,
                device,
            )

        async def run(tx: _PostgresTx, wrap: Callable[[StoreTx], StoreTx] | None) -> PushResult:
            return await apply_push(
                tx,
                tenant,
                client_id,
                changes,
                clock,
                clock.client_id,
                wrap=wrap,
                aliases=aliases,
                chains=chains,
                skipped=skipped,
                bodies=bodies,
            )

        async def attempt(tx: _PostgresTx) -> PushResult | None:
            tx.between = self._between_read_and_write
            try:
                result = await run(tx, None)
            except _Stale:
                self._forget(tenant)
                return None
            self._remember(tenant, tx.known_after)
            return result

        async def optimistic(conn: Any) -> tuple[str, PushResult | None]:
            known = self._known.get(tenant)
            if known is not None:
                tx = tx_on(conn)
                if tx.read_known(tenant, client_id, known):
                    result = await attempt(tx)
                    # (Nothing written, nothing checked: the answer is read again.)
                    if result is not None and tx.known_after is not None:
                        return "known", result
                    self.pushes["known_stale"] += 1
            tx = tx_on(conn)
            if not await tx.read_optimistic(tenant, client_id, self._known.get(tenant)):
                return "resent", None
            result = await attempt(tx)
            return ("optimistic", result) if result is not None else ("stale", None)

        async def locked(conn: Any) -> PushResult:
            result = await run(tx_on(conn), self._wrap_tx)
            if result.cursors and self.feed_retention is not None:
                await self._retain(conn, tenant, self.feed_retention)
                result.feed, result.previous_head = [], None  # read the page back instead
            return result

        way, found = "locked", None
        if self.optimistic and self.feed_retention is None:
            way, found = await self._run("push failed", optimistic, transaction=False)
        self.pushes[way] += 1
        if found is None:
            self._forget(tenant)  # (its head moves: what was known of it goes stale)
            found = await self._run("push failed, rolled back", locked, transaction=True)
        result = found
        if result.cursors:
            self._analyze_when_young(min(result.cursors) - 1, max(result.cursors))
        return result

    async def _device_of(self, client_id: str) -> tuple[bytes, int] | None:
        """The pushing device's stamp node (``device_node``) and its number in ``nodes``,
        numbered in a statement of its own the first time this process meets it (committed
        then, whatever becomes of the push: a number a row names always has its node);
        None for a device whose stamps name no node so."""
        node = device_node(client_id)
        if not node:
            return None
        number = self._nodes.get(node)
        if number is None:
            found = await self._run(
                "cannot number a device's stamp node",
                lambda conn: conn.fetchval(self._sql.add_node, node),
                transaction=False,
            )
            number = int(found)
            if len(self._nodes) >= _NODES_KEPT:
                self._nodes.clear()
            self._nodes[node] = number
        return node, number

    def _analyze_when_young(self, before: int, head: int) -> None:
        """Analyze the tables in the background when a push took the feed past an
        ``ANALYZE_AT`` cursor (``before``: the feed's head the push found, or about)."""
        if self._seen_from is None:
            self._seen_from = before
        due = analyze_due(self._seen_from, head, self._analyzed)
        if not due or (self._analyzing is not None and not self._analyzing.done()):
            return  # (one at a time: the next push past a cursor still due starts it)
        self._analyzed.update(due)
        self._analyzing = asyncio.create_task(self._analyze(head), name="pleach-pg-analyze")

    async def analyzed(self) -> None:
        """Wait for the tables' analysis under way, if any (``ANALYZE_AT``)."""
        if self._analyzing is not None:
            await asyncio.gather(self._analyzing, return_exceptions=True)

    async def _analyze(self, head: int) -> None:
        try:
            await self._run(
                "cannot analyze the tables",
                lambda conn: conn.execute(self._sql.analyze),
                transaction=False,
            )
        except (StorageError, StorageUnavailable, InvalidState) as exc:
            # (A role that does not own the tables is not refused: PostgreSQL skips each with
            # a warning of its own, and autovacuum analyzes them in its time.)
            log.warning("the tables were not analyzed at feed cursor %d: %s", head, exc)
        else:
            log.info("tables analyzed at feed cursor %d (their plans are made again)", head)

    async def _retain(self, conn: Any, tenant: Tenant, keep: int) -> None:
        cursor = await conn.fetchval(self._sql.retain_cursor, tenant.org_id, tenant.user_id, keep)
        if cursor is not None:
            await _compact(conn, self._sql, tenant, int(cursor))

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
        budget = max_bytes if max_bytes is not None else 1 << 62
        rows = await self._run(
            "pull failed",
            lambda conn: conn.fetch(
                self._sql.pull,
                tenant.org_id,
                tenant.user_id,
                cursor,
                limit + 1,
                budget,
                packed_tenant(tenant),
            ),
            transaction=False,
        )
        floor = int(rows[0][0])
        if 0 < cursor < floor:  # cursor 0: a full resync, always complete
            raise CursorTooOld(
                f"cursor {cursor} predates the retained feed (floor {floor}): resync"
            )
        entries = sorted((r for r in rows if r[1] is not None), key=_CURSOR)
        taken = [
            (int(c), stored_body(int(c), b, n, None if i is None else bytes(i)))
            for _, c, b, within, n, i in entries[:limit]
            if within
        ]
        return feed_page(taken, cursor, len(entries) > len(taken), raw=raw)

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self._run(
            "cannot read the head cursor",
            lambda conn: _head(conn, self._sql, tenant),
            transaction=False,
        )

    async def put_health(self, reports: Sequence[DeviceHealth]) -> None:
        if not reports:
            return
        rows = [(r.org_id, r.user_id, r.client_id, r.seen_at, r.health) for r in reports]
        tenants = dict.fromkeys((r.org_id, r.user_id) for r in reports)
        trims = [(*t, MAX_DEVICES_PER_TENANT) for t in tenants]

        async def body(conn: Any) -> None:
            await conn.executemany(self._sql.put_health, rows)
            await conn.executemany(self._sql.trim_devices, trims)

        await self._run("cannot keep the devices' health", body, transaction=True)

    async def list_health(self, limit: int = 1000) -> list[DeviceHealth]:
        rows = await self._run(
            "cannot read device health",
            lambda conn: conn.fetch(self._sql.list_health, limit),
            transaction=False,
        )
        return [
            DeviceHealth(org_id=o, user_id=u, client_id=c, seen_at=float(s), health=bytes(h))
            for o, u, c, s, h in rows
        ]

    async def compact_feed(self, tenant: Tenant, keep_after_cursor: int) -> int:
        async def body(conn: Any) -> int:
            # Under the tenant's lock: a push cannot append while the floor moves.
            await conn.execute(self._sql.lock_tenant, tenant_lock_key(self.schema, tenant))
            return await _compact(conn, self._sql, tenant, keep_after_cursor)

        return await self._run("compaction failed, rolled back", body, transaction=True)


async def _rollback(conn: Any, tx: Any) -> None:
    """Roll ``tx`` back; if the connection is too broken to, terminate it (never reused)."""
    try:
        await tx.rollback()
    except _DATABASE_ERRORS as exc:
        log.warning("rollback failed (%s: %s); terminating the connection", type(exc).__name__, exc)
        _discard(conn)


def _discard(conn: Any) -> None:
    """Terminate a pool connection so that it is never reused (the pool replaces it)."""
    with contextlib.suppress(asyncpg.InterfaceError):  # already released: nothing to do
        conn.terminate()
