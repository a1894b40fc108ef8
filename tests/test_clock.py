"""Hybrid logical clocks and version vectors. No event loop."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.clock import HybridClock, Order, Timestamp, vv_bump, vv_compare, vv_merge
from shared.errors import ClockSkew, InvalidRecord

MAX_WALL = 10**13 - 1
MAX_COUNTER = 10**6 - 1

walls = st.integers(min_value=0, max_value=MAX_WALL)
counters = st.integers(min_value=0, max_value=MAX_COUNTER)
client_ids = st.text(min_size=1, max_size=12)
timestamps = st.builds(Timestamp, walls, counters, client_ids)


class FakeWall:
    """An injected wall clock the test moves by hand."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def ts(value: str) -> Timestamp:
    return Timestamp.decode(value)


# -- Timestamp ---------------------------------------------------------------------------


def test_encode_layout() -> None:
    assert Timestamp(1_700_000_000_000, 7, "dev-a").encode() == "1700000000000-000007-dev-a"
    assert Timestamp(0, 0, "x").encode() == "0000000000000-000000-x"


@settings(max_examples=200)
@given(timestamps)
def test_encode_decode_round_trip(stamp: Timestamp) -> None:
    assert Timestamp.decode(stamp.encode()) == stamp


@settings(max_examples=200)
@given(timestamps, timestamps)
def test_string_order_is_tuple_order(a: Timestamp, b: Timestamp) -> None:
    assert (a.encode() < b.encode()) == (a < b)
    assert (a.encode() == b.encode()) == (a == b)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "nonsense",
        "1700000000000",
        "1700000000000-000001",
        "170000000000-000001-a",  # 12 wall digits
        "17000000000000-000001-a",  # 14 wall digits
        "1700000000000-00001-a",  # 5 counter digits
        "1700000000000-0000001-a",  # 7 counter digits
        "17000000000x0-000001-a",
        "1700000000000-00000x-a",
        "-700000000000-000001-a",
        # Not in canonical form, so its string would not sort like its tuple:
        "+700000000000-000001-a",
        " 700000000000-000001-a",
        "1_00000000000-000001-a",
        "1700000000000-+00001-a",
        "\u0661\u0667\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660"
        "-000001-a",  # Arabic-Indic digits: int() reads them, but they sort after "9"
    ],
)
def test_malformed_stamp_raises_invalid_record(bad: str) -> None:
    with pytest.raises(InvalidRecord):
        Timestamp.decode(bad)


def test_decode_of_non_string_raises_invalid_record() -> None:
    with pytest.raises(InvalidRecord):
        Timestamp.decode(None)  # type: ignore[arg-type]


# -- HybridClock -------------------------------------------------------------------------


def test_now_follows_an_advancing_wall() -> None:
    wall = FakeWall(1000)
    clock = HybridClock("a", wall=wall)
    assert ts(clock.now()) == Timestamp(1000, 0, "a")
    wall.ms = 1005
    assert ts(clock.now()) == Timestamp(1005, 0, "a")


def test_now_strictly_increases_when_wall_stands_still() -> None:
    clock = HybridClock("a", wall=FakeWall(1000))
    stamps = [clock.now() for _ in range(500)]
    assert all(x < y for x, y in pairwise(stamps))
    assert [ts(s).counter for s in stamps] == list(range(500))
    assert clock.last == stamps[-1]


def test_now_strictly_increases_when_wall_steps_back() -> None:
    wall = FakeWall(5000)
    clock = HybridClock("a", wall=wall)
    stamps = [clock.now()]
    for back in (4999, 1000, 0, 4000, 5000):
        wall.ms = back
        stamps.append(clock.now())
    assert all(x < y for x, y in pairwise(stamps))
    assert all(ts(s).wall_ms == 5000 for s in stamps)
    wall.ms = 5001
    assert ts(clock.now()) == Timestamp(5001, 0, "a")


@settings(max_examples=150)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=60))
def test_now_monotonic_for_any_wall_sequence(walls_seen: list[int]) -> None:
    wall = FakeWall(0)
    clock = HybridClock("a", wall=wall)
    stamps = []
    for ms in walls_seen:
        wall.ms = ms
        stamps.append(clock.now())
        assert ts(stamps[-1]).wall_ms >= ms
    assert all(x < y for x, y in pairwise(stamps))


@settings(max_examples=200)
@given(
    st.integers(min_value=0, max_value=10**9),
    st.lists(st.integers(min_value=0, max_value=10**9), max_size=5),
    st.builds(Timestamp, st.integers(min_value=0, max_value=10**9), counters, client_ids),
)
def test_observe_yields_a_stamp_after_the_remote(
    start: int, local_walls: list[int], remote: Timestamp
) -> None:
    wall = FakeWall(start)
    clock = HybridClock("local", wall=wall)
    issued = []
    for ms in local_walls:
        wall.ms = ms
        issued.append(clock.now())
    out = clock.observe(remote.encode())
    assert ts(out) > remote
    assert out > remote.encode()
    assert all(out > s for s in issued)
    assert clock.last == out
    # Whatever the wall does next, later stamps stay after the observed one.
    wall.ms = 0
    assert clock.now() > out


@settings(max_examples=200)
@given(
    st.lists(st.integers(min_value=0, max_value=10**9), max_size=5),
    st.lists(st.builds(Timestamp, st.integers(min_value=0, max_value=10**9), counters, client_ids)),
)
def test_advance_moves_the_clock_as_observe_does(
    local_walls: list[int], remotes: list[Timestamp]
) -> None:
    """``advance`` is ``observe`` without the returned stamp: two clocks fed the same stamps,
    one each way, stay equal, and each next stamp is after every stamp either saw."""
    wall = FakeWall(0)
    a, b = HybridClock("local", wall=wall), HybridClock("local", wall=wall)
    for ms in local_walls:
        wall.ms = ms
        assert a.now() == b.now()
    for remote in remotes:
        out = a.observe(remote.encode())
        assert b.advance(remote.encode()) is None
        assert b.last == a.last == out
        assert ts(b.last) > remote
    assert a.now() == b.now()


def test_observe_takes_remote_counter_on_the_same_millisecond() -> None:
    clock = HybridClock("b", wall=FakeWall(1000))
    out = clock.observe(Timestamp(2000, 41, "a").encode())
    assert ts(out) == Timestamp(2000, 42, "b")
    clock2 = HybridClock("b", wall=FakeWall(2000))
    assert clock2.now() == Timestamp(2000, 0, "b").encode()
    assert ts(clock2.observe(Timestamp(2000, 9, "a").encode())) == Timestamp(2000, 10, "b")


def test_observe_of_an_old_stamp_still_advances() -> None:
    clock = HybridClock("b", wall=FakeWall(5000))
    first = clock.now()
    out = clock.observe(Timestamp(10, 3, "zzz").encode())
    assert out > first
    assert ts(out) == Timestamp(5000, 1, "b")


def test_observe_malformed_raises_invalid_record() -> None:
    clock = HybridClock("b", wall=FakeWall(5000))
    before = clock.last
    with pytest.raises(InvalidRecord):
        clock.observe("garbage")
    assert clock.last == before


def test_max_skew_refuses_far_future_and_accepts_within() -> None:
    wall = FakeWall(1_000_000)
    clock = HybridClock("srv", wall=wall, max_skew_ms=60_000)
    before = clock.now()
    with pytest.raises(ClockSkew) as info:
        clock.observe(Timestamp(1_000_000 + 60_001, 0, "dev").encode())
    assert info.value.code == 3011
    assert clock.last == before  # a refused stamp does not move the clock
    exactly = Timestamp(1_000_000 + 60_000, 5, "dev")
    out = clock.observe(exactly.encode())
    assert ts(out) > exactly
    assert clock.observe(Timestamp(1_000_000 + 10, 0, "dev").encode()) > out


def test_no_skew_limit_accepts_anything() -> None:
    clock = HybridClock("srv", wall=FakeWall(0))
    far = Timestamp(MAX_WALL - 10, 0, "dev")
    assert ts(clock.observe(far.encode())) > far


def test_counter_overflow_borrows_the_next_millisecond() -> None:
    wall = FakeWall(1000)
    clock = HybridClock("a", last=Timestamp(1000, MAX_COUNTER - 1, "a").encode(), wall=wall)
    assert ts(clock.now()) == Timestamp(1000, MAX_COUNTER, "a")
    borrowed = clock.now()
    assert ts(borrowed) == Timestamp(1001, 0, "a")
    # The wall catching up to the borrowed millisecond must not repeat it.
    wall.ms = 1001
    assert clock.now() > borrowed


def test_observe_overflow_borrows_the_next_millisecond() -> None:
    clock = HybridClock("b", wall=FakeWall(1000))
    remote = Timestamp(1000, MAX_COUNTER, "a")
    out = clock.observe(remote.encode())
    assert ts(out) == Timestamp(1001, 0, "b")
    assert ts(out) > remote


def test_restoring_from_last_continues_monotonically() -> None:
    wall = FakeWall(9000)
    first = HybridClock("a", wall=wall)
    stamps = [first.now() for _ in range(3)]
    # The process restarts with its wall clock set back an hour.
    wall.ms = 9000 - 3_600_000
    restored = HybridClock("a", last=first.last, wall=wall)
    assert restored.last == first.last
    stamps += [restored.now() for _ in range(3)]
    assert all(x < y for x, y in pairwise(stamps))


def test_restoring_from_malformed_last_raises() -> None:
    with pytest.raises(InvalidRecord):
        HybridClock("a", last="not-a-stamp")


# -- version vectors ---------------------------------------------------------------------

vv_keys = st.sampled_from(["a", "b", "c", "d", "e"])
vectors = st.dictionaries(vv_keys, st.integers(min_value=0, max_value=6), max_size=5)


def norm(vv: dict[str, int]) -> dict[str, int]:
    """A vector without its zero entries: a missing entry means zero."""
    return {k: v for k, v in vv.items() if v}


def test_bump() -> None:
    vv = {"a": 2}
    assert vv_bump(vv, "a") == {"a": 3}
    assert vv_bump(vv, "b") == {"a": 2, "b": 1}
    assert vv == {"a": 2}  # a copy, not in place
    assert vv_compare(vv_bump(vv, "b"), vv) is Order.DOMINATES


@settings(max_examples=200)
@given(vectors, vv_keys)
def test_bump_dominates(vv: dict[str, int], key: str) -> None:
    bumped = vv_bump(vv, key)
    assert vv_compare(bumped, vv) is Order.DOMINATES
    assert bumped[key] == vv.get(key, 0) + 1


def test_merge_is_pointwise_max() -> None:
    assert vv_merge({"a": 3, "b": 1}, {"b": 4, "c": 2}) == {"a": 3, "b": 4, "c": 2}
    assert vv_merge({}, {}) == {}


@settings(max_examples=200)
@given(vectors, vectors)
def test_merge_pointwise_max_and_commutative(a: dict[str, int], b: dict[str, int]) -> None:
    merged = vv_merge(a, b)
    for key in a.keys() | b.keys():
        assert merged.get(key, 0) == max(a.get(key, 0), b.get(key, 0))
    assert norm(merged) == norm(vv_merge(b, a))
    assert vv_compare(merged, vv_merge(b, a)) is Order.EQUAL
    assert vv_compare(merged, a) in (Order.EQUAL, Order.DOMINATES)
    assert vv_compare(merged, b) in (Order.EQUAL, Order.DOMINATES)


@settings(max_examples=200)
@given(vectors, vectors, vectors)
def test_merge_associative(a: dict[str, int], b: dict[str, int], c: dict[str, int]) -> None:
    assert norm(vv_merge(vv_merge(a, b), c)) == norm(vv_merge(a, vv_merge(b, c)))


@settings(max_examples=200)
@given(vectors)
def test_merge_idempotent(a: dict[str, int]) -> None:
    assert vv_merge(a, a) == a
    assert norm(vv_merge(a, {})) == norm(a)


@pytest.mark.parametrize(
    ("a", "b", "order"),
    [
        ({}, {}, Order.EQUAL),
        ({"a": 1}, {"a": 1}, Order.EQUAL),
        ({"a": 1, "b": 0}, {"a": 1}, Order.EQUAL),
        ({"a": 2}, {"a": 1}, Order.DOMINATES),
        ({"a": 1, "b": 1}, {"a": 1}, Order.DOMINATES),
        ({"a": 1}, {}, Order.DOMINATES),
        ({"a": 1}, {"a": 2}, Order.DOMINATED),
        ({}, {"b": 1}, Order.DOMINATED),
        ({"a": 2, "b": 1}, {"a": 1, "b": 2}, Order.CONCURRENT),
        ({"a": 1}, {"b": 1}, Order.CONCURRENT),
    ],
)
def test_compare_cases(a: dict[str, int], b: dict[str, int], order: Order) -> None:
    assert vv_compare(a, b) is order


MIRROR = {
    Order.EQUAL: Order.EQUAL,
    Order.DOMINATES: Order.DOMINATED,
    Order.DOMINATED: Order.DOMINATES,
    Order.CONCURRENT: Order.CONCURRENT,
}


@settings(max_examples=200)
@given(vectors, vectors)
def test_compare_is_mirrored_and_matches_pointwise(a: dict[str, int], b: dict[str, int]) -> None:
    order = vv_compare(a, b)
    assert vv_compare(b, a) is MIRROR[order]
    keys = a.keys() | b.keys()
    ge = all(a.get(k, 0) >= b.get(k, 0) for k in keys)
    le = all(a.get(k, 0) <= b.get(k, 0) for k in keys)
    expected = {
        (True, True): Order.EQUAL,
        (True, False): Order.DOMINATES,
        (False, True): Order.DOMINATED,
        (False, False): Order.CONCURRENT,
    }[(ge, le)]
    assert order is expected


def test_decoded_stamps_are_kept_within_a_bound_and_read_the_same() -> None:
    from shared import clock

    stamps = [Timestamp(1_700_000_000_000 + i, i % 1000, "dev").encode() for i in range(5000)]
    first = [Timestamp.decode(s) for s in stamps]
    assert len(clock._DECODED) <= clock._DECODED_LIMIT
    assert [Timestamp.decode(s) for s in stamps] == first  # kept or parsed again: the same
    assert all(t.encode() == s for t, s in zip(first, stamps, strict=True))
    with pytest.raises(InvalidRecord):
        Timestamp.decode(stamps[-1][:-4] + "+" + stamps[-1][-3:])  # never kept when malformed
