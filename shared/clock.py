"""Hybrid logical clocks and version vectors.

An HLC timestamp is ``(wall_ms, counter, client_id)``. Its string form sorts the same way the
tuple does, so stores can compare ``updated_at`` values as plain strings. A clock never goes
backwards, even when the wall clock does: it keeps the largest wall time it has seen and bumps
the counter instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from .errors import ClockSkew, InvalidRecord

_WALL_DIGITS = 13
_COUNTER_DIGITS = 6
_MAX_COUNTER = 10**_COUNTER_DIGITS - 1


@dataclass(frozen=True, order=True, slots=True)
class Timestamp:
    wall_ms: int
    counter: int
    client_id: str

    def encode(self) -> str:
        return (
            f"{self.wall_ms:0{_WALL_DIGITS}d}-{self.counter:0{_COUNTER_DIGITS}d}-{self.client_id}"
        )

    @classmethod
    def decode(cls, value: str) -> Timestamp:
        """Parse an encoded stamp; raises ``InvalidRecord`` when it is malformed.

        Stamps parsed lately are kept (at most ``_DECODED_LIMIT``, then all are dropped): a
        server checks each pushed stamp, then observes it, a stamp apart in the same push."""
        if type(value) is str and cls is Timestamp:
            known = _DECODED.get(value)
            if known is not None:
                return known
            stamp = cls._parse(value)
            if len(_DECODED) >= _DECODED_LIMIT:
                _DECODED.clear()
            _DECODED[value] = stamp
            return stamp
        return cls._parse(value)

    @classmethod
    def _parse(cls, value: str) -> Timestamp:
        try:
            wall, counter, client_id = value.split("-", 2)
            if len(wall) != _WALL_DIGITS or len(counter) != _COUNTER_DIGITS:
                raise ValueError(value)
            # ASCII digits only: int() also takes "+", spaces, "_" and non-ASCII digits, whose
            # strings would not sort like their tuples.
            if not (wall.isascii() and wall.isdigit() and counter.isascii() and counter.isdigit()):
                raise ValueError(value)
            return cls(int(wall), int(counter), client_id)
        except (ValueError, AttributeError) as exc:
            raise InvalidRecord(f"malformed HLC timestamp: {value!r}") from exc


_DECODED_LIMIT = 4096
_DECODED: dict[str, Timestamp] = {}
"""Stamps parsed lately (``Timestamp.decode``); each is immutable, so it may be shared."""


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class HybridClock:
    """A hybrid logical clock for one node (a device or a server).

    Call ``now()`` for every local write and ``observe(stamp)`` for every stamp received.
    """

    def __init__(
        self,
        client_id: str,
        *,
        last: str | None = None,
        wall: Callable[[], int] = wall_clock_ms,
        max_skew_ms: int | None = None,
    ) -> None:
        self.client_id = client_id
        self._wall = wall
        self.max_skew_ms = max_skew_ms
        if last is not None:
            ts = Timestamp.decode(last)
            self._wall_ms, self._counter = ts.wall_ms, ts.counter
        else:
            self._wall_ms, self._counter = 0, 0

    @property
    def wall(self) -> Callable[[], int]:
        """The wall clock under this HLC (milliseconds since the epoch)."""
        return self._wall

    @property
    def last(self) -> str:
        return Timestamp(self._wall_ms, self._counter, self.client_id).encode()

    def now(self) -> str:
        """A new stamp, greater than every stamp this clock has issued or observed."""
        wall = self._wall()
        if wall > self._wall_ms:
            self._wall_ms, self._counter = wall, 0
        else:
            self._bump()
        return self.last

    def observe(self, stamp: str) -> str:
        """Advance past a received stamp; raises ``ClockSkew`` if it is too far ahead.

        Returns a fresh local stamp that sorts after ``stamp``.
        """
        self.advance(stamp)
        return self.last

    def advance(self, stamp: str) -> None:
        """``observe`` without making the fresh stamp: for a caller that does not use it (a
        server observes every record it is sent, and formatting a stamp costs more than the
        rest of the step)."""
        remote = Timestamp.decode(stamp)
        wall = self._wall()
        if self.max_skew_ms is not None and remote.wall_ms - wall > self.max_skew_ms:
            raise ClockSkew(
                f"timestamp is {remote.wall_ms - wall} ms in the future "
                f"(more than {self.max_skew_ms} ms)"
            )
        top = max(wall, self._wall_ms, remote.wall_ms)
        if top == self._wall_ms == remote.wall_ms:
            self._counter = max(self._counter, remote.counter)
            self._bump()
        elif top == self._wall_ms:
            self._bump()
        elif top == remote.wall_ms:
            self._wall_ms, self._counter = top, remote.counter
            self._bump()
        else:
            self._wall_ms, self._counter = top, 0

    def _bump(self) -> None:
        if self._counter >= _MAX_COUNTER:
            # Counter exhausted within one millisecond: borrow the next millisecond.
            self._wall_ms += 1
            self._counter = 0
        else:
            self._counter += 1


class Order(StrEnum):
    EQUAL = "equal"
    DOMINATES = "dominates"
    DOMINATED = "dominated"
    CONCURRENT = "concurrent"


VersionVector = dict[str, int]


def vv_bump(vv: Mapping[str, int], client_id: str) -> VersionVector:
    """A copy of ``vv`` with ``client_id``'s entry incremented."""
    out = dict(vv)
    out[client_id] = out.get(client_id, 0) + 1
    return out


def vv_merge(a: Mapping[str, int], b: Mapping[str, int]) -> VersionVector:
    """Pointwise maximum: the smallest vector that is at least both."""
    out = dict(a)
    for key, value in b.items():
        if value > out.get(key, 0):
            out[key] = value
    return out


def vv_compare(a: Mapping[str, int], b: Mapping[str, int]) -> Order:
    """How ``a`` relates to ``b``."""
    a_ahead = b_ahead = False
    for key in a.keys() | b.keys():
        x, y = a.get(key, 0), b.get(key, 0)
        if x > y:
            a_ahead = True
        elif y > x:
            b_ahead = True
    if a_ahead and b_ahead:
        return Order.CONCURRENT
    if a_ahead:
        return Order.DOMINATES
    if b_ahead:
        return Order.DOMINATED
    return Order.EQUAL


MAX_VV_ENTRY = 2**53
"""The largest counter a version vector may hold (a peer's huge one would overflow the next
bump and block every write of that session)."""
MAX_VV_ENTRIES = 4096
"""The most devices a session's version vector may name."""


def vector_problem(vv: dict[str, int]) -> str | None:
    """Why ``vv`` is not a version vector this code accepts from a peer, or None."""
    if len(vv) > MAX_VV_ENTRIES:
        return f"version vector names {len(vv)} devices, more than {MAX_VV_ENTRIES}"
    for key, count in vv.items():
        if not key or len(key) > 256:
            return "version vector keys must be device ids of 1 to 256 characters"
        if not 0 <= count <= MAX_VV_ENTRY:
            return f"version vector entries must be between 0 and {MAX_VV_ENTRY}"
    return None
