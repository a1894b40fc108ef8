"""Fan-out of a commit whose pusher is gone: the other devices still hear of it live.

The pusher's socket dies after the push transaction commits and before its acknowledgement is
written. The commit stands (the device learns it from ``Welcome.last_seq`` on reconnect); the
other connected devices must get the live page, or they would believe they are at the head
while they are not (found by the seeded simulation: a device "synced" at cursor 0 while the
server's head was 2).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pleach_server.server import SyncServer
from pleach_server.store.base import PushResult
from pleach_server.store.sqlite import SQLiteServerStore
from shared.messages import Push
from tests.server_factories import Device, new_tenant
from tests.test_server import SECRET, TIMEOUT, device


class GatedStore(SQLiteServerStore):
    """A store whose push commits, says so, then waits for the test before returning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.committed = asyncio.Event()
        self.release = asyncio.Event()

    async def push(self, *args: Any, **kwargs: Any) -> PushResult:
        result = await super().push(*args, **kwargs)
        self.committed.set()
        await self.release.wait()
        return result


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[tuple[SyncServer, GatedStore]]:
    async with (
        GatedStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
    ):
        yield srv, store


async def test_a_commit_reaches_the_others_when_the_pusher_died_before_its_ack(
    gated: tuple[SyncServer, GatedStore],
) -> None:
    srv, store = gated
    tenant = new_tenant()
    laptop, phone = Device(tenant), Device(tenant)
    session = laptop.session(title="written just before the laptop vanished")
    async with device(srv, phone) as watcher, device(srv, laptop) as pusher:
        await pusher.send(Push(changes=laptop.changes(session), request_id=2))
        async with asyncio.timeout(TIMEOUT):
            await store.committed.wait()
            (server_side,) = [c for c in srv.connections if c.client_id == laptop.client_id]
            pusher.ws.transport.abort()  # the laptop's network is gone, mid-push
            await server_side.ws.wait_closed()
            store.release.set()
            await watcher.live_until({session.id})
    assert session.id in watcher.live_ids()
