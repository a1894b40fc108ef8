"""A long session's message ids sent once per connection (protocol 7): the sides' id lists.

A session row names every message of its session in order (``state.message_ids``, one ext 4
of 16 bytes an id in its compact body), and every turn sends a new version of it: at 2,000
messages, 32 KB on the wire each turn for two new ids, compressed again by each side. From
protocol 7 each direction of a connection keeps the lists it has carried (``IdLists``): the
sender's of what it sent, the receiver's of what it read, the same on both sides since both
see the same frames in the same order. (A server may hold live pages back behind answers sent
after them, so a connection keeps one set for its pushes and answers and another for its
live pages: ``shared.protocol``. Each stream keeps its own order.) A session body whose list
extends the one the connection carried last for that session travels with its list as ext 5,
a reference:

    ext 5 = digest (8 bytes) + the count of ids referred to (4 bytes, big-endian) + new ids

meaning "the list this connection carried last for this session (which has this digest and
count), then these ids". The receiver puts the whole list back (``grow``) before anything
else reads the body, so what a store keeps, and what goes on to other devices, is the body
as it would have come whole, byte for byte (``shrink`` touches only that one value).

Both sides change their lists by one rule, frame by frame, body by body, so they stay equal:
a session body whose list is an ext 4 of at least ``MIN_IDS`` ids is remembered (the list
and its digest), any other session body forgets its session's list; a reference is resolved
and the whole list remembered. The digest of a list sent whole is ``blake2b`` of its bytes;
of a list sent as a reference, of the digest referred to and the new ids: it covers the whole
list and costs what the new ids cost. At most ``MAX_HELD_BYTES`` of lists are kept a
direction, the least recently carried forgotten first. A reference to a list the receiver
does not hold as named (another digest or count: the sides disagree, or a peer lies) is a
malformed frame (``msgspec.DecodeError``); nothing it carries is taken, and the connection
must end, since the two sides' lists can no longer be trusted to agree.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

import msgspec

__all__ = [
    "ID_LAYOUT",
    "ID_REFS_SINCE",
    "MAX_HELD_BYTES",
    "MIN_IDS",
    "SQLITE_ID_LAYOUT",
    "UNRESOLVED",
    "IdLayout",
    "IdLists",
    "id_blocks",
    "ids_apart",
    "ids_joined",
    "joined_blocks",
    "rechunked",
    "unresolved",
]

ID_REFS_SINCE: Final = 7
"""The protocol version from which session bodies may carry id list references."""
MIN_IDS: Final = 64
"""Lists of fewer ids travel whole and are not remembered (a reference would save little)."""
MAX_HELD_BYTES: Final = 256 * 1024
"""Bytes of id lists a direction of a connection keeps at most (the same rule on both sides:
the least recently carried go first)."""

UNRESOLVED: Final = "an id list reference that does not resolve"
"""In the message of the error (3004) that ends a connection whose sides' lists disagree."""

_EXT_IDS: Final = 4
_EXT_REF: Final = 5
_DIGEST: Final = 8
_COUNT: Final = 4
_SESSION_KIND: Final = 0
_STATE: Final = 12
"""A compact session body's values: the kind, then its fields (``state`` the 12th)."""
_IDS_KEY: Final = "message_ids"
_EMPTY_LIST: Final = 0x90

Body = bytes | msgspec.Raw
"""A record's packed bytes, as a frame holds them (``msgspec.Raw``) or not."""

_VALUES: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_STATE_MAP: Final = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_ENCODER: Final = msgspec.msgpack.Encoder()


def _ext(code: int, data: memoryview) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, data.tobytes())


_VALUE: Final = msgspec.msgpack.Decoder(ext_hook=_ext)


def unresolved(message: str) -> bool:
    """Whether an error's ``message`` says the two sides' id lists disagreed (``UNRESOLVED``)."""
    return UNRESOLVED in message


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _kind(data: Body) -> int | None:
    """The kind index a compact body starts with (its array header, then the index as a
    positive fixint), without decoding it; None for anything else."""
    body = memoryview(data)
    head = body[0] if body else None
    at = 1 if head is not None and 0x90 <= head <= 0x9F else 3 if head == 0xDC else None
    if at is None or len(body) <= at or body[at] > 0x7F:
        return None
    return body[at]


class IdLists:
    """One direction of one connection: the session id lists it has carried, by session.

    ``shrink`` (the sender, each body it sends, in order) and ``grow`` (the receiver, each
    body it reads, in order) change it by the same rule. Bounded by ``max_bytes``."""

    __slots__ = ("_bytes", "_held", "max_bytes")

    def __init__(self, max_bytes: int = MAX_HELD_BYTES) -> None:
        # In the order last carried (a dict keeps insertion order; ``_remember`` inserts anew).
        self._held: dict[bytes, tuple[bytes, bytes]] = {}
        self._bytes = 0
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def shrink(self, body: Body) -> Body:
        """``body`` as it goes on this connection: a session's list that extends the one
        carried last for that session as a reference (new bytes), anything else as it is
        (the very object given)."""
        parts = _parts(body)
        if parts is None:
            return body
        values, state, key, ids = parts
        if ids is None or type(ids) is not msgspec.msgpack.Ext or ids.code != _EXT_IDS:
            self._forget(key)
            return body
        blob: bytes = ids.data  # type: ignore[assignment]  # (bytes, from ``_ext``)
        held = self._held.get(key)
        if held is None or len(blob) < len(held[0]) or not blob.startswith(held[0]):
            self._remember_whole(key, blob)
            return body
        known, digest = held
        tail = blob[len(known) :]
        count = len(known) // 16
        ref = msgspec.msgpack.Ext(_EXT_REF, digest + count.to_bytes(_COUNT, "big") + tail)
        self._remember(key, blob, _digest(digest + tail))
        return _with_ids(values, state, ref)

    def grow(self, body: Body) -> Body:
        """``body`` as the sender had it: a reference made whole again (new bytes), anything
        else as it is (the very object given). Raises ``msgspec.DecodeError`` for a reference
        to a list this side does not hold as named."""
        parts = _parts(body)
        if parts is None:
            return body
        values, state, key, ids = parts
        if type(ids) is not msgspec.msgpack.Ext or ids.code not in (_EXT_IDS, _EXT_REF):
            self._forget(key)
            return body
        data: bytes = ids.data  # type: ignore[assignment]  # (bytes, from ``_ext``)
        if ids.code == _EXT_IDS:
            self._remember_whole(key, data)
            return body
        held = self._held.get(key)
        head = _DIGEST + _COUNT
        if len(data) < head or (len(data) - head) % 16:
            raise msgspec.DecodeError(f"an id list reference of {len(data)} bytes")
        digest, count = data[:_DIGEST], int.from_bytes(data[_DIGEST:head], "big")
        if held is None or held[1] != digest or len(held[0]) != 16 * count:
            raise msgspec.DecodeError(
                f"{UNRESOLVED}: a session body refers to an id list this connection has not "
                f"carried ({count} ids); the two sides' lists differ"
            )
        tail = data[head:]
        blob = held[0] + tail
        self._remember(key, blob, _digest(digest + tail))
        return _with_ids(values, state, msgspec.msgpack.Ext(_EXT_IDS, blob))

    # -- the rule both sides follow ----------------------------------------------------------

    def _remember_whole(self, key: bytes, blob: bytes) -> None:
        """A list sent whole: its digest is of its bytes (computed only when it is kept)."""
        if len(blob) < 16 * MIN_IDS:
            self._forget(key)
        else:
            self._remember(key, blob, _digest(blob))

    def _remember(self, key: bytes, blob: bytes, digest: bytes) -> None:
        self._forget(key)
        if len(blob) < 16 * MIN_IDS:
            return
        self._held[key] = (blob, digest)
        self._bytes += len(blob)
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._held))
            self._bytes -= len(self._held.pop(oldest)[0])

    def _forget(self, key: bytes) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= len(held[0])


def _parts(body: Body) -> tuple[list[msgspec.Raw], dict[str, msgspec.Raw], bytes, Any] | None:
    """A compact session body's values, its state map, its id's packed bytes and its list
    (decoded: an Ext, a list, or None when the state holds none); None for any other body,
    and for one these parts do not read from (it travels as it is: the record's decode then
    says what is wrong with it)."""
    if _kind(body) != _SESSION_KIND:
        return None
    try:
        values = _VALUES.decode(body)
        if len(values) <= _STATE:
            return values, {}, bytes(values[1]), None
        state = _STATE_MAP.decode(values[_STATE])
        ids = state.get(_IDS_KEY)
        return values, state, bytes(values[1]), None if ids is None else _VALUE.decode(ids)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        return None


def _with_ids(values: list[msgspec.Raw], state: dict[str, msgspec.Raw], ids: Any) -> bytes:
    """The body of ``values`` with ``ids`` (an Ext, or a list) as its state's list, in the
    place the state had it."""
    state[_IDS_KEY] = msgspec.Raw(_ENCODER.encode(ids))
    values[_STATE] = msgspec.Raw(_ENCODER.encode(state))
    return _ENCODER.encode(values)


# -- a long list kept apart from its body (the stores' id blocks) ---------------------------


class IdLayout(NamedTuple):
    """Where a store keeps a session's message ids: a session of at most ``inline`` ids
    keeps them in its row's body, a longer one in blocks of ``block`` ids beside it, so that
    a turn writes the block it appended to, not every id the session has. One layout for a
    file's life (a block's size is not stored); only tests change it."""

    inline: int = 128
    block: int = 128
    """16 bytes an id: 2 KB, a row that fits in a page."""


ID_LAYOUT: Final = IdLayout()
SQLITE_ID_LAYOUT: Final = IdLayout(inline=ID_LAYOUT.inline, block=124)
"""Where a SQLite file keeps a long session's message ids (the server's since its schema 18, the
device's since its schema 17): blocks of 124 ids (1,984 bytes), two to a 4 KiB page of
``session_ids`` (a rowid table, which keeps a row of up to about 4 KB within its page). A
block of 128 (2 KB and its key) was just past half a page: each took a page of its own, and
half the table was unused. Not smaller blocks: a push reads all of a session's, and blocks
of 60 made a turn of a 20,000-id session read twice the rows."""


def ids_apart(body: Body, least: int) -> tuple[bytes, bytes] | None:
    """A compact session body whose list is an ext 4 of at least ``least`` ids, as the body
    with an empty list in its place and the list's bytes (16 an id); None for any other body
    (it is kept whole). ``ids_joined`` puts the two back together, byte for byte."""
    parts = _parts(body)
    if parts is None:
        return None
    values, state, _, ids = parts
    if type(ids) is not msgspec.msgpack.Ext or ids.code != _EXT_IDS:
        return None
    blob: bytes = ids.data  # type: ignore[assignment]  # (bytes, from ``_ext``)
    if len(blob) < 16 * least or len(blob) % 16:
        return None
    return _with_ids(values, state, []), blob


def ids_joined(body: Body, blob: bytes) -> bytes | None:
    """``body`` (a session body kept apart from its list: ``ids_apart``) with the list
    ``blob`` (16 bytes an id) back in its place; None when ``body`` is no session body whose
    state holds an empty list."""
    parts = _parts(body)
    if parts is None or len(blob) % 16:
        return None
    values, state, _, ids = parts
    if ids != []:
        return None
    at = _empty_list_at(body, values, state)
    if at is not None:  # (one copy of the list, where encoding the parts again made three)
        return b"".join((body[:at], _ext_head(_EXT_IDS, len(blob)), blob, body[at + 1 :]))
    return _with_ids(values, state, msgspec.msgpack.Ext(_EXT_IDS, bytes(blob)))


def _empty_list_at(
    body: Body, values: list[msgspec.Raw], state: dict[str, msgspec.Raw]
) -> int | None:
    """The offset in ``body`` of its state's list, an empty one (one byte), found from the
    lengths of what comes before it, as ``ids_apart`` encodes the parts; None when the bytes
    there are not that list under its key (a body encoded another way)."""
    data = memoryview(body)
    at = len(data) - sum(map(len, values))  # (the values' array header)
    at += sum(map(len, values[:_STATE]))
    keys = {key: _ENCODER.encode(key) for key in state}
    at += len(values[_STATE]) - sum(len(keys[key]) + len(raw) for key, raw in state.items())
    for key, raw in state.items():
        at += len(keys[key])
        if key == _IDS_KEY:
            head = data[at - len(keys[key]) : at] == keys[key]
            placed = head and at < len(data) and data[at] == _EMPTY_LIST
            return at if placed else None
        at += len(raw)
    return None


def _ext_head(code: int, size: int) -> bytes:
    """The msgpack header of an ext of ``size`` bytes, as msgspec writes it."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(size)
    if fixed is not None:
        return bytes((fixed, code))
    if size < 1 << 8:
        return bytes((0xC7, size, code))
    if size < 1 << 16:
        return b"\xc8" + size.to_bytes(2, "big") + bytes((code,))
    return b"\xc9" + size.to_bytes(4, "big") + bytes((code,))


def joined_blocks(blocks: Iterable[tuple[int, bytes]]) -> bytes | None:
    """The ids of a session's blocks ``(part, ids)`` (in any order) joined; None when their
    parts are not 0, 1, 2... (a block is missing)."""
    ordered = sorted(blocks)
    if [part for part, _ in ordered] != list(range(len(ordered))):
        return None
    return b"".join(bytes(ids) for _, ids in ordered)


def rechunked(blocks: list[tuple[int, bytes]], block: int) -> list[tuple[int, bytes]]:
    """A session's blocks ``(part, ids)`` cut again into blocks of ``block`` ids (its ids
    joined in part order); the blocks as they are when a part is missing (a row left so by a
    fault: every read of it fails alike, before and after)."""
    ids = joined_blocks(blocks)
    return blocks if ids is None else id_blocks(ids, b"", block)


def id_blocks(data: bytes, stored: bytes, block: int = ID_LAYOUT.block) -> list[tuple[int, bytes]]:
    """The blocks ``(part, ids)`` of ``block`` ids to write for a session whose message ids
    are ``data`` (16 bytes each) where its blocks hold ``stored``: those that differ (after
    a turn, the one it appended to, or a new one). Blocks past ``data``'s are the caller's to
    drop."""
    size = 16 * block
    first = len(stored) // size if data.startswith(stored) else 0
    return [
        (part, data[part * size : (part + 1) * size])
        for part in range(first, -(-len(data) // size))
        if data[part * size : (part + 1) * size] != stored[part * size : (part + 1) * size]
    ]
