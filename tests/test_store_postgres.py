"""``PostgresAdapter``: the device store conformance suite against a real PostgreSQL, then what
only it has: many devices in one database (isolated, and not waiting for each other), writers
of one device in two pools (nothing lost), migrations, failures, query plans, a runtime turn,
and ``from_url``.

The database is ``PLEACH_TEST_PG_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
The conformance tests share one fresh schema per test session, each test on a device key of
its own; tests of migrations work in a schema of their own. When PostgreSQL is unreachable the
tests skip, unless ``CI`` is set: then they fail. Nothing here sleeps to wait: waits are on
events, tasks, or a condition read from ``pg_stat_activity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import msgspec
import pytest

pytest.register_assert_rewrite("tests.store_conformance")

from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply  # noqa: E402
from pleach_client.runtime import SessionRuntime  # noqa: E402
from pleach_client.store import (  # noqa: E402
    STORE_ENV,
    MemoryAdapter,
    SQLiteAdapter,
    WriteBatch,
    from_env,
    from_url,
)
from pleach_client.store import postgres as pg_module  # noqa: E402
from pleach_client.store.base import CommitReceipt, TxReader  # noqa: E402
from pleach_client.store.postgres import SCHEMA_VERSION, PostgresAdapter  # noqa: E402
from pleach_server.store.postgres import migrate as migrate_server_schema  # noqa: E402
from shared.errors import InvalidState, StorageError  # noqa: E402
from shared.ids import uuid7  # noqa: E402
from tests.factories import (  # noqa: E402
    make_event,
    make_message,
    make_session,
)
from tests.store_conformance import StoreConformance, commit, one_of_each, read_back  # noqa: E402
from tests.test_server_store_postgres import (  # noqa: E402
    PG_DSN,
    admin,
    drop_schema,
    new_schema_name,
    pg_available,  # noqa: F401 - a session fixture, used by name
    scratch_schema,
    wait_until,
)

pytestmark = pytest.mark.postgres

TIMEOUT = 20.0
TABLES = {
    "artifact_updates",
    "audit",
    "checkpoints",
    "dead_letters",
    "devices",
    "events",
    "hydrations",
    "messages",
    "outbox",
    "schema_migrations",
    "sessions",
    "sync_state",
}


def new_key(label: str = "dev") -> str:
    return f"{label}-{uuid7()}"


def adapter(schema: str, key: str | None = None, **kwargs: Any) -> PostgresAdapter:
    return PostgresAdapter(PG_DSN, device_key=key or new_key(), schema=schema, **kwargs)


@pytest.fixture(scope="session")
def client_schema(pg_available: None) -> Iterator[str]:  # noqa: F811 - the fixture above
    """The schema this test session's device stores share (created by the first open)."""
    schema = new_schema_name()
    yield schema
    drop_schema(schema)


@pytest.fixture
async def store(client_schema: str) -> AsyncIterator[PostgresAdapter]:
    """An opened, empty store: a device key of its own in the shared schema."""
    async with adapter(client_schema) as opened:
        yield opened


@pytest.fixture
async def schema(pg_available: None) -> AsyncIterator[str]:  # noqa: F811
    """A schema of its own for one test, dropped after it."""
    async with scratch_schema() as name:
        yield name


class TestPostgresStoreConformance(StoreConformance):
    pass


async def lock_waiters(application_name: str) -> int:
    """Sessions of ``application_name`` waiting on a lock (a device's row, here)."""
    async with admin() as conn:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                "AND wait_event_type = 'Lock'",
                application_name,
            )
        )


class Holder:
    """A ``transact`` plan that holds the device's lock until released."""

    def __init__(self) -> None:
        self.inside = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, tx: TxReader) -> WriteBatch:
        await tx.get_meta("cursor")
        self.inside.set()
        await self.release.wait()
        return WriteBatch(meta={"held": "yes"})


@contextlib.asynccontextmanager
async def holding(
    store: PostgresAdapter,
) -> AsyncIterator[tuple[Holder, asyncio.Task[CommitReceipt]]]:
    """``store`` holds its device's lock (a ``transact`` inside its plan) until the test
    sets ``release`` or the block ends, whatever happens in it."""
    holder = Holder()
    task = asyncio.create_task(store.transact(holder))
    try:
        async with asyncio.timeout(TIMEOUT):
            await holder.inside.wait()
        yield holder, task
    finally:
        holder.release.set()
        await asyncio.wait([task], timeout=TIMEOUT)


# -- many devices on one database -------------------------------------------------------------


async def test_two_device_keys_on_one_database_see_only_their_own_rows(
    client_schema: str,
) -> None:
    records = one_of_each()
    audit = next(r for r in records if type(r).__name__ == "AuditRow")
    async with adapter(client_schema) as a, adapter(client_schema) as b:
        await commit(a, *records, meta={"cursor": "7", "client_id": "dev-a"})
        # b holds nothing of a's, and its sequence starts on its own.
        assert await b.list_sessions(include_deleted=True) == []
        for record in records:
            assert await read_back(b, record) is None
        assert (await b.outbox_count(), await b.last_client_seq(), await b.get_meta("cursor")) == (
            0,
            0,
            None,
        )
        # The same records on both devices (one user's two devices hold one session).
        receipt = await commit(b, *records, meta={"client_id": "dev-b"})
        assert receipt.client_seqs == [1, 2, 3, 4, 5, 6]
        session = records[0]
        renamed = msgspec.structs.replace(session, title="renamed on b")
        await commit(b, renamed)
        # b's writes, deletes and redactions never reach a's rows.
        await b.outbox_remove([1, 2, 3])
        await b.outbox_dead_letter(4, 3007, "invalid")
        assert await b.gdpr_soft_delete(audit.subject_key or "") == 1
        await commit(b, purge_sessions=[session.id])
        await b.set_meta("cursor", "99")
        for record in records:
            assert await read_back(a, record) == record
        assert [e.client_seq for e in await a.outbox_pending()] == [1, 2, 3, 4, 5, 6]
        assert await a.dead_letter_count() == 0
        assert (await a.get_meta("cursor"), await a.get_meta("client_id")) == ("7", "dev-a")
        stored = await b.get_session(session.id)
        assert stored is not None and stored.title == "renamed on b"
        assert await b.get_messages([records[1].id]) == []


async def test_adapters_sharing_one_pool_are_isolated_and_leave_it_open(
    client_schema: str,
) -> None:
    pool = await asyncpg.create_pool(PG_DSN, min_size=1, max_size=3)
    try:
        one = PostgresAdapter(pool=pool, device_key=new_key(), schema=client_schema)
        two = PostgresAdapter(pool=pool, device_key=new_key(), schema=client_schema)
        async with one, two:
            first, second = make_session(title="one"), make_session(title="two")
            await asyncio.gather(commit(one, first), commit(two, second))
            assert await one.list_sessions() == [first]
            assert await two.list_sessions() == [second]
            await one.close()
            assert await two.get_session(second.id) == second
            with pytest.raises(InvalidState):
                await one.get_session(first.id)
        assert await pool.fetchval("SELECT 1") == 1  # still the caller's to close
        async with PostgresAdapter(pool=pool, device_key=one.device_key, schema=client_schema):
            pass
        async with one:  # re-opened on the shared pool, with its data
            assert await one.list_sessions() == [first]
    finally:
        await pool.close()


async def test_a_device_waits_for_its_own_writer_only(client_schema: str) -> None:
    """While one adapter holds device K's lock, a second adapter of K (another pool, as
    another process) waits on it in PostgreSQL; an adapter of another device does not."""
    key = new_key()
    async with (
        adapter(client_schema, key, application_name="pleach-hold-a") as a,
        adapter(client_schema, key, application_name="pleach-wait-b") as b,
        adapter(client_schema, application_name="pleach-other-c") as c,
    ):
        async with holding(a) as (holder, held):
            blocked = asyncio.create_task(commit(b, make_session()))

            async def b_waits() -> bool:
                return await lock_waiters("pleach-wait-b") == 1

            await wait_until(b_waits, "b to wait on the device lock")
            # Another device writes and reads meanwhile.
            assert (await commit(c, make_session())).client_seqs == [1]
            assert not blocked.done()
            holder.release.set()
            assert (await held).client_seqs == []
        assert (await blocked).client_seqs == [1]
        assert await b.get_meta("held") == "yes"
        assert await lock_waiters("pleach-wait-b") == 0


async def test_a_writer_past_lock_timeout_gets_a_retryable_error(client_schema: str) -> None:
    key = new_key()
    session = make_session()
    async with (
        adapter(client_schema, key) as a,
        adapter(client_schema, key, lock_timeout_ms=50) as b,
    ):
        async with holding(a) as (_, held):
            with pytest.raises(StorageError, match="lock timeout") as info:
                await commit(b, session)
            assert info.value.retryable is True
            assert await b.outbox_count() == 0  # reads do not wait
        assert (await held).client_seqs == []
        assert (await commit(b, session)).client_seqs == [1]


async def test_two_pools_writing_one_device_lose_nothing(client_schema: str) -> None:
    """Two adapters of one device key on two pools (two processes, as far as PostgreSQL
    knows) commit and read-modify-write at once: every record and every increment lands, and
    the outbox numbers stay distinct and gap-free."""
    key = new_key()
    async with adapter(client_schema, key) as a, adapter(client_schema, key) as b:
        await a.set_meta("n", "0")

        async def bump(tx: TxReader) -> WriteBatch:
            n = int(await tx.get_meta("n") or 0)
            return WriteBatch(meta={"n": str(n + 1)})

        written: dict[str, list[Any]] = {"a": [], "b": []}

        async def writer(store: PostgresAdapter, label: str) -> list[int]:
            seqs: list[int] = []
            for _ in range(25):
                session = make_session(title=label)
                message = make_message(session_id=session.id)
                written[label] += [session, message]
                seqs += (await commit(store, session, message)).client_seqs
                await store.transact(bump)
            return seqs

        seqs_a, seqs_b = await asyncio.gather(writer(a, "a"), writer(b, "b"))
        assert sorted(seqs_a + seqs_b) == list(range(1, 101))
        assert await a.get_meta("n") == await b.get_meta("n") == "50"
        for record in written["a"] + written["b"]:
            assert await read_back(b, record) == record
        pending = await a.outbox_pending(limit=1000)
        assert [e.client_seq for e in pending] == list(range(1, 101))
        assert {e.record.id for e in pending} == {r.id for r in written["a"] + written["b"]}
        assert await a.last_client_seq() == await b.last_client_seq() == 100


async def test_a_cancelled_transaction_rolls_back_and_frees_the_device(
    client_schema: str,
) -> None:
    key = new_key()
    async with (
        adapter(client_schema, key) as a,
        adapter(client_schema, key, lock_timeout_ms=2000) as b,
    ):
        async with holding(a) as (_, held):
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
        assert (await commit(b, make_session())).client_seqs == [1]
        assert await b.get_meta("held") is None
        assert (await commit(a, make_session())).client_seqs == [2]


# -- failures ------------------------------------------------------------------------------------


async def test_failure_mid_transaction_rolls_everything_back(store: PostgresAdapter) -> None:
    session, message = make_session(), make_message()
    # Encodes fine (msgpack uint64) but does not fit a bigint: fails at the events insert,
    # after the session and message rows were written inside the transaction.
    bad = make_event(sequence_number=2**63)
    with pytest.raises(StorageError, match="out of int64 range") as info:
        await commit(store, session, message, bad, meta={"cursor": "1"})
    assert info.value.retryable is False
    assert await store.get_session(session.id) is None
    assert await store.get_messages([message.id]) == []
    assert await store.get_meta("cursor") is None
    assert await store.outbox_count() == 0
    assert (await commit(store, session)).client_seqs == [1]


async def test_constraint_violation_is_a_storage_error(store: PostgresAdapter) -> None:
    session = make_session()
    with pytest.raises(StorageError, match="not-null") as info:
        await commit(store, session, make_message(session_id=None))
    assert info.value.retryable is False
    assert await store.get_session(session.id) is None


async def test_corrupt_rows_raise_storage_error_naming_table_and_id(
    store: PostgresAdapter,
) -> None:
    session, message = make_session(), make_message()
    await commit(store, session, message)
    await store.outbox_dead_letter(2, 3007, "invalid")
    s, key = store.schema, store.device_key
    async with admin() as conn:
        await conn.execute(
            f"UPDATE {s}.messages SET body = (SELECT body FROM {s}.sessions "
            "WHERE device = $1 LIMIT 1) WHERE device = $1 AND id = $2",
            key,
            message.id,
        )
        await conn.execute(f"UPDATE {s}.sessions SET body = '\\xc1ff00' WHERE device = $1", key)
        await conn.execute(f"UPDATE {s}.dead_letters SET body = 'text' WHERE device = $1", key)
    with pytest.raises(StorageError, match=rf"corrupt row in sessions \(id '{session.id}'\)"):
        await store.get_session(session.id)
    with pytest.raises(StorageError, match="sessions"):
        await store.list_sessions()
    with pytest.raises(StorageError, match=rf"messages \(id '{message.id}'\)"):
        await store.get_messages([message.id])
    with pytest.raises(StorageError, match=r"outbox \(id 1\)"):
        await store.outbox_pending()  # refers to the corrupt session row
    with pytest.raises(StorageError, match=r"dead_letters \(id 2\)"):
        await store.dead_letters()


async def test_unreachable_database_is_a_retryable_error_and_leaves_nothing_open() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = PostgresAdapter(
        f"postgresql://postgres@127.0.0.1:{port}/test", device_key="d", connect_timeout=2
    )
    with pytest.raises(StorageError, match=rf"open 127.0.0.1:{port}/test failed") as info:
        await store.open()
    assert info.value.retryable is True
    with pytest.raises(InvalidState):
        await store.get_meta("cursor")


async def kill_backends(application_name: str) -> None:
    """Terminate every session of ``application_name`` and wait until those are gone
    (``pg_terminate_backend`` only signals: a backend may still run one more statement)."""
    async with admin() as conn:
        pids = [
            int(row[0])
            for row in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1", application_name
            )
        ]
        assert pids
        for pid in pids:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)

    async def gone() -> bool:
        async with admin() as conn:
            left = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", pids
            )
        return bool(left == 0)

    await wait_until(gone, f"the terminated sessions of {application_name} to end")


async def test_connections_killed_under_the_store_are_replaced(client_schema: str) -> None:
    session = make_session()
    async with adapter(client_schema, application_name="pleach-killed") as store:
        await commit(store, session)
        await kill_backends("pleach-killed")
        assert await store.get_session(session.id) == session
        await kill_backends("pleach-killed")
        assert (await commit(store, make_session())).client_seqs == [2]
        assert await store.outbox_count() == 2


async def test_store_dropped_while_open_warns(client_schema: str) -> None:
    store = adapter(client_schema)
    await store.open()
    pool = store._pool
    with pytest.warns(ResourceWarning, match="unclosed"):
        del store
        gc.collect()
    await pool.close()


async def test_close_waits_for_the_commit_in_progress(client_schema: str) -> None:
    key = new_key()
    store = adapter(client_schema, key)
    await store.open()
    session = make_session()
    receipt, _ = await asyncio.gather(commit(store, session), store.close())
    assert receipt.client_seqs == [1]
    async with adapter(client_schema, key) as again:
        assert await again.get_session(session.id) == session
        assert await again.outbox_count() == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PostgresAdapter(device_key="d")
    with pytest.raises(ValueError, match="device_key"):
        PostgresAdapter(PG_DSN, device_key="")
    with pytest.raises(ValueError, match="device_key"):
        PostgresAdapter(PG_DSN, device_key="x" * 201)
    with pytest.raises(ValueError, match="schema"):
        PostgresAdapter(PG_DSN, device_key="d", schema="Robert'); DROP TABLE x;--")
    with pytest.raises(ValueError, match="timeouts"):
        PostgresAdapter(PG_DSN, device_key="d", lock_timeout_ms=-1)


# -- migrations ----------------------------------------------------------------------------------


async def tables_of(schema: str) -> set[str]:
    async with admin() as conn:
        rows = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1", schema
        )
    return {str(row[0]) for row in rows}


async def test_a_fresh_schema_migrates_once_under_concurrent_opens(schema: str) -> None:
    stores = [adapter(schema) for _ in range(4)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        migrated = sorted(store.migrated_from or 0 for store in stores)
        assert migrated == [0, SCHEMA_VERSION, SCHEMA_VERSION, SCHEMA_VERSION]
        assert await tables_of(schema) == TABLES
        async with admin() as conn:
            versions = await conn.fetch(f"SELECT version FROM {schema}.schema_migrations")
        assert [row[0] for row in versions] == list(range(1, SCHEMA_VERSION + 1))
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    async with adapter(schema) as again:  # re-opening is a no-op
        assert again.migrated_from == SCHEMA_VERSION
    assert await tables_of(schema) == TABLES


async def test_a_newer_schema_is_refused_untouched(schema: str) -> None:
    async with admin() as conn:
        await conn.execute(f"CREATE SCHEMA {schema}")
        await conn.execute(f"CREATE TABLE {schema}.schema_migrations (version integer)")
        await conn.execute(f"INSERT INTO {schema}.schema_migrations VALUES (99)")
    store = adapter(schema)
    with pytest.raises(StorageError, match=r"version 99, newer than .* upgrade pleach"):
        await store.open()
    assert await tables_of(schema) == {"schema_migrations"}


async def test_a_server_schema_is_refused(schema: str) -> None:
    await migrate_server_schema(PG_DSN, schema)
    before = await tables_of(schema)
    with pytest.raises(StorageError, match="pleach server store"):
        await adapter(schema).open()
    assert await tables_of(schema) == before


# -- query plans ---------------------------------------------------------------------------------


async def fill(schema: str, devices: int, idle: int) -> None:
    """``devices`` devices with sessions, messages, events, audit rows and an outbox each,
    and ``idle`` devices registered with nothing stored yet."""
    s = schema
    async with admin() as conn:
        await conn.execute(
            f"INSERT INTO {s}.devices (device) SELECT 'dev-' || d FROM generate_series(1, $1) d "
            "UNION ALL SELECT 'idle-' || d FROM generate_series(1, $2) d",
            devices,
            idle,
        )
        for table, extra_cols, extra_vals, per in (
            ("sessions", "updated_at, deleted", "lpad(n::text, 8, '0'), n % 5 = 0", 10),
            ("messages", "session_id, hlc", "'s-' || n % 10, lpad(n::text, 8, '0')", 40),
            ("checkpoints", "session_id, hlc", "'s-' || n % 10, lpad(n::text, 8, '0')", 20),
            (
                "events",
                "session_id, sequence_number, hlc",
                "'s-' || n % 10, n, lpad(n::text, 8, '0')",
                40,
            ),
            (
                "audit",
                "client_id, session_id, sequence_number, subject_key",
                "'c-' || n % 2, 's-' || n % 10, n, CASE WHEN n % 3 = 0 THEN 'u' END",
                40,
            ),
            (
                "artifact_updates",
                "artifact_id, session_id, hlc",
                "'a-' || n % 4, 's-' || n % 10, lpad(n::text, 8, '0')",
                20,
            ),
        ):
            await conn.execute(
                f"INSERT INTO {s}.{table} (device, id, {extra_cols}, body) "
                f"SELECT 'dev-' || d, 'id-' || n, {extra_vals}, '\\x00'::bytea "
                "FROM generate_series(1, $1) d, generate_series(1, $2) n",
                devices,
                per,
            )
        await conn.execute(
            f"INSERT INTO {s}.outbox (device, client_seq, record_id, kind, created_at) "
            "SELECT 'dev-' || d, n, 'id-' || n, 'Message', 0 "
            "FROM generate_series(1, $1) d, generate_series(1, 40) n",
            devices,
        )
        await conn.execute(
            f"INSERT INTO {s}.dead_letters "
            "(device, client_seq, record_id, kind, body, code, message, attempts, failed_at) "
            "SELECT 'dev-' || d, n, 'id-' || n, 'Message', '\\x00', 3007, 'x', 1, 0 "
            "FROM generate_series(1, $1) d, generate_series(41, 45) n",
            devices,
        )
        await conn.execute(
            f"INSERT INTO {s}.sync_state (device, key, value) "
            "SELECT 'dev-' || d, k, 'v' FROM generate_series(1, $1) d, "
            "unnest(ARRAY['cursor', 'hlc', 'client_id', 'generation']) k",
            devices,
        )
        await conn.execute(f"ANALYZE {s}.devices, {s}.sessions, {s}.messages, {s}.checkpoints")
        await conn.execute(f"ANALYZE {s}.events, {s}.audit, {s}.artifact_updates, {s}.outbox")
        await conn.execute(f"ANALYZE {s}.dead_letters, {s}.sync_state")


# Arguments after the device key, by the number of parameters a statement takes.
PLAN_ARGS: dict[str, tuple[Any, ...]] = {
    "get_session": ("id-3",),
    "list_sessions": (),
    "list_sessions_all": (),
    "get_messages": (["id-3", "id-9"],),
    "missing_messages": (["id-3", "nope"],),
    "get_checkpoint": ("id-3",),
    "list_checkpoints": ("s-3",),
    "child_checkpoints": ("s-3", "id-2"),
    "get_event": ("id-3",),
    "event_head": ("s-3",),
    "hydration_key": ("s-3", 2**63 - 1),
    "kept_hydration": ("s-3",),
    "list_events": ("s-3", 0, 5),
    "list_events_of_types": ("s-3", 0, ["turn.complete"]),
    "list_audit": (),
    "list_audit_session": ("s-3",),
    "list_audit_client": ("c-1",),
    "list_audit_both": ("s-3", "c-1"),
    "audit_subject": ("u",),
    "list_artifact_updates": ("a-1",),
    "get_meta": ("cursor",),
    "outbox_pending": (500, 0),
    "outbox_count": (),
    "session_queued": ("id-3",),
    "audit_rows": (["id-1", "id-2"],),
    "dead_letters": (),
    "dead_letter_count": (),
    "last_seq": (),
    "lock_device": (),
    # the writes
    "add_device": (),
    "set_last_seq": (5,),
    "put_sessions": (["id-1"], ["x"], [False], [b"\x00"]),
    "put_messages": (["id-1"], ["s-1"], ["h"], [b"\x00"]),
    "put_checkpoints": (["id-1"], ["s-1"], ["h"], [""], [b"\x00"]),
    "put_events": (["id-1"], ["s-1"], [1], ["h"], ["turn.complete"], [b"\x00"]),
    "put_audit": (["id-1"], ["c-1"], ["s-1"], [1], [None], [b"\x00"]),
    "put_artifacts": (["id-1"], ["a-1"], ["s-1"], ["h"], [b"\x00"]),
    "put_meta": (["cursor"], ["9"]),
    "keep_hydration": ("s-1", 3, 5, "h", 1, b"\x00"),
    "enqueue": (41, 0.0, [41], ["id-1"], ["Message"]),
    "rechain_audit": (["id-1"], ["c-2"], [1], [b"\x00"]),
    "event_bodies": (["id-1", "id-2"],),
    "put_event_bodies": (["id-1"], [b"\x00"]),
    "purge_sessions": (["s-1"], ["id-2"]),
    "purge_checkpoints": (["s-1"],),
    "renumber_outbox": (),
    "redact_audit": (["id-1"], [b"\x00"]),
    "outbox_remove": ([1, 2],),
    "outbox_mark_attempt": ([1], 3009, "x"),
    "dead_letter": (1, 3007, "x", 0.0),
    "retry_dead_letter": (46, 41, 0.0),
    "discard_dead_letter": (41,),
}


async def test_every_per_device_read_is_an_index_scan(schema: str) -> None:
    """With 300 devices holding data and 5,000 more registered in one schema, no statement
    of one device, read or write, scans a whole table (on near-empty tables the planner would
    rightly read the one page instead). EXPLAIN plans a statement without running it."""
    async with adapter(schema):
        pass
    await fill(schema, 300, 5000)
    sql = vars(pg_module._Sql(schema))
    assert set(PLAN_ARGS) == set(sql)  # every statement is checked
    problems: dict[str, str] = {}
    plans: dict[str, str] = {}
    async with admin() as conn:
        for name, args in PLAN_ARGS.items():
            statements = sql[name] if isinstance(sql[name], tuple) else (sql[name],)
            for i, statement in enumerate(statements):
                lines = await conn.fetch("EXPLAIN " + statement, "dev-7", *args)
                plan = "\n".join(str(line[0]) for line in lines)
                plans[f"{name}[{i}]"] = plan
                if "Seq Scan" in plan:
                    problems[f"{name}[{i}]"] = plan
    assert problems == {}
    if os.environ.get("PLEACH_SHOW_PLANS"):
        print(*(f"-- {name}\n{plan}" for name, plan in plans.items()), sep="\n")


# -- the runtime on PostgreSQL ---------------------------------------------------------------------


def calculator_script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            ScriptedReply(
                text="Let me work that out.", tool_calls=[("calculator", {"expression": "6*7"})]
            ),
            ScriptedReply(text="6 times 7 is 42."),
        ]
    )


async def user_texts(rt: SessionRuntime, session_id: str) -> list[str]:
    return [
        block["text"]
        for m in await rt.sessions.messages(session_id)
        if m.role == "user"
        for block in m.content
        if block.get("type") == "text"
    ]


async def test_a_runtime_turn_on_postgres_end_to_end(client_schema: str) -> None:
    key = new_key("alice")
    async with SessionRuntime(
        adapter(client_schema, key), calculator_script(), user_id="alice", org_id="acme"
    ) as rt:
        session = await rt.create_session(title="maths")
        events = [e async for e in rt.execute_message(session.id, "What is 6 times 7?")]
        types = [e.type for e in events]
        assert "tool.completed" in types and types[-1] == "turn.complete"
        completed = next(e for e in events if e.type == "tool.completed")
        assert "42" in str(completed.output)
        messages = await rt.sessions.messages(session.id)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert (await rt.events.verify_chain(session.id)).ok
        assert (await rt.audit.verify_chain()).ok
        status = await rt.sync.status()
        assert status.pending == await rt.store.outbox_count() > 0
        client_id = rt.client_id
    # Another runtime on the same device key, picked by URL: the same device, its session.
    url = f"{PG_DSN}?device={key}&schema={client_schema}"
    async with SessionRuntime(url, ScriptedProvider(), user_id="alice", org_id="acme") as again:
        assert isinstance(again.store, PostgresAdapter)
        assert again.client_id == client_id
        resumed = await again.resume_session(session.id)
        assert resumed.record.state.message_ids == [m.id for m in messages]
        async for _ in again.execute_message(session.id, "thanks"):
            pass
        assert await user_texts(again, session.id) == ["What is 6 times 7?", "thanks"]
        assert (await again.events.verify_chain(session.id)).ok
    # A runtime of another device key on the same database starts empty.
    async with SessionRuntime(adapter(client_schema), ScriptedProvider(), user_id="bob") as bob:
        assert await bob.sessions.list() == []
        assert bob.client_id != client_id


async def test_two_runtimes_of_one_device_interleave_turns_without_losing_any(
    client_schema: str,
) -> None:
    key = new_key()
    async with (
        SessionRuntime(adapter(client_schema, key), ScriptedProvider()) as a,
        SessionRuntime(adapter(client_schema, key), ScriptedProvider()) as b,
    ):
        assert a.client_id == b.client_id  # one device key, one device
        shared = await a.create_session(title="shared")
        await asyncio.gather(
            *(turn(a, shared.id, f"a{i}") for i in range(4)),
            *(turn(b, shared.id, f"b{i}") for i in range(4)),
        )
        expected = sorted([f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)])
        assert sorted(await user_texts(a, shared.id)) == expected
        assert sorted(await user_texts(b, shared.id)) == expected
        for rt in (a, b):
            assert (await rt.events.verify_chain(shared.id)).ok
            assert (await rt.audit.verify_chain()).ok


async def turn(rt: SessionRuntime, session_id: str, text: str) -> None:
    async for _ in rt.execute_message(session_id, text):
        pass


# -- picking a store by URL or environment ---------------------------------------------------------


def test_from_url_picks_the_adapter(tmp_path: Path) -> None:
    assert isinstance(from_url("memory:"), MemoryAdapter)
    relative = from_url("sqlite:///device.db")
    assert isinstance(relative, SQLiteAdapter) and relative.path == "device.db"
    absolute = from_url(f"sqlite:///{tmp_path}/device.db")
    assert isinstance(absolute, SQLiteAdapter) and absolute.path == f"{tmp_path}/device.db"
    plain = from_url(str(tmp_path / "plain.db"))
    assert isinstance(plain, SQLiteAdapter) and plain.path == str(tmp_path / "plain.db")
    store = from_url(
        "postgresql://u:pw@db.internal:6543/app?device=alice&sslmode=disable&schema=tenants"
    )
    assert isinstance(store, PostgresAdapter)
    assert store.device_key == "alice" and store.schema == "tenants"
    assert store.dsn == "postgresql://u:pw@db.internal:6543/app?sslmode=disable"
    keyed = from_url("postgres://db/app", device_key="bob")
    assert isinstance(keyed, PostgresAdapter) and keyed.device_key == "bob"
    assert keyed.schema == "pleach_client"


def test_from_url_refuses_what_it_cannot_open() -> None:
    for url in ("", "mysql://db/app", "memory:x", "sqlite://host/x.db", "sqlite:"):
        with pytest.raises(ValueError, match="store URL"):
            from_url(url)
    with pytest.raises(ValueError, match="needs a device key"):
        from_url("postgresql://db/app")
    with pytest.raises(ValueError, match="device_key is 'b'"):
        from_url("postgresql://db/app?device=a", device_key="b")


def test_from_env_reads_pleach_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    assert isinstance(from_env(), MemoryAdapter)
    monkeypatch.setenv(STORE_ENV, f"sqlite:///{tmp_path}/env.db")
    picked = from_env()
    assert isinstance(picked, SQLiteAdapter) and picked.path == f"{tmp_path}/env.db"
    monkeypatch.setenv(STORE_ENV, "postgresql://db/app?device=carol")
    chosen = SessionRuntime()  # no store given: the environment picks it
    assert isinstance(chosen.store, PostgresAdapter) and chosen.store.device_key == "carol"


async def test_rows_written_before_schema_2_are_read_by_their_bodies(schema: str) -> None:
    """Schema 2 keeps a checkpoint's parent and an event's type beside the body, so resume
    reads the head's children and the events the fold counts only. Rows written before hold
    NULL there and must still be found: resume sees every turn, old and new, and the children
    of an old and a new checkpoint."""
    key = new_key("old")
    async with SessionRuntime(adapter(schema, key), ScriptedProvider()) as rt:
        session = await rt.create_session(title="before")
        for text in ("one", "two", "three"):
            async for _ in rt.execute_message(session.id, text):
                pass
        before = await rt.store.list_checkpoints(session.id)
    # The same rows as schema 1 wrote them: the columns gone, versions 2 and 3 not applied.
    async with admin() as conn:
        await conn.execute(f"ALTER TABLE {schema}.checkpoints DROP COLUMN parent_id")
        await conn.execute(f"ALTER TABLE {schema}.events DROP COLUMN type")
        await conn.execute(f"DROP TABLE {schema}.hydrations")
        await conn.execute(f"DELETE FROM {schema}.schema_migrations WHERE version >= 2")
    async with SessionRuntime(adapter(schema, key), ScriptedProvider()) as rt:
        assert isinstance(rt.store, PostgresAdapter) and rt.store.migrated_from == 1
        async for _ in rt.execute_message(session.id, "four"):
            pass
        async with admin() as conn:
            nulls = await conn.fetchval(
                f"SELECT count(*) FROM {schema}.events WHERE device = $1 AND type IS NULL", key
            )
            typed = await conn.fetchval(
                f"SELECT count(*) FROM {schema}.events WHERE device = $1 AND type IS NOT NULL",
                key,
            )
        assert nulls > 0 and typed > 0  # old rows and new ones side by side
        handle = await rt.sessions.resume(session.id)
        assert handle.hydrated["turns"] == 4
        after = await rt.store.list_checkpoints(session.id)
        old_parent, old_child = before[-2], before[-1]  # written before: parent_id NULL
        assert [c.id for c in await rt.store.child_checkpoints(session.id, old_parent.id)] == [
            old_child.id
        ]
        newest = after[-1]  # written after: parent_id kept
        assert newest.parent_id == old_child.id
        assert [c.id for c in await rt.store.child_checkpoints(session.id, old_child.id)] == [
            newest.id
        ]
        assert await rt.store.child_checkpoints(session.id, newest.id) == []
        tallied = await rt.store.event_payloads(session.id, {"turn.complete"})
        assert [t for t, _ in tallied] == ["turn.complete"] * 4
        tallies, whole = await rt.store.hydration_log(
            session.id, {"turn.complete"}, {"checkpoint.created"}
        )
        assert tallies == tallied
        assert whole == await rt.store.list_events(session.id, types={"checkpoint.created"})
        assert len(whole) == 4
