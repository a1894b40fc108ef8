"""UUIDv7 ids: layout, per-process monotonicity, embedded time. No event loop."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from shared import ids
from shared.ids import is_uuid, uuid7, uuid7_time_ms

_MAX_MS = (1 << 48) - 1
_MAX_RAND = (1 << 74) - 1


@contextmanager
def fresh_generator(last_ms: int = 0, last_rand: int = 0) -> Iterator[None]:
    """Run with the module's monotonic state set, then put the process state back."""
    saved = ids._last_ms, ids._last_rand
    ids._last_ms, ids._last_rand = last_ms, last_rand
    try:
        yield
    finally:
        ids._last_ms, ids._last_rand = saved


def _layout(ms: int, rand: int) -> str:
    """The id uuid7 builds for ``ms`` and a 74-bit random tail."""
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) << 64) | (0b10 << 62)
    value |= rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


def _int(value: str) -> int:
    return uuid.UUID(value).int


def test_version_7_and_rfc_variant() -> None:
    for _ in range(100):
        u = uuid.UUID(uuid7())
        assert u.version == 7
        assert u.variant == uuid.RFC_4122
        assert str(u) == str(u).lower()


def test_strictly_increasing_with_real_clock() -> None:
    values = [uuid7() for _ in range(2000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)
    ints = [_int(v) for v in values]
    assert all(a < b for a, b in pairwise(ints))


def test_strictly_increasing_within_one_millisecond() -> None:
    with fresh_generator():
        values = [uuid7(now_ms=1_700_000_000_000) for _ in range(1000)]
    ints = [_int(v) for v in values]
    assert all(a < b for a, b in pairwise(ints))
    assert values == sorted(values)
    assert {uuid7_time_ms(v) for v in values} == {1_700_000_000_000}


def test_strictly_increasing_when_clock_goes_backwards() -> None:
    with fresh_generator():
        first = uuid7(now_ms=1_700_000_000_500)
        later = [uuid7(now_ms=1_700_000_000_500 - step) for step in (1, 100, 500, 10_000)]
    sequence = [first, *later]
    assert sequence == sorted(sequence)
    assert len(set(sequence)) == len(sequence)
    # The id keeps the largest time seen rather than going back.
    assert all(uuid7_time_ms(v) == 1_700_000_000_500 for v in later)


def test_strictly_increasing_when_random_tail_is_exhausted() -> None:
    # The 74-bit tail is at its maximum: the next id in that millisecond must not wrap.
    with fresh_generator(last_ms=1_700_000_000_000, last_rand=_MAX_RAND):
        before = _layout(1_700_000_000_000, _MAX_RAND)
        after = uuid7(now_ms=1_700_000_000_000)
        again = uuid7(now_ms=1_700_000_000_000)
    assert uuid.UUID(after).version == 7
    assert before < after < again


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=_MAX_MS))
def test_time_round_trips(ms: int) -> None:
    with fresh_generator():
        value = uuid7(now_ms=ms)
    assert uuid7_time_ms(value) == ms
    assert uuid.UUID(value).version == 7


@settings(max_examples=100)
@given(st.lists(st.integers(min_value=0, max_value=_MAX_MS), min_size=1, max_size=50))
def test_monotonic_for_any_clock_sequence(times: list[int]) -> None:
    with fresh_generator():
        values = [uuid7(now_ms=ms) for ms in times]
    ints = [_int(v) for v in values]
    assert all(a < b for a, b in pairwise(ints))
    # Each id carries the largest time seen so far.
    running = 0
    for ms, value in zip(times, values, strict=True):
        running = max(running, ms)
        assert uuid7_time_ms(value) == running


def test_is_uuid() -> None:
    assert is_uuid(uuid7())
    assert is_uuid(str(uuid.uuid4()))
    assert is_uuid("00000000-0000-0000-0000-000000000000")
    for bad in ("", "nope", "0000", "00000000-0000-0000-0000-00000000000g", "x" * 36):
        assert not is_uuid(bad)
    assert not is_uuid(None)  # type: ignore[arg-type]
    assert not is_uuid(42)  # type: ignore[arg-type]


def test_neighbours_made_in_one_millisecond_are_not_predictable() -> None:
    """Ids of one millisecond differ by random steps, not by one: seeing one id does not
    give the next (which someone could otherwise push first under another account)."""
    ids = [uuid.UUID(uuid7(now_ms=1_800_000_000_000)).int for _ in range(200)]
    steps = [b - a for a, b in pairwise(ids)]
    assert all(step > 0 for step in steps)
    assert len(set(steps)) > 190  # random steps, almost never equal
    assert min(steps) > 1 or steps.count(1) < 2


@given(st.integers(min_value=0, max_value=(1 << 128) - 1))
def test_the_text_of_any_128_bit_value_is_the_uuid_modules(value: int) -> None:
    assert ids._text(value) == str(uuid.UUID(int=value))
