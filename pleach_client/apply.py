"""Applying one page of the server's feed: what to write, decided inside the transaction.

``plan_page`` runs in ``DeviceCore.transact_remote``: it reads the rows as they are under the
write lock (through the ``TxReader`` and the core's ``RemoteView``), asks the pure decisions of
``syncplan`` (``decide_session``, ``rebase``), and returns the ``WriteBatch``: sessions taken,
content kept or dropped by the delete cascade, canonical events placed and the provisional tail
rebased, and a local fork when counters collided. It never writes itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any

import msgspec

from shared.clock import vector_problem
from shared.errors import PleachError
from shared.ids import uuid7
from shared.merge import unmarked
from shared.messages import ConflictReceipt, KeptReceipt
from shared.records import (
    ArtifactUpdate,
    AuditRow,
    Event,
    FeedChange,
    Message,
    Record,
    Session,
)

from .artifacts import copy_document
from .core import PREVIOUS_IDS, RemoteView, previous_ids, purge_keep
from .payloads import read_payload
from .store.base import TxReader, WriteBatch
from .stream import (
    SyncApplied,
    SyncConflict,
    SyncDeleteKept,
    job_events,
    remote_interrupt_events,
)
from .syncplan import Decision, decide_session, lands_in_place, rebase

log = logging.getLogger("pleach.sync")


def _observe_page(view: RemoteView, changes: list[FeedChange]) -> None:
    """Move the clock past every stamp of the page. Observing the greatest is enough (stamps
    sort as text like their tuples); only when it is refused (skew or a malformed stamp) is
    each one observed, so every good stamp still counts and each bad one is logged."""
    if not changes:
        return
    top = max(change.record.hlc for change in changes)
    try:
        view.clock.advance(top)
        return
    except PleachError:
        pass
    for change in changes:
        try:
            view.clock.advance(change.record.hlc)
        except PleachError as exc:  # skew or a malformed stamp: apply, but say so
            log.warning("remote stamp not observed: %s", exc)


async def plan_page(
    tx: TxReader,
    view: RemoteView,
    changes: list[FeedChange],
    emitted: list[Any],
    wanted: Collection[str] = (),
) -> WriteBatch:
    """The writes for one page of remote changes, decided from the rows under the lock.
    ``wanted``: ids of content a pass from the start of the feed looks for (``ResyncLedger``):
    kept through the delete cascade of this page, since a later version of a session may name
    them again (the page's own versions may not, as at this place in the feed)."""
    records: list[Record] = []
    queued: list[Record] = []
    purge: list[str] = []
    remote_sessions: dict[str, Session] = {}
    events_by_session: dict[str, list[Event]] = {}
    contents: list[Record] = []
    audit: list[AuditRow] = []
    _observe_page(view, changes)
    for change in changes:
        record = change.record
        match record:
            case Session():
                problem = vector_problem(record.vv)
                if problem is not None:  # a poisoned peer record: refuse it, keep syncing
                    log.warning("session %s refused from a page: %s", record.id, problem)
                    continue
                # The server only ever replaces a session id by a dominating version, in feed
                # order: the last version of an id in the page is the one to compare.
                remote_sessions[record.id] = record
            case Event():
                events_by_session.setdefault(record.session_id, []).append(record)
            case AuditRow():
                audit.append(record)
            case _:
                contents.append(record)
    touched: set[str] = set()
    kept_versions: list[KeptReceipt] = []
    for remote in remote_sessions.values():
        local = await view.row(tx, remote.id)
        decision = decide_session(local, remote)
        if decision is Decision.TAKE and await _reuses_our_counter(tx, view, local, remote):
            decision = Decision.REUSED
        if remote.deleted and local is not None and local.deleted:
            # Our own delete coming back (or a later tombstone): sweep again, so content that
            # arrived meanwhile for a fork we did not know yet is kept only if a fork uses it.
            purge.append(remote.id)
        if decision is Decision.REUSED and local is not None:
            if local.client_id == view.client_id:
                view.identity_reused = True  # the sync loop takes a new id after this page
            continue
        if decision is Decision.KEEP:
            continue
        records.append(remote)
        view.rows[remote.id] = remote
        touched.add(remote.id)
        if remote.deleted:
            if remote.id not in purge:
                purge.append(remote.id)
            view.purged.append(remote.id)
        if decision is Decision.FORK_LOCAL and local is not None:
            fork = view.stamp(
                msgspec.structs.replace(
                    local,
                    id=uuid7(),
                    vv={},
                    state=unmarked(local.state),
                    forked_from=local.id,
                    conflict_id=uuid7(),
                    conflict_loser_side="local",
                ),
                base=None,
            )
            queued.append(fork)
            view.rows[fork.id] = fork
            touched.add(fork.id)
    # Content of a session this page deletes is not kept (the delete cascade), unless a live
    # session (a fork) still refers to it. Content of a session deleted here earlier is kept
    # for now: it may belong to a fork this device has not seen yet, and the tombstone's
    # return through the feed sweeps what no fork uses.
    kept = set(await purge_keep(tx, purge, view.rows.values())) if purge else set()
    if purge and wanted:
        kept |= set(wanted)
    held = await _held_messages(tx, view.client_id, contents)
    for record in contents:
        if getattr(record, "session_id", None) in purge:
            ref = record.artifact_id if isinstance(record, ArtifactUpdate) else record.id
            if ref not in kept:
                continue
        if isinstance(record, Message) and record.id in held:
            continue
        records.append(record)
    for session_id, incoming in events_by_session.items():
        known = view.canonical_head(session_id)
        if known is None:
            existing = await tx.list_events(session_id)
            verified = sorted((e for e in existing if e.canonical), key=_seq)
            head = (verified[-1].sequence_number, verified[-1].row_hash) if verified else (0, "")
            tail = [e for e in existing if not e.canonical]
            genesis = ""
            log_head = None
        else:
            head, verified, genesis = known, [], known[1]
            tail, log_head = await _provisional_tail(tx, view, session_id, incoming, known)
        placed = rebase(
            session_id, incoming, known_head=head, verified=verified, tail=tail, genesis=genesis
        )
        if log_head is not None:
            placed = dataclasses.replace(placed, head=log_head)
        view.canonical_heads[session_id] = placed.canonical_head
        view.heads[session_id] = placed.head
        records.extend(placed.out)
        touched.add(session_id)
        emitted.extend(
            conflict_event(receipt)
            for e in placed.fresh
            if e.type == "sync.conflict"
            and e.client_id != view.client_id
            and (receipt := _receipt(e)) is not None
        )
        for e in placed.fresh:
            if e.type == "sync.delete.kept":
                kept_receipt = read_payload(e, KeptReceipt)
                if kept_receipt is not None:
                    kept_versions.append(kept_receipt)
                    emitted.append(kept_event(e, kept_receipt))
        emitted.extend(
            remote_interrupt_events([e for e in placed.fresh if e.client_id != view.client_id])
        )
        # Another device's job lifecycle (``pleach_client.jobs``), raised on first sight.
        emitted.extend(job_events([e for e in placed.fresh if e.client_id != view.client_id]))
    if kept_versions:
        own = {view.client_id, *previous_ids(await tx.get_meta(PREVIOUS_IDS))}
        for kept_version in kept_versions:
            if kept_version.version_by in own:
                queued.extend(await _own_kept(tx, view, kept_version, touched))
    emitted[:0] = [SyncApplied(session_id=sid, records=len(changes)) for sid in sorted(touched)]
    kept_audit, moved = await _place_audit(tx, audit)
    records.extend(kept_audit)
    return WriteBatch(
        records=records,
        outbox=False,
        purge_sessions=purge,
        purge_keep=sorted(kept),
        queued=queued,
        rechained_audit=moved,
    )


# What a re-key may change of an audit row: its place in a device's chain and the digests
# derived from it (``chain_audit``). Everything the row says about the call stays.
_UNPLACED: dict[str, Any] = dict.fromkeys(
    ("client_id", "sequence_number", "prev_hash", "row_hash", "payload_digest", "identity_digest")
)


async def _place_audit(tx: TxReader, rows: list[AuditRow]) -> tuple[list[AuditRow], list[AuditRow]]:
    """Remote audit rows to insert, and those to move: a row this device holds under another
    place is one an earlier copy of this device moved onto a new id's chain when it re-keyed
    (a restored file still holds it where it was; the row's old place may meanwhile belong to
    a copy of the file that writes under the old id). The server's place is taken, so each
    chain here is the one the server holds. A row whose content differs is refused: the
    ledger is append-only."""
    if not rows:
        return [], []
    held = {row.id: row for row in await tx.audit_rows([row.id for row in rows])}
    fresh: list[AuditRow] = []
    moved: list[AuditRow] = []
    for row in rows:
        local = held.get(row.id)
        if local is None:
            fresh.append(row)
        elif local != row:
            same = msgspec.structs.replace(local, **_UNPLACED) == msgspec.structs.replace(
                row, **_UNPLACED
            )
            if same:
                moved.append(row)
            else:
                log.warning("audit row %s refused from a page: its content differs", row.id)
    return fresh, moved


async def _provisional_tail(
    tx: TxReader,
    view: RemoteView,
    session_id: str,
    incoming: list[Event],
    known: tuple[int, str],
) -> tuple[list[Event], tuple[int, str] | None]:
    """This device's provisional events after the canonical head ``known``, for ``rebase``;
    and the log's head when only the start of them was read (the page leaves the rest as it
    is). A page of another device's events where this device has no tail reads nothing (the
    core knows its log's head); a page of this device's own events coming back in order
    (``lands_in_place``) reads only as many as it places, so a long pull-back does not read
    and decode the rest of the tail again for every page."""
    log_head = await view.event_head(tx, session_id)
    if log_head == known:
        return [], None
    count = sum(1 for e in incoming if e.sequence_number > known[0])
    if count:
        start = await tx.list_events(session_id, from_sequence=known[0] + 1, limit=count)
        if lands_in_place(incoming, known[0], start):
            return start, log_head
    events = await tx.list_events(session_id, from_sequence=known[0] + 1)
    return [e for e in events if not e.canonical], None


async def _held_messages(tx: TxReader, client_id: str, contents: list[Record]) -> set[str]:
    """The page's messages of this device that it still holds. A message is immutable and
    stored once (a second insert of its id does nothing), so a held one is not written again:
    a device's own messages come back in every pull, and each would be encoded for nothing.
    Other devices' messages are not looked up (a live page's are new here: the lookup would
    cost the page a store call and save nothing)."""
    ids = [r.id for r in contents if isinstance(r, Message) and r.client_id == client_id]
    if not ids:
        return set()
    return set(ids).difference(await tx.missing_messages(ids))


async def _reuses_our_counter(
    tx: TxReader, view: RemoteView, local: Session | None, remote: Session
) -> bool:
    """A remote version that counts this device's latest, still unacknowledged version (its
    own counter or more) cannot have seen it: nobody has. Another copy of this device's file
    wrote under the same counter (a restored or copied file)."""
    if local is None or remote.deleted or local.client_id != view.client_id:
        return False
    mine = local.vv.get(view.client_id, 0)
    return 0 < mine <= remote.vv.get(view.client_id, 0) and await tx.session_queued(local.id)


async def missing_content(tx: TxReader, view: RemoteView, batch: WriteBatch) -> list[str]:
    """Messages that the live sessions this page took refer to and that neither the store nor
    the page holds. Only ids the row did not refer to before the page are looked up, so a
    live page of one turn checks that turn's messages, not the whole conversation."""
    wanted: set[str] = set()
    for row in view.rows.values():
        if row.deleted:
            continue
        before = view.before.get(row.id)
        wanted.update(new_ids(row.state.message_ids, before.state.message_ids if before else []))
    if not wanted:
        return []
    wanted -= {r.id for r in batch.records if isinstance(r, Message)}
    return await tx.missing_messages(sorted(wanted))


def new_ids(ids: list[str], known: list[str]) -> list[str]:
    """The ids of ``ids`` that ``known`` lacks. A row's list mostly extends the one it had (a
    turn appends its messages): then its tail, the prefix compared in one C loop, where a set
    of the known ids and a look at each id cost about 55 µs at 2,000. Any other list (a
    rollback, a merge) is looked at id by id. (A tail id that is also among the known ones
    is given too: its message is stored, so no lookup finds it lacking.)"""
    size = len(known)
    if len(ids) >= size and ids[:size] == known:
        return ids[size:]
    held = set(known)
    return [m for m in ids if m not in held]


def _receipt(event: Event) -> ConflictReceipt | None:
    """The receipt in a ``sync.conflict`` event; None (and a warning) if a peer sent junk."""
    return read_payload(event, ConflictReceipt)


def _seq(event: Event) -> int:
    return event.sequence_number


def conflict_event(receipt: ConflictReceipt) -> SyncConflict:
    return SyncConflict(
        session_id=receipt.session_id,
        conflict_id=receipt.conflict_id,
        fork_session_id=receipt.fork_session_id,
        winner=receipt.winner,
        conflicted_paths=receipt.conflicted_paths,
    )


async def _own_kept(
    tx: TxReader, view: RemoteView, receipt: KeptReceipt, touched: set[str]
) -> list[Record]:
    """This device wrote the version the server kept as ``receipt.fork_session_id`` beside
    a delete (a resolve's, ``SessionState.resolved``): make the kept session own its content.

    The kept session names the version's messages and artifacts, filed under the deleted
    session. The server kept those it had; but what it got after the delete, in pushes before
    the one with the version (a long resolve's copies, sent over several pushes), it drained,
    and only this device still holds them. So it writes them again as copies filed under the
    kept session (new ids), and a new version of it naming the copies, queued in the page's
    own transaction: the server stores them whatever it drained, and every device gets them.
    Content filed elsewhere (a later turn in the kept session) stays as it is."""
    fork = await view.row(tx, receipt.fork_session_id)
    if fork is None or fork.deleted:
        return []
    deleted = receipt.session_id
    # What the version named: this device's row of it, while it has not taken the delete
    # (``decide_session`` waits for the server's tombstone); the server's kept session names
    # only the messages it holds.
    version = view.before.get(deleted) or await view.row(tx, deleted)
    named = fork.state.message_ids
    if version is not None and not version.deleted and version.state.resolved:
        # The version's transcript, then what the kept session gained since (later turns).
        own = set(version.state.message_ids)
        named = [*version.state.message_ids, *(m for m in named if m not in own)]
    copies: dict[str, Record] = {}
    for message in await tx.get_messages(named):
        if message.session_id == deleted and message.id not in copies:
            copies[message.id] = msgspec.structs.replace(
                message,
                id=uuid7(),
                session_id=fork.id,
                client_id=view.client_id,
                hlc=view.clock.now(),
            )
    documents: dict[str, ArtifactUpdate] = {}
    for artifact_id in fork.state.artifacts:
        updates = await tx.list_artifact_updates(artifact_id)
        if updates and all(u.session_id == deleted for u in updates):
            documents[artifact_id] = copy_document(updates, fork.id, view.client_id, view.clock)
    if not copies and not documents:
        return []
    message_ids = [copies[i].id if i in copies else i for i in named]
    artifacts = [documents[a].artifact_id if a in documents else a for a in fork.state.artifacts]
    checkpoint = view.draft_checkpoint(
        fork.id, parent_id=None, turn_id=None, kind="fork", appended=[], snapshot=message_ids
    )
    state = msgspec.structs.replace(fork.state, message_ids=message_ids, artifacts=artifacts)
    row = view.stamp(
        msgspec.structs.replace(fork, state=state, head_checkpoint_id=checkpoint.id), base=fork
    )
    view.rows[fork.id] = row
    touched.add(fork.id)
    return [*copies.values(), *documents.values(), checkpoint, row]


def kept_event(event: Event, receipt: KeptReceipt) -> SyncDeleteKept:
    return SyncDeleteKept(
        session_id=event.session_id,
        fork_session_id=receipt.fork_session_id,
        version_by=receipt.version_by,
        deleted_by=receipt.deleted_by,
    )


__all__ = ["conflict_event", "kept_event", "missing_content", "new_ids", "plan_page"]
