"""Multi-device sync end to end: a real server on a free loopback port, real runtimes on
SQLite files, real websockets. Waits are on conditions (``wait_until_synced``, events)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pleach_client import sync as sync_module
from pleach_client.hydration import hydrate, load_hydration
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import WriteBatch
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import ServerStore, SQLiteServerStore, Tenant
from shared import compact
from shared.clock import HybridClock
from shared.errors import CursorTooOld, ErrorCode, StorageError
from shared.ids import uuid7
from shared.messages import MAX_PROTOCOL
from shared.records import Message
from tests.server_factories import rewrite_page, rewrite_push

SECRET = b"test-secret-for-sync"
ALICE = Tenant(org_id="acme", user_id="alice")


class Cluster:
    """A server and the devices connected to it, torn down together."""

    def __init__(self, tmp: Path, stack: AsyncExitStack) -> None:
        self.tmp = tmp
        self.stack = stack
        self.store: ServerStore | None = None
        self.server: SyncServer | None = None
        self.port = 0

    async def start_server(self, store: ServerStore | None = None) -> SyncServer:
        if store is None:
            store = SQLiteServerStore(self.tmp / "server.db")
            await store.open()
        self.store = store
        self.server = SyncServer(store, port=self.port, secret=SECRET)
        await self.server.start()
        self.port = self.server.port
        return self.server

    async def stop_server(self) -> None:
        assert self.server is not None and self.store is not None
        await self.server.shutdown()
        await self.store.close()
        self.server = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/sync"

    def token(
        self, tenant: Tenant = ALICE, ttl: int | None = 3600, now: float | None = None
    ) -> str:
        return issue_token(SECRET, tenant, ttl, now=now)

    async def device(self, name: str, tenant: Tenant = ALICE) -> SessionRuntime:
        rt = SessionRuntime(
            SQLiteAdapter(self.tmp / f"{name}.db"),
            ScriptedProvider(),
            user_id=tenant.user_id,
            org_id=tenant.org_id,
            client_id=name,
        )
        await self.stack.enter_async_context(rt)
        rt.sync.backoff_initial = 0.01
        rt.sync.backoff_max = 0.2
        return rt

    async def online(self, *devices: SessionRuntime) -> None:
        for rt in devices:
            await rt.sync.connect(
                self.url, self.token(Tenant(org_id=rt.org_id, user_id=rt.user_id))
            )
        await self.settle(*devices)

    async def settle(self, *devices: SessionRuntime) -> None:
        for _ in range(3):  # each device's pushes reach the others live; go round twice
            for rt in devices:
                assert await rt.sync.wait_until_synced(20), await rt.sync.status()


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


async def chat(rt: SessionRuntime, session_id: str, text: str) -> list[StreamEventBase]:
    return [e async for e in rt.execute_message(session_id, text)]


PROSE = (
    "A device that was offline for a week brings back a long conversation, and every word of "
    "it must reach the other devices as it was written, whatever protocol each one speaks."
)


async def message_texts(rt: SessionRuntime, session_id: str) -> list[str]:
    """The texts of the session's messages on ``rt``'s device, in order."""
    row = await rt.store.get_session(session_id)
    assert row is not None
    messages = await rt.store.get_messages(row.state.message_ids)
    return [str(block.get("text", "")) for m in messages for block in m.content]


async def snapshot(rt: SessionRuntime, session_id: str) -> dict[str, Any]:
    row = await rt.store.get_session(session_id)
    assert row is not None
    events = await rt.store.list_events(session_id)
    return {
        "messages": row.state.message_ids,
        "head": row.head_checkpoint_id,
        "vv": row.vv,
        "checkpoints": [c.id for c in await rt.checkpoints.list(session_id)],
        "events": [(e.id, e.sequence_number, e.row_hash) for e in events],
        "audit": sorted(r.id for r in await rt.audit.rows(session_id)),
    }


async def test_two_offline_devices_converge(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    status = await laptop.sync.status()
    assert status.state == "offline" and not status.has_synced
    session = await laptop.create_session(title="plane")
    await chat(laptop, session.id, "written on a plane")
    await chat(laptop, session.id, "still offline")
    offline = await laptop.sync.status()
    assert offline.pending > 0 and offline.state == "offline"
    stuck = await laptop.sync.flush_outbox()
    assert stuck.outcome == "all-stuck" and stuck.failed_entries
    assert "offline" in stuck.failed_entries[0].message

    other = await phone.create_session(title="phone notes")
    await chat(phone, other.id, "from the phone")
    await cluster.online(laptop, phone)

    for sid in (session.id, other.id):
        a, b = await snapshot(laptop, sid), await snapshot(phone, sid)
        assert a == b
        assert all(seq == i + 1 for i, (_, seq, _) in enumerate(a["events"]))
        assert (await laptop.events.verify_chain(sid)).ok
        assert (await phone.events.verify_chain(sid)).ok
    laptop_status = await laptop.sync.status()
    assert laptop_status.pending == 0 and laptop_status.has_synced
    assert laptop_status.state == "connected" and laptop_status.cursor > 0

    # The phone continues the laptop's conversation; the laptop gets it live.
    resumed = await phone.resume_session(session.id)
    assert len(resumed.message_ids) == 4
    await chat(phone, session.id, "continued on the phone")
    await cluster.settle(phone, laptop)
    assert await snapshot(laptop, session.id) == await snapshot(phone, session.id)
    texts = [
        m.content[0].get("text")
        for m in await laptop.sessions.messages(session.id)
        if m.role == "user"
    ]
    assert texts == ["written on a plane", "still offline", "continued on the phone"]


async def test_concurrent_edits_fork_and_resolve(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session(title="shared")
    await chat(laptop, session.id, "hello")
    await cluster.online(laptop, phone)
    await laptop.sync.disconnect()
    await phone.sync.disconnect()

    await chat(laptop, session.id, "laptop edit")
    await chat(phone, session.id, "phone edit")
    conflicts: dict[str, list[Any]] = {"laptop": [], "phone": []}
    laptop.events.on("sync.conflict", conflicts["laptop"].append)
    phone.events.on("sync.conflict", conflicts["phone"].append)

    await cluster.online(laptop)
    await phone.sync.connect(cluster.url, cluster.token())
    await cluster.settle(phone, laptop)
    assert len(conflicts["phone"]) == 1 and len(conflicts["laptop"]) == 1
    event = conflicts["phone"][0]
    assert event.session_id == session.id
    paths = {p.path for p in event.conflicted_paths}
    assert "state.message_ids" in paths and "head_checkpoint_id" in paths
    fork_id = event.fork_session_id

    for rt in (laptop, phone):
        fork = await rt.sessions.find(fork_id)
        assert fork is not None and fork.forked_from == session.id
        assert fork.conflict_id == event.conflict_id
    assert await snapshot(laptop, session.id) == await snapshot(phone, session.id)
    assert await snapshot(laptop, fork_id) == await snapshot(phone, fork_id)
    # Nothing was lost: both edits exist, one on the session, the other on the fork.
    texts = set()
    for sid in (session.id, fork_id):
        for m in await laptop.sessions.messages(sid):
            texts.add(m.content[0].get("text"))
    assert {"laptop edit", "phone edit"} <= texts

    winner_before = [
        m.content for m in await laptop.sessions.messages(session.id)
    ]  # the swap moves copies (new ids): compare what the messages say
    loser_before = [m.content for m in await laptop.sessions.messages(fork_id)]
    loser_side = (await phone.store.get_session(fork_id)).conflict_loser_side  # type: ignore[union-attr]
    assert loser_side in ("local", "remote")
    receipt = await phone.sync.resolve_conflict(session.id, event.conflict_id, loser_side)
    assert receipt.resolved and receipt.swapped and receipt.resolution == loser_side
    await cluster.settle(phone, laptop)
    for rt in (laptop, phone):
        now = await rt.store.get_session(session.id)
        fork = await rt.store.get_session(fork_id)
        assert now is not None and fork is not None
        assert [m.content for m in await rt.sessions.messages(fork_id)] == winner_before
        assert [m.content for m in await rt.sessions.messages(session.id)] == loser_before
        # Each holds copies of its own: neither depends on the other's content any more.
        assert not set(fork.state.message_ids) & set(now.state.message_ids)
    assert await snapshot(laptop, session.id) == await snapshot(phone, session.id)
    again = await phone.sync.resolve_conflict(session.id, event.conflict_id, loser_side)
    assert again.resolved and not again.swapped


@pytest.mark.parametrize("who", ["pusher", "holder"])
async def test_local_is_the_calling_devices_version(cluster: Cluster, who: str) -> None:
    """As in the reference: ``resolve_conflict(..., "local")`` keeps the caller's own
    version on the session id, whether the caller pushed last or wrote the version the
    server held; "remote" keeps the other device's."""
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session(title="shared")
    await chat(laptop, session.id, "hello")
    await cluster.online(laptop, phone)
    await laptop.sync.disconnect()
    await phone.sync.disconnect()
    await chat(laptop, session.id, "laptop edit")
    await chat(phone, session.id, "phone edit")
    await cluster.online(laptop)  # the laptop's version is stored first
    await cluster.online(phone)  # the phone pushes last: it is the pusher
    await cluster.settle(laptop, phone)
    caller = phone if who == "pusher" else laptop
    own = "phone edit" if caller is phone else "laptop edit"
    conflict = next(
        e for e in await caller.store.list_events(session.id) if e.type == "sync.conflict"
    )
    assert conflict.payload["pushed_by"] == "phone" and conflict.payload["stored_by"] == "laptop"

    async def texts(sid: str) -> list[str]:
        return [m.content[0].get("text") for m in await caller.sessions.messages(sid)]

    receipt = await caller.sync.resolve_conflict(
        session.id, conflict.payload["conflict_id"], "local"
    )
    assert receipt.resolved and receipt.resolution == "local"
    assert own in await texts(session.id)
    await cluster.settle(laptop, phone)
    for rt in (laptop, phone):
        shown = [m.content[0].get("text") for m in await rt.sessions.messages(session.id)]
        assert own in shown
    again = await caller.sync.resolve_conflict(
        session.id, conflict.payload["conflict_id"], "remote"
    )
    assert again.swapped and own not in await texts(session.id)


@pytest.mark.parametrize("batch", [200, 1, 2])
async def test_poisoned_change_is_dead_lettered_and_the_queue_goes_on(
    cluster: Cluster, batch: int
) -> None:
    laptop = await cluster.device("laptop")
    laptop.sync.batch_size = batch  # small: the poisoned change is in a push with more in flight
    session = await laptop.create_session()
    await chat(laptop, session.id, "before")
    clock = HybridClock("laptop")
    foreign = Message(
        id=uuid7(),
        session_id=session.id,
        org_id="other-org",
        user_id="mallory",
        client_id="laptop",
        hlc=clock.now(),
        role="user",
        content=[{"type": "text", "text": "not mine"}],
    )
    await laptop.store.commit(WriteBatch(records=[foreign]))
    await chat(laptop, session.id, "after")
    await laptop.sync.connect(cluster.url, cluster.token())
    # The background loop flushes on connect: wait for the queue to drain.
    assert await laptop.sync.wait_until_synced(20)
    status = await laptop.sync.status()
    assert status.pending == 0 and status.dead_letters == 1
    dead = await laptop.sync.dead_letters()
    assert dead[0].code == 3002 and dead[0].record.id == foreign.id
    phone = await cluster.device("phone")
    await cluster.online(phone)
    assert len(await phone.sessions.messages(session.id)) == 4
    # Retrying re-queues it under a new client_seq; the server refuses it again.
    new_seq = await laptop.sync.retry_dead_letter(dead[0].client_seq)
    assert new_seq is not None and new_seq > dead[0].client_seq
    assert await laptop.sync.wait_until_synced(20)
    again = await laptop.sync.dead_letters()
    assert [d.client_seq for d in again] == [new_seq] and again[0].code == 3002
    await laptop.sync.disconnect()
    assert await laptop.sync.discard_dead_letter(new_seq)
    assert (await laptop.sync.status()).dead_letters == 0


@pytest.mark.parametrize("batch", [200, 1, 3])
async def test_flush_receipt_outcomes(cluster: Cluster, batch: int) -> None:
    laptop = await cluster.device("laptop")
    laptop.sync.batch_size = batch
    session = await laptop.create_session()
    receipt = await laptop.sync.sync_once(cluster.url, cluster.token())
    assert receipt.outcome == "all-flushed" and receipt.flushed == receipt.pending_before > 0
    assert receipt.pending_after == 0
    again = await laptop.sync.sync_once(cluster.url, cluster.token())
    assert again.outcome == "none-pending"
    clock = HybridClock("laptop")
    bad = Message(
        id=uuid7(),
        session_id=session.id,
        org_id="x",
        user_id="y",
        client_id="laptop",
        hlc=clock.now(),
        role="user",
        content=[],
    )
    await laptop.store.commit(WriteBatch(records=[bad]))
    await chat(laptop, session.id, "fine")
    partial = await laptop.sync.sync_once(cluster.url, cluster.token())
    assert partial.outcome == "partial" and partial.failed_entries[0].code == 3002
    assert partial.flushed > 0 and partial.pending_after == 0


async def test_lost_push_ack_is_not_duplicated(cluster: Cluster) -> None:
    assert cluster.store is not None
    inner = cluster.store
    committed = asyncio.Event()
    release = asyncio.Event()

    class AckEater:
        """Commits the push, then never answers until released: the ack is lost."""

        armed = True

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def push(self, *args: Any, **kwargs: Any) -> Any:
            result = await inner.push(*args, **kwargs)
            if self.armed:
                self.armed = False
                committed.set()
                await release.wait()
            return result

    await cluster.server.shutdown()  # type: ignore[union-attr]
    await cluster.start_server(AckEater())  # type: ignore[arg-type]
    laptop = await cluster.device("laptop")
    session = await laptop.create_session()
    await chat(laptop, session.id, "exactly once")
    queued = sorted(e.record.id for e in await laptop.store.outbox_pending(1000))
    try:
        await laptop.sync.connect(cluster.url, cluster.token())
        async with asyncio.timeout(20):
            await committed.wait()
        for conn in list(cluster.server.connections):  # type: ignore[union-attr]
            conn.ws.transport.abort()  # the connection dies after the commit, before the ack
        assert await laptop.sync.wait_until_synced(20)
    finally:
        release.set()
    phone = await cluster.device("phone")
    await cluster.online(phone)
    changes = (await inner.pull(ALICE, 0, 10_000)).changes
    fed = [c.record.id for c in changes]
    assert set(fed) == set(queued)  # nothing lost
    immutable = [c.record.id for c in changes if type(c.record).__name__ != "Session"]
    assert len(immutable) == len(set(immutable))  # and nothing applied twice
    assert await snapshot(phone, session.id) == await snapshot(laptop, session.id)


async def test_server_restart_between_batches(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    laptop.sync.batch_size = 5
    session = await laptop.create_session()
    await chat(laptop, session.id, "first")
    await cluster.online(laptop)
    await cluster.stop_server()
    await chat(laptop, session.id, "while the server was down")
    await cluster.start_server()
    assert await laptop.sync.wait_until_synced(20)
    await chat(laptop, session.id, "after the restart")
    assert await laptop.sync.wait_until_synced(20)
    phone = await cluster.device("phone")
    await cluster.online(phone)
    assert await snapshot(phone, session.id) == await snapshot(laptop, session.id)
    assert cluster.store is not None
    feed = (await cluster.store.pull(ALICE, 0, 10_000)).changes
    ids = [c.record.id for c in feed if type(c.record).__name__ != "Session"]
    assert len(ids) == len(set(ids)), "an immutable record was applied twice"
    versions = [(c.record.id, c.record.vv) for c in feed if type(c.record).__name__ == "Session"]
    assert len(versions) == len({(i, tuple(sorted(v.items()))) for i, v in versions})


async def test_a_server_restored_from_an_older_backup_does_not_stall_the_device(
    cluster: Cluster,
) -> None:
    """The server lost what it held of the laptop (restored from a backup taken before the
    laptop's first sync): it waits for client_seq 1, which the laptop settled long ago.
    Resending can never close that gap; the laptop takes a new id, says why (3006), and what
    it writes from then on reaches the other devices."""
    laptop = await cluster.device("laptop")
    first = await laptop.create_session()
    await chat(laptop, first.id, "synced before the restore")
    await cluster.online(laptop)
    await cluster.stop_server()
    store = SQLiteServerStore(cluster.tmp / "restored.db")  # the backup: nothing of it
    await store.open()
    await cluster.start_server(store)
    second = await laptop.create_session()
    await chat(laptop, second.id, "written after the restore")
    old_id = laptop.client_id
    assert await laptop.sync.wait_until_synced(20), await laptop.sync.status()
    status = await laptop.sync.status()
    assert status.pending == 0
    assert laptop.client_id != old_id
    assert status.last_error_code == ErrorCode.SEQUENCE_GAP
    assert "restored" in (status.last_error or "")
    phone = await cluster.device("phone")
    await cluster.online(phone)
    assert await snapshot(phone, second.id) == await snapshot(laptop, second.id)
    assert (await laptop.audit.verify_chain()).ok
    assert (await laptop.audit.verify_chain(old_id)).ok


async def test_bad_tokens_need_auth_and_tenants_are_isolated(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    await laptop.sync.connect(cluster.url, "forged.token")
    assert await _until(laptop, lambda: laptop.sync._state == "needs-auth")
    status = await laptop.sync.status()
    assert status.state == "needs-auth" and status.last_error_code == 3001
    await laptop.sync.connect(cluster.url, cluster.token(ttl=60, now=time.time() - 7200))
    assert await _until(laptop, lambda: laptop.sync._state == "needs-auth")

    bob = Tenant(org_id="acme", user_id="bob")
    bobs = await cluster.device("bobs-phone", tenant=bob)
    secret_session = await laptop.create_session(title="alice only")
    await cluster.online(laptop, bobs)
    assert await bobs.sessions.find(secret_session.id) is None
    assert await bobs.sessions.list() == []


async def _until(rt: SessionRuntime, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Wait on the sync facet's state-change condition until ``predicate`` holds."""
    return await rt.sync.wait_for(predicate, timeout)


async def test_artifacts_merge_concurrent_offline_edits(cluster: Cluster) -> None:
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session()
    created = await laptop.artifacts.create(session.id, "Packing list:")
    await cluster.online(laptop, phone)
    assert await phone.artifacts.text(created.artifact_id) == "Packing list:"
    await laptop.sync.disconnect()
    await phone.sync.disconnect()
    await laptop.artifacts.append(created.artifact_id, " umbrella")

    def prepend(body: Any) -> None:
        body.insert(0, "TRIP. ")

    await phone.artifacts.edit(created.artifact_id, prepend)
    await cluster.online(laptop, phone)
    text = await laptop.artifacts.text(created.artifact_id)
    assert text == await phone.artifacts.text(created.artifact_id)
    assert text == "TRIP. Packing list: umbrella"
    assert await phone.artifacts.list(session.id) == [created.artifact_id]


def forged(record: Any) -> Any:
    """An event with an altered payload (its hashes left as they were); any other record."""
    if type(record).__name__ == "Event":
        return msgspec.structs.replace(record, payload={"forged": True})
    return record


async def test_a_pulled_chain_that_does_not_verify_is_refused(cluster: Cluster) -> None:
    assert cluster.store is not None and cluster.server is not None
    inner = cluster.store

    class Tamper:
        """Serves pulls whose events carry altered payloads (hashes left as they were)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def pull(self, *args: Any, **kwargs: Any) -> Any:
            return rewrite_page(await inner.pull(*args, **kwargs), forged)

    laptop = await cluster.device("laptop")
    session = await laptop.create_session()
    await chat(laptop, session.id, "genuine")
    await cluster.online(laptop)
    await cluster.server.shutdown()
    await cluster.start_server(Tamper())  # type: ignore[arg-type]
    phone = await cluster.device("phone")
    await phone.sync.connect(cluster.url, cluster.token())
    assert await _until(phone, lambda: (phone.sync._last_error or "").startswith("ChainError"))
    status = await phone.sync.status()
    assert status.cursor == 0 and "does not verify" in (status.last_error or "")
    assert await phone.sessions.find(session.id) is None  # nothing of the page was applied
    await phone.sync.disconnect()


async def test_a_push_that_never_answers_times_out_and_reconnects(cluster: Cluster) -> None:
    assert cluster.store is not None and cluster.server is not None
    inner = cluster.store
    release = asyncio.Event()

    class Stall:
        """The first push commits and then never answers (until the test ends)."""

        armed = True
        hellos = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def client_state(self, *args: Any) -> Any:
            self.hellos += 1
            return await inner.client_state(*args)

        async def push(self, *args: Any, **kwargs: Any) -> Any:
            result = await inner.push(*args, **kwargs)
            if self.armed:
                self.armed = False
                await release.wait()
            return result

    stall = Stall()
    await cluster.server.shutdown()
    await cluster.start_server(stall)  # type: ignore[arg-type]
    laptop = await cluster.device("laptop")
    laptop.sync.request_timeout = 1.0  # the exercised limit, not a wait
    session = await laptop.create_session()
    await chat(laptop, session.id, "stalled once")
    try:
        await laptop.sync.connect(cluster.url, cluster.token())
        assert await laptop.sync.wait_until_synced(30)
        assert (await laptop.sync.status()).pending == 0
        assert stall.hellos == 2  # it gave up on the silent connection and came back
        feed = (await inner.pull(ALICE, 0, 10_000)).changes
        immutable = [c.record.id for c in feed if type(c.record).__name__ != "Session"]
        assert len(immutable) == len(set(immutable))
    finally:
        release.set()


async def test_a_device_behind_a_compacted_feed_resyncs_from_zero(cluster: Cluster) -> None:
    assert cluster.store is not None
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session()
    await chat(laptop, session.id, "before")
    await cluster.online(laptop, phone)
    behind = (await phone.sync.status()).cursor
    await phone.sync.disconnect()
    for text in ("one", "two", "three"):
        await chat(laptop, session.id, text)
    assert await laptop.sync.wait_until_synced(20)
    head = await cluster.store.head_cursor(ALICE)
    # Older versions of the session row left the feed as each new one came: compaction has
    # nothing left to drop, and raises the floor.
    assert await cluster.store.compact_feed(ALICE, head) == 0  # type: ignore[attr-defined]
    with pytest.raises(CursorTooOld):
        await cluster.store.pull(ALICE, behind, 10)
    await cluster.online(phone)
    assert await snapshot(phone, session.id) == await snapshot(laptop, session.id)
    assert (await phone.sync.status()).cursor == head


async def test_a_tampered_page_after_the_first_is_refused_too(cluster: Cluster) -> None:
    """Once a device holds a session's canonical head it verifies new pages from that head."""
    assert cluster.store is not None and cluster.server is not None
    inner = cluster.store
    tamper = asyncio.Event()

    class Tamper:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def pull(self, *args: Any, **kwargs: Any) -> Any:
            return rewrite_page(await inner.pull(*args, **kwargs), forge)

        async def push(self, *args: Any, **kwargs: Any) -> Any:
            # The rows a live page is made of, when not read back.
            return rewrite_push(await inner.push(*args, **kwargs), forge)

    def forge(record: Any) -> Any:
        return forged(record) if tamper.is_set() else record

    await cluster.server.shutdown()
    await cluster.start_server(Tamper())  # type: ignore[arg-type]
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session()
    await chat(laptop, session.id, "genuine")
    await cluster.online(laptop, phone)
    before = await snapshot(phone, session.id)
    cursor = (await phone.sync.status()).cursor
    tamper.set()
    await chat(laptop, session.id, "forged on the way")
    assert await _until(phone, lambda: (phone.sync._last_error or "").startswith("ChainError"))
    assert (await phone.sync.status()).cursor == cursor
    assert await snapshot(phone, session.id) == before
    await phone.sync.disconnect()
    await laptop.sync.disconnect()


def _stored_bodies(path: Path, table: str) -> dict[str, bytes]:
    """A device file's bodies of ``table`` by id, read with plain sqlite3 (as the store
    reads them: a body stored without its row's ids given them back, ``_whole_body``)."""
    import sqlite3
    import uuid

    from pleach_client.store.sqlite import _whole_row, sql_functions

    whole = _whole_row(table)  # (a session by its number: schema 12; an event's prev_hash: 14)
    with sqlite3.connect(path) as conn:
        sql_functions(conn)  # (an audit row's digests: schema 17)
        rows = conn.execute(f"SELECT id, {whole} FROM {table}").fetchall()
    return {str(uuid.UUID(bytes=key)) if len(key) == 16 else key: body for key, body in rows}


async def test_records_keep_their_bytes_from_device_to_server_to_device(cluster: Cluster) -> None:
    """Protocol 6 end to end: a message travels as the bytes the laptop stored, the server
    keeps them, and the phone stores them again, byte for byte; a device pinned to protocol 5
    (the map form) in the same account reads the same history and its turn reaches both.
    A device pinned to protocol 7 gets each body with its device written out (the bytes a
    build before protocol 8 wrote: ``compact.explicit``), and its own go as it stored them,
    which every device reads alike. The messages are long prose, which protocol 9 writes
    deflated: a device pinned to 8 gets them written out (``compact.inflated``), and so does
    the one at 7; the texts read alike everywhere."""
    assert cluster.store is not None
    names = ("laptop", "phone", "old", "mid", "eight")
    laptop, phone, old, mid, eight = [await cluster.device(n) for n in names]
    old.sync.max_protocol = 5
    mid.sync.max_protocol = 7
    eight.sync.max_protocol = 8
    session = await laptop.create_session()
    await chat(laptop, session.id, "as its bytes: " + PROSE)
    await cluster.online(laptop, phone, old, mid, eight)
    assert (await laptop.sync.status()).protocol == MAX_PROTOCOL == 9
    assert (await old.sync.status()).protocol == 5
    assert (await mid.sync.status()).protocol == 7
    assert (await eight.sync.status()).protocol == 8
    laptop_bodies = _stored_bodies(cluster.tmp / "laptop.db", "messages")
    phone_bodies = _stored_bodies(cluster.tmp / "phone.db", "messages")
    mid_bodies = _stored_bodies(cluster.tmp / "mid.db", "messages")
    eight_bodies = _stored_bodies(cluster.tmp / "eight.db", "messages")
    page = await cluster.store.pull(ALICE, 0, 1000, raw=True)
    server_bodies = {
        entry.record.id: bytes(body.body)
        for entry, body in zip(page.entries(), page.bodies, strict=True)
    }
    assert len(laptop_bodies) == 2
    for message_id, body in laptop_bodies.items():
        assert server_bodies[message_id] == body == phone_bodies[message_id]
        # The laptop's bodies leave its device implied by their stamps; protocol 7 names it.
        assert mid_bodies[message_id] == compact.inflated(compact.explicit(body)) != body
        assert compact.decode(mid_bodies[message_id]) == compact.decode(body)
        # Both of its texts are long enough to go deflated; protocol 8 has them written out.
        assert eight_bodies[message_id] == compact.inflated(body)
        assert len(eight_bodies[message_id]) > len(body)
        assert compact.decode(eight_bodies[message_id]) == compact.decode(body)
    # So do its audit rows, whose usage and outcome go as arrays from protocol 8.
    laptop_audit = _stored_bodies(cluster.tmp / "laptop.db", "audit")
    mid_audit = _stored_bodies(cluster.tmp / "mid.db", "audit")
    assert len(laptop_audit) == 1 and mid_audit.keys() == laptop_audit.keys()
    for row_id, body in laptop_audit.items():
        assert mid_audit[row_id] == compact.explicit(body) != body
        assert b"input_tokens" in mid_audit[row_id] and b"input_tokens" not in body
    # And its events, whose type and payload keys go as WORDS indexes from protocol 8: the
    # device at 7 stores them canonical in the form before, the laptop marked its own in place.
    laptop_events = _stored_bodies(cluster.tmp / "laptop.db", "events")
    mid_events = _stored_bodies(cluster.tmp / "mid.db", "events")
    assert len(laptop_events) >= 4 and mid_events.keys() == laptop_events.keys()
    for event_id, body in laptop_events.items():
        assert compact.decode(body).canonical
        assert mid_events[event_id] == compact.explicit(body) != body
        if compact.decode(body).type == "message.added":  # a payload key: a word, or its text
            assert b"message_id" in mid_events[event_id] and b"message_id" not in body
    await chat(old, session.id, "from the old device: " + PROSE)
    await cluster.settle(old, mid, eight, laptop, phone)
    await chat(mid, session.id, "from the device at 7: " + PROSE)
    await cluster.settle(mid, old, eight, laptop, phone)
    await chat(eight, session.id, "from the device at 8: " + PROSE)
    await cluster.settle(eight, mid, old, laptop, phone)
    expected = await snapshot(old, session.id)
    assert len(expected["messages"]) == 8
    texts = await message_texts(old, session.id)
    assert sum(PROSE in text for text in texts) == 8  # each user text, and its echo
    for device in (laptop, phone, mid, eight):
        assert await snapshot(device, session.id) == expected
        assert await message_texts(device, session.id) == texts
    await old.sync.disconnect()
    assert (await old.sync.status()).protocol is None  # no connection open


async def test_a_pull_keeps_the_fold_of_the_long_logs_it_brought(cluster: Cluster) -> None:
    """A new device pulling a session whose log the pull grows by ``fold_after_pull_events``
    or more folds it at the feed's end and keeps the fold: that session's first resume reads
    it (step "kept") and it is the whole log's; a session the pull grew by less is left to
    its resume, which folds it whole (and keeps it then)."""
    laptop = await cluster.device("laptop")
    long, short = await laptop.create_session(), await laptop.create_session()
    for i in range(4):
        await chat(laptop, long.id, f"long {i}")
    await chat(laptop, short.id, "short")
    await laptop.sync.sync_once(cluster.url, cluster.token())
    phone = await cluster.device("phone")
    long_log = len(await laptop.store.list_events(long.id))
    short_log = len(await laptop.store.list_events(short.id))
    assert short_log < long_log
    phone.sync.fold_after_pull_events = long_log  # (about a thousand events by default)
    await phone.sync.sync_once(cluster.url, cluster.token())
    kept = await phone.store.kept_hydration(long.id)
    assert kept is not None and kept.key == await phone.store.hydration_key(long.id)
    assert await phone.store.kept_hydration(short.id) is None
    for session_id, step in ((long.id, "kept"), (short.id, "whole")):
        events = await phone.store.list_events(session_id)
        assert await load_hydration(phone.store, session_id) == (hydrate(events), step)
    resumed = await phone.sessions.resume(long.id)
    assert resumed.hydrated["turns"] == 4


async def test_a_fold_that_fails_after_a_pull_leaves_the_pull_standing(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that cannot read the log to fold it (a corrupt row, a full disk): the pull has
    applied every page and moved its cursor all the same; the failure is a warning, and the
    session's resume folds its log when it can."""
    laptop = await cluster.device("laptop")
    session = await laptop.create_session()
    for i in range(2):
        await chat(laptop, session.id, f"turn {i}")
    await laptop.sync.sync_once(cluster.url, cluster.token())

    class Unreadable(SQLiteAdapter):
        failing = True

        async def hydration_log(self, *args: Any, **kwargs: Any) -> Any:
            if self.failing:
                raise StorageError("read events failed: database disk image is malformed")
            return await super().hydration_log(*args, **kwargs)

    store = Unreadable(cluster.tmp / "phone.db")
    phone = SessionRuntime(
        store, ScriptedProvider(), user_id=ALICE.user_id, org_id=ALICE.org_id, client_id="phone"
    )
    await cluster.stack.enter_async_context(phone)
    phone.sync.fold_after_pull_events = 1
    with caplog.at_level(logging.WARNING, logger="pleach.sync"):
        receipt = await phone.sync.sync_once(cluster.url, cluster.token())
    assert receipt.outcome == "none-pending"
    assert int(await store.get_meta("cursor") or 0) == await cluster.store.head_cursor(ALICE)  # type: ignore[union-attr]
    assert len(await phone.sessions.messages(session.id)) == 4
    assert "was not folded after the pull" in caplog.text
    assert await store.kept_hydration(session.id) is None
    store.failing = False
    events = await store.list_events(session.id)
    assert await load_hydration(store, session.id) == (hydrate(events), "whole")


async def test_a_device_deflates_in_a_small_kept_window_and_the_server_each_frame_alone(
    cluster: Cluster,
) -> None:
    """The device's connection negotiates permessage-deflate: the device keeps its context in
    the 4 KiB window the server allows, at level 1; the server deflates each frame alone. A
    long conversation still syncs whole through it."""
    laptop = await cluster.device("laptop")
    phone = await cluster.device("phone")
    session = await laptop.create_session(title="deflated")
    for i in range(30):
        await chat(laptop, session.id, f"turn {i}: " + "words repeat in a long reply " * 40)
    await cluster.online(laptop, phone)
    link = laptop.sync._link
    assert link is not None
    (extension,) = link.ws.protocol.extensions
    assert extension.name == "permessage-deflate"
    assert extension.remote_no_context_takeover  # the server's frames, each alone
    assert not extension.local_no_context_takeover  # the device's, context kept
    assert extension.local_max_window_bits == 12
    assert extension.compress_settings == {"level": 1, "memLevel": 8}
    assert await snapshot(laptop, session.id) == await snapshot(phone, session.id)


async def test_a_page_of_a_catch_up_is_applied_in_place(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pulled page of up to ``IN_PLACE_PAGE`` changes (here about 300, the whole history in
    one page) is read and written on the loop's thread, its transaction never a hop: the
    store's thread and the loop would contend for the GIL (the write beside the next page's
    decode took twice its time). A page past the mark is applied on the store's thread, and
    both devices end with the laptop's rows."""
    laptop = await cluster.device("laptop")
    session = await laptop.create_session(title="long")
    for i in range(33):
        await chat(laptop, session.id, f"turn {i}")
    await cluster.online(laptop)
    in_place: dict[str, list[int]] = {}
    for name, mark in (("phone", sync_module.IN_PLACE_PAGE), ("tablet", 16)):
        monkeypatch.setattr(sync_module, "IN_PLACE_PAGE", mark)
        rt = await cluster.device(name)
        done = in_place[name] = []
        real = rt.store._transact_in_place

        async def recorded(plan: Any, done: list[int] = done, real: Any = real) -> Any:
            receipt = await real(plan)
            if receipt is not None:
                done.append(receipt.records)
            return receipt

        monkeypatch.setattr(rt.store, "_transact_in_place", recorded)
        await cluster.online(rt)
        assert await snapshot(rt, session.id) == await snapshot(laptop, session.id)
    assert max(in_place["phone"]) >= 250  # the whole history (266 records), one page, in place
    assert max(in_place["tablet"], default=0) <= 16  # the pages past the mark: on the thread
