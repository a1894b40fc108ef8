"""A raw device connection for server tests: msgpack frames over a real websocket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from shared.messages import (
    PROTOCOL_VERSION,
    Changes,
    Error,
    Frame,
    FrameCodec,
    Hello,
    Pull,
    Push,
    PushAck,
    Welcome,
    unpacked,
)
from shared.records import Change

TIMEOUT = 20.0


class Client:
    """One device connection: sends frames, and sorts what arrives into answers and live."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.codec = FrameCodec()
        self.live: list[Changes] = []

    async def send(self, frame: Frame) -> None:
        await self.ws.send(self.codec.encode(frame))

    async def send_raw(self, data: bytes | str) -> None:
        await self.ws.send(data)

    async def recv(self) -> Frame:
        async with asyncio.timeout(TIMEOUT):
            data = await self.ws.recv()
        assert isinstance(data, bytes)
        frame = self.codec.decode(data)
        # Protocol 6: records may come as their stored bytes; read them as records too.
        return unpacked(frame) if isinstance(frame, Changes) else frame

    async def answer(self) -> Frame:
        """The next frame that is not a live ``Changes`` (live ones are kept in ``live``)."""
        while True:
            frame = await self.recv()
            if isinstance(frame, Changes) and frame.live:
                self.live.append(frame)
                continue
            return frame

    async def live_frame(self) -> Changes:
        if self.live:
            return self.live.pop(0)
        frame = await self.recv()
        assert isinstance(frame, Changes) and frame.live, frame
        return frame

    async def hello(
        self, client_id: str, cursor: int = 0, protocol: int = PROTOCOL_VERSION
    ) -> Welcome:
        await self.send(Hello(protocol=protocol, client_id=client_id, cursor=cursor))
        welcome = await self.answer()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    async def push(self, changes: list[Change]) -> PushAck:
        await self.send(Push(changes=changes))
        ack = await self.answer()
        assert isinstance(ack, PushAck), ack
        return ack

    async def pull(self, cursor: int, limit: int = 500) -> Changes:
        await self.send(Pull(cursor=cursor, limit=limit))
        page = await self.answer()
        assert isinstance(page, Changes), page
        return page

    async def error(self) -> Error:
        frame = await self.answer()
        assert isinstance(frame, Error), frame
        return frame

    async def closed(self) -> ConnectionClosed:
        """Wait for the server to close; returns the close exception (code in ``.rcvd``)."""
        with pytest.raises(ConnectionClosed) as info:
            while True:
                await self.answer()
        return info.value

    async def pull_all(self) -> list[Any]:
        """Every change of the tenant's feed, paging from cursor 0."""
        out: list[Any] = []
        cursor = 0
        while True:
            page = await self.pull(cursor, limit=100)
            out.extend(page.changes)
            cursor = page.to_cursor
            if not page.more:
                return out

    def live_ids(self) -> list[str]:
        return [c.record.id for frame in self.live for c in frame.changes]

    async def live_until(self, record_ids: set[str]) -> None:
        """Read live frames (and nothing else) until every id in ``record_ids`` has arrived."""
        while not record_ids <= set(self.live_ids()):
            frame = await self.recv()
            assert isinstance(frame, Changes) and frame.live, frame
            self.live.append(frame)
