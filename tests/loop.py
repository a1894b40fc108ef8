"""Waiting on the event loop itself, for tests.

``next_tick()`` returns once the loop has run every callback that was ready when it was
called: the tasks just created have started and reached their first real wait. It waits on
a future that a ``call_soon`` callback sets (an event), never on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["hold", "next_tick", "until_true"]


async def next_tick() -> None:
    loop = asyncio.get_running_loop()
    ran: asyncio.Future[None] = loop.create_future()
    loop.call_soon(ran.set_result, None)
    await ran


async def until_true(condition: Callable[[], bool], ticks: int = 1000) -> bool:
    """Run the loop a tick at a time until ``condition()`` holds (at most ``ticks`` ticks):
    for state that other tasks change within a few turns of the loop, with no event of its
    own. Returns whether it held."""
    for _ in range(ticks):
        if condition():
            return True
        await next_tick()
    return condition()


async def hold(seconds: float) -> None:
    """Let ``seconds`` pass: a duration the caller chose (a fault that lasts that long, the
    pace of an offered load, a measurement window, the moment of a kill), never a wait for
    something to happen. The one place the tests let time pass on purpose."""
    if seconds > 0:
        await asyncio.sleep(seconds)
