"""Fan-out of a commit whose pusher is gone: the other devices still hear of it live.

The pusher's socket dies after the push transaction commits and before its acknowledgement is
written. The commit stands (the device learns it from ``Welcome.last_seq`` on reconnect); the
other connected devices must get the live page, or they would believe they are at the head
while they are not (found by the seeded simulation: a device "synced" at cursor 0 while the
server's head was 2).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
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


class CountingStore(SQLiteServerStore):
    """Counts the pulls the server makes (a live page read back from the store)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pulls = 0

    async def pull(self, *args: Any, **kwargs: Any) -> Any:
        self.pulls += 1
        return await super().pull(*args, **kwargs)


@pytest.mark.parametrize("seed", range(4))
async def test_every_live_page_is_the_feed_page_a_pull_returns(tmp_path: Path, seed: int) -> None:
    """Live pages are published from the push that committed them when its rows directly
    follow the page's start, and read back from the store otherwise (another push of the
    tenant came between). Generated schedules of concurrent pushes by three devices of one
    user (and another user's, whose cursors interleave): every live page a watcher gets is,
    change for change, what a pull of the same range returns, and together they cover the
    whole feed."""
    rng = random.Random(seed)
    tenant, other = new_tenant(), new_tenant()
    writers = [Device(tenant) for _ in range(3)]
    stranger = Device(other)
    async with (
        CountingStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
    ):
        async with AsyncExitStack() as stack:
            watcher = await stack.enter_async_context(device(srv, Device(tenant)))
            clients = [await stack.enter_async_context(device(srv, w)) for w in writers]
            outsider = await stack.enter_async_context(device(srv, stranger))
            sessions: dict[int, Any] = {}
            pushes = 0

            async def push(i: int, dev: Device, client: Any) -> None:
                nonlocal pushes
                records: list[Any] = []
                for _ in range(rng.randint(1, 60)):
                    if i in sessions and rng.random() < 0.7:
                        records.append(dev.message(sessions[i].id, "x" * rng.randint(1, 300)))
                    else:
                        sessions[i] = dev.session(title=f"s{i}")
                        records.append(sessions[i])
                ack = await client.push(dev.changes(*records))
                assert all(r.status == "applied" for r in ack.results), ack
                pushes += 1

            for _ in range(6):
                batch = [push(i, writers[i], clients[i]) for i in range(3) if rng.random() < 0.8]
                batch.append(push(9, stranger, outsider))
                await asyncio.gather(*batch)
            read_back = store.pulls  # by the fan-out alone: nobody else pulled yet
            feed = await watcher.pull_all()
            await watcher.live_until({c.record.id for c in feed})
        for frame in watcher.live:
            page = await store.pull(tenant, frame.from_cursor, 10_000)
            page_changes = [c for c in page.changes if c.cursor <= frame.to_cursor]
            assert frame.changes == page_changes[: len(frame.changes)]
            assert frame.changes == page_changes or frame.more
        live = {c.cursor for frame in watcher.live for c in frame.changes}
        assert {c.cursor for c in feed} <= live
        assert 0 < read_back < pushes  # both ways were taken; most pages were not read back


async def test_the_others_hear_of_a_push_before_its_pusher_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push's live page is queued for the other devices, and written to them, before the
    pusher's ack is queued: the change reaching another device is the latency that counts,
    and it never waits for the pusher's socket (nor for the ack's encoding and write)."""
    from pleach_server.connection import Connection, ConnectionContext
    from shared.protocol import ServerProtocol

    order: list[str] = []
    fan_out, send_push_ack = ConnectionContext.fan_out, ServerProtocol.send_push_ack
    take = Connection._take

    def taking(self: Any, kind: str) -> int:
        if kind == "changes_live":
            order.append("page written")
        return take(self, kind)

    monkeypatch.setattr(Connection, "_take", taking)

    async def fanning(self: Any, *args: Any, **kwargs: Any) -> Any:
        order.append("fan-out")
        return await fan_out(self, *args, **kwargs)

    def acking(self: Any, *args: Any, **kwargs: Any) -> Any:
        order.append("ack")
        return send_push_ack(self, *args, **kwargs)

    monkeypatch.setattr(ConnectionContext, "fan_out", fanning)
    monkeypatch.setattr(ServerProtocol, "send_push_ack", acking)
    tenant = new_tenant()
    laptop, phone = Device(tenant), Device(tenant)
    async with (
        SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
        device(srv, phone) as watcher,
        device(srv, laptop) as pusher,
    ):
        sessions = [laptop.session(title=f"s{i}") for i in range(3)]
        for i, session in enumerate(sessions):
            await pusher.send(Push(changes=laptop.changes(session), request_id=10 + i))
            async with asyncio.timeout(TIMEOUT):
                await watcher.live_until({session.id})
    assert order == ["fan-out", "page written", "ack"] * 3
