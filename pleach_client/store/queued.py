"""A device file's outbox rows (schema 18): one row a commit, naming its records in order.

A commit queues its records under consecutive numbers (``client_seq``); its outbox row is
keyed by the first of them and holds, for each in turn, what the flush reads it by: its kind
(the index in ``compact.KINDS``) and its row's key (``sqlite._key``: a UUID's 16 bytes, any
other id its text), or the body itself for an entry that carries its own copy (a dead letter
queued again, a row of a file before schema 4). An entry acknowledged or dead-lettered before
the rest of its row is left in place as a gap (``GONE``), so that the others keep their
numbers; a row whose entries are all gone is removed. A row holds at most ``ROW_ENTRIES``
entries (a larger commit, a pull's or an import's, takes several rows), so that reading the
entries after a number never decodes more than one row's worth it does not need.

The bytes of ``refs``, an entry after another:

    0xff                                  gone
    tag [key] [body]                      tag: kind (bits 0-3), the key is 16 bytes (0x10),
                                          a body follows (0x20)
    key:  16 bytes: the count of its first bytes that are the previous 16-byte key's of the
          row (one byte, 0 for the first; as many as are), then the rest of its bytes;
          else varint length + UTF-8 text
    body: varint length + bytes

The ids of a commit are UUIDv7s made within a millisecond or two (``shared.ids.uuid7``): each
shares its first ten bytes or so with the one before, so a key takes about eight bytes with
its count. Nine entries of a turn take about 105 bytes in one row (its time and count beside
them) where nine rows took about 330 with their keys, counts and times. Pure: no I/O;
``unpack`` raises ``ValueError`` on bytes it did not write (a corrupt row), never anything
else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple, TypeVar

import msgspec

__all__ = [
    "GONE",
    "ROW_ENTRIES",
    "Queued",
    "Tried",
    "gone",
    "live",
    "pack",
    "renumbered",
    "rows_of",
    "sessions_of",
    "tried",
    "tries_of",
    "unpack",
]

_T = TypeVar("_T")

ROW_ENTRIES: Final = 64
"""Entries an outbox row holds at most (a turn's nine take one)."""

_GONE: Final = 0xFF
_UUID: Final = 0x10
_BODY: Final = 0x20
_KIND: Final = 0x0F


class Queued(NamedTuple):
    """An entry of an outbox row: its record's kind and key, and its own copy of the
    record's body (None: the flush reads the record where it is stored)."""

    kind: int
    key: str | bytes
    body: bytes | None = None


GONE: Final = None
"""An entry acknowledged or dead-lettered while others of its row are still queued."""

Entry = Queued | None


def _varint(value: int, out: bytearray) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack(entries: Iterable[Entry]) -> bytes:
    """The ``refs`` of ``entries`` (``unpack`` reversed). ``ValueError`` for a kind outside
    0-14 or a key that is neither 16 bytes nor text."""
    out = bytearray()
    before = b""  # the previous 16-byte key of the row
    for entry in entries:
        if entry is None:
            out.append(_GONE)
            continue
        kind, key, body = entry
        if not 0 <= kind < _KIND:
            raise ValueError(f"an outbox entry's kind out of range: {kind!r}")
        tag = kind | (_BODY if body is not None else 0)
        if isinstance(key, bytes) and len(key) == 16:
            shared = _shared(before, key)
            out.append(tag | _UUID)
            out.append(shared)
            out += key[shared:]
            before = key
        elif isinstance(key, str):
            text = key.encode()
            out.append(tag)
            _varint(len(text), out)
            out += text
        else:
            raise ValueError(f"an outbox entry's key is neither 16 bytes nor text: {key!r}")
        if body is not None:
            _varint(len(body), out)
            out += body
    return bytes(out)


def _shared(before: bytes, key: bytes) -> int:
    """How many first bytes ``key`` shares with ``before`` (0 when there is none)."""
    shared = 0
    for a, b in zip(before, key, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 35:
            raise ValueError("an outbox row's refs end inside a length")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and shift:  # (``pack`` writes each length one way only)
                raise ValueError("an outbox row's refs hold a length not written by pack")
            return value, at
        shift += 7


def unpack(refs: bytes) -> list[Entry]:
    """The entries ``refs`` holds, in order (``GONE`` for a gap). ``ValueError`` for bytes
    that ``pack`` did not write."""
    if not isinstance(refs, bytes):
        raise ValueError(f"an outbox row's refs are not bytes: {type(refs).__name__}")
    out: list[Entry] = []
    at, end = 0, len(refs)
    before = b""
    while at < end:
        tag = refs[at]
        at += 1
        if tag == _GONE:
            out.append(None)
            continue
        if tag & ~(_KIND | _UUID | _BODY) or tag & _KIND == _KIND:
            raise ValueError(f"an outbox row's refs hold an unknown tag {tag:#x}")
        key: str | bytes
        if tag & _UUID:
            if at >= end:
                raise ValueError("an outbox row's refs end inside a key")
            shared = refs[at]
            rest = 16 - shared
            if shared > len(before) or at + 1 + rest > end:
                raise ValueError("an outbox row's refs hold a key cut short")
            key = before[:shared] + refs[at + 1 : at + 1 + rest]
            if shared < len(before) and before[shared] == key[shared]:
                raise ValueError("an outbox row's refs hold a key not written by pack")
            at += 1 + rest
            before = key
        else:
            size, at = _read_varint(refs, at)
            if at + size > end:
                raise ValueError("an outbox row's refs end inside a key")
            try:
                key = refs[at : at + size].decode()
            except UnicodeDecodeError as exc:
                raise ValueError("an outbox row's refs hold a key that is not UTF-8") from exc
            at += size
        body = None
        if tag & _BODY:
            size, at = _read_varint(refs, at)
            if at + size > end:
                raise ValueError("an outbox row's refs end inside a body")
            body, at = refs[at : at + size], at + size
        out.append(Queued(tag & _KIND, key, body))
    return out


def live(entries: Sequence[Entry]) -> int:
    """How many of ``entries`` are still queued (not ``GONE``)."""
    return sum(entry is not None for entry in entries)


def gone(first: int, entries: Sequence[Entry], numbers: Iterable[int]) -> list[Entry]:
    """``entries`` (the first numbered ``first``) with those of ``numbers`` gone; numbers
    outside the row are ignored."""
    out = list(entries)
    for number in numbers:
        at = number - first
        if 0 <= at < len(out):
            out[at] = None
    return out


def rows_of(first: int, entries: Sequence[Queued]) -> list[tuple[int, list[Entry]]]:
    """``entries``, numbered from ``first`` on, as rows of at most ``ROW_ENTRIES``: each row's
    first number and its entries."""
    return [
        (first + at, list(entries[at : at + ROW_ENTRIES]))
        for at in range(0, len(entries), ROW_ENTRIES)
    ]


def renumbered(
    rows: Iterable[tuple[int, Sequence[Entry], _T]],
) -> tuple[list[tuple[int, list[Entry], _T]], dict[int, int]]:
    """``rows`` (each its first number, its entries and a value of its own, in order) with
    their queued entries numbered 1, 2, ... in the same order and no gaps, as rows (each old
    row's entries in rows of their own, ``rows_of``, carrying its value), and each old
    number's new one."""
    out: list[tuple[int, list[Entry], _T]] = []
    moved: dict[int, int] = {}
    number = 1
    for first, entries, value in rows:
        kept: list[Queued] = []
        for at, entry in enumerate(entries):
            if entry is not None:
                moved[first + at] = number + len(kept)
                kept.append(entry)
        if kept:
            out += [(start, part, value) for start, part in rows_of(number, kept)]
            number += len(kept)
    return out, moved


def sessions_of(
    rows: Iterable[tuple[int, Sequence[Entry]]], kind: int
) -> dict[str | bytes, tuple[int, int | None]]:
    """The records of ``kind`` (the sessions') that ``rows`` (each its first number and its
    entries) queue: for each key, how many of its entries are queued, and the last number
    under which it is queued by reference (None: none is)."""
    out: dict[str | bytes, tuple[int, int | None]] = {}
    for first, entries in rows:
        for at, entry in enumerate(entries):
            if entry is not None and entry.kind == kind:
                count, last = out.get(entry.key, (0, None))
                if entry.body is None and (last is None or first + at > last):
                    last = first + at
                out[entry.key] = (count + 1, last)
    return out


Tried = tuple[int, int | None, str | None]
"""An entry's failed attempts: how many, and the last one's error code and message."""
_TRIES: Final = msgspec.msgpack.Decoder(list[tuple[int, int, int | None, str | None]])
_TRIES_OUT: Final = msgspec.msgpack.Encoder()


def tried(tries: Mapping[int, Tried]) -> bytes | None:
    """A row's ``tried`` (schema 18): the failed attempts of its entries, each under its
    place in the row (``tries_of`` reversed); None when none failed."""
    if not tries:
        return None
    return _TRIES_OUT.encode([(at, *tries[at]) for at in sorted(tries)])


def tries_of(data: bytes | None) -> dict[int, Tried]:
    """The failed attempts a row's ``tried`` holds, by place in the row (``tried``
    reversed); ``ValueError`` for bytes it did not write."""
    if data is None:
        return {}
    try:
        return {
            at: (attempts, code, message) for at, attempts, code, message in _TRIES.decode(data)
        }
    except (msgspec.DecodeError, TypeError) as exc:
        raise ValueError(f"an outbox row's tried is not one: {exc}") from exc
