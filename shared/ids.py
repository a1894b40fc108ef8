"""UUIDv7 identifiers (RFC 9562): time-ordered, so ids sort by creation time.

Within one millisecond the tail grows by a random step of up to 48 bits (RFC 9562's
"monotonic random" method), not by one: knowing an id does not tell its neighbours, so a
record id cannot be guessed (and claimed first) by someone who saw another.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_last_rand = 0


def uuid7(now_ms: int | None = None) -> str:
    """Return a new UUIDv7 as a string; ids made in one process are strictly increasing."""
    global _last_ms, _last_rand
    with _lock:
        ms = int(time.time() * 1000) if now_ms is None else now_ms
        if ms <= _last_ms:
            # Same (or earlier) millisecond: keep order by a random step up the tail.
            ms = _last_ms
            rand = _last_rand + 1 + int.from_bytes(os.urandom(6), "big")
            if rand >> 74:
                # Tail exhausted: borrow the next millisecond rather than wrap to a smaller id.
                ms, rand = ms + 1, int.from_bytes(os.urandom(10), "big") >> 6
        else:
            rand = int.from_bytes(os.urandom(10), "big") >> 6  # 74 random bits
        _last_ms, _last_rand = ms, rand
    rand_a = (rand >> 62) & 0xFFF
    rand_b = rand & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= rand_a << 64
    value |= 0b10 << 62
    value |= rand_b
    return _text(value)


def _text(value: int) -> str:
    """The canonical text of the 128-bit ``value`` (``str(uuid.UUID(int=value))``, in a
    third of its time: a turn makes about ten ids)."""
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def uuid7_time_ms(value: str) -> int:
    """The millisecond timestamp inside a UUIDv7."""
    return uuid.UUID(value).int >> 80


def is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        return False
    return True
