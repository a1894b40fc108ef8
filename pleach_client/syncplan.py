"""The sync client's decisions, as pure functions from values to plans (no I/O, no loop).

- ``settle``: what one ``PushAck`` means for the outbox entries that were sent.
- ``decide_session``: what to do with a remote version of a session, given the local row.
- ``rebase``: place canonical events from the server and move the provisional tail after them.
- ``echo_of`` and ``echo_lands``: when a ``PushAck`` says the push's feed rows are its changes
  as pushed (protocol 5), the device takes its cursor past them without pulling them back.
- ``ResyncLedger``: whether a pull reads the feed again from the start, for messages a taken
  session names and this device lacks, and when such a pass counts as made.
- ``logs_to_fold``: which sessions' logs a pull folds and keeps the fold of, so that the first
  resume after it reads one row instead of the whole log.

``pleach_client.sync`` loads what these need, calls them, and writes what they return; the
tests drive them directly (unit and property tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol

import msgspec

from shared.clock import Order, vv_compare
from shared.errors import ChainError, ErrorCode
from shared.hashchain import GENESIS, chain_event, verify_chain
from shared.merge import kept_beside_delete
from shared.messages import ConflictReceipt, PushAck
from shared.records import Change, Event, Session

from .receipts import FailedEntry


@dataclass(frozen=True)
class Sent:
    """An outbox entry that was in the push: its sequence number and failed attempts so far."""

    client_seq: int
    attempts: int = 0


@dataclass
class Settlement:
    """What to do with the outbox after a ``PushAck``.

    ``remove``: on the server (applied, duplicate, superseded, resolved, or at or below its
    ``last_seq``). ``dead``: refused for good, ``(client_seq, code, message)``; they go to the
    dead letters. ``keep``: resend later (a sequence gap, a clock ahead of the server's: 3011).
    ``conflicts``: receipts to record.
    ``rekey``: another copy of this device (a restored or copied file) has used its client
    id and numbers: the server says so for each change it does not hold (3012), which is
    kept, and the device takes a new id.
    ``rechain``: an audit row the server did not take because it does not continue its chain
    where the server holds it (3013): ``(client_seq, sequence_number, row_hash)`` of the row
    and of the server's last place in that chain. It and the changes after it are kept; the
    device chains its queued rows of that chain on from the server's place, and resends.
    """

    remove: list[int] = field(default_factory=list)
    dead: list[tuple[int, int, str]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    conflicts: list[ConflictReceipt] = field(default_factory=list)
    failed: list[FailedEntry] = field(default_factory=list)
    rekey: bool = False
    rechain: tuple[int, int, str] | None = None
    skew: str | None = None
    """The server's word on this device's clock (3011), when it refused stamps ahead of it."""
    lost_numbers: bool = False
    """The server expects numbers this device no longer queues (3006 before the oldest queued
    change): it lost what it held of this device (a server restored from a backup), or never
    had it (another server, a file opened as another user). ``rekey`` is set with it: under a
    new id the numbering starts over and the queue goes through."""

    @property
    def progress(self) -> int:
        return len(self.remove) + len(self.dead)

    @property
    def settled_all(self) -> bool:
        """Whether every change of the push is settled (on the server or dead) and the
        device keeps its id: the server's ``last_seq`` is then at the push's end, so a push
        sent after it without waiting (``SyncFacet`` keeps a few in flight) went where the
        server expected it, and its ack can be settled as it stands. Otherwise the server
        refused that later push's changes as a sequence gap, which its ack, settled on its
        own, would take for lost numbers: the device drops the pushes in flight and resends
        from its oldest queued change."""
        return not self.keep and not self.rekey and self.rechain is None


FOLD_AFTER_PULL_EVENTS: Final = 1_000
"""A pull that brought a session at least this many events folds its log at the feed's end and
keeps the fold (``logs_to_fold``): about 1 ms a thousand events, paid by the pull rather than
by the first resume of the session after it. A log that grew by less is folded on from its
kept fold when it is next resumed (or whole, which costs little at that size)."""


def logs_to_fold(grown: Mapping[str, int], at_least: int = FOLD_AFTER_PULL_EVENTS) -> list[str]:
    """The sessions whose logs a pull folds and keeps, given the events it brought each
    (``grown``): those with ``at_least`` events or more (none when ``at_least`` is 0 or
    less: folding is off), in id order."""
    if at_least <= 0:
        return []
    return sorted(session_id for session_id, n in grown.items() if n >= at_least)


def unsettled(oldest_queued: int | None, server_seq: int, unsure_through: int) -> bool:
    """Whether the oldest queued change may already be on the server, unacknowledged, so a
    page must not be applied before a resend settles it.

    ``server_seq`` is the server's last word on this device's numbers (Welcome, PushAck): a
    queued change at or below it is held there (its ack was lost) or another copy of this
    file wrote under its number. ``unsure_through`` is the highest number sent in a push whose
    answer said nothing of it (the server's store failed under the commit, the connection
    dropped): the server may hold it, and its Welcome or next PushAck will say. Until then a
    page may carry another device's version built on such a change, which this device cannot
    tell from a copy of its file writing under the same counter.
    """
    if oldest_queued is None:
        return False
    return oldest_queued <= max(server_seq, unsure_through)


def settle(sent: Sequence[Sent], ack: PushAck, issued: int | None = None) -> Settlement:
    """Settle the entries of one push against its acknowledgement.

    An entry the ack does not mention is kept unless the server's ``last_seq`` covers it. A
    result for an entry that was not sent is ignored (a confused or hostile server cannot
    make the device drop a row it did not send). ``issued`` is the highest ``client_seq``
    this device ever gave out: a server ``last_seq`` above it means another copy of the
    device wrote under its id, so an entry the ack does not mention is not taken for held.
    A ``duplicate`` is the server's word that it holds that change (it checks the id).
    """
    by_seq = {s.client_seq: s for s in sent}
    out = Settlement()
    reused = issued is not None and ack.last_seq > issued
    decided: set[int] = set()
    gapped = False
    for result in ack.results:
        entry = by_seq.get(result.client_seq)
        if entry is None or result.client_seq in decided:
            continue
        decided.add(result.client_seq)
        if result.status == "rejected" and result.code == ErrorCode.SEQUENCE_GAP:
            out.keep.append(result.client_seq)
            gapped = True
            continue
        if result.status == "rejected" and result.code == ErrorCode.CLOCK_SKEW:
            out.keep.append(result.client_seq)  # the clock, not the change: send it later
            out.skew = out.skew or result.message or "clock skew"
            continue
        if result.status == "rejected" and result.code == ErrorCode.IDENTITY_REUSED:
            out.keep.append(result.client_seq)
            out.rekey = True
            continue
        if result.status == "rejected" and result.code == ErrorCode.CHAIN_BROKEN:
            out.keep.append(result.client_seq)  # held back: sent again once chained on
            place = (result.chain_sequence, result.chain_hash)
            if out.rechain is None and place[0] is not None and place[1] is not None:
                out.rechain = (result.client_seq, max(0, place[0]), place[1])
            continue
        if result.status == "rejected":
            code = result.code or ErrorCode.INVALID_RECORD
            message = result.message or "rejected"
            out.dead.append((result.client_seq, int(code), message))
            out.failed.append(
                FailedEntry(
                    client_seq=result.client_seq,
                    code=result.code,
                    message=message,
                    attempts=entry.attempts + 1,
                )
            )
            continue
        out.remove.append(result.client_seq)
        if result.status == "resolved" and result.conflict is not None:
            out.conflicts.append(result.conflict)
    if gapped and not reused and by_seq and min(by_seq) > ack.last_seq + 1:
        # The oldest queued change always goes first, so the numbers the server waits for are
        # no longer queued here: resending can never close the gap.
        out.lost_numbers = out.rekey = True
    for seq in by_seq:
        if seq in decided:
            continue
        # Anything at or below the server's last_seq is on the server, whatever the result
        # (unless another copy of this device put it there).
        if seq <= ack.last_seq and not reused:
            out.remove.append(seq)
        else:
            out.keep.append(seq)
    out.remove.sort()
    out.keep.sort()
    return out


class Decision(Enum):
    TAKE = "take"  # the remote version replaces the local row
    KEEP = "keep"  # the local row stays (newer, concurrent: our push settles it, or deleted)
    FORK_LOCAL = "fork-local"  # take the remote version, keep the local one as a new session
    REUSED = "reused"  # keep the local row: another copy of its writer wrote the remote one


def decide_session(local: Session | None, remote: Session) -> Decision:
    """What a device does with a remote version of a session it may hold.

    Never overwrites a local version that the remote one does not include: a remote version
    replaces the row only when its vector dominates the local one. Concurrent: the local row
    stays, the pending push meets the remote version at the server, which keeps the loser as
    a fork. Equal vectors with different contents mean an id was reused (a restored or
    copied device file): when both versions name the same writer, the local row stays
    (``REUSED``: that writer, if it is this device, takes a new id and stamps a new version,
    which the server then settles as a conflict, both kept); otherwise both are kept here,
    the local version as a fork. Deletion wins both ways: a remote tombstone is taken, a
    local tombstone is kept. Except over a conflict resolution's version the tombstone never
    saw (``kept_beside_delete``): the server keeps that one as a new session, so the local row
    stays until its push gets there and the tombstone the server writes then, which includes
    it, comes back after the kept session.
    """
    if local is None:
        return Decision.TAKE
    if local.deleted != remote.deleted:
        if remote.deleted and kept_beside_delete(local, remote):
            return Decision.KEEP
        return Decision.TAKE if remote.deleted else Decision.KEEP
    order = vv_compare(remote.vv, local.vv)
    if order is Order.DOMINATES:
        return Decision.TAKE  # both tombstones too: converge on the server's
    if order is Order.EQUAL and local != remote and not local.deleted:
        return Decision.REUSED if local.client_id == remote.client_id else Decision.FORK_LOCAL
    return Decision.KEEP


@dataclass
class Rebase:
    """Rows to write for one session's events, and the heads after them.

    ``out``: newly placed canonical events and the rebased provisional tail. ``head``: the last
    event of the whole log; ``canonical_head``: the last canonical one. ``fresh``: canonical
    events this device had not seen before (neither placed nor in its tail).
    """

    out: list[Event]
    head: tuple[int, str]
    canonical_head: tuple[int, str]
    fresh: list[Event]


def rebase(
    session_id: str,
    incoming: Sequence[Event],
    *,
    known_head: tuple[int, str],
    verified: Sequence[Event],
    tail: Sequence[Event],
    genesis: str,
) -> Rebase:
    """Merge canonical events into a session's log and rebase the provisional tail.

    ``known_head`` is the last canonical event the device holds; ``verified`` the canonical
    events to re-verify with the new ones (empty when ``known_head`` was verified before, and
    then ``genesis`` is its hash); ``tail`` the device's provisional events. Raises
    ``ChainError`` when the new canonical events do not chain on or are not contiguous: the
    caller refuses the whole page.
    """
    # Pages may overlap (a live page and a pull): what is at or below the head is known.
    new = sorted((e for e in incoming if e.sequence_number > known_head[0]), key=_seq)
    contiguous = [e.sequence_number for e in new] == list(
        range(known_head[0] + 1, known_head[0] + 1 + len(new))
    )
    chain = [*verified, *new]
    report = verify_chain(chain, genesis=genesis)
    if not report.ok or not contiguous:
        index = report.first_bad_index if not report.ok else len(verified)
        raise ChainError(
            f"pulled event chain of session {session_id} does not verify at index "
            f"{index}: {report.reason or 'sequence numbers are not contiguous'}",
            index=index,
        )
    canonical_head = (new[-1].sequence_number, new[-1].row_hash) if new else known_head
    placed_ids = {e.id for e in new}
    tail_ids = {t.id for t in tail}
    fresh = [e for e in new if e.id not in tail_ids]
    seq, prev = canonical_head
    out = list(new)
    for event in sorted((e for e in tail if e.id not in placed_ids), key=_seq):
        seq += 1
        placed = chain_event(event, prev, seq)
        prev = placed.row_hash
        if placed != event:
            out.append(placed)
    return Rebase(out=out, head=(seq, prev), canonical_head=canonical_head, fresh=fresh)


def lands_in_place(incoming: Sequence[Event], known_head: int, tail_start: Sequence[Event]) -> bool:
    """Whether the page's canonical events after ``known_head`` are exactly the first events
    of this device's provisional tail (``tail_start``), at the places and with the hashes it
    gave them: its own events coming back in order, with no other device's in between (a
    pull-back, or a live page of its own turn). Then placing them changes nothing after
    them, so the rest of the tail need not be read: ``rebase`` over ``tail_start`` alone,
    with the log's head as it was, is the whole answer.
    """
    new = sorted((e for e in incoming if e.sequence_number > known_head), key=_seq)
    if not new or len(new) != len(tail_start):
        return False
    return all(
        not mine.canonical
        and (mine.id, mine.sequence_number, mine.row_hash)
        == (placed.id, placed.sequence_number, placed.row_hash)
        for placed, mine in zip(new, tail_start, strict=True)
    )


@dataclass(frozen=True)
class Echo:
    """A push's own feed rows, known from its acknowledgement (protocol 5, ``as_pushed_from``).

    The tenant's feed holds after ``from_cursor`` exactly these rows, up to ``to_cursor``: the
    changes of the push the server applied, as they were pushed. A device whose cursor is at
    ``from_cursor`` holds all of them already; taking them changes only its cursor (to
    ``to_cursor``) and marks ``events`` (the pushed events, ``canonical``, in order of session
    and place) canonical.
    """

    from_cursor: int
    to_cursor: int
    events: tuple[Event, ...] = ()


def echo_of(changes: Sequence[Change], ack: PushAck) -> Echo | None:
    """What ``ack`` says of the push's own feed rows, for the ``changes`` that were sent; None
    when it says nothing (an older server, a conflict, an event the server placed elsewhere)
    or what it says does not add up (then the device pulls its rows back, as before)."""
    start = ack.as_pushed_from
    if start is None or start < 0:
        return None
    sent = {change.client_seq: change.record for change in changes}
    events: list[Event] = []
    cursors: list[int] = []
    for result in ack.results:
        if result.status != "applied":
            if result.cursor is not None:
                return None  # a row the device did not push (a fork): nothing is known
            continue
        record = sent.get(result.client_seq)
        if record is None or result.cursor is None or result.cursor <= start:
            return None
        cursors.append(result.cursor)
        if isinstance(record, Event):
            events.append(_canonical(record))
    if not cursors or len(set(cursors)) != len(cursors):
        return None
    events.sort(key=lambda e: (e.session_id, e.sequence_number))
    for before, after in itertools.pairwise(events):
        if before.session_id == after.session_id and (
            after.sequence_number != before.sequence_number + 1
            or after.prev_hash != before.row_hash
        ):
            return None  # one session's pushed events are one run of places
    return Echo(from_cursor=start, to_cursor=max(cursors), events=tuple(events))


class Placed(Protocol):
    """An event's id and place: an ``Event``, or a store's ``EventPlace`` of one."""

    @property
    def id(self) -> str: ...
    @property
    def sequence_number(self) -> int: ...
    @property
    def prev_hash(self) -> str: ...
    @property
    def row_hash(self) -> str: ...
    @property
    def canonical(self) -> bool: ...


def echo_lands(pushed: Sequence[Event], held: Sequence[Placed]) -> bool:
    """Whether one session's ``pushed`` events (an ``Echo``'s, in order) are where this device
    holds them: ``held`` are its events from the place before the first (from the first when
    that is place 1), as read in the same transaction. Each must be there, provisional, with
    the pushed id and hashes, and the event before them canonical with the hash the first
    names (or the first at place 1 chain on from nothing)."""
    if not pushed:
        return True
    first = pushed[0]
    rows = list(held)
    if first.sequence_number > 1:
        if not rows or rows[0].sequence_number != first.sequence_number - 1:
            return False
        before, rows = rows[0], rows[1:]
        if not before.canonical or before.row_hash != first.prev_hash:
            return False
    elif first.prev_hash != GENESIS:
        return False
    if len(rows) < len(pushed):
        return False
    return all(
        not mine.canonical
        and (mine.id, mine.sequence_number, mine.prev_hash, mine.row_hash)
        == (placed.id, placed.sequence_number, placed.prev_hash, placed.row_hash)
        for placed, mine in zip(pushed, rows, strict=False)
    )


def _canonical(event: Event) -> Event:
    return event if event.canonical else msgspec.structs.replace(event, canonical=True)


def _seq(event: Event) -> int:
    return event.sequence_number


RESYNC_DUE = "resync_due"
"""The meta key of the messages that taken sessions name and this device lacks, not yet found
nor given their pass (``ResyncLedger``): a JSON list of ids, written in the transaction of
the page that found them lacking, so a cancel or a crash right after cannot forget them."""
MAX_RESYNC_IDS = 10_000
"""Ids kept under ``RESYNC_DUE`` at most (about 40 bytes each), and in the ledger's ``done``:
past it, ``done`` is emptied (a forgotten id may cost one more pass from the start of the
feed, which reads only what the device holds) and a page's further ids wait for a later page
that counts them again."""


def stored_ids(text: str | None, limit: int) -> list[str]:
    """A list of ids kept in a meta value as JSON, at most ``limit`` of them: none for a
    missing or unreadable value (a file's meta is read, never trusted to parse)."""
    if not text:
        return []
    try:
        ids = msgspec.json.decode(text, type=list[str])
    except msgspec.DecodeError:  # (ValidationError is one)
        return []
    return ids[:limit]


def resync_ids(text: str | None) -> set[str]:
    """The ids stored under ``RESYNC_DUE`` (none for a missing or unreadable value)."""
    return set(stored_ids(text, MAX_RESYNC_IDS))


def resync_text(ids: set[str]) -> str:
    """``ids`` as stored under ``RESYNC_DUE`` (sorted, at most ``MAX_RESYNC_IDS``)."""
    return msgspec.json.encode(sorted(ids)[:MAX_RESYNC_IDS]).decode() if ids else ""


@dataclass
class ResyncLedger:
    """Whether a pull should read the feed again from the start, for messages that taken
    sessions name and this device lacks.

    A session row taken from a page may name messages that this device does not hold (it
    purged them with a session it deleted, before it learned of a fork that shares them).
    The page's transaction adds them to the ids stored under ``RESYNC_DUE``. At the end of a
    pull the device looks up those not ``done`` (``due``) and keeps stored only those it still
    lacks: when some are, the pull reads the feed again from cursor 0, once for those ids
    (``start_pass``). They are done only when that pass reaches the end of the
    feed (``end_of_feed``) without bringing them: a pass cut short (a disconnect, a cancel, a
    crash) leaves them stored and not done, so the next pull starts the pass again, and a
    complete pass that still did not bring them (the server lost them too) is not repeated.
    Ids a pass brought are not done: a later page may sweep them again (a tombstone of the
    session they are filed under, while no live session names them), and a later version
    naming them again then gets a pass of its own (each such pass needs new changes in the
    feed, so they cannot repeat without end). Pure: the sync loop reads and writes the stored
    ids, in the same transaction as the look-up.
    """

    done: set[str] = field(default_factory=set)
    """Had their complete pass from the start of the feed (in this process)."""
    passing: set[str] = field(default_factory=set)
    """The ids of the pass this pull is making (empty when it makes none)."""
    maybe_stored: bool = True
    """Whether ids may be stored: the end of a pull looks only then (a transaction), so a
    pull that found nothing lacking costs nothing more. True when the ledger starts (ids a
    process stored before may wait) and on each new connection (another process on the same
    file may have stored some), after a page stored ids; False after a look kept none."""

    def wants_look(self, ids: Sequence[str]) -> bool:
        """A page found ``ids`` lacking: whether any is not done (a pull should look)."""
        return any(i not in self.done for i in ids)

    def pull_started(self) -> None:
        """A new pull: a pass that an earlier pull left unfinished is no longer under way."""
        self.passing = set()

    def end_of_feed(self, unfound: Collection[str] | None = None) -> None:
        """The pull reached the end of the feed: a pass under way is complete. ``unfound``:
        those of its ids this device still lacks (None: all of them), done from now on; the
        ones it brought may be asked for again if they go missing again."""
        if self.passing:
            done = self.passing if unfound is None else self.passing & set(unfound)
            if len(self.done) + len(done) > MAX_RESYNC_IDS:
                self.done.clear()
            self.done |= done
            self.passing = set()

    def due(self, stored: set[str]) -> set[str]:
        """Of the stored ids, those to look up now: never given a complete pass."""
        return stored - self.done

    def start_pass(self, ids: set[str]) -> None:
        """The look-up found ``ids`` still lacking (they stay stored, and only they): a pass
        from the start of the feed begins for them (none: no pass)."""
        self.passing = set(ids)
        self.maybe_stored = bool(ids)

    def stored(self) -> None:
        """A page stored ids, or a new connection began: the next end of a pull looks."""
        self.maybe_stored = True


__all__ = [
    "MAX_RESYNC_IDS",
    "RESYNC_DUE",
    "Decision",
    "Echo",
    "FailedEntry",
    "Rebase",
    "ResyncLedger",
    "Sent",
    "Settlement",
    "decide_session",
    "echo_lands",
    "echo_of",
    "lands_in_place",
    "rebase",
    "resync_ids",
    "resync_text",
    "settle",
    "stored_ids",
    "unsettled",
]
