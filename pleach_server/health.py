"""Device health reports: kept in memory as they come, written to the store in batches.

A device tells the server how its sync stands (a ``Health`` frame) whenever that changes, at
most once a second, and every 30 s when nothing does (``pleach_client.sync``). An active
device's cursor and last flush change at every turn it writes and every page it applies, so
each connected device reports about once a second. Written as it came, each report was a
durable transaction of its own (an fsync on SQLite, a WAL flush on PostgreSQL): with 100
devices writing a turn every two seconds (``bench_live``), the server committed about two
health reports (1.7) for every push, and they took a fifth to a third of its CPU (SQLite).

``HealthReports`` is the one owner of the reports not yet written: the latest of each device
(a newer report replaces the one waiting), written together in one transaction
(``ServerStore.put_health``) at most ``flush_after`` seconds after the first of them came. The
sync-health page (``SyncServer.status_report``) writes what waits before it reads, so it
shows every report this process has. What a report costs to lose: a server that dies loses at
most the last ``flush_after`` seconds of reports, which devices send again when they reconnect
(a device reports at its first flush on a new connection) and whenever their sync changes.
With several server processes, a page served by one process shows another's reports as of
that process's last write (at most ``flush_after`` old).

A report is observation, never user data: nothing a device wrote waits here. The waiting
reports are bounded (``max_pending`` devices and ``max_bytes``; past either the oldest waiting
report goes, and is counted), as is what the store keeps (``MAX_DEVICES_PER_TENANT`` per
tenant).
"""

from __future__ import annotations

import asyncio
import logging

from shared.aio import reap
from shared.errors import InvalidState, StorageError, StorageUnavailable

from .store.base import DeviceHealth, ServerStore

__all__ = [
    "DEFAULT_FLUSH_AFTER_S",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_MAX_PENDING_BYTES",
    "HealthReports",
    "kept_after_failure",
]

log = logging.getLogger(__name__)

DEFAULT_FLUSH_AFTER_S = 1.0
"""How long a report may wait before it is written: the reports of that second share one
transaction."""
DEFAULT_MAX_PENDING = 10_000
"""How many devices' reports may wait at once (about a hundred bytes each, usually)."""
DEFAULT_MAX_PENDING_BYTES = 8 << 20
"""How many bytes of reports may wait at once (a report is at most about 12 KB: its texts
and its ten conflicts are bounded by the protocol)."""

Key = tuple[str, str, str]
"""A device: its org, user and client id."""


def key_of(report: DeviceHealth) -> Key:
    return (report.org_id, report.user_id, report.client_id)


def kept_after_failure(
    failed: dict[Key, DeviceHealth],
    waiting: dict[Key, DeviceHealth],
    max_pending: int,
    max_bytes: int,
) -> dict[Key, DeviceHealth]:
    """What waits after a write of ``failed`` did not happen, while ``waiting`` came in: every
    device's newest report (one that came meanwhile replaces the failed one), the failed ones
    first (they are older), at most ``max_pending`` of them and ``max_bytes`` of their
    bodies, the oldest going first (the newest always stays)."""
    kept = {k: r for k, r in failed.items() if k not in waiting}
    kept.update(waiting)
    size = sum(len(r.health) for r in kept.values())
    while len(kept) > 1 and (len(kept) > max_pending or size > max_bytes):
        size -= len(kept.pop(next(iter(kept))).health)
    return kept


class HealthReports:
    """The reports not yet written (see the module's docstring). ``start()`` it on the loop,
    ``put`` reports, ``flush()`` to write what waits now; ``close()`` writes what is left."""

    def __init__(
        self,
        store: ServerStore,
        *,
        flush_after: float = DEFAULT_FLUSH_AFTER_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if flush_after < 0:
            raise ValueError(f"flush_after must not be negative, got {flush_after}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self._store = store
        self.flush_after = flush_after
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self._waiting: dict[Key, DeviceHealth] = {}  # oldest first
        self._bytes = 0  # of the waiting reports' bodies
        self._due = asyncio.Event()
        self._lock = asyncio.Lock()  # one write at a time, in the order reports came
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        """Reports written so far."""
        self.writes = 0
        """Store transactions they took."""
        self.dropped = 0
        """Reports that went unwritten because ``max_pending`` others waited."""

    @property
    def waiting(self) -> int:
        """How many devices' reports wait to be written."""
        return len(self._waiting)

    def start(self) -> None:
        """Start writing reports in the background (on the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pleach-health-reports")

    def put(self, report: DeviceHealth) -> None:
        """Keep ``report`` as its device's latest; it is written within ``flush_after``. Past
        ``max_pending`` reports or ``max_bytes``, the oldest waiting go (and are counted)."""
        key = key_of(report)
        waiting = self._waiting
        replaced = waiting.pop(key, None)
        if replaced is not None:
            self._bytes -= len(replaced.health)
        waiting[key] = report  # the newest last
        self._bytes += len(report.health)
        while len(waiting) > 1 and (
            len(waiting) > self.max_pending or self._bytes > self.max_bytes
        ):
            self._bytes -= len(waiting.pop(next(iter(waiting))).health)
            self.dropped += 1
        self._due.set()

    async def flush(self) -> int:
        """Write every report waiting now, in one transaction; how many. On a failure they
        wait again (a newer report of a device that came meanwhile wins) and it raises."""
        async with self._lock:
            batch, self._waiting, self._bytes = self._waiting, {}, 0
            if not batch:
                return 0
            try:
                await self._store.put_health(list(batch.values()))
            except BaseException:
                came = len(self._waiting) + sum(1 for k in batch if k not in self._waiting)
                self._waiting = kept_after_failure(
                    batch, self._waiting, self.max_pending, self.max_bytes
                )
                self._bytes = sum(len(r.health) for r in self._waiting.values())
                self.dropped += came - len(self._waiting)
                raise
            self.written += len(batch)
            self.writes += 1
            return len(batch)

    async def close(self) -> None:
        """Stop the background writer and write what waits (a failure is logged: the devices
        report again when they reconnect)."""
        task, self._task = self._task, None
        if task is not None:
            await reap(task)
        try:
            await self.flush()
        except (StorageError, StorageUnavailable, InvalidState) as exc:
            log.warning("%d device health report(s) not written at close: %s", self.waiting, exc)

    async def _run(self) -> None:
        failing = False  # (a store that stays down is said once, and again when it is back)
        while True:
            await self._due.wait()
            # The reports of the next ``flush_after`` seconds join this write.
            await asyncio.sleep(self.flush_after)
            self._due.clear()
            try:
                await self.flush()
            except (StorageError, StorageUnavailable, InvalidState) as exc:
                # They wait again, and are tried again after ``flush_after``.
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "%d device health report(s) not written: %s", self.waiting, exc)
                failing = True
                self._due.set()
            except Exception:
                log.exception("device health reports not written")
                self._due.set()
            else:
                if failing:
                    log.warning("device health reports written again")
                failing = False
