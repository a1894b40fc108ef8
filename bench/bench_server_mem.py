"""Server memory per idle connection: a real ``pleach-server`` against a plain websockets echo.

A ``pleach-server`` subprocess (SQLite store on a temporary file, started by its CLI as in
production) gets one warm-up device connection (kept open, so one-time costs such as the first
handshake's imports and caches are not counted), then its ``VmRSS`` is read from
``/proc/<pid>/status``. Then N more devices connect (500 users x 2 devices for N = 1,000, each
user its own tenant token in the ``Authorization`` header) and each does the ``Hello`` /
``Welcome`` handshake, then stays idle. Once every ``Welcome`` has arrived and the server's own
``/metrics`` counts N + 1 connections and live subscribers, ``VmRSS`` is read again:
(after - before) / N is the memory one idle device costs the server.

Floor, same run: a plain ``websockets`` echo server subprocess holding as many idle
connections, each having echoed one frame of the same bytes as the ``Hello`` (same handshake
shape: one frame each way). Both use websockets' default permessage-deflate, as pleach does;
the same pair without compression is shown too, to separate what the zlib contexts cost.

Run ``python -m bench.bench_server_mem [--quick]`` (``--quick``: 200 connections).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

from bench.bench_live import TIMEOUT, helper, rss_kib, scrape_metrics
from bench.bench_local import Row, report
from bench.bench_push import SECRET as SERVER_SECRET
from bench.bench_push import servers
from pleach_server.auth import issue_token
from pleach_server.store import Tenant
from shared.ids import uuid7
from shared.messages import PROTOCOL_VERSION, FrameCodec, Hello, Welcome

__all__ = ["main", "run"]

CONCURRENT_OPENS = 50  # handshakes in flight at once


def raise_nofile(needed: int) -> None:
    """Raise this process's open-files limit to ``needed`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def hello_bytes(client_id: str) -> bytes:
    return FrameCodec().encode(Hello(protocol=PROTOCOL_VERSION, client_id=client_id))


async def open_many(
    count: int, opener: Callable[[int], Awaitable[ClientConnection]], stack: AsyncExitStack
) -> list[ClientConnection]:
    """Open ``count`` connections, ``CONCURRENT_OPENS`` handshakes at a time; each is closed
    when ``stack`` unwinds."""
    conns: list[ClientConnection] = []
    limit = asyncio.Semaphore(CONCURRENT_OPENS)

    async def one(i: int) -> None:
        async with limit:
            ws = await opener(i)
        stack.push_async_callback(ws.close)
        conns.append(ws)

    await asyncio.gather(*(one(i) for i in range(count)))
    return conns


def device_opener(url: str, run_id: str) -> Callable[[int], Awaitable[ClientConnection]]:
    """Connection ``i`` is device ``i % 2`` of user ``i // 2``: token, ``Hello``, ``Welcome``."""
    codec = FrameCodec()
    secret = SERVER_SECRET.encode()

    async def opener(i: int) -> ClientConnection:
        tenant = Tenant(org_id="bench-mem", user_id=f"user-{run_id}-{i // 2}")
        token = issue_token(secret, tenant, 3600)
        async with asyncio.timeout(TIMEOUT):
            ws = await connect(
                url, additional_headers={"Authorization": f"Bearer {token}"}, proxy=None
            )
            await ws.send(hello_bytes(f"dev-{run_id}-{i}"))
            data = await ws.recv()
        assert isinstance(data, bytes)
        frame = codec.decode(data)
        assert isinstance(frame, Welcome), frame
        return ws

    return opener


def echo_opener(url: str, compression: str | None) -> Callable[[int], Awaitable[ClientConnection]]:
    async def opener(i: int) -> ClientConnection:
        payload = hello_bytes(f"dev-echo-{i}")
        async with asyncio.timeout(TIMEOUT):
            ws = await connect(url, proxy=None, compression=compression)
            await ws.send(payload)
            assert await ws.recv() == payload
        return ws

    return opener


@dataclass
class Measured:
    before_kib: int
    after_kib: int
    connections: int

    @property
    def per_connection_kib(self) -> float:
        return (self.after_kib - self.before_kib) / self.connections


async def pleach_counts(url: str) -> tuple[float, float]:
    metrics = await scrape_metrics(url)
    return metrics.get("pleach_connections", 0.0), metrics.get("pleach_fanout_subscribers", 0.0)


async def measure_pleach(url: str, pid: int, count: int) -> Measured:
    run_id = uuid7()[-12:]
    opener = device_opener(url, run_id)
    async with AsyncExitStack() as stack:
        await open_many(1, lambda i: opener(count + i), stack)  # warm-up, kept open
        await pleach_counts(url)  # the scrape's own allocations before "before" too
        before = rss_kib(pid)
        await open_many(count, opener, stack)
        # Every Welcome is in; the server subscribes a device right after writing its
        # Welcome, so ask its /metrics until it counts them all (each scrape is a request the
        # server answers after what it already had queued; no sleeping).
        for _ in range(100):
            conns, subs = await pleach_counts(url)
            if conns == subs == count + 1:
                break
        else:
            raise RuntimeError(f"server reports {conns} connections, {subs} subscribers")
        after = rss_kib(pid)
    return Measured(before, after, count)


async def measure_echo(url: str, pid: int, count: int, compression: str | None) -> Measured:
    opener = echo_opener(url, compression)
    async with AsyncExitStack() as stack:
        await open_many(1, lambda i: opener(count + i), stack)
        before = rss_kib(pid)
        await open_many(count, opener, stack)  # every echo is back: every handler runs
        after = rss_kib(pid)
    return Measured(before, after, count)


@contextlib.asynccontextmanager
async def pleach_cli(db: Path) -> AsyncIterator[tuple[str, int]]:
    async with servers(str(db), None, 1) as (srv,):
        yield srv.url, srv.proc.pid


# -- the run -----------------------------------------------------------------------------------


async def _run(count: int) -> tuple[list[Row], list[str]]:
    raise_nofile(2 * count + 256)
    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pleach-bench-mem-") as tmp:
        root = Path(tmp)
        async with pleach_cli(root / "server.db") as (url, pid):
            pleach = await measure_pleach(url, pid, count)
        async with helper("echo") as echo_srv:
            echo = await measure_echo(echo_srv.url, echo_srv.pid, count, "deflate")
        plain_db = str(root / "plain.db")
        async with helper("pleach-plain", "--db", plain_db) as srv:
            pleach_plain = await measure_pleach(srv.url, srv.pid, count)
        async with helper("echo-plain") as echo_srv:
            echo_plain = await measure_echo(echo_srv.url, echo_srv.pid, count, None)
    rows += [
        Row(
            f"pleach-server, per idle device connection ({count} conns, deflate)",
            pleach.per_connection_kib,
            "KiB",
            "ws echo server, deflate",
            echo.per_connection_kib,
        ),
        Row(
            f"  RSS before -> after {count} conns",
            pleach.after_kib / 1024,
            "MiB",
            "from (MiB)",
            pleach.before_kib / 1024,
        ),
        Row(
            "  echo server RSS before -> after",
            echo.after_kib / 1024,
            "MiB",
            "from (MiB)",
            echo.before_kib / 1024,
        ),
        Row(
            f"SyncServer without permessage-deflate, per connection ({count} conns)",
            pleach_plain.per_connection_kib,
            "KiB",
            "ws echo server, no deflate",
            echo_plain.per_connection_kib,
        ),
    ]
    notes.append(
        "before = after start and one warm-up connection (kept open); each connection is a "
        "device of its own (2 per user, each user its own tenant token) that did Hello/Welcome "
        "and stays idle; the echo clients send one frame of the same bytes and read it back"
    )
    notes.append(
        "the first pleach row is the pleach-server CLI; the no-deflate row is SyncServer("
        "compression=False) on SQLiteServerStore in a subprocess (bench.ws_baselines); the echo "
        "servers import websockets only"
    )
    return rows, notes


def run(quick: bool = False, connections: int | None = None) -> list[Row]:
    """Measure, print the table, return the rows."""
    count = connections or (200 if quick else 1000)
    started = time.perf_counter()
    rows, notes = asyncio.run(_run(count))
    report("bench_server_mem: server memory per idle connection", rows, notes, started)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="200 connections instead of 1,000")
    parser.add_argument("--connections", type=int, default=None, help="idle connections (1000)")
    args = parser.parse_args(argv)
    run(args.quick, args.connections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
