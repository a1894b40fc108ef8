"""Fan-out of committed changes to the connected devices of a tenant.

Each device connection subscribes once (after ``Welcome``) and gets a ``Subscription``: a
BOUNDED queue of live ``Changes`` frames that the connection's writer drains. ``publish``
never awaits: it appends to every queue of the tenant and returns. A device that falls
``queue_size`` frames behind is cut: its queue is replaced by one empty live marker
``Changes(from_cursor=to, to_cursor=to, changes=[], live=True)``, which the device reads as
"you are behind: pull from your cursor". A slow device therefore costs the publisher nothing
and never holds more than ``queue_size`` frames of memory.
"""

from __future__ import annotations

import asyncio
from collections import deque

from shared.errors import InvalidState
from shared.messages import Changes, FeedBody
from shared.records import FeedChange

from .store.base import Tenant

__all__ = ["DEFAULT_QUEUE_SIZE", "Hub", "Subscription"]

DEFAULT_QUEUE_SIZE = 256


class Subscription:
    """One device's queue of live frames. Drain it with ``await get()``; ``close()`` when done.

    Not thread-safe: use from the event loop that runs the hub.
    """

    def __init__(self, hub: Hub, tenant: Tenant, maxsize: int) -> None:
        self.hub = hub
        self.tenant = tenant
        self.maxsize = maxsize
        self.cuts = 0  # times this device fell behind and was cut
        self.dropped = 0  # frames dropped by those cuts
        self.closed = False
        self._frames: deque[Changes] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._frames)

    def offer(self, frame: Changes) -> bool:
        """Queue ``frame`` without waiting; returns False when the queue was full and cut.

        After a cut the queue holds only the marker for ``frame.to_cursor``.
        """
        if self.closed:
            return True
        if len(self._frames) < self.maxsize:
            self._frames.append(frame)
            self._ready.set()
            return True
        dropped = len(self._frames) + 1  # the queued frames and the one that did not fit
        self._frames.clear()
        self._frames.append(
            Changes(
                from_cursor=frame.to_cursor,
                to_cursor=frame.to_cursor,
                changes=[],
                live=True,
            )
        )
        self._ready.set()
        self.cuts += 1
        self.dropped += dropped
        self.hub.drops += dropped
        self.hub.cuts += 1
        return False

    def get_nowait(self) -> Changes | None:
        """The next frame, or ``None`` when the queue is empty."""
        if not self._frames:
            return None
        frame = self._frames.popleft()
        if not self._frames:
            self._ready.clear()
        return frame

    async def get(self) -> Changes:
        """Wait for the next frame. Raises ``InvalidState`` once the subscription is closed."""
        while True:
            if self.closed:
                raise InvalidState("subscription is closed")
            frame = self.get_nowait()
            if frame is not None:
                return frame
            await self._ready.wait()

    def close(self) -> None:
        """Unsubscribe: no more frames arrive; a waiting ``get`` raises ``InvalidState``."""
        if self.closed:
            return
        self.closed = True
        self._frames.clear()
        self._ready.set()  # wake a waiting get() so it sees `closed`
        self.hub._remove(self)


class Hub:
    """The connected devices of every tenant, and fan-out to them.

    ``queue_size`` bounds each device's queue of live frames (default 256). ``drops`` counts
    frames discarded by cuts and ``cuts`` the cuts themselves, for metrics.
    """

    def __init__(self, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.queue_size = queue_size
        self.drops = 0
        self.cuts = 0
        self.published = 0
        self._subs: dict[Tenant, set[Subscription]] = {}
        # Highest feed cursor known per tenant with subscribers here: a commit's live frame
        # starts from it, so the frame is a complete feed page (see ``head``).
        self._heads: dict[Tenant, int] = {}

    def subscribe(self, tenant: Tenant) -> Subscription:
        """Register a device of ``tenant``; call ``close()`` on the result when it leaves."""
        sub = Subscription(self, tenant, self.queue_size)
        self._subs.setdefault(tenant, set()).add(sub)
        return sub

    def subscribers(self, tenant: Tenant) -> int:
        return len(self._subs.get(tenant, ()))

    def head(self, tenant: Tenant) -> int | None:
        """The highest feed cursor of ``tenant`` this hub has seen, or ``None`` if unknown.

        It never exceeds the tenant's real head, so a commit made after reading it can be
        published as the page ``(head, new head]``: complete, and ``from_cursor`` no higher
        than the device's cursor unless the device really missed something. Known only
        while the tenant has subscribers.
        """
        return self._heads.get(tenant)

    def note_head(self, tenant: Tenant, cursor: int) -> None:
        """Record a head read from the store (e.g. for ``Welcome``); ignored without subscribers."""
        if tenant in self._subs and cursor > self._heads.get(tenant, -1):
            self._heads[tenant] = cursor

    def __len__(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    def publish(
        self,
        tenant: Tenant,
        from_cursor: int,
        to_cursor: int,
        changes: list[FeedChange],
        *,
        bodies: list[FeedBody] | None = None,
        skip: Subscription | None = None,
    ) -> int:
        """Queue a live ``Changes`` frame for every device of ``tenant`` but ``skip``; returns
        how many.

        ``from_cursor`` is the tenant's head before the commit and ``to_cursor`` after it, so a
        device whose cursor is below ``from_cursor`` knows to pull first. Never waits. The one
        frame object is shared by all queues: treat it as read-only. ``skip``: the device whose
        push this is, when it learns its rows from the acknowledgement (protocol 5).
        """
        subs = self._subs.get(tenant)
        if not subs:
            return 0
        frame = Changes(
            from_cursor=from_cursor,
            to_cursor=to_cursor,
            changes=changes,
            live=True,
            bodies=bodies or [],
        )
        offered = 0
        for sub in subs:
            if sub is not skip:
                sub.offer(frame)
                offered += 1
        if to_cursor > self._heads.get(tenant, -1):
            self._heads[tenant] = to_cursor
        self.published += 1
        return offered

    def close(self) -> None:
        """Close every subscription (their waiting ``get`` calls raise ``InvalidState``)."""
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.close()

    def _remove(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.tenant)
        if subs is None:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.tenant]
            self._heads.pop(sub.tenant, None)
