"""``PostgresNotifier``: cross-process fan-out over PostgreSQL ``LISTEN/NOTIFY``.

Every push that writes feed entries NOTIFYs ``pleach_feed`` inside its own transaction (see
``postgres.py``), so a notification exists exactly for each committed push, is delivered
only after the commit is visible, and arrives in commit order. ``publish`` therefore has
nothing to send: it is a no-op.

Every process LISTENs on one dedicated connection, including the process that committed.
**Dedupe rule:** the committing process serves its own devices from its local ``Hub`` right
after the commit (``ConnectionContext.fan_out``), so its notifier drops notifications that
carry its own server id, as the ``Notifier`` contract requires; other processes call
``on_commit(tenant, from, to)``, which reads that page once and publishes it to their hub.

Delivery is serial (``on_commit`` finishes before the next starts) and bounded: notifications
wait in a queue of at most ``max_pending`` entries, and consecutive remote notifications of a
tenant are merged into one page (never across one of this process's own commits, which its
devices already have). On overflow the oldest entry is dropped and counted in ``dropped``;
those devices get the changes on their next pull.

When the listening connection is lost, the notifier reconnects by itself with exponential
backoff (``reconnect_min`` doubling up to ``reconnect_max``). A ping every ``ping_interval``
seconds notices a connection that died silently. Commits that happen while it is not
listening are not replayed: devices of this process see them on their next pull (they pull
after every reconnect and after a retried push).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from shared.errors import InvalidState, StorageError, StorageUnavailable, SyncError

from ..notify import CommitCallback
from .base import Tenant
from .postgres import DEFAULT_SCHEMA, NOTIFY_CHANNEL, redact_dsn

__all__ = ["DEFAULT_MAX_PENDING", "PostgresNotifier"]

logger = logging.getLogger("pleach_server.pg_notify")

DEFAULT_MAX_PENDING = 10_000

_CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
)


@dataclass(slots=True)
class _Page:
    """A tenant's feed page ``(from_cursor, to_cursor]`` waiting to be delivered."""

    tenant: Tenant
    from_cursor: int
    to_cursor: int


class PostgresNotifier:
    """The ``Notifier`` of servers sharing one PostgreSQL database; see the module docstring.

    ``server_id`` must be the ``SyncServer``'s id (the pushes it commits carry it in their
    notifications); ``schema`` the store's schema (other schemas' notifications are ignored).
    """

    def __init__(
        self,
        dsn: str,
        *,
        server_id: str,
        schema: str = DEFAULT_SCHEMA,
        channel: str = NOTIFY_CHANNEL,
        max_pending: int = DEFAULT_MAX_PENDING,
        reconnect_min: float = 0.1,
        reconnect_max: float = 5.0,
        ping_interval: float = 10.0,
        connect_timeout: float = 5.0,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        if not 0 < reconnect_min <= reconnect_max:
            raise ValueError("need 0 < reconnect_min <= reconnect_max")
        if not server_id:
            raise ValueError("server_id must not be empty")
        self.dsn = dsn
        self.server_id = server_id
        self.schema = schema
        self.channel = channel
        self.max_pending = max_pending
        self.reconnect_min = reconnect_min
        self.reconnect_max = reconnect_max
        self.ping_interval = ping_interval
        self.connect_timeout = connect_timeout
        self.application_name = f"pleach-listen-{server_id}"[:63]
        self.published = 0  # local commits announced (no-ops: the push NOTIFYs itself)
        self.delivered = 0  # remote pages handed to on_commit
        self.own = 0  # notifications of this process's own commits, skipped
        self.ignored = 0  # notifications of another schema, skipped
        self.dropped = 0  # pages dropped on overflow
        self.reconnects = 0
        self._on_commit: CommitCallback | None = None
        self._conn: Any = None
        self._pending: deque[_Page] = deque()
        self._open_tail: dict[Tenant, _Page] = {}  # the last queued page of a tenant, mergeable
        self._wakeup = asyncio.Event()
        self._lost = asyncio.Event()
        self._listening = asyncio.Event()
        self._reconnected = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def __repr__(self) -> str:
        state = "listening" if self.listening else "not listening"
        return f"<PostgresNotifier {redact_dsn(self.dsn)} {self.channel} {state}>"

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up."""
        return self._listening.is_set()

    async def wait_reconnected(self, count: int = 1) -> None:
        """Return once the LISTEN connection has been restored ``count`` times in all."""
        async with self._reconnected:
            await self._reconnected.wait_for(lambda: self.reconnects >= count)

    # -- Notifier ----------------------------------------------------------------------------

    async def start(self, on_commit: CommitCallback) -> None:
        """Connect and LISTEN; raises ``StorageUnavailable`` if the database is unreachable."""
        if self._on_commit is not None:
            raise InvalidState("notifier already started")
        if self._closing:
            raise InvalidState("notifier is closed")
        self._on_commit = on_commit
        try:
            await self._listen()
        except _CONNECT_ERRORS as exc:
            self._on_commit = None
            raise StorageUnavailable(
                f"cannot LISTEN on PostgreSQL at {redact_dsn(self.dsn)}: {exc}"
            ) from exc
        self._tasks = [
            asyncio.create_task(self._deliver_loop(), name="pleach-notify-deliver"),
            asyncio.create_task(self._watch_loop(), name="pleach-notify-watch"),
        ]

    async def publish(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        # The push transaction already NOTIFYed, atomically with its commit.
        self.published += 1

    async def close(self) -> None:
        """Stop listening and close the connection; idempotent, shielded from cancellation."""
        self._closing = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        conn, self._conn = self._conn, None
        self._listening.clear()
        if conn is not None:
            await asyncio.shield(self._close_conn(conn))
        self._pending.clear()
        self._open_tail.clear()
        self._on_commit = None

    # -- the LISTEN connection ---------------------------------------------------------------

    async def _listen(self) -> None:
        conn = await asyncpg.connect(
            self.dsn,
            timeout=self.connect_timeout,
            server_settings={"application_name": self.application_name},
        )
        try:
            await conn.add_listener(self.channel, self._on_notification)
            conn.add_termination_listener(self._on_terminated)
        except BaseException:
            await asyncio.shield(self._close_conn(conn))
            raise
        self._conn = conn
        self._lost.clear()
        self._listening.set()

    async def _close_conn(self, conn: Any) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout):
                await conn.close()
        except _CONNECT_ERRORS as exc:
            logger.debug("closing the LISTEN connection failed (%s); terminating it", exc)
            conn.terminate()

    def _on_terminated(self, conn: Any) -> None:
        if conn is self._conn and not self._closing:
            logger.warning("LISTEN connection to %s lost; reconnecting", redact_dsn(self.dsn))
            self._listening.clear()
            self._lost.set()

    async def _watch_loop(self) -> None:
        """Reconnect when the connection is lost; ping it so a silent death is noticed."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.ping_interval):
                    await self._lost.wait()
            if not self._lost.is_set():
                await self._ping()
                continue
            old, self._conn = self._conn, None
            if old is not None:
                old.terminate()
            await self._reconnect()

    async def _ping(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            async with asyncio.timeout(self.connect_timeout):
                await conn.fetchval("SELECT 1")
        except _CONNECT_ERRORS as exc:
            logger.warning("LISTEN connection ping failed (%s); reconnecting", exc)
            self._listening.clear()
            self._lost.set()

    async def _reconnect(self) -> None:
        delay = self.reconnect_min
        while True:
            try:
                await self._listen()
            except _CONNECT_ERRORS as exc:
                logger.info("LISTEN reconnect failed (%s); next try in %.1fs", exc, delay)
                await asyncio.sleep(delay)  # backoff between attempts, not a wait on an event
                delay = min(delay * 2, self.reconnect_max)
                continue
            logger.info("LISTEN connection to %s restored", redact_dsn(self.dsn))
            async with self._reconnected:
                self.reconnects += 1
                self._reconnected.notify_all()
            return

    # -- notifications -----------------------------------------------------------------------

    def _on_notification(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            note = json.loads(payload)
            tenant = Tenant(org_id=str(note["org"]), user_id=str(note["user"]))
            from_cursor, to_cursor = int(note["from"]), int(note["to"])
            schema, server = note.get("schema"), note.get("server")
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning(
                "ignoring a malformed %s notification %r: %s", self.channel, payload, exc
            )
            return
        if schema != self.schema:
            self.ignored += 1
            return
        if server == self.server_id:
            # Our own commit: our devices already have it. Seal the tenant's queued page so
            # a later remote page is never merged across it (that would resend this one).
            self.own += 1
            self._open_tail.pop(tenant, None)
            return
        self._enqueue(tenant, from_cursor, to_cursor)

    def _enqueue(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        tail = self._open_tail.get(tenant)
        if tail is not None:
            # Remote commits of one tenant arrive in cursor order: extend the queued page.
            tail.to_cursor = max(tail.to_cursor, to_cursor)
            return
        if len(self._pending) >= self.max_pending:
            oldest = self._pending.popleft()
            if self._open_tail.get(oldest.tenant) is oldest:
                del self._open_tail[oldest.tenant]
            self.dropped += 1
            logger.warning(
                "notification queue full (%d): dropped %s (%d, %d]; its devices catch up by pull",
                self.max_pending,
                oldest.tenant,
                oldest.from_cursor,
                oldest.to_cursor,
            )
        page = _Page(tenant, from_cursor, to_cursor)
        self._pending.append(page)
        self._open_tail[tenant] = page
        self._wakeup.set()

    async def _deliver_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                page = self._pending.popleft()
                if self._open_tail.get(page.tenant) is page:
                    del self._open_tail[page.tenant]  # being delivered: no longer mergeable
                await self._deliver(page)

    async def _deliver(self, page: _Page) -> None:
        on_commit = self._on_commit
        if on_commit is None:
            return
        try:
            await on_commit(page.tenant, page.from_cursor, page.to_cursor)
        except (SyncError, StorageError) as exc:
            logger.warning(
                "delivering %s (%d, %d] failed: %s",
                page.tenant,
                page.from_cursor,
                page.to_cursor,
                exc,
            )
        except Exception:
            # A bug in the callback must not stop delivery for every other tenant.
            logger.exception("on_commit failed for %s", page.tenant)
        else:
            self.delivered += 1
