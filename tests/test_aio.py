"""``shared.aio.reap``: a task is stopped and awaited, and the caller's own cancellation is
never swallowed on the way (a ``disconnect()`` landing in a connection's clean-up used to be
taken for the reader's cancellation, and the sync loop ran on, so ``disconnect()`` never
returned)."""

from __future__ import annotations

import asyncio

import pytest

from shared.aio import reap


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_reap_swallows_the_reaped_tasks_cancellation() -> None:
    task = asyncio.create_task(_forever())
    await asyncio.sleep(0)  # let it start
    await reap(task)
    assert task.cancelled()


async def test_reap_keeps_the_callers_own_cancellation() -> None:
    stopping, release = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await _forever()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()  # clean-up that takes a while
            raise

    went_on = []

    async def caller() -> None:
        child = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0)
        await reap(child)
        went_on.append(True)  # a swallowed cancellation would get here

    task = asyncio.create_task(caller())
    await stopping.wait()  # the caller waits in reap for its child to end
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert went_on == []


async def test_reap_raises_what_the_task_ended_with_unless_ignored() -> None:
    async def fails() -> None:
        raise ConnectionError("gone")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    await reap(task, ConnectionError)
    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    with pytest.raises(ConnectionError):
        await reap(task)
