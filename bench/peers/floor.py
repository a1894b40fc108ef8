"""The conversation workload's floor: plain stdlib ``sqlite3``, nothing else.

WAL, ``synchronous=NORMAL``, one table ``(id TEXT PRIMARY KEY, session_id TEXT, role TEXT,
content TEXT)``; per turn the same two messages as every other side (200-byte user text,
800-byte assistant text) inserted in one ``BEGIN IMMEDIATE`` ... ``COMMIT``. No checkpoint, no
event, no index beyond the primary key: the least any library could write.

``python -m bench.peers.floor --dir DIR [--turns N]`` prints one JSON line.
"""

from __future__ import annotations

import sqlite3
import time
import uuid

from bench.peers.common import (
    assistant_text,
    conversation_figures,
    emit,
    remove_db,
    turn_args,
    user_text,
    versions,
)

SESSION_ID = "bench-session"


def run(turns: int, path: str) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(
            "CREATE TABLE messages (id TEXT PRIMARY KEY, session_id TEXT, role TEXT, content TEXT)"
        )
        insert = "INSERT INTO messages (id, session_id, role, content) VALUES (?, ?, ?, ?)"
        seconds: list[float] = []
        for i in range(turns):
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(insert, (str(uuid.uuid4()), SESSION_ID, "user", user_text(i)))
            conn.execute(insert, (str(uuid.uuid4()), SESSION_ID, "assistant", assistant_text(i)))
            conn.execute("COMMIT")
            seconds.append(time.perf_counter() - started)
        (count,) = conn.execute("SELECT count(*) FROM messages").fetchone()
        assert count == 2 * turns, count
        return seconds
    finally:
        conn.close()


def main() -> None:
    args = turn_args(__doc__.split("\n\n")[0] if __doc__ else "")
    path = args.dir / "floor.db"
    remove_db(path)
    seconds = run(args.turns, str(path))
    result = conversation_figures(seconds, path)
    result["versions"] = versions()
    remove_db(path)
    emit(result)


if __name__ == "__main__":
    main()
