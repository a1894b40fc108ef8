"""Catch-up and resume: a new device pulling a long history, a fresh runtime resuming a session.

- ``catch-up``: the server holds H changes (100,000; 10,000 with ``--quick``) of one user. They
  are real device records: one device runs turns offline (``ScriptedProvider``, one session of
  T turns plus sessions of 25 turns until H is reached), and its outbox goes to the server's
  ``SQLiteServerStore.push`` in batches of 1,000 changes, made as the device's flush makes a
  ``Push`` (``_push_of``: a session row once, at its last number, after its messages) (the
  call the server makes for a ``Push`` frame; only the WebSocket hop is skipped, to fill the
  server fast). Then a new device
  of the same user runs ``sync.sync_once`` against a real ``SyncServer`` on loopback: it pulls
  and applies the whole feed. Baseline: the very rows that device committed (captured), bulk
  inserted with plain ``sqlite3`` into a fresh file of the same schema, ``executemany`` per
  table in ONE transaction (WAL, ``synchronous=NORMAL``). The same catch-up is then run again
  by three more new devices against a ``pleach-server`` process on the same server file, as a
  user meets it (the server's work no longer shares this process's core and GIL), each
  followed by the floor into a new file; that row and its floor are the medians of the three
  (one floor alone varied by a fifth from run to run).
- ``resume``: a fresh ``SessionRuntime`` opened on the caught-up device's file resumes the
  long session (``sessions.resume``: row, checkpoints, the log's fold, hydration) and reads its
  transcript (``sessions.messages``). Baseline: plain ``sqlite3`` opening the file and
  ``SELECT``-ing the same rows (session row, checkpoints, events, messages), no decoding. The
  pull itself folded the long session's log and kept the fold (a row of the file: a pull
  does so for each log it grew by a thousand events or more, ``SyncFacet._keep_folds``, in
  the catch-up's time), so every resume finds the log unchanged and reads that row
  (``pleach_client.hydration``). The figure is their median. The first resume after a pull
  is a row of its own: each device that caught up apart resumes the session once, the
  first on its file, beside the floor's read of that file, and the row is the median of the
  three (one sample a device: one device alone read 28-86 ms from run to run). So is the
  median of three resumes each in a new Python process (the imports before not counted), as
  an app opening a session meets it.

Run ``python -m bench.bench_catchup [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import bench_push
from bench.bench_local import RecordingAdapter, Row, raw_rows, report
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import WriteBatch
from pleach_client.store.sqlite import _PUT_META, SQLiteAdapter, create_schema
from pleach_client.sync import _push_of
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.clock import HybridClock
from shared.ids import uuid7

__all__ = ["main", "run"]

SECRET = b"bench-secret-for-catchup"
REPLY = ScriptedReply(text="Done: three short bullets for tomorrow.")
TEXT = "Plan tomorrow in three short bullets, please."
SMALL_SESSION_TURNS = 25
PUSH_BATCH = 1000
TIMEOUT = 600.0


async def fill(
    path: Path, tenant: Tenant, store: SQLiteServerStore, history: int, long_turns: int
) -> tuple[str, int]:
    """Make ``history`` changes on a device (one session of ``long_turns`` turns first) and
    push them to ``store``; returns the long session's id and the changes pushed."""
    clock = HybridClock(f"srv-{uuid7()}")
    async with SessionRuntime(
        SQLiteAdapter(path),
        ScriptedProvider(default_reply=REPLY),
        user_id=tenant.user_id,
        org_id=tenant.org_id,
        client_id="filler",
    ) as rt:

        async def push_pending() -> int:
            pending = await rt.store.outbox_pending(limit=1_000_000)
            for i in range(0, len(pending), PUSH_BATCH):
                # As the device's flush makes a push (``_push_of``): each record as its stored
                # bytes, a session row once, at its last number, after the messages it names
                # (its earlier numbers ``skipped``), so the feed holds it after them.
                changes, skipped, bodies = _push_of(
                    pending[i : i + PUSH_BATCH], 1 << 40, skipping=True, as_bodies=True
                )
                result = await store.push(
                    tenant, rt.client_id, changes, clock, skipped=skipped, bodies=bodies or ()
                )
                # (a skipped number is acknowledged as "superseded")
                bad = [r for r in result.results if r.status not in ("applied", "superseded")]
                assert not bad, bad[:3]
            await rt.store.outbox_remove([e.client_seq for e in pending])
            return len(pending)

        long_id = (await rt.create_session(title="long")).id
        for i in range(long_turns):
            async for _ in rt.execute_message(long_id, f"turn {i}: {TEXT}"):
                pass
        pushed = await push_pending()
        while pushed < history:
            sid = (await rt.create_session(title="short")).id
            for i in range(SMALL_SESSION_TURNS):
                async for _ in rt.execute_message(sid, f"turn {i}: {TEXT}"):
                    pass
            if await rt.store.outbox_count() >= 10 * PUSH_BATCH:
                pushed += await push_pending()
            elif pushed + await rt.store.outbox_count() >= history:
                pushed += await push_pending()
    return long_id, pushed


def new_device(store: SQLiteAdapter, tenant: Tenant, name: str) -> SessionRuntime:
    """A runtime of ``tenant`` on ``store`` that has never synced."""
    return SessionRuntime(
        store,
        ScriptedProvider(),
        user_id=tenant.user_id,
        org_id=tenant.org_id,
        client_id=f"new-device-{name}",
    )


async def catch_ups_apart(
    root: Path, tenant: Tenant, batches: list[WriteBatch], reps: int, session_id: str
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Seconds of ``reps`` new devices' ``sync_once`` against one ``pleach-server`` process on
    the filled file, each followed by the floor (the same rows bulk inserted into a new
    file): in turn, so that a noisy moment of the machine falls on both sides alike. Then
    each device's first resume of ``session_id`` after its pull, beside the floor's read of
    that device's rows (seconds, each pair in turn)."""
    apart: list[float] = []
    raws: list[float] = []
    firsts: list[tuple[float, float]] = []
    async with bench_push.servers(str(root / "server.db"), None, 1) as (server,):
        token = issue_token(bench_push.SECRET.encode(), tenant, 3600)
        for i in range(reps):
            store = SQLiteAdapter(root / f"new-device-apart-{i}.db")
            async with new_device(store, tenant, f"apart-{i}") as rt:
                started = time.perf_counter()
                await rt.sync.sync_once(server.url, token, timeout=TIMEOUT)
                apart.append(time.perf_counter() - started)
            raws.append(await asyncio.to_thread(raw_bulk, root / f"raw-{i}.db", batches))
    for i in range(reps):
        path = root / f"new-device-apart-{i}.db"
        first = (await resume_once(path, session_id))[0]
        firsts.append((first, await asyncio.to_thread(raw_resume, path, session_id)))
    return apart, raws, firsts


def raw_bulk(path: Path, batches: list[WriteBatch]) -> float:
    """Plain sqlite3: the rows of ``batches`` in one transaction; returns seconds."""
    rows = raw_rows(batches)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        create_schema(conn)
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        for groups, enqueue, meta in rows:
            for sql, params in groups.items():
                conn.executemany(sql, params)
            for sql, params in enqueue:
                conn.executemany(sql, params)
            conn.executemany(_PUT_META, meta)
        conn.execute("COMMIT")
        return time.perf_counter() - started
    finally:
        conn.close()


async def resume_once(path: Path, session_id: str) -> tuple[float, int, int]:
    """Open a fresh runtime on ``path``, resume the session, read its transcript; returns
    seconds, events hydrated and messages read."""
    started = time.perf_counter()
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        handle = await rt.sessions.resume(session_id)
        messages = await rt.sessions.messages(session_id)
        seconds = time.perf_counter() - started
        events = len(await rt.store.list_events(session_id))
    assert handle.id == session_id
    return seconds, events, len(messages)


_FRESH_RESUME = """
import asyncio, sys, time
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter

async def main(path, session_id):
    started = time.perf_counter()
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        await rt.sessions.resume(session_id)
        await rt.sessions.messages(session_id)
        print(time.perf_counter() - started)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def fresh_process_resume(path: Path, session_id: str) -> float:
    """``resume_once`` in a new Python process, as an app opening a session meets it: the
    runtime made, opened, the session resumed and its transcript read (the imports before
    are not counted: ``bench_startup`` has them). Returns seconds."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _FRESH_RESUME,
        str(path),
        session_id,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the fresh-process resume failed ({proc.returncode})")
    return float(out.decode().strip())


def raw_resume(path: Path, session_id: str) -> float:
    started = time.perf_counter()
    conn = sqlite3.connect(path)
    key = uuid.UUID(session_id).bytes  # how the device file keeps a UUID id (schema 5)
    try:
        rows = conn.execute("SELECT body FROM sessions WHERE id = ?", (key,)).fetchall()
        conn.execute("SELECT part, ids FROM session_ids WHERE session_id = ?", (key,)).fetchall()
        # (schema 12: events and checkpoints name their session by its number)
        numbered = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'session_keys'")
        session = "session_id = ?"
        if numbered.fetchone() is not None:
            session = "session_n = (SELECT n FROM session_keys WHERE id = ?)"
        # (schema 15: a checkpoint keeps no stamp beside its body; its reader orders them)
        conn.execute(f"SELECT id, body FROM checkpoints WHERE {session}", (key,)).fetchall()
        conn.execute(
            f"SELECT id, body FROM events WHERE {session} ORDER BY sequence_number, id",
            (key,),
        ).fetchall()
        # (schema 16: messages name their session by its number too)
        columns = {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
        by = session if "session_n" in columns else "session_id = ?"
        conn.execute(f"SELECT id, body FROM messages WHERE {by}", (key,)).fetchall()
        seconds = time.perf_counter() - started
        if not rows:
            raise RuntimeError(f"the floor found no session row for {session_id}")
        return seconds
    finally:
        conn.close()


async def _run(history: int, long_turns: int, reps: int) -> tuple[list[Row], list[str]]:
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pleach-bench-catchup-") as tmp:
        root = Path(tmp)
        tenant = Tenant(org_id="bench-catchup", user_id=f"user-{uuid7()}")
        async with SQLiteServerStore(root / "server.db") as store:
            started = time.perf_counter()
            long_id, pushed = await fill(root / "filler.db", tenant, store, history, long_turns)
            notes.append(
                f"server filled with {pushed:,} changes (real turns of one device, pushed to "
                f"SQLiteServerStore.push in batches of {PUSH_BATCH}) in "
                f"{time.perf_counter() - started:.1f}s"
            )
            async with SyncServer(store, port=0, secret=SECRET) as server:
                batches: list[WriteBatch] = []
                seconds: list[float] = []
                device = root / "new-device.db"
                token = issue_token(SECRET, tenant, 3600)
                async with new_device(
                    RecordingAdapter(device, batches, seconds), tenant, "1"
                ) as rt:
                    started = time.perf_counter()
                    await rt.sync.sync_once(server.url, token, timeout=TIMEOUT)
                    catchup = time.perf_counter() - started
                    cursor = int(await rt.store.get_meta("cursor") or 0)
        aparts, bulks, firsts = await catch_ups_apart(root, tenant, batches, CATCHUP_REPS, long_id)
        apart, raw = statistics.median(aparts), statistics.median(bulks)
        applied = sum(len(b.records) for b in batches)
        # Taken in turn, so that a noisy moment of the machine falls on both sides alike.
        resumes, raws = [], []
        for _ in range(reps):
            resumes.append(await resume_once(device, long_id))
            raws.append(await asyncio.to_thread(raw_resume, device, long_id))
        fresh = [await fresh_process_resume(device, long_id) for _ in range(FRESH_REPS)]
    events, messages = resumes[0][1], resumes[0][2]
    rows = [
        Row(
            f"catch-up: new device sync_once, {pushed:,} changes ({applied:,} records applied)",
            pushed / catchup,
            "changes/s",
            "raw sqlite3 bulk insert",
            pushed / raw,
        ),
        Row("  catch-up, total", catchup, "s", "raw sqlite3 bulk insert", raw),
        Row(
            f"  catch-up, server in its own process (median of {CATCHUP_REPS})",
            apart,
            "s",
            "raw sqlite3 bulk insert",
            raw,
        ),
        Row(
            f"resume: fresh runtime, {events:,}-event session, {messages:,} messages "
            f"(median of {reps})",
            statistics.median(r[0] for r in resumes) * 1e3,
            "ms",
            "raw sqlite3 SELECT",
            statistics.median(raws) * 1e3,
        ),
        Row(
            f"  resume in a fresh process, as an app opens it (median of {FRESH_REPS})",
            statistics.median(fresh) * 1e3,
            "ms",
            "raw sqlite3 SELECT",
            statistics.median(raws) * 1e3,
        ),
        # The first resume after the pull: it reads the fold the pull kept (before pulls
        # kept folds, it folded the whole log: 3.1-3.9x). One sample a device, so the
        # median of the devices that caught up apart, each beside the floor's read of its
        # file (one device's read from 28 to 86 ms from run to run).
        Row(
            f"  resume, the first after the pull (its fold kept by the pull; median of "
            f"{len(firsts)} devices)",
            statistics.median(f[0] for f in firsts) * 1e3,
            "ms",
            "raw sqlite3 SELECT",
            statistics.median(f[1] for f in firsts) * 1e3,
        ),
    ]
    notes.append(
        f"catch-up pulled to cursor {cursor:,} in {len(batches)} local transaction(s); "
        "resume = open SessionRuntime + sessions.resume + sessions.messages"
    )
    return rows, notes


FRESH_REPS = 3
CATCHUP_REPS = 3
"""New devices catching up against the server process, each beside its own floor (a bulk
insert into a new file); the figure and its floor are the medians."""
"""Resumes each in a new Python process (imports not counted)."""
RESUME_REPS = 9
"""Resumes timed, each beside one of the floor's reads: the median of each side is reported
(the floor's SELECTs moved between 15 and 30 ms from one run to the next with three)."""


def run(
    quick: bool = False, history: int | None = None, long_turns: int | None = None
) -> list[Row]:
    history = history or (10_000 if quick else 100_000)
    long_turns = long_turns or (250 if quick else 2500)
    started = time.perf_counter()
    rows, notes = asyncio.run(_run(history, long_turns, RESUME_REPS))
    report("bench_catchup: a new device catching up, a session resumed", rows, notes, started)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10,000 changes, 250-turn session")
    parser.add_argument("--history", type=int, default=None, help="changes (100,000)")
    parser.add_argument(
        "--long-turns",
        type=int,
        default=None,
        help="long session turns (2500: a 10,001-event session)",
    )
    args = parser.parse_args(argv)
    run(args.quick, args.history, args.long_turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
