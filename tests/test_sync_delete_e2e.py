"""Deleting a session end to end: real runtimes, a real server on a loopback port.

The server deletes the session's content with its tombstone; a new device never downloads it,
and an offline device's later turn in the deleted session drains from its outbox.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from pleach_client.runtime import SessionRuntime
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


@pytest.mark.parametrize("batch", [200, 1])
@pytest.mark.parametrize("first", ["delete", "resolve"])
async def test_a_delete_beside_a_resolve_keeps_what_the_resolve_took_from_the_fork(
    cluster: Cluster, first: str, batch: int
) -> None:
    """A conflict forks a session; the phone writes a turn in the fork, then resolves the
    conflict toward the fork (the session takes copies of the fork's messages, the fork
    copies of the session's). The tablet, which never saw the resolve, deletes the session.
    The delete stands everywhere, and the turn written in the fork is still in a live session
    on every device, in whichever order the two reach the server."""
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    tablet = await cluster.device("tablet")
    phone.sync.batch_size = batch  # 1: the resolve's copies and its version in separate pushes
    session = await laptop.create_session(title="shared")
    await chat(laptop, session.id, "hello")
    await cluster.online(laptop, phone, tablet)
    await tablet.sync.disconnect()
    for rt in (laptop, phone):
        await rt.sync.disconnect()
    await chat(laptop, session.id, "laptop edit")
    await chat(phone, session.id, "phone edit")
    await cluster.online(laptop, phone)
    fork = next(
        s
        for s in await phone.store.list_sessions()
        if s.forked_from == session.id and s.conflict_id is not None
    )
    await chat(phone, fork.id, "written in the fork")
    await cluster.settle(laptop, phone)
    await phone.sync.disconnect()

    # Offline on both sides: the tablet deletes, the phone resolves toward the fork.
    await tablet.sessions.delete(session.id)
    # The fork's side, as the phone names it: "local" is the phone's own version.
    conflict = next(
        e for e in await phone.store.list_events(session.id) if e.type == "sync.conflict"
    )
    fork_side = fork.conflict_loser_side
    if conflict.payload["pushed_by"] != "phone":
        fork_side = "remote" if fork_side == "local" else "local"
    assert fork.conflict_id is not None and fork_side is not None
    receipt = await phone.sync.resolve_conflict(session.id, fork.conflict_id, fork_side)
    assert receipt.swapped
    kept: list[Any] = []
    for rt in (laptop, phone, tablet):
        rt.events.on("sync.delete.kept", kept.append)
    order = [tablet, phone] if first == "delete" else [phone, tablet]
    for rt in order:
        await cluster.online(rt)
    await cluster.settle(laptop, phone, tablet)

    async def live_texts(rt: SessionRuntime) -> dict[str, list[str]]:
        out = {}
        for s in await rt.store.list_sessions():
            texts = [m.content[0].get("text", "") for m in await rt.sessions.messages(s.id)]
            out[s.id] = [t for t in texts if isinstance(t, str)]
        return out

    views = [await live_texts(rt) for rt in (laptop, phone, tablet)]
    assert views[0] == views[1] == views[2]
    assert session.id not in views[0]
    assert any("written in the fork" in texts for texts in views[0].values())
    assert any("phone edit" in texts for texts in views[0].values())
    # Every device heard of it once, naming the session that keeps the resolved version.
    assert sorted(e.session_id for e in kept) == [session.id] * 3
    assert {e.fork_session_id for e in kept} <= set(views[0])
    (event,) = {e.fork_session_id for e in kept}
    assert "written in the fork" in views[0][event]
    # The phone, which wrote the kept version, gave the kept session copies of its own: on
    # every device its messages are filed under it, whatever the server drained (batch 1: the
    # resolve's copies reached it in pushes before the version, after the delete).
    for rt in (laptop, phone, tablet):
        assert {m.session_id for m in await rt.sessions.messages(event)} == {event}
