"""``python -m bench.bench_conversation [--quick] [--turns N]``: one long conversation.

The workload of docs/BENCHMARKS.md's storage and turn rows: one session of N turns (1,000 by
default), each a 200-byte user text and an 800-byte assistant reply (real prose, different
each turn: ``bench.peers.common``), a checkpoint per turn, one SQLite file. The floor,
measured in the same run: plain ``sqlite3`` (WAL, ``synchronous=NORMAL``) inserting the same
two messages per turn in one transaction.

Figures: file bytes after N turns, unsynced and after a full sync to a real server (device
file and the server's file; and the bytes of the same history on the PostgreSQL store, its
tables with their indexes, when PostgreSQL answers at ``PLEACH_TEST_PG_DSN``); the same when
the device stays connected and each turn syncs as it is written (what a device online does:
every turn pushes the session's new version); turn p50 over turns 51-150 and over the last
100; p99 over the last 100. Each beside its floor, as a ratio.

A turn is also set beside the floor of its own work (``OwnWork``): the provider's stream of
the same reply consumed by a bare loop, then plain ``sqlite3`` running the turn's own
statements (the rows and bytes its commit wrote, captured as it ran: messages, events,
checkpoint, audit row, session row, outbox rows and sync keys) on the same schema, in one
transaction, each floor turn run right after the turn it mirrors. What a turn costs beyond
that is the runtime's own work. The device file's bytes are also printed by table (SQLite's
``dbstat``), indexes with their table.

Each store's bytes are also given beyond what it weighs empty (``empty_bytes``: the schema
alone, made by the store itself, in the same run), beside the floor's beyond its own empty
file: what each turn of history costs, the fixed cost of a schema's tables and indexes (a
page or two each: 0.30 MB of PostgreSQL's, 0.17 MB of the device's file) taken out. Beside
the totals, not instead of them: the targets are the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.bench_local import Row, file_bytes, render
from bench.peers.common import assistant_text, user_text
from pleach_client.providers.base import ProviderRequest
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store import sqlite as sqlite_store
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant

CLIENT_ID = "bench-conversation-device"
SECRET = b"bench-conversation-secret"
TENANT = Tenant(org_id="default", user_id="anonymous")  # SessionRuntime's own defaults
PG_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def replies() -> ScriptedProvider:
    """A provider whose ``k``-th call replies turn ``k``'s assistant text (``assistant_text``)."""
    calls = itertools.count()
    return ScriptedProvider(default_reply=lambda _: ScriptedReply(text=assistant_text(next(calls))))


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


Statements = list[tuple[str, list[tuple[Any, ...]]]]


async def pleach_run(
    path: Path,
    n: int,
    capture: list[Statements] | None = None,
    after_turn: Callable[[int], Awaitable[None]] | None = None,
) -> list[float]:
    """``n`` turns through ``SessionRuntime`` on ``path``; each turn's seconds. ``capture``:
    also collect each turn's commit as the statements and rows it ran (``OwnWork``).
    ``after_turn(i)``: awaited after turn ``i``, outside its time (``OwnWork.turn`` of that
    turn's statements: the floor measured beside it, turn by turn)."""
    out: list[float] = []
    provider = replies()
    with _capturing(capture):
        async with SessionRuntime(SQLiteAdapter(path), provider, client_id=CLIENT_ID) as rt:
            session_id = (await rt.create_session(title="bench")).id
            if capture is not None:
                capture.clear()  # the session's creation is no turn
            for i in range(n):
                started = time.perf_counter()
                async for _ in rt.execute_message(session_id, user_text(i)):
                    pass
                out.append(time.perf_counter() - started)
                if after_turn is not None:
                    await after_turn(i)
    return out


class _Recorder:
    """A ``sqlite3.Connection`` stand-in for the store's batch writer: runs each statement
    on the real connection and keeps what ran."""

    def __init__(self, raw: sqlite3.Connection, into: Statements) -> None:
        self.raw, self.into = raw, into

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        self.into.append((sql, [tuple(params)]))
        return self.raw.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> sqlite3.Cursor:
        kept = [tuple(row) for row in rows]
        self.into.append((sql, kept))
        return self.raw.executemany(sql, kept)


@contextlib.contextmanager
def _capturing(capture: list[Statements] | None) -> Iterator[None]:
    """While inside, every batch the device's store writes is also kept in ``capture``."""
    if capture is None:
        yield
        return
    writer = sqlite_store._write_batch_now

    def recorded(raw: sqlite3.Connection, *args: Any) -> Any:
        capture.append([])
        return writer(_Recorder(raw, capture[-1]), *args)  # type: ignore[arg-type]

    sqlite_store._write_batch_now = recorded  # type: ignore[assignment]
    try:
        yield
    finally:
        sqlite_store._write_batch_now = writer  # type: ignore[assignment]


class OwnWork:
    """The floor of a turn's own work, a turn at a time: the provider's stream of the same
    reply consumed by a bare loop (the request as the turn sent it: the conversation so far),
    then the turn's captured statements run by plain ``sqlite3`` on a file of the device's
    schema, in one ``BEGIN IMMEDIATE`` transaction (WAL, ``synchronous=NORMAL``, as the
    store). ``turn(i, statements)`` runs turn ``i`` (turns go in order) and gives its seconds.

    ``_run`` runs each floor turn right after the runtime's turn it mirrors (``pleach_run``'s
    ``after_turn``), so that the two see the same moment of a shared machine: run one after
    the other, each 1,000 turns long, the ratio read 1.6x to 3.1x in four runs of one hour as
    the machine's load moved; turn by turn, 2.12-2.28x (early turns) and 2.31-2.36x (late) in
    three runs of that hour."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._provider = replies()
        self._messages: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, path: Path) -> OwnWork:
        async with SQLiteAdapter(path):  # the schema, created by the store itself
            pass
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA synchronous = NORMAL")
        return cls(conn)

    def close(self) -> None:
        self._conn.close()

    async def turn(self, i: int, statements: Statements) -> float:
        conn, messages = self._conn, self._messages
        messages.append({"role": "user", "content": [{"type": "text", "text": user_text(i)}]})
        request = ProviderRequest(model="bench", messages=list(messages))
        started = time.perf_counter()
        async for _ in self._provider.stream(request):
            pass
        conn.execute("BEGIN IMMEDIATE")
        for sql, rows in statements:
            if sql.startswith("SELECT"):  # (the outbox's last number)
                for params in rows:
                    conn.execute(sql, params).fetchall()
            elif sql != "COMMIT":
                conn.executemany(sql, rows)
        conn.execute("COMMIT")
        seconds = time.perf_counter() - started
        messages.append(
            {"role": "assistant", "content": [{"type": "text", "text": assistant_text(i)}]}
        )
        return seconds


async def own_rows_run(path: Path, turns: list[Statements]) -> list[float]:
    """``OwnWork`` of each of ``turns`` in order, on a new file at ``path``: each one's
    seconds (``bench_instructions`` counts the floor's instructions so, in a run of its own)."""
    floor = await OwnWork.open(path)
    try:
        return [await floor.turn(i, statements) for i, statements in enumerate(turns)]
    finally:
        floor.close()


def bytes_by_table(path: Path) -> str:
    """The file's bytes per table, its indexes counted with it (SQLite's ``dbstat``)."""
    conn = sqlite3.connect(path)
    try:
        tables = dict(
            conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE name IS NOT NULL")
        )
        sizes: dict[str, int] = {}
        for name, size in conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
            table = tables.get(name, name)
            sizes[table] = sizes.get(table, 0) + int(size)
    except sqlite3.OperationalError as exc:  # a SQLite built without dbstat
        return f"(bytes by table: {exc})"
    finally:
        conn.close()
    ordered = sorted(sizes.items(), key=lambda kv: -kv[1])
    return "bytes by table: " + ", ".join(f"{t} {b / 1e6:.2f} MB" for t, b in ordered if b > 8192)


def _closed_bytes(path: Path) -> int:
    """The bytes of the SQLite file at ``path`` once checkpointed and closed, as the floor's
    are measured (``raw_run`` closes its file): a connection left open keeps a WAL index
    (``-shm``, 32 KB) beside the file, which ``file_bytes`` would count."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return file_bytes(path)


async def synced_bytes(device: Path, server_path: Path) -> tuple[int, int]:
    """Sync the device file at ``device`` to a real server on ``server_path`` (``sync_once``:
    everything pushed, its events marked canonical from the acks); the device file's bytes
    and the server file's bytes then, each with its WAL (both checkpointed first)."""
    async with (
        SQLiteServerStore(server_path) as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as server,
    ):
        provider = replies()
        async with SessionRuntime(SQLiteAdapter(device), provider, client_id=CLIENT_ID) as rt:
            receipt = await rt.sync.sync_once(server.url, issue_token(SECRET, TENANT, 3600), 600)
            if receipt.pending_after:
                raise RuntimeError(f"the sync left {receipt.pending_after} change(s) queued")
    return _closed_bytes(device), _closed_bytes(server_path)


async def empty_bytes(root: Path, dsn: str | None) -> tuple[int, int, int, int | None]:
    """What each store weighs with nothing in it, made by the store itself: the device's
    file, the floor's (its table alone), the SQLite server's file, and the PostgreSQL store's
    schema (None when PostgreSQL does not answer at ``dsn``, or ``dsn`` is None)."""
    async with SQLiteAdapter(root / "empty-device.db"):
        pass
    raw_run(root / "empty-raw.db", 0)
    async with SQLiteServerStore(root / "empty-server.db"):
        pass
    pg = None if dsn is None else await postgres_bytes(None, dsn)
    return (
        _closed_bytes(root / "empty-device.db"),
        file_bytes(root / "empty-raw.db"),
        _closed_bytes(root / "empty-server.db"),
        pg,
    )


async def postgres_bytes(device: Path | None, dsn: str) -> int | None:
    """Sync the device file at ``device`` to a real server on the PostgreSQL store, in a
    schema of its own (dropped after); the bytes of that schema's tables then, with their
    indexes and TOAST (``pg_total_relation_size``). None, and why printed, when PostgreSQL
    does not answer at ``dsn``. ``device`` None: the schema's bytes as the store makes it,
    with nothing synced."""
    import asyncpg  # type: ignore[import-untyped]

    from pleach_server.store.postgres import PostgresServerStore

    schema = f"bench_conv_{uuid.uuid4().hex[:12]}"
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"- PostgreSQL server bytes skipped: {dsn} does not answer ({exc})")
        return None
    try:
        async with PostgresServerStore(dsn, schema=schema) as store:
            if device is not None:  # (None: the schema as the store makes it, nothing synced)
                async with (
                    SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as server,
                    SessionRuntime(SQLiteAdapter(device), replies(), client_id=CLIENT_ID) as rt,
                ):
                    token = issue_token(SECRET, TENANT, 3600)
                    receipt = await rt.sync.sync_once(server.url, token, 600)
                    if receipt.pending_after:
                        raise RuntimeError(
                            f"the sync left {receipt.pending_after} change(s) queued"
                        )
        size = await conn.fetchval(
            "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class AS c "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relkind = 'r'",
            schema,
        )
        return int(size)
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


async def live_synced_bytes(device: Path, server_path: Path, n: int) -> tuple[int, int]:
    """``n`` turns on a device connected to a real server, each synced before the next; the
    device file's bytes and the server file's bytes then (both checkpointed first)."""
    async with (
        SQLiteServerStore(server_path) as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as server,
    ):
        provider = replies()
        async with SessionRuntime(SQLiteAdapter(device), provider, client_id=CLIENT_ID) as rt:
            await rt.sync.connect(server.url, issue_token(SECRET, TENANT, 3600))
            session_id = (await rt.create_session(title="bench")).id
            for i in range(n):
                async for _ in rt.execute_message(session_id, user_text(i)):
                    pass
                if not await rt.sync.wait_until_synced(60):
                    raise RuntimeError(f"turn {i} did not sync within 60 s")
            await rt.sync.disconnect()
    return _closed_bytes(device), _closed_bytes(server_path)


def raw_run(path: Path, n: int) -> list[float]:
    """The floor: the same two messages per turn, plain ``sqlite3``, one transaction each."""
    conn = sqlite3.connect(path, isolation_level=None)
    out: list[float] = []
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(
            "CREATE TABLE messages (id TEXT PRIMARY KEY, session_id TEXT NOT NULL, "
            "role TEXT NOT NULL, content TEXT NOT NULL)"
        )
        session_id = str(uuid.uuid4())
        for i in range(n):
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO messages VALUES (?, ?, ?, ?)",
                [
                    (str(uuid.uuid4()), session_id, "user", user_text(i)),
                    (str(uuid.uuid4()), session_id, "assistant", assistant_text(i)),
                ],
            )
            conn.execute("COMMIT")
            out.append(time.perf_counter() - started)
    finally:
        conn.close()
    return out


def beyond_empty(floor: int, *stores: tuple[str, int]) -> list[Row]:
    """Rows of each store's bytes beyond its empty schema, beside the floor's beyond its
    empty file (``floor``)."""
    return [
        Row(f"  {name}, beyond its empty schema", value, "bytes", "raw, beyond empty", floor)
        for name, value in stores
    ]


def windows(seconds: Sequence[float]) -> tuple[float, float, float]:
    """p50 of turns 51-150, p50 and p99 of the last 100 turns."""
    early = seconds[50:150] or seconds
    late = seconds[-100:]
    return statistics.median(early), statistics.median(late), percentile(late, 0.99)


async def _run(n: int) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="pleach-conv-") as tmp:
        root = Path(tmp)
        await pleach_run(root / "warm.db", 5)
        raw_run(root / "warm-raw.db", 5)
        statements: list[Statements] = []
        own: list[float] = []
        floor = await OwnWork.open(root / "own-rows.db")

        async def beside(i: int) -> None:
            if len(statements) != i + 1:  # (the floor replays one commit a turn)
                raise RuntimeError(f"{len(statements)} commits captured after {i + 1} turns")
            own.append(await floor.turn(i, statements[i]))

        try:
            ours = await pleach_run(root / "device.db", n, statements, beside)
        finally:
            floor.close()
        raw = raw_run(root / "raw.db", n)
        ours_bytes = file_bytes(root / "device.db")
        raw_bytes = file_bytes(root / "raw.db")
        # (closed: a connection left open keeps the file from being cut to its pages as the
        # store's last connection closes, which the full sync's figure would count)
        with contextlib.closing(sqlite3.connect(root / "device.db")) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        print(bytes_by_table(root / "device.db"))
        shutil.copy(root / "device.db", root / "device-pg.db")  # unsynced, as the other
        device_synced, server_bytes = await synced_bytes(root / "device.db", root / "server.db")
        pg_bytes = await postgres_bytes(root / "device-pg.db", PG_DSN)
        live_device, live_server = await live_synced_bytes(
            root / "live-device.db", root / "live-server.db", n
        )
        empty_device, empty_raw, empty_server, empty_pg = await empty_bytes(
            root, None if pg_bytes is None else PG_DSN
        )
    o_early, o_late, o_p99 = windows(ours)
    r_early, r_late, r_p99 = windows(raw)
    w_early, w_late, _ = windows(own)
    last = f"{n - 99}-{n}"
    own_work = "stream + its rows raw"
    return [
        Row(f"bytes after {n} turns (unsynced)", ours_bytes, "bytes", "raw sqlite3", raw_bytes),
        Row("  device bytes after a full sync", device_synced, "bytes", "raw sqlite3", raw_bytes),
        Row("  server bytes for the same history", server_bytes, "bytes", "raw sqlite3", raw_bytes),
        *(
            []
            if pg_bytes is None
            else [Row("  the same, PostgreSQL store", pg_bytes, "bytes", "raw sqlite3", raw_bytes)]
        ),
        Row("  device bytes, synced turn by turn", live_device, "bytes", "raw sqlite3", raw_bytes),
        Row("  server bytes, synced turn by turn", live_server, "bytes", "raw sqlite3", raw_bytes),
        *beyond_empty(
            raw_bytes - empty_raw,
            ("device, unsynced", ours_bytes - empty_device),
            ("device, synced", device_synced - empty_device),
            ("SQLite server", server_bytes - empty_server),
            *(
                []
                if pg_bytes is None or empty_pg is None
                else [("PostgreSQL store", pg_bytes - empty_pg)]
            ),
        ),
        Row("turn p50, turns 51-150", o_early * 1e6, "us", "raw sqlite3", r_early * 1e6),
        Row(f"turn p50, turns {last}", o_late * 1e6, "us", "raw sqlite3", r_late * 1e6),
        Row(f"turn p50, turns {last} vs 51-150", o_late * 1e6, "us", "turns 51-150", o_early * 1e6),
        # The same growth beside its own work's over the same turns: a machine whose load moves
        # between the two windows moves both (one run read 1.62x here and 1.63x for the floor).
        Row(
            f"  turns {last} vs 51-150, beside its own work's",
            o_late / o_early,
            "x",
            "its own work's late vs early",
            w_late / w_early,
        ),
        Row(
            "turn p50, turns 51-150, vs its own work", o_early * 1e6, "us", own_work, w_early * 1e6
        ),
        Row(f"turn p50, turns {last}, vs its own work", o_late * 1e6, "us", own_work, w_late * 1e6),
        Row(f"turn p99, turns {last}", o_p99 * 1e6, "us", f"p50 turns {last}", o_late * 1e6),
        Row(f"raw turn p99, turns {last}", r_p99 * 1e6, "us", "raw p50", r_late * 1e6),
    ]


def run(quick: bool = False, turns: int | None = None) -> list[Row]:
    n = turns or (300 if quick else 1000)
    started = time.perf_counter()
    rows = asyncio.run(_run(n))
    print(render(f"bench_conversation: one conversation of {n} turns", rows))
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="300 turns instead of 1,000")
    parser.add_argument("--turns", type=int, default=None, help="number of turns")
    args = parser.parse_args(argv)
    run(args.quick, args.turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
