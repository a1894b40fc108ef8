"""A simulated network: one in-process TCP proxy per device, driven by the scheduler.

The device connects to its proxy's loopback port; the proxy opens a connection to the real
server and copies bytes both ways, except where the scheduler says otherwise:

- ``hold_live``: live ``Changes`` frames from the server are held back while answers (push
  acks, pull pages) pass, and are released later, after them: live pages reordered against
  push acknowledgements and pulls, which the protocol allows.
- ``delay``: every frame from the server is held until ``release()``.
- ``drop_next_ack``: the next ``PushAck`` is swallowed and the connection is cut: the push
  committed, the device never learns it, reconnects and resends (duplicate delivery).
- ``error_next_ack``: the next ``PushAck`` is replaced by the ``Error`` (3009, retryable) a
  server sends when its store fails under a commit whose outcome it cannot know (a database
  connection lost during ``COMMIT``): the push committed, the connection stays up, and the
  device believes nothing was taken.
- ``cut()``: every open connection is aborted; the device reconnects and resends.
- ``partitioned``: new connections are accepted and closed at once until healed.

To see frame boundaries the proxy removes ``Sec-WebSocket-Extensions`` from the upgrade
request, so no compression is negotiated and each server frame stands alone. Frames are only
ever held and released whole and in their own order, except live pages moved behind answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

import msgspec

from shared.errors import ErrorCode
from shared.messages import Error, FrameCodec


class _Head(msgspec.Struct):
    """The two fields of a server frame the proxy looks at (the rest is ignored)."""

    type: str = ""
    live: bool = False
    request_id: int = 0


_head_decoder = msgspec.msgpack.Decoder(_Head)
_codec = FrameCodec()
_HEADER_END = b"\r\n\r\n"
_MAX_HEADER = 64 * 1024


def _classify(payload: bytes) -> _Head:
    try:
        return _head_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Head()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, int, bool, bytes]:
    """One WebSocket frame: (raw bytes, opcode, fin, unmasked payload)."""
    head = await reader.readexactly(2)
    b0, b1 = head[0], head[1]
    length = b1 & 0x7F
    ext = b""
    if length == 126:
        ext = await reader.readexactly(2)
        length = struct.unpack(">H", ext)[0]
    elif length == 127:
        ext = await reader.readexactly(8)
        length = struct.unpack(">Q", ext)[0]
    mask = await reader.readexactly(4) if b1 & 0x80 else b""
    payload = await reader.readexactly(length)
    raw = head + ext + mask + payload
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return raw, b0 & 0x0F, bool(b0 & 0x80), payload


async def _read_header(reader: asyncio.StreamReader) -> bytes:
    data = await reader.readuntil(_HEADER_END)
    if len(data) > _MAX_HEADER:
        raise ConnectionError("header too large")
    return data


def _store_failure(request_id: int) -> bytes:
    """What the server answers a push when its store failed under it (``_handle``)."""
    return _codec.encode(
        Error(
            code=int(ErrorCode.STORAGE_UNAVAILABLE),
            message="store failed: connection lost during commit (simulated)",
            retryable=True,
            request_id=request_id,
        )
    )


def _server_frame(payload: bytes) -> bytes:
    """``payload`` as one unmasked, final binary WebSocket frame (server to device)."""
    size = len(payload)
    if size < 126:
        head = bytes([0x82, size])
    elif size < 1 << 16:
        head = bytes([0x82, 126]) + struct.pack(">H", size)
    else:
        head = bytes([0x82, 127]) + struct.pack(">Q", size)
    return head + payload


def _strip_extensions(request: bytes) -> bytes:
    lines = request.split(b"\r\n")
    kept = [ln for ln in lines if not ln.lower().startswith(b"sec-websocket-extensions:")]
    return b"\r\n".join(kept)


class _Pipe:
    """One proxied connection: device <-> proxy <-> server."""

    def __init__(
        self,
        proxy: Proxy,
        dev_reader: asyncio.StreamReader,
        dev_writer: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.dev_reader = dev_reader
        self.dev_writer = dev_writer
        self.srv_writer: asyncio.StreamWriter | None = None
        self.held: list[tuple[bytes, bool]] = []  # (raw message, is live)
        self.closed = False

    def abort(self) -> None:
        self.closed = True
        self.held.clear()
        self.dev_writer.transport.abort()
        if self.srv_writer is not None:
            self.srv_writer.transport.abort()

    def send_down(self, raw: bytes) -> None:
        if not self.closed:
            self.dev_writer.write(raw)

    def release(self) -> None:
        held, self.held = self.held, []
        for raw, _ in held:
            self.send_down(raw)

    async def run(self) -> None:
        try:
            host, port = self.proxy.upstream()
            if port == 0:
                raise ConnectionRefusedError("the server is down")
            srv_reader, self.srv_writer = await asyncio.open_connection(host, port)
            request = await _read_header(self.dev_reader)
            self.srv_writer.write(_strip_extensions(request))
            up = asyncio.create_task(self._up(srv_writer=self.srv_writer))
            try:
                await self._down(srv_reader)
            finally:
                up.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                    await up
        except (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a cut, a refused upstream (server down) or a closed device: all just end
        finally:
            self.abort()

    async def _up(self, srv_writer: asyncio.StreamWriter) -> None:
        while True:
            data = await self.dev_reader.read(65536)
            if not data:
                srv_writer.write_eof()
                return
            srv_writer.write(data)

    async def _down(self, srv_reader: asyncio.StreamReader) -> None:
        response = await _read_header(srv_reader)
        self.send_down(response)
        if b" 101 " not in response.split(b"\r\n", 1)[0]:
            while data := await srv_reader.read(65536):  # a refusal (401...): pass it on
                self.send_down(data)
            return
        message: list[bytes] = []
        payload = b""
        while True:
            raw, opcode, fin, data = await _read_frame(srv_reader)
            if opcode >= 0x8:  # control frames are never held
                self.send_down(raw)
                if opcode == 0x8:
                    return
                continue
            message.append(raw)
            payload += data
            if not fin:
                continue
            whole, body = b"".join(message), payload
            message, payload = [], b""
            head = _classify(body)
            is_live = head.type == "changes" and head.live
            if head.type == "push_ack" and self.proxy.drop_next_ack:
                self.proxy.drop_next_ack = False
                self.proxy.acks_dropped += 1
                raise ConnectionError("push ack dropped by the simulation")
            if head.type == "push_ack" and self.proxy.error_next_ack:
                self.proxy.error_next_ack = False
                self.proxy.acks_failed += 1
                whole = _server_frame(_store_failure(head.request_id))
            if self.proxy.delay or (self.proxy.hold_live and is_live):
                self.held.append((whole, is_live))
            else:
                self.send_down(whole)


class Proxy:
    """The network between one device and the server. ``url`` is what the device dials.

    ``upstream`` is asked for the server's address at every new connection, so a restarted
    server on another port is found without the device knowing.
    """

    def __init__(self, name: str, upstream: Callable[[], tuple[str, int]]) -> None:
        self.name = name
        self.upstream = upstream
        self.hold_live = False
        self.delay = False
        self.drop_next_ack = False
        self.error_next_ack = False
        self.partitioned = False
        self.acks_dropped = 0
        self.acks_failed = 0
        self.cuts = 0
        self._pipes: set[_Pipe] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._closing = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/sync"

    @property
    def faulty(self) -> bool:
        return (
            self.hold_live
            or self.delay
            or self.drop_next_ack
            or self.error_next_ack
            or self.partitioned
        )

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = _Pipe(self, reader, writer)
        if self.partitioned or self._closing:
            # A connection accepted while the proxy closes is dropped at once: nothing would
            # wait for its pump, and its transport would outlive the loop.
            pipe.abort()
            return
        self._pipes.add(pipe)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await pipe.run()
        finally:
            self._pipes.discard(pipe)
            self._tasks.discard(task)

    def release(self) -> None:
        """Stop holding frames; deliver what was held (live pages after the answers)."""
        self.hold_live = False
        self.delay = False
        for pipe in list(self._pipes):
            pipe.release()

    def cut(self) -> None:
        """Abort every open connection (held frames are lost with it, as on a real network)."""
        for pipe in list(self._pipes):
            self.cuts += 1
            pipe.abort()

    def heal(self) -> None:
        """Back to a plain network; frames held so far are delivered."""
        self.partitioned = False
        self.drop_next_ack = False
        self.error_next_ack = False
        self.release()

    async def close(self) -> None:
        """Stop listening and abort every connection; returns once their pumps have ended."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        self.cut()
        while self._tasks:
            # Aborted transports end each pump with a read error; the timeout is a safety net.
            done, _ = await asyncio.wait(list(self._tasks), timeout=10)
            if not done:
                break
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


__all__ = ["Proxy"]
