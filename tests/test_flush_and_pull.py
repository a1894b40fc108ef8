"""A pull asks for the next page before it applies the one in hand (one page ahead); a pull
does not write again the messages a device holds; a flush in small batches puts each change
on the server once.

Generated: histories of random shape, pages and batches of random size, poisoned changes
here and there. A new device pulls them all and must hold exactly what the writer holds, and
every page that said "more" must have had its successor asked for before its own apply
finished. A flush must put every change on the server exactly once (the poisoned ones in the
dead letters) and keep the device's id. An apply that fails mid-pull, or one after which the
device takes a new id, drops the page asked ahead and loses nothing; the next pull takes up
from the stored cursor.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from pleach_client.link import Link
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import OutboxEntry, WriteBatch
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.clock import HybridClock
from shared.errors import ErrorCode, SyncError
from shared.ids import uuid7
from shared.protocol import ClientProtocol
from shared.records import Change, Message, Session

SECRET = b"test-secret-for-pipelined-sync"
ALICE = Tenant(org_id="acme", user_id="alice")
TIMEOUT = 30.0


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SyncServer]:
    async with SQLiteServerStore(tmp_path / "server.db") as store:
        async with SyncServer(store, port=0, secret=SECRET) as srv:
            yield srv


def device(path: Path, name: str) -> SessionRuntime:
    return SessionRuntime(
        SQLiteAdapter(path),
        ScriptedProvider(),
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
        client_id=name,
    )


async def holdings(rt: SessionRuntime) -> dict[str, Any]:
    """Everything of the user's the device holds, by session."""
    out: dict[str, Any] = {}
    for session in await rt.store.list_sessions():
        out[session.id] = (
            session.state.message_ids,
            session.head_checkpoint_id,
            [(e.id, e.sequence_number, e.row_hash) for e in await rt.store.list_events(session.id)],
            sorted(c.id for c in await rt.store.list_checkpoints(session.id)),
            len(await rt.store.get_messages(session.state.message_ids)),
        )
    return out


async def write_history(rt: SessionRuntime, rng: random.Random) -> None:
    sessions = [(await rt.create_session(title=f"s{i}")).id for i in range(rng.randint(1, 3))]
    for _ in range(rng.randint(1, 6)):
        async for _ in rt.execute_message(rng.choice(sessions), "hello"):
            pass


async def writer_and_reader(
    stack: AsyncExitStack, server: SyncServer, tmp_path: Path, rng: random.Random
) -> tuple[SessionRuntime, SessionRuntime]:
    """A laptop that wrote a random history and put it all on the server, and a new phone."""
    laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
    await write_history(laptop, rng)
    token = issue_token(SECRET, ALICE, 3600)
    assert (await laptop.sync.sync_once(server.url, token)).outcome == "all-flushed"
    phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
    return laptop, phone


class Recorder:
    """Logs the device's pull requests and the start and end of each page's apply; can make
    one apply fail (``fail_at``) or be followed by a re-key (``rekey_at``), by its number."""

    def __init__(
        self, rt: SessionRuntime, fail_at: int | None = None, rekey_at: int | None = None
    ) -> None:
        self.log: list[tuple[str, int]] = []
        self.pages: list[tuple[int, bool]] = []  # (to_cursor, more) of each page answered
        self.fail_at = fail_at
        self.rekey_at = rekey_at
        sync = rt.sync
        apply, ask_page = sync._apply, sync._ask_page

        async def ask(link: Any, cursor: int) -> Any:
            self.log.append(("ask", cursor))
            answer = await ask_page(link, cursor)
            if hasattr(answer, "more"):
                self.pages.append((answer.to_cursor, answer.more))
            return answer

        async def applied(changes: Any, to_cursor: int, bodies: Any = None) -> int:
            self.log.append(("apply", to_cursor))
            if self.fail_at is not None and len(self.applies()) == self.fail_at:
                self.fail_at = None
                raise OSError("disk full (injected)")
            n = await apply(changes, to_cursor, bodies)
            self.log.append(("applied", to_cursor))
            if self.rekey_at is not None and len(self.applies()) == self.rekey_at:
                self.rekey_at = None
                await sync._rekey("a copy of this file was found (injected)")
                self.log.append(("rekey", to_cursor))
            return n

        sync._ask_page = ask  # type: ignore[method-assign]
        sync._apply = applied  # type: ignore[method-assign]

    def applies(self) -> list[int]:
        return [c for what, c in self.log if what == "apply"]


@pytest.mark.parametrize("seed", range(6))
async def test_a_new_device_pulls_every_page_one_ahead(
    server: SyncServer, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop, phone = await writer_and_reader(stack, server, tmp_path, rng)
        phone.sync.pull_limit = rng.randint(1, 3)
        recorder = Recorder(phone)
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)
        head = await server.store.head_cursor(ALICE)
        assert (await phone.sync.status()).cursor == head
        paged = [to for to, more in recorder.pages if more]
        assert len(paged) >= 2, recorder.pages  # the case is one of several pages
        for to_cursor in paged:
            asked = recorder.log.index(("ask", to_cursor))
            done = recorder.log.index(("applied", to_cursor))
            assert asked < done, (to_cursor, recorder.log)  # asked while still applying


async def test_an_apply_that_fails_mid_pull_drops_the_page_ahead_and_loses_nothing(
    server: SyncServer, tmp_path: Path
) -> None:
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop, phone = await writer_and_reader(stack, server, tmp_path, random.Random(99))
        phone.sync.pull_limit = 2
        recorder = Recorder(phone, fail_at=2)
        with pytest.raises((OSError, SyncError)):
            await phone.sync.sync_once(server.url, token)
        kept = (await phone.sync.status()).cursor
        first = recorder.applies()[0]
        assert kept == first  # the first page stayed applied; the failed one left no trace
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)
        assert (await phone.sync.status()).cursor == await server.store.head_cursor(ALICE)


async def test_no_page_asked_on_a_link_is_applied_after_a_re_key_closed_it(
    server: SyncServer, tmp_path: Path
) -> None:
    """A page's apply can make the device take a new id (it shows another copy of the file
    writing under this one), which closes the link. The page already asked ahead on that link
    is dropped, not applied under the new id; the next pull, as the new id, takes up from the
    stored cursor and nothing is lost."""
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop, phone = await writer_and_reader(stack, server, tmp_path, random.Random(5))
        phone.sync.pull_limit = 2
        recorder = Recorder(phone, rekey_at=2)
        await phone.sync.sync_once(server.url, token)
        assert phone.client_id != "phone"  # the injected re-key happened
        at = recorder.log.index(("rekey", recorder.applies()[1]))
        assert ("ask", recorder.applies()[1]) in recorder.log[:at]  # a page was asked ahead
        assert not [e for e in recorder.log[at + 1 :] if e[0] == "apply"], recorder.log
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)
        assert (await phone.sync.status()).cursor == await server.store.head_cursor(ALICE)


def poison(session_id: str) -> Message:
    """A change the server refuses for good: another tenant's message (3002)."""
    return Message(
        id=uuid7(),
        session_id=session_id,
        org_id="other-org",
        user_id="mallory",
        client_id="laptop",
        hlc=HybridClock("laptop").now(),
        role="user",
        content=[{"type": "text", "text": "not mine"}],
    )


@pytest.mark.parametrize("seed", range(8))
async def test_a_flush_in_small_batches_puts_each_change_on_the_server_once(
    server: SyncServer, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        sessions = [(await laptop.create_session(title=f"s{i}")).id for i in range(2)]
        poisoned: list[str] = []
        for _ in range(rng.randint(2, 6)):
            if seed % 2 and rng.random() < 0.5:  # odd seeds: poisoned changes among the rest
                bad = poison(rng.choice(sessions))
                await laptop.store.commit(WriteBatch(records=[bad]))
                poisoned.append(bad.id)
            async for _ in laptop.execute_message(rng.choice(sessions), "hello"):
                pass
        queued = [e.record.id for e in await laptop.store.outbox_pending(100_000)]
        laptop.sync.batch_size = rng.randint(1, 4)
        receipt = await laptop.sync.sync_once(server.url, token)
        assert laptop.client_id == "laptop"  # no re-key: every answer was read in its place
        assert receipt.pending_after == 0, receipt
        assert sorted(d.record.id for d in await laptop.sync.dead_letters()) == sorted(poisoned)
        feed = (await server.store.pull(ALICE, 0, 100_000)).changes
        held = [c.record.id for c in feed if type(c.record).__name__ != "Session"]
        assert len(held) == len(set(held))  # none twice
        assert set(queued) - set(poisoned) <= {c.record.id for c in feed}
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)


async def test_a_session_queued_once_per_turn_goes_once_at_its_last_number(
    server: SyncServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thirty turns written offline queue the session thirty times, each number referring to
    its one stored row: its newest version, which names every message. A flush sends that row
    once, at its last number, after every message it names, and the numbers before it go
    ``skipped`` (protocol 4), in whichever push they fall: every number is answered, nothing
    is lost, and no push carries a session naming a message not sent yet."""
    pushes: list[tuple[list[Change], list[int]]] = []
    send_push = ClientProtocol.send_push

    def recording(self: ClientProtocol, changes: list[Change], **kwargs: Any) -> int:
        pushes.append((list(changes), list(kwargs.get("skipped") or [])))
        return send_push(self, changes, **kwargs)

    monkeypatch.setattr(ClientProtocol, "send_push", recording)
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        session_id = (await laptop.create_session(title="long")).id
        for i in range(30):
            async for _ in laptop.execute_message(session_id, f"turn {i}"):
                pass
        queued = await laptop.store.outbox_count()
        entries = await laptop.store.outbox_pending(100_000)
        last_number = max(e.client_seq for e in entries if isinstance(e.record, Session))
        laptop.sync.batch_size = 100
        receipt = await laptop.sync.sync_once(server.url, token)
        assert receipt.pending_after == 0 and receipt.flushed == queued, receipt
        assert sum(len(c) + len(k) for c, k in pushes) == queued  # every number, once
        assert len(pushes) > 2
        sent: set[str] = set()
        rows = []
        for changes, _ in pushes:
            sent.update(c.record.id for c in changes if isinstance(c.record, Message))
            for change in changes:
                if isinstance(change.record, Session):
                    rows.append(change.client_seq)
                    assert set(change.record.state.message_ids) <= sent  # none before them
        assert rows == [last_number]  # once, at its last number
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)
        texts = [m.content[0]["text"] for m in await phone.sessions.messages(session_id)]
        assert [t for t in texts if t.startswith("turn ")] == [f"turn {i}" for i in range(30)]


class Batches(SQLiteAdapter):
    """A SQLite store that keeps every batch its writes decided."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.batches: list[WriteBatch] = []

    async def transact(self, plan: Any) -> Any:
        async def keep(tx: Any) -> Any:
            batch = await plan(tx)
            if batch is not None:
                self.batches.append(batch)
            return batch

        return await super().transact(keep)


async def test_a_pull_does_not_write_again_the_messages_a_device_holds(
    server: SyncServer, tmp_path: Path
) -> None:
    token = issue_token(SECRET, ALICE, 3600)
    store = Batches(tmp_path / "laptop.db")
    async with SessionRuntime(
        store, ScriptedProvider(), user_id=ALICE.user_id, org_id=ALICE.org_id, client_id="laptop"
    ) as laptop:
        await write_history(laptop, random.Random(7))
        ours = {
            m.id
            for s in await laptop.store.list_sessions()
            for m in await laptop.sessions.messages(s.id)
        }
        store.batches.clear()
        await laptop.sync.sync_once(server.url, token)  # pushes, then pulls its own changes back
        pulled = [b for b in store.batches if "cursor" in b.meta]
        assert pulled  # the pages were applied
        written = {r.id for b in pulled for r in b.records if isinstance(r, Message)}
        assert ours and not written & ours
        async with device(tmp_path / "phone.db", "phone") as phone:
            await phone.sync.sync_once(server.url, token)
            assert await holdings(phone) == await holdings(laptop)


@pytest.mark.parametrize("seed", range(6))
async def test_a_device_takes_its_own_rows_from_the_acks_and_pulls_none_back(
    server: SyncServer, tmp_path: Path, seed: int
) -> None:
    """Protocol 5: each ack says where the push's rows start, and a device at that cursor takes
    them from the ack. Generated: rounds in which the laptop, the phone or both write turns,
    some in one shared session, then sync in a random order in batches of random size. A
    device that pushed from the head applies no page row of its own (the second of two
    devices that raced pulls its rows back: the other's came first); every event is
    canonical once synced; both converge on what a new device pulls from the server."""
    rng = random.Random(seed)
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        own_rows: dict[str, list[str]] = {"laptop": [], "phone": []}
        for rt in (laptop, phone):
            apply = rt.sync._apply

            async def applied(
                changes: Any, to_cursor: int, bodies: Any = None, rt: Any = rt, apply: Any = apply
            ) -> int:
                own_rows[rt.client_id] += [
                    c.record.id for c in changes if c.record.client_id == rt.client_id
                ]
                return int(await apply(changes, to_cursor, bodies))

            rt.sync._apply = applied  # type: ignore[method-assign]

        async def sync(rt: SessionRuntime) -> None:
            rt.sync.batch_size = rng.randint(1, 8)
            receipt = await rt.sync.sync_once(server.url, token)
            assert receipt.pending_after == 0, receipt

        shared_session = (await laptop.create_session(title="both")).id
        await sync(laptop)
        await sync(phone)
        sessions = {
            laptop: [shared_session, (await laptop.create_session(title="laptop")).id],
            phone: [shared_session, (await phone.create_session(title="phone")).id],
        }
        await sync(laptop)
        await sync(phone)
        await sync(laptop)  # both at the head
        own_rows = {"laptop": [], "phone": []}
        for _ in range(rng.randint(2, 5)):
            writers = rng.sample([laptop, phone], rng.randint(1, 2))
            for rt in writers:
                for _ in range(rng.randint(1, 3)):
                    async for _ in rt.execute_message(rng.choice(sessions[rt]), "hello"):
                        pass
            order = rng.sample([laptop, phone], 2)
            for rt in order:
                await sync(rt)
            first = order[0] if order[0] in writers else order[1]
            assert own_rows[first.client_id] == [], "pushed from the head, pulled back"
            if len(writers) == 1:
                assert own_rows == {"laptop": [], "phone": []}
            await sync(order[0])  # both at the head before the next round
            own_rows = {"laptop": [], "phone": []}
        head = await server.store.head_cursor(ALICE)
        for rt in (laptop, phone):
            assert int(await rt.store.get_meta("cursor") or 0) == head
            for sid in sessions[rt]:
                assert all(e.canonical for e in await rt.store.list_events(sid))
        fresh = await stack.enter_async_context(device(tmp_path / "fresh.db", "fresh"))
        await fresh.sync.sync_once(server.url, token)
        assert await holdings(laptop) == await holdings(phone) == await holdings(fresh)


class HeldPushStore(SQLiteServerStore):
    """Holds the pushes of the device ``hold`` names before they reach the store, until
    ``release`` is set (``entered`` says one is waiting)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold: str | None = None
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def push(self, tenant: Tenant, client_id: str, *args: Any, **kwargs: Any) -> Any:
        if client_id == self.hold:
            self.entered.set()
            await self.release.wait()
        return await super().push(tenant, client_id, *args, **kwargs)


class SignallingDeque(deque[Any]):
    def __init__(self, arrived: asyncio.Event) -> None:
        super().__init__()
        self.arrived = arrived

    def append(self, item: Any) -> None:
        super().append(item)
        self.arrived.set()


async def test_an_ack_waits_for_the_live_page_of_the_rows_before_it(tmp_path: Path) -> None:
    """The laptop's push reaches the store only after the phone's has committed, so its ack
    says its rows start after the phone's, which the laptop has not applied yet (their live
    page waits in its queue while it flushes). The laptop keeps the ack, applies the phone's
    page, then takes its own rows from the ack: no pull, none of its own rows applied."""
    token = issue_token(SECRET, ALICE, 3600)
    async with (
        HeldPushStore(tmp_path / "server.db") as store,
        SyncServer(store, port=0, secret=SECRET) as srv,
        AsyncExitStack() as stack,
    ):
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        mine = (await laptop.create_session(title="laptop")).id
        theirs = (await phone.create_session(title="phone")).id
        for rt in (laptop, phone):
            await rt.sync.connect(srv.url, token)
        for rt in (laptop, phone, laptop):  # each holds the other's session
            assert await rt.sync.wait_until_synced(TIMEOUT), await rt.sync.status()
        own_rows: list[str] = []
        pulls = 0
        apply, pull = laptop.sync._apply, laptop.sync._pull

        async def applied(changes: Any, to_cursor: int, bodies: Any = None) -> int:
            own_rows.extend(c.record.id for c in changes if c.record.client_id == "laptop")
            return int(await apply(changes, to_cursor, bodies))

        async def pulled(link: Any) -> int:
            nonlocal pulls
            pulls += 1
            return int(await pull(link))

        laptop.sync._apply = applied  # type: ignore[method-assign]
        laptop.sync._pull = pulled  # type: ignore[method-assign]
        came = asyncio.Event()
        laptop.sync._live = SignallingDeque(came)

        store.hold = "laptop"
        async for _ in laptop.execute_message(mine, "from the laptop"):
            pass
        async with asyncio.timeout(TIMEOUT):
            await store.entered.wait()  # the laptop's push waits at the store's door
        async for _ in phone.execute_message(theirs, "from the phone"):
            pass
        assert await phone.sync.wait_until_synced(TIMEOUT), await phone.sync.status()
        async with asyncio.timeout(TIMEOUT):
            await came.wait()  # the phone's page is queued on the laptop, mid-flush
        store.release.set()
        assert await laptop.sync.wait_until_synced(TIMEOUT), await laptop.sync.status()
        assert await phone.sync.wait_until_synced(TIMEOUT), await phone.sync.status()

        assert own_rows == [] and pulls == 0
        head = await store.head_cursor(ALICE)
        assert int(await laptop.store.get_meta("cursor") or 0) == head
        assert all(e.canonical for e in await laptop.store.list_events(mine))
        assert await holdings(laptop) == await holdings(phone)


@pytest.mark.parametrize("pipeline", [1, 4])
async def test_a_flush_keeps_pushes_in_flight_and_settles_each_ack_in_order(
    server: SyncServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline: int
) -> None:
    """A flush sends up to ``pipeline`` pushes before it waits for the first ack (each starts
    after the last one sent), and settles the acks in order: every change is on the server
    once, none is pulled back, and a fresh device pulls what the writer holds."""
    pushes: list[int] = []
    in_flight: list[int] = []  # answers awaited when each push went out
    send_push, send = ClientProtocol.send_push, Link.send

    def recording(self: ClientProtocol, changes: list[Change], **kwargs: Any) -> int:
        pushes.append(len(changes) + len(kwargs.get("skipped") or []))
        return send_push(self, changes, **kwargs)

    async def counting(self: Link, request: Any) -> Any:
        before, waiting = len(pushes), len(self.waiters)
        sent = await send(self, request)
        if len(pushes) > before:
            in_flight.append(waiting)
        return sent

    monkeypatch.setattr(ClientProtocol, "send_push", recording)
    monkeypatch.setattr(Link, "send", counting)
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        await write_history(laptop, random.Random(pipeline))
        queued = await laptop.store.outbox_count()
        laptop.sync.batch_size, laptop.sync.pipeline = 3, pipeline
        applied: list[Any] = []
        laptop.events.on("sync.applied", applied.append)
        receipt = await laptop.sync.sync_once(server.url, token)
        assert receipt.outcome == "all-flushed" and receipt.flushed == queued, receipt
        assert sum(pushes) == queued and len(pushes) > pipeline  # every number, once
        assert max(in_flight) == pipeline - 1  # never more in flight than asked, and as many
        assert applied == []  # its own rows came back with the acks, not by a pull
        status = await laptop.sync.status()
        assert status.cursor == await server.store.head_cursor(ALICE)
        for session in await laptop.store.list_sessions():
            assert all(e.canonical for e in await laptop.store.list_events(session.id))
        feed = (await server.store.pull(ALICE, 0, 100_000)).changes
        held = [c.record.id for c in feed if not isinstance(c.record, Session)]
        assert len(held) == len(set(held))
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        await phone.sync.sync_once(server.url, token)
        assert await holdings(phone) == await holdings(laptop)


async def test_a_change_kept_back_mid_window_drops_the_pushes_after_it(
    server: SyncServer, tmp_path: Path
) -> None:
    """A change the server keeps back (a stamp ahead of its clock: 3011) in the middle of the
    pushes in flight: the server refuses the pushes after it as a sequence gap. The device
    drops them (it does not take them for numbers the server lost, which would make it take a
    new id), keeps the change and all after it queued, and every change before it is on the
    server, once."""
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        session_id = (await laptop.create_session(title="s")).id
        for _ in range(3):
            async for _ in laptop.execute_message(session_id, "before"):
                pass
        ahead = HybridClock("laptop", wall=lambda: int(time.time() * 1000) + 600_000).now()
        early = Message(
            id=uuid7(),
            session_id=session_id,
            org_id=ALICE.org_id,
            user_id=ALICE.user_id,
            client_id="laptop",
            hlc=ahead,
            role="user",
            content=[{"type": "text", "text": "from a clock ten minutes fast"}],
        )
        skewed = (await laptop.store.commit(WriteBatch(records=[early]))).client_seqs[0]
        for _ in range(3):
            async for _ in laptop.execute_message(session_id, "after"):
                pass
        queued = [e.client_seq for e in await laptop.store.outbox_pending(100_000)]
        laptop.sync.batch_size, laptop.sync.pipeline = 2, 4
        for _ in range(2):  # and again: the same, nothing more
            receipt = await laptop.sync.sync_once(server.url, token)
            assert laptop.client_id == "laptop", receipt
            assert receipt.pending_after == len([s for s in queued if s >= skewed]), receipt
            left = [e.client_seq for e in await laptop.store.outbox_pending(100_000)]
            assert left == [s for s in queued if s >= skewed]
            assert (await laptop.sync.status()).last_error_code == int(ErrorCode.CLOCK_SKEW)
            assert (await server.store.client_state(ALICE, "laptop"))[0] == skewed - 1
            feed = (await server.store.pull(ALICE, 0, 100_000)).changes
            held = [c.record.id for c in feed if not isinstance(c.record, Session)]
            assert len(held) == len(set(held))
            assert early.id not in held


async def test_a_live_page_alone_is_applied_without_an_outbox_read(
    server: SyncServer, tmp_path: Path
) -> None:
    """A device with nothing queued that receives another device's live page applies it
    without reading its outbox first (that read sat between the page and its apply); its own
    next write is flushed as ever."""
    token = issue_token(SECRET, ALICE, 3600)
    async with AsyncExitStack() as stack:
        laptop = await stack.enter_async_context(device(tmp_path / "laptop.db", "laptop"))
        phone = await stack.enter_async_context(device(tmp_path / "phone.db", "phone"))
        session_id = (await laptop.create_session(title="live")).id
        for rt in (laptop, phone):
            await rt.sync.connect(server.url, token)
            assert await rt.sync.wait_until_synced(TIMEOUT)
        reads: list[int] = []
        pending = phone.store.outbox_pending

        async def counted(*args: Any, **kwargs: Any) -> Any:
            reads.append(1)
            return await pending(*args, **kwargs)

        phone.store.outbox_pending = counted  # type: ignore[method-assign]
        applied = asyncio.Event()
        phone.events.on("sync.applied", lambda _: applied.set())
        for _ in range(3):
            applied.clear()
            async for _ in laptop.execute_message(session_id, "from the laptop"):
                pass
            async with asyncio.timeout(TIMEOUT):
                await applied.wait()
        assert reads == []  # three live pages, no outbox read
        async for _ in phone.execute_message(session_id, "and from the phone"):
            pass
        assert await phone.sync.wait_until_synced(TIMEOUT)
        assert reads and (await phone.sync.status()).pending == 0
        assert await laptop.sync.wait_until_synced(TIMEOUT)
        texts = [m.content[0]["text"] for m in await laptop.sessions.messages(session_id)]
        assert "and from the phone" in texts


async def test_a_flush_at_protocol_6_sends_the_outbox_as_its_stored_bytes(tmp_path: Path) -> None:
    """``_push_of`` cuts a push by the bytes it will send: the stored bytes of each record
    (the very objects the outbox read), once per record however many numbers refer to it;
    without them (a server before protocol 6), the records are sent and measured as such."""
    from pleach_client.sync import _push_of
    from shared import compact

    entries = await outbox_after_turns(tmp_path / "d.db", [f"turn {i}" for i in range(3)])
    assert all(compact.is_compact(e.body) for e in entries)
    changes, skipped, bodies = _push_of(entries, 1 << 30, True, True)
    assert bodies is not None and len(bodies) == len(changes) and skipped
    for change, body in zip(changes, bodies, strict=True):
        (entry,) = [e for e in entries if e.client_seq == change.client_seq]
        assert body is entry.body and compact.decode(body) == change.record
    plain, plain_skipped, none = _push_of(entries, 1 << 30, True, False)
    assert none is None and plain == changes and plain_skipped == skipped
    # A budget that holds the first few records' bytes and not the rest cuts there.
    first = sum(len(e.body) + 10 for e in entries[:3] if not e.again_later)
    cut, cut_skipped, cut_bodies = _push_of(entries, first, True, True)
    assert cut_bodies is not None and 0 < len(cut) + len(cut_skipped) < len(entries)


async def outbox_after_turns(path: Path, texts: list[str]) -> list[OutboxEntry]:
    """The outbox of a new device file at ``path`` after one session's turns of ``texts``."""
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        session = await rt.create_session(title="t")
        for text in texts:
            async for _ in rt.execute_message(session.id, text):
                pass
        return await rt.store.outbox_pending(1000)


async def test_a_push_to_a_server_before_protocol_9_is_cut_by_its_texts_written_out(
    tmp_path: Path,
) -> None:
    """Long texts are stored deflated (protocol 9); a server before it gets them written out
    (``compact.inflated``), so ``_push_of`` counts them so: a budget that holds every stored
    body holds only some of them written out, and the push it cuts fits the budget as sent."""
    from pleach_client.sync import _push_of
    from shared import compact

    rng = random.Random(3)  # a tool's log: about 10 KB that deflate about 11 times
    log = "\n".join(" ".join(rng.choice(("ok", "warn")) for _ in range(6)) for _ in range(400))
    entries = await outbox_after_turns(tmp_path / "d.db", [f"turn {i}: {log}" for i in range(4)])
    stored = sum(len(e.body) + 10 for e in entries)
    written = sum(len(compact.inflated(e.body)) + 10 for e in entries)
    assert written > 3 * stored
    whole, _, _ = _push_of(entries, stored, False, True)
    assert len(whole) == len(entries)  # the stored bytes: all of it
    cut, _, bodies = _push_of(entries, stored, False, True, deflated=False)
    assert bodies is not None and 0 < len(cut) < len(entries)
    assert all(compact.inflated(b) is b for b in bodies)  # given written out already
    sent = [compact.inflated(b) for b in bodies]
    assert sum(len(b) + 10 for b in sent[:-1]) <= stored
    assert [compact.decode(b) for b in sent] == [c.record for c in cut]


async def test_the_sync_loop_waits_on_one_event_for_any_work(tmp_path: Path) -> None:
    """A local commit wakes the loop's one wait (``_wait_for_work``) at once and is taken
    once; with nothing to do, the wait ends at its timeout and says so. A live page and the
    reader's end set the same event (the end-to-end tests cover them)."""
    async with device(tmp_path / "laptop.db", "laptop") as rt:
        sync = rt.sync
        assert not await sync._wait_for_work(0)
        session = await rt.create_session(title="s")  # a local commit
        assert session.id
        waiting = asyncio.ensure_future(sync._wait_for_work(None))
        assert await asyncio.wait_for(waiting, TIMEOUT)
        assert not sync._wake.is_set()  # taken: the next wait waits
        assert not await sync._wait_for_work(0)
        sync.notify_local_write()
        assert await sync._wait_for_work(None)


async def test_state_changes_notify_only_while_someone_waits(tmp_path: Path) -> None:
    """The loop pokes its state condition at every page and state change: a task each while
    a caller waits on it (``wait_for``, ``wait_until_synced``), none when nobody does."""
    async with device(tmp_path / "laptop.db", "laptop") as rt:
        sync = rt.sync
        before = len(asyncio.all_tasks())
        sync._poke()
        assert len(asyncio.all_tasks()) == before
        with sync._watching():
            sync._poke()
            assert len(asyncio.all_tasks()) == before + 1
        assert not await sync.wait_for(lambda: sync.connected, 0)
        flag: list[bool] = []
        waiting = asyncio.ensure_future(sync.wait_for(lambda: bool(flag), TIMEOUT))
        await asyncio.sleep(0)  # one turn of the loop: the wait has begun
        assert sync._watchers == 1 and not waiting.done()
        flag.append(True)
        sync._poke()
        assert await waiting
        assert sync._watchers == 0
