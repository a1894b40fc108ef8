"""``python -m bench.bench_long_session [--quick] [--dsn DSN]``: a turn's push and pull on the
server as a session grows.

A device's turn reaches the server as one push of three changes: its two messages and the new
version of its session row, which names every message the session has. Each row here is the
median of a run of such turns, called on the store directly (``ServerStore.push``, then
``pull`` of the turn's page, as a live device's next pull would), in a session that already
names 2,000 or 20,000 messages, against the same turns in a new session: the ratio says what
the session's length costs each turn. The server stores keep a long session's ids in blocks
beside its row (``pleach_server.store.base.session_row``), so that a turn writes the block it
appended to rather than every id; the pull puts the list back together. PostgreSQL rows run
when it answers at ``--dsn`` (``PLEACH_TEST_PG_DSN``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec

from bench.bench_local import Row, render
from pleach_server.store.base import ServerStore, Tenant
from pleach_server.store.sqlite import SQLiteServerStore
from shared import compact
from shared.clock import HybridClock
from shared.ids import uuid7
from shared.records import Change, Message, Session, SessionState

DEFAULT_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
LENGTHS = (2_000, 20_000)
"""Message ids the long sessions start with."""


class Conversation:
    """One device's session of ``length`` message ids, and its turns' pushes."""

    def __init__(self, length: int) -> None:
        self.tenant = Tenant(org_id=f"org-{uuid7()}", user_id=f"user-{uuid7()}")
        self.client_id = f"dev-{uuid7()}"
        self.clock = HybridClock(self.client_id)
        self.seq = 0
        now = self.clock.now()
        self.session = Session(
            id=uuid7(),
            org_id=self.tenant.org_id,
            user_id=self.tenant.user_id,
            client_id=self.client_id,
            hlc=now,
            provider="scripted",
            model="scripted-1",
            created_at=now,
            updated_at=now,
            vv={self.client_id: 1},
            state=SessionState(message_ids=[uuid7() for _ in range(length)]),
        )

    def first(self) -> tuple[list[Change], list[bytes]]:
        return self._changes([self.session])

    def turn(self) -> tuple[list[Change], list[bytes]]:
        """Two messages (200 B asked, 800 B answered) and the session naming them."""
        turn: tuple[tuple[Literal["user", "assistant"], int], ...] = (
            ("user", 200),
            ("assistant", 800),
        )
        messages = [
            Message(
                id=uuid7(),
                session_id=self.session.id,
                role=role,
                content=[{"type": "text", "text": "x" * size}],
                org_id=self.tenant.org_id,
                user_id=self.tenant.user_id,
                client_id=self.client_id,
                hlc=self.clock.now(),
            )
            for role, size in turn
        ]
        now = self.clock.now()
        state = SessionState(
            message_ids=[*self.session.state.message_ids, *(m.id for m in messages)]
        )
        vv = {self.client_id: self.session.vv[self.client_id] + 1}
        self.session = msgspec.structs.replace(
            self.session, state=state, vv=vv, hlc=now, updated_at=now
        )
        return self._changes([*messages, self.session])

    def _changes(self, records: list[Message | Session]) -> tuple[list[Change], list[bytes]]:
        changes = []
        for record in records:
            self.seq += 1
            changes.append(Change(client_seq=self.seq, record=record))
        return changes, [compact.encode(r) for r in records]


async def measure(store: ServerStore, length: int, turns: int) -> tuple[float, float]:
    """Median µs of a turn's push, and of the pull of its page, in a session of ``length``."""
    server = HybridClock(f"srv-{uuid7()}")
    talk = Conversation(length)
    changes, bodies = talk.first()
    result = await store.push(talk.tenant, talk.client_id, changes, server, bodies=bodies)
    cursor = result.head_cursor
    pushes: list[float] = []
    pulls: list[float] = []
    for _ in range(turns):
        changes, bodies = talk.turn()
        started = time.perf_counter()
        result = await store.push(talk.tenant, talk.client_id, changes, server, bodies=bodies)
        pushed = time.perf_counter()
        page = await store.pull(talk.tenant, cursor, 100, raw=True)
        pulls.append(time.perf_counter() - pushed)
        pushes.append(pushed - started)
        assert [r.status for r in result.results] == ["applied"] * 3, result.results
        assert len(page.bodies) == 3 and bytes(page.bodies[-1].body) == bodies[-1]
        cursor = page.to_cursor
    return statistics.median(pushes) * 1e6, statistics.median(pulls) * 1e6


async def _rows(label: str, store: ServerStore, turns: int) -> list[Row]:
    await measure(store, 0, 5)  # (warm: the store's statements prepared, its caches filled)
    short = await measure(store, 0, turns)
    rows = []
    for length in LENGTHS:
        push, pull = await measure(store, length, turns)
        rows.append(
            Row(
                f"{label}: a turn's push, session at {length:,} ids",
                push,
                "us",
                "new session",
                short[0],
            )
        )
        rows.append(
            Row(
                f"{label}:   the pull of its page, at {length:,}",
                pull,
                "us",
                "new session",
                short[1],
            )
        )
    return rows


async def _pg_rows(dsn: str, turns: int) -> list[Row]:
    from bench.__main__ import _pg_reachable
    from pleach_server.store.postgres import PostgresServerStore

    why = await _pg_reachable(dsn)
    if why is not None:
        print(f"bench_long_session: PostgreSQL rows skipped: {why}")
        return []
    from bench.bench_push import drop_schema

    schema = f"pleach_bench_{uuid7().replace('-', '')}"
    try:
        async with PostgresServerStore(dsn, schema=schema, pool_max=2) as store:
            return await _rows("PostgreSQL", store, turns)
    finally:
        await drop_schema(dsn, schema)


async def _run(quick: bool, dsn: str) -> list[Row]:
    turns = 20 if quick else 60
    with tempfile.TemporaryDirectory(prefix="pleach-long-") as tmp:
        async with SQLiteServerStore(Path(tmp) / "server.db") as store:
            rows = await _rows("SQLite", store, turns)
    return rows + await _pg_rows(dsn, turns)


def run(quick: bool = False, dsn: str = DEFAULT_DSN) -> list[Row]:
    rows = asyncio.run(_run(quick, dsn))
    print(render("bench_long_session: a turn on the server as the session grows (median)", rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL (PLEACH_TEST_PG_DSN)")
    args = parser.parse_args(argv)
    run(args.quick, args.dsn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
