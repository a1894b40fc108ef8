"""The outbox row of a commit (``pleach_client.store.queued``): what it packs is what it
unpacks, any other bytes are refused as a ``ValueError`` alone, and gaps and renumbering keep
every queued entry, in order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.store import queued
from pleach_client.store.queued import Queued

keys = st.one_of(st.binary(min_size=16, max_size=16), st.text(max_size=40))
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


def test_what_is_no_row_is_refused() -> None:
    for data in (
        b"\x0f",  # (a kind out of range)
        b"\x40",  # (a tag of no meaning)
        b"\x10" + b"x" * 15,  # (a key cut short)
        b"\x00\x05ab",
        b"\x00\x02\xff\xfe",  # (a key that is not UTF-8)
        b"\x00\x80\x00",  # (a length written two ways)
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
