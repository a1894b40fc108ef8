"""The sync client's decisions, tested as pure functions: no loop, no store, no socket.

``settle`` (a PushAck against the entries sent), ``decide_session`` (a remote session version
against the local row), ``rebase`` (canonical events placed, the provisional tail moved
after them), ``echo_of`` / ``echo_lands`` (a push's own rows taken from its ack) and
``logs_to_fold`` (the logs a pull folds and keeps), each with examples and Hypothesis
properties.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.apply import new_ids
from pleach_client.syncplan import (
    FOLD_AFTER_PULL_EVENTS,
    Decision,
    Sent,
    decide_session,
    echo_lands,
    echo_of,
    lands_in_place,
    logs_to_fold,
    rebase,
    settle,
    unsettled,
)
from shared.clock import Order, vv_bump, vv_compare, vv_merge
from shared.errors import ChainError, ErrorCode
from shared.hashchain import chain_event, verify_chain
from shared.messages import ChangeResult, ConflictReceipt, PushAck
from shared.records import Change, SessionState
from tests.factories import make_event, make_message, make_session

# -- settle -----------------------------------------------------------------------------------

STATUSES = ["applied", "duplicate", "superseded", "resolved", "rejected"]


def ack(results: list[ChangeResult], last_seq: int) -> PushAck:
    return PushAck(results=results, last_seq=last_seq, head_cursor=0)


def test_settle_removes_what_landed_and_dead_letters_what_was_refused() -> None:
    receipt = ConflictReceipt(
        conflict_id="c",
        session_id="s",
        winner="remote",
        fork_session_id="f",
        conflicted_paths=[],
    )
    plan = settle(
        [Sent(1), Sent(2, attempts=2), Sent(3), Sent(4)],
        ack(
            [
                ChangeResult(client_seq=1, status="applied"),
                ChangeResult(client_seq=2, status="rejected", code=ErrorCode.FORBIDDEN),
                ChangeResult(client_seq=3, status="resolved", conflict=receipt),
                ChangeResult(client_seq=4, status="rejected", code=ErrorCode.SEQUENCE_GAP),
            ],
            last_seq=3,
        ),
    )
    assert plan.remove == [1, 3]
    assert plan.dead == [(2, ErrorCode.FORBIDDEN, "rejected")]
    assert plan.keep == [4]
    assert plan.conflicts == [receipt]
    assert [(f.client_seq, f.attempts) for f in plan.failed] == [(2, 3)]


def test_settle_rekeys_on_3012_and_takes_nothing_for_held_by_number() -> None:
    """The server knows client_seq 9 of this id, but this device only ever gave out 4:
    another copy used the numbers. Unmentioned entries are not taken for held; what the
    server says it does not hold (3012) is kept, and the device takes a new id."""
    results = [ChangeResult(client_seq=3, status="duplicate")]
    plan = settle([Sent(3), Sent(4)], ack(results, last_seq=9), issued=4)
    assert plan.remove == [3] and plan.keep == [4] and not plan.rekey
    same = settle([Sent(3), Sent(4)], ack(results, last_seq=4), issued=4)
    assert same.remove == [3, 4] and not same.rekey
    told = settle(
        [Sent(3)],
        ack([ChangeResult(client_seq=3, status="rejected", code=ErrorCode.IDENTITY_REUSED)], 4),
        issued=4,
    )
    assert told.keep == [3] and told.dead == [] and told.rekey


def test_settle_rekeys_when_the_numbers_the_server_waits_for_are_no_longer_queued() -> None:
    """The server counts this device only to 4 but the oldest queued change is 12: it lost
    (or never had) 5-11, which this device already settled. Resending can never close that
    gap, so the device takes a new id; a gap it can still close (its oldest queued change is
    the one the server waits for) is only kept."""
    gap = [
        ChangeResult(client_seq=s, status="rejected", code=ErrorCode.SEQUENCE_GAP) for s in (12, 13)
    ]
    lost = settle([Sent(12), Sent(13)], ack(gap, last_seq=4), issued=13)
    assert lost.keep == [12, 13] and lost.dead == [] and lost.remove == []
    assert lost.rekey and lost.lost_numbers
    closable = settle(
        [Sent(5), Sent(12)],
        ack([ChangeResult(client_seq=5, status="applied"), *gap[:1]], last_seq=5),
        issued=13,
    )
    assert closable.remove == [5] and closable.keep == [12] and not closable.rekey
    fresh = settle([Sent(1)], ack([], last_seq=0), issued=1)
    assert fresh.keep == [1] and not fresh.rekey


def test_settle_keeps_what_3013_held_back_and_names_where_the_chain_goes_on() -> None:
    """An audit row that does not continue its chain on the server (3013) and everything the
    server held back after it stay queued; the first 3013 that names the server's place says
    where the device chains its rows on from. One without a place changes nothing."""
    broken = ErrorCode.CHAIN_BROKEN
    results = [
        ChangeResult(client_seq=5, status="applied"),
        ChangeResult(client_seq=6, status="rejected", code=broken, chain_sequence=3,
                     chain_hash="ab" * 32),
        ChangeResult(client_seq=7, status="rejected", code=broken),
    ]  # fmt: skip
    plan = settle([Sent(5), Sent(6), Sent(7)], ack(results, last_seq=5), issued=7)
    assert plan.remove == [5] and plan.keep == [6, 7] and plan.dead == []
    assert plan.rechain == (6, 3, "ab" * 32) and not plan.rekey
    unplaced = settle(
        [Sent(7)], ack([ChangeResult(client_seq=7, status="rejected", code=broken)], 6), issued=7
    )
    assert unplaced.keep == [7] and unplaced.rechain is None and unplaced.dead == []


def test_settle_ignores_results_for_entries_it_did_not_send() -> None:
    plan = settle([Sent(5)], ack([ChangeResult(client_seq=9, status="applied")], last_seq=4))
    assert plan.remove == [] and plan.keep == [5] and plan.progress == 0


@settings(max_examples=300, deadline=None)
@given(
    seqs=st.lists(st.integers(1, 60), min_size=1, max_size=20, unique=True),
    data=st.data(),
)
def test_settle_partitions_every_sent_entry_exactly_once(
    seqs: list[int], data: st.DataObject
) -> None:
    sent = [Sent(s) for s in seqs]
    answered = data.draw(st.lists(st.sampled_from([*seqs, 99, 100]), max_size=30))
    results = [
        ChangeResult(
            client_seq=s,
            status=data.draw(st.sampled_from(STATUSES)),  # type: ignore[arg-type]
            code=data.draw(
                st.sampled_from(
                    [
                        None,
                        ErrorCode.SEQUENCE_GAP,
                        ErrorCode.FORBIDDEN,
                        ErrorCode.IDENTITY_REUSED,
                        ErrorCode.CHAIN_BROKEN,
                    ]
                )
            ),
        )
        for s in answered
    ]
    last_seq = data.draw(st.integers(0, 70))
    issued = data.draw(st.none() | st.integers(0, 70))
    reused = issued is not None and last_seq > issued
    plan = settle(sent, ack(results, last_seq), issued)
    dead = [d[0] for d in plan.dead]
    everything = plan.remove + dead + plan.keep
    # Each sent entry lands in exactly one bucket; nothing that was not sent appears.
    assert sorted(everything) == sorted(seqs)
    first = {}
    for r in results:
        first.setdefault(r.client_seq, r)
    for s in seqs:
        r = first.get(s)
        if r is None:
            assert (s in plan.remove) == (s <= last_seq and not reused)
        elif r.status == "rejected" and r.code == ErrorCode.SEQUENCE_GAP:
            assert s in plan.keep
        elif r.status == "rejected" and r.code == ErrorCode.IDENTITY_REUSED:
            assert s in plan.keep and plan.rekey
        elif r.status == "rejected" and r.code == ErrorCode.CHAIN_BROKEN:
            assert s in plan.keep  # held back, never dead-lettered
        elif r.status == "rejected":
            assert s in dead
        else:
            assert s in plan.remove
    assert plan.progress == len(plan.remove) + len(plan.dead)
    told = any(
        r.status == "rejected" and r.code == ErrorCode.IDENTITY_REUSED
        for s, r in first.items()
        if s in seqs
    )
    gapped = any(
        r.status == "rejected" and r.code == ErrorCode.SEQUENCE_GAP
        for s, r in first.items()
        if s in seqs
    )
    # A gap before the oldest entry sent can never close: the device takes a new id.
    lost = gapped and not reused and min(seqs) > last_seq + 1
    assert plan.lost_numbers == lost
    assert plan.rekey == (told or lost)
    # Pushes sent after this one stand only when it is settled whole: every entry on the
    # server or dead, under the same id.
    assert plan.settled_all == (sorted(plan.remove + dead) == sorted(seqs) and not plan.rekey)


# -- decide_session ---------------------------------------------------------------------------


def test_a_local_version_the_remote_does_not_include_is_never_taken_over() -> None:
    base = make_session(vv={"a": 1})
    local = msgspec.structs.replace(base, vv={"a": 2}, title="mine")  # unpushed local edit
    remote = msgspec.structs.replace(base, vv={"a": 1, "b": 1}, title="theirs")
    assert decide_session(local, remote) is Decision.KEEP  # concurrent: the push settles it
    newer = msgspec.structs.replace(base, vv={"a": 2, "b": 1}, title="merged")
    assert decide_session(local, newer) is Decision.TAKE
    assert decide_session(None, remote) is Decision.TAKE
    assert decide_session(newer, local) is Decision.KEEP  # older remote


def test_equal_vectors_with_different_contents_keep_both() -> None:
    # One writer id, one vector, two contents: two copies of one device file wrote them.
    # The local row stays; that device takes a new id and the server settles the conflict.
    local = make_session(vv={"a": 3}, title="restored file's edit")
    remote = msgspec.structs.replace(local, title="the edit the server saw first")
    assert decide_session(local, remote) is Decision.REUSED
    assert decide_session(local, local) is Decision.KEEP
    # Other writers (a vector reached twice some other way): both kept here, local as a fork.
    other = msgspec.structs.replace(remote, client_id="b")
    assert decide_session(local, other) is Decision.FORK_LOCAL


def test_delete_wins_both_ways() -> None:
    local = make_session(vv={"a": 5})
    tomb = msgspec.structs.replace(local, vv={"b": 1}, deleted=True)
    assert decide_session(local, tomb) is Decision.TAKE
    assert decide_session(tomb, msgspec.structs.replace(local, vv={"a": 9, "b": 9})) is (
        Decision.KEEP
    )
    # Two tombstones converge on the one that includes the other.
    merged = msgspec.structs.replace(tomb, vv={"a": 5, "b": 1, "srv": 1})
    assert decide_session(tomb, merged) is Decision.TAKE
    assert decide_session(merged, tomb) is Decision.KEEP


def test_a_tombstone_that_never_saw_a_resolve_waits_for_the_servers() -> None:
    """A resolved version (marked) is kept by the server beside a delete that never saw it: a
    device holding it does not take such a tombstone, only the one the server writes once the
    version got there (which includes it)."""
    base = make_session(vv={"a": 2, "b": 1})
    resolved = msgspec.structs.replace(
        base,
        vv={"a": 3, "b": 1},
        state=SessionState(message_ids=["m"], resolved={"a": 2}),
    )
    unaware = msgspec.structs.replace(base, vv={"a": 2, "b": 1, "c": 1}, deleted=True)
    assert decide_session(resolved, unaware) is Decision.KEEP
    # One that saw the resolve wins as always, and so does the server's, which includes it.
    aware = msgspec.structs.replace(base, vv={"a": 3, "b": 1, "c": 1}, deleted=True)
    assert decide_session(resolved, aware) is Decision.TAKE
    servers = msgspec.structs.replace(unaware, vv={"a": 3, "b": 1, "c": 1, "srv": 1})
    assert decide_session(resolved, servers) is Decision.TAKE
    # An unmarked version loses to the unaware tombstone: delete wins.
    plain = msgspec.structs.replace(resolved, state=SessionState(message_ids=["m"]))
    assert decide_session(plain, unaware) is Decision.TAKE


vectors = st.dictionaries(st.sampled_from("abcd"), st.integers(1, 4), max_size=4)


@settings(max_examples=400, deadline=None)
@given(local_vv=vectors, remote_vv=vectors, same=st.booleans())
def test_decide_session_takes_only_what_includes_the_local_version(
    local_vv: dict[str, int], remote_vv: dict[str, int], same: bool
) -> None:
    local = make_session(id="s", vv=local_vv, title="l")
    remote = msgspec.structs.replace(local, vv=remote_vv, title="l" if same else "r")
    decision = decide_session(local, remote)
    order = vv_compare(remote_vv, local_vv)
    if decision is Decision.TAKE:
        # The only way a local version is replaced: the remote one includes it.
        assert order is Order.DOMINATES
    elif decision is Decision.FORK_LOCAL:
        assert order is Order.EQUAL and not same
    else:
        assert order is not Order.DOMINATES
    # Applying the merged vector of both, bumped by a third device, is always taken.
    merged = msgspec.structs.replace(remote, vv=vv_bump(vv_merge(local_vv, remote_vv), "z"))
    assert decide_session(local, merged) is Decision.TAKE


# -- rebase -----------------------------------------------------------------------------------


def chain(events: list, prev: str = "", start: int = 1) -> list:
    out = []
    for i, e in enumerate(events):
        placed = chain_event(e, prev, start + i)
        prev = placed.row_hash
        out.append(placed)
    return out


def canonical(events: list) -> list:
    return [msgspec.structs.replace(e, canonical=True) for e in events]


def test_rebase_places_remote_events_before_the_local_tail() -> None:
    shared_log = canonical(chain([make_event(session_id="s") for _ in range(2)]))
    remote_new = canonical(
        chain([make_event(session_id="s", client_id="b")], shared_log[-1].row_hash, start=3)
    )
    tail = chain([make_event(session_id="s") for _ in range(2)], shared_log[-1].row_hash, start=3)
    plan = rebase(
        "s",
        remote_new,
        known_head=(2, shared_log[-1].row_hash),
        verified=[],
        tail=tail,
        genesis=shared_log[-1].row_hash,
    )
    log = shared_log + [e for e in plan.out]
    log.sort(key=lambda e: e.sequence_number)
    assert [e.sequence_number for e in log] == [1, 2, 3, 4, 5]
    assert verify_chain(log).ok
    assert [e.id for e in log[3:]] == [t.id for t in tail]
    assert plan.head == (5, log[-1].row_hash) and plan.canonical_head == (3, remote_new[0].row_hash)
    assert plan.fresh == remote_new


def test_rebase_refuses_a_tampered_or_gapped_page() -> None:
    log = canonical(chain([make_event(session_id="s") for _ in range(3)]))
    bad = msgspec.structs.replace(log[1], payload={"forged": True})
    with pytest.raises(ChainError):
        rebase("s", [log[0], bad, log[2]], known_head=(0, ""), verified=[], tail=[], genesis="")
    with pytest.raises(ChainError):
        rebase("s", [log[0], log[2]], known_head=(0, ""), verified=[], tail=[], genesis="")


@settings(max_examples=200, deadline=None)
@given(
    known=st.integers(0, 4),
    new=st.integers(0, 4),
    tail=st.integers(0, 4),
    overlap=st.booleans(),
    placed_from_tail=st.integers(0, 4),
)
def test_rebase_always_yields_one_verifying_chain_with_nothing_lost(
    known: int, new: int, tail: int, overlap: bool, placed_from_tail: int
) -> None:
    # The server's log: ``known`` events this device holds, then ``new`` ones, some of which
    # may be this device's own tail events placed by the server.
    mine = [make_event(session_id="s", client_id="me") for _ in range(tail)]
    placed_mine = mine[: min(placed_from_tail, tail, new)]
    others = [make_event(session_id="s", client_id="b") for _ in range(new - len(placed_mine))]
    server = canonical(
        chain([make_event(session_id="s") for _ in range(known)] + others + placed_mine)
    )
    held = server[:known]
    head = (known, held[-1].row_hash) if held else (0, "")
    local_tail = chain(mine, head[1], start=known + 1)
    incoming = server[known:]
    if overlap and held:
        incoming = [held[-1], *incoming]  # a live page overlapping what is held
    plan = rebase("s", incoming, known_head=head, verified=[], tail=local_tail, genesis=head[1])
    final = {e.id: e for e in held}
    for e in local_tail:
        final[e.id] = e
    for e in plan.out:
        final[e.id] = e
    log = sorted(final.values(), key=lambda e: e.sequence_number)
    assert [e.sequence_number for e in log] == list(range(1, len(log) + 1))
    assert verify_chain(log).ok
    assert {e.id for e in log} == {e.id for e in server} | {e.id for e in mine}
    assert plan.head == ((log[-1].sequence_number, log[-1].row_hash) if log else (0, ""))


@settings(max_examples=300, deadline=None)
@given(
    known=st.integers(0, 4),
    others=st.integers(0, 3),
    tail=st.integers(0, 6),
    placed=st.integers(0, 6),
    others_first=st.booleans(),
)
def test_reading_only_the_start_of_the_tail_gives_the_whole_rebase(
    known: int, others: int, tail: int, placed: int, others_first: bool
) -> None:
    """When ``lands_in_place`` says a page's canonical events are this device's own tail
    events at their places, a rebase over the tail's start, with the log's head as it was,
    writes and concludes exactly what the rebase over the whole tail does; whenever another
    device's event comes between, it says no."""
    mine = [make_event(session_id="s", client_id="me") for _ in range(tail)]
    placed_mine = mine[: min(placed, tail)]
    theirs = [make_event(session_id="s", client_id="b") for _ in range(others)]
    page_events = [*theirs, *placed_mine] if others_first else [*placed_mine, *theirs]
    held = canonical(chain([make_event(session_id="s") for _ in range(known)]))
    head = (known, held[-1].row_hash) if held else (0, "")
    server = canonical(chain(page_events, head[1], start=known + 1))
    local_tail = chain(mine, head[1], start=known + 1)
    log_head = (local_tail[-1].sequence_number, local_tail[-1].row_hash) if local_tail else head
    whole = rebase("s", server, known_head=head, verified=[], tail=local_tail, genesis=head[1])
    start = local_tail[: len(server)]
    fits = lands_in_place(server, known, start)
    assert fits == (bool(placed_mine) and not theirs)
    if fits:
        part = rebase("s", server, known_head=head, verified=[], tail=start, genesis=head[1])
        assert part.out == whole.out
        assert part.canonical_head == whole.canonical_head
        assert part.fresh == whole.fresh == []
        assert whole.head == log_head


@given(
    queued=st.none() | st.integers(1, 50),
    server_seq=st.integers(0, 50),
    unsure_through=st.integers(0, 50),
)
def test_unsettled_holds_pages_back_while_a_queued_change_may_be_on_the_server(
    queued: int | None, server_seq: int, unsure_through: int
) -> None:
    """A page waits while the oldest queued change is one the server counts (its last word)
    or may hold (a push of it got no answer that says): exactly then, and never with an
    empty queue."""
    held = unsettled(queued, server_seq, unsure_through)
    if queued is None:
        assert not held
    else:
        assert held == (queued <= server_seq or queued <= unsure_through)
    # Learning that the server may hold more never releases a page.
    if held:
        assert unsettled(queued, server_seq, unsure_through + 1)
        assert unsettled(queued, server_seq + 1, unsure_through)


# -- echo_of, echo_lands ----------------------------------------------------------------------


def pushed_ack(changes: list[Change], start: int | None, first_cursor: int) -> PushAck:
    results = [
        ChangeResult(client_seq=c.client_seq, status="applied", cursor=first_cursor + i)
        for i, c in enumerate(changes)
    ]
    return PushAck(
        results=results,
        last_seq=changes[-1].client_seq,
        head_cursor=first_cursor + len(changes) - 1,
        as_pushed_from=start,
    )


def test_echo_of_names_the_rows_and_the_events_to_mark_canonical() -> None:
    events = chain([make_event(session_id="s") for _ in range(2)])
    message = make_message(session_id="s")
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate([message, *events])]
    echo = echo_of(changes, pushed_ack(changes, start=40, first_cursor=41))
    assert echo is not None
    assert (echo.from_cursor, echo.to_cursor) == (40, 43)
    assert list(echo.events) == canonical(events)


def test_echo_of_says_nothing_unless_the_ack_vouches_for_every_row() -> None:
    events = chain([make_event(session_id="s") for _ in range(3)])
    changes = [Change(client_seq=i + 1, record=e) for i, e in enumerate(events)]
    assert echo_of(changes, pushed_ack(changes, start=None, first_cursor=5)) is None  # v4
    ack_ = pushed_ack(changes, start=4, first_cursor=5)
    assert echo_of(changes[:2], ack_) is None  # a result for a change it did not send
    at_start = pushed_ack(changes, start=5, first_cursor=5)
    assert echo_of(changes, at_start) is None  # a row at or before where the rows start
    forked = pushed_ack(changes, start=4, first_cursor=5)
    forked.results[1] = ChangeResult(client_seq=2, status="resolved", cursor=6)
    assert echo_of(changes, forked) is None
    twice = pushed_ack(changes, start=4, first_cursor=5)
    twice.results[2].cursor = 5
    assert echo_of(changes, twice) is None
    gapped = [changes[0], changes[2]]
    assert echo_of(gapped, pushed_ack(gapped, start=4, first_cursor=5)) is None
    none_applied = PushAck(
        results=[ChangeResult(client_seq=1, status="duplicate")], last_seq=3, as_pushed_from=4
    )
    assert echo_of(changes, none_applied) is None


def test_echo_lands_only_where_the_device_holds_the_pushed_events() -> None:
    held = canonical(chain([make_event(session_id="s") for _ in range(2)]))
    tail = chain([make_event(session_id="s") for _ in range(2)], held[-1].row_hash, start=3)
    pushed = canonical(tail)
    assert echo_lands(pushed, [held[-1], *tail])
    assert echo_lands(pushed[:1], [held[-1], *tail])  # the tail goes on after the push
    assert not echo_lands(pushed, [held[-1], *tail[:1]])  # one is not held
    assert not echo_lands(pushed, tail)  # the place before is not read
    assert not echo_lands(pushed, [tail[0], *tail])  # nor canonical
    assert not echo_lands(pushed, [held[-1], *pushed])  # already canonical: a page placed them
    other = chain([make_event(session_id="s")], held[-1].row_hash, start=3)
    assert not echo_lands(pushed, [held[-1], *other, tail[1]])
    first = canonical(chain([make_event(session_id="s")]))
    assert echo_lands(first, [msgspec.structs.replace(first[0], canonical=False)])
    assert not echo_lands(canonical(tail[:1]), [msgspec.structs.replace(tail[0], canonical=False)])


@settings(max_examples=300, deadline=None)
@given(
    known=st.integers(0, 3),
    theirs=st.integers(0, 2),
    tail=st.integers(1, 5),
    sent=st.integers(1, 5),
    messages=st.integers(0, 2),
)
def test_taking_an_echo_leaves_the_log_a_pull_back_would(
    known: int, theirs: int, tail: int, sent: int, messages: int
) -> None:
    """The device holds ``known`` canonical events and a provisional tail; it pushes the first
    ``sent`` of them. The server (a model of ``_Batch._event``) holds another device's
    ``theirs`` events after the known ones, unseen here, and places the pushed ones after them.
    The ack vouches for the rows exactly when nothing came between; then taking the echo
    leaves the same log as pulling the rows back and rebasing, and otherwise it is refused."""
    held = canonical(chain([make_event(session_id="s") for _ in range(known)]))
    head = (known, held[-1].row_hash) if held else (0, "")
    mine = chain([make_event(session_id="s") for _ in range(tail)], head[1], start=known + 1)
    pushed = mine[: min(sent, tail)]
    others = canonical(
        chain(
            [make_event(session_id="s", client_id="b") for _ in range(theirs)],
            head[1],
            start=known + 1,
        )
    )
    top = (others[-1].sequence_number, others[-1].row_hash) if others else head
    placed = canonical(chain(pushed, top[1], start=top[0] + 1))
    records = [make_message(session_id="s") for _ in range(messages)] + pushed
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(records)]
    as_pushed = all(
        (p.sequence_number, p.row_hash) == (q.sequence_number, q.row_hash)
        for p, q in zip(placed, pushed, strict=True)
    )
    start = 100 + theirs
    ack_ = pushed_ack(changes, start=start if as_pushed else None, first_cursor=start + 1)
    echo = echo_of(changes, ack_)
    assert (echo is not None) == as_pushed == (theirs == 0)
    if echo is None:
        return
    assert list(echo.events) == placed and echo.to_cursor == start + len(changes)
    before = held[-1:] if known else []
    assert echo_lands(list(echo.events), [*before, *mine])
    taken = {e.id: e for e in [*held, *mine]}
    taken.update((e.id, e) for e in echo.events)
    slow = rebase("s", placed, known_head=head, verified=[], tail=mine, genesis=head[1])
    pulled = {e.id: e for e in [*held, *mine]}
    pulled.update((e.id, e) for e in slow.out)
    assert taken == pulled


# -- logs_to_fold -----------------------------------------------------------------------------


@given(st.dictionaries(st.text(max_size=4), st.integers(0, 50), max_size=12), st.integers(-2, 40))
def test_a_pull_folds_the_logs_it_grew_by_the_threshold_or_more(
    grown: dict[str, int], at_least: int
) -> None:
    folded = logs_to_fold(grown, at_least)
    assert folded == sorted(folded)  # in id order: the same pull folds in the same order
    if at_least <= 0:
        assert folded == []  # folding is off
        return
    assert set(folded) == {session for session, n in grown.items() if n >= at_least}


def test_the_default_threshold_leaves_short_logs_to_their_resume() -> None:
    assert logs_to_fold({"long": FOLD_AFTER_PULL_EVENTS, "short": FOLD_AFTER_PULL_EVENTS - 1}) == [
        "long"
    ]


# -- the ids a taken row adds (``apply.new_ids``) --------------------------------------------

_IDS = st.lists(st.sampled_from([f"m-{i}" for i in range(12)]), max_size=10)


@given(known=_IDS, ids=_IDS, extend=st.booleans())
@settings(max_examples=300, deadline=None)
def test_new_ids_are_the_ids_the_known_list_lacks(
    known: list[str], ids: list[str], extend: bool
) -> None:
    """Whatever the two lists (one extending the other, as a turn appends, or not), the ids
    given are ids of the row, and every id of the row that the known list lacks is given."""
    if extend:
        ids = known + ids
    got = new_ids(ids, known)
    assert set(got) <= set(ids)
    assert set(ids) - set(known) <= set(got)
    if extend:
        assert got == ids[len(known) :]  # the tail alone, in order


def test_new_ids_of_a_list_that_is_not_an_extension() -> None:
    assert new_ids(["a", "c", "d"], ["a", "b", "c"]) == ["d"]  # a rollback, then a turn
    assert new_ids(["a"], ["a", "b"]) == []  # truncated
    assert new_ids(["a", "b", "c"], ["a", "b"]) == ["c"]
