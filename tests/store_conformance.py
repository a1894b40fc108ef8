"""The ``StorageAdapter`` conformance suite: what every local store must do.

Subclass ``StoreConformance`` in a test module that provides a ``store`` fixture yielding an
opened adapter (see ``tests/test_store.py``); every test here then runs against it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from pleach_client.apply import _place_audit
from pleach_client.store import StorageAdapter, WriteBatch
from pleach_client.store.base import CommitReceipt, KeptHydration, TxReader
from shared.errors import InvalidState, StorageError
from shared.hashchain import GENESIS, chain_audit, chain_event
from shared.ids import uuid7
from shared.records import Record
from tests.factories import (
    clock_for,
    make_artifact_update,
    make_audit,
    make_checkpoint,
    make_event,
    make_message,
    make_session,
)

__all__ = ["StoreConformance", "commit", "one_of_each", "read_back"]


async def commit(store: StorageAdapter, *records: Record, **batch: Any) -> CommitReceipt:
    return await store.commit(WriteBatch(records=list(records), **batch))


def one_of_each() -> list[Record]:
    session = make_session(title="plane")
    return [
        session,
        make_message(session_id=session.id),
        make_checkpoint(session_id=session.id),
        make_event(session_id=session.id, payload={"k": [1, 2]}),
        make_audit(session_id=session.id, subject_key="alice", detail={"ip": "10.0.0.1"}),
        make_artifact_update(session_id=session.id, update=b"\x01\x02"),
    ]


async def read_back(store: StorageAdapter, record: Record) -> Record | None:
    """The stored version of ``record`` (looked up by its id)."""
    match type(record).__name__:
        case "Session":
            return await store.get_session(record.id)
        case "Message":
            found = await store.get_messages([record.id])
            return found[0] if found else None
        case "Checkpoint":
            return await store.get_checkpoint(record.id)
        case "Event":
            return await store.get_event(record.id)
        case "AuditRow":
            rows = [row for row in await store.list_audit() if row.id == record.id]
            return rows[0] if rows else None
        case _:
            updates = await store.list_artifact_updates(record.artifact_id)  # type: ignore[union-attr]
            matching = [update for update in updates if update.id == record.id]
            return matching[0] if matching else None


class StoreConformance:
    """Every test takes the ``store`` fixture: an opened, empty adapter."""

    # -- shape and lifecycle ------------------------------------------------------------------

    async def test_is_a_storage_adapter(self, store: StorageAdapter) -> None:
        assert isinstance(store, StorageAdapter)
        assert isinstance(store.durable, bool)

    async def test_empty_store(self, store: StorageAdapter) -> None:
        assert await store.get_session("nope") is None
        assert await store.list_sessions(include_deleted=True) == []
        assert await store.get_messages(["nope"]) == []
        assert await store.get_messages([]) == []
        assert await store.get_checkpoint("nope") is None
        assert await store.list_checkpoints("nope") == []
        assert await store.get_event("nope") is None
        assert await store.list_events("nope") == []
        assert await store.list_audit() == []
        assert await store.list_artifact_updates("nope") == []
        assert await store.get_meta("cursor") is None
        assert await store.outbox_pending() == []
        assert await store.outbox_count() == 0
        assert await store.dead_letters() == []
        assert await store.dead_letter_count() == 0

    async def test_open_twice_is_refused(self, store: StorageAdapter) -> None:
        with pytest.raises(InvalidState):
            await store.open()

    async def test_closed_store_refuses_calls_and_reopens_with_its_data(
        self, store: StorageAdapter
    ) -> None:
        session = make_session()
        await commit(store, session, meta={"cursor": "7"})
        await store.close()
        await store.close()  # idempotent
        with pytest.raises(InvalidState):
            await store.get_meta("cursor")
        with pytest.raises(InvalidState):
            await commit(store, make_session())
        await store.open()
        assert await store.get_session(session.id) == session
        assert await store.get_meta("cursor") == "7"
        assert (await commit(store, make_session())).client_seqs == [2]

    # -- commit -------------------------------------------------------------------------------

    async def test_commit_stores_every_kind_with_outbox_rows(self, store: StorageAdapter) -> None:
        records = one_of_each()
        receipt = await commit(store, *records)
        assert receipt == CommitReceipt(client_seqs=[1, 2, 3, 4, 5, 6], records=6)
        for record in records:
            assert await read_back(store, record) == record
        pending = await store.outbox_pending()
        assert [entry.client_seq for entry in pending] == [1, 2, 3, 4, 5, 6]
        assert [entry.record for entry in pending] == records
        assert all(entry.attempts == 0 and entry.created_at > 0 for entry in pending)
        assert all(entry.last_error_code is None for entry in pending)
        assert await store.outbox_count() == 6

    async def test_commit_without_outbox(self, store: StorageAdapter) -> None:
        session = make_session()
        receipt = await commit(store, session, outbox=False)
        assert receipt == CommitReceipt(client_seqs=[], records=1)
        assert await store.get_session(session.id) == session
        assert await store.outbox_count() == 0

    async def test_empty_commit(self, store: StorageAdapter) -> None:
        assert await commit(store) == CommitReceipt(client_seqs=[], records=0)
        assert await store.outbox_count() == 0

    async def test_records_are_copied_in_and_out(self, store: StorageAdapter) -> None:
        session = make_session(title="before")
        await commit(store, session)
        session.title = "mutated by caller"
        session.state.message_ids.append("m-1")
        stored = await store.get_session(session.id)
        assert stored is not None
        assert stored.title == "before" and stored.state.message_ids == []
        stored.title = "mutated again"
        stored.vv["dev-z"] = 9
        again = await store.get_session(session.id)
        assert again is not None and again.title == "before" and "dev-z" not in again.vv
        entry = (await store.outbox_pending())[0]
        entry.record.hlc = "x"
        assert (await store.outbox_pending())[0].record.hlc != "x"

    async def test_unencodable_record_fails_the_whole_batch(self, store: StorageAdapter) -> None:
        await commit(store, make_session())
        session = make_session()
        message = make_message(session_id=session.id)
        bad = make_event(session_id=session.id, payload={"x": object()})
        with pytest.raises(StorageError):
            await commit(store, session, message, bad, meta={"cursor": "9"})
        assert await store.get_session(session.id) is None
        assert await store.get_messages([message.id]) == []
        assert await store.get_event(bad.id) is None
        assert await store.get_meta("cursor") is None
        assert await store.outbox_count() == 1
        # The store is still usable and the failed batch consumed no sequence numbers.
        assert (await commit(store, make_session())).client_seqs == [2]

    async def test_invalid_meta_fails_the_whole_batch(self, store: StorageAdapter) -> None:
        """The meta keys are written last, so this fails after every record was written."""
        session = make_session()
        checkpoint = make_checkpoint(session_id=session.id)
        old = make_checkpoint()
        await commit(store, old, outbox=False)
        batch = WriteBatch(
            records=[session, checkpoint],
            meta={"hlc": "1", "cursor": None},  # type: ignore[dict-item]
            purge_checkpoints_for=[old.session_id],
        )
        with pytest.raises(StorageError):
            await store.commit(batch)
        assert await store.get_session(session.id) is None
        assert await store.get_checkpoint(checkpoint.id) is None
        assert await store.get_checkpoint(old.id) == old
        assert await store.get_meta("hlc") is None
        assert await store.outbox_count() == 0

    async def test_not_a_record_is_refused(self, store: StorageAdapter) -> None:
        with pytest.raises(StorageError):
            await commit(store, make_session(), {"id": "x"})  # type: ignore[arg-type]
        assert await store.list_sessions() == []
        assert await store.outbox_count() == 0

    async def test_concurrent_commits_get_distinct_contiguous_seqs(
        self, store: StorageAdapter
    ) -> None:
        receipts = await asyncio.gather(
            *(commit(store, make_session(), make_message()) for _ in range(20))
        )
        for receipt in receipts:
            assert receipt.client_seqs[1] == receipt.client_seqs[0] + 1
        seqs = sorted(seq for receipt in receipts for seq in receipt.client_seqs)
        assert seqs == list(range(1, 41))
        assert len(await store.list_sessions()) == 20

    # -- mutability rules ---------------------------------------------------------------------

    async def test_session_is_replaced(self, store: StorageAdapter) -> None:
        first = make_session(title="first")
        await commit(store, first)
        second = msgspec.structs.replace(
            first, title="second", updated_at=clock_for().now(), vv={"dev-a": 2}
        )
        await commit(store, second)
        assert await store.get_session(first.id) == second
        assert await store.list_sessions() == [second]

    async def test_last_version_in_one_batch_wins(self, store: StorageAdapter) -> None:
        first = make_session(title="first")
        second = msgspec.structs.replace(first, title="second")
        await commit(store, first, second)
        assert await store.get_session(first.id) == second

    async def test_immutable_kinds_ignore_a_reinsert(self, store: StorageAdapter) -> None:
        message = make_message()
        checkpoint = make_checkpoint()
        audit = make_audit()
        update = make_artifact_update()
        await commit(store, message, checkpoint, audit, update)
        await commit(
            store,
            msgspec.structs.replace(message, content=[{"type": "text", "text": "changed"}]),
            msgspec.structs.replace(checkpoint, appended=["m-9"]),
            msgspec.structs.replace(audit, model="other", row_hash="forged"),
            msgspec.structs.replace(update, update=b"changed"),
        )
        for record in (message, checkpoint, audit, update):
            assert await read_back(store, record) == record
        assert len(await store.list_audit()) == 1
        assert len(await store.list_artifact_updates(update.artifact_id)) == 1

    # -- reads --------------------------------------------------------------------------------

    async def test_list_sessions_newest_first_and_deleted(self, store: StorageAdapter) -> None:
        old = make_session(title="old")
        gone = make_session(title="gone", deleted=True)
        new = make_session(title="new")
        await commit(store, new, old, gone)
        assert await store.list_sessions() == [new, old]
        assert await store.list_sessions(include_deleted=True) == [new, gone, old]

    async def test_list_sessions_ties_broken_by_id(self, store: StorageAdapter) -> None:
        stamp = clock_for().now()
        a, b = make_session(updated_at=stamp), make_session(updated_at=stamp)
        await commit(store, a, b)
        assert [s.id for s in await store.list_sessions()] == sorted([a.id, b.id], reverse=True)

    async def test_get_messages_follows_the_requested_order(self, store: StorageAdapter) -> None:
        m1, m2, m3 = make_message(), make_message(role="assistant"), make_message()
        await commit(store, m1, m2, m3)
        assert await store.get_messages([m3.id, "unknown", m1.id]) == [m3, m1]
        assert await store.get_messages([m2.id, m2.id]) == [m2, m2]
        # Longer than a part a store decodes at a time (the SQLite store's 2,048).
        many = [make_message() for _ in range(2500)]
        await commit(store, *many, outbox=False)
        wanted = [m.id for m in reversed(many)]
        assert await store.get_messages(wanted) == many[::-1]
        # Any count (a store may read in lists of a few sizes), ids that are no UUIDs among
        # UUIDs, unknown ones and repeats anywhere.
        texts = [make_message(id=f"text-{i}") for i in range(3)]
        await commit(store, *texts, outbox=False)
        for count in (1, 5, 17, 257, 300, 2100):
            wanted = [m.id for m in many[:count]]
            wanted[count // 2 : count // 2] = [texts[count % 3].id, "unknown", wanted[0]]
            found = await store.get_messages(wanted)
            assert [m.id for m in found] == [i for i in wanted if i != "unknown"], count

    async def test_missing_messages_are_those_not_held_in_the_asked_order(
        self, store: StorageAdapter
    ) -> None:
        held = [make_message() for _ in range(300)] + [make_message(id="text-held")]
        await commit(store, *held, outbox=False)
        absent = [make_message().id for _ in range(3)]
        asked = [held[0].id, absent[0], "nope", held[-1].id, *[m.id for m in held[1:299]]]
        asked += [absent[1], "nope", held[299].id, absent[2]]
        found: list[list[str]] = []

        async def plan(tx: Any) -> None:
            found.append(await tx.missing_messages(asked))
            found.append(await tx.missing_messages([]))

        await store.transact(plan)
        assert found == [[absent[0], "nope", absent[1], "nope", absent[2]], []]

    async def test_transact_reads_messages_and_artifact_updates_as_the_store_does(
        self, store: StorageAdapter
    ) -> None:
        held = [make_message() for _ in range(300)] + [make_message(id="text-held")]
        doc, other = uuid7(), uuid7()
        updates = [make_artifact_update(artifact_id=doc) for _ in range(3)]
        await commit(store, *held, *updates, make_artifact_update(artifact_id=other), outbox=False)
        asked = [held[-1].id, "nope", *[m.id for m in held[:299]], held[0].id]
        found: list[Any] = []

        async def plan(tx: Any) -> None:
            found.append(await tx.get_messages(asked))
            found.append(await tx.get_messages([]))
            found.append(await tx.list_artifact_updates(doc))
            found.append(await tx.list_artifact_updates(uuid7()))

        await store.transact(plan)
        messages, none, doc_updates, no_updates = found
        assert messages == await store.get_messages(asked)
        assert [m.id for m in messages] == [i for i in asked if i != "nope"]
        assert none == [] and no_updates == []
        assert sorted(u.id for u in doc_updates) == sorted(u.id for u in updates)
        assert doc_updates == await store.list_artifact_updates(doc)

    async def test_checkpoints_oldest_first_and_get(self, store: StorageAdapter) -> None:
        session_id = "s-1"
        c1, c2, c3 = (make_checkpoint(session_id=session_id) for _ in range(3))
        other = make_checkpoint(session_id="s-2")
        await commit(store, c3, other, c1, c2)
        assert await store.list_checkpoints(session_id) == [c1, c2, c3]
        assert await store.get_checkpoint(c2.id) == c2

    async def test_child_checkpoints(self, store: StorageAdapter) -> None:
        root = make_checkpoint(session_id="s-1")
        a, b = (make_checkpoint(session_id="s-1", parent_id=root.id) for _ in range(2))
        grandchild = make_checkpoint(session_id="s-1", parent_id=a.id)
        elsewhere = make_checkpoint(session_id="s-2", parent_id=root.id)
        await commit(store, grandchild, b, root, elsewhere, a)
        assert await store.child_checkpoints("s-1", root.id) == [a, b]
        assert await store.child_checkpoints("s-1", a.id) == [grandchild]
        assert await store.child_checkpoints("s-1", grandchild.id) == []
        assert await store.child_checkpoints("s-1", "not-a-checkpoint") == []

    async def test_purge_checkpoints(self, store: StorageAdapter) -> None:
        doomed = [make_checkpoint(session_id="s-1") for _ in range(3)]
        kept = make_checkpoint(session_id="s-2")
        await commit(store, *doomed, kept)
        tombstone = make_session(id="s-1", deleted=True)
        receipt = await commit(store, tombstone, purge_checkpoints_for=["s-1", "s-unknown"])
        assert receipt.records == 1
        assert await store.list_checkpoints("s-1") == []
        assert await store.get_checkpoint(doomed[0].id) is None
        assert await store.list_checkpoints("s-2") == [kept]
        assert await store.get_session("s-1") == tombstone

    async def test_purged_checkpoints_still_queued_send_the_tombstone(
        self, store: StorageAdapter
    ) -> None:
        doomed = make_checkpoint(session_id="s-1")
        kept = make_checkpoint(session_id="s-2")
        first = await commit(store, doomed, kept)
        tombstone = make_session(id="s-1", deleted=True)
        await commit(store, tombstone, purge_checkpoints_for=["s-1"])
        pending = {e.client_seq: e.record for e in await store.outbox_pending()}
        # The queued row keeps its client_seq (no gap) but sends the tombstone instead.
        assert pending[first.client_seqs[0]] == tombstone
        assert pending[first.client_seqs[1]] == kept

    async def test_renumber_outbox_restarts_the_sequence_in_order(
        self, store: StorageAdapter
    ) -> None:
        records = one_of_each()
        receipt = await commit(store, *records)
        await store.outbox_remove(receipt.client_seqs[:2])  # the server took the first two
        assert await store.last_client_seq() == len(records)
        more = make_message()
        again = await commit(store, more, renumber_outbox=True)
        pending = await store.outbox_pending()
        assert [e.client_seq for e in pending] == list(range(1, len(records) - 1 + 1))
        assert [e.record for e in pending] == [*records[2:], more]
        assert again.client_seqs == [len(records) - 1]
        assert await store.last_client_seq() == len(records) - 1

        async def read(tx: TxReader) -> None:
            assert await tx.queued_records() == [*records[2:], more]

        await store.transact(read)

    async def test_rechained_audit_rows_replace_the_stored_ones(
        self, store: StorageAdapter
    ) -> None:
        row = make_audit(client_id="old", sequence_number=3)
        await commit(store, row)
        moved = msgspec.structs.replace(row, client_id="new", sequence_number=1)
        await commit(store, rechained_audit=[moved])
        assert await store.list_audit(client_id="new") == [moved]
        assert await store.list_audit(client_id="old") == []
        assert [e.record for e in await store.outbox_pending()] == [moved]

    async def test_events_in_sequence_order_with_from_sequence(self, store: StorageAdapter) -> None:
        events = {n: make_event(session_id="s-1", sequence_number=n) for n in (1, 2, 3, 4)}
        await commit(store, events[3], events[1], make_event(session_id="s-2"), events[4])
        await commit(store, events[2])
        assert await store.list_events("s-1") == [events[1], events[2], events[3], events[4]]
        assert await store.list_events("s-1", from_sequence=3) == [events[3], events[4]]
        assert await store.list_events("s-1", from_sequence=5) == []
        assert await store.get_event(events[2].id) == events[2]

    async def test_events_of_some_types(self, store: StorageAdapter) -> None:
        kinds = ["message.added", "turn.complete", "checkpoint.created", "error", "turn.complete"]
        events = [
            make_event(session_id="s-1", sequence_number=n, type=kind, payload={"n": n})
            for n, kind in enumerate(kinds, start=1)
        ]
        await commit(store, *events, make_event(session_id="s-2", type="turn.complete"))
        wanted = {"turn.complete", "error"}
        assert await store.list_events("s-1", types=wanted) == [events[1], events[3], events[4]]
        assert await store.list_events("s-1", types=wanted, from_sequence=3) == events[3:]
        assert await store.list_events("s-1", types=set()) == []
        assert await store.list_events("s-1", types=None) == events

    async def test_event_upsert_rebases_a_provisional_event(self, store: StorageAdapter) -> None:
        canonical = make_event(session_id="s-1", sequence_number=1, canonical=True)
        provisional = make_event(session_id="s-1", sequence_number=2, prev_hash="p", row_hash="a")
        await commit(store, canonical, provisional)
        remote = make_event(session_id="s-1", sequence_number=2, canonical=True, client_id="dev-b")
        rebased = msgspec.structs.replace(
            provisional, sequence_number=3, prev_hash="r", row_hash="b", canonical=True
        )
        await commit(store, remote, rebased, outbox=False)
        assert await store.get_event(provisional.id) == rebased
        assert await store.list_events("s-1") == [canonical, remote, rebased]
        assert await store.list_events("s-1", from_sequence=3) == [rebased]

    async def test_events_marked_canonical_where_they_stand(self, store: StorageAdapter) -> None:
        """``WriteBatch.canonical`` writes what the events replaced ``canonical=True`` would:
        placed or not, with a payload or without, canonical already or not; other events and
        unknown ids are left alone, and nothing is queued."""
        first = chain_event(make_event(session_id="s-1", payload={"n": 1}), GENESIS, 1)
        second = chain_event(make_event(session_id="s-1", type="turn.complete"), first.row_hash, 2)
        bare = make_event(session_id="s-1", sequence_number=3)  # trailing defaults left out
        done = make_event(session_id="s-1", sequence_number=4, canonical=True)
        other = chain_event(make_event(session_id="s-2"), GENESIS, 1)
        await commit(store, first, second, bare, done, other, outbox=False)
        marked = [first, second, bare, done]
        receipt = await store.commit(
            WriteBatch(canonical=[e.id for e in marked] + ["nope"], outbox=False)
        )
        assert receipt.client_seqs == [] and await store.outbox_count() == 0
        assert await store.list_events("s-1") == [
            msgspec.structs.replace(e, canonical=True) for e in marked
        ]
        assert await store.list_events("s-2") == [other]
        assert not WriteBatch(canonical=["x"]).is_empty()

    async def test_audit_ordered_per_client_and_filtered(self, store: StorageAdapter) -> None:
        a1 = make_audit(client_id="dev-a", session_id="s-1", sequence_number=1)
        a2 = make_audit(client_id="dev-a", session_id="s-2", sequence_number=2)
        a3 = make_audit(client_id="dev-a", session_id="s-1", sequence_number=3)
        b1 = make_audit(client_id="dev-b", session_id="s-1", sequence_number=1)
        b2 = make_audit(client_id="dev-b", session_id="s-2", sequence_number=2)
        await commit(store, b2, a3, a1)
        await commit(store, b1, a2)
        assert await store.list_audit() == [a1, a2, a3, b1, b2]
        assert await store.list_audit(session_id="s-1") == [a1, a3, b1]
        assert await store.list_audit(client_id="dev-b") == [b1, b2]
        assert await store.list_audit(session_id="s-2", client_id="dev-a") == [a2]
        assert await store.list_audit(session_id="s-9") == []

    async def test_gdpr_soft_delete_keeps_ids_and_hashes(self, store: StorageAdapter) -> None:
        rows = [
            make_audit(
                subject_key=subject,
                sequence_number=n,
                detail={"ip": "10.0.0.1"},
                payload_digest=f"digest-{n}",
                prev_hash=f"prev-{n}",
                row_hash=f"hash-{n}",
                cost_usd=0.01,
            )
            for n, subject in enumerate(["alice", "bob", "alice", None], start=1)
        ]
        await commit(store, *rows)
        assert await store.gdpr_soft_delete("alice") == 2
        after = await store.list_audit()
        assert [row.id for row in after] == [row.id for row in rows]
        for before, row in zip(rows, after, strict=True):
            if before.subject_key != "alice":
                assert row == before
                continue
            assert row.subject_key is None and row.request_id is None
            assert row.detail == {} and row.redacted is True
            expected = msgspec.structs.replace(
                before, subject_key=None, request_id=None, detail={}, redacted=True
            )
            assert row == expected  # ids, digest, prev_hash, row_hash, usage... all kept
        # Rows not yet sent leave redacted: the outbox refers to the stored row.
        assert [e.record for e in await store.outbox_pending()] == after
        assert await store.gdpr_soft_delete("alice") == 0
        assert await store.gdpr_soft_delete("nobody") == 0
        assert await store.list_audit(session_id=rows[0].session_id) == [after[0]]

    async def test_artifact_updates(self, store: StorageAdapter) -> None:
        u1 = make_artifact_update(artifact_id="doc", update=b"\x01")
        u2 = make_artifact_update(artifact_id="doc", update=b"\x02")
        other = make_artifact_update(artifact_id="other")
        await commit(store, u2, other, u1)
        assert await store.list_artifact_updates("doc") == [u1, u2]
        assert await store.list_artifact_updates("other") == [other]

    # -- sync state ---------------------------------------------------------------------------

    async def test_meta_get_and_set(self, store: StorageAdapter) -> None:
        await store.set_meta("client_id", "dev-a")
        await store.set_meta("cursor", "1")
        await store.set_meta("cursor", "2")
        assert await store.get_meta("cursor") == "2"
        assert await store.get_meta("client_id") == "dev-a"
        assert await store.get_meta("unknown") is None
        with pytest.raises(StorageError):
            await store.set_meta("cursor", 3)  # type: ignore[arg-type]

    async def test_peek_meta_reads_what_is_committed(self, store: StorageAdapter) -> None:
        assert await store.peek_meta("cursor") is None
        await store.set_meta("cursor", "1")
        assert await store.peek_meta("cursor") == "1"
        await commit(store, make_message(), meta={"cursor": "2", "hlc": "h"})
        assert await store.peek_meta("cursor") == "2"
        assert await store.peek_meta("hlc") == "h"
        assert await store.peek_meta("unknown") is None
        assert await store.get_meta("cursor") == "2"

    async def test_meta_inside_commit(self, store: StorageAdapter) -> None:
        session = make_session()
        await store.set_meta("cursor", "1")
        await commit(store, session, outbox=False, meta={"cursor": "5", "hlc": session.hlc})
        assert await store.get_meta("cursor") == "5"
        assert await store.get_meta("hlc") == session.hlc
        assert await commit(store, meta={"cursor": "6"}) == CommitReceipt(client_seqs=[], records=0)
        assert await store.get_meta("cursor") == "6"
        assert await store.outbox_count() == 0

    # -- outbox -------------------------------------------------------------------------------

    async def test_outbox_pending_order_and_limit(self, store: StorageAdapter) -> None:
        records = [make_session() for _ in range(5)]
        for record in records:
            await commit(store, record)
        pending = await store.outbox_pending()
        assert [e.client_seq for e in pending] == [1, 2, 3, 4, 5]
        assert [e.record for e in pending] == records
        assert [e.client_seq for e in await store.outbox_pending(limit=2)] == [1, 2]
        assert await store.outbox_pending(limit=0) == []

    async def test_outbox_pending_after(self, store: StorageAdapter) -> None:
        """The next push's entries, read while the ones before it are in flight: those after
        a client_seq, oldest first, gaps (removed entries) skipped."""
        records = [make_session() for _ in range(6)]
        await commit(store, *records)
        await store.outbox_remove([4])
        after = await store.outbox_pending(limit=2, after=2)
        assert [(e.client_seq, e.record) for e in after] == [(3, records[2]), (5, records[4])]
        assert [e.client_seq for e in await store.outbox_pending(after=3)] == [5, 6]
        assert await store.outbox_pending(after=6) == []
        assert [e.client_seq for e in await store.outbox_pending(after=0)] == [1, 2, 3, 5, 6]

    async def test_a_session_queued_again_later_says_so(self, store: StorageAdapter) -> None:
        """Each number of a session refers to its one stored row, the newest version: every
        number but the last says a later one refers to the row too (the flush sends the row
        there, after the messages queued between), whichever entries a read returns."""
        first = make_session(title="v1")
        other = make_session()
        await commit(store, first, other)
        message = make_message(session_id=first.id)
        newer = msgspec.structs.replace(
            first,
            title="v2",
            state=msgspec.structs.replace(first.state, message_ids=[message.id]),
        )
        await commit(store, message, newer)
        pending = await store.outbox_pending()
        assert [(e.client_seq, e.again_later) for e in pending] == [
            (1, True),
            (2, False),
            (3, False),
            (4, False),
        ]
        assert pending[0].record == newer == pending[3].record
        assert [e.again_later for e in await store.outbox_pending(limit=1)] == [True]
        await store.outbox_remove([4])
        assert [e.again_later for e in await store.outbox_pending(limit=1)] == [False]

    async def test_outbox_seq_is_never_reused(self, store: StorageAdapter) -> None:
        assert (await commit(store, make_session(), make_session())).client_seqs == [1, 2]
        await store.outbox_remove([1, 2])
        assert await store.outbox_count() == 0
        assert (await commit(store, make_session())).client_seqs == [3]
        await store.outbox_dead_letter(3, 3007, "invalid")
        assert await store.discard_dead_letter(3)
        assert (await commit(store, make_session())).client_seqs == [4]

    async def test_outbox_remove(self, store: StorageAdapter) -> None:
        await commit(store, *(make_session() for _ in range(4)))
        await store.outbox_remove([2, 4, 99])
        assert [e.client_seq for e in await store.outbox_pending()] == [1, 3]
        await store.outbox_remove([])
        assert await store.outbox_count() == 2

    async def test_outbox_mark_attempt(self, store: StorageAdapter) -> None:
        await commit(store, *(make_session() for _ in range(3)))
        await store.outbox_mark_attempt([1, 2, 2, 99], 3009, "storage unavailable")
        await store.outbox_mark_attempt([2], 3008, "rate limited")
        pending = {e.client_seq: e for e in await store.outbox_pending()}
        assert len(pending) == 3
        assert (pending[1].attempts, pending[1].last_error_code) == (1, 3009)
        assert pending[1].last_error_message == "storage unavailable"
        assert (pending[2].attempts, pending[2].last_error_code) == (2, 3008)
        assert pending[2].last_error_message == "rate limited"
        assert (pending[3].attempts, pending[3].last_error_code) == (0, None)
        await store.outbox_mark_attempt([1], None, None)
        entry = (await store.outbox_pending(limit=1))[0]
        assert (entry.attempts, entry.last_error_code, entry.last_error_message) == (2, None, None)

    async def test_dead_letter_moves_the_entry(self, store: StorageAdapter) -> None:
        first, second = make_session(), make_session()
        await commit(store, first, second)
        await store.outbox_mark_attempt([1], 3009, "unavailable")
        await store.outbox_dead_letter(1, 3007, "invalid record")
        assert [e.client_seq for e in await store.outbox_pending()] == [2]
        assert await store.outbox_count() == 1
        assert await store.dead_letter_count() == 1
        (letter,) = await store.dead_letters()
        assert letter.client_seq == 1 and letter.record == first
        assert (letter.code, letter.message, letter.attempts) == (3007, "invalid record", 1)
        assert letter.failed_at > 0
        # The record itself stays in its table: only the outbox entry moved.
        assert await store.get_session(first.id) == first

    async def test_dead_letter_unknown_seq_is_a_no_op(self, store: StorageAdapter) -> None:
        await commit(store, make_session())
        await store.outbox_dead_letter(42, 3007, "invalid")
        assert await store.dead_letter_count() == 0
        assert await store.outbox_count() == 1

    async def test_retry_dead_letter(self, store: StorageAdapter) -> None:
        record = make_session()
        await commit(store, record, make_session())
        await store.outbox_mark_attempt([1], 3007, "invalid")
        await store.outbox_dead_letter(1, 3007, "invalid")
        new_seq = await store.retry_dead_letter(1)
        assert new_seq == 3
        assert await store.dead_letter_count() == 0
        pending = await store.outbox_pending()
        assert [e.client_seq for e in pending] == [2, 3]
        assert pending[1].record == record
        assert (pending[1].attempts, pending[1].last_error_code) == (0, None)
        assert await store.retry_dead_letter(1) is None
        assert await store.retry_dead_letter(77) is None
        assert (await commit(store, make_session())).client_seqs == [4]

    async def test_discard_dead_letter(self, store: StorageAdapter) -> None:
        await commit(store, make_session(), make_session())
        await store.outbox_dead_letter(1, 3002, "forbidden")
        await store.outbox_dead_letter(2, 3007, "invalid")
        assert await store.discard_dead_letter(1) is True
        assert await store.discard_dead_letter(1) is False
        assert [d.client_seq for d in await store.dead_letters()] == [2]
        assert await store.dead_letter_count() == 1
        assert await store.outbox_count() == 0

    # -- transactions decided under the write lock ----------------------------------------------

    async def test_transact_reads_under_the_lock_and_commits_the_plan(
        self, store: StorageAdapter
    ) -> None:
        session = make_session(title="one")
        events = [make_event(session_id=session.id, sequence_number=n) for n in (1, 2)]
        await commit(store, session, *events, meta={"generation": "g1"})
        seen: dict[str, Any] = {}

        async def plan(tx: Any) -> WriteBatch:
            seen["generation"] = await tx.get_meta("generation")
            seen["row"] = await tx.get_session(session.id)
            seen["head"] = await tx.event_head(session.id)
            seen["none"] = await tx.event_head("nope")
            seen["tail"] = await tx.list_events(session.id, from_sequence=2)
            renamed = msgspec.structs.replace(seen["row"], title="two")
            return WriteBatch(records=[renamed], meta={"generation": "g2"})

        receipt = await store.transact(plan)
        assert seen["generation"] == "g1" and seen["row"] == session
        assert seen["head"] == (2, events[1].row_hash) and seen["none"] == (0, "")
        assert [e.id for e in seen["tail"]] == [events[1].id]
        assert len(receipt.client_seqs) == 1
        stored = await store.get_session(session.id)
        assert stored is not None and stored.title == "two"
        assert await store.get_meta("generation") == "g2"

    async def test_transact_lists_the_first_events_of_a_tail(self, store: StorageAdapter) -> None:
        session = make_session()
        events = [make_event(session_id=session.id, sequence_number=n) for n in range(1, 6)]
        await commit(store, session, *events)
        seen: dict[int | None, list[str]] = {}

        async def plan(tx: Any) -> None:
            for limit in (None, 0, 1, 2, 9):
                listed = await tx.list_events(session.id, from_sequence=2, limit=limit)
                seen[limit] = [e.id for e in listed]

        await store.transact(plan)
        after = [e.id for e in events[1:]]
        assert seen == {None: after, 0: [], 1: after[:1], 2: after[:2], 9: after}

    async def test_transact_lists_event_places_as_list_events_has_them(
        self, store: StorageAdapter
    ) -> None:
        """Each event's id and place, read without its payload, are the listed event's:
        placed or provisional, canonical or not, with a payload or without."""
        session = make_session()
        first = chain_event(make_event(session_id=session.id, payload={"big": "x" * 500}), "", 1)
        first = msgspec.structs.replace(first, canonical=True)
        second = chain_event(make_event(session_id=session.id), first.row_hash, 2)
        bare = make_event(session_id=session.id, sequence_number=3)
        await commit(store, session, first, second, bare)
        seen: dict[int | None, tuple[list[Any], list[Any]]] = {}

        async def plan(tx: Any) -> None:
            for limit in (None, 0, 2):
                places = await tx.event_places(session.id, from_sequence=1, limit=limit)
                listed = await tx.list_events(session.id, from_sequence=1, limit=limit)
                seen[limit] = (
                    [tuple(p) for p in places],
                    [
                        (e.id, e.sequence_number, e.prev_hash, e.row_hash, e.canonical)
                        for e in listed
                    ],
                )

        await store.transact(plan)
        for limit, (places, listed) in seen.items():
            assert places == listed, limit
        assert len(seen[None][0]) == 3 and seen[None][0][0][4] is True

    async def test_a_remote_page_moves_a_held_audit_row_to_the_servers_place(
        self, store: StorageAdapter
    ) -> None:
        """An earlier copy of this device moved the row onto a new id's chain when it
        re-keyed; a restored file still holds it at its old place. The page's place is taken;
        a row whose content differs is refused (the ledger is append-only)."""
        held = make_audit(client_id="old", sequence_number=1)
        other = make_audit(client_id="old", sequence_number=2)
        await commit(store, held, other)
        moved = chain_audit(msgspec.structs.replace(held, client_id="new"), "", 1)
        forged = msgspec.structs.replace(other, latency_ms=9999.0)
        fresh = make_audit(client_id="peer", sequence_number=1)

        async def plan(tx: Any) -> WriteBatch:
            assert sorted(r.id for r in await tx.audit_rows([held.id, "nope", fresh.id])) == [
                held.id
            ]
            kept, moving = await _place_audit(tx, [moved, forged, fresh, held])
            assert kept == [fresh] and moving == [moved]
            return WriteBatch(records=kept, rechained_audit=moving, outbox=False)

        await store.transact(plan)
        assert await store.list_audit(client_id="new") == [moved]
        assert await store.list_audit(client_id="old") == [other]
        assert await store.list_audit(client_id="peer") == [fresh]

    async def test_transact_plan_none_or_failing_writes_nothing(
        self, store: StorageAdapter
    ) -> None:
        async def nothing(_: Any) -> None:
            return None

        assert (await store.transact(nothing)).client_seqs == []

        async def failing(tx: Any) -> WriteBatch:
            await tx.get_meta("cursor")
            raise RuntimeError("decided not to")

        with pytest.raises(RuntimeError):
            await store.transact(failing)
        assert await store.outbox_count() == 0
        # The lock was released: later writes go through.
        await commit(store, make_session())
        assert await store.outbox_count() == 1

    async def test_transactions_run_one_at_a_time(self, store: StorageAdapter) -> None:
        await commit(store, make_session(), meta={"n": "0"}, outbox=False)

        async def bump(tx: Any) -> WriteBatch:
            n = int(await tx.get_meta("n") or 0)
            return WriteBatch(meta={"n": str(n + 1)})

        await asyncio.gather(*(store.transact(bump) for _ in range(20)))
        assert await store.get_meta("n") == "20"

    async def test_the_key_of_a_log_and_of_its_beginning(self, store: StorageAdapter) -> None:
        session = make_session()
        assert await store.hydration_key(session.id) == (0, 0, "")
        events, prev = [], GENESIS
        for n in (1, 2, 4):  # a gap: 3 arrives later
            events.append(chain_event(make_event(session_id=session.id), prev, n))
            prev = events[-1].row_hash
        await commit(store, session, *events)
        assert await store.hydration_key(session.id) == (3, 4, events[2].row_hash)
        assert await store.hydration_key(session.id, upto=2) == (2, 2, events[1].row_hash)
        assert await store.hydration_key(session.id, upto=3) == (2, 2, events[1].row_hash)
        assert await store.hydration_key(session.id, upto=0) == (0, 0, "")
        late = chain_event(make_event(session_id=session.id), events[1].row_hash, 3)
        await commit(store, late)
        # The last event is the same, the log is not: the count tells.
        assert await store.hydration_key(session.id) == (4, 4, events[2].row_hash)
        assert await store.hydration_key("another") == (0, 0, "")

    async def test_the_log_read_from_a_place_on(self, store: StorageAdapter) -> None:
        session = make_session()
        events = [
            make_event(
                session_id=session.id, type="turn.complete", payload={"n": n}, sequence_number=n
            )
            for n in range(1, 6)
        ]
        await commit(store, session, *events)
        tallies, whole = await store.hydration_log(
            session.id, {"turn.complete"}, {"turn.complete"}, from_sequence=4
        )
        assert tallies == [("turn.complete", {"n": 4}), ("turn.complete", {"n": 5})]
        assert whole == events[3:]

    async def test_a_kept_fold_reads_back_and_is_replaced(self, store: StorageAdapter) -> None:
        session = make_session()
        assert await store.kept_hydration(session.id) is None
        first = KeptHydration((3, 4, "a" * 64), 1, b"\x01\x02")
        await store.keep_hydration(session.id, first)
        assert await store.kept_hydration(session.id) == first
        second = KeptHydration((5, 6, "b" * 64), 2, b"\x03")
        await store.keep_hydration(session.id, second)
        assert await store.kept_hydration(session.id) == second
        assert await store.kept_hydration("another") is None
        # A cache: no outbox row, nothing synced.
        assert await store.outbox_count() == 0
        # Kept through a purge, as the log it was folded from is.
        await commit(store, session, purge_sessions=[session.id])
        assert await store.kept_hydration(session.id) == second

    async def test_purge_sessions_removes_contents_keeps_tombstone_log_and_ledger(
        self, store: StorageAdapter
    ) -> None:
        session = make_session()
        other = make_session()
        message = make_message(session_id=session.id)
        kept = make_message(session_id=other.id)
        checkpoint = make_checkpoint(session_id=session.id)
        update = make_artifact_update(session_id=session.id)
        event = make_event(session_id=session.id, sequence_number=1)
        audit = make_audit(session_id=session.id)
        await commit(store, session, other, message, kept, checkpoint, update, event, audit)
        tomb = msgspec.structs.replace(session, deleted=True)
        receipt = await commit(store, tomb, purge_sessions=[session.id])
        assert await store.get_messages([message.id, kept.id]) == [kept]
        assert await store.list_checkpoints(session.id) == []
        assert await store.list_artifact_updates(update.artifact_id) == []
        assert await store.get_event(event.id) == event
        assert await store.list_audit(session_id=session.id) == [audit]
        stored = await store.get_session(session.id)
        assert stored is not None and stored.deleted
        # Queued contents of the deleted session never leave the device: their rows send the
        # tombstone instead, so client_seq stays gap-free. The rest are untouched.
        entries = await store.outbox_pending()
        pending = [e.record.id for e in entries]
        assert message.id not in pending and checkpoint.id not in pending
        assert update.id not in pending
        assert kept.id in pending and event.id in pending and audit.id in pending
        seqs = [e.client_seq for e in entries]
        assert seqs == list(range(1, len(seqs) + 1))
        assert receipt.client_seqs[-1] == seqs[-1]
        assert [e.record for e in entries].count(tomb) == 5  # 3 purged + 2 of its own

    async def test_queued_records_get_outbox_rows_whatever_outbox_says(
        self, store: StorageAdapter
    ) -> None:
        remote = make_session()
        local = make_session()
        receipt = await store.commit(WriteBatch(records=[remote], queued=[local], outbox=False))
        assert len(receipt.client_seqs) == 1
        assert [e.record for e in await store.outbox_pending()] == [local]
        assert await store.get_session(remote.id) == remote
        assert await store.get_session(local.id) == local

    async def test_purge_keeps_what_a_live_session_refers_to(self, store: StorageAdapter) -> None:
        session = make_session()
        shared_message = make_message(session_id=session.id)
        own = make_message(session_id=session.id)
        checkpoint = make_checkpoint(session_id=session.id)
        update = make_artifact_update(session_id=session.id)
        await commit(store, session, shared_message, own, checkpoint, update)
        keep = [shared_message.id, checkpoint.id, update.artifact_id]
        await commit(store, purge_sessions=[session.id], purge_keep=keep)
        assert await store.get_messages([shared_message.id, own.id]) == [shared_message]
        assert [c.id for c in await store.list_checkpoints(session.id)] == [checkpoint.id]
        assert await store.list_artifact_updates(update.artifact_id) == [update]
        entries = await store.outbox_pending()
        pending = [e.record.id for e in entries]
        assert shared_message.id in pending and own.id not in pending
        assert [e.client_seq for e in entries] == list(range(1, 6))
