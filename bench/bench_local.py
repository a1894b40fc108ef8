"""Local (device-side) costs: a turn and its commit, storage per turn, the frame codec.

Every figure is printed beside a baseline measured in the same run on the same machine:

- ``turn``: N turns through ``SessionRuntime(SQLiteAdapter)`` with a ``ScriptedProvider``
  (text replies, no delay). Baseline: the very rows those turns committed (captured, same
  record count, same bytes, same SQL statements and schema), replayed with the ``sqlite3``
  module: ``executemany`` per table in one ``BEGIN IMMEDIATE`` transaction per turn, WAL,
  ``synchronous=NORMAL``. ``MemoryAdapter`` is shown for reference against the same baseline.
- ``storage``: file bytes per turn of an offline device (outbox included) after N and 2N turns,
  against the msgpack bytes of the records kept (overhead), and 2N against N (linearity).
- ``codec``: ``FrameCodec`` (msgspec msgpack) encode + decode of a ``Push`` of 200 changes
  against the stdlib ``json`` module on the same data as builtins.

Run ``python -m bench.bench_local [--quick]``; bounded (a few seconds, no network).
The table helpers here are shared with ``bench_sync``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import CommitReceipt, Plan, StorageAdapter, TxReader, WriteBatch
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import (
    _PUT_ID_BLOCK,
    _PUT_META,
    _PUT_SESSION,
    SQLiteAdapter,
    _encode_batch,
    _numbers_for,
    _queued_rows,
    _shortened,
    create_schema,
    id_blocks,
)
from shared.messages import FrameCodec, Push
from shared.records import Change, Record, Session, encode_record

__all__ = ["Row", "main", "p95", "render", "run"]

TURN_TEXT = "Summarise the plan for tomorrow in three short bullet points, please."
CLIENT_ID = "bench-device"
PUSH_CHANGES = 200


# -- the table (shared with bench_sync) --------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One printed figure; ``ratio`` is ``value / baseline`` (read it with the unit)."""

    figure: str
    value: float
    unit: str
    baseline_name: str = ""
    baseline: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "value": self.value,
            "unit": self.unit,
            "baseline_name": self.baseline_name or None,
            "baseline": self.baseline,
            "ratio": self.ratio,
        }


def _num(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render(title: str, rows: Sequence[Row]) -> str:
    """A plain fixed-width table: figure, value, unit, baseline, ratio."""
    header = ("figure", "value", "unit", "baseline", "baseline is", "ratio")
    cells = [
        (
            r.figure,
            _num(r.value),
            r.unit,
            _num(r.baseline),
            r.baseline_name or "-",
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    right = {1, 3, 5}

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    out = [title, line(header), "-" * len(line(header))]
    out.extend(line(c) for c in cells)
    return "\n".join(out)


def report(title: str, rows: Sequence[Row], notes: Sequence[str], started: float) -> None:
    """Print ``rows`` under ``title`` (``render``), each note as a line of its own, then the
    seconds since ``started`` (``time.perf_counter``) and the machine's cores."""
    print(render(title, rows))
    for note in notes:
        print(f"- {note}")
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")


def p95(samples: Sequence[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


# -- (a) turns ---------------------------------------------------------------------------------


class RecordingAdapter(SQLiteAdapter):
    """``SQLiteAdapter`` that keeps each committed batch (a reference) and the write's time."""

    def __init__(self, path: Path, batches: list[WriteBatch], seconds: list[float]) -> None:
        super().__init__(path)
        self.batches = batches
        self.seconds = seconds

    async def transact(self, plan: Plan) -> CommitReceipt:
        # Every write goes through here (``commit`` too): the batch is what ``plan`` decided
        # inside the transaction, the time is the whole transaction's.
        decided: list[WriteBatch] = []

        async def recording(tx: TxReader) -> WriteBatch | None:
            batch = await plan(tx)
            if batch is not None:
                decided.append(batch)
            return batch

        started = time.perf_counter()
        receipt = await super().transact(recording)
        self.seconds.append(time.perf_counter() - started)
        self.batches.extend(decided)
        return receipt


async def turns(rt: SessionRuntime, session_id: str, start: int, count: int) -> list[float]:
    """Run ``count`` turns (events fully consumed); returns each turn's seconds."""
    out: list[float] = []
    for i in range(start, start + count):
        started = time.perf_counter()
        async for _ in rt.execute_message(session_id, f"turn {i}: {TURN_TEXT}"):
            pass
        out.append(time.perf_counter() - started)
    return out


def file_bytes(path: Path) -> int:
    """The database file plus its WAL and shared-memory files, if any."""
    total = 0
    for suffix in ("", "-wal", "-shm"):
        candidate = Path(f"{path}{suffix}")
        if candidate.exists():
            total += candidate.stat().st_size
    return total


@dataclass
class SQLiteRun:
    turn_seconds: list[float]
    commit_seconds: list[float]  # one per turn
    batches: list[WriteBatch]  # one per turn
    bytes_at_half: int
    bytes_at_end: int
    session_row_at_half: int
    session_row_at_end: int


async def sqlite_run(path: Path, half: int) -> SQLiteRun:
    """``2 * half`` turns in one session; the runtime is closed (WAL checkpointed) after
    ``half`` turns to measure the file, then reopened on the same file."""
    batches: list[WriteBatch] = []
    seconds: list[float] = []
    async with SessionRuntime(
        RecordingAdapter(path, batches, seconds), ScriptedProvider(), client_id=CLIENT_ID
    ) as rt:
        session_id = (await rt.create_session(title="bench")).id
        first = len(batches)
        times = await turns(rt, session_id, 0, half)
        row_half = await rt.store.get_session(session_id)
    at_half = file_bytes(path)
    async with SessionRuntime(
        RecordingAdapter(path, batches, seconds), ScriptedProvider(), client_id=CLIENT_ID
    ) as rt:
        times += await turns(rt, session_id, half, half)
        row_end = await rt.store.get_session(session_id)
    at_end = file_bytes(path)
    assert row_half is not None and row_end is not None
    assert len(batches) - first == 2 * half, "one commit per turn expected"
    return SQLiteRun(
        turn_seconds=times,
        commit_seconds=seconds[first:],
        batches=batches[first:],
        bytes_at_half=at_half,
        bytes_at_end=at_end,
        session_row_at_half=len(encode_record(row_half)),
        session_row_at_end=len(encode_record(row_end)),
    )


async def memory_run(count: int) -> list[float]:
    store: StorageAdapter = MemoryAdapter()
    async with SessionRuntime(store, ScriptedProvider(), client_id=CLIENT_ID) as rt:
        session_id = (await rt.create_session(title="bench")).id
        return await turns(rt, session_id, 0, count)


RawTurn = tuple[
    dict[str, list[tuple[Any, ...]]],
    list[tuple[str, list[tuple[Any, ...]]]],
    list[tuple[str, str]],
]
"""A turn's rows: per insert statement, the outbox's statements (``_queued_rows``), meta."""


def raw_rows(batches: Sequence[WriteBatch], client_id: str | None = None) -> list[RawTurn]:
    """The rows each batch puts in each table, as ``SQLiteAdapter.commit`` would write them
    (same statements, same bytes, outbox and meta rows included): the bodies short, as the
    store's ``_shortened`` writes them in a file of device ``client_id`` (a scratch file in
    memory keeps the tenant and node it takes, as the store's does). A batch's records are
    queued only as the store queues them: unless ``outbox`` is off (a pull's page), and its
    ``queued`` records always. Not timed."""
    out: list[RawTurn] = []
    seq = 0
    now = int(time.time() * 1000)
    held: dict[Any, bytes] = {}
    scratch = sqlite3.connect(":memory:")
    create_schema(scratch)
    if client_id is not None:
        scratch.execute(_PUT_META, ("client_id", client_id))
    for batch in batches:
        groups, outbox = _encode_batch([*batch.records, *batch.queued])
        if not batch.outbox:  # (a pull's page: its records are not queued, its own are)
            outbox = outbox[len(batch.records) :]
        if _PUT_SESSION in groups:
            groups = {**groups, **_session_rows(groups.pop(_PUT_SESSION), held)}
        (groups,) = _shortened(scratch, groups)
        # (schema 12: the sessions' and devices' numbers first, as the store writes them)
        groups = {**dict(_numbers_for(list(groups.items()))), **groups}
        enqueue = _queued_rows(seq + 1, outbox, now)
        seq += len(outbox)
        out.append((groups, enqueue, list(batch.meta.items())))
    scratch.close()
    return out


def _session_rows(
    rows: Sequence[tuple[Any, ...]], held: dict[Any, bytes]
) -> dict[str, list[tuple[Any, ...]]]:
    """``_encode_batch``'s session rows as the store writes them (schema 7): the row, and of a
    long session's message ids the blocks that differ from those written before (``held``)."""
    sessions, blocks = [], []
    for key, updated_at, deleted, ids, block, body in rows:
        count = None if ids is None else len(ids) // 16
        sessions.append((key, updated_at, deleted, body, count, None if ids is None else 1))
        if ids is not None:
            changed = id_blocks(ids, held.get(key, b""), block)
            blocks += [(key, part, data) for part, data in changed]
            held[key] = ids
    return {_PUT_SESSION: sessions, _PUT_ID_BLOCK: blocks}


def raw_replay(path: Path, rows: Sequence[RawTurn]) -> list[float]:
    """The baseline: write ``rows`` with plain ``sqlite3``, one transaction per turn."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        create_schema(conn)
        out: list[float] = []
        for groups, enqueue, meta in rows:
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            for sql, params in groups.items():
                conn.executemany(sql, params)
            for sql, params in enqueue:
                conn.executemany(sql, params)
            conn.executemany(_PUT_META, meta)
            conn.execute("COMMIT")
            out.append(time.perf_counter() - started)
        return out
    finally:
        conn.close()


def kept_bytes(batches: Sequence[WriteBatch]) -> int:
    """msgpack bytes of the records the store keeps (last version of each id)."""
    sizes: dict[tuple[str, str], int] = {}
    for batch in batches:
        for record in batch.records:
            sizes[(type(record).__name__, record.id)] = len(encode_record(record))
    return sum(sizes.values())


# -- (c) codec ---------------------------------------------------------------------------------


def codec_rows(records: Sequence[Record], reps: int) -> list[Row]:
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(records)]
    frame = Push(changes=changes)
    codec = FrameCodec()
    builtins = msgspec.to_builtins(frame)
    packed = codec.encode(frame)
    as_json = json.dumps(builtins).encode()
    assert codec.decode(packed) == frame and json.loads(as_json) == builtins

    def ours() -> float:
        started = time.perf_counter()
        codec.decode(codec.encode(frame))
        return time.perf_counter() - started

    def stdlib() -> float:
        started = time.perf_counter()
        json.loads(json.dumps(builtins).encode())
        return time.perf_counter() - started

    ours(), stdlib()  # warm up
    msgspec_s: list[float] = []
    json_s: list[float] = []
    for _ in range(reps):  # interleaved, so noise hits both alike
        msgspec_s.append(ours())
        json_s.append(stdlib())
    n = len(records)
    return [
        Row(
            f"Push frame, {n} changes: encode+decode (median of {reps})",
            statistics.median(msgspec_s) * 1e6,
            "us",
            "stdlib json",
            statistics.median(json_s) * 1e6,
        ),
        Row(f"Push frame, {n} changes: size", len(packed), "bytes", "json", len(as_json)),
    ]


# -- the run -----------------------------------------------------------------------------------


async def _run(quick: bool) -> list[Row]:
    half = 100 if quick else 250
    reps = 50 if quick else 300
    with tempfile.TemporaryDirectory(prefix="pleach-bench-") as tmp:
        root = Path(tmp)
        # Warm up once: imports, aiosqlite's thread, the decoders, sqlite3 itself.
        await sqlite_run(root / "warm.db", 5)
        await memory_run(5)

        run = await sqlite_run(root / "device.db", half)
        memory = await memory_run(half)

        first = run.batches[:half]
        rows = raw_rows(first, CLIENT_ID)
        replays = [raw_replay(root / f"raw-{i}.db", rows) for i in range(3)]
        raw_total = statistics.median(sum(r) for r in replays)
        raw_median = statistics.median(statistics.median(r) for r in replays)

    ours = run.turn_seconds[:half]
    window = min(50, half)
    early = statistics.median(run.turn_seconds[:window])
    late = statistics.median(run.turn_seconds[-window:])
    records_per_turn = sum(len(b.records) for b in first) / half
    bytes_per_turn = sum(len(encode_record(r)) for b in first for r in b.records) / half
    half_per_turn = run.bytes_at_half / half
    end_per_turn = run.bytes_at_end / (2 * half)
    flat = [r for b in run.batches for r in b.records]
    push_records = flat[:PUSH_CHANGES]
    assert any(isinstance(r, Session) for r in push_records)
    raw_rate = half / raw_total
    return [
        Row(
            f"turn, SQLiteAdapter ({half} turns; {records_per_turn:.0f} records,"
            f" {bytes_per_turn / 1024:.1f} KiB written per turn)",
            half / sum(ours),
            "turns/s",
            "raw sqlite3, same rows",
            raw_rate,
        ),
        Row(
            "turn, SQLiteAdapter, median",
            statistics.median(ours) * 1e6,
            "us/turn",
            "raw sqlite3, same rows",
            raw_median * 1e6,
        ),
        Row(
            "  of which SQLiteAdapter.commit, median",
            statistics.median(run.commit_seconds[:half]) * 1e6,
            "us/turn",
            "raw sqlite3, same rows",
            raw_median * 1e6,
        ),
        Row(
            f"turn, MemoryAdapter ({half} turns, reference)",
            half / sum(memory),
            "turns/s",
            "raw sqlite3, same rows",
            raw_rate,
        ),
        Row(
            f"turn, SQLiteAdapter, turns {2 * half - window + 1}-{2 * half}, median",
            late * 1e6,
            "us/turn",
            f"turns 1-{window}",
            early * 1e6,
        ),
        Row(
            f"session row after {2 * half} turns (rewritten each turn)",
            run.session_row_at_end,
            "bytes",
            f"after {half} turns",
            run.session_row_at_half,
        ),
        Row(
            f"storage after {half} turns (offline, outbox kept)",
            half_per_turn,
            "bytes/turn",
            "msgpack of records kept",
            kept_bytes(first) / half,
        ),
        Row(
            f"storage after {2 * half} turns",
            end_per_turn,
            "bytes/turn",
            f"after {half} turns",
            half_per_turn,
        ),
        *codec_rows(push_records, reps),
    ]


def run(quick: bool = False) -> list[Row]:
    """Run every measurement, print the table, return the rows."""
    started = time.perf_counter()
    rows = asyncio.run(_run(quick))
    print(render("bench_local: device turns, storage, frame codec", rows))
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer turns and repetitions")
    args = parser.parse_args(argv)
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
