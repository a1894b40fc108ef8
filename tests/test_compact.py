"""The compact storage form gives back an equal record, whatever the strings in it; and the
codec (with its caches) writes and reads exactly the bytes the first, plain version did."""

from __future__ import annotations

import datetime
import enum
import os
import random
import re
import secrets
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import compact
from shared.clock import Timestamp
from shared.records import (
    RECORD_KINDS,
    AuditRow,
    Event,
    Outcome,
    Record,
    SessionState,
    Usage,
    encode_record,
)
from tests.factories import (
    make_artifact_update,
    make_audit,
    make_checkpoint,
    make_event,
    make_message,
    make_session,
)

Ext = msgspec.msgpack.Ext
UUIDS = st.uuids().map(str)
HEX = st.binary(min_size=32, max_size=32).map(bytes.hex)
STAMPS = st.builds(
    lambda wall, counter, node: Timestamp(wall, counter, node).encode(),
    st.integers(0, 10**13 - 1),
    st.integers(0, 10**6 - 1),
    st.one_of(UUIDS, st.text(max_size=12)),
)
NEAR_MISSES = st.one_of(
    UUIDS.map(str.upper),  # uppercase: must stay text (it would come back lowercase)
    UUIDS.map(lambda u: u[:-1]),
    UUIDS.map(lambda u: u.replace("-", "")),
    UUIDS.map(lambda u: " " + u[1:]),
    HEX.map(str.upper),
    HEX.map(lambda h: h[:-1] + "g"),
    STAMPS.map(lambda s: s.replace("-", "+", 1)),
    st.text(max_size=70),
)
PROSE_WORDS = "the a device turn of session sync offline message reply and to is".split()
LONG = st.one_of(  # texts a body may write deflated (protocol 9), or may not
    st.lists(st.sampled_from(PROSE_WORDS), min_size=20, max_size=300).map(" ".join),
    st.text(min_size=compact.DEFLATE_MIN - 2, max_size=400),  # mostly too random to deflate
    st.text(min_size=1, max_size=4).map(lambda t: t * 300),  # may inflate past the ratio
)
TEXT = st.one_of(UUIDS, HEX, STAMPS, NEAR_MISSES, LONG)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def records(draw: st.DrawFn) -> Record:
    hlc = draw(STAMPS)
    # Most records name the device their stamp names (protocol 8 then leaves it implied).
    client = draw(st.one_of(st.just(hlc.split("-", 2)[2]), TEXT))
    base = {"id": draw(TEXT), "client_id": client, "hlc": hlc}
    kind = draw(st.sampled_from(["session", "message", "checkpoint", "event", "audit", "artifact"]))
    if kind == "session":
        ids = draw(st.one_of(st.lists(UUIDS, max_size=40), st.lists(TEXT, max_size=5)))
        state = {
            "message_ids": ids,
            "pending_tool_calls": draw(
                st.lists(st.dictionaries(TEXT, JSON, max_size=3), max_size=2)
            ),
        }
        return make_session(
            **base,
            state=msgspec.convert(state, type=SessionState),
            title=draw(TEXT),
        )
    if kind == "message":
        text = draw(TEXT)
        return make_message(**base, session_id=draw(TEXT), content=[{"type": "text", "text": text}])
    if kind == "checkpoint":
        return make_checkpoint(
            **base, appended=draw(st.lists(UUIDS, max_size=5)), parent_id=draw(st.none() | TEXT)
        )
    if kind == "event":
        # Types and payload keys from WORDS (written as their indexes) and not.
        words = st.sampled_from(compact.WORDS)
        payload = draw(st.dictionaries(words | st.text(max_size=8), JSON, max_size=4))
        return make_event(
            **base,
            type=draw(words | st.text(max_size=20)),
            payload=payload,
            prev_hash=draw(HEX),
            row_hash=draw(TEXT),
        )
    if kind == "audit":
        return make_audit(
            **base, payload_digest=draw(HEX), detail=draw(st.dictionaries(TEXT, JSON, max_size=3))
        )
    return make_artifact_update(**base, update=draw(st.binary(max_size=40)))


@settings(max_examples=400)
@given(records())
def test_round_trip_is_exact(record: Record) -> None:
    data = compact.encode(record)
    assert compact.decode(data) == record
    assert compact.decode(encode_record(record)) == record  # the map form still reads


@st.composite
def events(draw: st.DrawFn) -> Event:
    """Events as stored: provisional with a place and hashes, or anything (trailing defaults
    left out, canonical already, odd text)."""
    payload = draw(st.dictionaries(st.text(max_size=8), JSON, max_size=4))
    placed = draw(st.booleans())
    return make_event(
        id=draw(UUIDS | TEXT),
        hlc=draw(STAMPS),
        payload=payload,
        sequence_number=draw(st.integers(1, 2**40)) if placed else draw(st.integers(0, 3)),
        prev_hash=draw(HEX) if placed else draw(st.just("") | HEX | TEXT),
        row_hash=draw(HEX) if placed else draw(st.just("") | HEX | TEXT),
        canonical=draw(st.booleans()),
    )


@settings(max_examples=500)
@given(events())
def test_canonical_body_is_the_canonical_events_encoding(event: Event) -> None:
    """Marking a stored event canonical from its bytes gives exactly the bytes of encoding it
    canonical; a body it cannot mark so is left to the caller (None), never marked wrong."""
    data = compact.encode(event)
    marked = compact.canonical_body(data)
    canonical = msgspec.structs.replace(event, canonical=True)
    if marked is not None:
        assert marked == compact.encode(canonical)
        assert compact.decode(marked) == canonical
    assert marked is not None  # every event as stored (all its fields): from its bytes
    assert len(marked) == len(data)  # one byte changed in place: the row keeps its size
    # A body of the form before protocol 8 (the flag left out) is marked one byte longer.
    before = old_encode(event, implied=False)
    if event.row_hash and not event.canonical:
        assert compact.canonical_body(before) == old_encode(canonical, implied=False)
    assert compact.canonical_body(encode_record(event)) is None  # the map form: decoded
    assert compact.canonical_body(compact.encode(make_message())) is None


@settings(max_examples=500)
@given(events())
def test_event_place_reads_what_decode_gives(event: Event) -> None:
    """An event's id and place, read without its payload, are the decoded event's."""
    data = compact.encode(event)
    whole = compact.decode(data)
    assert isinstance(whole, Event)
    place = (whole.id, whole.sequence_number, whole.prev_hash, whole.row_hash, whole.canonical)
    assert compact.event_place(data) == place
    assert compact.event_place(encode_record(event)) is None  # the map form: decoded whole
    assert compact.event_place(compact.encode(make_message())) is None
    assert compact.event_place(data[: len(data) // 2]) is None  # cut short: decoded, refused


@pytest.mark.parametrize(
    "record",
    [
        make_session(),
        make_message(),
        make_checkpoint(),
        make_event(),
        make_audit(),
        make_artifact_update(),
    ],
)
def test_smaller_than_the_map_form(record: Record) -> None:
    assert len(compact.encode(record)) < len(encode_record(record)) * 0.7


def test_a_list_of_message_ids_costs_16_bytes_each() -> None:
    ids = [str(uuid.uuid4()) for _ in range(1000)]
    session = make_session(state=msgspec.structs.replace(make_session().state, message_ids=ids))
    assert len(compact.encode(session)) < 16 * 1000 + 300


def test_strings_that_join_into_uuids_come_back_as_they_were() -> None:
    """Items of 28 and 44 characters whose concatenation reads as two UUIDs are not a list of
    UUIDs: packed as one, they came back as two other strings."""
    joined = str(uuid.uuid4()) + str(uuid.uuid4())
    for cut in (28, 8, 40):
        parts = [joined[:cut], joined[cut:]]
        event = make_event(payload={"parts": parts})
        assert compact.decode(compact.encode(event)) == event


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x91\x63",
        b"\x92\x00\xc7\x03\x09abc",
        b"\xde\x00\x01",
        b"\x92\x00\xd5\x03xx",
        b"\x93\x01",
        msgspec.msgpack.encode([3, Ext(3, bytes(9) + b"\x00\xff")]),  # node: bad UTF-8
        msgspec.msgpack.encode([3, Ext(3, bytes(9) + b"\x07abc")]),  # node kind 7
        msgspec.msgpack.encode([3, Ext(1, bytes(15))]),
        msgspec.msgpack.encode([3, Ext(2, bytes(31))]),
        msgspec.msgpack.encode([3, Ext(4, bytes(17))]),
        msgspec.msgpack.encode([3, Ext(9, bytes(16))]),
        msgspec.msgpack.encode([True, "x"]),
        msgspec.msgpack.encode([3, *["x"] * 13]),
    ],
)
def test_corrupt_bytes_raise_a_decode_or_validation_error(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        compact.decode(data)


def test_not_a_record_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a record"):
        compact.encode({"id": "x"})  # type: ignore[arg-type]


# -- the plain codec, as first written: the oracle for the cached one ---------------------
# Copied from shared/compact.py before its caches and fast paths (only renamed); the bytes
# it writes are the stored format, so the codec must write exactly these and read them alike.

_O_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_O_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_O_HLC = re.compile(r"([0-9]{13})-([0-9]{6})-", re.ASCII)
_O_NODEFAULT = object()


def _o_kind(index: int) -> tuple[type[Any], list[str], list[Any]]:
    cls = RECORD_KINDS[compact.KINDS[index]].cls
    info = msgspec.structs.fields(cls)
    defaults: list[Any] = []
    for f in info:
        if f.default is not msgspec.NODEFAULT:
            defaults.append(msgspec.to_builtins(f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            defaults.append(msgspec.to_builtins(f.default_factory()))
        else:
            defaults.append(_O_NODEFAULT)
    return cls, [f.encode_name for f in info], defaults


_O_KINDS = [_o_kind(i) for i in range(len(compact.KINDS))]


def _o_hlc(value: str) -> Ext | None:
    match = _O_HLC.match(value)
    if match is None:
        return None
    wall, counter = int(match[1]), int(match[2])
    node = value[match.end() :]
    head = wall.to_bytes(6, "big") + counter.to_bytes(3, "big")
    if len(node) == 36 and _O_UUID.match(node):
        return Ext(3, head + bytes((1,)) + bytes.fromhex(node.replace("-", "")))
    try:
        return Ext(3, head + bytes((0,)) + node.encode())
    except UnicodeEncodeError:
        return None


def _o_uuid_list(value: list[Any]) -> Ext | None:
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
    return Ext(4, data) if len(data) == 16 * count else None


def _o_deflated(value: str) -> Ext | None:
    """Protocol 9: a text of 128 characters or more as ext 6 (its UTF-8, raw deflate, level
    6) when that saves an eighth of its bytes and the text is at most 16 times the ext's."""
    try:
        raw = value.encode()
    except UnicodeEncodeError:
        return None
    data = zlib.compress(raw, 6, wbits=-15)
    return Ext(6, data) if 8 * len(data) <= 7 * len(raw) <= 7 * 16 * len(data) else None


def _o_pack(value: Any, deflate: bool = True, nested: bool = False) -> Any:
    """``nested``: ``value`` is inside a list or a map, where a long text deflates."""
    kind = type(value)
    if kind is str:
        size = len(value)
        if size == 36 and _O_UUID.match(value):
            return Ext(1, bytes.fromhex(value.replace("-", "")))
        if size == 64 and _O_HEX64.match(value):
            return Ext(2, bytes.fromhex(value))
        if size > 21 and value[13] == "-" and (stamp := _o_hlc(value)) is not None:
            return stamp
        if deflate and nested and size >= 128:
            return _o_deflated(value) or value
        return value
    if kind is list:
        if len(value) > 1:
            ids = _o_uuid_list(value)
            if ids is not None:
                return ids
        return [_o_pack(item, deflate, True) for item in value]
    if kind is dict:
        return {key: _o_pack(item, deflate, True) for key, item in value.items()}
    return value


def old_encode(record: Record, implied: bool = True, deflate: bool = True) -> bytes:
    """The plain spec of the compact form. ``implied`` (protocol 8): a ``client_id`` equal to
    its ``hlc``'s node (what follows the stamp's second dash) is nil; without it, the form
    before protocol 8. ``deflate`` (protocol 9): long texts deflated (``_o_deflated``);
    without it, the form before protocol 9."""
    index = compact.KINDS.index(type(record).__name__)
    cls, names, defaults = _O_KINDS[index]
    fields = msgspec.to_builtins(record, builtin_types=(bytes,))
    values = [fields.get(name, default) for name, default in zip(names, defaults, strict=True)]
    end = len(values)
    while end and values[end - 1] == defaults[end - 1] and not (implied and cls is Event):
        end -= 1  # (protocol 8: an event writes every field)
    if implied and _o_node(fields["hlc"]) == fields["client_id"]:
        values[names.index("client_id")] = None
    if implied:  # an audit row's usage and outcome: arrays, trailing defaults left out
        for name, cls in (("usage", Usage), ("outcome", Outcome)):
            at = names.index(name) if name in names else len(values)
            if at < end and type(getattr(record, name)) is cls:
                items = [values[at][f.encode_name] for f in msgspec.structs.fields(cls)]
                tail = [f.default for f in msgspec.structs.fields(cls)]  # (no Structs)
                while items and items[-1] == tail[len(items) - 1]:
                    items.pop()
                values[at] = items
    packed = [index, *(_o_pack(v, deflate) for v in values[:end])]
    if implied and isinstance(record, Event):  # its type and payload keys as word indexes
        words = {word: i for i, word in enumerate(compact.WORDS)}
        at = names.index("type") + 1
        packed[at] = words.get(packed[at], packed[at])
        if len(packed) > at + 1 and isinstance(packed[at + 1], dict):
            packed[at + 1] = {words.get(k, k): v for k, v in packed[at + 1].items()}
    return msgspec.msgpack.encode(packed)


def _o_node(hlc: Any) -> str | None:
    parts = hlc.split("-", 2) if isinstance(hlc, str) else []
    return parts[2] if len(parts) == 3 else None


def _o_uuid_text(h: str) -> str:
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _o_unext(code: int, data: memoryview) -> Any:
    if code == 1 and len(data) == 16:
        return _o_uuid_text(data.hex())
    if code == 4 and len(data) % 16 == 0:
        h = data.hex()
        return [_o_uuid_text(h[i : i + 32]) for i in range(0, len(h), 32)]
    if code == 2 and len(data) == 32:
        return bytes(data).hex()
    if code == 3 and len(data) >= 10:
        wall = int.from_bytes(data[:6], "big")
        counter = int.from_bytes(data[6:9], "big")
        node_bytes = bytes(data[10:])
        if data[9] == 1 and len(node_bytes) == 16:
            node = _o_uuid_text(node_bytes.hex())
        elif data[9] == 0:
            node = node_bytes.decode()
        else:
            raise msgspec.DecodeError(f"malformed HLC stamp (node kind {data[9]})")
        return f"{wall:013d}-{counter:06d}-{node}"
    if code == 6:
        inflater = zlib.decompressobj(-15)
        try:
            raw = inflater.decompress(bytes(data))
        except zlib.error as exc:
            raise msgspec.DecodeError(str(exc)) from None
        if not inflater.eof or inflater.unused_data or len(raw) > 16 * len(data):
            raise msgspec.DecodeError("malformed deflated text")
        return raw.decode()
    raise msgspec.DecodeError(f"unknown ext type {code} ({len(data)} bytes)")


_O_DECODER = msgspec.msgpack.Decoder(ext_hook=_o_unext)


def old_decode(data: bytes) -> Record:
    raw = _O_DECODER.decode(data)
    if not raw or type(raw[0]) is not int or not 0 <= raw[0] < len(_O_KINDS):
        raise msgspec.ValidationError(f"unknown record kind {raw[0] if raw else None!r}")
    cls, names, _ = _O_KINDS[raw[0]]
    values = raw[1:]
    if len(values) > len(names):
        raise msgspec.ValidationError(f"{len(values)} values for {len(names)} fields")
    fields = dict(zip(names, values, strict=False))
    if fields.get("client_id", "") is None and _o_node(fields.get("hlc")) is not None:
        fields["client_id"] = _o_node(fields["hlc"])
    if type(fields.get("type")) is int and "payload" in names:
        fields["type"] = compact.WORDS[fields["type"]]
    if type(fields.get("payload")) is dict:
        fields["payload"] = {
            compact.WORDS[k] if type(k) is int else k: v for k, v in fields["payload"].items()
        }
    for name, struct in (("usage", Usage), ("outcome", Outcome)):
        fnames = [f.encode_name for f in msgspec.structs.fields(struct)]
        if type(fields.get(name)) is list and len(fields[name]) <= len(fnames):
            fields[name] = dict(zip(fnames, fields[name], strict=False))
    record: Record = msgspec.convert(fields, cls)
    return record


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    """What ``fn(*args)`` gives, or the kind of error it raises: ValueError covers msgspec's
    DecodeError and ValidationError, and the UnicodeDecodeError the old decoder let out."""
    try:
        return "ok", fn(*args)
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
        return ("value" if isinstance(exc, ValueError) else "type"), None


# -- the same bytes as the oracle ---------------------------------------------------------


@settings(max_examples=600)
@given(records())
def test_encode_writes_the_old_bytes_and_decode_reads_them_alike(record: Record) -> None:
    data = old_encode(record)
    assert compact.encode(record) == data
    assert compact.encode(record) == data  # again, now from warm caches
    assert compact.decode(data) == old_decode(data)


@settings(max_examples=300)
@given(records())
def test_a_body_for_a_peer_before_protocol_8_names_its_device(record: Record) -> None:
    # explicit gives the bytes of the form before protocol 8, whatever the record's device
    # and stamp; a body already explicit (or in the map form) comes back as the very object.
    data = compact.encode(record)
    before = old_encode(record, implied=False)
    assert compact.explicit(data) == before
    assert compact.explicit(msgspec.Raw(data)) in (before, msgspec.Raw(before))
    assert compact.explicit(before) is before
    assert compact.decode(before) == compact.decode(data) == record
    implied = compact.implied_client(record.hlc) == record.client_id
    arrays = type(record) is AuditRow  # its usage and outcome
    words = type(record) is Event and (
        record.type in compact.WORDS or any(k in compact.WORDS for k in record.payload)
    )
    # An event writes every field from protocol 8, trailing defaults too (its canonical flag).
    flag = type(record) is Event and not record.canonical
    assert (before != data) is (implied or arrays or words or flag)
    assert len(before) >= len(data) or type(record) is Event
    mapped = encode_record(record)
    assert compact.explicit(mapped) is mapped


@settings(max_examples=400)
@given(records())
def test_a_body_for_a_peer_before_protocol_9_has_its_texts_written_out(record: Record) -> None:
    # inflated gives the bytes of the form before protocol 9 (no ext 6), every other value as
    # it was; after explicit, those of the form before protocol 8. A body without deflated
    # text comes back as the very object.
    data = compact.encode(record)
    plain = old_encode(record, deflate=False)
    assert compact.inflated(data) == plain
    assert bytes(compact.inflated(msgspec.Raw(data))) == plain
    assert compact.inflated(plain) is plain
    assert compact.inflated(compact.explicit(data)) == old_encode(
        record, implied=False, deflate=False
    )
    assert compact.decode(plain) == compact.decode(data) == record
    mapped = encode_record(record)
    assert compact.inflated(mapped) is mapped
    assert (plain != data) is (len(plain) > len(data))  # deflated only where it saves bytes


@settings(max_examples=600)
@given(
    st.binary(max_size=64)
    | st.builds(
        lambda a, b: a + b"\xc7\x03\x06" + b, st.binary(max_size=20), st.binary(max_size=20)
    )
)
def test_a_body_for_a_peer_before_protocol_9_never_breaks_the_sender(data: bytes) -> None:
    """``inflated`` runs on the server's way out to an older device, over bytes another peer
    pushed: whatever they are, it gives bytes and never raises, and bytes that read as a
    record read as the same record after it."""
    out = compact.inflated(data)
    assert isinstance(out, bytes)
    assert out is data or _same(_result(compact.decode, out), _result(compact.decode, data))


def _deflated_message(ext: Ext) -> bytes:
    """A message's compact body whose text (in its content) is ``ext``."""
    values = msgspec.msgpack.decode(compact.encode(make_message(content=[{"type": "text"}])))
    values[-1 if type(values[-1]) is list else 8] = [{"type": "text", "text": ext}]
    return msgspec.msgpack.encode(values)


def test_real_prose_is_written_deflated_and_read_back() -> None:
    from bench.peers.common import assistant_text

    text = assistant_text(7)  # 800 bytes of the reference manual's prose
    record = make_message(content=[{"type": "text", "text": text}])
    data = compact.encode(record)
    plain = compact.inflated(data)
    assert len(plain) - len(data) > 300  # about half of the text's bytes
    assert compact.decode(data) == record
    # a text's deflated form is kept for its next encoding (a session's texts, each version)
    assert compact.encode(record) == data
    # a text that deflates past the ratio is written as it is; one that saves too little too
    for same in ("=" * 4000, secrets.token_urlsafe(96)):  # random: 128 characters
        record = make_message(content=[{"type": "text", "text": same}])
        assert compact.encode(record) == compact.inflated(compact.encode(record))


@pytest.mark.parametrize(
    "data",
    [
        zlib.compress(b"a" * 100_000, 9, wbits=-15),  # past the ratio: inflating stops there
        zlib.compress(b"prose " * 40, 6, wbits=-15)[:-3],  # cut short
        zlib.compress(b"prose " * 40, 6, wbits=-15) + b"more",  # followed by more
        zlib.compress(b"\xff\xfe not UTF-8 " * 20, 6, wbits=-15),
        b"\xff" * 40,  # no deflate stream
        b"",
    ],
    ids=["past-ratio", "cut-short", "followed", "not-utf8", "garbage", "empty"],
)
def test_a_malformed_deflated_text_is_refused_by_every_read(data: bytes) -> None:
    ext = Ext(6, data)
    with pytest.raises(msgspec.DecodeError):
        compact.decode(_deflated_message(ext))  # a text in JSON: the ext hook
    record = make_message()
    values = msgspec.msgpack.decode(compact.encode(record))
    values[3] = ext  # the message's org_id, a str field: the twin's text
    with pytest.raises(msgspec.DecodeError):
        compact.decode(msgspec.msgpack.encode(values))
    body = _deflated_message(ext)
    assert compact.inflated(body) is body  # sent as it is, for the receiver to refuse


def test_the_deflated_texts_kept_stay_within_their_budget() -> None:
    compact._clear_caches()
    words = PROSE_WORDS * 20
    for n in range(3000):
        text = f"{n} " + " ".join(words[n % 7 :])
        compact.encode(make_message(content=[{"type": "text", "text": text}]))
        assert compact._deflated_held <= compact._DEFLATED_BUDGET
    assert 0 < len(compact._deflated_exts) < 3000


def test_a_nil_device_with_a_stamp_that_names_none_is_refused() -> None:
    # A nil client_id stands for the device its stamp names; a stamp without two dashes
    # names none, and the body is refused, by every path (the twin, typed and generic).
    for record in (make_event(hlc="nodash"), make_audit(hlc="no-node")):
        values = msgspec.msgpack.decode(compact.encode(record))
        names = [f.name for f in msgspec.structs.fields(type(record))]
        values[names.index("client_id") + 1] = None
        with pytest.raises(msgspec.ValidationError):
            compact.decode(msgspec.msgpack.encode(values))


class Color(enum.Enum):
    RED = "red"


class Size(enum.IntEnum):
    BIG = 3


class Label(enum.StrEnum):
    ID = "01a22ec1-7295-7349-b68b-c3206dd10e7c"


OBJECTS = st.one_of(  # what to_builtins converts: the codec must convert it as it did
    st.tuples(UUIDS, UUIDS),
    st.lists(UUIDS, max_size=3).map(tuple),
    st.lists(st.one_of(st.uuids(), UUIDS, st.just(Label.ID)), min_size=2, max_size=3),
    st.frozensets(st.integers(0, 5), max_size=3),
    st.sampled_from([Color.RED, Size.BIG, Label.ID]),
    st.uuids(),
    st.datetimes(timezones=st.just(datetime.UTC)),
    st.builds(Usage, input_tokens=st.integers(0, 9)),
    st.builds(Outcome, status=st.just("ok"), message=st.none() | TEXT),
    st.dictionaries(st.integers(0, 9) | st.sampled_from([Label.ID]), TEXT, max_size=2),
    st.binary(max_size=8),
    st.floats(allow_nan=False),
)
ODD = st.recursive(
    st.one_of(JSON, OBJECTS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def odd_records(draw: st.DrawFn) -> Record:
    """Records holding what their declared types do not say: tuples for lists, enums, UUID
    and datetime objects, Structs in a payload, UNSET fields, non-str keys."""
    base = {"id": draw(TEXT | st.sampled_from([Label.ID])), "hlc": draw(STAMPS)}
    kind = draw(st.sampled_from(["checkpoint", "event", "audit", "session"]))
    if kind == "checkpoint":
        appended = draw(
            st.lists(UUIDS, max_size=4).map(tuple)
            | st.lists(st.uuids() | UUIDS, min_size=2, max_size=3)
            | st.lists(ODD, max_size=3)
        )
        return make_checkpoint(**base, appended=appended, state_set=draw(st.just({}) | ODD))
    if kind == "event":
        payload: Any = draw(st.dictionaries(TEXT, ODD, max_size=4) | st.sampled_from([{}, ()]))
        canonical = draw(st.sampled_from([False, True, 0, 1, msgspec.UNSET]))
        return make_event(**base, payload=payload, row_hash=draw(TEXT), canonical=canonical)
    if kind == "audit":
        usage = draw(st.sampled_from([Usage(), Usage(input_tokens=2), msgspec.UNSET, {}]))
        return make_audit(**base, usage=usage, detail=draw(st.dictionaries(TEXT, ODD, max_size=3)))
    state = SessionState(message_ids=draw(st.lists(UUIDS, max_size=3)), jobs=[{"x": Color.RED}])
    return make_session(**base, state=draw(st.sampled_from([state, SessionState()])))


@settings(max_examples=400)
@given(odd_records())
def test_encode_converts_odd_values_as_the_old_encoder_did(record: Record) -> None:
    assert _outcome(compact.encode, record) == _outcome(old_encode, record)


NODES = st.one_of(  # an HLC ext's node kind byte and node: mostly well formed
    st.tuples(st.just(1), st.binary(min_size=16, max_size=16)),
    st.tuples(st.just(0), st.text(max_size=50).map(str.encode)),
    st.tuples(st.integers(0, 2), st.binary(max_size=20)),
)
HLC_EXTS = st.builds(
    lambda wall, counter, node: Ext(
        3, wall.to_bytes(6, "big") + counter.to_bytes(3, "big") + bytes((node[0],)) + node[1]
    ),
    st.integers(0, 2**48 - 1) | st.integers(10**12 - 1, 10**13 + 1),
    st.integers(0, 2**24 - 1) | st.integers(0, 1001),
    NODES,
)
TEXT_EXTS = st.one_of(  # exts that read back as a string
    HLC_EXTS,
    st.builds(Ext, st.just(1), st.binary(min_size=16, max_size=16)),
    st.builds(Ext, st.just(2), st.binary(min_size=32, max_size=32)),
)
ANY_EXTS = st.one_of(
    TEXT_EXTS,
    st.builds(Ext, st.just(4), st.integers(0, 40).map(lambda n: os.urandom(16 * n))),
    st.builds(Ext, st.integers(0, 6), st.binary(max_size=40)),
)


@settings(max_examples=600)
@given(
    st.just(3) | st.integers(-1, 7),
    st.lists(st.one_of(TEXT, TEXT_EXTS, TEXT_EXTS, ANY_EXTS), min_size=6, max_size=6),
    st.dictionaries(st.text(max_size=3), ANY_EXTS, max_size=3),
)
def test_decode_reads_any_exts_as_the_old_decoder_did(
    index: int, fields: list[Any], payload: dict[str, Any]
) -> None:
    # Event-shaped: six str fields (exts that read as text validate), the type, a payload.
    data = msgspec.msgpack.encode([index, *fields, "t", payload])
    new, old = _outcome(compact.decode, data), _outcome(old_decode, data)
    assert new == old
    if new[0] != "ok":
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            compact.decode(data)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 33, 1000])  # both sides of _BULK_UUIDS
def test_uuid_lists_of_any_length_decode_alike(count: int) -> None:
    ids = [uuid.uuid4() for _ in range(count)]
    ext = Ext(4, b"".join(u.bytes for u in ids))  # what the encoder writes for two or more
    checkpoint = msgspec.msgpack.encode([2, "c", "s", "o", "u", "d", "h", None, None, "turn", ext])
    session = msgspec.msgpack.encode([0, *["x"] * 9, {}, "", {"message_ids": ext}])
    for body in (checkpoint, session):
        assert compact.decode(body) == old_decode(body)
    assert compact.decode(checkpoint).appended == [str(u) for u in ids]  # type: ignore[union-attr]


# -- the typed decode against the generic one ------------------------------------------------
# decode reads a body into a typed Struct (_BODY_TYPES) and falls back to _decode_values (a
# list, then a dict) when that fails: it must give exactly what _decode_values gives, a record
# or a refusal (the error's type and text).


def _result(fn: Any, data: bytes) -> tuple[Any, Any]:
    try:
        return "ok", fn(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return type(exc), str(exc)


def _same(a: tuple[Any, Any] | None, b: tuple[Any, Any] | None) -> bool:
    """Two results alike: errors by type and message, records by the bytes of their fields (a
    float field may hold a NaN, which ``==`` finds equal to no NaN, itself included)."""
    if a is None or b is None or a[0] != "ok" or b[0] != "ok":
        return a == b
    return type(a[1]) is type(b[1]) and msgspec.msgpack.encode(a[1]) == msgspec.msgpack.encode(b[1])


@settings(max_examples=400)
@given(records() | odd_records().filter(lambda r: _outcome(compact.encode, r)[0] == "ok"))
def test_the_typed_decode_reads_what_the_generic_one_reads(record: Record) -> None:
    data = compact.encode(record)
    expected = _result(compact._decode_values, data)
    assert _same(_result(compact.decode, data), expected)
    if expected[0] == "ok":  # and read by the typed path itself, not by falling back
        body = compact._BODY_DECODER.decode(data)
        fields = compact._fields_read(msgspec.structs.asdict(body))
        assert _same(("ok", msgspec.convert(fields, compact._BODY_TYPES[type(body)])), expected)


# decode first reads a body of a kind with a twin (every kind but Session) into
# that twin natively; what the twin reads must be what the generic decode reads, and a body
# it refuses goes on to the typed path above.


ARRAY_STRUCTS: dict[Any, Any] = {
    Outcome: lambda at: Outcome(status="ok", code=f"code {at}"),
    Usage: lambda at: Usage(input_tokens=at),
}
"""A distinct value of each Struct a twin reads from an array (``compact._ARRAY_STRUCTS``)."""


def _twin_result(data: bytes) -> tuple[Any, Any] | None:
    """What the twin alone gives for ``data``: None when it refuses it."""
    record = compact._decode_twin(data)
    return None if record is None else ("ok", record)


@settings(max_examples=400)
@given(records() | odd_records().filter(lambda r: _outcome(compact.encode, r)[0] == "ok"))
def test_the_twin_reads_what_the_generic_decode_reads(record: Record) -> None:
    data = compact.encode(record)
    read = _twin_result(data)
    if type(record).__name__ == "Session":
        assert read is None  # no twin: the typed path reads them
        return
    expected = _result(compact._decode_values, data)
    # Every valid body of a kind with a twin is read by it (the fast path is the path taken),
    # and alike; one that decodes to no valid record (an odd value encoded) is refused.
    assert _same(read, expected if expected[0] == "ok" else None)


def test_each_twin_hands_every_field_to_its_record() -> None:
    for index, twin in compact._TWIN_OF.items():
        if twin is None:
            continue
        cls, make = twin
        record_cls = compact._BY_INDEX[index].cls
        assert cls.__struct_fields__ == record_cls.__struct_fields__
        # A distinct value in every field (of no type the twin converts; a Struct it reads
        # from an array as itself), through ``make``.
        structs = {
            f.name: f.type for f in msgspec.structs.fields(record_cls) if f.type in ARRAY_STRUCTS
        }
        values = {
            name: ARRAY_STRUCTS[structs[name]](at) if name in structs else ("value", at)
            for at, name in enumerate(cls.__struct_fields__)
        }
        made = make(cls(**values))
        assert msgspec.structs.asdict(made) == values


@st.composite
def mistyped_bodies(draw: st.DrawFn) -> bytes:
    """A record's compact body with values replaced, added or cut: any JSON value or ext
    where a field is (a list or a map where a string is, an ext in an int field...)."""
    values = msgspec.msgpack.decode(compact.encode(draw(records())))  # exts left as Ext
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(values)))
        value = draw(JSON | ANY_EXTS | st.floats() | st.binary(max_size=4))
        what = draw(st.sampled_from(["replace", "insert", "cut"]))
        if what == "replace" and at < len(values):
            values[at] = value
        elif what == "insert":
            values.insert(at, value)
        else:
            del values[at:]
    return msgspec.msgpack.encode(values)


@settings(max_examples=600)
@given(mistyped_bodies())
def test_a_mistyped_body_reads_or_is_refused_as_by_the_generic_decode(data: bytes) -> None:
    expected = _result(compact._decode_values, data)
    assert _same(_result(compact.decode, data), expected)
    read = _twin_result(data)
    assert read is None or _same(read, expected)


@settings(max_examples=600)
@given(mistyped_bodies() | st.binary(max_size=64))
def test_a_body_for_a_peer_before_protocol_8_never_breaks_the_sender(data: bytes) -> None:
    """``explicit`` runs on the server's way out to an older device, over bytes another peer
    pushed: whatever they are, it gives bytes (never raises), and bytes that read as a record
    read as the same record after it (what it cannot read goes as it is, for the receiver to
    refuse as it would have)."""
    out = compact.explicit(data)
    assert isinstance(out, bytes)
    assert out is data or _same(_result(compact.decode, out), _result(compact.decode, data))
    raw = compact.explicit(msgspec.Raw(data))
    assert bytes(raw) == out


@settings(max_examples=400)
@given(records(), st.data())
def test_a_corrupt_body_reads_or_is_refused_as_by_the_generic_decode(
    record: Record, data: st.DataObject
) -> None:
    body = bytearray(compact.encode(record))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(1, len(body) - 1))  # not the array head: no map form
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del body[data.draw(st.integers(1, len(body))) :]  # cut short
    expected = _result(compact._decode_values, bytes(body))
    assert _same(_result(compact.decode, bytes(body)), expected)
    read = _twin_result(bytes(body))
    assert read is None or _same(read, expected)


def test_defaults_filled_in_are_not_shared_between_records() -> None:
    session = make_session()
    event = make_event()
    # Trailing defaults left out (an event's body from before protocol 8 for the event, which
    # now writes every field): decode fills them in.
    bodies = {"session": compact.encode(session), "event": old_encode(event, implied=False)}
    for record, body in zip((session, event), bodies.values(), strict=True):
        assert len(msgspec.msgpack.decode(body)) < len(record.__struct_fields__)
    first, second = compact.decode(bodies["session"]), compact.decode(bodies["session"])
    first.state.message_ids.append("x")  # type: ignore[union-attr]
    first.tools.append("x")  # type: ignore[union-attr]
    assert second == session
    one, other = compact.decode(bodies["event"]), compact.decode(bodies["event"])
    one.payload["x"] = 1  # type: ignore[union-attr]
    assert other == event


def _fresh_ids(count: int) -> Iterator[str]:
    return (str(uuid.uuid4()) for _ in range(count))


def test_the_caches_stay_bounded() -> None:
    limit = compact._CACHE_LIMIT
    node = "n" * (compact._NODE_CACHE_MAX + 1)  # too long to cache
    for i, id_ in enumerate(_fresh_ids(limit + 10)):
        record = make_event(id=id_, client_id=id_, hlc=Timestamp(10**12, i, id_).encode())
        assert compact.decode(compact.encode(record)) == record
        long_node = make_event(hlc=Timestamp(10**12, i, node + str(i)).encode())
        assert compact.decode(compact.encode(long_node)) == long_node
    caches = (compact._uuid_exts, compact._node_tails, compact._uuid_texts, compact._node_texts)
    assert all(0 < len(cache) <= limit for cache in caches)
    assert not any(key.startswith(b"\0" + node.encode()) for key in compact._node_texts)
    assert not any(key.startswith(node) for key in compact._node_tails)


def test_learned_uuids_are_read_by_lookup_and_stay_bounded() -> None:
    """``learn_uuids``: the texts a reader knows are what the next decode finds (the records
    decode as without them), and the cache keeps its bound: emptied first when the pairs would
    pass it, and more pairs than the bound are not taken at all."""
    compact._clear_caches()
    limit = compact._CACHE_LIMIT
    records = [make_message(id=id_) for id_ in _fresh_ids(50)]
    bodies = [compact.encode(record) for record in records]
    compact._clear_caches()
    pairs = [(uuid.UUID(r.id).bytes, r.id) for r in records]
    compact.learn_uuids(pairs)
    assert {key: compact._uuid_texts[key] for key, _ in pairs} == dict(pairs)
    assert [compact.decode(body) for body in bodies] == records
    compact.learn_uuids([(uuid.UUID(i).bytes, i) for i in _fresh_ids(limit - 10)])
    assert len(compact._uuid_texts) <= limit  # emptied first: 50 and more, plus limit - 10
    too_many = [(uuid.UUID(i).bytes, i) for i in _fresh_ids(limit + 1)]
    compact.learn_uuids(too_many)
    assert too_many[0][0] not in compact._uuid_texts and len(compact._uuid_texts) <= limit
    assert [compact.decode(body) for body in bodies] == records


# A session's message ids as turns change them: grown by a few, a turn rolled back (cut), an
# id replaced (a conflict swap), a non-UUID item, or a list of another session.
ID_LIST_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(1, 3)),
        st.tuples(st.just("cut"), st.integers(1, 4)),
        st.tuples(st.just("replace"), st.integers(0, 40)),
        st.tuples(st.just("odd"), st.sampled_from(["x", "X" * 36, str(uuid.uuid4()).upper()])),
        st.tuples(st.just("other"), st.integers(2, 5)),
    ),
    max_size=12,
)


@settings(max_examples=300)
@given(st.integers(2, 40), ID_LIST_STEPS)
def test_a_growing_id_list_encodes_as_it_would_from_cold(start: int, steps: list[Any]) -> None:
    """The list cache (a session's ids encoded again with a few more) never changes a byte:
    at every step, the session encodes exactly as the reference encoder writes it, however
    the list changed since it was last encoded."""
    ids = [str(uuid.uuid4()) for _ in range(start)]
    for what, arg in [("grow", 0), *steps]:
        if what == "grow":
            ids = ids + [str(uuid.uuid4()) for _ in range(arg)]
        elif what == "cut":
            ids = ids[: max(1, len(ids) - arg)]
        elif what == "replace":
            ids = ids.copy()
            ids[arg % len(ids)] = str(uuid.uuid4())
        elif what == "odd":
            ids = [*ids, arg]
        else:
            ids = [ids[0], *(str(uuid.uuid4()) for _ in range(arg))]  # same first id
        session = make_session(state=SessionState(message_ids=ids))
        assert compact.encode(session) == old_encode(session), (what, arg)
        assert compact.decode(compact.encode(session)) == session


def test_the_id_list_cache_stays_bounded() -> None:
    for _ in range(compact._LISTS_LIMIT * 3):
        session = make_session(state=SessionState(message_ids=list(_fresh_ids(3))))
        assert compact.decode(compact.encode(session)) == session
    assert 0 < len(compact._uuid_lists) <= compact._LISTS_LIMIT


# -- reading a checkpoint's parent without decoding it ---------------------------------------


@settings(max_examples=300)
@given(records(), st.none() | TEXT)
def test_a_checkpoints_parent_reads_as_its_packed_id(record: Record, other: str | None) -> None:
    """``checkpoint_parent`` of any compact body matches ``packed`` of exactly the checkpoint's
    parent (ids, near misses, None), and of nothing else; other kinds read as None."""
    data = compact.encode(record)
    parent = compact.checkpoint_parent(data)
    if type(record).__name__ != "Checkpoint":
        assert parent is None
        return
    assert parent == compact.packed(record.parent_id)  # type: ignore[attr-defined]
    assert (parent == compact.packed(other)) == (other == record.parent_id)  # type: ignore[attr-defined]


def test_a_body_that_is_no_compact_checkpoint_reads_as_no_parent() -> None:
    checkpoint = make_checkpoint(parent_id="p")
    assert compact.checkpoint_parent(encode_record(checkpoint)) is None  # the map form
    assert compact.checkpoint_parent(b"") is None
    assert compact.checkpoint_parent(msgspec.msgpack.encode([2, "x"])) is None  # cut short


@given(
    st.one_of(
        st.uuids().map(str),
        st.uuids().map(lambda u: str(u).upper()),
        st.uuids().map(lambda u: u.hex),
        st.text(min_size=30, max_size=40),
    )
)
def test_uuid_bytes_converts_exactly_the_ids_a_body_packs(value: str) -> None:
    """A store keys rows by ``uuid_bytes``: it must convert what ``encode`` packs as ext 1,
    and nothing else, and ``uuid_text`` give the text back."""
    packed = msgspec.msgpack.decode(compact.packed(value), ext_hook=lambda code, data: (code, data))
    key = compact.uuid_bytes(value)
    if isinstance(packed, tuple):
        assert packed == (1, key)
        assert key is not None and compact.uuid_text(key) == value
    else:
        assert key is None and packed == value


@given(
    st.lists(
        st.one_of(
            st.uuids().map(str),
            st.uuids().map(str),
            st.uuids().map(lambda u: str(u).upper()),
            st.text(min_size=34, max_size=38),
        ),
        max_size=8,
    )
)
def test_uuids_bytes_is_uuid_bytes_of_a_whole_list(values: list[str]) -> None:
    """``uuids_bytes`` keys a list at once: the joined ``uuid_bytes`` of its items when each
    is a canonical UUID, None when any is not (then a store keys them one by one)."""
    each = [compact.uuid_bytes(v) for v in values]
    joined = compact.uuids_bytes(values)
    if all(key is not None for key in each):
        assert joined == b"".join(key for key in each if key is not None)
    else:
        assert joined is None
    assert compact.uuids_bytes(tuple(values)) == joined


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "truncate", "fresh", "same first"]), st.integers(0, 90)
        ),
        min_size=1,
        max_size=8,
    ),
    st.randoms(use_true_random=False),
)
def test_long_id_lists_decode_alike_through_their_cache(
    steps: list[tuple[str, int]], rng: random.Random
) -> None:
    """A long id list (a session's message ids) that extends one decoded before converts
    only its tail (``_id_lists``): whatever came before, each list decodes to its ids, as a
    new list each time, and the cache holds no more ids than its budget."""

    def ids(n: int) -> list[str]:
        return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]

    current = ids(compact._ID_LISTS_MIN)
    for step, n in steps:
        if step == "extend":
            current = current + ids(n)
        elif step == "truncate":
            current = current[: max(2, len(current) - n)]
        elif step == "fresh":
            current = ids(compact._ID_LISTS_MIN + n)
        else:  # the same first id, then other ids
            current = current[:1] + ids(compact._ID_LISTS_MIN + n)
        data = memoryview(compact.uuids_bytes(current) or b"")
        first = compact._unext(4, data)
        again = compact._unext(4, data)
        assert first == again == current and first is not again
        first.append("changed")  # the caller's own list: the cache is not touched
        assert compact._unext(4, data) == current
        held = sum(len(texts) for _, texts in compact._id_lists.values())
        assert held == compact._id_lists_held <= compact._ID_LISTS_BUDGET


def test_a_list_that_the_kept_one_extends_converts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server reads a session's row as pushed (a turn's two more ids), then, at the next
    turn, as stored: the list kept extends that one, which is its head; nothing is converted,
    and the longer list stays kept for the next push."""
    compact._clear_caches()
    ids = [str(uuid.uuid4()) for _ in range(300)]
    assert compact._unext(4, memoryview(compact.uuids_bytes(ids) or b"")) == ids
    converted: list[int] = []
    convert = compact._uuid_list_texts
    monkeypatch.setattr(
        compact, "_uuid_list_texts", lambda data: converted.append(len(data)) or convert(data)
    )
    head = compact._unext(4, memoryview(compact.uuids_bytes(ids[:298]) or b""))
    assert head == ids[:298] and converted == []
    assert compact._unext(4, memoryview(compact.uuids_bytes(ids) or b"")) == ids
    assert converted == []  # the longer list was still kept
    compact._clear_caches()


def test_the_id_list_cache_keeps_to_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists past the budget empty the cache; one longer than the budget is never kept."""
    monkeypatch.setattr(compact, "_ID_LISTS_BUDGET", 200)
    compact._clear_caches()
    lists = [[str(uuid.uuid4()) for _ in range(n)] for n in (64, 100, 70, 250)]
    for at, ids in enumerate(lists):
        assert compact._unext(4, memoryview(compact.uuids_bytes(ids) or b"")) == ids
        held = sorted(len(texts) for _, texts in compact._id_lists.values())
        assert held == [[64], [64, 100], [70], []][at]
        assert compact._id_lists_held == sum(held)
    compact._clear_caches()


# -- Bodies: records kept in the bytes they came in -------------------------------------------


@settings(max_examples=100)
@given(st.lists(records(), min_size=1, max_size=5))
def test_bodies_give_back_the_bytes_a_record_came_in(batch: list[Record]) -> None:
    """The very bytes (the same object) for a record that came in them in the compact form;
    a record equal to it but not it, a record that came in the map form, and a record that
    came in none are encoded, and every answer is what ``encode`` gives."""
    sent = [compact.encode(r) for r in batch]
    bodies = compact.Bodies(zip(batch, sent, strict=True))
    for record, body in zip(batch, sent, strict=True):
        assert bodies.of(record) is body
        twin = msgspec.structs.replace(record)
        again = bodies.of(twin)
        assert again == body and again is not body
    maps = compact.Bodies((r, encode_record(r)) for r in batch)
    assert [maps.of(r) for r in batch] == sent
    assert [compact.Bodies().of(r) for r in batch] == sent


def test_digest_bytes_is_the_rule_encode_packs_hashes_by() -> None:
    """A 64-character lowercase hex digest gives its 32 bytes; uppercase, spaced, short or
    non-hex text gives None, as ``encode`` leaves such text as text."""
    from shared.compact import digest_bytes

    digest = "ab" * 32
    assert digest_bytes(digest) == bytes.fromhex(digest)
    for other in ("AB" * 32, "ab" * 31 + " a", "ab" * 31, "zz" * 32, "provisional", ""):
        assert digest_bytes(other) is None, other


# -- the stored form: a body without the ids (and tenant) its row holds ----------------------


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["message", "checkpoint", "event", "audit"]),
    uuids=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    wrong=st.sampled_from([None, "key", "session", "tenant", "node"]),
    with_tenant=st.booleans(),
    with_node=st.booleans(),
    device=st.sampled_from(["uuid", "text", "six", "long", "not the stamp's"]),
    text=st.text(max_size=40),
)
def test_a_short_body_is_given_back_whole_byte_for_byte(
    kind: str,
    uuids: tuple[bool, bool, bool],
    wrong: str | None,
    with_tenant: bool,
    with_node: bool,
    device: str,
    text: str,
) -> None:
    """``short_body`` then ``whole_body_sql`` (run by SQLite) gives back the very bytes,
    whatever the record, its ids, its tenant and its device, and whatever keys, tenant and
    node a row holds beside it; the body is 35 bytes shorter exactly when it is the compact
    form of a kind that starts with its id and session id and those are the row's, shorter
    by its tenant's bytes less one more when the store gives its tenant and it is the
    body's, and by the node's bytes after the stamp's 9 less the 3 of its ext's head more
    when the store gives a node, it is the stamp's and the device is nil in the body."""
    import sqlite3

    from shared.compact import short_body, stamp_node, uuid_bytes, whole_body_sql

    session_id = str(uuid.uuid4()) if uuids[1] else f"session {text}"
    record_id = str(uuid.uuid4()) if uuids[0] else f"ID {text}"
    org = str(uuid.uuid4()) if uuids[2] else f"org {text}"
    client = {"uuid": str(uuid.uuid4()), "six": "device", "long": "d" * 300}.get(
        device, f"device {text}"
    )
    stamp = f"1796575446531-000007-{client}"
    base = {
        "id": record_id,
        "session_id": session_id,
        "org_id": org,
        "user_id": f"u{text}",
        "hlc": stamp,
        "client_id": "another device" if device == "not the stamp's" else client,
    }
    made: Any = {
        "message": lambda: make_message(**base),
        "checkpoint": lambda: make_checkpoint(**base),
        "event": lambda: make_event(**base),
        "audit": lambda: make_audit(**base),
    }[kind]()
    body = compact.encode(made)
    key = uuid_bytes(str(uuid.uuid4()) if wrong == "key" else record_id) or record_id
    session = uuid_bytes(str(uuid.uuid4()) if wrong == "session" else session_id) or session_id
    owner = "someone else" if wrong == "tenant" else org
    tenant = compact.packed(owner) + compact.packed(made.user_id) if with_tenant else b""
    node = stamp_node("a third device" if wrong == "node" else client) if with_node else b""
    stored = short_body(body, key, session, tenant, node)
    conn = sqlite3.connect(":memory:")
    try:
        whole = whole_body_sql("body", "id", "session_id", "?4", "?5")
        query = f"WITH t(id, session_id, body) AS (VALUES (?1, ?2, ?3)) SELECT {whole} FROM t"
        params = (key, session, stored, tenant or None, node or None)
        assert conn.execute(query, params).fetchone()[0] == body
    finally:
        conn.close()
    if type(key) is bytes and type(session) is bytes and wrong is None and kind != "audit":
        given = (org, made.user_id)  # (read as it is, by the twin: an audit row has none)
        assert compact.decode_short(stored, record_id, session_id, given, node) == made
        if stored[:2] in (compact.SHORT + b"\x00", compact.SHORT + b"\x01"):  # not given:
            with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):  # refused
                compact.decode_short(stored, record_id, session_id, None, node)
        else:
            assert compact.decode_short(stored, record_id, session_id, None) == made
        if stored[:2] == compact.SHORT + b"\x01":  # a node left out and not given: refused
            with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
                compact.decode_short(stored, record_id, session_id, given)
    ids = uuids[0] and uuids[1] and wrong not in ("key", "session")
    shortened = kind != "audit" and ids
    tenant_out = shortened and with_tenant and wrong != "tenant"
    mine = device != "not the stamp's" and wrong != "node"
    node_out = tenant_out and len(node) > 3 and mine
    assert (len(node) > 3) is (with_node and (device not in ("six", "long") or wrong == "node"))
    fewer = 35 + (len(tenant) - 1 if tenant_out else 0) + (len(node) - 3 if node_out else 0)
    # An audit row's: all at once (its id, tenant, device, node and session id) or nothing.
    audit_out = kind == "audit" and ids and with_tenant and wrong != "tenant" and len(node) > 3
    audit_out = audit_out and mine
    if audit_out:
        shortened, fewer = True, 18 + len(tenant) + 1 + len(node) - 3 + 18 - 2
    assert len(stored) == len(body) - (fewer if shortened else 0)
    assert stored.startswith(compact.SHORT) is shortened
    assert (stored[:2] == compact.SHORT + b"\x00") is (tenant_out and not node_out)
    assert (stored[:2] == compact.SHORT + b"\x01") is node_out
    assert (stored[:2] == compact.SHORT + b"\x02") is audit_out
    if (
        shortened and not tenant_out and not audit_out
    ):  # (as a device leaves it out later, in its transaction)
        assert compact.body_tenant(stored) == compact.packed(org) + compact.packed(made.user_id)


def _offered(own: bytes | None, given: str) -> bytes:
    """The digest a test offers as a row's ``prev_hash``: its own (32 zero bytes for none),
    another, or its own cut short."""
    return {
        "its own": own or bytes(32),
        "another": secrets.token_bytes(32),
        "short": (own or bytes(32))[:31],
    }[given]


@settings(max_examples=300, deadline=None)
@given(
    prev=st.sampled_from(["digest", "genesis", "text", "none"]),
    row=st.sampled_from(["digest", "text", "none"]),
    canonical=st.booleans(),
    with_node=st.booleans(),
    given_prev=st.sampled_from(["its own", "another", "short"]),
    payload=st.dictionaries(st.sampled_from(["turn_id", "note", "n"]), st.text(max_size=30)),
)
def test_an_event_body_without_its_prev_hash_is_given_back_byte_for_byte(
    prev: str, row: str, canonical: bool, with_node: bool, given_prev: str, payload: Any
) -> None:
    """``prev_apart`` leaves a short event body's ``prev_hash`` out (35 bytes fewer, its form
    16 or 17) exactly when it is an ext 2 of the very digest given, right before its
    ``row_hash``; ``whole_body_sql`` given that digest (as the row before it holds it:
    ``chain_digest_sql`` of that row's body, whatever its form) gives back the very bytes,
    and the Python mirror the same. Whatever the digests are (a digest, text, empty), whether
    the event is canonical, and whatever digest is given. ``event_apart`` gives the same
    body, and the digest, for an event with both digests, and nothing else."""
    import sqlite3

    from shared.compact import (
        chain_digest,
        chain_digest_sql,
        prev_apart,
        short_body,
        stamp_node,
        uuid_bytes,
        whole_body_sql,
    )

    digests = {"digest": secrets.token_hex(32), "genesis": "0" * 64, "text": "provisional"}
    made = make_event(
        prev_hash=digests.get(prev, ""),
        row_hash=digests.get(row, "") if row != "digest" else secrets.token_hex(32),
        canonical=canonical,
        sequence_number=7,
        payload=payload,
    )
    body = compact.encode(made)
    key, session = uuid_bytes(made.id), uuid_bytes(made.session_id)
    tenant = compact.packed(made.org_id) + compact.packed(made.user_id)
    node = stamp_node(made.client_id) if with_node else b""
    stored = short_body(body, key, session, tenant, node)
    assert stored[:2] == compact.SHORT + (b"\x01" if with_node else b"\x00")
    own = compact.digest_bytes(made.prev_hash)
    offered = _offered(own, given_prev)
    apart = prev_apart(stored, offered)
    left_out = given_prev == "its own" and own is not None and row == "digest"
    assert (apart != stored) is left_out
    if left_out:
        assert len(apart) == len(stored) - 35
        assert apart[:2] == compact.SHORT + (b"\x11" if with_node else b"\x10")
    # A device leaves out the digest the body holds, whatever it is offered.
    held = compact.event_apart(stored)
    if own is not None and row == "digest":
        assert held == (prev_apart(stored, own), own) and held[0] != stored
    else:
        assert held is None
    # The digest the row after it finds here, whichever form this row is stored in.
    mine = compact.digest_bytes(made.row_hash) if row == "digest" else None
    for form in (body, stored, apart):
        assert chain_digest(form) == mine
    conn = sqlite3.connect(":memory:")
    try:
        whole = whole_body_sql("body", "id", "session_id", "?4", "?5", "?6")
        query = f"WITH t(id, session_id, body) AS (VALUES (?1, ?2, ?3)) SELECT {whole} FROM t"
        params = (key, session, apart, tenant, node or None, offered if left_out else None)
        assert conn.execute(query, params).fetchone()[0] == body
        for form in (body, stored, apart):
            assert conn.execute(f"SELECT {chain_digest_sql('?1')}", (form,)).fetchone()[0] == mine
    finally:
        conn.close()
    ids = compact.packed(made.id), compact.packed(made.session_id)
    assert compact._whole(apart, *ids, tenant, node, offered) == body
    if left_out:  # (a twin never reads it: it is read in SQL, with the row before it)
        with pytest.raises(msgspec.DecodeError):
            compact.decode_short(apart, made.id, made.session_id, (made.org_id, made.user_id), node)


_DIGESTS = st.sampled_from(["digest", "genesis", "text", "empty", "the row hash"])


@settings(max_examples=400, deadline=None)
@given(
    prev=_DIGESTS,
    row=_DIGESTS,
    payload=_DIGESTS,
    identity=_DIGESTS,
    redacted=st.booleans(),
    detail=st.dictionaries(st.sampled_from(["tool", "note", "n"]), st.text(max_size=400)),
    given_prev=st.sampled_from(["its own", "another", "short"]),
)
def test_an_audit_body_with_its_row_hash_in_front_is_given_back_byte_for_byte(
    prev: str,
    row: str,
    payload: str,
    identity: str,
    redacted: bool,
    detail: Any,
    given_prev: str,
) -> None:
    """``audit_apart`` moves a short audit body's ``row_hash`` to its front (form 18, one
    byte fewer) when it is a digest, and leaves its ``prev_hash`` out too (form 19, 36 fewer)
    exactly when that is an ext of the very digest given right before it; a store reads the
    row hash there (``audit_digest`` and its SQL), and ``whole_body_sql`` (given that digest
    for form 19) gives back the very bytes, as does the Python mirror. Whatever the other
    digests are (any of them the row hash itself, as a hostile device may make them), the
    detail before them (its place past 255 bytes), and whatever digest is given."""
    import sqlite3

    from shared.compact import (
        audit_apart,
        audit_digest,
        audit_digest_sql,
        short_body,
        stamp_node,
        uuid_bytes,
        whole_body_sql,
    )

    own_hash = secrets.token_hex(32)
    digests = {
        "genesis": "0" * 64,
        "text": "provisional",
        "empty": "",
        "the row hash": own_hash,
    }
    row_hash = own_hash if row in ("digest", "the row hash") else digests[row]
    made = make_audit(
        prev_hash=digests.get(prev, secrets.token_hex(32)),
        row_hash=row_hash,
        payload_digest=digests.get(payload, secrets.token_hex(32)),
        identity_digest=digests.get(identity, secrets.token_hex(32)),
        redacted=redacted,
        detail=detail,
        sequence_number=9,
    )
    body = compact.encode(made)
    key, session = uuid_bytes(made.id), uuid_bytes(made.session_id)
    tenant = compact.packed(made.org_id) + compact.packed(made.user_id)
    node = stamp_node(made.client_id)
    stored = short_body(body, key, session, tenant, node)
    assert stored[:2] == compact.SHORT + b"\x02"
    own = compact.digest_bytes(made.prev_hash)
    offered = _offered(own, given_prev)
    digest = compact.digest_bytes(made.row_hash)
    hashed, chained = audit_apart(stored, digest or b"", offered)
    if digest is None:
        assert (hashed, chained) == (stored, None)
        return
    assert hashed[:2] == compact.SHORT + b"\x12" and len(hashed) == len(stored) - 1
    assert (chained is not None) is (given_prev == "its own" and own is not None)
    forms = [(hashed, None)]
    if chained is not None:
        assert chained[:2] == compact.SHORT + b"\x13" and len(chained) == len(stored) - 36
        forms.append((chained, offered))
    # (the detail as the body packs it: a long text in it may be deflated, protocol 9)
    packed_detail = compact._ENCODER.encode(compact._pack(detail))
    assert int.from_bytes(hashed[2:4], "big") > 255 or len(packed_detail) < 200
    conn = sqlite3.connect(":memory:")
    try:
        whole = whole_body_sql("body", "id", "session_id", "?4", "?5", "?6")
        query = f"WITH t(id, session_id, body) AS (VALUES (?1, ?2, ?3)) SELECT {whole} FROM t"
        ids = compact.packed(made.id), compact.packed(made.session_id)
        for form, prev_given in forms:
            assert audit_digest(form) == digest
            assert conn.execute(f"SELECT {audit_digest_sql('?1')}", (form,)).fetchone()[0] == digest
            params = (key, session, form, tenant, node, prev_given)
            assert conn.execute(query, params).fetchone()[0] == body
            assert compact._whole(form, *ids, tenant, node, prev_given) == body
        assert audit_digest(stored) is None and audit_digest(body) is None
    finally:
        conn.close()
    tenant_texts = (made.org_id, made.user_id)
    assert compact.decode_short(hashed, made.id, made.session_id, tenant_texts, node) == made
    if chained is not None:  # (read in SQL alone, with the row before it)
        with pytest.raises(msgspec.DecodeError):
            compact.decode_short(chained, made.id, made.session_id, tenant_texts, node)


@settings(max_examples=800, deadline=None)
@given(
    kind=st.sampled_from(["message", "checkpoint", "event", "audit"]),
    form=st.sampled_from(["ids", "tenant", "node", "chain", "chain and node", "hashed"]),
    at=st.integers(0, 200),
    value=st.integers(0, 255),
    cut=st.booleans(),
)
def test_a_short_body_read_as_it_is_reads_as_the_whole_one(
    kind: str, form: str, at: int, value: int, cut: bool
) -> None:
    """``decode_short`` reads a short body as ``decode`` reads the body put together again,
    whatever one byte of it is made (or where it is cut short): the same record, or an
    error of the same kind. A body its twin refuses is put together and read whole, so the
    short read never takes what the whole one refuses. SQL and the Python mirror put the same
    bytes together, an event's without its prev_hash (``chain``) given the same digest."""
    import sqlite3

    from shared.compact import prev_apart, short_body, stamp_node, uuid_bytes, whole_body_sql

    if (form.startswith("chain") and kind not in ("event", "audit")) or (
        form == "hashed" and kind != "audit"
    ):
        return
    digest = secrets.token_bytes(32)
    made: Any = {
        "message": make_message,
        "checkpoint": make_checkpoint,
        "event": lambda: make_event(prev_hash=digest.hex(), row_hash=secrets.token_hex(32)),
        "audit": lambda: make_audit(prev_hash=digest.hex(), row_hash=secrets.token_hex(32)),
    }[kind]()
    tenant = (made.org_id, made.user_id)
    packed_tenant = compact.packed(made.org_id) + compact.packed(made.user_id)
    node = stamp_node(made.client_id)
    assert len(node) > 3
    body = compact.encode(made)
    key, session_key = uuid_bytes(made.id), uuid_bytes(made.session_id)
    stored = short_body(
        body,
        key,
        session_key,
        b"" if form == "ids" else packed_tenant,
        node if form.endswith("node") or (kind == "audit" and form != "ids") else b"",
    )
    if kind == "audit":  # (all or nothing; its row hash in front, its prev_hash out: 18, 19)
        hashed, chained = compact.audit_apart(
            stored, compact.digest_bytes(made.row_hash) or b"", digest
        )
        if form == "ids":
            assert stored == body
            return
        assert stored[:2] == compact.SHORT + b"\2" and chained is not None
        stored = {"hashed": hashed, "node": stored, "tenant": stored}.get(form, chained)
    else:
        if form.startswith("chain"):
            stored = prev_apart(stored, digest)
        forms = {"ids": stored[1:2], "tenant": b"\0", "node": b"\1", "chain": b"\x10"}
        assert stored[:2] == compact.SHORT + forms.get(form, b"\x11")
    if cut:
        mutated = stored[: at % len(stored)]
    else:
        where = at % len(stored)
        mutated = stored[:where] + bytes((value,)) + stored[where + 1 :]
    ids = compact.packed(made.id), compact.packed(made.session_id)
    whole = compact._whole(mutated, *ids, packed_tenant, node, digest)
    if len(mutated) >= 4 and mutated[:1] == compact.SHORT:  # the very bytes SQL puts together
        sql = whole_body_sql("body", "id", "session_id", "?4", "?5", "?6")
        query = f"WITH t(id, session_id, body) AS (VALUES (?1, ?2, ?3)) SELECT {sql} FROM t"
        conn = sqlite3.connect(":memory:")
        try:
            params = (key, session_key, mutated, packed_tenant, node, digest)
            assert conn.execute(query, params).fetchone()[0] == whole
        finally:
            conn.close()
    if mutated[:1] == compact.SHORT and (
        mutated[1:2] in (b"\x10", b"\x11", b"\x13") or whole is None
    ):
        # Without its prev_hash: read in SQL alone, with the row before it (above); a twin
        # refuses it, as it refuses a body SQL gives no bytes for (NULL: a place none has).
        read = lambda: compact.decode_short(  # noqa: E731
            mutated, made.id, made.session_id, (made.org_id, made.user_id), node
        )
        with pytest.raises(msgspec.DecodeError):
            read()
        return

    def outcome(read: Any) -> Any:
        try:
            return read()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return type(exc)

    if mutated[:1] == compact.SHORT:
        short = outcome(
            lambda: compact.decode_short(mutated, made.id, made.session_id, tenant, node)
        )
        assert short == outcome(lambda: compact.decode(whole))


@settings(max_examples=300)
@given(
    prev=st.sampled_from(["digest", "empty", "text"]),
    payload=st.sampled_from(["digest", "empty", "text"]),
    identity=st.sampled_from(["digest", "empty", "text"]),
    row=st.sampled_from(["digest", "text"]),
    redacted=st.booleans(),
    detail=st.dictionaries(TEXT, JSON, max_size=3),
    request_id=st.none() | TEXT,
    short=st.booleans(),
)
def test_an_audit_body_leaves_out_its_content_digests_and_takes_them_back_exactly(
    prev: str,
    payload: str,
    identity: str,
    row: str,
    redacted: bool,
    detail: Any,
    request_id: str | None,
    short: bool,
) -> None:
    """``audit_digests_apart`` puts a nil where each of an audit body's ``payload_digest`` and
    ``identity_digest`` was (68 bytes fewer) exactly when both are digests, its row hash a
    digest, its prev_hash one or empty, and the row not redacted; the body then decodes,
    each nil an empty text (``audit_placeholders``), as its row with those two empty, and
    ``audit_digests_put`` gives back the very bytes. No body ``encode`` writes, of any
    other row, reads as one left so (``audit_digests_left_out``). Whole or short."""
    values = {"digest": secrets.token_hex(32), "empty": "", "text": "not-a-digest"}
    made = make_audit(
        prev_hash=values[prev],
        payload_digest=values[payload],
        identity_digest=values[identity],
        row_hash=values[row],
        redacted=redacted,
        detail=detail,
        request_id=request_id,
        sequence_number=7,
    )
    body = compact.encode(made)
    if short:
        key, session = compact.uuid_bytes(made.id), compact.uuid_bytes(made.session_id)
        tenant = compact.packed(made.org_id) + compact.packed(made.user_id)
        body = compact.short_body(body, key, session, tenant, compact.stamp_node(made.client_id))
    assert compact.audit_digests_left_out(body) is None
    apart = compact.audit_digests_apart(body)
    eligible = (payload, identity, row) == ("digest",) * 3 and prev != "text" and not redacted
    assert (apart is not None) is eligible
    if apart is None:
        return
    left, payload_bytes, identity_bytes = apart
    assert len(left) == len(body) - 68
    assert payload_bytes.hex() == made.payload_digest
    assert identity_bytes.hex() == made.identity_digest
    at = compact.audit_digests_left_out(left)
    assert at is not None and left[at] == 0xC0
    assert compact.audit_digests_put(left, at, payload_bytes, identity_bytes) == body
    if not short:
        empty = msgspec.structs.replace(made, payload_digest="", identity_digest="")
        assert compact.decode(compact.audit_placeholders(left, at)) == empty


@settings(max_examples=200)
@given(records())
def test_no_other_body_reads_as_an_audit_body_without_its_digests(record: Record) -> None:
    """A body of any record (an audit row's too: its fields are never nil) is never taken
    for one ``audit_digests_apart`` gave."""
    assert compact.audit_digests_left_out(compact.encode(record)) is None
