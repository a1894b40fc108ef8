"""``runtime.cache``: a bounded LRU of immutable records read from the store.

Messages and checkpoints never change once written (a deleted session's content goes, and
the cache forgets it then), so a cached copy can never be stale: resuming a session, building
a transcript or listing messages reads the store only for what the cache lacks. The default
holds at most 1,000 entries and 64 MB (each entry's size is its encoded size);
``SessionRuntime(cache=None)`` turns it off. ``metrics_snapshot()`` says how it does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

import msgspec

__all__ = ["CacheMetrics", "RecordCache"]

V = TypeVar("V")

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class CacheMetrics(msgspec.Struct, kw_only=True):
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int

    @property
    def hit_ratio(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


class RecordCache(Generic[V]):
    """Least recently used first out, bounded by entries and by bytes."""

    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            self._misses += 1
            return None
        self._items.move_to_end(key)
        self._hits += 1
        return item[0]

    def get_many(self, keys: Iterable[str]) -> tuple[dict[str, V], list[str]]:
        """``(found, missing)``: what the cache holds of ``keys``, and the rest in order."""
        if not self._items:  # (a fresh runtime's first read of a long transcript)
            every = list(keys)
            self._misses += len(every)
            return {}, every
        found: dict[str, V] = {}
        missing: list[str] = []
        for key in keys:
            value = self.get(key)
            if value is None:
                missing.append(key)
            else:
                found[key] = value
        return found, missing

    def put(self, key: str, value: V, size: int) -> None:
        """Keep ``value`` (``size`` bytes); one larger than the whole budget is not kept."""
        self.discard(key)
        if size > self.max_bytes:
            return
        self._items[key] = (value, size)
        self._bytes += size
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped
            self._evictions += 1

    def discard(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0

    def metrics_snapshot(self) -> CacheMetrics:
        return CacheMetrics(
            entries=len(self._items),
            bytes=self._bytes,
            max_entries=self.max_entries,
            max_bytes=self.max_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )
