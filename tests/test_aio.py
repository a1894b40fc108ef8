"""``shared.aio.reap``: a task is stopped and awaited, and the caller's own cancellation is
never swallowed on the way (a ``disconnect()`` landing in a connection's clean-up used to be
taken for the reader's cancellation, and the sync loop ran on, so ``disconnect()`` never
returned). ``shared.aio.Every``: a job every n-th tick, never two at once."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.aio import Every, reap


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


@given(n=st.integers(1, 5), script=st.lists(st.booleans(), max_size=40))
def test_every_starts_a_job_at_each_nth_tick_and_never_two_at_once(
    n: int, script: list[bool]
) -> None:
    """``script``: at each step, tick (True) or let the running job finish (False). A model
    counts ticks since the last start and starts one at a tick that makes them at least n,
    if none runs then."""

    async def run() -> None:
        started = 0
        gate = asyncio.Event()

        async def job() -> None:
            nonlocal started
            started += 1
            await gate.wait()

        every = Every(n, job)
        ticks = expected = 0
        running = False
        for tick in script:
            if tick:
                ticks += 1
                if ticks >= n and not running:
                    ticks, running, expected = 0, True, expected + 1
                every.tick()
                await asyncio.sleep(0)  # the job starts and waits at the gate
            elif running:
                gate.set()
                await every.wait()
                gate.clear()
                running = False
            assert started == expected
            assert (every.running is not None) == running
        gate.set()
        await every.wait()
        assert every.running is None

    asyncio.run(run())


def test_every_refuses_a_period_below_one() -> None:
    with pytest.raises(ValueError):
        Every(0, _forever)
