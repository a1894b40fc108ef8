"""``SQLiteServerStore``: the shared conformance suite, plus what only SQLite has."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import aiosqlite
import msgspec
import pytest

from pleach_server.store import ServerStore, SQLiteServerStore, Tenant
from pleach_server.store import sqlite as server_sqlite
from pleach_server.store.apply import StoreTx
from pleach_server.store.base import APART, decode_session, feed_body, feed_change, packed_tenant
from pleach_server.store.sqlite import SCHEMA_VERSION
from shared import compact
from shared.clock import HybridClock
from shared.compact import uuid_bytes, uuid_text
from shared.errors import CursorTooOld, ErrorCode, InvalidState, StorageError, StorageUnavailable
from shared.idrefs import ID_LAYOUT, rechunked
from shared.ids import uuid7
from shared.records import AuditRow, Event, Session, encode_record
from tests.factories import count_hops
from tests.server_factories import Device, new_tenant
from tests.server_store_conformance import (
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


class _WrappedStore(SQLiteServerStore):
    def __init__(self, path: Path, tx_wrapper: TxWrapper) -> None:
        super().__init__(path)
        self._tx_wrapper = tx_wrapper

    def _wrap_tx(self, tx: StoreTx) -> StoreTx:
        return self._tx_wrapper(tx)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "server.db"


@pytest.fixture
def make_store(db_path: Path) -> MakeStore:
    def make(tx_wrapper: TxWrapper | None = None) -> ServerStore:
        if tx_wrapper is None:
            return SQLiteServerStore(db_path)
        return _WrappedStore(db_path, tx_wrapper)

    return make


@pytest.fixture
async def server_store(db_path: Path) -> AsyncIterator[ServerStore]:
    async with SQLiteServerStore(db_path) as store:
        yield store


@pytest.fixture
def stored_rows(db_path: Path) -> StoredRows:
    async def rows(tenant: Tenant) -> set[tuple[str, str]]:
        t = (tenant.org_id, tenant.user_id)
        async with aiosqlite.connect(db_path) as conn:
            found = await conn.execute_fetchall(
                "WITH t(tid) AS (SELECT tid FROM tenants WHERE org_id = ? AND user_id = ?) "
                "SELECT 'Session', id FROM sessions WHERE tid = (SELECT tid FROM t) "
                "UNION ALL SELECT 'Event', id FROM events WHERE tid = (SELECT tid FROM t) "
                "UNION ALL SELECT kind, id FROM records WHERE tid = (SELECT tid FROM t) "
                "UNION ALL SELECT kind, id FROM messages WHERE tid = (SELECT tid FROM t)",
                t,
            )
        # Schema 8 keeps a kind as its number and a UUID id as its 16 bytes.
        return {
            (
                compact.KINDS[kind] if isinstance(kind, int) else str(kind),
                uuid_text(record_id) if isinstance(record_id, bytes) else str(record_id),
            )
            for kind, record_id in found
        }

    return rows


class TestSQLiteServerStore(ServerStoreConformance):
    pass


class TestSQLiteServerStoreInIdBlocks(ServerStoreConformanceInIdBlocks):
    pass


# -- SQLite only -------------------------------------------------------------------------------


async def test_feed_retention_compacts_on_push(db_path: Path) -> None:
    clock = HybridClock("server")
    dev = Device(new_tenant())
    session = dev.session()
    async with SQLiteServerStore(db_path, feed_retention=3) as store:
        pushed = await store.push(
            dev.tenant,
            dev.client_id,
            dev.changes(session, *(dev.message(session.id) for _ in range(4))),
            clock,
        )
        assert [c.cursor for c in await pull_all(store, dev.tenant, pushed.cursors[1])] == (
            pushed.cursors[2:]
        )
        with pytest.raises(CursorTooOld):
            await store.pull(dev.tenant, pushed.cursors[0], 10)


async def test_pull_limit_is_capped(db_path: Path) -> None:
    clock = HybridClock("server")
    dev = Device(new_tenant())
    session = dev.session()
    async with SQLiteServerStore(db_path, max_pull_limit=2) as store:
        await store.push(
            dev.tenant, dev.client_id, dev.changes(session, dev.message(session.id)), clock
        )
        await store.push(dev.tenant, dev.client_id, dev.changes(dev.message(session.id)), clock)
        page = await store.pull(dev.tenant, 0, 500)
        assert len(page.changes) == 2 and page.more
        with pytest.raises(ValueError):
            await store.pull(dev.tenant, 0, 0)


async def test_sqlite_errors_become_storage_unavailable(db_path: Path) -> None:
    class Broken:
        def __init__(self, inner: StoreTx) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        async def put_session(self, session: Session) -> None:
            raise sqlite3.OperationalError("disk I/O error")

    clock = HybridClock("server")
    dev = Device(new_tenant())
    async with _WrappedStore(db_path, lambda tx: Broken(tx)) as store:  # type: ignore[arg-type, return-value]
        with pytest.raises(StorageUnavailable) as info:
            await store.push(dev.tenant, dev.client_id, dev.changes(dev.session()), clock)
        assert info.value.retryable and info.value.code == ErrorCode.STORAGE_UNAVAILABLE
        assert await store.client_state(dev.tenant, dev.client_id) == (0, 0)
        assert await store.healthy()


async def test_lifecycle(db_path: Path) -> None:
    store = SQLiteServerStore(db_path)
    assert not await store.healthy()
    with pytest.raises(InvalidState):
        await store.head_cursor(new_tenant())
    async with store:
        assert await store.healthy()
        with pytest.raises(InvalidState):
            await store.open()
    assert not await store.healthy()
    await store.close()  # idempotent


async def test_open_migrates_and_refuses_newer_schema(db_path: Path) -> None:
    async with SQLiteServerStore(db_path):
        pass
    async with aiosqlite.connect(db_path) as conn:
        async with conn.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        assert row is not None and row[0] == SCHEMA_VERSION
        async with conn.execute("PRAGMA journal_mode") as cur:
            row = await cur.fetchone()
        assert row is not None and row[0] == "wal"
        await conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        await conn.commit()
    store = SQLiteServerStore(db_path)
    with pytest.raises(StorageError, match="schema version"):
        await store.open()
    assert not await store.healthy()


async def test_unopenable_path_is_storage_unavailable(tmp_path: Path) -> None:
    store = SQLiteServerStore(tmp_path / "missing-dir" / "server.db")
    with pytest.raises(StorageUnavailable):
        await store.open()


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        SQLiteServerStore("x.db", feed_retention=0)
    with pytest.raises(ValueError):
        SQLiteServerStore("x.db", max_pull_limit=0)


async def test_a_transaction_left_open_never_wedges_the_store(tmp_path: Path) -> None:
    """A BEGIN that ran after its caller was cancelled leaves a transaction open on the
    shared connection; the next push and pull still work (and nothing of it is kept)."""
    from shared.clock import HybridClock
    from tests.server_factories import Device, new_tenant

    async with SQLiteServerStore(tmp_path / "s.db", synchronous="NORMAL") as store:
        dev = Device(new_tenant())
        for conn in (store._writer, store._reader):  # as a cancelled BEGIN would leave them
            assert conn is not None
            await conn.execute("BEGIN")
        session = dev.session()
        result = await store.push(dev.tenant, dev.client_id, dev.changes(session), HybridClock("s"))
        assert [r.status for r in result.results] == ["applied"]
        page = await store.pull(dev.tenant, 0, 10)
        assert [c.record.id for c in page.changes] == [session.id]


async def test_schema_3_files_migrate_to_tenant_scoped_ids(db_path: Path) -> None:
    """A server file written before ids were scoped to their tenant (schema 3) keeps every
    row through the migration, and its rows are found by their new keys."""
    from pleach_server.store import sqlite as module
    from shared.records import encode_record

    alice, bob = Device(new_tenant()), Device(new_tenant())
    session = alice.session(title="before the upgrade")
    message = alice.message(session.id)
    with sqlite3.connect(db_path) as conn:
        for statements in module._MIGRATIONS[:3]:
            for statement in statements:
                conn.execute(statement)
        t = (alice.tenant.org_id, alice.tenant.user_id)
        conn.execute(
            "INSERT INTO sessions (id, org_id, user_id, updated_at, body) VALUES (?, ?, ?, ?, ?)",
            (session.id, *t, session.updated_at, encode_record(session)),
        )
        conn.execute(
            "INSERT INTO records (kind, id, org_id, user_id, session_id, body) "
            "VALUES ('Message', ?, ?, ?, ?, ?)",
            (message.id, *t, session.id, encode_record(message)),
        )
        for kind, record in (("Session", session), ("Message", message)):
            conn.execute(
                "INSERT INTO feed (org_id, user_id, kind, record_id, body) VALUES (?, ?, ?, ?, ?)",
                (*t, kind, record.id, encode_record(record)),
            )
        conn.execute(
            "INSERT INTO clients (org_id, user_id, client_id, last_seq) VALUES (?, ?, ?, 2)",
            (*t, alice.client_id),
        )
        conn.execute("PRAGMA user_version = 3")
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path) as store:
        feed = (await store.pull(alice.tenant, 0, 10)).changes
        assert [c.record for c in feed] == [session, message]
        # The device resends: the migrated rows are found (duplicates, nothing doubled).
        again = await store.push(
            alice.tenant, alice.client_id, alice.changes(session, message), clock
        )
        assert [r.status for r in again.results] == ["duplicate", "duplicate"]
        # Another user under the same ids writes in their own namespace.
        theirs = await store.push(
            bob.tenant, bob.client_id, bob.changes(bob.session(id=session.id)), clock
        )
        assert [r.status for r in theirs.results] == ["applied"]
        assert (await store.pull(alice.tenant, 0, 10)).changes == feed
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


_BATCH_LOOKUPS = (
    "_RECORD_OWNERS_SQL",
    "_EVENT_OWNERS_SQL",
    "_SESSION_OWNERS_SQL",
    "_SESSIONS_SQL",
    "_CHAIN_TAILS_SQL",
    "_AUDIT_TAILS_SQL",
    "_CASCADE_CANDIDATES_SQL",
    "_DOOMED_SQL",
    "_DROP_ENTRY_SQL",
    "_DELETE_RECORD_SQL",
)


@pytest.mark.parametrize("name", _BATCH_LOOKUPS)
async def test_a_batch_lookup_reads_each_key_through_an_index(db_path: Path, name: str) -> None:
    """Each key of a push's lookups is found by an index on the key itself, never by walking
    the tenant's rows: a plan that searched on (org_id, user_id) alone made each push cost
    time in proportion to the tenant's whole history."""
    import pleach_server.store.sqlite as server_sqlite

    async with SQLiteServerStore(db_path):
        pass
    sql = getattr(server_sqlite, name)
    conn = sqlite3.connect(db_path)
    conn.create_function("pleach_key", 1, server_sqlite._sql_key, deterministic=True)
    try:
        numbered = [int(n) for n in re.findall(r"\?(\d+)", sql)]
        params = ("[]",) * (max(numbered) if numbered else sql.count("?"))
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
    finally:
        conn.close()
    # The tenant's number is found once per statement, by its (org_id, user_id) key.
    searches = [line for line in plan if line.startswith("SEARCH") and " tenants " not in line]
    assert searches, plan
    assert not any(line.startswith("SCAN") and "VIRTUAL TABLE" not in line for line in plan), plan
    for line in searches:
        constrained = line[line.index("(") + 1 : line.rindex(")")]
        columns = {c.split("=")[0].strip() for c in constrained.split(" AND ")}
        assert columns - {"org_id", "user_id", "tid"}, f"{name}: {line}"


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
async def test_a_small_push_is_one_hop_and_a_large_one_three(
    db_path: Path, synchronous: Literal["NORMAL", "FULL"]
) -> None:
    """A push of at most ``IN_PLACE_MAX_CHANGES`` changes runs its BEGIN, lookups and writes
    on the caller's thread and speaks to the writer connection's thread once, for its COMMIT
    (whose fsync must not hold the event loop); a batch resent whole (a lost ack) writes
    nothing and commits in place: no hop. A larger push speaks to the thread three times,
    however many changes it carries: BEGIN with the device's last_seq, the batch's keys and
    every lookup with the tenant's head; every write with the head after it; COMMIT (two when
    resent). Each hop is a thread handoff that costs more than the SQLite work of a small
    push. What the in-place push wrote is committed: the reader sees it."""
    clock = HybridClock("server-x")
    big = server_sqlite.IN_PLACE_MAX_CHANGES + 1
    async with SQLiteServerStore(db_path, synchronous=synchronous) as store:
        hops = count_hops(store._writer)
        counts = []
        for size in (1, big - 4, big - 3):  # 1 + size + 2 changes: 4, 64 and 65
            dev = Device(new_tenant())
            session = dev.session()
            records = [session, *(dev.message(session.id) for _ in range(size))]
            records += [dev.event(session.id), dev.audit(session.id)]
            changes = dev.changes(*records)
            hops[0] = 0
            result = await store.push(dev.tenant, dev.client_id, changes, clock)
            assert {r.status for r in result.results} == {"applied"}
            counts.append(hops[0])
            pulled = await store.pull(dev.tenant, 0, 1000)
            assert [c.record for c in pulled.changes][-1] == records[-1]
            assert len(pulled.changes) == len(records)
            hops[0] = 0  # the same batch again (a lost ack): every change a duplicate
            again = await store.push(dev.tenant, dev.client_id, changes, clock)
            assert {r.status for r in again.results} == {"duplicate"}
            assert again.head_cursor == result.head_cursor
            counts.append(hops[0])
        assert counts == [1, 0, 1, 0, 3, 2]


async def test_a_push_waits_for_another_process_write_lock_off_the_event_loop(
    db_path: Path,
) -> None:
    """A small push never waits on the caller's thread: with another process's write lock on
    the file, its BEGIN in place is refused at once (busy timeout 0 for that one statement),
    and the transaction is begun on the writer's thread, which waits for the lock while the
    event loop runs on; the push is applied once the lock goes, and the next runs in place."""
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path, busy_timeout_ms=60_000) as store:
        writer = store._writer
        assert writer is not None
        statements: list[str] = []
        writer._conn.set_trace_callback(statements.append)
        on_thread = asyncio.Event()
        execute = writer._execute

        async def watched(fn: Any, *args: Any, **kwargs: Any) -> Any:
            on_thread.set()
            return await execute(fn, *args, **kwargs)

        writer._execute = watched  # type: ignore[method-assign]
        dev = Device(new_tenant())
        session = dev.session()
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            task = asyncio.create_task(
                store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
            )
            await on_thread.wait()  # refused in place; this line runs while the push waits
            assert not task.done()
            assert statements[:3] == [
                "PRAGMA busy_timeout = 0",
                "BEGIN IMMEDIATE",
                "PRAGMA busy_timeout = 60000",
            ]
        finally:
            other.execute("ROLLBACK")
            other.close()
        result = await task
        assert [r.status for r in result.results] == ["applied"]
        assert [c.record for c in (await store.pull(dev.tenant, 0, 10)).changes] == [session]
        writer._execute = execute  # type: ignore[method-assign]
        hops = count_hops(store._writer)
        statements.clear()
        message = dev.message(session.id)
        result = await store.push(dev.tenant, dev.client_id, dev.changes(message), clock)
        assert [r.status for r in result.results] == ["applied"]
        assert hops[0] == 1  # its COMMIT
        assert statements[:2] == ["PRAGMA busy_timeout = 0", "BEGIN IMMEDIATE"]


async def test_the_servers_wal_is_checkpointed_beside_the_writer(db_path: Path) -> None:
    """Every ``CHECKPOINT_EVERY`` write transactions a checkpoint runs on a connection of its
    own, so no push copies the WAL inside its commit (SQLite's own checkpoint stays, at
    ``AUTOCHECKPOINT_PAGES``, as a safety net); close waits for one in flight."""
    clock = HybridClock("server-x")
    every = server_sqlite.CHECKPOINT_EVERY
    dev = Device(new_tenant())
    store = SQLiteServerStore(db_path)
    await store.open()
    try:
        session = dev.session()
        for n in range(every - 1):
            records = [session] if n == 0 else [dev.message(session.id)]
            await store.push(dev.tenant, dev.client_id, dev.changes(*records), clock)
        assert store._checkpoints.running is None
        before = db_path.stat().st_size  # the rows are in the WAL only
        await store.push(dev.tenant, dev.client_id, dev.changes(dev.message(session.id)), clock)
        side = store._checkpoints.running
        assert side is not None
        await side
        assert db_path.stat().st_size > before  # copied into the file, beside the writer
        writer = store._writer
        assert writer is not None
        pages = await writer.execute_fetchall("PRAGMA wal_autocheckpoint")
        assert list(pages) == [(server_sqlite.AUTOCHECKPOINT_PAGES,)]
        for _ in range(every):
            await store.push(dev.tenant, dev.client_id, dev.changes(dev.message(session.id)), clock)
        side = store._checkpoints.running
        assert side is not None and not side.done()
    finally:
        await store.close()
    assert side.done() and store._checkpointer is None
    async with SQLiteServerStore(db_path) as again:  # and the file reads back whole
        feed = (await again.pull(dev.tenant, 0, 1000)).changes
        assert len(feed) == 2 * every


async def test_schema_4_files_migrate_with_every_audit_row_placed(db_path: Path) -> None:
    """Audit rows stored before the server kept their places (schema 4) are placed by
    migration 5: a row that continues a chain applies, one that leaves a hole is refused."""
    from pleach_server.store import sqlite as module
    from shared.errors import ErrorCode
    from shared.hashchain import chain_audit
    from shared.records import encode_record

    dev = Device(new_tenant())
    session = dev.session()
    rows = [dev.audit(session.id) for _ in range(3)]
    with sqlite3.connect(db_path) as conn:
        for statements in module._MIGRATIONS[:4]:
            for statement in statements:
                assert isinstance(statement, str)
                conn.execute(statement)
        t = (dev.tenant.org_id, dev.tenant.user_id)
        for row in rows:
            conn.execute(
                "INSERT INTO records (kind, id, org_id, user_id, session_id, body) "
                "VALUES ('AuditRow', ?, ?, ?, ?, ?)",
                (row.id, *t, session.id, encode_record(row)),
            )
        conn.execute("PRAGMA user_version = 4")
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path) as store:
        hole = chain_audit(dev.audit(session.id), "f" * 64, 5)
        refused = await store.push(dev.tenant, dev.client_id, dev.changes(hole), clock)
        assert [r.code for r in refused.results] == [ErrorCode.CHAIN_BROKEN]
        assert (refused.results[0].chain_sequence, refused.results[0].chain_hash) == (
            3,
            rows[-1].row_hash,
        )
        dev.next_seq -= 1
        dev.audit_head = (3, rows[-1].row_hash)
        after = await store.push(
            dev.tenant, dev.client_id, dev.changes(dev.audit(session.id)), clock
        )
        assert [r.status for r in after.results] == ["applied"]
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("SELECT count(*) FROM audit_places").fetchone()[0] == 4
        # Migration 6 kept every record, now in a rowid table (bodies pack into its pages).
        assert conn.execute("SELECT count(*) FROM records").fetchone()[0] == 4
        (sql,) = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'records'").fetchone()
        assert "WITHOUT ROWID" not in sql.upper()


async def test_schema_6_files_migrate_to_a_feed_that_refers_to_its_records(db_path: Path) -> None:
    """A feed that held a copy of every body, and every version of a session (schema 6), keeps
    one entry per record after migration 7, each read from its row; cursors go on above the
    highest one ever handed out, even one whose entry is gone."""
    from pleach_server.store import sqlite as module
    from shared.records import encode_record

    dev = Device(new_tenant())
    v1 = dev.session(title="v1")
    message = dev.message(v1.id)
    v2 = dev.edit(v1, title="v2", message_ids=[message.id])
    event = dev.event(v1.id)
    gone = dev.message(v1.id)
    t = (dev.tenant.org_id, dev.tenant.user_id)
    with sqlite3.connect(db_path) as conn:
        for statements in module._MIGRATIONS[:6]:
            for statement in statements:
                if isinstance(statement, str):  # a backfill of empty tables writes nothing
                    conn.execute(statement)
        conn.execute(
            "INSERT INTO sessions (id, org_id, user_id, updated_at, body) VALUES (?, ?, ?, ?, ?)",
            (v2.id, *t, v2.updated_at, encode_record(v2)),
        )
        conn.execute(
            "INSERT INTO records (kind, id, org_id, user_id, session_id, body) "
            "VALUES ('Message', ?, ?, ?, ?, ?)",
            (message.id, *t, v1.id, encode_record(message)),
        )
        conn.execute(
            "INSERT INTO events (id, session_id, sequence_number, org_id, user_id, row_hash, "
            "body) VALUES (?, ?, 1, ?, ?, ?, ?)",
            (event.id, v1.id, *t, event.row_hash, encode_record(event)),
        )
        for kind, record in (
            ("Session", v1),
            ("Message", message),
            ("Session", v2),
            ("Event", event),
            ("Message", gone),
        ):
            conn.execute(
                "INSERT INTO feed (org_id, user_id, kind, record_id, body) VALUES (?, ?, ?, ?, ?)",
                (*t, kind, record.id, encode_record(record)),
            )
        conn.execute("DELETE FROM feed WHERE cursor = 5")  # its session's content was deleted
        conn.execute("PRAGMA user_version = 6")
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path) as store:
        feed = await pull_all(store, dev.tenant)
        assert [(c.cursor, c.record) for c in feed] == [(2, message), (3, v2), (4, event)]
        later = await store.push(dev.tenant, dev.client_id, dev.changes(dev.message(v1.id)), clock)
        assert later.cursors == [6]  # not 5: that cursor was handed out before
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        columns = [row[1] for row in conn.execute("PRAGMA table_info(feed)")]
        assert columns == ["tid", "cursor", "kind", "record_id"]  # (by tenant: schema 17)
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(feed)")}
        assert indexes == {"sqlite_autoindex_feed_1", "feed_session"}


async def test_schema_7_files_migrate_to_tenant_numbers_and_id_keys(db_path: Path) -> None:
    """A file of schema 7 (tenants, ids and hashes as text in every row) written by a real
    store keeps every row through migration 8: two tenants' feeds pull the same records under
    the same cursors, a device's last_seq and a compacted floor stay, a resent change is a
    duplicate, the next cursor is above every one handed out, and the ids and hashes are kept
    as their bytes (an id that is no UUID as its text)."""
    from pleach_server.store import sqlite as module

    alice, bob = Device(new_tenant()), Device(new_tenant())
    clock = HybridClock("server-x")
    session = alice.session(title="before the upgrade")
    odd = alice.session(id="not-a-uuid", title="an id that is no UUID")
    message = alice.message(session.id)
    placed = alice.event(session.id)
    event = msgspec.structs.replace(placed, sequence_number=1, prev_hash="", row_hash="ab" * 32)
    audit = alice.audit(session.id)
    theirs = bob.session(id=session.id)  # the same id in bob's own namespace
    renamed = alice.edit(session, title="renamed", message_ids=[message.id])
    a, b = (alice.tenant.org_id, alice.tenant.user_id), (bob.tenant.org_id, bob.tenant.user_id)
    with sqlite3.connect(db_path) as conn:
        for statements in module._MIGRATIONS[:7]:
            for statement in statements:
                if isinstance(statement, str):  # a backfill of empty tables writes nothing
                    conn.execute(statement)
        for t, row in ((a, renamed), (a, odd), (b, theirs)):
            conn.execute(
                "INSERT INTO sessions (id, org_id, user_id, updated_at, body) "
                "VALUES (?, ?, ?, ?, ?)",
                (row.id, *t, row.updated_at, compact.encode(row)),
            )
        for row in (message, audit):
            conn.execute(
                "INSERT INTO records (kind, id, org_id, user_id, session_id, body) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (type(row).__name__, row.id, *a, session.id, compact.encode(row)),
            )
        conn.execute(
            "INSERT INTO audit_places (org_id, user_id, client_id, sequence_number, row_hash, id) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (*a, audit.client_id, audit.sequence_number, audit.row_hash, audit.id),
        )
        conn.execute(
            "INSERT INTO events (id, session_id, sequence_number, org_id, user_id, row_hash, body) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                event.id,
                session.id,
                event.sequence_number,
                *a,
                event.row_hash,
                compact.encode(event),
            ),
        )
        # Cursor 1 held the first version of the session; compaction took it and raised the
        # floor to 2. Cursor 7 was handed out to an entry that is gone.
        for cursor, t, kind, record_id in (
            (2, a, "Message", message.id),
            (3, a, "Event", event.id),
            (4, a, "AuditRow", audit.id),
            (5, a, "Session", odd.id),
            (6, b, "Session", theirs.id),
            (8, a, "Session", renamed.id),
        ):
            conn.execute(
                "INSERT INTO feed (cursor, org_id, user_id, kind, record_id) VALUES (?, ?, ?, ?, ?)",
                (cursor, *t, kind, record_id),
            )
        conn.execute("UPDATE sqlite_sequence SET seq = 9 WHERE name = 'feed'")
        conn.execute("INSERT INTO meta (org_id, user_id, feed_floor) VALUES (?, ?, 2)", a)
        for t, device, last_seq in ((a, alice, 6), (b, bob, 1)):
            conn.execute(
                "INSERT INTO clients (org_id, user_id, client_id, last_seq) VALUES (?, ?, ?, ?)",
                (*t, device.client_id, last_seq),
            )
        conn.execute("PRAGMA user_version = 7")
    alice.next_seq, bob.next_seq = 7, 2
    before = [
        [(2, message), (3, event), (4, audit), (5, odd), (8, renamed)],
        [(6, theirs)],
    ]
    highest = 9
    async with SQLiteServerStore(db_path) as store:
        pulled = [await pull_all(store, d.tenant) for d in (alice, bob)]
        assert [[(c.cursor, c.record) for c in feed] for feed in pulled] == before
        assert await store.client_state(alice.tenant, alice.client_id) == (6, 8)
        with pytest.raises(CursorTooOld):
            await store.pull(alice.tenant, 1, 10)  # under the floor compaction raised
        again = await store.push(alice.tenant, alice.client_id, alice.changes(message), clock)
        assert [r.status for r in again.results] == ["duplicate"]
        later = await store.push(
            bob.tenant, bob.client_id, bob.changes(bob.message(theirs.id)), clock
        )
        assert later.cursors == [highest + 1]
        audit_next = await store.push(
            alice.tenant, alice.client_id, alice.changes(alice.audit(session.id)), clock
        )
        assert [r.status for r in audit_next.results] == ["applied"]  # the chain's tail read back
        # An event goes on from the chain's tail, whose row hash is read from its body.
        placed = await store.push(
            alice.tenant, alice.client_id, alice.changes(alice.event(session.id)), clock
        )
        assert [r.status for r in placed.results] == ["applied"]
        (last,) = (await store.pull(alice.tenant, max(placed.cursors) - 1, 10)).changes
        assert isinstance(last.record, Event)
        assert (last.record.sequence_number, last.record.prev_hash) == (2, event.row_hash)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT count(*) FROM tenants").fetchone()[0] == 2
        kept = dict(
            conn.execute(
                "SELECT typeof(id), count(*) FROM "
                "(SELECT id FROM records UNION ALL SELECT id FROM messages) GROUP BY 1"
            )
        )
        assert kept == {"blob": 4}  # two messages, two audit rows: ids of 16 bytes each
        ids = {row[0] for row in conn.execute("SELECT id FROM sessions")}
        assert ids == {uuid_bytes(session.id), "not-a-uuid"}
        columns = [row[1] for row in conn.execute("PRAGMA table_info(events)")]
        assert columns == ["id", "chain", "sequence_number", "tid", "body", "device"]
        kinds = conn.execute(
            "SELECT DISTINCT kind FROM feed UNION SELECT kind FROM records "
            "UNION SELECT kind FROM messages"
        )
        assert {compact.KINDS[k] for (k,) in kinds} == {
            "Message",
            "Event",
            "AuditRow",
            "Session",
        }


def _records(conn: sqlite3.Connection) -> str:
    """SQL: every record row of the file, its messages among them (in ``messages`` since
    schema 14, in ``records`` before)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages'").fetchall():
        return "(SELECT body FROM records UNION ALL SELECT body FROM messages)"
    return "records"


def _with_prev(stored: bytes, prev: bytes) -> bytes:
    """A short event body stored without its prev_hash (``compact.prev_apart``) with ``prev``
    back in its place, as schema 14 stored it."""
    head = b"\xc7\x20\x02"
    cut = len(stored) - 35 - (stored[-36:-33] == head and stored[-1:] in (b"\xc2", b"\xc3"))
    return compact.SHORT + bytes((stored[1] - 0x10,)) + stored[2:cut] + head + prev + stored[cut:]


def _as_schema_21(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 21 wrote: every audit row's
    body in form 2 (its prev_hash and row hash where ``encode`` puts them), no ``prev_row``."""
    if conn.execute("PRAGMA user_version").fetchone()[0] < 22:
        return
    head = b"\xc7\x20\x02"
    rows = conn.execute(
        f"SELECT r.rowid, r.body, {compact.audit_digest_sql('q.body')} FROM records AS r "
        "LEFT JOIN records AS q ON q.rowid = r.prev_row "
        "WHERE substr(r.body, 1, 2) IN (X'c112', X'c113')"
    ).fetchall()
    for rowid, body, prev in rows:
        place = int.from_bytes(body[2:4], "big")
        taken = head + prev if body[1] == 0x13 else b""
        whole = body[36 : place + 34] + taken + head + body[4:36] + body[place + 34 :]
        conn.execute(
            "UPDATE records SET body = ? WHERE rowid = ?", (compact.SHORT + b"\x02" + whole, rowid)
        )
    conn.execute("ALTER TABLE records DROP COLUMN prev_row")
    conn.execute("PRAGMA user_version = 21")


def _as_schema_20(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 20 wrote: each audit row's
    place holding its tenant, client id, id and row hash (read from the row's body), and no
    ``audit_chains``."""
    _as_schema_21(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 21:
        return
    conn.execute(
        "CREATE TABLE audit_places_20 (tid INTEGER NOT NULL, client_id TEXT NOT NULL, "
        "sequence_number INTEGER NOT NULL, id BLOB NOT NULL, row_hash BLOB NOT NULL, "
        "PRIMARY KEY (tid, client_id, sequence_number, id)) WITHOUT ROWID"
    )
    places = conn.execute(
        f"SELECT c.tid, c.client_id, p.sequence_number, r.id, {server_sqlite._WHOLE_EITHER} "
        "FROM audit_places AS p JOIN audit_chains AS c ON c.n = p.chain "
        "JOIN records AS r ON r.rowid = p.row"
    ).fetchall()
    conn.executemany(
        "INSERT INTO audit_places_20 (tid, client_id, sequence_number, id, row_hash) "
        "VALUES (?, ?, ?, ?, ?)",
        [
            (*place, server_sqlite._digest_key(compact.decode(body).row_hash))
            for *place, body in places
        ],
    )
    conn.execute("DROP TABLE audit_places")
    conn.execute("DROP TABLE audit_chains")
    conn.execute("ALTER TABLE audit_places_20 RENAME TO audit_places")
    conn.execute("PRAGMA user_version = 20")


def _as_schema_19(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 19 wrote: each record naming
    its session by its id (``session_id``), indexed by tenant and id, and ``chains`` holding
    the sessions of events alone."""
    _as_schema_20(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 20:
        return
    for table in ("records", "messages"):
        conn.execute(
            f"CREATE TABLE {table}_19 (kind INTEGER NOT NULL, id BLOB NOT NULL, "
            "tid INTEGER NOT NULL, session_id BLOB, body BLOB NOT NULL, device INTEGER)"
        )
        conn.execute(
            f"INSERT INTO {table}_19 (rowid, kind, id, tid, session_id, body, device) "
            "SELECT r.rowid, r.kind, r.id, r.tid, c.session_id, r.body, r.device "
            f"FROM {table} AS r LEFT JOIN chains AS c ON c.n = r.session ORDER BY r.rowid"
        )
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE {table}_19 RENAME TO {table}")
        conn.execute(f"CREATE UNIQUE INDEX {table}_key ON {table} (tid, kind, id)")
        conn.execute(f"CREATE INDEX {table}_tenant ON {table} (tid, session_id)")
    conn.execute("DELETE FROM chains WHERE n NOT IN (SELECT chain FROM events)")
    conn.execute("PRAGMA user_version = 19")


def _as_schema_18(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 18 wrote: each event naming
    its session by its id (``session_id``), its unique key by place ``(tid, session_id,
    sequence_number)``, and no ``chains``."""
    _as_schema_19(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 19:
        return
    conn.execute(
        "CREATE TABLE events_18 (id BLOB NOT NULL, session_id BLOB NOT NULL, "
        "sequence_number INTEGER NOT NULL, tid INTEGER NOT NULL, body BLOB NOT NULL, "
        "device INTEGER, UNIQUE (tid, id), UNIQUE (tid, session_id, sequence_number))"
    )
    conn.execute(
        "INSERT INTO events_18 (rowid, id, session_id, sequence_number, tid, body, device) "
        "SELECT e.rowid, e.id, c.session_id, e.sequence_number, e.tid, e.body, e.device "
        "FROM events AS e JOIN chains AS c ON c.n = e.chain ORDER BY e.rowid"
    )
    conn.execute("DROP TABLE events")
    conn.execute("DROP TABLE chains")
    conn.execute("ALTER TABLE events_18 RENAME TO events")
    conn.execute("PRAGMA user_version = 18")


def _as_schema_17(conn: sqlite3.Connection, block: int = ID_LAYOUT.block) -> None:
    """Turn a file written by this store back into what schema 17 wrote: every session's
    id blocks of ``block`` ids (128: the layout before schema 18), in a ``WITHOUT ROWID``
    table."""
    _as_schema_18(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 18:
        return
    rows = conn.execute("SELECT tid, id, part, ids FROM session_ids")
    sessions: dict[tuple[int, Any], list[tuple[int, bytes]]] = {}
    for tid, key, part, ids in rows.fetchall():
        sessions.setdefault((tid, key), []).append((part, bytes(ids)))
    conn.execute("DROP TABLE session_ids")
    conn.execute(
        "CREATE TABLE session_ids (tid INTEGER NOT NULL, id BLOB NOT NULL, "
        "part INTEGER NOT NULL, ids BLOB NOT NULL, PRIMARY KEY (tid, id, part)) WITHOUT ROWID"
    )
    conn.executemany(  # (cut again as the migration cuts them, at the size before)
        "INSERT INTO session_ids (tid, id, part, ids) VALUES (?, ?, ?, ?)",
        [
            (tid, key, part, ids)
            for (tid, key), blocks in sessions.items()
            for part, ids in rechunked(blocks, block)
        ],
    )
    conn.execute("PRAGMA user_version = 17")


def _rowid_feed(conn: sqlite3.Connection, record_id: str, column: str, head: str) -> None:
    """The feed made again as schema 8-16 kept it: a rowid table whose cursors AUTOINCREMENT
    gives (its high-water mark ``head``, an SQL read of it, kept in ``sqlite_sequence``), its
    index of sessions' entries and by tenant; ``record_id``: each entry's id, SQL over its
    entry ``f``, in a column declared ``column``."""
    conn.execute(
        "CREATE TABLE feed_old (cursor INTEGER PRIMARY KEY AUTOINCREMENT, "
        f"tid INTEGER NOT NULL, kind INTEGER NOT NULL, record_id {column})"
    )
    conn.execute(
        "INSERT INTO feed_old (cursor, tid, kind, record_id) "
        f"SELECT f.cursor, f.tid, f.kind, {record_id} FROM feed AS f ORDER BY f.cursor"
    )
    (last,) = conn.execute(head).fetchone()
    conn.execute("DROP TABLE feed")
    conn.execute("ALTER TABLE feed_old RENAME TO feed")
    conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'feed'", (last,))
    session = compact.KINDS.index("Session")
    conn.execute(f"CREATE INDEX feed_session ON feed (tid, record_id) WHERE kind = {session}")
    conn.execute("CREATE INDEX feed_tenant ON feed (tid)")


def _as_schema_16(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 16 wrote: the feed a rowid
    table, its cursors given by AUTOINCREMENT (its high-water mark in ``sqlite_sequence``),
    and an index of it by tenant."""
    _as_schema_17(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 17:
        return
    _rowid_feed(conn, "f.record_id", "BLOB", "SELECT cursor FROM feed_head")
    conn.execute("DROP TABLE feed_head")
    conn.execute("PRAGMA user_version = 16")


def _as_schema_15(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 15 wrote: every feed entry
    naming its record's id (``record_id`` NOT NULL), read from the row at its cursor in the
    table of its kind."""
    _as_schema_16(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 16:
        return
    event, message = compact.KINDS.index("Event"), compact.KINDS.index("Message")
    named = (
        "COALESCE(f.record_id, CASE f.kind "
        f"WHEN {event} THEN (SELECT id FROM events WHERE rowid = f.cursor) "
        f"WHEN {message} THEN (SELECT id FROM messages WHERE rowid = f.cursor) "
        "ELSE (SELECT id FROM records WHERE rowid = f.cursor) END)"
    )
    head = "SELECT seq FROM sqlite_sequence WHERE name = 'feed'"
    _rowid_feed(conn, named, "BLOB NOT NULL", head)
    conn.execute("PRAGMA user_version = 15")


def _as_schema_14(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 14 wrote: every event body
    with its prev_hash (read from the row before it, as every read of it does)."""
    _as_schema_15(conn)
    if conn.execute("PRAGMA user_version").fetchone()[0] < 15:
        return
    prev = (  # (``_prev_digest`` as schema 15-18 read it: by the session's id)
        f"(SELECT {compact.chain_digest_sql('p.body')} FROM events AS p WHERE p.tid = e.tid "
        "AND p.session_id = e.session_id AND p.sequence_number = e.sequence_number - 1)"
    )
    rows = conn.execute(
        f"SELECT e.rowid, e.body, {prev} FROM events AS e "
        "WHERE substr(e.body, 1, 1) = x'c1' AND substr(e.body, 2, 1) IN (x'10', x'11')"
    ).fetchall()
    for rowid, body, digest in rows:
        assert len(digest) == 32
        conn.execute(
            "UPDATE events SET body = ? WHERE rowid = ?", (_with_prev(body, digest), rowid)
        )
    conn.execute("PRAGMA user_version = 14")


def _as_schema_13(conn: sqlite3.Connection) -> None:
    """Turn a file written by this store back into what schema 13 wrote: its messages among
    the other records (``records``), each at its rowid, and no ``messages`` table."""
    _as_schema_14(conn)
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages'").fetchall():
        return  # (schema 13 already)
    conn.execute(
        "INSERT INTO records (rowid, kind, id, tid, session_id, body, device) "
        "SELECT rowid, kind, id, tid, session_id, body, device FROM messages"
    )
    conn.execute("DROP TABLE messages")
    conn.execute("PRAGMA user_version = 13")


def _as_schema_12(conn: sqlite3.Connection) -> None:
    """Turn the rows of a file written by this store back into what schema 12 wrote: a body
    that left out its stamp's node put together and written short as schema 12 did (its ids
    and its tenant left out), and no ``device`` columns nor ``nodes``."""
    _as_schema_13(conn)
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'nodes'").fetchall():
        return  # (schema 12 already)
    for table in ("records", "events"):
        tenant = f"(SELECT packed FROM tenants AS t WHERE t.tid = {table}.tid)"
        node = f"(SELECT node FROM nodes AS n WHERE n.n = {table}.device)"
        whole = compact.whole_body_sql("body", "id", "session_id", tenant, node)
        rows = conn.execute(
            f"SELECT rowid, id, session_id, {tenant}, {whole} FROM {table} WHERE device IS NOT NULL"
        ).fetchall()
        for rowid, key, session_key, packed, body in rows:
            short = compact.short_body(body, key, session_key, packed)
            conn.execute(f"UPDATE {table} SET body = ? WHERE rowid = ?", (short, rowid))
        conn.execute(f"ALTER TABLE {table} DROP COLUMN device")
    conn.execute("DROP TABLE nodes")
    conn.execute("PRAGMA user_version = 12")


def _as_schema_11(conn: sqlite3.Connection) -> None:
    """Turn the rows of a file written by this store back into what schema 11 wrote: every
    body whole (``compact.whole_body_sql``, the tenant's packed org and user too), and the
    tenants without them."""
    _as_schema_12(conn)
    for table in ("records", "events"):
        tenant = f"(SELECT packed FROM tenants AS t WHERE t.tid = {table}.tid)"
        whole = compact.whole_body_sql("body", "id", "session_id", tenant)
        conn.execute(f"UPDATE {table} SET body = {whole}")
    conn.execute("ALTER TABLE tenants DROP COLUMN packed")
    conn.execute("PRAGMA user_version = 11")


def _as_schema_10(db_path: Path) -> None:
    """Turn a file written by this store back into what schema 10 wrote: its records' and
    events' rowids numbers of their own (here in reverse order, none a cursor), the feed's
    index of every entry by record, no index of sessions alone."""
    from pleach_server.store import sqlite as module

    with sqlite3.connect(db_path) as conn:
        conn.create_function("pleach_key", 1, lambda value: value, deterministic=True)
        _as_schema_11(conn)
        for table in ("records", "events"):
            top = conn.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]
            conn.execute(f"UPDATE {table} SET rowid = rowid + ? + 1000", (top,))
            conn.execute(f"UPDATE {table} SET rowid = ? + 5000 - rowid", (top,))
        conn.execute("DROP INDEX feed_session")
        conn.execute("CREATE INDEX feed_record ON feed (tid, kind, record_id, cursor)")
        conn.execute("PRAGMA user_version = 10")
        assert module.SCHEMA_VERSION == 23


async def test_schema_10_files_migrate_to_rowids_that_are_feed_cursors(db_path: Path) -> None:
    """A file of schema 10 keeps every row through migration 11: a record's and an event's
    rowid becomes its feed entry's cursor (a row whose entry has gone, a negative one; an
    immutable record's older entry goes), the feed pulls as before, a deleted session's
    content leaves the feed whole (a record numbered as the build before numbers them, too,
    and no other entry goes with it), and later pushes keep the rule."""
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path) as store:
        h = await placed_history(store, clock)
    alice, bob, other, first, gone = h.alice, h.bob, h.other, h.first, h.gone
    content = h.content
    before, theirs = h.before, h.theirs
    at = h.at
    gap = next(c for c in range(1, max(at.values())) if c not in at.values())  # renamed's
    _as_schema_10(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM feed WHERE cursor = ?", (at[gone.id],))  # its entry gone
        conn.execute(  # an older entry of the first message, as no version since 7 writes
            "INSERT INTO feed (cursor, tid, kind, record_id) "
            "SELECT ?, tid, kind, record_id FROM feed WHERE cursor = ?",
            (gap, at[first.id]),
        )
    kept = [(c, r) for c, r in before if r.id != gone.id]
    async with SQLiteServerStore(db_path) as store:
        assert [(c.cursor, c.record) for c in await pull_all(store, alice.tenant)] == kept
        assert [(c.cursor, c.record) for c in await pull_all(store, bob.tenant)] == theirs
        with sqlite3.connect(db_path) as conn:
            places = {
                uuid_text(key): rowid
                for table in ("records", "messages", "events")
                for rowid, key in conn.execute(f"SELECT rowid, id FROM {table}")
            }
            assert (
                conn.execute("SELECT count(*) FROM feed WHERE cursor = ?", (gap,)).fetchone()[0]
                == 0
            )
        assert places.pop(gone.id) < 0
        assert places == {r.id: c for c, r in kept if not isinstance(r, Session)}
        # A message a process of the build before writes after the migration: its rowid
        # numbered as it did (here the cursor of bob's session entry), its entry elsewhere.
        stray = alice.message(other.id)
        with sqlite3.connect(db_path) as conn:
            tid = "(SELECT tid FROM tenants WHERE org_id = ? AND user_id = ?)"
            a = (alice.tenant.org_id, alice.tenant.user_id)
            conn.execute(  # (into the table of its kind since schema 14; its session's
                # number since schema 20)
                f"INSERT INTO messages (rowid, kind, id, tid, session, body) "
                f"VALUES (?, ?, ?, {tid}, (SELECT n FROM chains WHERE tid = {tid} "
                "AND session_id = ?), ?)",
                (
                    theirs[0][0],
                    compact.KINDS.index("Message"),
                    uuid_bytes(stray.id),
                    *a,
                    *a,
                    uuid_bytes(other.id),
                    compact.encode(stray),
                ),
            )
            conn.execute("UPDATE feed_head SET cursor = cursor + 1")  # (its cursor, as taken)
            conn.execute(
                f"INSERT INTO feed (tid, cursor, kind, record_id) "
                f"VALUES ({tid}, (SELECT cursor FROM feed_head), ?, ?)",
                (*a, compact.KINDS.index("Message"), uuid_bytes(stray.id)),
            )
        assert stray in [c.record for c in await pull_all(store, alice.tenant)]
        content.append(stray)
        tomb = tombstone(alice, other)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert [r.status for r in deleted.results] == ["applied"]
        after = await pull_all(store, alice.tenant)  # no entry is left without its row
        assert not {c.record.id for c in after} & {r.id for r in content}
        assert [(c.cursor, c.record) for c in await pull_all(store, bob.tenant)] == theirs
        later = await store.push(
            alice.tenant, alice.client_id, alice.changes(alice.message(h.session.id)), clock
        )
        (cursor,) = later.cursors
        assert cursor > max(at.values())
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(feed)")}
        assert indexes == {"sqlite_autoindex_feed_1", "feed_session"}  # (its key, schema 17)
        columns = {
            name: [row[2] for row in conn.execute(f"PRAGMA index_info({name})")]
            for name in (
                "sqlite_autoindex_feed_1",
                "feed_session",
                "records_session",
                "messages_session",
            )
        }  # the cursor, a rowid, once
        assert columns == {
            "sqlite_autoindex_feed_1": ["tid", "cursor"],
            "feed_session": ["tid", "record_id"],
            "records_session": ["session"],  # (its session's number: schema 20)
            "messages_session": ["session"],
        }
        assert conn.execute("SELECT max(rowid) FROM messages").fetchone()[0] == cursor
        for table in ("records", "messages", "events"):  # every row with an entry at its rowid
            assert not conn.execute(
                f"SELECT rowid FROM {table} AS r WHERE rowid > 0 AND NOT EXISTS ("
                "SELECT 1 FROM feed AS f WHERE f.cursor = r.rowid "
                "AND (f.record_id IS NULL OR f.record_id = r.id))"
            ).fetchall()


async def _placed_file(
    db_path: Path,
) -> tuple[HybridClock, PlacedHistory, list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """A server file at ``db_path`` holding ``placed_history``: the server's clock, the
    history, and what each of its two tenants pulls (alice's, then bob's: ``_raw_bodies``)."""
    clock = HybridClock("server-x")
    async with SQLiteServerStore(db_path) as store:
        h = await placed_history(store, clock)
        return (
            clock,
            h,
            await _raw_bodies(store, h.alice.tenant),
            await _raw_bodies(store, h.bob.tenant),
        )


async def _raw_bodies(store: SQLiteServerStore, tenant: Tenant) -> list[tuple[int, bytes]]:
    """Each feed entry's cursor and body as a pull sends them (``raw``: the stored bytes)."""
    page = await store.pull(tenant, 0, 1000, raw=True)
    return [(e.cursor, bytes(b.body)) for e, b in zip(page.entries(), page.bodies, strict=True)]


async def test_a_server_file_leaves_out_the_node_of_the_device_that_pushed(
    db_path: Path,
) -> None:
    """Schema 13: a body pushed by the device whose stamp it carries leaves out the stamp's
    node, kept once in ``nodes`` and named by the row (``device``); a record whose stamp
    names another device (a draft relabelled to the pushing one) keeps its node, and so does
    a device whose id no node of that form fits. A file of schema 12 opens at 13 and
    pulls the very bytes it pulled before, and every body pulls as the bytes pushed."""
    clock = HybridClock("server-x")
    tenant = new_tenant()
    phone, laptop, odd = Device(tenant), Device(tenant), Device(tenant, "device")  # (6: none)
    async with SQLiteServerStore(db_path) as store:
        h = await placed_history(store, clock)
        before = await _raw_bodies(store, h.alice.tenant)
    with sqlite3.connect(db_path) as conn:
        _as_schema_12(conn)
        conn.commit()
    async with SQLiteServerStore(db_path) as store:
        assert await _raw_bodies(store, h.alice.tenant) == before
        session = phone.session()
        own = [
            phone.message(session.id),
            phone.checkpoint(session.id),
            phone.event(session.id),
            phone.audit(session.id),
        ]
        # (a draft stamped under another id, relabelled: its device is not the stamp's node)
        relayed = msgspec.structs.replace(laptop.message(session.id), client_id=phone.client_id)
        pushes = [(phone, [session, *own]), (phone, [relayed]), (odd, [odd.message(session.id)])]
        pushed = []
        for device, records in pushes:
            result = await store.push(tenant, device.client_id, device.changes(*records), clock)
            assert {r.status for r in result.results} == {"applied"}, result.results
            pushed += records
        feed = await pull_all(store, tenant)
        bodies = [b for _, b in await _raw_bodies(store, tenant)]
        assert [c.record.id for c in feed] == [r.id for r in pushed]
        for change, body, record in zip(feed, bodies, pushed, strict=True):
            assert compact.decode(body) == change.record
            if not isinstance(record, (Session, Event)):  # (as pushed; the server places those)
                assert body == compact.encode(record) and change.record == record
        assert await _raw_bodies(store, h.alice.tenant) == before
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        nodes = dict(conn.execute("SELECT node, n FROM nodes"))
        assert set(nodes) == {compact.stamp_node(phone.client_id)}  # (neither laptop nor odd)
        rows = {
            bytes(key): (bytes(body[:2]), device)
            for table in ("records", "messages", "events")
            for key, body, device in conn.execute(f"SELECT id, body, device FROM {table}")
        }
    number = nodes[compact.stamp_node(phone.client_id)]
    for record in own:  # (an audit row's body leaves out its id, tenant, node and session id)
        # (and keeps its row hash in front, schema 22: the first of its chain, form 18)
        form = b"\x12" if isinstance(record, AuditRow) else b"\x01"
        assert rows[compact.uuid_bytes(record.id)] == (compact.SHORT + form, number)
    for record in pushed[-2:]:  # another device's stamp; a device with no node of that form
        assert rows[compact.uuid_bytes(record.id)] == (compact.SHORT + b"\x00", None)


async def test_whole_and_short_bodies_of_one_server_file_pull_alike(db_path: Path) -> None:
    """Schema 12 stores a message's, checkpoint's and event's body without the ids its row
    holds. A file of schema 11 (every body whole) opens at 12 and pulls the very bytes it
    pulled before; rows written after are short, and whole and short side by side pull as
    the bytes pushed; a chain goes on from a whole tail and from a short one; a deleted
    session's content goes whichever form its rows are in."""
    clock, h, before, theirs = await _placed_file(db_path)
    alice, bob = h.alice, h.bob

    def shorts(conn: sqlite3.Connection) -> list[int]:
        count = "SELECT count(*) FROM {} WHERE substr(body, 1, 1) = x'c1'"
        return [conn.execute(count.format(t)).fetchone()[0] for t in (_records(conn), "events")]

    with sqlite3.connect(db_path) as conn:
        assert shorts(conn) == [5, 2]  # alice's 3 messages, checkpoint, audit row; 2 events
        _as_schema_21(conn)  # (its audit row's row hash where it was: form 2)
        sizes = conn.execute(f"SELECT sum(length(body)) FROM {_records(conn)}").fetchone()[0]
        _as_schema_12(conn)  # (schema 13 left out the node of alice's device: put back)
        assert shorts(conn) == [4, 2]  # (schema 12 kept an audit row whole)
        node = compact.stamp_node(alice.client_id)
        packed = len(compact.packed(alice.tenant.org_id) + compact.packed(alice.tenant.user_id))
        grown = conn.execute("SELECT sum(length(body)) FROM records").fetchone()[0] - sizes
        audit = 18 + packed + 1 + len(node) - 3 + 18 - 2  # (id, tenant, nil, node, session)
        assert grown == 4 * (len(node) - 3) + audit and len(node) > 3
        sizes += grown
        _as_schema_11(conn)
        assert shorts(conn) == [0, 0]
        grown = conn.execute("SELECT sum(length(body)) FROM records").fetchone()[0] - sizes
        packed = len(compact.packed(alice.tenant.org_id) + compact.packed(alice.tenant.user_id))
        assert grown == 4 * (35 + packed - 1)  # (the 0 that says the tenant is left out)
    async with SQLiteServerStore(db_path) as store:
        with sqlite3.connect(db_path) as conn:  # (the migration packed each tenant)
            packed = dict(conn.execute("SELECT user_id, packed FROM tenants"))
        assert packed == {t.user_id: packed_tenant(t) for t in (alice.tenant, bob.tenant)}
        assert await _raw_bodies(store, alice.tenant) == before
        assert await _raw_bodies(store, bob.tenant) == theirs
        session = h.session
        pushed = [alice.message(session.id), alice.checkpoint(session.id)]
        for record in [*pushed, alice.event(session.id), alice.event(session.id)]:
            result = await store.push(alice.tenant, alice.client_id, alice.changes(record), clock)
            assert [r.status for r in result.results] == ["applied"]
        feed = await pull_all(store, alice.tenant)
        assert [c.record for c in feed[-4:-2]] == pushed
        log = [c.record for c in feed if isinstance(c.record, Event)]
        log = [e for e in log if e.session_id == session.id]
        assert [e.sequence_number for e in log] == [1, 2, 3]
        assert [e.prev_hash for e in log[1:]] == [e.row_hash for e in log[:-1]]
        after = await _raw_bodies(store, alice.tenant)
        assert after[: len(before)] == before
        assert [compact.decode(b) for _, b in after] == [c.record for c in feed]
        tomb = tombstone(alice, h.other)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert [r.status for r in deleted.results] == ["applied"]
        left = {c.record.id for c in await pull_all(store, alice.tenant)}
        assert not left & {r.id for r in h.content}
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        for table in ("records", "messages", "events"):
            short = conn.execute(
                f"SELECT count(*) FROM {table} WHERE substr(body, 1, 1) = x'c1'"
            ).fetchone()[0]
            assert short == {"records": 1, "messages": 1, "events": 2}[table]  # pushed after


def test_a_chain_tail_is_read_from_the_event_body_in_either_form() -> None:
    """A chain's tail is read from its last event's body: the compact form without decoding
    its payload, the map form older servers wrote by decoding it; a corrupt body is a
    ``StorageError``, never a wrong hash."""
    from shared.records import encode_record

    dev = Device(new_tenant())
    event = msgspec.structs.replace(
        dev.event(dev.session().id), sequence_number=3, prev_hash="cd" * 32, row_hash="ef" * 32
    )
    assert server_sqlite._row_hash(event.session_id, compact.encode(event)) == "ef" * 32
    assert server_sqlite._row_hash(event.session_id, encode_record(event)) == "ef" * 32
    for corrupt in (b"\xc1", compact.encode(dev.session())):
        with pytest.raises(StorageError):
            server_sqlite._row_hash(event.session_id, corrupt)


def test_pleach_server_migrate_says_what_it_did(tmp_path: Path) -> None:
    """`pleach-server migrate` on a server file of schema 7 says it took it to 8, and again
    that nothing was left to do; on a path with no file, that it made one from nothing."""
    import subprocess
    import sys

    from pleach_server.store import sqlite as module

    old = tmp_path / "old.db"
    with sqlite3.connect(old) as conn:
        for statements in module._MIGRATIONS[:7]:
            for statement in statements:
                if isinstance(statement, str):  # a backfill of empty tables writes nothing
                    conn.execute(statement)
        conn.execute("PRAGMA user_version = 7")

    def migrate(path: Path) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pleach_server.cli", "migrate", "--db", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert migrate(old).endswith(
        f"schema version 7 -> {SCHEMA_VERSION} ({SCHEMA_VERSION - 7} migration(s) applied)"
    )
    assert migrate(old).endswith("(0 migration(s) applied)")
    fresh = migrate(tmp_path / "new.db")
    assert fresh.endswith(f"0 -> {SCHEMA_VERSION} ({SCHEMA_VERSION} migration(s) applied)")


# -- a long session's ids in blocks --------------------------------------------------------


async def test_a_turn_of_a_long_session_writes_one_block_not_its_whole_list(
    db_path: Path,
) -> None:
    """At 2,000 ids a session's row holds none of them: they are in 17 blocks of 124 beside
    it (``SQLITE_ID_LAYOUT``). A turn (two more ids) writes the row and the one block it
    appended to; a new block when the last is full; a rollback drops the blocks past the
    list; a list changed in its middle rewrites from the first block that differs."""
    clock = HybridClock("server")
    dev = Device(new_tenant())
    ids = [uuid7() for _ in range(2_200)]
    async with SQLiteServerStore(db_path) as store:
        assert store._writer is not None
        statements: list[str] = []
        store._writer._conn.set_trace_callback(statements.append)

        async def push(session: Session) -> list[str]:
            statements.clear()
            result = await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
            assert [r.status for r in result.results] == ["applied"]
            feed = await pull_all(store, dev.tenant)
            assert [c.record for c in feed] == [session]
            writes = ("INSERT OR REPLACE INTO session_ids", "DELETE FROM session_ids")
            return [x for x in statements if x.startswith(writes)]

        def stored() -> tuple[int, list[tuple[int, int]]]:
            with sqlite3.connect(db_path) as conn:
                (size,) = conn.execute("SELECT length(body) FROM sessions").fetchone()
                blocks = conn.execute("SELECT part, length(ids) FROM session_ids ORDER BY part")
                return size, blocks.fetchall()

        session = dev.session(message_ids=ids[:2_000])
        assert server_sqlite.SQLITE_ID_LAYOUT.block == 124
        assert len(await push(session)) == 17  # every block, once
        size, blocks = stored()
        assert size < 1_000 and blocks == [(p, 1984) for p in range(16)] + [(16, 16 * 16)]
        session = dev.edit(session, message_ids=ids[:2_002])
        written = await push(session)
        assert len(written) == 1 and "INSERT" in written[0]
        assert stored()[1][-1] == (16, 18 * 16)
        session = dev.edit(session, message_ids=ids[:2_110])
        assert len(await push(session)) == 2  # the last block filled, a new one begun
        session = dev.edit(session, message_ids=ids[:290])
        written = await push(session)
        assert len(written) == 2 and "DELETE" in written[0]  # blocks 3-17 dropped, 2 cut
        assert stored()[1] == [(0, 1984), (1, 1984), (2, 42 * 16)]
        session = dev.edit(session, message_ids=[*ids[:200], *reversed(ids[200:290])])
        assert len(await push(session)) == 2  # from the block that differs on
        session = dev.edit(session, message_ids=ids[:100])
        written = await push(session)
        assert len(written) == 1 and "DELETE" in written[0]
        assert stored()[1] == []  # short again: the ids are in the row's body


async def _long_session_stored(
    db_path: Path, ids: list[str] | None = None
) -> tuple[HybridClock, Device, Session]:
    """A server file at ``db_path`` holding one device's session of ``ids`` (300 new ones by
    default), kept in blocks: the server's clock, the device and the session."""
    clock = HybridClock("server")
    dev = Device(new_tenant())
    session = dev.session(message_ids=ids or [uuid7() for _ in range(300)])
    async with SQLiteServerStore(db_path) as store:
        await store.push(dev.tenant, dev.client_id, dev.changes(session), clock)
    return clock, dev, session


async def test_a_long_sessions_blocks_that_do_not_hold_its_ids_are_a_storage_error(
    db_path: Path,
) -> None:
    """A block lost or cut (a damaged file) is a corrupt row, said as such by a pull and by
    the next push's read of the row; nothing is served or merged from a partial list."""
    clock, dev, session = await _long_session_stored(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM session_ids WHERE part = 1")
    async with SQLiteServerStore(db_path) as store:
        with pytest.raises(StorageError, match="corrupt feed entry"):
            await store.pull(dev.tenant, 0, 10)
        later = dev.edit(session, title="later")
        with pytest.raises(StorageError, match="corrupt session row"):
            await store.push(dev.tenant, dev.client_id, dev.changes(later), clock)


async def test_a_row_kept_apart_reads_as_corrupt_to_a_reader_that_knows_no_blocks(
    db_path: Path,
) -> None:
    """A server process of the build before schema 9 (and 12) reads a session row by its
    body alone: a row whose ids are in blocks must never read to it as a session naming no
    message (its devices would take that version). Its body starts with ``APART``, a byte
    msgpack never uses: the old reads (a pull's, decoding or not, and a push's merge) find
    it corrupt, a coded error the device retries once the old process is gone."""
    *_, session = await _long_session_stored(db_path)
    with sqlite3.connect(db_path) as conn:
        body, count = conn.execute("SELECT body, ids_count FROM sessions").fetchone()
    assert count == 300 and body[:1] == APART
    with pytest.raises(StorageError):
        decode_session(session.id, body)
    with pytest.raises(StorageError):
        feed_body(1, body)
    with pytest.raises(StorageError):
        feed_change(1, body)


async def test_a_version_written_whole_over_a_row_kept_apart_is_read_whole(
    db_path: Path,
) -> None:
    """A process of the build before writes a long session's next version whole, over a row
    kept apart, leaving its ``ids_count`` and blocks: the row reads as that whole version (a
    body without ``APART`` is whole), and the next version written here moves its ids back
    to blocks, over the blocks that were left."""
    ids = [uuid7() for _ in range(400)]
    clock, dev, v1 = await _long_session_stored(db_path, ids[:300])
    v2 = dev.edit(v1, message_ids=ids[:301])
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE sessions SET body = ?", (compact.encode(v2),))  # (as it did)
    async with SQLiteServerStore(db_path) as store:
        assert [c.record for c in await pull_all(store, dev.tenant)] == [v2]
        v3 = dev.edit(v2, message_ids=[*ids[:100], *ids[200:400]])
        result = await store.push(dev.tenant, dev.client_id, dev.changes(v3), clock)
        assert [r.status for r in result.results] == ["applied"]
        assert [c.record for c in await pull_all(store, dev.tenant)] == [v3]
    with sqlite3.connect(db_path) as conn:
        body, count = conn.execute("SELECT body, ids_count FROM sessions").fetchone()
        blocks = conn.execute("SELECT part FROM session_ids ORDER BY part").fetchall()
    assert body[:1] == APART and count == 300 and blocks == [(0,), (1,), (2,)]


async def test_a_schema_13_file_opens_with_its_messages_in_a_table_of_their_own(
    db_path: Path,
) -> None:
    """Schema 14 keeps messages apart from the other records (``messages``): a file of
    schema 13 (every record in ``records``) opens at 14 with each message moved there at its
    rowid (its feed entry's cursor) and nothing else moved, pulls the very bytes it pulled
    before, files later pushes by kind, finds a pushed message again as already there, and
    deletes a session's content from both tables with its feed entries."""
    from tests.sim.invariants import server_file_problems

    clock, h, before, theirs = await _placed_file(db_path)
    message = compact.KINDS.index("Message")
    with sqlite3.connect(db_path) as conn:
        _as_schema_13(conn)
        conn.commit()
        placed = {
            (kind, bytes(key)): rowid
            for rowid, kind, key in conn.execute("SELECT rowid, kind, id FROM records")
        }
    assert {kind for kind, _ in placed} >= {message, compact.KINDS.index("Checkpoint")}
    async with SQLiteServerStore(db_path) as store:
        assert await _raw_bodies(store, h.alice.tenant) == before
        assert await _raw_bodies(store, h.bob.tenant) == theirs
        with sqlite3.connect(db_path) as conn:
            moved = {
                (kind, bytes(key)): (rowid, table)
                for table in ("records", "messages")
                for rowid, kind, key in conn.execute(f"SELECT rowid, kind, id FROM {table}")
            }
        assert {k: at for k, (at, _) in moved.items()} == placed
        assert all((t == "messages") == (k == message) for (k, _), (_, t) in moved.items())
        # Later pushes: a message and a checkpoint each in its table; a message pushed again
        # (as a device does whose ack was lost) is found there, not written twice.
        alice, session = h.alice, h.session
        new = [alice.message(session.id), alice.checkpoint(session.id)]
        result = await store.push(alice.tenant, alice.client_id, alice.changes(*new), clock)
        assert statuses(result) == ["applied", "applied"]
        again = await store.push(alice.tenant, alice.client_id, alice.changes(new[0]), clock)
        assert statuses(again) == ["duplicate"] and again.cursors == []
        feed = await pull_all(store, alice.tenant)
        assert [c.record for c in feed[-2:]] == new
        tomb = tombstone(alice, h.other)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert statuses(deleted) == ["applied"]
        left = {c.record.id for c in await pull_all(store, alice.tenant)}
        assert not left & {r.id for r in h.content}
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert (
            conn.execute("SELECT count(*) FROM records WHERE kind = ?", (message,)).fetchone()[0]
            == 0
        )
        rows = {bytes(k) for (k,) in conn.execute("SELECT id FROM messages")}
        assert uuid_bytes(new[0].id) in rows
        assert not rows & {uuid_bytes(r.id) for r in h.content}
    assert server_file_problems(db_path) == []


async def test_an_event_is_stored_without_the_prev_hash_the_row_before_it_holds(
    db_path: Path,
) -> None:
    """Schema 15: a placed event's body leaves out its prev_hash where the row before it in
    its chain (its session's, one number lower) holds that digest as its row_hash, read as
    every read reads it; the first of a chain keeps it, and so does an event whose row
    before holds no digest at its end (a body of the map form). Every pull gives the bytes
    placed, the chain links, and a file of schema 14 (every prev_hash in its body) opens at
    15, pulls the very bytes it pulled, and goes on with the rows it holds."""
    clock = HybridClock("server-x")
    tenant = new_tenant()
    phone = Device(tenant)
    session = phone.session()

    async def log(store: SQLiteServerStore) -> list[Event]:
        feed = await pull_all(store, tenant)
        return [c.record for c in feed if isinstance(c.record, Event)]

    def forms(conn: sqlite3.Connection) -> list[bytes]:
        rows = "SELECT substr(body, 2, 1) FROM events ORDER BY sequence_number"  # (one chain)
        return [bytes(f) for (f,) in conn.execute(rows)]

    async with SQLiteServerStore(db_path) as store:
        first = [phone.event(session.id), phone.event(session.id), phone.event(session.id)]
        await store.push(tenant, phone.client_id, phone.changes(session, *first), clock)
        await store.push(tenant, phone.client_id, phone.changes(phone.event(session.id)), clock)
        events = await log(store)
        before = await _raw_bodies(store, tenant)
    assert [e.sequence_number for e in events] == [1, 2, 3, 4]
    assert [e.prev_hash for e in events[1:]] == [e.row_hash for e in events[:-1]]
    assert [compact.decode(b) for _, b in before][-4:] == events  # (as placed)
    with sqlite3.connect(db_path) as conn:
        assert forms(conn) == [b"\x01", b"\x11", b"\x11", b"\x11"]  # (its node left out too)
        stored = sum(len(b) for (b,) in conn.execute("SELECT body FROM events"))
        _as_schema_14(conn)
        conn.commit()
        assert forms(conn) == [b"\x01"] * 4
        assert sum(len(b) for (b,) in conn.execute("SELECT body FROM events")) == stored + 3 * 35
        # The chain's last row as a build of the map form wrote it: no digest at its end.
        conn.execute(
            "UPDATE events SET body = ? WHERE sequence_number = 4",
            (encode_record(events[3]),),
        )
        conn.commit()
    async with SQLiteServerStore(db_path) as store:
        pulled = await _raw_bodies(store, tenant)
        assert [compact.decode(b) for _, b in pulled] == [compact.decode(b) for _, b in before]
        more = [phone.event(session.id), phone.event(session.id)]
        await store.push(tenant, phone.client_id, phone.changes(*more), clock)
        events = await log(store)
        assert [e.sequence_number for e in events] == [1, 2, 3, 4, 5, 6]
        assert [e.prev_hash for e in events[1:]] == [e.row_hash for e in events[:-1]]
        assert (await _raw_bodies(store, tenant))[: len(pulled)] == pulled
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        # The one after the row of the map form keeps its prev_hash (that row's digest is not
        # at its end); the one after it leaves it out again.
        assert forms(conn)[:3] + forms(conn)[4:] == [b"\x01"] * 4 + [b"\x11"]
        mapped = conn.execute("SELECT body FROM events WHERE sequence_number = 4").fetchone()[0]
        assert compact.chain_digest(mapped) is None
        assert conn.execute(
            f"SELECT {compact.chain_digest_sql('?1')} IS NULL", (mapped,)
        ).fetchone()[0]


async def test_a_feed_entry_whose_row_is_at_its_cursor_names_no_id(db_path: Path) -> None:
    """Schema 16: a feed entry of a record or an event whose row is at its cursor, in the
    table of its kind, names no id (``record_id`` NULL); a session's entry names its own. A
    file of schema 15 (every entry naming its id) opens at 16 with each such entry's id
    dropped and no other, pulls the very bytes it pulled before, keeps the id of an entry
    whose row is elsewhere (a row a process of a build before 11 wrote at a rowid of its
    own), and later pushes and deletes keep the layout."""
    from tests.sim.invariants import server_file_problems

    session_kind = compact.KINDS.index("Session")

    def named(conn: sqlite3.Connection) -> dict[int, bool]:
        """Each feed entry's cursor: whether it names an id."""
        rows = conn.execute("SELECT cursor, record_id IS NOT NULL FROM feed ORDER BY cursor")
        return {cursor: bool(names) for cursor, names in rows}

    def sessions_at(conn: sqlite3.Connection) -> set[int]:
        rows = conn.execute("SELECT cursor FROM feed WHERE kind = ?", (session_kind,))
        return {cursor for (cursor,) in rows}

    clock, h, before, theirs = await _placed_file(db_path)
    with sqlite3.connect(db_path) as conn:
        written = named(conn)
        assert {c for c, names in written.items() if names} == sessions_at(conn)
        _as_schema_15(conn)
        assert set(named(conn).values()) == {True}
        # A message a process of a build before 11 wrote: its row at a rowid of its own (far
        # above every cursor), its entry naming its id.
        stray = h.alice.message(h.other.id)
        tid = "(SELECT tid FROM tenants WHERE org_id = ? AND user_id = ?)"
        a = (h.alice.tenant.org_id, h.alice.tenant.user_id)
        message = compact.KINDS.index("Message")
        conn.execute(
            "INSERT INTO messages (rowid, kind, id, tid, session_id, body) "
            f"VALUES (9000, ?, ?, {tid}, ?, ?)",
            (message, uuid_bytes(stray.id), *a, uuid_bytes(h.other.id), compact.encode(stray)),
        )
        conn.execute(
            f"INSERT INTO feed (tid, kind, record_id) VALUES ({tid}, ?, ?)",
            (*a, message, uuid_bytes(stray.id)),
        )
        stray_at = conn.execute("SELECT max(cursor) FROM feed").fetchone()[0]
        conn.commit()
    async with SQLiteServerStore(db_path) as store:
        pulled = await _raw_bodies(store, h.alice.tenant)
        assert pulled[:-1] == before and pulled[-1][0] == stray_at
        assert compact.decode(pulled[-1][1]) == stray
        assert await _raw_bodies(store, h.bob.tenant) == theirs
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
            migrated = named(conn)
            assert {c for c, names in migrated.items() if names} == sessions_at(conn) | {stray_at}
            assert migrated.keys() == written.keys() | {stray_at}
        assert server_file_problems(db_path) == [  # (the layout this build writes: not so)
            f"feed-orphan: entry {stray_at} (Message) has no row at its cursor",
            "row-unfed: messages row 9000 has no feed entry at it",
        ]
        # Later pushes: each record's and event's entry names no id, a session's its own.
        alice, session = h.alice, h.session
        new = [alice.message(session.id), alice.event(session.id), alice.checkpoint(session.id)]
        result = await store.push(alice.tenant, alice.client_id, alice.changes(*new), clock)
        assert statuses(result) == ["applied"] * 3
        edited = alice.edit(session, title="again")
        await store.push(alice.tenant, alice.client_id, alice.changes(edited), clock)
        feed = await pull_all(store, alice.tenant)
        assert [c.record.id for c in feed[-4:]] == [r.id for r in [*new, edited]]  # (placed)
        with sqlite3.connect(db_path) as conn:
            now = named(conn)
            assert [now[c.cursor] for c in feed[-4:]] == [False, False, False, True]
        # Deleting the session the stray belongs to takes it and its entry (found by its id),
        # with every other record of that session and its entry (found at its cursor).
        tomb = tombstone(alice, h.other)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert statuses(deleted) == ["applied"]
        left = {c.record.id for c in await pull_all(store, alice.tenant)}
        assert not left & {r.id for r in [*h.content, stray]}
        assert await _raw_bodies(store, h.bob.tenant) == theirs
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        gone = {uuid_bytes(r.id) for r in [*h.content, stray]}
        for table in ("records", "messages"):
            assert not {bytes(k) for (k,) in conn.execute(f"SELECT id FROM {table}")} & gone
        assert stray_at not in named(conn)
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(feed)")}
        assert indexes == {"sqlite_autoindex_feed_1", "feed_session"}
    assert server_file_problems(db_path) == []


async def test_the_feed_is_kept_by_tenant_and_cursor(db_path: Path) -> None:
    """Schema 17: the feed is a table keyed by ``(tid, cursor)`` (``WITHOUT ROWID``: no index
    of it by tenant), its high-water mark in ``feed_head``. A file of schema 16 opens at 17
    pulling the very bytes it pulled; a cursor handed out before (its entry gone) is never
    given again; every statement that finds an entry by tenant and cursor searches the
    table's key, none scans it."""
    from tests.sim.invariants import server_file_problems

    clock, h, before, theirs = await _placed_file(db_path)
    with sqlite3.connect(db_path) as conn:
        head = conn.execute("SELECT cursor FROM feed_head").fetchone()[0]
        assert head == max(c for c, _ in before + theirs)
        _as_schema_16(conn)
        # Cursors handed out before whose entries have gone (the file's high-water mark).
        conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'feed'", (head + 5,))
        conn.commit()
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'feed_head'").fetchall() == []
    async with SQLiteServerStore(db_path) as store:
        assert await _raw_bodies(store, h.alice.tenant) == before
        assert await _raw_bodies(store, h.bob.tenant) == theirs
        alice = h.alice
        new = [alice.message(h.session.id), alice.event(h.session.id)]
        result = await store.push(alice.tenant, alice.client_id, alice.changes(*new), clock)
        assert result.cursors == [head + 6, head + 7]
        mine = await pull_all(store, alice.tenant)
        assert [c.cursor for c in mine[-2:]] == [head + 6, head + 7]
        tomb = tombstone(alice, h.other)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert deleted.cursors == [head + 8]
        left = {c.record.id for c in await pull_all(store, alice.tenant)}
        assert not left & {r.id for r in h.content}
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'feed'").fetchone()[0]
        assert sql.rstrip().endswith("WITHOUT ROWID")
        assert conn.execute("SELECT cursor FROM feed_head").fetchone()[0] == head + 8
        assert (
            conn.execute("SELECT count(*) FROM sqlite_sequence WHERE name = 'feed'").fetchone()[0]
            == 0
        )
        conn.create_function("pleach_key", 1, lambda value: value, deterministic=True)
        t = (alice.tenant.org_id, alice.tenant.user_id)
        for statement, params in (
            (server_sqlite._PULL_SQL, (1 << 40, *t, 0, 100)),
            (server_sqlite._DROP_ENTRY_SQL, (*t, 1)),
            (server_sqlite._HEAD_SQL, (*t, *t)),
            (server_sqlite._DOOMED_SQL, (*t, "[]")),
            (server_sqlite._SUPERSEDED_SQL, (*t, b"session", 5)),
            (server_sqlite._COMPACT, (*t, 5)),
        ):
            plan = " | ".join(
                row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", params)
            )
            assert "SCAN f" not in plan and "SCAN feed" not in plan, plan
            assert "feed" not in plan or "PRIMARY KEY" in plan or "feed_session" in plan, plan
        # A session's older entries are found among sessions' entries alone, not by reading
        # the tenant's entries below a cursor.
        for statement, params in (
            (server_sqlite._SUPERSEDED_SQL, (*t, b"session", 5)),
            (server_sqlite._COMPACT, (*t, 5)),
        ):
            plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", params)]
            feed = [step for step in plan if " feed " in f" {step} " or " later " in step]
            assert feed and all("feed_session" in step for step in feed), plan
    assert server_file_problems(db_path) == []


async def test_a_long_sessions_ids_are_kept_in_blocks_a_page_holds(db_path: Path) -> None:
    """Schema 18: a long session's ids in blocks of 124 (1,984 bytes), two to a page of a
    rowid table (no overflow page; a block of 128 in the ``WITHOUT ROWID`` table before
    overflowed). A file of schema 17 (blocks of 128) opens at 18 with every session's blocks
    cut again, pulls the very bytes it pulled before, and a turn then writes the one block it
    appended to; sessions of every length around a block's edges come through alike."""
    clock = HybridClock("server")
    dev = Device(new_tenant())
    ids = [uuid7() for _ in range(2_100)]
    lengths = [129, 180, 256, 257, 300, 2_000]  # (more than 128: kept in blocks)
    sessions = [dev.session(message_ids=ids[:n]) for n in lengths]
    async with SQLiteServerStore(db_path) as store:
        store._id_layout = ID_LAYOUT  # (as schema 17 wrote them: blocks of 128)
        await store.push(dev.tenant, dev.client_id, dev.changes(*sessions), clock)
        before = await _raw_bodies(store, dev.tenant)

    def blocks(conn: sqlite3.Connection) -> dict[Any, list[int]]:
        found: dict[Any, list[int]] = {}
        for key, part, size in conn.execute(
            "SELECT id, part, length(ids) FROM session_ids ORDER BY id, part"
        ):
            assert part == len(found.setdefault(bytes(key), []))
            found[bytes(key)].append(size // 16)
        return found

    def pages(conn: sqlite3.Connection, kind: str) -> int:
        rows = conn.execute(
            "SELECT count(*) FROM dbstat WHERE name = 'session_ids' AND pagetype = ?", (kind,)
        )
        return int(rows.fetchone()[0])

    def overflow(conn: sqlite3.Connection) -> int:
        return pages(conn, "overflow")

    with sqlite3.connect(db_path) as conn:
        _as_schema_17(conn)
        old = blocks(conn)
        assert sorted(map(sum, old.values())) == lengths
        assert max(map(max, old.values())) == 128 and overflow(conn) > 0
    async with SQLiteServerStore(db_path) as store:
        assert await _raw_bodies(store, dev.tenant) == before
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
            cut = blocks(conn)
            assert overflow(conn) == 0
            held = sum(map(len, cut.values()))
            assert pages(conn, "leaf") <= held // 2 + 1  # (two blocks a page)
        assert cut.keys() == old.keys()
        for key, sizes in cut.items():
            n = sum(old[key])
            assert sizes == [124] * (n // 124) + ([n % 124] if n % 124 else [])
        # A turn of the longest: the row and the one block it appended to.
        statements: list[str] = []
        assert store._writer is not None
        store._writer._conn.set_trace_callback(statements.append)
        longest = dev.edit(sessions[-1], message_ids=ids[:2_002])
        result = await store.push(dev.tenant, dev.client_id, dev.changes(longest), clock)
        assert statuses(result) == ["applied"]
        written = [x for x in statements if x.startswith("INSERT OR REPLACE INTO session_ids")]
        assert len(written) == 1
        feed = await pull_all(store, dev.tenant)
        assert [c.record for c in feed] == [*sessions[:-1], longest]
    with sqlite3.connect(db_path) as conn:
        assert blocks(conn)[uuid_bytes(longest.id)] == [124] * 16 + [18]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_an_event_names_its_sessions_chain_by_a_number(db_path: Path) -> None:
    """Schema 19: an event names its session's chain by a number (``chains``, one row for
    each tenant's session with events) where it held the session's id. Two tenants' sessions
    under one id are two chains; each pulls its own events, linked as placed; a file of
    schema 18 opens at 19 pulling the very bytes it pulled, and its chains go on; the reads
    by chain and place search the events' unique key."""
    clock = HybridClock("server-x")
    alice, bob = Device(new_tenant()), Device(new_tenant())
    shared_id = uuid7()
    mine, theirs = alice.session(id=shared_id), bob.session(id=shared_id)
    other = alice.session()

    async def chain(store: SQLiteServerStore, dev: Device, session_id: str) -> list[Event]:
        feed = await pull_all(store, dev.tenant)
        return [
            c.record
            for c in feed
            if isinstance(c.record, Event) and c.record.session_id == session_id
        ]

    async with SQLiteServerStore(db_path) as store:
        for dev, session in ((alice, mine), (bob, theirs), (alice, other)):
            events = [dev.event(session.id) for _ in range(3)]
            result = await store.push(
                dev.tenant, dev.client_id, dev.changes(session, *events), clock
            )
            assert statuses(result) == ["applied"] * 4
        before = {dev: await _raw_bodies(store, dev.tenant) for dev in (alice, bob)}
    with sqlite3.connect(db_path) as conn:
        chains = conn.execute("SELECT n, tid, session_id FROM chains ORDER BY n").fetchall()
        assert [bytes(k) for _, _, k in chains] == [
            uuid_bytes(x) for x in (shared_id, shared_id, other.id)
        ]
        assert len({tid for _, tid, _ in chains}) == 2  # (alice's two, bob's one)
        per_chain = dict(conn.execute("SELECT chain, count(*) FROM events GROUP BY chain"))
        assert per_chain == {n: 3 for n, _, _ in chains}
        _as_schema_18(conn)
        conn.commit()
    async with SQLiteServerStore(db_path) as store:
        for dev in (alice, bob):
            assert await _raw_bodies(store, dev.tenant) == before[dev]
        for dev, session in ((alice, mine), (bob, theirs)):
            more = [dev.event(session.id), dev.event(session.id)]
            result = await store.push(dev.tenant, dev.client_id, dev.changes(*more), clock)
            assert statuses(result) == ["applied", "applied"]
            log = await chain(store, dev, session.id)
            assert [e.sequence_number for e in log] == [1, 2, 3, 4, 5]
            assert [e.prev_hash for e in log[1:]] == [e.row_hash for e in log[:-1]]
            assert {e.client_id for e in log} == {dev.client_id}  # (its tenant's own)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        columns = [row[1] for row in conn.execute("PRAGMA table_info(events)")]
        assert columns == ["id", "chain", "sequence_number", "tid", "body", "device"]
        assert conn.execute("SELECT count(*) FROM chains").fetchone()[0] == 3
        # Forms as placed: the first of a chain keeps its prev_hash, the others leave it out.
        forms = conn.execute(
            "SELECT chain, group_concat(hex(substr(body, 2, 1)), ',') FROM "
            "(SELECT chain, body FROM events ORDER BY chain, sequence_number) GROUP BY chain"
        ).fetchall()
        assert {f for _, f in forms} >= {"01,11,11,11,11", "01,11,11"}
        conn.create_function("pleach_key", 1, lambda value: value, deterministic=True)
        t = (alice.tenant.org_id, alice.tenant.user_id)
        for statement, params in (
            (f"SELECT {server_sqlite._prev_digest('1', '2')}", ()),
            (server_sqlite._CHAIN_TAILS_SQL, (*t, "[]")),
        ):
            plan = " | ".join(
                row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", params)
            )
            assert "SCAN p" not in plan and "SCAN events" not in plan, plan
            assert "sqlite_autoindex_events_2 (chain=? AND sequence_number" in plan, plan


async def test_a_record_names_its_session_by_its_number(db_path: Path) -> None:
    """Schema 20: a record (a message too) names its session by its number in ``chains``,
    and the index a session's delete reads is on that number alone. Two tenants' sessions
    under one id are two numbers: one tenant's delete takes its own records of it and none
    of the other's. A file of schema 19 opens at 20 pulling the very bytes it pulled, every
    record numbered as its tenant's session, and the delete reads the index by number."""
    clock = HybridClock("server-x")
    alice, bob = Device(new_tenant()), Device(new_tenant())
    shared_id = uuid7()
    mine, theirs = alice.session(id=shared_id), bob.session(id=shared_id)
    content = {
        dev: [dev.message(s.id), dev.checkpoint(s.id), dev.message(s.id), dev.audit(s.id)]
        for dev, s in ((alice, mine), (bob, theirs))
    }
    async with SQLiteServerStore(db_path) as store:
        for dev, session in ((alice, mine), (bob, theirs)):
            records = content[dev]
            result = await store.push(
                dev.tenant, dev.client_id, dev.changes(session, *records), clock
            )
            assert statuses(result) == ["applied"] * 5
        before = {dev: await _raw_bodies(store, dev.tenant) for dev in (alice, bob)}
    with sqlite3.connect(db_path) as conn:
        numbered = conn.execute(
            "SELECT c.tid, count(*) FROM (SELECT session FROM records UNION ALL "
            "SELECT session FROM messages) AS r JOIN chains AS c ON c.n = r.session GROUP BY c.n"
        ).fetchall()
        assert (
            sorted(count for _, count in numbered) == [4, 4] and len({t for t, _ in numbered}) == 2
        )
        _as_schema_19(conn)
        conn.commit()
        assert conn.execute("SELECT count(*) FROM chains").fetchone()[0] == 0  # (no events)
    async with SQLiteServerStore(db_path) as store:
        for dev in (alice, bob):
            assert await _raw_bodies(store, dev.tenant) == before[dev]
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
            assert conn.execute("SELECT count(*) FROM chains").fetchone()[0] == 2
            for table in ("records", "messages"):
                columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
                kept = ["kind", "id", "tid", "session", "body", "device"]
                assert columns == kept + (["prev_row"] if table == "records" else [])
                index = [row[2] for row in conn.execute(f"PRAGMA index_info({table}_session)")]
                assert index == ["session"]
                assert not conn.execute(f"SELECT 1 FROM {table} WHERE session IS NULL").fetchall()
            conn.create_function("pleach_key", 1, lambda value: value, deterministic=True)
            plan = " | ".join(
                row[3]
                for row in conn.execute(
                    f"EXPLAIN QUERY PLAN {server_sqlite._CASCADE_CANDIDATES_SQL}",
                    ("[]", alice.tenant.org_id, alice.tenant.user_id, "[]"),
                )
            )
            assert "records_session (session=?)" in plan and "messages_session (session=?)" in plan
        later = alice.message(mine.id)
        result = await store.push(alice.tenant, alice.client_id, alice.changes(later), clock)
        assert statuses(result) == ["applied"]
        tomb = tombstone(alice, mine)
        deleted = await store.push(alice.tenant, alice.client_id, alice.changes(tomb), clock)
        assert statuses(deleted) == ["applied"]
        left = {c.record.id for c in await pull_all(store, alice.tenant)}
        assert not left & {r.id for r in [*content[alice], later] if not isinstance(r, AuditRow)}
        assert await _raw_bodies(store, bob.tenant) == before[bob]  # (theirs, whole)
    from tests.sim.invariants import server_file_problems

    assert server_file_problems(db_path) == []
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # The simulation's check finds a row that names another tenant's session.
        theirs_n = conn.execute(
            "SELECT c.n FROM chains AS c JOIN tenants AS t ON t.tid = c.tid "
            "WHERE t.org_id = ? AND t.user_id = ?",
            (bob.tenant.org_id, bob.tenant.user_id),
        ).fetchone()[0]
        conn.execute(
            "UPDATE records SET session = ? WHERE rowid = (SELECT max(rowid) FROM records "
            "WHERE tid = (SELECT tid FROM tenants WHERE org_id = ? AND user_id = ?))",
            (theirs_n, alice.tenant.org_id, alice.tenant.user_id),
        )
    assert [p.split(" row ")[0] for p in server_file_problems(db_path)] == [
        "session-astray: records"
    ]


async def test_an_audit_place_names_its_chain_by_a_number_and_its_row_by_its_rowid(
    db_path: Path,
) -> None:
    """Schema 21: an audit row's place holds its chain's number (``audit_chains``: each
    tenant's client id, once) and the rowid of its row, whose body holds its row hash: a push
    reads a chain's last place there. A file of schema 20 opens at 21 with every place kept,
    two tenants' devices under one client id two chains; each chain then takes its next row
    and refuses any other with its last place, as before the migration, and later rows go on
    the same way."""
    from shared.hashchain import chain_audit

    clock = HybridClock("server-x")
    alice, bob = Device(new_tenant()), Device(new_tenant())
    laptop = Device(alice.tenant)
    twin = Device(bob.tenant, client_id=alice.client_id)  # (another tenant, the same id)
    sessions = {dev: dev.session() for dev in (alice, laptop, bob, twin)}
    async with SQLiteServerStore(db_path) as store:
        for dev, turns in ((alice, 3), (laptop, 2), (bob, 1), (twin, 4)):
            session = sessions[dev]
            rows = [
                r for _ in range(turns) for r in (dev.message(session.id), dev.audit(session.id))
            ]
            result = await store.push(dev.tenant, dev.client_id, dev.changes(session, *rows), clock)
            assert statuses(result) == ["applied"] * (1 + 2 * turns)
        before = {dev: await _raw_bodies(store, dev.tenant) for dev in (alice, bob)}
    with sqlite3.connect(db_path) as conn:
        chains = conn.execute(
            "SELECT c.tid, c.client_id, count(*), max(p.sequence_number) FROM audit_places AS p "
            "JOIN audit_chains AS c ON c.n = p.chain GROUP BY c.n ORDER BY 3"
        ).fetchall()
        assert [(n, top) for _, _, n, top in chains] == [(1, 1), (2, 2), (3, 3), (4, 4)]
        assert len({(tid, client) for tid, client, _, _ in chains}) == 4
        assert conn.execute("SELECT count(DISTINCT client_id) FROM audit_chains").fetchone()[0] == 3
        columns = [row[1] for row in conn.execute("PRAGMA table_info(audit_places)")]
        assert columns == ["chain", "sequence_number", "row"]
        _as_schema_20(conn)
        conn.commit()
        assert conn.execute("SELECT count(*) FROM audit_places").fetchone()[0] == 10
        # The migration finds each place's row through the records' key, the places the
        # outer loop (not the records scanned, each tenant's places searched for each).
        conn.execute(
            "CREATE TEMP TABLE audit_chains (n INTEGER PRIMARY KEY, tid INTEGER NOT NULL, "
            "client_id TEXT NOT NULL, UNIQUE (tid, client_id))"
        )
        conn.execute("CREATE TEMP TABLE audit_places_21 (chain, sequence_number, row)")
        plan = [
            row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {server_sqlite._PLACES_21_SQL}")
        ]
        conn.execute("DROP TABLE temp.audit_chains")
        conn.execute("DROP TABLE temp.audit_places_21")
        assert plan[0] == "SCAN p", plan
        assert any("records_key (tid=? AND kind=? AND id=?)" in step for step in plan), plan
    async with SQLiteServerStore(db_path) as store:
        for dev in (alice, bob):
            assert await _raw_bodies(store, dev.tenant) == before[dev]
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 23
            assert conn.execute("SELECT count(*) FROM audit_chains").fetchone()[0] == 4
            # Every place names an audit row of its chain's tenant at that place.
            placed = conn.execute(
                f"SELECT c.client_id, p.sequence_number, r.tid = c.tid, r.kind, "
                f"{server_sqlite._WHOLE_RECORD} FROM audit_places AS p "
                "JOIN audit_chains AS c ON c.n = p.chain JOIN records AS r ON r.rowid = p.row"
            ).fetchall()
            assert len(placed) == 10
            for client_id, number, own, kind, body in placed:
                row = compact.decode(body)
                assert (own, kind) == (1, server_sqlite._AUDIT_KIND)
                assert isinstance(row, AuditRow)
                assert (row.client_id, row.sequence_number) == (client_id, number)
            conn.create_function("pleach_key", 1, lambda value: value, deterministic=True)
            plan = " | ".join(
                row[3]
                for row in conn.execute(
                    f"EXPLAIN QUERY PLAN {server_sqlite._AUDIT_TAILS_SQL}",
                    (alice.tenant.org_id, alice.tenant.user_id, "[]"),
                )
            )
            assert "PRIMARY KEY (chain=? AND sequence_number=?)" in plan, plan
            assert "INTEGER PRIMARY KEY (rowid=?)" in plan, plan
        for dev in (alice, laptop, bob, twin):
            # A row past the chain's next place is refused with the chain's last place.
            last = dev.audit_head
            hole = chain_audit(dev.audit(sessions[dev].id), "f" * 64, last[0] + 5)
            dev.audit_head = last
            refused = await store.push(dev.tenant, dev.client_id, dev.changes(hole), clock)
            assert codes(refused) == [ErrorCode.CHAIN_BROKEN]
            assert (refused.results[0].chain_sequence, refused.results[0].chain_hash) == last
            dev.next_seq -= 1
            rows = [dev.audit(sessions[dev].id) for _ in range(2)]
            result = await store.push(dev.tenant, dev.client_id, dev.changes(*rows), clock)
            assert statuses(result) == ["applied", "applied"]
            # So is one at the next place that chains on from another hash.
            last = dev.audit_head
            wrong = chain_audit(dev.audit(sessions[dev].id), "0" * 64, last[0] + 1)
            dev.audit_head = last
            refused = await store.push(dev.tenant, dev.client_id, dev.changes(wrong), clock)
            assert codes(refused) == [ErrorCode.CHAIN_BROKEN]
            assert (refused.results[0].chain_sequence, refused.results[0].chain_hash) == last
            dev.next_seq -= 1
    from tests.sim.invariants import server_file_problems

    assert server_file_problems(db_path) == []
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # The simulation's check finds a place whose row is not an audit row of its tenant.
        conn.execute(
            "UPDATE audit_places SET row = (SELECT min(rowid) FROM messages) "
            "WHERE chain = 1 AND sequence_number = 1"
        )
    assert [p.split(" place ")[0] for p in server_file_problems(db_path)] == ["place-astray:"]


async def test_an_audit_row_keeps_its_row_hash_in_front_and_its_prev_hash_in_the_row_before(
    db_path: Path,
) -> None:
    """Schema 22: an audit row's body keeps its row hash in front (form 18) and leaves out
    its prev_hash (form 19, 36 bytes fewer than form 2) where a row at the place before it in
    its chain holds that digest in front, which it names (``prev_row``); every read gives
    back the bytes pushed. A file of schema 21 opens at 22 with its rows as they were, the
    next row of each chain keeping its prev_hash (the row before holds no digest in front)
    and the rows after leaving it out. Rows a device of protocol 2 pushes unchecked (two at
    one place, a row before the one it chains on from, a prev_hash no row holds) read back
    as they were pushed too."""
    from shared.hashchain import chain_audit

    clock = HybridClock("server-x")
    alice = Device(new_tenant())
    laptop = Device(alice.tenant)
    session = alice.session()
    pushed: list[AuditRow] = []

    def forms(conn: sqlite3.Connection) -> dict[str, tuple[bytes, str | None]]:
        """Each audit row's form and the id of the row its ``prev_row`` names."""
        rows = conn.execute(
            "SELECT r.id, substr(r.body, 1, 2), q.id FROM records AS r "
            "LEFT JOIN records AS q ON q.rowid = r.prev_row WHERE r.kind = ?",
            (server_sqlite._AUDIT_KIND,),
        )
        return {
            uuid_text(key): (bytes(form), None if prev is None else uuid_text(prev))
            for key, form, prev in rows
        }

    async def read_back(store: SQLiteServerStore) -> None:
        bodies = {
            r.id: b for _, b in await _raw_bodies(store, alice.tenant) for r in [compact.decode(b)]
        }
        for row in pushed:
            assert bodies[row.id] == compact.encode(row)

    async with SQLiteServerStore(db_path) as store:
        for dev, turns in ((alice, 3), (laptop, 2)):
            rows = [dev.audit(session.id) for _ in range(turns)]
            records = [session, *rows] if dev is alice else rows
            result = await store.push(dev.tenant, dev.client_id, dev.changes(*records), clock)
            assert statuses(result) == ["applied"] * len(records)
            pushed += rows
        await read_back(store)
    a, b = pushed[:3], pushed[3:]
    with sqlite3.connect(db_path) as conn:
        assert forms(conn) == {
            a[0].id: (b"\xc1\x12", None),
            a[1].id: (b"\xc1\x13", a[0].id),
            a[2].id: (b"\xc1\x13", a[1].id),
            b[0].id: (b"\xc1\x12", None),
            b[1].id: (b"\xc1\x13", b[0].id),
        }
        sizes = dict(
            conn.execute(
                "SELECT id, length(body) FROM records WHERE kind = ?", (server_sqlite._AUDIT_KIND,)
            )
        )
        _as_schema_21(conn)
        conn.commit()
        heads = conn.execute(
            "SELECT DISTINCT substr(body, 1, 2) FROM records WHERE kind = ?",
            (server_sqlite._AUDIT_KIND,),
        )
        assert heads.fetchall() == [(b"\xc1\x02",)]
        grown = dict(
            conn.execute(
                "SELECT id, length(body) FROM records WHERE kind = ?", (server_sqlite._AUDIT_KIND,)
            )
        )
        assert sorted(grown[k] - sizes[k] for k in sizes) == [1, 1, 36, 36, 36]
    async with SQLiteServerStore(db_path) as store:
        await read_back(store)  # (at 22, its rows as schema 21 wrote them)
        more = [alice.audit(session.id) for _ in range(2)]
        result = await store.push(alice.tenant, alice.client_id, alice.changes(*more), clock)
        assert statuses(result) == ["applied", "applied"]
        pushed += more
        # A device of protocol 2, unchecked: a second row at place 2 of its chain, a row at
        # place 3 chained on from it, one that names a prev_hash no row holds, and a row
        # that goes in before the row it chains on from.
        old = Device(alice.tenant)
        first = old.audit(session.id)
        second, twin = old.audit(session.id), chain_audit(old.audit(session.id), first.row_hash, 2)
        third = chain_audit(old.audit(session.id), twin.row_hash, 3)
        stray = chain_audit(old.audit(session.id), "e" * 64, 4)
        late = old.audit(session.id)
        after_late = chain_audit(old.audit(session.id), late.row_hash, late.sequence_number + 1)
        unchecked = [first, second, twin, third, stray, after_late, late]
        result = await store.push(
            alice.tenant, old.client_id, old.changes(*unchecked), clock, chains=False
        )
        assert statuses(result) == ["applied"] * len(unchecked)
        pushed += unchecked
        await read_back(store)
    with sqlite3.connect(db_path) as conn:
        now = forms(conn)
        assert now[more[0].id] == (b"\xc1\x12", None)  # (the row before: form 2)
        assert now[more[1].id] == (b"\xc1\x13", more[0].id)
        assert now[second.id] == (b"\xc1\x13", first.id)
        assert now[twin.id] == (b"\xc1\x13", first.id)
        assert now[third.id] == (b"\xc1\x13", twin.id)
        assert now[stray.id] == (b"\xc1\x12", None)
        assert now[after_late.id] == (b"\xc1\x12", None)  # (its row before not in yet)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    from tests.sim.invariants import server_file_problems

    assert server_file_problems(db_path) == []
