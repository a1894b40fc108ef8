"""Push throughput: SQLite against PostgreSQL, one server process against two.

Rows (changes per second; the ratio is against the SQLite row of the same kind, measured in the
same run, on the same machine):

- ``store``: ``ServerStore.push`` called directly. ``1 device``: one device pushing its batches
  one after another (latency-bound: one transaction at a time). ``8 tenants``: eight devices of
  eight tenants pushing at once (SQLite serializes every write; PostgreSQL runs one
  transaction per pool connection in parallel and only serializes within a tenant).
- ``server``: real ``pleach-server`` subprocesses on loopback, ``websockets`` devices sending
  ``Push`` frames and waiting for each ``PushAck``. Records go as a device at protocol 6 sends
  them, as their compact bytes (``bodies``); ``store`` rows pass the same bytes. ``x2`` splits
  the devices across two processes sharing one PostgreSQL database.

Each row is measured ``--rounds`` times (3), the rounds taken in turn (every row once, then
every row again), and the run of the median rate is printed: on a shared machine one run of a
row against one run of another moved the PostgreSQL server's ratio from 0.66x to 1.09x between
runs of the same code. Each round's ratios of the server rows are printed below the table.

No thresholds: this prints figures (docs/POSTGRES.md quotes a run). Bounded: about a minute
with the defaults. Run ``python -m bench.bench_push`` (``--help`` for sizes and the DSN).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from websockets.asyncio.client import connect

from pleach_server.auth import issue_token
from pleach_server.store.base import ServerStore, Tenant
from pleach_server.store.postgres import PostgresServerStore
from pleach_server.store.sqlite import SQLiteServerStore
from shared import compact
from shared.clock import HybridClock
from shared.ids import uuid7
from shared.messages import (
    PROTOCOL_VERSION,
    Changes,
    FrameCodec,
    Hello,
    Push,
    PushAck,
    Welcome,
    change_bodies,
)
from shared.records import Change, Message, Session, SessionState

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SECRET = "bench-secret"


class Workload:
    """``batches`` pushes of ``per_batch`` message changes for one new device and tenant."""

    def __init__(self, batches: int, per_batch: int) -> None:
        self.tenant = Tenant(org_id=f"org-{uuid7()}", user_id=f"user-{uuid7()}")
        self.client_id = f"dev-{uuid7()}"
        clock = HybridClock(self.client_id)
        base = {
            "org_id": self.tenant.org_id,
            "user_id": self.tenant.user_id,
            "client_id": self.client_id,
        }
        now = clock.now()
        session = Session(
            id=uuid7(),
            provider="scripted",
            model="scripted-1",
            created_at=now,
            updated_at=now,
            vv={self.client_id: 1},
            state=SessionState(),
            hlc=now,
            **base,
        )
        seq = 0
        self.batches: list[list[Change]] = []
        for b in range(batches):
            batch = []
            for i in range(per_batch):
                seq += 1
                record: Session | Message
                if b == 0 and i == 0:
                    record = session
                else:
                    record = Message(
                        id=uuid7(),
                        session_id=session.id,
                        role="user",
                        content=[{"type": "text", "text": f"message {seq} " + "x" * 200}],
                        hlc=clock.now(),
                        **base,
                    )
                batch.append(Change(client_seq=seq, record=record))
            self.batches.append(batch)
        # What a device at protocol 6 sends: each record as the compact bytes it stored.
        self.bodies = [[compact.encode(c.record) for c in batch] for batch in self.batches]

    @property
    def changes(self) -> int:
        return sum(len(b) for b in self.batches)


# -- direct store pushes -----------------------------------------------------------------------


async def push_direct(store: ServerStore, workloads: list[Workload]) -> float:
    """Push every workload's batches (workloads in parallel); returns elapsed seconds."""
    clock = HybridClock(f"srv-{uuid7()}")

    async def one(w: Workload) -> None:
        for batch, bodies in zip(w.batches, w.bodies, strict=True):
            result = await store.push(w.tenant, w.client_id, batch, clock, bodies=bodies)
            assert all(r.status == "applied" for r in result.results), result

    started = time.perf_counter()
    await asyncio.gather(*(one(w) for w in workloads))
    return time.perf_counter() - started


# -- through real servers ----------------------------------------------------------------------


class Server:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, db: str, schema: str | None, env: dict[str, str]) -> Server:
        args = [sys.executable, "-m", "pleach_server.cli", "--port", "0", "--db", db]
        args += ["--log-level", "warning"]
        if schema is not None:
            args += ["--schema", schema]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
        )
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(30):
                line = (await proc.stdout.readline()).decode()
                await proc.stdout.readline()  # "data: ..."
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        if not line.startswith("pleach-server listening on "):
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"pleach-server did not start: {line!r}")
        return cls(proc, line.split()[-1])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def servers(db: str, schema: str | None, count: int) -> AsyncIterator[list[Server]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    env["PLEACH_SECRET"] = SECRET
    env.pop("PYTHONASYNCIODEBUG", None)
    started: list[Server] = []
    try:
        for _ in range(count):  # one by one: the first migrates, the others find it done
            started.append(await Server.start(db, schema, env))
        yield started
    finally:
        await asyncio.gather(*(s.stop() for s in started))


async def push_over_websockets(urls: list[str], workloads: list[Workload]) -> float:
    """Each workload is one device connection (round-robin over ``urls``); returns seconds."""
    codec = FrameCodec()

    async def one(url: str, w: Workload, ready: asyncio.Barrier) -> None:
        token = issue_token(SECRET.encode(), w.tenant, 3600)
        async with connect(
            url, additional_headers={"Authorization": f"Bearer {token}"}, proxy=None
        ) as ws:
            await ws.send(codec.encode(Hello(protocol=PROTOCOL_VERSION, client_id=w.client_id)))
            assert isinstance(codec.decode(await _recv(ws)), Welcome)
            await ready.wait()
            for batch, bodies in zip(w.batches, w.bodies, strict=True):
                packed = change_bodies(batch, bodies)
                await ws.send(codec.encode(Push(changes=[], bodies=packed)))
                while True:  # live Changes frames of our own pushes are skipped
                    frame = codec.decode(await _recv(ws))
                    if isinstance(frame, PushAck):
                        break
                    assert isinstance(frame, Changes), frame
                assert all(r.status == "applied" for r in frame.results), frame

    ready = asyncio.Barrier(len(workloads) + 1)
    tasks = [
        asyncio.create_task(one(urls[i % len(urls)], w, ready)) for i, w in enumerate(workloads)
    ]
    await ready.wait()  # every device connected and welcomed: start the clock
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    return time.perf_counter() - started


async def _recv(ws: Any) -> bytes:
    async with asyncio.timeout(30):
        data = await ws.recv()
    assert isinstance(data, bytes)
    return data


# -- the run -----------------------------------------------------------------------------------


async def drop_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()


Row = tuple[str, str, int, float]


async def run(args: argparse.Namespace) -> list[list[Row]]:
    """Every row, once a round, the rounds taken in turn; each round's rows in order."""
    rounds: list[list[Row]] = []
    schema = f"pleach_bench_{uuid7().replace('-', '')}"

    def workloads(devices: int) -> list[Workload]:
        return [Workload(args.batches, args.changes) for _ in range(devices)]

    async def measure(
        label: str, kind: str, devices: int, go: Callable[[list[Workload]], Awaitable[float]]
    ) -> None:
        ws = workloads(devices)
        seconds = await go(ws)
        rounds[-1].append((label, kind, sum(w.changes for w in ws), seconds))

    with tempfile.TemporaryDirectory() as tmp:
        try:
            for _ in range(args.rounds):
                rounds.append([])
                await _round(args, Path(tmp), schema, measure)
        finally:
            await drop_schema(args.dsn, schema)
    return rounds


Measure = Callable[[str, str, int, Callable[[list[Workload]], Awaitable[float]]], Awaitable[None]]


async def _round(args: argparse.Namespace, tmp: Path, schema: str, measure: Measure) -> None:
    """Every row once (the same files and schema each round: new tenants each time)."""
    stores: list[tuple[str, contextlib.AbstractAsyncContextManager[ServerStore]]] = [
        ("SQLite", SQLiteServerStore(tmp / "direct.db")),
        ("PostgreSQL", PostgresServerStore(args.dsn, schema=schema, pool_max=args.devices + 2)),
    ]
    for label, opening in stores:
        async with opening as store:
            n = args.devices
            for kind, devices in (("store, 1 device", 1), (f"store, {n} tenants", n)):
                await measure(label, kind, devices, functools.partial(push_direct, store))
    if args.no_servers:
        return
    kind = f"server, {args.devices} devices"
    for label, db, in_schema, count in (
        ("SQLite x1", str(tmp / "server.db"), None, 1),
        ("PostgreSQL x1", args.dsn, schema, 1),
        ("PostgreSQL x2", args.dsn, schema, 2),
    ):
        async with servers(db, in_schema, count) as running:
            urls = [s.url for s in running]
            await measure(label, kind, args.devices, functools.partial(push_over_websockets, urls))


def _rate(row: Row) -> float:
    return row[2] / row[3]


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """Of each row, the run of the median rate over the rounds (the lower middle of an even
    number), in the rows' order."""
    picked: list[Row] = []
    for runs in zip(*rounds, strict=True):
        ordered = sorted(runs, key=_rate)
        picked.append(ordered[(len(ordered) - 1) // 2])
    return picked


def round_ratios(rounds: list[list[Row]]) -> list[str]:
    """Each round's ratio of every PostgreSQL server row to the SQLite server row."""
    lines = []
    for at, rows in enumerate(rounds, 1):
        base = {r[1]: _rate(r) for r in rows if r[0].startswith("SQLite")}
        parts = []
        for label, kind, changes, seconds in rows:
            if kind.startswith("server") and not label.startswith("SQLite") and kind in base:
                parts.append(f"{label} {changes / seconds / base[kind]:.2f}x")
        if parts:
            lines.append(f"round {at}: " + ", ".join(parts))
    return lines


def render(rows: list[Row]) -> str:
    baseline: dict[str, float] = {}
    for label, kind, changes, seconds in rows:
        if label.startswith("SQLite"):
            baseline[kind] = changes / seconds
    lines = [
        f"{'store':<15} {'workload':<22} {'changes':>8} {'seconds':>8} {'changes/s':>10} "
        f"{'vs SQLite':>9}",
        "-" * 77,
    ]
    for label, kind, changes, seconds in rows:
        rate = changes / seconds
        ratio = rate / baseline[kind] if kind in baseline else float("nan")
        lines.append(
            f"{label:<15} {kind:<22} {changes:>8} {seconds:>8.2f} {rate:>10.0f} {ratio:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL (PLEACH_TEST_PG_DSN)")
    parser.add_argument("--batches", type=int, default=60, help="pushes per device (60)")
    parser.add_argument("--changes", type=int, default=10, help="changes per push (10)")
    parser.add_argument("--devices", type=int, default=8, help="concurrent devices (8)")
    parser.add_argument("--no-servers", action="store_true", help="store rows only")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds, taken in turn; the median is printed (3)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    started = time.perf_counter()
    rounds = asyncio.run(run(args))
    print(render(median_rows(rounds)))
    if len(rounds) > 1:
        print(f"\nthe median of {len(rounds)} rounds taken in turn; the server rows by round:")
        for line in round_ratios(rounds):
            print(f"  {line}")
    print(
        f"\n{args.batches} pushes x {args.changes} changes per device; "
        f"total {time.perf_counter() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
