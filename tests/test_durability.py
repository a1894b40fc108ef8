"""Crash safety and storage growth on a real SQLite file.

A real subprocess commits turns and is killed with SIGKILL at random points; a new process
resumes and checks that every committed turn is whole and nothing is half-written.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import sys
from collections import Counter
from pathlib import Path

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter

ROOT = Path(__file__).resolve().parent.parent


async def _kill_after(db: Path, session_file: Path, turns: int) -> None:
    """Start the writer, let it commit ``turns`` turns (then a random bit more), SIGKILL it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.scripts.turn_writer",
        str(db),
        str(session_file),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    seen = 0
    while seen < turns:
        line = await proc.stdout.readline()
        assert line, "writer exited early"
        seen += 1
    # Let it run into the middle of a further turn's work, at a random point.
    for _ in range(random.randint(0, 3)):
        await proc.stdout.read(random.randint(1, 8))
    proc.send_signal(signal.SIGKILL)
    await proc.wait()


async def test_sigkill_at_random_points_leaves_whole_turns(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    session_file = tmp_path / "session"
    for round_ in range(5):
        await _kill_after(db, session_file, turns=random.randint(1, 6))
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok", round_
        async with SessionRuntime(
            SQLiteAdapter(db), ScriptedProvider(), user_id="u", org_id="o"
        ) as rt:
            session_id = session_file.read_text().strip()
            handle = await rt.resume_session(session_id)
            messages = await rt.sessions.messages(session_id)
            assert len(messages) == len(handle.message_ids), "a message id points nowhere"
            checkpoints = await rt.checkpoints.list(session_id)
            events = await rt.store.list_events(session_id)
            audit = await rt.audit.rows(session_id)
            turns = {m.turn_id for m in messages}
            completes = [e for e in events if e.type == "turn.complete"]
            # Every committed turn is whole: its messages, checkpoint, events and audit rows.
            assert len(checkpoints) == len(turns) == len(completes) == handle.hydrated["turns"]
            assert {c.turn_id for c in checkpoints} == turns
            assert {r.turn_id for r in audit} == turns
            per_turn = Counter(r.turn_id for r in audit)
            assert set(per_turn.values()) <= {1, 2}
            assert checkpoints[-1].id == handle.record.head_checkpoint_id
            assert (await rt.events.verify_chain(session_id)).ok
            assert (await rt.audit.verify_chain()).ok
            # Every record of every committed turn has its outbox row, and no more.
            pending = await rt.store.outbox_pending(limit=100_000)
            queued = Counter(type(e.record).__name__ for e in pending)
            assert queued["Message"] == len(messages)
            assert queued["Checkpoint"] == len(checkpoints)
            assert queued["AuditRow"] == len(audit)
            assert queued["Event"] == len(events)


def _db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


async def test_storage_grows_linearly_with_turns(tmp_path: Path) -> None:
    sizes = {}
    for turns in (250, 500):
        db = tmp_path / f"growth-{turns}.db"
        async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider()) as rt:
            handle = await rt.create_session()
            for n in range(turns):
                async for _ in rt.execute_message(handle.id, f"message number {n} " * 4):
                    pass
        with sqlite3.connect(db) as conn:
            conn.execute("VACUUM")
        sizes[turns] = _db_bytes(db)
    ratio = sizes[500] / sizes[250]
    assert ratio < 2.2, f"500 turns take {ratio:.2f}x the bytes of 250 turns: {sizes}"
