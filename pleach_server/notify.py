"""Cross-instance fan-out: tell the other server processes that a tenant's feed grew.

A ``Notifier`` carries only ``(tenant, from_cursor, to_cursor)``, never records. The server
publishes one after every commit that wrote feed entries. On a notification from ANOTHER
instance, the notifier calls the server's ``on_commit`` callback, which reads that feed page
once (``store.pull(tenant, from_cursor, to_cursor - from_cursor)``) and publishes it to its own
``Hub``. Local devices are always served by the local hub directly, never through here.

``LocalNotifier`` is the single-process implementation: there is nobody else to tell. A
Postgres ``LISTEN/NOTIFY`` implementation plugs in behind the same protocol.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from .store.base import Tenant

__all__ = ["CommitCallback", "LocalNotifier", "Notifier"]

CommitCallback = Callable[[Tenant, int, int], Awaitable[None]]
"""``on_commit(tenant, from_cursor, to_cursor)``: another instance committed that page."""


@runtime_checkable
class Notifier(Protocol):
    """Cross-instance commit notifications.

    Contract: ``start`` is called once, before any ``publish``; ``on_commit`` is only called
    for commits published by OTHER instances (an implementation that hears its own
    notifications filters them out); ``on_commit`` runs to completion before the next one is
    delivered, and may raise ``SyncError`` (logged by the caller). ``close`` is idempotent.
    """

    async def start(self, on_commit: CommitCallback) -> None:
        """Begin listening; deliver remote commits to ``on_commit``."""
        ...

    async def publish(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        """Announce a local commit of ``(from_cursor, to_cursor]`` for ``tenant``.

        Best effort: a failure must not undo or fail the push (devices catch up by pull).
        """
        ...

    async def close(self) -> None:
        """Stop listening and release connections."""
        ...


class LocalNotifier:
    """One server process: nothing crosses instances, so every call is a no-op."""

    def __init__(self) -> None:
        self.on_commit: CommitCallback | None = None
        self.published = 0

    async def start(self, on_commit: CommitCallback) -> None:
        self.on_commit = on_commit

    async def publish(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        self.published += 1

    async def close(self) -> None:
        self.on_commit = None
