"""Small servers that run in their own process for the baselines of ``bench_live`` and
``bench_server_mem``: ``python -m bench.ws_baselines KIND [--db PATH]``.

- ``relay``: a plain ``websockets`` relay. A client names its pair and role (``b"7:a"``);
  once both ends of the pair are there each gets ``b"ok"``, and every later frame of one end
  is forwarded to the other.
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
import sys
from collections.abc import Awaitable, Callable

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


async def relay_server() -> None:
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
            await peer.send(message)

    await serve_until_signalled(relay, "deflate")


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
    parser.add_argument("kind", choices=["relay", "echo", "echo-plain", "pleach-plain"])
    parser.add_argument("--db", default=None, help="SQLite file (pleach-plain)")
    args = parser.parse_args(argv)
    if args.kind == "relay":
        asyncio.run(relay_server())
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
