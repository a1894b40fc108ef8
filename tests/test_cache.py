"""``runtime.cache``'s LRU: bounded by entries and bytes, checked against a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.cache import RecordCache
from shared.records import Message

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
    empty: RecordCache[int] = RecordCache()
    assert empty.get_many(iter(["x", "y", "x"])) == ({}, ["x", "y", "x"])  # any iterable
    assert empty.metrics_snapshot().misses == 3


async def test_the_runtime_reads_messages_through_the_cache(tmp_path: object) -> None:
    """A read of messages by id reads the store only for what the cache lacks; a delete
    clears it; None turns it off."""
    from pathlib import Path

    from pleach_client.providers.scripted import ScriptedProvider
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.sqlite import SQLiteAdapter

    db = Path(str(tmp_path)) / "d.db"
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider()) as rt:
        assert rt.cache is not None
        session = await rt.create_session()
        for text in ("one", "two", "three"):
            async for _ in rt.execute_message(session.id, text):
                pass
        first = await rt.sessions.messages(session.id)
        assert len(first) == 6
        ids = [m.id for m in first]
        # Read by id: what the cache lacks from the store, then from the cache.
        before = rt.cache.metrics_snapshot()
        assert await rt.core.messages(ids) == first
        read = rt.cache.metrics_snapshot()
        assert read.misses - before.misses == 6 and read.entries == 6 and read.bytes > 0
        assert await rt.core.messages(ids) == first
        after = rt.cache.metrics_snapshot()
        assert after.hits - read.hits == 6 and after.misses == read.misses
        await rt.delete_session(session.id)
        assert rt.cache.metrics_snapshot().entries == 0
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider(), cache=RecordCache(4)) as rt:
        # A transcript longer than the cache holds: all of it read, its last ones kept.
        assert rt.cache is not None
        session = await rt.create_session()
        for text in ("one", "two", "three"):
            async for _ in rt.execute_message(session.id, text):
                pass
        rt.cache.clear()
        evicted = rt.cache.metrics_snapshot().evictions
        ids = (await rt.core.session(session.id)).state.message_ids
        transcript = await rt.core.messages(ids)
        assert [m.content[0]["text"] for m in transcript[::2]] == ["one", "two", "three"]
        assert len(rt.cache) == 4 and rt.cache.metrics_snapshot().evictions == evicted
        kept, missing = rt.cache.get_many([m.id for m in transcript])
        assert list(kept) == [m.id for m in transcript[2:]] and len(missing) == 2
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider(), cache=None) as rt:
        assert rt.cache is None
        other = await rt.create_session()
        async for _ in rt.execute_message(other.id, "hi"):
            pass
        assert len(await rt.sessions.messages(other.id)) == 2


async def test_a_listed_transcript_is_kept_for_the_next_turn(tmp_path: object) -> None:
    """A fresh runtime that resumes a session and lists its messages (an app opening it)
    reads them once: the next turn reads no message from the store, and its request holds the
    whole conversation. Listing again reads nothing either."""
    from pathlib import Path

    from pleach_client.providers.scripted import ScriptedProvider
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.sqlite import SQLiteAdapter

    db = Path(str(tmp_path)) / "d.db"
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider()) as rt:
        session = await rt.create_session()
        for text in ("one", "two", "three"):
            async for _ in rt.execute_message(session.id, text):
                pass
    provider = ScriptedProvider()
    # A record cache smaller than the transcript, as a long session's is (1,000 by default).
    async with SessionRuntime(SQLiteAdapter(db), provider, cache=RecordCache(4)) as rt:
        asked: list[int] = []
        read = rt.store.get_messages

        async def counted(ids: list[str]) -> list[Message]:
            asked.append(len(ids))
            return await read(ids)

        rt.store.get_messages = counted  # type: ignore[method-assign]
        await rt.sessions.resume(session.id)
        listed = await rt.sessions.messages(session.id)
        assert len(listed) == 6 and asked == [6]
        assert await rt.sessions.messages(session.id) == listed and asked == [6]
        async for _ in rt.execute_message(session.id, "four"):
            pass
        assert asked == [6]
        sent = provider.requests[-1].messages
        assert [m["content"][0]["text"] for m in sent[::2]] == ["one", "two", "three", "four"]
        after = await rt.sessions.messages(session.id)
        assert after[:6] == listed and len(after) == 8 and asked == [6]


async def test_a_transcript_missing_messages_is_read_again_once_they_are_here(
    tmp_path: object,
) -> None:
    """A session row can name messages the device does not hold yet (a pull's later page, a
    sync on hold): its transcript is then read without them, and not kept, so the listing
    and the next turn's request hold them as soon as they are here. (A transcript kept with
    holes was returned again while its ids matched the row, found by the seeded simulation,
    races seed 10,570,959.)"""
    from pathlib import Path

    import msgspec

    from pleach_client.providers.scripted import ScriptedProvider
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.base import WriteBatch
    from pleach_client.store.sqlite import SQLiteAdapter
    from tests.factories import make_message

    db = Path(str(tmp_path)) / "d.db"
    provider = ScriptedProvider()
    async with (
        SessionRuntime(SQLiteAdapter(db), provider) as rt,
        SessionRuntime(SQLiteAdapter(db), ScriptedProvider()) as other,
    ):
        session = await rt.create_session()
        async for _ in rt.execute_message(session.id, "one"):
            pass
        row = await other.core.session(session.id)
        late = make_message(
            session_id=session.id,
            org_id=row.org_id,
            user_id=row.user_id,
            role="assistant",
            content=[{"type": "text", "text": "late"}],
        )
        state = msgspec.structs.replace(row.state, message_ids=[*row.state.message_ids, late.id])
        await other.sessions.save(msgspec.structs.replace(row, state=state))  # names it
        listed = await rt.sessions.messages(session.id)
        assert [m.content[0]["text"] for m in listed] == ["one", "You said: one"]
        await other.store.commit(WriteBatch(records=[late]))  # here now
        listed = await rt.sessions.messages(session.id)
        assert [m.content[0]["text"] for m in listed] == ["one", "You said: one", "late"]
        async for _ in rt.execute_message(session.id, "two"):
            pass
        sent = [[b["text"] for b in m["content"]] for m in provider.requests[-1].messages]
        assert sent == [["one"], ["You said: one", "late"], ["two"]]
