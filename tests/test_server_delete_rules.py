"""The store-independent delete rules of ``pleach_server.store.apply``, with no database."""

from __future__ import annotations

import msgspec

from pleach_server.store.apply import (
    batch_keys,
    content_to_delete,
    validate_record,
)
from shared.clock import Order, vv_compare
from shared.merge import kept_beside_delete
from shared.records import Record, Session, SessionState
from tests.server_factories import Device, new_tenant


def test_content_to_delete_spares_what_live_sessions_refer_to() -> None:
    dev = Device(new_tenant())
    gone, live = dev.session(), dev.session()
    shared_m, own_m = dev.message(gone.id), dev.message(gone.id)
    shared_doc, own_doc = dev.artifact(gone.id), dev.artifact(gone.id)
    cp = dev.checkpoint(gone.id)
    gone = msgspec.structs.replace(gone, deleted=True, state=SessionState())
    live = msgspec.structs.replace(
        live, state=SessionState(message_ids=[shared_m.id], artifacts=[shared_doc.artifact_id])
    )
    live_content: list[Record] = [dev.message(live.id), dev.checkpoint(live.id)]
    metadata: list[Record] = [dev.event(gone.id), dev.audit(gone.id)]
    candidates = [shared_m, own_m, shared_doc, own_doc, cp, *live_content, *metadata]

    doomed = content_to_delete([gone, live], candidates)
    assert doomed == [
        ("Message", own_m.id),
        ("ArtifactUpdate", own_doc.id),
        ("Checkpoint", cp.id),
    ]
    # Once the referring session is deleted too, the shared content goes.
    live_gone = msgspec.structs.replace(live, deleted=True)
    assert {i for _, i in content_to_delete([gone, live_gone], candidates)} == {
        shared_m.id,
        own_m.id,
        shared_doc.id,
        own_doc.id,
        cp.id,
        *(r.id for r in live_content),
    }
    assert content_to_delete([], candidates) == []


def test_a_live_conflict_fork_spares_all_of_its_deleted_origins_content() -> None:
    """A conflict fork shares its origin's content by id, and a device may still send a
    version of the fork naming any of it (written before it learned that a resolve gave the
    fork copies of its own): while the fork lives, none of the origin's content goes. A
    user's fork (which holds copies) spares only what it names."""
    dev = Device(new_tenant())
    gone = msgspec.structs.replace(dev.session(), deleted=True, state=SessionState())
    own = [dev.message(gone.id), dev.message(gone.id)]
    update, cp = dev.artifact(gone.id), dev.checkpoint(gone.id)
    candidates: list[Record] = [*own, update, cp]
    conflict_fork = msgspec.structs.replace(
        dev.session(), forked_from=gone.id, conflict_id="c", state=SessionState()
    )
    user_fork = msgspec.structs.replace(dev.session(), forked_from=gone.id, state=SessionState())
    assert content_to_delete([gone, conflict_fork], candidates) == []
    assert {i for _, i in content_to_delete([gone, user_fork], candidates)} == {
        r.id for r in candidates
    }
    # A session the server kept beside the delete shares it the same way.
    kept = msgspec.structs.replace(
        dev.session(), forked_from=gone.id, state=SessionState(kept_from=gone.id)
    )
    assert content_to_delete([gone, kept], candidates) == []
    kept_gone = msgspec.structs.replace(kept, deleted=True)
    assert len(content_to_delete([gone, kept_gone], candidates)) == len(candidates)
    # Once the conflict fork is deleted too, the origin's content goes with the next sweep.
    both_gone = msgspec.structs.replace(conflict_fork, deleted=True)
    assert {i for _, i in content_to_delete([gone, both_gone], candidates)} == {
        r.id for r in candidates
    }


def test_a_live_fork_spares_every_deleted_session_up_its_line() -> None:
    """A conflict fork of a conflict fork, or a kept session of a kept one, may name content
    filed under any deleted session up its line: all of it stays while the last one lives,
    and goes with the next sweep once it is deleted. A live session in the line stops the
    walk (its own content is not swept), and a line that loops ends."""
    dev = Device(new_tenant())

    def session(**fields: object) -> Session:
        return msgspec.structs.replace(dev.session(), **{"state": SessionState(), **fields})

    root = session(deleted=True)
    middle = session(deleted=True, forked_from=root.id, conflict_id="c1")
    leaf = session(forked_from=middle.id, conflict_id="c2")
    kept_gone = session(deleted=True, forked_from=middle.id)
    kept_again = session(forked_from=kept_gone.id, state=SessionState(kept_from=kept_gone.id))
    other = session(deleted=True)
    beside = dev.message(kept_gone.id)
    own = dev.message(other.id)
    candidates: list[Record] = [dev.message(root.id), dev.message(middle.id), beside, own]
    line = [root, middle, kept_gone, other]
    # The conflict fork's line is middle and root; kept_gone is beside it, not up it.
    doomed = content_to_delete([*line, leaf], candidates)
    assert sorted(doomed) == sorted([("Message", beside.id), ("Message", own.id)])
    # The kept session's line: kept_gone, then middle, then root.
    assert content_to_delete([*line, kept_again], candidates) == [("Message", own.id)]
    leaf_gone = msgspec.structs.replace(leaf, deleted=True)
    assert len(content_to_delete([*line, leaf_gone], candidates)) == len(candidates)
    # A loop in the line (a hostile peer's forked_from) ends.
    a = session(deleted=True, forked_from="b", id="a")
    b = session(deleted=True, forked_from="a", id="b")
    fork = session(forked_from="a", conflict_id="c3")
    looped: list[Record] = [dev.message("a"), dev.message("b")]
    assert content_to_delete([a, b, fork], looped) == []


def test_content_to_delete_spares_the_checkpoint_lineage_of_a_live_head() -> None:
    dev = Device(new_tenant())
    gone, fork = dev.session(), dev.session()
    root = dev.checkpoint(gone.id)
    mid = dev.checkpoint(gone.id, parent_id=root.id)
    after = dev.checkpoint(gone.id, parent_id=mid.id)  # the origin went on after the fork
    gone = msgspec.structs.replace(gone, deleted=True)
    # A conflict fork keeps the loser's head: a checkpoint filed under the origin.
    fork = msgspec.structs.replace(fork, head_checkpoint_id=mid.id, forked_from=gone.id)
    doomed = content_to_delete([gone, fork], [root, mid, after])
    assert doomed == [("Checkpoint", after.id)]
    fork_gone = msgspec.structs.replace(fork, deleted=True)
    assert len(content_to_delete([gone, fork_gone], [root, mid, after])) == 3


def test_batch_keys_load_the_session_of_content_to_see_if_it_is_deleted() -> None:
    dev = Device(new_tenant())
    session = dev.session()
    event, audit = dev.event(session.id), dev.audit(session.id)
    message, artifact = dev.message("s-1"), dev.artifact("s-2")
    keys = batch_keys(
        dev.changes(session, message, artifact, event, audit), 0, dev.tenant, dev.client_id
    )
    assert keys.sessions == {session.id, "s-1", "s-2"}  # not the sessions of metadata alone
    assert keys.records == {
        ("Message", message.id),
        ("ArtifactUpdate", artifact.id),
        ("AuditRow", audit.id),
    }
    assert keys.events == {event.id} and keys.chains == {session.id}
    assert keys.session_owners == {session.id, "s-1", "s-2"}


def test_batch_keys_keep_the_verdict_of_every_change_they_read_for() -> None:
    """``validate_record`` runs once a pushed change: ``batch_keys`` keeps each verdict for
    the rules, for exactly the changes processed (after ``last_seq``, before a gap)."""
    dev = Device(new_tenant())
    session = dev.session()
    good = dev.message(session.id)
    foreign = msgspec.structs.replace(dev.message(session.id), org_id="someone-else")
    late = dev.message(session.id)
    changes = dev.changes(session, good, foreign, late)
    seqs = [c.client_seq for c in changes]
    gapped = [*changes[:3], msgspec.structs.replace(changes[3], client_seq=seqs[3] + 1)]
    keys = batch_keys(gapped, seqs[0], dev.tenant, dev.client_id)  # the first is held
    assert set(keys.verdicts) == {seqs[1], seqs[2]}  # not the held one, none after the gap
    assert keys.verdicts[seqs[1]] is None
    assert validate_record(foreign, dev.tenant, dev.client_id) is not None
    assert type(keys.verdicts[seqs[2]]) is type(validate_record(foreign, dev.tenant, dev.client_id))


def _marked(session: Session, mark: dict[str, int]) -> Session:
    return msgspec.structs.replace(
        session, state=msgspec.structs.replace(session.state, resolved=mark)
    )


def test_a_resolved_version_is_kept_only_beside_a_delete_that_never_saw_the_resolve() -> None:
    """Histories of one session on a resolving device and a deleting one, built step by step;
    what each tombstone saw is known from how it was built, not from the rule."""
    resolver, deleter = Device(new_tenant()), Device(new_tenant())
    base = resolver.session()
    seen_by_both = deleter.edit(base)
    for start in (base, seen_by_both):
        before = resolver.edit(start)  # an unmarked edit ahead of the resolve
        mark = {resolver.client_id: before.vv[resolver.client_id]}
        resolve = _marked(resolver.edit(before), mark)
        after = resolver.edit(resolve)  # a later turn: the mark stays
        lives = {"before": before, "resolve": resolve, "after": after}
        tombstones = {
            # (what the deleting device had seen, its tombstone)
            "start": msgspec.structs.replace(deleter.edit(start), deleted=True),
            "before": msgspec.structs.replace(deleter.edit(before), deleted=True),
            "resolve": msgspec.structs.replace(deleter.edit(resolve), deleted=True),
            "after": msgspec.structs.replace(deleter.edit(after), deleted=True),
        }
        for seen, tomb in tombstones.items():
            for name, live in lives.items():
                kept = kept_beside_delete(live, tomb)
                saw_resolve = seen in ("resolve", "after")
                marked = name != "before"
                assert kept == (marked and not saw_resolve), (seen, name)
                # A version built on the delete (a revival) is never kept.
                revival = msgspec.structs.replace(resolver.edit(tomb), deleted=False)
                assert not kept_beside_delete(_marked(revival, mark), tomb)
                assert not kept_beside_delete(tomb, live)  # a live row is never the tombstone
    # Unmarked versions are never kept: delete wins over a concurrent edit, as before.
    plain = resolver.edit(base)
    tomb = msgspec.structs.replace(deleter.edit(base), deleted=True)
    assert vv_compare(plain.vv, tomb.vv) is Order.CONCURRENT
    assert not kept_beside_delete(plain, tomb)
    assert kept_beside_delete(
        _marked(plain, {resolver.client_id: base.vv[resolver.client_id]}), tomb
    )
