"""A compact, lossless byte form of a record, for storage.

``encode_record`` (the wire and the server's form) writes each record as a msgpack map: every
field name in every row, ids as 36-character text, hashes as 64 hex characters, HLC stamps as
about 60 characters. This form keeps the same values in less than half the bytes:

- a msgpack array: the kind's index in ``KINDS``, then the field values in declaration order,
  with trailing values equal to their defaults left out (field names are implied);
- canonical lowercase UUID strings as msgpack ext 1 (16 bytes), a list of two or more of them
  as ext 4 (16 bytes each), 64-character lowercase hex
  digests as ext 2 (32 bytes), HLC stamps (``<13 digits>-<6 digits>-<node>``) as ext 3 (wall
  and counter as integers, the node as a UUID or text), wherever they occur in the record.

Only strings whose text comes back exactly are converted, so decoding gives back an equal
record. ``decode`` also reads the map form (a body written by ``encode_record``), so stores may
hold both. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from .records import RECORD_KINDS, Record, decode_record

__all__ = ["KINDS", "decode", "encode"]

KINDS: Final[tuple[str, ...]] = (
    "Session",
    "Message",
    "Checkpoint",
    "Event",
    "AuditRow",
    "ArtifactUpdate",
)
"""Kind index -> kind name. Append only: an index, once written, names its kind forever."""

_EXT_UUID, _EXT_HEX, _EXT_HLC, _EXT_UUIDS = 1, 2, 3, 4
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HLC = re.compile(r"([0-9]{13})-([0-9]{6})-", re.ASCII)
_NODE_TEXT, _NODE_UUID = 0, 1
_NODEFAULT: Final = object()

Ext = msgspec.msgpack.Ext


class _Kind:
    """What the codec needs of one kind: its class, field names and defaults (as builtins)."""

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.cls = RECORD_KINDS[name].cls
        info = msgspec.structs.fields(self.cls)
        self.names = [f.encode_name for f in info]
        defaults: list[Any] = []
        for f in info:
            if f.default is not msgspec.NODEFAULT:
                defaults.append(msgspec.to_builtins(f.default))
            elif f.default_factory is not msgspec.NODEFAULT:
                defaults.append(msgspec.to_builtins(f.default_factory()))
            else:
                defaults.append(_NODEFAULT)
        self.defaults = defaults


_BY_NAME: Final = {name: _Kind(i, name) for i, name in enumerate(KINDS)}
_BY_INDEX: Final = tuple(_BY_NAME[name] for name in KINDS)
_ENCODER: Final = msgspec.msgpack.Encoder()


def _hlc(value: str) -> Ext | None:
    match = _HLC.match(value)
    if match is None:
        return None
    wall, counter = int(match[1]), int(match[2])
    node = value[match.end() :]
    head = wall.to_bytes(6, "big") + counter.to_bytes(3, "big")
    if len(node) == 36 and _UUID.match(node):
        return Ext(_EXT_HLC, head + bytes((_NODE_UUID,)) + bytes.fromhex(node.replace("-", "")))
    try:
        return Ext(_EXT_HLC, head + bytes((_NODE_TEXT,)) + node.encode())
    except UnicodeEncodeError:  # a lone surrogate: leave it to the encoder to refuse
        return None


def _uuid_list(value: list[Any]) -> Ext | None:
    """A list of canonical UUID strings (message ids...) as one ext, 16 bytes each; checked
    and converted by whole-string operations (C loops), so a long list costs little."""
    try:
        joined = "".join(value)
    except TypeError:
        return None
    count = len(value)
    if len(joined) != 36 * count or joined.count("-") != 4 * count:
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
    return Ext(_EXT_UUIDS, data) if len(data) == 16 * count else None


def _pack(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        size = len(value)
        if size == 36 and _UUID.match(value):
            return Ext(_EXT_UUID, bytes.fromhex(value.replace("-", "")))
        if size == 64 and _HEX64.match(value):
            return Ext(_EXT_HEX, bytes.fromhex(value))
        if size > 21 and value[13] == "-":
            return _hlc(value) or value
        return value
    if kind is list:
        if len(value) > 1:
            ids = _uuid_list(value)
            if ids is not None:
                return ids
        return [_pack(item) for item in value]
    if kind is dict:
        return {key: _pack(item) for key, item in value.items()}
    return value


def encode(record: Record) -> bytes:
    """The compact bytes of ``record``. Raises what msgspec raises for unencodable values."""
    kind = _BY_NAME.get(type(record).__name__)
    if kind is None or type(record) is not kind.cls:
        raise TypeError(f"not a record: {type(record).__name__}")
    fields = msgspec.to_builtins(record, builtin_types=(bytes,))
    values = [
        fields.get(name, default) for name, default in zip(kind.names, kind.defaults, strict=True)
    ]
    end = len(values)
    while end and values[end - 1] == kind.defaults[end - 1]:
        end -= 1
    return _ENCODER.encode([kind.index, *(_pack(v) for v in values[:end])])


def _uuid_text(h: str) -> str:
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _unext(code: int, data: memoryview) -> Any:
    if code == _EXT_UUID and len(data) == 16:
        return _uuid_text(data.hex())
    if code == _EXT_UUIDS and len(data) % 16 == 0:
        h = data.hex()
        return [
            f"{h[i : i + 8]}-{h[i + 8 : i + 12]}-{h[i + 12 : i + 16]}-{h[i + 16 : i + 20]}-"
            f"{h[i + 20 : i + 32]}"
            for i in range(0, len(h), 32)
        ]
    if code == _EXT_HEX and len(data) == 32:
        return bytes(data).hex()
    if code == _EXT_HLC and len(data) >= 10:
        wall = int.from_bytes(data[:6], "big")
        counter = int.from_bytes(data[6:9], "big")
        node_bytes = bytes(data[10:])
        if data[9] == _NODE_UUID and len(node_bytes) == 16:
            node = _uuid_text(node_bytes.hex())
        elif data[9] == _NODE_TEXT:
            node = node_bytes.decode()
        else:
            raise msgspec.DecodeError(f"malformed HLC stamp (node kind {data[9]})")
        return f"{wall:013d}-{counter:06d}-{node}"
    raise msgspec.DecodeError(f"unknown ext type {code} ({len(data)} bytes)")


_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_unext)


def decode(data: bytes) -> Record:
    """The record in ``data`` (compact or map form). Raises ``msgspec.DecodeError`` when the
    bytes are corrupt and ``msgspec.ValidationError`` when they decode to no valid record."""
    if not data or (data[0] & 0xF0 != 0x90 and data[0] not in (0xDC, 0xDD)):
        return decode_record(data)  # the map form (or garbage, which it refuses)
    raw = _DECODER.decode(data)
    if not raw or type(raw[0]) is not int or not 0 <= raw[0] < len(_BY_INDEX):
        raise msgspec.ValidationError(f"unknown record kind {raw[0] if raw else None!r}")
    kind = _BY_INDEX[raw[0]]
    values = raw[1:]
    if len(values) > len(kind.names):
        raise msgspec.ValidationError(f"{len(values)} values for {len(kind.names)} fields")
    fields = dict(zip(kind.names, values, strict=False))
    record: Record = msgspec.convert(fields, kind.cls)
    return record
