"""``python -m bench.bench_codec [--quick] [--db PATH]``: the storage codec, per record.

Times ``shared.compact.decode`` and ``encode`` on the bodies of a real device file: one session
of 500 scripted turns (100 with ``--quick``), written by ``SessionRuntime`` over SQLite, or the
file given with ``--db``. Each figure is the best of several passes over every row of a table,
in µs per record; a pass starts with the codec's caches empty, as a fresh read would. The
baseline is plain ``msgspec.msgpack`` on the same bytes (decode leaves the exts as ``Ext``) or
of the same record (encode, map form): the floor the codec's own Python work sits on.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.bench_local import Row, render
from shared import compact

TABLES = ("events", "messages", "checkpoints", "audit", "sessions")


async def _write_device_file(path: Path, turns: int) -> None:
    from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.sqlite import SQLiteAdapter

    provider = ScriptedProvider(default_reply=ScriptedReply(text="Done."))
    async with SessionRuntime(SQLiteAdapter(path), provider, user_id="u", org_id="o") as rt:
        sid = (await rt.create_session(title="long")).id
        for i in range(turns):
            async for _ in rt.execute_message(sid, f"turn {i}"):
                pass


def _bodies(path: Path) -> dict[str, list[bytes]]:
    """Each table's bodies as the codec reads them: a row that leaves out what its columns
    hold (device schema 10) given back whole, as the store's queries give it."""
    from pleach_client.store import sqlite as store_module

    whole = getattr(store_module, "_whole_body", None)  # (absent before schema 10)
    short = getattr(store_module, "_SHORT_TABLES", ())
    numbered = getattr(store_module, "_NUMBERED", ())  # (schema 12: a session by its number)

    whole_row = getattr(store_module, "_whole_row", None)  # (schema 14: an event's prev_hash)

    def read(table: str) -> str:
        if table not in short:
            return "body"
        if whole_row is not None:
            return str(whole_row(table))
        return whole(numbered=True) if table in numbered else whole()

    functions = getattr(store_module, "sql_functions", None)  # (schema 17: audit digests)
    with sqlite3.connect(path) as db:
        if functions is not None:
            functions(db)
        return {t: [row[0] for row in db.execute(f"SELECT {read(t)} FROM {t}")] for t in TABLES}


def _per_item(fn: Callable[[Any], object], items: Sequence[Any], passes: int) -> float:
    """Best-of-``passes`` µs per item of ``fn`` over ``items``, caches emptied each pass."""
    best = float("inf")
    forget = getattr(compact, "_clear_caches", lambda: None)  # absent before the caches existed
    for _ in range(passes):
        forget()
        started = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - started)
    return best / len(items) * 1e6


def measure(path: Path, passes: int) -> list[Row]:
    plain_decoder = msgspec.msgpack.Decoder()
    plain_encoder = msgspec.msgpack.Encoder()
    rows: list[Row] = []
    for table, bodies in _bodies(path).items():
        if not bodies:
            continue
        records = [compact.decode(b) for b in bodies]
        size = sum(map(len, bodies)) / len(bodies)
        label = f"{table} ({len(bodies)} rows, {size:.0f} B)"
        rows.append(
            Row(
                f"decode {label}",
                _per_item(compact.decode, bodies, passes),
                "µs",
                "msgpack decode",
                _per_item(plain_decoder.decode, bodies, passes),
            )
        )
        rows.append(
            Row(
                f"encode {label}",
                _per_item(compact.encode, records, passes),
                "µs",
                "msgpack encode",
                _per_item(plain_encoder.encode, records, passes),
            )
        )
    return rows


def run(quick: bool = False, db: Path | None = None) -> list[Row]:
    passes = 3 if quick else 7
    with tempfile.TemporaryDirectory(prefix="pleach-codec-") as tmp:
        if db is None:
            db = Path(tmp) / "device.db"
            asyncio.run(_write_device_file(db, 100 if quick else 500))
        rows = measure(db, passes)
    print(render("bench_codec: shared.compact per record (best pass)", rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--db", type=Path, help="an existing device file to read")
    args = parser.parse_args(argv)
    run(args.quick, args.db)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
