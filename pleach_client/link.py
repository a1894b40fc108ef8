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

    async def send(self, send: Callable[[], int]) -> tuple[int, asyncio.Future[Frame]]:
        """Send one request frame (``send`` queues it and returns its id) without waiting for
        its answer: its id and the future the answer lands in (``wait``). Several may be in
        flight at once: the server answers a connection's frames in order."""
        request_id = send()
        future = self.expect(request_id)
        await self.flush_out()
        return request_id, future

    async def wait(self, future: asyncio.Future[Frame], timeout: float) -> Frame:
        """The answer of a request sent with ``send``. None within ``timeout`` drops the
        connection: the loop reconnects and resends what is not acknowledged."""
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            self.ws.transport.abort()
            raise ConnectionError(f"no answer within {timeout}s; reconnecting") from None

    async def request(self, send: Callable[[], int], timeout: float) -> Frame:
        """Send one request frame and wait for its answer (``send``, then ``wait``)."""
        _, future = await self.send(send)
        return await self.wait(future, timeout)

    def forget(self, request_id: int) -> None:
        """Stop waiting for a request's answer: when it comes, it is dropped."""
        future = self.waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

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
