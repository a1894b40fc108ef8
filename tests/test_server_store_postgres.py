"""``PostgresServerStore``: the shared conformance suite against a real PostgreSQL, plus what
only PostgreSQL has: migrations, index scans, cursor visibility under concurrent pushers, and
the database going away.

The database is ``PLEACH_TEST_PG_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
Each test session works in its own fresh schema (``pleach_test_<hex>``), dropped at the end,
so concurrent runs never see each other's rows. When PostgreSQL is unreachable the tests skip,
unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import itertools
import json
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_server.store import ServerStore
from pleach_server.store.apply import StoreTx
from pleach_server.store.base import APART, PushResult, Tenant, decode_body, packed_tenant
from pleach_server.store.postgres import (
    _ANALYZED_TABLES,
    _HASH_SQL,
    _PLEACH_WHOLE,
    ANALYZE_AT,
    DEFAULT_KNOWN_BYTES,
    NOTIFY_CHANNEL,
    SCHEMA_VERSION,
    PostgresServerStore,
    _audit_tails,
    _pg_hash,
    _pg_hash_text,
    _pg_id,
    _pg_key,
    analyze_due,
    migrate,
    redact_dsn,
    tenant_lock_key,
)
from shared import compact
from shared.clock import HybridClock
from shared.compact import KINDS, SHORT, chain_digest
from shared.errors import CursorTooOld, ErrorCode, InvalidState, StorageError, StorageUnavailable
from shared.hashchain import chain_audit, event_digest, link, verify_chain
from shared.ids import uuid7
from shared.records import (
    CASCADE_KINDS,
    AuditRow,
    Change,
    Checkpoint,
    Event,
    Message,
    Record,
    Session,
    kind_of,
    record_kind,
)
from tests.server_factories import Device, new_tenant
from tests.server_store_conformance import (
    FaultyTx,
    InjectedFault,
    MakeStore,
    PlacedHistory,
    ServerStoreConformance,
    ServerStoreConformanceInIdBlocks,
    StoredRows,
    TxWrapper,
    codes,
    placed_history,
    pull_all,
    statuses,
    tombstone,
)

pytestmark = pytest.mark.postgres

PG_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
TIMEOUT = 20.0


# -- the database ------------------------------------------------------------------------------


def postgres_unreachable(dsn: str = PG_DSN) -> str | None:
    """Why PostgreSQL at ``dsn`` cannot be used, or None when it answers."""

    async def probe() -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    try:
        asyncio.run(probe())
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def require_postgres(dsn: str = PG_DSN) -> None:
    """Skip the test when PostgreSQL is unreachable, or FAIL it when ``CI`` is set."""
    reason = postgres_unreachable(dsn)
    if reason is None:
        return
    message = (
        f"PostgreSQL at {redact_dsn(dsn)} is unreachable ({reason}); start it "
        "(pg_ctlcluster <version> main start) or set PLEACH_TEST_PG_DSN"
    )
    if os.environ.get("CI"):
        pytest.fail(f"CI is set, so a PostgreSQL test may not skip: {message}")
    pytest.skip(message)


def new_schema_name() -> str:
    return f"pleach_test_{uuid7().replace('-', '')}"


def drop_schema(schema: str, dsn: str = PG_DSN) -> None:
    async def drop() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture(scope="session")
def pg_available() -> None:
    """Once per session: skip (or fail under CI) every PostgreSQL test if it is unreachable."""
    require_postgres()


@pytest.fixture(autouse=True)
def _needs_postgres(pg_available: None) -> None:
    """Every test of this module needs PostgreSQL (sync, so it runs outside the event loop)."""


@pytest.fixture(scope="session")
def pg_schema(pg_available: None) -> Iterator[str]:
    """The schema this test session's stores share (created by the first store's open)."""
    schema = new_schema_name()
    yield schema
    drop_schema(schema)


@contextlib.asynccontextmanager
async def admin() -> AsyncIterator[Any]:
    """A plain connection, outside any store's pool."""
    conn = await asyncpg.connect(PG_DSN, timeout=10)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def scratch_schema() -> AsyncIterator[str]:
    """A schema of its own for one test, dropped after it."""
    schema = new_schema_name()
    try:
        yield schema
    finally:
        async with admin() as conn:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


class _WrappedStore(PostgresServerStore):
    def __init__(self, dsn: str, tx_wrapper: TxWrapper, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self._tx_wrapper = tx_wrapper

    def _wrap_tx(self, tx: StoreTx) -> StoreTx:
        return self._tx_wrapper(tx)


def pg_store(
    schema: str, tx_wrapper: TxWrapper | None = None, **kwargs: Any
) -> PostgresServerStore:
    if tx_wrapper is None:
        return PostgresServerStore(PG_DSN, schema=schema, **kwargs)
    return _WrappedStore(PG_DSN, tx_wrapper, schema=schema, **kwargs)


@pytest.fixture
def make_store(pg_schema: str) -> MakeStore:
    def make(tx_wrapper: TxWrapper | None = None) -> ServerStore:
        return pg_store(pg_schema, tx_wrapper)

    return make


@pytest.fixture
async def server_store(pg_schema: str) -> AsyncIterator[ServerStore]:
    async with pg_store(pg_schema) as store:
        yield store


@pytest.fixture
def stored_rows(pg_schema: str) -> StoredRows:
    async def rows(tenant: Tenant) -> set[tuple[str, str]]:
        s = pg_schema
        async with admin() as conn:
            # Kinds as their numbers and ids as their keys (schema 9), the tenant as its number
            # (10), read back as the store does.
            t = f"(SELECT tid FROM {s}.tenants WHERE org_id = $1 AND user_id = $2)"
            found = await conn.fetch(
                f"SELECT 0::smallint, id FROM {s}.sessions WHERE tid = {t} "
                f"UNION ALL SELECT 3::smallint, id FROM {s}.events WHERE tid = {t} "
                f"UNION ALL SELECT kind, id FROM {s}.records WHERE tid = {t}",
                tenant.org_id,
                tenant.user_id,
            )
        return {(KINDS[kind], _pg_id(key)) for kind, key in found}

    return rows


class TestPostgresServerStore(ServerStoreConformance):
    pass


class TestPostgresServerStoreInIdBlocks(ServerStoreConformanceInIdBlocks):
    pass


# -- helpers -----------------------------------------------------------------------------------


class Hooked(FaultyTx):
    """A ``StoreTx`` that never fails but can run hooks after a lock or after the last read.

    ``apply_push`` calls ``head_cursor`` last, after every cursor of the batch is allocated:
    ``after_cursors`` runs there, with the transaction still open.
    """

    def __init__(
        self,
        inner: StoreTx,
        *,
        after_cursors: Callable[[], Any] | None = None,
        skip_lock: bool = False,
    ) -> None:
        super().__init__(inner, fail_at=0)
        self.after_cursors = after_cursors
        self.skip_lock = skip_lock

    async def lock_tenant(self, tenant: Tenant) -> None:
        if not self.skip_lock:
            await self.inner.lock_tenant(tenant)

    async def head_cursor(self, tenant: Tenant) -> int:
        if self.after_cursors is not None:
            await self.after_cursors()
        return await self.inner.head_cursor(tenant)


async def wait_until(check: Callable[[], Any], what: str) -> None:
    """Poll an async ``check`` until it is truthy; each poll is a database round trip."""
    async with asyncio.timeout(TIMEOUT):
        for _ in range(100_000):
            if await check():
                return
    raise AssertionError(f"gave up waiting for {what}")


async def wait_for_one_on_the_tenant_lock(conn: Any, store: PostgresServerStore, what: str) -> None:
    """Until exactly one of ``store``'s connections waits on an advisory (tenant) lock."""

    async def one_waits() -> bool:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
            "AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            store.application_name,
        )
        return bool(waiting == 1)

    await wait_until(one_waits, what)


# -- migrations --------------------------------------------------------------------------------


async def test_migrations_are_versioned_idempotent_and_safe_concurrently() -> None:
    async with scratch_schema() as schema:
        stores = [pg_store(schema) for _ in range(4)]
        try:
            await asyncio.gather(*(s.open() for s in stores))  # four processes starting at once
            applied = sorted(s.migrated.applied for s in stores if s.migrated is not None)
            assert applied == [0, 0, 0, SCHEMA_VERSION]
        finally:
            await asyncio.gather(*(s.close() for s in stores))
        async with pg_store(schema) as store:
            assert store.migrated is not None and store.migrated.applied == 0
        again = await migrate(PG_DSN, schema)
        assert (again.from_version, again.to_version) == (SCHEMA_VERSION, SCHEMA_VERSION)
        async with admin() as conn:
            versions = await conn.fetch(f"SELECT version FROM {schema}.schema_migrations")
            assert [r[0] for r in versions] == list(range(1, SCHEMA_VERSION + 1))
            await conn.execute(
                f"INSERT INTO {schema}.schema_migrations (version) VALUES ($1)", SCHEMA_VERSION + 1
            )
        store = pg_store(schema)
        with pytest.raises(StorageError, match="upgrade pleach"):
            await store.open()
        assert not await store.healthy()


async def test_migrate_creates_a_fresh_schema() -> None:
    async with scratch_schema() as schema:
        result = await migrate(PG_DSN, schema)
        assert (result.schema, result.from_version, result.to_version) == (
            schema,
            0,
            SCHEMA_VERSION,
        )
        async with admin() as conn:
            tables = await conn.fetch(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = $1",
                schema,
            )
        assert {r[0] for r in tables} == {
            "schema_migrations",
            "sessions",
            "session_ids",
            "records",
            "events",
            "feed",
            "clients",
            "meta",
            "devices",
            "audit_tails",
            "tenants",
            "nodes",
            "chains",
        }
        # (the tables the store analyzes while the database is young: all of them)
        assert set(_ANALYZED_TABLES) == {r[0] for r in tables} - {"schema_migrations"}


# -- index scans -------------------------------------------------------------------------------


def tid(s: str, org: str, user: str) -> str:
    """SQL: the number of the tenant whose org and user are the expressions ``org`` and
    ``user`` (schema 10), for rows a test writes directly."""
    return f"(SELECT tid FROM {s}.tenants WHERE org_id = {org} AND user_id = {user})"


def explain_queries(store: PostgresServerStore) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """Every per-tenant or per-id query of the store, with example parameters."""
    sql = store._sql
    return {
        "pull": (sql.pull, ("org-7", "user-7", 100, 51, 1 << 20, b"")),
        "pull (the tenant with the rows)": (
            sql.pull,
            ("org-1", "user-1", 100, 51, 1 << 20, b""),
        ),
        "head_cursor": (sql.head, ("org-7", "user-7")),
        "client_state": (sql.client_state, ("org-7", "user-7", "dev-7")),
        "get_last_seq": (sql.get_last_seq, ("org-7", "user-7", "dev-7")),
        # ids as their keys and kinds as their numbers, as the store binds them (schema 9)
        "owner_of(Session)": (sql.session_owner, ("org-7", "user-7", _pg_key("session-7"))),
        "owner_of(Event)": (sql.event_owner, ("org-7", "user-7", _pg_key("event-7"))),
        "owner_of(Message)": (
            sql.record_owner,
            ("org-7", "user-7", KINDS.index("Message"), _pg_key("message-7")),
        ),
        "get_session": (sql.get_session, ("org-7", "user-7", _pg_key("session-7"))),
        "last_event": (sql.last_event, ("org-7", "user-7", _pg_key("session-7"))),
        "audit_tail": (sql.audit_tail, ("org-1", "user-1", "dev-7")),
        # the tenant with the rows (org-1): each branch a probe of one index per key
        "load (a push's lookups, one statement)": (
            sql.load,
            (
                "org-1",
                "user-1",
                [KINDS.index("Message")],
                [_pg_key("message-7")],
                [_pg_key("event-7")],
                [_pg_key("session-7")],
                [_pg_key("session-7")],
                [_pg_key("session-7")],
                ["dev-7"],
            ),
        ),
        "retain": (sql.retain_cursor, ("org-7", "user-7", 10)),
        # a push's rows, feed (with the entries of its sessions it supersedes) and notice
        "write": (
            sql.write,
            (
                "org-7",
                "user-7",
                *([] for _ in range(4)),  # records
                *([] for _ in range(5)),  # events
                *([] for _ in range(3)),  # sessions
                "dev-7",
                None,
                *([] for _ in range(4)),  # audit places
                [KINDS.index("Message"), KINDS.index("Session")],  # kinds and ids as kept
                [_pg_key("message-1"), _pg_key("session-7")],
                [_pg_key("session-7")],
                "schema",
                "server-1",
                [],  # how many ids each session's blocks hold
                [_pg_key("session-7")],  # a block written...
                [2],
                [b"\x00" * 32],
                [_pg_key("session-7")],  # ...and those past it dropped
                [3],
                [],  # the records' entries among the feed rows
                [],  # the events'
                [],  # the events' bodies without their prev_hash
                [],  # and the prev_hash each left out
                [],  # the records' stamp nodes' numbers
                [],  # the events'
            ),
        ),
        "drop_cursors": (sql.drop_cursors, ("org-7", "user-7", [10, 20])),
        "compact": (sql.compact, ("org-1", "user-1", 100)),
        # a deleted session's content (its records' entries go with them)
        "delete_records": (
            sql.delete_records,
            ("org-1", "user-1", [KINDS.index("Message")], [_pg_key("message-7")]),
        ),
    }


async def test_per_tenant_queries_are_index_scans() -> None:
    """EXPLAIN every per-tenant query on a realistically sized, analyzed schema.

    No ``enable_seqscan = off`` is needed: with a few thousand rows per table, the planner
    picks the indexes on its own (on near-empty tables it would rightly read one page instead).
    The printed plans are the ones quoted in docs/POSTGRES.md.
    """
    async with scratch_schema() as schema:
        async with pg_store(schema) as store, admin() as conn:
            s = schema
            # 500 tenants x 40 feed entries (sessions'; records and events are their own
            # entries, at their cursors); sessions, events and records to match.
            await conn.execute(
                f"""INSERT INTO {s}.tenants (org_id, user_id)
                SELECT 'org-' || i, 'user-' || i FROM generate_series(0, 499) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.feed (tid, kind, record_id)
                SELECT {tid(s, "'org-' || (i % 500)", "'user-' || (i % 500)")},
                       {s}.pleach_kind(CASE WHEN i % 10 = 0 THEN 'Session' ELSE 'Message' END),
                       {s}.pleach_key(
                           CASE WHEN i % 10 = 0 THEN 'session-' ELSE 'message-' END || i)
                FROM generate_series(1, 20000) AS i WHERE i % 10 = 0"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.clients (org_id, user_id, client_id, last_seq)
                SELECT 'org-' || (i % 500), 'user-' || (i % 500), 'dev-' || i, i
                FROM generate_series(1, 5000) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.sessions (id, tid, updated_at, body)
                SELECT {s}.pleach_key('session-' || i),
                       {tid(s, "'org-' || (i % 500)", "'user-' || (i % 500)")}, 'x', ''
                FROM generate_series(1, 5000) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.session_ids (tid, id, part, ids)
                SELECT {tid(s, "'org-' || (i % 500)", "'user-' || (i % 500)")},
                       {s}.pleach_key('session-' || i), p, '\\x00'::bytea
                FROM generate_series(1, 5000) AS i, generate_series(0, 2) AS p"""
            )
            await conn.execute(  # (the sessions of org-1's events and records)
                f"""INSERT INTO {s}.chains (tid, session_id)
                SELECT {tid(s, "'org-1'", "'user-1'")}, {s}.pleach_key('session-' || i)
                FROM generate_series(0, 4999) AS i"""
            )
            org_1 = tid(s, "'org-1'", "'user-1'")
            chain = (
                f"(SELECT n FROM {s}.chains WHERE tid = {org_1} "
                f"AND session_id = {s}.pleach_key('session-' || (i % 5000)))"
            )
            await conn.execute(
                f"""INSERT INTO {s}.events
                    (id, chain, sequence_number, tid, row_hash, body, cursor)
                SELECT {s}.pleach_key('event-' || i), {chain},
                       i, {tid(s, "'org-1'", "'user-1'")}, 'h', '', 100000 + i
                FROM generate_series(1, 20000) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.records (kind, id, tid, chain, body, cursor)
                SELECT {s}.pleach_kind('Message'), {s}.pleach_key('message-' || i),
                       {tid(s, "'org-1'", "'user-1'")}, {chain}, '', 200000 + i
                FROM generate_series(1, 20000) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.meta (org_id, user_id, feed_floor)
                SELECT 'org-' || i, 'user-' || i, 0 FROM generate_series(1, 500) AS i"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.audit_tails
                    (tid, client_id, sequence_number, row_hash, id)
                SELECT {tid(s, "'org-' || (i % 500)", "'user-' || (i % 500)")}, 'dev-' || i,
                       i, 'h', {s}.pleach_key('audit-' || i)
                FROM generate_series(1, 20000) AS i"""
            )
            await conn.execute(
                f"ANALYZE {s}.feed, {s}.clients, {s}.sessions, {s}.session_ids, {s}.events, "
                f"{s}.records, "
                f"{s}.meta, {s}.audit_tails, {s}.tenants"
            )
            report = []
            for name, (query, args) in explain_queries(store).items():
                rows = await conn.fetch(f"EXPLAIN (COSTS OFF) {query}", *args)
                plan = "\n".join(r[0] for r in rows)
                report.append(f"-- {name}\n{plan}")
                assert "Seq Scan" not in plan, f"{name} reads a whole table:\n{plan}"
                assert "Index Scan" in plan or "Index Only Scan" in plan, plan
            print("\n\n".join(report))


def _literal(value: Any) -> str:
    """``value`` as an SQL literal an ``EXECUTE`` coerces to the parameter's type."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        raise TypeError("no boolean parameters here")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, bytes):
        return "'\\x" + value.hex() + "'"
    if isinstance(value, list):
        items = ",".join(
            '"\\\\x' + v.hex() + '"'
            if isinstance(v, bytes)
            else '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
            for v in value
        )
        return "'{" + items.replace("'", "''") + "}'"
    raise TypeError(f"no literal for {type(value).__name__}")


def _blocks(plan: dict[str, Any]) -> int:
    """The shared buffers a plan node and everything under it touched."""
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


async def _explain(
    conn: Any, query: str, args: tuple[Any, ...], options: str, *, generic: bool
) -> list[Any]:
    """``EXPLAIN (options)`` of ``query`` run with ``args``, as a custom plan (planned for these
    values) or as a generic plan (planned for any: ``PREPARE``, then ``EXPLAIN EXECUTE`` of
    the values as literals). Inside a transaction that is rolled back: with ``ANALYZE`` the
    statement runs, and its writes write nothing."""
    rows: list[Any] = []
    with contextlib.suppress(_RolledBack):
        async with conn.transaction():
            if generic:
                await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                await conn.execute(f"PREPARE explained AS {query}")
                literals = ", ".join(_literal(a) for a in args)
                rows = await conn.fetch(f"EXPLAIN ({options}) EXECUTE explained({literals})")
            else:
                rows = await conn.fetch(f"EXPLAIN ({options}) {query}", *args)
            raise _RolledBack
    if generic:
        await conn.execute("DEALLOCATE explained")  # a prepared statement outlives a rollback
    return rows


async def _buffers(conn: Any, query: str, args: tuple[Any, ...], *, generic: bool) -> int:
    """The shared buffers ``query`` touches when run with ``args`` (see ``_explain``)."""
    rows = await _explain(conn, query, args, "ANALYZE, BUFFERS, FORMAT JSON", generic=generic)
    return _blocks(json.loads(rows[0][0])[0]["Plan"])


async def _plan_text(conn: Any, query: str, args: tuple[Any, ...], *, generic: bool) -> str:
    """The plan ``_buffers`` measured, as text (for a failure's message)."""
    rows = await _explain(conn, query, args, "COSTS OFF", generic=generic)
    return "\n".join(r[0] for r in rows)


class _RolledBack(Exception):
    """Raised to roll a measuring transaction back."""


async def test_plans_do_not_depend_on_a_tenants_size() -> None:
    """A tenant 4,000 times the size of another costs each statement about as many buffers.

    A generic plan estimates a tenant's rows from the whole table (about 15 here), so a plan
    that is right for the average tenant can read every row of a large one. Without
    migration 8's statistics, key lookups walked every record or event of the tenant (this
    test fails then). ``MAX(cursor)`` over the feed, measured at 300,000 entries before those
    statistics, was an aggregate over all of the tenant's entries (40-80 ms a call); at this
    size, with them, the planner happens to avoid it, and the head is now written so that no
    estimate can bring it back. Each per-tenant and
    per-key statement runs here for a small tenant and for the large one with the same number
    of keys, in the generic plan PostgreSQL switches a prepared statement to after five runs
    (and, reported only, a custom plan); the large tenant may touch only a few more buffers
    (one more index level).
    """
    small, big = ("org-7", "user-7"), ("org-big", "user-big")
    async with scratch_schema() as schema:
        async with pg_store(schema) as store, admin() as conn:
            s = schema
            # 2,000 tenants of 5 rows in each table (TID: the tenant's number), and one of 20,000.
            await conn.execute(
                f"""INSERT INTO {s}.tenants (org_id, user_id)
                SELECT 'org-' || i, 'user-' || i FROM generate_series(0, 1999) AS i
                UNION ALL SELECT 'org-big', 'user-big'"""
            )
            await conn.execute(  # (each tenant's session-7, which its events are filed under)
                f"INSERT INTO {s}.chains (tid, session_id) "
                f"SELECT tid, {s}.pleach_key('session-7') FROM {s}.tenants"
            )
            chain_7 = (
                "(SELECT n FROM {s}.chains WHERE tid = TID "
                "AND session_id = {s}.pleach_key('session-7'))"
            )
            for table, columns, select in (
                (  # (sessions' entries; a record and an event are their own, at their cursor)
                    "feed",
                    "tid, kind, record_id",
                    "TID, {s}.pleach_kind('Session'), {s}.pleach_key('session-' || i)",
                ),
                (
                    "records",
                    "kind, id, tid, chain, body, cursor",
                    "{s}.pleach_kind('Message'), {s}.pleach_key('message-' || i), TID, "
                    f"{chain_7}, '', 100000 + i",
                ),
                (
                    "events",
                    "id, chain, sequence_number, tid, row_hash, body, cursor",
                    f"{{s}}.pleach_key('event-' || i), {chain_7}, i, TID, 'h', '', 200000 + i",
                ),
                (  # (a chain's last place: the row of each of the tenant's devices)
                    "audit_tails",
                    "tid, client_id, sequence_number, row_hash, id",
                    "TID, 'dev-' || i, i, 'h', {s}.pleach_key('audit-' || i)",
                ),
            ):
                for number, numbers in (
                    (tid(s, "'org-' || (i % 2000)", "'user-' || (i % 2000)"), "1, 10000"),
                    (tid(s, "'org-big'", "'user-big'"), "10001, 30000"),
                ):
                    await conn.execute(
                        f"INSERT INTO {s}.{table} ({columns}) "
                        f"SELECT {select.replace('TID', number).replace('{s}', s)} "
                        f"FROM generate_series({numbers}) AS i"
                    )
            await conn.execute(
                f"""INSERT INTO {s}.sessions (id, tid, updated_at, body)
                SELECT {s}.pleach_key('session-7'), tid, 'x', ''::bytea FROM {s}.tenants"""
            )
            await conn.execute(
                f"""INSERT INTO {s}.clients (org_id, user_id, client_id, last_seq)
                SELECT 'org-' || i, 'user-' || i, 'dev-7', 1 FROM generate_series(0, 1999) AS i
                UNION ALL SELECT 'org-big', 'user-big', 'dev-7', 1"""
            )
            await conn.execute(
                f"ANALYZE {s}.feed, {s}.clients, {s}.sessions, {s}.events, "
                f"{s}.records, {s}.audit_tails, {s}.tenants"
            )
            # A key of each tenant: its newest rows (the small tenant's are spread out).
            keys = {small: ("message-9007", "event-9007"), big: ("message-29000", "event-29000")}
            report: list[str] = []
            failures: list[str] = []
            for name, (query, args) in explain_queries(store).items():
                costs = {}
                bounds: dict[tuple[str, str], tuple[Any, ...]] = {}
                for tenant in (small, big):
                    ids = {"message-7": keys[tenant][0], "message-1": keys[tenant][0]}
                    ids["event-7"] = keys[tenant][1]
                    ids.update({_pg_key(a): _pg_key(b) for a, b in ids.items()})  # (as bound)

                    def swap(value: Any, ids: dict[Any, Any] = ids) -> Any:
                        if isinstance(value, list):
                            return [swap(v) for v in value]
                        return ids.get(value, value) if isinstance(value, str | bytes) else value

                    if query == store._sql.drop_cursors:  # two of the tenant's entries
                        newest = await conn.fetch(
                            f"SELECT cursor FROM {s}.feed WHERE tid = {tid(s, '$1', '$2')} "
                            "ORDER BY cursor DESC LIMIT 2",
                            *tenant,
                        )
                        bound: tuple[Any, ...] = (*tenant, [r[0] for r in newest])
                    elif query == store._sql.pull:  # the same page for both: 3 entries
                        bound = (*tenant, 0, 3, 1 << 20, b"")
                    else:
                        bound = (*tenant, *(swap(a) for a in args[2:]))
                    bounds[tenant] = bound
                    costs[tenant] = [
                        await _buffers(conn, query, bound, generic=generic)
                        for generic in (True, False)
                    ]
                report.append(f"{name}: small {costs[small]}, large {costs[big]}")
                # Only the generic plan is held to it: a custom plan, shown beside, is planned
                # for the values at hand and, when this tenant holds most of the table, may
                # walk the feed's primary key past the other tenants' rows (by the statistics,
                # a fair guess for a tenant that large).
                few, many = costs[small][0], costs[big][0]
                if many > 2 * few + 12:
                    plan = await _plan_text(conn, query, bounds[big], generic=True)
                    failures.append(
                        f"{name} (generic plan) touches {many} buffers for the large tenant "
                        f"against {few} for a small one:\n{plan}"
                    )
            print("\n".join(report))
            assert not failures, "\n".join(failures)


# -- cursor visibility -------------------------------------------------------------------------


async def test_reader_sees_every_change_exactly_once_in_cursor_order(pg_schema: str) -> None:
    """8 pushers on their own pool connections, one tenant, many batches; every third
    transaction stays open (its cursors allocated, not committed) until the reader has pulled
    twice more. A reader pulling in a loop must see every applied change once, in order."""
    pushers, batches, per_batch = 8, 25, 4
    tenant = new_tenant()
    session_id = uuid7()
    reader_pulls = 0
    progressed = asyncio.Condition()
    held = 0
    transactions = 0

    async def hold_open() -> None:
        nonlocal held, transactions
        transactions += 1
        if transactions % 3:
            return
        held += 1
        async with progressed:
            target = reader_pulls + 2
            await progressed.wait_for(lambda: reader_pulls >= target)

    def wrap(tx: StoreTx) -> StoreTx:
        return Hooked(tx, after_cursors=hold_open)

    async with pg_store(pg_schema, wrap, pool_max=pushers + 2) as store:
        clock = HybridClock(f"server-{uuid7()}")
        applied: dict[str, int] = {}  # record id -> cursor, from the push results
        pushing_done = asyncio.Event()

        async def pusher() -> None:
            dev = Device(tenant)
            for _ in range(batches):
                batch = dev.changes(*(dev.message(session_id) for _ in range(per_batch)))
                result = await store.push(tenant, dev.client_id, batch, clock)
                assert statuses(result) == ["applied"] * per_batch
                for change, outcome in zip(batch, result.results, strict=True):
                    assert outcome.cursor is not None
                    applied[change.record.id] = outcome.cursor

        seen: list[tuple[int, str]] = []

        async def reader() -> None:
            nonlocal reader_pulls
            cursor = 0
            while True:
                finished = pushing_done.is_set()  # read BEFORE the pull: the last pull is complete
                page = await store.pull(tenant, cursor, 50)
                for entry in page.changes:
                    assert entry.cursor > cursor, f"cursor went back: {entry.cursor} <= {cursor}"
                    cursor = entry.cursor
                    seen.append((entry.cursor, entry.record.id))
                assert page.to_cursor == cursor
                async with progressed:
                    reader_pulls += 1
                    progressed.notify_all()
                if finished and not page.more:
                    return

        async def push_all() -> None:
            try:
                await asyncio.gather(*(pusher() for _ in range(pushers)))
            finally:
                pushing_done.set()

        async with asyncio.timeout(120):
            await asyncio.gather(push_all(), reader())

        total = pushers * batches * per_batch
        assert len(applied) == total
        assert len(seen) == total, f"reader saw {len(seen)} of {total} changes"
        assert len({record_id for _, record_id in seen}) == total  # none twice
        assert dict((record_id, cursor) for cursor, record_id in seen) == applied
        assert [c for c, _ in seen] == sorted(applied.values())
        assert held >= pushers * batches // 3 - 1 and reader_pulls > held
        assert [(c.cursor, c.record.id) for c in await pull_all(store, tenant)] == seen


async def _open_then_commit_later(
    store_of: Callable[[TxWrapper], PostgresServerStore], *, skip_lock: bool
) -> tuple[list[int], list[int], int]:
    """Push A allocates its cursor and stays open; push B starts; a reader pulls; A commits.

    Returns (A's cursors, B's cursors, what the reader had seen before A committed plus after).
    """
    tenant = new_tenant()
    a, b = Device(tenant), Device(tenant)
    session_id = uuid7()
    a_allocated, release_a = asyncio.Event(), asyncio.Event()

    async def hold_a() -> None:
        a_allocated.set()
        await release_a.wait()

    def wrap(tx: StoreTx) -> StoreTx:
        first = not a_allocated.is_set()
        return Hooked(tx, after_cursors=hold_a if first else None, skip_lock=skip_lock)

    clock = HybridClock(f"server-{uuid7()}")
    async with store_of(wrap) as store, admin() as conn:
        # The tenant has written before, in this session: a tenant's first push makes its
        # number, and the first push filed under a session its chain's (``chains``), so two
        # first pushes of one tenant would wait on each other's row even without the lock.
        await conn.execute(
            f"INSERT INTO {store.schema}.tenants (org_id, user_id) VALUES ($1, $2)",
            tenant.org_id,
            tenant.user_id,
        )
        await conn.execute(
            f"INSERT INTO {store.schema}.chains (tid, session_id) SELECT tid, $3 "
            f"FROM {store.schema}.tenants WHERE org_id = $1 AND user_id = $2",
            tenant.org_id,
            tenant.user_id,
            _pg_key(session_id),
        )
        push_a = asyncio.create_task(
            store.push(tenant, a.client_id, a.changes(a.message(session_id)), clock)
        )
        await a_allocated.wait()
        push_b = asyncio.create_task(
            store.push(tenant, b.client_id, b.changes(b.message(session_id)), clock)
        )
        if skip_lock:
            await push_b  # nothing holds B back: it commits a higher cursor first
        else:
            await wait_for_one_on_the_tenant_lock(conn, store, "B to wait on the tenant lock")
        first_page = await store.pull(tenant, 0, 100)
        release_a.set()
        result_a = await push_a
        result_b = await push_b
        second_page = await store.pull(tenant, first_page.to_cursor, 100)
        seen = len(first_page.changes) + len(second_page.changes)
        return result_a.cursors, result_b.cursors, seen


async def test_tenant_lock_closes_the_sequence_gap_race(pg_schema: str) -> None:
    """The classic race, staged deterministically: A takes cursor n and stays open, B takes
    n+1 and commits, a reader pulls past n+1, A commits n. Without the tenant lock (control)
    the reader never sees n; with it, B waits for A, and the reader sees both."""

    def store_of(wrap: TxWrapper) -> PostgresServerStore:
        return pg_store(pg_schema, wrap)

    a_cursors, b_cursors, seen = await _open_then_commit_later(store_of, skip_lock=True)
    assert a_cursors[0] < b_cursors[0]
    assert seen == 1  # control: without the lock, A's change was skipped

    a_cursors, b_cursors, seen = await _open_then_commit_later(store_of, skip_lock=False)
    assert a_cursors[0] < b_cursors[0]
    assert seen == 2


async def test_a_push_waiting_on_the_tenant_lock_reads_the_last_seq_committed_before_it(
    pg_schema: str,
) -> None:
    """A device's push is held open after its writes (tenant lock taken); the same device
    sends the same changes again (its ack was lost) and waits on the lock. The lock and the
    read of last_seq are one round trip (migration 7's function), and the read must still
    come after the lock, on a snapshot of its own: the second push finds every change a
    duplicate. A read on the snapshot from before the wait would apply them twice."""
    tenant = new_tenant()
    dev = Device(tenant)
    session = dev.session()
    changes = dev.changes(session, dev.message(session.id), dev.event(session.id))
    allocated, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        allocated.set()
        await release.wait()

    def wrap(tx: StoreTx) -> StoreTx:
        return Hooked(tx, after_cursors=hold if not allocated.is_set() else None)

    clock = HybridClock(f"server-{uuid7()}")
    async with pg_store(pg_schema, wrap) as store, admin() as conn:
        first = asyncio.create_task(store.push(tenant, dev.client_id, changes, clock))
        await allocated.wait()
        again = asyncio.create_task(store.push(tenant, dev.client_id, changes, clock))
        await wait_for_one_on_the_tenant_lock(conn, store, "the second push to wait on the lock")
        release.set()
        assert statuses(await first) == ["applied"] * 3
        assert statuses(await again) == ["duplicate"] * 3
        page = await store.pull(tenant, 0, 100)
    assert len(page.changes) == 3  # each change once in the feed


async def test_a_push_waiting_on_the_tenant_lock_reads_the_rows_committed_before_it(
    pg_schema: str,
) -> None:
    """The laptop's edit of a session is held open after its writes (tenant lock taken);
    the phone, which saw the session before that edit, pushes its own edit of it and waits
    on the lock. Its lookups go with the lock in one round trip (migration 11), and must
    still be read after the lock, on a snapshot of their own: the phone's push finds the
    laptop's version and resolves the conflict (a fork keeps the loser). Lookups on the
    snapshot from before the wait would find the version before the laptop's edit, take the
    phone's as its successor and drop the laptop's edit."""
    tenant = new_tenant()
    laptop, phone = Device(tenant), Device(tenant)
    v1 = laptop.session(title="v1", message_ids=["m1"])
    allocated, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        allocated.set()
        await release.wait()

    holding = [False]

    def wrap(tx: StoreTx) -> StoreTx:
        return Hooked(tx, after_cursors=hold if holding[0] and not allocated.is_set() else None)

    clock = HybridClock(f"server-{uuid7()}")
    async with pg_store(pg_schema, wrap) as store, admin() as conn:
        assert statuses(await store.push(tenant, laptop.client_id, laptop.changes(v1), clock)) == [
            "applied"
        ]
        on_laptop = laptop.edit(v1, title="laptop", message_ids=["m1", "l2"])
        phone.clock.observe(on_laptop.updated_at)  # the phone writes later: it wins LWW
        on_phone = phone.edit(v1, title="phone", message_ids=["m1", "p2"])
        holding[0] = True
        first = asyncio.create_task(
            store.push(tenant, laptop.client_id, laptop.changes(on_laptop), clock)
        )
        await allocated.wait()
        second = asyncio.create_task(
            store.push(tenant, phone.client_id, phone.changes(on_phone), clock)
        )
        await wait_for_one_on_the_tenant_lock(conn, store, "the phone's push to wait on the lock")
        release.set()
        assert statuses(await first) == ["applied"]
        resolved = await second
        assert statuses(resolved) == ["resolved"]
        receipt = resolved.results[0].conflict
        assert receipt is not None and receipt.session_id == v1.id
        feed = [c.record for c in (await store.pull(tenant, 0, 100)).changes]
    titles = sorted(r.title for r in feed if isinstance(r, Session))
    assert titles == ["laptop", "phone"]  # the laptop's edit survives, as the fork


class _Between(PostgresServerStore):
    """A store that runs ``between`` (once) between an optimistic push's read and its write."""

    between: Callable[[], Any] | None = None

    async def _between_read_and_write(self) -> None:
        step, self.between = self.between, None
        if step is not None:
            await step()


async def test_an_optimistic_push_whose_tenant_moved_runs_locked(pg_schema: str) -> None:
    """The phone's push reads the session as v1; before it writes, the laptop's edit of the
    session commits. The phone's write finds the tenant's head moved and writes nothing;
    the push runs again, locked, finds the laptop's version and resolves the conflict (a
    fork keeps the loser). Written on its read alone, it would take the phone's version as
    v1's successor and drop the laptop's edit."""
    tenant = new_tenant()
    laptop, phone = Device(tenant), Device(tenant)
    v1 = laptop.session(title="v1", message_ids=["m1"])
    clock = HybridClock(f"server-{uuid7()}")
    async with _Between(PG_DSN, schema=pg_schema, pool_max=2) as store:
        assert statuses(await store.push(tenant, laptop.client_id, laptop.changes(v1), clock)) == [
            "applied"
        ]
        on_laptop = laptop.edit(v1, title="laptop", message_ids=["m1", "l2"])
        phone.clock.observe(on_laptop.updated_at)  # the phone writes later: it wins LWW
        on_phone = phone.edit(v1, title="phone", message_ids=["m1", "p2"])
        laptop_result: list[Any] = []

        async def laptop_pushes() -> None:
            pushed = await store.push(tenant, laptop.client_id, laptop.changes(on_laptop), clock)
            laptop_result.append(pushed)

        store.between = laptop_pushes
        resolved = await store.push(tenant, phone.client_id, phone.changes(on_phone), clock)
        assert [statuses(r) for r in laptop_result] == [["applied"]]
        assert statuses(resolved) == ["resolved"]
        assert store.pushes == {"optimistic": 1, "known": 1, "stale": 1}
        receipt = resolved.results[0].conflict
        assert receipt is not None and receipt.session_id == v1.id
        # The live page of the phone's push starts where the laptop's ended.
        assert resolved.previous_head == laptop_result[0].head_cursor
        feed = [c.record for c in (await store.pull(tenant, 0, 100)).changes]
    titles = sorted(r.title for r in feed if isinstance(r, Session))
    assert titles == ["laptop", "phone"]  # the laptop's edit survives, as the fork


async def _bare_row(conn: Any, schema: str, tenant: Tenant, record: Message) -> None:
    """A row of ``records`` under ``record``'s id with no feed entry and a one-byte body (which
    no build writes): a write's check of the ids it takes for new, shown."""
    await conn.execute(
        f"INSERT INTO {schema}.records (tid, kind, id, chain, body) SELECT t.tid, $3, $4, "
        f"(SELECT c.n FROM {schema}.chains AS c WHERE c.tid = t.tid AND c.session_id = $5), "
        f"'\\x00' FROM {schema}.tenants AS t WHERE t.org_id = $1 AND t.user_id = $2",
        tenant.org_id,
        tenant.user_id,
        KINDS.index(record_kind(record)),
        _pg_key(record.id),
        _pg_key(record.session_id),
    )


async def test_an_optimistic_write_that_finds_an_id_taken_is_undone_whole(
    pg_schema: str, stored_rows: StoredRows
) -> None:
    """Between an optimistic push's read and its write, a row under the id of one of its
    messages appears without a feed entry (no build writes so: every write adds one, which
    the write's check of the head would see; this is the check behind that argument). The
    write (one statement) raises and is undone whole: none of its rows, not its device's
    last_seq, and the push fails retryably (3009), as a locked push whose write lost the same
    race."""
    mine = Device(new_tenant())
    clock = HybridClock(f"server-{uuid7()}")
    s = pg_schema
    # (Its rows read each time: ``known_bytes`` 0. With them known, the push runs again from
    # a read instead: the next test.)
    async with _Between(PG_DSN, schema=s, pool_max=2, known_bytes=0) as store, admin() as conn:
        session = mine.session()
        await store.push(mine.tenant, mine.client_id, mine.changes(session), clock)
        taken = mine.message(session.id)
        batch = mine.changes(mine.message(session.id), taken, mine.event(session.id))

        async def claims() -> None:
            await _bare_row(conn, s, mine.tenant, taken)

        before = await stored_rows(mine.tenant) | {("Message", taken.id)}
        store.between = claims
        with pytest.raises(StorageUnavailable) as raised:
            await store.push(mine.tenant, mine.client_id, batch, clock)
        assert raised.value.code == ErrorCode.STORAGE_UNAVAILABLE and raised.value.retryable
        assert await stored_rows(mine.tenant) == before
        assert (await store.client_state(mine.tenant, mine.client_id))[0] == 1
        assert store.pushes == {"optimistic": 1}  # (the first push; the second raised)


async def test_a_push_served_from_what_is_known_reads_when_an_id_is_not_new(
    pg_schema: str, stored_rows: StoredRows
) -> None:
    """A push served from what the process knows of its tenant takes its records' ids for
    new. When one is not (here a row that appeared without a feed entry, which no build
    writes; or an id the device sends again under a new number), the write refuses it and is
    undone whole, and the push runs again from a read, where the rules see the row: it is
    answered as a read push would answer it, and the row already there is left as it was."""
    mine = Device(new_tenant())
    clock = HybridClock(f"server-{uuid7()}")
    s = pg_schema
    async with _Between(PG_DSN, schema=s, pool_max=2) as store, admin() as conn:
        session = mine.session()
        await store.push(mine.tenant, mine.client_id, mine.changes(session), clock)
        taken = mine.message(session.id)
        fresh = mine.message(session.id)
        batch = mine.changes(fresh, taken, mine.event(session.id))

        async def claims() -> None:
            await _bare_row(conn, s, mine.tenant, taken)

        store.between = claims
        pushed = await store.push(mine.tenant, mine.client_id, batch, clock)
        assert store.pushes == {"optimistic": 2, "known_stale": 1}
        assert [r.status for r in pushed.results][0::2] == ["applied", "applied"]
        assert (await store.client_state(mine.tenant, mine.client_id))[0] == 4
        rows = await stored_rows(mine.tenant)
        assert {("Message", fresh.id), ("Message", taken.id)} <= rows
        body = await conn.fetchval(f"SELECT body FROM {s}.records WHERE id = $1", _pg_key(taken.id))
        assert bytes(body) == b"\x00"  # (left as it was: the push did not write over it)


async def test_what_a_process_knows_of_a_tenant_is_bounded() -> None:
    """``known_bytes`` bounds what the process keeps: the least recently pushed tenants go
    first, a tenant whose rows would take more than an eighth of it is not kept, and 0 keeps
    nothing (every push reads)."""
    clock = HybridClock(f"server-{uuid7()}")
    async with scratch_schema() as s, pg_store(s, known_bytes=8_000) as store:
        devices = [Device(new_tenant()) for _ in range(12)]
        for dev in devices:
            session = dev.session(title="t" * 100)
            await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
        kept = list(store._known)
        assert 0 < len(kept) < len(devices)
        assert kept == [d.tenant for d in devices[-len(kept) :]]  # the latest, in order
        assert store._known_total == sum(k.size() for k in store._known.values()) <= 8_000
        big = Device(new_tenant())
        session = big.session(title="x" * 1_000)
        await store.push(big.tenant, big.client_id, big.changes(session), clock)
        assert big.tenant not in store._known
        # The latest tenant's next push is served from what is known; an unknown one reads.
        again = devices[-1]
        edit = again.edit(session_of(await store.pull(again.tenant, 0, 10)), title="u")
        before = dict(store.pushes)
        await store.push(again.tenant, again.client_id, again.changes(edit), clock)
        assert store.pushes["known"] == before.get("known", 0) + 1
        store.known_bytes = 0  # (kept no more from the next push on: then every push reads)
        for title in ("v", "w"):
            edit = again.edit(edit, title=title)
            await store.push(again.tenant, again.client_id, again.changes(edit), clock)
            assert again.tenant not in store._known
        assert store.pushes["optimistic"] == before["optimistic"] + 1


async def test_two_devices_of_a_tenant_pushing_in_turn_are_served_from_what_is_known(
    pg_schema: str,
) -> None:
    """A laptop and a phone of one user each write their own session, in turn (as
    ``bench_live``'s devices do). A push that reads keeps what the process knew of the other
    device (both exact at the head it read), so after each session's creation every push is
    served from what is known; and every turn of both is in the feed."""
    tenant = new_tenant()
    devices = [Device(tenant), Device(tenant)]
    clock = HybridClock(f"server-{uuid7()}")
    async with pg_store(pg_schema) as store:
        sessions = [d.session(title="start") for d in devices]
        for dev, session in zip(devices, sessions, strict=True):
            await store.push(tenant, dev.client_id, dev.changes(session), clock)
        sent: set[str] = set()
        for turn in range(6):
            for i, dev in enumerate(devices):
                sessions[i] = dev.edit(sessions[i], title=f"turn {turn}")
                message = dev.message(sessions[i].id)
                sent.add(message.id)
                records = [message, dev.event(sessions[i].id), sessions[i]]
                pushed = await store.push(tenant, dev.client_id, dev.changes(*records), clock)
                assert {r.status for r in pushed.results} == {"applied"}
        # (Each session's creation reads; every turn after is served from what is known. A
        # read that kept only its own device's rows made every push of the two read.)
        assert store.pushes == {"optimistic": 2, "known": 12}, store.pushes
        feed = [c.record for c in (await store.pull(tenant, 0, 1000)).changes]
    assert {r.id for r in feed if isinstance(r, Message)} == sent


def test_the_server_command_sizes_what_a_process_keeps() -> None:
    """``--known-mib`` sizes ``known_bytes`` (``open_store``; the several-process tests start
    their servers with it); 16 MiB without it; a negative size is refused with a clear error,
    as the command prints it."""
    from pleach_server.cli import CliError, open_store

    default = open_store(PG_DSN)
    assert isinstance(default, PostgresServerStore)
    assert default.known_bytes == DEFAULT_KNOWN_BYTES == 16 << 20
    none = open_store(PG_DSN, known_mib=0)
    assert isinstance(none, PostgresServerStore) and none.known_bytes == 0
    with pytest.raises(CliError, match="known_bytes must be >= 0"):
        open_store(PG_DSN, known_mib=-1)


def session_of(page: Any) -> Session:
    """The one session of a page."""
    (found,) = [c.record for c in page.changes if isinstance(c.record, Session)]
    assert isinstance(found, Session)
    return found


async def test_seeded_interleavings_of_optimistic_pushes_lose_nothing(pg_schema: str) -> None:
    """Generated schedules: three devices of one tenant edit two sessions, each from its own
    view of them (a device sees another's edit only sometimes), and add messages; before a
    push writes, another device's push may run to its end (the hook between an optimistic
    push's read and its write). Whatever the schedule: every push applies, resolves or finds
    superseded each change, every message sent is in the tenant's feed, every conflict's losing version is
    there as its fork, each push's live page starts at the head the push before it left,
    and the schedules did make optimistic pushes go stale."""
    totals: collections.Counter[str] = collections.Counter()
    for seed in range(12):
        totals += await _one_schedule(pg_schema, seed)
    assert totals["stale"] > 0 and totals["optimistic"] > totals["stale"], totals


async def _one_schedule(schema: str, seed: int) -> collections.Counter[str]:
    """One schedule of ``test_seeded_interleavings_of_optimistic_pushes_lose_nothing``."""
    rng = random.Random(seed)
    tenant = new_tenant()
    devices = [Device(tenant) for _ in range(3)]
    clock = HybridClock(f"server-{uuid7()}")
    sessions = [devices[0].session(title=f"s{i}") for i in range(2)]
    views = {d.client_id: {x.id: x for x in sessions} for d in devices}
    messages: set[str] = set()
    results: list[PushResult] = []

    def batch(dev: Device) -> list[Change]:
        view = views[dev.client_id]
        x = view[rng.choice(sorted(view))]
        edit = dev.edit(x, title=f"{seed}-{len(results)}-{rng.random()}")
        view[x.id] = edit
        for other in devices:
            if rng.random() < 0.4:
                views[other.client_id][x.id] = edit
        sent = [dev.message(x.id) for _ in range(rng.randint(0, 3))]
        messages.update(m.id for m in sent)
        records: list[Record] = [edit, *sent]
        rng.shuffle(records)
        return dev.changes(*records)

    async with _Between(PG_DSN, schema=schema, pool_max=3) as store:

        async def push(dev: Device, changes: list[Change]) -> None:
            pushed = await store.push(tenant, dev.client_id, changes, clock)
            # (superseded: an edit that another device's edit built on, committed first)
            assert {r.status for r in pushed.results} <= {"applied", "resolved", "superseded"}
            results.append(pushed)

        await push(devices[0], devices[0].changes(*sessions))
        for _ in range(10):
            dev, other = rng.sample(devices, 2)
            changes = batch(dev)
            if rng.random() < 0.6:
                store.between = functools.partial(push, other, batch(other))
            await push(dev, changes)
            await store._between_read_and_write()  # (if the push did not run it)
        feed = [c.record for c in (await store.pull(tenant, 0, 1000)).changes]
        pushes = store.pushes
    assert {r.id for r in feed if isinstance(r, Message)} >= messages, seed
    forks = {r.conflict.fork_session_id for p in results for r in p.results if r.conflict}
    assert {r.id for r in feed if isinstance(r, Session)} >= forks, seed
    # (In commit order, each live page begins at the head the push before it left.)
    ordered = sorted(results, key=lambda p: p.head_cursor)
    for before, after in itertools.pairwise(ordered):
        assert after.previous_head in (None, before.head_cursor), seed
    return pushes


async def test_a_delete_racing_many_pushers_leaves_no_content(
    pg_schema: str, stored_rows: StoredRows
) -> None:
    """6 devices push turns into one session on their own pool connections while another
    deletes it. One pusher's batch is written and held open (tenant lock taken) until every
    other push, the delete included, waits on the lock; then everything runs to the end.
    Whatever the order, no content of the session is left, rows or feed, and nothing is
    rejected: content committed before the delete goes with it, content after it drains."""
    pushers, batches = 6, 5
    tenant = new_tenant()
    owner = Device(tenant)
    session = owner.session()
    armed, held, release = False, asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        held.set()
        await release.wait()

    def wrap(tx: StoreTx) -> StoreTx:
        first = armed and not held.is_set()
        return Hooked(tx, after_cursors=hold if first else None)

    clock = HybridClock(f"server-{uuid7()}")
    async with pg_store(pg_schema, wrap, pool_max=pushers + 2) as store, admin() as conn:
        await store.push(tenant, owner.client_id, owner.changes(session), clock)
        armed = True

        async def pusher() -> list[list[str]]:
            dev = Device(tenant)
            outcomes = []
            for i in range(batches):
                batch = dev.changes(
                    dev.message(session.id, f"{i}"),
                    dev.checkpoint(session.id),
                    dev.artifact(session.id),
                    dev.event(session.id, i=i),
                    dev.audit(session.id),
                )
                outcomes.append(statuses(await store.push(tenant, dev.client_id, batch, clock)))
            return outcomes

        async def everyone_waits_on_the_lock() -> bool:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                "AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
                store.application_name,
            )
            return bool(waiting == pushers)  # the other pushers and the delete

        async with asyncio.timeout(60):
            pushing = asyncio.gather(*(pusher() for _ in range(pushers)))
            await held.wait()
            deleting = asyncio.create_task(
                store.push(tenant, owner.client_id, owner.changes(tombstone(owner, session)), clock)
            )
            await wait_until(everyone_waits_on_the_lock, "every push to wait on the tenant lock")
            release.set()
            outcomes = [o for per_device in await pushing for o in per_device]
            deleted = await deleting

    assert statuses(deleted) == ["applied"]
    for outcome in outcomes:
        assert outcome[:3] in (["applied"] * 3, ["superseded"] * 3), outcome
        assert outcome[3:] == ["applied"] * 2
    assert ["applied"] * 5 in outcomes  # at least the held batch came before the delete
    assert ["superseded"] * 3 + ["applied"] * 2 in outcomes  # and some after it
    async with pg_store(pg_schema) as store:
        feed = await pull_all(store, tenant)
    assert not [c for c in feed if record_kind(c.record) in CASCADE_KINDS]
    assert not {kind for kind, _ in await stored_rows(tenant)} & set(CASCADE_KINDS)
    events = [c.record for c in feed if isinstance(c.record, Event)]
    assert len(events) == pushers * batches and verify_chain(events).ok


# -- notifications -----------------------------------------------------------------------------


async def test_push_notifies_at_commit_and_never_on_rollback(pg_schema: str) -> None:
    dev = Device(new_tenant())
    session = dev.session()
    clock = HybridClock(f"server-{uuid7()}")
    heard: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def listener(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
        heard.put_nowait(json.loads(payload))

    def fail_third_write(tx: StoreTx) -> StoreTx:
        return FaultyTx(tx, fail_at=3)

    async with admin() as conn:
        await conn.add_listener(NOTIFY_CHANNEL, listener)
        try:
            batch = dev.changes(session, dev.message(session.id), dev.message(session.id))
            async with pg_store(pg_schema, fail_third_write) as faulty:
                with pytest.raises(InjectedFault):
                    await faulty.push(dev.tenant, dev.client_id, batch, clock)
            async with pg_store(pg_schema) as store:
                result = await store.push(dev.tenant, dev.client_id, batch, clock)
                dup = await store.push(dev.tenant, dev.client_id, batch, clock)
                assert statuses(dup) == ["duplicate"] * 3
                marker = await store.push(
                    dev.tenant, dev.client_id, dev.changes(dev.message(session.id)), clock
                )
            async with asyncio.timeout(TIMEOUT):
                mine = [await heard.get()]
                while mine[-1]["to"] != marker.head_cursor:
                    mine.append(await heard.get())
            mine = [n for n in mine if n["org"] == dev.tenant.org_id]
            assert mine == [
                {
                    "schema": pg_schema,
                    "org": dev.tenant.org_id,
                    "user": dev.tenant.user_id,
                    "from": result.cursors[0] - 1,
                    "to": result.cursors[-1],
                    "server": clock.client_id,
                },
                {
                    "schema": pg_schema,
                    "org": dev.tenant.org_id,
                    "user": dev.tenant.user_id,
                    "from": marker.cursors[0] - 1,
                    "to": marker.cursors[0],
                    "server": clock.client_id,
                },
            ]  # nothing for the rolled-back push, nothing for the duplicate one
        finally:
            await conn.remove_listener(NOTIFY_CHANNEL, listener)


# -- PostgreSQL going away ---------------------------------------------------------------------


async def terminate_backends(application_name: str) -> int:
    async with admin() as conn:
        rows = await conn.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            application_name,
        )
    return sum(1 for r in rows if r[0])


async def test_terminated_backends_give_3009_then_the_pool_recovers(pg_schema: str) -> None:
    """pg_terminate_backend on every connection of the store while a push is mid-transaction:
    that push fails with a retryable 3009, the retry succeeds on a fresh connection."""
    dev = Device(new_tenant())
    session = dev.session()
    clock = HybridClock(f"server-{uuid7()}")
    hold = False
    reached, release = asyncio.Event(), asyncio.Event()

    async def stall() -> None:
        if hold:
            reached.set()
            await release.wait()

    def wrap(tx: StoreTx) -> StoreTx:
        return Hooked(tx, after_cursors=stall)

    async with pg_store(pg_schema, wrap, pool_min=2, pool_max=4) as store:
        message = dev.message(session.id)
        before = await store.push(dev.tenant, dev.client_id, dev.changes(session, message), clock)
        assert statuses(before) == ["applied", "applied"]

        batch = dev.changes(dev.message(session.id), dev.event(session.id))
        hold = True
        inflight = asyncio.create_task(store.push(dev.tenant, dev.client_id, batch, clock))
        await reached.wait()  # mid-transaction: cursors allocated, nothing committed
        hold = False
        assert await terminate_backends(store.application_name) == 2  # busy and idle
        release.set()
        with pytest.raises(StorageUnavailable) as info:
            await inflight
        assert info.value.code == ErrorCode.STORAGE_UNAVAILABLE and info.value.retryable

        # Nothing of the failed batch committed; the device retries the same batch.
        assert await store.client_state(dev.tenant, dev.client_id) == (2, before.head_cursor)
        retried = await store.push(dev.tenant, dev.client_id, batch, clock)
        assert statuses(retried) == ["applied", "applied"] and retried.last_seq == 4
        feed = await pull_all(store, dev.tenant)
        assert [c.record.id for c in feed] == [session.id, message.id] + [
            c.record.id for c in batch
        ]
        assert [c.cursor for c in feed] == before.cursors + retried.cursors
        assert await store.healthy()


class TcpProxy:
    """A loopback TCP proxy in front of PostgreSQL that can go down and come back on the
    same port: a stand-in for a database restart that disturbs nobody else's sessions."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        """Refuse new connections and cut every open one (both ends see a reset)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._pipes):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._pipes.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._pipes.discard(dst)
            dst.transport.abort()


async def test_database_outage_gives_3009_and_the_store_reconnects_by_itself(
    pg_schema: str,
) -> None:
    """The database goes away (connections cut, new ones refused) and comes back: pushes in
    between fail with a retryable 3009, the device retries, nothing is lost or doubled."""
    host, port = "127.0.0.1", 5432
    proxy = TcpProxy(host, port)
    await proxy.up()
    dsn = PG_DSN.replace(f"{host}:{port}", f"{host}:{proxy.port}")
    assert dsn != PG_DSN
    dev = Device(new_tenant())
    session = dev.session()
    clock = HybridClock(f"server-{uuid7()}")
    store = PostgresServerStore(dsn, schema=pg_schema, connect_timeout=2, acquire_timeout=5)
    try:
        async with store:
            first = await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
            assert statuses(first) == ["applied"]

            await proxy.down()
            pending = dev.changes(dev.message(session.id), dev.message(session.id))
            for _ in range(3):  # every attempt during the outage: 3009, retryable
                with pytest.raises(StorageUnavailable) as info:
                    await store.push(dev.tenant, dev.client_id, pending, clock)
                assert info.value.retryable
            assert not await store.healthy()
            with pytest.raises(StorageUnavailable):
                await store.pull(dev.tenant, 0, 10)

            await proxy.up()  # the database is back: the pool reconnects on its own
            retried = await store.push(dev.tenant, dev.client_id, pending, clock)
            assert statuses(retried) == ["applied", "applied"]
            again = await store.push(dev.tenant, dev.client_id, pending, clock)
            assert statuses(again) == ["duplicate", "duplicate"]
            assert await store.healthy()
            feed = await pull_all(store, dev.tenant)
            assert [c.record.id for c in feed] == [session.id] + [c.record.id for c in pending]
            assert await store.client_state(dev.tenant, dev.client_id) == (
                3,
                retried.head_cursor,
            )
    finally:
        await proxy.down()


# -- timeouts, options, lifecycle ---------------------------------------------------------------


async def test_statement_timeout_covers_a_wait_on_the_tenant_lock(pg_schema: str) -> None:
    tenant = new_tenant()
    a, b = Device(tenant), Device(tenant)
    reached, release = asyncio.Event(), asyncio.Event()

    async def stall() -> None:
        reached.set()
        await release.wait()

    def wrap(tx: StoreTx) -> StoreTx:
        return Hooked(tx, after_cursors=None if reached.is_set() else stall)

    clock = HybridClock(f"server-{uuid7()}")
    async with pg_store(pg_schema, wrap, statement_timeout_ms=200) as store:
        holder = asyncio.create_task(
            store.push(tenant, a.client_id, a.changes(a.message(uuid7())), clock)
        )
        await reached.wait()
        waiting = b.changes(b.message(uuid7()))
        with pytest.raises(StorageUnavailable) as info:
            await store.push(tenant, b.client_id, waiting, clock)
        assert info.value.retryable and "QueryCanceled" in info.value.message
        release.set()
        assert statuses(await holder) == ["applied"]
        retried = await store.push(tenant, b.client_id, waiting, clock)
        assert statuses(retried) == ["applied"]


async def test_pool_options_reach_the_server(pg_schema: str) -> None:
    async with pg_store(pg_schema, pool_min=2, pool_max=3, statement_timeout_ms=1234) as store:
        async with admin() as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                store.application_name,
            )
        assert count == 2  # pool_min connections, opened at start
        pool = store._pool
        async with pool.acquire() as conn:
            assert await conn.fetchval("SHOW statement_timeout") == "1234ms"
            assert await conn.fetchval("SHOW application_name") == store.application_name
        assert pool.get_max_size() == 3


async def test_feed_retention_and_pull_limit(pg_schema: str) -> None:
    clock = HybridClock("server")
    dev = Device(new_tenant())
    session = dev.session()
    async with pg_store(pg_schema, feed_retention=3, max_pull_limit=2) as store:
        pushed = await store.push(
            dev.tenant,
            dev.client_id,
            dev.changes(session, *(dev.message(session.id) for _ in range(4))),
            clock,
        )
        page = await store.pull(dev.tenant, pushed.cursors[1], 500)
        assert [c.cursor for c in page.changes] == pushed.cursors[2:4] and page.more
        with pytest.raises(CursorTooOld):
            await store.pull(dev.tenant, pushed.cursors[0], 10)
        with pytest.raises(ValueError):
            await store.pull(dev.tenant, 0, 0)


async def test_lifecycle_and_unreachable_database(pg_schema: str) -> None:
    store = pg_store(pg_schema)
    assert not await store.healthy()
    with pytest.raises(InvalidState):
        await store.head_cursor(new_tenant())
    async with store:
        assert await store.healthy()
        with pytest.raises(InvalidState):
            await store.open()
    assert not await store.healthy()
    await store.close()  # idempotent

    nowhere = PostgresServerStore("postgresql://postgres@127.0.0.1:1/test", connect_timeout=2)
    with pytest.raises(StorageUnavailable) as info:
        await nowhere.open()
    assert info.value.retryable and "127.0.0.1:1/test" in info.value.message
    assert not await nowhere.healthy()


def test_bad_parameters_and_lock_keys() -> None:
    for kwargs in (
        {"feed_retention": 0},
        {"max_pull_limit": 0},
        {"pool_min": 3, "pool_max": 2},
        {"schema": "Robert'); DROP TABLE students;--"},
        {"statement_timeout_ms": -1},
    ):
        with pytest.raises(ValueError):
            PostgresServerStore(PG_DSN, **kwargs)
    t = Tenant(org_id="o", user_id="u")
    assert tenant_lock_key("pleach", t) == tenant_lock_key(
        "pleach", Tenant(org_id="o", user_id="u")
    )
    assert tenant_lock_key("pleach", t) != tenant_lock_key("other", t)
    assert tenant_lock_key("pleach", t) != tenant_lock_key(
        "pleach", Tenant(org_id="ou", user_id="")
    )
    assert -(2**63) <= tenant_lock_key("pleach", t) < 2**63
    assert redact_dsn("postgresql://alice:s3cret@db.example:6543/prod") == "db.example:6543/prod"


async def schema_at(conn: Any, s: str, version: int) -> None:
    """Create schema ``s`` as a build at ``version`` left it (its migrations, in order)."""
    from pleach_server.store import postgres as module

    await conn.execute(f"CREATE SCHEMA {s}")
    await conn.execute(
        f"CREATE TABLE {s}.schema_migrations (version integer PRIMARY KEY, "
        "applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for number, statements in enumerate(module._MIGRATIONS[:version], start=1):
        for statement in statements:
            if isinstance(statement, str):
                await conn.execute(statement.format(s=s))
            else:  # a backfill
                await statement(conn, s)
        await conn.execute(f"INSERT INTO {s}.schema_migrations VALUES ($1)", number)


async def text_rows(
    conn: Any,
    s: str,
    tenant: Tenant,
    *,
    sessions: Iterable[Session] = (),
    messages: Iterable[Message] = (),
    events: Iterable[Event] = (),
    feed: Iterable[tuple[str, Record]] = (),
    feed_bodies: bool = False,
) -> list[int]:
    """Rows as the schemas before 9 kept them (tenants, kinds and ids as text) in schema ``s``:
    the sessions, the messages (each under its session), the events (places 1, 2, ...) and
    the feed entries (with a copy of each body: ``feed_bodies``, before 6); their cursors."""
    from shared.records import encode_record

    t = (tenant.org_id, tenant.user_id)
    await conn.executemany(
        f"INSERT INTO {s}.sessions (id, org_id, user_id, updated_at, body) "
        "VALUES ($1, $2, $3, $4, $5)",
        [(x.id, *t, x.updated_at, encode_record(x)) for x in sessions],
    )
    await conn.executemany(
        f"INSERT INTO {s}.records (kind, id, org_id, user_id, session_id, body) "
        "VALUES ('Message', $1, $2, $3, $4, $5)",
        [(m.id, *t, m.session_id, encode_record(m)) for m in messages],
    )
    await conn.executemany(
        f"INSERT INTO {s}.events (id, session_id, sequence_number, org_id, user_id, "
        "row_hash, body) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        [
            (e.id, e.session_id, number, *t, e.row_hash, encode_record(e))
            for number, e in enumerate(events, start=1)
        ],
    )
    cursors = []
    for kind, record in feed:
        row = [*t, kind, record.id, *([encode_record(record)] if feed_bodies else [])]
        cursor = await conn.fetchval(
            f"INSERT INTO {s}.feed (org_id, user_id, kind, record_id"
            f"{', body' if feed_bodies else ''}) "
            f"VALUES ({', '.join(f'${n}' for n in range(1, len(row) + 1))}) RETURNING cursor",
            *row,
        )
        cursors.append(int(cursor))
    return cursors


async def test_schema_3_migrates_to_tenant_scoped_ids() -> None:
    """A schema at version 3 (ids unique across tenants) keeps its rows through migration 4,
    and they are found by their new keys."""

    alice, bob = Device(new_tenant()), Device(new_tenant())
    session = alice.session(title="before the upgrade")
    message = alice.message(session.id)
    t = (alice.tenant.org_id, alice.tenant.user_id)
    async with scratch_schema() as s:
        async with admin() as conn:
            await schema_at(conn, s, 3)
            await text_rows(
                conn, s, alice.tenant, sessions=[session], messages=[message],
                feed=[("Session", session), ("Message", message)], feed_bodies=True,
            )  # fmt: skip
            await conn.execute(
                f"INSERT INTO {s}.clients VALUES ($1, $2, $3, 2)", *t, alice.client_id
            )

        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (3, SCHEMA_VERSION)
        clock = HybridClock("server-x")
        async with pg_store(s) as store:
            feed = (await store.pull(alice.tenant, 0, 10)).changes
            assert [c.record for c in feed] == [session, message]
            again = await store.push(
                alice.tenant, alice.client_id, alice.changes(session, message), clock
            )
            assert [r.status for r in again.results] == ["duplicate", "duplicate"]
            theirs = await store.push(
                bob.tenant, bob.client_id, bob.changes(bob.session(id=session.id)), clock
            )
            assert [r.status for r in theirs.results] == ["applied"]
            assert (await store.pull(alice.tenant, 0, 10)).changes == feed


async def test_schema_4_migrates_with_every_audit_row_placed() -> None:
    """Audit rows stored before the server kept their places (schema 4) are placed by
    migration 5: a row that continues a chain applies, one that leaves a hole is refused."""
    from shared.records import encode_record

    dev = Device(new_tenant())
    session = dev.session()
    rows = [dev.audit(session.id) for _ in range(3)]
    t = (dev.tenant.org_id, dev.tenant.user_id)
    async with scratch_schema() as s:
        async with admin() as conn:
            await schema_at(conn, s, 4)
            for row in rows:
                await conn.execute(
                    f"INSERT INTO {s}.records (kind, id, org_id, user_id, session_id, body) "
                    "VALUES ('AuditRow', $1, $2, $3, $4, $5)",
                    row.id, *t, session.id, encode_record(row),
                )  # fmt: skip
        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (4, SCHEMA_VERSION)
        clock = HybridClock("server-x")
        async with pg_store(s) as store:
            hole = chain_audit(dev.audit(session.id), "f" * 64, 5)
            refused = await store.push(dev.tenant, dev.client_id, dev.changes(hole), clock)
            assert [r.code for r in refused.results] == [ErrorCode.CHAIN_BROKEN]
            assert refused.results[0].chain_sequence == 3
            assert refused.results[0].chain_hash == rows[-1].row_hash
            dev.next_seq -= 1
            dev.audit_head = (3, rows[-1].row_hash)
            after = await store.push(
                dev.tenant, dev.client_id, dev.changes(dev.audit(session.id)), clock
            )
            assert [r.status for r in after.results] == ["applied"]


async def test_schema_5_migrates_to_a_feed_that_refers_to_its_records() -> None:
    """A feed that held a copy of every body, and every version of a session (schema 5),
    keeps one entry per record after migration 6, each read from its row."""

    dev = Device(new_tenant())
    v1 = dev.session(title="v1")
    message = dev.message(v1.id)
    v2 = dev.edit(v1, title="v2", message_ids=[message.id])
    event = dev.event(v1.id)
    async with scratch_schema() as s:
        async with admin() as conn:
            await schema_at(conn, s, 5)
            cursors = await text_rows(
                conn, s, dev.tenant, sessions=[v2], messages=[message], events=[event],
                feed=[("Session", v1), ("Message", message), ("Session", v2), ("Event", event)],
                feed_bodies=True,
            )  # fmt: skip

        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (5, SCHEMA_VERSION)
        clock = HybridClock("server-x")
        async with pg_store(s) as store:
            feed = await pull_all(store, dev.tenant)
            assert [(c.cursor, c.record) for c in feed] == list(
                zip(cursors[1:], [message, v2, event], strict=True)
            )
            later = await store.push(
                dev.tenant, dev.client_id, dev.changes(dev.message(v1.id)), clock
            )
            assert later.cursors[0] > cursors[-1]
        async with admin() as conn:
            columns = await conn.fetch(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = $1 AND table_name = 'feed' ORDER BY ordinal_position",
                s,
            )
            assert [c[0] for c in columns] == ["cursor", "kind", "record_id", "tid"]


async def test_a_push_is_two_statements_whatever_its_size(pg_schema: str) -> None:
    """A push is two statements, however many changes it carries, and no transaction: its
    read (the device's last_seq, the tenant's head and every lookup of the batch, one
    snapshot) and its write (``push_write``: the lock, the check that neither moved, the
    tables, the feed rows and the notice to the other processes, committed as one
    statement). Each is a round trip to the database; the head after the feed rows is their
    last cursor, not another query. The first push of a device the process meets numbers
    its stamp node first (``add_node``, one statement of its own, once). A push whose
    device's last_seq is not the one it expects (a resend after a lost ack) runs locked:
    BEGIN, the lock with the last_seq and the lookups, the lookups again (for the last_seq
    found), the write, COMMIT."""
    clock = HybridClock("server-x")
    async with pg_store(pg_schema, pool_min=1, pool_max=1) as store:
        statements: list[str] = []
        async with store._pool.acquire() as conn:
            conn.add_query_logger(lambda record: statements.append(record.query))
        runs = []
        for size in (1, 1, 200):  # the first push also has asyncpg look up the types
            dev = Device(new_tenant())
            session = dev.session()
            records = [session, *(dev.message(session.id) for _ in range(size))]
            records += [dev.event(session.id), dev.audit(session.id)]
            statements.clear()
            result = await store.push(dev.tenant, dev.client_id, dev.changes(*records), clock)
            assert {r.status for r in result.results} == {"applied"}
            assert result.head_cursor == max(r.cursor or 0 for r in result.results)
            runs.append(list(statements))
        sql = store._sql
        assert runs[1:] == [[sql.add_node, sql.push_read, sql.push_write]] * 2
        assert store.pushes == {"optimistic": 3}
        # The last device sends its first change again with a new one (its ack was lost):
        # its last_seq is past what the push expects, so it runs locked.
        again = dev.changes(dev.message(session.id))
        statements.clear()
        first = Change(client_seq=1, record=records[0])
        result = await store.push(dev.tenant, dev.client_id, [first, *again], clock)
        assert [r.status for r in result.results] == ["duplicate", "applied"]
        verbs = [q.split()[0].upper().rstrip(";") for q in statements]
        assert statements[0] == store._sql.push_read
        assert verbs.index("COMMIT") - verbs.index("BEGIN") - 1 == 3
        assert store.pushes == {"optimistic": 3, "resent": 1}


async def test_keys_are_converted_alike_in_python_and_in_sql(pg_schema: str) -> None:
    """``_pg_key`` (a push's rows) and ``pleach_key`` (lookups, migration 9) give one key per
    id, no two ids share one, no key but a UUID's is 16 bytes, and ``_pg_id`` reads it back;
    ``pleach_kind`` numbers the kinds as ``KINDS`` does."""
    ids = [
        uuid7(),
        uuid7().upper(),  # not canonical: kept as its text
        "",
        "a",
        "x" * 14,
        "x" * 15,  # 15 bytes: behind two marks, so not 16 bytes long
        "x" * 16,
        "\u00ff" + "x" * 13,  # 15 bytes in UTF-8
        "session-" + "é" * 4,
        "01234567-89ab-cdef-0123-456789abcdeg",  # 36 characters, no UUID
    ]
    async with pg_store(pg_schema), admin() as conn:
        in_sql = [await conn.fetchval(f"SELECT {pg_schema}.pleach_key($1)", i) for i in ids]
        kinds = [await conn.fetchval(f"SELECT {pg_schema}.pleach_kind($1)", k) for k in KINDS]
    keys = [_pg_key(i) for i in ids]
    assert keys == [bytes(k) for k in in_sql]
    assert len(set(keys)) == len(ids)
    assert [len(k) == 16 for k in keys] == [True] + [False] * (len(ids) - 1)
    assert [_pg_id(k) for k in keys] == ids
    assert kinds == list(range(len(KINDS)))


async def test_bodies_and_row_hashes_are_kept_alike_in_python_and_in_sql(pg_schema: str) -> None:
    """``compact.short_body`` keeps a message's, a checkpoint's and an event's body without its row's ids
    when both are UUIDs, and without its tenant, and ``prev_apart`` an event's without its
    prev_hash too; ``pleach_whole`` (every statement that reads a body) gives back its bytes
    exactly, given the row's keys, the tenant and the prev_hash; any other body (another
    kind, an id that is no UUID, a body already whole) is kept and read as it is. The
    tenant is named by text or by UUIDs. ``_pg_hash`` (a push's rows) and migration 15's SQL
    keep a row hash alike, 32 bytes for a digest alone, one value per text, and
    ``_pg_hash_text`` reads it back."""
    for tenant in (new_tenant(), Tenant(org_id=uuid7(), user_id=uuid7())):
        await _bodies_alike(pg_schema, tenant)
    digest = hashlib.sha256(b"row").hexdigest()
    hashes = [
        digest,
        digest.upper(),
        "",
        "h",
        "x" * 31,
        "x" * 32,
        "x" * 33,
        "é" * 16,
        "provisional",
    ]
    async with admin() as conn:
        kept = _HASH_SQL.replace("row_hash", "$1::text").format()
        in_sql = [bytes(await conn.fetchval(f"SELECT {kept}", h)) for h in hashes]
    assert [_pg_hash(h) for h in hashes] == in_sql
    assert [len(k) == 32 for k in in_sql] == [True] + [False] * (len(hashes) - 1)
    assert len(set(in_sql)) == len(hashes)
    assert [_pg_hash_text(k) for k in in_sql] == hashes


@pytest.mark.parametrize("seed", range(3))
async def test_generated_bodies_are_put_together_alike_in_python_and_in_sql(
    pg_schema: str, seed: int
) -> None:
    """Over generated messages, checkpoints, events and audit rows (texts of any length and
    script, tenants and devices by text or by UUIDs), every form a push keeps
    (``short_body`` with and without the device's stamp node, ``prev_apart``) is given back
    by ``pleach_whole`` byte for byte, as ``compact._whole`` gives it; and a body with any
    one byte changed or cut short reads in SQL as ``compact._whole`` reads it where it is a
    form the store writes, else as its bytes are (nothing errs)."""
    rng = random.Random(seed)
    rows: list[tuple[bytes, bytes, bytes, bytes, bytes, bytes | None]] = []
    expected: list[bytes] = []
    written = set()
    for _ in range(150):
        uuids = rng.random() < 0.5
        tenant = Tenant(
            org_id=uuid7() if uuids else "org-" + "ü" * rng.randrange(40),
            user_id=uuid7() if uuids else "user-" + "x" * rng.randrange(300),
        )
        dev, session_id = Device(tenant, uuid7() if rng.random() < 0.5 else None), uuid7()
        text = "".join(rng.choice("ab é漢\n") for _ in range(rng.randrange(600)))
        prev = rng.randbytes(32)
        kind = rng.choice(["message", "checkpoint", "event", "audit"])
        if kind == "event":
            placed = msgspec.structs.replace(
                dev.event(session_id, text=text),
                sequence_number=rng.randrange(2, 1 << 40),
                prev_hash=prev.hex(),
            )
            record: Record = msgspec.structs.replace(
                placed, row_hash=link(prev.hex(), event_digest(placed))
            )
        elif kind == "checkpoint":
            record = dev.checkpoint(session_id, appended=[uuid7() for _ in range(rng.randrange(9))])
        elif kind == "audit":
            record = dev.audit(session_id)
        else:
            record = dev.message(session_id, text)
        body = compact.encode(record)
        key, session_key, tenant_bytes = (
            _pg_key(record.id),
            _pg_key(session_id),
            packed_tenant(tenant),
        )
        node = compact.stamp_node(dev.client_id)
        stored = compact.short_body(body, key, session_key, tenant_bytes)
        noded = compact.short_body(body, key, session_key, tenant_bytes, node)
        forms = [stored, compact.prev_apart(stored, prev), noded, compact.prev_apart(noded, prev)]
        if kind == "audit":
            assert stored is body and noded[:2] == SHORT + b"\x02"
            forms = [noded]
        else:
            assert forms[0][:2] == SHORT + b"\x00" and forms[2][:2] == SHORT + b"\x01"
            assert (kind != "event") == (forms[1] is forms[0]) == (forms[3] is forms[2])
        for form in forms:
            written.add(form[:2])
            rows.append((form, key, session_key, tenant_bytes, node, prev))
            expected.append(body)
            at = rng.randrange(len(form))
            for mutated in (form[:at], form[:at] + bytes((rng.randrange(256),)) + form[at + 1 :]):
                ids = compact.packed(record.id), compact.packed(session_id)
                whole = compact._whole(mutated, *ids, tenant_bytes, node, prev)
                read = len(mutated) >= 4 and mutated[:1] == SHORT
                read = read and (0x90 <= mutated[1] <= 0x9D or mutated[1] in (0, 1, 2, 16, 17))
                if read and mutated[1] in (16, 17):
                    tail = mutated[-36:-33] == b"\xc7\x20\x02" and mutated[-1:] in (
                        b"\xc2",
                        b"\xc3",
                    )
                    if len(mutated) - 35 - tail < (4 if mutated[1] == 16 else 17):
                        read = False  # (too short for its form: SQL reads it as it is)
                rows.append((mutated, key, session_key, tenant_bytes, node, prev))
                expected.append(whole if read and whole is not None else mutated)
    assert written == {SHORT + bytes((form,)) for form in (0, 1, 2, 16, 17)}
    async with pg_store(pg_schema), admin() as conn:
        got = await conn.fetch(
            f"SELECT {pg_schema}.pleach_whole(b, k, sk, t, nd, p), {pg_schema}.pleach_digest(b) "
            "FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bytea[], $5::bytea[], "
            "$6::bytea[]) WITH ORDINALITY AS u (b, k, sk, t, nd, p, n) ORDER BY n",
            *(list(column) for column in zip(*rows, strict=True)),
        )
    assert [bytes(r[0]) for r in got] == expected
    # The row hash an event's body ends with (version 16), read alike from every form and
    # from every mutation of one: the store keeps none in the column where they agree.
    digests = [r[1] and bytes(r[1]) for r in got]
    assert digests == [chain_digest(row[0]) for row in rows]
    assert sum(d is not None for d in digests) > len(rows) // 6  # (the events' forms)


async def test_the_statements_that_read_bodies_inline_pleach_whole(pg_schema: str) -> None:
    """A pull and a delete's cascade read every body through ``pleach_whole``, which
    PostgreSQL inlines into the statement only when each argument is a column or a
    parameter and the functions it calls inline too: called instead, it took about 0.1 ms a
    row (a pull of one turn's page twice the time). The plans name none of the functions."""
    async with pg_store(pg_schema) as store, admin() as conn:
        sql = store._sql
        for query, args in (
            (sql.pull, ("org-1", "user-1", 0, 10, 1 << 20, b"")),
            (sql.cascade_candidates, ("org-1", "user-1", [b"\0" * 16], [1], b"")),
        ):
            rows = await conn.fetch(f"EXPLAIN (VERBOSE, COSTS OFF) {query}", *args)
            plan = "\n".join(r[0] for r in rows)
            for function in ("pleach_whole", "pleach_head", "pleach_cut", "pleach_digest"):
                assert function not in plan, plan


async def _bodies_alike(s: str, tenant: Tenant) -> None:
    """``test_bodies_and_row_hashes_are_kept_alike_in_python_and_in_sql`` for ``tenant``."""
    dev, session_id = Device(tenant), uuid7()
    prev = hashlib.sha256(b"before").hexdigest()
    placed = msgspec.structs.replace(
        dev.event(session_id, note="x" * 70), sequence_number=2, prev_hash=prev
    )
    event = msgspec.structs.replace(placed, row_hash=link(prev, event_digest(placed)))
    records = [
        dev.message(session_id),
        dev.message(session_id, "é" * 300),
        dev.checkpoint(session_id, parent_id=uuid7(), appended=[uuid7()]),
        dev.event(session_id, note="x" * 70),
        event,
        dev.audit(session_id),  # (a store that knows the device's stamp node shortens it)
        dev.session(),
        dev.message("session-as-text"),
        dev.message(session_id, id="message-as-text"),
        dev.artifact(session_id),
    ]
    tenant_bytes = packed_tenant(tenant)
    node = compact.stamp_node(dev.client_id)
    shorter, forms = [], []
    async with pg_store(s), admin() as conn:
        whole = f"SELECT {s}.pleach_whole($1, $2, $3, $4, $5, $6)"
        for record in records:
            body = compact.encode(record)
            session = kind_of(record).session_of(record)
            key, session_key = _pg_key(record.id), None if session is None else _pg_key(session)
            args = (key, session_key, tenant_bytes)
            short = compact.short_body(body, key, session_key, tenant_bytes)
            # (and without the stamp node of the device that pushed it: version 16)
            noded = compact.short_body(body, key, session_key, tenant_bytes, node)
            shorter.append((len(body) - len(short), len(short) - len(noded)))
            forms.append(noded[:2])
            for stored in (short, noded, body):
                assert bytes(await conn.fetchval(whole, stored, *args, node, None)) == body
            if record is event:  # and without its prev_hash, given the row before's hash
                given = bytes.fromhex(prev)
                for stored in (short, noded):
                    apart = compact.prev_apart(stored, given)
                    assert len(apart) == len(stored) - 35
                    assert bytes(await conn.fetchval(whole, apart, *args, node, given)) == body
    assert [n >= 35 + len(tenant_bytes) - 2 for n, _ in shorter] == [True] * 5 + [False] * 5
    assert [n >= len(node) - 3 for _, n in shorter] == [True] * 6 + [False] * 4
    assert forms == [SHORT + b"\x01"] * 5 + [SHORT + b"\x02"] + [f[:2] for f in forms[6:]]


async def test_an_event_leaves_out_the_prev_hash_the_row_before_it_keeps(pg_schema: str) -> None:
    """An event is stored without its prev_hash where the row before it in its session keeps
    it as its row hash: a row of the same push or of an earlier one (the first event of a
    session, after the chain's start, keeps it); every pull gives the events whole, chained
    as the server placed them, and the bodies are the same bytes as the pushes' own."""
    dev = Device(new_tenant())
    clock = HybridClock("server-x")
    async with pg_store(pg_schema) as store:
        session = dev.session(title="chained")
        first = [session, *(dev.event(session.id, n=i) for i in range(3))]
        pushed = [await store.push(dev.tenant, dev.client_id, dev.changes(*first), clock)]
        later = [dev.event(session.id, n=3), dev.message(session.id), dev.event(session.id)]
        pushed.append(await store.push(dev.tenant, dev.client_id, dev.changes(*later), clock))
        feed = await pull_all(store, dev.tenant)
        again = await pull_all(store, dev.tenant, feed[1].cursor)
        raw = await store.pull(dev.tenant, 0, 100, raw=True)
    events = [c.record for c in feed if isinstance(c.record, Event)]
    assert [e.sequence_number for e in events] == [1, 2, 3, 4, 5]
    assert all(b.prev_hash == a.row_hash for a, b in itertools.pairwise(events))
    assert [c.record for c in again] == [c.record for c in feed[2:]]
    as_pushed = {
        c.cursor: bytes(b)
        for p in pushed
        for c, b in zip(p.feed, p.bodies, strict=True)
        if not isinstance(c.record, Session)
    }
    assert len(as_pushed) == 6
    assert {b.cursor: bytes(b.body) for b in raw.bodies if b.cursor in as_pushed} == as_pushed
    async with admin() as conn:
        forms = [
            bytes(r[0])[:2]
            for r in await conn.fetch(
                f"SELECT e.body FROM {pg_schema}.events AS e JOIN {pg_schema}.tenants AS t "
                "ON t.tid = e.tid WHERE t.org_id = $1 AND t.user_id = $2 "
                "ORDER BY e.sequence_number",
                dev.tenant.org_id,
                dev.tenant.user_id,
            )
        ]
    # (each also without the pushing device's stamp node: 1 and 17, since version 16)
    assert forms == [SHORT + b"\x01"] + [SHORT + b"\x11"] * 4


async def test_schema_14_migrates_to_short_bodies_and_row_hashes_as_bytes() -> None:
    """Rows a schema 14 store wrote (whole bodies, row hashes as hex text, an entry in the
    feed for every record and event, the feed keyed by cursor beside its index by tenant)
    read as before after migration 15: each tenant's pull gives the same records under the
    same cursors, a session's events and a device's audit rows chain on from the row hashes
    kept, the rows written after keep short bodies and 32-byte hashes, and the feed holds
    sessions' entries alone, keyed by tenant and cursor."""
    clock = HybridClock("server-x")
    async with scratch_schema() as s:
        h = await history_as_schema(s, clock, as_schema_14)
        alice = h.alice
        async with admin() as conn:
            bodies = await conn.fetch(
                f"SELECT body FROM {s}.records UNION ALL SELECT body FROM {s}.events"
            )
            assert bodies and all(bytes(b)[:1] != SHORT for (b,) in bodies)
        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (14, SCHEMA_VERSION) == (14, 18)
        async with pg_store(s) as store:
            await assert_pulled_as_placed(store, h)
            later = [alice.message(h.session.id), alice.event(h.session.id)]
            later.append(alice.audit(h.session.id))
            pushed = await store.push(alice.tenant, alice.client_id, alice.changes(*later), clock)
            assert statuses(pushed) == ["applied"] * 3
            feed = await pull_all(store, alice.tenant)
        events = [c.record for c in feed if isinstance(c.record, Event)]
        chain = [e for e in events if e.session_id == h.session.id]
        assert [e.sequence_number for e in chain] == [1, 2]
        assert chain[1].prev_hash == chain[0].row_hash
        assert verify_chain(sorted(audit_rows(feed), key=lambda r: r.sequence_number)).ok
        async with admin() as conn:
            rows = {
                _pg_id(r[0]): (bytes(r[1]), r[2] and bytes(r[2]))
                for r in await conn.fetch(f"SELECT id, body, row_hash FROM {s}.events")
            }
            new = rows.pop(chain[1].id)
            # (the row before it, written by schema 14, keeps its prev_hash: 17, tenant and
            # stamp node out; its row hash read from its body since version 16, the rows
            # before keep theirs)
            assert new[0][:2] == SHORT + b"\x11" and new[1] is None
            assert chain_digest(new[0]) == bytes.fromhex(chain[1].row_hash)
            assert all(body[:1] != SHORT and len(digest) == 32 for body, digest in rows.values())
            assert (await index_def(conn, s, "feed_pkey")).endswith("(tid, cursor)")
            indexes = await conn.fetch(
                "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'feed'", s
            )
            assert {r[0] for r in indexes} == {"feed_pkey", "feed_session"}
            kinds = await conn.fetch(f"SELECT DISTINCT kind FROM {s}.feed")
            assert [r[0] for r in kinds] == [KINDS.index("Session")]  # (records: their own)


async def test_schema_15_migrates_to_row_hashes_read_from_bodies() -> None:
    """Rows a schema 15 store wrote (every event's row hash in its column, the records keyed
    kind first) read as before after migration 16: each tenant's pull gives the same records
    under the same cursors, a session's events chain on from the row hash an old row keeps
    in its column, an event written after keeps none there (its body ends with it), and the
    records are keyed in id order."""
    clock = HybridClock("server-x")
    async with scratch_schema() as s:
        h = await history_as_schema(s, clock, as_schema_15)
        alice = h.alice
        async with admin() as conn:
            held = await conn.fetchval(f"SELECT count(*) FROM {s}.events WHERE row_hash IS NULL")
            assert held == 0
        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (15, SCHEMA_VERSION) == (15, 18)
        async with pg_store(s) as store:
            await assert_pulled_as_placed(store, h)
            later = [alice.event(h.session.id), alice.event(h.session.id)]
            pushed = await store.push(alice.tenant, alice.client_id, alice.changes(*later), clock)
            assert statuses(pushed) == ["applied"] * 2
            feed = await pull_all(store, alice.tenant)
        chain = [c.record for c in feed if isinstance(c.record, Event)]
        chain = [e for e in chain if e.session_id == h.session.id]
        assert [e.sequence_number for e in chain] == [1, 2, 3]
        assert all(b.prev_hash == a.row_hash for a, b in itertools.pairwise(chain))
        async with admin() as conn:
            kept = {
                _pg_id(r[0]): r[1]
                for r in await conn.fetch(
                    f"SELECT id, row_hash FROM {s}.events WHERE tid = "
                    f"(SELECT tid FROM {s}.tenants WHERE org_id = $1)",
                    alice.tenant.org_id,
                )
            }
            assert kept[chain[0].id] == bytes.fromhex(chain[0].row_hash)
            assert kept[chain[1].id] is None and kept[chain[2].id] is None
            assert (await index_def(conn, s, "records_pkey")).endswith("(tid, id, kind)")


async def test_a_session_is_numbered_once_by_the_push_that_first_files_under_it() -> None:
    """A session's chain (schema 18) is made by the push that files its first record or event
    under it, whichever comes first, and found by every push after, which takes no number of
    the sequence; its rows read back whole, and its events chain on."""
    dev = Device(new_tenant())
    clock = HybridClock(f"server-{uuid7()}")
    first, second = dev.session(), dev.session()
    async with scratch_schema() as s, pg_store(s) as store, admin() as conn:

        async def numbers() -> tuple[int, int]:
            made = await conn.fetchval(f"SELECT count(*) FROM {s}.chains")
            taken = await conn.fetchval(f"SELECT last_value FROM {s}.chains_n_seq WHERE is_called")
            return int(made), int(taken or 0)

        pushes = [
            [first, dev.message(first.id)],  # (a record first)
            [dev.event(first.id), dev.event(first.id), dev.audit(first.id)],
            [second, dev.event(second.id), dev.message(second.id)],  # (an event first)
            [dev.message(first.id), dev.event(second.id), dev.checkpoint(second.id)],
        ]
        seen = []
        for records in pushes:
            pushed = await store.push(dev.tenant, dev.client_id, dev.changes(*records), clock)
            assert statuses(pushed) == ["applied"] * len(records)
            seen.append(await numbers())
        assert seen == [(1, 1), (1, 1), (2, 2), (2, 2)]
        feed = await pull_all(store, dev.tenant)
    assert sorted(c.record.id for c in feed) == sorted(r.id for p in pushes for r in p)
    kept = (Message, Checkpoint, AuditRow)  # (an event is placed by the server)
    assert {c.record.id: c.record for c in feed if isinstance(c.record, kept)} == {
        r.id: r for p in pushes for r in p if isinstance(r, kept)
    }
    for session in (first, second):
        chain = [
            c.record
            for c in feed
            if isinstance(c.record, Event) and c.record.session_id == session.id
        ]
        assert [e.sequence_number for e in chain] == list(range(1, len(chain) + 1))
        assert all(b.prev_hash == a.row_hash for a, b in itertools.pairwise(chain))


async def test_the_layout_check_finds_a_chain_astray_and_a_tail_astray() -> None:
    """The simulation's check of a PostgreSQL store's layout (``postgres_layout_problems``)
    finds nothing in a store this build wrote, then, each made by hand, a record whose chain
    is another tenant's session (a body read back whole would name it) and an audit chain's
    last place that names no audit row (a push would chain on from a row that is not there)."""
    from tests.sim.invariants import postgres_layout_problems

    clock = HybridClock(f"server-{uuid7()}")
    async with scratch_schema() as s, pg_store(s) as store, admin() as conn:
        h = await placed_history(store, clock)
        bob = h.bob
        pushed = await store.push(
            bob.tenant, bob.client_id, bob.changes(bob.message(h.session.id)), clock
        )
        assert statuses(pushed) == ["applied"]
        assert await postgres_layout_problems(store) == []
        alice_tid = f"(SELECT tid FROM {s}.tenants WHERE org_id = $1 AND user_id = $2)"
        await conn.execute(
            f"UPDATE {s}.records SET chain = (SELECT c.n FROM {s}.chains AS c "
            f"WHERE c.tid <> {alice_tid} LIMIT 1) WHERE ctid = (SELECT ctid FROM {s}.records "
            f"WHERE tid = {alice_tid} AND chain IS NOT NULL LIMIT 1)",
            h.alice.tenant.org_id,
            h.alice.tenant.user_id,
        )
        await conn.execute(f"UPDATE {s}.audit_tails SET id = '\\x00'::bytea")
        found = await postgres_layout_problems(store)
    assert sorted(p.split(" ")[0] for p in found) == ["session-astray:", "tail-astray:"], found


async def test_schema_17_migrates_to_audit_tails_and_session_chains() -> None:
    """Audit places a schema 17 store kept (one a row) become one a chain after migration
    18, its last: a row at the next place of each device's chain applies, one that leaves a
    hole is refused with the chain's last place; of two rows at that place (which a device
    of protocol 2 or earlier leaves) the one of the greater id is the tail, before the
    migration and after. Events and records named their session by its id; after it, by its
    number in ``chains``: each tenant's pull gives the same records under the same cursors,
    and the rows written after go on in the same chains."""
    clock = HybridClock("server-x")
    async with scratch_schema() as s:
        async with pg_store(s) as store:
            h = await placed_history(store, clock)
            alice, bob = h.alice, h.bob
            other = Device(alice.tenant)
            for dev, count in ((alice, 2), (other, 1), (bob, 2)):
                rows = [dev.audit(h.session.id) for _ in range(count)]
                pushed = await store.push(dev.tenant, dev.client_id, dev.changes(*rows), clock)
                assert statuses(pushed) == ["applied"] * count
            place, prev = alice.audit_head
            last = alice.audit(h.session.id)
            twin = chain_audit(alice.audit(h.session.id), prev, place + 1)
            pushed = await store.push(alice.tenant, alice.client_id, alice.changes(last), clock)
            unchecked = await store.push(
                alice.tenant, alice.client_id, alice.changes(twin), clock, chains=False
            )
            assert statuses(pushed) == statuses(unchecked) == ["applied"]
            tail = max(last, twin, key=lambda r: _pg_key(r.id))
            alice.audit_head = (tail.sequence_number, tail.row_hash)
            assert await tail_of(store, alice) == alice.audit_head
            before = [await pull_all(store, d.tenant) for d in (alice, bob)]
        async with admin() as conn:
            await as_schema_17(conn, s, (alice.tenant, bob.tenant))
            places = await conn.fetchval(f"SELECT count(*) FROM {s}.audit_places")
            assert places == 3 + 1 + 2 + 1 + 1  # (the history's row, and the twin)
        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (17, SCHEMA_VERSION) == (17, 18)
        async with pg_store(s) as store:
            assert [await pull_all(store, d.tenant) for d in (alice, bob)] == before
            hole = chain_audit(alice.audit(h.session.id), "f" * 64, place + 3)
            refused = await store.push(alice.tenant, alice.client_id, alice.changes(hole), clock)
            assert codes(refused) == [ErrorCode.CHAIN_BROKEN]
            assert (refused.results[0].chain_sequence, refused.results[0].chain_hash) == (
                tail.sequence_number,
                tail.row_hash,
            )
            alice.next_seq -= 1
            alice.audit_head = (tail.sequence_number, tail.row_hash)
            for dev in (alice, other, bob):
                pushed = await store.push(
                    dev.tenant, dev.client_id, dev.changes(dev.audit(h.session.id)), clock
                )
                assert statuses(pushed) == ["applied"], dev.client_id
                assert await tail_of(store, dev) == dev.audit_head
        async with admin() as conn:
            assert await conn.fetchval(f"SELECT count(*) FROM {s}.audit_tails") == 3
            assert await conn.fetchval(f"SELECT count(*) FROM {s}.chains") == 3
            assert await index_def(conn, s, "events_place") == (
                f"CREATE UNIQUE INDEX events_place ON {s}.events USING btree "
                "(chain, sequence_number)"
            )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["dev-a", "dev-b", "dev-c"]), st.integers(1, 6)),
        max_size=12,
    )
)
def test_a_batch_moves_each_audit_chain_to_its_greatest_place(places: list[Any]) -> None:
    """``_audit_tails`` gives one row a device: of the batch's rows of its chain, the one at
    the greatest place, and of two there the greater id (as ``audit_tails`` orders them)."""
    dev = Device(new_tenant())
    rows = [
        msgspec.structs.replace(dev.audit("s"), client_id=client, sequence_number=number)
        for client, number in places
    ]
    devices, numbers, digests, ids = _audit_tails(rows)
    assert len(set(devices)) == len(devices) == len({r.client_id for r in rows})
    for client, number, digest, key in zip(devices, numbers, digests, ids, strict=True):
        best = max((r for r in rows if r.client_id == client), key=lambda r: (
            r.sequence_number, _pg_key(r.id)
        ))  # fmt: skip
        assert (number, key, digest) == (
            best.sequence_number, _pg_key(best.id), _pg_hash(best.row_hash)
        )  # fmt: skip


async def tail_of(store: PostgresServerStore, dev: Device) -> tuple[int, str]:
    """The last place of ``dev``'s audit chain, as a push reads it (``_Sql.audit_tail``)."""
    async with admin() as conn:
        found = await conn.fetchrow(
            store._sql.audit_tail, dev.tenant.org_id, dev.tenant.user_id, dev.client_id
        )
    assert found is not None
    return int(found[0]), _pg_hash_text(bytes(found[1]))


async def history_as_schema(
    s: str, clock: HybridClock, undo: Callable[[Any, str, Iterable[Tenant]], Awaitable[None]]
) -> PlacedHistory:
    """``placed_history`` written into schema ``s`` by this build, then taken back for its
    two tenants to what an earlier version kept by ``undo`` (``as_schema_15``...)."""
    async with pg_store(s) as store:
        h = await placed_history(store, clock)
    async with admin() as conn:
        await undo(conn, s, (h.alice.tenant, h.bob.tenant))
    return h


async def assert_pulled_as_placed(store: PostgresServerStore, h: PlacedHistory) -> None:
    """Each tenant of ``h`` pulls the records ``placed_history`` placed, under their cursors."""
    assert [(c.cursor, c.record) for c in await pull_all(store, h.alice.tenant)] == h.before
    assert [(c.cursor, c.record) for c in await pull_all(store, h.bob.tenant)] == h.theirs


async def index_def(conn: Any, s: str, name: str) -> str:
    """The definition of the index ``name`` of schema ``s``."""
    found = await conn.fetchval(
        "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index AS i "
        "JOIN pg_class AS c ON c.oid = i.indexrelid JOIN pg_namespace AS n "
        "ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2",
        s,
        name,
    )
    return str(found)


def audit_rows(feed: list[Any]) -> list[AuditRow]:
    """The audit rows of ``feed``'s changes."""
    return [c.record for c in feed if isinstance(c.record, AuditRow)]


async def test_schema_8_migrates_ids_to_keys_and_kinds_to_numbers() -> None:
    """Rows a schema 8 store wrote (ids and kinds as text, UUIDs and other ids alike) are read
    after migration 9 as before, under the same cursors, and a push finds them by their ids."""

    dev = Device(new_tenant())
    session = dev.session(title="s", id="session-15chars")  # 15 characters: two marks
    uuid_message = dev.message(session.id)
    text_message = dev.message(session.id, id="message-16-chars")
    session = dev.edit(session, message_ids=[uuid_message.id, text_message.id])
    event = dev.event(session.id)
    async with scratch_schema() as s:
        async with admin() as conn:
            await schema_at(conn, s, 8)
            entries = (
                ("Message", uuid_message),
                ("Message", text_message),
                ("Session", session),
                ("Event", event),
            )
            cursors = await text_rows(
                conn, s, dev.tenant, sessions=[session], messages=[uuid_message, text_message],
                events=[event], feed=entries,
            )  # fmt: skip

        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (8, SCHEMA_VERSION)
        async with pg_store(s) as store:
            feed = await pull_all(store, dev.tenant)
            assert [(c.cursor, c.record) for c in feed] == list(
                zip(cursors, [r for _, r in entries], strict=True)
            )
            # Found by their ids: the session (not claimed as new), a message id already held.
            again = await store.push(
                dev.tenant,
                dev.client_id,
                dev.changes(dev.edit(session, title="t"), text_message),
                HybridClock("server-x"),
            )
            assert [r.status for r in again.results] == ["applied", "duplicate"]
        async with admin() as conn:
            types = await conn.fetch(
                "SELECT table_name, column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = $1 AND column_name IN ('id', 'session_id', 'record_id', "
                "'kind') ORDER BY table_name, column_name",
                s,
            )
        assert {(r[0], r[1]): r[2] for r in types} == {
            ("audit_tails", "id"): "bytea",
            ("chains", "session_id"): "bytea",
            ("events", "id"): "bytea",
            ("feed", "kind"): "smallint",
            ("feed", "record_id"): "bytea",
            ("records", "id"): "bytea",
            ("records", "kind"): "smallint",
            ("sessions", "id"): "bytea",
            ("session_ids", "id"): "bytea",
        }


async def as_schema_17(conn: Any, s: str, tenants: Iterable[Tenant]) -> None:
    """Take schema ``s`` back to what version 17 kept (migration 18 undone) for ``tenants``'
    rows: every audit row's place in ``audit_places`` (read from the rows' bodies), no
    ``audit_tails``; events and records with their session's id (``events_place`` and
    ``records_tenant`` by it), no ``chains``. (The columns' order differs from a schema
    made at 17; the functions stay: migration 18 makes ``lock_last_seq_load`` again
    whatever it was.)"""
    await conn.execute(
        f"CREATE TABLE {s}.audit_places (client_id text NOT NULL, sequence_number bigint "
        "NOT NULL, row_hash bytea NOT NULL, id bytea NOT NULL, tid integer NOT NULL, "
        "PRIMARY KEY (tid, client_id, sequence_number, id))"
    )
    for tenant in tenants:
        rows = await conn.fetch(
            f"SELECT r.tid, {s}.pleach_whole(r.body, r.id, "
            f"(SELECT session_id FROM {s}.chains WHERE n = r.chain), $1, "
            f"(SELECT node FROM {s}.nodes WHERE n = r.device), NULL) FROM {s}.records AS r "
            f"WHERE r.tid = (SELECT tid FROM {s}.tenants WHERE org_id = $2 AND user_id = $3) "
            "AND r.kind = $4",
            packed_tenant(tenant),
            tenant.org_id,
            tenant.user_id,
            KINDS.index("AuditRow"),
        )
        audit = [(number, decode_body(bytes(body))) for number, body in rows]
        assert all(isinstance(row, AuditRow) for _, row in audit)
        await conn.executemany(
            f"INSERT INTO {s}.audit_places (client_id, sequence_number, row_hash, id, tid) "
            "VALUES ($1, $2, $3, $4, $5)",
            [
                (r.client_id, r.sequence_number, _pg_hash(r.row_hash), _pg_key(r.id), number)
                for number, r in audit
                if isinstance(r, AuditRow)
            ],
        )
    await conn.execute(
        f"DROP TABLE {s}.audit_tails; "
        + "".join(
            f"ALTER TABLE {s}.{table} ADD COLUMN session_id bytea; "
            f"UPDATE {s}.{table} AS r SET session_id = c.session_id FROM {s}.chains AS c "
            "WHERE c.n = r.chain; "
            for table in ("events", "records")
        )
        + f"ALTER TABLE {s}.events ALTER COLUMN session_id SET NOT NULL, "
        "DROP CONSTRAINT events_place, "
        "ADD CONSTRAINT events_place UNIQUE (tid, session_id, sequence_number), "
        "DROP COLUMN chain; "
        f"ALTER TABLE {s}.records DROP COLUMN chain; "
        f"CREATE INDEX records_tenant ON {s}.records (tid, session_id); "
        f"DROP TABLE {s}.chains; " + f"DELETE FROM {s}.schema_migrations WHERE version >= 18"
    )


async def as_schema_15(conn: Any, s: str, tenants: Iterable[Tenant]) -> None:
    """Take schema ``s`` back to what version 15 kept (migration 16 undone) for ``tenants``'
    rows: every event's row hash in its column, the records keyed kind first, no body
    without its stamp node (such a body whole again, as rows written before 15 are), no
    ``nodes``. (``lock_last_seq_load`` stays: migration 16 makes it again whatever it
    was.)"""
    await as_schema_17(conn, s, tenants)
    for tenant in tenants:
        t = f"(SELECT tid FROM {s}.tenants WHERE org_id = $2 AND user_id = $3)"
        args = (packed_tenant(tenant), tenant.org_id, tenant.user_id)
        for table in ("records", "events"):
            await conn.execute(
                f"UPDATE {s}.{table} AS r SET body = {s}.pleach_whole(r.body, r.id, "
                f"r.session_id, $1, (SELECT node FROM {s}.nodes WHERE n = r.device), NULL) "
                f"WHERE r.tid = {t} AND r.device IS NOT NULL",
                *args,
            )
    await conn.execute(
        f"UPDATE {s}.events SET row_hash = {s}.pleach_digest(body) WHERE row_hash IS NULL; "
        f"ALTER TABLE {s}.events ALTER COLUMN row_hash SET NOT NULL; "
        f"ALTER TABLE {s}.records DROP CONSTRAINT records_pkey, "
        "ADD PRIMARY KEY (tid, kind, id); "
        f"ALTER TABLE {s}.records DROP COLUMN device; "
        f"ALTER TABLE {s}.events DROP COLUMN device; "
        f"DROP TABLE {s}.nodes; "
        f"DROP FUNCTION {s}.pleach_digest; "
        f"DROP FUNCTION {s}.pleach_whole; " + _PLEACH_WHOLE.format(s=s) + "; "
        f"DELETE FROM {s}.schema_migrations WHERE version >= 16"
    )


async def as_schema_14(conn: Any, s: str, tenants: Iterable[Tenant]) -> None:
    """Take schema ``s`` back to what version 14 kept (migrations 16 and 15 undone) for
    ``tenants``' rows: whole bodies, row hashes as hex text, an entry in the feed for every
    record and event (at the cursor it keeps), the feed keyed by cursor with its index by
    tenant. (The functions stay: migration 15 makes ``lock_last_seq_load`` again whatever
    it was.)"""
    await as_schema_15(conn, s, tenants)
    for tenant in tenants:
        t = f"(SELECT tid FROM {s}.tenants WHERE org_id = $2 AND user_id = $3)"
        args = (packed_tenant(tenant), tenant.org_id, tenant.user_id)
        await conn.execute(
            f"UPDATE {s}.records SET body = {s}.pleach_whole(body, id, session_id, $1, NULL) "
            f"WHERE tid = {t}",
            *args,
        )
        await conn.execute(
            f"UPDATE {s}.events AS e SET body = {s}.pleach_whole(body, id, session_id, $1, "
            f"(SELECT p.row_hash FROM {s}.events AS p WHERE p.tid = e.tid "
            "AND p.session_id = e.session_id AND p.sequence_number = e.sequence_number - 1)) "
            f"WHERE tid = {t}",
            *args,
        )
    await conn.execute(
        f"INSERT INTO {s}.feed (cursor, tid, kind, record_id) OVERRIDING SYSTEM VALUE "
        f"SELECT cursor, tid, kind, id FROM {s}.records WHERE cursor IS NOT NULL "
        f"UNION ALL SELECT cursor, tid, {KINDS.index('Event')}, id FROM {s}.events "
        "WHERE cursor IS NOT NULL; "
        f"DROP INDEX {s}.records_cursor; "
        f"DROP INDEX {s}.events_cursor; "
        f"ALTER TABLE {s}.events ALTER COLUMN row_hash TYPE text "
        "USING encode(row_hash, 'hex'); "
        f"ALTER TABLE {s}.audit_places ALTER COLUMN row_hash TYPE text "
        "USING encode(row_hash, 'hex'); "
        f"ALTER TABLE {s}.feed DROP CONSTRAINT feed_pkey, ADD PRIMARY KEY (cursor); "
        f"CREATE INDEX feed_tenant ON {s}.feed (tid, cursor); "
        f"DROP FUNCTION {s}.pleach_whole; "
        f"DROP FUNCTION {s}.pleach_cut; "
        f"DROP FUNCTION {s}.pleach_head; "
        f"DELETE FROM {s}.schema_migrations WHERE version = 15"
    )


async def test_schema_13_migrates_to_records_that_keep_their_feed_cursor() -> None:
    """Rows a schema 13 store wrote are read as before after migration 14: a record and an
    event keep their feed entry's cursor (NULL where the entry has gone; an immutable
    record's older entry goes), a deleted session's content leaves the feed whole (a record
    written with no cursor, as a process of the build before writes one, too), and later
    pushes keep the rule."""
    clock = HybridClock("server-x")
    async with scratch_schema() as s:
        async with pg_store(s) as store:
            h = await placed_history(store, clock)
        alice, bob, other, first, gone = h.alice, h.bob, h.other, h.first, h.gone
        content = h.content
        before, theirs = h.before, h.theirs
        at = h.at
        async with admin() as conn:  # back to what schema 13 wrote
            await as_schema_14(conn, s, (alice.tenant, h.bob.tenant))
            taken = {r[0] for r in await conn.fetch(f"SELECT cursor FROM {s}.feed")}
            gap = next(c for c in range(1, max(at.values())) if c not in taken)  # renamed's
            await conn.execute(
                f"ALTER TABLE {s}.records DROP COLUMN cursor; "
                f"ALTER TABLE {s}.events DROP COLUMN cursor; "
                f"DROP INDEX {s}.feed_session; "
                f"CREATE INDEX feed_record ON {s}.feed (tid, kind, record_id, cursor); "
                f"DELETE FROM {s}.schema_migrations WHERE version = 14"
            )
            await conn.execute(f"DELETE FROM {s}.feed WHERE cursor = $1", at[gone.id])
            await conn.execute(  # an older entry of the first message, as none since 7 writes
                f"INSERT INTO {s}.feed (cursor, tid, kind, record_id) OVERRIDING SYSTEM VALUE "
                f"SELECT $1, tid, kind, record_id FROM {s}.feed WHERE cursor = $2",
                gap,
                at[first.id],
            )
        result = await migrate(PG_DSN, s)
        assert (result.from_version, result.to_version) == (13, SCHEMA_VERSION)
        kept = [(c, r) for c, r in before if r.id != gone.id]
        async with pg_store(s) as store:
            assert [(c.cursor, c.record) for c in await pull_all(store, alice.tenant)] == kept
            assert [(c.cursor, c.record) for c in await pull_all(store, bob.tenant)] == theirs
            async with admin() as conn:
                rows = await conn.fetch(
                    f"SELECT id, cursor FROM {s}.records UNION ALL "
                    f"SELECT id, cursor FROM {s}.events"
                )
                places = {_pg_id(r[0]): r[1] for r in rows}
                assert not await conn.fetchval(
                    f"SELECT count(*) FROM {s}.feed WHERE cursor = $1", gap
                )
            assert places.pop(gone.id) is None
            assert places == {r.id: c for c, r in kept if not isinstance(r, Session)}
            async with admin() as conn:  # as a process of the build before writes a record
                await conn.execute(
                    f"UPDATE {s}.records SET cursor = NULL WHERE id = $1", _pg_key(content[0].id)
                )
            tomb = tombstone(alice, other)
            deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
            assert [r.status for r in deleted.results] == ["applied"]
            after = await pull_all(store, alice.tenant)  # no entry is left without its row
            assert not {c.record.id for c in after} & {r.id for r in content}
            later = await store.push(
                alice.tenant, alice.client_id, alice.changes(alice.message(h.session.id)), clock
            )
        async with admin() as conn:
            (cursor,) = later.cursors
            assert await conn.fetchval(f"SELECT max(cursor) FROM {s}.records") == cursor
            # (since schema 15 a record and an event are their own entries: the feed holds
            # sessions' alone)
            kinds = await conn.fetch(f"SELECT DISTINCT kind FROM {s}.feed")
            assert [r[0] for r in kinds] == [KINDS.index("Session")]
            indexes = await conn.fetch(
                "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'feed'", s
            )
            assert {r[0] for r in indexes} == {"feed_pkey", "feed_session"}


@pytest.mark.parametrize("way", ["known", "optimistic", "locked"])
async def test_a_push_and_a_pull_are_planned_once(way: str) -> None:
    """A push's lookups and writes and a pull each run as a generic plan after PostgreSQL's
    five custom ones (``plan_cache_mode = auto``), never planned again at each run. A write
    statement that numbered its cursors from ``generate_series(1, cardinality(...))`` (a
    thousand rows to the planner) and joined three inserts on them was planned anew every
    time, which took a push's write from 0.7 to 1.3 ms. (An optimistic push's write runs
    ``write`` inside ``push_write``, whose plans PL/pgSQL keeps in the same plan cache by the
    same rule; the locked push prepares it itself. An optimistic push's read is planned for
    its arrays each time, which PostgreSQL finds cheaper than a generic plan: measured, the
    read took 0.316 ms a push so and 0.304 ms with ``force_generic_plan``. A push served from
    what the process knows of its tenant reads nothing: the first push alone reads.)"""
    dev = Device(new_tenant())
    clock = HybridClock("server-x")
    async with scratch_schema() as s, pg_store(s, pool_min=1, pool_max=1) as store:
        store.optimistic = way != "locked"
        store.known_bytes = DEFAULT_KNOWN_BYTES if way == "known" else 0
        session = dev.session(title="planned")
        await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
        for i in range(12):
            session = dev.edit(session, title=f"turn {i}")
            turn = [dev.message(session.id), dev.event(session.id), dev.checkpoint(session.id)]
            await store.push(dev.tenant, dev.client_id, dev.changes(session, *turn), clock)
            await store.pull(dev.tenant, 0, 100)
        push = (
            (store._sql.push_read, store._sql.push_write)
            if way != "locked"
            else (store._sql.lock_last_seq_load, store._sql.write)
        )
        async with store._pool.acquire() as conn:
            plans = {
                name: (generic, custom)
                for statement, generic, custom in await conn.fetch(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                )
                for name, sql in (
                    ("lookups", push[0]),
                    ("write", push[1]),
                    ("pull", store._sql.pull),
                )
                if statement == sql
            }
        assert store.pushes == ({"optimistic": 1, "known": 12} if way == "known" else {way: 13})
    assert set(plans) == {"write", "lookups", "pull"}
    for name, (generic, custom) in plans.items():
        if way != "locked" and name == "lookups":
            assert generic + custom == (1 if way == "known" else 13)
            continue
        assert custom <= 5 < generic + custom, f"{name}: {generic} generic, {custom} custom"


async def _scans(store: PostgresServerStore, schema: str) -> dict[str, tuple[int, int]]:
    """Each table's (sequential scans, index scans) so far, the store's own included."""
    async with store._pool.acquire() as conn:
        # (Its counters reach the statistics as the statement ends, before it answers.)
        await conn.execute("SELECT pg_stat_force_next_flush()")
        rows = await conn.fetch(
            "SELECT relname, seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables "
            "WHERE schemaname = $1",
            schema,
        )
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


async def _analyses(schema: str) -> dict[str, int]:
    """How many times each table of ``schema`` was analyzed by a statement (not autovacuum)."""
    async with admin() as conn:
        rows = await conn.fetch(
            "SELECT relname, analyze_count FROM pg_stat_user_tables WHERE schemaname = $1 "
            "AND relname <> 'schema_migrations'",
            schema,
        )
    return {r[0]: int(r[1]) for r in rows}


async def test_a_new_database_analyzes_its_tables_so_pushes_use_the_indexes() -> None:
    """On a new schema the plans a connection keeps after its first pushes were made on empty
    tables: they read ``records`` and ``feed`` whole (measured: a push of nine changes went
    from 4 to 20 ms over the first 2,400). Once the feed passes ``ANALYZE_AT[0]`` the store
    analyzes its tables, which makes every connection plan again: its pushes then read
    ``records`` only by its indexes. Without the analysis (``ANALYZE_AT`` empty) they still
    scan it, each push of nine changes nine times. (Since schema 15 the feed holds sessions'
    entries alone, here one, which a scan reads best.)"""
    clock = HybridClock("server-x")
    async with scratch_schema() as schema:
        async with pg_store(schema, pool_min=1, pool_max=1) as store:  # one connection
            analyses = await _analyses(schema)  # (the migration's, of the empty tables)
            dev = Device(new_tenant())
            session = dev.session()
            await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)

            async def push_nine() -> int:
                changes = dev.changes(*(dev.message(session.id) for _ in range(9)))
                result = await store.push(dev.tenant, dev.client_id, changes, clock)
                assert {r.status for r in result.results} == {"applied"}
                return result.head_cursor

            head = 0
            while head < ANALYZE_AT[0] + 100:  # (its plans made while the tables were small)
                head = await push_nine()
            await store.analyzed()
            after_analysis = await _analyses(schema)
            assert all(after_analysis[t] == analyses[t] + 1 for t in analyses), after_analysis
            before = await _scans(store, schema)
            for _ in range(10):
                await push_nine()
            after = await _scans(store, schema)
            for table in ("records",):
                seq = after[table][0] - before[table][0]
                index = after[table][1] - before[table][1]
                assert (seq, index > 0) == (0, True), (table, seq, index)


def test_analyze_is_due_once_at_each_cursor_the_feed_passes_in_this_process() -> None:
    """``analyze_due``: a cursor is due when a push takes the feed past it, in a process
    that saw the feed before it (one that started past it leaves it to autovacuum), once."""
    first = ANALYZE_AT[0]
    assert analyze_due(0, first - 1, set()) == []
    assert analyze_due(0, first, set()) == [first]
    assert analyze_due(0, first, {first}) == []
    assert analyze_due(first, first * 100, set()) == list(ANALYZE_AT[1:])
    assert analyze_due(0, max(ANALYZE_AT), set()) == list(ANALYZE_AT)
    assert analyze_due(max(ANALYZE_AT), 10 * max(ANALYZE_AT), set()) == []


async def test_a_turn_of_a_long_session_writes_one_block_not_its_whole_list() -> None:
    """At 2,000 ids a session's row holds none of them: they are in 16 blocks of 128 beside
    it. A turn (two more ids) writes a new version of the row and of the one block it
    appended to, and of no other (each row's ``xmin``: the transaction that wrote it)."""
    clock = HybridClock("server-x")
    dev = Device(new_tenant())
    ids = [uuid7() for _ in range(2_002)]
    async with scratch_schema() as s, pg_store(s) as store:

        async def written() -> tuple[int, dict[int, str]]:
            async with admin() as conn:
                size = await conn.fetchval(f"SELECT octet_length(body) FROM {s}.sessions")
                rows = await conn.fetch(f"SELECT part, xmin::text FROM {s}.session_ids")
            return int(size), {int(r[0]): str(r[1]) for r in rows}

        session = dev.session(message_ids=ids[:2_000])
        await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
        size, before = await written()
        assert size < 1_000 and sorted(before) == list(range(16))
        async with admin() as conn:
            body = await conn.fetchval(f"SELECT body FROM {s}.sessions")
        assert bytes(body[:1]) == APART  # (a reader that knows no blocks finds it corrupt)
        session = dev.edit(session, message_ids=ids)
        result = await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
        assert [r.status for r in result.results] == ["applied"]
        _, after = await written()
        assert [p for p in after if after[p] != before[p]] == [15]
        assert [c.record for c in await pull_all(store, dev.tenant)] == [session]
