"""Session merge: version vectors, LWW on concurrent edits, diverged paths. No event loop."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.clock import Order, Timestamp, vv_compare
from shared.ids import uuid7
from shared.merge import diverged_paths, lww_key, resolve_conflicts
from shared.records import Session, SessionState
from tests.factories import make_session

SESSION_ID = uuid7()


def stamp(wall: int, counter: int = 0, client: str = "dev-a") -> str:
    return Timestamp(wall, counter, client).encode()


def version(
    vv: dict[str, int], *, updated_at: str | None = None, client_id: str = "dev-a", **fields: Any
) -> Session:
    at = updated_at or stamp(1000, 0, client_id)
    return make_session(id=SESSION_ID, vv=vv, updated_at=at, hlc=at, client_id=client_id, **fields)


def at_least(merged: dict[str, int], vv: dict[str, int]) -> bool:
    return vv_compare(merged, vv) in (Order.EQUAL, Order.DOMINATES)


# -- ordered versions --------------------------------------------------------------------


def test_local_dominates() -> None:
    local = version({"a": 2, "b": 1}, title="new")
    remote = version({"a": 1, "b": 1}, title="old", updated_at=stamp(9999))
    res = resolve_conflicts(local, remote)
    assert res.order is Order.DOMINATES
    assert res.winner == "local"
    assert not res.concurrent
    assert res.merged_vv == {"a": 2, "b": 1}
    assert res.conflicted_paths == []


def test_local_dominated() -> None:
    # A newer-looking stamp does not beat a dominating vector.
    local = version({"a": 1}, title="old", updated_at=stamp(9999))
    remote = version({"a": 1, "b": 3}, title="new")
    res = resolve_conflicts(local, remote)
    assert res.order is Order.DOMINATED
    assert res.winner == "remote"
    assert not res.concurrent
    assert res.merged_vv == {"a": 1, "b": 3}
    assert res.conflicted_paths == []


def test_equal_vectors_keep_remote() -> None:
    local = version({"a": 2}, title="x")
    remote = version({"a": 2}, title="x")
    res = resolve_conflicts(local, remote)
    assert res.order is Order.EQUAL
    assert res.winner == "remote"
    assert not res.concurrent
    assert res.merged_vv == {"a": 2}
    assert res.conflicted_paths == []


def test_concurrent_newer_stamp_wins() -> None:
    local = version({"a": 2, "b": 1}, title="L", updated_at=stamp(2000, 0, "dev-a"))
    remote = version(
        {"a": 1, "b": 2}, title="R", updated_at=stamp(1500, 7, "dev-b"), client_id="dev-b"
    )
    res = resolve_conflicts(local, remote)
    assert res.order is Order.CONCURRENT
    assert res.concurrent
    assert res.winner == "local"
    assert res.merged_vv == {"a": 2, "b": 2}
    assert [p.path for p in res.conflicted_paths] == ["title"]
    assert resolve_conflicts(remote, local).winner == "remote"


def test_concurrent_counter_breaks_a_wall_tie() -> None:
    local = version({"a": 1}, updated_at=stamp(2000, 3, "dev-a"))
    remote = version({"b": 1}, updated_at=stamp(2000, 4, "dev-a"), client_id="dev-b")
    assert resolve_conflicts(local, remote).winner == "remote"
    assert resolve_conflicts(remote, local).winner == "local"


def test_concurrent_client_id_breaks_a_stamp_tie() -> None:
    at = stamp(2000, 3, "dev-x")
    local = version({"a": 1}, updated_at=at, client_id="dev-a")
    remote = version({"b": 1}, updated_at=at, client_id="dev-b")
    res = resolve_conflicts(local, remote)
    assert res.winner == "remote"  # "dev-b" > "dev-a"
    assert resolve_conflicts(remote, local).winner == "local"


def test_different_session_ids_raise() -> None:
    local = version({"a": 1})
    other = msgspec.structs.replace(version({"a": 1}), id=uuid7())
    with pytest.raises(ValueError, match="same session"):
        resolve_conflicts(local, other)


# -- properties --------------------------------------------------------------------------

clients = st.sampled_from(["dev-a", "dev-b", "dev-c"])
stamps = st.builds(
    Timestamp,
    st.integers(min_value=1000, max_value=1003),
    st.integers(min_value=0, max_value=2),
    clients,
).map(Timestamp.encode)
vectors = st.dictionaries(clients, st.integers(min_value=0, max_value=3), max_size=3)


@st.composite
def session_pairs(draw: st.DrawFn) -> tuple[Session, Session]:
    sides = []
    for _ in range(2):
        at = draw(stamps)
        sides.append(
            version(
                draw(vectors),
                updated_at=at,
                client_id=draw(clients),
                title=draw(st.sampled_from(["", "t1", "t2"])),
            )
        )
    return sides[0], sides[1]


@settings(max_examples=200)
@given(session_pairs())
def test_resolution_is_deterministic_and_symmetric(pair: tuple[Session, Session]) -> None:
    a, b = pair
    ab = resolve_conflicts(a, b)
    ba = resolve_conflicts(b, a)
    assert ab == resolve_conflicts(a, b)  # pure
    assert ab.concurrent == ba.concurrent == (ab.order is Order.CONCURRENT)
    assert at_least(ab.merged_vv, a.vv)
    assert at_least(ab.merged_vv, b.vv)
    assert vv_compare(ab.merged_vv, ba.merged_vv) is Order.EQUAL
    if ab.order is Order.EQUAL:
        # Same version on both sides: each keeps the one it was sent.
        assert ab.winner == ba.winner == "remote"
        return
    if ab.concurrent:
        assume(lww_key(a) != lww_key(b))
        newer = "local" if (a.updated_at, a.client_id) > (b.updated_at, b.client_id) else "remote"
        assert ab.winner == newer
    assert (ab.winner == "local") == (ba.winner == "remote")
    # Both peers keep the same version.
    kept_ab = a if ab.winner == "local" else b
    kept_ba = b if ba.winner == "local" else a
    assert kept_ab is kept_ba


# -- diverged paths ----------------------------------------------------------------------

# For every compared path, a way to give the remote a different value.
CHANGES: dict[str, dict[str, Any]] = {
    "title": {"title": "remote title"},
    "provider": {"provider": "anthropic"},
    "model": {"model": "claude-x"},
    "tools": {"tools": ["search", "shell"]},
    "head_checkpoint_id": {"head_checkpoint_id": "cp-remote"},
    "deleted": {"deleted": True},
}
STATE_CHANGES: dict[str, Any] = {
    "state.message_ids": ["m1", "m2", "m3"],
    "state.pending_tool_calls": [{"id": "call-1", "name": "shell"}],
    "state.artifacts": ["art-1"],
    "state.jobs": [{"id": "job-1", "status": "running"}],
}
ALL_PATHS = [*CHANGES, *STATE_CHANGES]


def base_state() -> SessionState:
    return SessionState(message_ids=["m1", "m2"], pending_tool_calls=[], artifacts=[], jobs=[])


def concurrent_pair(paths: list[str]) -> tuple[Session, Session]:
    local = version(
        {"dev-a": 2, "dev-b": 1},
        updated_at=stamp(3000, 0, "dev-a"),
        title="local title",
        tools=["search"],
        head_checkpoint_id="cp-local",
        state=base_state(),
    )
    fields: dict[str, Any] = {}
    state = base_state()
    for path in paths:
        if path in CHANGES:
            fields.update(CHANGES[path])
        else:
            setattr(state, path.split(".", 1)[1], STATE_CHANGES[path])
    remote = msgspec.structs.replace(
        local,
        vv={"dev-a": 1, "dev-b": 2},
        client_id="dev-b",
        hlc=stamp(2000, 0, "dev-b"),
        updated_at=stamp(2000, 0, "dev-b"),
        created_at=stamp(1, 0, "dev-b"),  # not a compared path
        forked_from="elsewhere",  # not a compared path
        state=state,
        **fields,
    )
    return local, remote


@settings(max_examples=150)
@given(st.lists(st.sampled_from(ALL_PATHS), unique=True))
def test_conflicted_paths_are_exactly_the_diverged_fields(paths: list[str]) -> None:
    local, remote = concurrent_pair(paths)
    res = resolve_conflicts(local, remote)
    assert res.concurrent
    assert res.winner == "local"
    got = {p.path: p for p in res.conflicted_paths}
    assert set(got) == set(paths)
    for path, conflict in got.items():
        assert conflict.chosen_side == "local"
        obj_l: Any = local
        obj_r: Any = remote
        for part in path.split("."):
            obj_l, obj_r = getattr(obj_l, part), getattr(obj_r, part)
        assert conflict.local_value == msgspec.to_builtins(obj_l)
        assert conflict.remote_value == msgspec.to_builtins(obj_r)
        assert conflict.local_value != conflict.remote_value
    # The mirror reports the same paths with the sides swapped.
    mirror = resolve_conflicts(remote, local)
    assert mirror.winner == "remote"
    assert [p.path for p in mirror.conflicted_paths] == [p.path for p in res.conflicted_paths]
    for p, q in zip(res.conflicted_paths, mirror.conflicted_paths, strict=True):
        assert (p.local_value, p.remote_value) == (q.remote_value, q.local_value)
        assert q.chosen_side == "remote"


def test_conflicted_paths_example_values() -> None:
    local, remote = concurrent_pair(["title", "state.message_ids"])
    res = resolve_conflicts(local, remote)
    got = [(p.path, p.local_value, p.remote_value, p.chosen_side) for p in res.conflicted_paths]
    assert got == [
        ("title", "local title", "remote title", "local"),
        ("state.message_ids", ["m1", "m2"], ["m1", "m2", "m3"], "local"),
    ]
    # Plain data, ready for the wire.
    assert msgspec.json.decode(msgspec.json.encode(res.conflicted_paths))[0]["path"] == "title"


def test_diverged_paths_direct() -> None:
    local, remote = concurrent_pair(["model", "deleted"])
    paths = diverged_paths(local, remote, "remote")
    assert [p.path for p in paths] == ["model", "deleted"]
    assert {p.chosen_side for p in paths} == {"remote"}
    assert diverged_paths(local, local, "local") == []
