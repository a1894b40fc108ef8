"""A compact, lossless byte form of a record, for storage.

``encode_record`` (the wire and the server's form) writes each record as a msgpack map: every
field name in every row, ids as 36-character text, hashes as 64 hex characters, HLC stamps as
about 60 characters. This form keeps the same values in less than half the bytes:

- a msgpack array: the kind's index in ``KINDS``, then the field values in declaration order,
  with trailing values equal to their defaults left out (field names are implied);
- canonical lowercase UUID strings as msgpack ext 1 (16 bytes), a list of two or more of them
  as ext 4 (16 bytes each), 64-character lowercase hex
  digests as ext 2 (32 bytes), HLC stamps (``<13 digits>-<6 digits>-<node>``) as ext 3 (wall
  and counter as integers, the node as a UUID or text), wherever they occur in the record;
- since protocol 9, a text of at least ``DEFLATE_MIN`` characters inside a list or a map (a
  message's blocks, an event's payload; never a record's own field) as ext 6, its UTF-8
  deflated (raw ``zlib``, level 6), where that saves at least an eighth of its bytes and the
  text is at most ``INFLATE_RATIO`` times the ext's bytes; ``inflated`` writes them out for
  a peer before protocol 9, and an ext 6 that inflates past the ratio, or is not whole
  deflate data, is refused like any other malformed ext;
- since protocol 8 (``shared.messages``), a ``client_id`` equal to its record's stamp's node
  as nil (``implied_client``); an audit row's ``usage`` and ``outcome`` as arrays of their
  fields, trailing defaults left out (``_ARRAY_STRUCTS``); an event's ``type`` and payload
  keys in ``WORDS`` as their indexes, and every field of an event written, trailing defaults
  too (``canonical_body``). ``explicit`` gives the bytes of the form before, for a peer before
  protocol 8. ``decode`` reads both forms.

Only strings whose text comes back exactly are converted, so decoding gives back an equal
record. ``decode`` also reads the map form (a body written by ``encode_record``), so stores may
hold both. Pure: no I/O.

Speed: the codec's time goes to the exts, one Python step each (msgspec does the rest). Ids
repeat heavily (session, device and turn ids; an HLC stamp's node is its device's id), so
both directions keep small bounded caches of converted ids and nodes (see ``_CACHE_LIMIT``);
the caches change no byte and no value, only the time taken. ``decode`` reads a body of a
message, checkpoint, event or artifact update natively into its kind's twin (``_TWINS``: the
record's own field types, where a text may also be an ext), and its ``make`` turns the exts
that stand for text into text and builds the record: no hook call for those, no second
validation (a message about 30% faster, an event about 20%). A body of another kind, or one
its twin refuses, is read in one typed pass into the kind's array-like body type
(``_BODY_TYPES``: every field ``Any``, so each ext reaches the hook; the record's defaults),
then ``msgspec.convert`` validates the fields into the record, as strictly as a map-form body.
A body that pass refuses is read again the generic way (a list of values, then a dict of the
fields), which gives what it always gave: the error, mostly. ``tests/test_compact.py`` holds
the first, plain version of this codec and checks that this one writes its bytes exactly and
reads them alike, and that the twin, the typed and the generic reads agree on valid, mistyped
and corrupt bodies.
"""

from __future__ import annotations

import contextlib
import re
import struct
import types
import typing
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal, TypeVar, Union, cast

import msgspec

from .records import RECORD_KINDS, Event, Outcome, Record, Usage, decode_record

__all__ = [
    "KINDS",
    "SHORT",
    "Bodies",
    "body_tenant",
    "canonical_body",
    "chain_digest",
    "chain_digest_sql",
    "checkpoint_parent",
    "decode",
    "decode_short",
    "digest_bytes",
    "encode",
    "event_apart",
    "event_payload",
    "event_place",
    "event_type",
    "explicit",
    "id_list_bytes",
    "id_list_texts",
    "implied_client",
    "inflated",
    "is_compact",
    "packed",
    "prev_apart",
    "short_body",
    "stamp_node",
    "tenant_texts",
    "uuid_bytes",
    "uuid_text",
    "uuids_bytes",
    "whole_body_sql",
]

KINDS: Final[tuple[str, ...]] = (
    "Session",
    "Message",
    "Checkpoint",
    "Event",
    "AuditRow",
    "ArtifactUpdate",
)
"""Kind index -> kind name. Append only: an index, once written, names its kind forever."""

_EXT_UUID, _EXT_HEX, _EXT_HLC, _EXT_UUIDS, _EXT_DEFLATED = 1, 2, 3, 4, 6
DEFLATE_MIN: Final = 128
"""The shortest text (in characters) a body writes deflated (protocol 9): shorter ones seldom
save a tenth, and each costs a few microseconds both ways."""
INFLATE_RATIO: Final = 16
"""A deflated text is at most this many times its ext's bytes, whoever wrote it: ``encode``
writes any text that deflates further as it is (real prose deflates 1.5-3x), and a decode
refuses an ext 6 that would inflate past it, so a peer's body never holds more than 16 times
its own bytes of text."""
_DEFLATE_LEVEL: Final = 6
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_NODE_TEXT, _NODE_UUID = 0, 1
_NODEFAULT: Final = object()
_K = TypeVar("_K")
_B = TypeVar("_B", bytes, msgspec.Raw)
_V = TypeVar("_V")

Ext = msgspec.msgpack.Ext


class _Kind:
    """What the codec needs of one kind: its class, field names and defaults (as builtins)."""

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.cls = RECORD_KINDS[name].cls
        info = msgspec.structs.fields(self.cls)
        self.names = [f.encode_name for f in info]
        self.defaults = defaults = _struct_defaults(self.cls)
        self.arrays = tuple(
            (i, f.type, _struct_defaults(f.type))
            for i, f in enumerate(info)
            if isinstance(f.type, type) and f.type in _ARRAY_STRUCTS
        )
        """The fields written as arrays (``_ARRAY_STRUCTS``): index, Struct, its defaults."""
        self.words = (
            (self.names.index("type"), self.names.index("payload")) if name == "Event" else None
        )
        """Where an event's type and payload are (``WORDS``); None for any other kind."""
        self.whole = name == "Event"
        """Whether a body writes every field, trailing defaults too (protocol 8): an event,
        so that marking it canonical changes one byte and its row keeps its size
        (``canonical_body``)."""
        self.packed_defaults = [
            None if d is _NODEFAULT else msgspec.Raw(msgspec.msgpack.encode(d)) for d in defaults
        ]
        """Each field's default as its packed bytes (``explicit``: the form before trimmed
        them); None for a field without one."""
        self.client_at = self.names.index("client_id")
        self.hlc_at = self.names.index("hlc")
        """Where the record's device and its stamp are among its values (``implied_client``)."""
        self.convert_first = tuple(
            i
            for i, (f, default) in enumerate(zip(info, defaults, strict=True))
            if _is_struct(f.type) or (isinstance(default, list | dict) and default)
        )
        """The fields ``encode`` converts to builtins before comparing them with their
        defaults: Structs, and containers whose default is not empty (see ``encode``)."""


_ARRAY_STRUCTS: Final[frozenset[type]] = frozenset({Usage, Outcome})
"""The Structs a record holds that its compact body writes as arrays (protocol 8): their
fields in declaration order, trailing defaults left out, as a record's own. An audit row's
usage and outcome are then about a hundred bytes fewer: no field names. A session's state
stays a map (``shared.idrefs`` and the stores read its id list by its key)."""


WORDS: Final[tuple[str, ...]] = (
    # event types
    "session.created",
    "session.saved",
    "session.tools",
    "session.deleted",
    "message.added",
    "message.complete",
    "turn.complete",
    "turn.suspended",
    "turn.stopped",
    "checkpoint.created",
    "checkpoint.rollback",
    "tool.started",
    "tool.completed",
    "tool.failed",
    "interrupt.requested",
    "interrupt.resolved",
    "artifact.created",
    "job.queued",
    "job.started",
    "job.progress",
    "job.completed",
    "job.failed",
    "job.cancelled",
    "job.cancel_requested",
    "subagent.started",
    "subagent.completed",
    # payload keys
    "message_id",
    "role",
    "turn_id",
    "stop_reason",
    "checkpoint_id",
    "reason",
    "outcome",
    "title",
    "tools",
    "tool_use_id",
    "tool_call_id",
    "name",
    "input",
    "output",
    "is_error",
    "error",
    "code",
    "message",
    "job_id",
    "artifact_id",
    "interrupt_id",
    "subagent_id",
    "parent_turn_id",
    "parent_session_id",
    "session_id",
    "status",
    "kind",
    "provider",
    "model",
    "to_checkpoint",
    "forked_from",
    "description",
    "data",
    "source",
    "stopped_by",
)
"""Words an event says again and again (protocol 8): its ``type`` and its payload's keys. An
event's compact body writes a type in this table as its index, and a payload key in it as its
index (a key of a JSON object is text, so an integer key is never the payload's own). Append
only: an index, once written, names its word forever."""
_WORD_INDEX: Final = {word: i for i, word in enumerate(WORDS)}
if len(WORDS) > 128:  # pragma: no cover - ``explicit`` reads an index as one byte
    raise TypeError("WORDS holds at most 128 words (a positive fixint each)")


def _word(index: Any) -> str:
    """The word at ``index`` in ``WORDS``; ``_NotText`` for any other index."""
    if type(index) is not int or not 0 <= index < len(WORDS):
        raise _NotText
    return WORDS[index]


def _words_keyed(payload: dict[Any, Any]) -> dict[Any, Any]:
    """``payload`` with its keys in ``WORDS`` as their indexes (itself when it has none).
    ``TypeError`` for a key that is not text: it would read back as a word (a payload is a
    JSON object, whose keys are text; such a key was refused on reading before, too)."""
    index = _WORD_INDEX
    if not _STR.issuperset(map(type, payload)):
        raise TypeError("an event payload's keys must be text")
    if not any(key in index for key in payload):
        return payload
    return {index.get(key, key) if type(key) is str else key: v for key, v in payload.items()}


_WORD_OF: Final = dict(enumerate(WORDS))


def _keys_read(payload: dict[Any, Any]) -> dict[Any, Any]:
    """``payload`` with its integer keys as the words they stand for (a new dict; itself when
    it is no dict); ``_NotText`` for an index ``WORDS`` does not have. (A loop: half the time
    of a comprehension calling ``_word``, on the path of every event read.)"""
    if payload.__class__ is not dict:
        return payload
    read = {}
    words = _WORD_OF
    for key, value in payload.items():
        if key.__class__ is int:
            key = words.get(key)
            if key is None:
                raise _NotText
        read[key] = value
    return read


def _struct_defaults(cls: type) -> list[Any]:
    """Each field's default of the Struct ``cls``, as builtins (``_NODEFAULT``: none)."""
    return [
        msgspec.to_builtins(f.default)
        if f.default is not msgspec.NODEFAULT
        else msgspec.to_builtins(f.default_factory())
        if f.default_factory is not msgspec.NODEFAULT
        else _NODEFAULT
        for f in msgspec.structs.fields(cls)
    ]


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


_BY_INDEX: Final = tuple(_Kind(i, name) for i, name in enumerate(KINDS))
_BY_CLASS: Final = {kind.cls: kind for kind in _BY_INDEX}
_ENCODER: Final = msgspec.msgpack.Encoder()

# -- caches --------------------------------------------------------------------------------
# A cache is emptied when it reaches _CACHE_LIMIT entries (cheaper than LRU bookkeeping: the
# frequent ids are back after one use), and every key is short (UUIDs; HLC nodes up to
# _NODE_CACHE_MAX), so a stream of fresh ids, or a hostile peer's records, holds at most
# about 6 MB in all four; the id lists (``_uuid_lists`` for encode, ``_id_lists`` for decode)
# have bounds of their own. Dict reads and writes are atomic under the GIL: threads may share.
_CACHE_LIMIT: Final = 8192
_NODE_CACHE_MAX: Final = 40
"""HLC nodes longer than this (characters, or bytes with the kind byte) are never cached."""
_LISTS_LIMIT: Final = 64
"""Id lists kept whole (``_uuid_lists``): a session's message ids grow by a turn's few at a
time, so the list encoded last is this turn's minus its new tail. Each entry holds its items
(references) and 16 bytes per id."""
_uuid_lists: dict[str, tuple[list[str], bytes]] = {}  # encode: first id -> (ids, data)
_id_lists: dict[bytes, tuple[bytes, tuple[str, ...]]] = {}  # decode: first 16 bytes -> both
_ID_LISTS_MIN: Final = 64
"""Id lists of fewer ids than this are decoded whole (``_uuid_list_texts``), never kept."""
_ID_LISTS_BUDGET: Final = 1 << 16
"""Ids kept in all of ``_id_lists`` at most (about 110 bytes each with their bytes): past it,
the cache is emptied, so a peer's long lists hold about 7 MB at most. The count is kept under
the GIL; threads decoding long lists at once may miscount it by a list until it is emptied."""
_id_lists_held = 0
_uuid_exts: dict[str, Ext] = {}  # encode: UUID text -> ext 1
_deflated_exts: dict[str, Ext | None] = {}  # encode: long text -> ext 6, None: written as is
_DEFLATED_KEPT_MAX: Final = 1 << 14
"""Texts longer than this (characters) are deflated each time they are encoded, never kept."""
_DEFLATED_BUDGET: Final = 1 << 20
"""Characters of text kept in ``_deflated_exts`` at most (with their exts, about 2 MB): past
it, the cache is emptied."""
_deflated_held = 0
_UNSEEN: Final = object()
_node_tails: dict[str, bytes] = {}  # encode: HLC node text -> node kind byte + node
_uuid_texts: dict[bytes, str] = {}  # decode: ext 1 bytes -> UUID text
_node_texts: dict[bytes, str] = {}  # decode: node kind byte + node -> HLC node text


def _remember(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _clear_caches() -> None:
    """Empties every cache (a benchmark starts each pass cold with it)."""
    global _id_lists_held, _deflated_held
    for cache in (_uuid_exts, _node_tails, _uuid_texts, _node_texts, _uuid_lists, _id_lists):
        cache.clear()
    _deflated_exts.clear()
    _id_lists_held = _deflated_held = 0


# -- encode --------------------------------------------------------------------------------


def _new_node_tail(node: str) -> bytes | None:
    """An HLC ext's node part: the node kind byte, then the node. None for a lone surrogate."""
    if len(node) == 36 and _UUID.match(node):
        tail = bytes((_NODE_UUID,)) + bytes.fromhex(node.replace("-", ""))
    else:
        try:
            tail = bytes((_NODE_TEXT,)) + node.encode()
        except UnicodeEncodeError:  # a lone surrogate: leave it to the encoder to refuse
            return None
    return _remember(_node_tails, node, tail) if len(node) <= _NODE_CACHE_MAX else tail


def _new_uuid_ext(value: str) -> Ext | None:
    """A 36-character ``value`` as ext 1 when it is a canonical UUID (then cached), else None."""
    if not _UUID.match(value):
        return None
    return _remember(_uuid_exts, value, Ext(_EXT_UUID, bytes.fromhex(value.replace("-", ""))))


def _hlc(value: str) -> Ext | None:
    """``<13 digits>-<6 digits>-<node>`` as ext 3, else None. The digits are checked with
    str methods and parsed with one ``int``: half the cost of a regex and two ``int``."""
    digits = value[:13] + value[14:20]
    if value[13:14] != "-" or value[20:21] != "-" or not (digits.isascii() and digits.isdigit()):
        return None
    node = value[21:]
    tail = _node_tails.get(node) or _new_node_tail(node)  # a tail is never empty
    if tail is None:
        return None
    wall, counter = divmod(int(digits), 10**6)
    return Ext(_EXT_HLC, (wall << 24 | counter).to_bytes(9, "big") + tail)  # 6 + 3 bytes


def _hex_digest(value: str) -> Ext | None:
    """A 64-character lowercase hex digest as ext 2. ``fromhex`` also takes uppercase and
    spaces, so the bytes must give back exactly ``value`` (cheaper than a regex first)."""
    try:
        data = bytes.fromhex(value)
    except ValueError:
        return None
    return Ext(_EXT_HEX, data) if data.hex() == value else None


def _uuid_list(value: list[Any]) -> Ext | None:
    """A list of canonical UUID strings (message ids...) as one ext, 16 bytes each.

    A list that extends one encoded before (a session's message ids, a turn's few more each
    time: ``_uuid_lists``, keyed by its first id) converts only its new tail; the rest is
    checked by one list comparison (C, and mostly by identity)."""
    first = value[0] if value else None
    known = _uuid_lists.get(first) if type(first) is str else None
    if known is not None:
        items, data = known
        size = len(items)
        if len(value) >= size and value[size - 1] == items[-1] and value[:size] == items:
            tail = _uuid_list_bytes(value[size:]) if len(value) > size else b""
            if tail is not None:
                return _remember_list(value, data + tail)
    whole = _uuid_list_bytes(value)
    return None if whole is None else _remember_list(value, whole)


def _remember_list(value: list[Any], data: bytes) -> Ext:
    if len(_uuid_lists) >= _LISTS_LIMIT:
        _uuid_lists.clear()
    _uuid_lists[value[0]] = (value.copy(), data)  # a copy: nobody else can change it
    return Ext(_EXT_UUIDS, data)


def _uuid_list_bytes(value: list[Any]) -> bytes | None:
    """The 16-byte forms of a list of canonical UUID strings, joined; None when any item is
    not one. Checked and converted by whole-string operations (C loops)."""
    if not value:
        return b""
    try:
        joined = "".join(value)
    except TypeError:
        return None
    count = len(value)
    if len(joined) != 36 * count or joined.count("-") != 4 * count:
        return None
    # Each item 36 characters: items of 28 and 44 may still join into two valid UUIDs, which
    # would come back as two other strings.
    if set(map(len, value)) != {36}:
        return None
    dashes = "-" * count
    if not all(joined[at::36] == dashes for at in (8, 13, 18, 23)):
        return None
    digits = joined.replace("-", "")
    if digits != digits.lower():
        return None
    try:
        data = bytes.fromhex(digits)
    except ValueError:
        return None
    return data if len(data) == 16 * count else None


_PLAIN: Final = frozenset({str, int, float, bool, type(None), bytes})
"""The types ``msgspec.to_builtins`` gives back as they are (bytes: as ``encode`` calls it)."""
_RAW: Final = _PLAIN | {list, dict}
_BUILTIN: Final = _RAW | {tuple}
"""What ``to_builtins`` gives (tuples it keeps, and ``_pack`` leaves as they are)."""
_STR: Final = frozenset({str})
_WALKED: Final = frozenset({str, list, dict})


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, builtin_types=(bytes,))


def _pack(value: Any) -> Any:
    """``value``, as ``_builtins`` would give it, with its ids, digests and stamps as exts.

    Lists and dicts are walked as they are; what ``to_builtins`` would change (a Struct, an
    enum, a set, a dict with other than str keys...) is converted where it is found: the
    same builtins as converting the whole record first, without copying it all."""
    kind = type(value)
    if kind is str:
        size = len(value)
        if size == 36:
            ext = _uuid_exts.get(value) or _new_uuid_ext(value)
            if ext is not None:
                return ext
        elif size == 64:
            digest = _hex_digest(value)
            if digest is not None:
                return digest
        if size > 21 and value[13] == "-":  # not a UUID or digest: perhaps an HLC stamp
            return _hlc(value) or value
        return value
    if kind is dict:
        if not _STR.issuperset(map(type, value)):
            value = _builtins(value)  # other keys (to_builtins converts some): as it has them
        return {
            key: _pack(item)
            if item.__class__ is not str or len(item) < DEFLATE_MIN
            else _pack_long(item)
            for key, item in value.items()
        }
    if kind is list:
        return _pack_list(value)
    if kind in _PLAIN:
        return value
    value = _builtins(value)  # a str, list or dict now, or a tuple: left as it is, as before
    return _pack(value) if type(value) in _WALKED else value


def _pack_long(value: str) -> Any:
    """A text of ``DEFLATE_MIN`` characters or more inside a list or a map (a message's
    blocks, an event's payload, a session's state): an HLC stamp as ext 3, else deflated
    (protocol 9) where that pays, else as it is. A record's own fields (its ids, tenant,
    device, stamp, title) are never deflated: their packed bytes are compared (``packed``),
    and deflated bytes may differ from one zlib to another."""
    packed = _pack(value)
    if packed is not value:
        return packed
    deflated = _deflated_exts.get(value, _UNSEEN)
    return (_new_deflated(value) if deflated is _UNSEEN else deflated) or value


def _new_deflated(value: str) -> Ext | None:
    """``value`` as ext 6 when deflating its UTF-8 saves at least an eighth of its bytes and
    stays within ``INFLATE_RATIO``, else None; kept in ``_deflated_exts`` when short enough
    (a session's long texts are encoded again with each of its versions)."""
    try:
        raw = value.encode()
    except UnicodeEncodeError:  # a lone surrogate: leave it to the encoder to refuse
        return None
    data = zlib.compress(raw, _DEFLATE_LEVEL, wbits=-15)
    size = len(data)
    ext = (
        Ext(_EXT_DEFLATED, data)
        if size * 8 <= len(raw) * 7 and len(raw) <= size * INFLATE_RATIO
        else None
    )
    if len(value) <= _DEFLATED_KEPT_MAX:
        global _deflated_held
        if _deflated_held + len(value) > _DEFLATED_BUDGET:
            _deflated_exts.clear()
            _deflated_held = 0
        _deflated_exts[value] = ext
        _deflated_held += len(value)
    return ext


def _pack_list(value: list[Any]) -> Any:
    if len(value) > 1:
        ids = _uuid_list(value)
        if ids is not None:
            return ids
    if not _BUILTIN.issuperset(map(type, value)):
        # UUID objects, enums...: converted, the ids among them may make one ext after all.
        # Once: to_builtins gives builtins only.
        return _pack_list(_builtins(value))
    return [
        _pack(item) if item.__class__ is not str or len(item) < DEFLATE_MIN else _pack_long(item)
        for item in value
    ]


def encode(record: Record) -> bytes:
    """The compact bytes of ``record``. Raises what msgspec raises for unencodable values."""
    kind = _BY_CLASS.get(type(record))
    if kind is None:
        raise TypeError(f"not a record: {type(record).__name__}")
    defaults = kind.defaults
    fields = msgspec.structs.astuple(record)
    values = list(fields)
    # Trailing values equal to their defaults are left out, compared as builtins (as the
    # defaults are). Structs are converted first (convert_first); a list or dict equals an
    # empty default before conversion exactly when after, and _pack converts what is nested
    # in it. Any other type (a tuple where a list is declared, UNSET, an enum...) takes the
    # long way: every field converted, as to_builtins(record) would.
    for i in kind.convert_first:
        values[i] = _field_builtins(values[i], defaults[i])
    if not _RAW.issuperset(map(type, values)):
        values = [_field_builtins(v, default) for v, default in zip(values, defaults, strict=True)]
    end = len(values) if kind.whole else _kept(values, defaults)
    for i, cls, field_defaults in kind.arrays:
        if i < end and type(fields[i]) is cls:  # (its builtins: every field, in order)
            items = list(values[i].values())
            values[i] = items[: _kept(items, field_defaults)]
    if kind.words is not None:
        type_at = kind.words[0]
        word = _WORD_INDEX.get(values[type_at]) if type(values[type_at]) is str else None
        if word is not None:
            values[type_at] = word
    client = values[kind.client_at]
    if type(client) is str and implied_client(values[kind.hlc_at]) == client:
        values[kind.client_at] = None  # the stamp's node names the device (protocol 8)
    packed = [kind.index, *map(_pack, values[:end])]
    if kind.words is not None and kind.words[1] < end:
        payload = packed[kind.words[1] + 1]
        if type(payload) is dict:  # (keyed after _pack: its keys stay text for it)
            packed[kind.words[1] + 1] = _words_keyed(payload)
    return _ENCODER.encode(packed)


def _kept(values: Sequence[Any], defaults: Sequence[Any]) -> int:
    """How many of ``values`` a body writes: trailing values equal to their defaults (the
    value at the same place in ``defaults``) are left out."""
    end = len(values)
    while end and values[end - 1] == defaults[end - 1]:
        end -= 1
    return end


def implied_client(hlc: Any) -> str | None:
    """The device a record's ``hlc`` stamp names (its node: what follows the stamp's second
    dash, as ``shared.clock`` reads it), or None when ``hlc`` is no text with two dashes.

    A record's ``client_id`` that equals it is written as nil, and read back as it: the one
    rule both ways. Every record a device stamps itself has it (the stamp's node is the
    device's id), so its id is not written twice, about 17 bytes a record for a UUID (more
    for a longer id). A record whose ``client_id`` differs from its stamp's node (a stamp
    taken from another device, an id changed since) keeps both as they are."""
    if type(hlc) is not str:
        return None
    parts = hlc.split("-", 2)
    return parts[2] if len(parts) == 3 else None


class Bodies:
    """The compact bytes of records, each encoded at most once, and none encoded that came
    in compact bytes (protocol 6 sends records as their stored bytes).

    ``known`` pairs records with the bytes they were decoded from. ``of(record)`` gives those
    bytes back for the very same object when they are in the compact form; anything else (a
    map-form body, a record made anew from one) is encoded, once. Records are matched by
    identity, never by equality, and each entry holds its record, so the match cannot be
    taken by another object at the same address.
    """

    __slots__ = ("_known",)

    def __init__(self, known: Iterable[tuple[Record, bytes]] = ()) -> None:
        # Whether the bytes are compact is asked when they are used: a page's bodies are
        # paired in C loops (``pairs``), most are used once, and some not at all.
        self._known: dict[int, tuple[Record, bytes]] = {id(r): (r, b) for r, b in known}

    @classmethod
    def pairs(cls, records: Sequence[Record], bodies: Sequence[bytes]) -> Bodies:
        """``Bodies`` of ``records[i]`` in ``bodies[i]`` (as many of each)."""
        if len(records) != len(bodies):
            raise ValueError(f"{len(bodies)} bodies for {len(records)} records")
        made = cls()
        made._known = dict(zip(map(id, records), zip(records, bodies, strict=True), strict=True))
        return made

    def known(self, record: Record) -> bytes | None:
        """The compact bytes ``record`` came in (or was given by ``keep``), or None."""
        known = self._known.get(id(record))
        if known is None or known[0] is not record or not is_compact(known[1]):
            return None
        return known[1]

    def keep(self, record: Record, body: bytes) -> None:
        """Take ``body`` as the compact bytes of ``record`` (which the caller made sure they
        are, as from ``canonical_body``)."""
        self._known[id(record)] = (record, body)

    def of(self, record: Record) -> bytes:
        """The compact bytes of ``record``."""
        known = self._known.get(id(record))
        if known is not None and known[0] is record and is_compact(known[1]):
            return known[1]
        body = encode(record)
        self._known[id(record)] = (record, body)
        return body


def _field_builtins(value: Any, default: Any) -> Any:
    """A field's value as ``to_builtins(record)`` has it (which leaves UNSET fields out)."""
    return default if value is msgspec.UNSET else _builtins(value)


# -- decode --------------------------------------------------------------------------------
# msgspec calls _unext once per ext in a body (about eight in an Event): the hot path.

_HLC_HEAD: Final = struct.Struct(">QB")
"""An HLC ext's first 9 bytes as two numbers: the 48-bit wall and the counter's high 16 bits,
then its low 8."""
_COUNTER_TEXTS: Final = tuple(f"{counter:06d}" for counter in range(1000))
"""Zero-padded counters: formatting with padding costs about 1 µs here, a lookup almost none."""


def _uuid_text(key: bytes) -> str:
    # Three hexes, the middle one dashed every 2 bytes: fewer objects made than cutting one hex
    # into five groups, and a quarter less time.
    return f"{key[:4].hex()}-{key[4:10].hex('-', 2)}-{key[10:].hex()}"


def _unknown_ext(code: int, data: bytes | memoryview) -> msgspec.DecodeError:
    return msgspec.DecodeError(f"unknown ext type {code} ({len(data)} bytes)")


def _new_node_text(key: bytes) -> str:
    """The node of an HLC ext (``key``: its node kind byte, then the node)."""
    kind, node = key[0], key[1:]
    if kind == _NODE_UUID and len(node) == 16:
        text = _uuid_text(node)
    elif kind == _NODE_TEXT:
        try:
            text = node.decode()
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"malformed HLC stamp ({exc})") from None
    else:
        raise msgspec.DecodeError(f"malformed HLC stamp (node kind {kind})")
    return _remember(_node_texts, key, text) if len(key) <= _NODE_CACHE_MAX else text


_UUID_GROUPS: Final = re.compile(r"(.{8})(.{4})(.{4})(.{4})(.{12})", re.DOTALL)
_BULK_UUIDS: Final = 3


def _uuid_list_texts(data: memoryview) -> list[str]:
    """The texts of an ext 4 (16 bytes a UUID), by C loops over the whole list.

    One or two UUIDs: a regex cuts the hex into groups and ``"-".join`` mends each. More: the
    hex dashed every 2 bytes holds each UUID as eight 4-digit groups with a dash after each
    but the last; strided writes mark the three dashes its text has not (after groups 1, 6
    and 7) and make the eighth a newline, then one replace and one split give the texts. A
    fixed cost that one or two UUIDs would not repay, then a quarter of the regex's time a
    UUID (and three quarters of copying the 32 digit columns one by one)."""
    count = len(data) // 16
    if count < _BULK_UUIDS:
        return list(map("-".join, _UUID_GROUPS.findall(data.hex())))
    text = bytearray(data.hex("-", 2), "ascii")
    cut = b"_" * count
    text[4::40] = cut
    text[29::40] = cut
    text[34::40] = cut
    text[39::40] = b"\n" * (count - 1)
    return text.replace(b"_", b"").decode().split("\n")


def _unext(code: int, data: memoryview) -> Any:
    # Most frequent code first, and the frequent work inline: a further Python call would cost
    # about as much as a cache hit does.
    if code == _EXT_UUID:
        key = data.tobytes()  # not the view: its hash is no faster, and a key must outlive it
        text = _uuid_texts.get(key)
        return _new_uuid_text(key) if text is None else text
    if code == _EXT_HEX and len(data) == 32:
        return data.hex()  # a digest rarely repeats: no cache
    if code == _EXT_HLC and len(data) >= 10:
        return _hlc_text(data.tobytes())
    if code == _EXT_UUIDS and len(data) % 16 == 0:
        return _uuid_list_texts(data) if len(data) < 16 * _ID_LISTS_MIN else _id_list(data)
    if code == _EXT_DEFLATED:
        return _inflate(data)
    raise _unknown_ext(code, data)


def _inflate(data: bytes | memoryview) -> str:
    """The text an ext 6 stands for. ``msgspec.DecodeError`` for bytes that are not one whole
    raw deflate stream, that inflate past ``INFLATE_RATIO`` times their size (inflating stops
    there: a peer's body costs at most that much memory), or whose text is not UTF-8."""
    inflater = zlib.decompressobj(-15)
    try:
        # One byte past the ratio: a text of exactly the ratio still reaches its stream's end.
        raw = inflater.decompress(data, INFLATE_RATIO * len(data) + 1)
    except zlib.error as exc:
        raise msgspec.DecodeError(f"malformed deflated text ({exc})") from None
    if (
        not inflater.eof
        or inflater.unconsumed_tail
        or inflater.unused_data
        or len(raw) > INFLATE_RATIO * len(data)
    ):
        raise msgspec.DecodeError(
            f"malformed deflated text ({len(data)} bytes: cut short, followed by more, or "
            f"inflating past {INFLATE_RATIO} times its size)"
        )
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"malformed deflated text ({exc})") from None


def _new_uuid_text(key: bytes) -> str:
    """The text of an ext 1 not in the cache (``key``: its bytes), then cached both ways."""
    if len(key) != 16:
        raise _unknown_ext(_EXT_UUID, key)
    text = f"{key[:4].hex()}-{key[4:10].hex('-', 2)}-{key[10:].hex()}"  # _uuid_text
    if len(_uuid_texts) >= _CACHE_LIMIT:
        _uuid_texts.clear()
    _uuid_texts[key] = text
    # The way back too: a record just read is often keyed or encoded next (a pulled page is
    # stored by its ids), and this text is canonical, so its ext is this one.
    if len(_uuid_exts) >= _CACHE_LIMIT:
        _uuid_exts.clear()
    _uuid_exts[text] = Ext(_EXT_UUID, key)
    return text


def _hlc_text(raw: bytes) -> str:
    """The stamp an ext 3 stands for (``raw``: its bytes, at least 10)."""
    return _stamp(raw)[0]


def _stamp(raw: bytes) -> tuple[str, str]:
    """The stamp an ext 3 stands for and its node, the device ``implied_client`` reads from
    the stamp's text (``raw``: its bytes; at least 10, else the ext is refused). A twin's
    ``make`` takes both at once: a record of this device's writes its ``client_id`` as nil,
    and splitting the stamp's text again for it cost about a tenth of a message's decode."""
    if len(raw) < 10:
        raise _unknown_ext(_EXT_HLC, raw)
    node = _node_texts.get(raw[9:])
    if node is None:
        node = _new_node_text(raw[9:])
    head, counter_low = _HLC_HEAD.unpack_from(raw)
    wall = head >> 16
    counter = (head & 0xFFFF) << 8 | counter_low
    if 10**12 <= wall < 10**13 and counter < 1000:  # 13 digits, a counter in the table
        return f"{wall}-{_COUNTER_TEXTS[counter]}-{node}", node
    return f"{wall:013d}-{counter:06d}-{node}", node  # early walls, busy ms, odd bytes


def _id_list(data: memoryview) -> list[str]:
    """``_uuid_list_texts`` of a long list, by way of ``_id_lists``: a session's message ids
    come again and again, a turn's few more each time (the server reads a session row as
    pushed and as stored, each device as pulled), so a list that extends one decoded before,
    byte for byte, converts only its new tail, and one that the list decoded before extends
    converts none. Each call gives a new list."""
    global _id_lists_held
    raw = data.tobytes()
    key = raw[:16]
    known = _id_lists.get(key)
    if known is not None and raw.startswith(known[0]):
        size = len(known[0])
        texts = [*known[1], *_uuid_list_texts(data[size:])] if len(raw) > size else [*known[1]]
    elif known is not None and known[0].startswith(raw):
        # A list the one kept extends (the row as stored, read after the version pushed
        # was decoded; another device's older copy): its head, and the longer one is kept.
        return list(known[1][: len(raw) // 16])
    else:
        texts = _uuid_list_texts(data)
    count = len(texts)
    if known is not None:
        _id_lists_held -= len(known[1])
    if _id_lists_held + count > _ID_LISTS_BUDGET:
        _id_lists.clear()
        _id_lists_held = 0
    if count <= _ID_LISTS_BUDGET:
        _id_lists[key] = (raw, tuple(texts))
        _id_lists_held += count
    return texts


_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_unext)


def _body_type(kind: _Kind) -> type[msgspec.Struct]:
    """What a compact body of ``kind`` decodes into in one typed pass: an array-like Struct
    tagged by the kind's index, then the record's fields in order, each ``Any`` (msgspec hands
    an ext to the hook only where any value may be) with the record's own default."""
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(kind.cls):
        if f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, Any, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, Any, msgspec.field(default=f.default)))
    return msgspec.defstruct(
        f"{kind.cls.__name__}Body",
        fields,
        array_like=True,
        kw_only=True,  # as the records: a required field may follow a defaulted one
        tag=kind.index,
        tag_field="record_kind",  # any name but a field's (not "type"): the tag has no key
        forbid_unknown_fields=True,  # values beyond the last field: refused, not dropped
        gc=False,
    )


_asdict: Final = msgspec.structs.asdict  # bound once: decode calls them for every record
_convert: Final = msgspec.convert
_BODY_TYPES: Final = {_body_type(kind): kind.cls for kind in _BY_INDEX}
_BODY_DECODER: Final = msgspec.msgpack.Decoder(
    Union[tuple(_BODY_TYPES)],  # noqa: UP007 (types built at run time: no | to write)
    ext_hook=_unext,
)
_ARRAY_HEADS: Final = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
"""The first bytes of a msgpack array (the compact form; a map-form body starts as a map)."""


def is_compact(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts as a msgpack array (the compact form) rather than a map."""
    return bool(data) and data[0] in _ARRAY_HEADS


# -- decode, the fast path: each kind's native twin ------------------------------------------
# A kind whose fields are all text, lists of text, numbers, flags, literals, JSON (``Any``)
# and Structs of such has a twin: an array-like Struct with the record's own field types,
# except that a text may also be an Ext and a list of text an ext 4 (``_twin_annotation``).
# msgspec reads a body into it natively, checking every type as ``convert`` would; only the
# exts that stand for text are left to Python, by the kind's ``make`` function, which then
# builds the record with its keywords (no dict of the fields, no second validation). JSON
# values (``Any``: a payload, a message's blocks) still meet the ext hook. A body the twin
# refuses (a value of another type, an ext where none can be, an ext of another kind, a
# packed string in a nested Struct) takes the typed path below, which gives what it always
# gave; the twin only ever reads a body that path reads alike (``tests/test_compact.py``).


class _NotText(Exception):
    """An ext where text was expected that stands for no text (or a list where a list of
    text was expected that is no ext 4): the twin refuses the body."""


_TEXT: Final = "text"
_TEXTS: Final = "texts"
_KEYS: Final = "keys"
_STRUCT: Final = "struct"
_TWIN_PLAIN: Final = frozenset({int, bool, float, bytes, type(None), Any})


def _default_of(f: msgspec.structs.FieldInfo) -> Any:
    """A twin's field's default, as its record's (none when it has none)."""
    if f.default_factory is not msgspec.NODEFAULT:
        return msgspec.field(default_factory=f.default_factory)
    return msgspec.field(default=f.default)  # (NODEFAULT: no default)


def _array_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """The twin of a Struct a body writes as an array (``_ARRAY_STRUCTS``): array-like, with
    its fields' own types and defaults, no more values than it has fields (as the typed path,
    which reads a longer array as no record). A text in it that was packed as an ext is
    refused: the typed path reads it."""
    fields = [(f.name, f.type, _default_of(f)) for f in msgspec.structs.fields(cls)]
    return msgspec.defstruct(
        f"{cls.__name__}Twin", fields, array_like=True, forbid_unknown_fields=True, gc=False
    )


def _from_array_twin(cls: type[msgspec.Struct]) -> Callable[[Any], Any]:
    """A function giving the ``cls`` its array twin read (its fields' values, checked by the
    decode), or the value as it is when it is one already (a field's default)."""
    names = [f.name for f in msgspec.structs.fields(cls)]
    source = (
        "def struct(v):\n"
        "    if v.__class__ is cls: return v\n"
        "    if v.__class__ is dict: return as_struct(v)\n"
        f"    return cls({', '.join(f'{n}=v.{n}' for n in names)})\n"
    )

    def as_struct(value: dict[str, Any]) -> Any:
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError:
            raise _NotText from None  # (the twin refuses the body: the typed path says why)

    scope: dict[str, Any] = {"cls": cls, "as_struct": as_struct}
    exec(compile(source, f"<compact twin of {cls.__name__}>", "exec"), scope)
    made: Callable[[Any], Any] = scope["struct"]
    return made


_ARRAY_TWINS: Final = {cls: _array_twin(cls) for cls in _ARRAY_STRUCTS}
_FROM_ARRAY_TWINS: Final = {cls: _from_array_twin(cls) for cls in _ARRAY_STRUCTS}


def _twin_annotation(annotation: Any) -> tuple[Any, str | None] | None:
    """The twin's type of a field annotated ``annotation`` and what ``make`` does to its value
    (``_TEXT``: an Ext to its text; ``_TEXTS``: an ext 4, or Exts in a list, to texts; None:
    nothing), or None when the field has no native twin (the kind then has none)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is str:
        return Union[str, Ext], _TEXT  # noqa: UP007 (a runtime type)
    if annotation in _ARRAY_TWINS:  # (an audit row's outcome and usage)
        # The array, or the map a body before protocol 8 wrote (and one still writes for a
        # field left UNSET): read whole, then converted as the typed path converts it.
        return Union[_ARRAY_TWINS[annotation], dict[str, Any]], _STRUCT  # noqa: UP007
    if annotation == list[str]:
        return Union[list[Union[str, Ext]], Ext], _TEXTS  # noqa: UP007
    if annotation in _TWIN_PLAIN or origin is Literal:
        return annotation, None
    if origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        (inner,) = (arg for arg in args if arg is not type(None))
        twin = _twin_annotation(inner)
        if twin is None:
            return None
        return twin[0] | None, twin[1]
    if origin in (Union, types.UnionType) and all(arg in _TWIN_PLAIN for arg in args):
        return annotation, None
    if origin is dict and args[0] is str and _twin_annotation(args[1]) == (args[1], None):
        return annotation, None  # JSON (Any) or plain values: exts in it meet the hook
    if origin is list and _twin_annotation(args[0]) == (args[0], None):
        return annotation, None
    # Anything else has no twin, a Struct in the record written as a map included: read
    # natively from its map, a Struct skips the keys it does not know without reading them
    # (text that is no UTF-8, a malformed ext), where the typed path refuses them. (A Struct
    # written as an array has a twin of its own, above; its map form is read as a dict.)
    return None


def _ext_text(ext: Ext) -> str:
    """The text an ext 1, 2, 3 or 6 stands for, as the ext hook gives it (and its errors, for
    malformed bytes); ``_NotText`` for an ext of any other code."""
    code = ext.code
    data: bytes = ext.data  # type: ignore[assignment]  # (bytes, as msgspec decodes an ext)
    if code == _EXT_UUID:
        text = _uuid_texts.get(data)
        return _new_uuid_text(data) if text is None else text
    if code == _EXT_HEX and len(data) == 32:
        return data.hex()
    if code == _EXT_HLC and len(data) >= 10:
        return _hlc_text(data)
    if code == _EXT_DEFLATED:
        return _inflate(data)
    if code in (_EXT_HEX, _EXT_HLC):
        raise _unknown_ext(code, data)
    raise _NotText


def _ext_texts(value: Any) -> list[str]:
    """The texts of a list of text as the twin read it: an ext 4 (decoded as the hook does),
    or a list whose Exts (ext 1, 2 or 3) are replaced by their texts. ``_NotText`` when it is
    an ext of another code."""
    if value.__class__ is Ext:
        if value.code != _EXT_UUIDS:
            raise _NotText
        texts: list[str] = _unext(_EXT_UUIDS, memoryview(value.data))
        return texts
    if Ext in set(map(type, value)):
        return [item if item.__class__ is str else _ext_text(item) for item in value]
    return cast(list[str], value)


def _implied_or_refused(hlc: Any) -> str:
    """The device a nil ``client_id`` stands for (``implied_client``); ``_NotText`` when the
    stamp names none (the twin refuses the body, and the typed path says why)."""
    client = implied_client(hlc)
    if client is None:
        raise _NotText
    return client


def _fields_read(fields: dict[str, Any]) -> dict[str, Any]:
    """A body's fields as the record reads them (the typed and the generic reads; the twin's
    ``make`` does the same): a nil ``client_id`` as the device its stamp names, a Struct
    written as an array (``_ARRAY_STRUCTS``) as the map of its fields, and an event's type and
    payload keys given as ``WORDS`` indexes as their words. A value none of these reads (a
    stamp that names no device, more values than the Struct has fields, an index ``WORDS``
    does not have) is left as it is, for the record's validation to refuse."""
    if fields.get("client_id", "") is None:
        client = implied_client(fields.get("hlc"))
        if client is not None:
            fields["client_id"] = client
    for name, names in _ARRAY_FIELDS:
        value = fields.get(name)
        if type(value) is list and len(value) <= len(names):
            fields[name] = dict(zip(names, value))  # noqa: B905 (shorter: defaults)
    if "type" in fields:  # an event (the one kind with a type): its ``WORDS`` indexes
        word, payload = fields["type"], fields.get("payload")
        with contextlib.suppress(_NotText):  # (left as they are: the record refuses them)
            if type(word) is int:
                fields["type"] = _word(word)
            if type(payload) is dict:
                fields["payload"] = _keys_read(payload)
    return fields


if [kind.cls for kind in _BY_INDEX if "type" in kind.names] != [Event]:  # pragma: no cover
    raise TypeError("only an Event may have a field named type (``_fields_read``)")
_ARRAY_FIELDS: Final = tuple(
    {
        (kind.names[i], tuple(f.encode_name for f in msgspec.structs.fields(cls)))
        for kind in _BY_INDEX
        for i, cls, _ in kind.arrays
    }
)
"""Each record field that a body may hold as an array, and its Struct's field names."""


def _twin(
    kind: _Kind, given: int = 0, node: bool = False
) -> tuple[type[msgspec.Struct], Callable[..., Record]] | None:
    """A kind's twin and its ``make`` function (the twin's values to the record), or None
    when one of its fields has no native twin (a Session: its state holds packed id lists).
    ``given``: how many of the record's first fields the twin leaves out, for ``make`` to
    take as its arguments after the twin (a short body's: ``decode_short``); ``node``:
    ``make`` takes one more, the stamp's node its ext left out (``short_body``'s ``node``),
    to put after the ext's bytes.

    ``make`` is written out for the kind, one line a field, and compiled once, as
    ``dataclasses`` writes ``__init__``: a loop over the fields costs more than the decode
    saves. Its source is kept as ``make.source``."""
    hints = typing.get_type_hints(kind.cls)
    fields: list[tuple[str, Any, Any]] = []
    structs: dict[str, Callable[[Any], Any]] = {}
    tail = ", tail" if node else ""
    lines = ["def make(t" + "".join(f", g{at}" for at in range(given)) + tail + "):"]
    arguments = []
    for at, f in enumerate(msgspec.structs.fields(kind.cls)):
        if at < given:
            arguments.append(f"{f.name}=g{at}")
            continue
        twin = _twin_annotation(hints[f.name])
        if twin is None:
            return None
        annotation, fix = twin
        if f.encode_name == "client_id":  # nil: the stamp's node (``implied_client``)
            annotation = annotation | None
        if kind.words is not None and at in kind.words:  # an index in ``WORDS``
            annotation = annotation | int if at == kind.words[0] else dict[str | int, Any]
            fix = fix or _KEYS
        fields.append((f.name, annotation, _default_of(f)))
        if fix is None:
            arguments.append(f"{f.name}=t.{f.name}")
            continue
        lines.append(f"    v{at} = t.{f.name}")
        if fix == _KEYS:
            lines.append(f"    v{at} = keys(v{at})")
        elif fix == _TEXT and at == kind.hlc_at:  # the stamp, and its node (``_stamp``)
            lines.append(f"    n{at} = None")
            lines.append(f"    if v{at}.__class__ is Ext:")
            data = f"v{at}.data + tail" if node else f"v{at}.data"
            lines.append(f"        if v{at}.code == 3: v{at}, n{at} = stamp({data})")
            lines.append(f"        else: v{at} = text(v{at})")
        elif fix == _TEXT:  # a known id by a lookup here, a digest here, anything else by
            # ``_ext_text`` (as it reads an ext 2: a digest rarely repeats, so no cache)
            lines.append(f"    if v{at}.__class__ is Ext:")
            lines.append(f"        c = v{at}.code")
            lines.append(f"        if c == 1: v{at} = known(v{at}.data) or text(v{at})")
            lines.append(f"        elif c == 2 and len(v{at}.data) == 32: v{at} = v{at}.data.hex()")
            lines.append(f"        else: v{at} = text(v{at})")
            if kind.words is not None and at == kind.words[0]:
                word = f"words(v{at}) or word(v{at})"  # (``word`` refuses what has none)
                lines.append(f"    elif v{at}.__class__ is int: v{at} = {word}")
        elif fix == _STRUCT:  # its array twin, checked by the decode, as the Struct
            lines.append(f"    v{at} = struct{at}(v{at})")
            structs[f"struct{at}"] = _FROM_ARRAY_TWINS[hints[f.name]]
        else:
            lines.append(f"    if v{at} is not None: v{at} = texts(v{at})")
        arguments.append(f"{f.name}=v{at}")
    client, hlc, found = f"v{kind.client_at}", f"v{kind.hlc_at}", f"n{kind.hlc_at}"
    lines.append(f"    if {client} is None: {client} = {found} or implied({hlc})")
    lines.append(f"    return cls({', '.join(arguments)})")
    cls = msgspec.defstruct(
        f"{kind.cls.__name__}Twin" + (f"Less{given}" if given else ""),
        fields,
        array_like=True,
        kw_only=True,
        tag=kind.index,
        tag_field="record_kind",
        forbid_unknown_fields=True,
        gc=False,
    )
    source = "\n".join(lines)
    scope: dict[str, Any] = {
        "Ext": Ext,
        "known": _uuid_texts.get,  # (the caches are emptied in place, never replaced)
        "text": _ext_text,
        "texts": _ext_texts,
        "implied": _implied_or_refused,
        "stamp": _stamp,
        "word": _word,
        "words": _WORD_OF.get,
        "keys": _keys_read,
        "cls": kind.cls,
        **structs,
    }
    exec(compile(source, f"<compact twin of {kind.cls.__name__}>", "exec"), scope)
    make = scope["make"]
    make.source = source
    return cls, make


_TWIN_OF: Final = {kind.index: _twin(kind) for kind in _BY_INDEX}
_TWINS: Final = {twin[0]: twin[1] for twin in _TWIN_OF.values() if twin is not None}
"""Each twin's ``make``."""
_TWIN_KINDS: Final = frozenset(index for index, twin in _TWIN_OF.items() if twin is not None)
"""The kind indexes that have a twin: every kind but ``Session``, whose state is a Struct
written as a map (an audit row's outcome and usage are arrays, which their own twins read)."""
_TWIN_DECODER: Final = msgspec.msgpack.Decoder(
    Union[tuple(_TWINS)],  # noqa: UP007
    ext_hook=_unext,
)
_KIND_AT: Final = {0xDC: 3, 0xDD: 5}
"""Where a compact body's kind index is: after the array's head (one byte, or a length)."""


def _decode_twin(data: bytes | memoryview) -> Record | None:
    """The record in the compact ``data`` read by its kind's twin, or None when the twin
    refuses it or its kind has none: the caller then reads it the typed way."""
    at = _KIND_AT.get(data[0], 1)
    if len(data) <= at or data[at] not in _TWIN_KINDS:
        return None
    try:
        twin = _TWIN_DECODER.decode(data)
        return _TWINS[twin.__class__](twin)
    except (msgspec.DecodeError, msgspec.ValidationError, _NotText):
        return None


def decode(data: bytes | memoryview) -> Record:
    """The record in ``data`` (compact or map form). Raises ``msgspec.DecodeError`` when the
    bytes are corrupt and ``msgspec.ValidationError`` when they decode to no valid record."""
    if not data or data[0] not in _ARRAY_HEADS:  # is_compact, inline
        return decode_record(data)  # the map form (or garbage, which it refuses)
    twin = _decode_twin(data)
    if twin is not None:
        return twin
    try:
        body = _BODY_DECODER.decode(data)
        # A dict of the fields, then convert: a little cheaper than from_attributes=True.
        record: Record = _convert(_fields_read(_asdict(body)), _BODY_TYPES[type(body)])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _decode_values(data)  # refused: what reading it value by value gives, error and all
    return record


def _decode_values(data: bytes | memoryview) -> Record:
    """``decode`` of a compact body the generic way: a list of values, then a dict of the
    fields. Slower; it gives what ``decode`` gives, and says why a body is refused."""
    raw = _DECODER.decode(data)
    index = raw[0] if raw else None
    if type(index) is not int or not 0 <= index < len(_BY_INDEX):
        raise msgspec.ValidationError(f"unknown record kind {index!r}")
    kind = _BY_INDEX[index]
    if len(raw) > len(kind.names) + 1:
        raise msgspec.ValidationError(f"{len(raw) - 1} values for {len(kind.names)} fields")
    # One dict and one convert: msgspec validates every field (and fills the defaults of
    # those left out) as for a map-form body. zip stops at the values on purpose; strict=False
    # would cost 0.6 µs a record (keywords take a slow path through zip on 3.11).
    fields = dict(zip(kind.names, raw[1:]))  # noqa: B905
    record: Record = msgspec.convert(_fields_read(fields), kind.cls)
    return record


def _head_decoder(kind: str, last: str, last_type: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder of a compact ``kind`` body's fields up to ``last``: the kind index, the fields
    before ``last`` left unread (``Raw``), ``last`` as ``last_type`` (``Raw`` keeps its packed
    bytes). A reader that needs one field decodes only that much of each body."""
    names = _BY_INDEX[KINDS.index(kind)].names
    fields: list[tuple[str, Any]] = [("kind", int)]
    fields += [(f"_{name}", msgspec.Raw) for name in names[: names.index(last)]]
    fields.append(("last", last_type))
    return msgspec.msgpack.Decoder(msgspec.defstruct(f"{kind}Head", fields, array_like=True))


def _read_head(decoder: msgspec.msgpack.Decoder[Any], index: int, data: bytes) -> Any:
    """The head ``decoder`` reads of the compact body ``data`` of the kind at ``index`` in
    ``KINDS``; None when ``data`` is not such a body (the map form, another kind, corrupt
    bytes): the caller then decodes it whole, which tells."""
    if not is_compact(data):
        return None
    try:
        head = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return head if head.kind == index else None


_EVENT_HEAD: Final = _head_decoder("Event", "type", Union[str, int])  # noqa: UP007
_EVENT_INDEX: Final = KINDS.index("Event")
_CHECKPOINT_HEAD: Final = _head_decoder("Checkpoint", "parent_id", msgspec.Raw)
_CHECKPOINT_INDEX: Final = KINDS.index("Checkpoint")


def event_type(data: bytes) -> str | None:
    """The ``type`` of the Event in compact ``data``, read without decoding the rest (about a
    tenth of ``decode``); None when ``data`` is not a compact Event body."""
    head = _read_head(_EVENT_HEAD, _EVENT_INDEX, data)
    if head is None:
        return None
    try:
        return str(head.last) if type(head.last) is str else _word(head.last)
    except _NotText:
        return None  # no such word: the caller decodes it whole, which refuses it


def _payload_decoder() -> msgspec.msgpack.Decoder[Any]:
    """A decoder of a compact Event body's kind index, ``type`` and ``payload`` (the field
    after it), the fields before left unread; the payload's exts are converted as ``decode``
    converts them, and a payload left out as its default reads as the default."""
    names = _BY_INDEX[_EVENT_INDEX].names
    at = names.index("type")
    if names[at + 1] != "payload":
        raise TypeError("an Event's payload must follow its type")  # a reordered record
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [("kind", int)]
    fields += [(f"_{name}", msgspec.Raw) for name in names[:at]]
    # The payload as the record types it: a value ``decode`` would refuse is refused here too.
    event_fields = msgspec.structs.fields(_BY_INDEX[_EVENT_INDEX].cls)
    payload_type = next(f.type for f in event_fields if f.encode_name == "payload")
    if payload_type != dict[str, Any]:
        raise TypeError("an Event's payload must be a JSON object")  # (keys: ``WORDS``)
    fields += [
        ("type", Union[str, int]),  # noqa: UP007
        ("payload", dict[Union[str, int], Any], msgspec.field(default_factory=dict)),  # noqa: UP007
    ]
    head = msgspec.defstruct("EventPayloadHead", fields, array_like=True)
    return msgspec.msgpack.Decoder(head, ext_hook=_unext)


_EVENT_PAYLOAD: Final = _payload_decoder()


def event_payload(data: bytes) -> tuple[str, dict[str, Any]] | None:
    """The ``type`` and ``payload`` of the Event in compact ``data``, read without decoding
    the rest; None when ``data`` is not a compact Event body (the caller then decodes it
    whole, which tells)."""
    head = _read_head(_EVENT_PAYLOAD, _EVENT_INDEX, data)
    if head is None:
        return None
    try:
        kind = head.type if type(head.type) is str else _word(head.type)
        return kind, _keys_read(head.payload)
    except _NotText:
        return None  # no such word: the caller decodes it whole, which refuses it


def _place_decoder() -> msgspec.msgpack.Decoder[Any]:
    """A decoder of a compact Event body's id and place: the kind index, ``id`` (through the
    ext hook), the fields up to ``payload`` left unread (``Raw``), then ``sequence_number``,
    ``prev_hash``, ``row_hash`` and ``canonical`` as ``decode`` gives them (their defaults when
    left out)."""
    names = _BY_INDEX[_EVENT_INDEX].names
    tail = ["payload", "sequence_number", "prev_hash", "row_hash", "canonical"]
    if names[0] != "id" or names[-len(tail) :] != tail:
        raise TypeError("an Event's place must be its last fields")  # a reordered record
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [("kind", int), ("id", Any)]
    fields += [(f"_{name}", msgspec.Raw) for name in names[1 : -len(tail)]]
    fields += [
        ("_payload", msgspec.Raw, msgspec.Raw(_ENCODER.encode({}))),
        ("sequence_number", int, 0),
        ("prev_hash", Any, ""),
        ("row_hash", Any, ""),
        ("canonical", bool, False),
    ]
    head = msgspec.defstruct("EventPlaceHead", fields, array_like=True)
    return msgspec.msgpack.Decoder(head, ext_hook=_unext)


_EVENT_PLACE: Final = _place_decoder()


def event_place(data: bytes) -> tuple[str, int, str, str, bool] | None:
    """``(id, sequence_number, prev_hash, row_hash, canonical)`` of the Event in compact
    ``data``, read without decoding its payload; None when ``data`` is not a compact Event
    body whose id and hashes are text (the caller then decodes it whole, which tells)."""
    head = _read_head(_EVENT_PLACE, _EVENT_INDEX, data)
    if head is None:
        return None
    place = (head.id, head.sequence_number, head.prev_hash, head.row_hash, head.canonical)
    if not (type(head.id) is type(head.prev_hash) is type(head.row_hash) is str):
        return None
    return place


_FIXARRAY: Final = 0x90
_EVENT_FIELDS: Final = len(_BY_INDEX[_EVENT_INDEX].names)
if _BY_INDEX[_EVENT_INDEX].names[-1] != "canonical":  # pragma: no cover - a reordered record
    raise TypeError("an Event's canonical flag must be its last field")
_PROVISIONAL_HEAD: Final = bytes((_FIXARRAY + _EVENT_FIELDS, _EVENT_INDEX))
"""A compact Event body with every field but ``canonical`` (left out: its default, False)."""
_TRUE: Final = b"\xc3"
_FALSE: Final = b"\xc2"
_WHOLE_HEAD: Final = bytes((_FIXARRAY + _EVENT_FIELDS + 1, _EVENT_INDEX))
"""A compact Event body with every field, ``canonical`` last (protocol 8 writes them all)."""


def canonical_body(data: bytes) -> bytes | None:
    """The compact body of the Event in ``data`` marked ``canonical``, made from the bytes
    alone. From protocol 8 an event's body writes every field, its flag last (``False``, one
    byte), so the canonical body is the same bytes with that one byte ``True``: a row marked
    canonical keeps its size (a row that grew by a byte split full pages, a third of the
    events' pages after a full sync). A body of the form before leaves the flag out (a
    provisional event holds every field before it: it has hashes), and the canonical body is
    the same array one longer, ending in ``True``. ``data`` itself when it is canonical
    already; None for any other body (the map form, a body with trailing defaults left out,
    other kinds): the caller decodes, replaces and encodes it. Either way, encoding the event
    marked canonical in the same form gives the same bytes."""
    if data[:2] == _WHOLE_HEAD and data[-1:] == _FALSE:
        return data[:-1] + _TRUE  # the flag in place: the row keeps its size
    if data[:2] == _PROVISIONAL_HEAD:
        return bytes((_FIXARRAY + _EVENT_FIELDS + 1,)) + data[1:] + _TRUE
    if data[:2] == _WHOLE_HEAD and data[-1:] == _TRUE:
        return data
    return None


_VALUES: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_PAYLOAD_KEYS: Final = msgspec.msgpack.Decoder(dict[Union[str, int], msgspec.Raw])  # noqa: UP007
_MAP_HEADS: Final = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_NIL: Final = msgspec.Raw(b"\xc0")


def explicit(data: _B) -> _B | bytes:
    """``data`` as a peer before protocol 8 reads it: its ``client_id`` written out where it
    is implied (nil: the device its stamp names, ``implied_client``), its Structs written as
    arrays (``_ARRAY_STRUCTS``) as the maps of every field they were, an event's ``WORDS``
    indexes as their words and its trailing defaults left out: the same bytes this codec
    wrote before protocol 8, every other value's bytes as they are. Any other body (the map
    form, one in that form already, one that does not decode: the receiver refuses it as it
    would have) is ``data`` itself; it never raises (it runs on a server's way out, over
    bytes another peer pushed)."""
    if not is_compact(memoryview(data)):
        return data
    changed = False
    try:
        values = _VALUES.decode(data)
        index = msgspec.msgpack.decode(values[0]) if values else None
        if type(index) is not int or not 0 <= index < len(_BY_INDEX):
            return data
        kind = _BY_INDEX[index]
        if len(values) > len(kind.names) + 1:
            return data  # more values than fields: refused by any decode, sent as it is
        at = kind.client_at + 1
        if len(values) > kind.hlc_at + 1 and values[at] == _NIL:
            client = implied_client(_DECODER.decode(values[kind.hlc_at + 1]))
            if client is not None:
                values[at] = msgspec.Raw(_ENCODER.encode(_pack(client)))
                changed = True
        for i, cls, _ in kind.arrays:
            if len(values) > i + 1 and memoryview(values[i + 1])[0] in _ARRAY_HEADS:
                names = [f.encode_name for f in msgspec.structs.fields(cls)]
                items = _DECODER.decode(values[i + 1])
                if len(items) > len(names):
                    return data
                struct: Any = msgspec.convert(dict(zip(names, items)), cls)  # noqa: B905
                values[i + 1] = msgspec.Raw(_ENCODER.encode(_pack(_builtins(struct))))
                changed = True
        if kind.words is not None:
            type_at, payload_at = (at + 1 for at in kind.words)
            if len(values) > type_at and memoryview(values[type_at])[0] < 0x80:
                word = _word(msgspec.msgpack.decode(values[type_at]))  # (a positive fixint)
                values[type_at] = msgspec.Raw(_ENCODER.encode(word))
                changed = True
            if len(values) > payload_at and memoryview(values[payload_at])[0] in _MAP_HEADS:
                keys = _PAYLOAD_KEYS.decode(values[payload_at])
                if any(type(key) is int for key in keys):
                    payload = _keys_read(_DECODER.decode(values[payload_at]))
                    values[payload_at] = msgspec.Raw(_ENCODER.encode(_pack(payload)))
                    changed = True
        if kind.whole:  # the form before left trailing defaults out
            end = 1 + _kept(values[1:], kind.packed_defaults)
            if end < len(values):
                values = values[:end]
                changed = True
    except (msgspec.DecodeError, msgspec.ValidationError, _NotText):
        return data
    return _ENCODER.encode(values) if changed else data


_DEFLATED_HEAD: Final = re.compile(
    rb"\xc7[\s\S]\x06|\xc8[\s\S]{2}\x06|\xc9[\s\S]{4}\x06|[\xd4-\xd8]\x06"
)
"""Bytes that may start an ext 6 (ext 8, 16, 32 or a fixext, then the code): a body without
them holds no deflated text (a body with them may still hold none: the bytes can be text)."""


def _inflated_or_kept(code: int, data: memoryview) -> Any:
    return _inflate(data) if code == _EXT_DEFLATED else Ext(code, data.tobytes())


_AS_WRITTEN: Final = msgspec.msgpack.Decoder(ext_hook=_inflated_or_kept)


def inflated(data: _B) -> _B | bytes:
    """``data`` as a peer before protocol 9 reads it: each deflated text (ext 6) written out
    as its text, every other value as it was (its exts too). ``data`` itself when it holds
    none, and when it does not decode (the receiver refuses it as it would have); it never
    raises (it runs on a server's way out, over bytes another peer pushed). Written out, a
    body may be up to ``INFLATE_RATIO`` times its bytes: a server cuts a pull page for such a
    peer to its byte budget as written out (``pleach_server.connection.written_out``)."""
    if _DEFLATED_HEAD.search(data) is None:
        return data
    try:
        values = _AS_WRITTEN.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return data
    written = _ENCODER.encode(values)
    return data if written == bytes(data) else written


def uuid_bytes(value: str) -> bytes | None:
    """The 16 bytes of ``value`` when it is a canonical (lowercase) UUID, else None: the rule
    and the bounded cache by which ``encode`` packs ids (a store keying its rows by them
    converts exactly the ids a body holds as ext 1)."""
    ext = _uuid_exts.get(value) or (_new_uuid_ext(value) if len(value) == 36 else None)
    if ext is None:
        return None
    data: bytes = ext.data  # type: ignore[assignment]  # (made from bytes; no ``cast`` call)
    return data


def digest_bytes(value: str) -> bytes | None:
    """The 32 bytes of ``value`` when it is a 64-character lowercase hex digest, else None:
    the rule by which ``encode`` packs hashes (ext 2), for a store keeping them as bytes."""
    ext = _hex_digest(value) if len(value) == 64 else None
    return None if ext is None else cast(bytes, ext.data)  # (made from bytes, above)


def uuids_bytes(values: Sequence[str]) -> bytes | None:
    """The 16 bytes of each of ``values`` joined, when every one is a canonical (lowercase)
    UUID, else None: ``uuid_bytes`` of a whole list at once, by C loops (a store keying a
    transcript's rows converts its ids in about a fifth of the time of one by one)."""
    return _uuid_list_bytes(values if type(values) is list else list(values))


def id_list_bytes(values: list[str]) -> bytes | None:
    """``uuids_bytes`` of a list that ``encode`` packs as one ext (a session's message ids),
    by way of the same cache: a list that extends one converted before converts only its new
    tail. None when any item is not a canonical UUID."""
    ext = _uuid_list(values) if values else None
    if ext is None:
        return b"" if not values else None
    data: bytes = ext.data  # type: ignore[assignment]  # (made from bytes; no ``cast`` call)
    return data


def id_list_texts(data: bytes) -> list[str]:
    """The UUID texts of ``data``, 16 bytes each (``id_list_bytes`` reversed), as ``decode``
    reads an id list: a long list that extends one read before converts only its new tail.
    Each call gives a new list. ``msgspec.DecodeError`` when ``data`` is not whole UUIDs."""
    texts: list[str] = _unext(_EXT_UUIDS, memoryview(data))
    return texts


def learn_uuids(pairs: Sequence[tuple[bytes, str]]) -> None:
    """Tell the decode cache the texts of UUIDs whose 16 bytes a reader holds already: a store
    reading rows by the ids it was asked for (a transcript's messages) knows each row's id
    as text and as its key, so the bodies it decodes next find their ids by a lookup instead
    of converting each one (about a quarter of decoding a message the cache has not seen).
    Give only exact pairs: ``key == uuid_bytes(text)``. Bounded as the cache is: emptied
    first when the pairs would take it past ``_CACHE_LIMIT``; more pairs than that are not
    taken (the reader gives them a part at a time)."""
    if len(pairs) > _CACHE_LIMIT:
        return
    if len(_uuid_texts) + len(pairs) > _CACHE_LIMIT:
        _uuid_texts.clear()
    _uuid_texts.update(pairs)


def uuid_text(key: bytes) -> str:
    """The canonical text of the UUID whose 16 bytes are ``key`` (``uuid_bytes`` reversed)."""
    return _uuid_text(key)


def packed(value: str | None) -> bytes:
    """``value`` as a compact body holds it (an id as its ext, None as nil). The packing is a
    function of the value and tells values apart, so equal bytes mean equal values."""
    return _ENCODER.encode(_pack(value))


def checkpoint_parent(data: bytes) -> bytes | None:
    """The ``parent_id`` of the Checkpoint in compact ``data``, as its packed bytes (compare
    them with ``packed(id)``), read without decoding the rest; None when ``data`` is not a
    compact Checkpoint body."""
    head = _read_head(_CHECKPOINT_HEAD, _CHECKPOINT_INDEX, data)
    return None if head is None else bytes(head.last)


# -- the stored form: a body without the ids its row holds -------------------------------------

SHORT: Final = b"\xc1"
"""The first byte of a body stored without the ids its row holds (``short_body``). msgpack never
uses the byte, so no body ``encode`` writes starts with it. The byte after it is 0 when the
body leaves out its tenant too (``short_body`` given it), 1 when it leaves out its tenant and
its stamp's node (given both), its array's header (never 0 or 1) when neither."""
_TENANT_OUT: Final = b"\x00"
_NODE_OUT: Final = b"\x01"
_SHORT_KINDS: Final = frozenset(
    kind.index for kind in _BY_INDEX if kind.names[:4] == ["id", "session_id", "org_id", "user_id"]
)
"""The kinds whose compact body starts with the record's ids and tenant: Message, Checkpoint,
Event."""
_NODE_KINDS: Final = frozenset(
    kind.index
    for kind in _BY_INDEX
    if kind.index in _SHORT_KINDS and (kind.client_at, kind.hlc_at) == (4, 5)
)
"""Of those, the kinds whose device and stamp come next (all three): a body whose device is
nil (``implied_client``) has its stamp at a fixed place once the four are left out."""
_NODELESS_STAMP: Final = b"\xc7\x09\x03"
"""An ext 3 of the stamp's 9 bytes alone (``encode`` never writes one: a node is never empty)."""
_AUDIT_OUT: Final = b"\x02"
_PREV_APART: Final = 0x10
"""Added to a short event body's form (0 or 1: 16 or 17): its ``prev_hash`` left out too,
which the row before it in its chain holds as its ``row_hash`` (``prev_apart``)."""
_DIGEST_HEAD: Final = b"\xc7\x20\x02"
"""An ext 2 of 32 bytes: a digest as ``encode`` writes it."""
_AUDIT_HASHED: Final = b"\x12"
"""A short audit body (form 2) with its ``row_hash``'s 32 bytes in front, where a store reads
them without looking (``audit_digest``): the two bytes of where its ext was (big-endian),
the digest, the body less that ext (``audit_apart``)."""
_AUDIT_CHAINED: Final = b"\x13"
"""The same, less the ``prev_hash`` right before it too (its ext of 32 bytes), which the row
before it in its chain holds as its ``row_hash`` (``audit_apart``)."""
_HASHED_AT: Final = 36
"""Where the rest of an audit body of form 18 or 19 starts: after ``SHORT``, the form, the
two bytes of the place and the digest."""
_AUDIT: Final = _BY_INDEX[KINDS.index("AuditRow")]
_AUDIT_HEAD: Final = bytes((_AUDIT.index,))
"""An audit row's body: ``[kind, id, org_id, user_id, client_id, hlc, session_id, ...]``, an
array of more than 15 values (its ``0xdc`` header 3 bytes long)."""


def stamp_node(client_id: str) -> bytes:
    """What ``short_body`` leaves out of a stamp of ``client_id``'s (its ``node``): the head of
    the ext 3 a stamp of that node is (``C7``, its length, 3) and the node's bytes after the
    stamp's 9, as ``encode`` writes them; ``b""`` when no stamp of it is an ext 8 of that
    form (a node of 6 bytes makes a fixext 16, a long one an ext 16)."""
    ext = _hlc(f"0000000000000-000000-{client_id}")
    if ext is None:
        return b""
    data = _ENCODER.encode(ext)
    if data[:1] != b"\xc7" or data[2:3] != b"\x03" or len(data) != 3 + data[1]:
        return b""
    return data[:3] + data[12:]


def short_body(
    body: bytes, key: object, session_key: object, tenant: bytes = b"", node: bytes = b""
) -> bytes:
    """``body`` as a store's row keeps it when the row's columns hold the record's id and session id
    as their 16 bytes (``key``, ``session_key``; ``uuid_bytes``): when the body is the compact
    form of a record that starts ``[kind, id, session_id, org_id, user_id, ...]`` (a Message, a
    Checkpoint, an Event) and the ids are exactly those keys, it is ``SHORT``, then the same
    array without them (its header two values fewer, the kind, the fields after the ids: 35
    bytes fewer), which a twin of the kind without those fields reads as it is
    (``decode_short``). When the store knows the row's tenant (``tenant``: ``packed(org_id) +
    packed(user_id)``) and those are the body's next fields, they are left out too (``SHORT``,
    0, then the array two values fewer again). When it knows the device whose records it
    mostly holds too (``node``: ``stamp_node`` of its client id), and the body's device is
    nil and its stamp's node is that one, the node is left out of the stamp as well
    (``SHORT``, 1, the array as with 0 but the stamp an ext of its 9 bytes alone: 17 bytes
    fewer for a device id that is a UUID). Anything else is given back as it is (an id that
    is not a canonical UUID, keys that are not the body's, the map form, another kind).
    An audit row's body (an array of more than 15 values, whose session id follows its stamp)
    leaves out, all at once or not at all, its id, tenant, device (nil), stamp node and
    session id (``SHORT``, 2, its header as it was, the kind, the stamp an ext of its 9 bytes,
    the fields after the session id: about 80 bytes fewer); no twin reads it as it is.
    ``whole_body_sql`` undoes each, byte for byte, as a query reads the row. Pure."""
    if body[:1] == b"\xdc" and body[3:4] == _AUDIT_HEAD:
        return _short_audit(body, key, session_key, tenant, node)
    if (
        type(key) is bytes
        and type(session_key) is bytes
        and body[2:38] == b"\xd8\x01" + key + b"\xd8\x01" + session_key
        and _FIXARRAY + 2 <= body[0] <= _FIXARRAY + 15  # (a compact array of 2 to 15 values)
        and body[1] in _SHORT_KINDS
    ):
        end = 38 + len(tenant)
        if tenant and body[38:end] == tenant and body[0] >= _FIXARRAY + 4:  # (one copy)
            head = bytes((body[0] - 4, body[1]))
            after = end + 13 + len(node) - 3  # (nil, the ext's head, its 9 bytes, the node)
            if (
                len(node) > 3
                and body[1] in _NODE_KINDS
                and body[end : end + 4] == b"\xc0" + node[:3]
                and body[end + 13 : after] == node[3:]
                and body[0] >= _FIXARRAY + 6
            ):
                stamp = memoryview(body)[end + 4 : end + 13]
                rest = memoryview(body)[after:]
                return b"".join((SHORT, _NODE_OUT, head, b"\xc0", _NODELESS_STAMP, stamp, rest))
            return b"".join((SHORT, _TENANT_OUT, head, memoryview(body)[end:]))
        return b"".join((SHORT, bytes((body[0] - 2, body[1])), memoryview(body)[38:]))
    return body


def _short_audit(
    body: bytes, key: object, session_key: object, tenant: bytes, node: bytes
) -> bytes:
    """``short_body`` of an audit row's compact body (an array 16: ``0xdc`` and its count)."""
    if not (tenant and len(node) > 3 and type(key) is bytes and type(session_key) is bytes):
        return body
    end = 22 + len(tenant)  # (the header, the kind, the id's ext 1, the tenant)
    after = end + 13 + len(node) - 3  # (nil, the stamp's head and 9 bytes, the node)
    if (
        body[4:22] == b"\xd8\x01" + key
        and body[22:end] == tenant
        and body[end : end + 4] == b"\xc0" + node[:3]
        and body[end + 13 : after] == node[3:]
        and body[after : after + 18] == b"\xd8\x01" + session_key
    ):
        stamp, rest = memoryview(body)[end + 4 : end + 13], memoryview(body)[after + 18 :]
        return b"".join((SHORT, _AUDIT_OUT, body[:4], _NODELESS_STAMP, stamp, rest))
    return body


def _digest_tail(body: bytes) -> int | None:
    """How many bytes follow an event body's ``row_hash`` (its last field but ``canonical``):
    1 when the body ends with the digest's ext and a boolean, 0 when with the digest's ext,
    else None. ``chain_digest_sql`` reads it the same way."""
    if body[-36:-33] == _DIGEST_HEAD and body[-1:] in (b"\xc2", b"\xc3"):
        return 1
    return 0 if body[-35:-32] == _DIGEST_HEAD else None


def chain_digest(body: bytes) -> bytes | None:
    """The 32 bytes of a stored event body's ``row_hash`` (whatever its form: whole, short or
    its ``prev_hash`` apart), read from its end; None for a body that does not end with it (a
    map-form body). ``chain_digest_sql`` in Python. Pure."""
    tail = _digest_tail(body)
    return None if tail is None else body[len(body) - tail - 32 : len(body) - tail]


def _tail_sql(body: str) -> str:
    """SQL: 1 when the body in ``body`` ends with a digest's ext and a boolean, else 0 (the
    first case of ``_digest_tail``)."""
    return f"(substr({body}, -36, 3) = X'c72002' AND substr({body}, -1) IN (X'c2', X'c3'))"


def chain_digest_sql(body: str) -> str:
    """SQLite SQL: ``chain_digest`` of the stored event body in ``body`` (NULL for none)."""
    return (
        f"CASE WHEN {_tail_sql(body)} THEN substr({body}, -33, 32) "
        f"WHEN substr({body}, -35, 3) = X'c72002' THEN substr({body}, -32) END"
    )


def prev_apart(short: bytes, prev: bytes) -> bytes:
    """``short``, a short event body that leaves out its tenant (``short_body``'s form 0 or 1),
    without its ``prev_hash`` too when that is an ext 2 of exactly ``prev`` (32 bytes) right
    before its ``row_hash`` (its form then 16 or 17: 35 bytes fewer); anything else as it is.
    A store keeps it only where the row before it in its chain holds ``prev`` as its
    ``row_hash`` for good (``chain_digest_sql`` of that row's body): ``whole_body_sql``
    given that row's digest as ``prev`` puts it back, byte for byte. Pure."""
    if len(prev) != 32 or short[:1] != SHORT or short[1:2] not in (_TENANT_OUT, _NODE_OUT):
        return short
    tail = _digest_tail(short)
    if tail is None:
        return short
    row_at = len(short) - tail - 35
    prev_at = row_at - 35
    if prev_at < (17 if short[1:2] == _NODE_OUT else 4):  # (within the fields after the stamp)
        return short
    if short[prev_at:row_at] != _DIGEST_HEAD + prev:
        return short
    form = bytes((short[1] + _PREV_APART,))
    return b"".join((SHORT, form, memoryview(short)[2:prev_at], memoryview(short)[row_at:]))


def event_apart(short: bytes) -> tuple[bytes, bytes] | None:
    """An event's short body (``short_body``'s form 0 or 1) without its ``prev_hash``
    (``prev_apart``: form 16 or 17), beside the 32 bytes left out; None for any other body
    (another form, the first of a chain, whose ``prev_hash`` is empty). A device keeps that
    form only where the row before it in its session holds those bytes as its ``row_hash``
    as it is stored (the row a read finds there again: a row whose hash changes moves, and
    so does every row after it). Pure."""
    tail = _digest_tail(short)
    if tail is None:
        return None
    row_at = len(short) - tail - 35
    prev = short[row_at - 32 : row_at]
    apart = prev_apart(short, prev)
    return None if apart is short else (apart, prev)


def audit_apart(short: bytes, row_hash: bytes, prev: bytes) -> tuple[bytes, bytes | None]:
    """``short``, an audit row's short body (``short_body``'s form 2), with its ``row_hash``
    (the ext of exactly the 32 bytes ``row_hash``) moved to its front, and the same less its
    ``prev_hash`` too when that is the ext of exactly ``prev`` right before it (else None):
    forms 18 and 19, each ``SHORT``, the form, the two bytes (big-endian) of the place in
    ``short`` where what was taken out was, the row hash's 32 bytes, then ``short`` after its
    form less what was taken out. A store reads a row hash from its front, whatever else the
    body holds (``audit_digest``), and keeps the second only where the row before it in its
    chain holds ``prev`` there for good: ``whole_body_sql`` given that row's digest as
    ``prev`` puts it back, byte for byte. Anything else is given back as it is, with None
    (another form, a row hash that is not a digest, one not after the fields its form
    starts with). Pure."""
    if short[:2] != SHORT + _AUDIT_OUT or len(row_hash) != 32:
        return short, None
    # (The pair first: a device may make any other digest its row hash too.)
    pair = short.rfind(_DIGEST_HEAD + prev + _DIGEST_HEAD + row_hash) if len(prev) == 32 else -1
    at = pair + 35 if pair >= 0 else short.rfind(_DIGEST_HEAD + row_hash)
    if at < 18 or at > 0xFFFF:  # (within the fields after the stamp; a place two bytes hold)
        return short, None
    after = memoryview(short)[at + 35 :]
    hashed = b"".join((SHORT, _AUDIT_HASHED, at.to_bytes(2, "big"), row_hash, short[2:at], after))
    before = at - 35
    if len(prev) != 32 or before < 18 or short[before:at] != _DIGEST_HEAD + prev:
        return hashed, None
    place = before.to_bytes(2, "big")
    return hashed, b"".join((SHORT, _AUDIT_CHAINED, place, row_hash, short[2:before], after))


def audit_digest(body: bytes) -> bytes | None:
    """The 32 bytes of a stored audit body's ``row_hash`` when it is kept in front (forms 18
    and 19: ``audit_apart``), else None. ``audit_digest_sql`` in Python. Pure."""
    if body[:1] == SHORT and body[1:2] in (_AUDIT_HASHED, _AUDIT_CHAINED) and len(body) >= 36:
        return body[4:36]
    return None


def audit_digest_sql(body: str) -> str:
    """SQLite SQL: ``audit_digest`` of the stored audit body in ``body`` (NULL for none)."""
    return (
        f"CASE WHEN substr({body}, 1, 2) IN (X'c112', X'c113') AND length({body}) >= 36 "
        f"THEN substr({body}, 5, 32) END"
    )


_DIGEST_EXT: Final = 35
"""The bytes of a digest as ``encode`` writes it: ``_DIGEST_HEAD`` and its 32 bytes."""
_NIL_BYTE: Final = 0xC0
_FALSE_BYTE: Final = 0xC2
_EMPTY_TEXT: Final = 0xA0


def _audit_tail(body: bytes, ext: int) -> int | None:
    """Where the ``payload_digest`` of an audit body (whole, or short: both end alike) is,
    when the body ends ``[payload_digest, prev_hash, row_hash, false, identity_digest]``,
    each digest ``ext`` bytes long (35, as ``encode`` writes one; 1, a nil), the row hash a
    digest and the prev_hash one or empty (a chain's first row); else None."""
    n = len(body)
    row = n - ext - 1 - _DIGEST_EXT
    if row < 1 or body[row + _DIGEST_EXT] != _FALSE_BYTE or body[row : row + 3] != _DIGEST_HEAD:
        return None
    if body[row - 1] == _EMPTY_TEXT:
        at = row - 1 - ext
    elif body[row - _DIGEST_EXT : row - 32] == _DIGEST_HEAD:
        at = row - _DIGEST_EXT - ext
    else:
        return None
    return at if at >= 1 else None


def audit_digests_apart(body: bytes) -> tuple[bytes, bytes, bytes] | None:
    """An audit row's stored body (whole, or short) with a nil where each of its
    ``payload_digest`` and ``identity_digest`` was (70 bytes fewer, 68 once the nils are
    counted: a str field is never nil, so no body ``encode`` writes ends so), beside the 32
    bytes of each; None for a body that does not end as ``_audit_tail`` says, a redacted
    row's included (its identity digest is no longer what its fields give). A device keeps
    that form only where the row's content gives those very digests
    (``shared.hashchain.audit_digest``): ``audit_digests_put`` puts them back, byte for byte.
    Pure."""
    at = _audit_tail(body, _DIGEST_EXT)
    if at is None or body[at : at + 3] != _DIGEST_HEAD or body[-_DIGEST_EXT:-32] != _DIGEST_HEAD:
        return None
    payload, identity = body[at + 3 : at + _DIGEST_EXT], body[-32:]
    nil = bytes((_NIL_BYTE,))
    apart = b"".join((body[:at], nil, body[at + _DIGEST_EXT : -_DIGEST_EXT], nil))
    return apart, payload, identity


def audit_digests_left_out(body: bytes) -> int | None:
    """Where the nil that stands for the ``payload_digest`` of a body ``audit_digests_apart``
    gave is; None for any other body. Pure."""
    if not body or body[-1] != _NIL_BYTE:
        return None
    at = _audit_tail(body, 1)
    return at if at is not None and body[at] == _NIL_BYTE else None


def audit_placeholders(body: bytes, at: int) -> bytes:
    """A body ``audit_digests_apart`` gave (its payload's nil at ``at``) with an empty text in
    place of each nil: it decodes as its row, the two digests empty. Pure."""
    empty = bytes((_EMPTY_TEXT,))
    return b"".join((body[:at], empty, body[at + 1 : -1], empty))


def audit_digests_put(body: bytes, at: int, payload: bytes, identity: bytes) -> bytes:
    """A body ``audit_digests_apart`` gave (its payload's nil at ``at``) with the digests
    ``payload`` and ``identity`` (32 bytes each) where its nils are. Pure."""
    return b"".join((body[:at], _DIGEST_HEAD, payload, body[at + 1 : -1], _DIGEST_HEAD, identity))


def body_tenant(short: bytes) -> bytes | None:
    """The packed org and user a ``short_body`` that leaves out only the ids starts its fields
    with (what ``short_body`` given them would leave out), or None when it is not such a
    body or they are not two strings or UUIDs. Pure."""
    if short[:1] != SHORT or short[1:2] == _TENANT_OUT:
        return None
    at = 3
    for _ in range(2):
        head = short[at : at + 1]
        if not head:
            return None
        code = head[0]
        if 0xA0 <= code <= 0xBF:  # fixstr
            at += 1 + (code & 0x1F)
        elif code == 0xD9 and len(short) > at + 1:  # str 8
            at += 2 + short[at + 1]
        elif code == 0xDA and len(short) > at + 2:  # str 16
            at += 3 + int.from_bytes(short[at + 1 : at + 3], "big")
        elif short[at : at + 2] == b"\xd8\x01":  # a UUID (ext 1)
            at += 18
        else:
            return None
    return short[3:at] if at <= len(short) else None


_HEADS: Final = "X'" + bytes(range(_FIXARRAY, _FIXARRAY + 16)).hex() + "'"
"""SQL: the sixteen fixarray headers in order, so that a header plus n is a lookup."""
_BYTES: Final = "X'" + bytes(range(256)).hex() + "'"
"""SQL: every byte in order, so that a byte's value is a lookup (its position less one)."""
_DIGEST_SQL: Final = "X'" + _DIGEST_HEAD.hex() + "'"


def whole_body_sql(
    body: str,
    key: str,
    session_key: str,
    tenant: str = "NULL",
    node: str = "NULL",
    prev: str = "NULL",
) -> str:
    """SQLite SQL: the stored body in column ``body`` as its record was written, the row's
    ``key`` and ``session_key`` columns (and ``tenant``, an expression of the row's tenant's
    packed bytes, for a body that left it out, and ``node``, one of the stamp node's bytes
    ``short_body`` was given, for a body that left that out, and ``prev``, an expression of
    the 32 bytes ``prev_apart`` was given, for an event body that left its ``prev_hash`` out)
    giving back what was left out (each id as ext 1, the form this codec writes a UUID in,
    the array's header restored by a lookup in ``_HEADS``); any other body as it is.
    Concatenating blobs gives text in SQLite, and the cast the very bytes back (a database's
    text is UTF-8: no conversion either way). ``prev`` is written once a form, so a query
    that reads it from another row does so once a row. An audit body of form 18 or 19
    (``audit_apart``; 19 with ``prev``, its row before's ``audit_digest``) is its form 2
    put together again first."""
    ids = f"X'd801' || {key} || X'd801' || {session_key}"

    def head(at: int, more: int) -> str:
        return f"substr({_HEADS}, instr({_HEADS}, substr({body}, {at}, 1)) + {more}, 1)"

    # A body without its prev_hash: from ``at`` to its row_hash's ext, the digest, the rest.
    cut = f"length({body}) - 35 - {_tail_sql(body)}"

    def rest(at: int) -> str:  # (NULL for a body too short to hold it: no such body is kept)
        return (
            f"CASE WHEN {cut} >= {at - 1} THEN substr({body}, {at}, {cut} - {at - 1}) || "
            f"X'c72002' || {prev} || substr({body}, {cut} + 1) END"
        )

    def audit(header: int, stamp: int, rest: str) -> str:  # (form 2, its parts where they are)
        return (
            f"substr({body}, {header}, 4) || X'd801' || {key} || {tenant} || X'c0' || "
            f"substr({node}, 1, 3) || substr({body}, {stamp}, 9) || substr({node}, 4) || "
            f"X'd801' || {session_key} || {rest}"
        )

    # Forms 18 and 19: form 2's fields after its stamp are this body's from 53 up to the place
    # (``place``: where what was taken out was in form 2, from 19 on), what was taken out (19:
    # ``prev``'s ext, then) the row hash's ext, the rest. NULL for a place no such body has.
    place = (
        f"((instr({_BYTES}, substr({body}, 3, 1)) - 1) * 256 "
        f"+ instr({_BYTES}, substr({body}, 4, 1)) - 1)"
    )

    def hashed(taken: str) -> str:
        rest = (
            f"CASE WHEN {place} >= 18 AND length({body}) >= {place} + 34 THEN "
            f"substr({body}, 53, {place} - 18) || {taken}{_DIGEST_SQL} || substr({body}, 5, 32) "
            f"|| substr({body}, {place} + 35) END"
        )
        return audit(_HASHED_AT + 1, _HASHED_AT + 8, rest)

    # Forms 0 and 1 (and 16, 17) start alike: the header, the kind, the ids, the tenant;
    # 1 (and 17) then the device (nil) and the stamp with its node put back.
    ids_tenant = f"{head(3, 4)} || substr({body}, 4, 1) || {ids} || {tenant}"
    stamp = f"substr({body}, 5, 1) || substr({node}, 1, 3) || substr({body}, 9, 9) || " + (
        f"substr({node}, 4)"
    )
    return (
        f"CASE WHEN substr({body}, 1, 1) = X'c1' THEN CAST(CASE substr({body}, 2, 1) "
        f"WHEN X'00' THEN {ids_tenant} || substr({body}, 5) "
        f"WHEN X'01' THEN {ids_tenant} || {stamp} || substr({body}, 18) "
        f"WHEN X'02' THEN {audit(3, 10, f'substr({body}, 19)')} "
        f"WHEN X'12' THEN {hashed('')} "
        f"WHEN X'13' THEN {hashed(f'{_DIGEST_SQL} || {prev} || ')} "
        f"WHEN X'10' THEN {ids_tenant} || {rest(5)} "
        f"WHEN X'11' THEN {ids_tenant} || {stamp} || {rest(18)} "
        f"ELSE {head(2, 2)} || substr({body}, 3, 1) || {ids} || "
        f"substr({body}, 4) END AS BLOB) ELSE {body} END"
    )


_SHORT_TWINS: Final = {
    given: {
        twin[0]: twin[1]
        for kind in _BY_INDEX
        if kind.index in _SHORT_KINDS
        for twin in [_twin(kind, given)]
        if twin is not None
    }
    for given in (2, 4)
}
"""The twins of a short body's kinds, without the ids (2) or the ids and the tenant (4), and
each one's ``make`` (which takes those as its arguments)."""
_NODE_MAKES: Final = {
    cls: twin[1]
    for cls in _SHORT_TWINS[4]
    if cls.__struct_config__.tag in _NODE_KINDS
    for twin in [_twin(_BY_INDEX[cls.__struct_config__.tag], 4, node=True)]
    if twin is not None
}
"""For a body that left out its stamp's node too, the ``make`` of each twin without the ids
and the tenant (the same twin reads it: its stamp is an ext of its 9 bytes), which takes the
node's bytes after those."""
_SHORT_DECODERS: Final = {
    given: msgspec.msgpack.Decoder(Union[tuple(twins)], ext_hook=_unext)  # noqa: UP007
    for given, twins in _SHORT_TWINS.items()
}
_TENANT_DECODER: Final = msgspec.msgpack.Decoder(tuple[str, str], ext_hook=_unext)


def tenant_texts(tenant: bytes) -> tuple[str, str] | None:
    """The org and user in ``tenant`` (``packed(org_id) + packed(user_id)``), or None when it
    is not two of them."""
    try:
        return _TENANT_DECODER.decode(b"\x92" + tenant)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_short(
    data: bytes,
    record_id: str,
    session_id: str,
    tenant: tuple[str, str] | None,
    node: bytes = b"",
) -> Record:
    """The record in ``data``, a body a row stores (``short_body``, whole or short), given the
    row's ids as text (the texts of its keys), its tenant's org and user (``tenant_texts`` of
    what ``short_body`` was given) and the stamp node ``short_body`` was given: a short body
    is read as it is, by its kind's twin without the fields left out, which ``make`` is
    given: no bytes are put together (about 0.9 us a row in SQL), and the rest reads as
    quickly as the whole body does. A body the twin refuses, or that leaves out a tenant or
    node not given, is put together and read by ``decode``, which gives what it always gives
    (its error, mostly)."""
    if data[:1] != SHORT:
        return decode(data)
    form = data[1:2]
    try:
        if form == _TENANT_OUT and tenant is not None:
            twin = _SHORT_DECODERS[4].decode(memoryview(data)[2:])
            return _SHORT_TWINS[4][twin.__class__](twin, record_id, session_id, *tenant)
        if form == _NODE_OUT and tenant is not None and len(node) > 3:
            if data[5:8] == _NODELESS_STAMP:  # (else: put together as SQL would)
                twin = _SHORT_DECODERS[4].decode(memoryview(data)[2:])
                make = _NODE_MAKES[twin.__class__]
                return make(twin, record_id, session_id, *tenant, node[3:])
        elif form not in (_TENANT_OUT, _NODE_OUT):
            twin = _SHORT_DECODERS[2].decode(memoryview(data)[1:])
            return _SHORT_TWINS[2][twin.__class__](twin, record_id, session_id)
    except (msgspec.DecodeError, msgspec.ValidationError, _NotText, IndexError, KeyError):
        pass
    packed_tenant = b"" if tenant is None else packed(tenant[0]) + packed(tenant[1])
    whole = _whole(data, packed(record_id), packed(session_id), packed_tenant, node)
    if whole is None:  # (its prev_hash is in the row before it: only SQL reads it)
        raise msgspec.DecodeError(
            "a body without its prev_hash is read with the row before it (or is corrupt)"
        )
    return decode(whole)


_HEAD_BYTES: Final = bytes(range(_FIXARRAY, _FIXARRAY + 16))


def _head(code: int, more: int) -> bytes:
    """``whole_body_sql``'s header lookup: the fixarray header ``more`` values longer than
    ``code``, as SQL finds it (a byte that is no fixarray header found nowhere: position 0)."""
    at = code - _FIXARRAY + 1 if _FIXARRAY <= code < _FIXARRAY + 16 else 0
    return _HEAD_BYTES[at + more - 1 : at + more]


def _whole(
    data: bytes,
    record_id: bytes,
    session_id: bytes,
    tenant: bytes,
    node: bytes,
    prev: bytes | None = None,
) -> bytes | None:
    """``data``, a short body, put together again from the packed values it left out, byte for
    byte as ``whole_body_sql`` does, in Python: for the rare body a twin refuses. None where
    SQL gives NULL: a body without its ``prev_hash`` and no ``prev`` given."""
    if len(data) < 4:
        return data[1:]  # (no array: ``decode`` refuses it)
    if data[1] in (_PREV_APART, _PREV_APART + 1):
        if prev is None:
            return None
        cut = len(data) - 35 - (_digest_tail(data) == 1)  # (as SQL's ``_tail_sql``)
        at = 4 if data[1] == _PREV_APART else 17
        if cut < at:
            return None
        data = data[:cut] + _DIGEST_HEAD + prev + data[cut:]
        data = SHORT + bytes((data[1] - _PREV_APART,)) + data[2:]
    ids = record_id + session_id
    if data[1:2] == _TENANT_OUT:
        return _head(data[2], 4) + data[3:4] + ids + tenant + data[4:]
    if data[1:2] == _NODE_OUT:
        head = _head(data[2], 4) + data[3:4] + ids + tenant + data[4:5]
        return head + node[:3] + data[8:17] + node[3:] + data[17:]
    if data[1:2] in (_AUDIT_HASHED, _AUDIT_CHAINED):
        place = int.from_bytes(data[2:4], "big") if len(data) >= 4 else -1
        if place < 18 or len(data) < place + 34:
            return None
        taken = b""
        if data[1:2] == _AUDIT_CHAINED:
            if prev is None:
                return None
            taken = _DIGEST_HEAD + prev
        digest, before, after = (
            data[4:_HASHED_AT],
            data[_HASHED_AT : place + 34],
            data[place + 34 :],
        )
        data = b"".join((SHORT, _AUDIT_OUT, before, taken, _DIGEST_HEAD, digest, after))
    if data[1:2] == _AUDIT_OUT:
        head = data[2:6] + record_id + tenant + b"\xc0" + node[:3]
        return head + data[9:18] + node[3:] + session_id + data[18:]
    return _head(data[1], 2) + data[2:3] + ids + data[3:]
