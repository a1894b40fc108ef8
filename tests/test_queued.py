"""The outbox row of a commit (``pleach_client.store.queued``): what it packs is what it
unpacks, any other bytes are refused as a ``ValueError`` alone, and gaps and renumbering keep
every queued entry, in order."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.store import MemoryAdapter, SQLiteAdapter, queued
from pleach_client.store.base import OutboxEntry, WriteBatch
from pleach_client.store.queued import Queued
from shared.ids import uuid7
from shared.records import Record
from tests.factories import make_checkpoint, make_event, make_message, make_session

keys = st.one_of(
    st.binary(min_size=16, max_size=16),
    # (keys of two byte values: many share their first bytes with the one before, as the
    # UUIDv7s of a commit do)
    st.lists(st.integers(0, 1), min_size=16, max_size=16).map(bytes),
    st.text(max_size=40),
)
entries = st.builds(
    Queued,
    kind=st.integers(min_value=0, max_value=14),
    key=keys,
    body=st.one_of(st.none(), st.binary(max_size=300)),
)
rows = st.lists(st.one_of(st.none(), entries), max_size=queued.ROW_ENTRIES)


@given(rows)
@settings(max_examples=400)
def test_a_row_unpacks_to_what_was_packed(row: list[queued.Entry]) -> None:
    assert queued.unpack(queued.pack(row)) == row


@given(st.binary(max_size=200))
@settings(max_examples=600)
def test_other_bytes_are_refused_or_read_as_a_row_that_packs_back(data: bytes) -> None:
    """Bytes that no row was packed to are a ``ValueError``, never another error; bytes that
    do unpack are a row whose packing gives them back (one reading of any bytes)."""
    try:
        row = queued.unpack(data)
    except ValueError:
        return
    assert queued.pack(row) == data


@given(rows, st.integers(min_value=0, max_value=199))
@settings(max_examples=200)
def test_a_row_cut_anywhere_is_refused_or_a_shorter_row(row: list[queued.Entry], cut: int) -> None:
    data = queued.pack(row)
    try:
        short = queued.unpack(data[: cut % (len(data) + 1)])
    except ValueError:
        return
    assert short == row[: len(short)]


def test_a_turns_keys_take_about_seven_bytes_each() -> None:
    """A turn's ids, UUIDv7s made one after another (``uuid7``), share their first bytes:
    packed, nine entries take well under their 144 bytes of keys."""
    made = [Queued(1, uuid.UUID(uuid7()).bytes) for _ in range(9)]
    packed = queued.pack(made)
    assert queued.unpack(packed) == made
    assert len(packed) < 9 * (2 + 9)


def test_what_is_no_row_is_refused() -> None:
    for data in (
        b"\x0f",  # (a kind out of range)
        b"\x40",  # (a tag of no meaning)
        b"\x10" + b"x" * 15,  # (a key cut short)
        b"\x00\x05ab",
        b"\x00\x02\xff\xfe",  # (a key that is not UTF-8)
        b"\x00\x80\x00",  # (a length written two ways)
        b"\x10\x00" + bytes(16) + b"\x10\x03" + bytes(13),  # (shares less than it does)
        b"\x10\x00" + bytes(16) + b"\x10\x11",  # (shares more than 16 bytes)
    ):
        with pytest.raises(ValueError):
            queued.unpack(data)
    with pytest.raises(ValueError):
        queued.unpack("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        queued.pack([Queued(15, "k")])
    with pytest.raises(ValueError):
        queued.pack([Queued(0, b"short")])


@given(
    st.integers(min_value=1, max_value=10**6),
    st.lists(entries, min_size=1, max_size=200),
)
@settings(max_examples=200)
def test_a_commit_takes_rows_of_at_most_row_entries_numbered_on(
    first: int, made: list[Queued]
) -> None:
    out = queued.rows_of(first, made)
    assert all(1 <= len(part) <= queued.ROW_ENTRIES for _, part in out)
    numbered = [(start + at, e) for start, part in out for at, e in enumerate(part)]
    assert numbered == list(enumerate(made, start=first))


@given(
    st.lists(
        st.tuples(st.lists(st.one_of(st.none(), entries), min_size=1, max_size=70), st.integers()),
        max_size=8,
    ),
    st.data(),
)
@settings(max_examples=300)
def test_gaps_and_renumbering_keep_every_queued_entry_in_order(
    made: list[tuple[list[queued.Entry], int]], data: st.DataObject
) -> None:
    rows_in: list[tuple[int, list[queued.Entry], int]] = []
    number = data.draw(st.integers(min_value=1, max_value=1000))
    for entries_of, value in made:
        rows_in.append((number, entries_of, value))
        number += len(entries_of) + data.draw(st.integers(min_value=0, max_value=5))
    removed = set(data.draw(st.lists(st.integers(min_value=0, max_value=number))))
    after = [(first, queued.gone(first, e, removed), v) for first, e, v in rows_in]
    held = [
        (first + at, entry, v)
        for first, row, v in after
        for at, entry in enumerate(row)
        if entry is not None
    ]
    assert all(number not in removed for number, _, _ in held)
    assert sum(queued.live(row) for _, row, _ in after) == len(held)
    out, moved = queued.renumbered(after)
    assert [(start + at, entry, v) for start, part, v in out for at, entry in enumerate(part)] == [
        (n, entry, v) for n, (_, entry, v) in enumerate(held, start=1)
    ]
    assert moved == {old: new for new, (old, _, _) in enumerate(held, start=1)}
    assert all(1 <= len(part) <= queued.ROW_ENTRIES for _, part, _ in out)


# -- a device file's outbox beside the in-memory store's, over generated histories ----------


async def _same_outbox(
    sqlite: SQLiteAdapter, memory: MemoryAdapter, step: str, sessions: list[str]
) -> list[int]:
    """The two stores' outboxes agree entry by entry (number, record, attempts, last error,
    queued again later), and so do their counts, sequences and dead letters; the numbers
    queued."""

    def seen(entries: list[OutboxEntry]) -> list[tuple[object, ...]]:
        return [
            (
                e.client_seq,
                e.record,
                e.attempts,
                e.last_error_code,
                e.last_error_message,
                e.again_later,
            )
            for e in entries
        ]

    ours, theirs = await sqlite.outbox_pending(10**6), await memory.outbox_pending(10**6)
    if seen(ours) != seen(theirs):
        short = [
            [(s[0], type(s[1]).__name__, getattr(s[1], "title", ""), *s[2:]) for s in seen(x)]
            for x in (ours, theirs)
        ]
        assert short[0] == short[1], step
    assert seen(ours) == seen(theirs), step
    for after, limit in ((0, 3), (len(ours) // 2, 7)):
        if ours:
            at = ours[min(after, len(ours) - 1)].client_seq
            got = await sqlite.outbox_pending(limit, after=at)
            assert seen(got) == seen(await memory.outbox_pending(limit, after=at)), step
    assert await sqlite.outbox_count() == await memory.outbox_count() == len(ours), step
    assert await sqlite.last_client_seq() == await memory.last_client_seq(), step
    for session in [*sessions, "no-such-session"]:
        assert await _queued(sqlite, session) == await _queued(memory, session), step
    letters = [(d.client_seq, d.record, d.code, d.attempts) for d in await sqlite.dead_letters()]
    assert letters == [
        (d.client_seq, d.record, d.code, d.attempts) for d in await memory.dead_letters()
    ], step
    return [e.client_seq for e in ours]


async def _queued(store: SQLiteAdapter | MemoryAdapter, session_id: str) -> bool:
    """``TxReader.session_queued``: whether a version of the session is queued."""
    found: list[bool] = []

    async def plan(tx: Any) -> None:
        found.append(await tx.session_queued(session_id))

    await store.transact(plan)
    return found[0]


def _some(rng: random.Random, numbers: list[int]) -> list[int]:
    """Some of ``numbers`` (a run, or any few), and a number no entry holds."""
    if not numbers:
        return [rng.randint(1, 500)]
    if rng.random() < 0.5:
        start = rng.randrange(len(numbers))
        picked = numbers[start : start + rng.randint(1, 80)]
    else:
        picked = rng.sample(numbers, rng.randint(1, min(len(numbers), 12)))
    return [*picked, max(numbers) + rng.randint(1, 100)]


@pytest.mark.parametrize("seed", range(24))
async def test_a_device_files_outbox_keeps_every_entry_as_the_memory_store_does(
    tmp_path: Path, seed: int
) -> None:
    """Commits of any size (rows of ``ROW_ENTRIES`` and more), a session queued again and
    again, acknowledgements of runs and of scattered entries, failed attempts, dead letters
    and their retries, a renumbering, a purge of checkpoints: after every step the file's
    outbox (a row a commit) holds what the in-memory store's (a row an entry) holds."""
    rng = random.Random(seed)
    sessions = [make_session(title=f"s{n}") for n in range(2)]
    async with SQLiteAdapter(tmp_path / "device.db") as sqlite, MemoryAdapter() as memory:
        stores = (sqlite, memory)
        numbers: list[int] = []
        for step in range(30):
            action = rng.choice(
                ["commit", "commit", "commit", "remove", "remove", "attempt", "dead", "retry"]
                + ["renumber", "purge"] * (step > 10)
            )
            label = f"seed {seed} step {step}: {action}"
            if action in ("commit", "renumber", "purge"):
                session = rng.choice(sessions)
                session = msgspec.structs.replace(session, title=f"{session.title}+")
                sessions = [session if s.id == session.id else s for s in sessions]
                records: list[Record] = []
                # (a purge's batch writes the session's new version alone: no checkpoint it
                # would delete as it writes it)
                for _ in range(0 if action == "purge" else rng.choice((1, 2, 9, 40, 70, 130))):
                    kind = rng.random()
                    if kind < 0.6:
                        records.append(make_message(session_id=session.id))
                    elif kind < 0.8:
                        records.append(make_checkpoint(session_id=session.id))
                    else:
                        records.append(make_event(session_id=session.id))
                records.insert(rng.randrange(len(records) + 1), session)
                batch: dict[str, Any] = {}
                if action == "renumber":
                    batch["renumber_outbox"] = True
                if action == "purge":
                    batch["purge_checkpoints_for"] = [session.id]
                for store in stores:
                    await store.commit(WriteBatch(records=list(records), **batch))
            elif action == "remove":
                picked = _some(rng, numbers)
                for store in stores:
                    await store.outbox_remove(picked)
            elif action == "attempt":
                picked = _some(rng, numbers)
                code = rng.choice((None, 3001, 4003))
                for store in stores:
                    await store.outbox_mark_attempt(picked, code, f"try {step}")
            elif action == "dead":
                seq = rng.choice(numbers) if numbers else 7
                for store in stores:
                    await store.outbox_dead_letter(seq, 3007, "invalid")
            else:
                letters = await memory.dead_letters()
                seq = rng.choice(letters).client_seq if letters else 9
                assert await sqlite.retry_dead_letter(seq) == await memory.retry_dead_letter(seq)
            numbers = await _same_outbox(sqlite, memory, label, [s.id for s in sessions])
        assert await sqlite.integrity_check() == []


@given(
    st.dictionaries(
        st.integers(0, queued.ROW_ENTRIES - 1),
        st.tuples(
            st.integers(1, 2**31),
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
            st.one_of(st.none(), st.text(max_size=60)),
        ),
        max_size=10,
    )
)
@settings(max_examples=200)
def test_a_rows_failed_attempts_read_back_as_written(tries: dict[int, queued.Tried]) -> None:
    data = queued.tried(tries)
    assert (data is None) == (not tries)
    assert queued.tries_of(data) == tries


@given(st.binary(max_size=80))
@settings(max_examples=300)
def test_other_bytes_are_no_failed_attempts(data: bytes) -> None:
    try:
        tries = queued.tries_of(data)
    except ValueError:
        return
    assert all(isinstance(held[0], int) for held in tries.values())
