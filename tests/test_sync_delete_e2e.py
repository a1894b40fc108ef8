"""Deleting a session end to end: real runtimes, a real server on a loopback port.

The server deletes the session's content with its tombstone; a new device never downloads it,
and an offline device's later turn in the deleted session drains from its outbox.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from pleach_server.store import ServerStore
from shared.records import CASCADE_KINDS, Record, Session, record_kind
from tests.server_store_conformance import pull_all
from tests.test_sync_e2e import ALICE, Cluster, chat


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        c = Cluster(tmp_path, stack)
        await c.start_server()
        try:
            yield c
        finally:
            await stack.aclose()
            if c.server is not None:
                await c.stop_server()


def _belongs(record: Record, session_id: str) -> bool:
    return record.id == session_id or getattr(record, "session_id", None) == session_id


async def _server_feed(store: ServerStore | None, session_id: str) -> list[Record]:
    assert store is not None
    return [c.record for c in await pull_all(store, ALICE) if _belongs(c.record, session_id)]


async def test_a_deleted_sessions_content_leaves_the_server(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session(title="to delete")
    await chat(laptop, session.id, "first")
    await cluster.online(laptop, phone)
    kinds = {record_kind(r) for r in await _server_feed(cluster.store, session.id)}
    assert {"Message", "Checkpoint"} <= kinds

    # The phone goes offline and writes a turn the server will only see after the delete.
    await phone.sync.disconnect()
    await chat(phone, session.id, "written offline")
    await laptop.delete_session(session.id)
    await cluster.settle(laptop)

    feed = await _server_feed(cluster.store, session.id)
    assert not [r for r in feed if record_kind(r) in CASCADE_KINDS]
    latest = [r for r in feed if isinstance(r, Session)][-1]
    assert latest.deleted

    await cluster.online(phone)
    await cluster.settle(laptop, phone)
    status = await phone.sync.status()
    assert status.pending == 0 and status.dead_letters == 0
    feed = await _server_feed(cluster.store, session.id)
    assert not [r for r in feed if record_kind(r) in CASCADE_KINDS]
    row = await phone.store.get_session(session.id)
    assert row is not None and row.deleted

    # A new device downloads the tombstone and the event log, no content.
    tablet = await cluster.device("tablet")
    await cluster.online(tablet)
    row = await tablet.store.get_session(session.id)
    assert row is not None and row.deleted
    assert await tablet.store.list_checkpoints(session.id) == []
    events = await tablet.store.list_events(session.id)
    assert events and (await tablet.events.verify_chain(session.id)).ok
