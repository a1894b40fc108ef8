"""One open sync connection: the socket, its sans-I/O ``ClientProtocol``, and the requests
awaiting their answers, matched by the request id every answer echoes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from websockets.asyncio.client import ClientConnection

from shared.messages import Frame
from shared.protocol import ClientProtocol


class Link:
    """One open connection: the socket, the protocol, and the requests awaiting answers.

    Answers are matched to requests by the id they echo (``ClientProtocol`` sorts answers,
    live pages and notices), so one lost or late answer never shifts another.
    """

    def __init__(self, ws: ClientConnection, protocol: ClientProtocol) -> None:
        self.ws = ws
        self.protocol = protocol
        self.waiters: dict[int, asyncio.Future[Frame]] = {}

    async def flush_out(self) -> None:
        for data in self.protocol.data_to_send():
            await self.ws.send(data)

    def expect(self, request_id: int) -> asyncio.Future[Frame]:
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = future
        return future

    async def request(self, send: Callable[[], int], timeout: float) -> Frame:
        """Send one request frame (``send`` queues it and returns its id); wait for its
        answer. A request with no answer within ``timeout`` drops the connection: the loop
        reconnects and resends what is not acknowledged."""
        future = self.expect(send())
        await self.flush_out()
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            self.ws.transport.abort()
            raise ConnectionError(f"no answer within {timeout}s; reconnecting") from None

    def answer(self, request_id: int, frame: Frame) -> None:
        future = self.waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(frame)

    def fail_all(self, exc: BaseException) -> None:
        waiters, self.waiters = self.waiters, {}
        for future in waiters.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: a waiter may already have gone


__all__ = ["Link"]
