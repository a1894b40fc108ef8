"""``runtime.cache``'s LRU: bounded by entries and bytes, checked against a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.cache import RecordCache

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "discard"]),
        st.integers(0, 12),
        st.integers(1, 40),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 6), st.integers(1, 100))
def test_the_cache_behaves_as_an_lru_within_both_bounds(
    steps: list[tuple[str, int, int]], max_entries: int, max_bytes: int
) -> None:
    cache: RecordCache[str] = RecordCache(max_entries, max_bytes)
    model: list[tuple[str, int]] = []  # (key, size), least recently used first
    for op, k, size in steps:
        key = f"k{k}"
        if op == "put":
            model = [(x, s) for x, s in model if x != key]
            if size <= max_bytes:
                model.append((key, size))
                while len(model) > max_entries or sum(s for _, s in model) > max_bytes:
                    model.pop(0)
            cache.put(key, f"v{key}", size)
        elif op == "get":
            hit = any(x == key for x, _ in model)
            assert cache.get(key) == (f"v{key}" if hit else None)
            if hit:
                model = [(x, s) for x, s in model if x != key] + [
                    (x, s) for x, s in model if x == key
                ]
        else:
            model = [(x, s) for x, s in model if x != key]
            cache.discard(key)
        metrics = cache.metrics_snapshot()
        assert metrics.entries == len(model) <= max_entries
        assert metrics.bytes == sum(s for _, s in model) <= max_bytes


def test_metrics_count_hits_misses_and_evictions() -> None:
    cache: RecordCache[int] = RecordCache(max_entries=2, max_bytes=1000)
    cache.put("a", 1, 10)
    cache.put("b", 2, 10)
    assert cache.get("a") == 1
    cache.put("c", 3, 10)  # evicts b, the least recently used
    found, missing = cache.get_many(["a", "b", "c"])
    assert found == {"a": 1, "c": 3} and missing == ["b"]
    m = cache.metrics_snapshot()
    assert (m.hits, m.misses, m.evictions, m.entries, m.bytes) == (3, 1, 1, 2, 20)
    assert m.hit_ratio == 0.75
    cache.put("huge", 4, 5000)  # over the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
