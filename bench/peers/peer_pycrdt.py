"""``pycrdt-websocket`` (Yjs over WebSocket, ``pycrdt`` docs); runs from ``.venv-peers``.

A ``pycrdt.websocket.WebsocketServer`` served by ``websockets`` on a loopback port (rooms in
memory: no store, on the server or the clients), clients are ``pycrdt.Doc``s synchronised by
``pycrdt.Provider`` over a ``websockets`` connection. A thin adapter gives each connection the
``Channel`` shape (``path``, ``send``, ``recv``, async iteration) that pycrdt asks for. Both
sides use websockets' default permessage-deflate, as the raw baselines do.

- ``live``: clients A and B in one room. Per round A appends one turn to a shared ``Map`` (the
  turn's 200-byte user text and 800-byte assistant text, two keys, one transaction); timing
  starts before A's transaction and stops when B's map observer fires for that turn. Baseline:
  a raw ``websockets`` relay that forwards the very bytes A sent that round (recorded from A's
  channel) to B.
- ``sync``: A appends K turns (2K changes, one transaction per turn) and the server's room has
  them all; then a fresh client C connects, timing from before the connect until C has all 2K
  entries. Baseline: a raw ``websockets`` echo (connect included) of the very messages C
  received, the same bytes up and down.

``python -m bench.peers.peer_pycrdt --dir DIR [--rounds R] [--turns K] [--reps N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from bench.peers.common import assistant_text, emit, percentile, user_text, versions

PACKAGES = ("pycrdt", "pycrdt-websocket", "websockets", "anyio")
TIMEOUT = 30.0
ROOM = "/bench-room"


class WsChannel:
    """A ``websockets`` connection as a pycrdt ``Channel``; keeps what it sent and received
    when ``record`` is set."""

    def __init__(self, ws: ServerConnection | ClientConnection, path: str) -> None:
        self._ws = ws
        self._path = path
        self.record = False
        self.sent: list[bytes] = []
        self.received: list[bytes] = []

    @property
    def path(self) -> str:
        return self._path

    def __aiter__(self) -> WsChannel:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    async def send(self, message: bytes) -> None:
        if self.record:
            self.sent.append(bytes(message))
        await self._ws.send(bytes(message))

    async def recv(self) -> bytes:
        message = await self._ws.recv()
        data = message.encode() if isinstance(message, str) else bytes(message)
        if self.record:
            self.received.append(data)
        return data


@asynccontextmanager
async def crdt_server() -> AsyncIterator[tuple[str, Any]]:
    """A pycrdt ``WebsocketServer`` behind ``websockets.serve``; yields (url, server)."""
    from pycrdt.websocket import WebsocketServer  # type: ignore[import-not-found,unused-ignore]

    async with WebsocketServer(auto_clean_rooms=False) as ystore_server:

        async def handler(ws: ServerConnection) -> None:
            path = ws.request.path if ws.request is not None else ROOM
            await ystore_server.serve(WsChannel(ws, path))

        async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
            port = server.sockets[0].getsockname()[1]
            yield f"ws://127.0.0.1:{port}", ystore_server


@asynccontextmanager
async def client(stack_url: str) -> AsyncIterator[tuple[Any, WsChannel]]:
    """A ``Doc`` connected to the room through a ``Provider``; yields (doc, channel) once the
    initial sync is done."""
    from pycrdt import Doc, Provider  # type: ignore[import-not-found,unused-ignore]

    async with connect(stack_url + ROOM, max_size=None, proxy=None) as ws:
        channel = WsChannel(ws, ROOM)
        doc: Any = Doc()
        async with Provider(doc, channel) as provider:
            with _timeout():
                await provider.synced.wait()
            yield doc, channel


def _timeout() -> Any:
    import anyio  # type: ignore[import-not-found,unused-ignore]

    return anyio.fail_after(TIMEOUT)


def append_turn(doc: Any, turns: Any, i: int) -> None:
    """One turn, one transaction: two map entries (user 200 bytes, assistant 800 bytes)."""
    with doc.transaction():
        turns[f"{i:06d}-user"] = user_text(i)
        turns[f"{i:06d}-assistant"] = assistant_text(i)


# -- live --------------------------------------------------------------------------------------


async def live(rounds: int) -> dict[str, Any]:
    from pycrdt import Map  # type: ignore[import-not-found,unused-ignore]

    async with AsyncExitStack() as stack:
        url, _ = await stack.enter_async_context(crdt_server())
        doc_a, chan_a = await stack.enter_async_context(client(url))
        doc_b, _ = await stack.enter_async_context(client(url))
        map_a = doc_a.get("turns", type=Map)
        map_b = doc_b.get("turns", type=Map)
        arrived: dict[str, float] = {}
        wake = asyncio.Event()

        def on_change(event: Any) -> None:
            now = time.perf_counter()
            for key in event.keys:
                arrived.setdefault(key, now)
            wake.set()

        subscription = map_b.observe(on_change)
        latencies: list[float] = []
        payloads: list[list[bytes]] = []
        for r in range(rounds + 1):  # round 0 warms up
            chan_a.sent.clear()
            chan_a.record = True
            key = f"{r:06d}-assistant"
            started = time.perf_counter()
            append_turn(doc_a, map_a, r)
            async with asyncio.timeout(TIMEOUT):
                while key not in arrived:
                    wake.clear()
                    await wake.wait()
            assert map_b[key] == assistant_text(r)
            await asyncio.sleep(0.005)  # let A's provider finish sending (quiet before the next)
            chan_a.record = False
            if r > 0:
                latencies.append(arrived[key] - started)
                payloads.append(list(chan_a.sent))
        map_b.unobserve(subscription)
    relay = await relay_latency(payloads)
    sizes = [sum(len(p) for p in round_) for round_ in payloads]
    return {
        "rounds": rounds,
        "payload_bytes": statistics.median(sizes),
        "messages_per_round": statistics.median(len(r) for r in payloads),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "relay_p50_ms": statistics.median(relay) * 1e3,
        "relay_p99_ms": percentile(relay, 99) * 1e3,
    }


async def relay_latency(rounds: list[list[bytes]]) -> list[float]:
    """Raw websockets: A sends each round's messages to a relay that forwards them to B; the
    round ends when B has the last one. One warm-up round first."""
    peers: dict[bytes, ServerConnection] = {}
    both = asyncio.Event()

    async def relay(ws: ServerConnection) -> None:
        role = await ws.recv()
        assert isinstance(role, bytes)
        peers[role] = ws
        if len(peers) == 2:
            both.set()
        async for message in ws:
            await peers[b"b"].send(message)

    async with serve(relay, "127.0.0.1", 0, max_size=None) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with (
            connect(url, max_size=None, proxy=None) as a,
            connect(url, max_size=None, proxy=None) as b,
        ):
            await a.send(b"a")
            await b.send(b"b")
            await asyncio.wait_for(both.wait(), TIMEOUT)
            out: list[float] = []
            for r, messages in enumerate([rounds[0], *rounds]):
                started = time.perf_counter()
                for message in messages:
                    await a.send(message)
                async with asyncio.timeout(TIMEOUT):
                    for _ in messages:
                        await b.recv()
                if r > 0:
                    out.append(time.perf_counter() - started)
    return out


# -- full sync to a fresh client ---------------------------------------------------------------


async def _echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def echo_round(url: str, payloads: list[bytes]) -> float:
    """Connect, send each payload and wait for it to come back, close; returns seconds."""
    started = time.perf_counter()
    async with connect(url, max_size=None, proxy=None) as ws:
        for payload in payloads:
            await ws.send(payload)
            async with asyncio.timeout(TIMEOUT):
                await ws.recv()
    return time.perf_counter() - started


async def fresh_client(url: str, changes: int) -> tuple[float, list[bytes]]:
    """A fresh client connects and syncs the room: seconds until it holds ``changes`` entries,
    and the messages it received."""
    from pycrdt import Doc, Map, Provider  # type: ignore[import-not-found,unused-ignore]

    started = time.perf_counter()
    async with connect(url + ROOM, max_size=None, proxy=None) as ws:
        channel = WsChannel(ws, ROOM)
        channel.record = True
        doc: Any = Doc()
        turns = doc.get("turns", type=Map)
        async with Provider(doc, channel) as provider:
            with _timeout():
                await provider.synced.wait()  # set once the room's state is applied
            await wait_for_len(turns, changes)
            seconds = time.perf_counter() - started
    return seconds, channel.received


async def wait_for_len(shared: Any, n: int) -> None:
    """Until the shared map ``shared`` has ``n`` entries (its observer wakes the wait)."""
    changed = asyncio.Event()
    subscription = shared.observe(lambda _: changed.set())
    try:
        async with asyncio.timeout(TIMEOUT):
            while len(shared) < n:
                changed.clear()
                await changed.wait()
    finally:
        shared.unobserve(subscription)


async def full_sync(k: int, reps: int) -> dict[str, Any]:
    from pycrdt import Map  # type: ignore[import-not-found,unused-ignore]

    changes = 2 * k
    async with (
        crdt_server() as (url, ystore_server),
        serve(_echo, "127.0.0.1", 0, max_size=None) as echo,
    ):
        echo_url = f"ws://127.0.0.1:{echo.sockets[0].getsockname()[1]}"
        async with client(url) as (doc_a, _):
            map_a = doc_a.get("turns", type=Map)
            for i in range(k):
                append_turn(doc_a, map_a, i)
            room = await ystore_server.get_room(ROOM)
            await wait_for_len(room.ydoc.get("turns", type=Map), changes)
        # A is gone; the room keeps the document (auto_clean_rooms=False)
        _, received = await fresh_client(url, changes)  # warm up
        await echo_round(echo_url, received)
        syncs: list[float] = []
        echoes: list[float] = []
        for _ in range(reps):  # interleaved, so noise hits both alike
            seconds, received = await fresh_client(url, changes)
            syncs.append(seconds)
            echoes.append(await echo_round(echo_url, received))
    return {
        "turns": k,
        "changes": changes,
        "bytes": sum(len(m) for m in received),
        "messages": len(received),
        "reps": reps,
        "changes_per_s": changes / statistics.median(syncs),
        "turns_per_s": k / statistics.median(syncs),
        "echo_changes_per_s": changes / statistics.median(echoes),
        "echo_turns_per_s": k / statistics.median(echoes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, required=True, help="unused: nothing is stored")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--turns", type=int, default=150, help="turns for the full sync")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    async def both() -> dict[str, Any]:
        return {"live": await live(args.rounds), "sync": await full_sync(args.turns, args.reps)}

    result = asyncio.run(both())
    result["versions"] = versions(*PACKAGES)
    emit(result)


if __name__ == "__main__":
    main()
