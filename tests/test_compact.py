"""The compact storage form gives back an equal record, whatever the strings in it."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import compact
from shared.clock import Timestamp
from shared.records import Record, SessionState, encode_record
from tests.factories import (
    make_artifact_update,
    make_audit,
    make_checkpoint,
    make_event,
    make_message,
    make_session,
)

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
TEXT = st.one_of(UUIDS, HEX, STAMPS, NEAR_MISSES)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def records(draw: st.DrawFn) -> Record:
    base = {"id": draw(TEXT), "client_id": draw(TEXT), "hlc": draw(STAMPS)}
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
        payload = draw(st.dictionaries(st.text(max_size=8), JSON, max_size=4))
        return make_event(**base, payload=payload, prev_hash=draw(HEX), row_hash=draw(TEXT))
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


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x91\x63",
        b"\x92\x00\xc7\x03\x09abc",
        b"\xde\x00\x01",
        b"\x92\x00\xd5\x03xx",
        b"\x93\x01",
    ],
)
def test_corrupt_bytes_raise_a_decode_or_validation_error(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        compact.decode(data)


def test_not_a_record_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a record"):
        compact.encode({"id": "x"})  # type: ignore[arg-type]
