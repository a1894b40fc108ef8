"""``reap``: stop a task and wait for it, without swallowing the caller's own cancellation.

The usual ``task.cancel()`` then ``with suppress(CancelledError): await task`` cannot tell the
task's cancellation from the caller's: when the caller is itself cancelled while it waits
(a ``disconnect()`` landing in a connection's clean-up), the suppress eats that too, and the
caller runs on as if nothing had asked it to stop; whoever awaits it then waits for ever.
``reap`` re-raises the ``CancelledError`` when the running task has a cancellation pending
(``Task.cancelling()``), and swallows it only when it is the reaped task's.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["reap"]


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
