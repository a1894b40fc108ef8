"""A fault-injecting loopback TCP proxy, put between ``pleach-server`` and PostgreSQL.

Bytes are copied both ways, except while a fault is on:

- ``cut()``: every open connection is aborted (both ends see a reset): a crashed database,
  a firewall dropping state, ``pg_terminate_backend`` of everything;
- ``refusing``: new connections are accepted and reset at once (a database restarting, or
  out of connection slots); with ``cut()`` first, that is a database restart;
- ``stalled``: no byte moves on any connection, open or new, until it is lifted (a network
  freeze): what was sent meanwhile is delivered afterwards, in order.

The proxy listens on one port for its whole life, so a DSN pointing at it stays valid.
"""

from __future__ import annotations

import asyncio
import contextlib


class FaultProxy:
    """``FaultProxy(host, port)``: ``await start()``, then point the DSN at ``self.port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.refusing = False
        self.accepted = 0
        self.refused = 0
        self.cut_connections = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    @stalled.setter
    def stalled(self, on: bool) -> None:
        if on:
            self._flowing.clear()
        else:
            self._flowing.set()

    @property
    def open_connections(self) -> int:
        return len(self._pipes) // 2

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> int:
        """Abort every open connection; returns how many there were."""
        count = self.open_connections
        self.cut_connections += count
        for writer in list(self._pipes):
            writer.transport.abort()
        return count

    def heal(self) -> None:
        """No fault: accept, and move bytes again."""
        self.refusing = False
        self.stalled = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._pipes.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self._flowing.wait()  # a stall holds what was read until it is lifted
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._pipes.discard(dst)
            dst.transport.abort()

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self.heal()
        self.cut()
        if server is not None:
            await server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["FaultProxy"]
