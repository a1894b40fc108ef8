"""``reap``: stop a task and wait for it, without swallowing the caller's own cancellation.
``Every``: run a job in a task of its own every so many calls, never two at once.

The usual ``task.cancel()`` then ``with suppress(CancelledError): await task`` cannot tell the
task's cancellation from the caller's: when the caller is itself cancelled while it waits
(a ``disconnect()`` landing in a connection's clean-up), the suppress eats that too, and the
caller runs on as if nothing had asked it to stop; whoever awaits it then waits for ever.
``reap`` re-raises the ``CancelledError`` when the running task has a cancellation pending
(``Task.cancelling()``), and swallows it only when it is the reaped task's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Every", "reap"]


async def reap(task: asyncio.Future[Any], *ignore: type[BaseException]) -> None:
    """Cancel ``task`` (unless done) and wait until it has ended. Its cancellation and the
    exception types in ``ignore`` are swallowed; any other exception it ended with is raised,
    and so is a cancellation of the task running this."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except ignore:
        pass


class Every:
    """Start ``job()`` in a task of its own once ``n`` ``tick()`` calls came since the last
    start, at the first of them with no job running: at most one at a time. ``running`` is that task
    while it runs; ``wait()`` waits for it. ``job`` should not raise (log what fails): the
    task's exception is left to it. The stores' side checkpoints of their WAL run this way."""

    def __init__(self, n: int, job: Callable[[], Awaitable[None]]) -> None:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        self.n = n
        self._job = job
        self._ticks = 0
        self.running: asyncio.Task[None] | None = None

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks < self.n or self.running is not None:
            return
        self._ticks = 0
        self.running = asyncio.get_running_loop().create_task(self._run())

    async def wait(self) -> None:
        if self.running is not None:
            await self.running

    async def _run(self) -> None:
        try:
            await self._job()
        finally:
            self.running = None
