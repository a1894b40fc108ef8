"""The ``ServerStore`` conformance suite: every server store must pass it unchanged.

Subclass ``ServerStoreConformance`` in a backend's test module and provide two fixtures:

- ``make_store``: ``make_store(tx_wrapper=None) -> ServerStore``, a new UNOPENED store on the
  same database every time it is called within one test. ``tx_wrapper`` (when given) wraps
  the ``StoreTx`` each push runs against, so a test can inject faults mid-batch.
- ``server_store``: an open store from ``make_store()``, closed after the test.
- ``stored_rows``: ``await stored_rows(tenant) -> set[(kind, id)]``, the tenant's rows in the
  store's own tables (sessions, events and immutable records), read around the protocol: what
  a deletion must have removed is checked there, not only in the feed.

The suite uses only the ``ServerStore`` protocol (``compact_feed`` included) and ``StoreTx``;
each test works in fresh tenants, so stores on a shared database stay independent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, Protocol

import msgspec
import pytest

from pleach_server.store.apply import StoreTx
from pleach_server.store.base import (
    MAX_DEVICES_PER_TENANT,
    DeviceHealth,
    PullResult,
    PushResult,
    ServerStore,
    Tenant,
)
from shared import compact
from shared.clock import HybridClock, Order, vv_compare, wall_clock_ms
from shared.errors import CursorTooOld, ErrorCode, StorageUnavailable
from shared.hashchain import GENESIS, chain_audit, chain_event, verify_chain
from shared.idrefs import IdLayout
from shared.ids import uuid7
from shared.records import (
    CASCADE_KINDS,
    AuditRow,
    Change,
    Event,
    FeedChange,
    Message,
    Record,
    RecordKind,
    Session,
    SessionState,
    encode_record,
    record_kind,
)
from tests.server_factories import DAY_MS, Device, new_tenant

SMALL_BLOCKS: Final = IdLayout(inline=2, block=3)
"""A store (``_id_layout``) that keeps every session of more than two ids in blocks of three:
the whole suite takes the path of a long session's row at every read and write."""

TxWrapper = Callable[[StoreTx], StoreTx]
StoredRows = Callable[[Tenant], Awaitable[set[tuple[str, str]]]]


report = DeviceHealth.of
"""A device's health report as a server keeps it."""


class MakeStore(Protocol):
    def __call__(self, tx_wrapper: TxWrapper | None = None) -> ServerStore: ...


class InjectedFault(Exception):
    """Raised by ``FaultyTx``; a store must roll back and let it propagate unchanged."""


class FaultyTx:
    """A ``StoreTx`` that delegates to ``inner`` and misbehaves on its ``fail_at``-th write.

    Writes are ``put_session``, ``insert_if_absent`` and ``insert_event``. With ``block`` set,
    the failing write instead sets ``reached`` and waits forever (for cancellation tests).
    """

    def __init__(
        self,
        inner: StoreTx,
        fail_at: int,
        *,
        block: bool = False,
        reached: asyncio.Event | None = None,
    ) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.block = block
        self.writes = 0
        self.reached = reached or asyncio.Event()

    async def _write(self) -> None:
        self.writes += 1
        if self.writes == self.fail_at:
            self.reached.set()
            if self.block:
                await asyncio.Event().wait()
            raise InjectedFault(f"injected failure at write {self.writes}")

    async def lock_tenant(self, tenant: Tenant) -> None:
        await self.inner.lock_tenant(tenant)

    async def get_last_seq(self, tenant: Tenant, client_id: str) -> int:
        return await self.inner.get_last_seq(tenant, client_id)

    async def set_last_seq(self, tenant: Tenant, client_id: str, last_seq: int) -> None:
        await self.inner.set_last_seq(tenant, client_id, last_seq)

    async def owner_of(self, kind: RecordKind, record_id: str) -> Tenant | None:
        return await self.inner.owner_of(kind, record_id)

    async def get_session(self, session_id: str) -> Session | None:
        return await self.inner.get_session(session_id)

    async def put_session(self, session: Session) -> None:
        await self._write()
        await self.inner.put_session(session)

    async def insert_if_absent(self, record: Record) -> bool:
        await self._write()
        return await self.inner.insert_if_absent(record)

    async def last_event(self, session_id: str) -> tuple[int, str] | None:
        return await self.inner.last_event(session_id)

    async def insert_event(self, event: Event) -> None:
        await self._write()
        await self.inner.insert_event(event)

    async def audit_tail(self, client_id: str) -> tuple[int, str]:
        return await self.inner.audit_tail(client_id)

    async def delete_content(self, session_id: str) -> None:
        await self.inner.delete_content(session_id)

    async def append_feed(self, tenant: Tenant, record: Record) -> int:
        return await self.inner.append_feed(tenant, record)

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self.inner.head_cursor(tenant)


class FailAfterWritesTx(FaultyTx):
    """A ``StoreTx`` that fails at ``head_cursor``, after the batch's rows reached the database."""

    def __init__(self, inner: StoreTx) -> None:
        super().__init__(inner, fail_at=0)

    async def head_cursor(self, tenant: Tenant) -> int:
        head = await self.inner.head_cursor(tenant)
        raise InjectedFault(f"injected failure after the writes (head {head})")


class CollidingEventsTx(FaultyTx):
    """A ``StoreTx`` that places every event at ``sequence_number`` 1: the database refuses the
    second event of a session, in the middle of the batch's writes."""

    def __init__(self, inner: StoreTx) -> None:
        super().__init__(inner, fail_at=0)

    async def insert_event(self, event: Event) -> None:
        await self.inner.insert_event(msgspec.structs.replace(event, sequence_number=1))


async def _refused_as_a_copy_and_resend_held(
    store: ServerStore, clock: HybridClock, dev: Device, copy: Change, first: Session
) -> None:
    """``copy`` (another copy's session row under a used number) is answered 3012, and the
    device's first row resent under number 1 (a lost ack) is still a ``duplicate``."""
    result = await store.push(dev.tenant, dev.client_id, [copy], clock)
    assert statuses(result) == ["rejected"]
    assert codes(result) == [ErrorCode.IDENTITY_REUSED]
    again = await store.push(dev.tenant, dev.client_id, [Change(client_seq=1, record=first)], clock)
    assert statuses(again) == ["duplicate"]


async def pull_all(store: ServerStore, tenant: Tenant, cursor: int = 0) -> list[FeedChange]:
    """Every feed entry after ``cursor``, paging until ``more`` is false."""
    out: list[FeedChange] = []
    while True:
        page = await store.pull(tenant, cursor, 100)
        out.extend(page.changes)
        cursor = page.to_cursor
        if not page.more:
            return out


class PlacedHistory(msgspec.Struct):
    """What ``placed_history`` wrote: alice's two sessions (``other`` to be deleted, with its
    ``content``), a message whose feed entry a test takes away (``gone``) beside one it keeps
    (``first``), bob's session, and both tenants' feeds as pulled (cursor, record)."""

    alice: Device
    bob: Device
    session: Session
    other: Session
    first: Message
    gone: Message
    content: list[Record]
    before: list[tuple[int, Record]]
    theirs: list[tuple[int, Record]]

    @property
    def at(self) -> dict[str, int]:
        """Each of alice's records' cursor in ``before``, by its id."""
        return {record.id: cursor for cursor, record in self.before}


async def placed_history(store: ServerStore, clock: HybridClock) -> PlacedHistory:
    """A history for the migrations that move where a record's feed cursor is kept: two
    tenants, sessions, messages, events, an audit row, a checkpoint, and a session version
    that supersedes its first entry (which leaves a free cursor below the others)."""
    alice, bob = Device(new_tenant()), Device(new_tenant())
    session, other = alice.session(title="kept"), alice.session(title="deleted later")
    first, gone = alice.message(session.id), alice.message(session.id)
    content: list[Record] = [alice.message(other.id), alice.checkpoint(other.id)]
    for dev, records in (
        (alice, [session, first, gone, alice.event(session.id), alice.audit(session.id)]),
        (alice, [other, *content, alice.event(other.id)]),
        (bob, [bob.session(title="bob's")]),
    ):
        await store.push(dev.tenant, dev.client_id, dev.changes(*records), clock)
    renamed = alice.edit(session, title="renamed", message_ids=[first.id, gone.id])
    await store.push(alice.tenant, alice.client_id, alice.changes(renamed), clock)
    before = [(c.cursor, c.record) for c in await pull_all(store, alice.tenant)]
    theirs = [(c.cursor, c.record) for c in await pull_all(store, bob.tenant)]
    return PlacedHistory(alice, bob, renamed, other, first, gone, content, before, theirs)


def tombstone(dev: Device, session: Session) -> Session:
    """A device deletes ``session``: a new version with ``deleted`` set and an emptied state."""
    return msgspec.structs.replace(dev.edit(session, deleted=True), state=SessionState())


def kinds_of(feed: list[FeedChange], session_id: str) -> list[str]:
    """The kinds of the feed entries that are, or belong to, ``session_id``, in feed order."""
    return [
        record_kind(c.record)
        for c in feed
        if c.record.id == session_id or getattr(c.record, "session_id", None) == session_id
    ]


def statuses(result: PushResult) -> list[str]:
    return [r.status for r in result.results]


def codes(result: PushResult) -> list[int | None]:
    return [r.code for r in result.results]


class ServerStoreConformance:
    """Behaviour every ``ServerStore`` shares; see the module docstring for the fixtures."""

    @pytest.fixture
    def server_clock(self) -> HybridClock:
        return HybridClock(f"server-{uuid7()}")

    # -- device health (the /status page) ---------------------------------------------------

    async def test_health_keeps_the_latest_per_device(self, server_store: ServerStore) -> None:
        ann, bob = new_tenant(), new_tenant()
        await server_store.put_health([report(ann, "dev-1", b"first", 100.0)])
        await server_store.put_health(
            [report(ann, "dev-2", b"other", 101.0), report(ann, "dev-1", b"second", 102.0)]
        )
        await server_store.put_health([report(bob, "dev-1", b"bobs", 103.0)])
        await server_store.put_health([])  # nothing to write: no transaction, no error
        rows = [r for r in await server_store.list_health() if r.org_id in (ann.org_id, bob.org_id)]
        assert [(r.user_id, r.client_id, r.health, r.seen_at) for r in rows] == [
            (bob.user_id, "dev-1", b"bobs", 103.0),
            (ann.user_id, "dev-1", b"second", 102.0),
            (ann.user_id, "dev-2", b"other", 101.0),
        ]

    async def test_health_keeps_the_newest_whoever_writes_last(
        self, server_store: ServerStore
    ) -> None:
        """Two server processes may each hold a report of one device (it moved from one to the
        other) and write them in either order: the newer one stays."""
        tenant = new_tenant()
        await server_store.put_health([report(tenant, "dev-1", b"newer", 200.0)])
        await server_store.put_health([report(tenant, "dev-1", b"older", 150.0)])
        rows = [r for r in await server_store.list_health() if r.org_id == tenant.org_id]
        assert [(r.client_id, r.health, r.seen_at) for r in rows] == [("dev-1", b"newer", 200.0)]

    async def test_health_keeps_a_bounded_number_of_devices(
        self, server_store: ServerStore
    ) -> None:
        """A user (or a hostile client) inventing device ids cannot grow the table: the
        least recently seen devices go, whether their reports come one by one or together."""
        one_by_one, together = new_tenant(), new_tenant()
        extra = 5
        count = MAX_DEVICES_PER_TENANT + extra
        for i in range(count):
            await server_store.put_health([report(one_by_one, f"dev-{i}", b"h", 1000.0 + i)])
        await server_store.put_health(
            [report(together, f"dev-{i}", b"h", 1000.0 + i) for i in range(count)]
        )
        for tenant in (one_by_one, together):
            rows = [r for r in await server_store.list_health(10_000) if r.org_id == tenant.org_id]
            assert len(rows) == MAX_DEVICES_PER_TENANT
            assert {r.client_id for r in rows} == {f"dev-{i}" for i in range(extra, count)}

    # -- basics --------------------------------------------------------------------------------

    async def test_fresh_tenant_is_empty(self, server_store: ServerStore) -> None:
        tenant = new_tenant()
        assert isinstance(server_store, ServerStore)
        assert await server_store.healthy()
        assert await server_store.client_state(tenant, "dev-1") == (0, 0)
        assert await server_store.head_cursor(tenant) == 0
        assert await server_store.pull(tenant, 0, 10) == PullResult(
            changes=[], to_cursor=0, more=False
        )

    async def test_push_applies_every_kind(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        records = dev.one_of_each()
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(*records), server_clock
        )
        assert statuses(result) == ["applied"] * 6
        assert [r.client_seq for r in result.results] == [1, 2, 3, 4, 5, 6]
        cursors = [r.cursor for r in result.results]
        assert result.cursors == cursors
        assert result.cursors == sorted(result.cursors) and len(set(result.cursors)) == 6
        assert result.last_seq == 6
        assert result.head_cursor == result.cursors[-1]
        assert await server_store.head_cursor(dev.tenant) == result.head_cursor
        assert await server_store.client_state(dev.tenant, dev.client_id) == (
            6,
            result.head_cursor,
        )

        feed = await pull_all(server_store, dev.tenant)
        assert [c.cursor for c in feed] == result.cursors
        pulled = [c.record for c in feed]
        for before, after in zip(records, pulled, strict=True):
            if isinstance(before, Event):
                assert isinstance(after, Event) and after.id == before.id
                assert after.canonical and after.sequence_number == 1
            else:
                assert after == before

    async def test_records_are_kept_and_served_as_their_bytes(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """Protocol 6: a record stored as pushed keeps the compact bytes it came in, byte for
        byte; one pushed in the map form, or changed on the way in (an event placed, a merged
        session), is stored compact; ``pull(raw=True)`` serves the stored bytes, and they
        read as exactly what a decoding pull returns. The live page a push describes carries
        the same bytes."""
        dev = Device(new_tenant())
        records = dev.one_of_each()
        session = records[0]
        records.append(dev.message(session.id, "in the map form"))
        sent = [compact.encode(r) for r in records[:-1]] + [encode_record(records[-1])]
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(*records), server_clock, bodies=sent
        )
        assert statuses(result) == ["applied"] * 7
        raw = await server_store.pull(dev.tenant, 0, 100, raw=True)
        decoded = await server_store.pull(dev.tenant, 0, 100)
        assert raw.changes == [] and (raw.to_cursor, raw.more) == (decoded.to_cursor, False)
        assert raw.entries() == decoded.changes
        stored = [bytes(b.body) for b in raw.bodies]
        assert all(compact.is_compact(b) for b in stored)
        for record, body, mine, pulled in zip(records, stored, sent, decoded.changes, strict=True):
            assert compact.decode(body) == pulled.record
            placed = isinstance(record, Event)  # the server gave it its canonical place
            assert (body == mine) is (not placed and compact.is_compact(mine)), record_kind(record)
        assert stored[-1] == compact.encode(records[-1])  # the map form, stored compact
        assert result.bodies == stored  # what a live page of this push carries
        # Events pushed at the places the server gives them: stored as the pushed bytes
        # marked canonical, made from those bytes (``canonical_body``), not encoded again.
        head = next(r for r in decoded.changes if isinstance(r.record, Event)).record
        e2 = chain_event(dev.event(session.id, n=2), head.row_hash, 2)
        e3 = chain_event(dev.event(session.id, n=3), e2.row_hash, 3)
        sent = [compact.encode(e) for e in (e2, e3)]
        placed = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(e2, e3), server_clock, bodies=sent
        )
        assert statuses(placed) == ["applied"] * 2 and placed.as_pushed
        page = await server_store.pull(dev.tenant, raw.to_cursor, 100, raw=True)
        assert [bytes(b.body) for b in page.bodies] == [compact.canonical_body(b) for b in sent]
        assert [c.record for c in page.entries()] == [
            msgspec.structs.replace(e, canonical=True) for e in (e2, e3)
        ]

    # -- idempotency -------------------------------------------------------------------------

    async def test_resend_is_idempotent(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(session, dev.message(session.id), dev.event(session.id))
        first = await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
        assert statuses(first) == ["applied"] * 3

        again = await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
        assert statuses(again) == ["duplicate"] * 3
        assert again.cursors == [] and all(r.cursor is None for r in again.results)
        assert again.last_seq == 3 and again.head_cursor == first.head_cursor
        assert len(await pull_all(server_store, dev.tenant)) == 3

        # A resend overlapping new work: the old part is duplicate, the new part applies.
        extra = dev.changes(dev.message(session.id))
        overlap = await server_store.push(
            dev.tenant, dev.client_id, batch[1:] + extra, server_clock
        )
        assert statuses(overlap) == ["duplicate", "duplicate", "applied"]
        assert overlap.last_seq == 4
        assert len(await pull_all(server_store, dev.tenant)) == 4

    async def test_same_record_under_new_seq_is_duplicate(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        message, event = dev.message(session.id), dev.event(session.id)
        await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, message, event), server_clock
        )
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(message, event), server_clock
        )
        assert statuses(result) == ["duplicate", "duplicate"]
        assert result.last_seq == 5
        assert len(await pull_all(server_store, dev.tenant)) == 3

    async def test_a_different_change_under_a_used_seq_is_identity_reused(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A copy of the device (restored or copied file) reuses its numbers for new changes:
        they are not duplicates, and the copy is told so (3012) instead of dropping them."""
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(session, dev.message(session.id), dev.event(session.id))
        await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
        copy = [
            Change(client_seq=2, record=dev.message(session.id)),
            Change(client_seq=3, record=dev.event(session.id)),
        ]
        result = await server_store.push(dev.tenant, dev.client_id, copy, server_clock)
        assert statuses(result) == ["rejected", "rejected"]
        assert codes(result) == [ErrorCode.IDENTITY_REUSED] * 2
        assert result.last_seq == 3 and result.cursors == []
        assert len(await pull_all(server_store, dev.tenant)) == 3
        # The original's own resend (a lost ack) is still a duplicate, mixed in or not.
        again = await server_store.push(
            dev.tenant, dev.client_id, batch[1:] + copy[:1], server_clock
        )
        assert statuses(again) == ["duplicate", "duplicate", "rejected"]

    async def test_a_copys_session_version_under_a_used_seq_is_identity_reused(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A session's id is shared by both copies of a device: a version the stored row does
        not include, sent under a number the server used for another change, was never taken.
        Answered ``duplicate``, the copy dropped it (its rename and artifact, found by the
        simulation on seed 640,284 with PostgreSQL)."""
        dev = Device(new_tenant())
        session = dev.session(title="s0")
        await server_store.push(dev.tenant, dev.client_id, dev.changes(session), server_clock)
        # The original writes a message under number 2; its copy, from the same file, edits
        # the session twice (its own counter 2, then 3) and sends the row under number 2.
        original = dev.changes(dev.message(session.id))
        await server_store.push(dev.tenant, dev.client_id, original, server_clock)
        renamed = dev.edit(dev.edit(session, title="t5"), title="t12")
        # A version the row includes, resent after a lost ack, is still a duplicate: the
        # version itself, and (below) an older one once a newer version is stored.
        await _refused_as_a_copy_and_resend_held(
            server_store, server_clock, dev, Change(client_seq=2, record=renamed), session
        )
        newer = dev.changes(dev.edit(session, title="s1"))
        await server_store.push(dev.tenant, dev.client_id, newer, server_clock)
        older = await server_store.push(
            dev.tenant, dev.client_id, [Change(client_seq=1, record=session)], server_clock
        )
        assert statuses(older) == ["duplicate"]
        rows = [c.record for c in await pull_all(server_store, dev.tenant)]
        assert [r.title for r in rows if isinstance(r, Session)] == ["s1"]

    async def test_a_copys_new_session_under_a_used_seq_is_identity_reused(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A session the server has no row of was never taken, though its id is the tenant's
        once its ``session.created`` event is stored. The copy of a device created a session,
        its event went in under a fresh number, the original took the next numbers, and the
        row, sent under one of them, was answered ``duplicate``: no other device ever saw the
        session (found by the simulation on seed 691,062)."""
        dev = Device(new_tenant())
        first = dev.session()
        await server_store.push(dev.tenant, dev.client_id, dev.changes(first), server_clock)
        new = dev.session(title="s7")
        created = [Change(client_seq=2, record=dev.event(new.id))]  # the copy
        taken = await server_store.push(dev.tenant, dev.client_id, created, server_clock)
        assert statuses(taken) == ["applied"]
        original = [Change(client_seq=3, record=dev.event(first.id))]
        await server_store.push(dev.tenant, dev.client_id, original, server_clock)
        # The copy's row, under the original's number; the original's own row, resent.
        await _refused_as_a_copy_and_resend_held(
            server_store, server_clock, dev, Change(client_seq=3, record=new), first
        )

    async def test_resent_content_of_a_deleted_session_is_a_duplicate(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        message = dev.message(session.id)
        first = dev.changes(session, message)
        await server_store.push(dev.tenant, dev.client_id, first, server_clock)
        tomb = dev.edit(session, deleted=True)
        await server_store.push(dev.tenant, dev.client_id, dev.changes(tomb), server_clock)
        again = await server_store.push(dev.tenant, dev.client_id, first[1:], server_clock)
        assert statuses(again) == ["duplicate"]

    async def test_records_of_the_devices_earlier_ids_are_accepted(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        old = Device(new_tenant())
        new = Device(old.tenant)
        session = old.session()
        queued = [session, old.message(session.id)]  # written before the device re-keyed
        changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(queued)]
        refused = await server_store.push(new.tenant, new.client_id, changes, server_clock)
        assert codes(refused) == [ErrorCode.INVALID_RECORD] * 2
        other = Device(old.tenant)
        again = [Change(client_seq=i + 1, record=r) for i, r in enumerate(queued)]
        taken = await server_store.push(
            other.tenant, other.client_id, again, server_clock, aliases={old.client_id}
        )
        assert statuses(taken) == ["applied", "applied"]

    async def test_sequence_gap_rejects_rest_and_keeps_last_seq(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        m = [dev.message(session.id) for _ in range(4)]
        await server_store.push(dev.tenant, dev.client_id, dev.changes(session), server_clock)

        gapped = [Change(client_seq=4, record=m[2]), Change(client_seq=5, record=m[3])]
        result = await server_store.push(dev.tenant, dev.client_id, gapped, server_clock)
        assert statuses(result) == ["rejected", "rejected"]
        assert codes(result) == [ErrorCode.SEQUENCE_GAP] * 2
        assert result.last_seq == 1 and result.cursors == []
        assert await server_store.client_state(dev.tenant, dev.client_id) == (
            1,
            result.head_cursor,
        )

        # A gap mid-batch: what precedes it applies, everything after it is rejected.
        mixed = [
            Change(client_seq=2, record=m[0]),
            Change(client_seq=4, record=m[2]),
            Change(client_seq=3, record=m[1]),
        ]
        result = await server_store.push(dev.tenant, dev.client_id, mixed, server_clock)
        assert statuses(result) == ["applied", "rejected", "rejected"]
        assert codes(result) == [None, ErrorCode.SEQUENCE_GAP, ErrorCode.SEQUENCE_GAP]
        assert result.last_seq == 2

        # The device resends from last_seq + 1 and everything lands.
        resend = [Change(client_seq=3 + i, record=m[1 + i]) for i in range(3)]
        result = await server_store.push(dev.tenant, dev.client_id, resend, server_clock)
        assert statuses(result) == ["applied"] * 3 and result.last_seq == 5
        feed = await pull_all(server_store, dev.tenant)
        assert [c.record.id for c in feed] == [session.id] + [x.id for x in m]

    async def test_rejected_change_advances_last_seq(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        foreign = msgspec.structs.replace(dev.message(session.id), org_id="someone-else")
        ok = dev.message(session.id)
        batch = dev.changes(session, foreign, ok)
        result = await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
        assert statuses(result) == ["applied", "rejected", "applied"]
        assert codes(result) == [None, ErrorCode.FORBIDDEN, None]
        assert result.results[1].message
        assert result.last_seq == 3
        assert await server_store.client_state(dev.tenant, dev.client_id) == (
            3,
            result.head_cursor,
        )
        feed = await pull_all(server_store, dev.tenant)
        assert [c.record.id for c in feed] == [session.id, ok.id]
        # Resending the rejected change is a duplicate: it is never re-evaluated.
        again = await server_store.push(dev.tenant, dev.client_id, batch[1:2], server_clock)
        assert statuses(again) == ["duplicate"]

    # -- validation --------------------------------------------------------------------------

    @pytest.mark.parametrize("squatter_first", [False, True], ids=["after", "before"])
    async def test_ids_are_scoped_to_their_tenant(
        self, server_store: ServerStore, server_clock: HybridClock, squatter_first: bool
    ) -> None:
        """Nobody can take another user's ids: a user who learns ids of someone else (synced
        or not yet) and pushes records under them, before or after the owner, writes only in
        their own namespace. The owner's records are applied, unchanged and unseen by them."""
        alice, mallory = Device(new_tenant()), Device(new_tenant())
        session = alice.session(title="alice's")
        message = alice.message(session.id)
        event = alice.event(session.id)
        squat: list[Record] = [
            msgspec.structs.replace(mallory.message(uuid7()), id=message.id),
            msgspec.structs.replace(mallory.event(uuid7()), id=event.id),
            mallory.session(id=session.id, title="mine now"),
            mallory.message(session.id),
            mallory.event(session.id),
            mallory.checkpoint(session.id),
        ]

        async def owner() -> PushResult:
            return await server_store.push(
                alice.tenant, alice.client_id, alice.changes(session, message, event), server_clock
            )

        async def squatter() -> PushResult:
            return await server_store.push(
                mallory.tenant, mallory.client_id, mallory.changes(*squat), server_clock
            )

        if squatter_first:
            theirs, ours = await squatter(), await owner()
        else:
            ours, theirs = await owner(), await squatter()
        assert statuses(ours) == ["applied"] * 3
        assert statuses(theirs) == ["applied"] * len(squat)
        feed = await pull_all(server_store, alice.tenant)
        assert [c.record for c in feed[:2]] == [session, message]
        assert [c.record.id for c in feed] == [session.id, message.id, event.id]
        assert feed[2].record.sequence_number == 1  # type: ignore[union-attr]
        assert verify_chain([c.record for c in feed[2:]]).ok  # type: ignore[misc]
        others = await pull_all(server_store, mallory.tenant)
        assert {c.record.org_id for c in others} == {mallory.tenant.org_id}
        events = [c.record for c in others if isinstance(c.record, Event)]
        assert [e.sequence_number for e in events if e.session_id == session.id] == [1]

    async def test_a_session_id_is_held_by_records_before_its_row(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        alice, mallory = Device(new_tenant()), Device(new_tenant())
        session_id = uuid7()  # alice's events arrive before her session row
        await server_store.push(
            alice.tenant, alice.client_id, alice.changes(alice.event(session_id)), server_clock
        )
        result = await server_store.push(
            mallory.tenant,
            mallory.client_id,
            mallory.changes(mallory.event(session_id), mallory.session(id=session_id)),
            server_clock,
        )
        assert statuses(result) == ["applied", "applied"]
        later = await server_store.push(
            alice.tenant, alice.client_id, alice.changes(alice.session(id=session_id)), server_clock
        )
        assert statuses(later) == ["applied"]
        feed = await pull_all(server_store, alice.tenant)
        assert [type(c.record).__name__ for c in feed] == ["Event", "Session"]

    async def test_invalid_records_are_rejected_3007(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        bad: list[Record] = [
            msgspec.structs.replace(dev.message(session.id), client_id="another-device"),
            msgspec.structs.replace(dev.message(session.id), hlc="yesterday"),
            msgspec.structs.replace(dev.message(session.id), id=""),
            msgspec.structs.replace(dev.event(session.id), session_id=""),
            msgspec.structs.replace(dev.session(), updated_at="not-a-stamp"),
        ]
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, *bad), server_clock
        )
        assert statuses(result) == ["applied"] + ["rejected"] * len(bad)
        assert codes(result)[1:] == [ErrorCode.INVALID_RECORD] * len(bad)
        assert result.last_seq == 1 + len(bad)
        assert len(await pull_all(server_store, dev.tenant)) == 1

    async def test_poisoned_version_vectors_are_rejected_3007(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        huge = msgspec.structs.replace(dev.session(), vv={dev.client_id: 2**63 - 1})
        crowded = msgspec.structs.replace(
            dev.session(), vv={f"d{i}": 1 for i in range(5000)} | {dev.client_id: 1}
        )
        ok = dev.session()
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(huge, crowded, ok), server_clock
        )
        assert codes(result) == [ErrorCode.INVALID_RECORD, ErrorCode.INVALID_RECORD, None]

    async def test_clock_skew_is_rejected_3011(self, server_store: ServerStore) -> None:
        tenant = new_tenant()
        clock = HybridClock(f"server-{uuid7()}", max_skew_ms=60_000)
        ahead = Device(tenant, wall=lambda: wall_clock_ms() + DAY_MS)
        session = ahead.session()
        result = await server_store.push(
            tenant, ahead.client_id, ahead.changes(session, ahead.message(session.id)), clock
        )
        assert codes(result) == [ErrorCode.CLOCK_SKEW, ErrorCode.CLOCK_SKEW]
        assert "in the future" in (result.results[0].message or "")
        # Not taken: the device keeps both and sends them again when its clock is right.
        assert result.last_seq == 0 and result.cursors == []
        # The server clock did not jump a day ahead by looking at the rejected stamps.
        assert clock.now() < session.hlc
        fixed = Device(tenant, client_id=ahead.client_id)  # the same device, clock fixed
        again = fixed.session()
        result = await server_store.push(tenant, fixed.client_id, fixed.changes(again), clock)
        assert statuses(result) == ["applied"] and result.last_seq == 1

        on_time = Device(tenant)
        ok = on_time.session()
        result = await server_store.push(tenant, on_time.client_id, on_time.changes(ok), clock)
        assert statuses(result) == ["applied"]

    # -- sessions --------------------------------------------------------------------------------

    async def test_session_versions_dominate_or_are_superseded(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)

        v2 = phone.edit(v1, title="v2")
        result = await server_store.push(tenant, phone.client_id, phone.changes(v2), server_clock)
        assert statuses(result) == ["applied"]
        assert result.results[0].cursor == result.head_cursor

        stale = await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        same = await server_store.push(tenant, phone.client_id, phone.changes(v2), server_clock)
        assert statuses(stale) == ["superseded"] and statuses(same) == ["superseded"]
        assert stale.cursors == [] and same.cursors == []
        assert stale.results[0].conflict is None

        # A session keeps one feed entry: its latest version's (v1's went when v2 came).
        feed = await pull_all(server_store, tenant)
        assert [c.record for c in feed] == [v2]
        assert [c.cursor for c in feed] == result.cursors

    async def test_a_relayed_version_the_server_holds_is_superseded_not_refused(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        # A device's queued row refers to its session's current version; after it pulled a
        # newer version written by another device, that is what the row sends.
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        v2 = phone.edit(v1, title="v2")
        await server_store.push(tenant, phone.client_id, phone.changes(v2), server_clock)
        relayed = await server_store.push(
            tenant, laptop.client_id, laptop.changes(v2, v1), server_clock
        )
        assert statuses(relayed) == ["superseded", "superseded"]
        # A version the server does not hold, in another device's name, is still refused.
        forged = phone.edit(v2, title="forged")
        refused = await server_store.push(
            tenant, laptop.client_id, laptop.changes(forged), server_clock
        )
        assert statuses(refused) == ["rejected"] and codes(refused) == [ErrorCode.INVALID_RECORD]
        feed = await pull_all(server_store, tenant)
        assert [c.record for c in feed] == [v2]

    async def test_concurrent_push_that_wins_forks_the_server_version(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1", message_ids=["m1"])
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        on_phone = phone.edit(v1, title="phone", message_ids=["m1", "p2"])
        await server_store.push(tenant, phone.client_id, phone.changes(on_phone), server_clock)

        laptop.clock.observe(on_phone.updated_at)  # the laptop writes later: it wins LWW
        on_laptop = laptop.edit(v1, title="laptop", message_ids=["m1", "l2"])
        before = await server_store.head_cursor(tenant)
        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(on_laptop), server_clock
        )
        change = result.results[0]
        assert change.status == "resolved"
        receipt = change.conflict
        assert receipt is not None
        assert receipt.session_id == v1.id and receipt.winner == "local"
        assert receipt.fork_session_id not in ("", v1.id)
        assert receipt.conflict_id and receipt.detected_at
        paths = {p.path: p for p in receipt.conflicted_paths}
        assert set(paths) == {"title", "state.message_ids"}
        assert paths["title"].local_value == "laptop"
        assert paths["title"].remote_value == "phone"
        assert {p.chosen_side for p in paths.values()} == {"local"}

        feed = await pull_all(server_store, tenant, before)
        assert [c.cursor for c in feed] == result.cursors and len(feed) == 3
        assert change.cursor == result.cursors[-1] == result.head_cursor
        winner, logged, fork = (c.record for c in feed)
        # The server logs the conflict in the session's log, so every device learns of it.
        assert isinstance(logged, Event) and logged.type == "sync.conflict"
        assert logged.session_id == v1.id and logged.canonical
        assert logged.payload["conflict_id"] == receipt.conflict_id
        assert logged.payload["fork_session_id"] == receipt.fork_session_id
        assert isinstance(winner, Session) and isinstance(fork, Session)
        assert winner.id == v1.id and winner.title == "laptop"
        assert winner.state.message_ids == ["m1", "l2"]
        assert winner.conflict_id == receipt.conflict_id
        assert vv_compare(winner.vv, on_laptop.vv) is Order.DOMINATES
        assert vv_compare(winner.vv, on_phone.vv) is Order.DOMINATES
        assert server_clock.client_id in winner.vv

        assert fork.id == receipt.fork_session_id
        assert fork.title == "phone" and fork.state.message_ids == ["m1", "p2"]
        assert fork.forked_from == v1.id and fork.conflict_id == receipt.conflict_id
        assert fork.conflict_loser_side == "remote"
        assert fork.vv == {server_clock.client_id: 1}
        assert (fork.org_id, fork.user_id) == (tenant.org_id, tenant.user_id)
        assert fork.updated_at == fork.hlc > on_laptop.updated_at

        # Both devices now converge: the winner dominates what either of them holds.
        stale = await server_store.push(
            tenant, phone.client_id, phone.changes(on_phone), server_clock
        )
        assert statuses(stale) == ["superseded"]

    async def test_concurrent_push_that_loses_becomes_the_fork(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        on_laptop = laptop.edit(v1, title="laptop", message_ids=["l1"])
        phone.clock.observe(on_laptop.updated_at)  # the phone writes later: it wins LWW
        on_phone = phone.edit(v1, title="phone")
        await server_store.push(tenant, phone.client_id, phone.changes(on_phone), server_clock)

        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(on_laptop), server_clock
        )
        receipt = result.results[0].conflict
        assert result.results[0].status == "resolved" and receipt is not None
        assert receipt.winner == "remote"
        assert {p.chosen_side for p in receipt.conflicted_paths} == {"remote"}
        winner, fork = [
            c.record for c in await pull_all(server_store, tenant) if isinstance(c.record, Session)
        ][-2:]
        assert isinstance(winner, Session) and isinstance(fork, Session)
        assert winner.id == v1.id and winner.title == "phone"
        assert vv_compare(winner.vv, on_laptop.vv) is Order.DOMINATES
        assert vv_compare(winner.vv, on_phone.vv) is Order.DOMINATES
        assert fork.id == receipt.fork_session_id and fork.title == "laptop"
        assert fork.state.message_ids == ["l1"]
        assert fork.conflict_loser_side == "local" and fork.forked_from == v1.id

    # -- long sessions (their message ids kept in blocks beside the row) ------------------------

    async def test_a_long_sessions_ids_survive_every_change_of_its_list(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A session of more ids than a row keeps in its body (128, or what a test sets)
        reads back whole after each kind of change to its list: a turn's append, a new block,
        a rollback to fewer ids (blocks dropped) and to a short list (kept in the body again),
        a list changed in the middle (a merge), and a list that grows again. A pull serves the
        very bytes pushed, a decoding pull the very version, and the next push's merge reads
        the whole list (a stale version is superseded, not taken as new)."""
        dev = Device(new_tenant())
        ids = [uuid7() for _ in range(400)]
        lists = [ids[:300], ids[:302], ids[:390], ids[:140], ids[:40], ids[:2], ids[:1]]
        middle = [*ids[:100], *reversed(ids[100:200]), *ids[200:260]]
        lists += [middle, [*middle, *ids[260:262]], ids[:400], ids[:129], ids[:0], ids[:300]]
        versions = [dev.session(title="long", message_ids=lists[0])]
        for later in lists[1:]:
            versions.append(dev.edit(versions[-1], message_ids=later))
        cursor = 0
        for version in versions:
            sent = compact.encode(version)
            result = await server_store.push(
                dev.tenant, dev.client_id, dev.changes(version), server_clock, bodies=[sent]
            )
            assert statuses(result) == ["applied"]
            raw = await server_store.pull(dev.tenant, cursor, 100, raw=True)
            assert [bytes(b.body) for b in raw.bodies] == [sent]
            decoded = await server_store.pull(dev.tenant, cursor, 100)
            assert [c.record for c in decoded.changes] == [version]
            assert [c.record for c in await pull_all(server_store, dev.tenant)] == [version]
            cursor = raw.to_cursor
        # The merge reads the stored list whole: the last version read back dominates an
        # earlier one, which is superseded.
        stale = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(versions[3]), server_clock
        )
        assert statuses(stale) == ["superseded"]

    async def test_a_long_sessions_ids_are_kept_by_a_conflict_and_a_delete(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """Two devices write a long session at once: the loser's whole list is the fork's,
        the winner's the session's."""
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        messages = [laptop.message(v1.id, f"m{i}") for i in range(300)]
        shared_ids = [m.id for m in messages[:200]]
        first = await server_store.push(
            tenant, laptop.client_id, laptop.changes(v1, *messages), server_clock
        )
        assert set(statuses(first)) == {"applied"}
        on_phone = phone.edit(v1, title="phone", message_ids=[*shared_ids, messages[250].id])
        await server_store.push(tenant, phone.client_id, phone.changes(on_phone), server_clock)
        laptop.clock.observe(on_phone.updated_at)  # the laptop writes later: it wins LWW
        on_laptop = laptop.edit(v1, title="laptop", message_ids=[m.id for m in messages])
        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(on_laptop), server_clock
        )
        receipt = result.results[0].conflict
        assert result.results[0].status == "resolved" and receipt is not None
        sessions = {
            c.record.id: c.record
            for c in await pull_all(server_store, tenant)
            if isinstance(c.record, Session)
        }
        assert sessions[v1.id].state.message_ids == [m.id for m in messages]
        fork = sessions[receipt.fork_session_id]
        assert fork.state.message_ids == [*shared_ids, messages[250].id]

        # A user's fork sharing 201 of a long session's messages: deleting the session
        # leaves those (read from the fork's stored list) and takes the others.
        dev = Device(new_tenant())
        origin = dev.session(title="origin")
        messages = [dev.message(origin.id, f"m{i}") for i in range(300)]
        origin = dev.edit(origin, message_ids=[m.id for m in messages])
        fork = dev.session(
            title="fork", message_ids=[m.id for m in messages[:200]] + [messages[250].id]
        )
        fork = msgspec.structs.replace(fork, forked_from=origin.id)
        await server_store.push(
            dev.tenant, dev.client_id, dev.changes(*messages, origin, fork), server_clock
        )
        gone = tombstone(dev, origin)
        deleted = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(gone), server_clock
        )
        assert statuses(deleted) == ["applied"]
        left = {c.record.id for c in await pull_all(server_store, dev.tenant)}
        kept = {m.id for m in messages[:200]} | {messages[250].id}
        assert kept <= left
        assert not ({m.id for m in messages} - kept) & left

    # -- events ----------------------------------------------------------------------------------

    async def test_events_get_canonical_contiguous_places(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        session = laptop.session()
        other = laptop.session()
        e = [laptop.event(session.id, n=1), laptop.event(session.id, n=2)]
        await server_store.push(
            tenant,
            laptop.client_id,
            laptop.changes(session, other, *e, laptop.event(other.id)),
            server_clock,
        )
        e.append(phone.event(session.id, n=3))
        await server_store.push(tenant, phone.client_id, phone.changes(e[-1]), server_clock)
        e.append(laptop.event(session.id, n=4))
        await server_store.push(tenant, laptop.client_id, laptop.changes(e[-1]), server_clock)
        dup = await server_store.push(tenant, laptop.client_id, laptop.changes(e[0]), server_clock)
        assert statuses(dup) == ["duplicate"]

        events = [
            c.record
            for c in await pull_all(server_store, tenant)
            if isinstance(c.record, Event) and c.record.session_id == session.id
        ]
        assert [ev.id for ev in events] == [x.id for x in e]
        assert [ev.sequence_number for ev in events] == [1, 2, 3, 4]
        assert all(ev.canonical for ev in events)
        assert [ev.payload for ev in events] == [x.payload for x in e]
        check = verify_chain(events)
        assert check.ok, check
        assert events[0].prev_hash == ""

    async def test_a_push_stored_as_pushed_says_so_and_where_its_rows_start(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """``as_pushed`` (what a version 5 ack vouches for): the push's feed rows follow
        ``previous_head`` and are its changes as pushed, events only marked canonical. Not when
        the server placed an event elsewhere, forked a session, or deleted one."""
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        session = laptop.session(title="v1")
        e1, e2 = (chain_event(laptop.event(session.id, n=n), GENESIS, 1) for n in (1, 2))
        e2 = chain_event(e2, e1.row_hash, 2)
        records = [session, laptop.message(session.id), e1, e2]
        before = await server_store.head_cursor(tenant)
        first = await server_store.push(
            tenant, laptop.client_id, laptop.changes(*records), server_clock
        )
        assert first.as_pushed and first.previous_head == before
        feed = await pull_all(server_store, tenant, before)
        assert [c.cursor for c in feed] == [r.cursor for r in first.results]
        canon = [msgspec.structs.replace(e, canonical=True) for e in (e1, e2)]
        assert [c.record for c in feed] == [*records[:2], *canon]

        on_phone = chain_event(phone.event(session.id, n=3), e2.row_hash, 3)
        second = await server_store.push(
            tenant, phone.client_id, phone.changes(on_phone), server_clock
        )
        assert second.as_pushed and second.previous_head == first.head_cursor
        # The laptop had not seen the phone's event: the server places its own after it.
        stale = chain_event(laptop.event(session.id, n=4), e2.row_hash, 3)
        moved = await server_store.push(
            tenant, laptop.client_id, laptop.changes(stale), server_clock
        )
        assert statuses(moved) == ["applied"] and not moved.as_pushed
        provisional = await server_store.push(
            tenant, laptop.client_id, laptop.changes(laptop.event(session.id)), server_clock
        )
        assert not provisional.as_pushed

        on_laptop = laptop.edit(session, title="laptop")
        phone.clock.observe(on_laptop.updated_at)
        await server_store.push(
            tenant, phone.client_id, phone.changes(phone.edit(session, title="p")), server_clock
        )
        forked = await server_store.push(
            tenant, laptop.client_id, laptop.changes(on_laptop), server_clock
        )
        assert statuses(forked) == ["resolved"] and not forked.as_pushed
        gone = msgspec.structs.replace(laptop.edit(session, title="x"), deleted=True)
        deleted = await server_store.push(
            tenant, laptop.client_id, laptop.changes(gone), server_clock
        )
        assert not deleted.as_pushed
        nothing = await server_store.push(
            tenant, laptop.client_id, [Change(client_seq=1, record=records[1])], server_clock
        )
        assert statuses(nothing) == ["duplicate"] and not nothing.as_pushed

    async def test_concurrent_pushes_keep_chains_contiguous(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        devices = [Device(tenant) for _ in range(3)]
        session = devices[0].session()
        await server_store.push(
            tenant, devices[0].client_id, devices[0].changes(session), server_clock
        )
        pushes = [
            server_store.push(
                tenant,
                d.client_id,
                d.changes(*(d.event(session.id, i=i) for i in range(3))),
                server_clock,
            )
            for d in devices
        ]
        results = await asyncio.gather(*pushes)
        assert all(statuses(r) == ["applied"] * 3 for r in results)
        events = [
            c.record for c in await pull_all(server_store, tenant) if isinstance(c.record, Event)
        ]
        assert sorted(ev.sequence_number for ev in events) == list(range(1, 10))
        assert [ev.sequence_number for ev in events] == list(range(1, 10))  # feed order
        assert verify_chain(events).ok

    # -- skipped numbers (protocol 4) -------------------------------------------------------------

    async def test_skipped_numbers_fill_the_sequence_and_change_nothing(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A session queued once per turn goes once, at its last number; the numbers before
        it are skipped. Each skipped number is answered ``superseded`` in sequence with the
        changes, so the changes after it apply (their lookups included), and a resend of it is
        a ``duplicate``. A number neither sent nor skipped is still a gap (3006)."""
        dev = Device(new_tenant())
        session = dev.session()
        first, second = dev.message(session.id), dev.message(session.id)
        row = dev.edit(session, message_ids=[first.id, second.id])
        # client_seq 1: the session (skipped), 2: first, 3: the session (skipped), 4: second,
        # 5: the session, sent once with everything it refers to before it.
        changes = [
            Change(client_seq=2, record=first),
            Change(client_seq=4, record=second),
            Change(client_seq=5, record=row),
        ]
        result = await server_store.push(
            dev.tenant, dev.client_id, changes, server_clock, skipped=[1, 3]
        )
        assert [(r.client_seq, r.status) for r in result.results] == [
            (1, "superseded"),
            (2, "applied"),
            (3, "superseded"),
            (4, "applied"),
            (5, "applied"),
        ]
        assert result.last_seq == 5
        feed = [c.record for c in await pull_all(server_store, dev.tenant)]
        assert feed == [first, second, row]
        again = await server_store.push(
            dev.tenant, dev.client_id, changes[2:], server_clock, skipped=[3, 4]
        )
        assert [(r.client_seq, r.status) for r in again.results] == [
            (3, "duplicate"),
            (4, "duplicate"),
            (5, "duplicate"),
        ]
        third = dev.message(session.id)
        gap = await server_store.push(
            dev.tenant,
            dev.client_id,
            [Change(client_seq=8, record=third)],
            server_clock,
            skipped=[6],
        )
        assert [(r.client_seq, r.status, r.code) for r in gap.results] == [
            (6, "superseded", None),
            (8, "rejected", ErrorCode.SEQUENCE_GAP),
        ]
        assert gap.last_seq == 6

    # -- audit chains ----------------------------------------------------------------------------

    async def test_audit_rows_must_continue_their_chain(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A row at a place after a hole, or at a place already taken, is refused with 3013
        naming the chain's last place; so is the rest of the batch, and ``last_seq`` stays
        before it, so the device resends them once chained on. Rows that continue the chain
        apply, in one batch or across batches."""
        dev = Device(new_tenant())
        session = dev.session()
        first, second = dev.audit(session.id), dev.audit(session.id)
        ok = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, first, second), server_clock
        )
        assert statuses(ok) == ["applied"] * 3
        taken = chain_audit(dev.audit(session.id), first.row_hash, 2)  # where `second` sits
        dev.audit_head = (2, second.row_hash)
        hole = chain_audit(dev.audit(session.id), "f" * 64, 4)  # place 3 is empty
        for bad in (taken, hole):
            start = dev.next_seq
            batch = dev.changes(bad, dev.message(session.id))
            refused = await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert statuses(refused) == ["rejected", "rejected"]
            assert codes(refused) == [ErrorCode.CHAIN_BROKEN] * 2
            assert (refused.results[0].chain_sequence, refused.results[0].chain_hash) == (
                2,
                second.row_hash,
            )
            assert refused.last_seq == start - 1
            dev.next_seq = start  # the device sends them again under the same numbers
        third = chain_audit(dev.audit(session.id), second.row_hash, 3)
        fourth = chain_audit(dev.audit(session.id), third.row_hash, 4)
        batch = dev.changes(third, fourth)
        applied = await server_store.push(dev.tenant, dev.client_id, batch, server_clock)
        assert statuses(applied) == ["applied", "applied"]
        rows = [c.record for c in await pull_all(server_store, dev.tenant)]
        chain = [r for r in rows if isinstance(r, AuditRow)]
        assert [r.id for r in chain] == [first.id, second.id, third.id, fourth.id]
        assert verify_chain(chain).ok

    async def test_a_row_held_at_another_place_leaves_no_hole_in_the_next_chain(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """Two copies of one file moved the same queued row onto their new ids' chains. The
        server keeps the first placement (the second is a duplicate: it holds that id), and
        refuses the second chain's next row until it is chained on from that chain's start."""
        tenant = new_tenant()
        one, two = Device(tenant), Device(tenant)
        session = one.session()
        await server_store.push(tenant, one.client_id, one.changes(session), server_clock)
        moved = one.audit(session.id)
        at_one = await server_store.push(tenant, one.client_id, one.changes(moved), server_clock)
        assert statuses(at_one) == ["applied"]
        moved_too = chain_audit(msgspec.structs.replace(moved, client_id=two.client_id), "", 1)
        two.audit_head = (1, moved_too.row_hash)
        after = two.audit(session.id)
        result = await server_store.push(
            tenant, two.client_id, two.changes(moved_too, after), server_clock
        )
        assert statuses(result) == ["duplicate", "rejected"]
        assert result.results[1].code == ErrorCode.CHAIN_BROKEN
        assert (result.results[1].chain_sequence, result.results[1].chain_hash) == (0, "")
        two.next_seq -= 1
        again = await server_store.push(
            tenant, two.client_id, two.changes(chain_audit(after, "", 1)), server_clock
        )
        assert statuses(again) == ["applied"]
        rows = [c.record for c in await pull_all(server_store, tenant)]
        for device in (one, two):
            chain = [r for r in rows if isinstance(r, AuditRow) and r.client_id == device.client_id]
            assert len(chain) == 1 and verify_chain(chain).ok

    async def test_audit_chains_are_not_checked_for_older_devices(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A device at protocol 2 or earlier (``chains=False``) is answered as before."""
        dev = Device(new_tenant())
        session = dev.session()
        hole = chain_audit(dev.audit(session.id), "f" * 64, 7)
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, hole), server_clock, chains=False
        )
        assert statuses(result) == ["applied", "applied"]

    # -- pull ------------------------------------------------------------------------------------

    async def test_pull_pages(self, server_store: ServerStore, server_clock: HybridClock) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        messages = [dev.message(session.id, f"m{i}") for i in range(5)]
        pushed = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, *messages), server_clock
        )
        cursors = pushed.cursors

        page = await server_store.pull(dev.tenant, 0, 2)
        assert [c.cursor for c in page.changes] == cursors[:2]
        assert page.more and page.to_cursor == cursors[1]
        page = await server_store.pull(dev.tenant, page.to_cursor, 2)
        assert [c.cursor for c in page.changes] == cursors[2:4]
        assert page.more and page.to_cursor == cursors[3]
        page = await server_store.pull(dev.tenant, page.to_cursor, 2)
        assert [c.cursor for c in page.changes] == cursors[4:]
        assert not page.more and page.to_cursor == cursors[5] == pushed.head_cursor
        exact = await server_store.pull(dev.tenant, cursors[3], 2)
        assert len(exact.changes) == 2 and not exact.more
        empty = await server_store.pull(dev.tenant, page.to_cursor, 2)
        assert empty == PullResult(changes=[], to_cursor=page.to_cursor, more=False)
        assert [c.record for c in (await server_store.pull(dev.tenant, 0, 100)).changes] == [
            session,
            *messages,
        ]

    async def test_pull_pages_are_bounded_by_bytes(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        """A page stops once its records add up to the byte budget; a record larger than the
        budget travels alone; pulling on from each page's cursor gets everything once."""
        dev = Device(new_tenant())
        session = dev.session()
        big = [dev.message(session.id, text="x" * 30_000) for _ in range(4)]
        small = [dev.message(session.id) for _ in range(3)]
        await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, *big, *small), server_clock
        )
        page = await server_store.pull(dev.tenant, 0, 100, 50_000)
        assert [c.record.id for c in page.changes] == [session.id, big[0].id] and page.more
        alone = await server_store.pull(dev.tenant, page.to_cursor, 100, 1_000)
        assert [c.record.id for c in alone.changes] == [big[1].id] and alone.more
        seen: list[str] = []
        cursor = 0
        while True:
            page = await server_store.pull(dev.tenant, cursor, 100, 50_000)
            seen += [c.record.id for c in page.changes]
            cursor = page.to_cursor
            if not page.more:
                break
        assert seen == [session.id] + [m.id for m in big + small]
        whole = await server_store.pull(dev.tenant, 0, 100)
        assert len(whole.changes) == 8 and not whole.more

    async def test_pulls_are_tenant_isolated(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        a, b = Device(new_tenant()), Device(new_tenant(), client_id="shared-device-id")
        b_twin = Device(new_tenant(), client_id="shared-device-id")
        sa, sb, sc = a.session(), b.session(), b_twin.session()
        ra = await server_store.push(a.tenant, a.client_id, a.changes(sa), server_clock)
        rb = await server_store.push(
            b.tenant, b.client_id, b.changes(sb, b.message(sb.id)), server_clock
        )
        await server_store.push(b_twin.tenant, b_twin.client_id, b_twin.changes(sc), server_clock)

        assert [c.record.id for c in await pull_all(server_store, a.tenant)] == [sa.id]
        assert [c.cursor for c in await pull_all(server_store, b.tenant)] == rb.cursors
        assert await server_store.head_cursor(a.tenant) == ra.head_cursor
        assert await server_store.head_cursor(b.tenant) == rb.head_cursor
        # The same client_id in two tenants is two devices with their own last_seq.
        assert (await server_store.client_state(b.tenant, "shared-device-id"))[0] == 2
        assert (await server_store.client_state(b_twin.tenant, "shared-device-id"))[0] == 1
        assert (await server_store.client_state(a.tenant, "shared-device-id"))[0] == 0

    async def test_compaction_keeps_latest_versions_and_resync_from_zero(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev, bystander = Device(new_tenant()), Device(new_tenant())
        v1 = dev.session(title="v1")
        m1, m2 = dev.message(v1.id), dev.message(v1.id)
        v2 = dev.edit(v1, title="v2")
        v3 = dev.edit(v2, title="v3")
        pushed = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(v1, m1, v2, m2, v3), server_clock
        )
        other = await server_store.push(
            bystander.tenant,
            bystander.client_id,
            bystander.changes(bystander.session()),
            server_clock,
        )
        c = pushed.cursors
        # v1's and v2's entries left the feed when v3's was written: nothing is superseded.
        assert [x.cursor for x in await pull_all(server_store, dev.tenant)] == [c[1], c[3], c[4]]
        assert await server_store.compact_feed(dev.tenant, c[2]) == 0  # the floor rises to c[2]
        assert await server_store.compact_feed(dev.tenant, c[1]) == 0  # the floor never drops
        for stale in (c[0], c[1]):
            with pytest.raises(CursorTooOld) as info:
                await server_store.pull(dev.tenant, stale, 10)
            assert info.value.code == ErrorCode.CURSOR_TOO_OLD
        page = await server_store.pull(dev.tenant, c[2], 10)
        assert [x.cursor for x in page.changes] == c[3:]
        assert await server_store.compact_feed(dev.tenant, c[-1] + 1000) == 0  # all latest
        # A pull from 0 is a full resync: the latest version of every record, once each.
        resync = await pull_all(server_store, dev.tenant)
        assert [x.record.id for x in resync] == [m1.id, m2.id, v1.id]
        assert [x.cursor for x in resync] == [c[1], c[3], c[4]]
        latest = resync[-1].record
        assert isinstance(latest, Session) and latest.title == "v3"
        # Other tenants keep their whole feed.
        assert [x.cursor for x in await pull_all(server_store, bystander.tenant)] == other.cursors
        # Compacting past the head stops at the head: a device there is still current.
        head = await server_store.head_cursor(dev.tenant)
        assert head == c[-1]
        assert await server_store.pull(dev.tenant, head, 10) == PullResult(
            changes=[], to_cursor=head, more=False
        )
        later = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(dev.message(v1.id)), server_clock
        )
        page = await server_store.pull(dev.tenant, head, 10)
        assert [x.cursor for x in page.changes] == later.cursors

    # -- atomicity and durability -----------------------------------------------------------------

    async def test_failed_batch_leaves_nothing(
        self, make_store: MakeStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(
            session, dev.message(session.id), dev.event(session.id), dev.message(session.id)
        )
        faulty: list[FaultyTx] = []

        def wrap(tx: StoreTx) -> StoreTx:
            faulty.append(FaultyTx(tx, fail_at=4))
            return faulty[-1]

        async with make_store(tx_wrapper=wrap) as store:
            with pytest.raises(InjectedFault):
                await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert faulty[0].writes == 4  # three records were written before the fault
            assert await store.client_state(dev.tenant, dev.client_id) == (0, 0)
            assert await store.pull(dev.tenant, 0, 10) == PullResult(
                changes=[], to_cursor=0, more=False
            )

        async with make_store() as store:
            result = await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert statuses(result) == ["applied"] * 4
            records = [c.record for c in await pull_all(store, dev.tenant)]
            assert [r.id for r in records] == [c.record.id for c in batch]

    async def test_cancelled_push_rolls_back(
        self, make_store: MakeStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(session, dev.message(session.id), dev.message(session.id))
        reached = asyncio.Event()
        wrapped: list[FaultyTx] = []

        def wrap(tx: StoreTx) -> StoreTx:
            if wrapped:  # only the first push blocks
                return tx
            wrapped.append(FaultyTx(tx, fail_at=2, block=True, reached=reached))
            return wrapped[-1]

        async with make_store(tx_wrapper=wrap) as store:
            task = asyncio.create_task(store.push(dev.tenant, dev.client_id, batch, server_clock))
            await reached.wait()  # the push is mid-transaction, one record written
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await store.client_state(dev.tenant, dev.client_id) == (0, 0)
            result = await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert statuses(result) == ["applied"] * 3
            assert len(await pull_all(store, dev.tenant)) == 3

    async def test_state_survives_close_and_reopen(
        self, make_store: MakeStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        async with make_store() as store:
            first = await store.push(
                dev.tenant,
                dev.client_id,
                dev.changes(session, dev.message(session.id), dev.event(session.id)),
                server_clock,
            )
            before = await pull_all(store, dev.tenant)

        async with make_store() as store:
            assert await store.client_state(dev.tenant, dev.client_id) == (3, first.head_cursor)
            assert await pull_all(store, dev.tenant) == before
            resend = await store.push(
                dev.tenant,
                dev.client_id,
                [Change(client_seq=3, record=before[2].record)],
                server_clock,
            )
            assert statuses(resend) == ["duplicate"]
            more = await store.push(
                dev.tenant, dev.client_id, dev.changes(dev.event(session.id)), server_clock
            )
            assert statuses(more) == ["applied"] and more.cursors[0] > first.head_cursor
            events = [c.record for c in await pull_all(store, dev.tenant)]
            chain = [r for r in events if isinstance(r, Event)]
            assert [e.sequence_number for e in chain] == [1, 2]
            assert verify_chain(chain).ok

    async def test_client_state_tracks_each_device(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        session = laptop.session()
        await server_store.push(
            tenant,
            laptop.client_id,
            laptop.changes(session, laptop.message(session.id)),
            server_clock,
        )
        result = await server_store.push(
            tenant, phone.client_id, phone.changes(phone.message(session.id)), server_clock
        )
        assert await server_store.client_state(tenant, laptop.client_id) == (2, result.head_cursor)
        assert await server_store.client_state(tenant, phone.client_id) == (1, result.head_cursor)
        assert await server_store.client_state(tenant, "never-seen") == (0, result.head_cursor)

    # -- one batch: its changes depend on each other ------------------------------------------

    async def test_changes_of_one_batch_see_each_other(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop = Device(tenant)
        v1 = laptop.session(title="v1")
        m = laptop.message(v1.id)
        v2 = laptop.edit(v1, title="v2", message_ids=[m.id])
        e = [laptop.event(v1.id, i=i) for i in range(3)]
        fork = msgspec.structs.replace(laptop.session(title="fork"), forked_from=v1.id)
        batch = laptop.changes(v1, m, e[0], v2, e[1], m, e[2], v1, fork, laptop.checkpoint(v1.id))
        result = await server_store.push(tenant, laptop.client_id, batch, server_clock)
        assert statuses(result) == [
            "applied",  # v1 creates the session
            "applied",  # a message in the session created just before
            "applied",
            "applied",  # v2 dominates v1, written earlier in this batch
            "applied",
            "duplicate",  # the same message again
            "applied",
            "superseded",  # v1 again: v2 is the current row now
            "applied",  # forked from a session this batch created
            "applied",
        ]
        assert result.cursors == [r.cursor for r in result.results if r.cursor is not None]
        assert result.cursors == sorted(set(result.cursors))
        assert result.head_cursor == result.cursors[-1] and result.last_seq == 10

        # v1's entry went when v2's was written, in the same batch: one entry per session.
        feed = await pull_all(server_store, tenant)
        assert [c.cursor for c in feed] == result.cursors[1:]
        assert [c.record.id for c in feed] == [
            m.id, e[0].id, v2.id, e[1].id, e[2].id, fork.id, batch[9].record.id
        ]  # fmt: skip
        assert feed[2].record == v2
        events = [c.record for c in feed if isinstance(c.record, Event)]
        assert [ev.sequence_number for ev in events] == [1, 2, 3]
        assert verify_chain(events).ok

        # Another user using the same ids writes in their own namespace: this tenant's session
        # and its feed are untouched.
        mallory = Device(new_tenant())
        theirs = msgspec.structs.replace(mallory.session(), forked_from=v1.id)
        attempt = await server_store.push(
            mallory.tenant,
            mallory.client_id,
            mallory.changes(mallory.message(v1.id), mallory.session(id=v1.id), theirs),
            server_clock,
        )
        assert statuses(attempt) == ["applied"] * 3
        assert await pull_all(server_store, tenant) == feed
        again = await server_store.push(tenant, laptop.client_id, batch, server_clock)
        assert statuses(again) == ["duplicate"] * len(batch)

    async def test_conflicts_within_one_batch_build_on_each_other(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        on_phone = phone.edit(v1, title="phone")
        await server_store.push(tenant, phone.client_id, phone.changes(on_phone), server_clock)

        first = laptop.edit(v1, title="laptop 1")
        second = laptop.edit(first, title="laptop 2")
        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(first, second), server_clock
        )
        assert statuses(result) == ["resolved", "resolved"]
        assert len(result.cursors) == 6  # two winners, two sync.conflict events, two forks
        rows = [c.record for c in await pull_all(server_store, tenant)]
        logged = [r for r in rows if isinstance(r, Event) and r.type == "sync.conflict"]
        assert [e.sequence_number for e in logged] == [1, 2]
        assert verify_chain(logged).ok
        current = [r for r in rows if isinstance(r, Session) and r.id == v1.id][-1]
        # The second version was settled against the first one's result, which the server had
        # already bumped: its entry is bumped twice.
        assert current.vv[server_clock.client_id] == 2
        forks = [r for r in rows if isinstance(r, Session) and r.forked_from == v1.id]
        assert [f.id for f in forks] == [
            r.conflict.fork_session_id for r in result.results if r.conflict
        ]

    async def test_a_large_batch_applies_in_order(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        records: list[Record] = [session]
        for i in range(600):
            records += [dev.message(session.id, f"m{i}"), dev.event(session.id, i=i)]
        result = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(*records), server_clock
        )
        assert statuses(result) == ["applied"] * len(records)
        assert result.cursors == sorted(set(result.cursors)) and len(result.cursors) == 1201
        feed = await pull_all(server_store, dev.tenant)
        assert [(c.cursor, c.record.id) for c in feed] == list(
            zip(result.cursors, [r.id for r in records], strict=True)
        )
        events = [c.record for c in feed if isinstance(c.record, Event)]
        assert [ev.sequence_number for ev in events] == list(range(1, 601))
        assert verify_chain(events).ok

    # -- atomicity once the rows are in the database ---------------------------------------------

    async def test_failure_after_the_batch_was_written_leaves_nothing(
        self, make_store: MakeStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(
            session, dev.message(session.id), dev.event(session.id), dev.event(session.id)
        )
        async with make_store(tx_wrapper=FailAfterWritesTx) as store:
            with pytest.raises(InjectedFault):
                await store.push(dev.tenant, dev.client_id, batch, server_clock)

        async with make_store() as store:
            assert await store.client_state(dev.tenant, dev.client_id) == (0, 0)
            assert await store.pull(dev.tenant, 0, 10) == PullResult(
                changes=[], to_cursor=0, more=False
            )
            result = await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert statuses(result) == ["applied"] * 4
            events = [c.record for c in await pull_all(store, dev.tenant)][2:]
            assert [e.sequence_number for e in events if isinstance(e, Event)] == [1, 2]

    async def test_database_error_in_the_middle_of_the_writes_leaves_nothing(
        self, make_store: MakeStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        batch = dev.changes(
            session, dev.message(session.id), dev.event(session.id), dev.event(session.id)
        )
        async with make_store(tx_wrapper=CollidingEventsTx) as store:
            with pytest.raises(StorageUnavailable):
                await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert await store.client_state(dev.tenant, dev.client_id) == (0, 0)
            assert await store.pull(dev.tenant, 0, 10) == PullResult(
                changes=[], to_cursor=0, more=False
            )

        async with make_store() as store:
            result = await store.push(dev.tenant, dev.client_id, batch, server_clock)
            assert statuses(result) == ["applied"] * 4
            assert len(await pull_all(store, dev.tenant)) == 4

    # -- deleting a session ------------------------------------------------------------------

    async def test_tombstone_deletes_content_rows_and_feed_entries(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        session, other = laptop.session(title="doomed"), laptop.session(title="kept")
        m = [laptop.message(session.id), phone.message(session.id)]
        content: list[Record] = [
            *m,
            laptop.checkpoint(session.id, appended=[m[0].id]),
            laptop.artifact(session.id),
        ]
        metadata: list[Record] = [laptop.event(session.id), laptop.audit(session.id)]
        v2 = laptop.edit(session, message_ids=[x.id for x in m])
        kept = [laptop.message(other.id), laptop.checkpoint(other.id), laptop.artifact(other.id)]
        await server_store.push(
            tenant,
            laptop.client_id,
            laptop.changes(session, other, m[0], *content[2:], *metadata, *kept),
            server_clock,
        )
        await server_store.push(tenant, phone.client_id, phone.changes(m[1]), server_clock)
        await server_store.push(tenant, laptop.client_id, laptop.changes(v2), server_clock)
        before = await server_store.head_cursor(tenant)

        tomb = tombstone(laptop, v2)
        gone = laptop.event(session.id, "session.deleted")
        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(gone, tomb), server_clock
        )
        assert statuses(result) == ["applied", "applied"]
        assert result.head_cursor == result.cursors[-1] > before

        rows = await stored_rows(tenant)
        assert not {(record_kind(r), r.id) for r in content} & rows
        assert {(record_kind(r), r.id) for r in [*metadata, gone, *kept]} <= rows
        assert ("Session", session.id) in rows and ("Session", other.id) in rows

        feed = await pull_all(server_store, tenant)
        # The session's one entry is its tombstone's, after the entries filed under it.
        assert kinds_of(feed, session.id) == ["Event", "AuditRow", "Event", "Session"]
        latest = [c.record for c in feed if c.record.id == session.id][-1]
        assert isinstance(latest, Session) and latest.deleted
        assert latest.state == SessionState() and latest.vv == tomb.vv  # as the device sent it
        assert {c.record.id for c in feed} >= {r.id for r in kept} | {other.id}
        events = [
            c.record
            for c in feed
            if isinstance(c.record, Event) and c.record.session_id == session.id
        ]
        assert [e.type for e in events] == ["message.added", "session.deleted"]
        assert verify_chain(events).ok

    async def test_pull_from_zero_after_a_delete_pages_over_the_holes(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        dev = Device(new_tenant())
        session = dev.session()
        messages = [dev.message(session.id, f"m{i}") for i in range(7)]
        first = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(session, *messages), server_clock
        )
        device_cursor = first.cursors[3]  # a device that pulled part of the session
        deleted = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(tombstone(dev, session)), server_clock
        )
        later = await server_store.push(
            dev.tenant, dev.client_id, dev.changes(dev.session()), server_clock
        )
        head = await server_store.head_cursor(dev.tenant)
        assert head == later.cursors[-1]
        # From 0, a page of 1 steps over the holes (the messages, and the session's first
        # version, superseded by its tombstone) to the tombstone, then the other session.
        page = await server_store.pull(dev.tenant, 0, 1)
        assert [c.cursor for c in page.changes] == deleted.cursors
        assert page.more and page.to_cursor == deleted.cursors[0]
        page = await server_store.pull(dev.tenant, page.to_cursor, 2)
        assert [c.cursor for c in page.changes] == later.cursors and not page.more
        # The device in the middle of the deleted run moves on to the tombstone.
        page = await server_store.pull(dev.tenant, device_cursor, 1)
        assert [c.cursor for c in page.changes] == deleted.cursors and page.more
        page = await server_store.pull(dev.tenant, head, 10)
        assert page == PullResult(changes=[], to_cursor=head, more=False)
        # Compaction afterwards: nothing left to drop, a cursor below the floor is too old.
        assert await server_store.compact_feed(dev.tenant, deleted.cursors[0]) == 0
        with pytest.raises(CursorTooOld):
            await server_store.pull(dev.tenant, device_cursor, 10)
        resync = await pull_all(server_store, dev.tenant)
        assert [c.cursor for c in resync] == deleted.cursors + later.cursors

    async def test_content_pushed_after_the_delete_drains_without_being_stored(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        session = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(session), server_clock)
        await server_store.push(
            tenant, laptop.client_id, laptop.changes(tombstone(laptop, session)), server_clock
        )
        head = await server_store.head_cursor(tenant)
        rows = await stored_rows(tenant)

        # The phone was offline: a whole turn for the session, then its own edit of it.
        message = phone.message(session.id)
        late_content: list[Record] = [
            message,
            phone.checkpoint(session.id, appended=[message.id]),
            phone.artifact(session.id),
        ]
        late_meta: list[Record] = [phone.event(session.id), phone.audit(session.id)]
        batch = phone.changes(*late_content, *late_meta)
        result = await server_store.push(tenant, phone.client_id, batch, server_clock)
        assert statuses(result) == ["superseded"] * 3 + ["applied"] * 2
        assert [r.cursor for r in result.results[:3]] == [None] * 3
        assert result.last_seq == 5
        feed = await pull_all(server_store, tenant, head)
        assert [c.record.id for c in feed] == [r.id for r in late_meta]
        assert await stored_rows(tenant) == rows | {(record_kind(r), r.id) for r in late_meta}
        # Resent under the same client_seq: duplicates, as always.
        again = await server_store.push(tenant, phone.client_id, batch, server_clock)
        assert statuses(again) == ["duplicate"] * 5 and again.cursors == []
        # Resent under new client_seq (a device that lost its acks and rebuilt its outbox).
        renumbered = await server_store.push(
            tenant, phone.client_id, phone.changes(*late_content), server_clock
        )
        assert statuses(renumbered) == ["superseded"] * 3 and renumbered.cursors == []
        assert not {(record_kind(r), r.id) for r in late_content} & await stored_rows(tenant)

    async def test_a_live_version_never_undoes_a_delete(
        self, server_store: ServerStore, server_clock: HybridClock
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session(title="v1")
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        v2 = laptop.edit(v1, title="v2")
        tomb = tombstone(laptop, v2)
        await server_store.push(tenant, laptop.client_id, laptop.changes(v2, tomb), server_clock)
        head = await server_store.head_cursor(tenant)

        # Dominated by the tombstone: superseded, nothing written.
        stale = await server_store.push(tenant, laptop.client_id, laptop.changes(v2), server_clock)
        assert statuses(stale) == ["superseded"] and stale.cursors == []
        assert await server_store.head_cursor(tenant) == head

        # Concurrent with it, and later by the clock: it loses anyway, and is not forked.
        phone.clock.observe(tomb.updated_at)
        concurrent = phone.edit(v1, title="phone", message_ids=["p1"])
        result = await server_store.push(
            tenant, phone.client_id, phone.changes(concurrent), server_clock
        )
        assert statuses(result) == ["superseded"] and result.results[0].conflict is None
        (reissued,) = [c.record for c in await pull_all(server_store, tenant, head)]
        assert isinstance(reissued, Session) and reissued.id == v1.id and reissued.deleted
        assert reissued.state == SessionState() and reissued.title == tomb.title
        assert vv_compare(reissued.vv, concurrent.vv) is Order.DOMINATES
        assert vv_compare(reissued.vv, tomb.vv) is Order.DOMINATES
        assert result.results[0].cursor == result.cursors[0] == result.head_cursor

        # Dominating it (a version built on the tombstone): it cannot bring content back.
        revived = phone.edit(reissued, deleted=False, title="revived", message_ids=["p2"])
        result = await server_store.push(
            tenant, phone.client_id, phone.changes(revived), server_clock
        )
        assert statuses(result) == ["superseded"]
        latest = [c.record for c in await pull_all(server_store, tenant)][-1]
        assert isinstance(latest, Session) and latest.deleted and latest.title == tomb.title
        assert vv_compare(latest.vv, revived.vv) is Order.DOMINATES
        sessions = {c.record.id for c in await pull_all(server_store, tenant)}
        assert sessions == {v1.id}  # no fork anywhere

        # The laptop resends its tombstone: the server's dominates it, nothing is written.
        again = await server_store.push(
            tenant, laptop.client_id, laptop.changes(tomb), server_clock
        )
        assert statuses(again) == ["superseded"] and again.cursors == []

    async def test_a_tombstone_wins_over_a_concurrent_live_version(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        # The phone writes a turn; the laptop, which never saw it, deletes the session.
        m = phone.message(v1.id)
        on_phone = phone.edit(v1, message_ids=[m.id])
        await server_store.push(tenant, phone.client_id, phone.changes(m, on_phone), server_clock)
        tomb = tombstone(laptop, v1)
        assert vv_compare(tomb.vv, on_phone.vv) is Order.CONCURRENT
        result = await server_store.push(
            tenant, laptop.client_id, laptop.changes(tomb), server_clock
        )
        assert statuses(result) == ["applied"] and result.results[0].conflict is None
        latest = [c.record for c in await pull_all(server_store, tenant)][-1]
        assert isinstance(latest, Session) and latest.deleted
        assert vv_compare(latest.vv, on_phone.vv) is Order.DOMINATES
        assert vv_compare(latest.vv, tomb.vv) is Order.DOMINATES
        assert server_clock.client_id in latest.vv
        assert ("Message", m.id) not in await stored_rows(tenant)
        assert kinds_of(await pull_all(server_store, tenant), v1.id) == ["Session"]

        # A second, concurrent tombstone (the phone deleted it too): still one deleted session.
        late_tomb = tombstone(phone, on_phone)
        again = await server_store.push(
            tenant, phone.client_id, phone.changes(late_tomb), server_clock
        )
        assert statuses(again) == ["superseded"]
        assert {c.record.id for c in await pull_all(server_store, tenant)} == {v1.id}

    async def _resolved_and_deleted(
        self,
        server_store: ServerStore,
        server_clock: HybridClock,
        stored_rows: StoredRows,
        *,
        delete_first: bool,
    ) -> None:
        """A session resolved on the phone (the version holds copies of its conflict fork's
        messages, pushed in one batch with them, and the resolve's mark) while the laptop,
        which never saw that version, deletes it. Delete wins; the resolved version is kept as
        a new session, with the messages it names. (An unmarked version is not kept:
        ``test_a_tombstone_wins_over_a_concurrent_live_version``.)"""
        tenant = new_tenant()
        laptop, phone = Device(tenant), Device(tenant)
        v1 = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        head = await server_store.head_cursor(tenant)
        copied = phone.message(v1.id, "written in the fork")
        unnamed = phone.message(v1.id, "named by no version")
        # A copy sent in a push of its own before the version (a long resolve): after the
        # delete it drains, and the kept session must not name it.
        early = phone.message(v1.id, "an earlier copy")
        named = [early.id, copied.id] if delete_first else [copied.id]
        resolved = phone.edit(v1, message_ids=named)
        mark = {phone.client_id: v1.vv.get(phone.client_id, 0)}
        resolved = msgspec.structs.replace(
            resolved, state=msgspec.structs.replace(resolved.state, resolved=mark)
        )
        tomb = tombstone(laptop, v1)
        assert vv_compare(resolved.vv, tomb.vv) is Order.CONCURRENT
        if delete_first:
            deleted = await server_store.push(
                tenant, laptop.client_id, laptop.changes(tomb), server_clock
            )
            assert statuses(deleted) == ["applied"]
            ahead = phone.changes(early)
            drained = await server_store.push(tenant, phone.client_id, ahead, server_clock)
            assert statuses(drained) == ["superseded"]
            resolve = phone.changes(copied, unnamed, resolved)
            result = await server_store.push(tenant, phone.client_id, resolve, server_clock)
            assert statuses(result) == ["applied", "applied", "superseded"]
        else:
            resolve = phone.changes(copied, unnamed, resolved)
            result = await server_store.push(tenant, phone.client_id, resolve, server_clock)
            assert statuses(result) == ["applied"] * 3
            deleted = await server_store.push(
                tenant, laptop.client_id, laptop.changes(tomb), server_clock
            )
            assert statuses(deleted) == ["applied"]
            assert deleted.results[0].conflict is None

        feed = await pull_all(server_store, tenant, head)
        sessions = [c.record for c in feed if isinstance(c.record, Session)]
        (kept,) = [s for s in sessions if s.id != v1.id]
        latest = [s for s in sessions if s.id == v1.id][-1]
        assert latest.deleted and vv_compare(latest.vv, resolved.vv) is Order.DOMINATES
        # The fork comes ahead of the tombstone that deletes its origin.
        assert sessions.index(kept) < sessions.index(latest)
        assert kept.forked_from == v1.id and not kept.deleted
        assert kept.state.message_ids == [copied.id] and kept.state.resolved == {}
        assert kept.conflict_id is None and kept.client_id == server_clock.client_id
        assert kept.state.kept_from == v1.id
        rows = await stored_rows(tenant)
        assert ("Message", copied.id) in rows and ("Session", kept.id) in rows
        # While the kept session lives, none of its deleted origin's content goes: a device
        # that took it may still name any of it (SessionState.kept_from).
        assert ("Message", unnamed.id) in rows
        (announced,) = [
            c.record
            for c in feed
            if isinstance(c.record, Event) and c.record.type == "sync.delete.kept"
        ]
        assert announced.session_id == v1.id and announced.canonical
        assert announced.payload["fork_session_id"] == kept.id
        assert announced.payload["version_by"] == phone.client_id
        assert announced.payload["deleted_by"] == laptop.client_id

        # The phone resends the batch (its acks were lost): nothing new, no second fork.
        again = await server_store.push(tenant, phone.client_id, resolve, server_clock)
        assert statuses(again) == ["duplicate"] * 3 and again.cursors == []
        # A later version from the phone that saw the delete: a revival, not kept.
        revived = phone.edit(latest, deleted=False, message_ids=[copied.id])
        late = await server_store.push(
            tenant, phone.client_id, phone.changes(revived), server_clock
        )
        assert statuses(late) == ["superseded"]
        after = [c.record for c in await pull_all(server_store, tenant)]
        assert {r.id for r in after if isinstance(r, Session)} == {v1.id, kept.id}
        # The kept session deleted: what it spared goes with the sweep.
        await server_store.push(
            tenant, laptop.client_id, laptop.changes(tombstone(laptop, kept)), server_clock
        )
        rows = await stored_rows(tenant)
        assert ("Message", copied.id) not in rows and ("Message", unnamed.id) not in rows
        feed_ids = {c.record.id for c in await pull_all(server_store, tenant)}
        assert copied.id not in feed_ids and unnamed.id not in feed_ids

    async def test_a_resolved_version_pushed_after_the_delete_is_kept_as_a_fork(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        await self._resolved_and_deleted(server_store, server_clock, stored_rows, delete_first=True)

    async def test_a_delete_pushed_after_a_resolved_version_keeps_it_as_a_fork(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        await self._resolved_and_deleted(
            server_store, server_clock, stored_rows, delete_first=False
        )

    async def test_a_kept_session_spares_its_deleted_origins_content_while_it_lives(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        """The server keeps the phone's resolved version beside the laptop's delete: the kept
        session names a message filed under the deleted session. The tablet takes it and
        writes a turn on it; the phone, meanwhile, gives it copies of its own (``_own_kept``),
        so the stored row no longer names the original, and a delete of another session
        sweeps. The tablet's version, written before it heard of the copies, names the
        original and wins: the original must still be held. (Seed 8,700,030 of the races mix
        lost it: the sweep took it.) Once the kept session goes, so does the original."""
        tenant = new_tenant()
        laptop, phone, tablet = Device(tenant), Device(tenant), Device(tenant)
        v1 = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(v1), server_clock)
        original = phone.message(v1.id, "moved in by the resolve")
        resolved = phone.edit(v1, message_ids=[original.id])
        mark = {phone.client_id: v1.vv.get(phone.client_id, 0)}
        resolved = msgspec.structs.replace(
            resolved, state=msgspec.structs.replace(resolved.state, resolved=mark)
        )
        await server_store.push(
            tenant, phone.client_id, phone.changes(original, resolved), server_clock
        )
        await server_store.push(
            tenant, laptop.client_id, laptop.changes(tombstone(laptop, v1)), server_clock
        )
        (kept,) = [
            c.record
            for c in await pull_all(server_store, tenant)
            if isinstance(c.record, Session) and c.record.id != v1.id
        ]
        assert kept.state.kept_from == v1.id and kept.state.message_ids == [original.id]

        turn = tablet.message(kept.id, "a turn in the kept session")
        by_tablet = tablet.edit(kept, message_ids=[original.id, turn.id])
        # The tablet runs an older release, which does not know the mark: its version drops it.
        by_tablet = msgspec.structs.replace(
            by_tablet, state=msgspec.structs.replace(by_tablet.state, kept_from=None)
        )
        copy = phone.message(kept.id, "moved in by the resolve")
        by_phone = phone.edit(kept, message_ids=[copy.id])
        await server_store.push(
            tenant, phone.client_id, phone.changes(copy, by_phone), server_clock
        )
        other = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(other), server_clock)
        await server_store.push(
            tenant, laptop.client_id, laptop.changes(tombstone(laptop, other)), server_clock
        )
        assert ("Message", original.id) in await stored_rows(tenant)
        result = await server_store.push(
            tenant, tablet.client_id, tablet.changes(turn, by_tablet), server_clock
        )
        assert statuses(result) == ["applied", "resolved"]
        assert result.results[1].conflict is not None  # both versions live on
        feed = await pull_all(server_store, tenant)
        held = {c.record.id for c in feed if isinstance(c.record, Message)}
        latest: dict[str, Session] = {}
        for change in feed:
            if isinstance(change.record, Session):
                latest[change.record.id] = change.record
        live = [s for s in latest.values() if not s.deleted]
        assert any(original.id in s.state.message_ids for s in live)
        for session in live:
            assert set(session.state.message_ids) <= held, session.id
            # The server keeps the mark on what the tablet wrote (and on its conflict fork).
            assert session.state.kept_from == v1.id, session.id
        # So another sweep still spares what the tablet's version names.
        again = laptop.session()
        await server_store.push(tenant, laptop.client_id, laptop.changes(again), server_clock)
        await server_store.push(
            tenant, laptop.client_id, laptop.changes(tombstone(laptop, again)), server_clock
        )
        assert ("Message", original.id) in await stored_rows(tenant)

        # The kept session and its conflict fork deleted: the next sweep takes the original.
        for session in live:
            gone = tombstone(laptop, session)
            await server_store.push(tenant, laptop.client_id, laptop.changes(gone), server_clock)
        assert ("Message", original.id) not in await stored_rows(tenant)

    async def test_delete_within_one_batch_and_before_the_session_row(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        dev = Device(tenant)
        session = dev.session()
        before = dev.message(session.id)
        after = dev.message(session.id)
        tomb = tombstone(dev, session)
        # Content first, then the tombstone as the first version the server sees (a device
        # that created and deleted the session offline: its outbox sends the latest version).
        batch = dev.changes(before, dev.event(session.id), tomb, after, before)
        result = await server_store.push(tenant, dev.client_id, batch, server_clock)
        assert statuses(result) == ["applied", "applied", "applied", "superseded", "superseded"]
        rows = await stored_rows(tenant)
        assert ("Message", before.id) not in rows and ("Message", after.id) not in rows
        feed = await pull_all(server_store, tenant)
        assert kinds_of(feed, session.id) == ["Event", "Session"]
        assert [c.cursor for c in feed] == result.cursors[1:]
        again = await server_store.push(tenant, dev.client_id, batch, server_clock)
        assert statuses(again) == ["duplicate"] * len(batch)

    async def test_a_fork_keeps_the_messages_it_shares_with_a_deleted_session(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        dev = Device(tenant)
        origin = dev.session()
        shared_m, own_m = dev.message(origin.id), dev.message(origin.id)
        artifact = dev.artifact(origin.id)
        origin = msgspec.structs.replace(
            dev.edit(origin),
            state=SessionState(
                message_ids=[shared_m.id, own_m.id], artifacts=[artifact.artifact_id]
            ),
        )
        fork = msgspec.structs.replace(
            dev.session(message_ids=[shared_m.id]), forked_from=origin.id
        )
        fork = msgspec.structs.replace(
            fork, state=SessionState(message_ids=[shared_m.id], artifacts=[artifact.artifact_id])
        )
        await server_store.push(
            tenant,
            dev.client_id,
            dev.changes(origin, shared_m, own_m, artifact, fork),
            server_clock,
        )
        await server_store.push(
            tenant, dev.client_id, dev.changes(tombstone(dev, origin)), server_clock
        )
        rows = await stored_rows(tenant)
        assert ("Message", shared_m.id) in rows and ("ArtifactUpdate", artifact.id) in rows
        assert ("Message", own_m.id) not in rows
        feed_ids = {c.record.id for c in await pull_all(server_store, tenant)}
        assert {shared_m.id, artifact.id} <= feed_ids and own_m.id not in feed_ids

        # When the fork goes too, what it kept alive goes with it.
        await server_store.push(
            tenant, dev.client_id, dev.changes(tombstone(dev, fork)), server_clock
        )
        assert {kind for kind, _ in await stored_rows(tenant)} <= {"Session", "Event", "AuditRow"}
        assert kinds_of(await pull_all(server_store, tenant), origin.id) == ["Session"]

    async def test_concurrent_pushers_leave_no_content_of_a_deleted_session(
        self, server_store: ServerStore, server_clock: HybridClock, stored_rows: StoredRows
    ) -> None:
        tenant = new_tenant()
        owner = Device(tenant)
        session = owner.session()
        await server_store.push(tenant, owner.client_id, owner.changes(session), server_clock)
        writers = [Device(tenant) for _ in range(4)]

        async def write(dev: Device) -> list[PushResult]:
            results = []
            for i in range(6):
                batch = dev.changes(
                    dev.message(session.id, f"{i}"),
                    dev.checkpoint(session.id),
                    dev.artifact(session.id),
                    dev.event(session.id, i=i),
                    dev.audit(session.id),
                )
                results.append(await server_store.push(tenant, dev.client_id, batch, server_clock))
            return results

        async def delete() -> PushResult:
            return await server_store.push(
                tenant, owner.client_id, owner.changes(tombstone(owner, session)), server_clock
            )

        *written, deleted = await asyncio.gather(*(write(d) for d in writers), delete())
        assert statuses(deleted) == ["applied"]
        feed = await pull_all(server_store, tenant)
        assert not [c for c in feed if record_kind(c.record) in CASCADE_KINDS]
        assert not {kind for kind, _ in await stored_rows(tenant)} & set(CASCADE_KINDS)
        events = [c.record for c in feed if isinstance(c.record, Event)]
        assert len(events) == 24 and verify_chain(events).ok
        assert len([c for c in feed if isinstance(c.record, AuditRow)]) == 24
        # Whatever the interleaving, a batch's content was either applied before the delete
        # (and then deleted with it) or superseded after it; its events and audit rows stay.
        outcomes = [statuses(result) for results in written for result in results]
        for outcome in outcomes:
            assert outcome[:3] in (["applied"] * 3, ["superseded"] * 3), outcome
            assert outcome[3:] == ["applied"] * 2


__all__ = [
    "FaultyTx",
    "InjectedFault",
    "MakeStore",
    "ServerStoreConformance",
    "StoredRows",
    "TxWrapper",
    "pull_all",
    "statuses",
    "tombstone",
]


class ServerStoreConformanceInIdBlocks(ServerStoreConformance):
    """The whole suite again with every session of more than two ids kept in blocks of three
    (``SMALL_BLOCKS``): a backend's subclass takes its module's ``make_store`` as it is."""

    @pytest.fixture
    def make_store(self, make_store: MakeStore) -> MakeStore:
        def make(tx_wrapper: TxWrapper | None = None) -> ServerStore:
            store = make_store(tx_wrapper)
            store._id_layout = SMALL_BLOCKS  # type: ignore[attr-defined]
            return store

        return make

    @pytest.fixture
    async def server_store(self, make_store: MakeStore) -> AsyncIterator[ServerStore]:
        async with make_store() as store:
            yield store
