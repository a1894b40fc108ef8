"""Small servers that run in their own process for the baselines of ``bench_live`` and
``bench_server_mem``: ``python -m bench.ws_baselines KIND [--db PATH]``.

- ``relay``: a plain ``websockets`` relay. A client names its pair and role (``b"7:a"``);
  once both ends of the pair are there each gets ``b"ok"``, and every later frame of one end
  is forwarded to the other.
- ``durable-relay``: the same relay, but each frame is first written as one row into a SQLite
  file (``--db``; WAL, ``synchronous=FULL``, one ``INSERT`` + ``COMMIT`` per frame, so one
  fsync) on a dedicated connection in its own thread, and forwarded only once that commit
  returned: the least a server's durable store hop costs, one durable commit per push.
- ``echo`` / ``echo-plain``: a plain ``websockets`` echo server, with websockets' default
  permessage-deflate (as ``pleach-server``) or without compression.
- ``pleach-plain``: ``SyncServer(compression=False)`` on a ``SQLiteServerStore`` file (the
  ``pleach-server`` CLI has no flag to turn permessage-deflate off).

Each prints ``listening on ws://...`` once it accepts connections, and stops on SIGTERM or
SIGINT. Only ``pleach-plain`` imports pleach, so the floors' memory is websockets' alone.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from websockets.asyncio.server import ServerConnection, serve

__all__ = ["PLAIN_SECRET", "main"]

PLAIN_SECRET = b"bench-secret"  # the secret bench.bench_push gives its pleach-server processes


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def serve_until_signalled(
    handler: Callable[[ServerConnection], Awaitable[None]], compression: str | None
) -> None:
    """Serve ``handler`` on a free loopback port, print its URL, stop on SIGTERM/SIGINT."""
    stop = _stop_on_signals()
    async with serve(handler, "127.0.0.1", 0, max_size=None, compression=compression) as server:
        port = server.sockets[0].getsockname()[1]
        print(f"listening on ws://127.0.0.1:{port}", flush=True)
        await stop.wait()


class FrameLog:
    """Frames appended to a SQLite file, one durable transaction each.

    One connection, opened and used only by one worker thread (as ``aiosqlite`` does), so the
    event loop keeps serving other connections while a commit waits for its fsync; commits
    are serialized, as on a server store's single writer connection.
    """

    def __init__(self, path: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frame-log")
        self._conn = self._pool.submit(self._open, path).result()

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None)  # explicit transactions below
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        conn.execute("PRAGMA synchronous = FULL")
        sync = conn.execute("PRAGMA synchronous").fetchone()[0]
        if mode != "wal" or sync != 2:  # 2 is FULL
            raise RuntimeError(f"{path}: journal_mode={mode}, synchronous={sync}")
        conn.execute("CREATE TABLE IF NOT EXISTS frames (id INTEGER PRIMARY KEY, body BLOB)")
        return conn

    def _write(self, frame: bytes | str) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO frames (body) VALUES (?)", (frame,))
            conn.execute("COMMIT")  # WAL + synchronous=FULL: the WAL is fsynced here
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    async def append(self, frame: bytes | str) -> None:
        """Return once ``frame`` is committed (durable)."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._write, frame)

    def close(self) -> None:
        self._pool.submit(self._conn.close).result()
        self._pool.shutdown()


async def relay_server(db: str | None = None) -> None:
    """The relay; with ``db``, every frame is committed to a ``FrameLog`` before it is sent."""
    log = FrameLog(db) if db else None
    peers: dict[bytes, ServerConnection] = {}
    paired: dict[bytes, asyncio.Event] = {}

    async def relay(ws: ServerConnection) -> None:
        key = await ws.recv()
        assert isinstance(key, bytes)
        pair, _, role = key.partition(b":")
        peers[key] = ws
        other = pair + b":" + (b"b" if role == b"a" else b"a")
        ready = paired.setdefault(pair, asyncio.Event())
        if other in peers:
            ready.set()
        await ready.wait()
        await ws.send(b"ok")
        peer = peers[other]
        async for message in ws:
            if log is not None:
                await log.append(message)
            await peer.send(message)

    try:
        await serve_until_signalled(relay, "deflate")
    finally:
        if log is not None:
            log.close()


async def _echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def pleach_plain(db: str) -> None:
    from pleach_server.server import SyncServer
    from pleach_server.store import SQLiteServerStore

    stop = _stop_on_signals()
    async with (
        SQLiteServerStore(db) as store,
        SyncServer(store, port=0, secret=PLAIN_SECRET, compression=False) as srv,
    ):
        print(f"listening on {srv.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "kind", choices=["relay", "durable-relay", "echo", "echo-plain", "pleach-plain"]
    )
    parser.add_argument("--db", default=None, help="SQLite file (durable-relay, pleach-plain)")
    args = parser.parse_args(argv)
    if args.kind == "relay":
        asyncio.run(relay_server())
    elif args.kind == "durable-relay":
        if not args.db:
            parser.error("durable-relay needs --db")
        asyncio.run(relay_server(args.db))
    elif args.kind == "echo":
        asyncio.run(serve_until_signalled(_echo, "deflate"))
    elif args.kind == "echo-plain":
        asyncio.run(serve_until_signalled(_echo, None))
    else:
        if not args.db:
            parser.error("pleach-plain needs --db")
        asyncio.run(pleach_plain(args.db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
