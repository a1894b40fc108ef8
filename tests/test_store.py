"""Local stores: the conformance suite against both adapters, then SQLite-only behaviour
(durability, pragmas, migrations, corruption, transactions, locking, lifecycle)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import operator
import random
import re
import secrets
import sqlite3
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import aiosqlite
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The suite lives outside a test module: ask pytest to rewrite its asserts too.
pytest.register_assert_rewrite("tests.store_conformance")

from pleach_client.store import (  # noqa: E402
    MemoryAdapter,
    SQLiteAdapter,
    StorageAdapter,
    queued,
)
from pleach_client.store import sqlite as sqlite_module  # noqa: E402
from pleach_client.store.base import InPlace, Plan, Rerunnable, WriteBatch  # noqa: E402
from pleach_client.store.sqlite import QUERIES, SCHEMA_VERSION  # noqa: E402
from shared import (  # noqa: E402
    compact,
    hashchain,
    idrefs,
)
from shared.errors import InvalidState, StorageError  # noqa: E402
from shared.hashchain import chain_audit, chain_event  # noqa: E402
from shared.ids import uuid7  # noqa: E402
from shared.records import AuditRow, Checkpoint, Event, Record, SessionState, encode_record  # noqa: E402
from tests.factories import (  # noqa: E402
    CLIENT,
    count_hops,
    make_audit,
    make_checkpoint,
    make_event,
    make_message,
    make_session,
    small_id_blocks,
)
from tests.store_conformance import (  # noqa: E402
    StoreConformance,
    commit,
    one_of_each,
    read_back,
)

TABLES = {
    "sessions",
    "messages",
    "checkpoints",
    "events",
    "audit",
    "artifact_updates",
    "outbox",
    "dead_letters",
    "sync_state",
}


@pytest.fixture(params=["memory", "sqlite", "sqlite-blocks"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageAdapter]:
    """Each store; ``sqlite-blocks``: every session's message ids in small blocks."""
    adapter: StorageAdapter
    if request.param == "memory":
        adapter = MemoryAdapter()
    else:
        adapter = SQLiteAdapter(tmp_path / "x.db")
        if request.param == "sqlite-blocks":
            small_id_blocks(adapter)
    await adapter.open()
    try:
        yield adapter
    finally:
        await adapter.close()


class TestStoreConformance(StoreConformance):
    pass


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "x.db"


@pytest.fixture
async def sqlite_store(db_path: Path) -> AsyncIterator[SQLiteAdapter]:
    async with SQLiteAdapter(db_path) as adapter:
        yield adapter


def raw(path: Path) -> sqlite3.Connection:
    """A plain sqlite3 connection in autocommit mode, to inspect or damage a file; it reads
    ids as the store keeps them (``pleach_key``, as the store's own connection does)."""
    conn = sqlite3.connect(path, isolation_level=None)
    sqlite_module.sql_functions(conn)
    return conn


key, unkey = sqlite_module._key, sqlite_module._id


@contextlib.contextmanager
def locked_elsewhere(path: Path) -> Iterator[None]:
    """Another process's write lock on the file (``BEGIN IMMEDIATE`` on a plain connection),
    held while inside, then rolled back."""
    other = raw(path)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_durability_flags() -> None:
    assert MemoryAdapter.durable is False
    assert SQLiteAdapter.durable is True


# -- durability ---------------------------------------------------------------------------


async def test_data_survives_close_and_reopen(db_path: Path) -> None:
    records = one_of_each()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *records, meta={"cursor": "12"})
        await store.outbox_dead_letter(2, 3007, "invalid")
        await store.outbox_mark_attempt([3], 3009, "unavailable")
        await store.outbox_remove([1, 4, 5, 6])
    async with SQLiteAdapter(db_path) as store:
        for record in records:
            assert await read_back(store, record) == record
        assert await store.get_meta("cursor") == "12"
        (entry,) = await store.outbox_pending()
        assert (entry.client_seq, entry.attempts, entry.last_error_code) == (3, 1, 3009)
        (letter,) = await store.dead_letters()
        assert (letter.client_seq, letter.record) == (2, records[1])
        # Sequence numbers continue after the largest ever used, not the largest still queued.
        assert (await commit(store, make_session())).client_seqs == [7]
        assert await store.retry_dead_letter(2) == 8


# -- pragmas and lifecycle ----------------------------------------------------------------


async def test_wal_and_synchronous_normal_by_default(sqlite_store: SQLiteAdapter) -> None:
    assert await sqlite_store.settings() == {
        "journal_mode": "wal",
        "synchronous": "NORMAL",
        "busy_timeout_ms": 5000,
        "schema_version": SCHEMA_VERSION,
    }


async def test_synchronous_full_and_busy_timeout(db_path: Path) -> None:
    async with SQLiteAdapter(db_path, synchronous="FULL", busy_timeout_ms=1234) as store:
        settings = await store.settings()
    assert settings["synchronous"] == "FULL"
    assert settings["busy_timeout_ms"] == 1234
    assert settings["journal_mode"] == "wal"


def test_bad_settings_are_refused(db_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteAdapter(db_path, synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_timeout_ms"):
        SQLiteAdapter(db_path, busy_timeout_ms=-1)


async def test_unopenable_path_raises_storage_error(tmp_path: Path) -> None:
    store = SQLiteAdapter(tmp_path / "missing-dir" / "x.db")
    with pytest.raises(StorageError, match="open"):
        await store.open()
    with pytest.raises(InvalidState):
        await store.get_meta("cursor")


async def test_store_dropped_while_open_warns(db_path: Path) -> None:
    store = SQLiteAdapter(db_path)
    await store.open()
    conn = store._conn
    assert conn is not None
    with pytest.warns(ResourceWarning, match="unclosed"):
        del store
        gc.collect()
    await conn.close()


async def test_close_completes_when_the_caller_is_cancelled(db_path: Path) -> None:
    store = SQLiteAdapter(db_path)
    await store.open()
    session = make_session()
    await commit(store, session)
    conn = store._conn
    assert conn is not None
    started = asyncio.Event()

    async def closer() -> None:
        started.set()
        await store.close()  # runs on until it suspends inside the shielded close

    task = asyncio.create_task(closer())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.close()  # waits for the close already under way
    with pytest.raises(ValueError):  # aiosqlite: the connection is gone
        await conn.execute("SELECT 1")
    async with SQLiteAdapter(db_path) as again:
        assert await again.get_session(session.id) == session


async def test_close_waits_for_the_commit_in_progress(db_path: Path) -> None:
    store = SQLiteAdapter(db_path)
    await store.open()
    session = make_session()
    # gather starts the commit first: it is inside its transaction when close() begins.
    receipt, _ = await asyncio.gather(commit(store, session), store.close())
    assert receipt.client_seqs == [1]
    async with SQLiteAdapter(db_path) as again:
        assert await again.get_session(session.id) == session
        assert await again.outbox_count() == 1


# -- migrations ---------------------------------------------------------------------------


def _schema(path: Path) -> list[tuple[str, str]]:
    conn = raw(path)
    try:
        rows = conn.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    finally:
        conn.close()
    return [(str(name), str(sql)) for name, sql in rows]


def _user_version(path: Path) -> int:
    conn = raw(path)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


async def test_fresh_file_gets_the_current_schema(db_path: Path) -> None:
    async with SQLiteAdapter(db_path):
        pass
    assert _user_version(db_path) == SCHEMA_VERSION
    names = {name for name, _ in _schema(db_path)}
    assert names >= TABLES


async def test_reopening_is_idempotent(db_path: Path) -> None:
    session = make_session()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session)
    before = _schema(db_path)
    for _ in range(2):
        async with SQLiteAdapter(db_path) as store:
            assert await store.get_session(session.id) == session
    assert _schema(db_path) == before
    assert _user_version(db_path) == SCHEMA_VERSION


async def test_newer_schema_is_refused_untouched(db_path: Path) -> None:
    conn = raw(db_path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    store = SQLiteAdapter(db_path)
    with pytest.raises(StorageError, match=r"schema version 99, newer than .* upgrade pleach"):
        await store.open()
    assert _user_version(db_path) == 99
    assert [name for name, _ in _schema(db_path)] == ["future"]
    conn = raw(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal"
    conn.close()


async def test_failed_migration_changes_nothing(db_path: Path) -> None:
    conn = raw(db_path)
    conn.execute("CREATE TABLE outbox (x)")  # collides with a table of step 1
    conn.close()
    with pytest.raises(StorageError, match="outbox"):
        await SQLiteAdapter(db_path).open()
    assert _user_version(db_path) == 0
    assert [name for name, _ in _schema(db_path)] == ["outbox"]


# -- corruption and integrity -------------------------------------------------------------


async def test_a_corrupt_message_among_many_is_named(db_path: Path) -> None:
    """A transcript is decoded in one loop; a bad row in it (garbage, or a well-formed body
    of another kind) still fails the read with that row's id, wherever it lies."""
    session = make_session()
    messages = [make_message(session_id=session.id) for _ in range(40)]
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, *messages)
    ids = [m.id for m in messages]
    for at, damage in (
        (0, "x'c1ff00'"),
        (17, "(SELECT body FROM sessions LIMIT 1)"),
        (39, "x'90'"),
    ):
        conn = raw(db_path)
        original = conn.execute(
            "SELECT body FROM messages WHERE id = ?", (key(ids[at]),)
        ).fetchone()
        conn.execute(f"UPDATE messages SET body = {damage} WHERE id = ?", (key(ids[at]),))
        conn.close()
        async with SQLiteAdapter(db_path) as store:
            with pytest.raises(StorageError, match=rf"messages \(id '{ids[at]}'\)"):
                await store.get_messages(ids)
        conn = raw(db_path)
        conn.execute("UPDATE messages SET body = ? WHERE id = ?", (original[0], key(ids[at])))
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert await store.get_messages(ids) == messages


async def test_corrupt_rows_raise_storage_error_naming_table_and_id(db_path: Path) -> None:
    session, message = make_session(), make_message()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, message)
        await store.outbox_dead_letter(2, 3007, "invalid")
    conn = raw(db_path)
    # A well-formed body of the wrong kind is corrupt too.
    conn.execute(
        "UPDATE messages SET body = (SELECT body FROM sessions LIMIT 1) WHERE id = ?",
        (key(message.id),),
    )
    conn.execute("UPDATE sessions SET body = x'c1ff00' WHERE id = ?", (key(session.id),))
    conn.execute("UPDATE outbox SET refs = x'c1'")
    conn.execute("UPDATE dead_letters SET body = 'text, not msgpack'")
    conn.close()
    async with SQLiteAdapter(db_path) as store:
        with pytest.raises(StorageError, match=rf"corrupt row in sessions \(id '{session.id}'\)"):
            await store.get_session(session.id)
        with pytest.raises(StorageError, match="sessions"):
            await store.list_sessions()
        with pytest.raises(StorageError, match=rf"messages \(id '{message.id}'\)"):
            await store.get_messages([message.id])
        with pytest.raises(StorageError, match=r"outbox \(id 1\)"):
            await store.outbox_pending()
        with pytest.raises(StorageError, match=r"dead_letters \(id 2\)"):
            await store.dead_letters()
        assert await store.integrity_check() == []  # the file itself is sound


async def test_integrity_check_after_writes(sqlite_store: SQLiteAdapter) -> None:
    for _ in range(20):
        await commit(sqlite_store, *one_of_each(), meta={"cursor": "1"})
    await sqlite_store.outbox_remove(list(range(1, 60)))
    await sqlite_store.gdpr_soft_delete("alice")
    assert await sqlite_store.integrity_check() == []


# -- transactions -------------------------------------------------------------------------


async def test_commit_is_one_transaction(sqlite_store: SQLiteAdapter) -> None:
    conn = sqlite_store._conn
    assert conn is not None
    statements: list[str] = []
    await conn.set_trace_callback(statements.append)
    before = conn.total_changes
    records: list[Record] = [make_message(session_id="s") for _ in range(50)]
    records += [make_event(session_id="s", sequence_number=n) for n in range(20)]
    await commit(sqlite_store, make_session(id="s"), *records, meta={"cursor": "3"})
    await conn.set_trace_callback(None)  # type: ignore[arg-type]  # sqlite3 takes None
    verbs = [statement.split()[0].upper() for statement in statements]
    assert verbs.count("BEGIN") == 1
    assert verbs.count("COMMIT") == 1
    assert "ROLLBACK" not in verbs
    # 71 records; their outbox in two rows (64 entries a row at most), the session's entry
    # indexed and the sequence moved past them; one meta key and the session's number (its
    # first events): all in that one transaction.
    assert conn.total_changes - before == 71 + 2 + 1 + 1 + 1 + 1


class _CountingConnection:
    """Counts the awaited calls made on an aiosqlite connection."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "_conn":  # the raw sqlite3 connection, not a call
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("extra_keys", [0, sqlite_module._META_PREFETCH])
async def test_a_plan_reads_the_meta_keys_as_they_stand_in_its_transaction(
    sqlite_store: SQLiteAdapter, db_path: Path, extra_keys: int
) -> None:
    """The meta rows a plan reads come with its BEGIN: another process's write just before
    is seen, the plan's own batch is not (it comes after the last read), and a table with
    more rows than are read at once is read key by key, with the same answers."""
    from pleach_client.store.base import TxReader, WriteBatch

    other = raw(db_path)  # another process on the same file
    try:
        other.executemany(
            "INSERT INTO sync_state (key, value) VALUES (?, ?)",
            [(f"filler-{i}", "x") for i in range(extra_keys)],
        )
        other.execute("INSERT INTO sync_state (key, value) VALUES ('generation', 'theirs')")
    finally:
        other.close()
    seen: list[str | None] = []

    async def plan(tx: TxReader) -> WriteBatch:
        seen.extend([await tx.get_meta("generation"), await tx.get_meta("absent")])
        batch = WriteBatch(records=[], meta={"generation": "ours"})
        seen.append(await tx.get_meta("generation"))  # the batch is not written yet
        return batch

    await sqlite_store.transact(plan)
    assert seen == ["theirs", None, "theirs"]
    assert await sqlite_store.get_meta("generation") == "ours"


async def test_round_trips_do_not_grow_with_the_batch(sqlite_store: SQLiteAdapter) -> None:
    async def calls_for(size: int) -> Counter[str]:
        proxy = _CountingConnection(sqlite_store._conn)
        sqlite_store._conn = proxy  # type: ignore[assignment]
        try:
            await commit(
                sqlite_store,
                make_session(),
                *(make_message() for _ in range(size)),
                *(make_event() for _ in range(size)),
                meta={"cursor": str(size)},
            )
        finally:
            sqlite_store._conn = proxy.inner
        return proxy.calls

    small, large = await calls_for(2), await calls_for(300)
    assert small == large
    # Two hops to the connection's thread, whatever the batch: BEGIN with the device's meta
    # rows (the plan's reads of them cost none), then the whole batch (an executemany per
    # table touched, the outbox and the meta keys) ending with COMMIT.
    assert large == Counter({"_execute": 2}), large


async def test_failure_mid_transaction_rolls_everything_back(sqlite_store: SQLiteAdapter) -> None:
    session, message = make_session(), make_message()
    # Encodes fine (msgpack uint64), but does not fit SQLite's INTEGER: fails at the events
    # insert, after the session and message rows were written inside the transaction.
    bad = make_event(sequence_number=2**63)
    with pytest.raises(StorageError) as info:
        await commit(sqlite_store, session, message, bad, meta={"cursor": "1"})
    assert info.value.retryable is False
    assert await sqlite_store.get_session(session.id) is None
    assert await sqlite_store.get_messages([message.id]) == []
    assert await sqlite_store.get_meta("cursor") is None
    assert await sqlite_store.outbox_count() == 0
    assert (await commit(sqlite_store, session)).client_seqs == [1]


async def test_constraint_violation_is_a_storage_error(sqlite_store: SQLiteAdapter) -> None:
    session = make_session()
    with pytest.raises(StorageError, match="NOT NULL") as info:
        await commit(sqlite_store, session, make_message(session_id=None))
    assert info.value.retryable is False
    assert await sqlite_store.get_session(session.id) is None


async def test_locked_database_is_a_retryable_storage_error(db_path: Path) -> None:
    session = make_session()
    async with SQLiteAdapter(db_path, busy_timeout_ms=0) as store:
        with locked_elsewhere(db_path):  # another process holds the write lock
            with pytest.raises(StorageError, match="locked") as info:
                await commit(store, session)
            assert info.value.retryable is True
            assert await store.outbox_count() == 0  # reads still work under WAL
        assert (await commit(store, session)).client_seqs == [1]


# -- query plans --------------------------------------------------------------------------


# The outbox and dead letters are read whole, in rowid (client_seq) order: no index needed.
# The outbox is read in client_seq (rowid) order from its start: a scan of the rowid b-tree
# that stops at LIMIT, which is the access wanted.
# (``q``: the outbox's rows up to its LIMIT, which its sessions' id blocks are joined to.)
# ``message_span`` selects two scalar subqueries and no table: SQLite names that a scan of a
# constant row.
WHOLE_TABLE_READS = {"SCAN outbox", "SCAN o", "SCAN q", "SCAN dead_letters", "SCAN CONSTANT ROW"}


def _plan_problems(conn: sqlite3.Connection, sql: str) -> list[str]:
    numbered = [int(n) for n in re.findall(r"\?(\d+)", sql)]
    params = [None] * (max(numbered) if numbered else sql.count("?"))
    details = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
    return [
        detail
        for detail in details
        if "TEMP B-TREE" in detail
        or (
            detail.startswith("SCAN ")
            and "USING" not in detail
            and "json_each" not in detail
            and detail not in WHOLE_TABLE_READS
        )
    ]


async def test_every_query_uses_an_index(db_path: Path) -> None:
    async with SQLiteAdapter(db_path):
        pass
    statements = {name: sql.replace("{keys}", "?, ?") for name, sql in QUERIES.items()}
    for i, statement in enumerate(sqlite_module._PURGE_CHECKPOINTS):
        statements[f"purge_checkpoints_{i}"] = statement
    conn = raw(db_path)
    try:
        problems = {name: _plan_problems(conn, sql) for name, sql in statements.items()}
    finally:
        conn.close()
    assert {name: found for name, found in problems.items() if found} == {}


async def test_outbox_refers_to_records_instead_of_copying_them(db_path: Path) -> None:
    records = one_of_each()
    async with SQLiteAdapter(db_path) as store:
        receipt = await commit(store, *records)
        pending = await store.outbox_pending()
    assert [e.record for e in pending] == records
    assert [e.client_seq for e in pending] == receipt.client_seqs
    conn = raw(db_path)
    try:
        rows = conn.execute("SELECT client_seq, refs, live FROM outbox").fetchall()
    finally:
        conn.close()
    # One row for the commit (schema 18), its entries each a kind and a key, no copy.
    ((first, refs, live),) = rows
    entries = queued.unpack(refs)
    assert (first, live) == (receipt.client_seqs[0], len(records))
    assert [(e.kind, e.body) for e in entries if e is not None] == [
        (compact.KINDS.index(type(r).__name__), None) for r in records
    ]


async def test_outbox_rows_with_a_copy_from_older_files_still_flush(db_path: Path) -> None:
    message = make_message()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, message)
    conn = raw(db_path)
    try:  # an entry with a copy of its record, as older versions wrote them
        entry = queued.Queued(1, key(message.id), encode_record(message))
        conn.execute("UPDATE outbox SET refs = ?", (queued.pack([entry]),))
        conn.execute("DELETE FROM messages")
        conn.commit()
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert [e.record for e in await store.outbox_pending()] == [message]


@pytest.mark.parametrize("reclaim_pages", [8, sqlite_module.RECLAIM_PAGES])
async def test_a_drained_outbox_gives_its_pages_back(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, reclaim_pages: int
) -> None:
    """A new file is INCREMENTAL: once the server has a long offline stretch, the pages its
    outbox rows took go back to the OS instead of staying in the file as free pages. Under
    ``RECLAIM_PAGES`` a removal keeps them for the next commits to reuse, unless it empties
    the outbox: then they go back (``DRAINED_RECLAIM_PAGES``), so a device that has synced
    is no larger than its records."""
    monkeypatch.setattr(sqlite_module, "RECLAIM_PAGES", reclaim_pages)
    session = make_session()
    messages = [make_message(session_id=session.id) for _ in range(2000)]
    async with SQLiteAdapter(db_path) as store:
        receipt = await commit(store, session, *messages)
        conn = raw(db_path)
        try:
            assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            before = db_path.stat().st_size
            # A few pages, or (past the default's threshold) half of the outbox's: kept.
            first = 10 if reclaim_pages == 8 else len(receipt.client_seqs) // 2
            await store.outbox_remove(receipt.client_seqs[:first])
            kept = conn.execute("PRAGMA freelist_count").fetchone()[0]
            assert kept < reclaim_pages
            assert kept >= (sqlite_module.DRAINED_RECLAIM_PAGES if first > 10 else 0)
            await store.outbox_remove(receipt.client_seqs[first:])
            assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            assert db_path.stat().st_size < before
        finally:
            conn.close()
        assert await store.outbox_count() == 0
        assert await store.get_messages([m.id for m in messages]) == messages
        assert await store.integrity_check() == []


async def test_a_file_made_before_incremental_vacuum_keeps_its_mode(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "RECLAIM_PAGES", 3)
    conn = raw(db_path)
    try:  # as earlier versions made it: auto_vacuum NONE
        sqlite_module.create_schema(conn)
        conn.commit()
    finally:
        conn.close()
    session = make_session()
    async with SQLiteAdapter(db_path) as store:
        receipt = await commit(store, session, *(make_message() for _ in range(2000)))
        await store.outbox_remove(receipt.client_seqs)
        assert await store.outbox_count() == 0
        assert await store.get_session(session.id) == session
    conn = raw(db_path)
    try:
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] > 3  # kept for reuse
    finally:
        conn.close()


async def test_events_keep_their_type_beside_the_body(db_path: Path) -> None:
    """A reader of some types reads only their rows; rows written before schema 3 (no type
    beside the body) are read and sorted by their body, so none is missed. Since schema 9 a
    type in ``compact.WORDS`` is kept as its index's digits, any other as its text; rows of
    schema 3-8 keep the text of every type, and are read by it."""
    kinds = ["message.added", "turn.complete", "checkpoint.created", "turn.complete", "error"]
    kinds += ["my.plugin.event", "turn.complete"]
    events = [
        make_event(session_id="s-1", sequence_number=n, type=kind, payload={"n": n})
        for n, kind in enumerate(kinds, start=1)
    ]
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *events)
    conn = raw(db_path)
    try:
        stored = dict(conn.execute("SELECT id, type FROM events").fetchall())
        words = compact.WORDS
        assert stored == {
            key(e.id): str(words.index(e.type)) if e.type in words else e.type for e in events
        }
        assert stored[key(events[5].id)] == "my.plugin.event"  # no word: its text
        # As a file migrated from schema 2 holds them: no type beside the older rows; and
        # as schema 3-8 wrote them: the type's text.
        conn.execute("UPDATE events SET type = NULL WHERE sequence_number <= 2")
        conn.execute("UPDATE events SET type = 'turn.complete' WHERE sequence_number = 7")
        conn.commit()
        wanted = sqlite_module._type_keys({"error"})
        read = sqlite_module._select_events(conn, "s-1", 0, -1, wanted)
        assert [unkey(row[0]) for row in read] == [events[0].id, events[1].id, events[4].id]
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        wanted = {"turn.complete", "error"}
        expected = [events[1], events[3], events[4], events[6]]
        assert await store.list_events("s-1", types=wanted) == expected
        assert await store.list_events("s-1", types={"message.added"}) == [events[0]]
        assert await store.list_events("s-1", types={"my.plugin.event"}) == [events[5]]
        assert await store.list_events("s-1") == events
        assert await store.event_payloads("s-1", wanted) == [(e.type, e.payload) for e in expected]


async def test_a_checkpoint_keeps_its_parent_beside_its_body(db_path: Path) -> None:
    root = make_checkpoint(session_id="s-1")
    a, b = (make_checkpoint(session_id="s-1", parent_id=root.id) for _ in range(2))
    grandchild = make_checkpoint(session_id="s-1", parent_id=a.id)
    async with SQLiteAdapter(db_path) as store:
        await commit(store, root, a, b, grandchild)
    conn = raw(db_path)
    try:
        stored = dict(conn.execute("SELECT id, parent_id FROM checkpoints").fetchall())
        parents = {root.id: "", a.id: root.id, b.id: root.id, grandchild.id: a.id}
        assert stored == {key(child): key(parent) for child, parent in parents.items()}
        # The children query reads the head's children only (and rows without the column).
        query = QUERIES["child_checkpoints"]
        children = conn.execute(query, ("s-1", key(root.id)))
        assert [unkey(r[0]) for r in children] == [a.id, b.id]
        # As a file migrated from schema 3 holds them: no parent beside the older rows.
        conn.execute(
            "UPDATE checkpoints SET parent_id = NULL WHERE id IN (?, ?)", (key(a.id), key(b.id))
        )
        children = conn.execute(query, ("s-1", key(a.id)))
        assert [unkey(r[0]) for r in children] == [a.id, b.id, grandchild.id]
        conn.commit()
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:  # the body tells for a row without the column
        assert await store.child_checkpoints("s-1", root.id) == [a, b]
        assert await store.child_checkpoints("s-1", a.id) == [grandchild]
        assert await store.child_checkpoints("s-1", b.id) == []


async def test_no_query_reads_the_stamp_columns_of_messages_and_events(db_path: Path) -> None:
    """Schema 4 wrote '' there: the stamp is in the body, and the bytes went to nothing; since
    schema 12 events have no such column, since 16 messages neither, and since 15 no
    checkpoint has one (its stamp is read from its body)."""
    message = make_message(session_id="s-1")
    event = make_event(session_id="s-1", sequence_number=1)
    async with SQLiteAdapter(db_path) as store:
        await commit(store, message, event)
        assert await store.get_messages([message.id]) == [message]
        assert await store.list_events("s-1") == [event]
    conn = raw(db_path)
    try:
        for table in ("messages", "events", "checkpoints"):
            assert "hlc" not in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    finally:
        conn.close()
    for name, sql in QUERIES.items():
        assert "hlc" not in sql or not {"messages", "events", "checkpoints"} & set(sql.split()), (
            name
        )


async def _session_queued(store: SQLiteAdapter, session_id: str) -> bool:
    found: list[bool] = []

    async def plan(tx: Any) -> None:
        found.append(await tx.session_queued(session_id))

    await store.transact(plan)
    return found[0]


async def test_only_session_rows_of_the_outbox_are_indexed_by_record(db_path: Path) -> None:
    session = make_session(id="s-1")
    message = make_message(session_id="s-1")
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, message)
        assert await _session_queued(store, "s-1")
        assert not await _session_queued(store, message.id)  # a message is no session
        assert not await _session_queued(store, "s-2")
        await store.outbox_remove([1])  # (the session's entry acknowledged)
        assert not await _session_queued(store, "s-1")
        await commit(store, session)
    conn = raw(db_path)
    try:
        indexed = conn.execute(
            "SELECT session_id, entries, last_ref FROM outbox_sessions"
        ).fetchall()
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    finally:
        conn.close()
    assert indexed == [(key("s-1"), 1, 3)]  # (queued once, by reference, at 3)
    assert not {"ix_outbox_record", "ix_outbox_session"} & names


async def test_a_schema_3_file_migrates_to_4_with_nothing_lost(db_path: Path) -> None:
    conn = raw(db_path)
    root = make_checkpoint(session_id="s-1")
    child = make_checkpoint(session_id="s-1", parent_id=root.id)
    session = make_session(id="s-1")
    try:
        for step in sqlite_module._MIGRATIONS[:3]:
            for statement in step:
                conn.execute(statement)
        for cp in (root, child):
            conn.execute(
                "INSERT INTO checkpoints (id, session_id, hlc, body) VALUES (?, ?, ?, ?)",
                (cp.id, cp.session_id, cp.hlc, encode_record(cp)),
            )
        conn.execute(
            "INSERT INTO sessions (id, updated_at, deleted, body) VALUES (?, ?, 0, ?)",
            (session.id, session.updated_at, encode_record(session)),
        )
        conn.execute(
            "INSERT INTO outbox (record_id, kind, attempts, created_at) VALUES (?, 'Session', 0, 0)",
            (session.id,),
        )
        conn.execute("PRAGMA user_version = 3")
        conn.commit()
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert await store.child_checkpoints("s-1", root.id) == [child]
        assert await store.list_checkpoints("s-1") == [root, child]
        assert await _session_queued(store, "s-1")
        assert [e.record for e in await store.outbox_pending()] == [session]
    assert _user_version(db_path) == SCHEMA_VERSION


async def test_a_schema_2_file_gains_the_event_type_column(db_path: Path) -> None:
    conn = raw(db_path)
    try:
        for step in sqlite_module._MIGRATIONS[:2]:
            for statement in step:
                conn.execute(statement)
        event = make_event(session_id="s-1", sequence_number=1, type="turn.complete")
        conn.execute(
            "INSERT INTO events (id, session_id, sequence_number, hlc, body) VALUES (?, ?, ?, ?, ?)",
            (event.id, event.session_id, 1, event.hlc, encode_record(event)),
        )
        conn.execute("PRAGMA user_version = 2")
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert await store.list_events("s-1", types={"turn.complete"}) == [event]
        assert await store.list_events("s-1", types={"error"}) == []
    assert _user_version(db_path) == SCHEMA_VERSION


async def test_the_wal_is_checkpointed_beside_the_writer(db_path: Path) -> None:
    """Every ``CHECKPOINT_EVERY`` commits a checkpoint runs on a connection of its own, so no
    commit waits for SQLite's (which stays, at ``AUTOCHECKPOINT_PAGES``, as a safety net)."""
    every = sqlite_module.CHECKPOINT_EVERY
    async with SQLiteAdapter(db_path) as store:
        for _ in range(every - 1):
            await commit(store, make_message(session_id="s-1"))
        assert store._checkpoints.running is None
        before = db_path.stat().st_size  # the rows are in the WAL only
        await commit(store, make_message(session_id="s-1"))
        side = store._checkpoints.running
        assert side is not None
        await side
        assert db_path.stat().st_size > before  # copied into the file, beside the writer
        assert store._checkpoints.running is None
        autocheckpoint = await store._require_open().execute_fetchall("PRAGMA wal_autocheckpoint")
        assert list(autocheckpoint) == [(sqlite_module.AUTOCHECKPOINT_PAGES,)]


async def test_a_side_checkpoint_copies_first_beside_the_commits_then_under_the_lock(
    db_path: Path,
) -> None:
    """The side checkpoint runs twice: first beside this process's commits (it copies and
    syncs what the WAL holds), then under the store's lock, which holds them for the little
    they wrote meanwhile only, so that the next commit starts the WAL over. Alone (nothing
    written between), the second finds everything copied."""
    every = sqlite_module.CHECKPOINT_EVERY
    async with SQLiteAdapter(db_path) as store:
        for _ in range(every - 1):
            await commit(store, make_message(session_id="s-1"))
        # The checkpointer's connection, made as the store makes it, watched.
        checkpointer = await aiosqlite.connect(db_path, isolation_level=None)
        store._checkpointer = checkpointer
        locked: list[bool] = []
        results: list[tuple[int, int, int]] = []
        fetchall = checkpointer.execute_fetchall

        async def recorded(sql: str, *args: Any) -> Any:
            locked.append(store._lock.locked())
            rows = await fetchall(sql, *args)
            results.append(tuple(next(iter(rows))))
            return rows

        checkpointer.execute_fetchall = recorded  # type: ignore[method-assign]
        await commit(store, make_message(session_id="s-1"))  # starts the side checkpoint
        side = store._checkpoints.running
        assert side is not None
        await side
    assert locked == [False, True]
    (_, log_first, copied_first), (_, log_second, copied_second) = results
    assert copied_first == log_first > 0  # the first copied the WAL whole
    assert (log_second, copied_second) == (log_first, copied_first)  # the second: nothing new


async def test_close_waits_for_a_side_checkpoint(db_path: Path) -> None:
    store = SQLiteAdapter(db_path)
    await store.open()
    for _ in range(sqlite_module.CHECKPOINT_EVERY):
        await commit(store, make_message(session_id="s-1"))
    side = store._checkpoints.running
    assert side is not None and not side.done()
    await store.close()  # no task left pending, no connection left open
    assert side.done() and store._checkpointer is None
    async with SQLiteAdapter(db_path) as again:  # and the file reads back whole
        assert len(await again.list_events("s-1")) == 0
        assert await again.outbox_count() == sqlite_module.CHECKPOINT_EVERY


# -- ids as keys (schema 5) -----------------------------------------------------------------

# Every column that holds an id, by table.
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "sessions": ("id",),
    "messages": ("id", "session_id"),
    "checkpoints": ("id", "session_id", "parent_id"),  # (session_id: before schema 12)
    "events": ("id", "session_id"),
    "session_keys": ("id",),  # (since schema 12)
    "client_keys": ("id",),
    "audit": ("id", "client_id", "session_id"),
    "artifact_updates": ("id", "artifact_id", "session_id"),
    "outbox": ("record_id",),
    "dead_letters": ("record_id",),
}


def _uuid_texts(conn: sqlite3.Connection) -> dict[str, int]:
    """Per ``table.column``, how many values are a canonical UUID kept as its text (of the
    columns the file's schema has)."""
    found = {}
    for table, columns in KEY_COLUMNS.items():
        held = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column in held.intersection(columns):
            n = conn.execute(
                f"SELECT count(*) FROM {table} WHERE typeof({column}) = 'text' "
                f"AND pleach_key({column}) != {column}"
            ).fetchone()[0]
            if n:
                found[f"{table}.{column}"] = n
    return found


def _a_history() -> list[Record]:
    """Records of every kind, their ids UUIDs and not: a session's children, a checkpoint's
    parent, an audit row of a device whose id is a UUID and one whose id is a name."""
    records = one_of_each()
    session = records[0]
    root = next(r for r in records if type(r).__name__ == "Checkpoint")
    other = make_session(id="a-session-named-by-hand")
    return [
        *records,
        make_checkpoint(session_id=session.id, parent_id=root.id),
        make_message(session_id=session.id, id="MESSAGE-NOT-A-UUID"),
        make_message(session_id=session.id, id=session.id.upper()),  # no canonical UUID
        other,
        make_event(session_id=other.id, sequence_number=1),
        make_audit(session_id=other.id, client_id="3f6c2a58-1b1e-4e6f-9d4a-3c2e1f0a9b8c"),
    ]


def _in_schema_8_forms(conn: sqlite3.Connection, schema: str = "main") -> None:
    """The rows of ``schema`` as a build before schema 9 wrote them: an outbox row's and a
    dead letter's kind as its name, its created_at in seconds, an event's type as its
    text."""
    names = " ".join(f"WHEN '{code}' THEN '{name}'" for code, name in enumerate(compact.KINDS))
    words = " ".join(f"WHEN '{i}' THEN '{word}'" for i, word in enumerate(compact.WORDS))
    conn.execute(
        f"UPDATE {schema}.outbox SET kind = CASE kind {names} END, created_at = created_at / 1000.0"
    )
    conn.execute(f"UPDATE {schema}.dead_letters SET kind = CASE kind {names} END")
    conn.execute(f"UPDATE {schema}.events SET type = CASE type {words} ELSE type END")


_TABLES_11: Final = """
    CREATE TABLE events_11 (
        id TEXT PRIMARY KEY NOT NULL, session_id TEXT NOT NULL,
        sequence_number INTEGER NOT NULL, hlc TEXT NOT NULL, body BLOB NOT NULL, type TEXT);
    INSERT INTO events_11 (id, session_id, sequence_number, hlc, body, type)
        SELECT e.id, k.id, e.sequence_number, '', e.body, e.type
        FROM events e JOIN session_keys k ON k.n = e.session_n;
    DROP TABLE events;
    ALTER TABLE events_11 RENAME TO events;
    CREATE INDEX ix_events_session ON events (session_id, sequence_number, id);
    CREATE TABLE checkpoints_11 (
        id TEXT PRIMARY KEY NOT NULL, session_id TEXT NOT NULL, hlc TEXT NOT NULL,
        body BLOB NOT NULL, parent_id TEXT);
    INSERT INTO checkpoints_11 (id, session_id, hlc, body, parent_id)
        SELECT c.id, k.id, c.hlc, c.body, c.parent_id
        FROM checkpoints c JOIN session_keys k ON k.n = c.session_n;
    DROP TABLE checkpoints;
    ALTER TABLE checkpoints_11 RENAME TO checkpoints;
    CREATE INDEX ix_checkpoints_session ON checkpoints (session_id, hlc, id);
    CREATE TABLE audit_11 (
        id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, session_id TEXT NOT NULL,
        sequence_number INTEGER NOT NULL, subject_key TEXT, body BLOB NOT NULL);
    INSERT INTO audit_11 (rowid, id, client_id, session_id, sequence_number, subject_key, body)
        SELECT a.rowid, a.id, c.id, k.id, a.sequence_number, a.subject_key, a.body
        FROM audit a JOIN client_keys c ON c.n = a.client_n
        JOIN session_keys k ON k.n = a.session_n;
    DROP TABLE audit;
    ALTER TABLE audit_11 RENAME TO audit;
    CREATE INDEX ix_audit_client ON audit (client_id, sequence_number, id);
    CREATE INDEX ix_audit_session ON audit (session_id, client_id, sequence_number, id);
    CREATE INDEX ix_audit_subject ON audit (subject_key) WHERE subject_key IS NOT NULL;
    DROP TABLE session_keys;
    DROP TABLE client_keys;
    PRAGMA user_version = 11;
"""


_OUTBOX_17: Final = """
    DROP TABLE outbox;
    DROP TABLE outbox_sessions;
    CREATE TABLE sync_state_17 (key TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
    INSERT INTO sync_state_17 (key, value) SELECT key, value FROM sync_state;
    DROP TABLE sync_state;
    ALTER TABLE sync_state_17 RENAME TO sync_state;
    {outbox};
    CREATE INDEX ix_outbox_session ON outbox (record_id) WHERE kind = 0;
""".format(  # (the outbox as schema 1 made it, and 9 indexed it)
    outbox=next(step for step in sqlite_module._MIGRATIONS[0] if "TABLE outbox" in str(step))
)


def _as_schema_17(conn: sqlite3.Connection) -> None:
    """A file written by this store as schema 17 kept it (a file of schema 18 made so): an
    outbox row an entry, each with its key, its kind (its index as text), its own copy of a
    body if it has one, its attempts, time and last error, and an index of its sessions'."""
    if _version_of(conn) < 18:
        return
    rows = conn.execute("SELECT client_seq, refs, created_at, tried FROM outbox ORDER BY 1")
    rows = rows.fetchall()
    tries = {
        first + at: held
        for first, _, _, tried in rows
        for at, held in queued.tries_of(tried).items()
    }
    last = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
    conn.executescript(_OUTBOX_17)
    for first, refs, created_at, _ in rows:
        for at, entry in enumerate(queued.unpack(refs)):
            if entry is not None:
                attempts, code, message = tries.get(first + at, (0, None, None))
                conn.execute(
                    "INSERT INTO outbox VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        first + at,
                        entry.key,
                        entry.kind,
                        entry.body,
                        attempts,
                        created_at,
                        code,
                        message,
                    ),
                )
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
    if last is not None:
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('outbox', ?)", (last[0],))
    conn.execute("PRAGMA user_version = 17")


def _as_schema_16(conn: sqlite3.Connection) -> None:
    """A file written by this store as schema 16 kept it (a file of schema 17 made so): its
    sessions' id blocks of 128 ids (``ID_LAYOUT``), its audit rows' indexes holding their
    device, place and id, and their bodies their content digests."""
    _as_schema_17(conn)
    if _version_of(conn) < 17:
        return
    whole = sqlite_module._whole_row("audit")
    for row_id, body, made in conn.execute(f"SELECT id, body, {whole} FROM audit").fetchall():
        at = compact.audit_digests_left_out(body)
        if at is not None:
            _, payload, identity = compact.audit_digests_apart(made) or (b"", b"", b"")
            body = compact.audit_digests_put(body, at, payload, identity)
            conn.execute("UPDATE audit SET body = ? WHERE id = ?", (body, row_id))
    conn.executescript(
        """DROP INDEX ix_audit_client;
        DROP INDEX ix_audit_session;
        CREATE INDEX ix_audit_client ON audit (client_n, sequence_number, id);
        CREATE INDEX ix_audit_session ON audit (session_n, client_n, sequence_number, id);"""
    )
    blocks: dict[Any, list[tuple[int, bytes]]] = {}
    for session, part, ids in conn.execute("SELECT session_id, part, ids FROM session_ids"):
        blocks.setdefault(session, []).append((part, ids))
    conn.execute("DELETE FROM session_ids")
    conn.executemany(
        "INSERT INTO session_ids (session_id, part, ids) VALUES (?, ?, ?)",
        [
            (session, part, ids)
            for session, held in blocks.items()
            for part, ids in idrefs.rechunked(held, idrefs.ID_LAYOUT.block)
        ],
    )
    conn.execute("PRAGMA user_version = 16")


def _as_schema_13(conn: sqlite3.Connection) -> None:
    """A file written by this store as schema 13 kept it (a file of schema 14 to 17 made so):
    its messages naming their session by its key, beside an empty stamp; its checkpoints
    keyed by session, stamp and id, the stamp's text beside the body; and its events' bodies
    with their prev_hash (whole: a build before reads those as they are)."""
    _as_schema_16(conn)
    if _version_of(conn) < 14:
        return
    if _version_of(conn) >= 16:
        conn.executescript(
            """CREATE TABLE messages_15 (
                id TEXT PRIMARY KEY NOT NULL, session_id TEXT NOT NULL, hlc TEXT NOT NULL,
                body BLOB NOT NULL);
            INSERT INTO messages_15 (rowid, id, session_id, hlc, body)
                SELECT m.rowid, m.id, k.id, '', m.body FROM messages m
                JOIN session_keys k ON k.n = m.session_n ORDER BY m.rowid;
            DROP TABLE messages;
            ALTER TABLE messages_15 RENAME TO messages;"""
        )
    whole = sqlite_module._whole_row("events")
    conn.execute(f"UPDATE events SET body = {whole}")
    if _version_of(conn) >= 15:
        rows = conn.execute(
            f"SELECT id, session_n, parent_id, {sqlite_module._whole_row('checkpoints')} "
            "FROM checkpoints"
        ).fetchall()
        conn.executescript(
            """DROP TABLE checkpoints;
            CREATE TABLE checkpoints (
                id TEXT NOT NULL UNIQUE,
                session_n INTEGER NOT NULL,
                hlc TEXT NOT NULL,
                parent_id TEXT,
                body BLOB NOT NULL,
                PRIMARY KEY (session_n, hlc, id)) WITHOUT ROWID;"""
        )
        conn.executemany(
            "INSERT INTO checkpoints (id, session_n, hlc, parent_id, body) VALUES (?, ?, ?, ?, ?)",
            [(r[0], r[1], compact.decode(bytes(r[3])).hlc, r[2], r[3]) for r in rows],
        )
    conn.execute("PRAGMA user_version = 13")


def _as_schema_11(conn: sqlite3.Connection) -> None:
    """A file written by this store as schema 11 kept it (a file of schema 12 made so; any
    other left as it is): events and checkpoints in tables by rowid, each naming its
    session by its key, with an index by session; no ``session_keys``."""
    _as_schema_13(conn)
    if _version_of(conn) >= 12:
        conn.executescript(_TABLES_11)


def _version_of(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _as_schema_9(conn: sqlite3.Connection) -> None:
    """The rows of a file written by this store as schema 9 kept them: every body whole (the
    ids and the tenant put back, ``_whole_body``), and no ``tenant`` table."""
    _as_schema_11(conn)
    for table in sqlite_module._SHORT_TABLES:
        conn.execute(f"UPDATE {table} SET body = {sqlite_module._whole_body()}")
    conn.execute("DROP TABLE tenant")
    conn.execute("PRAGMA user_version = 9")


def _as_schema_4(source: Path, path: Path) -> None:
    """A file as schema 4 kept it (its tables, ids as text), holding ``source``'s rows (made
    schema 11's first, ``_as_schema_11``)."""
    conn = raw(source)
    _as_schema_11(conn)
    conn.close()
    conn = raw(path)
    conn.create_function("pleach_text", 1, lambda k: unkey(k) if isinstance(k, bytes) else k)
    for step in sqlite_module._MIGRATIONS[:4]:
        for statement in step:
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 4")
    conn.execute("ATTACH DATABASE ? AS new", (str(source),))
    for table in TABLES:
        old = {row[1] for row in conn.execute(f"PRAGMA main.table_info({table})")}
        columns = [r[1] for r in conn.execute(f"PRAGMA new.table_info({table})") if r[1] in old]
        keys = KEY_COLUMNS.get(table, ())
        read = ", ".join(
            f"pleach_text({c})"
            if c in keys
            else sqlite_module._whole_body()  # (no build before schema 10 left bodies short)
            if c == "body" and table in ("messages", "checkpoints", "events")
            else c
            for c in columns
        )
        conn.execute(
            f"INSERT INTO main.{table} ({', '.join(columns)}) SELECT {read} FROM new.{table}"
        )
    _in_schema_8_forms(conn)
    conn.execute("DETACH DATABASE new")
    conn.close()


async def test_every_id_column_keeps_a_uuid_as_its_bytes(db_path: Path) -> None:
    history = _a_history()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *history)
        await store.outbox_dead_letter(2, 3007, "invalid")
        for record in history:
            assert await read_back(store, record) == record
    conn = raw(db_path)
    try:
        assert _uuid_texts(conn) == {}
        # ... and any other id as its text, which reads back as it was written.
        ids = {unkey(k) for (k,) in conn.execute("SELECT id FROM messages")}
        assert {"MESSAGE-NOT-A-UUID", history[0].id.upper()} <= ids
        blobs = conn.execute("SELECT count(*) FROM messages WHERE typeof(id) = 'blob'")
        assert blobs.fetchone()[0] == 1
    finally:
        conn.close()


async def test_a_schema_4_file_migrates_its_ids_to_keys(db_path: Path, tmp_path: Path) -> None:
    history = _a_history()
    source = tmp_path / "source.db"
    async with SQLiteAdapter(source) as store:
        await commit(store, *history)
        await store.outbox_dead_letter(2, 3007, "invalid")
        before = await store.outbox_pending()
    _as_schema_4(source, db_path)
    conn = raw(db_path)
    assert _uuid_texts(conn) != {}
    assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 2
    conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert (await store.settings())["schema_version"] == SCHEMA_VERSION == 18
        for record in history:
            assert await read_back(store, record) == record
        session = history[0]
        assert [c.id for c in await store.child_checkpoints(session.id, history[2].id)] == [
            history[6].id
        ]
        assert [e.id for e in await store.list_events(history[9].id)] == [history[10].id]
        assert [r.id for r in await store.list_audit(client_id=history[11].client_id)] == [
            history[11].id
        ]
        # The outbox still refers to every record it queued, and the dead letter is there.
        assert await store.outbox_pending() == before
        assert [d.record.id for d in await store.dead_letters()] == [history[1].id]
        assert await store.integrity_check() == []
    conn = raw(db_path)
    try:
        assert _uuid_texts(conn) == {}
    finally:
        conn.close()


async def test_a_schema_8_file_keeps_its_outbox_and_log_through_schema_9(db_path: Path) -> None:
    """Schema 9 keeps an outbox row's kind as its index in ``compact.KINDS`` and its
    created_at in milliseconds, and a new event's type as its ``WORDS`` index. A file of
    schema 8 (kinds by name, seconds, types as text) opens with its outbox as it was: every
    entry with its time, a session's queued version found by the rebuilt index, the dead
    letter; its events are read by type, and the rows written after it beside them."""
    history = _a_history()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *history)
        await store.outbox_dead_letter(2, 3007, "invalid")
        before = await store.outbox_pending()
        letters = await store.dead_letters()
    conn = raw(db_path)
    try:
        _as_schema_9(conn)
        _in_schema_8_forms(conn)
        conn.execute("DROP INDEX ix_outbox_session")
        conn.execute("CREATE INDEX ix_outbox_session ON outbox (record_id) WHERE kind = 'Session'")
        conn.execute("PRAGMA user_version = 8")
        conn.commit()
        kinds = {k for (k,) in conn.execute("SELECT kind FROM outbox")}
        assert kinds and kinds <= set(compact.KINDS)
        assert {t for (t,) in conn.execute("SELECT type FROM events")} <= set(compact.WORDS)
    finally:
        conn.close()
    session = history[0]
    events = [r for r in history if type(r).__name__ == "Event"]
    later = make_event(session_id=events[0].session_id, sequence_number=2, type=events[0].type)
    async with SQLiteAdapter(db_path) as store:
        assert (await store.settings())["schema_version"] == SCHEMA_VERSION == 18
        assert await store.outbox_pending() == before
        assert await store.dead_letters() == letters
        assert await _session_queued(store, session.id)
        assert await store.list_events(events[0].session_id, types={events[0].type}) == [events[0]]
        await commit(store, later)
        assert await store.list_events(later.session_id, types={later.type}) == [events[0], later]
        pending = await store.outbox_pending()
        assert pending[: len(before)] == before
        assert [e.record for e in pending[len(before) :]] == [later]
        assert pending[-1].created_at >= before[-1].created_at
        assert await store.retry_dead_letter(letters[0].client_seq) is not None
        assert (await store.outbox_pending())[-1].record == letters[0].record
        assert await store.integrity_check() == []
    conn = raw(db_path)
    try:
        kinds = {
            entry.kind
            for (refs,) in conn.execute("SELECT refs FROM outbox")
            for entry in queued.unpack(refs)
            if entry is not None
        }
        assert kinds <= set(range(len(compact.KINDS)))
        times = [t for (t,) in conn.execute("SELECT created_at FROM outbox")]
        assert all(t == int(t) and t > 10**12 for t in times)  # milliseconds
    finally:
        conn.close()


# -- a rerunnable plan: planned on the meta the store saw last, written in one hop ---------


def _increment(calls: list[str], reads_session: bool = False) -> Rerunnable:
    """A counter in ``sync_state`` taken one up, and a message written beside it: a
    read-modify-write that loses an update if it is ever planned on stale meta."""

    async def plan(tx: Any) -> WriteBatch:
        calls.append("plan")
        if reads_session:
            await tx.get_session("s-1")
        n = int(await tx.get_meta("n") or 0)
        return WriteBatch(records=[make_message(session_id="s-1")], meta={"n": str(n + 1)})

    return Rerunnable(plan)


async def test_a_rerunnable_plan_on_an_unchanged_file_commits_in_place(db_path: Path) -> None:
    calls: list[str] = []
    async with SQLiteAdapter(db_path) as store:
        await store.transact(_increment(calls))  # the first: nothing seen yet, under the lock
        hops = count_hops(store._conn)
        for expected in range(2, 6):
            hops[0], calls[:] = 0, []
            receipt = await store.transact(_increment(calls))
            assert (hops[0], calls, len(receipt.client_seqs)) == (0, ["plan"], 1)
            assert await store.get_meta("n") == str(expected)
        # A plan that reads more than the meta keys runs again under the lock (two hops).
        hops[0], calls[:] = 0, []
        await store.transact(_increment(calls, reads_session=True))
        assert calls == ["plan", "plan"] and await store.get_meta("n") == "6"
        # A meta key set outside a plan: the next plan runs under the lock, on what is there.
        await store.set_meta("n", "100")
        hops[0], calls[:] = 0, []
        await store.transact(_increment(calls))
        assert calls == ["plan"] and hops[0] >= 2 and await store.get_meta("n") == "101"
        # A plan without the mark always runs under the lock.
        hops[0], calls[:] = 0, []
        await store.transact(_increment(calls).plan)
        assert hops[0] >= 2 and await store.get_meta("n") == "102"
        assert await store.outbox_count() == 8


async def test_rerunnable_plans_of_two_connections_lose_no_update(db_path: Path) -> None:
    """Two stores on one file (as two processes) each take a shared counter up 25 times, at
    once: each plan decided on the meta its store saw last must be planned again whenever the
    other wrote since, or an increment is lost."""
    calls: list[str] = []
    async with SQLiteAdapter(db_path) as a, SQLiteAdapter(db_path) as b:

        async def increments(store: SQLiteAdapter) -> None:
            for _ in range(25):
                await store.transact(_increment(calls))

        await asyncio.gather(increments(a), increments(b))
        assert await a.get_meta("n") == await b.get_meta("n") == "50"
        assert await a.outbox_count() == 50
        assert len(await a.outbox_pending(limit=100)) == 50
        # Taken in turns, each store's snapshot is stale every time (the other wrote since):
        # after the first of each store (a meta key set outside a plan leaves it none), every
        # plan is planned twice, and nothing is lost.
        await a.set_meta("n", "50")
        await b.set_meta("n", "50")
        calls.clear()
        for _ in range(10):
            await a.transact(_increment(calls))
            await b.transact(_increment(calls))
        assert await a.get_meta("n") == "70"
        assert len(calls) == 2 + 2 * 18


async def test_a_record_that_came_as_bytes_is_stored_as_those_bytes(tmp_path: Path) -> None:
    """A pulled page's records (protocol 6) are written in the bytes they came in (less the id
    and session id their row's columns hold: schema 10, here in a file of another tenant,
    whose org and user they keep); a record made anew is encoded. The file then gives back
    the very bytes that came, and reads them as the records they are."""
    from shared.compact import Bodies

    session = make_session()
    pulled = [make_message(session_id=session.id), make_checkpoint(session_id=session.id)]
    sent = [compact.encode(r) for r in pulled]
    made = make_message(session_id=session.id)
    batch = WriteBatch(
        records=[*pulled, made], outbox=False, bodies=Bodies(zip(pulled, sent, strict=True))
    )
    groups, _ = sqlite_module._encode_batch(batch.records, batch.bodies)
    other = sqlite3.connect(":memory:")  # (a device schema whose file is another tenant's)
    sqlite_module.create_schema(other)
    other.execute("INSERT INTO tenant (one, packed) VALUES (1, ?)", (compact.packed("x") * 2,))
    (groups,) = sqlite_module._shortened(other, groups)
    other.close()
    written = [row[-1] for rows in groups.values() for row in rows]
    keys = [(key(r.id), key(r.session_id)) for r in [*pulled, made]]
    bodies = [*sent, compact.encode(made)]
    shortened = [sqlite_module._short(b, *k) for b, k in zip(bodies, keys, strict=True)]
    assert sorted(written) == sorted(shortened) and len(written) == 3
    assert all(
        len(w) == len(b) - 35 for w, b in zip(shortened, bodies, strict=True)
    )  # 36 out, 1 in
    async with SQLiteAdapter(tmp_path / "d.db") as store:
        await store.commit(batch)
        assert await store.get_messages([pulled[0].id, made.id]) == [pulled[0], made]
    conn = raw(tmp_path / "d.db")
    try:
        for table, record, body in [
            ("messages", pulled[0], sent[0]),
            ("checkpoints", pulled[1], sent[1]),
        ]:
            whole = sqlite_module._whole_row(table)
            query = f"SELECT {whole} FROM {table} WHERE id = ?"
            assert conn.execute(query, (key(record.id),)).fetchone()[0] == body
    finally:
        conn.close()


_WHOLE_OF = "WITH t(id, session_id, body) AS (VALUES (?, ?, ?)) SELECT {} FROM t"


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(["message", "checkpoint", "event", "audit"]),
    own_ids=st.tuples(st.booleans(), st.booleans()),
    other_keys=st.tuples(st.booleans(), st.booleans()),
    map_form=st.booleans(),
    file_tenant=st.sampled_from(["own", "other", "none"]),
    file_client=st.sampled_from(["own", "other", "none"]),
    device=st.sampled_from(["uuid", "text"]),
    text=st.text(max_size=40),
    sequence=st.integers(0, 2**40),
)
def test_a_body_is_stored_short_and_read_back_byte_for_byte(
    kind: str,
    own_ids: tuple[bool, bool],
    other_keys: tuple[bool, bool],
    map_form: bool,
    file_tenant: str,
    file_client: str,
    device: str,
    text: str,
    sequence: int,
) -> None:
    """Schemas 10 and 11: whatever the record, the keys beside it, the file's tenant and its
    client id, a body as a row stores it (``_shortened``, in the write's transaction) reads
    back (``_whole_body``) as the very bytes written; it is 35 bytes shorter exactly when it
    is the compact form and its id and session id are the row's keys (canonical UUIDs),
    shorter by its org and user less one more when they are the file's tenant, and by its
    stamp's node less the 3 bytes of its ext's head when its device is the file's too; it
    stays as it is otherwise (an id by hand, a key that is not the body's, the map form a
    build before protocol 6 wrote)."""
    session_id = uuid7() if own_ids[1] else f"session by hand {text}"
    record_id = uuid7() if own_ids[0] else f"ID-{text}"
    made: Record
    client = uuid7() if device == "uuid" else f"device {text}"
    ours = {"id": record_id, "session_id": session_id, "client_id": client}
    if kind == "message":
        made = make_message(**ours)
        made.content = [{"type": "text", "text": text}]
    elif kind == "checkpoint":
        made = make_checkpoint(**ours, turn_id=text or None)
    elif kind == "audit":
        made = make_audit(**ours, sequence_number=sequence, request_id=text or None)
    else:
        made = make_event(**ours, sequence_number=sequence)
    body = encode_record(made) if map_form else compact.encode(made)
    row_key = key(uuid7()) if other_keys[0] else key(record_id)
    row_session = key(uuid7()) if other_keys[1] else key(session_id)
    own = compact.packed(made.org_id) + compact.packed(made.user_id)
    tenant = {"own": own, "other": compact.packed("org") + own[-4:], "none": b""}[file_tenant]
    conn = sqlite3.connect(":memory:")
    try:
        sqlite_module.create_schema(conn)
        if tenant:
            conn.execute("INSERT INTO tenant VALUES (1, ?, NULL)", (tenant,))
        if file_client != "none":
            file_id = client if file_client == "own" else "another device"
            conn.execute(sqlite_module._PUT_META, ("client_id", file_id))
        sql, row = sqlite_module._PUT_MESSAGE, (row_key, row_session, body)
        if kind == "audit":  # (its session's key after its client id's)
            sql, row = sqlite_module._PUT_AUDIT, (row_key, key(client), row_session, 1, None, body)
        (rows,) = sqlite_module._shortened(conn, {sql: [row]})
        stored = rows[sql][0][-1]
        query = _WHOLE_OF.format(sqlite_module._whole_body())
        assert conn.execute(query, (row_key, row_session, stored)).fetchone()[0] == body
        _, node = sqlite_module._tenant_of(conn)
    finally:
        conn.close()
    shortened = not map_form and all(own_ids) and not any(other_keys)
    tenant_out = shortened and file_tenant != "other"
    node_out = tenant_out and file_client == "own"
    if kind == "audit":  # (all at once or nothing; its row sets no tenant for the file)
        shortened = node_out = shortened and file_tenant == "own" and file_client == "own"
    if file_client != "none" and (file_tenant != "none" or shortened):  # (with its tenant)
        assert node == compact.stamp_node(file_id)
    else:
        assert node == b""
    fewer = 35 + (len(own) - 1 if tenant_out else 0) + (len(node) - 3 if node_out else 0)
    if kind == "audit":
        fewer = 18 + len(own) + 1 + len(node) - 3 + 18 - 2
    assert len(stored) == len(body) - (fewer if shortened else 0)
    assert (stored[:1] == b"\xc1") is shortened
    assert (stored[:2] == (b"\xc1\x02" if kind == "audit" else b"\xc1\x01")) is node_out
    assert compact.decode(body) == made


async def _migrated_then_written(
    store: SQLiteAdapter, history: list[Any], before: list[Any], later: list[Any]
) -> None:
    """A file just migrated to this schema: its outbox and records read as before, then
    ``later`` is committed beside them, and old and new read back alike, queued in order."""
    assert (await store.settings())["schema_version"] == SCHEMA_VERSION == 18
    assert await store.outbox_pending() == before
    for record in history:
        assert await read_back(store, record) == record
    await commit(store, *later)
    for record in [*history, *later]:
        assert await read_back(store, record) == record
    pending = await store.outbox_pending()
    assert pending[: len(before)] == before
    assert [e.record for e in pending[len(before) :]] == later


async def test_whole_and_short_bodies_of_one_file_read_alike(db_path: Path) -> None:
    """A file of schema 9 (whole bodies) opens at schema 10 and its rows read as before; rows
    written after are short, and both kinds side by side read back equal, by id, by session,
    in the outbox (the bytes a push sends) and after the log's events are marked canonical."""
    history = _a_history()
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *history)
        before = await store.outbox_pending()
    conn = raw(db_path)
    try:
        for table in ("messages", "checkpoints", "events"):  # (audit: only with a node)
            short = conn.execute(
                f"SELECT count(*) FROM {table} WHERE body >= x'c1' AND body < x'c2'"
            )
            assert short.fetchone()[0] > 0  # (the ids of UUIDs' rows)
        _as_schema_9(conn)
        conn.commit()
    finally:
        conn.close()
    session = history[0]
    events = [r for r in history if isinstance(r, Event) and r.session_id == session.id]
    later = [
        make_message(session_id=session.id),
        make_checkpoint(session_id=session.id),
        make_event(session_id=session.id, sequence_number=events[-1].sequence_number + 1),
    ]
    async with SQLiteAdapter(db_path) as store:
        await _migrated_then_written(store, history, before, later)
        pending = await store.outbox_pending()
        bodies = [compact.encode(e.record) for e in pending]
        assert [bytes(b) for b in await _outbox_bodies(store)] == bodies
        log = await store.list_events(session.id)
        await store.commit(WriteBatch(records=[], outbox=False, canonical=[e.id for e in log]))
        marked = await store.list_events(session.id)
        assert [e.canonical for e in marked] == [True] * len(log)
        assert [msgspec.structs.replace(e, canonical=False) for e in marked] == log
    conn = raw(db_path)
    try:
        kinds = dict(conn.execute("SELECT id, substr(body, 1, 1) = x'c1' FROM events"))
        assert kinds[key(later[-1].id)] == 1  # written short, and kept short once marked
        assert kinds[key(events[0].id)] == 1  # written whole: its marked body is written short
    finally:
        conn.close()


async def test_a_file_keeps_the_tenant_of_its_first_short_record(db_path: Path) -> None:
    """Schema 10: the file's tenant is the org and user of the first record a commit wrote
    short, set in that commit and never changed; the bodies of its records leave them out,
    a record of another tenant keeps its own, and another connection of the file (another
    process) writes by the same tenant. Every record reads back as written."""
    session = make_session()
    ours = [make_message(session_id=session.id), make_event(session_id=session.id)]
    theirs = make_message(session_id=session.id, org_id="another-org", user_id="someone")
    async with SQLiteAdapter(db_path) as store, SQLiteAdapter(db_path) as other:
        await commit(store, session, *ours)
        await commit(other, theirs, make_checkpoint(session_id=session.id))
        await commit(store, make_message(session_id=session.id, org_id="org-2"))
        rows = await other.get_messages([*(m.id for m in ours[:1]), theirs.id])
        assert rows == [ours[0], theirs]
        assert await store.list_events(session.id) == [ours[1]]
    conn = raw(db_path)
    try:
        packed = compact.packed(session.org_id) + compact.packed(session.user_id)
        assert conn.execute("SELECT one, packed FROM tenant").fetchall() == [(1, packed)]
        forms = {
            (table, bytes(body[:2]) == compact.SHORT + b"\x00")
            for table in sqlite_module._SHORT_TABLES
            for (body,) in conn.execute(f"SELECT body FROM {table}")
        }
        assert forms == {
            ("messages", True),  # ours
            ("messages", False),  # another org's, and another user's
            ("events", True),
            ("checkpoints", True),  # written by the other connection
        }
    finally:
        conn.close()


def _forms(conn: sqlite3.Connection) -> dict[bytes | str, bytes]:
    """Each short table's row key and the first two bytes of its stored body."""
    return {
        row_key: bytes(body[:2])
        for table in sqlite_module._SHORT_TABLES
        for row_key, body in conn.execute(f"SELECT id, body FROM {table}")
    }


async def test_a_file_leaves_out_the_stamp_node_of_its_own_device(db_path: Path) -> None:
    """Schema 11: a file whose client id is set leaves its stamp's node out of the bodies of
    its device's records (``SHORT`` then 1), from the first commit that writes one short;
    the node is set then and never changed, so records of the device's new id (a copy's) and
    of other devices keep theirs, and another connection of the file writes by the same
    node; the device's audit row leaves out its id, tenant, device, node and session id at
    once. Every record reads back as written, by id, by session and in the outbox's bytes,
    and its events once marked canonical."""
    session = make_session()
    ours = [
        make_message(session_id=session.id),
        make_checkpoint(session_id=session.id),
        make_event(session_id=session.id, sequence_number=1),
        make_audit(session_id=session.id, sequence_number=1),
    ]
    theirs = make_message(session_id=session.id, client_id="dev-b")
    renamed = make_message(session_id=session.id, client_id="dev-a2")
    late = make_event(session_id=session.id, sequence_number=2)
    async with SQLiteAdapter(db_path) as store, SQLiteAdapter(db_path) as other:
        await store.set_meta("client_id", CLIENT)
        await commit(store, session, *ours)
        await commit(other, theirs, late)
        await store.set_meta("client_id", "dev-a2")  # (a copied file's new id)
        await commit(store, renamed)
        written = [*ours, theirs, late, renamed]
        for record in written:
            assert await read_back(other, record) == record
            assert await read_back(store, record) == record
        messages = [ours[0], theirs, renamed]
        assert await store.get_messages([m.id for m in messages]) == messages
        assert await store.list_events(session.id) == [ours[2], late]
        assert await store.list_audit(session_id=session.id) == [ours[3]]
        bodies = [compact.encode(e.record) for e in await store.outbox_pending()]
        assert [bytes(b) for b in await _outbox_bodies(store)] == bodies
        log = await store.list_events(session.id)
        await store.commit(WriteBatch(records=[], outbox=False, canonical=[e.id for e in log]))
        marked = await other.list_events(session.id)
        assert [msgspec.structs.replace(e, canonical=False) for e in marked] == log
        assert all(e.canonical for e in marked)
    conn = raw(db_path)
    try:
        assert sqlite_module._tenant_of(conn)[1] == compact.stamp_node(CLIENT)
        forms = _forms(conn)
    finally:
        conn.close()
    node_out, tenant_out = compact.SHORT + b"\x01", compact.SHORT + b"\x00"
    for record in [*ours[:3], late]:
        assert forms[key(record.id)] == node_out, record  # (marked canonical: still)
    assert forms[key(ours[3].id)] == compact.SHORT + b"\x02"  # (an audit row's: all at once)
    assert forms[key(theirs.id)] == forms[key(renamed.id)] == tenant_out
    whole = {r.id: len(compact.encode(r)) for r in written}
    stamp = len(compact.stamp_node(CLIENT)) - 3
    conn = raw(db_path)
    try:
        for table in sqlite_module._SHORT_TABLES:
            for row_key, size in conn.execute(f"SELECT id, length(body) FROM {table}"):
                record_id = unkey(row_key)
                packed_tenant = compact.packed(session.org_id) + compact.packed(session.user_id)
                fewer = 35 + len(packed_tenant) - 1
                if forms[row_key] == node_out:
                    fewer += stamp
                if table == "audit":  # (its id, tenant, nil device, node and session id)
                    fewer = 18 + len(packed_tenant) + 1 + stamp + 18 - 2
                assert size == whole[record_id] - fewer, table
    finally:
        conn.close()


def _as_schema_10(conn: sqlite3.Connection) -> None:
    """A file written by this store as schema 10 kept it: no node (the bodies that left it out
    put together, ``_whole_body``, and written as schema 10 wrote them, ``_short`` given the
    tenant alone), and no ``node`` column."""
    _as_schema_11(conn)
    tenant, _ = sqlite_module._tenant_of(conn)
    for table in sqlite_module._SHORT_TABLES:
        rows = conn.execute(f"SELECT id, session_id, {sqlite_module._whole_body()} FROM {table}")
        for row_key, session_key, body in rows.fetchall():
            short = sqlite_module._short(body, row_key, session_key, tenant)
            conn.execute(f"UPDATE {table} SET body = ? WHERE id = ?", (short, row_key))
    conn.execute("ALTER TABLE tenant DROP COLUMN node")
    conn.execute("PRAGMA user_version = 10")


async def test_a_schema_10_file_opens_at_11_and_takes_its_node_at_its_next_commit(
    db_path: Path,
) -> None:
    """A file of schema 10 (bodies that keep their node, a tenant without one) opens at 11 with
    every row read as before; its next commit sets its node from its client id, the rows
    written then leave it out, and old and new read back alike, in the outbox's bytes too."""
    history = _a_history()
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("client_id", CLIENT)
        await commit(store, *history)
        before = await store.outbox_pending()
    conn = raw(db_path)
    try:
        assert compact.SHORT + b"\x01" in set(_forms(conn).values())
        _as_schema_10(conn)
        conn.commit()
        assert compact.SHORT + b"\x01" not in set(_forms(conn).values())
    finally:
        conn.close()
    session = history[0]
    later = [make_message(session_id=session.id), make_checkpoint(session_id=session.id)]
    async with SQLiteAdapter(db_path) as store:
        await _migrated_then_written(store, history, before, later)
        bodies = [compact.encode(e.record) for e in await store.outbox_pending()]
        assert [bytes(b) for b in await _outbox_bodies(store)] == bodies
    conn = raw(db_path)
    try:
        forms = _forms(conn)
        assert {forms[key(r.id)] for r in later} == {compact.SHORT + b"\x01"}
        assert sqlite_module._tenant_of(conn)[1] == compact.stamp_node(CLIENT)
    finally:
        conn.close()


async def test_a_schema_11_file_opens_at_12_its_log_and_checkpoints_by_session_number(
    db_path: Path,
) -> None:
    """A file of schema 11 (events and checkpoints in tables by rowid naming their session by
    its key, with an index by session; audit rows naming their session and device by key)
    opens at 12: each session whose events, checkpoints or audit rows the file holds is
    numbered once, and each device with audit rows; events and checkpoints are keyed by
    session number and place; every record, log, checkpoint list and audit list reads as
    before, in the outbox's bytes too, and rows written after, in a session numbered then and
    in one numbered by the migration, read back beside them in their order."""
    history = _a_history()
    session, other = history[0], next(r for r in history if r.id == "a-session-named-by-hand")
    history += [make_event(session_id=session.id, sequence_number=n) for n in (2, 1, 3)]
    history += [
        make_audit(session_id=session.id, client_id=device, sequence_number=n)
        for device in ("phone", "3f6c2a58-1b1e-4e6f-9d4a-3c2e1f0a9b8c", "laptop")
        for n in (1, 2)
    ]
    async with SQLiteAdapter(db_path) as store:
        await commit(store, *history)
        before = await store.outbox_pending()
        logs = {s: await store.list_events(s) for s in (session.id, other.id)}
        checkpoints = await store.list_checkpoints(session.id)
        bodies = await _outbox_bodies(store)
        audit = {
            "all": await store.list_audit(),
            "session": await store.list_audit(session_id=session.id),
            "device": await store.list_audit(client_id="phone"),
            "both": await store.list_audit(session_id=session.id, client_id="laptop"),
        }
    conn = raw(db_path)
    try:
        _as_schema_11(conn)
        assert _version_of(conn) == 11
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert {"ix_events_session", "ix_checkpoints_session"} <= indexes
    finally:
        conn.close()
    new_session = make_session()
    later = [
        make_event(session_id=session.id, sequence_number=4),
        make_checkpoint(session_id=session.id, parent_id=checkpoints[-1].id),
        new_session,
        make_event(session_id=new_session.id, sequence_number=1),
        make_checkpoint(session_id=new_session.id),
        make_audit(session_id=new_session.id, client_id="phone", sequence_number=3),
        make_audit(session_id=session.id, client_id="desktop", sequence_number=1),
    ]
    async with SQLiteAdapter(db_path) as store:
        assert {s: await store.list_events(s) for s in logs} == logs
        assert await store.list_checkpoints(session.id) == checkpoints
        assert [bytes(b) for b in await _outbox_bodies(store)] == [bytes(b) for b in bodies]
        assert await store.list_audit() == audit["all"]
        assert await store.list_audit(session_id=session.id) == audit["session"]
        assert await store.list_audit(client_id="phone") == audit["device"]
        both = await store.list_audit(session_id=session.id, client_id="laptop")
        assert both == audit["both"] and len(both) == 2
        await _migrated_then_written(store, history, before, later)
        assert await store.list_audit(client_id="phone") == [*audit["device"], later[5]]
        rows = await store.list_audit()
        assert rows == sorted(rows, key=lambda r: (r.client_id, r.sequence_number, r.id))
        assert len(rows) == len(audit["all"]) + 2
        assert await store.list_events(session.id) == [*logs[session.id], later[0]]
        assert await store.list_checkpoints(session.id) == [*checkpoints, later[1]]
        assert await store.list_events(new_session.id) == [later[3]]
        assert await store.list_checkpoints(new_session.id) == [later[4]]
    conn = raw(db_path)
    try:
        numbered = dict(conn.execute("SELECT id, n FROM session_keys"))
        assert set(numbered) == {key(session.id), key(other.id), key(new_session.id)}
        for table in sqlite_module._NUMBERED:
            held = {n for (n,) in conn.execute(f"SELECT DISTINCT session_n FROM {table}")}
            assert held <= set(numbered.values())
        for table in ("events", "checkpoints"):
            sql = conn.execute(f"SELECT sql FROM sqlite_master WHERE name = '{table}'")
            assert sql.fetchone()[0].endswith("WITHOUT ROWID")
        devices = {unkey(k) for (k,) in conn.execute("SELECT id FROM client_keys")}
        assert devices == {r.client_id for r in [*history, *later] if isinstance(r, AuditRow)}
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert not {"ix_events_session", "ix_checkpoints_session"} & indexes
    finally:
        conn.close()


async def test_a_migration_that_copies_tables_gives_their_pages_back(db_path: Path) -> None:
    """Schema 12 copies the events and checkpoints into new tables: the old ones' pages, free
    after it, go back to the OS as the file opens (``auto_vacuum`` incremental), so a
    migrated file is not larger than it was."""
    session = make_session()
    log = [make_event(session_id=session.id, sequence_number=n) for n in range(1, 2501)]
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, *log)
        await store.outbox_remove(list(range(1, len(log) + 2)))
    conn = raw(db_path)
    try:
        _as_schema_11(conn)
        conn.execute("VACUUM")  # (what the steps above freed: as a schema 11 file was)
        assert _free_pages(conn) == 0
    finally:
        conn.close()
    before = db_path.stat().st_size
    async with SQLiteAdapter(db_path) as store:
        assert await store.list_events(session.id) == log
    conn = raw(db_path)
    try:
        assert _free_pages(conn) < sqlite_module.RECLAIM_PAGES
        assert conn.execute("PRAGMA page_count").fetchone()[0] * 4096 <= before
    finally:
        conn.close()


async def test_a_new_file_keeps_no_page_its_migrations_freed(db_path: Path) -> None:
    """A new file is made by every schema step in turn; the pages of the tables and indexes
    later steps replace are given back as it opens, so an empty device file is no larger
    than its schema."""
    async with SQLiteAdapter(db_path):
        pass
    conn = raw(db_path)
    try:
        assert _free_pages(conn) == 0
        used = conn.execute("SELECT count(*) FROM dbstat").fetchone()[0]  # (every tree's)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        assert pages == used + 1  # (and the pointer map's: auto_vacuum)
    finally:
        conn.close()


def _free_pages(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA freelist_count").fetchone()[0])


async def _outbox_bodies(store: SQLiteAdapter) -> list[bytes]:
    """The bodies the flush reads for the whole outbox (``_outbox_read``'s)."""
    assert store._conn is not None
    rows, _ = await sqlite_module._selected(store._conn, sqlite_module._outbox_read, 0, -1)
    return [row[1] for row in rows if row[1] is not None]


# -- peek_meta: the committed value, on the caller's thread ----------------------------------


async def test_a_peek_sees_another_connections_commit_at_once(db_path: Path) -> None:
    """The look whether another process wrote: a commit of another connection (as another
    process) is seen by the next peek, with no hop to the store's thread."""
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("generation", "g1")
        hops = count_hops(store._conn)
        assert await store.peek_meta("generation") == "g1"
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("UPDATE sync_state SET value = 'g2' WHERE key = 'generation'")
        finally:
            other.close()
        assert await store.peek_meta("generation") == "g2"
        assert await store.peek_meta("unknown") is None
        assert hops[0] == 0


def _held_plan() -> tuple[Plan, asyncio.Event, asyncio.Event]:
    """A plan that sets ``n`` to 2 once ``release`` is set; ``planning`` is set as it waits."""
    planning, release = asyncio.Event(), asyncio.Event()

    async def plan(tx: Any) -> WriteBatch:
        planning.set()
        await release.wait()
        return WriteBatch(meta={"n": "2"})

    return plan, planning, release


async def test_a_peek_does_not_wait_for_a_write_in_progress(db_path: Path) -> None:
    """A plan holding the store's write lock: ``get_meta`` waits for it, a peek does not, and
    reads what is committed (not what the plan is about to write)."""
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("n", "1")
        plan, planning, release = _held_plan()

        writing = asyncio.ensure_future(store.transact(plan))
        await planning.wait()
        waiting = asyncio.ensure_future(store.get_meta("n"))
        async with asyncio.timeout(30):  # a guard: a peek that waited would hang here
            assert await store.peek_meta("n") == "1"
        assert not waiting.done() and not writing.done()
        release.set()
        await writing
        assert await waiting == "2"
        assert await store.peek_meta("n") == "2"


async def test_a_peek_that_fails_reads_on_the_connection(db_path: Path) -> None:
    """Any error of the caller's connection (here: closed under it) falls back to
    ``get_meta``."""
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("n", "7")
        assert await store.peek_meta("n") == "7"
        assert store._local is not None
        store._local.close()
        hops = count_hops(store._conn)
        assert await store.peek_meta("n") == "7"
        assert hops[0] == 1


async def test_the_flushs_outbox_read_is_made_in_place(db_path: Path) -> None:
    """``outbox_pending``, which a flush calls right after a turn's commit, reads on the
    caller's connection with no hop, and gives what the store's connection gives: the same
    entries, in order, after ``after``, at most ``limit``."""
    async with SQLiteAdapter(db_path) as store:
        records = one_of_each()
        await commit(store, *records)
        hops = count_hops(store._conn)
        pending = await store.outbox_pending()
        tail = await store.outbox_pending(2, after=pending[1].client_seq)
        assert hops[0] == 0
        assert [e.record for e in pending] == records
        assert [e.client_seq for e in tail] == [e.client_seq for e in pending[2:4]]
        assert store._local is not None
        store._local.close()  # any error there: read on the store's connection
        assert await store.outbox_pending() == pending
        assert hops[0] == 1


async def test_an_outbox_read_waits_for_a_write_in_progress(db_path: Path) -> None:
    """With a write of this store in progress, the outbox is read after it, on the store's
    connection, as every read but a peek is: the read gives what that write left."""
    async with SQLiteAdapter(db_path) as store:
        first, second = make_session(), make_session()
        await commit(store, first)
        planning, release = asyncio.Event(), asyncio.Event()

        async def plan(tx: Any) -> WriteBatch:
            planning.set()
            await release.wait()
            return WriteBatch(records=[second])

        writing = asyncio.ensure_future(store.transact(plan))
        await planning.wait()
        hops = count_hops(store._conn)
        reading = asyncio.ensure_future(store.outbox_pending())
        try:
            await asyncio.sleep(0)  # one turn of the loop: a read in place would be done now
            read_early = reading.done()
        finally:
            release.set()
            await writing
        assert not read_early
        assert [e.record for e in await reading] == [first, second]
        assert hops[0] >= 1


async def test_a_long_session_queued_is_decoded_once_by_the_outbox_read(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session whose ids are in blocks is put back together for the outbox (the whole body
    a push sends): the session made then is the entry's record, not decoded again from that
    body; and it is the session as stored, queued once per commit."""
    async with small_id_blocks(SQLiteAdapter(db_path)) as store:
        session = make_session(state=SessionState(message_ids=[uuid7() for _ in range(5)]))
        await commit(store, session)
        grown = msgspec.structs.replace(
            session, state=SessionState(message_ids=[*session.state.message_ids, uuid7()])
        )
        await commit(store, grown)
        decoded: list[str] = []
        decode = sqlite_module._decode

        def counted(body_type: Any, table: str, key: Any, body: bytes) -> Any:
            decoded.append(table)
            return decode(body_type, table, key, body)

        monkeypatch.setattr(sqlite_module, "_decode", counted)
        pending = await store.outbox_pending()
        # Both entries refer to the stored row, its newest version: one object.
        assert [e.record for e in pending] == [grown, grown]
        assert pending[0].record is pending[1].record
        assert compact.decode(pending[1].body) == grown  # the whole body a push sends
        assert decoded == ["sessions"]  # the row once, from its own body, never again


async def test_an_outbox_read_goes_on_beside_a_read_in_progress(db_path: Path) -> None:
    """A read of this store in progress (an app's, say, as a turn ends) holds its lock, but
    writes nothing: the flush's outbox read is made in place beside it, with no hop and no
    wait, and gives what a read after it gives."""
    async with SQLiteAdapter(db_path) as store:
        records = one_of_each()
        await commit(store, *records)
        reading, release = asyncio.Event(), asyncio.Event()

        async def slow_read() -> None:
            async with store._reading("a slow read"):
                reading.set()
                await release.wait()

        held = asyncio.ensure_future(slow_read())
        await reading.wait()
        hops = count_hops(store._conn)
        outbox = asyncio.ensure_future(store.outbox_pending())
        try:
            await asyncio.sleep(0)  # one turn of the loop: a read in place is done now
            read_early, locked = outbox.done(), store._lock.locked()
        finally:
            release.set()
            await held
        assert locked and read_early and hops[0] == 0
        pending = await outbox
        assert [e.record for e in pending] == records
        assert await store.outbox_pending() == pending


async def test_closing_closes_the_callers_connection_too(db_path: Path) -> None:
    """The caller's connection is closed with the store: the last connection to close removes
    the WAL, so no ``-wal`` file is left behind, and a peek after close raises as reads do."""
    store = SQLiteAdapter(db_path)
    async with store:
        await store.set_meta("n", "1")
        assert await store.peek_meta("n") == "1"
    assert store._local is None
    assert not Path(f"{db_path}-wal").exists()
    with pytest.raises(InvalidState):
        await store.peek_meta("n")


# -- small batches written on the caller's thread (``_write_in_place``) ----------------------


def _watch_hops(store: SQLiteAdapter) -> asyncio.Event:
    """An event set when the store's connection next hands work to its thread."""
    conn = store._conn
    assert conn is not None
    handed = asyncio.Event()
    execute = conn._execute

    async def watched(fn: Any, *args: Any, **kwargs: Any) -> Any:
        handed.set()
        return await execute(fn, *args, **kwargs)

    conn._execute = watched  # type: ignore[method-assign]
    return handed


def _dump(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the file's tables (the outbox without its clock column)."""
    conn = raw(path)
    try:
        out: dict[str, list[tuple[Any, ...]]] = {}
        for table in ("sessions", "messages", "checkpoints", "events", "audit", "sync_state"):
            out[table] = sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
        out["outbox"] = conn.execute(
            "SELECT client_seq, refs, live, tried FROM outbox ORDER BY client_seq"
        ).fetchall()
        out["outbox_sessions"] = conn.execute("SELECT * FROM outbox_sessions").fetchall()
        return out
    finally:
        conn.close()


def _planned(records: list[Record], n: int) -> Rerunnable:
    async def plan(tx: Any) -> WriteBatch:
        count = int(await tx.get_meta("n") or 0)
        return WriteBatch(records=records, meta={"n": str(count + n), "last": str(n)})

    return Rerunnable(plan)


@pytest.mark.parametrize("seed", range(8))
async def test_batches_written_in_place_leave_the_file_as_the_thread_does(
    tmp_path: Path, seed: int
) -> None:
    """Generated runs of batches (one to 80 records of every kind, some past the in-place
    bounds) committed by a store that writes small ones in place and by one that writes all
    on its connection's thread (``synchronous=FULL``): both files hold the same rows."""
    rng = random.Random(seed)
    runs: list[list[Record]] = []
    for _ in range(30):
        session = make_session()
        size = rng.choice([1, 3, 9, 20, 70, 80])
        kinds = [make_message, make_event, make_checkpoint, make_audit]
        runs.append(
            [session] + [rng.choice(kinds)(session_id=session.id) for _ in range(size - 1)]  # type: ignore[operator]
        )
    in_place = sqlite_module.SQLiteAdapter(tmp_path / "a.db")
    on_thread = sqlite_module.SQLiteAdapter(tmp_path / "b.db", synchronous="FULL")
    async with in_place, on_thread:
        hops = count_hops(in_place._conn)
        first = True
        for n, records in enumerate(runs, start=1):
            for store in (in_place, on_thread):
                await store.transact(_planned(records, n))
            small = len(records) <= sqlite_module.IN_PLACE_MAX_RECORDS
            if not first:
                assert hops[0] == (0 if small else 1), (n, len(records), hops)
            first, hops[0] = False, 0
    assert _dump(tmp_path / "a.db") == _dump(tmp_path / "b.db")


async def test_a_write_lock_of_another_process_is_waited_for_on_the_thread(
    db_path: Path,
) -> None:
    """In place, nothing waits for a lock: with another process's write lock held, the
    batch goes to the connection's thread, which waits (``busy_timeout_ms``) while the
    caller's thread goes on; once the lock is released, it is written."""
    calls: list[str] = []
    async with SQLiteAdapter(db_path) as store:
        await store.transact(_increment(calls))
        handed = _watch_hops(store)
        with locked_elsewhere(db_path):
            writing = asyncio.ensure_future(store.transact(_increment(calls)))
            await handed.wait()  # tried in place, refused at once: handed to the thread
            assert await store.peek_meta("n") == "1"  # and the caller's thread goes on
            assert not writing.done()
        await writing
        assert await store.get_meta("n") == "2"
        assert await store.outbox_count() == 2


async def test_a_failure_in_place_rolls_back_and_the_store_goes_on(db_path: Path) -> None:
    """A batch that fails in place (an event number past SQLite's INTEGER, at its insert,
    after the session row was written in the transaction) raises ``StorageError`` with
    nothing written; the next batch is written in place as usual."""
    calls: list[str] = []
    async with SQLiteAdapter(db_path) as store:
        await store.transact(_increment(calls))
        session = make_session()
        bad = make_event(session_id=session.id, sequence_number=2**63)
        hops = count_hops(store._conn)
        with pytest.raises(StorageError) as info:
            await store.transact(_planned([session, bad], 5))
        assert info.value.retryable is False and hops[0] == 0
        assert await store.get_session(session.id) is None
        assert await store.get_meta("n") == "1" and await store.outbox_count() == 1
        hops[0] = 0
        await store.transact(_increment(calls))
        await store.transact(_increment(calls))
        assert await store.get_meta("n") == "3" and await store.outbox_count() == 3
        assert store._local is not None and not store._local.in_transaction


async def test_a_wal_left_behind_sends_batches_to_the_thread(db_path: Path) -> None:
    """A reader of another process holding an old snapshot keeps the side checkpoints from
    copying the WAL back: once it holds more than half of ``AUTOCHECKPOINT_PAGES``, batches
    are written on the connection's thread (where SQLite's own checkpoint may run), and in
    place again once a writer has started the WAL over."""
    calls: list[str] = []
    async with SQLiteAdapter(db_path) as store:
        await store.transact(_increment(calls))
        reader = raw(db_path)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM outbox").fetchall()  # holds its snapshot
            for _ in range(2000):
                await store.transact(_increment(calls))
                await store._checkpoints.wait()
                if store._wal_long:
                    break
            assert store._wal_long
            hops = count_hops(store._conn)
            await store.transact(_increment(calls))
            assert hops[0] == 1
        finally:
            reader.execute("ROLLBACK")
            reader.close()
        for _ in range(100):  # each checkpoint awaited: the next write starts the WAL over
            await store.transact(_increment(calls))
            await store._checkpoints.wait()
            if not store._wal_long:
                break
        assert not store._wal_long
        hops[0] = 0
        await store.transact(_increment(calls))
        assert hops[0] == 0


async def test_steady_commits_in_place_keep_the_wal_bounded(db_path: Path) -> None:
    """Batches committed back to back, each in place, with no other process: the side
    checkpoints run under the store's lock, so the commit after each starts the WAL over and
    its file stays small. (With checkpoints running beside the commits, none began on a WAL
    copied back to its end, no writer started it over, and it grew to 33,000 pages in a
    1,000-turn conversation; this loop took it to 24,000.)"""
    async with SQLiteAdapter(db_path) as store:
        session = make_session()
        body = "x" * 24_000  # about six pages a commit, as a long session's row
        for n in range(1500):
            message = make_message(session_id=session.id, content=[{"type": "text", "text": body}])
            await store.transact(_planned([session, message], n))
        wal_pages = Path(f"{db_path}-wal").stat().st_size // 4096
    assert wal_pages < sqlite_module.AUTOCHECKPOINT_PAGES // 2, wal_pages


# -- InPlace plans: reads and writes on the caller's thread ----------------------------------


def _reading_plan(session_id: str, seen: list[Any]) -> Plan:
    """A plan that reads what a page's apply reads (meta, a session row, events, which
    messages are held, audit rows) and writes a message and a meta key from what it read."""

    async def plan(tx: Any) -> WriteBatch:
        n = int(await tx.get_meta("n") or 0)
        row = await tx.get_session(session_id)
        events = await tx.list_events(session_id)
        missing = await tx.missing_messages(["m-held", "m-absent"])
        audit = await tx.audit_rows(["a-1"])
        seen[:] = [n, row, events, missing, audit]
        return WriteBatch(
            records=[make_message(session_id=session_id)], meta={"n": str(n + len(events))}
        )

    return plan


def _held_records(session_id: str) -> list[Record]:
    return [
        make_session(id=session_id),
        make_message(id="m-held", session_id=session_id),
        make_event(session_id=session_id, sequence_number=1),
        make_event(session_id=session_id, sequence_number=2),
        make_audit(id="a-1", session_id=session_id),
    ]


async def _held_state(
    store: SQLiteAdapter, session_id: str, records: list[Record] | None = None
) -> None:
    held = records if records is not None else _held_records(session_id)
    await commit(store, *held, meta={"n": "5"})


async def test_an_in_place_plan_reads_and_writes_as_one_on_the_thread(tmp_path: Path) -> None:
    """The same plan, marked ``InPlace`` on one store and not on another (same rows): it
    reads the same, writes the same, and makes no hop in place."""
    sid = "s-in-place"
    seen_here: list[Any] = []
    seen_there: list[Any] = []
    async with SQLiteAdapter(tmp_path / "a.db") as here, SQLiteAdapter(tmp_path / "b.db") as there:
        held = _held_records(sid)
        for store in (here, there):
            await _held_state(store, sid, held)
        hops = count_hops(here._conn)
        await here.transact(InPlace(_reading_plan(sid, seen_here)))
        assert hops[0] == 0
        await there.transact(_reading_plan(sid, seen_there))
    assert seen_here == seen_there
    assert seen_here[0] == 5 and seen_here[3] == ["m-absent"] and len(seen_here[2]) == 2
    here_rows, there_rows = _dump(tmp_path / "a.db"), _dump(tmp_path / "b.db")
    # (the message each plan made has its own id and stamp; all else is the same)
    assert len(here_rows["messages"]) == len(there_rows["messages"]) == 2
    for rows in (here_rows, there_rows):
        del rows["messages"], rows["outbox"]
    assert here_rows == there_rows


async def test_an_in_place_plan_that_fails_leaves_nothing_and_the_store_goes_on(
    db_path: Path,
) -> None:
    async with SQLiteAdapter(db_path) as store:
        await _held_state(store, "s-1")

        async def failing(tx: Any) -> WriteBatch:
            await tx.get_session("s-1")
            raise ValueError("a plan's own error")

        with pytest.raises(ValueError, match="own error"):
            await store.transact(InPlace(failing))
        assert store._local is not None and not store._local.in_transaction
        await store.transact(InPlace(_reading_plan("s-1", [])))
        assert await store.get_meta("n") == "7"
        assert await store.outbox_count() == 6


async def test_an_in_place_transaction_is_never_seen_before_its_commit(db_path: Path) -> None:
    """A plan that waits on something else (here an event) leaves its transaction open on
    the caller's connection while other tasks run: a peek meanwhile does not read on that
    connection but on the store's, after the lock (the plan's write, once committed).
    Cancelled, the plan leaves nothing."""
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("n", "1")
        plan, planning, release = _held_plan()

        writing = asyncio.ensure_future(store.transact(InPlace(plan)))
        await planning.wait()
        assert store._local is not None and store._local.in_transaction
        peeking = asyncio.ensure_future(store.peek_meta("n"))  # runs before the plan goes on
        release.set()
        await writing
        assert await peeking == "2"

        # Cancelled while it waits: rolled back, nothing written, the store goes on.
        planning.clear()
        release.clear()
        writing = asyncio.ensure_future(store.transact(InPlace(plan)))
        await planning.wait()
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        assert not store._local.in_transaction
        await store.set_meta("n", "3")
        assert await store.peek_meta("n") == "3"


async def test_an_in_place_plan_waits_for_another_process_on_the_thread(db_path: Path) -> None:
    async with SQLiteAdapter(db_path) as store:
        await _held_state(store, "s-1")
        with locked_elsewhere(db_path):
            handed = _watch_hops(store)
            writing = asyncio.ensure_future(store.transact(InPlace(_reading_plan("s-1", []))))
            await handed.wait()
            assert not writing.done()
        await writing
        assert await store.get_meta("n") == "7"


# -- a long session's message ids in blocks (schema 7) ---------------------------------------


def _blocks(path: Path, session_id: str) -> list[tuple[int, int]]:
    """``(part, ids)`` of each stored block of the session, in order."""
    conn = raw(path)
    try:
        rows = conn.execute(
            "SELECT part, length(ids) / 16 FROM session_ids WHERE session_id = ? ORDER BY part",
            (key(session_id),),
        ).fetchall()
    finally:
        conn.close()
    return [(int(part), int(n)) for part, n in rows]


def _row_ids(path: Path, session_id: str) -> tuple[int | None, int]:
    """The row's ``ids_count`` and how many ids its body holds."""
    conn = raw(path)
    try:
        count, body = conn.execute(
            "SELECT ids_count, body FROM sessions WHERE id = ?", (key(session_id),)
        ).fetchone()
    finally:
        conn.close()
    return count, len(compact.decode(body).state.message_ids)  # type: ignore[union-attr]


async def test_a_long_sessions_ids_live_in_blocks_and_a_turn_rewrites_one(db_path: Path) -> None:
    """300 ids: the body holds none, three blocks hold them; two more (a turn) change the last
    block only, and a session of few ids keeps them in its body."""
    session = make_session(state=SessionState(message_ids=[uuid7() for _ in range(300)]))
    short = make_session(state=SessionState(message_ids=[uuid7() for _ in range(5)]))
    written: list[list[tuple[Any, ...]]] = []
    writer = sqlite_module._write_batch_now

    def recorded(raw_conn: sqlite3.Connection, *args: Any) -> Any:
        kept: list[tuple[Any, ...]] = []
        written.append(kept)
        raw_conn.set_trace_callback(lambda sql: kept.append((sql,)))
        try:
            return writer(raw_conn, *args)
        finally:
            raw_conn.set_trace_callback(None)

    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, short)
        assert _row_ids(db_path, session.id) == (300, 0)
        assert _blocks(db_path, session.id) == [(0, 124), (1, 124), (2, 52)]
        assert _row_ids(db_path, short.id) == (None, 5) and _blocks(db_path, short.id) == []
        longer = msgspec.structs.replace(
            session,
            state=SessionState(message_ids=[*session.state.message_ids, uuid7(), uuid7()]),
        )
        sqlite_module._write_batch_now = recorded  # type: ignore[assignment]
        try:
            await commit(store, longer)
        finally:
            sqlite_module._write_batch_now = writer  # type: ignore[assignment]
        assert (await store.get_session(session.id)) == longer
        listed = {s.id: s for s in await store.list_sessions()}
        assert listed == {session.id: longer, short.id: short}
    assert _blocks(db_path, session.id) == [(0, 124), (1, 124), (2, 54)]
    statements = [sql for batch in written for (sql,) in batch]
    block_writes = [sql for sql in statements if "INTO session_ids" in sql]
    assert len(block_writes) == 1, statements  # the last block, not the 302 ids
    async with SQLiteAdapter(db_path) as again:  # another process: no cache of its own
        assert await again.get_session(session.id) == longer
        queued = [e.record for e in await again.outbox_pending()]
        assert queued[-1] == longer  # a push sends the whole row, its ids joined


async def test_an_outbox_read_holds_a_long_sessions_blocks_once_however_often_it_is_queued(
    db_path: Path,
) -> None:
    """A long session queued at each of ten turns: the flush's read of the outbox gives one
    row an entry and the session's blocks once (joined to each entry, they came back ten
    times), and each entry's session is the whole row as stored, its ids from those blocks."""
    ids = [uuid7() for _ in range(300)]
    session = make_session(state=SessionState(message_ids=ids))
    async with SQLiteAdapter(db_path) as store:
        for _ in range(10):
            ids = [*ids, uuid7(), uuid7()]
            session = msgspec.structs.replace(session, state=SessionState(message_ids=ids))
            await commit(store, session)
        stored = await store.get_session(session.id)
        pending = await store.outbox_pending()
    assert stored == session
    assert [e.record for e in pending] == [session] * 10
    assert [e.again_later for e in pending] == [True] * 9 + [False]
    conn = raw(db_path)
    try:
        sqlite_module.sql_functions(conn)
        rows, blocks = sqlite_module._outbox_read(conn, 0, -1)
        assert not conn.in_transaction  # (its read transaction ended)
    finally:
        conn.close()
    assert len(rows) == 10
    assert sorted((part, len(ids_) // 16) for _, part, ids_ in blocks) == [
        (0, 124),
        (1, 124),
        (2, 72),
    ]


async def test_two_stores_of_one_process_each_write_a_long_session_without_reading_its_blocks(
    tmp_path: Path,
) -> None:
    """Two files in one process holding the same long session (two devices of one user, as
    a test or a benchmark runs them; an app with a second file), written in turn: each
    turn's write finds the blocks it replaces in this process's memory, with no read of them
    from its file (the cache once held one entry a session, and each store's write took the
    other's out), and each file reads back its own list."""
    session = make_session(state=SessionState(message_ids=[uuid7() for _ in range(300)]))
    writer = sqlite_module._write_batch_now
    statements: list[str] = []

    def recorded(raw_conn: sqlite3.Connection, *args: Any) -> Any:
        raw_conn.set_trace_callback(statements.append)
        try:
            return writer(raw_conn, *args)
        finally:
            raw_conn.set_trace_callback(None)

    stores = (SQLiteAdapter(tmp_path / "a.db"), SQLiteAdapter(tmp_path / "b.db"))
    async with stores[0], stores[1]:
        for store in stores:
            await commit(store, session)
        rows = {0: session, 1: session}
        sqlite_module._write_batch_now = recorded  # type: ignore[assignment]
        try:
            for turn in range(6):
                which = turn % 2
                ids = [*rows[which].state.message_ids, uuid7(), uuid7()]
                rows[which] = msgspec.structs.replace(session, state=SessionState(message_ids=ids))
                await commit(stores[which], rows[which])
        finally:
            sqlite_module._write_batch_now = writer  # type: ignore[assignment]
        reads = [sql for sql in statements if "FROM session_ids" in sql]
        assert reads == [], reads
        assert any("INTO session_ids" in sql for sql in statements)
        for which, store in enumerate(stores):
            assert await store.get_session(session.id) == rows[which]


_BLOCK_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["append", "truncate", "replace", "edit", "texts", "fail", "again", "back", "forget"]
        ),
        st.integers(min_value=0, max_value=12),
        st.sampled_from([0, 1]),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=_BLOCK_OPS, shared=st.booleans())
def test_a_sessions_ids_read_back_as_written_whatever_the_edits(
    ops: list[Any], shared: bool
) -> None:
    """Generated edits of one session's ids (appended, cut, replaced, one changed, ids that
    are no UUIDs, a write that rolls back and the same list again, the list before the last
    write again, a forgotten cache), each
    through one of two stores on the same file, each with a cache of its own (two
    processes) or both with one (``shared``: one process): each store reads back exactly the
    last committed list, and the file holds no block past it."""
    asyncio.run(_edits_read_back(ops, shared))


async def _edits_read_back(ops: list[Any], shared: bool) -> None:
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.db"
        session = make_session()
        ids: list[str] = []
        tried: list[str] = []
        before: list[str] = []
        stores = (SQLiteAdapter(path), SQLiteAdapter(path))
        for each in stores:
            each._id_layout = sqlite_module.IdLayout(inline=3, block=2)
        one: dict[object, Any] = {}
        caches: tuple[dict[object, Any], dict[object, Any]] = (one, one) if shared else ({}, one)
        async with stores[0], stores[1]:
            await commit(stores[0], session)
            for op, n, which in ops:
                store = stores[which]
                patch.setattr(sqlite_module, "_id_blocks", caches[which])
                new = list(ids)
                if op == "append":
                    new += [uuid7() for _ in range(n)]
                elif op == "truncate":
                    new = new[: len(new) - n] if n <= len(new) else []
                elif op == "replace":
                    new = [uuid7() for _ in range(n)]
                elif op == "edit" and new:
                    new[n % len(new)] = uuid7()
                elif op == "texts":
                    new = [*new, f"not-a-uuid-{n}"]
                elif op == "again":
                    new = list(tried)
                elif op == "back":
                    new = list(before)
                elif op == "forget":
                    caches[which].clear()
                row = msgspec.structs.replace(session, state=SessionState(message_ids=new))
                if op == "fail":  # the session row written, then a row refused: rolled back
                    tried = [*new, uuid7()]
                    row = msgspec.structs.replace(session, state=SessionState(message_ids=tried))
                    bad = make_message(session_id=None)  # type: ignore[arg-type]
                    with pytest.raises(StorageError):
                        await commit(store, row, bad)
                    row = msgspec.structs.replace(session, state=SessionState(message_ids=ids))
                else:
                    await commit(store, row)
                    before, ids = ids, new
                for reader in stores:
                    got = await reader.get_session(session.id)
                    assert got is not None and got.state.message_ids == ids, (op, n, which)
            count, _ = _row_ids(path, session.id)
            blocks = _blocks(path, session.id)
            if count is None:
                assert blocks == []
            else:
                assert count == len(ids) and sum(n for _, n in blocks) == len(ids)
                assert [part for part, _ in blocks] == list(range(len(blocks)))


def _audit_chain(client: str, n: int, **fields: Any) -> list[AuditRow]:
    rows: list[AuditRow] = []
    for number in range(1, n + 1):
        made = make_audit(client_id=client, **fields)
        rows.append(chain_audit(made, rows[-1].row_hash if rows else "", number))
    return rows


async def test_an_audit_row_leaves_out_the_digests_its_content_gives(db_path: Path) -> None:
    """Schema 17: an audit row's body keeps neither its payload digest nor its identity
    digest where its content gives those very ones (68 bytes fewer): this device's rows and
    another's, a chain's first row too. A redacted row, one whose digest its content does not
    give (as a hostile device may send), and one never chained keep theirs. Every read, the
    outbox's push included, gives the bytes written; a row changed in the file reads with
    the digests its content now gives, which no longer link: the chain names it. A redacted
    row is written whole, and its chain still verifies."""
    own = _audit_chain(CLIENT, 3, subject_key="alice")
    peer = _audit_chain("dev-peer", 2)
    redacted = msgspec.structs.replace(
        _audit_chain("dev-r", 1)[0], subject_key=None, request_id=None, redacted=True
    )
    poisoned = msgspec.structs.replace(
        _audit_chain("dev-p", 1)[0], payload_digest=secrets.token_hex(32)
    )
    rows = [*own, *peer, redacted, poisoned, make_audit(client_id="dev-u")]
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("client_id", CLIENT)
        await commit(store, *rows)
        by_id = operator.attrgetter("id")
        assert sorted(await store.list_audit(), key=by_id) == sorted(rows, key=by_id)
        pushed = {e.record.id: e.body for e in await store.outbox_pending()}
        assert pushed == {r.id: compact.encode(r) for r in rows}
    conn = raw(db_path)
    try:
        stored = {unkey(k): bytes(b) for k, b in conn.execute("SELECT id, body FROM audit")}
        left_out = {i for i, body in stored.items() if compact.audit_digests_left_out(body)}
        assert left_out == {r.id for r in own + peer}
        # (the model's text in the second row of ours: "scripted-1" made "scripted-2")
        body = stored[own[1].id]
        changed = body.replace(b"scripted-1", b"scripted-2")
        assert changed != body
        conn.execute("UPDATE audit SET body = ? WHERE id = ?", (changed, key(own[1].id)))
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        chain = await store.list_audit(client_id=CLIENT)
        assert chain[1].model == "scripted-2" and hashchain.audit_content_ok(chain[1])
        found = hashchain.verify_chain(chain)
        assert (found.first_bad_index, found.reason) == (1, "row_hash mismatch")
        assert hashchain.verify_chain(await store.list_audit(client_id="dev-peer")).ok
        assert await store.gdpr_soft_delete("alice") == 3
        after = await store.list_audit(client_id=CLIENT)
        assert [r.redacted for r in after] == [True] * 3
        assert hashchain.verify_chain([after[0]]).ok
        assert [r.identity_digest for r in after] == [r.identity_digest for r in own]


def _index_columns(path: Path, index: str) -> list[str]:
    conn = raw(path)
    try:
        return [row[2] for row in conn.execute(f"PRAGMA index_info({index})")]
    finally:
        conn.close()


async def test_a_schema_16_file_cuts_its_id_blocks_two_to_a_page_at_17(db_path: Path) -> None:
    """Schema 17: a long session's ids in blocks of 124 (``SQLITE_ID_LAYOUT``), two rows to a
    4 KiB page, where blocks of 128 took a page each. A schema 16 file's blocks are cut again
    as it opens: its sessions read the same, from this process's cache and from the file, a
    turn then writes the one block it appends to, and a session whose blocks are not all
    there stays as it was (a corrupt row, before and after). Its audit rows' indexes hold
    less, and its rows list as before, those written after too."""
    long = make_session(state=SessionState(message_ids=[uuid7() for _ in range(2_000)]))
    cut = make_session(state=SessionState(message_ids=[uuid7() for _ in range(300)]))
    short = make_session(state=SessionState(message_ids=[uuid7() for _ in range(5)]))
    rows = [  # (each chained alone: its digests left out, schema 17)
        chain_audit(make_audit(client_id=client, session_id=session.id), "", n)
        for n in (3, 1, 2)
        for client, session in (("dev-b", long), ("dev-a", long), ("dev-a", short))
    ]
    async with SQLiteAdapter(db_path) as store:
        await commit(store, long, cut, short, *rows)
        listed = {
            "all": await store.list_audit(),
            "long": await store.list_audit(session_id=long.id),
            "a": await store.list_audit(client_id="dev-a"),
            "both": await store.list_audit(session_id=long.id, client_id="dev-a"),
        }
    assert [(r.client_id, r.sequence_number) for r in listed["both"]] == [
        ("dev-a", n) for n in (1, 2, 3)
    ]
    conn = raw(db_path)
    try:
        _as_schema_16(conn)
        conn.execute("DELETE FROM session_ids WHERE session_id = ? AND part = 1", (key(cut.id),))
        conn.commit()
        assert _blocks(db_path, long.id) == [(p, 128) for p in range(15)] + [(15, 80)]
        bodies = [bytes(b) for (b,) in conn.execute("SELECT body FROM audit")]
        assert not any(compact.audit_digests_left_out(b) for b in bodies)
        pages_before = conn.execute(
            "SELECT count(*) FROM dbstat WHERE name = 'session_ids'"
        ).fetchone()[0]
    finally:
        conn.close()
    for cached in (True, False):
        if not cached:
            sqlite_module._id_blocks.clear()  # (as another process: it reads the blocks)
        path = db_path.with_name(f"copy-{cached}.db")
        path.write_bytes(db_path.read_bytes())
        async with SQLiteAdapter(path) as store:
            assert (await store.settings())["schema_version"] == SCHEMA_VERSION
            assert _index_columns(path, "ix_audit_client") == ["client_n", "sequence_number"]
            assert _index_columns(path, "ix_audit_session") == ["session_n"]
            assert await store.list_audit() == listed["all"]
            assert await store.list_audit(session_id=long.id) == listed["long"]
            assert await store.list_audit(client_id="dev-a") == listed["a"]
            assert await store.list_audit(session_id=long.id, client_id="dev-a") == listed["both"]
            assert _blocks(path, long.id) == [(p, 124) for p in range(16)] + [(16, 16)]
            assert await store.get_session(long.id) == long
            assert await store.get_session(short.id) == short
            assert _blocks(path, cut.id) == [(0, 128), (2, 44)]
            with pytest.raises(StorageError, match="corrupt row in sessions"):
                await store.get_session(cut.id)
            longer = msgspec.structs.replace(
                long, state=SessionState(message_ids=[*long.state.message_ids, uuid7()])
            )
            await commit(store, longer)
            assert await store.get_session(long.id) == longer
            assert _blocks(path, long.id)[-1] == (16, 17)
        conn = raw(path)
        try:
            pages = conn.execute("SELECT count(*) FROM dbstat WHERE name = 'session_ids'")
            assert pages.fetchone()[0] < pages_before * 2 / 3
        finally:
            conn.close()


async def test_a_missing_or_cut_block_is_a_corrupt_row_and_the_next_version_mends_it(
    db_path: Path,
) -> None:
    session = make_session(state=SessionState(message_ids=[uuid7() for _ in range(300)]))
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session)
        conn = raw(db_path)
        conn.execute("DELETE FROM session_ids WHERE part = 1")
        conn.close()
        with pytest.raises(StorageError, match=r"corrupt row in sessions.*id blocks hold 176"):
            await store.get_session(session.id)
        sqlite_module._id_blocks.clear()  # (as another process: it reads the blocks)
        newer = msgspec.structs.replace(
            session, state=SessionState(message_ids=[*session.state.message_ids, uuid7()])
        )
        await commit(store, newer)
        assert await store.get_session(session.id) == newer
        assert _blocks(db_path, session.id) == [(0, 124), (1, 124), (2, 53)]
        conn = raw(db_path)
        conn.execute("UPDATE session_ids SET ids = x'00' WHERE part = 2")
        conn.close()
        with pytest.raises(StorageError, match="corrupt row in sessions"):
            await store.list_sessions()


async def test_a_session_written_before_its_blocks_reads_as_it_was_and_moves_on_its_next_write(
    db_path: Path,
) -> None:
    """A row that holds its ids in its body (written before schema 7, or short) reads as it
    is; its next version of many ids goes to blocks, and a shorter one back to the body."""
    session = make_session(state=SessionState(message_ids=[uuid7() for _ in range(300)]))
    inline = SQLiteAdapter(db_path)
    inline._id_layout = sqlite_module.IdLayout(inline=10**6)
    async with inline:
        await commit(inline, session)
    assert _row_ids(db_path, session.id) == (None, 300)
    async with SQLiteAdapter(db_path) as store:
        assert await store.get_session(session.id) == session
        grown = msgspec.structs.replace(
            session, state=SessionState(message_ids=[*session.state.message_ids, uuid7()])
        )
        await commit(store, grown)
        assert _row_ids(db_path, session.id) == (301, 0)
        cut = msgspec.structs.replace(
            session, state=SessionState(message_ids=grown.state.message_ids[:7])
        )
        await commit(store, cut)
        assert await store.get_session(session.id) == cut
    assert _row_ids(db_path, session.id) == (None, 7) and _blocks(db_path, session.id) == []


def test_id_blocks_are_those_that_differ() -> None:
    size = 16 * sqlite_module.ID_LAYOUT.block
    old = bytes(range(256)) * (size * 2 // 256) + b"x" * 32
    assert sqlite_module.id_blocks(old + b"y" * 32, old) == [(2, b"x" * 32 + b"y" * 32)]
    assert sqlite_module.id_blocks(old, old) == []
    changed = b"z" * 16 + old[16:]
    assert sqlite_module.id_blocks(changed, old) == [(0, changed[:size])]
    assert [p for p, _ in sqlite_module.id_blocks(old[: size + 16], old)] == [1]


# -- a long transcript read as one span of the table -----------------------------------------


def _messages_table(rows: list[Any]) -> sqlite3.Connection:
    """A device schema on a plain connection holding ``rows`` (messages, in rowid order),
    written as the store writes them (short, the tenant left out: ``_write_batch_now``)."""
    conn = sqlite3.connect(":memory:")
    sqlite_module.create_schema(conn)
    conn.execute(sqlite_module._PUT_META, ("client_id", CLIENT))  # (the stamps' node left out)
    groups, _ = sqlite_module._encode_batch(rows)
    (written,) = sqlite_module._shortened(conn, groups)
    for sql, values in [*sqlite_module._numbers_for(list(written.items())), *written.items()]:
        conn.executemany(sql, values)  # (the sessions numbered first, as a commit does)
    conn.commit()
    return conn


@st.composite
def transcripts(draw: st.DrawFn) -> tuple[list[Any], list[str]]:
    """Messages of a few sessions in the order they were written, and an id list to read: a
    run of one session's, with others' rows between, ids out of the written order (a fork's
    earlier messages), ids asked twice and ids the table does not hold."""
    sessions = [uuid7() for _ in range(draw(st.integers(1, 3)))]
    written = [
        make_message(session_id=draw(st.sampled_from(sessions)), id=uuid7())
        for _ in range(draw(st.integers(1, 40)))
    ]
    ids = [m.id for m in written if m.session_id == sessions[0]]
    if ids and draw(st.booleans()):
        ids = draw(st.permutations(ids))
    extra = draw(st.lists(st.sampled_from([m.id for m in written] + [uuid7(), "NOT-A-UUID"])))
    for item in extra:
        ids.insert(draw(st.integers(0, len(ids))), item)
    return written, ids


@settings(max_examples=300)
@given(transcripts(), st.integers(1, 8), st.integers(1, 3))
def test_a_transcript_read_as_a_span_is_the_one_read_by_its_ids(
    case: tuple[list[Any], list[str]], span_min: int, slack: int
) -> None:
    written, ids = case
    keys = sqlite_module._keys(ids)
    conn = _messages_table(written)
    before = (sqlite_module.SPAN_MIN_KEYS, sqlite_module.SPAN_SLACK)
    sqlite_module.SPAN_MIN_KEYS, sqlite_module.SPAN_SLACK = span_min, slack
    try:
        by_span = sqlite_module._select_messages(conn, keys)
        tenant = sqlite_module._tenant_of(conn)
        by_keys = sqlite_module._select_in(conn, QUERIES["get_messages"], keys), *tenant
        assert tenant[1] == compact.stamp_node(CLIENT)
        expected = [m for i in ids for m in written if m.id == i]
        order = sqlite_module._messages_in_order
        assert order(keys, ids, by_span) == order(keys, ids, by_keys) == expected
    finally:
        sqlite_module.SPAN_MIN_KEYS, sqlite_module.SPAN_SLACK = before
        conn.close()


def test_a_long_transcript_is_read_as_one_span_and_a_scattered_one_by_its_ids() -> None:
    """A session's messages written turn after turn are one span of the table; a list whose
    first and last message are far apart (more than ``SPAN_SLACK`` rows a key) is read by its
    ids, so no read walks far for few rows. What each read ran, by SQLite's trace."""
    n = sqlite_module.SPAN_MIN_KEYS
    session, other = uuid7(), uuid7()
    run = [make_message(session_id=session, id=uuid7()) for _ in range(n)]
    scattered = [make_message(session_id=other, id=uuid7()) for _ in range(n)]
    filler = [make_message(session_id=uuid7(), id=uuid7()) for _ in range(3 * n)]
    # The other session's first message, then many rows of others, then the rest of it.
    conn = _messages_table([scattered[0], *run, *filler, *scattered[1:]])
    ran: list[str] = []
    conn.set_trace_callback(ran.append)
    try:
        for messages, span in ((run, True), (scattered, False)):
            ran.clear()
            ids = [m.id for m in messages]
            keys = sqlite_module._keys(ids)
            rows = sqlite_module._select_messages(conn, keys)
            assert sqlite_module._messages_in_order(keys, ids, rows) == messages
            ranged = [sql for sql in ran if "rowid BETWEEN" in sql]
            assert bool(ranged) is span
            assert any(" IN (" in sql for sql in ran) is not span
    finally:
        conn.close()


async def test_a_transcript_read_through_the_store_takes_the_span(db_path: Path) -> None:
    """``get_messages`` of a long session, through the store and in a transaction's reads,
    with an id the file does not hold among them (looked up by itself, and left out)."""
    session = make_session(id=uuid7())
    messages = [make_message(session_id=session.id) for _ in range(sqlite_module.SPAN_MIN_KEYS)]
    ids = [m.id for m in messages]
    ids.insert(len(ids) // 2, "unknown-id")
    async with SQLiteAdapter(db_path) as store:
        await commit(store, session, *messages)
        assert store._conn is not None
        ran: list[str] = []
        await store._conn.set_trace_callback(ran.append)
        assert await store.get_messages(ids) == messages
        assert any("rowid BETWEEN" in sql for sql in ran)
        read: list[Any] = []

        async def plan(tx: Any) -> None:
            read.extend(await tx.get_messages(ids))

        await store.transact(plan)
        assert read == messages


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["turn", "other", "push", "pull", "echo"]), st.integers(1, 4)),
        min_size=1,
        max_size=14,
    )
)
def test_an_event_leaves_out_the_prev_hash_the_row_before_it_holds(
    steps: list[tuple[str, int]],
) -> None:
    """Schema 14, over generated histories of one session: the device's turns chain
    provisional events on its log, another device's events and its own reach the server,
    which places them, and the device takes them back by pages (``syncplan.rebase``: placed
    events written, its provisional tail moved after them) or, when its own land in place, by
    marking them placed (a push's echo). After each step every event reads back as last
    written (by session, by id, as plain SQL reads the row, and in the outbox's bytes), the
    log verifies, and every body but the first leaves out its prev_hash: a rebase that moves
    the provisional tail writes each of its rows again, and a placed event and a provisional
    one that share a place while it does are told apart."""
    from pleach_client.syncplan import rebase
    from shared.hashchain import chain_event, verify_chain

    session = make_session()

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.db"
            server: list[Event] = []  # (the server's log: placed events)
            pushed = 0  # (how many of the device's own events the server has)
            own: list[str] = []  # (the device's own events' ids, in order)
            async with SQLiteAdapter(path) as store:
                await store.set_meta("client_id", CLIENT)
                await commit(store, session)
                for kind, count in steps:
                    log = await store.list_events(session.id)
                    placed = [e for e in log if e.canonical]
                    head = (len(placed), placed[-1].row_hash if placed else "")
                    tail = [e for e in log if not e.canonical]
                    if kind == "turn":
                        seq, prev = (log[-1].sequence_number, log[-1].row_hash) if log else (0, "")
                        made = []
                        for _ in range(count):
                            seq += 1
                            event = chain_event(make_event(session_id=session.id), prev, seq)
                            made.append(event)
                            prev = event.row_hash
                        own.extend(e.id for e in made)
                        await commit(store, *made)
                    elif kind == "other":
                        for _ in range(count):
                            prev = server[-1].row_hash if server else ""
                            event = make_event(session_id=session.id, client_id="dev-b")
                            event = chain_event(event, prev, len(server) + 1)
                            server.append(msgspec.structs.replace(event, canonical=True))
                    elif kind == "push":
                        mine = {e.id: e for e in tail}
                        for event_id in own[pushed:]:
                            prev = server[-1].row_hash if server else ""
                            event = chain_event(mine[event_id], prev, len(server) + 1)
                            server.append(msgspec.structs.replace(event, canonical=True))
                        pushed = len(own)
                    elif kind == "echo" and pushed < len(own) and len(server) == len(placed):
                        # (its own land in place: the server took them where they are)
                        landing = tail[: len(own) - pushed]
                        server.extend(msgspec.structs.replace(e, canonical=True) for e in landing)
                        pushed = len(own)
                        marked = WriteBatch(
                            records=[], outbox=False, canonical=[e.id for e in landing]
                        )
                        await store.commit(marked)
                    elif kind == "pull" and len(server) > len(placed):
                        incoming = server[len(placed) : len(placed) + count]
                        out = rebase(
                            session.id,
                            incoming,
                            known_head=head,
                            verified=[],
                            tail=tail,
                            genesis=head[1],
                        ).out
                        await store.commit(WriteBatch(records=out, outbox=False))
                    log = await store.list_events(session.id)
                    assert verify_chain(log).ok
                    assert [e.sequence_number for e in log] == list(range(1, len(log) + 1))
                    for event in log:
                        assert await store.get_event(event.id) == event
                    queued = {
                        e.record.id: bytes(b)
                        for e, b in zip(
                            await store.outbox_pending(), await _outbox_bodies(store), strict=True
                        )
                        if isinstance(e.record, Event)
                    }
                    assert queued == {
                        e.id: compact.encode(e) for e in log if e.id in queued
                    } and set(queued) == set(own)
                    conn = raw(path)
                    try:
                        whole = sqlite_module._whole_row("events")
                        rows = dict(conn.execute(f"SELECT id, {whole} FROM events"))
                        forms = dict(conn.execute("SELECT id, substr(body, 2, 1) FROM events"))
                    finally:
                        conn.close()
                    for before, event in itertools.pairwise([None, *log]):
                        assert rows[key(event.id)] == compact.encode(event)
                        apart = before is not None  # (the first holds no digest to leave out)
                        assert (forms[key(event.id)] >= b"\x10") is apart, (before, event)

    asyncio.run(run())


async def test_a_schema_13_file_keeps_its_checkpoints_in_order_of_stamp_at_15(
    db_path: Path,
) -> None:
    """Schema 15: checkpoints are kept by session and id, with no stamp text beside them, and
    read in order of stamp, then id, as before: those of another device whose stamps come
    before ids made later, a child of a root, a checkpoint whose id is no UUID. A file
    written as schema 13 kept them (by stamp, the text beside the body) opens at 16 and
    reads the same, and so do the checkpoints written after; its events' whole bodies too,
    and its messages (schema 16: by their session's number), a transcript read as a span
    of rowids as before."""
    session = make_session()
    root = make_checkpoint(session_id=session.id, hlc="1796644976000-000002-dev-b")
    made = [
        root,
        make_checkpoint(session_id=session.id, hlc="1796644976000-000001-dev-b"),
        make_checkpoint(session_id=session.id, hlc="1796644976000-000001-dev-a"),
        make_checkpoint(session_id=session.id, parent_id=root.id, hlc="1796644975999-000009-z"),
        make_checkpoint(session_id=session.id, parent_id=root.id, id="CHECKPOINT-BY-HAND"),
        make_checkpoint(session_id=make_session().id),
    ]
    chained = [make_event(session_id=session.id, sequence_number=1)]
    for n in (2, 3):
        chained.append(chain_event(make_event(session_id=session.id), chained[-1].row_hash, n))

    def in_order(rows: list[Checkpoint]) -> list[Checkpoint]:
        return sorted(rows, key=lambda c: (c.hlc, c.id))

    ours = in_order([c for c in made if c.session_id == session.id])
    children = [c for c in ours if c.parent_id == root.id]
    span = sqlite_module.SPAN_MIN_KEYS
    said = [make_message(session_id=s) for s in [session.id] * span + [made[-1].session_id]]
    async with SQLiteAdapter(db_path) as store:
        await store.set_meta("client_id", CLIENT)
        await commit(store, session, *made, *chained, *said)
        assert await store.list_checkpoints(session.id) == ours
        assert await store.child_checkpoints(session.id, root.id) == children
    conn = raw(db_path)
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(checkpoints)")}
        assert columns == {"id", "session_n", "parent_id", "body"}
        _as_schema_13(conn)
        conn.commit()
        assert "hlc" in {row[1] for row in conn.execute("PRAGMA table_info(checkpoints)")}
    finally:
        conn.close()
    later = make_checkpoint(session_id=session.id, hlc="1796644975000-000000-dev-c")
    async with SQLiteAdapter(db_path) as store:
        assert (await store.settings())["schema_version"] == SCHEMA_VERSION == 18
        assert await store.list_checkpoints(session.id) == ours
        await commit(store, later)
        assert await store.list_checkpoints(session.id) == in_order([*ours, later])
        assert await store.child_checkpoints(session.id, root.id) == children
        assert await store.get_checkpoint(later.id) == later
        assert await store.list_events(session.id) == chained
        assert await store.get_messages([m.id for m in said]) == said
        assert await store.get_messages([m.id for m in said[:span]]) == said[:span]


# -- schema 18: the outbox a row a commit ---------------------------------------------------


async def test_a_schema_17_file_keeps_every_queued_entry_at_18(db_path: Path) -> None:
    """Schema 18 keeps a commit's outbox entries in one row (``queued``). A file of schema 17
    (a row an entry) opens with every entry as it was: its number, record, attempts, last
    error and time, a session's version queued again later, a dead letter queued again with
    its own copy, the gaps acknowledgements left; the numbers go on after the largest ever
    handed out, and a commit after it takes one row."""
    history = _a_history()
    session = history[0]
    async with SQLiteAdapter(db_path) as store:
        first = await commit(store, *history)
        again = await commit(store, session, make_message(session_id=session.id))
        await store.outbox_mark_attempt(first.client_seqs[1:3], 3001, "slow down")
        await store.outbox_mark_attempt(first.client_seqs[2:3], None, "timed out")
        await store.outbox_dead_letter(first.client_seqs[3], 3007, "invalid")
        await store.outbox_remove([first.client_seqs[4], again.client_seqs[-1]])
        letter = (await store.dead_letters())[0]
        retried = await store.retry_dead_letter(letter.client_seq)
        dropped = await commit(store, make_message(session_id=session.id))
        await store.outbox_remove(dropped.client_seqs)  # (the largest number: gone)
        before = await store.outbox_pending()
        last = await store.last_client_seq()
    assert retried is not None and last == dropped.client_seqs[-1]
    tried = {e.client_seq: (e.attempts, e.last_error_code, e.last_error_message) for e in before}
    assert tried[first.client_seqs[1]] == (1, 3001, "slow down")
    assert tried[first.client_seqs[2]] == (2, None, "timed out")
    assert [e.again_later for e in before if e.record == session] == [True, False]
    assert before[-1].client_seq == retried and before[-1].record == letter.record
    conn = raw(db_path)
    try:
        _as_schema_17(conn)
        conn.commit()
        assert conn.execute("SELECT count(*) FROM outbox").fetchone()[0] == len(before)
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert (await store.settings())["schema_version"] == SCHEMA_VERSION == 18
        assert await store.outbox_pending() == before
        assert await store.outbox_count() == len(before)
        assert await store.last_client_seq() == last
        assert await _session_queued(store, session.id)
        later = await commit(store, make_message(session_id=session.id))
        assert later.client_seqs == [last + 1]
        assert [e.client_seq for e in await store.outbox_pending(2, after=retried)] == [last + 1]
        assert await store.integrity_check() == []
    conn = raw(db_path)
    try:
        rows = conn.execute("SELECT client_seq, live FROM outbox ORDER BY 1").fetchall()
    finally:
        conn.close()
    # The runs of one commit, one time, consecutive numbers: a row each (the gaps cut them).
    assert len(rows) < len(before) and sum(live for _, live in rows) == len(before) + 1


async def test_a_schema_17_files_corrupt_outbox_row_still_opens_at_18(db_path: Path) -> None:
    """A row of a schema 17 outbox with a kind or a key no build writes still migrates: the
    file opens, and the flush's read names the corrupt entry, as it did before."""
    async with SQLiteAdapter(db_path) as store:
        await commit(store, make_message())
    conn = raw(db_path)
    try:
        _as_schema_17(conn)
        conn.execute("UPDATE outbox SET kind = 'Nonsense', record_id = x'0102'")
        conn.commit()
    finally:
        conn.close()
    async with SQLiteAdapter(db_path) as store:
        assert await store.outbox_count() == 1
        with pytest.raises(StorageError, match=r"corrupt row in outbox \(id 1\)"):
            await store.outbox_pending()
        assert await store.integrity_check() == []
