"""Delta debugging over a failing schedule's op list.

``shrink(schedule, fails, budget_s)`` removes chunks of ops (halves, then quarters, ...),
reruns, and keeps a removal whenever the smaller schedule still fails with a problem of the
same category. It stops when no single op can go or the time budget is spent, and returns the
smallest failing schedule found. Real sockets make the interleaving of a run vary, so a
candidate counts as failing when any of ``tries`` runs fails.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from .schedule import Op, Schedule

Fails = Callable[[Schedule], Awaitable[bool]]


async def shrink(
    schedule: Schedule,
    fails: Fails,
    *,
    budget_s: float = 120.0,
    log: Callable[[str], None] | None = None,
) -> Schedule:
    deadline = time.monotonic() + budget_s
    ops: list[Op] = list(schedule.ops)
    chunks = 2
    while len(ops) > 1 and time.monotonic() < deadline:
        size = max(1, -(-len(ops) // chunks))
        removed = False
        start = 0
        while start < len(ops) and time.monotonic() < deadline:
            candidate = ops[:start] + ops[start + size :]
            if candidate and await fails(schedule.with_ops(candidate)):
                ops = candidate
                removed = True
                if log is not None:
                    log(f"shrink: {len(ops)} ops still fail")
                continue  # the same start now names the next chunk
            start += size
        if removed:
            chunks = max(2, chunks - 1)
        elif size == 1:
            break
        else:
            chunks = min(len(ops), chunks * 2)
    return schedule.with_ops(ops)


__all__ = ["shrink"]
