"""A restored or copied device file: the copy takes a new client id, and nothing is lost.

Real server on a loopback port, real runtimes on SQLite files. A file restored from a backup
(or copied to a second machine) reuses the client id and ``client_seq`` numbers the server
already saw; before, its new writes were answered ``duplicate`` and dropped unsent.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.clock import HybridClock
from shared.errors import ErrorCode, StorageError, StorageUnavailable
from shared.hashchain import verify_chain
from shared.records import AuditRow, Change, Message

SECRET = b"identity-test-secret"
ALICE = Tenant(org_id="acme", user_id="alice")
TIMEOUT = 20.0


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[SyncServer, SQLiteServerStore]]:
    async with (
        SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
    ):
        yield srv, store


@asynccontextmanager
async def device(
    path: Path, srv: SyncServer, batch_size: int = 200
) -> AsyncIterator[SessionRuntime]:
    rt = SessionRuntime(
        SQLiteAdapter(path), ScriptedProvider(), org_id=ALICE.org_id, user_id=ALICE.user_id
    )
    async with rt:
        rt.sync.backoff_initial = 0.01
        rt.sync.backoff_max = 0.2
        rt.sync.batch_size = batch_size  # small: several pushes in flight
        await rt.sync.connect(srv.url, issue_token(SECRET, ALICE, 3600))
        yield rt


async def say(rt: SessionRuntime, session_id: str, text: str) -> None:
    async for _ in rt.execute_message(session_id, text):
        pass


async def synced(rt: SessionRuntime) -> None:
    assert await rt.sync.wait_until_synced(TIMEOUT), await rt.sync.status()


async def server_user_texts(store: SQLiteServerStore) -> set[str]:
    page = await store.pull(ALICE, 0, 100_000)
    return {
        block["text"]
        for change in page.changes
        if isinstance(change.record, Message) and change.record.role == "user"
        for block in change.record.content
        if block.get("type") == "text"
    }


def copy_file(src: Path, dst: Path) -> None:
    """A whole-file copy of a closed database (what a backup or a copy to a new machine is)."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")


@pytest.mark.parametrize("batch", [200, 2])
async def test_a_restored_backup_takes_a_new_id_and_loses_nothing(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore], batch: int
) -> None:
    srv, store = server
    path, backup = tmp_path / "laptop.db", tmp_path / "backup.db"
    async with device(path, srv) as rt:
        session_id = (await rt.create_session(title="trip")).id
        await say(rt, session_id, "before the backup")
        await synced(rt)
        old_id = rt.client_id
    copy_file(path, backup)
    async with device(path, srv) as rt:  # the lost future: synced, then the disk dies
        await say(rt, session_id, "after the backup 1")
        await say(rt, session_id, "after the backup 2")
        await synced(rt)
    copy_file(backup, path)  # restored from the backup
    async with device(path, srv, batch) as rt:
        await say(rt, session_id, "written on the restored file")
        await synced(rt)
        status = await rt.sync.status()
        assert rt.client_id != old_id
        assert status.last_error_code == ErrorCode.IDENTITY_REUSED
        assert "restored or copied" in (status.last_error or "")
        texts = {m.content[0]["text"] for m in await rt.sessions.messages(session_id)}
    on_server = await server_user_texts(store)
    everything = {
        "before the backup",
        "after the backup 1",
        "after the backup 2",
        "written on the restored file",
    }
    assert everything <= on_server
    # The restored device ends with every message too: its version and the lost future's
    # are settled as a conflict, and both sides survive (one as a fork).
    async with device(path, srv) as rt:
        await synced(rt)
        everywhere: set[str] = set()
        for session in await rt.sessions.list():
            everywhere |= {m.content[0]["text"] for m in await rt.sessions.messages(session.id)}
    assert everything <= everywhere | texts


async def a_copied_file(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore], original_says: list[str]
) -> tuple[Path, str, str, int]:
    """A synced device's file copied; the original then says ``original_says`` and syncs.
    The copy's path, the shared session, the id both files hold, and the server's
    ``last_seq`` of that id."""
    srv, store = server
    path, clone_path = tmp_path / "laptop.db", tmp_path / "desktop.db"
    async with device(path, srv) as rt:
        session_id = (await rt.create_session(title="shared")).id
        await synced(rt)
        shared_id = rt.client_id
    copy_file(path, clone_path)
    async with device(path, srv) as original:
        for text in original_says:
            await say(original, session_id, text)
        await synced(original)
    held = (await store.client_state(ALICE, shared_id))[0]
    return clone_path, session_id, shared_id, held


@pytest.mark.parametrize("batch", [200, 2])
@pytest.mark.parametrize("clone_turns", [1, 2, 3])
async def test_a_copied_file_writing_beside_the_original_loses_nothing(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore], clone_turns: int, batch: int
) -> None:
    """The copy writes fewer, as many or more changes than the original before both sync:
    with as many, only the server can tell (same numbers, different changes)."""
    srv, store = server
    clone_path, session_id, shared_id, held = await a_copied_file(
        tmp_path, server, ["original 0", "original 1"]
    )
    async with device(clone_path, srv, batch) as clone:
        other = (await clone.create_session(title="clone's own")).id
        for i in range(clone_turns):
            await say(clone, other if i % 2 else session_id, f"clone {i}")
        await synced(clone)
        assert (await clone.sync.status()).last_error_code == ErrorCode.IDENTITY_REUSED
    # Nothing of the copy's went in under the id the original writes under, not even a push
    # sent behind the one whose ack said so.
    assert (await store.client_state(ALICE, shared_id))[0] == held
    on_server = await server_user_texts(store)
    assert {"original 0", "original 1"} <= on_server
    assert {f"clone {i}" for i in range(clone_turns)} <= on_server


@pytest.mark.parametrize("batch", [1, 2, 3])
async def test_nothing_goes_out_behind_a_push_of_numbers_the_server_holds(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore], batch: int
) -> None:
    """A copy's queue starts at numbers the server holds of its id (the original's turn). A
    push of them goes alone: the pushes behind it would start past the server's numbers and
    go in under the id the original writes under before the copy learns it must take a new
    one. Every change of both is on the server, and none of the copy's under the old id."""
    srv, store = server
    clone_path, session_id, shared_id, held = await a_copied_file(tmp_path, server, ["original"])
    async with device(clone_path, srv, batch) as clone:
        for i in range(3):
            await say(clone, session_id, f"clone {i}")
        await synced(clone)
        assert clone.client_id != shared_id
    assert (await store.client_state(ALICE, shared_id))[0] == held
    assert {"original", "clone 0", "clone 1", "clone 2"} <= await server_user_texts(store)


async def test_a_lost_ack_is_still_a_duplicate(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore]
) -> None:
    """The ordinary resend (the ack never came) must not look like a copy."""
    srv, store = server
    async with device(tmp_path / "phone.db", srv) as rt:
        session_id = (await rt.create_session(title="x")).id
        await say(rt, session_id, "hello")
        await synced(rt)
        client_id = rt.client_id
        entries = await rt.store.outbox_pending()
        assert entries == []
        # Resend everything the server has under the same numbers, as after a lost ack.
        page = await store.pull(ALICE, 0, 1000)
        mine = [c.record for c in page.changes if c.record.client_id == client_id]
        assert mine
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(mine)]
    result = await store.push(ALICE, client_id, changes, HybridClock("test-server"))
    assert {r.status for r in result.results} <= {"duplicate"}, result.results


class CommitThenFail(SQLiteServerStore):
    """A server store that commits a push of the devices in ``fail_for`` and then fails, as a
    store does when its database connection drops during ``COMMIT``: the server answers 3009
    and cannot know the outcome. ``between`` runs after the commit and before the failure
    (another device's push landing in that window)."""

    fail_for: frozenset[str] = frozenset()
    between: Callable[[], Awaitable[None]] | None = None

    async def push(self, tenant: Tenant, client_id: str, *args: Any, **kwargs: Any) -> Any:
        result = await super().push(tenant, client_id, *args, **kwargs)
        if client_id in self.fail_for:
            between, self.between = self.between, None
            if between is not None:
                await between()
            raise StorageError("connection lost during COMMIT", retryable=True)
        return result


def runtime(path: Path) -> SessionRuntime:
    """A device of ALICE's on ``path``, not connected (the test syncs it)."""
    return SessionRuntime(
        SQLiteAdapter(path), ScriptedProvider(), org_id=ALICE.org_id, user_id=ALICE.user_id
    )


@asynccontextmanager
async def failing_pair(
    tmp_path: Path,
) -> AsyncIterator[tuple[CommitThenFail, SyncServer, SessionRuntime, SessionRuntime]]:
    """A server on a ``CommitThenFail`` store, and two devices: a phone and a laptop."""
    async with (
        CommitThenFail(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
        runtime(tmp_path / "phone.db") as phone,
        runtime(tmp_path / "laptop.db") as laptop,
    ):
        yield store, srv, phone, laptop


async def test_a_push_the_store_failed_after_committing_is_not_taken_for_a_copy(
    tmp_path: Path,
) -> None:
    """The server's store commits a push and fails before it can answer (3009), and another
    device builds on the committed version at once. The device keeps the change queued and
    must not read that other device's version, which counts its own unacknowledged one, as
    another copy of its file writing under its counter: it pulls only once a resend settled
    the change (``duplicate``), keeps its id, and every audit chain verifies everywhere."""
    token = issue_token(SECRET, ALICE, 3600)

    async with failing_pair(tmp_path) as (store, srv, phone, laptop):
        session_id = (await phone.create_session(title="first")).id
        await say(phone, session_id, "hello")
        await phone.sync.sync_once(srv.url, token)
        phone_id = phone.client_id

        async def laptop_edits() -> None:
            await laptop.sync.sync_once(srv.url, token)  # takes the phone's committed turn
            await laptop.sessions.rename(session_id, "from the laptop")
            await say(laptop, session_id, "laptop turn")
            await laptop.sync.sync_once(srv.url, token)

        await phone.sessions.rename(session_id, "from the phone")
        await say(phone, session_id, "phone turn")
        store.fail_for, store.between = frozenset({phone_id}), laptop_edits
        receipt = await phone.sync.sync_once(srv.url, token)
        assert receipt.pending_after > 0 and store.between is None  # the fault fired
        assert phone.client_id == phone_id, "a failed commit answer was taken for a copy"

        store.fail_for = frozenset()
        receipt = await phone.sync.sync_once(srv.url, token)  # the resend: duplicate
        assert receipt.pending_after == 0, receipt
        await laptop.sync.sync_once(srv.url, token)
        assert phone.client_id == phone_id
        assert await phone.core.previous_client_ids() == []
        assert {"hello", "phone turn", "laptop turn"} <= await server_user_texts(store)
        for rt in (phone, laptop):
            row = await rt.sessions.find(session_id)
            assert row is not None and row.title == "from the laptop"
            for client_id in (phone_id, laptop.client_id):
                report = await rt.audit.verify_chain(client_id)
                assert report.ok, (client_id, report)


async def test_two_copies_that_both_move_the_same_queued_audit_rows_leave_no_hole(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore]
) -> None:
    """Two copies of one file hold the same unsent audit row, and both take a new id: each
    moves the row onto its new id's chain. The server keeps the first placement; the second
    copy's next row would sit after a hole, so the server refuses it (3013) until that copy
    chains it on from the server's place. Every chain verifies on the server and on both
    copies, and no audit row is lost."""
    srv, store = server
    token = issue_token(SECRET, ALICE, 3600)
    one_path, two_path = tmp_path / "one.db", tmp_path / "two.db"
    async with runtime(one_path) as one:
        first = (await one.create_session(title="first")).id
    copy_file(one_path, two_path)
    async with runtime(one_path) as one:  # the server comes to hold numbers neither copy queues
        await one.create_session(title="second")
        await one.sync.sync_once(srv.url, token)
        shared_id = one.client_id
    async with runtime(two_path) as two:
        await say(two, first, "written before the second copy")  # an audit row, queued
    copy_file(two_path, one_path)  # both files now hold that queued row
    async with runtime(two_path) as two:
        await say(two, first, "written on the second copy only")  # the next row of the chain
    audit_ids: set[str] = set()
    for path in (one_path, two_path):  # each copy learns of the other (3012) before either resends
        async with runtime(path) as rt:
            audit_ids |= {row.id for row in await rt.store.list_audit()}
            await rt.sync.connect(srv.url, token, auto=False)
            assert await rt.sync.wait_for(lambda rt=rt: rt.sync.connected, TIMEOUT)
            await rt.sync.flush_outbox()
            await rt.sync.disconnect()
            assert rt.client_id != shared_id, path.name  # it took a new id
    for path in (one_path, two_path):
        async with runtime(path) as rt:
            receipt = await rt.sync.sync_once(srv.url, token)  # its queue, under its new id
            assert receipt.pending_after == 0, receipt
    page = await store.pull(ALICE, 0, 100_000)
    on_server = [c.record for c in page.changes if isinstance(c.record, AuditRow)]
    assert audit_ids <= {row.id for row in on_server}
    chains = {row.client_id for row in on_server}
    assert len(chains) == 2 and shared_id not in chains  # each copy's new id
    for client_id in chains:
        chain = sorted(
            (row for row in on_server if row.client_id == client_id),
            key=lambda row: row.sequence_number,
        )
        assert verify_chain(chain).ok, (client_id, [r.sequence_number for r in chain])
    for path in (one_path, two_path):
        async with runtime(path) as rt:
            await rt.sync.sync_once(srv.url, token)
            for client_id in chains:
                report = await rt.audit.verify_chain(client_id)
                assert report.ok, (path.name, client_id, report)


async def test_a_pull_by_hand_after_a_failed_push_settles_the_push_first(
    tmp_path: Path,
) -> None:
    """The same window, driven by hand (``connect(auto=False)``, ``flush_outbox()``,
    ``pull()``): the pull sends the unsettled push again before it applies a page, so the
    other device's version built on it is taken, not read as another copy's; while the server
    cannot say, the pull refuses with 3009 and applies nothing."""
    token = issue_token(SECRET, ALICE, 3600)

    async with failing_pair(tmp_path) as (store, srv, phone, laptop):
        session_id = (await phone.create_session(title="first")).id
        await phone.sync.sync_once(srv.url, token)
        phone_id = phone.client_id

        async def laptop_edits() -> None:
            await laptop.sync.sync_once(srv.url, token)
            await laptop.sessions.rename(session_id, "from the laptop")
            await laptop.sync.sync_once(srv.url, token)

        await phone.sessions.rename(session_id, "from the phone")
        await phone.sync.connect(srv.url, token, auto=False)
        assert await phone.sync.wait_for(lambda: phone.sync.connected, TIMEOUT)
        store.fail_for, store.between = frozenset({phone_id}), laptop_edits
        receipt = await phone.sync.flush_outbox()
        assert receipt.pending_after > 0 and store.between is None  # committed, then 3009
        cursor = (await phone.sync.status()).cursor
        with pytest.raises(StorageUnavailable):
            await phone.sync.pull()  # the resend fails too: nothing is applied
        assert (await phone.sync.status()).cursor == cursor
        store.fail_for = frozenset()
        await phone.sync.pull()  # the resend is answered duplicate, then the page applies
        assert phone.client_id == phone_id, "a failed commit answer was taken for a copy"
        assert (await phone.sync.status()).pending == 0
        row = await phone.sessions.find(session_id)
        assert row is not None and row.title == "from the laptop"
        await phone.sync.disconnect()


async def test_sync_once_from_a_copied_file_sends_everything(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore]
) -> None:
    """The one-shot sync the CLI uses re-keys mid-flush and still sends it all."""
    srv, store = server
    token = issue_token(SECRET, ALICE, 3600)
    path, copy = tmp_path / "a.db", tmp_path / "b.db"

    async with runtime(path) as rt:
        session_id = (await rt.create_session(title="x")).id
        await rt.sync.sync_once(srv.url, token)
    copy_file(path, copy)
    for p, text in ((path, "from the original"), (copy, "from the copy")):
        async with runtime(p) as rt:
            await say(rt, session_id, text)
    for p in (path, copy):
        async with runtime(p) as rt:
            receipt = await rt.sync.sync_once(srv.url, token)
            assert receipt.pending_after == 0, receipt
    assert {"from the original", "from the copy"} <= await server_user_texts(store)


async def test_a_clock_ahead_keeps_changes_queued_until_it_is_right(tmp_path: Path) -> None:
    """A device whose clock runs ahead of the server's is told by how much (3011), keeps its
    changes queued (no dead letters) and sends them once its stamps are no longer ahead."""
    import time

    ahead_ms = [3_000]

    def wall() -> int:
        return int(time.time() * 1000) + ahead_ms[0]

    async with (
        SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(
            store, port=0, secret=SECRET, rate_limit_per_s=None, max_clock_skew_ms=1_000
        ) as srv,
    ):
        rt = SessionRuntime(
            SQLiteAdapter(tmp_path / "fast.db"),
            ScriptedProvider(),
            org_id=ALICE.org_id,
            user_id=ALICE.user_id,
            wall_clock=wall,
        )
        async with rt:
            rt.sync.backoff_initial = 0.05
            rt.sync.backoff_max = 0.5
            session_id = (await rt.create_session(title="fast clock")).id
            await say(rt, session_id, "written with a fast clock")
            await rt.sync.connect(srv.url, issue_token(SECRET, ALICE, 3600))
            assert await rt.sync.wait_for(
                lambda: rt.sync._last_error_code == ErrorCode.CLOCK_SKEW, TIMEOUT
            )
            status = await rt.sync.status()
            assert "in the future" in (status.last_error or "")
            assert status.pending > 0 and status.dead_letters == 0
            ahead_ms[0] = 0  # the clock is fixed; the stamps already made catch up with time
            await synced(rt)
            assert (await rt.sync.status()).dead_letters == 0
        assert "written with a fast clock" in await server_user_texts(store)


async def test_an_open_connection_ends_when_its_token_expires(
    tmp_path: Path, server: tuple[SyncServer, SQLiteServerStore]
) -> None:
    """Expiry holds on open connections too: the server says 3001 and closes, and the device
    stops in needs-auth with the server's reason, its changes kept."""
    srv, _ = server
    rt = SessionRuntime(
        SQLiteAdapter(tmp_path / "d.db"),
        ScriptedProvider(),
        org_id=ALICE.org_id,
        user_id=ALICE.user_id,
    )
    async with rt:
        rt.sync.backoff_initial = 0.01
        # A token's exp is whole seconds from the second it was issued in: a ttl of 1 s could
        # leave a few ms, less than a loaded machine takes to sync. 3 s leaves at least 2 s
        # for the connection to open and sync; then it must end.
        await rt.sync.connect(srv.url, issue_token(SECRET, ALICE, 3))
        await synced(rt)
        assert rt.sync._state != "needs-auth"  # the connection is open, its token still good
        assert await rt.sync.wait_for(lambda: rt.sync._state == "needs-auth", TIMEOUT)
        session_id = (await rt.create_session(title="after expiry")).id
        status = await rt.sync.status()
        assert "token expired" in (status.last_error or "")
        assert status.pending > 0  # kept, not refused
        await rt.sync.connect(srv.url, issue_token(SECRET, ALICE, 3600))
        await synced(rt)
        assert (await rt.store.get_session(session_id)) is not None


class _Entered(SQLiteAdapter):
    """A SQLite store that says when a write transaction has begun."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.entered = asyncio.Event()

    async def transact(self, plan: Any) -> Any:
        self.entered.set()
        return await super().transact(plan)


async def test_a_rekey_whose_caller_is_cancelled_mid_write_still_takes_its_id(
    tmp_path: Path,
) -> None:
    """A disconnect cancels the sync loop while its re-key writes. The re-key runs to its
    end, so the id in memory is the stored one, and a later re-key replaces that id (not
    the old one again): every id the device wrote under stays among its previous ids. It
    gave the old id back in memory while the new one had committed (the simulation, seed
    441,528), and the rows moved onto the lost id's chain were refused for good (3007)."""
    store = _Entered(tmp_path / "d.db")
    async with SessionRuntime(
        store, ScriptedProvider(), org_id=ALICE.org_id, user_id=ALICE.user_id
    ) as rt:
        session_id = (await rt.create_session(title="s")).id
        await say(rt, session_id, "queued")
        old = rt.client_id
        store.entered.clear()
        caller = asyncio.create_task(rt.core.rekey())
        await store.entered.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        second = await rt.core.rekey()  # waits for the first to end
        previous = await rt.core.previous_client_ids()
        assert rt.client_id == second == await rt.store.get_meta("client_id")
        assert len(previous) == 2 and previous[1] == old
        assert previous[0] not in (old, second)
        rows = await rt.audit.rows()
        assert {r.client_id for r in rows} <= {second, *previous}
